"""Sampling: per-request parameters, per-request state and the batched sampler.

One step for a batch of B rows (one row per running request), logits ``[B, V]``:

    raw logits ──► logprobs / top_logprobs      (log_softmax of the *raw* logits)
        │
        ├─ repetition_penalty   HF semantics, over prompt + generated ids:
        │                       positive logits / p, negative logits * p
        ├─ frequency_penalty    OpenAI semantics, over generated ids only:
        ├─ presence_penalty       l -= freq * count + pres * (count > 0)
        │
        ├─ greedy rows ──► torch.argmax (first maximum on ties)
        │
        └─ sampled rows: / temperature ─► top-k ─► top-p ─► min-p ─► softmax
                         ─► inverse-CDF draw with one uniform from the row's own
                            generator

Top-k keeps every token whose logit ties the k-th largest (as transformers does);
top-p is computed on the distribution left by top-k, min-p relative to the most likely
token left. Each sampled row consumes exactly one number from its own
``torch.Generator`` per step, so a seeded request yields the same tokens whatever
else shares the batch, and a greedy row consumes nothing.

Reported logprobs are those of the *model's raw distribution* (log_softmax of the
logits given to :meth:`Sampler.sample`, before penalties, temperature and filters),
which is also what vLLM returns by default.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch

from radixkv.cache.compress import check_policy
from radixkv.engine.constrain import KINDS as GRAMMAR_KINDS, GrammarSpec, check_grammar
from radixkv.errors import FieldError
from radixkv.validate import check_bool, check_float, check_int, is_int, token_list

MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries, as OpenAI's limit (300) and vLLM's
MAX_TEMPERATURE = 100.0
GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (logits / 1e-45 overflow float32)
MAX_REPETITION_PENALTY = 10.0
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


# ---------------------------------------------------------------- validation helpers


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Defaults follow vLLM / the OpenAI API.

    ``temperature`` below ``GREEDY_BELOW`` (1e-5, as vLLM; 0 included) or ``top_k == 1``
    means greedy. ``top_k`` 0 or -1 is off.
    ``repetition_penalty`` has HF semantics over prompt + generated tokens;
    ``frequency_penalty`` / ``presence_penalty`` OpenAI semantics over generated tokens
    only. ``seed`` makes a request reproducible whatever else is in the batch; with
    ``n > 1`` the engine gives choice i the seed ``seed + i``. ``stop`` accepts a str or
    a sequence of str and is stored as a tuple. ``logprobs`` asks for the chosen
    token's logprob under the raw model distribution, ``top_logprobs`` (needs
    ``logprobs=True``) for that many most likely tokens too. ``prompt_logprobs_from``
    asks for the logprobs of the prompt tokens from that position on.
    ``kv_policy`` (window, streaming, h2o, snapkv, keydiff) with ``kv_budget`` (tokens
    kept, an int, or a ratio in (0, 1) of the context) bounds the request's KV by
    dropping pages (``radixkv.cache.compress``); ``kv_compress_at``: prompt tokens of
    context compressed once after their prefill (a ratio's default: the whole prompt);
    ``kv_rerotate`` (a decode-time token budget only): compressions move the kept pages
    to consecutive positions, so the sequence may run past the model's context.

    Every field is checked on construction; a bad value raises ``ValueError`` naming
    the field and the allowed range.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs_from: int | None = None
    skip_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    choices: tuple[str, ...] | None = None
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] | None = None
    min_tokens: int = 0
    priority: int = 0
    kv_policy: str | None = None
    kv_budget: int | float | None = None
    kv_compress_at: int | None = None
    kv_rerotate: bool = False

    def __post_init__(self) -> None:
        setf = object.__setattr__
        check_int("max_new_tokens", self.max_new_tokens, 1)
        setf(self, "temperature", check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        setf(self, "top_p", check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        if not is_int(self.top_k) or self.top_k < -1:
            raise FieldError(
                "top_k", f"top_k must be an int >= -1 (0 or -1 = off), got {self.top_k!r} ({type(self.top_k).__name__})"
            )
        setf(self, "min_p", check_float("min_p", self.min_p, 0.0, 1.0))
        setf(
            self,
            "repetition_penalty",
            check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True),
        )
        setf(self, "frequency_penalty", check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        setf(self, "presence_penalty", check_float("presence_penalty", self.presence_penalty, -2.0, 2.0))
        if self.seed is not None:
            if not is_int(self.seed) or not (_SEED_MIN <= self.seed <= _SEED_MAX):
                raise FieldError("seed", f"seed must be None or an int in [-2**63, 2**64 - 1], got {self.seed!r}")
        setf(self, "stop", self._normalise_stop(self.stop))
        setf(self, "stop_token_ids", self._normalise_stop_token_ids(self.stop_token_ids))
        check_bool("ignore_eos", self.ignore_eos)
        check_int("n", self.n, 1, MAX_N)
        check_bool("logprobs", self.logprobs)
        check_int("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs > 0 and not self.logprobs:
            raise FieldError("top_logprobs", f"top_logprobs={self.top_logprobs} needs logprobs=True")
        if self.prompt_logprobs_from is not None:
            check_int("prompt_logprobs_from", self.prompt_logprobs_from, 0)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        check_policy(self.kv_policy, self.kv_budget, self.kv_compress_at, self.kv_rerotate)
        grammars = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise FieldError(grammars[1], f"one constraint per request: got {' and '.join(grammars)}")
        if grammars:
            spec = check_grammar(grammars[0], getattr(self, grammars[0]))
            setf(self, grammars[0], spec.source)  # json_schema as JSON text, choices as a tuple
        setf(self, "logit_bias", self._normalise_logit_bias(self.logit_bias))
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_new_tokens:
            raise FieldError("min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        check_int("priority", self.priority, -(2**31), 2**31 - 1)

    @staticmethod
    def _normalise_stop(stop: object) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise FieldError("stop", f"stop must be a str or a list of str, got {type(stop).__name__}")
        if len(stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for i, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise FieldError("stop", f"stop[{i}] must be a non-empty str, got {s!r}")
        return tuple(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)):
            raise FieldError("stop_token_ids", f"stop_token_ids must be a list of ints >= 0, got {type(ids).__name__}")
        if len(ids) > MAX_STOP_TOKEN_IDS:  # checked against every generated token
            raise FieldError("stop_token_ids", f"stop_token_ids must have at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        for i, t in enumerate(ids):
            if not is_int(t) or t < 0:
                raise FieldError("stop_token_ids", f"stop_token_ids[{i}] must be an int >= 0, got {t!r}")
        return tuple(ids)

    @staticmethod
    def _normalise_logit_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
        """OpenAI's logit_bias: token id (an int, or its decimal string as JSON keys are)
        -> a bias in [-100, 100] added to the logit; kept as sorted (id, bias) pairs,
        None when empty."""
        if bias is None:
            return None
        if isinstance(bias, tuple):
            bias = dict(bias)
        if not isinstance(bias, dict):
            raise FieldError("logit_bias", f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise FieldError("logit_bias", f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        out = {}
        for key, value in bias.items():
            tid = int(key) if isinstance(key, str) and key.isdigit() else key
            if not is_int(tid) or tid < 0:
                raise FieldError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
            try:
                out[int(tid)] = check_float(f"logit_bias[{key}]", value, -100.0, 100.0)
            except FieldError as e:
                raise FieldError("logit_bias", str(e)) from None
        return tuple(sorted(out.items())) or None

    @property
    def grammar(self) -> GrammarSpec | None:
        """The request's constraint as a ``GrammarSpec`` (constrain.py), or None."""
        kind = next((k for k in GRAMMAR_KINDS if getattr(self, k) is not None), None)
        return None if kind is None else GrammarSpec(kind, getattr(self, kind))

    @property
    def is_greedy(self) -> bool:
        """True when decoding takes the argmax: ``temperature`` below ``GREEDY_BELOW``
        (0 included; dividing logits by less overflows float32) or ``top_k == 1``."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


# ---------------------------------------------------------------- per-request state


class _TokenCounts:
    """Distinct token ids, each with a count, in growable NumPy buffers: ``add`` is
    amortised O(1) and :meth:`arrays` hands out views without copying."""

    __slots__ = ("_pos", "_ids", "_cnt", "_n", "max_id")

    def __init__(self) -> None:
        self._pos: dict[int, int] = {}
        self._ids = np.empty(16, dtype=np.int64)
        self._cnt = np.empty(16, dtype=np.float32)
        self._n = 0
        self.max_id = -1

    def __len__(self) -> int:
        return self._n

    def __contains__(self, t: int) -> bool:
        return t in self._pos

    def add_many(self, ids: Sequence[int]) -> None:
        """Add each distinct id of ``ids`` once (counts start at 1); for the prompt."""
        new = [t for t in dict.fromkeys(ids) if t not in self._pos]
        if not new:
            return
        need = self._n + len(new)
        if need > len(self._ids):
            cap = max(need, 2 * len(self._ids))
            self._ids = np.concatenate([self._ids[: self._n], np.empty(cap - self._n, dtype=np.int64)])
            self._cnt = np.concatenate([self._cnt[: self._n], np.empty(cap - self._n, dtype=np.float32)])
        self._ids[self._n : need] = new
        self._cnt[self._n : need] = 1.0
        self._pos.update(zip(new, range(self._n, need)))
        self._n = need
        self.max_id = max(self.max_id, max(new))

    def add(self, t: int) -> None:
        p = self._pos.get(t)
        if p is not None:
            self._cnt[p] += 1.0
            return
        if self._n == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
            self._cnt = np.concatenate([self._cnt, np.empty_like(self._cnt)])
        self._ids[self._n] = t
        self._cnt[self._n] = 1.0
        self._pos[t] = self._n
        self._n += 1
        if t > self.max_id:
            self.max_id = t

    def count(self, t: int) -> int:
        p = self._pos.get(t)
        return 0 if p is None else int(self._cnt[p])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64, counts float32)`` views of the first ``len(self)`` entries."""
        return self._ids[: self._n], self._cnt[: self._n]


