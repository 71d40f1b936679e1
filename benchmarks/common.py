"""What every benchmark writes next to its figures."""

from __future__ import annotations

import time

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
