"""How ``select`` picks a choice from the model's log-probabilities (SGLang's choices methods).

A ``select`` scores each choice by the log-probabilities of its tokens after the state
(prompt logprobs from the runtime: the choice is appended to the prompt, nothing is
sampled). A method then decides, given for each choice i:

- ``input_token_logprobs[i]``: one ``(logprob, token_id, None)`` per token of the choice,
  each conditioned on the state and the choice's tokens before it (``token_id`` is None
  where the backend knows only text);
- ``normalized_prompt_logprobs[i]``: the mean of those logprobs;
- ``unconditional_token_logprobs[i]`` (only for methods that ask for it): the same tokens
  scored with nothing before them, so the first one has no logprob (None).

The three methods, ties going to the earlier choice:

- ``token_length_normalized`` (the default): the highest mean token logprob.
- ``greedy_token_selection``: compare the choices token by token. A choice shorter than
  the longest is padded with its own mean logprob; at each position only the choices
  with the highest logprob there stay in; the first choice still in when one remains
  (or after the last position) wins. Choices that share their first k tokens share those
  tokens' logprobs exactly (the same context), so they stay tied up to where they differ.
- ``unconditional_likelihood_normalized``: the highest mean of (conditional -
  unconditional) token logprob, the first token's missing unconditional logprob counted
  as 0. It prefers choices that the context makes likelier than they are on their own.

A custom method is any callable with these keyword arguments that returns a
``ChoicesDecision`` (set ``requires_unconditional_logprobs = True`` to be given them):
the interface of SGLang's ``ChoicesSamplingMethod``, so methods written for SGLang run here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(frozen=True)
class ChoicesDecision:
    """What a choices method picked, and what it based that on (``s.get_meta_info(name)``)."""

    decision: str
    meta_info: dict[str, Any] = field(default_factory=dict)


class ChoicesSamplingMethod:
    """Base of the choices methods; see the module docstring for the arguments."""

    requires_unconditional_logprobs: bool = False
    name: str = "custom"

    def __call__(self, *, choices: Sequence[str], normalized_prompt_logprobs: Sequence[float],
                 input_token_logprobs: Sequence[Sequence[tuple]], output_token_logprobs: Sequence[Sequence[tuple]],
                 unconditional_token_logprobs: Sequence[Sequence[tuple]] | None = None) -> ChoicesDecision:  # fmt: skip
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


def _first_best(scores: Sequence[float]) -> int:
    """Index of the highest score; the earliest on a tie."""
    best = 0
    for i, v in enumerate(scores):
        if v > scores[best]:
            best = i
    return best


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _base_meta(normalized, inputs, outputs) -> dict:
    return {"normalized_prompt_logprobs": list(normalized), "input_token_logprobs": [list(x) for x in inputs],
            "output_token_logprobs": [list(x) for x in outputs]}  # fmt: skip


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token logprob."""

    name = "token_length_normalized"

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:  # fmt: skip
        pick = _first_best(normalized_prompt_logprobs)
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        return ChoicesDecision(choices[pick], meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Position by position, keep the choices with the highest logprob there (shorter
    choices padded with their mean logprob); the first one left wins."""

    name = "greedy_token_selection"

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:  # fmt: skip
        rows = [[t[0] for t in option] for option in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        alive = list(range(len(choices)))
        for col in range(width):
            top = max(matrix[i][col] for i in alive)
            alive = [i for i in alive if matrix[i][col] == top]
            if len(alive) == 1:
                break
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["greedy_logprob_matrix"] = matrix
        return ChoicesDecision(choices[alive[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (conditional - unconditional) token logprob."""

    name = "unconditional_likelihood_normalized"
    requires_unconditional_logprobs = True

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs=None) -> ChoicesDecision:  # fmt: skip
        if unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            if len(cond) != len(uncond):
                raise ValueError("conditional and unconditional token logprobs differ in length")
            base = [u[0] if u[0] is not None else 0.0 for u in uncond]
            scores.append(_mean([c[0] - b for c, b in zip(cond, base)]))
        meta = _base_meta(normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs)
        meta["unconditional_token_logprobs"] = [list(x) for x in unconditional_token_logprobs]
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return ChoicesDecision(choices[_first_best(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