class SamplerState:
    """Mutable sampling state of one request (one choice when ``n > 1``).

    Holds the params, the request's ``torch.Generator`` (CPU; seeded with
    ``seed + seed_offset`` when the params carry a seed, otherwise seeded on first use
    by the :class:`Sampler` from its own random source), the counts of generated
    tokens (frequency/presence penalties) and the set of prompt + generated ids
    (repetition penalty). :meth:`append` must be called with every token the request
    emits. Both are kept as sparse id lists, so a step costs O(distinct ids), not O(V).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Iterable[int] | torch.Tensor = (), seed_offset: int = 0):
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_int("seed_offset", seed_offset, 0)
        self.params = params
        self.seed_offset = seed_offset
        ids = token_list(prompt_ids)
        if ids and min(ids) < 0:
            raise ValueError(f"prompt_ids must be ints >= 0, got {min(ids)}")
        self.prompt_len = len(ids)
        self.num_generated = 0
        self._seen = _TokenCounts()  # prompt + generated (only membership matters)
        self._generated = _TokenCounts()  # generated only, with counts
        self._seen.add_many(ids)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed((params.seed + seed_offset) % 2**64)

    def append(self, token_id: int) -> None:
        """Record one generated token (mutates the counts and the seen set)."""
        t = int(token_id)
        if t < 0:
            raise ValueError(f"token_id must be >= 0, got {t}")
        self.num_generated += 1
        self._generated.add(t)
        self._seen.add(t)

    def count(self, token_id: int) -> int:
        """How many times ``token_id`` was generated."""
        return self._generated.count(int(token_id))

    def has_seen(self, token_id: int) -> bool:
        """Whether ``token_id`` is in the prompt or was generated."""
        return int(token_id) in self._seen

    # -- used by the Sampler

    @staticmethod
    def _ids_below(buf: _TokenCounts, vocab: int) -> tuple[np.ndarray, np.ndarray]:
        ids, cnt = buf.arrays()
        if buf.max_id >= vocab:  # ids past the logits' width cannot be penalised
            keep = ids < vocab
            ids, cnt = ids[keep], cnt[keep]
        return ids, cnt

    def _draw_uniform(self, rng: random.Random) -> float:
        if self.generator is None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(rng.getrandbits(64))
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def __repr__(self) -> str:
        return f"SamplerState(prompt_len={self.prompt_len}, num_generated={self.num_generated}, params={self.params})"


# ---------------------------------------------------------------- sampler


class SampleResult(NamedTuple):
    """One step's output, one entry per row. ``logprobs[i]`` is the chosen token's
    logprob under the raw model distribution (None unless the row asked for logprobs);
    ``top_logprobs[i]`` the row's ``top_logprobs`` most likely ``(token_id, logprob)``,
    most likely first (None unless asked for)."""

    tokens: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor | Sequence[int]) -> list[float]:
    """``log_softmax(logits[i])[target_ids[i]]`` for each row: ``logits [n, V]`` are the
    model's outputs at positions p..p+n-1 and ``target_ids [n]`` the prompt tokens at
    p+1..p+n. Raw model distribution, like :meth:`Sampler.sample`'s logprobs."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, V], got shape {tuple(logits.shape)}")
    tgt = torch.as_tensor(target_ids, dtype=torch.long, device=logits.device).reshape(-1)
    if tgt.numel() != logits.shape[0]:
        raise ValueError(f"target_ids has {tgt.numel()} ids for {logits.shape[0]} rows of logits")
    if tgt.numel() == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, tgt[:, None]).squeeze(1).tolist()


