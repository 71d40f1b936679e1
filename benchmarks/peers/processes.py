"""Start a server process on a free loopback port and wait until it answers; stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(cmd: list[str], ready_path: str, name: str, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """Run ``cmd --host 127.0.0.1 --port P``; return (process, base URL) once GET
    ``ready_path`` answers 200. Its output goes to a temporary log, shown on failure."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{name.replace(' ', '-')}-", suffix=".log", delete=False)
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(url + ready_path, timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{name} did not answer {ready_path} within {timeout:.0f} s (log: {log.name})")


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
