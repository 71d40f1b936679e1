"""Engine benchmark: batched decode throughput, multi-turn chat TTFT with the prefix
cache on and off, and how the engine thread's step time splits.

Everything runs on the CPU in one process: SmolLM2-135M-Instruct in float32, the
engine's default attention backend (``auto``: on a CPU the ``cpu`` backend, whose C
kernel does the decode rows; ``--attention-backend torch`` for the reference), page
size 16, one engine at a time.

1. Batch-16 decode. 16 distinct seeded-random 128-token prompts go in together through
   ``Engine.generate`` (greedy, 64 new tokens, ``ignore_eos``); fresh prompts and an
   emptied cache each repeat, so nothing is a cache hit; median of 3 repeats. The 16 x 128
   prompt tokens are exactly one step's budget (``max_batch_tokens`` 2048), so the first
   step prefills them all and samples each one's first token (checked). The engine
   thread stamps the end of every step with its generated-token counter; decode tok/s
   is counted from the end of that first step to the end of the last: ``16 * 63``
   tokens over that wall time, which holds the decode steps and the engine loop
   between them. End-to-end tok/s (all ``16 * 64`` tokens over the wall time of the
   ``generate`` call, prefill included) is shown beside it. Peer: HF transformers'
   batched greedy loop on the same GGUF weights, measured as ``bench_model.py`` does
   (prefill the 16 prompts, then time the one-token steps; here 63 of them, as many as
   the engine's decode window), on the same prompts, right after each engine repeat
   (alternating, so that drift in this machine's speed hits both alike), after one
   untimed run.
2. Multi-turn chat. 16 conversations x 4 turns, run turn by turn: the 16 turn-k requests
   are streamed concurrently (``Engine.stream`` under ``asyncio.gather``); a request's TTFT
   is the time from opening its stream to its first chunk with a token. Every
   conversation opens with the same system message: an instruction and about
   ``system_tokens`` tokens of reference notes (whole paragraphs of stdlib module
   docstrings), the way an assistant over a document or an agent with a long tool
   description starts; ``--system-tokens 0`` drops it. Turn 1 is ``render_chat`` of that
   system message and one user message (a 40-80 token stdlib docstring); turn k+1 appends
   token ids to turn k's prompt: the answer, ``<|im_end|>`` if the answer did not end
   with it, and the template's text for the next user message, so consecutive turns
   share their prefix token for token. Answers are greedy, 16 tokens at most. Once with
   ``enable_prefix_cache=True``, once with ``False``; cached tokens per turn are the
   tree's ``hit_tokens`` counter difference over the turn.
3. Overhead split. Every engine gets timers on the engine thread's calls (perf_counter,
   exclusive time: a call's nested timed calls are charged to their own part):
   ``EngineLoop._step`` (the total), ``model.forward``, ``scheduler.schedule`` / ``advance`` /
   ``remove``, ``scheduler.build_batch``, ``sampler.sample`` and the tree's
   ``match_prefix`` / ``insert`` / ``evict`` / ``lock`` / ``unlock``. The rest of
   ``_step`` (appending tokens, detokenizing, streaming) is shown as its own part; calls
   outside a step (``flush_cache``) are not counted. The < 5% target is checked against
   scheduler + batch building + tree together. The timers stay on during parts 1
   and 2 (a few microseconds per step) and their sums are reported per workload. Every
   engine first runs one untimed batch of the part-1 shape.

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--attention-backend auto]
        [--json benchmarks/out/bench_engine.json]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import transformers_decode_seconds, write_result  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.sampling import SamplingParams  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402

TARGETS = {"decode_tok_s": 130, "ttft_off_on_turns_2_plus": 5.0, "tree_scheduler_pct": 5.0}
ENGINE = {"kv_cache_tokens": 16384, "page_size": 16}  # and --attention-backend (default auto)
DOC_MODULES = ("argparse", "collections", "functools", "inspect", "itertools", "json", "os", "pathlib",
               "shutil", "statistics", "string", "textwrap", "threading")  # fmt: skip
ASK = "Explain this in plain words: "
SYSTEM = "You answer questions about Python's standard library. Reference notes:\n\n"
NOTE_MODULES = ("argparse", "json", "statistics", "os", "inspect", "itertools", "collections", "string")
NEXT_USER = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # the chat template's text after an answer


@dataclass(frozen=True)
class Settings:
    batch: int = 16
    prompt_tokens: int = 128
    new_tokens: int = 64
    repeat: int = 3
    conversations: int = 16
    turns: int = 4
    answer_tokens: int = 16
    system_tokens: int = 1024


FULL = Settings()
QUICK = Settings(new_tokens=16, repeat=1, conversations=8, turns=3, system_tokens=256)


# -- timers on the engine thread -----------------------------------------------------

PARTS = {  # part -> (the loop's attribute, its methods)
    "model forward": ("model", ("forward",)),
    "scheduler": ("scheduler", ("schedule", "advance", "remove")),
    "batch building": ("scheduler", ("build_batch",)),
    "radix tree": ("tree", ("match_prefix", "insert", "evict", "lock", "unlock")),
    "sampling": ("sampler", ("sample",)),
}
REST = "rest of _step"
OVERHEAD = ("scheduler", "batch building", "radix tree")  # what the < 5% target covers


class StepProfiler:
    """Exclusive time per part of the loop's ``EngineLoop._step``, and a (time, generated
    tokens) mark at the end of every step. Install on an idle engine; read and ``reset``
    while it is idle."""

    def __init__(self, engine: Engine):
        self._open: list[float] = []  # per open timed call: time spent in its timed children
        loop = engine.loop  # in-process: the loop's objects are reachable
        for part, (attr, methods) in PARTS.items():
            owner = getattr(loop, attr)
            if owner is not None:  # no tree when the prefix cache is off
                for name in methods:
                    setattr(owner, name, self._timed(part, getattr(owner, name)))
        step = self._timed(REST, loop._step)

        def marked_step():
            step()
            self.marks.append((time.perf_counter(), loop.generated_tokens))

        loop._step = marked_step
        self.reset()

    def reset(self) -> None:
        self.exclusive = dict.fromkeys([*PARTS, REST], 0.0)
        self.marks: list[tuple[float, int]] = []

    def _timed(self, part: str, fn):
        def timed(*args, **kwargs):
            if part != REST and not self._open:  # outside a step: not counted
                return fn(*args, **kwargs)
            self._open.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                self.exclusive[part] += elapsed - self._open.pop()
                if self._open:
                    self._open[-1] += elapsed

        return timed

    def split(self) -> dict:
        total = sum(self.exclusive.values())
        return {
            "steps": len(self.marks),
            "step_seconds": total,
            "pct": {part: 100 * t / total for part, t in self.exclusive.items()},
        }


def start_engine(s: Settings, rng, **settings) -> tuple[Engine, StepProfiler]:
    """An engine with timers, warmed up by one untimed batch of the part-1 shape."""
    engine = Engine(**ENGINE, **settings)
    profiler = StepProfiler(engine)
    warmup = rng.integers(0, engine.vocab_size, (s.batch, s.prompt_tokens)).tolist()
    engine.generate(warmup, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    engine.flush_cache()
    profiler.reset()
    return engine, profiler


# -- 1. batch decode -------------------------------------------------------------------


def bench_decode(engine: Engine, profiler: StepProfiler, s: Settings, rng) -> dict:
    """Engine and transformers runs alternate on the same fresh prompts, ``s.repeat`` times;
    medians of each system's tok/s."""
    hf = load_transformers()
    shape = (s.batch, s.prompt_tokens)
    vocab = engine.vocab_size
    transformers_decode(hf, rng.integers(0, vocab, shape).tolist(), s.new_tokens - 1)  # warm-up
    runs = []
    for _ in range(s.repeat):
        prompts = rng.integers(0, vocab, shape).tolist()
        runs.append((*engine_decode(engine, profiler, s, prompts), transformers_decode(hf, prompts, s.new_tokens - 1)))
    decode, end_to_end, peer = (statistics.median(column) for column in zip(*runs))
    return {"radixkv": {"decode_tok_s": decode, "end_to_end_tok_s": end_to_end}, "transformers": {"decode_tok_s": peer}}


