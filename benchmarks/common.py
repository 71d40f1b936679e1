"""What every benchmark writes next to its figures."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from radixkv.workloads.bench import write_result  # noqa: F401 (one implementation, shared)

# The fidelity chats: greedy continuations of these are compared token for token with
# transformers (tests/test_model.py on the CPU, tests/test_gpu.py and bench_gpu_model.py
# on a GPU).
FIDELITY_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}, {"role": "assistant", "content": "2, 3, 5."},
     {"role": "user", "content": "Three more?"}],
    [{"role": "user", "content": "Explain recursion to a child in one sentence."}],
    [{"role": "user", "content": "Traduis en anglais : « Le chat dort sur le canapé. »"}],
]  # fmt: skip


def median_seconds(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def paged_decode_seconds(model, pool, backend, prompts: list[list[int]], steps: int, page_size: int = 16) -> float:
    """Seconds radixkv's model takes for ``steps`` batched greedy one-token steps over
    ``pool`` after an untimed prefill of ``prompts`` (all the same length), as an engine
    step runs them (``LlamaModel.forward`` on a ``ForwardBatch``); the pages go back after."""
    import numpy as np

    from radixkv.model.batch import ForwardBatch, SeqInput

    context = len(prompts[0])
    tables = [pool.alloc(-(-(context + steps) // page_size)) for _ in prompts]
    seqs = [SeqInput(p, 0, t) for p, t in zip(prompts, tables)]
    tokens = model.forward(ForwardBatch.build(seqs, page_size), pool, backend).argmax(-1).tolist()
    t0 = time.perf_counter()
    for step in range(steps):
        seqs = [SeqInput([tok], context + step, t) for tok, t in zip(tokens, tables)]
        tokens = model.forward(ForwardBatch.build(seqs, page_size), pool, backend).argmax(-1).tolist()
    elapsed = time.perf_counter() - t0
    pool.decref(np.concatenate(tables))
    return elapsed


def transformers_decode_seconds(model, prompts: list[list[int]], steps: int) -> float:
    """Seconds transformers' batched greedy loop takes for ``steps`` one-token steps
    after an untimed prefill of ``prompts`` (all the same length: no padding)."""
    out = model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)
    cache, tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(tokens, past_key_values=cache, use_cache=True)
        cache, tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t0


def agreement(mine: list[int], ref: list[int]) -> int:
    """Tokens of ``mine`` equal to ``ref``'s before their first difference."""
    n = 0
    for a, b in zip(mine, ref):
        if a != b:
            break
        n += 1
    return n


# offsets of each GGUF block type's fp16 scale fields (d, and m or dmin where it has one)
HALF_FIELDS = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}


def random_blocks(type_id: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in the block layout of ggml type ``type_id`` (``uint8 [rows,
    row_bytes]``), with small finite fp16 scales: the packed-weight kernels' test and
    benchmark input (never zeros)."""
    from radixkv.kernels.weights import TYPES

    rng = np.random.default_rng(seed)
    _, values, nbytes = TYPES[type_id]
    a = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[type_id]:
        scales = (rng.standard_normal((rows, cols // values)) * 0.02).astype(np.float16)
        a[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    return a.reshape(rows, -1)
