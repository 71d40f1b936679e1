"""Seeded workloads in the manner of the SGLang paper's benchmarks, as frontend programs.

Text is natural English taken from Python's own standard-library docstrings (no
download). Each workload is a program plus the list of its runs' arguments; the same
seed gives the same prompts (on the same Python version: the docstrings are its own). Every generation uses ``ignore_eos`` and a fixed
``max_tokens``, so every system produces the same number of output tokens.

    few_shot    a 5-shot prefix of ~1k tokens shared by every question; short answers
    multi_turn  conversations x 4 turns, 256-512 new user tokens a turn
    branching   tree of thought: fork 3 at every level, depth 3
    rag         a shared instruction + top-3 of 30 documents for each question
    agent       ReAct-style loops: each step appends a tool observation to the prompt

``radixkv.workloads.recorder`` turns a workload into a trace for ``radixkv sim``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import random
import re
import time
import warnings
from dataclasses import dataclass
from typing import Callable

from radixkv.frontend import assistant, function, gen, system, user
from radixkv.frontend.backends import Backend

DOC_MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "mimetypes", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "selectors", "shlex", "shutil", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """Prose paragraphs (>= 25 words, no code) from the docstrings of DOC_MODULES and
    their public members, in a fixed order, without duplicates."""
    seen, out = set(), []
    for name in DOC_MODULES:
        module = importlib.import_module(name)
        with warnings.catch_warnings():  # typing's deprecated aliases warn on access
            warnings.simplefilter("ignore", DeprecationWarning)
            objects = [module] + [getattr(module, a) for a in sorted(dir(module)) if not a.startswith("_")]
        for obj in objects:
            doc = inspect.getdoc(obj) if (inspect.ismodule(obj) or callable(obj)) else None
            for para in (doc or "").split("\n\n"):
                text = " ".join(para.split())
                if len(text.split()) < 25 or text in seen or re.search(r">>>|::|\{|\}|==|\w\(\)|\$", text):
                    continue
                seen.add(text)
                out.append(text)
    return tuple(out)


def passage(rng: random.Random, min_words: int, max_words: int) -> str:
    """Consecutive corpus paragraphs from a random start, min..max words."""
    paras = corpus()
    target = rng.randint(min_words, max_words)
    i, words = rng.randrange(len(paras)), []
    while len(words) < target:
        words += paras[i % len(paras)].split()
        i += 1
    return " ".join(words[:target])


@dataclass(frozen=True)
class Scale:
    """How big each workload is. FULL follows the paper's shapes; SMALL is `radixkv
    bench`; TINY is what the test suite runs."""

    few_shot_questions: int = 64
    few_shot_answer: int = 8
    conversations: int = 16
    turns: int = 4
    turn_words: tuple[int, int] = (190, 380)  # ~256-512 tokens
    chat_answer: int = 32
    trees: int = 4
    branch_answer: int = 16
    rag_questions: int = 100
    rag_documents: int = 30
    rag_answer: int = 16
    agents: int = 8
    agent_steps: int = 6
    agent_answer: int = 24
    threads: int = 16


FULL = Scale()
SMALL = Scale(few_shot_questions=16, conversations=4, turns=3, trees=1, rag_questions=24, agents=3, agent_steps=4,
              threads=8)  # fmt: skip
TINY = Scale(few_shot_questions=3, few_shot_answer=2, conversations=2, turns=2, turn_words=(20, 40), chat_answer=3,
             trees=1, branch_answer=2, rag_questions=3, rag_documents=6, rag_answer=2, agents=1, agent_steps=2,
             agent_answer=2, threads=2)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    name: str
    program: Callable  # an @function program
    runs: list[dict]  # one kwargs dict per program run
    threads: int
    shared_prefix: bool  # whether the runs share a prefix (the cache's best case)


def _fixed(max_tokens: int) -> dict:
    return {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


# -- few-shot -----------------------------------------------------------------------------


@function
def few_shot(s, examples, question, answer_tokens):
    s += examples
    s += f"Passage: {question}\nTopic:"
    s += gen("answer", **_fixed(answer_tokens))


def make_few_shot(seed: int, sc: Scale) -> Workload:
    rng = random.Random(seed)
    shots = "".join(f"Passage: {passage(rng, 150, 170)}\nTopic: {rng.choice(DOC_MODULES)}\n\n" for _ in range(5))
    examples = "Name the standard-library module each passage documents.\n\n" + shots
    runs = [{"examples": examples, "question": passage(rng, 40, 80), "answer_tokens": sc.few_shot_answer}
            for _ in range(sc.few_shot_questions)]  # fmt: skip
    return Workload("few_shot", few_shot, runs, sc.threads, True)


# -- multi-turn chat -------------------------------------------------------------------------


@function
def multi_turn(s, messages, answer_tokens):
    s += system("You are a helpful assistant who explains Python documentation.")
    for i, message in enumerate(messages):
        s += user(message)
        s += assistant(gen(f"answer{i}", **_fixed(answer_tokens)))


def make_multi_turn(seed: int, sc: Scale) -> Workload:
    rng = random.Random(seed)
    runs = [
        {"messages": [f"Explain this: {passage(rng, *sc.turn_words)}" for _ in range(sc.turns)],
         "answer_tokens": sc.chat_answer}
        for _ in range(sc.conversations)
    ]  # fmt: skip
    return Workload("multi_turn", multi_turn, runs, min(sc.threads, sc.conversations), False)


# -- branching ---------------------------------------------------------------------------------


@function
def branching(s, problem, depth, width, answer_tokens, pause=0.0):
    """``pause``: seconds a real tree of thought spends scoring a level's branches before
    it expands them (benchmarks/bench_hints.py); 0 sends the same calls without waiting."""
    s += system("You reason step by step, one short step at a time.")
    s += user(f"Problem: {problem}\nPropose a first step.")
    frontier = [s]
    for level in range(depth):
        children = []
        for node in frontier:
            forks = node.fork(width)
            for k, f in enumerate(forks):
                f += assistant(gen(f"step{level}", **_fixed(answer_tokens)))
                if level + 1 < depth:
                    f += user(f"Continue from option {k + 1} with the next step.")
            children += forks
        for node in children:
            node.sync()
        time.sleep(pause)
        frontier = children


def make_branching(seed: int, sc: Scale) -> Workload:
    rng = random.Random(seed)
    runs = [{"problem": passage(rng, 60, 90), "depth": 3, "width": 3, "answer_tokens": sc.branch_answer}
            for _ in range(sc.trees)]  # fmt: skip
    return Workload("branching", branching, runs, min(sc.threads, sc.trees), True)


# -- RAG -----------------------------------------------------------------------------------------

RAG_INSTRUCTION = (
    "You answer questions about Python's standard library. Use only the documents below; if they do not contain "
    "the answer, say so. Quote the module name you rely on."
)


@function
def rag(s, documents, question, answer_tokens):
    s += system(RAG_INSTRUCTION)
    s += user("Documents:\n\n" + "\n\n".join(documents) + f"\n\nQuestion: {question}")
    s += assistant(gen("answer", **_fixed(answer_tokens)))


def make_rag(seed: int, sc: Scale) -> Workload:
    """Retrieval is simulated: each question's top 3 are drawn with Zipf-like popularity
    (some documents are retrieved far more often, as in real traffic) and listed in
    document-id order."""
    rng = random.Random(seed)
    docs = [f"[doc {i}] {passage(rng, 130, 170)}" for i in range(sc.rag_documents)]
    weights = [1 / (i + 1) for i in range(sc.rag_documents)]
    runs = []
    for _ in range(sc.rag_questions):
        picked: set[int] = set()
        while len(picked) < min(3, sc.rag_documents):
            picked.add(rng.choices(range(sc.rag_documents), weights)[0])
        question = "What does the documentation say about " + " ".join(passage(rng, 8, 14).split()[:10]) + "?"
        runs.append({"documents": [docs[i] for i in sorted(picked)], "question": question,
                     "answer_tokens": sc.rag_answer})  # fmt: skip
    return Workload("rag", rag, runs, sc.threads, True)


# -- agent -------------------------------------------------------------------------------------------

AGENT_SYSTEM = (
    "You are an agent with one tool, search(query), which returns documentation. Each turn, think briefly, "
    "then write Action: search[query] or Action: finish[answer]."
)


@function
def agent(s, task, observations, answer_tokens, pause=0.0):
    """``pause``: seconds each tool call takes, from when the step's action is read
    (benchmarks/bench_hints.py); 0 sends the same calls without reading or waiting."""
    s += system(AGENT_SYSTEM)
    s += user(f"Task: {task}")
    for i, observation in enumerate(observations):
        s += assistant(gen(f"step{i}", **_fixed(answer_tokens)))
        if pause:
            s[f"step{i}"]  # the action: the tool runs on it
            time.sleep(pause)
        s += user(f"Observation: {observation}")
    s += assistant(gen("final", **_fixed(answer_tokens)))


def make_agent(seed: int, sc: Scale) -> Workload:
    rng = random.Random(seed)
    runs = [
        {"task": passage(rng, 20, 40), "observations": [passage(rng, 60, 120) for _ in range(sc.agent_steps)],
         "answer_tokens": sc.agent_answer}
        for _ in range(sc.agents)
    ]  # fmt: skip
    return Workload("agent", agent, runs, min(sc.threads, sc.agents), False)


WORKLOADS = {"few_shot": make_few_shot, "multi_turn": make_multi_turn, "branching": make_branching,
             "rag": make_rag, "agent": make_agent}  # fmt: skip


def make(name: str, seed: int = 0, scale: Scale = FULL) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name](seed, scale)


def run(workload: Workload, backend: Backend, threads: int | None = None) -> list:
    """Run every program of the workload through the frontend; states in order."""
    return workload.program.run_batch(workload.runs, backend=backend, num_threads=threads or workload.threads)
