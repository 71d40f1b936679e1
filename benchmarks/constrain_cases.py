"""The constrained-decoding cases every mask benchmark runs: ``bench_constrain.py`` (the
project's llguidance path) and ``peers/xgrammar_masks.py`` (xgrammar against llguidance
called directly). Standard library only, so any virtualenv can import it.

Each case is a grammar and a text it accepts; a benchmark tokenizes the text with the
embedded SmolLM2 tokenizer and feeds the tokens one by one, timing the mask after each.

- ``regex``: ``grammar`` is the pattern (the regex cases include the hostile ones the
  server's hostile test used against the old backtracking matcher, and the largest
  repeat a request may send).
- ``json_schema``: ``grammar`` is the schema (a dict). Both schemas close their objects
  with ``additionalProperties: false`` so that the two engines accept the same language
  (xgrammar's default ``strict_mode`` forbids extra properties; llguidance follows the
  JSON Schema default, which allows them).
- ``json_object``: any JSON object (OpenAI's ``response_format: json_object``);
  ``grammar`` is None.

JSON layouts (``JSON_LAYOUTS``), for the json_schema and json_object cases:
- ``fixed``: one line, separators exactly as ``json.dumps`` writes them (``", "`` and
  ``": "``), no other whitespace: radixkv's layout (a small model given free whitespace
  can spend its budget on newlines). llguidance: the schema's ``x-guidance`` options
  below; xgrammar: ``any_whitespace=False, separators=(", ", ": ")``.
- ``flexible``: each engine's default, any JSON whitespace between tokens (llguidance's
  ``whitespace_flexible``, xgrammar's ``any_whitespace=True``).

The JSON texts are ``json.dumps(obj)`` with its default separators, which both layouts
allow; both engines accept them token by token in both layouts (the benchmarks fail on a
JSON case an engine rejects).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple


class Case(NamedTuple):
    name: str
    kind: str  # "regex" | "json_schema" | "json_object"
    grammar: Any  # the pattern (str), the schema (dict), or None for json_object
    text: str  # a text the grammar accepts: the tokens the steps feed


KINDS = ("regex", "json_schema", "json_object")

REGEX_CASES = [
    Case("date", "regex", r"2024-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])", "2024-11-22"),
    Case("email", "regex", r"[a-z]{1,20}@[a-z]{1,20}\.(com|org|net)", "someone@example.org"),
    Case("json object", "regex", r'\{"name": "[A-Za-z ]{1,40}", "age": [0-9]{1,3}\}', '{"name": "Ada Lovelace", "age": 36}'),
    Case("free text", "regex", r"[^\n]{0,400}", "The capital of France is Paris, and the capital of Italy is Rome."),
    Case("backtracking (a|a)+c", "regex", r"(a|a)+c", "a" * 60 + "c"),
    Case("nested (x+x+)+y", "regex", r"(x+x+)+y", "x" * 60 + "y"),
    Case("largest repeat a{4000}", "regex", r"a{4000}", "a" * 200),
    Case("nested repeats (a{40}){100}", "regex", r"(a{40}){100}", "a" * 200),
]  # fmt: skip

# (a) a nested object with an enum, an array of strings and a bounded integer
PROFILE_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "profile": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "role", "tags", "age"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "profile"],
    "additionalProperties": False,
}
PROFILE = {"id": 4217, "profile": {"name": "Ada Lovelace", "role": "editor", "tags": ["math", "poetry", "engines"], "age": 36}}

# (b) a tool call's arguments, flat
WEATHER_ARGS_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
WEATHER_ARGS = {"location": "Paris, France", "unit": "celsius"}

# (c) any JSON object: nesting, every value type, an escape
FREE_OBJECT = {
    "title": "Quarterly report \"Q3\"",
    "count": 3,
    "ratio": -0.75e-2,
    "ok": True,
    "missing": None,
    "items": [1, 2.5, {"k": "v", "list": []}, "x"],
}

JSON_CASES = [
    Case("schema nested profile", "json_schema", PROFILE_SCHEMA, json.dumps(PROFILE)),
    Case("schema tool args (weather)", "json_schema", WEATHER_ARGS_SCHEMA, json.dumps(WEATHER_ARGS)),
    Case("json_object (any object)", "json_object", None, json.dumps(FREE_OBJECT)),
]

CASES = REGEX_CASES + JSON_CASES

FIXED_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_LAYOUTS = {  # name -> (llguidance "x-guidance" options, xgrammar compile_json_schema kwargs)
    "fixed": (FIXED_LAYOUT, {"any_whitespace": False, "separators": (", ", ": ")}),
    "flexible": ({}, {}),
}


def llguidance_schema(case: Case, layout: str) -> dict:
    """The JSON schema llguidance compiles for a json_schema or json_object case (any
    object: ``{"type": "object"}``) in ``layout`` (a name of ``JSON_LAYOUTS``)."""
    schema = case.grammar if case.kind == "json_schema" else {"type": "object"}
    options = JSON_LAYOUTS[layout][0]
    return {**schema, "x-guidance": options} if options else schema


def select(kinds: str | list[str] = "all") -> list[Case]:
    """The cases of ``kinds`` ("all", a kind, or a list of kinds), in ``CASES`` order.
    ValueError on an unknown kind."""
    wanted = set(KINDS) if kinds == "all" else {kinds} if isinstance(kinds, str) else set(kinds)
    unknown = wanted - set(KINDS)
    if unknown:
        raise ValueError(f"unknown case kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}")
    return [c for c in CASES if c.kind in wanted]
