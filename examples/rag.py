"""Retrieval-augmented answers over a small local document set, with the prefix-cache
hit rate of every question.

The documents are the opening paragraphs of a dozen standard-library modules' own
docstrings (local, natural English, no download). Each question retrieves its top 3
documents with BM25, puts them in the prompt in a fixed (document id) order after a
shared instruction, and answers. Questions run as a batch; the instruction and any
leading documents two questions share come from the cache.

    python examples/rag.py [--url http://127.0.0.1:30000] [--questions 8] [--top-k 3]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import backend_arguments, make_backend  # noqa: E402

from radixkv.frontend import assistant, function, gen, system, user  # noqa: E402

MODULES = ("bisect", "heapq", "json", "csv", "zipfile", "gzip", "sqlite3", "statistics", "textwrap", "difflib",
           "fractions", "shlex")  # fmt: skip
QUESTIONS = [
    "How can I keep a list sorted while inserting items?",
    "Which module gives me a priority queue?",
    "How do I read a spreadsheet exported as comma separated values?",
    "How can I compare two texts and see their differences?",
    "What module computes the mean and median of data?",
    "How do I compress a file?",
    "How can I exactly represent one third as a number?",
    "How do I split a shell command line into words?",
    "How can I wrap long lines of text to a fixed width?",
    "How do I store records in a small local database?",
]
INSTRUCTION = "Answer the question in one sentence, using only the documents you are given."


def documents() -> list[tuple[str, str]]:
    """(module name, the first ~120 words of its docstring) for each module."""
    docs = []
    for name in MODULES:
        text = " ".join((inspect.getdoc(importlib.import_module(name)) or "").split())
        docs.append((name, " ".join(text.split()[:120])))
    return docs


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


class BM25:
    """Okapi BM25 over whole words; enough for a dozen documents."""

    def __init__(self, texts: list[str], k1: float = 1.5, b: float = 0.75):
        self.docs = [Counter(words(t)) for t in texts]
        self.lengths = [sum(d.values()) for d in self.docs]
        self.avg = sum(self.lengths) / len(self.lengths)
        df = Counter(w for d in self.docs for w in d)
        n = len(self.docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}
        self.k1, self.b = k1, b

    def top(self, query: str, k: int) -> list[int]:
        def score(i):
            d, norm = self.docs[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg)
            return sum(self.idf.get(w, 0) * d[w] * (self.k1 + 1) / (d[w] + norm) for w in set(words(query)))

        return sorted(range(len(self.docs)), key=score, reverse=True)[:k]


@function
def answer(s, question, docs, max_tokens):
    s += system(INSTRUCTION)
    listing = "\n\n".join(f"[{name}] {text}" for name, text in docs)
    s += user(f"Documents:\n\n{listing}\n\nQuestion: {question}")
    s += assistant(gen("answer", max_tokens=max_tokens, temperature=0))


def main(argv=None, backend=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend_arguments(parser)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    owned = backend is None
    backend = backend or make_backend(args)
    try:
        docs = documents()
        index = BM25([f"{name} {text}" for name, text in docs])
        questions = QUESTIONS[: args.questions]
        picks = [sorted(index.top(q, args.top_k)) for q in questions]  # document-id order: shared prefixes line up
        batch = [{"question": q, "docs": [docs[i] for i in p], "max_tokens": args.max_tokens}
                 for q, p in zip(questions, picks)]  # fmt: skip
        states = answer.run_batch(batch, backend=backend, num_threads=4)
        print(f"{'question':<58}{'documents':<28}{'prompt':>7}{'cached':>7}{'hit %':>7}")
        prompt = cached = 0
        for q, p, s in zip(questions, picks, states):
            (call,) = s.calls
            prompt, cached = prompt + call.prompt_tokens, cached + call.cached_tokens
            names = ",".join(docs[i][0] for i in p)
            print(f"{q[:56]:<58}{names[:26]:<28}{call.prompt_tokens:>7}{call.cached_tokens:>7}"
                  f"{100 * call.cached_tokens / call.prompt_tokens:>7.1f}")  # fmt: skip
        print(f"{'overall':<86}{prompt:>7}{cached:>7}{100 * cached / prompt:>7.1f}\n")
        for q, s in zip(questions[:3], states):
            print(f"Q: {q}\nA: {s['answer'].strip()}\n")
        return states, cached / prompt
    finally:
        if owned:
            backend.close()


if __name__ == "__main__":
    main()
