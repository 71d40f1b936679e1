"""Program hints under memory pressure: agent and branching programs
(``radixkv.workloads.programs``) on the embedded model, in process, with a KV pool sized
for about two programs' working sets, the frontend's cache advice on (sessions for each
program's next step, fork hints; radixkv.cache.pins) against plain LRU without it.

The programs pause between steps as real ones do (``--pause``: an agent's tool call,
scoring a tree's level before expanding it), and their documents are long (agent
observations of 250-400 words, branching problems of 400-600), the case the advice is
for: a lost prefix costs a long recompute. With the workloads' own short texts and no
pause, LRU already keeps nearly every reusable prefix (the next step comes within
milliseconds) and there is nothing for advice to win.

A program's working set is the union of the whole pages its requests touch (prompts and
outputs), computed without a model by replaying it through the model's tokenizer and chat
template (``RecordingBackend``, placeholder outputs of the same lengths). The pool holds
``--pool-sets`` (2) times the largest one. Both modes run on one engine per workload, the
cache flushed before each run, alternating off/on ``--repeats`` times; reported per mode:
wall seconds, output tokens/s (gen tokens / wall), prompt-cache hit rate, evicted pages,
preemptions, and whether every program's text equals the other mode's (greedy, so it
must). The target: hints >= 1.5x LRU's throughput on both workloads.

    .venv/bin/python benchmarks/bench_hints.py [--agents 6 --agent-steps 4 --trees 12 --pause 1 ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import replace

from radixkv.workloads import programs as PR
from radixkv.workloads.bench import _program_text, warm_up, write_result

TARGET = 1.5


def make_workload(name: str, seed: int, scale: PR.Scale, pause: float,
                  words: tuple[int, int] | None = None) -> PR.Workload:  # fmt: skip
    """The workload's runs with ``pause`` (programs.agent and programs.branching take it:
    an agent's tool call, scoring a tree's level); ``words``: the length of each agent
    observation or branching problem instead of the workload's own (long tool outputs
    and documents, where a lost prefix costs most)."""
    base = PR.make(name, seed, scale)
    runs = [{**r, "pause": pause} for r in base.runs]
    if words is not None:
        rng = random.Random(seed + 1)
        for r in runs:
            if name == "agent":
                r["observations"] = [PR.passage(rng, *words) for _ in r["observations"]]
            else:
                r["problem"] = PR.passage(rng, *words)
    return replace(base, runs=runs)


def working_set_pages(workload: PR.Workload, page_size: int) -> list[int]:
    """Per program run: the distinct whole pages its requests' prompts and outputs fill
    (page-aligned prefixes, as the radix tree keys them), from a model-free replay."""
    from array import array

    from radixkv.model import resolve_model
    from radixkv.model.chat_template import ChatTemplate
    from radixkv.model.tokenizer import Tokenizer
    from radixkv.workloads.recorder import RecordingBackend

    tok = Tokenizer.load(resolve_model())
    out = []
    for run in workload.runs:
        backend = RecordingBackend(tok, ChatTemplate.from_tokenizer(tok))
        workload.program.run_batch([{**run, "pause": 0.0}], backend=backend, num_threads=1)
        prefixes = set()
        for r in backend.requests:
            seq = array("i", r["tokens"] + r["output_tokens"][:-1]).tobytes()  # the last token is never computed
            width = 4 * page_size
            prefixes.update(seq[:end] for end in range(width, len(seq) + 1, width))
        out.append(len(prefixes))
    return out


def run_mode(engine, workload: PR.Workload, hints: bool) -> dict:
    from radixkv.frontend import EngineBackend

    engine.flush_cache()
    before = engine.stats()
    backend = EngineBackend(engine, hints=hints)
    t0 = time.perf_counter()
    states = PR.run(workload, backend)
    wall = time.perf_counter() - t0
    after = engine.stats()
    engine.check_integrity()
    calls = [c for s in states for c in s.all_calls()]
    gen_tokens = sum(c.completion_tokens for c in calls if c.kind == "gen")
    prompt, cached = sum(c.prompt_tokens for c in calls), sum(c.cached_tokens for c in calls)
    return {
        "hints": hints, "wall_s": wall, "output_tokens": gen_tokens, "tok_s": gen_tokens / wall,
        "requests": len(calls), "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / max(prompt, 1),
        "evicted_pages": after["cache"]["evicted_pages"] - before["cache"]["evicted_pages"],
        "preemptions": after["preemptions"] - before["preemptions"],
        **{k: after["pins"][k] - before["pins"][k] for k in ("hints_used", "hints_dropped", "expired")},
        "left_protected": len(engine.pins()), "texts": [_program_text(s) for s in states],
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="agent,branching")
    ap.add_argument("--agents", type=int, default=6)
    ap.add_argument("--agent-steps", type=int, default=4)
    ap.add_argument("--agent-answer", type=int, default=16)
    ap.add_argument("--trees", type=int, default=12)
    ap.add_argument("--branch-answer", type=int, default=16)
    ap.add_argument("--pool-sets", type=float, default=2.0, help="the pool, in largest programs' working sets")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds a program spends between steps (an agent's tool call, scoring a tree's level)")
    ap.add_argument("--observation-words", default="250,400",
                    help="MIN,MAX words of each agent observation (a tool's output); 'workload': the workload's own")
    ap.add_argument("--problem-words", default="400,600",
                    help="MIN,MAX words of each branching problem (a document); 'workload': the workload's own")
    ap.add_argument("--hint-hold", type=float, default=None, help="the engine's hint_hold (default: EngineConfig's)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/out/bench_hints.json")
    args = ap.parse_args(argv)

    from radixkv import Engine
    from radixkv.frontend import EngineBackend

    scale = replace(PR.SMALL, agents=args.agents, agent_steps=args.agent_steps, agent_answer=args.agent_answer,
                    trees=args.trees, branch_answer=args.branch_answer, threads=max(args.agents, args.trees))  # fmt: skip
    rows, summary = [], {}
    for name in args.workloads.split(","):
        spec = args.observation_words if name == "agent" else args.problem_words
        words = None if spec == "workload" else tuple(int(w) for w in spec.split(","))
        workload = make_workload(name, args.seed, scale, args.pause, words)
        sets = working_set_pages(workload, args.page_size)
        pool_pages = int(args.pool_sets * max(sets))
        print(f"\n== {name}: {len(workload.runs)} programs, {workload.threads} at a time; working sets "
              f"{min(sets)}-{max(sets)} pages (sum {sum(sets)}); pool {pool_pages} pages of {args.page_size}")
        hold = {} if args.hint_hold is None else {"hint_hold": args.hint_hold}
        engine = Engine(attention_backend=args.attention_backend, device=args.device, page_size=args.page_size,
                        kv_cache_tokens=pool_pages * args.page_size, **hold)  # fmt: skip
        try:
            warm_up(EngineBackend(engine))
            results = {False: [], True: []}
            for _ in range(args.repeats):
                for hints in (False, True):
                    r = run_mode(engine, workload, hints)
                    results[hints].append(r)
                    print(f"  {'hints' if hints else 'LRU  '}  wall {r['wall_s']:6.1f} s  {r['tok_s']:6.1f} tok/s  "
                          f"hit {100 * r['hit_rate']:5.1f}%  evicted {r['evicted_pages']:5d} pages  "
                          f"preemptions {r['preemptions']:3d}  hints used/dropped {r['hints_used']}/"
                          f"{r['hints_dropped']}  left protected {r['left_protected']}")  # fmt: skip
        finally:
            engine.close()
        off, on = results[False], results[True]
        same = all(r["texts"] == off[0]["texts"] for r in off + on)
        ratio = statistics.median(r["tok_s"] for r in on) / statistics.median(r["tok_s"] for r in off)
        summary[name] = {"ratio": ratio, "same_texts": same, "pool_pages": pool_pages, "working_sets": sets}
        print(f"  throughput with hints: {ratio:.2f}x LRU (target {TARGET}x); same texts: {same}")
        for r in off + on:
            rows.append({"workload": name, **{k: v for k, v in r.items() if k != "texts"}})
    write_result(args.out, rows, summary=summary, args=vars(args))
    return 0 if all(s["same_texts"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
