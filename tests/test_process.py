"""The child-process helpers every server test stands on: ports handed out once, and a
server that loses the race for its port started again on another."""

from __future__ import annotations

import signal
import socket
import sys
import textwrap
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