def engine_decode(engine: Engine, profiler: StepProfiler, s: Settings, prompts: list[list[int]]) -> tuple[float, float]:
    """One engine run from an empty cache: (decode tok/s, end-to-end tok/s)."""
    engine.flush_cache()
    before = engine.stats()["generated_tokens"]
    start = len(profiler.marks)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=s.new_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    # stats() runs on the engine thread between steps, so the last step's mark is in
    if engine.stats()["generated_tokens"] - before != s.batch * s.new_tokens:
        raise RuntimeError("a request stopped early")
    (t_first, n_first), *_, (t_last, n_last) = [(t, n - before) for t, n in profiler.marks[start:]]
    if n_first != s.batch:
        raise RuntimeError(f"the first step sampled {n_first} tokens, not one per prompt")
    return (n_last - n_first) / (t_last - t_first), s.batch * s.new_tokens / wall


def load_transformers():
    import transformers

    src = resolve_model()
    return transformers.AutoModelForCausalLM.from_pretrained(
        src.path.parent, gguf_file=src.path.name, dtype=torch.float32
    ).eval()


def transformers_decode(model, prompts: list[list[int]], steps: int) -> float:
    """tok/s of transformers' batched greedy loop, timed as ``bench_model.py`` does."""
    return len(prompts) * steps / transformers_decode_seconds(model, prompts, steps)


