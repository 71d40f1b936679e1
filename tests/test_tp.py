"""Tensor parallelism (radixkv.model.tp) on the real SmolLM2 model, over gloo on the CPU:
TP = 3 gives TP = 1's logits (within 1e-4) and greedy tokens; TP = 1 through a process
group is exact; workers end with the engine or when rank 0's pipe closes; what TP cannot
split or mirror is refused with an error naming the field."""

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import torch

from radixkv.cache.formats import KVScales
from radixkv.cache.pool import KVPool, PoolConfig
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine import Engine
from radixkv.engine.sampling import SamplingParams
from radixkv.errors import FieldError
from radixkv.kernels import get_backend
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.model.chat_template import ChatTemplate
from radixkv.model.loader import load_model
from radixkv.model.registry import resolve_model
from radixkv.model.tokenizer import Tokenizer
from radixkv.model.tp import TensorParallel, shard_model, shard_pool_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SYSTEM = "You are a concise assistant. Answer in one short sentence, without any preamble or lists."
QUESTIONS = ["What is the capital of France?", "Who wrote Hamlet?", "What do bees make?"]
GREEDY = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
FOLLOW = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
PAGE = 16


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pids, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model().path)


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.load(resolve_model())
    tmpl = ChatTemplate.from_tokenizer(tok)
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    return [tmpl.encode(tok, c) for c in chats]


def pool_config(model, pages: int = 64) -> PoolConfig:
    c = model.config
    return PoolConfig(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, page_size=PAGE,
                      num_pages=pages)  # fmt: skip


def steps(prompts):
    """A ragged prefill (the first prompt whole, the second after a cached page: an
    extend) and a decode step of both: (batch, all_logits) pairs, run in order."""
    a, b = prompts[0], prompts[1]
    pa, pb = np.arange(0, 8, dtype=np.int32), np.arange(8, 16, dtype=np.int32)
    return [
        (ForwardBatch.build([SeqInput(b[:PAGE], 0, pb)], PAGE), False),
        (ForwardBatch.build([SeqInput(a, 0, pa), SeqInput(b[PAGE:], PAGE, pb)], PAGE), True),
        (ForwardBatch.build([SeqInput([42], len(a), pa), SeqInput([7], len(b), pb)], PAGE), False),
    ]


def test_shard_splits_heads_and_checks_tp(model):
    part = shard_model(model, 1, 3)
    c = part.config
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size) == (3, 1, 512)
    assert part.layers[0].qkv.shape == ((3 + 2) * 64, 576) and part.layers[0].o.shape == (576, 3 * 64)
    assert part.layers[0].gate_up.shape == (2 * 512, 576) and part.layers[0].down.shape == (576, 512)
    assert torch.equal(part.layers[0].qkv[:192], model.layers[0].qkv[192:384])  # query heads 3..5
    assert torch.equal(part.layers[0].qkv[192:256], model.layers[0].qkv[576 + 64 : 576 + 128])  # KV head 1
    assert model.config.num_heads == 9 and model.all_reduce is None  # the whole model is untouched
    with pytest.raises(ValueError, match=r"tp=2 must divide the model's 9 query heads, 3 KV heads.*tp in \[1, 3\]"):
        shard_model(model, 0, 2)
    fp8 = dataclasses.replace(pool_config(model), kv_dtype="fp8_e4m3", kv_scales=KVScales(
        torch.arange(90.0).view(30, 3) + 1, torch.ones(30, 3), "test"))  # fmt: skip
    local = shard_pool_config(fp8, 2, 3)
    assert local.num_kv_heads == 1 and local.num_pages == 64 and torch.equal(local.kv_scales.k[:, 0], fp8.kv_scales.k[:, 2])
    budget = dataclasses.replace(pool_config(model), num_pages=None, memory_bytes=10 << 20)
    assert shard_pool_config(budget, 0, 3).num_pages == budget.resolved_num_pages()  # the whole model's bytes count


