"""A tool-using agent loop against a running `radixkv serve`.

Each step the model chooses an action with ``select`` (so the action is always valid),
writes the action's input with ``gen``, and the tool's observation is appended as the
next message. Every step's prompt is the previous one plus a few tokens, so the runtime's
prefix cache serves nearly all of it: the table at the end shows it.

    python examples/agent.py                       starts its own server on a free port
    python examples/agent.py --url http://127.0.0.1:30000 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import ast
import operator

from radixkv.frontend import (
    RuntimeEndpoint,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    select,
    system,
    user,
)
from radixkv.frontend.report import calls_table
from radixkv.server.process import ServerProcess

FACTS = {
    "earth": "The Earth is about 12,742 km across and orbits the Sun in 365.25 days.",
    "moon": "The Moon is about 384,400 km from the Earth.",
    "light": "Light travels about 299,792 km per second.",
    "python": "Python was first released in 1991.",
}
TASK = "How many seconds does light need to travel from the Moon to the Earth?"
SYSTEM = (
    "You solve tasks with tools. Each turn, write 'Action: ' followed by one of: search (look up a fact about a "
    f"topic: {', '.join(FACTS)}), compute (evaluate arithmetic such as 384400 / 299792), answer (give the "
    "final answer). Then write 'Input: ' followed by the tool's input on one line."
)
ACTIONS = ["search", "compute", "answer"]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg}  # fmt: skip


def calculator(expression: str) -> str:
    """Arithmetic only (numbers and + - * / **), evaluated without ``eval``."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** are allowed")

    try:
        return f"{value(ast.parse(expression.replace(',', ''), mode='eval').body):.6g}"
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


def lookup(topic: str) -> str:
    words = topic.lower().split()
    hits = [fact for key, fact in FACTS.items() if key in words or key in topic.lower()]
    return " ".join(hits) or f"no fact about {topic!r}; topics: {', '.join(FACTS)}"


EXAMPLE = [  # one worked task, shown to the model as earlier turns
    ("user", "How many times does the Moon's distance fit into 1,000,000 km?"),
    ("assistant", "Action: search\nInput: moon"),
    ("user", "Observation: The Moon is about 384,400 km from the Earth."),
    ("assistant", "Action: compute\nInput: 1000000 / 384400"),
    ("user", "Observation: 2.60146"),
    ("assistant", "Action: answer\nInput: About 2.6 times."),
]


@function
def agent(s, task, max_steps):
    s += system(SYSTEM)
    for role, text in EXAMPLE:
        s += user(text) if role == "user" else assistant(text)
    s += user(task)
    for step in range(max_steps):
        s += assistant_begin()
        s += "Action: "
        s += select(f"action{step}", ACTIONS if step else ACTIONS[:2])  # look something up before answering
        s += "\nInput: "
        s += gen(f"input{step}", max_tokens=24, stop="\n", temperature=0)
        s += assistant_end()
        action, argument = s[f"action{step}"], s[f"input{step}"].strip()
        if action == "answer":
            break
        observation = calculator(argument) if action == "compute" else lookup(argument)
        s += user(f"Observation: {observation}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `radixkv serve` (default: start one)")
    parser.add_argument("--api-key")
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args(argv)
    server = None
    if args.url is None:
        print("starting radixkv serve ...")
        server = ServerProcess("--kv-cache-tokens", "16384")
        args.url = server.url
    backend = RuntimeEndpoint(args.url, api_key=args.api_key)
    try:
        state = agent.run(task=TASK, max_steps=args.max_steps, backend=backend)
        print(f"task: {TASK}\n")
        for message in state.messages()[2 + len(EXAMPLE) :]:
            print(f"{message['role']}: {message['content']}")
        print()
        print(calls_table(state.calls))
        return state
    finally:
        backend.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