# -- 2. multi-turn chat ----------------------------------------------------------------


def user_messages(engine: Engine, count: int, rng) -> list[str]:
    """``count`` distinct user messages of 40-80 tokens, made of whole stdlib docstrings."""
    texts: set[str] = set()
    for module in map(__import__, DOC_MODULES):
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            doc = inspect.getdoc(obj) if callable(obj) and not name.startswith("_") else None
            if doc:
                text = ASK + " ".join(doc.split())
                if 40 <= len(engine.encode(text, add_special_tokens=False)) <= 80:
                    texts.add(text)
    pool = sorted(texts)
    return [pool[i] for i in rng.choice(len(pool), count, replace=False)]


def system_message(engine: Engine, tokens: int) -> list[dict]:
    """The shared system message: ``SYSTEM`` and whole docstring paragraphs of
    ``NOTE_MODULES`` until about ``tokens`` tokens (none when ``tokens`` is 0)."""
    if tokens <= 0:
        return []
    text = SYSTEM
    paragraphs = [p for m in NOTE_MODULES for p in inspect.getdoc(__import__(m)).split("\n\n")]
    for paragraph in paragraphs:
        if len(engine.encode(text, add_special_tokens=False)) >= tokens:
            break
        text += paragraph + "\n\n"
    return [{"role": "system", "content": text.strip()}]


