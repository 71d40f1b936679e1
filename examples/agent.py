"""A tool-using agent through the official OpenAI client's tool calling, against `radixkv serve`.

Three local tools: ``calculator`` (arithmetic, evaluated without ``eval``), ``weather``
(a lookup in a small dict) and ``search_docs`` (BM25 over the RAG example's documents).
Each step sends the conversation with ``tools=``; every ``tool_call`` that comes back is
executed here, the assistant message and a ``role: "tool"`` result per call are appended,
and the loop repeats until the model answers in text or the step limit is reached.

The embedded SmolLM2-135M has no tool format of its own: the server renders the tools'
JSON schemas into the system message and constrains each call to one tool's schema,
so whatever the model calls is a valid call. Choosing *whether* to call is the weak
part of a 135M model, hence ``tool_choice`` per step:

    step 1          "required"  left to itself ("auto") the model answers arithmetic from
                                memory, and wrongly ("17 * 23 = 389"; see --first auto);
                                "required" makes it call a tool first
    steps 2 .. n-1  "auto"      the tool's result is in view: answer, or call again
    step n          "none"      the step limit: no tools in the prompt, answer in text

"none" only at the step limit, because it changes the prompt: the server leaves the
tools out of the system message, so the prompt parts from the cached one near its
start (a few percent cached, where an "auto" step gets ~90%), and the model, no longer
shown its tools, answers worse. "auto" after a tool's result is what this model
answers in text from (see the transcript; --max-steps 2 shows "none" instead).

What helps a small model choose the right tool: a worked example of each tool's use as
earlier turns of the conversation (EXAMPLE), a system message saying which tool is for
what, and no generic prefix on tool names (named ``get_weather``, the weather tool got
every question, "17 times 23" included: "get" is the likeliest first token of any
function name). The example, the system message and the tools are the same for every
task, and every step's prompt is the previous step's plus the call and its result, so
the server's prefix cache serves nearly all of each prompt: the ``cached`` column is
``usage.prompt_tokens_details.cached_tokens``.

    python examples/agent.py                       starts its own server on a free port
    python examples/agent.py --url http://127.0.0.1:30000 [--api-key KEY]
    python examples/agent.py --task "What is 12 times 12?" --max-steps 3
    python examples/agent.py --first auto          the first step without "required"

Needs the ``openai`` package (``pip install openai``, or radixkv's ``test`` extra).
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rag import BM25, documents  # noqa: E402  (the RAG example's document set)

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression such as 3 * (4 + 5).",
        "parameters": {"type": "object", "properties": {
            "expression": {"type": "string", "pattern": r"^[0-9(][0-9+*/(). -]{0,39}$"}},
            "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "pattern": r"^[A-Z][A-Za-z .-]{1,29}$"}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the Python standard library documentation.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "pattern": r"^[A-Za-z][A-Za-z ]{1,39}$"}},
            "required": ["query"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = ("You are a helpful assistant. Use calculator for arithmetic, weather for the weather in a city, and "
          "search_docs for questions about Python modules. Answer in one sentence.")  # fmt: skip
TASKS = [
    "What is 17 times 23?",
    "Is it sunny in Paris?",
    "Which Python module gives me a priority queue?",
]
WEATHER = {
    "paris": {"condition": "sunny", "celsius": 18},
    "london": {"condition": "cloudy", "celsius": 12},
    "berlin": {"condition": "rain", "celsius": 9},
    "tokyo": {"condition": "clear", "celsius": 21},
    "new york": {"condition": "windy", "celsius": 15},
}


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


EXAMPLE = [  # worked turns, one per tool, in front of every task
    {"role": "user", "content": "What is 12 plus 30?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_ex1", "calculator", {"expression": "12 + 30"})]},
    {"role": "tool", "tool_call_id": "call_ex1", "content": "42"},
    {"role": "assistant", "content": "12 plus 30 is 42."},
    {"role": "user", "content": "Which module reads CSV files?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_ex2", "search_docs", {"query": "CSV files"})]},
    {"role": "tool", "tool_call_id": "call_ex2", "content": "[csv] CSV parsing and writing."},
    {"role": "assistant", "content": "The csv module reads and writes CSV files."},
    {"role": "user", "content": "Is it raining in Berlin?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_ex3", "weather", {"city": "Berlin"})]},
    {"role": "tool", "tool_call_id": "call_ex3", "content": json.dumps({"city": "Berlin", **WEATHER["berlin"]})},
    {"role": "assistant", "content": "Yes, it is raining in Berlin, at 9 degrees Celsius."},
]  # fmt: skip

# -- the tools, run locally -----------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg}  # fmt: skip


def calculator(expression: str) -> str:
    """Arithmetic only (numbers and + - * / **), evaluated without ``eval``."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            if isinstance(node.op, ast.Pow) and abs(value(node.right)) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ** are allowed")

    try:
        return f"{value(ast.parse(expression.replace(',', ''), mode='eval').body):.6g}"
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"


def weather(city: str) -> str:
    report = WEATHER.get(city.strip().lower())
    if report is None:
        return json.dumps({"error": f"no weather for {city!r}; known cities: {', '.join(c.title() for c in WEATHER)}"})
    return json.dumps({"city": city.strip().title(), **report})


