"""``radixkv serve``: flags for every EngineConfig and ServerConfig field, then uvicorn.

Flags are made from the two dataclasses, so a new setting gets a flag (and its
default) by being added there, plus one line of help in ``HELP``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import signal
import time

from radixkv.cache.events import FORMATS as EVENT_FORMATS
from radixkv.cache.formats import FORMATS
from radixkv.cache.tiers import WRITE_POLICIES
from radixkv.engine.config import KV_COMMIT, PARTIAL_PAGES, WEIGHTS, cpu_count
from radixkv.engine.engine import EngineConfig
from radixkv.kernels import BACKENDS
from radixkv.server.app import ServerConfig
from radixkv.validate import check_int

HELP = {
    "model": "registry name (see README), GGUF file or HF model directory",
    "page_size": "tokens per KV page",
    "kv_cache_tokens": "KV pool size in tokens (default: --kv-memory-share of the memory available)",
    "memory_bytes": "KV pool size in bytes, instead of --kv-cache-tokens",
    "kv_memory_share": "KV pool size as a share (0, 0.95] of the memory available once the weights are loaded "
                       "(default 0.25 when no size is given)",
    "kv_commit": "when the CPU pool's memory is committed: upfront (written once at start-up, as vLLM and llama.cpp "
                 "do, so no request pays a page's first write), lazy (as the cache first fills it: resident memory "
                 "only as used), auto: upfront for --kv-cache-tokens or --memory-bytes, lazy for a share",
    "device": "torch device: cpu, cuda, cuda:1 ...",
    "threads": "CPU threads for the model's kernels (torch's intra-op threads, which radixkv's C kernels take too); "
               "default: $OMP_NUM_THREADS, else the cores; with --replicas N each replica gets the cores / N (at "
               "least 1) unless this or $OMP_NUM_THREADS says otherwise",
    "dtype": "weights and activations dtype: float32, bfloat16, float16",
    "weights": "native: a quantized GGUF's blocks read as stored (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; "
               "on the CPU float32 activations rounded to 16-bit integers per block of 32; on CUDA float32, bfloat16 "
               "or float16, multiplied by a Triton kernel); fp32, bf16, fp16: expanded "
               "to that dtype (fp32 is the exact mode, token-equal to transformers); auto: native for a quantized "
               "GGUF on the CPU at tp 1, else --dtype",
    "activation_bits": "native weights on the CPU: bits their inputs are rounded to per block of 32: 16 (default), "
                       "or 8 as llama.cpp rounds them (Q4/Q5 types' prefill products 1.4-1.6x faster, logits further from "
                       "the exact mode; its KV never shares pages with 16's)",
    "kv_dtype": "KV cache format: auto (the weights' dtype), fp32, bf16, fp16, int8 (a scale byte per token and KV "
                "head: 0.254x fp32's bytes at head size 64), int4 (KIVI, quantized per page: 0.16x at page size 16), "
                "int4_norot, fp8_e4m3, fp8_e5m2 (0.25x; need --kv-scales)",
    "kv_scales": "fp8 KV only: a JSON scale file ({\"k_scale\": [...], \"v_scale\": [...]}, one entry per layer: a "
                 "number or one per KV head), or 'unity' (every scale 1); fp8 refuses to start without it",
    "host_cache_bytes": "a host tier below the KV pool, in bytes (RAM; evicted pages demote there, matches promote "
                        "them back); default none",
    "kv_store": "a KV page store below the pool: lmdb:PATH (local, persistent, shared by processes) or "
                "redis://HOST:PORT/DB (Redis/Valkey, shared across machines); secret for entry HMACs from "
                "$RADIXKV_KV_STORE_SECRET",
    "kv_store_bytes": "an LMDB store's size bound in bytes (least recently used out first); a Redis server bounds "
                      "itself (maxmemory, allkeys-lru)",
    "kv_store_write": "back: store pages as they leave the tiers above (eviction); through: as the tree takes them "
                      "(another process or a restart finds them at once)",
    "max_pinned_share": "the share of the KV pool that pins and TTLs (/pin, cache_control) may hold; a pin past it "
                        "is refused with an error naming the limit",
    "hint_ttl": "seconds a hint (a program's fork or next step) protects its prefix unless a request uses it first",
    "session_ttl": "seconds a finished request with a session_id keeps its prefix protected for the session's next "
                   "request (advice: given up under memory pressure)",
    "hint_hold": "seconds an idle engine keeps a waiting request out rather than give up hints and sessions whose "
                 "programs are about to come back; then they give way",
    "kv_events": "publish KV events (pages stored/removed per tier, vLLM's schema) on this ZMQ PUB endpoint for "
                 "KV-aware routers: tcp://127.0.0.1:PORT or ipc://PATH (loopback only: events carry token ids); "
                 "default none",
    "kv_events_replay": "with --kv-events: a ZMQ ROUTER endpoint that replays recent event batches to a "
                        "subscriber that missed them; default none",
    "kv_events_topic": "the topic frame of every event message",
    "kv_events_buffer": "event batches the replay socket keeps",
    "kv_events_format": "the events' wire form: array (each event a list of its fields by position: SGLang's, and "
                        "vLLM's before its events became maps) or map (each event a map of its fields by name, "
                        "tagged under type: vLLM's now)",
    "attention_backend": f"{', '.join(BACKENDS)} (auto: flashinfer or triton on CUDA, else cpu, else torch)",
    "policy": "prefix-cache eviction policy: lru, lfu, fifo, priority, cost (cost-aware, learned online)",
    "enable_prefix_cache": "reuse cached prompt prefixes (--no-enable-prefix-cache turns the cache off)",
    "partial_pages": "a cached prefix that ends inside a page: copy that page's leading tokens' KV into the "
                     "request's own page instead of computing them; auto (default): with the prefix cache at "
                     "--tp 1 and a --kv-dtype other than int4's (its pages are sealed whole); on requires that",
    "chunked_prefill_size": "longest prefill chunk in tokens; 0 prefills whole prompts",
    "max_batch_tokens": "token budget of one engine step (prefill chunks + decodes)",
    "max_running": "most requests in the running batch",
    "context_length": "tokens a sequence may span (prompt and output); default the model's trained context, at most "
                      "that (a kv_rerotate request bounds positions instead and may run past it)",
    "debug": "check pool and tree integrity whenever the engine goes idle",
    "tp": "tensor parallelism: ranks the model's heads and MLP are split across (gloo on the CPU, NCCL on CUDA); "
          "must divide the query and KV heads (1 or 3 for SmolLM2)",
    "host": "address to bind; loopback unless you mean to expose the server",
    "port": "TCP port",
    "api_key": "require 'Authorization: Bearer KEY' on every route but /health",
    "served_model_name": "the model name clients must send (default: --model)",
    "max_body_bytes": "largest request body accepted (413 above it)",
    "max_fanout": "most completions (prompts x n) one call may ask for (400 above it)",
    "cache_salt_header_only": "refuse a body cache_salt; only the X-Cache-Salt header (set by a gateway) picks the namespace",
    "graceful_shutdown_seconds": "on SIGINT/SIGTERM, how long in-flight requests may finish before they are aborted "
                                 "(each client still gets a JSON 503 or a final SSE error event)",
    "log_level": "uvicorn log level: critical, error, warning, info, debug",
    "allowed_origins": "CORS: origins (scheme://host[:port]) whose web pages may call the server, or '*' for any; "
                       "default none: no CORS headers",
    "allowed_methods": "CORS: methods a preflight may ask for ('*': those the server serves)",
    "allowed_headers": "CORS: request headers a preflight may ask for ('*': any, Authorization included)",
    "warmup": "before serving, run one prefill chunk of placeholder tokens through the model (discarded, nothing "
              "cached), so the first request pays no first-use costs; --no-warmup skips it",
    "stats_interval": "seconds between the stats lines in the log (throughput, running/waiting, hit rate, pool "
                      "usage); 0: none",
    "access_log": "FILE (appended) or '-' (stderr): one JSON line per request (time, method, path, status, "
                  "latency, tokens, request id; never the API key or a cache salt); default none",
    "record_trace": "write every finished request as a JSONL line that `radixkv sim` replays (prompt and output "
                    "ids, arrival, priority, cached tokens, the X-Session-Id header as session, the cache salt as "
                    "an opaque id, never the salt); default off",
    "record_trace_max_bytes": "with --record-trace: before the file would pass this size it is renamed FILE.1 "
                              "(replacing an older FILE.1) and a new FILE begins; default unbounded",
}
CHOICES = {"log_level": ("critical", "error", "warning", "info", "debug"), "dtype": ("float32", "bfloat16", "float16"),
           "weights": WEIGHTS, "kv_commit": KV_COMMIT, "partial_pages": PARTIAL_PAGES,
           "kv_dtype": ("auto", *FORMATS), "kv_store_write": WRITE_POLICIES,
           "kv_events_format": EVENT_FORMATS}  # fmt: skip
ZERO_IS_NONE = {"chunked_prefill_size"}
ANSWER_SECONDS = 5.0  # after the grace period: time for aborted requests' answers to go out


def _typed(kind: str, name: str):
    base = kind.replace(" | None", "")
    convert = {"int": int, "float": float, "str": str}[base]

    def parse(text: str):
        if text.lower() == "none" and "None" in kind:
            return None
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {base}, got {text!r}") from None
        if name in ZERO_IS_NONE and value == 0:
            return None
        return value

    parse.__name__ = base  # argparse names the type in its errors
    return parse


class _Given(argparse.Action):
    """Stores a flag's value and notes that the user typed it (``args._given``): a typed
    flag wins over $RADIXKV_* and the config file, a default does not."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _GivenBool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        _mark(namespace, self.dest)