async def stream_turn(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Stream all prompts at once; per prompt: (TTFT in seconds, answer token ids)."""

    async def one(prompt):
        ttft, ids = None, []
        t0 = time.perf_counter()
        async for chunk in engine.stream(prompt, params):
            if ttft is None and chunk.token_ids:
                ttft = time.perf_counter() - t0
            ids += chunk.token_ids
        return ttft, ids

    return await asyncio.gather(*(one(p) for p in prompts))


def bench_chat(engine: Engine, messages: list[list[str]], s: Settings) -> list[dict]:
    """Run the conversations turn by turn; per turn: TTFTs, prompt and cached tokens, answers."""
    params = SamplingParams(temperature=0, max_new_tokens=s.answer_tokens)
    system = system_message(engine, s.system_tokens)
    prompts = [
        engine.encode(engine.render_chat([*system, {"role": "user", "content": conv[0]}])) for conv in messages
    ]
    turns = []
    for k in range(s.turns):
        hits = _hit_tokens(engine)
        results = asyncio.run(stream_turn(engine, prompts, params))
        turns.append({
            "ttft": [t for t, _ in results],
            "prompt_tokens": sum(map(len, prompts)),
            "cached_tokens": _hit_tokens(engine) - hits,
            "answers": [ids for _, ids in results],
        })  # fmt: skip
        if k + 1 < s.turns:
            answers = [ids for _, ids in results]
            prompts = [next_prompt(engine, p, a, conv[k + 1]) for p, a, conv in zip(prompts, answers, messages)]
    return turns


def next_prompt(engine: Engine, prompt: list[int], answer: list[int], message: str) -> list[int]:
    """The next turn's prompt: this one, the answer, ``<|im_end|>`` unless the answer
    ended with it, and the template's text for the next user message."""
    end = engine.encode("<|im_end|>", add_special_tokens=False)
    close = [] if answer[-len(end) :] == end else end
    return prompt + answer + close + engine.encode(NEXT_USER.format(message), add_special_tokens=False)


def _hit_tokens(engine: Engine) -> int:
    cache = engine.stats()["cache"]
    return cache["hit_tokens"] if cache else 0


# -- report ------------------------------------------------------------------------------


def p90(xs) -> float:
    return float(np.percentile(xs, 90))


def report_decode(s: Settings, decode: dict) -> None:
    ours, hf = decode["radixkv"], decode["transformers"]["decode_tok_s"]
    print(f"\n1. Batch-{s.batch} greedy decode, {s.prompt_tokens}-token prompts, {s.new_tokens} new tokens, "
          f"median of {s.repeat}")  # fmt: skip
    print(f"{'system':<30}{'decode tok/s':>14}{'end-to-end tok/s':>18}")
    print(f"{'radixkv Engine':<30}{ours['decode_tok_s']:>14.1f}{ours['end_to_end_tok_s']:>18.1f}")
    print(f"{'transformers (greedy loop)':<30}{hf:>14.1f}{'-':>18}")
    print(f"{'target':<30}{TARGETS['decode_tok_s']:>14}")
    print(f"{'ratio radixkv / transformers':<30}{ours['decode_tok_s'] / hf:>13.2f}x")


def report_chat(s: Settings, chat: dict) -> tuple[list[dict], float, bool]:
    """Print the TTFT table; return its rows, mean TTFT off/on over turns 2+, and whether
    the answers were identical with the cache on and off."""
    print(f"\n2. Multi-turn chat TTFT: {s.conversations} conversations x {s.turns} turns, each turn's "
          f"{s.conversations} requests streamed together, greedy answers <= {s.answer_tokens} tokens, "
          f"shared system message of ~{s.system_tokens} tokens")  # fmt: skip
    print(f"{'':<5}{'prompt':>8}{'new':>6}{'cached':>8}{'TTFT on, s':>17}{'TTFT off, s':>17}{'off/on':>17}")
    print(f"{'turn':<5}{'tok':>8}{'tok':>6}{'%':>8}" + f"{'median    p90':>17}" * 3)
    rows = []
    for k, (on, off) in enumerate(zip(chat["on"], chat["off"]), 1):
        row = {
            "turn": k,
            "prompt_tokens_mean": on["prompt_tokens"] / s.conversations,
            "uncached_tokens_mean": (on["prompt_tokens"] - on["cached_tokens"]) / s.conversations,
            "cached_pct": 100 * on["cached_tokens"] / on["prompt_tokens"],
            "ttft_on": {"median": statistics.median(on["ttft"]), "p90": p90(on["ttft"])},
            "ttft_off": {"median": statistics.median(off["ttft"]), "p90": p90(off["ttft"])},
        }
        row["off_on"] = {q: row["ttft_off"][q] / row["ttft_on"][q] for q in ("median", "p90")}
        rows.append(row)
        print(f"{k:<5}{row['prompt_tokens_mean']:>8.0f}{row['uncached_tokens_mean']:>6.0f}{row['cached_pct']:>8.1f}"
              f"{row['ttft_on']['median']:>10.3f}{row['ttft_on']['p90']:>7.3f}"
              f"{row['ttft_off']['median']:>10.3f}{row['ttft_off']['p90']:>7.3f}"
              f"{row['off_on']['median']:>9.2f}x{row['off_on']['p90']:>6.2f}x")  # fmt: skip
    later = {mode: statistics.mean(t for turn in chat[mode][1:] for t in turn["ttft"]) for mode in ("on", "off")}
    ratio = later["off"] / later["on"]
    same = all(a["answers"] == b["answers"] for a, b in zip(chat["on"], chat["off"]))
    print(f"turns 2-{s.turns}: mean TTFT off/on {ratio:.2f}x, target >= "
          f"{TARGETS['ttft_off_on_turns_2_plus']:.0f}x; answers identical on/off: "
          f"{'yes' if same else 'no'}")  # fmt: skip
    print("(new tok: prompt tokens not served from the cache with it on; cached %: of all prompt tokens)")
    print("prompt/new tokens per turn (off/on if TTFT scaled with prefilled tokens): "
          + "  ".join(f"{r['prompt_tokens_mean'] / r['uncached_tokens_mean']:.2f}" for r in rows))
    return rows, ratio, same


def report_split(split: dict) -> dict:
    """Print the step-time table; return tree + scheduler + batch building % per workload."""
    print("\n3. Engine step time split (exclusive time on the engine thread, % of _step)")
    print(f"{'part':<18}" + "".join(f"{name:>18}" for name in split))
    for part in [*PARTS, REST]:
        print(f"{part:<18}" + "".join(f"{v['pct'][part]:>17.2f}%" for v in split.values()))
    overhead = {name: sum(v["pct"][part] for part in OVERHEAD) for name, v in split.items()}
    print(f"{'tree+sched+batch':<18}" + "".join(f"{v:>17.2f}%" for v in overhead.values())
          + f"   target < {TARGETS['tree_scheduler_pct']:.0f}%")  # fmt: skip
    print(f"{'steps':<18}" + "".join(f"{v['steps']:>18}" for v in split.values()))
    print(f"{'mean step ms':<18}" + "".join(f"{1000 * v['step_seconds'] / v['steps']:>18.1f}" for v in split.values()))
    return overhead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens, turns and repeats")
    ap.add_argument("--json", default="benchmarks/out/bench_engine.json")
    ap.add_argument("--system-tokens", type=int, help="length of the chat's shared system message (0: none)")
    ap.add_argument("--attention-backend", default="auto", help="auto, cpu or torch")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    s = QUICK if args.quick else FULL
    if args.system_tokens is not None:
        s = replace(s, system_tokens=args.system_tokens)
    rng = np.random.default_rng(0)

    engine, profiler = start_engine(s, rng, enable_prefix_cache=True, attention_backend=args.attention_backend)
    backend = engine.backend.name
    texts = user_messages(engine, s.conversations * s.turns, rng)
    messages = [texts[i * s.turns : (i + 1) * s.turns] for i in range(s.conversations)]
    decode = bench_decode(engine, profiler, s, rng)
    split = {"decode": profiler.split()}
    engine.flush_cache()
    profiler.reset()
    chat = {"on": bench_chat(engine, messages, s)}
    split["chat, cache on"] = profiler.split()
    engine.close()
    engine, profiler = start_engine(s, rng, enable_prefix_cache=False, attention_backend=args.attention_backend)
    chat["off"] = bench_chat(engine, messages, s)
    split["chat, cache off"] = profiler.split()
    engine.close()

    print(f"SmolLM2-135M float32, CPU ({torch.get_num_threads()} threads), {backend} attention backend, page size 16")
    report_decode(s, decode)
    rows_chat, ratio, same = report_chat(s, chat)
    overhead = report_split(split)

    write_result(
        args.json,
        {
            "decode": decode,
            "chat": {"turns": rows_chat, "turns_2_plus_mean_ttft_off_on": ratio, "answers_identical": same},
            "step_split": {name: {**v, "tree_scheduler_batch_pct": overhead[name]} for name, v in split.items()},
        },
        torch=torch.__version__, threads=torch.get_num_threads(), engine={**ENGINE, "backend": backend},
        settings=asdict(s), targets=TARGETS,
    )  # fmt: skip


if __name__ == "__main__":
    main()