def _exclusive(cum: torch.Tensor) -> torch.Tensor:
    """Shift an inclusive cumulative sum along the last dim by one: ``[0, c0, c1, ...]``."""
    return torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)


def _rows(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


class Sampler:
    """Batched sampler. ``Sampler(seed)`` seeds the random source that unseeded requests
    draw their generators from (None: from the OS), so a whole run can be made
    reproducible. Stateless otherwise: per-request state lives in :class:`SamplerState`."""

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    prompt_logprobs = staticmethod(prompt_logprobs)

    def process_logits(self, logits: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
        """The logits each row is decoded from, as a new ``[B, V]`` float32 tensor
        (``logits`` is not modified): penalties on every row; for sampled rows also
        temperature, then top-k / top-p / min-p with removed tokens set to ``-inf``.
        A greedy row gets penalties only: :meth:`sample` takes its argmax. Touches no
        generator."""
        self._check(logits, states)
        return self._process(logits, states, copy=True)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplerState]) -> SampleResult:
        """One token per row of ``logits [B, V]`` (float32; one row per state). Does not
        call ``states[i].append``: the caller records the token it keeps. Advances the
        generator of each sampled (non-greedy) row by exactly one draw."""
        self._check(logits, states)
        B, V = logits.shape
        dev = logits.device
        proc = self._process(logits, states, copy=False)
        tokens = [0] * B

        greedy = [i for i, s in enumerate(states) if s.params.is_greedy]
        sampled = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if greedy:
            g = proc if len(greedy) == B else proc[_rows(greedy, dev)]
            for i, t in zip(greedy, torch.argmax(g, dim=-1).tolist()):
                tokens[i] = t
        if sampled:
            sub = proc if len(sampled) == B else proc[_rows(sampled, dev)]
            # Inverse CDF: one uniform per row from the row's own generator.
            cdf = torch.softmax(sub, dim=-1, dtype=torch.float64).cumsum_(dim=-1)
            u = torch.tensor([states[i]._draw_uniform(self._rng) for i in sampled], dtype=torch.float64)
            x = (u.to(dev) * cdf[:, -1]).unsqueeze(1)
            # First index whose cdf exceeds x: its probability is > 0, so no filtered
            # token can be drawn. x == total (rounding) gives V: take the last kept token.
            idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
            over = idx >= V
            if bool(over.any()):
                last = V - 1 - torch.argmax(torch.flip(sub > float("-inf"), dims=[1]).to(torch.uint8), dim=-1)
                idx = torch.where(over, last, idx)
            for i, t in zip(sampled, idx.tolist()):
                tokens[i] = t

        lps: list[float | None] = [None] * B
        tops: list[list[tuple[int, float]] | None] = [None] * B
        want = [i for i, s in enumerate(states) if s.params.logprobs]
        if want:
            raw = logits if len(want) == B else logits[_rows(want, dev)]
            lp = torch.log_softmax(raw.float(), dim=-1)
            chosen = torch.tensor([tokens[i] for i in want], dtype=torch.long, device=dev)
            for i, v in zip(want, lp.gather(1, chosen[:, None]).squeeze(1).tolist()):
                lps[i] = v
            kmax = max(states[i].params.top_logprobs for i in want)
            if kmax > 0:
                vals, ids = torch.topk(lp, min(kmax, V), dim=-1)
                vals, ids = vals.tolist(), ids.tolist()
                for r, i in enumerate(want):
                    k = states[i].params.top_logprobs
                    if k > 0:  # tokens a constraint or logit_bias removed (-inf) are not alternatives
                        tops[i] = [(t, v) for t, v in zip(ids[r][:k], vals[r][:k]) if v != float("-inf")]
        return SampleResult(tokens, lps, tops)

    # -- internals

    @staticmethod
    def _check(logits: torch.Tensor, states: Sequence[SamplerState]) -> None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError("logits must be a 2-D floating-point tensor [B, V]")
        if logits.shape[0] != len(states):
            raise ValueError(f"logits have {logits.shape[0]} rows but {len(states)} states were given")
        if logits.shape[1] == 0:
            raise ValueError("logits have no columns")

    @staticmethod
    def _sparse(states: Sequence[SamplerState], rows: list[int], which: str, V: int, dev: torch.device):
        """Flattened ``(row, col, count)`` of the rows' seen ids (``which='seen'``) or
        generated ids (``'generated'``): index tensors for ``out[row, col]``."""
        parts = [SamplerState._ids_below(getattr(states[i], "_" + which), V) for i in rows]
        lens = torch.tensor([len(ids) for ids, _ in parts], dtype=torch.long)
        r = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lens)
        c = torch.from_numpy(np.concatenate([ids for ids, _ in parts]))
        n = torch.from_numpy(np.concatenate([cnt for _, cnt in parts]))
        return r.to(dev), c.to(dev), n.to(dev), lens.to(dev)

    def _process(self, logits: torch.Tensor, states: Sequence[SamplerState], copy: bool) -> torch.Tensor:
        B, V = logits.shape
        dev = logits.device
        params = [s.params for s in states]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        needs_work = copy or sampled or any(p.has_penalties for p in params)
        out = logits.float()
        if needs_work and out is logits:
            out = out.clone()

        # Repetition penalty (HF): on prompt + generated ids, positive / p, negative * p.
        rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep:
            r, c, _, lens = self._sparse(states, rep, "seen", V, dev)
            if r.numel():
                pen = torch.tensor([params[i].repetition_penalty for i in rep], dtype=torch.float32, device=dev)
                pen = torch.repeat_interleave(pen, lens)
                v = out[r, c]
                out[r, c] = torch.where(v < 0, v * pen, v / pen)

        # Frequency / presence penalties (OpenAI): on generated ids only,
        #   l -= frequency_penalty * count;  l -= presence_penalty.
        fp = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
        if fp:
            r, c, n, lens = self._sparse(states, fp, "generated", V, dev)
            if r.numel():
                f = torch.tensor([params[i].frequency_penalty for i in fp], dtype=torch.float32, device=dev)
                pr = torch.tensor([params[i].presence_penalty for i in fp], dtype=torch.float32, device=dev)
                v = out[r, c]
                v -= torch.repeat_interleave(f, lens) * n
                v -= torch.repeat_interleave(pr, lens)
                out[r, c] = v

        if not sampled:
            return out
        all_rows = len(sampled) == B
        sidx = None if all_rows else _rows(sampled, dev)
        sub = out if all_rows else out[sidx]
        sp = [params[i] for i in sampled]

        # Temperature.
        if any(p.temperature != 1.0 for p in sp):
            sub.div_(torch.tensor([p.temperature for p in sp], dtype=torch.float32, device=dev)[:, None])

        # Top-k: drop logits below the k-th largest (ties with it stay, as in transformers).
        kr = [r for r, p in enumerate(sp) if 0 < p.top_k < V]
        if kr:
            kidx = _rows(kr, dev)
            rows = sub[kidx]
            kmax = max(sp[r].top_k for r in kr)
            vals = torch.topk(rows, kmax, dim=-1, sorted=True).values
            ks = torch.tensor([sp[r].top_k - 1 for r in kr], dtype=torch.long, device=dev)
            sub[kidx] = rows.masked_fill(rows < vals.gather(1, ks[:, None]), float("-inf"))

        # Top-p on what top-k left: keep the most likely tokens while the mass ranked
        # above them is < top_p (at least one).
        pr_ = [r for r, p in enumerate(sp) if p.top_p < 1.0]
        if pr_:
            pidx = _rows(pr_, dev)
            sub[pidx] = self._top_p(sub[pidx], [sp[r] for r in pr_], V)

        # Min-p: drop tokens less likely than min_p times the most likely one left.
        mp = [r for r, p in enumerate(sp) if p.min_p > 0.0]
        if mp:
            midx = _rows(mp, dev)
            rows = sub[midx]
            probs = torch.softmax(rows, dim=-1)
            thr = torch.tensor([sp[r].min_p for r in mp], dtype=torch.float32, device=dev)[:, None]
            sub[midx] = rows.masked_fill(probs < thr * probs.amax(dim=-1, keepdim=True), float("-inf"))

        if all_rows:
            return sub
        out[sidx] = sub
        return out

    # Candidate counts tried, in turn, for top-p before a full sort of the row.
    TOP_P_CANDIDATES: tuple[int, ...] = (256, 4096)

    @classmethod
    def _top_p(cls, rows: torch.Tensor, ps: list[SamplingParams], V: int) -> torch.Tensor:
        """Nucleus filter of ``rows [R, V]`` (logits, -inf = already removed): keep the
        most likely tokens while the mass ranked above them is < top_p, at least one.

        The nucleus lies within the C most likely tokens whenever their mass reaches
        top_p, so a partial ``topk`` of C candidates is tried first, for growing C (a
        top-k row's C is its k, which holds its whole kept set), and only the rows whose
        nucleus is wider than every C get a full sort. Which of several tokens tied at
        the nucleus' edge stay follows the sort order, as in transformers."""
        dev = rows.device
        ninf = float("-inf")
        tp = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)[:, None]
        lse = torch.logsumexp(rows, dim=-1, keepdim=True)
        result = torch.full_like(rows, ninf)
        left = list(range(len(ps)))  # rows not done yet
        for c0 in cls.TOP_P_CANDIDATES:
            C = min(V, max(ps[r].top_k if 0 < ps[r].top_k < V else c0 for r in left))
            idx = _rows(left, dev)
            part = rows if len(left) == len(ps) else rows[idx]
            vals, ids = torch.topk(part, C, dim=-1, sorted=True)
            probs = torch.exp(vals - lse[idx])
            cum = probs.cumsum(dim=-1)
            done = cum[:, -1] >= tp[idx, 0]
            if C < V and not bool(done.all()):
                # or every token still in play is a candidate (only top-k has removed any)
                kr = [j for j, r in enumerate(left) if 0 < ps[r].top_k < V]
                if kr:
                    kk = _rows(kr, dev)
                    done[kk] |= (part[kk] > ninf).sum(dim=-1) <= C
            drop = _exclusive(cum) >= tp[idx]
            drop[:, 0] = False
            kept = torch.full_like(part, ninf).scatter_(1, ids, vals.masked_fill(drop, ninf))
            if bool(done.all()):
                result[idx] = kept
                return result
            d = done.nonzero().squeeze(1)
            result[idx[d]] = kept[d]
            left = [r for r, ok in zip(left, done.tolist()) if not ok]
        idx = _rows(left, dev)
        w = rows[idx]
        svals, sids = torch.sort(w, dim=-1, descending=True)
        sp = torch.softmax(svals, dim=-1)
        sdrop = _exclusive(sp.cumsum(dim=-1)) >= tp[idx]
        sdrop[:, 0] = False
        result[idx] = w.masked_fill(sdrop.scatter(1, sids, sdrop), ninf)
        return result
