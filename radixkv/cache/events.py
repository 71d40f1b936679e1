"""KV events: what a replica's cache stores and drops, published for KV-aware routers.

Every change to the pages a replica can reuse becomes an event in the schema vLLM and
SGLang publish (msgspec structs, msgpack): ``BlockStored`` (pages entered a
tier, with their token ids and the hash of the page before them), ``BlockRemoved``
(pages left a tier) and ``AllBlocksCleared`` (a fresh start: sent when the publisher
opens, so a router drops what it knew of a replica that restarted). Two wire forms
(``FORMATS``), the batch an array ``[ts, events, data_parallel_rank]`` in both:

- ``array``: each event a list, its tag then its fields by position (``["BlockStored",
  hashes, parent, token ids, block size, lora id, medium]``): what SGLang publishes and
  vLLM did until its events became maps (vLLM pull request 42892, 2026), and what
  subscribers written for it decode;
- ``map``: each event a map with its tag under ``"type"`` and its fields by name
  (``lora_name`` too, as ``None``): what vLLM publishes now (0.32 decodes it here).

``decode`` reads either (a map's fields past the ones above, which newer vLLM
releases add, are ignored). The *medium* is the
tier: ``"GPU"`` for the device pool (vLLM's name for the KV memory the model reads,
whatever the device) and ``"CPU"`` for the host tier (vLLM's name for offloaded KV). A
page that leaves the device for the host tier is removed from ``GPU`` and stored on
``CPU``; a page promoted back is stored on ``GPU`` again (the host keeps its copy).
The store below them (LMDB, Redis) is shared or bounded by itself, so it is not tracked.

A page's *block hash* comes from its key in the chain the tiers' keys use
(``store.page_keys``: SHA-256 over whole pages' token ids), here from a seed of the cache
salt and the page size alone, so a router can compute it:

    key_seed(salt)  -->  k0 = H(seed, page 0 tokens)  -->  k1 = H(k0, page 1 tokens) ...

and the hash is a key's first 8 bytes, big-endian, shifted to 63 bits (a non-negative
int64: ``hash_of``). A router computes the same chain over a request's tokens
(``block_hashes``) and looks the hashes up: exact, page by page. Long-context views'
pages (computed on a reduced context) are never published: no request matches them
exactly.

``KVEventRecorder`` follows the tree (``RadixCache.on_insert``) and the tiers (through
``KVCacheManager``) and queues events; the engine's loop takes them after each step
(``take``) and ``ZmqEventPublisher`` sends each step's batch on a ZMQ PUB socket,
multipart ``[topic, seq (8 bytes, big-endian), payload]``, keeping the last
``buffer_steps`` batches for a ROUTER replay socket: a client sends the first sequence
number it wants and gets ``[seq, payload]`` for each buffered batch from there, then
``[-1, b""]``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Iterable, NamedTuple
from urllib.parse import urlsplit

import msgspec
import numpy as np

from radixkv.cache.store import page_keys
from radixkv.errors import FieldError

logger = logging.getLogger("radixkv.events")

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
END_SEQ = -1  # the replay socket's last frame: no more buffered batches


# -- the schema (vLLM's and SGLang's) ------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to a replica's cache."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# the map form: the same events, each a map of its fields by name, tagged under "type"


class _MapEvent(msgspec.Struct, gc=False, tag_field="type"):
    pass


class _StoredMap(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _RemovedMap(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _ClearedMap(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(EventBatch):
    events: list[_StoredMap | _RemovedMap | _ClearedMap]


FORMATS = ("array", "map")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_map_decoder = msgspec.msgpack.Decoder(_MapBatch)


_TO_MAP = {BlockStored: _StoredMap, BlockRemoved: _RemovedMap, AllBlocksCleared: _ClearedMap}
_FROM_MAP = {m: a for a, m in _TO_MAP.items()}  # the same fields, in the same order (a map's lora_name aside)


def _convert(ev, to: dict):
    kind = to[type(ev)]
    return kind(*msgspec.structs.astuple(ev)[: len(kind.__struct_fields__)])


def check_format(form: str) -> str:
    """``form`` when it is a wire form (``FORMATS``); FieldError naming kv_events_format if not."""
    if form not in FORMATS:
        raise FieldError("kv_events_format", f"kv_events_format must be one of {', '.join(FORMATS)}, got {form!r}")
    return form


def encode(batch: KVEventBatch, form: str = "array") -> bytes:
    """``batch`` as msgpack bytes in wire form ``form`` (``FORMATS``)."""
    if check_format(form) == "map":
        return _encoder.encode(_MapBatch(batch.ts, [_convert(e, _TO_MAP) for e in batch.events], batch.data_parallel_rank))
    return _encoder.encode(batch)


def decode(payload: bytes) -> KVEventBatch:
    """A batch from its msgpack bytes in either wire form; msgspec.DecodeError /
    ValidationError if malformed (the array form's error when neither form fits)."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as array_error:
        try:
            batch = _map_decoder.decode(payload)
        except msgspec.ValidationError:
            raise array_error from None
    return KVEventBatch(batch.ts, [_convert(e, _FROM_MAP) for e in batch.events], batch.data_parallel_rank)


# -- block hashes ----------------------------------------------------------------------------------


def key_seed(salt: str | None, page_size: int) -> bytes:
    """The chain's start for a cache salt (None: no salt)."""
    text = f"radixkv-kv-events/page_size={page_size}/salt=" + ("" if salt is None else "s:" + salt)
    return hashlib.sha256(text.encode()).digest()


def hash_of(key: bytes) -> int:
    """A page key's block hash: its first 8 bytes, big-endian, as a non-negative int64."""
    return int.from_bytes(key[:8], "big") >> 1


def block_hashes(tokens, salt: str | None, page_size: int) -> list[int]:
    """The block hashes of the whole pages of ``tokens`` under ``salt``: what a replica
    publishes for them once cached. ValueError for ids outside [0, 2^32)."""
    return [hash_of(k) for k in page_keys(key_seed(salt, page_size), tokens, page_size)]


def _exact(namespace) -> bool:
    """Namespaces whose pages are published: a cache salt or none (not a view's)."""
    return namespace is None or isinstance(namespace, str)


def tree_blocks(tree) -> set[int]:
    """The block hashes of every page ``tree`` holds, recomputed from its paths (not from
    a recorder): what a router fed by this replica's events should hold on ``GPU``."""
    ps, last, out = tree.page_size, {}, set()
    for node in tree.nodes():  # parents before children
        if not _exact(node.namespace):
            continue
        parent = node.parent
        prev = last[id(parent)] if parent.parent is not None else key_seed(node.namespace, ps)
        keys = page_keys(prev, np.frombuffer(node.key, dtype=np.int32), ps)
        last[id(node)] = keys[-1]
        out.update(map(hash_of, keys))
    return out


# -- the recorder: tree and tier changes -> events ---------------------------------------------------


class KVEventRecorder:
    """Turns the cache's changes into queued events. ``device``: page id -> page key
    (``store.page_keys`` from ``key_seed``) of every published page the tree holds;
    ``host``: host-tier key -> page key. Single-threaded (the engine's loop); ``take``
    hands the queue over."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.device: dict[int, bytes] = {}
        self.host: dict[bytes, bytes] = {}
        self._events: list[KVCacheEvent] = [AllBlocksCleared()]
        self.published_events = 0

    def take(self) -> list[KVCacheEvent]:
        """The events queued since the last call (emptied)."""
        out, self._events = self._events, []
        self.published_events += len(out)
        return out

    def stored(self, leaf) -> None:
        """``RadixCache.on_insert``: ``leaf`` (a new node) holds new pages on the device."""
        if not _exact(leaf.namespace):
            return
        parent, ps = leaf.parent, self.page_size
        parent_key = None
        if parent.parent is not None:
            parent_key = self.device.get(int(parent.pages[-1]))
            if parent_key is None:  # its prefix was never published: nothing to chain from
                return
        tokens = np.frombuffer(leaf.key, dtype=np.int32)
        keys = page_keys(parent_key or key_seed(leaf.namespace, ps), tokens, ps)
        self.device.update(zip(leaf.pages.tolist(), keys))
        self._events.append(BlockStored([hash_of(k) for k in keys], _hash(parent_key), tokens.tolist(), ps, None,
                                        MEDIUM_DEVICE))  # fmt: skip

    def evicting(self, leaf, keep: int) -> tuple[list[bytes], bytes | None, np.ndarray] | None:
        """The device drops ``leaf.pages[keep:]`` (the leaf still whole): queue their
        removal; return (their keys, the key of the page before them, their tokens) for a
        tier below that keeps them, or None when they were never published."""
        pages = leaf.pages[keep:].tolist()
        keys = [k for k in (self.device.pop(p, None) for p in pages) if k is not None]
        if not keys:
            return None
        self._events.append(BlockRemoved([hash_of(k) for k in keys], MEDIUM_DEVICE))
        if len(keys) != len(pages):
            return None
        if keep:
            before = self.device.get(int(leaf.pages[keep - 1]))
        elif leaf.parent.parent is not None:
            before = self.device.get(int(leaf.parent.pages[-1]))
        else:
            before = None
        tokens = np.frombuffer(leaf.key, dtype=np.int32)[keep * self.page_size :]
        return keys, before, tokens

    def demoted(self, moved: tuple[list[bytes], bytes | None, np.ndarray], tier_keys: list[bytes],
                pushed: Iterable[bytes]) -> None:  # fmt: skip
        """The host tier took the pages ``moved`` describes under ``tier_keys`` and pushed
        ``pushed`` out."""
        keys, before, tokens = moved
        new = [i for i, k in enumerate(tier_keys) if k not in self.host]
        self.host.update(zip(tier_keys, keys))
        if new:  # from the first new page on (stored again, a page the host held stays held)
            ps, first = self.page_size, new[0]
            parent = before if first == 0 else keys[first - 1]
            self._events.append(BlockStored([hash_of(k) for k in keys[first:]], _hash(parent),
                                            tokens[first * ps :].tolist(), ps, None, MEDIUM_HOST))  # fmt: skip
        gone = [k for k in (self.host.pop(t, None) for t in pushed) if k is not None]  # possibly some just put
        if gone:
            self._events.append(BlockRemoved([hash_of(k) for k in gone], MEDIUM_HOST))

    def host_cleared(self) -> None:
        """The host tier was emptied."""
        if self.host:
            self._events.append(BlockRemoved([hash_of(k) for k in self.host.values()], MEDIUM_HOST))
            self.host.clear()


def _hash(key: bytes | None) -> int | None:
    return None if key is None else hash_of(key)


# -- the publisher -------------------------------------------------------------------------------------


def check_endpoint(field: str, endpoint: str | None) -> str | None:
    """A ZMQ endpoint this process may bind: ``tcp://`` on a loopback address with a port,
    or ``ipc://PATH``. Another interface would publish prompts' token ids to the
    network, so it is refused. Returns the endpoint; ValueError naming ``field``."""
    if endpoint is None:
        return None
    if not isinstance(endpoint, str):
        raise ValueError(f"{field} must be a ZMQ endpoint string, got {type(endpoint).__name__}")
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or port is None or parts.hostname is None:
        raise ValueError(f"{field} must be tcp://127.0.0.1:PORT or ipc://PATH, got {endpoint!r}")
    host = parts.hostname
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback:
        raise ValueError(f"{field} must bind a loopback address (127.0.0.1, ::1, localhost), got {host!r}: "
                         "events carry prompts' token ids")  # fmt: skip
    return endpoint


class ZmqEventPublisher:
    """Sends event batches on a PUB socket (``endpoint``) from its own thread, numbering
    them from 0, and answers replay requests on a ROUTER socket (``replay_endpoint``,
    optional) from the last ``buffer_steps`` batches, each in wire form ``form``
    (``FORMATS``). ``publish`` may be called from any
    thread; ``close`` stops the thread and closes the sockets."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "kv-events",
                 buffer_steps: int = 10000, data_parallel_rank: int | None = None, form: str = "array"):  # fmt: skip
        import zmq

        self.form = check_format(form)

        self._zmq = zmq
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot bind {endpoint if self._replay is None else replay_endpoint}: {e}")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue = queue.Queue()
        self._seq = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="radixkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (nothing for no events)."""
        if events:
            self._queue.put(KVEventBatch(time.time(), events, self.rank))

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            try:
                batch = self._queue.get(timeout=0.005)
            except queue.Empty:
                batch = False
            if batch is None:
                return
            try:
                if batch is not False:
                    payload = encode(batch, self.form)
                    seq = self._seq.to_bytes(8, "big", signed=True)
                    self._pub.send_multipart((self.topic, seq, payload))
                    self._buffer.append((self._seq, payload))
                    self._seq += 1
                    self.sent += 1
                if self._replay is not None and poller.poll(0):
                    self._answer_replay()
            except Exception:  # keep publishing: a lost batch shows as a gap the subscriber replays
                logger.exception("kv events: publishing failed")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        ident, start = frames[0], frames[-1]  # [id, start] (DEALER) or [id, b"", start] (REQ)
        envelope = [ident, b""] if len(frames) == 3 else [ident]
        if len(start) != 8:
            self._replay.send_multipart([*envelope, END_SEQ.to_bytes(8, "big", signed=True), b""])
            return
        first = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([*envelope, seq.to_bytes(8, "big", signed=True), payload])
        self._replay.send_multipart([*envelope, END_SEQ.to_bytes(8, "big", signed=True), b""])


