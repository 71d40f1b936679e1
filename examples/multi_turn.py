"""A multi-turn chat written as a program: each turn's prompt is the whole conversation
so far, and the prefix cache serves all of it except the newest message.

    python examples/multi_turn.py [--url http://127.0.0.1:30000] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import backend_arguments, make_backend  # noqa: E402

from radixkv.frontend import assistant, function, gen, system, user  # noqa: E402
from radixkv.frontend.report import calls_table  # noqa: E402

QUESTIONS = [
    "What is a prefix cache in an LLM server?",
    "Why does a multi-turn chat benefit from it?",
    "What happens when the cache is full?",
    "Summarise our conversation in one sentence.",
]


@function
def conversation(s, questions, max_tokens):
    s += system("You are a helpful assistant. Answer in two sentences at most.")
    for i, question in enumerate(questions):
        s += user(question)
        s += assistant(gen(f"answer{i}", max_tokens=max_tokens, temperature=0))


def main(argv=None, backend=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--turns", type=int, default=len(QUESTIONS))
    args = parser.parse_args(argv)
    owned = backend is None
    backend = backend or make_backend(args)
    try:
        questions = QUESTIONS[: args.turns]
        state = conversation.run(questions=questions, max_tokens=args.max_tokens, backend=backend)
        for i, question in enumerate(questions):
            print(f"user: {question}\nassistant: {state[f'answer{i}'].strip()}\n")
        print(calls_table(state.calls, [f"turn {i + 1}" for i in range(len(questions))]))
        return state
    finally:
        if owned:
            backend.close()


if __name__ == "__main__":
    main()
