"""Operating ``radixkv serve``: settings from a config file and the environment, checks
before the model loads, the start-up summary, the periodic stats line and the access log.

Settings come in layers, each overriding the one before it:

    defaults (EngineConfig, ServerConfig) < --config FILE < RADIXKV_* variables < flags

A config file (TOML; YAML when PyYAML is installed) holds the flags' fields by name
(``kv_cache_tokens = 16384`` or ``kv-cache-tokens = 16384``); an unknown key is an error
that names it. ``RADIXKV_<FIELD>`` (``RADIXKV_PORT=8000``, ``RADIXKV_API_KEY=...``) sets
one field; ``RADIXKV_CONFIG`` names a config file when ``--config`` is not given.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger("radixkv.server")
ENV_PREFIX = "RADIXKV_"
ENV_NOT_SETTINGS = {"RADIXKV_KV_STORE_SECRET", "RADIXKV_CONFIG"}  # secrets and pointers, not fields
TRUE, FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}

# The access-log record of the request being answered (set by the app for each request;
# Metrics.finished adds the token counts of what the request generated).
CURRENT = contextvars.ContextVar("radixkv_request_record", default=None)


# -- layered settings ------------------------------------------------------------------------


def read_config_file(path: str | os.PathLike) -> dict:
    """The settings of a TOML (or, with PyYAML installed, YAML) file as a flat dict.
    Raises ValueError naming the file for one that is missing or malformed."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ValueError(f"config file {str(p)!r} cannot be read: {e.strerror or e}") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"config file {str(p)!r} is YAML: install PyYAML (pip install pyyaml), or write it "
                             "as TOML") from None  # fmt: skip
        try:
            data = yaml.safe_load(raw) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {str(p)!r} is not valid YAML: {e}".replace("\n", " ")) from None
    else:
        import tomllib

        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(p)!r} must hold a table of settings, got {type(data).__name__}")
    return data


def _convert(field: dataclasses.Field, value, where: str):
    """``value`` (a string from the environment, or a file's typed value) as the field's type."""
    kind = field.type
    name = field.name
    if isinstance(value, str):
        text = value.strip()
        if kind == "bool":
            if text.lower() in TRUE:
                return True
            if text.lower() in FALSE:
                return False
            raise ValueError(f"{where}: {name} must be true or false, got {value!r}")
        if kind == "tuple[str, ...]":
            return tuple(v for v in text.replace(",", " ").split() if v)
        if "None" in kind and text.lower() in ("none", ""):
            return None
        base = kind.replace(" | None", "")
        try:
            return {"int": int, "float": float, "str": str}[base](text)
        except ValueError:
            raise ValueError(f"{where}: {name} must be {'an' if base == 'int' else 'a'} {base}, got {value!r}") from None
    ok = {
        "bool": isinstance(value, bool),
        "tuple[str, ...]": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": False,
    }
    base = kind.replace(" | None", "")
    if ok.get(kind, ok.get(base, False)):
        return tuple(value) if kind == "tuple[str, ...]" else (float(value) if base == "float" else value)
    raise ValueError(f"{where}: {name} must be {kind}, got {value!r} ({type(value).__name__})")


def layered(classes, given: dict, config_path: str | None, environ=None) -> tuple[dict, dict]:
    """The settings of ``classes``' fields: defaults, then the config file, then
    ``RADIXKV_*`` variables, then ``given`` (flags the user typed). Returns (settings,
    source of each non-default one: "file", "env" or "flag"). Raises ValueError for an
    unknown key in the file, or a value of the wrong type."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for cls in classes for f in dataclasses.fields(cls)}
    values = {name: f.default for name, f in fields.items()}
    source: dict[str, str] = {}
    path = config_path if config_path is not None else environ.get(ENV_PREFIX + "CONFIG") or None
    if path is not None:
        data = read_config_file(path)
        names = {k: k.replace("-", "_") for k in data}
        unknown = sorted(k for k, n in names.items() if n not in fields)
        if unknown:
            raise ValueError(f"config file {path!r}: unknown setting{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(unknown)} (the fields are the flags' names: radixkv serve --help)")  # fmt: skip
        for key, name in names.items():
            values[name] = _convert(fields[name], data[key], f"config file {path!r}")
            source[name] = "file"
    for key, text in environ.items():
        if not key.startswith(ENV_PREFIX) or key in ENV_NOT_SETTINGS:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name in fields:
            values[name] = _convert(fields[name], text, key)
            source[name] = "env"
    for name, value in given.items():
        if name in fields:
            values[name] = value
            source[name] = "flag"
    return values, source


# -- checks before the model loads -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What start-up will build, known before the weights are read."""

    model_path: str
    num_layers: int
    max_context: int
    pool_pages: int
    page_size: int
    bytes_per_page: int
    warnings: tuple[str, ...]

    @property
    def pool_tokens(self) -> int:
        return self.pool_pages * self.page_size


