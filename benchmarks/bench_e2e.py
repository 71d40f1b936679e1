"""End-to-end against the peers: ``radixkv.workloads.bench`` (what ``radixkv bench``
runs) plus HF transformers and llama.cpp's server on the same model and prompts.

    .venv/bin/python benchmarks/bench_e2e.py [--scale full|small|tiny] [--workloads rag,agent]
        [--systems radixkv,radixkv-no-cache,transformers,llama.cpp] [--out benchmarks/out]

The systems and what is measured: see ``radixkv/workloads/bench.py``. llama.cpp is
skipped with a notice unless ``bash benchmarks/peers/setup_llamacpp.sh`` installed it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixkv.workloads import bench  # noqa: E402


def transformers():
    from benchmarks.peers.transformers_backend import TransformersBackend

    return bench.InProcess(TransformersBackend())


def llama_cpp():
    from benchmarks.peers import llamacpp_backend

    reason = llamacpp_backend.unavailable()
    if reason:
        print(f"[llama.cpp skipped: {reason}]")
        return None
    return llamacpp_backend.LlamaCppServer()


def llama_server():
    from benchmarks.peers import llamaserver_backend

    reason = llamaserver_backend.unavailable()
    if reason:
        print(f"[llama-server skipped: {reason}]")
        return None
    return llamaserver_backend.LlamaServer()


def versions() -> dict:
    from benchmarks.peers import llamacpp_backend, llamaserver_backend

    return {"llama_cpp_python": None if llamacpp_backend.unavailable() else llamacpp_backend.version(),
            "llama_server": None if llamaserver_backend.unavailable() else llamaserver_backend.version()}


PEERS = {"transformers": transformers, "llama.cpp": llama_cpp, "llama-server": llama_server}


def main(argv=None) -> int:
    return bench.main(argv, PEERS, versions)


if __name__ == "__main__":
    sys.exit(main())
