"""Trace capture: write the requests a server or a program really sent as a JSONL trace
that ``radixkv sim`` replays (``radixkv.cache.traces`` reads it).

One line per finished request, in the order requests finish::

    {"tokens": [prompt ids], "namespace": "ns-1a2b3c4d5e6f", "arrival": 12.5031,
     "output_tokens": [generated ids], "priority": 0, "session": "run-7", "cached_tokens": 384}

- ``namespace``: an opaque id of the cache salt (``opaque_namespace``: ``ns-`` and 12 hex
  digits of an HMAC-SHA256 under a key drawn when the writer starts, the same keyed
  hash and, in a server, the same key as the Prometheus namespace labels), never the
  salt itself; left out for requests without a salt. Two requests share a namespace in
  the trace exactly when they shared one live; a salt gets a different id in another
  process (the key is not stored anywhere).
- ``arrival``: seconds from the writer's start to the request's arrival (submission).
  Lines are written when requests finish, so arrivals are not sorted; the simulator
  orders by arrival.
- ``session``: the program run (frontend) or the ``X-Session-Id`` request header
  (server); null where none is known.
- ``cached_tokens``: what the live run reported for the prompt.
- A text-level client (``OpenAIBackend``) knows no token ids: its lines carry ``text``
  (a completion prompt) or ``messages`` (a chat request) instead of ``tokens``, and
  ``output_tokens`` as a count; ``radixkv sim --model`` tokenizes them.

Writing costs the caller one queue put: a writer thread serializes and writes in
buffered batches and flushes whenever it has caught up. With ``max_bytes`` the file is
rotated before a line would take it past the bound: ``FILE`` becomes ``FILE.1`` (an
older ``FILE.1`` is dropped), so at most about ``2 * max_bytes`` stay on disk; arrivals
continue across the rotation (``cat FILE.1 FILE`` is one trace). A writer that starts on
a non-empty FILE (a restart) moves it to ``FILE.1`` first.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import os
import queue
import secrets
import threading
import time
from pathlib import Path

# The session of the request being submitted in this context (the server sets it from
# X-Session-Id for each HTTP request; Engine._submit reads it). None: unknown.
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("radixkv_trace_session", default=None)

SESSION_HEADER = "x-session-id"
MAX_SESSION_CHARS = 256


def opaque_namespace(key: bytes, salt: str) -> str:
    """``ns-`` and 12 hex digits of HMAC-SHA256(key, salt): stable for one key, not
    invertible without it. Pure; any thread."""
    return "ns-" + hmac.new(key, salt.encode(), "sha256").hexdigest()[:12]


class TraceWriter:
    """Append trace lines to ``path`` from any thread (``record``); see the module
    docstring. ``key``: the HMAC key for namespaces (default: fresh random bytes).
    ``close()`` writes what is queued and closes the file."""

    def __init__(self, path: str | Path, max_bytes: int | None = None, key: bytes | None = None):
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(f"record_trace_max_bytes must be an int >= 1, got {max_bytes!r}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.key = key if key is not None else secrets.token_bytes(32)
        self.start = time.perf_counter()  # arrivals are perf_counter stamps minus this
        self.rotations = 0
        self.cpu_seconds = 0.0  # the writer thread's CPU time (encoding, writing): what recording costs
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size:  # a previous run's trace: kept as FILE.1
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = open(self.path, "w", encoding="utf-8", buffering=1 << 16)
        self._size = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixkv-trace", daemon=True)
        self._thread.start()

    def record(self, tokens=None, output_tokens=(), *, salt: str | None = None, arrival: float | None = None,
               priority: int = 0, session: str | None = None, cached_tokens: int | None = None,
               text: str | None = None, messages: list | None = None) -> None:
        """Queue one request's line; returns at once. ``arrival`` is a
        ``time.perf_counter()`` stamp (default: now). ``tokens`` (ids) or ``text`` /
        ``messages``; ``output_tokens`` ids or a count. Any thread."""
        if self._closed:
            return
        stamp = time.perf_counter() if arrival is None else arrival
        self._queue.put((tokens, output_tokens, salt, stamp, priority, session, cached_tokens, text, messages))

    def flush(self, timeout: float | None = 10.0) -> None:
        """Block until every line queued before the call is written and flushed."""
        if self._closed:
            return
        marker = threading.Event()  # set by the writer thread once it reaches it
        self._queue.put(marker)
        marker.wait(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(30)

    # -- the writer thread ---------------------------------------------------------------

    def _line(self, item) -> str:
        tokens, out, salt, stamp, priority, session, cached, text, messages = item
        obj: dict = {}
        if tokens is not None:
            obj["tokens"] = list(tokens)
        elif messages is not None:
            obj["messages"] = messages
        else:
            obj["text"] = text if text is not None else ""
        if salt is not None:
            obj["namespace"] = opaque_namespace(self.key, salt)
        obj["arrival"] = round(max(0.0, stamp - self.start), 6)
        obj["output_tokens"] = out if isinstance(out, int) else list(out)
        obj["priority"] = int(priority or 0)
        obj["session"] = None if session is None else str(session)
        obj["cached_tokens"] = cached
        return json.dumps(obj, separators=(",", ":")) + "\n"

    def _write(self, line: str) -> None:
        size = len(line)  # json.dumps escapes non-ASCII: characters are bytes
        if self.max_bytes is not None and self._size and self._size + size > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._size += size

    def _rotate(self) -> None:
        """FILE -> FILE.1 (replacing an older one); a fresh FILE."""
        self._file.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._file = open(self.path, "w", encoding="utf-8", buffering=1 << 16)
        self._size = 0
        self.rotations += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            started = time.thread_time()
            batch = [item]
            try:
                while len(batch) < 256:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            stop = False
            flushes = []
            for item in batch:
                if item is None:
                    stop = True
                elif isinstance(item, threading.Event):
                    flushes.append(item)
                else:
                    try:
                        self._write(self._line(item))
                    except Exception:  # one bad record must not stop the trace
                        pass
            if stop or flushes or self._queue.empty():
                try:
                    self._file.flush()
                except OSError:
                    pass
            self.cpu_seconds += time.thread_time() - started
            for f in flushes:
                f.set()
            if stop:
                self._file.close()
                return
