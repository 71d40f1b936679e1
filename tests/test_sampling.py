"""Sampling: parameter validation, penalties and filters against transformers' logits
processors, seeded reproducibility independent of the batch, the sampled distribution,
and logprobs of the raw model distribution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from radixkv.engine.sampling import SampleResult, Sampler, SamplerState, SamplingParams, prompt_logprobs

NEG_INF = float("-inf")


def _state(**kw) -> SamplerState:
    prompt = kw.pop("prompt", ())
    generated = kw.pop("generated", ())
    offset = kw.pop("seed_offset", 0)
    st = SamplerState(SamplingParams(**kw), prompt, seed_offset=offset)
    for t in generated:
        st.append(t)
    return st


# ------------------------------------------------------------------ validation

BAD = [
    ("max_new_tokens", 0), ("max_new_tokens", -3), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("max_new_tokens", "8"),
    ("temperature", -1), ("temperature", 100.5), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", True), ("temperature", "1.0"), ("temperature", None),
    ("top_p", 0), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.01), ("top_p", float("nan")), ("top_p", False),
    ("top_k", -2), ("top_k", 1.0), ("top_k", True), ("top_k", "5"),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", 10.5),
    ("repetition_penalty", float("inf")),
    ("frequency_penalty", -2.01), ("frequency_penalty", 2.5), ("frequency_penalty", "0"),
    ("presence_penalty", -3), ("presence_penalty", 2.01), ("presence_penalty", float("nan")),
    ("seed", 1.5), ("seed", True), ("seed", "7"), ("seed", 2**64), ("seed", -(2**63) - 1),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", [f"s{i}" for i in range(17)]),
    ("stop", {"a"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", "abc"), ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("n", 0), ("n", 65), ("n", True), ("n", 2.0),
    ("logprobs", 1), ("logprobs", None),
    ("top_logprobs", -1), ("top_logprobs", 21), ("top_logprobs", 2.0),
    ("prompt_logprobs_from", -1), ("prompt_logprobs_from", 1.5), ("prompt_logprobs_from", True),
    ("skip_special_tokens", 0), ("skip_special_tokens", None),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}"[:40] for f, v in BAD])
def test_bad_value_raises_valueerror_naming_the_field(field, value):
    kw = {field: value}
    if field == "top_logprobs":
        kw["logprobs"] = True
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_error_message_gives_the_range():
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 100\], got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"n must be in \[1, 64\], got 65"):
        SamplingParams(n=65)
    with pytest.raises(ValueError, match=r"repetition_penalty must be in \(0, 10\]"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match=r"at most 16"):
        SamplingParams(stop=["x"] * 17)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=3)
    assert SamplingParams(logprobs=True, top_logprobs=3).top_logprobs == 3


GOOD = [
    {}, {"temperature": 0}, {"temperature": 100}, {"temperature": 1}, {"top_p": 1}, {"top_p": 1e-6},
    {"top_k": -1}, {"top_k": 0}, {"top_k": 1}, {"top_k": 10**6}, {"min_p": 0}, {"min_p": 1},
    {"repetition_penalty": 10}, {"repetition_penalty": 0.5}, {"frequency_penalty": -2}, {"presence_penalty": 2},
    {"seed": 0}, {"seed": -5}, {"seed": 2**64 - 1}, {"stop": ["a", "bc"]}, {"stop": ("x",) * 16},
    {"stop_token_ids": [0, 2]}, {"n": 64}, {"logprobs": True, "top_logprobs": 20},
    {"prompt_logprobs_from": 0}, {"max_new_tokens": 1}, {"ignore_eos": True, "skip_special_tokens": False},
]


@pytest.mark.parametrize("kw", GOOD, ids=[repr(k)[:40] for k in GOOD])
def test_good_values_accepted(kw):
    p = SamplingParams(**kw)
    for k, v in kw.items():
        got = getattr(p, k)
        assert got == (tuple(v) if isinstance(v, list) else v)


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.stop, p.stop_token_ids, p.n, p.logprobs, p.top_logprobs) == (None, (), (), 1, False, 0)
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    t = SamplingParams(temperature=1)
    assert isinstance(t.temperature, float)
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop="a"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams().is_greedy
    assert not SamplingParams(temperature=1e-3, top_k=2).is_greedy


def test_state_and_sampler_input_checks():
    with pytest.raises(ValueError, match="seed_offset"):
        SamplerState(SamplingParams(), [1], seed_offset=-1)
    with pytest.raises(ValueError, match="params"):
        SamplerState({"temperature": 0}, [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token_id"):
        _state().append(-1)
    with pytest.raises(ValueError, match="2 states"):
        Sampler().sample(torch.zeros(3, 5), [_state(), _state()])
    with pytest.raises(ValueError, match="2-D"):
        Sampler().sample(torch.zeros(5), [_state()])


# ------------------------------------------------------------------ greedy and penalties


def test_greedy_is_argmax_first_on_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    logits[2, 7] = logits[2, 99] = 50.0  # tie: the first index wins
    states = [_state(temperature=0) for _ in range(5)] + [_state(top_k=1, temperature=0.3)]
    res = Sampler().sample(logits, states)
    assert res.tokens == torch.argmax(logits, dim=-1).tolist()
    assert res.tokens[2] == 7
    assert isinstance(res, SampleResult) and res.logprobs == [None] * 6 and res.top_logprobs == [None] * 6


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    g = torch.Generator().manual_seed(1)
    V = 500
    logits = torch.randn(4, V, generator=g) * 4
    prompts = [[1, 2, 3, 3, 400], [0, 499], [], [7] * 5 + [8, 9, 700]]  # 700 >= V: ignored, like HF
    gens = [[5, 5, 2], [], [10, 11], [12]]
    states = [_state(temperature=0, repetition_penalty=penalty, prompt=p, generated=gn) for p, gn in zip(prompts, gens)]
    got = Sampler().process_logits(logits, states)
    for i, (p, gn) in enumerate(zip(prompts, gens)):
        ids = torch.tensor([p + gn], dtype=torch.long)
        want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits[i : i + 1].clone())[0]
        assert torch.equal(got[i], want)
    res = Sampler().sample(logits, states)
    assert res.tokens == torch.argmax(got, dim=-1).tolist()


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0]])
    assert Sampler().sample(logits, [_state(temperature=0)]).tokens == [1]
    st = _state(temperature=0, repetition_penalty=1.5, prompt=[1])
    assert Sampler().sample(logits, [st]).tokens == [2]  # 3.0 / 1.5 = 2.0 < 2.5


def test_frequency_presence_penalties_exact():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    # the prompt (token 4) does not count for OpenAI penalties; 1 generated twice, 2 once
    st = _state(temperature=0, frequency_penalty=0.5, presence_penalty=0.25, prompt=[4], generated=[1, 1, 2])
    got = Sampler().process_logits(logits, [st])
    assert got.tolist() == [[1.0, 2.0 - 1.0 - 0.25, 3.0 - 0.5 - 0.25, 4.0, 5.0]]
    assert st.count(1) == 2 and st.count(2) == 1 and st.count(4) == 0
    assert st.has_seen(4) and st.has_seen(2) and not st.has_seen(0)

    # negative penalties encourage; combined with the repetition penalty, which comes first
    # and covers the prompt too: seen {1, 2, 4}; positive / 2, negative * 2
    logits = torch.tensor([[1.0, 2.0, -3.0, 4.0, 5.0]])
    st = _state(temperature=0, repetition_penalty=2.0, frequency_penalty=-1.0, presence_penalty=0.5,
                prompt=[4], generated=[1, 1, 2])
    got = Sampler().process_logits(logits, [st])
    assert got.tolist() == [[1.0, 1.0 + 2.0 - 0.5, -6.0 + 1.0 - 0.5, 4.0, 2.5]]
    assert logits.tolist() == [[1.0, 2.0, -3.0, 4.0, 5.0]]  # input untouched


def test_penalties_per_row_in_a_mixed_batch():
    logits = torch.zeros(3, 4) + torch.tensor([1.0, 2.0, 3.0, 4.0])
    states = [
        _state(temperature=0, presence_penalty=1.0, generated=[3]),
        _state(temperature=0),
        _state(temperature=0, frequency_penalty=2.0, generated=[0, 3, 3]),
    ]
    got = Sampler().process_logits(logits, states)
    assert got.tolist() == [[1.0, 2.0, 3.0, 3.0], [1.0, 2.0, 3.0, 4.0], [-1.0, 2.0, 3.0, 0.0]]
    assert Sampler().sample(logits, states).tokens == [2, 3, 2]


# ------------------------------------------------------------------ filters vs transformers


def _hf_filter(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = row[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if p.temperature != 1.0:
        x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0.0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0]


FILTERS = [
    dict(top_k=5), dict(top_k=50, temperature=0.7), dict(top_p=0.9), dict(top_p=0.5, temperature=1.5),
    dict(top_p=0.99), dict(min_p=0.1), dict(min_p=0.02, temperature=0.8), dict(top_k=20, top_p=0.8),
    dict(top_k=100, top_p=0.95, min_p=0.05, temperature=0.6), dict(temperature=2.0), dict(top_p=0.3, min_p=0.3),
    dict(top_k=2000), dict(top_p=1e-4),
]


# (1024,) >= V: one full topk; (64,): some rows from the partial topk, some sorted;
# (16,): mostly sorted; (16, 64, 128): rows finish at different stages
@pytest.mark.parametrize(
    "candidates", [(1024,), (64,), (16,), (16, 64, 128)], ids=["full-topk", "partial-topk", "sort", "stages"]
)
def test_filters_match_transformers(monkeypatch, candidates):
    monkeypatch.setattr(Sampler, "TOP_P_CANDIDATES", candidates)
    V = 1000
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        scale = [0.5, 2.0, 5.0][seed % 3]
        logits = torch.randn(len(FILTERS) + 2, V, generator=g) * scale
        params = [SamplingParams(**kw) for kw in FILTERS] + [SamplingParams(temperature=0), SamplingParams()]
        got = Sampler().process_logits(logits, [SamplerState(p, []) for p in params])
        for i, p in enumerate(params):
            if p.is_greedy:
                assert torch.equal(got[i], logits[i])
                continue
            want = _hf_filter(logits[i], p)
            kept = torch.isfinite(got[i])
            assert torch.equal(kept, torch.isfinite(want)), (seed, FILTERS[i] if i < len(FILTERS) else p)
            torch.testing.assert_close(got[i][kept], want[kept], rtol=0, atol=0)


def test_top_k_keeps_ties_and_top_p_keeps_one():
    logits = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.0], [9.0, 0.0, 0.0, 0.0, 0.0]])
    states = [SamplerState(SamplingParams(top_k=2), []), SamplerState(SamplingParams(top_p=0.01), [])]
    got = Sampler().process_logits(logits, states)
    assert torch.isfinite(got[0]).tolist() == [True, False, True, True, False]
    assert torch.isfinite(got[1]).tolist() == [True, False, False, False, False]
    for i, st in enumerate(states):
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(_hf_filter(logits[i], st.params)))


def test_temperature_scaling():
    logits = torch.tensor([[1.0, -2.0, 4.0], [0.5, 0.25, 3.0]])
    states = [SamplerState(SamplingParams(temperature=0.5), []), SamplerState(SamplingParams(temperature=4.0), [])]
    got = Sampler().process_logits(logits, states)
    assert torch.equal(got[0], logits[0] / 0.5) and torch.equal(got[1], logits[1] / 4.0)


def test_large_batch_draws_only_kept_tokens():
    B, V = 64, 49152
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, V, generator=g) * 3
    kinds = [dict(temperature=0), dict(top_k=40), dict(top_p=0.9, temperature=0.7), dict(min_p=0.3),
             dict(top_k=50, top_p=0.8, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3), dict()]
    states = [_state(seed=i, prompt=range(0, 3000, 7), generated=[i, i + 1], **kinds[i % len(kinds)])
              for i in range(B)]
    sampler = Sampler(0)
    allowed = torch.isfinite(sampler.process_logits(logits, states))
    res = sampler.sample(logits, states)
    assert len(res.tokens) == B
    assert all(bool(allowed[i, t]) for i, t in enumerate(res.tokens))


# ------------------------------------------------------------------ seeds and distribution


def _run(sampler, rows_logits, states, row, steps):
    out = []
    for t in range(steps):
        res = sampler.sample(rows_logits(t), states)
        for st, tok in zip(states, res.tokens):
            st.append(tok)
        out.append(res.tokens[row])
    return out


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)])
def test_seed_reproducible_alone_or_in_a_batch(kw):
    V, steps = 1000, 25

    def target_logits(t):
        return torch.randn(V, generator=torch.Generator().manual_seed(100 + t)) * 2

    alone = _run(Sampler(), lambda t: target_logits(t)[None], [_state(seed=1234, prompt=[1, 2], **kw)], 0, steps)

    def batch_logits(t):
        x = torch.randn(8, V, generator=torch.Generator().manual_seed(7 + t)) * 2
        x[3] = target_logits(t)
        return x

    others = [
        _state(seed=1), _state(), _state(temperature=0), None, _state(seed=99, top_p=0.5),
        _state(min_p=0.2), _state(seed=1234), _state(top_k=3, frequency_penalty=1.0),
    ]
    others[3] = _state(seed=1234, prompt=[1, 2], **kw)
    batched = _run(Sampler(), batch_logits, others, 3, steps)
    assert batched == alone
    # and again, alone, with a fresh sampler
    assert _run(Sampler(5), lambda t: target_logits(t)[None], [_state(seed=1234, prompt=[1, 2], **kw)], 0, steps) == alone
    # a different seed gives a different sequence
    other = _run(Sampler(), lambda t: target_logits(t)[None], [_state(seed=4321, prompt=[1, 2], **kw)], 0, steps)
    assert other != alone


def test_seed_offset_is_seed_plus_index():
    V = 200
    logits = lambda t: torch.zeros(1, V)  # noqa: E731 - uniform: every draw depends on the generator
    a = _run(Sampler(), logits, [_state(seed=10, seed_offset=3)], 0, 20)
    b = _run(Sampler(), logits, [_state(seed=13)], 0, 20)
    c = _run(Sampler(), logits, [_state(seed=10)], 0, 20)
    assert a == b and a != c
    # seeds wrap modulo 2**64
    wrapped = _run(Sampler(), logits, [_state(seed=2**64 - 1, seed_offset=1)], 0, 20)
    assert wrapped == _run(Sampler(), logits, [_state(seed=0)], 0, 20)


def test_draw_at_the_ends_of_the_cdf_picks_kept_tokens(monkeypatch):
    logits = torch.tensor([[5.0, 0.0, 4.0, 3.0, 0.0, 1.0, 0.0]])
    st = _state(top_k=3)  # keeps 0, 2, 3
    for u, want in ((0.0, 0), (1.0 - 1e-12, 3), (1.0, 3)):  # 1.0: rounding past the total
        monkeypatch.setattr(SamplerState, "_draw_uniform", lambda self, rng, u=u: u)
        assert Sampler().sample(logits, [st]).tokens == [want]


def test_unseeded_rows_follow_the_sampler_seed():
    V = 200
    logits = lambda t: torch.zeros(2, V)  # noqa: E731
    a = _run(Sampler(42), logits, [_state(), _state()], 1, 20)
    b = _run(Sampler(42), logits, [_state(), _state()], 1, 20)
    c = _run(Sampler(43), logits, [_state(), _state()], 1, 20)
    assert a == b and a != c


@pytest.mark.parametrize(
    "kw,want",
    [
        (dict(), [0.2, 0.3, 0.5]),
        (dict(temperature=2.0), None),
        (dict(top_k=2), [0.0, 0.375, 0.625]),
        (dict(min_p=0.5), [0.0, 0.375, 0.625]),
    ],
)
def test_sampled_frequencies_match_probabilities(kw, want):
    probs = torch.tensor([0.2, 0.3, 0.5])
    logits = probs.log()[None]
    if want is None:  # temperature T: p ** (1 / T), renormalised
        w = probs ** (1 / kw["temperature"])
        want = (w / w.sum()).tolist()
    st = _state(seed=2024, **kw)
    sampler = Sampler()
    counts = [0, 0, 0]
    draws = 4000
    for _ in range(draws):
        counts[sampler.sample(logits, [st]).tokens[0]] += 1
    freqs = [c / draws for c in counts]
    for f, p in zip(freqs, want):
        assert abs(f - p) < 0.03, (freqs, want)
        if p == 0.0:
            assert f == 0.0


# ------------------------------------------------------------------ logprobs


def test_logprobs_are_raw_model_logprobs():
    g = torch.Generator().manual_seed(5)
    V = 300
    logits = torch.randn(4, V, generator=g) * 3
    states = [
        _state(temperature=0, logprobs=True, top_logprobs=5, repetition_penalty=1.5, prompt=[1, 2, 3]),
        _state(seed=3, temperature=0.5, top_p=0.8, logprobs=True, frequency_penalty=1.0, generated=[4]),
        _state(seed=4),
        _state(seed=5, top_k=10, logprobs=True, top_logprobs=20),
    ]
    res = Sampler().sample(logits, states)
    lp = torch.log_softmax(logits, dim=-1)
    for i in (0, 1, 3):
        assert res.logprobs[i] == pytest.approx(lp[i, res.tokens[i]].item(), abs=1e-6)
    assert res.logprobs[2] is None and res.top_logprobs[2] is None and res.top_logprobs[1] is None
    for i, k in ((0, 5), (3, 20)):
        top = res.top_logprobs[i]
        assert len(top) == k
        vals = [v for _, v in top]
        assert vals == sorted(vals, reverse=True)
        ref_v, ref_i = torch.topk(lp[i], k)
        assert [t for t, _ in top] == ref_i.tolist()
        assert vals == pytest.approx(ref_v.tolist(), abs=1e-6)
        assert all(isinstance(t, int) and isinstance(v, float) for t, v in top)


def test_prompt_logprobs_helper():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 50, generator=g)
    targets = [3, 0, 49, 7, 7]
    got = prompt_logprobs(logits, targets)
    want = torch.log_softmax(logits, -1)[torch.arange(5), torch.tensor(targets)]
    assert got == pytest.approx(want.tolist(), abs=1e-6)
    assert Sampler.prompt_logprobs(logits, torch.tensor(targets)) == got
    assert prompt_logprobs(logits[:0], []) == []
    with pytest.raises(ValueError, match="target_ids"):
        prompt_logprobs(logits, [1, 2])
    assert all(math.isfinite(v) and v <= 0 for v in got)
