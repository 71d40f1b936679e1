"""KV page stores: pages kept outside the pool, under keys that cannot be confused, and
entries verified before use.

A page of the prefix cache can outlive its pool in a store: a local persistent one that
processes on one machine share (LMDB: one memory-mapped file, transactions, many reader
processes) or a shared one across machines (the Redis protocol: Redis or Valkey). The
tree's tiers (radixkv.cache.tiers) write evicted pages there and read them back.

**Keys.** A page's key is a SHA-256 chain over the token ids of the whole pages up to
and including it, from a seed that says everything else a page's bytes depend on:

    seed    = sha256("radixkv/page-key/v1" || for each field, by name: len, name, len, value)
    key_0   = sha256(seed    || page 0's token ids, uint32 little-endian)
    key_i   = sha256(key_i-1 || page i's token ids)

The seed's fields (``key_seed``): the weights' fingerprint as loaded (a hash of the
tensors, not the file name), the tokenizer's, the KV layout (layers, KV heads, head
size, page size, tensor-parallel slice), the KV format's identity (scale file hash,
rotation), the eviction view and the cache salt. Two pages share a key only when all
of those and every token before them are equal. No Python ``hash()``: keys are the same
in every process and after every restart.

**Entries.** What a store holds under a key (``encode_entry``):

    magic "RKVP" | version u16 | flags u16 | key 32 B | layout length u32 | payload length u64
    | sha256(payload) 32 B | layout (UTF-8 JSON) | payload | HMAC-SHA256(secret, all before) 32 B (flag 1)

``decode_entry`` checks every field against what the reader expects (its key, its
layout, the payload's length and checksum, the HMAC when a secret is configured): any
mismatch raises ``BadEntry``, and ``PageStore`` turns that into a miss, deletes the entry
and counts it; a bad entry is never used. Both engines write an entry atomically (an
LMDB transaction, one Redis SET).

**Engines** (``KVStore``): ``LMDBStore`` (``lmdb:PATH``; its own size bound, least
recently used first) and ``RedisStore`` (``redis://HOST:PORT/DB``; bounded by the
server's ``maxmemory`` and eviction policy). ``open_store(spec)`` picks one by the
spec's form.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

KEY_BYTES = 32
_KEY_DOMAIN = b"radixkv/page-key/v1"
MAGIC = b"RKVP"
VERSION = 1
_FLAG_HMAC = 1
_HEADER = struct.Struct("<4sHH32sIQ32s")  # magic, version, flags, key, layout length, payload length, checksum
SEED_FIELDS = ("weights", "tokenizer", "layout", "kv_format", "view", "salt")


# -- keys ----------------------------------------------------------------------------------


def key_seed(**fields: str | bytes) -> bytes:
    """The seed of a page-key chain from the fields a page's bytes depend on besides its
    tokens (``SEED_FIELDS``; each a str or bytes, "" when it does not apply). Every
    field is length-prefixed, so no two field lists encode alike. Raises ValueError
    naming a missing or unknown field."""
    unknown = set(fields) - set(SEED_FIELDS)
    missing = set(SEED_FIELDS) - set(fields)
    if unknown or missing:
        raise ValueError(f"key_seed takes exactly the fields {', '.join(SEED_FIELDS)}; "
                         f"unknown: {sorted(unknown)}, missing: {sorted(missing)}")  # fmt: skip
    h = hashlib.sha256(_KEY_DOMAIN)
    for name in SEED_FIELDS:
        value = fields[name]
        value = value.encode() if isinstance(value, str) else bytes(value)
        h.update(struct.pack("<I", len(name)) + name.encode() + struct.pack("<Q", len(value)) + value)
    return h.digest()


def page_keys(seed: bytes, tokens, page_size: int, start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """Keys of the whole pages of ``tokens`` (token ids, each in [0, 2^32)) from page
    ``start`` on: ``parent`` is the key of page ``start - 1`` (None: ``start`` must be 0
    and the chain starts at ``seed``). A trailing partial page has no key."""
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token ids must lie in [0, 2^32) to be keyed")
    if parent is None and start != 0:
        raise ValueError("page_keys from a page other than 0 needs its parent key")
    data = ids.astype("<u4").tobytes()
    prev, keys, step = parent or seed, [], 4 * page_size
    for i in range(start, ids.size // page_size):
        prev = hashlib.sha256(prev + data[i * step : (i + 1) * step]).digest()
        keys.append(prev)
    return keys


# -- entries -------------------------------------------------------------------------------


class BadEntry(ValueError):
    """A stored entry that must not be used: ``reason`` says which check failed."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def encode_entry(key: bytes, layout: bytes, payload: bytes | memoryview, secret: bytes | None = None) -> bytes:
    """The bytes a store keeps for one page (see the module docstring)."""
    payload = memoryview(payload).cast("B")
    flags = _FLAG_HMAC if secret else 0
    head = _HEADER.pack(MAGIC, VERSION, flags, key, len(layout), payload.nbytes, hashlib.sha256(payload).digest())
    parts = [head, layout, payload]
    if secret:
        mac = hmac.new(secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(part)
        parts.append(mac.digest())
    return b"".join(parts)


def decode_entry(blob: bytes, key: bytes, layout: bytes, secret: bytes | None = None) -> memoryview:
    """The payload of an entry read under ``key``, after checking it all: magic and
    version, the key and layout it was written under, the lengths, the payload's
    checksum and, with ``secret``, its HMAC (an entry without one is refused). Raises
    ``BadEntry``."""
    view = memoryview(blob)
    if view.nbytes < _HEADER.size:
        raise BadEntry("truncated header")
    magic, version, flags, got_key, layout_len, payload_len, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise BadEntry(f"not a radixkv page entry of version {VERSION}")
    if got_key != key:
        raise BadEntry("written under another key")
    mac_len = KEY_BYTES if flags & _FLAG_HMAC else 0
    if view.nbytes != _HEADER.size + layout_len + payload_len + mac_len:
        raise BadEntry("length does not match its header (truncated or extended)")
    start = _HEADER.size + layout_len
    if view[_HEADER.size : start] != layout:
        raise BadEntry("another KV layout")
    payload = view[start : start + payload_len]
    if secret:
        if not mac_len:
            raise BadEntry("no HMAC, and this store requires one")
        mac = hmac.new(secret, view[: start + payload_len], hashlib.sha256).digest()
        if not hmac.compare_digest(mac, view[start + payload_len :]):
            raise BadEntry("HMAC does not match (another writer, or altered)")
    if hashlib.sha256(payload).digest() != checksum:
        raise BadEntry("payload checksum does not match")
    return payload


# -- engines -------------------------------------------------------------------------------


class StoreUnavailable(RuntimeError):
    """The store cannot be reached or used now (a server down, a file gone)."""


class KVStore:
    """A key -> bytes store of page entries. Engines implement these; ``PageStore``
    adds keys' meaning and verification. Methods raise ``StoreUnavailable`` when the
    store cannot be used."""

    spec = ""

    def longest_prefix(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first miss)."""
        raise NotImplementedError

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        """The entries under ``keys`` (None where there is none); a read counts as a use."""
        raise NotImplementedError

    def put(self, items: list[tuple[bytes, bytes]]) -> None:
        """Store (key, entry) pairs, each atomically, replacing what was there."""
        raise NotImplementedError

    def delete(self, keys: list[bytes]) -> int:
        """Remove ``keys``; returns how many were there."""
        raise NotImplementedError

    def clear(self) -> None:
        """Remove every entry of this store (its namespace only, in a shared server)."""
        raise NotImplementedError

    def usage(self) -> dict:
        """``entries``, ``bytes`` and ``max_bytes`` (None: bounded elsewhere or not at all)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


_ENVS: dict[str, tuple[object, int]] = {}  # resolved path -> (open environment, stores using it)
_ENVS_LOCK = threading.Lock()


class LMDBStore(KVStore):
    """Entries in one LMDB environment (a directory with ``data.mdb`` and ``lock.mdb``)
    that any number of processes on this machine open at once. Bounded by ``max_bytes``
    of entries: a write that goes past it removes the least recently used entries (a
    read is a use) in the same transaction. Readers never block the writer. Stores on
    one path in one process share one environment (LMDB allows one per process)."""

    _TOTAL = b"bytes"
    _TICK = b"tick"

    def __init__(self, path: str | Path, max_bytes: int = 8 << 30):
        import lmdb

        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"kv store max_bytes must be an int >= 1, got {max_bytes!r}")
        self.path, self.max_bytes, self.spec = Path(path), max_bytes, f"lmdb:{path}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._where = str(self.path.resolve())
            with _ENVS_LOCK:
                env, users = _ENVS.get(self._where, (None, 0))
                if env is None:
                    # the map is address space, not memory: room for the bound, its B-tree pages and slack
                    env = lmdb.open(self._where, map_size=2 * max_bytes + (256 << 20), max_dbs=4,
                                    subdir=True, readahead=False, metasync=False)  # fmt: skip
                _ENVS[self._where] = (env, users + 1)
            self.env = env
        except (OSError, lmdb.Error) as e:
            raise StoreUnavailable(f"kv_store lmdb:{path}: cannot open: {e}") from None
        self._lmdb = lmdb
        self.entries = self.env.open_db(b"entries")
        self.meta = self.env.open_db(b"meta")  # key -> (last use tick, entry size)
        self.order = self.env.open_db(b"order")  # tick (big-endian) -> key: least recent first
        self.totals = self.env.open_db(b"totals")

    def _guard(self, fn):
        try:
            return fn()
        except self._lmdb.Error as e:
            raise StoreUnavailable(f"kv_store {self.spec}: {e}") from None

    def longest_prefix(self, keys):
        def run():
            with self.env.begin(db=self.entries) as txn:
                cursor = txn.cursor()
                n = 0
                for key in keys:
                    if not cursor.set_key(key):
                        break
                    n += 1
                return n

        return self._guard(run)

    def get(self, keys):
        def run():
            with self.env.begin(db=self.entries, buffers=False) as txn:
                got = [txn.get(k) for k in keys]
            hits = [k for k, v in zip(keys, got) if v is not None]
            if hits:
                with self.env.begin(write=True) as txn:
                    tick = self._next_tick(txn, len(hits))
                    for k in hits:
                        old = txn.get(k, db=self.meta)
                        if old is None:  # removed between the two transactions
                            continue
                        old_tick, size = struct.unpack("<QQ", old)
                        txn.delete(struct.pack(">Q", old_tick), db=self.order)
                        txn.put(k, struct.pack("<QQ", tick, size), db=self.meta)
                        txn.put(struct.pack(">Q", tick), k, db=self.order)
                        tick += 1
            return got

        return self._guard(run)

    def put(self, items):
        def run():
            with self.env.begin(write=True) as txn:
                total = self._total(txn)
                tick = self._next_tick(txn, len(items))
                for key, blob in items:
                    total -= self._remove(txn, key)
                    txn.put(key, blob, db=self.entries)
                    txn.put(key, struct.pack("<QQ", tick, len(blob)), db=self.meta)
                    txn.put(struct.pack(">Q", tick), key, db=self.order)
                    total += len(blob)
                    tick += 1
                cursor = txn.cursor(db=self.order)
                while total > self.max_bytes and cursor.first():  # least recently used first
                    total -= self._remove(txn, cursor.value())
                txn.put(self._TOTAL, struct.pack("<Q", total), db=self.totals)

        self._guard(run)

    def delete(self, keys):
        def run():
            with self.env.begin(write=True) as txn:
                total, gone = self._total(txn), 0
                for key in keys:
                    size = self._remove(txn, key)
                    total -= size
                    gone += size > 0
                txn.put(self._TOTAL, struct.pack("<Q", total), db=self.totals)
                return gone

        return self._guard(run)

    def clear(self):
        def run():
            with self.env.begin(write=True) as txn:
                for db in (self.entries, self.meta, self.order, self.totals):
                    txn.drop(db, delete=False)

        self._guard(run)

    def usage(self):
        def run():
            with self.env.begin() as txn:
                return {"entries": txn.stat(self.entries)["entries"], "bytes": self._total(txn),
                        "max_bytes": self.max_bytes}  # fmt: skip

        return self._guard(run)

    def close(self):
        with _ENVS_LOCK:
            env, users = _ENVS.get(self._where, (None, 0))
            if env is not self.env:
                return  # closed already
            if users > 1:
                _ENVS[self._where] = (env, users - 1)
            else:
                del _ENVS[self._where]
                env.close()

    def _remove(self, txn, key: bytes) -> int:
        """Delete ``key``'s entry and bookkeeping; returns the entry's size (0: none)."""
        old = txn.get(key, db=self.meta)
        if old is None:
            return 0
        tick, size = struct.unpack("<QQ", old)
        txn.delete(key, db=self.entries)
        txn.delete(key, db=self.meta)
        txn.delete(struct.pack(">Q", tick), db=self.order)
        return size

    def _total(self, txn) -> int:
        raw = txn.get(self._TOTAL, db=self.totals)
        return struct.unpack("<Q", raw)[0] if raw else 0

    def _next_tick(self, txn, n: int) -> int:
        raw = txn.get(self._TICK, db=self.totals)
        tick = struct.unpack("<Q", raw)[0] if raw else 1
        txn.put(self._TICK, struct.pack("<Q", tick + n), db=self.totals)
        return tick


