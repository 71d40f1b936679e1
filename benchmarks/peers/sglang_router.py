"""SGLang's router (PyPI ``sglang-router``, the Rust "SGLang Model Gateway") as a
benchmark peer: started in front of `radixkv serve` replicas on loopback.

Installed into its own virtualenv, ``.peers/sglang-router-venv`` (``install()``; a
wheel with the Rust binary, plus fastapi, uvicorn, aiohttp, orjson, setproctitle for
its Python launcher), never into the project's. Launched as

    python -m sglang_router.launch_router --worker-urls URL... --policy cache_aware \\
        --host 127.0.0.1 --port P --prometheus-host 127.0.0.1 --prometheus-port Q

What it asks of a worker, and what radixkv answers: ``GET /health`` (registration and
the periodic health check), ``GET /server_info`` (``served_model_name`` names the
worker's model; ``model_path`` is where it would load a tokenizer from, which fails
without the hub and is only logged), ``GET /model_info`` (optional labels). It forwards
``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` re-encoded through its
own request types: SGLang's extra fields at their defaults are added (radixkv accepts
them at those values), and fields it does not know are dropped (radixkv's
``session_id``, ``cache_salt``, ``cache_control``, ``pin``/``hint``; ``seed`` and
``logit_bias`` inside /generate's ``sampling_params``). A chat or completions request
without ``model`` gets ``"unknown"``, which radixkv answers with a 404: send ``model``.
``cache_aware`` routes on the request's text: /generate's ``text`` (or its
``input_ids`` as digits), the chat messages' text contents joined, the completion's
``prompt``, matched in the router's own approximate prefix tree per worker.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VENV = ROOT / ".peers" / "sglang-router-venv"
PYTHON = VENV / "bin" / "python"
VERSION = "0.3.2"
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
# what start() passes unless opts say otherwise: metrics only on loopback, a quick
# shutdown (its default waits up to 180 s for in-flight requests), one log line per warning
DEFAULTS = {"prometheus_host": "127.0.0.1", "shutdown_grace_period_secs": 5, "log_level": "warn"}


def available() -> bool:
    """The venv's launcher imports (``install()`` makes it)."""
    if not PYTHON.exists():
        return False
    check = subprocess.run([str(PYTHON), "-c", "import sglang_router.launch_router"], capture_output=True)
    return check.returncode == 0


def version() -> str:
    out = subprocess.run([str(PYTHON), "-c", "import sglang_router.version as v; print(v.__version__)"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


def install() -> Path:
    """Create ``.peers/sglang-router-venv`` and pip-install ``sglang-router`` there (a
    minute on PyPI); the venv's python."""
    if not PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--quiet", f"sglang-router=={VERSION}"], check=True)
    if not available():
        raise RuntimeError(f"sglang-router was installed into {VENV} but sglang_router.launch_router does not import")
    return PYTHON


def _flags(opts: dict) -> list[str]:
    """``cache_threshold=0.5`` -> ``--cache-threshold 0.5``; True -> the bare flag, a list
    -> its values, None or False -> nothing."""
    out: list[str] = []
    for name, value in opts.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("_", "-"))
        if isinstance(value, (list, tuple)):
            out += [str(v) for v in value]
        elif value is not True:
            out.append(str(value))
    return out


def start(worker_urls: list[str], policy: str = "cache_aware", timeout: float = 120, log_path=None,
          **opts) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """The router on a free loopback port in front of ``worker_urls``; (process, base URL)
    once every worker is registered and healthy. ``opts`` are the launcher's flags by
    their Python names (``cache_threshold=0.3, balance_abs_threshold=64,
    balance_rel_threshold=1.5, eviction_interval_secs=60, max_tree_size=2**26``: its
    cache-aware defaults). Output goes to ``log_path`` (default: a temporary file)."""
    import httpx

    from radixkv.server.process import free_port, launch, stop

    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not worker_urls:
        raise ValueError("give at least one worker URL")
    opts = {**DEFAULTS, "prometheus_port": free_port(), **opts}
    for name in ("host", "port"):
        if name in opts:
            raise ValueError(f"{name} is chosen by start(): a free port on 127.0.0.1")
    cmd = [str(PYTHON), "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--policy", policy,
           *_flags(opts)]  # fmt: skip
    deadline = time.monotonic() + timeout
    proc, url = launch(cmd, "/liveness", "sglang router", timeout, log_path, die_with_parent=True)
    ready: dict = {}
    while time.monotonic() < deadline:  # workers register in the background after the port opens
        r = httpx.get(url + "/readiness", timeout=5)
        ready = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if ready.get("healthy_workers") == len(worker_urls):
            return proc, url
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"sglang router: {ready.get('healthy_workers', 0)} of {len(worker_urls)} workers healthy "
                       f"after {timeout:.0f} s")  # fmt: skip


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM (it drains for ``shutdown_grace_period_secs``), then its exit status."""
    from radixkv.server.process import stop as stop_process

    return stop_process(proc)


if __name__ == "__main__":
    print(f"sglang-router {version()} in {VENV}" if available() else f"not installed: {VENV} (install())")
