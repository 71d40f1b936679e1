"""Command line: ``radixkv serve | router | bench | demo | sim | kv-scales``.

    radixkv serve [--model M --port P ...]  the HTTP runtime (``radixkv serve --help``)
    radixkv bench [--scale small]           end-to-end workloads vs peers (source checkout)
    radixkv demo                         hit-rate simulation of the built-in workloads
    radixkv sim TRACE.jsonl [options]    replay your own trace, sweep capacities, plot
    radixkv sim --workload mixed         the same on a built-in workload (rag, agent: the bench's programs)
    radixkv sim ... --pool-bytes 1GiB,4GiB --kv-dtype fp32,int8   hit rate per KV format at fixed memory
    radixkv sim TRACE --what-if pool-bytes=64MiB,policy=lru --what-if pool-bytes=64MiB,kv-dtype=int8   side by side
    radixkv kv-scales --text FILE --out scales.json     fp8 KV scales measured on your text
    radixkv --version                    the installed package's version

Defaults come from ``SimConfig``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from radixkv.cache.policy import POLICIES


@dataclass(frozen=True)
class SimConfig:
    page_size: int = 16
    capacities: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8)  # fractions of the unique pages
    policies: tuple[str, ...] = tuple(POLICIES)
    in_flight: int = 1
    chunk_size: int = 512  # the engine's prefill chunk (sim.DEFAULT_CHUNK_SIZE); 0: whole prompts
    belady: bool = True
    out_dir: str = "out"


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"capacities must be > 0, got {text!r}")
    return values


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"page counts must be >= 1, got {text!r}")
    return values


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}  # fmt: skip


def _sizes(text: str) -> tuple[int, ...]:
    """Comma-separated byte sizes: ``1GiB,4GiB``, ``512MiB``, ``2e9``, ``1G`` (decimal)."""
    values = []
    for part in text.split(","):
        part = part.strip()
        number = part.rstrip("BbKkMmGgTtIi")
        unit = part[len(number) :].lower()
        if unit not in _UNITS:
            unit = unit.removesuffix("b")  # "B" (bytes), "GB" listed, "GiB" listed
        try:
            value = float(number) * _UNITS[unit]
        except (ValueError, KeyError):
            raise argparse.ArgumentTypeError(f"expected sizes like 1GiB,512MiB, got {part!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"sizes must be >= 1 byte, got {part!r}")
        values.append(int(value))
    return tuple(values)


def _kv_dtypes(text: str) -> tuple[str, ...]:
    from radixkv.cache.formats import kv_format

    try:
        return tuple(kv_format(name, "--kv-dtype").name for name in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _policies(text: str, offline: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Registered policy names, comma-separated; ``offline``: analysis-only names the
    simulator also takes."""
    names, known = tuple(text.split(",")), (*POLICIES, *offline)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {unknown[0]!r}; choose from {', '.join(known)}")
    return names


