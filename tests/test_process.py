"""The child-process helpers every server test stands on: ports handed out once, and a
server that loses the race for its port started again on another."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from radixkv.server import process

SERVER = textwrap.dedent("""
    import argparse, http.server
    p = argparse.ArgumentParser()
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    a = p.parse_args()

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

    http.server.HTTPServer((a.host, a.port), Ok).serve_forever()
""")


def test_free_port_never_hands_out_a_port_twice():
    with ThreadPoolExecutor(8) as pool:
        ports = list(pool.map(lambda _: process.free_port(), range(400)))
    assert len(set(ports)) == len(ports)


@pytest.fixture
def taken_port(monkeypatch):
    """A port a silent listener holds, which free_port() hands out first."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy])
    real = process.free_port
    monkeypatch.setattr(process, "free_port", lambda: next(ports, None) or real())
    yield busy
    taken.close()


def test_launch_starts_again_on_another_port_when_its_port_was_taken(tmp_path, taken_port):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    proc, url = process.launch([sys.executable, str(script)], "/", "test server", timeout=60)
    try:
        assert not url.endswith(f":{taken_port}")
        assert httpx.get(url + "/").text == "ok"
    finally:
        assert process.stop(proc, timeout=5) == -signal.SIGTERM  # it stopped when told


def test_launch_reports_a_child_that_fails_for_another_reason(tmp_path):
    script = tmp_path / "server.py"
    script.write_text("import sys; print('no model here'); sys.exit(3)")
    with pytest.raises(RuntimeError, match="(?s)exited with status 3.*no model here"):
        process.launch([sys.executable, str(script)], "/", "test server", timeout=60)


def test_redis_starts_again_on_another_port_when_its_port_was_taken(taken_port):
    import redis
    from test_store import start_redis  # a RedisProcess, or a skip saying why there is none

    server = start_redis()
    try:
        assert f":{taken_port}/" not in server.url
        client = redis.Redis.from_url(server.url)
        assert client.info("server")["process_id"] == server.proc.pid
        client.close()
    finally:
        server.stop()


PARENT = textwrap.dedent("""
    import sys, time
    from radixkv.server import process
    replica, url = process.launch([sys.executable, sys.argv[1]], "/", "replica", timeout=60)
    router, _ = process.launch([sys.executable, "-m", "radixkv", "router", "--replicas", url], "/health", "router",
                               timeout=120)
    peer, _ = process.launch([sys.executable, sys.argv[1]], "/", "peer", timeout=60, die_with_parent=True)
    print(replica.pid, router.pid, peer.pid, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_radixkv_server_stops_when_the_process_that_launched_it_is_killed(tmp_path):
    """A benchmark or test killed outright (SIGKILL: no cleanup runs) leaves no radixkv
    server behind: `radixkv router` (and `serve`) started by launch watch their launcher
    and shut down once it is gone; so does another command launched ``die_with_parent``
    (a benchmark's peer server). One launched without it is not told to."""
    (tmp_path / "replica.py").write_text(SERVER)
    (tmp_path / "parent.py").write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "replica.py")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    replica, router, peer = map(int, parent.stdout.readline().split())
    try:
        assert _alive(router) and _alive(replica) and _alive(peer)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 30
        while (_alive(router) or _alive(peer)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(router)
        assert not _alive(peer)  # launched die_with_parent: SIGTERM from the kernel
        assert _alive(replica)  # neither a radixkv command nor told to: it does not watch
    finally:
        for pid in (replica, router, peer):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_exit_with_parent_reads_and_clears_its_variable(monkeypatch):
    monkeypatch.delenv(process.PARENT_ENV, raising=False)
    assert process.exit_with_parent() is None  # not launched: no watcher
    # launched (here: told its parent is the one it has): a watcher, and the variable gone
    # from the environment its own children get
    code = ("import os, time; from radixkv.server import process; w = process.exit_with_parent(poll=0.05); "
            "time.sleep(0.3); print(w.is_alive(), process.PARENT_ENV in os.environ)")  # fmt: skip
    env = {**os.environ, process.PARENT_ENV: str(os.getpid())}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    assert out.split() == ["True", "False"]
