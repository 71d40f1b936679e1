"""Cache tiers below the device pool: a host tier in RAM and a store (LMDB, Redis).

Without tiers an evicted page is gone. With them, the tree's eviction *demotes* a page
(its bytes, ``KVPool.read_pages``) to the next tier down, and an admission whose tree
match ends early looks further down for the pages that follow and *promotes* the longest
run it finds into fresh pool pages before the prefill (``KVCacheManager.admit``):

    device pool (the tree)  --evict-->  host tier (RAM, LRU)  --overflow-->  store
            ^                                 |                               |
            +------ promote: the run of pages following the tree's match -----+

Every page below the device is named by its key (``radixkv.cache.store.page_keys``):
a chain over the tokens up to its end from a seed of the weights' fingerprint, the
tokenizer's, the KV layout, the format's identity and the namespace (cache salt), so a
page is only ever found under the exact prefix, model and format that computed it. The
store verifies each entry before use (``PageStore``); the host tier lives in this
process and holds raw bytes.

Writes to the store: ``write="back"`` (default) writes a page when it leaves the last
tier above the store (evicted from the device without a host tier, or pushed out of
the host tier); ``write="through"`` writes every page when the tree first takes it, so
another process (or this one after a restart) finds it at once. Single-threaded: the
engine's loop owns the tiers, as it owns the pool and the tree.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from radixkv.cache.compress import ViewNamespace
from radixkv.cache.store import PageStore, key_seed, page_keys

WRITE_POLICIES = ("back", "through")


class HostTier:
    """Pages in host memory below the device pool: page key -> the page's bytes,
    bounded by ``max_bytes``, least recently used out first. ``page_cost``: what one
    page counts against the bound instead of its bytes (the simulator's pages have
    none: there ``max_bytes`` counts pages at cost 1)."""

    def __init__(self, max_bytes: int, page_cost: int | None = None):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ValueError(f"host_cache_bytes must be an int >= 1, got {max_bytes!r}")
        self.max_bytes, self.page_cost = max_bytes, page_cost
        self.bytes = 0
        self._pages: OrderedDict[bytes, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pages)

    def run(self, keys: list[bytes]) -> list[np.ndarray]:
        """The pages of the leading ``keys`` held here (stops at the first miss); each
        becomes the most recently used."""
        out = []
        for key in keys:
            row = self._pages.get(key)
            if row is None:
                break
            self._pages.move_to_end(key)
            out.append(row)
        return out

    def put(self, keys: list[bytes], rows: np.ndarray) -> list[tuple[bytes, np.ndarray]]:
        """Hold ``rows`` (one page's bytes each) under ``keys``; returns the pages pushed
        out to stay within the bound (least recent first; possibly some just put)."""
        for key, row in zip(keys, rows):
            old = self._pages.pop(key, None)
            if old is not None:
                self.bytes -= self._cost(old)
            self._pages[key] = row = np.array(row, copy=True)  # not a view: it would keep its whole batch alive
            self.bytes += self._cost(row)
        out = []
        while self.bytes > self.max_bytes and self._pages:
            key, row = self._pages.popitem(last=False)
            self.bytes -= self._cost(row)
            out.append((key, row))
        return out

    def _cost(self, row: np.ndarray) -> int:
        return row.nbytes if self.page_cost is None else self.page_cost

    def clear(self) -> None:
        self._pages.clear()
        self.bytes = 0


@dataclass
class TierStats:
    """Tokens served from each tier below the device (the device's are the tree's)."""

    host_hit_tokens: int = 0
    store_hit_tokens: int = 0
    demoted_pages: int = 0  # pages the device evicted into a lower tier
    promoted_pages: int = 0


class KVTiers:
    """The tiers below one ``KVPool``: an optional ``HostTier`` and an optional
    ``PageStore``. ``weights``, ``tokenizer``: their fingerprints (hex digests, see
    ``weights_fingerprint``), part of every page key. Over a bare ``PageAllocator``
    (the simulator: pages without bytes) give ``page_size``."""

    def __init__(self, pool, weights: str, tokenizer: str, host: HostTier | None = None,
                 store: PageStore | None = None, write: str = "back", page_size: int | None = None):  # fmt: skip
        if write not in WRITE_POLICIES:
            raise ValueError(f"kv_store_write must be one of {', '.join(WRITE_POLICIES)}, got {write!r}")
        self.pool, self.host, self.store, self.write = pool, host, store, write
        self.page_size = page_size or pool.page_size
        self.layout = layout(pool) if hasattr(pool, "config") else {"page_size": self.page_size}
        self._fields = dict(weights=weights, tokenizer=tokenizer, kv_format=self.layout.get("kv_format", ""), view="",
                            layout=json.dumps(self.layout, sort_keys=True))  # fmt: skip
        self._seeds: dict[object, bytes] = {}
        self.stats = TierStats()

    def seed(self, namespace) -> bytes:
        """The key seed of ``namespace`` (None: no salt; a namespace is a str)."""
        seed = self._seeds.get(namespace)
        if seed is None:
            salt = "" if namespace is None else "salt:" + str(namespace)
            seed = self._seeds[namespace] = key_seed(**self._fields, salt=salt)
        return seed

    def keys(self, tokens, namespace) -> list[bytes]:
        """Keys of the whole pages of ``tokens`` (int32 ids)."""
        return page_keys(self.seed(namespace), np.asarray(tokens, dtype=np.int64), self.page_size)

    # -- down: eviction ------------------------------------------------------------------

    def demote(self, leaf, keep: int) -> tuple[list[bytes], list[bytes]] | None:
        """``RadixCache.on_evict``: the device drops ``leaf.pages[keep:]``; keep their
        bytes in the next tier down (host; else the store, when writing back). Returns
        (their keys, the keys the host tier pushed out) when the host tier took them,
        else None."""
        dropped = leaf.pages[keep:]
        if not len(dropped) or (self.host is None and (self.store is None or self.write == "through")):
            return None
        if isinstance(leaf.namespace, ViewNamespace):  # computed on a long-context view: device only
            return None
        keys = self.keys(np.frombuffer(leaf.path_key(), dtype=np.int32), leaf.namespace)  # the path's whole pages
        keys = keys[len(keys) - len(dropped) :]  # the leaf's pages end the path
        rows = self.pool.read_pages(dropped)
        self.stats.demoted_pages += len(dropped)
        if self.host is None:
            self.store.save(keys, list(rows))
            return None
        pushed = self.host.put(keys, rows)
        if pushed and self.store is not None and self.write == "back":
            self.store.save([k for k, _ in pushed], [r for _, r in pushed])
        return keys, [k for k, _ in pushed]

    # -- up: admission ---------------------------------------------------------------------

    def fetch(self, tokens, namespace, start: int, limit: int) -> np.ndarray | None:
        """The bytes of the longest run of whole pages of ``tokens`` from page ``start``
        that the lower tiers hold (host first, then the store; at most ``limit``
        pages), as ``[n, page_bytes]`` uint8, or None for none."""
        if self.store is None and (self.host is None or not len(self.host)):
            return None  # nothing below the device: skip hashing the prompt
        keys = self.keys(tokens, namespace)[start : start + limit]
        rows: list[np.ndarray] = []
        while len(rows) < len(keys):  # the run may alternate: the host holds what left the device last
            rest = keys[len(rows) :]
            got = self.host.run(rest) if self.host is not None else []
            self.stats.host_hit_tokens += len(got) * self.page_size
            rest = rest[len(got) :]
            if rest and self.store is not None:
                found = self.store.longest_prefix(rest)
                for payload in self.store.load(rest[:found]) if found else []:
                    if payload is None:  # refused (and deleted) by verification: the run ends here
                        break
                    got.append(np.frombuffer(payload, dtype=np.uint8))
                    self.stats.store_hit_tokens += self.page_size
            if not got:
                break
            rows += got
        if not rows:
            return None
        self.stats.promoted_pages += len(rows)
        return np.stack(rows)

    def published(self, tokens, namespace, pages, first: int, end: int) -> None:
        """The tree took pages ``first..end-1`` of ``tokens`` (``pages``: the page
        table): with ``write="through"``, store them now."""
        if self.store is None or self.write != "through" or end <= first or isinstance(namespace, ViewNamespace):
            return
        keys = self.keys(np.asarray(tokens[: end * self.page_size]), namespace)[first:end]
        self.store.save(keys, list(self.pool.read_pages(pages[first:end])))

    # -- operations ------------------------------------------------------------------------

    def flush(self, tier: str) -> None:
        """Empty ``host`` or ``store`` (nothing when this has no such tier)."""
        if tier == "host" and self.host is not None:
            self.host.clear()
        if tier == "store" and self.store is not None:
            self.store.clear()

    def snapshot(self) -> dict:
        """What /stats reports per tier."""
        out: dict = {"write": self.write, **self.stats.__dict__}
        if self.host is not None:
            out["host"] = {"pages": len(self.host), "bytes": self.host.bytes, "max_bytes": self.host.max_bytes}
        if self.store is not None:
            s = self.store.stats
            out["store"] = {"spec": self.store.store.spec, "available": self.store.available, "hits": s.hits,
                            "misses": s.misses, "writes": s.writes, "read_bytes": s.read_bytes,
                            "write_bytes": s.write_bytes, "read_s": s.read_s, "write_s": s.write_s,
                            "corrupt": s.corrupt, "corrupt_reasons": dict(s.corrupt_reasons),
                            "unavailable": s.unavailable, "max_bytes": self.store.max_bytes(),
                            "page_bytes": self.layout.get("page_bytes"),
                            "kv_format": self.layout.get("kv_format")}  # fmt: skip
        return out


def layout(pool) -> dict:
    """What a page's bytes are laid out as in ``pool`` (also each entry's header)."""
    c = pool.config
    return {"layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "page_size": c.page_size,
            "kv_format": pool.identity, "page_bytes": pool.page_bytes,
            "tp": "1/1"}  # fmt: skip


def weights_fingerprint(model) -> str:
    """SHA-256 over the model's configuration and tensors as loaded (names, dtypes,
    shapes, bytes; native matrices as GGUF's blocks, not the layout this CPU's kernels
    store them in, which gives the same values) and, where not the default 16, the bits
    native weights round their inputs to: the weights, not the file name, so two
    checkpoints served under one name never share pages, nor one checkpoint at two
    activation precisions, while one checkpoint on two builds (panels or split rows) does."""
    h = hashlib.sha256(repr(model.config).encode())
    if model.activation_bits != 16:  # the same weights compute other KV from rounder inputs
        h.update(f"activation_bits|{model.activation_bits}|".encode())
    for name, t in model.tensors(stored=False):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer, vocab_size: int) -> str:
    """SHA-256 over the tokenizer's vocabulary (every id's token string)."""
    h = hashlib.sha256()
    for i in range(vocab_size):
        tok = tokenizer.id_to_token(i)
        h.update((tok if tok is not None else "\x00<none>").encode("utf-8", "surrogatepass") + b"\x00")
    return h.hexdigest()
