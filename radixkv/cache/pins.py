"""Pins, TTLs, hints and sessions: cached prefixes kept out of eviction on purpose.

Each entry holds one lock on the tree node that ends its prefix, as a running sequence
does (a lock pins the whole path to the root), so what it protects is exactly the
tree's "protected" pages, and eviction needs no new rule. This module is bookkeeping
only: ``KVCacheManager`` takes and drops the locks (it alone mutates the tree).

    kind     made by                               released by                         cap
    pin      Engine.pin, /pin, "pin" on /generate  unpin                               max_pinned_share
    ttl      a pin with a ttl; cache_control       unpin, or its expiry                max_pinned_share
    hint     a program's fork; Engine.hint         `uses` admissions that continue     none: advisory
                                                   it, its session's end, its expiry,
                                                   memory pressure
    session  a finished request's session_id       the session's next request, its     none: advisory
                                                   end, its expiry, memory pressure

Pins and TTLs ("hard") are never released for memory: their distinct pages are capped at
a share of the pool, so running requests always keep the rest. Hints and sessions
("soft") are advice: they hold off admissions while requests run, but give way to a
running request's growth before anything is preempted, and to admissions when nothing
runs (so they never stall the engine). Re-pinning a prefix refreshes its entry (the
later expiry wins, None being the latest) instead of stacking a second one.

    tokens  |==== pinned: whole cached pages, locked ====|== partial / uncached: not pinned ==|
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from dataclasses import dataclass

from radixkv.cache.radix import Node

KINDS = ("pin", "ttl", "hint", "session")
HARD = frozenset(("pin", "ttl"))  # capped, never given up for memory
SOFT = frozenset(("hint", "session"))  # advisory: given up under pressure, sessions first
MAX_TTL = 30 * 24 * 3600.0  # seconds: the longest ttl taken (a month)
MAX_PROGRAMS = 1 << 16  # programs whose rank in time is remembered while they hold nothing


@dataclass(frozen=True)
class PinInfo:
    """One entry as callers see it. ``tokens``/``pages``: the prefix it protects (whole
    pages); ``expires_at``: on the manager's clock (``time.monotonic`` in the engine),
    None for none; ``uses``: admissions a hint still waits for (None for other kinds)."""

    id: str
    kind: str
    tokens: int
    pages: int
    created: float
    expires_at: float | None
    uses: int | None = None
    session: str | None = None

    def expires_in(self, now: float) -> float | None:
        return None if self.expires_at is None else max(0.0, self.expires_at - now)

    def describe(self, now: float) -> dict:
        """The entry for ``/stats`` (no namespace: a cache salt is a tenant's secret)."""
        out = {"id": self.id, "kind": self.kind, "tokens": self.tokens, "pages": self.pages,
               "expires_in": self.expires_in(now)}  # fmt: skip
        if self.uses is not None:
            out["uses"] = self.uses
        if self.session is not None:
            out["session"] = self.session
        return out


@dataclass(frozen=True)
class PendingPin:
    """A request's claim on the pin cap, from its arrival until it finishes and pins
    (``KVCacheManager.claim_pin``)."""

    namespace: object
    key: bytes  # the prefix's whole-page tokens, int32 bytes


@dataclass(eq=False)
class Entry:
    """The registry's record (mutable: a refresh moves ``expires_at``, a use lowers
    ``uses``). ``node``: the locked node that ends the prefix."""

    id: str
    kind: str
    namespace: object
    key: bytes
    node: Node
    pages: int
    created: float
    expires_at: float | None
    uses: int | None = None
    session: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.key) // 4

    def info(self) -> PinInfo:
        return PinInfo(self.id, self.kind, self.tokens, self.pages, self.created, self.expires_at, self.uses,
                       self.session)  # fmt: skip


def later(a: float | None, b: float | None) -> float | None:
    """The later of two expiries, None (never) being the latest."""
    return None if a is None or b is None else max(a, b)


