"""EngineConfig: the settings of an engine, read by its client side and its loop."""

from __future__ import annotations

import os
from dataclasses import dataclass

from radixkv.cache.events import check_endpoint, check_format
from radixkv.cache.formats import KVFormat, kv_format
from radixkv.cache.pins import MAX_TTL
from radixkv.cache.store import check_store_spec
from radixkv.cache.tiers import WRITE_POLICIES
from radixkv.kernels.weights import check_activation_bits
from radixkv.model.loader import as_dtype, check_native, has_native_weights
from radixkv.model.registry import DEFAULT_MODEL
from radixkv.validate import check_float, check_int, check_optional_int


WEIGHTS = ("auto", "native", "fp32", "bf16", "fp16")


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


DEFAULT_KV_MEMORY_SHARE = 0.25  # of the memory available after loading: the KV pool when no size is given
MAX_KV_MEMORY_SHARE = 0.95
MAX_THREADS = 1024  # a sanity bound on the threads setting (torch refuses nothing)
PARTIAL_PAGES = ("auto", "on", "off")  # EngineConfig.partial_pages
KV_COMMIT = ("auto", "upfront", "lazy")  # when the CPU pool's memory is committed: EngineConfig.kv_commit
DENSE_WEIGHTS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings; the CLI's defaults come from here.

    KV capacity: ``kv_cache_tokens`` (tokens), ``memory_bytes`` (bytes) or
    ``kv_memory_share`` (that share of the memory still available once the weights are
    loaded, like vLLM's ``gpu_memory_utilization``), at most one; none of them means
    ``kv_memory_share`` = ``DEFAULT_KV_MEMORY_SHARE``.

    ``kv_commit``, on the CPU: ``upfront`` writes the whole pool once at start-up, so the
    system commits its memory then (as vLLM and llama.cpp do with theirs) and no forward
    pays the first write of a page; ``lazy`` leaves it to be committed as the cache first
    fills it, so a large pool costs resident memory only as it is used; ``auto``
    (default): upfront for a pool of a given size (``kv_cache_tokens``,
    ``memory_bytes``), lazy for a share of the memory available (the default pool, a
    quarter of what is free, stays out of resident memory until used).
    """

    model: str = DEFAULT_MODEL
    page_size: int = 16
    kv_cache_tokens: int | None = None
    memory_bytes: int | None = None
    kv_memory_share: float | None = None  # (0, 0.95]; None: DEFAULT_KV_MEMORY_SHARE unless a size is given
    kv_commit: str = "auto"  # auto | upfront | lazy: when the CPU pool's memory is committed (see above)
    device: str = "cpu"
    # CPU threads of the model's kernels (torch's intra-op threads, which radixkv's C kernels
    # take too; process-wide); None: torch's default (OMP_NUM_THREADS, else the cores)
    threads: int | None = None
    dtype: str = "float32"  # weights and activations
    # weights: native (a GGUF's quantized blocks read in place; activations float32 on the CPU, float32,
    # bfloat16 or float16 on CUDA), fp32 / bf16 / fp16 (expanded to that dtype: sets dtype; fp32 is the
    # exact mode), auto (native for a quantized GGUF when dtype is float32 on the CPU at tp 1, else
    # expanded to dtype)
    weights: str = "auto"
    # native weights on the CPU: the bits their inputs are rounded to per block of 32; 16, or 8 (llama.cpp's
    # precision: the Q4/Q5 types' prefill products 1.4-1.6x as fast, logits further from the exact mode)
    activation_bits: int = 16
    kv_dtype: str = "auto"  # the KV cache's format; auto: the weights' dtype
    kv_scales: str | None = None  # fp8 KV: a JSON scale file, or "unity"; no other format takes one
    attention_backend: str = "auto"
    policy: str = "lru"
    enable_prefix_cache: bool = True
    # a prefix match that ends inside a page takes the cached page's leading rows too (copied
    # into the request's own page; radixkv.cache.manager): auto (default) where it can, i.e.
    # tp 1 and a format whose rows copy apart (not int4's sealed pages); on requires that; off
    partial_pages: str = "auto"
    chunked_prefill_size: int | None = 512
    max_batch_tokens: int = 2048
    max_running: int = 64
    context_length: int | None = None  # tokens a sequence may span; None: the model's trained context (at most that)
    debug: bool = False  # check pool/tree integrity whenever the engine goes idle
    host_cache_bytes: int | None = None  # a host tier below the pool (RAM), in bytes; None: none
    kv_store: str | None = None  # a store below: lmdb:PATH or redis://HOST:PORT/DB; None: none
    kv_store_bytes: int = 8 << 30  # an LMDB store's size bound (a Redis server bounds itself: maxmemory)
    kv_store_write: str = "back"  # back: store pages as they leave the tiers above; through: as the tree takes them
    # pins, TTLs, hints, sessions (radixkv.cache.pins): the share of the pool pins and TTLs may
    # hold; how long a hint (a program's next step) and a session's entry wait, in seconds; how
    # long an idle engine keeps a waiting request out rather than give advice up
    max_pinned_share: float = 0.5
    hint_ttl: float = 30.0
    session_ttl: float = 300.0
    hint_hold: float = 1.0
    # KV events (radixkv.cache.events) for KV-aware routers: a ZMQ PUB endpoint to bind (None:
    # no events), a replay (ROUTER) endpoint, the topic, and how many batches replay keeps
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = "kv-events"
    kv_events_buffer: int = 10000
    kv_events_format: str = "array"  # the wire form (radixkv.cache.events.FORMATS): array (SGLang's) or map (vLLM's)
    # tensor parallelism (radixkv.model.tp): ranks the model's heads and MLP are split across
    # (gloo on the CPU, NCCL on CUDA); must divide the model's query and KV heads
    tp: int = 1

    @property
    def copies_partial_pages(self) -> bool:
        """Whether a match may end inside a page (``partial_pages``, auto resolved)."""
        if self.partial_pages == "auto":
            return self.enable_prefix_cache and self.tp == 1 and not self.kv_format.paged
        return self.partial_pages == "on"

    @property
    def kv_share(self) -> float | None:
        """The share of available memory the pool takes: ``kv_memory_share``, or its
        default when no size is given; None when a size is."""
        if self.kv_cache_tokens is not None or self.memory_bytes is not None:
            return None
        return self.kv_memory_share or DEFAULT_KV_MEMORY_SHARE

    @property
    def commits_upfront(self) -> bool:
        """Whether the pool's memory is written at start-up (``kv_commit``, ``auto`` resolved)."""
        if self.kv_commit == "auto":
            return self.kv_cache_tokens is not None or self.memory_bytes is not None
        return self.kv_commit == "upfront"

    def kv_pool_bytes(self, available: int | None) -> int | None:
        """The pool's byte budget when no token count is given: ``memory_bytes``, else
        ``kv_share`` of ``available`` bytes (1 GiB when that cannot be told); None with
        ``kv_cache_tokens``."""
        if self.kv_share is None:
            return self.memory_bytes
        return 1 << 30 if available is None else int(self.kv_share * available)

    def __post_init__(self):
        for name in ("page_size", "max_batch_tokens", "max_running", "kv_store_bytes", "tp"):
            check_int(name, getattr(self, name), 1)
        for name in ("kv_cache_tokens", "memory_bytes", "chunked_prefill_size", "host_cache_bytes", "context_length"):
            check_optional_int(name, getattr(self, name), 1)
        check_optional_int("threads", self.threads, 1, MAX_THREADS)
        sizes = [n for n in ("kv_cache_tokens", "memory_bytes", "kv_memory_share") if getattr(self, n) is not None]
        if len(sizes) > 1:
            raise ValueError(f"give at most one of kv_cache_tokens, memory_bytes and kv_memory_share (got {', '.join(sizes)})")
        if self.kv_memory_share is not None:
            check_float("kv_memory_share", self.kv_memory_share, 0.0, MAX_KV_MEMORY_SHARE, lo_open=True)
        if self.kv_commit not in KV_COMMIT:
            raise ValueError(f"kv_commit must be one of {', '.join(KV_COMMIT)}, got {self.kv_commit!r}")
        check_float("max_pinned_share", self.max_pinned_share, 0.0, 1.0)
        for name in ("hint_ttl", "session_ttl"):
            check_float(name, getattr(self, name), 0.0, MAX_TTL, lo_open=True)
        check_float("hint_hold", self.hint_hold, 0.0, 3600.0)
        as_dtype(self.dtype)
        self._check_weights()
        if self.kv_store is not None:
            check_store_spec(self.kv_store)
        if self.kv_store_write not in WRITE_POLICIES:
            raise ValueError(f"kv_store_write must be one of {', '.join(WRITE_POLICIES)}, got {self.kv_store_write!r}")
        if (self.host_cache_bytes or self.kv_store) and not self.enable_prefix_cache:
            raise ValueError("host_cache_bytes and kv_store are tiers of the prefix cache: they need enable_prefix_cache")
        self.kv_format.check_scales(self.kv_scales is not None)  # also a clear error for an unknown kv_dtype
        if self.tp > 1:  # what the workers cannot mirror (radixkv.model.tp): pool writes outside the forward
            if self.host_cache_bytes or self.kv_store:
                raise ValueError("tp > 1 does not support host_cache_bytes or kv_store yet (the tiers would copy "
                                 "rank 0's KV heads only)")  # fmt: skip
            if self.kv_format.paged:
                raise ValueError(f"tp > 1 does not support kv_dtype {self.kv_format.name} yet (a paged format's "
                                 "sealing follows the allocator, which only rank 0 has)")  # fmt: skip
        if self.partial_pages not in PARTIAL_PAGES:
            raise ValueError(f"partial_pages must be one of {', '.join(PARTIAL_PAGES)}, got {self.partial_pages!r}")
        if self.partial_pages == "on" and (self.tp > 1 or self.kv_format.paged or not self.enable_prefix_cache):
            raise ValueError("partial_pages on copies rows of cached pages outside the forward: it needs the prefix "
                             f"cache, tp 1 and a kv_dtype whose pages are not sealed whole (got tp={self.tp}, "
                             f"kv_dtype {self.kv_format.name}, enable_prefix_cache {self.enable_prefix_cache})")
        check_endpoint("kv_events", self.kv_events)
        check_endpoint("kv_events_replay", self.kv_events_replay)
        check_int("kv_events_buffer", self.kv_events_buffer, 1)
        check_format(self.kv_events_format)
        if self.kv_events_replay is not None and self.kv_events is None:
            raise ValueError("kv_events_replay replays kv_events: give kv_events too")
        if self.kv_events is not None and not self.enable_prefix_cache:
            raise ValueError("kv_events publish the prefix cache's pages: they need enable_prefix_cache")

    def _check_weights(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        dense = DENSE_WEIGHTS.get(self.weights)
        if dense is not None and self.dtype != dense:
            if self.dtype != "float32":
                raise ValueError(f"weights {self.weights} expands the weights to {dense}, but dtype is {self.dtype}: "
                                 "give one of them")  # fmt: skip
            object.__setattr__(self, "dtype", dense)  # the default float32 follows the weights
        check_activation_bits(self.activation_bits)
        if self.activation_bits != 16 and (self.weights not in ("native", "auto") or not self.device.startswith("cpu")):
            raise ValueError(f"activation_bits {self.activation_bits} needs weights native (or auto) on the CPU, got "
                             f"weights {self.weights} on {self.device}")  # fmt: skip
        if self.weights == "native":
            check_native(self.device, as_dtype(self.dtype))
            if self.tp > 1:
                raise ValueError("weights native does not support tp > 1 yet (the ranks split expanded weights): "
                                 "use weights fp32")  # fmt: skip

    def native_weights(self, source) -> bool:
        """Whether the model at ``source`` (a ModelSource) runs with native weights: asked
        for, or ``auto`` with a quantized GGUF, float32, the CPU and tp 1."""
        if self.weights != "auto":
            return self.weights == "native"
        plain = self.dtype == "float32" and self.device.startswith("cpu") and self.tp == 1
        return plain and has_native_weights(source)

    @property
    def kv_format(self) -> KVFormat:
        return kv_format(as_dtype(self.dtype) if self.kv_dtype == "auto" else self.kv_dtype)