def check_device(device: str) -> None:
    """ValueError unless torch can place tensors on ``device`` here."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}, "
                             f"{'no CUDA build' if torch.version.cuda is None else 'no GPU visible'}); use --device cpu")  # fmt: skip
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"--device {device}: this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})")
        return
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu")
        return
    raise ValueError(f"--device {device}: radixkv runs on cpu, cuda or mps, not {dev.type}")


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def preflight(engine_config, server_config) -> Plan:
    """Check what can be checked before the weights load (seconds): the model file, the
    device, names (backend, policy), files, the port and the pool's size. Raises
    ValueError with a one-line message; returns the Plan (its warnings included)."""
    from radixkv.cache.policy import POLICIES
    from radixkv.cache.pool import available_memory
    from radixkv.kernels import BACKENDS
    from radixkv.model.loader import load_config
    from radixkv.model.registry import resolve_model
    from radixkv.validate import ceil_div

    e, s = engine_config, server_config
    if not 0 <= s.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {s.port}")
    if not s.host:
        raise ValueError("--host must not be empty")
    if s.api_key is not None and not s.api_key.strip():
        raise ValueError("--api-key must not be empty")
    if e.attention_backend not in BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {e.attention_backend!r}")
    if e.policy not in POLICIES:
        raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {e.policy!r}")
    if e.kv_scales not in (None, "unity") and not Path(e.kv_scales).is_file():
        raise ValueError(f"--kv-scales {e.kv_scales!r}: no such file")
    check_device(e.device)
    source = resolve_model(e.model)  # ModelLoadError (a ValueError) for a missing file
    try:
        mc = load_config(source)
    except OSError as ex:
        raise ValueError(f"model {str(source.path)!r} cannot be read: {ex}") from None
    except (KeyError, IndexError, struct.error) as ex:
        raise ValueError(f"model {str(source.path)!r} is not a readable model file: {ex!r}") from None
    if e.context_length is not None and e.context_length > mc.max_position_embeddings:
        raise ValueError(f"--context-length {e.context_length} is past the model's trained context "
                         f"({mc.max_position_embeddings} positions)")  # fmt: skip
    per_page = e.kv_format.bytes_per_page(mc.num_layers, e.page_size, mc.num_kv_heads, mc.head_dim)
    if e.kv_cache_tokens is not None:
        pages = ceil_div(e.kv_cache_tokens, e.page_size)
    else:  # a share is of what the weights leave: estimated here from what is available before they load
        budget = e.kv_pool_bytes(available_memory(e.device))
        if budget < per_page:
            given = f"--kv-memory-share {e.kv_share} ({_size(budget)})" if e.kv_share else f"--memory-bytes {budget}"
            raise ValueError(f"{given} does not hold one KV page ({per_page} bytes at page size {e.page_size})")
        from radixkv.cache.pool import MAX_PAGES

        pages = min(budget // per_page, MAX_PAGES)
    total = pages * per_page
    ram = _memory_bytes()
    if e.device == "cpu" and ram is not None and total > ram:
        raise ValueError(f"the KV pool would take {_size(total)} ({pages} pages of {_size(per_page)}), more than this "
                         f"machine's {_size(ram)} of memory: lower --kv-cache-tokens or --memory-bytes")  # fmt: skip
    max_context = e.context_length or mc.max_position_embeddings
    warnings = []
    if pages * e.page_size < max_context:
        warnings.append(f"the KV pool holds {pages * e.page_size} tokens, less than one full context "
                        f"({max_context} tokens): longer prompts are refused (raise --kv-cache-tokens, or lower "
                        f"--context-length)")  # fmt: skip
    if s.access_log not in (None, "-"):
        try:
            with open(s.access_log, "a"):
                pass
        except OSError as ex:
            raise ValueError(f"--access-log {s.access_log!r} cannot be written: {ex.strerror or ex}") from None
    return Plan(str(source.path), mc.num_layers, max_context, pages, e.page_size, per_page, tuple(warnings))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def summary(engine, plan: Plan, model_name: str, host: str, port: int, load_seconds: float) -> list[str]:
    """The start-up summary: one line per fact, logged at INFO once the model is loaded."""
    cfg, pool = engine.config, engine.pool
    backend = getattr(engine.backend, "name", type(engine.backend).__name__)
    cache = f"on ({cfg.policy})" if cfg.enable_prefix_cache else "off"
    tiers = []
    if cfg.host_cache_bytes:
        tiers.append(f"host {_size(cfg.host_cache_bytes)}")
    if cfg.kv_store:
        tiers.append(f"store {cfg.kv_store.split('://')[0].split(':')[0]}")
    return [
        f"model: {model_name} ({plan.model_path}), {plan.num_layers} layers, context {engine.max_context} tokens",
        f"weights: {_weights_line(engine.loop.weights)}; activations {cfg.dtype}"
        f"{_rounding(engine.loop.weights)}; KV dtype: "
        f"{pool.format.name}; device: {cfg.device}{_threads_note(engine)}",
        f"KV pool: {pool.num_pages} pages x {pool.page_size} tokens = {pool.num_pages * pool.page_size} tokens, "
        f"{_size(pool.num_pages * pool.config.bytes_per_page)} ({_size(pool.config.bytes_per_page)} a page)"
        f"{_share_note(engine)}{_commit_note(pool)}",
        f"page size: {pool.page_size}; prefix cache: {cache}{'; tiers: ' + ', '.join(tiers) if tiers else ''}",
        f"attention backend: {backend} (asked: {cfg.attention_backend})",
        f"scheduler: max batch tokens {cfg.max_batch_tokens}, max running {cfg.max_running}, chunked prefill "
        f"{cfg.chunked_prefill_size or 'off'}",
        f"loaded in {load_seconds:.2f} s",
        f"listening on http://{host}:{port}",
    ]


def _threads_note(engine) -> str:
    """``, 2 threads`` on the CPU: how many the kernels run on (``threads``)."""
    n = engine.loop.threads
    return f", {n} thread{'s' if n != 1 else ''}" if str(engine.config.device).startswith("cpu") else ""


def _share_note(engine) -> str:
    """``; 25% of 20.1 GiB available`` when the pool was sized by a share of memory."""
    share, free = engine.config.kv_share, engine.loop.available_memory
    return "" if share is None or free is None else f"; {100 * share:g}% of {_size(free)} available"


def _commit_note(pool) -> str:
    """``; committed at start-up in 3.20 s`` or ``; committed as it fills`` (CPU pools)."""
    if str(pool.config.device).split(":")[0] != "cpu":
        return ""
    if pool.commit_seconds is None:
        return "; committed as it fills"
    return f"; committed at start-up in {pool.commit_seconds:.2f} s"


def _rounding(weights: dict) -> str:
    """How native weights round their inputs, for the start-up line ("" for expanded weights)."""
    bits = weights.get("activation_bits")
    return f" (rounded to {bits}-bit codes per block of 32)" if bits else ""


def _weights_line(summary: dict) -> str:
    """``native (Q8_0 x 1, float32 x 61, Q4_1 x 120), 96.6 MB``: how the weights are held."""
    kinds = ", ".join(f"{k} x {n}" for k, n in summary["tensors"].items())
    return f"{summary['mode']} ({kinds}), {summary['bytes'] / 1e6:.1f} MB"


# -- the periodic stats line -------------------------------------------------------------------


class StatsLine:
    """A daemon thread that logs one line every ``interval`` seconds: prompt and generation
    throughput since the last line, running/waiting, prefix-cache hit rate (since the last
    line and overall) and pool usage. Lines while idle and unchanged are skipped."""

    def __init__(self, engine, metrics, interval: float, log: Callable[[str], None] | None = None):
        self.engine, self.metrics, self.interval = engine, metrics, interval
        self.log = log or logger.info
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixkv-stats", daemon=True)
        self._last = self._read()
        self._quiet = False

    def _read(self) -> dict:
        s = self.engine.snapshot()
        cache = s["cache"] or {}
        queried = cache.get("queried_tokens", 0)
        # prompt tokens as requests are admitted (the tree counts them), else as they finish
        prompt = queried if s["cache"] is not None else self.metrics.prompt_tokens_seen
        return {"t": time.monotonic(), "gen": s["generated_tokens"], "prompt": prompt, "queried": queried,
                "hit": cache.get("hit_tokens", 0), "snap": s}  # fmt: skip

    def line(self) -> str | None:
        now = self._read()
        last, self._last = self._last, now
        dt = max(now["t"] - last["t"], 1e-9)
        s = now["snap"]
        idle = now["gen"] == last["gen"] and now["prompt"] == last["prompt"] and not s["running"] and not s["waiting"]
        if idle and self._quiet:
            return None
        self._quiet = idle
        pool = s["pool"]
        used = 1 - pool["free"] / pool["pages"]
        queried, hit = now["queried"] - last["queried"], now["hit"] - last["hit"]
        if s["cache"] is None:
            cache = "prefix cache off"
        else:
            recent = f"{100 * hit / queried:.1f}%" if queried else "-"
            total = f"{100 * now['hit'] / now['queried']:.1f}%" if now["queried"] else "-"
            cache = f"prefix-cache hit rate {recent} (overall {total})"
        return (f"stats: prompt {(now['prompt'] - last['prompt']) / dt:.1f} tok/s, generation "
                f"{(now['gen'] - last['gen']) / dt:.1f} tok/s, running {s['running']}, waiting {s['waiting']}, "
                f"{cache}, KV pool {100 * used:.1f}% used ({pool['pages'] - pool['free']}/{pool['pages']} pages)")  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                text = self.line()
            except Exception:  # a stats line must never take the server down
                logger.debug("stats line failed", exc_info=True)
                continue
            if text is not None:
                self.log(text)

    def start(self) -> StatsLine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


# -- the access log ----------------------------------------------------------------------------


class AccessLog:
    """One JSON line per answered request to a file (appended) or ``-`` (stderr): time,
    method, path, status, latency, prompt/completion/cached tokens where known, request id.
    Never headers (the API key) or bodies (a cache salt)."""

    def __init__(self, target: str):
        self._own = target != "-"
        self._file = open(target, "a", buffering=1, encoding="utf-8") if self._own else sys.stderr
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except (OSError, ValueError):  # a full disk or a closed file: never fail a request over it
                pass

    def close(self) -> None:
        if self._own:
            with self._lock:
                self._file.close()


def new_record(method: str, path: str, request_id: str | None) -> dict:
    """The access-log record of a request as it starts; the app and Metrics fill it in."""
    return {"method": method, "path": path, "request_id": request_id, "status": None, "_start": time.perf_counter(),
            "_time": time.time(), "prompt_tokens": None, "completion_tokens": None, "cached_tokens": None,
            "rids": []}  # fmt: skip


def add_output(out) -> None:
    """Count a finished engine request into the current request's record (if any)."""
    record = CURRENT.get()
    if record is None:
        return
    for key, value in (("prompt_tokens", out.prompt_tokens), ("completion_tokens", out.completion_tokens),
                       ("cached_tokens", out.cached_tokens)):  # fmt: skip
        record[key] = (record[key] or 0) + value
    record["rids"].append(out.rid)


def finish_record(record: dict, error: str | None = None, param: str | None = None) -> dict:
    """The JSON line of a finished request's record."""
    out = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record["_time"])) + f".{int(record['_time'] * 1000) % 1000:03d}Z",
        "method": record["method"], "path": record["path"], "status": record["status"],
        "latency_s": round(time.perf_counter() - record["_start"], 6),
        "prompt_tokens": record["prompt_tokens"], "completion_tokens": record["completion_tokens"],
        "cached_tokens": record["cached_tokens"],
        "request_id": record["request_id"] or (record["rids"][0] if record["rids"] else None),
    }  # fmt: skip
    if error is not None:
        out["error"] = error
        if param is not None:
            out["param"] = param
    return out