# -- the subscriber's side -------------------------------------------------------------------------------


def leading(keys, held) -> int:
    """How many of ``keys``, from the first, ``held`` contains (``in``)."""
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


class Overlap(NamedTuple):
    """How much of a request a replica holds: ``device`` pages from the start on the
    device, then ``lower`` more pages in a tier below it (host)."""

    device: int
    lower: int


class BlockIndex:
    """What one replica's cache holds, rebuilt from its events: block hash -> media.
    ``apply`` a batch; ``match`` a request's block hashes. Not thread-safe."""

    def __init__(self):
        self.device: set[int] = set()
        self.lower: dict[str, set[int]] = {}
        self.page_size: int | None = None
        self.batches = 0

    def __len__(self) -> int:
        return len(self.device) + sum(map(len, self.lower.values()))

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.page_size = ev.block_size
                self._medium(ev.medium).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self._medium(ev.medium).difference_update(ev.block_hashes)
            else:
                self.clear()
        self.batches += 1

    def clear(self) -> None:
        self.device.clear()
        self.lower.clear()

    def match(self, hashes: list[int]) -> Overlap:
        """The leading run of ``hashes`` on the device, then the run after it that some
        tier holds."""
        d = n = leading(hashes, self.device)
        if self.lower:
            tiers = [self.device, *self.lower.values()]
            while n < len(hashes) and any(hashes[n] in t for t in tiers):
                n += 1
        return Overlap(d, n - d)

    def blocks(self) -> dict[str, list[int]]:
        return {MEDIUM_DEVICE: sorted(self.device), **{m: sorted(s) for m, s in self.lower.items()}}

    def _medium(self, medium: str | None) -> set[int]:
        if medium is None or medium == MEDIUM_DEVICE:
            return self.device
        return self.lower.setdefault(medium, set())