def _mark(namespace: argparse.Namespace, dest: str) -> None:
    given = set(getattr(namespace, "_given", ()))
    given.add(dest)
    namespace._given = given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="settings from a TOML file (YAML with PyYAML installed), keys named as these flags "
                             "(kv_cache_tokens = 16384); precedence: flags > RADIXKV_* environment variables "
                             "(RADIXKV_PORT, RADIXKV_API_KEY, ...) > this file > defaults; default $RADIXKV_CONFIG")  # fmt: skip
    for group_name, cls in (("engine", EngineConfig), ("server", ServerConfig)):
        group = parser.add_argument_group(f"{group_name} ({cls.__name__})")
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            help_text = HELP[f.name] if "default" in HELP[f.name] else f"{HELP[f.name]} (default: {default})"
            if f.type == "bool":
                group.add_argument(flag, action=_GivenBool, default=default, help=help_text)
            elif f.type == "tuple[str, ...]":
                if "default" not in HELP[f.name]:
                    help_text = f"{HELP[f.name]} (default: {' '.join(default)})"
                group.add_argument(flag, nargs="+", action=_Given, default=default,
                                   metavar=f.name.upper().removesuffix("S"), help=help_text)  # fmt: skip
            else:
                group.add_argument(flag, action=_Given, type=_typed(f.type, f.name), default=default,
                                   choices=CHOICES.get(f.name), metavar=f.name.upper(), help=help_text)  # fmt: skip


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas")
    group.add_argument("--replicas", type=int, default=1, metavar="N",
                       help="start N replicas of this server (each on a free loopback port, publishing KV events) "
                            "and a cache-aware router (radixkv router) on --host/--port in front of them "
                            "(default: 1, no router)")  # fmt: skip


