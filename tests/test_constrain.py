"""Constraints and logits processors in the engine, on the real SmolLM2 model: json_schema,
ebnf and choices grammars, the compiled-grammar cache, batched masks (inline and
prefetched on the mask thread), min_tokens against a grammar's end, priority scheduling."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from radixkv.engine.constrain import Grammar, GrammarSpec, disallowed, prefetch
from radixkv.engine.engine import Engine
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import FieldError


@pytest.fixture(scope="module")
def engine():
    with Engine(kv_cache_tokens=8192, max_running=1) as e:
        yield e
        e.check_integrity()


def ask(engine, text):
    return engine.render_chat([{"role": "user", "content": text}])


def test_each_grammar_kind_constrains_the_output(engine):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 5}},
              "required": ["city", "rank"], "additionalProperties": False}  # fmt: skip
    out = engine.generate(ask(engine, "A city and its rank as JSON."),
                          SamplingParams(temperature=0, max_new_tokens=60, json_schema=schema))  # fmt: skip
    jsonschema.validate(json.loads(out.text), schema)
    assert out.text == json.dumps(json.loads(out.text))  # one line, json.dumps's separators
    out = engine.generate(ask(engine, "Pick a colour."), SamplingParams(temperature=0.9, seed=2, max_new_tokens=8,
                                                                         choices=["red", "green", "blue"]))  # fmt: skip
    assert out.text in ("red", "green", "blue") and out.finish_reason == "stop"
    for grammar in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):  # GBNF and Lark
        out = engine.generate(ask(engine, "Is water wet?"), SamplingParams(temperature=0, max_new_tokens=8, ebnf=grammar))
        assert out.text in ("yes", "no")


def test_grammar_fields_are_checked(engine):
    for kwargs, field in [
        ({"regex": "a+", "json_schema": "{}"}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": "[1, 2]"}, "json_schema"),
        ({"ebnf": "start: undefined_rule"}, "ebnf"),
        ({"choices": []}, "choices"),
        ({"choices": ["a", 3]}, "choices"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
    ]:  # fmt: skip
        with pytest.raises(FieldError) as e:
            SamplingParams(**kwargs)
        assert e.value.field == field, (kwargs, e.value)


def test_compiled_grammars_are_cached_and_copies_are_independent(engine):
    grammar = Grammar(engine.tokenizer, engine.loop.vocab_size, cached=2)
    spec = GrammarSpec("regex", r"[0-9]{2}-[a-z]{2}")
    a = grammar.compile(spec)
    b = grammar.compile(spec)
    assert (grammar.misses, grammar.hits) == (1, 1)
    assert torch.equal(a.allowed(), b.allowed())
    for t in engine.tokenizer.encode("12", add_special_tokens=False):
        a.advance(t)
    assert not torch.equal(a.allowed(), b.allowed())  # a moved on, b did not
    for s in ("x+", "y+"):  # two more specs push the first out of a cache of 2
        grammar.compile(GrammarSpec("regex", s))
    grammar.compile(spec)
    assert grammar.misses == 4


def test_batched_masks_match_each_constraint_and_prefetch_changes_nothing(engine):
    g = engine.grammar
    specs = [GrammarSpec("regex", r"[a-z ]{1,30}"), GrammarSpec("json_schema", '{"type": "object"}'),
             GrammarSpec("choices", ("alpha", "beta"))]  # fmt: skip
    texts = ["hello wor", '{"a": [1, 2', "alp"]
    inline, fetched = [g.compile(s) for s in specs], [g.compile(s) for s in specs]
    for cs in (inline, fetched):
        for c, text in zip(cs, texts):
            for t in engine.tokenizer.encode(text, add_special_tokens=False):
                c.advance(t)
    V = engine.loop.vocab_size + 7  # logits wider than the vocabulary: the extra columns are never allowed
    bad, errors, counts = disallowed(inline, V)
    prefetch(fetched)
    bad2, errors2, counts2 = disallowed(fetched, V)
    assert torch.equal(bad, bad2) and errors == errors2 == [None] * 3 and counts == counts2
    for k, c in enumerate(inline):
        assert torch.equal(~bad[k, : c.vocab_size], c.allowed()) and bad[k, c.vocab_size :].all()
        assert counts[k] == int(c.allowed().sum())


def test_min_tokens_yields_to_a_grammars_end(engine):
    p = SamplingParams(temperature=0, max_new_tokens=20, min_tokens=10, choices=["yes", "no"])
    out = engine.generate(ask(engine, "Is fire hot?"), p)
    assert out.text in ("yes", "no") and out.finish_reason == "stop"  # the grammar ended before 10 tokens
    free = engine.generate(ask(engine, "Is fire hot? Answer in one word."),
                           SamplingParams(temperature=0, max_new_tokens=30, min_tokens=10))  # fmt: skip
    assert len(free.token_ids) >= 10


def test_priority_orders_admission(engine):
    """One request runs at a time (max_running=1): waiting ones start highest priority first."""
    prompts = [ask(engine, f"Count to {k}.") for k in range(4)]
    params = [SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, priority=p) for p in (0, 1, 5, 3)]
    outs = engine.generate(prompts, params)
    finish = [o.metrics.finish_time for o in outs]
    order = sorted(range(4), key=finish.__getitem__)
    assert order == [2, 3, 1, 0], (order, finish)


def test_a_batch_with_a_bad_prompt_sends_none_of_it(engine):
    """generate() checks every prompt before it sends any (one command: the loop admits a
    batch together, so priorities order all of it), and a refused one leaves nothing running."""
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    before = engine.loop.generated_tokens
    with pytest.raises(ValueError, match="the model's context is"):
        engine.generate([ask(engine, "Hi."), [1] * (engine.max_context + 1)], params)
    assert len(engine.generate(ask(engine, "Hello."), params).token_ids) == 4  # behind the first, had it been sent
    assert engine.loop.generated_tokens == before + 4


def test_top_logprobs_leave_out_the_tokens_a_constraint_removed(engine):
    p = SamplingParams(temperature=0, max_new_tokens=4, choices=["yes", "no"], logprobs=True, top_logprobs=5)
    out = engine.generate(ask(engine, "Is water wet?"), p).outputs[0]
    assert out.top_logprobs and all(v > float("-inf") for row in out.top_logprobs for _, v in row)
    assert all(len(row) >= 1 for row in out.top_logprobs)