class PinRegistry:
    """Entries by id, by prefix, by session and by node, with a heap of expiries (a
    check costs O(1) when nothing is due; refreshed or removed entries leave stale heap
    items that are skipped when they surface). Does not touch the tree."""

    def __init__(self):
        self.entries: dict[str, Entry] = {}  # by id, in creation order
        self._by_prefix: dict[tuple, str] = {}  # (group, namespace, key, session) -> id
        self._sessions: dict[str, str] = {}  # session -> its session entry's id
        self._by_node: dict[Node, list[str]] = {}  # locked node -> hint ids on it
        self._heap: list[tuple[float, int, str]] = []
        self._ids = itertools.count(1)
        self._tag = secrets.token_hex(3)
        self._seq = itertools.count()
        self.pending: dict[tuple, int] = {}  # (namespace, key) -> requests holding a PendingPin of it
        # distinct pages under hard / soft entries (paths share nodes; see _changed)
        self.pinned_pages = 0
        self.hinted_pages = 0
        self._soft_dirty = False
        # program (session group) -> its rank in time: when it was first seen (``birth``), and
        # how many entries it holds; a program whose last entry expires is forgotten
        self._births: dict[str, int] = {}
        self._held: dict[str, int] = {}
        # counters: hints and sessions used up or replaced by the requests they waited for,
        # given up under memory pressure, expired
        self.used = 0
        self.dropped = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self.entries)

    def new_id(self, kind: str) -> str:
        """``pin-<tag>-<n>`` or ``hint-<tag>-<n>``: ``tag`` is random per registry, so ids
        of replicas behind one router never collide (the router sends ``/unpin`` to all)."""
        return f"{'pin' if kind in HARD else 'hint'}-{self._tag}-{next(self._ids)}"

    @staticmethod
    def prefix_key(kind: str, namespace, key: bytes, session: str | None) -> tuple:
        """Pins and TTLs of one prefix are one entry; hints are one per prefix and session."""
        return ("pin", namespace, key, None) if kind in HARD else ("hint", namespace, key, session)

    def find(self, kind: str, namespace, key: bytes, session: str | None = None) -> Entry | None:
        eid = self._by_prefix.get(self.prefix_key(kind, namespace, key, session))
        return None if eid is None else self.entries[eid]

    def session(self, session: str) -> Entry | None:
        eid = self._sessions.get(session)
        return None if eid is None else self.entries[eid]

    def add(self, e: Entry) -> None:
        self.entries[e.id] = e
        g = group(e.session)
        if g is not None:
            self.birth(g)
            self._held[g] = self._held.get(g, 0) + 1
        if e.kind == "session":
            self._sessions[e.session] = e.id
        else:
            self._by_prefix[self.prefix_key(e.kind, e.namespace, e.key, e.session)] = e.id
        if e.kind == "hint":
            self._by_node.setdefault(e.node, []).append(e.id)
        self.schedule(e)
        self._changed(e)

    def remove(self, eid: str) -> Entry:
        e = self.entries.pop(eid)
        g = group(e.session)
        if g is not None:
            self._held[g] -= 1
            if not self._held[g]:
                del self._held[g]
        if e.kind == "session":
            if self._sessions.get(e.session) == eid:  # (a replaced entry goes after its successor came)
                del self._sessions[e.session]
        else:
            del self._by_prefix[self.prefix_key(e.kind, e.namespace, e.key, e.session)]
        if e.kind == "hint":
            ids = self._by_node[e.node]
            ids.remove(eid)
            if not ids:
                del self._by_node[e.node]
        self._changed(e)
        return e

    def _changed(self, e: Entry) -> None:
        """Pinned pages count at once (the cap reads them); hinted pages at the next
        ``refresh_counts`` (once a step: there may be many sessions)."""
        if e.kind in HARD:
            self.pinned_pages = _pages_under(x.node for x in self.entries.values() if x.kind in HARD)
        else:
            self._soft_dirty = True

    def refresh_counts(self) -> None:
        if self._soft_dirty:
            self._soft_dirty = False
            self.hinted_pages = _pages_under(e.node for e in self.entries.values() if e.kind in SOFT)

    def has_hints(self) -> bool:
        """Whether any hint (kind "hint") waits for its uses."""
        return bool(self._by_node)

    def has_soft(self) -> bool:
        """Whether any hint or session entry exists."""
        return bool(self._by_node or self._sessions)

    def schedule(self, e: Entry) -> None:
        """Queue ``e``'s expiry (call again after moving it; the old item goes stale)."""
        if e.expires_at is not None:
            heapq.heappush(self._heap, (e.expires_at, next(self._seq), e.id))

    def due(self, now: float) -> list[str]:
        """Ids of entries whose expiry has come, popped from the heap."""
        out = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, eid = heapq.heappop(heap)
            e = self.entries.get(eid)
            if e is not None and e.expires_at == at:
                out.append(eid)
        if len(heap) > 2 * len(self.entries) + 64:  # mostly stale: rebuild
            self._heap = [(e.expires_at, next(self._seq), e.id) for e in self.entries.values() if e.expires_at is not None]
            heapq.heapify(self._heap)
        return out

    def hints_on(self, node: Node) -> list[str]:
        return self._by_node.get(node, [])

    def of_session(self, session: str) -> list[str]:
        """Every entry a session owns (its session entry and its hints)."""
        return [eid for eid, e in self.entries.items() if e.session == session]

    def birth(self, session: str | None) -> int:
        """The rank in time of ``session``'s program (``group``): when it was first seen
        (an entry, or a request admitted); a fresh rank for None. Lower is older."""
        g = group(session)
        if g is None:
            return next(self._seq)
        b = self._births.get(g)
        if b is None:
            b = self._births[g] = next(self._seq)
            if len(self._births) > MAX_PROGRAMS:  # forget the oldest programs that hold nothing
                for old in [k for k in self._births if k not in self._held][: MAX_PROGRAMS // 4]:
                    del self._births[old]
        return b

    def forget(self, session: str) -> None:
        """``session``'s program ended (or went quiet past its entries' expiry): a later
        request of it ranks as new."""
        g = group(session)
        if g not in self._held:
            self._births.pop(g, None)

    def soft_victim(self, younger_than: int | None = None) -> str | None:
        """The soft entry to give up first under memory pressure: the youngest program's
        (``birth``; entries without a session count as youngest), its session entries
        before its hints, oldest first. With ``younger_than`` only entries of programs
        born after that rank. Older programs keep their prefixes, so those that started
        first run on to their end while later ones wait or recompute."""
        best, best_key = None, None
        for eid, e in self.entries.items():
            if e.kind not in SOFT:
                continue
            b = self._births.get(group(e.session), 1 << 62) if e.session is not None else 1 << 62
            if younger_than is not None and b <= younger_than:
                continue
            key = (-b, e.kind != "session")
            if best_key is None or key < best_key:
                best, best_key = eid, key
        return best

    def hard_nodes(self) -> set[Node]:
        """Every node on the path of a pin or TTL."""
        return _path_nodes(e.node for e in self.entries.values() if e.kind in HARD)


def group(session: str | None) -> str | None:
    """The program a session belongs to: its id up to the first "/" (a program's forks
    are sessions ``<run>/<k>``, ``<run>/<k>/<j>``, ...)."""
    return None if session is None else session.split("/", 1)[0]


def _path_nodes(ends) -> set[Node]:
    seen: set[Node] = set()
    for node in ends:
        while node.parent is not None and node not in seen:
            seen.add(node)
            node = node.parent
    return seen


def _pages_under(ends) -> int:
    return sum(len(n.pages) for n in _path_nodes(ends))
