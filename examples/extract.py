"""Structured extraction: a JSON record per document through the official OpenAI client's
``response_format`` json_schema, against `radixkv serve`, with the prefix-cache hits.

The documents are the RAG example's (the opening of a dozen standard-library modules'
docstrings). For each, one chat request asks for a record with
``response_format={"type": "json_schema", "json_schema": {"name": "module_record",
"schema": SCHEMA, "strict": True}}``: the server constrains decoding to the schema, so
the reply parses and validates (checked here with ``jsonschema``) whatever the model.
The schema does not reach the prompt, so the system message describes the fields.

Every request starts with the same system message (the instruction), so after the first
document the server's prefix cache serves it: ``cached`` is
``usage.prompt_tokens_details.cached_tokens`` (whole 16-token pages). The first document
goes alone, to put the instruction in the cache; the rest go concurrently (``--parallel``)
and the server batches them.

    python examples/extract.py                  starts its own server on a free port
    python examples/extract.py --url http://127.0.0.1:30000 [--api-key KEY] [--docs 4]

Needs the ``openai`` and ``jsonschema`` packages (radixkv's ``test`` extra has both).
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag import documents  # noqa: E402  (the RAG example's document set)

TOPICS = ["algorithms", "data formats", "files and compression", "databases", "math", "text processing"]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 3, "maxLength": 48},
        "topic": {"enum": TOPICS},
        "keywords": {"type": "array", "items": {"type": "string", "pattern": "^[a-z][a-z ]{1,19}$"},
                     "minItems": 1, "maxItems": 3},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "topic", "keywords", "difficulty"],
    "additionalProperties": False,
}  # fmt: skip
INSTRUCTION = (
    "You catalogue Python standard library modules. Read the module's documentation and answer with one JSON "
    "object with these fields:\n"
    '- "title": a short title for the module, at most 48 characters;\n'
    f'- "topic": one of {", ".join(json.dumps(t) for t in TOPICS)};\n'
    '- "keywords": one to three lowercase keywords;\n'
    '- "difficulty": how hard the module is to use, from 1 (easy) to 5 (hard).\n'
    "Answer with the JSON object only."
)
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "module_record", "schema": SCHEMA, "strict": True}}


@dataclass
class Extraction:
    module: str
    record: dict
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str


def extract(client, model: str, name: str, text: str, max_tokens: int) -> Extraction:
    r = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0, response_format=RESPONSE_FORMAT,
        messages=[{"role": "system", "content": INSTRUCTION},
                  {"role": "user", "content": f"Documentation of the {name} module:\n\n{text}"}],
    )  # fmt: skip
    choice, details = r.choices[0], r.usage.prompt_tokens_details
    if choice.finish_reason != "stop":  # cut short by max_tokens: not a whole record
        raise RuntimeError(f"{name}: no whole record within {max_tokens} tokens: {choice.message.content!r}")
    cached = details.cached_tokens if details else 0
    return Extraction(name, json.loads(choice.message.content), r.usage.prompt_tokens, cached,
                      r.usage.completion_tokens, choice.finish_reason)  # fmt: skip


def main(argv=None) -> list[Extraction]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `radixkv serve` (default: start one)")
    parser.add_argument("--api-key", help="the server's --api-key, if it has one")
    parser.add_argument("--docs", type=int, help="extract only the first N documents (default: all)")
    parser.add_argument("--parallel", type=int, default=4, help="concurrent requests after the first")
    parser.add_argument("--max-tokens", type=int, default=96, help="per record")
    args = parser.parse_args(argv)

    import jsonschema
    import openai

    from radixkv.server.process import ServerProcess

    docs = documents()[: args.docs]
    server = None
    if args.url is None:
        print("starting radixkv serve ...")
        server = ServerProcess("--kv-cache-tokens", "16384")
        args.url = server.url
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none", max_retries=0)
    try:
        model = client.models.list().data[0].id
        first = extract(client, model, *docs[0], args.max_tokens)  # puts the instruction in the cache
        with ThreadPoolExecutor(max(args.parallel, 1)) as pool:
            rest = list(pool.map(lambda doc: extract(client, model, *doc, args.max_tokens), docs[1:]))
        results = [first, *rest]
        for x in results:
            jsonschema.validate(x.record, SCHEMA)  # the constraint's promise, checked independently
        print(f"{'module':<12}{'prompt':>7}{'cached':>7}{'hit %':>7}  record (valid against SCHEMA)")
        for x in results:
            hit = 100 * x.cached_tokens / x.prompt_tokens
            print(f"{x.module:<12}{x.prompt_tokens:>7}{x.cached_tokens:>7}{hit:>7.1f}  {json.dumps(x.record)}")
        prompt, cached = sum(x.prompt_tokens for x in results), sum(x.cached_tokens for x in results)
        print(f"{'overall':<12}{prompt:>7}{cached:>7}{100 * cached / prompt:>7.1f}  "
              f"{len(results)} records, all valid; the instruction is a shared prefix of every prompt")  # fmt: skip
        return results
    finally:
        client.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
