"""llama.cpp's own ``llama-server`` as a benchmark peer: parallel slots, continuous
batching and prompt caching, on the same GGUF file.

The binary comes from ``bash benchmarks/peers/setup_llamacpp_bin.sh`` (the llama.cpp that
llama-cpp-python's sdist vendors, built into ``.peers/llama.cpp-bin``). Settings, the
ones a user serving several clients would pick: 2 threads, ``-np 8`` slots (one per
client thread of the busiest workload) over one unified KV buffer of 65536 tokens
(radixkv's pool in ``bench``), continuous batching and prompt caching (both on by
default), ``--cache-reuse 256`` (reuse cached chunks of 256+ tokens through KV shifting)
and its RAM prompt cache (default 8 GiB); slots are erased between workloads. Prompts go as token ids to ``/completion``
and the generated ids come back (``return_tokens``), so programs continue from the exact
ids; ``ignore_eos`` is the server's own. Branches of a fork are sent together, each on
its own connection, so they run in parallel slots. Cached prompt tokens come from each
response's ``timings.cache_n``.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.peers.llamacpp_backend import LlamaCppBackend, greedy_only, sse_chunks
from radixkv.frontend.backends import BackendError, CallResult, Delta

ROOT = Path(__file__).resolve().parent.parent.parent
BINARY = ROOT / ".peers" / "llama.cpp-bin" / "bin" / "llama-server"
SLOTS, CONTEXT = 8, 65536


def unavailable() -> str | None:
    """Why the peer cannot run here, or None."""
    if not BINARY.exists():
        return "not built (bash benchmarks/peers/setup_llamacpp_bin.sh)"
    return None


def version() -> str:
    out = subprocess.run([str(BINARY), "--version"], capture_output=True, text=True)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return lines[0].removeprefix("version: ") if lines else "?"


class LlamaServer:
    """The server process and a backend on it."""

    reports_cache = True  # each response's timings.cache_n

    def __init__(self, threads: int = 2):
        from radixkv.model import resolve_model
        from radixkv.server.process import launch

        self._slots_dir = tempfile.TemporaryDirectory(prefix="llama-server-slots-")  # lets /slots erase
        cmd = [str(BINARY), "-m", str(resolve_model().path), "-c", str(CONTEXT), "-np", str(SLOTS), "-kvu",
               "-t", str(threads), "-tb", str(threads), "--cache-reuse", "256", "--no-webui",
               "--slot-save-path", self._slots_dir.name]  # fmt: skip
        self.proc, url = launch(cmd, "/health", "llama-server", die_with_parent=True)
        self.backend = LlamaServerBackend(url)

    def reset(self) -> None:
        self.backend.erase_slots()

    def close(self) -> None:
        from radixkv.server.process import stop

        self.backend.close()
        stop(self.proc)
        self._slots_dir.cleanup()


class SideBySideBackend(LlamaCppBackend):
    """llama-cpp-python's backend (the same tokenizer and chat template, an HTTP client)
    for a server that batches: the prompts of one call (a fork's branches) are sent
    side by side, each on its own connection. Subclasses speak the server's route in
    ``stream``."""

    def __init__(self, url: str, max_context: int, connections: int):
        super().__init__(url)
        self.max_context = max_context
        self._pool = ThreadPoolExecutor(connections)

    def generate(self, prompts: list[list[int]], params: dict) -> list[CallResult]:
        def one(p):
            *_, last = self.stream(p, params)
            return last

        return list(self._pool.map(one, prompts)) if len(prompts) > 1 else [one(prompts[0])]

    def close(self) -> None:
        self._pool.shutdown()
        super().close()


class LlamaServerBackend(SideBySideBackend):
    """llama-server's own ``/completion`` with token ids, its slots in parallel."""

    def __init__(self, url: str):
        super().__init__(url, CONTEXT // SLOTS, SLOTS)

    def stream(self, prompt: list[int], params: dict):
        import httpx

        greedy_only(params, "llama-server")
        body = {"prompt": prompt, "n_predict": params.get("max_new_tokens", 128), "temperature": 0.0, "top_k": 1,
                "stream": True, "cache_prompt": True, "return_tokens": True,
                "ignore_eos": bool(params.get("ignore_eos"))}  # fmt: skip
        t0, ttft, ids, text, cached, reason = time.perf_counter(), None, [], [], 0, None
        for attempt in range(3):  # a kept-alive connection the server closed meanwhile: send it again
            try:
                r = self._http.send(self._http.build_request("POST", "/completion", json=body), stream=True)
                break
            except httpx.RemoteProtocolError:
                if attempt == 2:
                    raise
        try:
            for chunk in sse_chunks(r, "llama-server"):
                new = chunk.get("tokens") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += new
                text.append(chunk.get("content") or "")
                if new or chunk.get("content"):
                    yield Delta(chunk.get("content") or "", list(new))
                if chunk.get("stop"):
                    cached = int((chunk.get("timings") or {}).get("cache_n") or 0)
                    reason = "length" if chunk.get("stop_type") == "limit" else "stop"
        finally:
            r.close()
        yield CallResult("".join(text), ids, len(prompt), cached, reason, None, ttft)

    def erase_slots(self) -> None:
        """Forget every slot's KV (the benchmark flushes caches between workloads; its RAM
        prompt cache has no flush, and holds other workloads' prefixes only)."""
        for slot in self._http.get("/slots").json():
            r = self._http.post(f"/slots/{slot['id']}?action=erase")
            if r.status_code != 200:
                raise BackendError(f"llama-server did not erase slot {slot['id']}: {r.status_code} {r.text[:200]}")