def configs(args: argparse.Namespace, environ=None) -> tuple[EngineConfig, ServerConfig]:
    """Both configs from parsed flags over $RADIXKV_* variables over ``--config FILE``
    over the defaults (radixkv.server.ops.layered); raises ValueError on a bad value or
    combination, or an unknown key in the file."""
    from radixkv.server.ops import layered

    given = {name: getattr(args, name) for name in getattr(args, "_given", ())}
    values, source = layered((EngineConfig, ServerConfig), given, getattr(args, "config", None), environ)
    for name, value in values.items():
        if name in ZERO_IS_NONE and value == 0:
            values[name] = None
        if source.get(name) in ("env", "file") and name in CHOICES and value not in CHOICES[name]:
            where = f"${'RADIXKV_' + name.upper()}" if source[name] == "env" else "the config file"
            raise ValueError(f"{name} (from {where}) must be one of {', '.join(CHOICES[name])}, got {value!r}")
    pick = lambda cls: {f.name: values[f.name] for f in dataclasses.fields(cls)}  # noqa: E731
    return EngineConfig(**pick(EngineConfig)), ServerConfig(**pick(ServerConfig))


_OWN = {"host", "port", "kv_events", "kv_events_replay", "api_key"}  # set per replica, or passed by environment


def replica_flags(engine_config: EngineConfig, server_config: ServerConfig) -> list[str]:
    """The flags that give a replica these settings (those not at their defaults), but
    the ones each replica gets its own value of (``_OWN``)."""
    out: list[str] = []
    for cfg in (engine_config, server_config):
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if f.name in _OWN or value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, tuple):
                out += [flag, *map(str, value)]
            else:
                out += [flag, "none" if value is None else str(value)]
    return out