_DOCS = documents()
_INDEX = BM25([f"{name} {text}" for name, text in _DOCS])


def search_docs(query: str) -> str:
    """The best-matching document, its first 40 words."""
    name, text = _DOCS[_INDEX.top(query, 1)[0]]
    return f"[{name}] {' '.join(text.split()[:40])}"


EXECUTORS = {"calculator": calculator, "weather": weather, "search_docs": search_docs}


def execute(name: str, arguments: str) -> str:
    """Run one tool call; a bad call becomes an error message for the model, not an exception."""
    if name not in EXECUTORS:
        return f"error: no tool named {name!r}"
    try:
        args = json.loads(arguments)
        return EXECUTORS[name](**args)
    except (ValueError, TypeError) as e:
        return f"error: bad arguments {arguments!r}: {e}"


# -- the loop --------------------------------------------------------------------------------


@dataclass
class ToolRun:
    name: str
    arguments: str  # JSON text, as the model wrote it
    result: str


@dataclass
class Step:
    tool_choice: str
    prompt_tokens: int
    cached_tokens: int
    content: str | None
    calls: list[ToolRun] = field(default_factory=list)


@dataclass
class AgentRun:
    task: str
    steps: list[Step]
    answer: str | None  # the final text answer; None if the step limit came first
    messages: list[dict]


def tool_choice_for(step: int, max_steps: int, first: str = "required") -> str:
    """``first`` at step 0, "none" at the last step (an answer in text), "auto" between."""
    if step == max_steps - 1:
        return "none"
    return first if step == 0 else "auto"


def run_agent(client, model: str, task: str, max_steps: int = 4, max_tokens: int = 64,
              first: str = "required") -> AgentRun:  # fmt: skip
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": task}]
    steps, answer = [], None
    for i in range(max_steps):
        choice = tool_choice_for(i, max_steps, first)
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=max_tokens, temperature=0)  # fmt: skip
        msg = r.choices[0].message
        details = r.usage.prompt_tokens_details
        step = Step(choice, r.usage.prompt_tokens, details.cached_tokens if details else 0, msg.content)
        steps.append(step)
        messages.append(msg.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        if not msg.tool_calls:
            answer = (msg.content or "").strip()
            break
        for call in msg.tool_calls:
            result = execute(call.function.name, call.function.arguments)
            step.calls.append(ToolRun(call.function.name, call.function.arguments, result))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return AgentRun(task, steps, answer, messages)


def print_run(n: int, run: AgentRun) -> None:
    print(f"task {n}: {run.task}")
    for i, step in enumerate(run.steps, 1):
        hit = 100 * step.cached_tokens / max(step.prompt_tokens, 1)
        print(f"  step {i}  tool_choice={step.tool_choice:<9} prompt {step.prompt_tokens:>4} tokens, "
              f"cached {step.cached_tokens:>4} ({hit:.0f}%)")  # fmt: skip
        if step.content and step.calls:  # text beside the calls
            print("    assistant: " + textwrap.indent(step.content, " " * 15).lstrip())
        for call in step.calls:
            print(f"    assistant -> {call.name}({call.arguments})")
            print(f"    tool      <- {call.result}")
    if run.answer is None:
        print("    (no answer within the step limit)")
    else:
        print("    answer: " + textwrap.indent(run.answer, " " * 12).lstrip())
    print()


def main(argv=None) -> list[AgentRun]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `radixkv serve` (default: start one)")
    parser.add_argument("--api-key", help="the server's --api-key, if it has one")
    parser.add_argument("--task", action="append", help="a task (repeatable; default: three built-in ones)")
    parser.add_argument("--tasks", type=int, help="run only the first N built-in tasks")
    parser.add_argument("--max-steps", type=int, default=4, help="model calls per task, at least 2")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--first", choices=["required", "auto"], default="required",
                        help="the first step's tool_choice")
    args = parser.parse_args(argv)
    if args.max_steps < 2:
        parser.error("--max-steps must be at least 2 (a tool call, then an answer)")
    tasks = args.task or TASKS[: args.tasks]

    import openai

    from radixkv.server.process import ServerProcess

    server = None
    if args.url is None:
        print("starting radixkv serve ...")
        server = ServerProcess("--kv-cache-tokens", "16384")
        args.url = server.url
    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key or "none", max_retries=0)
    try:
        model = client.models.list().data[0].id
        print(f"model {model}; tools: {', '.join(SCHEMAS)}\n")
        runs = [run_agent(client, model, task, args.max_steps, args.max_tokens, args.first) for task in tasks]
        for n, run in enumerate(runs, 1):
            print_run(n, run)
        prompt = sum(s.prompt_tokens for r in runs for s in r.steps)
        cached = sum(s.cached_tokens for r in runs for s in r.steps)
        calls = sum(len(s.calls) for r in runs for s in r.steps)
        print(f"total: {len(runs)} tasks, {sum(len(r.steps) for r in runs)} requests, {calls} tool calls; "
              f"prompt {prompt} tokens, cached {cached} ({100 * cached / max(prompt, 1):.1f}%)")  # fmt: skip
        return runs
    finally:
        client.close()
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
