"""End-to-end against the peers: ``radixkv.workloads.bench`` (what ``radixkv bench``
runs) plus HF transformers, llama.cpp (llama-cpp-python's server and its own
``llama-server``) and vLLM's CPU build, on the same model and prompts.

    .venv/bin/python benchmarks/bench_e2e.py [--scale full|small|tiny] [--workloads rag,agent]
        [--systems radixkv,radixkv-no-cache,transformers,llama.cpp,llama-server,vllm,vllm-bf16] [--out benchmarks/out]

The systems and what is measured: see ``radixkv/workloads/bench.py``. A served peer is
skipped with a notice unless its setup script (``benchmarks/peers/setup_*.sh``) installed it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixkv.workloads import bench  # noqa: E402


def transformers():
    from benchmarks.peers.transformers_backend import TransformersBackend

    return bench.InProcess(TransformersBackend())


# a served peer: its module in benchmarks/peers (with unavailable() and version()), its server class,
# the version's key and the server's arguments
SERVED = {"llama.cpp": ("llamacpp_backend", "LlamaCppServer", "llama_cpp_python", {}),
          "llama-server": ("llamaserver_backend", "LlamaServer", "llama_server", {}),
          "vllm": ("vllm_backend", "VllmServer", "vllm", {}),
          "vllm-bf16": ("vllm_backend", "VllmServer", "vllm", {"dtype": "bfloat16"})}  # fmt: skip


def served(system: str):
    """A factory for ``system``'s server, or None (with the reason printed) where it cannot run."""

    def factory():
        module = importlib.import_module(f"benchmarks.peers.{SERVED[system][0]}")
        reason = module.unavailable()
        if reason:
            print(f"[{system} skipped: {reason}]")
            return None
        return getattr(module, SERVED[system][1])(**SERVED[system][3])

    return factory


def versions() -> dict:
    out = {}
    for module_name, _, key, _ in SERVED.values():
        module = importlib.import_module(f"benchmarks.peers.{module_name}")
        out[key] = None if module.unavailable() else module.version()
    return out


PEERS = {"transformers": transformers, **{system: served(system) for system in SERVED}}


def main(argv=None) -> int:
    return bench.main(argv, PEERS, versions)


if __name__ == "__main__":
    sys.exit(main())