def test_tp3_logits_match_tp1_and_workers_end_when_rank0_pipe_closes(model, prompts):
    backend = get_backend("torch")
    tp = TensorParallel(model, resolve_model().path, pool_config(model), "torch", "float32", "cpu", 3).start()
    try:
        pool1, pool3 = KVPool(pool_config(model)), KVPool(tp.pool_config)
        assert pool3.num_pages == pool1.num_pages and pool3.k[0].shape == (64, PAGE, 1, 64)
        for batch, all_logits in steps(prompts):
            ref = model.forward(batch, pool1, backend, all_logits)
            got = tp.forward(batch, pool3, backend, all_logits)
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() < 1e-4
            assert torch.equal(got.argmax(-1), ref.argmax(-1))
        # rank 0's end, as a kill would leave it: its pipe ends close without a "stop"
        pids = tp.pids
        assert len(pids) == 2 and tp.alive()
        for conn in tp._conns:
            conn.close()
        assert wait_gone(pids)
    finally:
        tp._conns = []
        tp.close()
    with pytest.raises(RuntimeError, match="tensor-parallel workers stopped"):
        tp.forward(steps(prompts)[0][0], KVPool(tp.pool_config), backend)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_tp1_through_a_process_group_is_exact(device, prompts):
    """The TP path with a group of one (gloo here; NCCL on a GPU) is bit-exact."""
    model = load_model(resolve_model().path, "float32", device)
    backend = get_backend("torch")
    cfg = pool_config(model)
    tp = TensorParallel(model, resolve_model().path, cfg, "torch", "float32", device, 1).start()
    try:
        pool1 = KVPool(dataclasses.replace(cfg, device=device))
        pool_tp = KVPool(dataclasses.replace(tp.pool_config, device=device))
        for batch, all_logits in steps(prompts):
            batch = ForwardBatch(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.__dict__.items()})
            ref = model.forward(batch, pool1, backend, all_logits)
            assert torch.equal(tp.forward(batch, pool_tp, backend, all_logits), ref)
    finally:
        tp.close()


def test_engine_tp3_greedy_tokens_match_tp1():
    settings = dict(kv_cache_tokens=4096)
    with Engine(**settings) as one:
        chat = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
        ids = [one.chat_prompt_ids(c) for c in chat]
        first = one.generate(ids, GREEDY)
        follow = ids[0] + first[0].token_ids + one.encode("<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n"
                                                          "<|im_start|>assistant\n")  # fmt: skip
        second = one.generate(follow, FOLLOW)
    with Engine(tp=3, **settings) as three:
        pids = three.loop.tp.pids
        assert len(pids) == 2 and three.pool.k[0].shape[2] == 1  # one KV head a rank
        got = three.generate(ids, GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in first]
        again = three.generate(follow, FOLLOW)
        assert again.cached_tokens >= PAGE and again.cached_tokens == second.cached_tokens
        assert again.token_ids == second.token_ids
        three.check_integrity()
        with pytest.raises(FieldError, match="tp > 1") as e:
            three.generate(ids[0], SamplingParams(max_new_tokens=4, kv_policy="streaming", kv_budget=64))
        assert e.value.field == "kv_policy"
        os.kill(pids[1], signal.SIGKILL)  # a worker dies: requests fail, the engine still answers
        assert wait_gone(pids[1:])
        out = three.generate(ids[0], FOLLOW)
        assert out.error is not None and "tensor-parallel step failed" in out.error
        assert three.is_alive() and gone(pids[0])  # the other worker was stopped
    assert wait_gone(pids, 5.0)  # close joined them


def test_bad_tp_is_refused_naming_tp():
    with pytest.raises(ValueError, match=r"tp=2 must divide the model's 9 query heads, 3 KV heads"):
        Engine(tp=2, kv_cache_tokens=256)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"^tp must be"):
            EngineConfig(tp=bad)
    with pytest.raises(ValueError, match="tp > 1 does not support host_cache_bytes"):
        EngineConfig(tp=3, host_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="tp > 1 does not support kv_dtype int4"):
        EngineConfig(tp=3, kv_dtype="int4")
    EngineConfig(tp=3, kv_dtype="int8")  # per-token formats split by head like the KV itself
