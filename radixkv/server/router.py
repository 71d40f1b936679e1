"""``radixkv router``: one HTTP front for N replicas, routing each request where its
prompt is cached.

    client --> router --(the replica with the least to prefill, plus load)--> replica i
                  ^                                                             |
                  +------ KV events: pages stored / removed, per tier ----------+

Modes, per replica:

- **events** (the replica publishes KV events, ``radixkv serve --kv-events``): the router
  tokenizes the prompt with the model's tokenizer and chat template, chains its pages'
  block hashes (``radixkv.cache.events``) and reads from each replica's ``BlockIndex``
  (rebuilt from its events: exact, per tier) how many leading pages it holds on the
  device and below it (host tier), and from what it routed there before (the prefix's
  home) how many it sent there. A replica's cost is the tokens it would prefill after
  the longer of the two runs (``host_page_cost`` of a page for one promoted from the
  host tier, ``store_page_cost`` for one read from a store) plus ``load_weight`` times
  the prefill still queued there by this router; the lowest wins (``choose_by_cost``).
  Replicas whose ``/stats`` name the same store (``--kv-store``) share it: what any of
  them wrote there (from their events: every page stored, with ``--kv-store-write
  through``; every page leaving memory, with ``back``) counts for all of them, past
  what each holds in memory. Between routing and the replica's events
  arriving, the routed prompt's pages count as the replica's cache for
  ``pending_seconds``.
- **approx** (any replica without events): SGLang's approximate mode. A text prefix tree
  per replica of the prompts routed there (16-character chunks, least recently used out
  past ``max_tree_chars``); when the in-flight requests are imbalanced (max - min >
  ``balance_abs_threshold`` and max > ``balance_rel_threshold`` x min) the least loaded
  replica, else the best match if it covers more than ``cache_threshold`` of the text,
  else the replica with the smallest tree.
- **round_robin** (``--policy round_robin``): the baseline.

A replica is healthy while ``GET /health`` answers 200 (checked every
``health_interval`` seconds and after each failure). A request that cannot reach its
replica, or whose connection breaks before the answer is complete (non-streaming) or
before its first byte (streaming), or that gets a 503, is sent to the next best
healthy replica: no request is lost while one replica lives. Every route the replicas
serve is forwarded (headers ``Authorization``, ``X-Cache-Salt``, ``X-Session-Id`` too);
the router's own routes are ``/health``, ``/metrics`` (Prometheus, per replica) and
``/router/state`` (``?blocks=1``: each index's block hashes).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import parse_qs

import msgspec

from radixkv.cache.events import (END_SEQ, MEDIUM_DEVICE, MEDIUM_HOST, BlockIndex, BlockRemoved, BlockStored,
                                  block_hashes, decode, leading)
from radixkv.model.registry import DEFAULT_MODEL
from radixkv.server import protocol as P
from radixkv.server.app import ClientGone, Http
from radixkv.validate import check_float, check_int

logger = logging.getLogger("radixkv.router")

POLICIES = ("cache_aware", "round_robin")
MODES = ("auto", "events", "approx")
FORWARD_HEADERS = ("authorization", "x-cache-salt", "x-session-id", "content-type", "accept")
GENERATION_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
ROUTED_ROUTES = (*GENERATION_ROUTES, "/pin")  # routed by their prompt: a pin lands where its prompt is served
UNSIZED_STORE_PAGES = 1 << 20  # pages remembered of a store that states no size (Redis without maxmemory)
BROADCAST_ROUTES = ("/flush_cache", "/unpin")  # sent to every replica: each holds its own cache and pins


@dataclass(frozen=True)
class RouterConfig:
    """Router settings; ``radixkv router``'s flags come from here."""

    replicas: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    model: str = DEFAULT_MODEL  # the replicas' model: its tokenizer and chat template (no weights load)
    policy: str = "cache_aware"
    mode: str = "auto"  # auto: events where every replica publishes them, else approx
    cache_threshold: float = 0.3
    events_cache_threshold: float = 0.1
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 1 << 24
    host_page_cost: float = 0.2
    store_page_cost: float = 0.1
    load_weight: float = 0.0
    pending_seconds: float = 10.0
    health_interval: float = 2.0
    request_timeout: float = 3600.0
    max_body_bytes: int = 64 << 20
    log_level: str = "warning"
    api_key: str | None = None  # the replicas' key, for the router's own calls (/stats); requests carry their own

    def __post_init__(self):
        if isinstance(self.replicas, str) or not all(isinstance(r, str) for r in self.replicas):
            raise ValueError(f"replicas must be a list of base URLs, got {self.replicas!r}")
        bad = [r for r in self.replicas if not r.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"replicas: {bad[0]!r} is not an http(s):// base URL")
        object.__setattr__(self, "replicas", tuple(r.rstrip("/") for r in self.replicas))
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_int("port", self.port, 0, 65535)
        check_int("balance_abs_threshold", self.balance_abs_threshold, 0)
        check_int("max_tree_chars", self.max_tree_chars, 1)
        check_int("max_body_bytes", self.max_body_bytes, 1)
        check_float("cache_threshold", self.cache_threshold, 0.0, 1.0)
        check_float("events_cache_threshold", self.events_cache_threshold, 0.0, 1.0)
        check_float("balance_rel_threshold", self.balance_rel_threshold, 1.0, 1e9)
        check_float("host_page_cost", self.host_page_cost, 0.0, 1.0)
        check_float("store_page_cost", self.store_page_cost, 0.0, 1.0)
        check_float("load_weight", self.load_weight, 0.0, 1e9)
        for name in ("pending_seconds", "health_interval", "request_timeout"):
            check_float(name, getattr(self, name), 0.0, 1e9, lo_open=name != "pending_seconds")


