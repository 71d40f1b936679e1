"""Tree-of-thought in miniature: fork the conversation into several lines of thought,
let them generate side by side, join them, and let the model pick the best.

The shared prefix (instructions and question) is computed once; every branch and the
final choice find it in the prefix cache.

    python examples/branching.py [--url http://127.0.0.1:30000] [--branches 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import backend_arguments, make_backend  # noqa: E402

from radixkv.frontend import assistant, function, gen, select, system, user  # noqa: E402
from radixkv.frontend.report import calls_table  # noqa: E402

QUESTION = "How could a small team make their web service respond faster?"
ANGLES = ["caching", "the database", "the network", "the code itself"]


@function
def tree_of_thought(s, question, angles, max_tokens):
    s += system("You are a practical engineer. Keep every answer to one or two sentences.")
    s += user(question)
    s += assistant("Let me think about it from several angles.")
    branches = s.fork(len(angles))
    for branch, angle in zip(branches, angles):
        branch += user(f"Give one concrete idea that focuses on {angle}.")
        branch += assistant(gen("idea", max_tokens=max_tokens, temperature=0))
    branches.join()  # s["idea"] is now the list of the branches' ideas
    listing = "\n".join(f"{i + 1}. {idea.strip()}" for i, idea in enumerate(s["idea"]))
    s += user(f"Here are the ideas:\n{listing}\nWhich one would help most? Answer with its number.")
    s += assistant(select("best", [str(i + 1) for i in range(len(angles))]))


def main(argv=None, backend=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    backend_arguments(parser)
    parser.add_argument("--branches", type=int, default=3, choices=range(1, len(ANGLES) + 1))
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    owned = backend is None
    backend = backend or make_backend(args)
    try:
        angles = ANGLES[: args.branches]
        state = tree_of_thought.run(question=QUESTION, angles=angles, max_tokens=args.max_tokens, backend=backend)
        print(f"question: {QUESTION}\n")
        for angle, idea in zip(angles, state["idea"]):
            print(f"[{angle}] {idea.strip()}")
        print(f"\nthe model picks idea {state['best']} ({angles[int(state['best']) - 1]})\n")
        calls = state.all_calls()
        labels = [f"{c.kind} {c.name or ''}".strip() for c in calls]
        print(calls_table(calls, labels))
        return state
    finally:
        if owned:
            backend.close()


if __name__ == "__main__":
    main()