def masked_url(url: str) -> str:
    """``url`` with its password (if any) shown as ``***``."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "redis://***"
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}{port}"))


class RedisStore(KVStore):
    """Entries in a Redis or Valkey server (``redis://HOST:PORT/DB``), under
    ``radixkv:kv:<key>``. The server bounds them: set its ``maxmemory`` and an LRU
    eviction policy (``allkeys-lru``); ``usage`` reports both. A read is a use (the
    server's LRU clock)."""

    PREFIX = b"radixkv:kv:"

    def __init__(self, url: str, timeout_s: float = 2.0):
        import redis

        self.spec, self._redis = masked_url(url), redis  # what /stats and errors show: never the password
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _guard(self, fn):
        try:
            return fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as e:
            raise StoreUnavailable(f"kv_store {self.spec}: {e}") from None

    def longest_prefix(self, keys):
        def run():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.PREFIX + key)
            n = 0
            for present in pipe.execute():
                if not present:
                    break
                n += 1
            return n

        return self._guard(run) if keys else 0

    def get(self, keys):
        return self._guard(lambda: self.client.mget([self.PREFIX + k for k in keys])) if keys else []

    def put(self, items):
        def run():
            pipe = self.client.pipeline(transaction=False)
            for key, blob in items:
                pipe.set(self.PREFIX + key, blob)
            pipe.execute()

        if items:
            self._guard(run)

    def delete(self, keys):
        return self._guard(lambda: self.client.delete(*[self.PREFIX + k for k in keys])) if keys else 0

    def clear(self):
        def run():
            batch = []
            for name in self.client.scan_iter(match=self.PREFIX + b"*", count=1000):
                batch.append(name)
                if len(batch) == 1000:
                    self.client.delete(*batch)
                    batch = []
            if batch:
                self.client.delete(*batch)

        self._guard(run)

    @property
    def max_bytes(self) -> int | None:
        """The server's ``maxmemory`` now (None: unbounded)."""
        return self._guard(lambda: self.client.info("memory").get("maxmemory") or None)

    def usage(self):
        def run():
            memory = self.client.info("memory")
            entries = sum(1 for _ in self.client.scan_iter(match=self.PREFIX + b"*", count=1000))
            return {"entries": entries, "bytes": memory.get("used_memory"), "max_bytes": memory.get("maxmemory") or None,
                    "policy": memory.get("maxmemory_policy")}  # fmt: skip

        return self._guard(run)

    def close(self):
        self.client.close()


class MemoryStore(KVStore):
    """Entries in this process's memory, at most ``max_entries`` of them, least recently
    used out first: the simulator's store tier (``radixkv sim --store-pages``)."""

    spec = "memory"

    def __init__(self, max_entries: int):
        from collections import OrderedDict

        self.max_entries = max_entries
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()

    def longest_prefix(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self._entries:
            n += 1
        return n

    def get(self, keys):
        out = []
        for key in keys:
            blob = self._entries.get(key)
            if blob is not None:
                self._entries.move_to_end(key)
            out.append(blob)
        return out

    def put(self, items):
        for key, blob in items:
            self._entries.pop(key, None)
            self._entries[key] = blob
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def delete(self, keys):
        return sum(self._entries.pop(k, None) is not None for k in keys)

    def clear(self):
        self._entries.clear()

    def usage(self):
        return {"entries": len(self._entries), "bytes": sum(map(len, self._entries.values())), "max_bytes": None}


def check_store_spec(spec, field: str = "kv_store") -> str:
    """``spec``'s engine (``lmdb`` or ``redis``), or ValueError naming ``field``."""
    if isinstance(spec, str) and spec.startswith("lmdb:") and len(spec) > 5:
        return "lmdb"
    if isinstance(spec, str) and spec.startswith(("redis://", "rediss://", "valkey://")) and len(spec.split("://", 1)[1]):
        return "redis"
    raise ValueError(f"{field} must be lmdb:PATH or redis://HOST:PORT/DB, got {spec!r}")


def open_store(spec: str, max_bytes: int = 8 << 30, field: str = "kv_store") -> KVStore:
    """An engine by ``spec``: ``lmdb:PATH`` (``max_bytes`` bounds it) or
    ``redis://HOST:PORT/DB`` (the server's ``maxmemory`` bounds it; ``rediss://`` for
    TLS, ``valkey://`` the same as ``redis://``). Raises ValueError naming ``field``
    for another form."""
    if check_store_spec(spec, field) == "lmdb":
        return LMDBStore(spec[5:], max_bytes)
    return RedisStore(spec.replace("valkey://", "redis://", 1))


# -- verified pages -----------------------------------------------------------------------


@dataclass
class StoreStats:
    """What a ``PageStore`` did, for /metrics and /stats."""

    hits: int = 0  # pages read and verified
    misses: int = 0
    writes: int = 0  # pages written
    read_bytes: int = 0
    write_bytes: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    corrupt: int = 0  # entries refused by decode_entry (and deleted)
    corrupt_reasons: dict = field(default_factory=dict)
    unavailable: int = 0  # operations that found the store unreachable (treated as misses)


class PageStore:
    """A ``KVStore`` seen as pages of one pool: keys from one seed, entries encoded and
    checked against one layout (and a secret, for a shared store). A bad entry is a
    miss, deleted and counted; an unreachable store is a miss for ``retry_s`` seconds
    (operations are not attempted meanwhile), so serving goes on from the other tiers.
    Thread-safe for its counters; the engines are used from one thread at a time."""

    def __init__(self, store: KVStore, layout: dict, secret: bytes | None = None, retry_s: float = 5.0):
        self.store, self.secret, self.retry_s = store, secret, retry_s
        self.layout = json.dumps(layout, sort_keys=True, separators=(",", ":")).encode()
        self.stats = StoreStats()
        self._down_until = 0.0
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def longest_prefix(self, keys: list[bytes]) -> int:
        """Leading ``keys`` the store holds (unverified: ``load`` checks each entry)."""
        return self._try(lambda: self.store.longest_prefix(keys), 0) if keys else 0

    def load(self, keys: list[bytes]) -> list[memoryview | None]:
        """The verified payloads of ``keys``; None for a miss or a refused entry."""
        if not keys:
            return []
        t0 = time.perf_counter()
        blobs = self._try(lambda: self.store.get(keys), None)
        if blobs is None:
            return [None] * len(keys)
        out, bad = [], []
        for key, blob in zip(keys, blobs):
            if blob is None:
                out.append(None)
                continue
            try:
                out.append(decode_entry(blob, key, self.layout, self.secret))
            except BadEntry as e:
                bad.append(key)
                out.append(None)
                with self._lock:
                    self.stats.corrupt += 1
                    self.stats.corrupt_reasons[e.reason] = self.stats.corrupt_reasons.get(e.reason, 0) + 1
        if bad:
            self._try(lambda: self.store.delete(bad), 0)
        with self._lock:
            found = [p for p in out if p is not None]
            self.stats.hits += len(found)
            self.stats.misses += len(out) - len(found)
            self.stats.read_bytes += sum(len(b) for b in blobs if b is not None)
            self.stats.read_s += time.perf_counter() - t0
        return out

    def save(self, keys: list[bytes], payloads: list) -> bool:
        """Write pages (``payloads``: bytes-like, one per key). Returns False when the
        store was unavailable (nothing written)."""
        if not keys:
            return True
        t0 = time.perf_counter()
        items = [(k, encode_entry(k, self.layout, p, self.secret)) for k, p in zip(keys, payloads)]
        ok = self._try(lambda: self.store.put(items) or True, False)
        if ok:
            with self._lock:
                self.stats.writes += len(items)
                self.stats.write_bytes += sum(len(b) for _, b in items)
                self.stats.write_s += time.perf_counter() - t0
        return ok

    def clear(self) -> None:
        self._try(self.store.clear, None)

    def usage(self) -> dict:
        return self._try(self.store.usage, {"entries": None, "bytes": None, "max_bytes": None})

    def max_bytes(self) -> int | None:
        """The store's bound in bytes (LMDB's ``max_bytes``, a Redis server's
        ``maxmemory``), for ``/stats`` and a router that bounds what it expects there;
        None when it has none or cannot be reached."""
        return self._try(lambda: getattr(self.store, "max_bytes", None), None)

    def _try(self, fn, fallback):
        if not self.available:
            return fallback
        try:
            return fn()
        except StoreUnavailable:
            with self._lock:
                self.stats.unavailable += 1
            self._down_until = time.monotonic() + self.retry_s
            return fallback
