"""Tensor parallelism: one model split across ``N`` ranks on ``torch.distributed``.

Megatron-style split of a Llama-family decoder, per layer:

    rank r of N        q/k/v rows of its query heads (Hq/N) and KV heads (Hkv/N)
                       o_proj columns of its query heads           -> partial [T, hidden]: all-reduce (sum)
                       gate/up rows, down columns of its intermediate slice -> partial: all-reduce (sum)
    every rank         embedding, norms, lm_head (replicated)

so each rank's KV pool holds its KV heads only, ``[num_pages, page_size, Hkv/N, D]``,
with the same number of pages and the same page ids on every rank: rank 0 owns the
scheduler, the radix tree and the allocator, and the page ids it puts in a batch are
valid on every rank as they are.

Processes. Rank 0 lives in the caller's process (the engine loop); ``TensorParallel``
starts ranks 1..N-1 as spawned worker processes. Each worker loads the model itself
(the same file), shards it, allocates its pool shard, reports ready and joins the
process group (gloo on the CPU, NCCL on CUDA). Then, per step:

    rank 0   header (ForwardBatch's host fields, tensor dtypes and sizes) --pipe--> each worker
             one int64 tensor (every batch tensor packed)  --dist.broadcast--> all ranks
    all      model.forward(batch, pool shard): 2 all-reduces per layer; only rank 0 samples

The header goes through a pipe rather than the process group so an idle worker waits
on the pipe, not in a collective that would time out, and learns of rank 0's end at
once: a closed pipe (rank 0 exited or was killed) ends the worker. ``close`` sends
"stop", joins, and kills a worker that does not end. A worker computes no logits (its
output head is empty): only rank 0's are used.

What this does not mirror: pool writes outside ``forward`` (host/store tiers,
``kv_rerotate``), per-page state freed through the allocator (the int4 formats' sealing)
and attention mass or keys read for long-context policies (rank 0 sees its heads
only). The engine rejects those with ``tp > 1`` (``EngineConfig``, ``Engine.check_policy``).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from radixkv.cache.formats import KVScales
from radixkv.cache.pool import KVPool, PoolConfig
from radixkv.errors import FieldError
from radixkv.model.batch import ForwardBatch
from radixkv.model.llama import LayerWeights, LlamaModel
from radixkv.validate import check_int

logger = logging.getLogger("radixkv.tp")

START_TIMEOUT = 600.0  # seconds for the workers to load the model and join
COLLECTIVE_TIMEOUT = timedelta(seconds=300)  # one collective (a rank stuck longer has failed)
STOP_TIMEOUT = 10.0  # seconds a worker gets to end after "stop" before it is killed


# -- splitting a model --------------------------------------------------------------------------


def check_tp(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> None:
    """FieldError (a ValueError) naming ``tp`` unless ``tp`` ranks can split the heads
    and the MLP."""
    check_int("tp", tp, 1)
    if num_heads % tp or num_kv_heads % tp or intermediate_size % tp:
        ok = [n for n in range(1, num_kv_heads + 1) if not (num_heads % n or num_kv_heads % n or intermediate_size % n)]
        raise FieldError("tp", f"tp={tp} must divide the model's {num_heads} query heads, {num_kv_heads} KV heads and "
                         f"intermediate size {intermediate_size}; this model allows tp in {ok}")  # fmt: skip


def shard_model(model: LlamaModel, rank: int, world: int, logits: bool = True) -> LlamaModel:
    """Rank ``rank`` of ``world``'s part of ``model`` (a new model; ``model`` is not
    changed and its replicated tensors are shared, not copied): its config has the local
    head counts and intermediate size. ``logits`` False gives it an empty output head
    (``forward`` then returns ``[B, 0]``: a worker's logits are never used). Its
    ``all_reduce`` is None until a process group sets it. ValueError naming ``tp`` when
    ``world`` does not divide the heads."""
    cfg = model.config
    check_tp(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    d, hq, hkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    lq, lkv, li = hq // world, hkv // world, inter // world
    q = slice(rank * lq * d, (rank + 1) * lq * d)  # rows of the stacked qkv
    k = slice((hq + rank * lkv) * d, (hq + (rank + 1) * lkv) * d)
    v = slice((hq + hkv + rank * lkv) * d, (hq + hkv + (rank + 1) * lkv) * d)
    mlp = slice(rank * li, (rank + 1) * li)
    layers = []
    for w in model.layers:
        gate, up = w.gate_up[:inter], w.gate_up[inter:]
        layers.append(dataclasses.replace(  # norms (per head for q/k: the same on every head) stay whole
            w,
            qkv=torch.cat([w.qkv[q], w.qkv[k], w.qkv[v]]),
            qkv_bias=None if w.qkv_bias is None else torch.cat([w.qkv_bias[q], w.qkv_bias[k], w.qkv_bias[v]]),
            o=w.o[:, q].contiguous(),
            gate_up=torch.cat([gate[mlp], up[mlp]]),
            down=w.down[:, mlp].contiguous(),
        ))  # fmt: skip
    local = dataclasses.replace(cfg, num_heads=lq, num_kv_heads=lkv, intermediate_size=li)
    lm_head = model.lm_head if logits else model.lm_head[:0]
    return LlamaModel(local, model.embed, layers, model.norm, lm_head)


def shard_pool_config(config: PoolConfig, rank: int, world: int) -> PoolConfig:
    """Rank ``rank``'s pool for ``config`` (the whole model's: every KV head): its KV
    heads only, the same number of pages (resolved from ``config``: a memory budget
    counts the whole model's bytes, so the engine holds as many tokens as at ``tp=1``),
    fp8 scales sliced to its heads."""
    per = config.num_kv_heads // world
    heads = slice(rank * per, (rank + 1) * per)
    scales = config.kv_scales
    if scales is not None:
        scales = KVScales(scales.k[:, heads].contiguous(), scales.v[:, heads].contiguous(), scales.digest)
    return dataclasses.replace(config, num_kv_heads=per, num_pages=config.resolved_num_pages(), memory_bytes=None,
                               kv_scales=scales)  # fmt: skip


# -- the batch on the wire ----------------------------------------------------------------------

_TENSORS = tuple(f.name for f in dataclasses.fields(ForwardBatch) if f.type.startswith("torch.Tensor"))


def _pack(batch: ForwardBatch) -> tuple[dict, torch.Tensor]:
    """The header (host fields; each tensor's dtype and length) and every tensor of
    ``batch`` as one int64 tensor on its device."""
    parts = [getattr(batch, name) for name in _TENSORS]
    for name, t in zip(_TENSORS, parts):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dim() != 1:
            raise TypeError(f"ForwardBatch.{name}: tensor parallelism sends 1-D integer tensors, got {t.dtype} "
                            f"{list(t.shape)}")  # fmt: skip
    header = {f.name: getattr(batch, f.name) for f in dataclasses.fields(ForwardBatch) if f.name not in _TENSORS}
    header["_tensors"] = [(t.dtype, t.numel()) for t in parts]
    return header, torch.cat([t.to(torch.int64) for t in parts])


def _unpack(header: dict, packed: torch.Tensor) -> ForwardBatch:
    fields = {k: v for k, v in header.items() if k != "_tensors"}
    at = 0
    for name, (dtype, n) in zip(_TENSORS, header["_tensors"]):
        fields[name] = packed[at : at + n].to(dtype)
        at += n
    return ForwardBatch(**fields)


# -- processes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank: the model file, dtypes, device, the whole
    model's pool config (pages resolved) and the attention backend's name."""

    model_path: str
    dtype: str
    device: str
    pool: PoolConfig
    backend: str
    kv_dtype: torch.dtype
    threads: int  # CPU threads of a worker


def _backend_name(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: ``cuda:i+rank`` for ``cuda:i``; the CPU for every rank."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    return f"cuda:{(dev.index or 0) + rank}"


def _init_group(device: str, rank: int, world: int, store) -> None:
    """Join the default process group through ``store`` (rank 0's TCPStore)."""
    backend = _backend_name(device)
    extra = {"device_id": torch.device(_rank_device(device, rank))} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT,
                            **extra)  # fmt: skip


def _moved(model: LlamaModel, device: str) -> LlamaModel:
    """``model`` with every tensor on ``device`` (itself when they are there)."""
    if model.device == torch.device(device):
        return model
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    layers = [LayerWeights(**{f.name: move(getattr(w, f.name)) for f in dataclasses.fields(w)}) for w in model.layers]
    return LlamaModel(model.config, move(model.embed), layers, move(model.norm), move(model.lm_head))


def _all_reduce(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def _worker(rank: int, world: int, port: int, spec: WorkerSpec, conn) -> None:
    """A worker process (rank >= 1): build the rank, report ready, join the group, then
    run each step rank 0 announces until "stop" or a closed pipe."""
    from radixkv.kernels import get_backend
    from radixkv.model.loader import as_dtype, load_state_dict
    from radixkv.model.registry import resolve_model

    torch.set_num_threads(spec.threads)
    device = _rank_device(spec.device, rank)
    try:
        # built on the host and uncached (not load_model): only this rank's part stays, on its device
        config, sd = load_state_dict(resolve_model(spec.model_path))
        full = LlamaModel.from_state_dict(config, {k: v.to(as_dtype(spec.dtype)) for k, v in sd.items()})
        del sd
        model = _moved(shard_model(full, rank, world, logits=False), device)
        del full
        pool = KVPool(dataclasses.replace(shard_pool_config(spec.pool, rank, world), device=device))
        backend = get_backend(spec.backend, device, spec.kv_dtype, as_dtype(spec.dtype))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        _init_group(spec.device, rank, world, store)
        model.all_reduce = _all_reduce
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # rank 0 is gone
                return
            if msg[0] == "stop":
                return
            header = msg[1]
            packed = torch.empty(sum(n for _, n in header["_tensors"]), dtype=torch.int64, device=device)
            dist.broadcast(packed, src=0)
            model.forward(_unpack(header, packed), pool, backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _worker_main(rank: int, world: int, port: int, spec: WorkerSpec, conn) -> None:
    """A worker process's target: ``_worker``, then exit at once (the interpreter's
    teardown of a loaded model takes seconds on a busy machine, and nothing is left to
    flush)."""
    code = 1
    try:
        _worker(rank, world, port, spec, conn)
        code = 0
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
    finally:
        conn.close()
        os._exit(code)


class TensorParallel:
    """Rank 0 of a tensor-parallel model, and the workers of ranks 1..N-1.

    ``TensorParallel(model, model_path, pool, backend, dtype, device, world)`` shards
    ``model`` (the whole model, as loaded from ``model_path``; not changed) for rank 0
    and raises ValueError naming ``tp`` when ``world`` does not divide the heads; it
    starts nothing. ``model`` and ``pool_config`` are rank 0's: build rank 0's
    ``KVPool`` from that config (``pool``: the whole model's). ``worker_threads``: CPU
    threads of each worker (default this process's threads / ``world``, at least 1).

    ``start`` launches the workers and joins the process group (``world`` 1 starts no
    worker but still runs through a process group of one: the NCCL path on one GPU);
    ``forward`` runs one step on every rank; ``close`` stops the workers. One started
    object per process (the default process group is process-wide). A forward that
    raises leaves the ranks out of step: the workers are stopped and every later call
    raises.
    """

    def __init__(self, model: LlamaModel, model_path: str, pool: PoolConfig, backend: str, dtype: str,
                 device: str, world: int, worker_threads: int | None = None):  # fmt: skip
        cfg = model.config
        check_tp(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, world)
        self.world = world
        self.device = device
        self.model = shard_model(model, 0, world)
        self.pool_config = shard_pool_config(pool, 0, world)
        self.failed: str | None = "not started"
        self._procs: list = []
        self._conns: list = []
        threads = worker_threads or max(1, torch.get_num_threads() // world)
        self._spec = WorkerSpec(str(model_path), dtype, device, dataclasses.replace(
            pool, num_pages=pool.resolved_num_pages(), memory_bytes=None), backend, self.pool_config.format.dtype,
            threads)  # fmt: skip

    def start(self) -> TensorParallel:
        """Start the workers, wait until each has built its rank (up to ``START_TIMEOUT``
        seconds) and join the process group; returns self. RuntimeError (with a worker's
        traceback) when one fails, and nothing is left running then."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process")  # fmt: skip
        world = self.world
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        ctx = mp.get_context("spawn")
        try:
            for rank in range(1, world):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(rank, world, store.port, self._spec, child),
                                   name=f"radixkv-tp{rank}", daemon=True)  # fmt: skip
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self._wait_ready()
            _init_group(self.device, 0, world, store)
        except BaseException:
            self._stop()
            raise
        self.model.all_reduce = _all_reduce
        self.failed = None
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        waiting = set(range(len(self._conns)))
        while waiting:
            for i in sorted(waiting):
                conn, proc = self._conns[i], self._procs[i]
                if conn.poll(0.05):
                    try:
                        kind, text = conn.recv()
                    except EOFError:
                        kind, text = "error", "exited"
                    if kind != "ready":
                        raise RuntimeError(f"tensor-parallel rank {i + 1} failed to start:\n{text}")
                    waiting.discard(i)
                elif not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {i + 1} exited while starting (code {proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers not ready after {START_TIMEOUT:.0f} s")

    def forward(self, batch: ForwardBatch, pool: KVPool, backend, all_logits: bool = False) -> torch.Tensor:
        """``LlamaModel.forward`` on every rank: rank 0's logits (the workers compute
        theirs and drop them). Writes each rank's KV shard. Raises RuntimeError once the
        workers have failed."""
        if self.failed is not None:
            raise RuntimeError(f"tensor-parallel workers stopped: {self.failed}")
        try:
            header, packed = _pack(batch)
            for conn in self._conns:
                conn.send(("step", header))
            if self.world > 1:
                dist.broadcast(packed, src=0)
            return self.model.forward(batch, pool, backend, all_logits)
        except BaseException as e:  # KeyboardInterrupt and the like too: the ranks are out of step all the same
            self.failed = f"{type(e).__name__}: {e}"
            self._stop()
            if isinstance(e, Exception):
                raise RuntimeError(f"tensor-parallel step failed (the workers are stopped): {self.failed}") from e
            raise

    def alive(self) -> bool:
        """True while every worker runs."""
        return all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers (ranks 1..N-1)."""
        return [p.pid for p in self._procs]

    def close(self) -> None:
        """Stop the workers (joined; killed after ``STOP_TIMEOUT``) and leave the process
        group. Idempotent."""
        if self.failed is None:
            self.failed = "closed"
        self._stop()

    def _stop(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        if dist.is_initialized():  # first: a worker caught in a collective then fails at once
            dist.destroy_process_group()
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop: killing it", proc.pid)
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