def replica_threads(n: int, cpus: int | None = None) -> int:
    """Kernel threads for each of ``n`` replicas on ``cpus`` cores (default: this
    process's): the cores shared out, at least one each. With every replica at torch's
    default, n OpenMP teams of all the cores share them: a team's threads spin at each
    barrier while the thread they wait for is descheduled (README, "Replicas, KV events and
    the router")."""
    check_int("replicas", n, 1)
    return max(1, (cpus or cpu_count()) // n)


def shared_threads(threads: int | None, n: int, environ, cpus: int | None = None) -> list[str]:
    """The ``--threads`` flag each of ``n`` replicas gets when neither ``threads`` (the
    setting, which replica_flags passes on) nor ``$OMP_NUM_THREADS`` says: the cores
    shared out (``replica_threads``); else none."""
    if threads is not None or environ.get("OMP_NUM_THREADS"):
        return []
    return ["--threads", str(replica_threads(n, cpus))]


def run_replicas(engine_config: EngineConfig, server_config: ServerConfig, n: int) -> int:
    """``radixkv serve --replicas N``: N servers with these settings on free loopback ports,
    each publishing KV events (with a replay socket), then ``radixkv router`` on
    ``--host``/``--port`` in front of them until SIGINT/SIGTERM; the replicas stop with it."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from radixkv.server.process import free_port, launch, stop
    from radixkv.server.router import RouterConfig
    from radixkv.server.router import run as run_router

    if n < 1:
        raise ValueError(f"replicas must be >= 1, got {n}")
    logging.basicConfig(level=server_config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("radixkv.server")
    flags = replica_flags(engine_config, server_config) + shared_threads(engine_config.threads, n, os.environ)
    if server_config.api_key is not None:
        os.environ["RADIXKV_API_KEY"] = server_config.api_key  # to the children, never on their command lines

    def start(i: int):
        ev, replay = free_port(), free_port()
        cmd = [sys.executable, "-m", "radixkv", "serve", *flags, "--kv-events", f"tcp://127.0.0.1:{ev}",
               "--kv-events-replay", f"tcp://127.0.0.1:{replay}"]  # fmt: skip
        return launch(cmd, "/health", f"radixkv replica {i}", timeout=600)

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(start, i) for i in range(n)]
    procs = [f.result() for f in futures if f.exception() is None]  # stopped below, whatever else failed
    try:
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise failed
        for i, (_, url) in enumerate(procs):
            log.info("replica %d at %s", i, url)
        router = RouterConfig(replicas=tuple(url for _, url in procs), host=server_config.host,
                              port=server_config.port, model=engine_config.model, api_key=server_config.api_key,
                              log_level=server_config.log_level)  # fmt: skip
        return run_router(router)
    finally:
        for proc, _ in procs:
            stop(proc)


def run(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the model, serve until SIGINT/SIGTERM, shut down cleanly."""
    import uvicorn

    from radixkv.engine.engine import Engine
    from radixkv.server import ops
    from radixkv.server.app import Server

    logging.basicConfig(level=server_config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("radixkv.server")
    plan = ops.preflight(engine_config, server_config)  # one-line ValueErrors, before the weights load
    for warning in plan.warnings:
        log.warning("%s", warning)
    settings = {f.name: getattr(engine_config, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    started = time.perf_counter()
    engine = Engine(engine_config.model, **settings)
    engine.grammar.prepare()  # not in the first constrained request: it holds the GIL for ~0.5 s
    loaded = time.perf_counter() - started
    if server_config.warmup:  # before /health answers: the first request finds the engine warm
        warming = time.perf_counter()
        log.info("warm-up: %d tokens in %.2f s", engine.warm_up(), time.perf_counter() - warming)
    app = Server(engine, server_config)
    # What is built by now (model, tokenizer, grammar tables, the app) lives as long as the
    # process: frozen out of the collector's generations, its full passes walk only what
    # requests create (they were 1.8% of the server's CPU in a RAG run, 0.25% after)
    gc.collect()
    gc.freeze()
    for line in ops.summary(engine, plan, app.model_name, server_config.host, server_config.port, loaded):
        log.info("%s", line)
    stats = None
    if server_config.stats_interval:
        stats = ops.StatsLine(engine, app.metrics, server_config.stats_interval).start()
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # not on this platform
        loop = "asyncio"
    config = uvicorn.Config(
        app, host=server_config.host, port=server_config.port, loop=loop, lifespan="on",
        log_level=server_config.log_level, access_log=server_config.log_level == "debug",
        # the app aborts what still runs at graceful_shutdown_seconds and answers every
        # client; uvicorn's own deadline (it cancels handlers) comes after that
        timeout_graceful_shutdown=server_config.graceful_shutdown_seconds + ANSWER_SECONDS,
    )  # fmt: skip
    log.info("event loop: %s", loop)
    # On SIGINT/SIGTERM uvicorn stops accepting and waits for the in-flight requests;
    # the app (begin_shutdown) refuses new ones and aborts the rest after
    # graceful_shutdown_seconds, so each gets a well-formed answer; the lifespan shutdown
    # closes the engine. uvicorn then re-raises the signal to the handler that was there
    # before: make that a no-op, so a clean shutdown exits 0 instead of dying by the signal.
    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.begin_shutdown()
            super().handle_exit(sig, frame)

    previous = {sig: signal.signal(sig, _shutdown_done) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _Server(config).run()
    finally:
        if stats is not None:
            stats.stop()
        engine.close()
        app.close_access_log()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _shutdown_done(signum, frame) -> None:
    """Receives the signal uvicorn re-raises after its graceful shutdown."""