# -- approximate mode: a text prefix tree per replica ------------------------------------------------------

CHUNK = 16  # characters per node of the approximate tree


class TextTree:
    """Prompts routed to one replica, as chained hashes of ``CHUNK``-character chunks
    with their last use; least recently used chunks go past ``max_chars``. ``match``:
    the characters of the longest cached prefix."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self._chunks: OrderedDict[bytes, None] = OrderedDict()

    @property
    def chars(self) -> int:
        return len(self._chunks) * CHUNK

    @staticmethod
    def _keys(text: str) -> list[bytes]:
        data, prev, out = text.encode("utf-8", "surrogatepass"), b"", []
        for i in range(0, len(data) - CHUNK + 1, CHUNK):
            prev = hashlib.blake2b(prev + data[i : i + CHUNK], digest_size=8).digest()
            out.append(prev)
        return out

    def match(self, text: str) -> int:
        return leading(self._keys(text), self._chunks) * CHUNK

    def clear(self) -> None:
        self._chunks.clear()

    def insert(self, text: str) -> None:
        for k in self._keys(text):
            self._chunks[k] = None
            self._chunks.move_to_end(k)
        while self.chars > self.max_chars:
            self._chunks.popitem(last=False)


# -- per replica ---------------------------------------------------------------------------------------------


class SharedStore:
    """The pages replicas wrote to one store (LMDB file, Redis server), as their events
    tell: a bounded set of block hashes, least recently written out first (the store
    evicts on its own and does not publish it, so this is an estimate; a page it lost
    costs a prefill the router expected to save, never a wrong answer)."""

    def __init__(self, spec: str, limit: int, kv_format: str = ""):
        self.spec, self.limit, self.kv_format = spec, limit, kv_format
        self._pages: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pages)

    def add(self, hashes: list[int]) -> None:
        with self._lock:
            remember(self._pages, hashes, self.limit)

    def clear(self) -> None:
        """The store was emptied (a flush through the router)."""
        with self._lock:
            self._pages.clear()

    def run(self, hashes: list[int], start: int) -> int:
        """How many pages from ``hashes[start]`` on the store holds, in a row."""
        with self._lock:
            return leading(itertools.islice(hashes, start, None), self._pages)


def written_to_store(events, write: str, last_medium: str) -> list[int]:
    """The block hashes a replica's events say reached its store: with ``write``
    "through", every page stored (on any tier); with "back", every page leaving its last
    memory tier (``last_medium``: the host tier's with one, else the device's; a page the
    device hands to the host tier is not in the store yet)."""
    out: list[int] = []
    for ev in events:
        if write == "through" and isinstance(ev, BlockStored):
            out.extend(ev.block_hashes)
        elif write == "back" and isinstance(ev, BlockRemoved) and (ev.medium or MEDIUM_DEVICE) == last_medium:
            out.extend(ev.block_hashes)
    return out


@dataclass
class Replica:
    url: str
    up: bool = False
    events: dict | None = None  # the replica's kv_events endpoints ({endpoint, replay_endpoint, topic}), if any
    index: BlockIndex = field(default_factory=BlockIndex)
    text: TextTree | None = None
    pending: dict[int, float] = field(default_factory=dict)  # block hash -> until when it counts as cached
    history: OrderedDict = field(default_factory=OrderedDict)  # block hashes routed here, least recent first
    inflight: int = 0
    queued_tokens: float = 0.0  # prefill routed here and not finished
    requests: int = 0
    failures: int = 0
    expected_hit_tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    subscriber: EventSubscriber | None = None
    store: SharedStore | None = None  # the store it writes to, shared with the replicas naming the same one
    store_write: str = "through"  # when its pages reach the store: through (when stored) or back (when evicted)
    store_last: str = MEDIUM_DEVICE  # its last memory tier: leaving it, a page is written back (CPU with a host tier)


class Choice(NamedTuple):
    replica: int
    prefill: float  # tokens the replica is expected to compute
    cached: int  # tokens expected from its cache (device, host tier, store)


class _Candidate(NamedTuple):
    cost: float
    inflight: int
    routed: int  # pages in the replica's routed history
    replica: int
    run: int  # tokens: the longer of the cached run and the home run
    choice: Choice


def choose_by_cost(replicas: list[Replica], candidates: list[int], hashes: list[int], prompt_tokens: int,
                   page_size: int, host_page_cost: float, load_weight: float, now: float,
                   cache_threshold: float = 0.0, abs_threshold: int | None = None,
                   rel_threshold: float = 1.5, store_page_cost: float = 0.1) -> Choice:  # fmt: skip
    """Events mode. A candidate's run is the longer of what its cache holds (its index,
    plus pages routed there whose events are still pending) and what this router routed
    there before (its history: the prefix's *home*); its cost is the tokens it would
    prefill after that run (a host-tier page at ``host_page_cost``, a page further on
    in the store it shares with others at ``store_page_cost``) plus ``load_weight``
    x the prefill queued there. SGLang's structure around it: in-flight requests
    imbalanced past the thresholds -> the least loaded; else a candidate whose run
    covers more than ``cache_threshold`` of the prompt -> the least cost (ties: fewest in
    flight, fewest routed pages, lowest index); else (a cold prompt) the fewest in
    flight, then the fewest routed pages remembered, then the lowest index.

    The home counts as much as the cache because under memory pressure a replica loses
    a prefix between uses: sending it home again keeps one copy of each prefix, where
    following whichever replica happens to hold part of it now makes copies everywhere.
    A cold prompt starts a new working set: it goes where the least is running, since
    what a replica whose programs have finished holds is the least likely to be asked
    for again, however much was routed there (routed pages alone, SGLang's smallest
    tree, put a fourth conversation beside a running one while a finished one's replica
    sat idle). Measured in benchmarks/RESULTS.md (routers). The returned ``prefill`` and
    ``cached`` are what the cache holds."""
    rows = []
    for i in candidates:
        r = replicas[i]
        with r.lock:
            ov = r.index.match(hashes)
            home = leading(hashes, r.history)
            routed = len(r.history)
        device, lower = ov.device, ov.lower
        if r.pending and device + lower < len(hashes):  # just routed here, its events not in yet
            n = device + lower
            while n < len(hashes) and r.pending.get(hashes[n], 0.0) > now:
                n += 1
            device = n - lower
        stored = r.store.run(hashes, device + lower) if r.store is not None else 0
        limit = max(prompt_tokens - 1, 0)
        cached = min((device + lower + stored) * page_size, limit)
        lower_cost = (host_page_cost * lower + store_page_cost * stored) * page_size
        run = max(cached, min(home * page_size, limit))
        prefill = prompt_tokens - cached + lower_cost
        cost = prompt_tokens - run + lower_cost + load_weight * r.queued_tokens
        rows.append(_Candidate(cost, r.inflight, routed, i, run, Choice(i, prefill, cached)))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("candidates: %s", [(c.replica, c.run, round(c.cost), c.inflight, c.routed) for c in rows])
    if abs_threshold is not None and imbalanced([c.inflight for c in rows], abs_threshold, rel_threshold):
        best = min(rows, key=lambda c: (c.inflight, c.cost, c.replica))
    elif prompt_tokens and max(c.run for c in rows) <= cache_threshold * prompt_tokens:
        best = min(rows, key=lambda c: (c.inflight, c.routed, c.replica))  # cold
    else:
        best = min(rows, key=lambda c: (c.cost, c.inflight, c.routed, c.replica))
    return best.choice


def imbalanced(loads: list[int], abs_threshold: int, rel_threshold: float) -> bool:
    """SGLang's test: the busiest has more than ``abs_threshold`` requests in flight over
    the idlest, and more than ``rel_threshold`` times its count."""
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > rel_threshold * lo


def remember(history: OrderedDict, hashes: list[int], limit: int) -> None:
    """Note ``hashes`` as routed to a replica (most recent last), keeping ``limit``."""
    for h in hashes:
        history[h] = None
        history.move_to_end(h)
    while len(history) > limit:
        history.popitem(last=False)


def choose_approx(replicas: list[Replica], candidates: list[int], text: str, cache_threshold: float,
                  abs_threshold: int, rel_threshold: float) -> int:  # fmt: skip
    """SGLang's cache-aware rule over approximate text trees (see the module doc)."""
    loads = [replicas[i].inflight for i in candidates]
    if imbalanced(loads, abs_threshold, rel_threshold):
        return candidates[loads.index(min(loads))]
    matches = [replicas[i].text.match(text) for i in candidates]
    best = max(matches)
    if text and best / len(text.encode("utf-8", "surrogatepass")) > cache_threshold:
        return candidates[matches.index(best)]
    sizes = [replicas[i].text.chars for i in candidates]
    return candidates[sizes.index(min(sizes))]


# -- KV events: one subscriber thread per replica --------------------------------------------------------------


class EventSubscriber:
    """Follows one replica's KV events into its ``BlockIndex``: SUB for the stream, a
    DEALER on the replay socket for what it missed (at start, after a gap, or when the
    publisher restarted: its sequence went back). Runs in its own thread until ``stop``."""

    def __init__(self, replica: Replica, endpoint: str, replay: str | None, topic: str):
        self.replica, self.endpoint, self.replay, self.topic = replica, endpoint, replay, topic.encode()
        self.next_seq: int | None = None
        self.gaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {replica.url}", daemon=True)

    def start(self) -> EventSubscriber:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if self.next_seq is None or seq != self.next_seq:
                    if self.next_seq is not None and seq < self.next_seq:  # the publisher restarted
                        with self.replica.lock:
                            self.replica.index.clear()
                        self.next_seq = 0
                    self._catch_up(ctx, seq)
                if self.next_seq is None or seq == self.next_seq:
                    self._apply(seq, frames[2])
        except Exception:
            logger.exception("kv events of %s: subscriber stopped", self.replica.url)
        finally:
            sub.close(0)
            ctx.term()

    def _catch_up(self, ctx, upto: int) -> None:
        """Replay batches [next_seq or 0, upto) from the replay socket, when there is one."""
        import zmq

        start = self.next_seq or 0
        if self.replay is None or upto <= start:
            if self.next_seq is not None and upto > start:
                self.gaps += 1
            self.next_seq = upto
            return
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        try:
            dealer.send(start.to_bytes(8, "big", signed=True))
            while dealer.poll(5000):
                seq_b, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    break
                if seq < upto and (self.next_seq is None or seq >= self.next_seq):
                    if self.next_seq is not None and seq > self.next_seq:
                        self.gaps += 1  # older than the replica's buffer keeps
                    self._apply(seq, payload)
        finally:
            dealer.close(0)
        if self.next_seq is None or self.next_seq < upto:
            self.gaps += self.next_seq is not None
            self.next_seq = upto

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("kv events of %s: batch %d is malformed, skipped", self.replica.url, seq)
        else:
            with self.replica.lock:
                self.replica.index.apply(batch)
            r = self.replica
            if r.store is not None:
                r.store.add(written_to_store(batch.events, r.store_write, r.store_last))
        self.next_seq = seq + 1


# -- the HTTP application ------------------------------------------------------------------------------------


class Retry(Exception):
    """This replica failed before anything went to the client: try another."""


class Router:
    """The router's ASGI application over ``config.replicas``."""

    def __init__(self, config: RouterConfig, tokenizer=None, chat_template=None):
        if not config.replicas:
            raise ValueError("replicas: give at least one replica URL")
        self.config = config
        self.replicas = [Replica(u, text=TextTree(config.max_tree_chars)) for u in config.replicas]
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self._rr = itertools.count()
        self.stores: dict[tuple, SharedStore] = {}  # (spec, KV format) -> what the replicas wrote there
        self.retries = 0
        self.lost = 0
        self._client = None
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle ---------------------------------------------------------------------------------------

    def load_tokenizer(self) -> None:
        """The model's tokenizer and chat template (events mode tokenizes prompts)."""
        from radixkv.model.chat_template import ChatTemplate
        from radixkv.model.registry import resolve_model
        from radixkv.model.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.load(resolve_model(self.config.model))
        self.chat_template = ChatTemplate.from_tokenizer(self.tokenizer) if self.tokenizer.chat_template else None

    async def start(self) -> None:
        import httpx

        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.config.request_timeout, connect=5.0), limits=limits)
        await asyncio.gather(*(self._check(i) for i in range(len(self.replicas))))
        self._tasks.append(asyncio.create_task(self._health_loop()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for r in self.replicas:
            if r.subscriber is not None:
                r.subscriber.stop()
        if self._client is not None:
            await self._client.aclose()

    @property
    def mode(self) -> str:
        """``events`` when every replica publishes KV events (and the mode allows), else ``approx``."""
        if self.config.mode == "approx":
            return "approx"
        if all(r.events for r in self.replicas):
            return "events"
        return "approx"

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await asyncio.gather(*(self._check(i) for i in range(len(self.replicas))), return_exceptions=True)

    async def _check(self, i: int) -> None:
        """Health, and the replica's event endpoints once (subscribing to them)."""
        r = self.replicas[i]
        headers = self._auth()
        try:
            resp = await self._client.get(r.url + "/health", timeout=5.0)
            up = resp.status_code == 200
        except Exception:
            up = False
        if up and r.events is None and self.config.mode != "approx":
            try:
                stats = (await self._client.get(r.url + "/stats", headers=headers, timeout=10.0)).json()
                ev = stats.get("kv_events")
            except Exception:
                stats, ev = {}, None
            if ev:
                self._join_store(r, stats.get("tiers") or {})
                r.events = ev
                r.subscriber = EventSubscriber(r, ev["endpoint"], ev.get("replay_endpoint"), ev.get("topic", "")).start()
            else:
                r.events = {}
        if up != r.up:
            logger.warning("replica %s is %s", r.url, "up" if up else "down")
        r.up = up

    def _join_store(self, r: Replica, tiers: dict) -> None:
        """Note the store ``r`` writes to (from its /stats ``tiers``), shared with every
        replica naming the same one in the same KV format; bounded by the store's bytes
        when it says them."""
        store = tiers.get("store") or {}
        if not store.get("spec"):
            return
        key = (store["spec"], store.get("kv_format"))
        if key not in self.stores:
            max_bytes, page_bytes = store.get("max_bytes"), store.get("page_bytes")
            limit = max_bytes // page_bytes if max_bytes and page_bytes else UNSIZED_STORE_PAGES
            self.stores[key] = SharedStore(store["spec"], max(int(limit), 1), str(store.get("kv_format") or ""))
        r.store, r.store_write = self.stores[key], tiers.get("write") or "through"
        r.store_last = MEDIUM_HOST if tiers.get("host") else MEDIUM_DEVICE

    def _auth(self) -> dict:
        key = self.config.api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    # -- routing ---------------------------------------------------------------------------------------------

    def prompt(self, path: str, body: dict) -> tuple[list[int] | None, str]:
        """The request's prompt as token ids (None when they cannot be known here) and as
        text (approximate mode)."""
        ids, text = None, ""
        try:
            if path == "/v1/chat/completions":
                messages = body.get("messages") or []
                text = "".join(f"{m.get('role', '')}:{_content_text(m.get('content'))}\n" for m in messages)
                if self.chat_template is not None and self.mode == "events":
                    msgs = [{**m, "content": _content_text(m.get("content"))} for m in messages]
                    ids = self.chat_template.encode(self.tokenizer, msgs, add_generation_prompt=True)
            else:
                prompt = body.get("prompt") if path == "/v1/completions" else body.get("input_ids", body.get("text"))
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
                if isinstance(prompt, str):
                    text = prompt
                    if self.tokenizer is not None and self.mode == "events":
                        ids = self.tokenizer.encode(prompt)
                elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                    ids, text = prompt, " ".join(map(str, prompt))
        except Exception:  # a prompt the replica will refuse with a clear error: route it anywhere
            ids = None
        return ids, text

    def route(self, path: str, body: dict, salt: str | None, exclude: set[int]) -> Choice | None:
        """Pick the replica for a request (None: no healthy one left). A hint (``/pin``
        with ``hint``) computes nothing: it goes where its prompt is cached, and its
        pages are not counted as that replica's (pending) or as routed there."""
        cands = [i for i, r in enumerate(self.replicas) if r.up and i not in exclude]
        if not cands:
            cands = [i for i, r in enumerate(self.replicas) if i not in exclude]  # health may lag: try anyway
            if not cands:
                return None
        cfg = self.config
        if cfg.policy == "round_robin":
            return Choice(cands[next(self._rr) % len(cands)], 0.0, 0)
        ids, text = self.prompt(path, body)
        claims = not (path == "/pin" and body.get("hint"))  # a hint computes nothing: it claims no pages
        if self.mode == "events" and ids is not None:
            ps = next((r.index.page_size for r in self.replicas if r.index.page_size), None) or 16
            hashes = block_hashes(ids, salt, ps)
            now = time.monotonic()
            choice = choose_by_cost(self.replicas, cands, hashes, len(ids), ps, cfg.host_page_cost, cfg.load_weight,
                                    now, cfg.events_cache_threshold, cfg.balance_abs_threshold,
                                    cfg.balance_rel_threshold, cfg.store_page_cost)  # fmt: skip
            r = self.replicas[choice.replica]
            if not claims:
                return choice
            until = now + cfg.pending_seconds
            if len(r.pending) > 1 << 20:
                r.pending = {h: t for h, t in r.pending.items() if t > now}
            for h in hashes:
                r.pending[h] = until
            remember(r.history, hashes, max(cfg.max_tree_chars // ps, 1))
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("route %d tokens (pages %s) -> replica %d: cached %d, prefill %.0f", len(ids),
                             " ".join(f"{h:x}"[:6] for h in hashes[:3]), choice.replica, choice.cached,
                             choice.prefill)  # fmt: skip
            return choice
        i = choose_approx(self.replicas, cands, text, cfg.cache_threshold, cfg.balance_abs_threshold,
                          cfg.balance_rel_threshold)  # fmt: skip
        if claims:
            self.replicas[i].text.insert(text)
        return Choice(i, float(len(text)), 0)

    # -- ASGI ----------------------------------------------------------------------------------------------

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    try:
                        await self.start()
                    except Exception as e:
                        await send({"type": "lifespan.startup.failed", "message": str(e)})
                        return
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await self.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        http = Http(scope, receive, send, self.config.max_body_bytes)
        path, method = scope["path"], scope["method"]
        try:
            if method == "GET" and path == "/health":
                ok = any(r.up for r in self.replicas)
                return await http.send(200 if ok else 503, b'{"status":"ok"}' if ok else b'{"status":"no replica"}')
            if method == "GET" and path == "/metrics":
                return await http.send(200, self.metrics().encode(), [(b"content-type", b"text/plain; version=0.0.4")])
            if method == "GET" and path == "/router/state":
                blocks = b"blocks=1" in scope.get("query_string", b"")
                return await http.send(200, msgspec.json.encode(self.state(blocks)))
            if method == "POST" and path in BROADCAST_ROUTES:
                return await self.broadcast(http, await http.body())
            await self.forward(http, await http.body())
        except P.ApiError as e:
            await http.error(e)
        except ClientGone:
            pass

    async def forward(self, http: Http, body: bytes) -> None:
        """Send the request to the chosen replica; on failure before anything reached the
        client, to the next one. ApiError 503 when none could serve it."""
        scope = http.scope
        path = scope["path"]
        parsed = _json_object(body) if path in ROUTED_ROUTES and scope["method"] == "POST" else {}
        salt = http.headers.get("x-cache-salt") or parsed.get("cache_salt")
        stream = bool(parsed.get("stream"))
        url_tail, fwd = _outgoing(http)
        tried: set[int] = set()
        while True:
            choice = self.route(path, parsed, salt, tried) if parsed else self._any(tried)
            if choice is None:
                self.lost += 1
                raise P.ApiError(503, "no replica could serve the request", type="router_error")
            tried.add(choice.replica)
            r = self.replicas[choice.replica]
            r.inflight += 1
            r.queued_tokens += choice.prefill
            r.requests += 1
            if parsed:
                r.expected_hit_tokens += choice.cached
            try:
                await self._proxy(r, scope["method"], url_tail, fwd, body, stream, http)
                return
            except Retry:
                r.failures += 1
                r.up = False
                self.retries += 1
                asyncio.create_task(self._check(choice.replica))
            finally:
                r.inflight -= 1
                r.queued_tokens -= choice.prefill

    async def broadcast(self, http: Http, body: bytes) -> None:
        """``/flush_cache`` and ``/unpin``: sent to every replica, as SGLang's router
        sends ``/flush_cache`` (each replica holds its own cache, pins and sessions; pin
        ids are unique per replica process). The answer is 200 when every replica that
        was reached answered 200 (``/unpin`` by id: when one did, the others' 404 being
        expected), else the first other status; its body lists each replica's answer
        (``replicas``: ``url``, ``status``, ``body``) and, for ``/unpin``, the entries
        released in all (``unpinned``). A successful flush also drops what the router
        knew of the replica's cache: what it routed there (``history``, pending pages),
        its text tree, and with ``tiers=store`` or ``all`` the shared store's pages (the
        replicas' events remove the rest)."""
        import httpx

        path = http.scope["path"]
        url_tail, fwd = _outgoing(http)

        async def one(r: Replica) -> tuple[int, object]:
            try:
                resp = await self._client.post(r.url + url_tail, headers=fwd, content=body, timeout=60.0)
            except httpx.TransportError as e:
                return 502, {"error": {"message": f"replica unreachable: {type(e).__name__}", "type": "router_error"}}
            try:
                return resp.status_code, resp.json()
            except ValueError:
                return resp.status_code, resp.text
        answers = await asyncio.gather(*(one(r) for r in self.replicas))
        statuses = [status for status, _ in answers]
        out: dict = {"replicas": [{"url": r.url, "status": status, "body": data}
                                  for r, (status, data) in zip(self.replicas, answers)]}  # fmt: skip
        if path == "/unpin":
            out["unpinned"] = sum(int(d.get("unpinned", 0)) for s, d in answers if s == 200 and isinstance(d, dict))
            by_id = _json_object(body).get("id") is not None and 200 in statuses
            reached = [s for s in statuses if s != 502]
            ok = bool(reached) and all(s == 200 or (by_id and s == 404) for s in reached)
        else:
            ok = all(s == 200 for s in statuses)
            tiers = parse_qs(http.scope.get("query_string", b"").decode("latin-1")).get("tiers", ["memory"])[-1]
            for r, s in zip(self.replicas, statuses):
                if s == 200:
                    self._flushed(r, tiers)
        status = 200 if ok else next(s for s in statuses if s != 200)
        await http.send(status, msgspec.json.encode(out))

    def _flushed(self, r: Replica, tiers: str) -> None:
        """Forget what ``r``'s flush of ``tiers`` emptied, beyond what its events say."""
        with r.lock:
            if tiers in ("device", "memory", "all"):
                r.history.clear()
                r.pending.clear()
                r.text.clear()
            if tiers in ("store", "all") and r.store is not None:
                r.store.clear()

    def _any(self, exclude: set[int]) -> Choice | None:
        cands = [i for i, r in enumerate(self.replicas) if r.up and i not in exclude] or \
                [i for i in range(len(self.replicas)) if i not in exclude]  # fmt: skip
        return Choice(cands[next(self._rr) % len(cands)], 0.0, 0) if cands else None

    async def _proxy(self, r: Replica, method: str, url_tail: str, headers: dict, body: bytes, stream: bool,
                     http: Http) -> None:  # fmt: skip
        import httpx

        req = self._client.build_request(method, r.url + url_tail, headers=headers, content=body)
        try:
            resp = await self._client.send(req, stream=True)
        except httpx.TransportError:
            raise Retry from None
        try:
            if resp.status_code == 503:
                raise Retry
            out_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items()
                           if k.lower() in ("content-type", "cache-control", "x-request-id")]  # fmt: skip
            if not stream:
                try:
                    data = await resp.aread()
                except httpx.TransportError:
                    raise Retry from None
                return await http.send(resp.status_code, data, out_headers)
            it = resp.aiter_raw()
            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                first = b""
            except httpx.TransportError:
                raise Retry from None
            http.started = True
            await http.send_raw({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
            await http.send_raw({"type": "http.response.body", "body": first, "more_body": True})
            try:
                async for chunk in it:
                    await http.send_raw({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError:  # the replica died mid-stream: say so as the last event
                return await http.error(P.ApiError(502, "the replica serving this stream failed", type="router_error"))
            await http.end()
        finally:
            await resp.aclose()

    # -- observability --------------------------------------------------------------------------------------

    def state(self, blocks: bool = False) -> dict:
        out = {"mode": self.mode if self.config.policy == "cache_aware" else "round_robin", "retries": self.retries,
               "lost": self.lost, "replicas": []}  # fmt: skip
        for r in self.replicas:
            with r.lock:
                item = {"url": r.url, "up": r.up, "events": bool(r.events), "inflight": r.inflight,
                        "requests": r.requests, "failures": r.failures, "expected_hit_tokens": r.expected_hit_tokens,
                        "index": {"device": len(r.index.device), **{m: len(s) for m, s in r.index.lower.items()},
                                  "batches": r.index.batches},
                        "routed_pages": len(r.history), "text_tree_chars": r.text.chars}  # fmt: skip
                if r.store is not None:
                    item["store"] = {"spec": r.store.spec, "pages": len(r.store), "limit": r.store.limit,
                                     "write": r.store_write}  # fmt: skip
                if r.subscriber is not None:
                    item["index"]["next_seq"] = r.subscriber.next_seq
                    item["index"]["gaps"] = r.subscriber.gaps
                if blocks:
                    item["blocks"] = r.index.blocks()
            out["replicas"].append(item)
        return out

    def metrics(self) -> str:
        lines = []

        def metric(name: str, kind: str, help_: str, values: list[tuple[str, float]]):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {value}" for labels, value in values)

        per = [(f'{{replica="{_label(r.url)}"}}', r) for r in self.replicas]
        metric("radixkv_router_replica_up", "gauge", "1 while the replica answers /health",
               [(lb, int(r.up)) for lb, r in per])  # fmt: skip
        metric("radixkv_router_requests_total", "counter", "requests sent to the replica (retries included)",
               [(lb, r.requests) for lb, r in per])  # fmt: skip
        metric("radixkv_router_failures_total", "counter", "requests the replica failed (then retried elsewhere)",
               [(lb, r.failures) for lb, r in per])  # fmt: skip
        metric("radixkv_router_inflight", "gauge", "requests in flight at the replica", [(lb, r.inflight) for lb, r in per])
        metric("radixkv_router_expected_hit_tokens_total", "counter", "prompt tokens routed to a replica holding them",
               [(lb, r.expected_hit_tokens) for lb, r in per])  # fmt: skip
        metric("radixkv_router_index_blocks", "gauge", "pages the replica's events say it holds, by medium",
               [(f'{{replica="{_label(r.url)}",medium="{_label(m)}"}}', n) for r in self.replicas
                for m, n in (("GPU", len(r.index.device)), *((k, len(s)) for k, s in r.index.lower.items()))])
        metric("radixkv_router_store_blocks", "gauge", "pages the replicas' events say they wrote to a store they share",
               [(f'{{store="{_label(st.spec)}",kv_format="{_label(st.kv_format)}"}}', len(st))
                for st in self.stores.values()])  # fmt: skip
        metric("radixkv_router_retries_total", "counter", "requests sent again after their replica failed",
               [("", self.retries)])  # fmt: skip
        metric("radixkv_router_lost_total", "counter", "requests no replica could serve", [("", self.lost)])
        return "\n".join(lines) + "\n"


def _json_object(body: bytes) -> dict:
    """``body`` as a JSON object; {} for anything else (the replica answers that with its
    own clear error)."""
    try:
        parsed = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _outgoing(http: Http) -> tuple[str, dict]:
    """What a request forwarded to a replica carries: its path with the query string,
    and the headers that pass through (``FORWARD_HEADERS``)."""
    scope = http.scope
    query = scope.get("query_string") or b""
    tail = scope["path"] + ("?" + query.decode("latin-1") if query else "")
    return tail, {k: v for k, v in http.headers.items() if k in FORWARD_HEADERS}


def _label(value: str) -> str:
    """``value`` as a Prometheus label value (backslash, quote and newline escaped)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _content_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


HELP = {
    "replicas": "the replicas' base URLs (http://127.0.0.1:30001 ...)",
    "host": "address to bind; loopback unless you mean to expose the router",
    "port": "TCP port",
    "model": "the replicas' model (registry name, GGUF file or HF directory): its tokenizer and chat template "
             "turn prompts into the pages their KV events name (no weights load)",
    "policy": "cache_aware (events where every replica publishes them, else SGLang's approximate text tree) or "
              "round_robin",
    "mode": "auto (events where every replica publishes KV events, else approx), events, approx",
    "cache_threshold": "approx mode: the share of a prompt the best replica's text tree must match to win",
    "events_cache_threshold": "events mode: the share of a prompt the best replica's run (cache or home) must cover "
                              "to route by cost; at or below it the prompt is cold (fewest in flight wins)",
    "balance_abs_threshold": "approx mode: in-flight requests between the busiest and idlest replica past which the "
                             "idlest wins (with balance_rel_threshold)",
    "balance_rel_threshold": "approx mode: and the busiest has this many times the idlest's",
    "max_tree_chars": "approx mode: characters each replica's text tree keeps (least recently used out)",
    "host_page_cost": "events mode: what a page in a replica's host tier costs, as a share of computing it",
    "store_page_cost": "events mode: what a page in a store the replicas write to costs, as a share of computing it",
    "load_weight": "events mode: weight of the prefill tokens already queued at a replica against the tokens "
                   "a request would prefill there (0: load counts through the balance thresholds only; replicas "
                   "that share compute gain nothing from spreading prefill)",
    "pending_seconds": "events mode: how long a routed prompt's pages count as its replica's before its events come",
    "health_interval": "seconds between health checks of each replica",
    "request_timeout": "seconds a forwarded request may take",
    "max_body_bytes": "largest request body accepted (413 above it)",
    "log_level": "log level: critical, error, warning, info, debug",
    "api_key": "the replicas' API key, for the router's own calls to them (/stats); clients' requests carry "
               "their own Authorization header through",
}


def add_arguments(parser) -> None:
    """``radixkv router``'s flags, one per RouterConfig field."""
    import dataclasses

    from radixkv.server.serve import CHOICES

    for f in dataclasses.fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "replicas":
            parser.add_argument("--replica", "--replicas", dest="replicas", nargs="+", required=True, metavar="URL",
                                help=HELP[f.name])  # fmt: skip
            continue
        kind = {"int": int, "float": float}.get(f.type, str)
        choices = {"policy": POLICIES, "mode": MODES, "log_level": CHOICES["log_level"]}.get(f.name)
        parser.add_argument(flag, type=kind, default=f.default, choices=choices, metavar=f.name.upper(),
                            help=f"{HELP[f.name]} (default: {f.default})")  # fmt: skip


def config_from(args) -> RouterConfig:
    import dataclasses

    return RouterConfig(**{f.name: (tuple(getattr(args, f.name)) if f.name == "replicas" else getattr(args, f.name))
                           for f in dataclasses.fields(RouterConfig)})  # fmt: skip


def run(config: RouterConfig) -> int:
    """Serve the router until SIGINT/SIGTERM."""
    import uvicorn

    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    router = Router(config)
    if config.policy == "cache_aware" and config.mode != "approx":
        router.load_tokenizer()
    server = uvicorn.Server(uvicorn.Config(router, host=config.host, port=config.port, lifespan="on",
                                           log_level=config.log_level, access_log=False))  # fmt: skip
    # uvicorn re-raises SIGINT/SIGTERM to the handler that was there before once it has shut
    # down: make that a no-op, so a clean shutdown exits 0 instead of dying by the signal
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