def _sim_policies(text: str) -> tuple[str, ...]:
    return _policies(text, ("return-oracle",))  # Belady runs on its own (--no-belady)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Version(argparse.Action):
    """``radixkv --version``: the package version alone on a line, exit 0 (looked up only
    when asked for)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from radixkv import package_version

        print(package_version())
        parser.exit()


PROGRAM_WORKLOADS = ("rag", "agent")  # radixkv.workloads programs, traced with the model's tokenizer
_PREFILL_TOK_S, _DECODE_TOK_S = 275.0, 13.5  # radixkv.cache.sim's defaults (a test keeps them equal)
_MAX_RUNNING = 64  # EngineConfig.max_running (a test keeps them equal)
_WHAT_IF_KEYS = ("name", "pool-bytes", "pages", "page-size", "policy", "kv-dtype", "host-pages", "store-pages",
                 "in-flight", "chunk-size")  # fmt: skip


def _what_if(text: str) -> dict:
    """``--what-if pool-bytes=64MiB,page-size=16,policy=lru``: the given keys, parsed."""
    convert = {"pool-bytes": lambda v: _sizes(v)[0], "page-size": _positive, "host-pages": _positive,
               "store-pages": _positive, "in-flight": _positive, "name": str,
               "pages": lambda v: None if v == "unlimited" else _positive(v),
               "policy": lambda v: v if v == "belady" else _policies(v)[0],  # one value: the spec was split on ","
               "kv-dtype": lambda v: _kv_dtypes(v)[0],
               "chunk-size": lambda v: _positive(v) if v != "0" else 0}  # fmt: skip
    out: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in _WHAT_IF_KEYS:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r}: expected KEY=VALUE with KEY one of "
                                             f"{', '.join(_WHAT_IF_KEYS)}")  # fmt: skip
        if key in out:
            raise argparse.ArgumentTypeError(f"{key!r} given twice in {text!r}")
        try:
            out[key] = convert[key](value.strip())
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{key} in {text!r}: {e}") from None
    if "pool-bytes" in out and "pages" in out:
        raise argparse.ArgumentTypeError(f"give pool-bytes or pages, not both, in {text!r}")
    out["_text"] = text
    return out


def build_parser() -> argparse.ArgumentParser:
    from radixkv.cache.traces import TRACE_FORMATS, WORKLOADS

    d = SimConfig()
    parser = argparse.ArgumentParser(prog="radixkv", description="radixkv: radix-tree prefix-cache LLM runtime")
    parser.add_argument("--version", action=_Version, help="print radixkv's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a multi-turn chat on the embedded model, then hit rate vs cache size")
    demo.add_argument("--out-dir", default=d.out_dir, help=f"where plots and JSON go (default {d.out_dir})")
    demo.add_argument("--no-model", action="store_true", help="skip the chat; only the cache simulation")

    serve = sub.add_parser(
        "serve", help="run the HTTP runtime (OpenAI-compatible and native API)",
        description="Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/models, /generate, "
        "/flush_cache, /metrics, /health. Every engine and server setting is a flag; defaults come from "
        "EngineConfig and ServerConfig.",
    )  # fmt: skip
    from radixkv.server.serve import add_arguments

    add_arguments(serve)
    from radixkv.server.serve import add_replica_arguments

    add_replica_arguments(serve)

    router = sub.add_parser(
        "router", help="a cache-aware router in front of radixkv replicas",
        description="One HTTP front (the replicas' routes) for N replicas: each request goes where its prompt is "
        "cached (the replicas' KV events; SGLang's approximate text tree for replicas without them), with health "
        "checks and retries.",
    )  # fmt: skip
    from radixkv.server.router import add_arguments as add_router_arguments

    add_router_arguments(router)

    bench = sub.add_parser(
        "bench", help="end-to-end benchmark: SGLang-paper workloads on radixkv (and its peers in a source checkout)",
        description="Runs the SGLang-paper workloads (a small scale by default: minutes, not hours) and prints "
        "per-workload throughput, TTFT and hit rates for radixkv and radixkv without its prefix cache; in a "
        "source checkout also HF transformers request by request, and llama.cpp's server when installed.",
    )  # fmt: skip
    bench.add_argument("--scale", choices=("tiny", "small", "full"), default="small", help="workload sizes (default small)")
    bench.add_argument("--workloads", help="comma-separated subset of few_shot,multi_turn,branching,rag,agent")
    bench.add_argument("--systems", help="comma-separated subset of radixkv,radixkv-no-cache,radixkv-bf16-kv,radixkv-act8,"
                                          "transformers,llama.cpp")
    bench.add_argument("--rounds", type=int, default=1,
                       help="run every system this many times, in reversed order every other round; the "
                            "throughput multiples are the median of the rounds' (default 1)")  # fmt: skip
    bench.add_argument("--out", default="benchmarks/out", help="where JSON and plots go (default benchmarks/out)")

    sim = sub.add_parser("sim", help="replay a trace against the prefix cache at several capacities")
    src = sim.add_mutually_exclusive_group(required=True)
    src.add_argument("trace", nargs="?",
                     help="JSONL trace, one request a line: {\"tokens\": [...]} or {\"text\": ...} or "
                          "{\"messages\": [...]}, optionally namespace, output_tokens, priority, arrival, session, "
                          "cached_tokens (radixkv.cache.traces); or a Mooncake trace (--trace-format)")  # fmt: skip
    src.add_argument("--workload", choices=sorted({*WORKLOADS, *PROGRAM_WORKLOADS}),
                     help="a built-in workload instead: synthetic token streams, or rag / agent (the programs "
                          "`radixkv bench` runs, with the model's tokenizer and chat template)")  # fmt: skip
    sim.add_argument("--trace-format", choices=TRACE_FORMATS, default="auto",
                     help="radixkv: the JSONL above; mooncake: Mooncake's {timestamp, input_length, output_length, "
                          "hash_ids} lines (each hash id a run of 512 synthetic token ids); auto (default): "
                          "mooncake when the first line has hash_ids")  # fmt: skip
    sim.add_argument("--seed", type=int, default=0, help="seed of the built-in workload (default 0)")
    sim.add_argument("--page-size", type=_positive, default=d.page_size, help=f"tokens per page (default {d.page_size})")
    cap = sim.add_mutually_exclusive_group()
    cap.add_argument(
        "--capacity", type=_floats, default=d.capacities,
        help="capacities as fractions of the trace's unique pages (default %(default)s)",
    )  # fmt: skip
    cap.add_argument("--capacity-pages", type=_ints, help="capacities in pages, e.g. 1000,4000")
    cap.add_argument("--pool-bytes", type=_sizes,
                     help="KV pool sizes in bytes, e.g. 1GiB,4GiB: pages per size follow from --kv-dtype and "
                          "--model's shape (no Belady reference in this mode)")  # fmt: skip
    sim.add_argument("--kv-dtype", type=_kv_dtypes, default=("fp32",),
                     help="with --pool-bytes: comma-separated KV formats to compare, e.g. fp32,int8 (default fp32)")
    sim.add_argument("--model", default=None,
                     help="the model whose tokenizer and chat template encode 'text' / 'messages' trace lines (as "
                          "the server does) and whose KV shape sizes a page for --pool-bytes (default: the "
                          "embedded model)")  # fmt: skip
    sim.add_argument(
        "--policy", type=_sim_policies, default=d.policies,
        help=f"comma-separated eviction policies (default {','.join(d.policies)}); return-oracle: the offline "
             f"LRU told only whether a leaf is ever used again (how much of the gap to Belady is that question)",
    )  # fmt: skip
    sim.add_argument("--no-belady", action="store_true", help="skip the offline Belady reference")
    sim.add_argument("--host-pages", type=_positive, default=None,
                     help="a host tier of this many pages below the pool (evictions demote there, matches promote "
                          "back); hit rates count both, and a 'from host' row says how much came from it")  # fmt: skip
    sim.add_argument("--store-pages", type=_positive, default=None,
                     help="a store of this many pages below those (written back as pages leave the tiers above); "
                          "a 'from store' row says what it served")  # fmt: skip
    sim.add_argument("--in-flight", type=_positive, default=None,
                     help="requests in flight at once (default 1; with arrival times, the engine's max_running: "
                          "%d)" % _MAX_RUNNING)  # fmt: skip
    sim.add_argument("--ignore-arrival", action="store_true",
                     help="replay a trace with arrival times in file order, one request after another as without "
                          "them; by default a timed trace runs in arrival order: a request is admitted at its "
                          "arrival or when one of --in-flight slots frees, and stays in flight for its uncached "
                          "prompt at --prefill-tok-s plus its outputs at --decode-tok-s")  # fmt: skip
    sim.add_argument("--what-if", action="append", type=_what_if, metavar="KEY=VALUE,...",
                     help="replay the trace under this configuration (repeat for several, side by side): keys "
                          "pool-bytes (e.g. 64MiB: pages from kv-dtype and --model), pages (or 'unlimited'), page-size, "
                          "policy, kv-dtype, host-pages, store-pages, in-flight, chunk-size, name; unset keys come "
                          "from the other flags. Prints per configuration the hit rate, prefill tokens saved and "
                          "the estimated prefill seconds saved")  # fmt: skip
    sim.add_argument("--prefill-tok-s", type=float, default=None,
                     help="prefill tokens/s for the time estimates (default %.0f: SmolLM2-135M fp32, a 2048-token "
                          "prompt, measured 2026-11-23 on a 2-core x86_64 AMD EPYC VM; measure yours: README)"
                          % _PREFILL_TOK_S)  # fmt: skip
    sim.add_argument("--decode-tok-s", type=float, default=None,
                     help="one sequence's decode tokens/s for timed traces (default %.1f, measured alike)"
                          % _DECODE_TOK_S)  # fmt: skip
    sim.add_argument("--chunk-size", type=int, default=d.chunk_size,
                     help=f"prefill chunk in tokens, as the engine's --chunked-prefill-size; 0: whole prompts "
                          f"(default {d.chunk_size})")  # fmt: skip
    sim.add_argument("--plot", help="write a PNG of hit rate vs capacity here")
    sim.add_argument("--json", help="write the full results as JSON here")
    sim.add_argument("--export-trace", help="write the (built-in) trace as JSONL here")

    scales = sub.add_parser("kv-scales", help="measure fp8 KV scales on a text file and write the scale file")
    scales.add_argument("--text", required=True, help="text to prefill (natural text like your prompts; UTF-8)")
    scales.add_argument("--out", required=True, help="where the JSON scale file goes (give it to serve --kv-scales)")
    scales.add_argument("--model", default=None, help="registry name, GGUF file or HF directory (default: embedded)")
    scales.add_argument("--kv-dtype", default="fp8_e4m3", choices=("fp8_e4m3", "fp8_e5m2"),
                        help="the fp8 format the scales are for (default fp8_e4m3)")  # fmt: skip
    scales.add_argument("--tokens", type=_positive, default=4096, help="use at most this many tokens (default 4096)")
    scales.add_argument("--headroom", type=float, default=1.0,
                        help="largest value seen maps to fp8's max / headroom (default 1.0: no margin)")  # fmt: skip
    return parser


def cmd_kv_scales(args) -> int:
    import json

    from radixkv.model import resolve_model
    from radixkv.model.kv_scales import calibrate
    from radixkv.model.loader import load_model
    from radixkv.model.tokenizer import Tokenizer

    text = Path(args.text).read_text(encoding="utf-8")
    source = resolve_model(args.model) if args.model else resolve_model()
    ids = Tokenizer.load(source).encode(text, add_special_tokens=False)[: args.tokens]
    result = calibrate(load_model(source.path), ids, args.kv_dtype, args.headroom)
    Path(args.out).write_text(json.dumps(result) + "\n")
    k, v = (max(max(row) for row in result[key]) for key in ("k_scale", "v_scale"))
    print(f"wrote {args.out}: {args.kv_dtype} scales from {result['tokens']} tokens (largest K {k:.4g}, V {v:.4g})")
    return 0


def cmd_sim(args) -> int:
    from radixkv.cache import sim, traces

    if args.trace:
        from radixkv.workloads.prompt_encoder import ModelPromptEncoder

        trace = traces.load_trace(args.trace, args.trace_format, ModelPromptEncoder(args.model))  # text: --model's
        title = Path(args.trace).name
    elif args.workload in PROGRAM_WORKLOADS:
        from radixkv import workloads

        trace = workloads.trace(workloads.make(args.workload, args.seed), args.model)
        title = f"{args.workload} program (seed {args.seed})"
    else:
        trace = traces.synthetic(args.workload, args.seed)
        title = f"{args.workload} (seed {args.seed})"
    if args.export_trace:
        traces.dump_jsonl(trace, args.export_trace)
    if args.chunk_size < 0:
        print("radixkv sim: --chunk-size must be >= 0", file=sys.stderr)
        return 2
    for flag in ("prefill_tok_s", "decode_tok_s"):
        if getattr(args, flag) is not None and not getattr(args, flag) > 0:
            print(f"radixkv sim: --{flag.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    arrivals = sim.timed(trace) and not args.ignore_arrival
    in_flight = args.in_flight or (_MAX_RUNNING if arrivals else SimConfig().in_flight)
    timing = {"arrivals": arrivals, "prefill_tok_s": args.prefill_tok_s or sim.DEFAULT_PREFILL_TOK_S,
              "decode_tok_s": args.decode_tok_s or sim.DEFAULT_DECODE_TOK_S}  # fmt: skip
    order = (f"in arrival order, up to {in_flight} in flight" if arrivals
             else f"in file order, {in_flight} in flight")  # fmt: skip
    if args.what_if:
        configs = [_what_if_config(w, args, in_flight) for w in args.what_if]
        result = sim.what_if(trace, configs, **timing)
        print(f"{title}: {len(trace)} requests {order}; prefill time at {timing['prefill_tok_s']:g} tok/s")
        print(sim.format_what_if(result))
        runs, explain = result["configs"], []
        sizes = {c.page_size for c in configs}
    else:
        if args.pool_bytes:  # a model that cannot be read, or a pool too small for a page: main's error exit
            per_page = _bytes_per_page(args.model, args.kv_dtype, args.page_size)
            result = sim.byte_sweep(trace, args.page_size, args.pool_bytes, per_page, args.policy, in_flight,
                                    chunk_size=args.chunk_size or None, host_pages=args.host_pages,
                                    store_pages=args.store_pages, **timing)  # fmt: skip
            table = sim.format_byte_table(result)
        else:
            result = sim.sweep(
                trace, args.page_size, args.policy, args.capacity, args.capacity_pages, in_flight,
                not args.no_belady, chunk_size=args.chunk_size or None, host_pages=args.host_pages,
                store_pages=args.store_pages, **timing,
            )  # fmt: skip
            table = sim.format_table(result)
        print(f"{title}: {len(trace)} requests {order}, {result['unique_pages']} unique pages of "
              f"{args.page_size} tokens")  # fmt: skip
        print(table)
        if "live" in result:
            live = result["live"]
            print(f"live run: {100 * live['hit_rate']:.2f}% of {live['prompt_tokens']:,} prompt tokens cached "
                  f"({live['requests']} requests reported)")  # fmt: skip
        runs, explain = result["runs"], sim.explain_identical(result)
        sizes = {args.page_size}
    for key in ("namespace", "session"):
        text = sim.format_breakdown(result, key)
        if text:
            print(f"\nby {key} (hit % of prompt tokens):\n{text}")
    for line in explain:
        print(line)
    notes = [w for size in sorted(sizes) for w in sim.warnings_for(trace, size, runs)]
    result["warnings"] = notes
    result["notes"] = explain
    for w in notes:
        print(f"radixkv sim: warning: {w}", file=sys.stderr)
    if args.json:
        sim.write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        if args.what_if:
            print("radixkv sim: --plot draws capacity sweeps; the what-if table has no plot", file=sys.stderr)
        else:
            sim.plot(result, args.plot, f"{title}, page size {args.page_size}")
            print(f"wrote {args.plot}")
    return 0


def _what_if_config(spec: dict, args, in_flight: int):
    """A ``--what-if`` spec with the unset keys from the other flags: pages from
    pool-bytes (kv-dtype's bytes per page of --model), else pages, else the first
    --pool-bytes / --capacity-pages, else unlimited."""
    from radixkv.cache.sim import WhatIf

    page_size = spec.get("page-size", args.page_size)
    kv_dtype = spec.get("kv-dtype", args.kv_dtype[0])
    pool_bytes = spec.get("pool-bytes")
    if pool_bytes is None and "pages" not in spec and args.pool_bytes:
        pool_bytes = args.pool_bytes[0]
    per_page = pages = None
    if pool_bytes is not None:
        per_page = _bytes_per_page(args.model, (kv_dtype,), page_size)[kv_dtype]
        pages = pool_bytes // per_page
        if pages < 1:
            raise ValueError(f"--what-if {spec['_text']!r}: {pool_bytes} bytes hold no page of {kv_dtype} "
                             f"({per_page} bytes per page)")  # fmt: skip
    elif "pages" in spec:
        pages = spec["pages"]
    elif args.capacity_pages:
        pages = args.capacity_pages[0]
    chunk = spec.get("chunk-size", args.chunk_size)
    return WhatIf(spec.get("name", spec["_text"]), pages, page_size, spec.get("policy", args.policy[0]),
                  spec.get("in-flight", in_flight), chunk or None, spec.get("host-pages", args.host_pages),
                  spec.get("store-pages", args.store_pages), kv_dtype, pool_bytes, per_page)  # fmt: skip


def _bytes_per_page(model: str | None, formats: tuple[str, ...], page_size: int) -> dict[str, int]:
    """Bytes of one page per KV format for ``model``'s KV shape (read from its metadata).
    Raises ValueError (ModelLoadError) or OSError when the model cannot be read."""
    from radixkv.cache.formats import kv_format
    from radixkv.model import resolve_model
    from radixkv.model.loader import load_config

    config = load_config(resolve_model(model) if model else resolve_model())
    shape = (config.num_layers, page_size, config.num_kv_heads, config.head_dim)
    return {name: kv_format(name).bytes_per_page(*shape) for name in formats}


def cmd_bench(args) -> int:
    from radixkv.workloads import bench

    argv = ["--scale", args.scale, "--out", args.out, "--rounds", str(args.rounds)]
    for flag in ("workloads", "systems"):
        if getattr(args, flag):
            argv += [f"--{flag}", getattr(args, flag)]
    root = Path(__file__).resolve().parent.parent
    if (root / "benchmarks" / "bench_e2e.py").exists():  # a source checkout: the peers too
        sys.path.insert(0, str(root))
        from benchmarks import bench_e2e

        return bench_e2e.main(argv)
    return bench.main(argv)


def cmd_serve(args) -> int:
    from radixkv.server.serve import configs, run, run_replicas

    if args.replicas != 1:
        return run_replicas(*configs(args), args.replicas)
    return run(*configs(args))


def cmd_router(args) -> int:
    from radixkv.server.router import config_from, run

    return run(config_from(args))


def cmd_demo(args) -> int:
    from radixkv.cache import sim, traces

    if not args.no_model:
        demo_chat()
    d = SimConfig()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print("radixkv demo: how much of each prompt the radix-tree prefix cache serves, by cache size")
    print("(hit rate in % of prompt tokens; columns are capacities in pages, as a share of unique pages)\n")
    for name in ("multi_turn", "few_shot", "branching"):
        trace = traces.synthetic(name)
        result = sim.sweep(trace, d.page_size, d.policies, d.capacities, None, d.in_flight, d.belady,
                           chunk_size=d.chunk_size or None)  # fmt: skip
        print(f"== {name}: {len(trace)} requests, page size {d.page_size}, {result['unique_pages']} unique pages")
        print(sim.format_table(result) + "\n")
        sim.write_json(result, out / f"demo_{name}.json")
        sim.plot(result, out / f"demo_{name}.png", f"{name}, page size {d.page_size}")
    print(f"plots and JSON in {out}/")
    return 0


DEMO_TURNS = [
    "In one sentence, what is a radix tree?",
    "Why does that help an LLM server reuse work between requests?",
]
DEMO_STYLES = ["a haiku", "a one-line joke", "advice for a beginner"]


def demo_program():
    """The demo: a 2-turn chat, then a fork into three branches that share it."""
    from radixkv.frontend import assistant, function, gen, system, user

    @function
    def demo(s, turns, styles):
        s += system("You are a helpful assistant. Answer briefly.")
        for i, question in enumerate(turns):
            s += user(question)
            s += assistant(gen(f"turn{i}", max_tokens=40, temperature=0))
        branches = s.fork(len(styles))
        for branch, style in zip(branches, styles):
            branch += user(f"Now say it as {style}.")
            branch += assistant(gen("take", max_tokens=32, temperature=0))
        branches.join()

    return demo


def demo_chat() -> None:
    """Run the demo program on the embedded model and show what the cache served."""
    import time

    from radixkv.frontend import EngineBackend
    from radixkv.frontend.report import calls_table

    print("radixkv demo: a chat program with SmolLM2-135M on this CPU (greedy): two turns, then three branches\n")
    t0 = time.perf_counter()
    backend = EngineBackend(attention_backend="torch", kv_cache_tokens=8192)
    print(f"(model loaded in {time.perf_counter() - t0:.1f} s)\n")
    try:
        state = demo_program().run(turns=DEMO_TURNS, styles=DEMO_STYLES, backend=backend)
    finally:
        backend.close()
    for i, question in enumerate(DEMO_TURNS):
        print(f"user: {question}\nassistant: {state[f'turn{i}'].strip()}\n")
    for style, take in zip(DEMO_STYLES, state["take"]):
        print(f"[branch: {style}] {take.strip()}")
    calls = state.all_calls()
    labels = [*(f"turn {i + 1}" for i in range(len(DEMO_TURNS))), "fork: shared prefix",
              *(f"branch: {style}" for style in DEMO_STYLES)]  # fmt: skip
    print("\nWhat each call sent, and how much of it the radix-tree prefix cache already held:\n")
    print(calls_table(calls, labels))
    print("\nLater turns and every branch reuse the conversation before them; only new tokens are computed.\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "router"):
        from radixkv.server.process import exit_with_parent

        exit_with_parent()  # started by launch (tests, benchmarks, --replicas): stop when the launcher is gone
    try:
        commands = {"sim": cmd_sim, "demo": cmd_demo, "serve": cmd_serve, "router": cmd_router, "bench": cmd_bench, "kv-scales": cmd_kv_scales}
        return commands[args.command](args)
    except (ValueError, OSError) as e:
        print(f"radixkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
