"""KVCacheManager: the one owner of KV memory at the level of sequences.

The page allocator counts references and the radix tree holds cached prefixes; this
class is the only code that drives both for sequences (the engine's scheduler and
``radixkv sim`` alike), so the simulator replays exactly what the engine does. A
sequence's state is a ``SeqKV`` handle, which only the manager changes:

    tokens   |============= prompt =============|======= output =======|
             |== published: whole pages in the tree, path locked ==|
             |================ computed: KV in pages =================|todo|
    pages    |== the tree's (locked, no reference) ==|== own: one reference each ==|

Every page has one owner: the tree, or the one sequence that computed it and has not
published it yet. A sequence reads the tree's pages under the lock on its node (locked
nodes are never evicted), as SGLang's scheduler does, so admitting and releasing a
sequence costs no reference counting on the pages it shares; publishing hands the
sequence's reference to the tree (``insert(adopt=True)``).

Life of a sequence:

    admit    match tokens[:-1] in the tree, lock the match (its pages become the
             first entries of the page table); where the match ends inside a cached
             page, copy that page's shared leading tokens into an own page
             (``partial_pages``; the tree shares whole pages only)
    reserve  grow the page table for the next chunk (evict first; else the caller's
             make_room frees memory, e.g. by preempting; else refuse)
    (the caller computes KV and calls ``computed``)
    commit   publish the whole computed pages into the tree (a prefill chunk): the
             tree adopts them; where it already held those tokens, the sequence takes
             its pages and frees its own copies
    release  publish, unlock, free the pages still its own (the partial last page,
             copies of pages the tree had); the handle is empty again and can be
             admitted anew (preemption)

With tiers (``radixkv.cache.tiers``), eviction demotes pages to the host tier or a
store, and ``admit`` promotes the longest run of pages that follows the tree's match
from them into fresh pages of the tree before taking the match.

Under a long-context policy (``radixkv.cache.compress``), a sequence compresses at
points: it publishes what it computed, keeps the policy's pages as a view, and goes on
under the view's namespace; its table then holds fewer KV entries than it has tokens
(``dropped``), and admission matches the deepest view of its policy before the tree:

    tokens   |========== point ==========|====== after the view ======|
    pages    |== view's kept pages ==|== the view namespace's (tree) ==|== own ==|

The last prompt token is never matched: its logits are needed to sample the first
output token (and a match inside a page leaves two tokens, see ``_copy_partial``).
With ``recompute_from`` (prompt logprobs), prompt positions from there on are computed
again, and only the pages before them are taken from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from radixkv.cache.compress import (
    OBSERVE_TOKENS, KVPolicySpec, View, ViewIndex, chain_hashes, keydiff_scores, page_sums, select_pages,
)  # fmt: skip
from radixkv.cache.events import hash_of, tree_blocks
from radixkv.cache.pins import HARD, SOFT, Entry, PendingPin, PinInfo, PinRegistry, later
from radixkv.cache.pool import PageAllocator, PageIds
from radixkv.cache.radix import Node, RadixCache, token_key
from radixkv.errors import FieldError, IntegrityError
from radixkv.validate import ceil_div, check_float

_EMPTY = np.empty(0, dtype=np.int32)
FLUSH_TIERS = ("memory", "device", "host", "store", "all")  # what flush empties; memory = device + host


def check_flush_tiers(tiers: str) -> str:
    """``tiers`` if it names what ``flush`` can empty, else FieldError naming ``tiers``."""
    if tiers not in FLUSH_TIERS:
        raise FieldError("tiers", f"tiers must be one of {', '.join(FLUSH_TIERS)}, got {tiers!r}")
    return tiers


@dataclass(eq=False)
class SeqKV:
    """One sequence's KV memory. Read its fields; only ``KVCacheManager`` writes them.

    ``pages``: the page table (int32): the tree's pages for the ``published`` tokens,
    then the sequence's own (one reference each); ``node``: the locked tree node that
    ends the published pages (None when nothing is locked); ``computed``: tokens whose
    KV is in ``pages``; ``published``: tokens whose whole pages the tree holds through
    ``node``; ``cached_tokens``: prompt tokens served from the cache at the first
    admission (None before it).

    Under a long-context policy (``policy``): ``view``, the locked view whose kept
    pages begin the table (its namespace holds ``node``'s path); ``dropped``, tokens
    whose KV the table does not hold (KV entries = ``computed - dropped``);
    ``last_point``, the last compression point passed; ``scores``, the policy's score of
    each table page (None for policies without scores).
    """

    namespace: object = None
    priority: int = 0
    pages: PageIds = field(default_factory=lambda: _EMPTY)
    node: Node | None = None
    computed: int = 0
    published: int = 0
    cached_tokens: int | None = None
    prompt_len: int | None = None  # tokens at the first admission: where generated text begins
    policy: KVPolicySpec | None = None
    view: View | None = None
    dropped: int = 0
    last_point: int = 0
    scores: np.ndarray | None = None

    @property
    def kv_len(self) -> int:
        """KV entries in the page table (``computed`` less what compression dropped)."""
        return self.computed - self.dropped

    @property
    def position_shift(self) -> int:
        """Token index minus rotary position: 0, or with ``kv_rerotate`` what
        compression dropped (positions are then KV indices)."""
        return self.dropped if self.policy is not None and self.policy.rerotate else 0

    @property
    def offset(self) -> int:
        """Where the keys of the namespace ``node`` lives in begin (the view's point)."""
        return 0 if self.view is None else self.view.point

    @property
    def tree_namespace(self):
        """The tree namespace the sequence publishes into: its own, or its view's."""
        return self.namespace if self.view is None else self.view.namespace

    def shared_pages(self, page_size: int) -> int:
        """Leading table pages it reads without owning them (view's and tree's)."""
        vp = 0 if self.view is None else len(self.view.pages)
        return vp + (self.published - self.offset) // page_size


class KVCacheManager:
    """Sequences' KV over one ``PageAllocator`` (a ``KVPool`` in the engine) and an
    optional ``RadixCache`` (None: no prefix cache, every sequence computes all).

    Every method says what it mutates; none is thread-safe (one thread owns memory).
    """

    def __init__(self, pool: PageAllocator, tree: RadixCache | None, page_size: int, tiers=None,
                 rerotate: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
                 max_pinned_share: float = 0.5, events=None, partial_pages: bool = True):  # fmt: skip
        if tree is not None and tree.page_size != page_size:
            raise ValueError(f"page_size {page_size} but the tree's pages hold {tree.page_size} tokens")
        if tiers is not None and tree is None:
            raise ValueError("cache tiers need the prefix cache (enable_prefix_cache)")
        self.pool = pool
        self.tree = tree
        self.page_size = page_size
        self.tiers = tiers  # a KVTiers below the pool, or None
        if events is not None and tree is None:
            raise ValueError("KV events need the prefix cache (enable_prefix_cache)")
        self.events = events  # a KVEventRecorder (radixkv.cache.events), or None
        if events is not None:
            tree.on_insert = events.stored
        if tiers is not None or events is not None:
            tree.on_evict = self._on_evict
        self.views = ViewIndex(pool, tree, page_size) if tree is not None else None  # long-context views
        # kv_rerotate: rerotate(src, dst, shifts) writes src pages' KV into dst with keys moved
        # shifts[i] positions back (the engine binds the pool and the model's rotary); None:
        # pages are moved without content (the simulator's allocator has none)
        self.rerotate = rerotate
        # pins, TTLs, hints and sessions (radixkv.cache.pins): entries that hold tree locks
        self.max_pinned_share = check_float("max_pinned_share", max_pinned_share, 0.0, 1.0)
        self.pinned = PinRegistry()
        # a match that ends inside a page: copy the cached page's leading rows (admit); pages
        # of one token have no leading rows to copy
        self.partial_pages = partial_pages and pool.copies_rows and page_size > 1

    # -- queries -------------------------------------------------------------------------

    def cached_len(self, tokens, namespace=None) -> int:
        """Tokens ``admit`` would take from the cache now (whole pages of ``tokens[:-1]``).
        May split a tree node (as ``match_prefix`` does); counts no statistics."""
        if self.tree is None or len(tokens) < 2:
            return 0
        return self.tree.match_prefix(tokens[:-1], namespace, record_stats=False).num_tokens

    def reusable_tokens(self, tokens, recompute_from: int | None = None) -> int:
        """How many leading positions of ``tokens`` ``admit`` may take from the cache: all
        but the last (its logits sample the first output token), and none from
        ``recompute_from`` on (prompt logprobs). Does not mutate."""
        limit = len(tokens) - 1
        return limit if recompute_from is None else min(limit, max(0, recompute_from - 1))

    def pages_needed(self, seq: SeqKV, count: int) -> int:
        """More pages ``seq`` needs to compute ``count`` more tokens. Does not mutate."""
        return ceil_div(seq.kv_len + count, self.page_size) - len(seq.pages)

    # -- the lifecycle ---------------------------------------------------------------------

    def admit(self, seq: SeqKV, tokens, recompute_from: int | None = None) -> int:
        """Take the cached prefix of ``tokens[:-1]``: lock it; its pages begin the page
        table (read under the lock, no reference taken). With partial pages, a match that
        ends inside a page copies that page's leading rows (``_copy_partial``), and one
        that would leave the last token alone gives up its last page for a copy of that
        page's leading rows (``_copy_last_page``).

        With ``recompute_from``, only the whole pages before that prompt position are
        taken (and locked); the rest of the cached copy stays evictable, so a prompt
        computed again never holds the pool twice. Returns ``seq.computed``.

        Mutates ``seq`` (which must be empty: fresh or released), the tree's lock
        counts, access times and statistics (on the first admission only, so a
        preempted sequence is not counted twice). Raises ValueError for a sequence that
        still holds memory.
        """
        if len(seq.pages) or seq.node is not None or seq.view is not None:
            raise ValueError("admit takes an empty sequence (fresh, or released)")
        if seq.prompt_len is None:
            seq.prompt_len = len(tokens)
        if seq.policy is not None and self.tree is not None and len(tokens) >= 2:
            return self._admit_compressed(seq, tokens, recompute_from)
        if self.tree is None or len(tokens) < 2:
            self._set(seq, _EMPTY, None, 0)
            return 0
        first = seq.cached_tokens is None
        m = self.tree.match_prefix(tokens[:-1], seq.namespace, record_stats=first)
        node, pages = (m.node if len(m.pages) else None), m.pages
        if self.tiers is not None and recompute_from is None:
            node, pages = self._promote(seq, tokens[:-1], node, pages)
        keep = len(pages) if recompute_from is None else self.reusable_tokens(tokens, recompute_from) // self.page_size
        if keep < len(pages):
            #   cached  |== kept, locked ==|===== recomputed; the tree's copy unlocked =====|
            pages = pages[:keep]
            node = self._node_at(tokens, keep, seq.namespace)
        if node is not None:
            self.tree.lock(node)
        self._set(seq, pages, node, len(pages) * self.page_size)
        if recompute_from is None and self.partial_pages and not self._copy_last_page(seq, tokens, first):
            self._copy_partial(seq, tokens, first)
        if first:
            seq.cached_tokens = seq.computed
        return seq.computed

    def _copy_last_page(self, seq: SeqKV, tokens, record_stats: bool) -> bool:
        """After ``admit``'s whole pages, where they end one token before ``tokens`` do (a
        prompt sent again with one more token): copy the last page's leading rows into
        the sequence's own page and give that page back to the tree, so that two tokens are
        computed, not the last one alone.

            tokens  |== tree's pages ==|== last page ==|x|
            after   |== tree's pages ==|== copied ==|computed|

        One new token is a decode row to the model (the decode kernels, another order of
        float steps than the prefill that token belongs to), so its logits would not be
        the bits of the prompt computed cold; two are a prefill's rows. The copy is taken
        while the page is locked (it may have just come from a lower tier), before the
        lock moves to the node above it. With no page to copy into, the lone token stays.
        Returns whether it copied. Mutates the pool (one page), the tree's locks (and may
        split an edge), ``seq``, and with ``record_stats`` takes the computed token out of
        the tree's hit count."""
        size = self.page_size
        if seq.computed != len(tokens) - 1 or not self._room_for_one():  # (admit's tokens are two or more)
            return False
        last, keep, matched = int(seq.pages[-1]), len(seq.pages) - 1, seq.node
        above = self._node_at(tokens, keep, seq.namespace)
        if above is not None:
            self.tree.lock(above)
        self._set(seq, seq.pages[:keep], above, keep * size)
        self._append_copy(seq, last, size - 1)  # while ``matched`` still locks the last page
        self.tree.unlock(matched)
        if record_stats:
            self.tree.hit_tokens -= 1
        return True

    def _node_at(self, tokens, pages: int, namespace) -> Node | None:
        """The tree's node that ends after the first ``pages`` whole pages of ``tokens`` (a
        cached prefix at least that long), None for none. May split an edge there; no
        statistics are recorded."""
        if not pages:
            return None
        return self.tree.match_prefix(tokens[: pages * self.page_size], namespace, record_stats=False).node

    def _copy_partial(self, seq: SeqKV, tokens, record_stats: bool) -> None:
        """After ``admit``'s whole pages: when the tokens that follow them begin a cached
        page (the edge below the match that shares the most of them,
        ``RadixCache.partial_page``), copy those tokens' KV into the sequence's next page,
        its own, so that it computes only the rest of the page:

            tokens  |== tree's pages (locked) ==|== copied ==|== computed ... |
            pages   |== tree's ==|              |== own page: rows copied, then its own ==|

        The tree's page stays the tree's (shared pages are whole pages, never a part of
        one). A page is needed for those tokens anyway; when none is free and no unlocked
        one can be evicted, nothing is copied (``reserve`` makes room later). At least two
        tokens are left to compute: a sequence with one new token is a decode row to the
        model (whose products and attention then take the decode path, another order of
        float steps than a prefill's), and a prompt's last token should be computed as a
        prefill computes it, cached or not. Mutates the pool (one page), ``seq.pages`` and
        ``seq.computed``, the edge's access time and (``record_stats``) the tree's hit
        count."""
        limit = self.reusable_tokens(tokens) - seq.computed - 1
        if limit <= 0 or not self._room_for_one():  # before the lookup: evicting after it could take the donor
            return
        node = seq.node if seq.node is not None else self.tree.root(seq.namespace)
        part = self.tree.partial_page(node, tokens, limit, record_stats)
        if part is not None:
            self._append_copy(seq, part.page, part.count)

    def _room_for_one(self) -> bool:
        """Whether a page is free, evicting one unlocked page if none is. Mutates the tree
        and pool by that eviction."""
        return bool(self.pool.num_free() or self._evict(1))

    def _append_copy(self, seq: SeqKV, src: int, count: int) -> None:
        """A new own page at the end of ``seq``'s page table holding a copy of the first
        ``count`` rows of page ``src`` (which the caller keeps alive), counted as computed.
        A page must be free (``_room_for_one``). Mutates the pool and ``seq``."""
        own = self.pool.alloc(1)
        self.pool.copy_rows(src, int(own[0]), count)
        seq.pages = np.concatenate([seq.pages, own])
        seq.computed += count

    def reserve(self, seq: SeqKV, count: int, make_room: Callable[[], bool] | None = None) -> bool:
        """Grow ``seq``'s page table with own pages to hold ``count`` more tokens. When
        the pool is short, evicts unlocked tree leaves first, then calls ``make_room()``
        (which frees memory some other way, e.g. preempting a sequence, and returns
        False when it cannot) until there is room. Returns False, with ``seq``
        unchanged, when there is none.

        Mutates the pool (allocation), the tree (eviction) and ``seq.pages``.
        """
        need = self.pages_needed(seq, count)
        while need > self.pool.num_free():
            if self._evict(need - self.pool.num_free()):
                continue
            if make_room is None or not make_room():
                return False
        if need > 0:
            seq.pages = np.concatenate([seq.pages, self.pool.alloc(need)])
        return True

    def computed(self, seq: SeqKV, upto: int) -> None:
        """Record that KV for ``tokens[:upto]`` is now in ``seq``'s pages. Raises
        ValueError past the page table."""
        if not seq.computed <= upto <= seq.dropped + len(seq.pages) * self.page_size:
            raise ValueError(f"computed must grow within the page table: {seq.computed} -> {upto}, "
                             f"{len(seq.pages)} pages")  # fmt: skip
        seq.computed = upto

    def commit(self, seq: SeqKV, tokens) -> None:
        """Publish ``seq``'s whole computed pages (``tokens[:computed]``) into the tree
        and move its lock to the node that ends them (see ``_publish``).

        Mutates the tree, the pool and ``seq``. No-op without a tree or when nothing
        new is whole.
        """
        whole = seq.computed // self.page_size * self.page_size  # dropped is whole pages: the same boundary
        if self.tree is None or whole <= seq.published:
            return
        old = seq.node
        seq.node = self._publish(seq, tokens, whole)
        self.tree.lock(seq.node)
        if old is not None:
            self.tree.unlock(old)

    def release(self, seq: SeqKV, tokens) -> None:
        """``seq`` is done (or preempted): publish its whole computed pages, unlock,
        free the pages still its own (the partial last page; copies of pages the tree
        had already):

            tokens  |===== computed, whole pages =====|partial|not computed|
                    |-> tree (copies of tree pages go) |-> free            |

        Mutates the tree, the pool and ``seq`` (empty afterwards, ``computed`` 0, ready
        to be admitted again).
        """
        whole = seq.computed // self.page_size * self.page_size
        if self.tree is not None and whole > seq.published:
            self._publish(seq, tokens, whole)
        if seq.node is not None:
            self.tree.unlock(seq.node)
        if seq.view is not None:
            self.views.unlock(seq.view)
        self.pool.free(seq.pages[seq.shared_pages(self.page_size) :])
        self._set(seq, _EMPTY, None, 0)

    def flush(self, tiers: str = "memory") -> int:
        """Empty cache tiers (``FLUSH_TIERS``): ``device`` evicts every unlocked page of
        the tree without demoting it, ``host`` and ``store`` empty those tiers; ``memory``
        is device and host, ``all`` every tier. Returns how many pool pages went free.
        Raises ValueError for another name."""
        check_flush_tiers(tiers)
        freed = 0
        if self.tree is not None and tiers in ("device", "memory", "all"):
            for eid in [eid for eid, e in self.pinned.entries.items() if e.kind in SOFT]:
                self._unpin(eid)  # hints are advice; pins and TTLs stay (their pages stay locked)
            freed += self.views.clear()
            hook, self.tree.on_evict = self.tree.on_evict, self._dropped if self.events is not None else None
            try:
                freed += self.tree.evict(self.tree.cached_pages)
            finally:
                self.tree.on_evict = hook
        if self.tiers is not None:
            if tiers in ("host", "memory", "all"):
                self.tiers.flush("host")
                if self.events is not None:
                    self.events.host_cleared()
            if tiers in ("store", "all"):
                self.tiers.flush("store")
        return freed

    # -- pins, TTLs, hints and sessions (radixkv.cache.pins) ----------------------------------

    @property
    def max_pinned_pages(self) -> int:
        """The cap on distinct pages under pins and TTLs: ``max_pinned_share`` of the pool."""
        return int(self.max_pinned_share * self.pool.num_pages)

    def pin(self, tokens, namespace=None, ttl: float | None = None, now: float = 0.0, field: str = "pin",
            claim: PendingPin | None = None) -> PinInfo:  # fmt: skip
        """Pin the cached whole-page prefix of ``tokens``: lock the node that ends it and
        record an entry, kind "pin" (until ``unpin``) or with ``ttl`` "ttl" (until ``now +
        ttl``, then ``expire`` lets it go). A prefix pinned already keeps its one entry,
        refreshed: the later expiry wins (None, never, is the latest).

            tokens  |== cached whole pages: locked, counted in the cap ==|== rest: not pinned ==|

        ``claim`` (from ``claim_pin``) is the caller's reservation, given up here first.
        Raises FieldError naming ``field``, changing nothing else, when no whole page of
        ``tokens`` is cached, or when the distinct pages under pins and TTLs, with those
        claimed by requests in flight, would pass ``max_pinned_pages``.

        Mutates: may split a node (the match), lock counts, the registry.
        """
        if claim is not None:
            self.release_claim(claim)
        m = self._match_whole(tokens, namespace, field)
        if m is None:
            raise FieldError(field, f"{field}: no whole page ({self.page_size} tokens) of the prefix is cached: "
                                    f"nothing to pin")  # fmt: skip
        key = token_key(tokens)[: m.num_tokens * 4]
        expires = None if ttl is None else now + ttl
        old = self.pinned.find("pin", namespace, key)
        if old is not None:
            old.expires_at = later(old.expires_at, expires)
            old.kind = "pin" if old.expires_at is None else "ttl"
            self.pinned.schedule(old)
            return old.info()
        claimed, hard = self._claimed_pages()
        self._check_cap(field, len(m.pages) - self._pages_on_path(m.node, hard), claimed)
        return self._add(Entry(self.pinned.new_id("pin"), "pin" if ttl is None else "ttl", namespace, key, m.node,
                               len(m.pages), now, expires))  # fmt: skip

    def claim_pin(self, tokens, namespace=None, field: str = "pin") -> PendingPin | None:
        """Reserve room under the cap for pinning the whole pages of ``tokens`` later (a
        request with a pin, when it finishes): the pages not pinned now count against the
        cap until ``pin(..., claim=)`` or ``release_claim``. Claims of one prefix count
        once. None when ``tokens`` holds no whole page (nothing will be pinned).

        Raises FieldError naming ``field`` (nothing claimed) beyond the cap. Mutates the
        claims; a bookkeeping match may split a node.
        """
        self._need_tree(field)
        whole = len(tokens) // self.page_size * self.page_size
        if whole == 0:
            return None
        claim = PendingPin(namespace, token_key(tokens[:whole]))
        pk = (claim.namespace, claim.key)
        if pk not in self.pinned.pending:
            m = self.tree.match_prefix(tokens[:whole], namespace, record_stats=False)
            claimed, hard = self._claimed_pages()
            self._check_cap(field, whole // self.page_size - self._pages_on_path(m.node, hard), claimed)
        self.pinned.pending[pk] = self.pinned.pending.get(pk, 0) + 1
        return claim

    def release_claim(self, claim: PendingPin) -> None:
        """Give back one ``claim_pin`` reservation (a request that ended without pinning)."""
        pk = (claim.namespace, claim.key)
        left = self.pinned.pending.get(pk, 0) - 1
        if left > 0:
            self.pinned.pending[pk] = left
        else:
            self.pinned.pending.pop(pk, None)

    def hint(self, tokens, namespace=None, ttl: float = 30.0, now: float = 0.0, uses: int = 1,
             session: str | None = None, kind: str = "hint") -> PinInfo | None:  # fmt: skip
        """Protect the cached whole-page prefix of ``tokens`` as advice (radixkv.cache.pins):
        kind "hint" until ``uses`` admitted sequences continue it (``use_hints``), or kind
        "session" (``session`` required) until the session's next request replaces it;
        either until ``now + ttl``, ``end_session``, or memory pressure (``drop_hint``). A
        hint of the same prefix and session adds its uses and the later expiry. Never
        counted in the cap; None when nothing of ``tokens`` is cached.

        Mutates: may split a node (the match), lock counts, the registry.
        """
        if kind not in SOFT or (kind == "session" and session is None):
            raise ValueError(f"hint kinds are {sorted(SOFT)}; a session entry needs its session")
        m = self._match_whole(tokens, namespace) if self.tree is not None else None
        if m is None:
            return None
        key = token_key(tokens)[: m.num_tokens * 4]
        old = self.pinned.session(session) if kind == "session" else self.pinned.find("hint", namespace, key, session)
        if kind == "hint" and old is not None:
            old.uses += uses
            old.expires_at = later(old.expires_at, now + ttl)
            self.pinned.schedule(old)
            return old.info()
        info = self._add(Entry(self.pinned.new_id(kind), kind, namespace, key, m.node, len(m.pages), now, now + ttl,
                               uses if kind == "hint" else None, session))  # fmt: skip
        if old is not None:  # the session's entry moves (the new lock is taken first: no merge in between)
            self._unpin(old.id)
        return info

    def use_hints(self, seq: SeqKV, session: str | None = None) -> None:
        """``seq`` was admitted and holds its lock: every hint its locked path reaches
        (ends at or below) counts a use, and goes when used up; the earlier session entry
        of ``session`` goes too (replaced by this request). Costs a walk up the path only
        while hints exist. Mutates the registry and lock counts."""
        if seq.node is not None and self.pinned.has_hints():
            node = seq.node
            while node.parent is not None:  # locked by seq all the way up: releases merge nothing here
                for eid in list(self.pinned.hints_on(node)):
                    e = self.pinned.entries[eid]
                    e.uses -= 1
                    if e.uses <= 0:
                        self._unpin(eid)
                        self.pinned.used += 1
                node = node.parent
        if session is not None:
            old = self.pinned.session(session)
            if old is not None:
                self._unpin(old.id)
                self.pinned.used += 1

    def unpin(self, pin_id: str) -> bool:
        """Release the entry ``pin_id`` (any kind); False when there is none (unknown,
        expired, used up). Mutates lock counts and the registry."""
        if pin_id not in self.pinned.entries:
            return False
        self._unpin(pin_id)
        return True

    def end_session(self, session: str) -> int:
        """Release every entry ``session`` owns (its session entry and its hints); returns
        how many. Mutates lock counts and the registry."""
        ids = self.pinned.of_session(session)
        for eid in ids:
            self._unpin(eid)
        self.pinned.forget(session)
        return len(ids)

    def expire(self, now: float) -> int:
        """Release the entries whose expiry is at or before ``now``; O(1) when none is due.
        Returns how many went. Mutates lock counts and the registry."""
        due = self.pinned.due(now)
        for eid in due:
            e = self.pinned.entries[eid]
            self._unpin(eid)
            if e.session is not None:
                self.pinned.forget(e.session)  # only once the program holds nothing more
        self.pinned.expired += len(due)
        self.pinned.refresh_counts()
        return len(due)

    def drop_hint(self, younger_than: int | None = None) -> bool:
        """Give up one hint or session entry under memory pressure (``PinRegistry.soft_victim``'s
        order: the youngest program's first; with ``younger_than``, only a program born
        after that rank); False when there is none. A ``make_room`` for ``reserve``.
        Mutates lock counts and the registry."""
        eid = self.pinned.soft_victim(younger_than)
        if eid is None:
            return False
        self._unpin(eid)
        self.pinned.dropped += 1
        return True

    def pins(self) -> list[PinInfo]:
        """Every entry, oldest first. Does not mutate."""
        return [e.info() for e in self.pinned.entries.values()]

    def _add(self, e: Entry) -> PinInfo:
        self.tree.lock(e.node)
        self.pinned.add(e)
        return e.info()

    def _unpin(self, eid: str) -> None:
        e = self.pinned.remove(eid)
        self.tree.unlock(e.node)

    def _match_whole(self, tokens, namespace, field: str = "tokens"):
        """The tree's match of the whole pages of ``tokens`` (no statistics), or None when
        it holds none."""
        self._need_tree(field)
        m = self.tree.match_prefix(tokens, namespace, record_stats=False)
        return m if len(m.pages) else None

    def _need_tree(self, field: str) -> None:
        if self.tree is None:
            raise FieldError(field, f"{field}: pins and hints need the prefix cache (enable_prefix_cache)")

    @staticmethod
    def _pages_on_path(node: Node, nodes: set[Node]) -> int:
        """Pages of ``node``'s path to the root that lie in ``nodes``."""
        count = 0
        while node.parent is not None:
            if node in nodes:
                count += len(node.pages)
            node = node.parent
        return count

    def _claimed_pages(self) -> tuple[int, set[Node]]:
        """Pages the claims of requests in flight may still pin (their prefixes' whole
        pages not pinned now; a prefix not cached counts whole), and the nodes under
        pins. Matches first (a match may split a node), then the pinned paths."""
        ends = []
        for (namespace, key) in self.pinned.pending:
            m = self.tree.match_prefix(np.frombuffer(key, dtype=np.int32), namespace, record_stats=False)
            ends.append((len(key) // (4 * self.page_size), m.node))
        hard = self.pinned.hard_nodes()
        return sum(total - self._pages_on_path(node, hard) for total, node in ends), hard

    def _check_cap(self, field: str, new: int, claimed: int) -> None:
        total = self.pinned.pinned_pages + claimed + new
        if new > 0 and total > self.max_pinned_pages:
            raise FieldError(field, f"{field}: pinning {new} more pages would put {total} of the pool's "
                                    f"{self.pool.num_pages} pages under pins ({self.pinned.pinned_pages} pinned, "
                                    f"{claimed} claimed by requests in flight); the cap is {self.max_pinned_pages} "
                                    f"pages (max_pinned_share {self.max_pinned_share:g})")  # fmt: skip

    # -- long-context policies ---------------------------------------------------------------

    def next_point(self, seq: SeqKV) -> int | None:
        """The token count at which ``seq`` compresses next, page-aligned, or None (no
        policy, or none left). Prefill-time (an explicit point: ``compress_at``, or a
        ratio's): that point once. Decode-time (a token budget, no explicit point): each
        time its KV would exceed the budget plus the interval. Does not mutate."""
        spec = seq.policy
        if spec is None:
            return None
        if spec.compress_at is not None:
            return spec.compress_at if seq.last_point < spec.compress_at else None
        return seq.dropped + spec.kept_pages() * self.page_size + spec.interval

    def until_point(self, seq: SeqKV) -> int | None:
        """Tokens ``seq`` may compute before its next point (a chunk ends there)."""
        point = self.next_point(seq)
        return None if point is None else point - seq.computed

    def observe_from(self, seq: SeqKV, start: int, count: int) -> int | None:
        """Which of the ``count`` new tokens from ``start`` the attention backend must
        observe for ``seq``'s policy (``SeqInput.observe_from``), or None: all of them
        for h2o; for snapkv those among the last ``OBSERVE_TOKENS`` before the next point."""
        spec, point = seq.policy, self.next_point(seq)
        if point is None or spec.policy.observe == "none":
            return None
        if spec.policy.observe == "all":
            return 0
        first = point - OBSERVE_TOKENS
        return max(0, first - start) if first < start + count else None

    def observe(self, seq: SeqKV, mass: np.ndarray) -> None:
        """Add a step's attention mass (one value per KV entry of the table) to the
        table pages' scores. Mutates ``seq.scores``."""
        sums = page_sums(mass, self.page_size)
        if seq.scores is None:
            seq.scores = np.zeros(len(seq.pages))
        elif len(seq.scores) < len(seq.pages):
            seq.scores = np.concatenate([seq.scores, np.zeros(len(seq.pages) - len(seq.scores))])
        seq.scores[: len(sums)] += sums

    def at_point(self, seq: SeqKV) -> bool:
        """Whether ``seq`` has just computed up to its next point (then ``compress``)."""
        return seq.policy is not None and seq.computed == self.next_point(seq)

    def compress(self, seq: SeqKV, tokens) -> int:
        """Compress ``seq`` at its point (``at_point``): publish what it computed, keep
        its policy's pages and drop the rest from the table; with the prefix cache the
        kept pages become a view (an equal view already stored is taken instead) and the
        sequence goes on in the view's namespace:

            table  |== view or tree pages, all whole ==|     (point = computed)
            ->     |== kept: the new view (locked) ==|       dropped pages stay cached, unlocked

        With ``kv_rerotate`` the kept pages that move are rotated to their new positions
        first (``_move_kept``).

        Returns the pages dropped from the table. Mutates ``seq``, the tree, the views
        and (without a tree) the pool. Raises ValueError away from a point, and
        MemoryError when kept pages must be copied and nothing frees room.
        """
        if not self.at_point(seq):
            raise ValueError(f"compress runs at a point: computed {seq.computed}, next point {self.next_point(seq)}")
        spec, ps, point = seq.policy, self.page_size, seq.computed
        self.commit(seq, tokens)
        n = len(seq.pages)
        scores = seq.scores
        if spec.policy.keys:
            scores = self._keydiff(seq)
        idx = select_pages(spec, n, spec.kept_pages(), None if scores is None else np.asarray(scores)[:n])
        kept = seq.pages[idx]
        kept_scores = seq.scores[idx] if spec.policy.observe == "all" and seq.scores is not None else None
        if self.views is None:  # no prefix cache: the sequence owns every page
            self.pool.free(np.delete(seq.pages, idx))
            if spec.rerotate:
                self._rotate(kept, kept, idx - np.arange(len(idx)))
            seq.pages, seq.dropped = kept.copy(), point - len(kept) * ps
        else:
            key = self._view_key(seq, tokens, point)
            old = self.views.get(key) if spec.rerotate else None
            held = None
            if spec.rerotate and old is None:
                self.pool.incref(kept)  # the kept pages outlive the unlocks below
                held = kept
            if seq.node is not None:
                self.tree.unlock(seq.node)
            if seq.view is not None:
                self.views.unlock(seq.view)
            seq.view, seq.node = None, None
            if held is not None:
                try:
                    kept = held = self._move_kept(held, idx)
                except MemoryError:
                    self._set(seq, _EMPTY, None, 0)
                    raise
            view = old or self.views.add(key, point, kept, kept_scores)
            self.views.lock(view)
            if held is not None:
                self.pool.release(held)
            seq.view = view
            seq.pages, seq.dropped, seq.published = view.pages.copy(), view.dropped, point
            kept_scores = None if view.scores is None else view.scores.copy()
        seq.last_point = point
        seq.scores = kept_scores
        return n - len(idx)

    def _move_kept(self, kept: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``kv_rerotate``: kept page ``i`` (table index ``idx[i]``) goes to position
        ``i * page_size``. A page that moves is rotated in place when the caller's
        reference (taken on every kept page) is its only one, else into a new page;
        unlocked memory is evicted (LRU) while copies find no room, which frees pages or
        leaves kept pages to the caller alone (either helps). Returns the kept pages (the
        caller holds one reference on each). Mutates the pool, the tree, the views;
        MemoryError when eviction can do no more."""
        moved = np.flatnonzero(idx != np.arange(len(idx)))
        shared = moved[self.pool.refcount(kept[moved]) > 1]
        while len(shared) > self.pool.num_free():
            before = (len(shared), self.pool.num_free())
            self._evict(len(shared) - self.pool.num_free())
            shared = moved[self.pool.refcount(kept[moved]) > 1]
            if (len(shared), self.pool.num_free()) == before:
                self.pool.release(kept)  # at a point the sequence owns no page: it ends empty
                raise MemoryError(f"kv_rerotate: no room to copy {len(shared)} kept pages that other running "
                                  "requests share")  # fmt: skip
        out = kept.copy()
        if len(shared):
            out[shared] = self.pool.alloc(len(shared))
        self._rotate(kept[moved], out[moved], idx[moved] - moved)
        if len(shared):
            self.pool.release(kept[shared])  # the caller's reference moves to the copies
        return out

    def _rotate(self, src: np.ndarray, dst: np.ndarray, shift_pages: np.ndarray) -> None:
        """Rotate pages ``src`` into ``dst`` moved back ``shift_pages`` pages (in place:
        ``dst is src``); entries that do not move are skipped."""
        move = shift_pages != 0
        if self.rerotate is not None and move.any():
            self.rerotate(src[move], dst[move], shift_pages[move] * self.page_size)

    def _keydiff(self, seq: SeqKV) -> np.ndarray:
        """KeyDiff scores of ``seq``'s table pages, from the keys in the pool."""
        if not hasattr(self.pool, "read_kv"):
            raise ValueError("keydiff reads keys: it needs a KV pool, not a bare allocator")
        slots = self.pool.slots(seq.pages, 0, seq.kv_len)
        read = lambda layer: self.pool.read_kv(layer, slots)[0].float().cpu().numpy()  # noqa: E731
        return keydiff_scores(read, self.pool.config.num_layers, self.page_size)

    def _view_key(self, seq: SeqKV, tokens, point: int) -> tuple:
        """A view's identity: cache namespace, policy, explicit points up to ``point`` and
        the hash of ``tokens[:point]``."""
        spec = seq.policy
        points = () if spec.compress_at is None or spec.compress_at > point else (spec.compress_at,)
        return (seq.namespace, spec.key(), points, chain_hashes(tokens, self.page_size, point)[-1])

    def _admit_compressed(self, seq: SeqKV, tokens, recompute_from: int | None) -> int:
        """``admit`` under a policy: the deepest view of the policy on ``tokens[:-1]``
        (before ``recompute_from``), then the tree in that view's namespace (or the plain
        namespace without a view), up to what the next point lets the cache serve:

            tokens  |== view (kept pages) ==|== view namespace: tree ==|-- computed again --|point
                                                                        ^ snapkv: its observation window;
                                                                          h2o: all (scores of every query)
        """
        ps, spec = self.page_size, seq.policy
        first = seq.cached_tokens is None
        limit = self.reusable_tokens(tokens, recompute_from)
        view = None
        if limit >= ps and len(self.views):
            hashes = chain_hashes(tokens, ps, limit)
            for i in range(len(hashes) - 1, -1, -1):
                b = (i + 1) * ps
                points = () if spec.compress_at is None or spec.compress_at > b else (spec.compress_at,)
                view = self.views.get((seq.namespace, spec.key(), points, hashes[i]))
                if view is not None:
                    break
        if view is not None:
            self.views.lock(view)
            self.views.hits += 1
            seq.view, seq.dropped, seq.last_point = view, view.dropped, view.point
            seq.scores = None if view.scores is None else view.scores.copy()
            seq.pages = view.pages.copy()
        offset, point = seq.offset, self.next_point(seq)
        seq.computed = seq.published = offset
        stop = limit
        if point is not None and spec.policy.observe == "all":
            stop = offset  # every query's attention feeds the scores: nothing from the tree
        elif point is not None and spec.policy.observe == "window":
            stop = min(stop, point - ceil_div(OBSERVE_TOKENS, ps) * ps)
        elif point is not None:
            stop = min(stop, point - ps)  # a chunk ends at the point: compress runs there
        node = None
        if stop - offset >= ps:
            m = self.tree.match_prefix(tokens[offset:stop], seq.tree_namespace, record_stats=False)
            if len(m.pages):
                node = m.node
                self.tree.lock(node)
                seq.pages = np.concatenate([seq.pages, m.pages])
                seq.computed = seq.published = offset + m.num_tokens
        seq.node = node
        if first:
            seq.cached_tokens = seq.computed
            self.tree.queried_tokens += len(tokens) - 1
            self.tree.hit_tokens += seq.computed
        return seq.computed

    # -- checks ------------------------------------------------------------------------------

    def owners(self, seqs: Iterable[SeqKV]) -> dict[int, int]:
        """Page id -> references the sequences hold (their own pages; for ``check``).
        Does not mutate."""
        tables = [s.pages[s.shared_pages(self.page_size) :] for s in seqs]
        tables = [t for t in tables if len(t)]
        if not tables:
            return {}
        ids, counts = np.unique(np.concatenate(tables), return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist()))

    def check(self, seqs: Sequence[SeqKV]) -> None:
        """Pool and tree invariants with the sequences' references counted exactly:
        every reference is the tree's or a listed sequence's, and each sequence's
        shared pages are exactly the pages of its locked path (a page is never read
        under another prefix's identity). Raises IntegrityError."""
        for s in seqs:
            vp = 0
            if s.view is not None:
                vp = len(s.view.pages)
                if not s.view.alive or s.view.lock_ref < 1:
                    raise IntegrityError("a sequence's view is evicted or unlocked")
                if s.view.pages.tobytes() != s.pages[:vp].tobytes():
                    raise IntegrityError("a sequence's first pages are not its view's")
            shared = s.shared_pages(self.page_size) - vp
            if s.node is None:
                if shared:
                    raise IntegrityError(f"a sequence reads {shared} tree pages without a lock")
                continue
            if not s.node.alive or s.node.lock_ref < 1:
                raise IntegrityError("a sequence's node is evicted or unlocked")
            if s.node.namespace != s.tree_namespace:
                raise IntegrityError("a sequence's node lies in another namespace than its view's")
            if s.node.path_pages().tobytes() != s.pages[vp : vp + shared].tobytes():
                raise IntegrityError("a sequence's shared pages are not the pages of its locked path")
        if self.tree is not None:
            self._check_locks(seqs)
            self.views.check()
            refs = self.owners(seqs)
            for page, n in self.views.owners().items():
                refs[page] = refs.get(page, 0) + n
            self.tree.check_integrity(external_refs=refs)
            if self.events is not None and set(map(hash_of, self.events.device.values())) != tree_blocks(self.tree):
                raise IntegrityError("the KV events' device pages differ from the tree's")
        else:
            self.pool.check_integrity()
            refs = self.pool.refcounts()
            expected = np.zeros_like(refs)
            for page, n in self.owners(seqs).items():
                expected[page] = n
            if not np.array_equal(refs, expected):
                bad = int(np.flatnonzero(refs != expected)[0])
                raise IntegrityError(f"page {bad}: refcount {refs[bad]} but sequences hold {expected[bad]}")

    def _check_locks(self, seqs: Sequence[SeqKV]) -> None:
        """Every tree lock has its owner: a node's lock count is exactly the sequences and
        the pin entries (radixkv.cache.pins) whose locked path holds it; every entry's node
        is alive and ends its prefix's whole pages. Raises IntegrityError."""
        ends = [s.node for s in seqs if s.node is not None]
        for e in self.pinned.entries.values():
            if not e.node.alive or e.node.namespace != e.namespace:
                raise IntegrityError(f"{e.id}: its node was evicted or lies in another namespace")
            if e.node.path_key() != e.key or len(e.node.path_pages()) != e.pages:
                raise IntegrityError(f"{e.id}: its node does not end its {e.tokens} tokens")
            ends.append(e.node)
        expected: dict[Node, int] = {}
        for node in ends:
            while node.parent is not None:
                expected[node] = expected.get(node, 0) + 1
                node = node.parent
        for node in self.tree.nodes():
            if node.lock_ref != expected.get(node, 0):
                raise IntegrityError(f"{node!r}: {node.lock_ref} locks but its owners (sequences, pins) hold "
                                     f"{expected.get(node, 0)}")  # fmt: skip

    # -- internals ---------------------------------------------------------------------------

    def _promote(self, seq: SeqKV, tokens, node: Node | None, pages: PageIds) -> tuple[Node | None, PageIds]:
        """Extend a tree match (``node``, ``pages``) with the run of pages of ``tokens``
        that follows it in the lower tiers: as many as the pool has room for (evicting
        unlocked leaves, never the match), written into fresh pages the tree adopts.
        Returns the match's new end and pages. Mutates pool, tree and tiers."""
        start = len(pages)
        limit = len(tokens) // self.page_size - start
        rows = self.tiers.fetch(tokens, seq.namespace, start, limit) if limit > 0 else None
        if rows is None:
            return node, pages
        if node is not None:
            self.tree.lock(node)  # the match must survive the room made for what follows it
        try:
            short = len(rows) - self.pool.num_free()
            if short > 0:
                self.tree.evict(short)
            n = min(len(rows), self.pool.num_free())
            if n == 0:
                return node, pages
            new = self.pool.alloc(n)
            self.pool.write_pages(new, rows[:n])
            table = np.concatenate([pages, new])
            end = self.tree.insert(tokens[: len(table) * self.page_size], table, seq.namespace, seq.priority, adopt=True).node
            return end, table
        finally:
            if node is not None:
                self.tree.unlock(node)

    def _publish(self, seq: SeqKV, tokens, whole: int) -> Node:
        """Insert ``tokens[:whole]`` with ``seq``'s pages; the tree adopts the new ones.
        Where the tree already held some of the tokens (a prompt recomputed for its
        logprobs, a sequence resumed after preemption), ``seq`` takes the tree's pages
        and frees its own copies:

            seq.pages  |== tree's ==|== own copies of cached tokens ==|== new ==|partial|
                                     -> the tree's pages (own freed)  -> adopted

        Sets ``seq.published = whole``; returns the node that ends it (not locked).
        """
        ps, offset = self.page_size, seq.offset
        vp = 0 if seq.view is None else len(seq.view.pages)
        pages = seq.pages[vp:]  # the namespace's part of the table
        generated = None if seq.prompt_len is None else seq.prompt_len - offset
        inserted = self.tree.insert(tokens[offset:whole], pages, seq.tree_namespace, seq.priority, adopt=True,
                                    generated_from=generated)  # fmt: skip
        own, cached = (seq.published - offset) // ps, inserted.num_cached // ps
        if self.tiers is not None and seq.view is None:
            self.tiers.published(tokens, seq.namespace, seq.pages, max(own, cached), whole // ps)
        if cached > own:
            self.pool.free(pages[own:cached])
            pages = np.concatenate([inserted.node.path_pages()[:cached], pages[cached:]])
            seq.pages = np.concatenate([seq.pages[:vp], pages])
        seq.published = whole
        return inserted.node

    # -- internals ---------------------------------------------------------------------------

    def _on_evict(self, leaf: Node, keep: int) -> None:
        """The tree's ``on_evict``: the device drops ``leaf.pages[keep:]``; the tiers demote
        them and the events say where they went."""
        moved = self.events.evicting(leaf, keep) if self.events is not None else None
        if self.tiers is not None:
            host = self.tiers.demote(leaf, keep)
            if moved is not None and host is not None:
                self.events.demoted(moved, *host)

    def _dropped(self, leaf: Node, keep: int) -> None:
        """``on_evict`` while flushing: pages dropped, never demoted."""
        self.events.evicting(leaf, keep)

    def _evict(self, num_pages: int) -> int:
        """Free ``num_pages`` pages if unlocked memory holds them: tree leaves first, then
        long-context views (least recently used). Returns the pages freed."""
        if self.tree is None:
            return 0
        freed = self.tree.evict(num_pages)
        if freed < num_pages and len(self.views):
            freed += self.views.evict(num_pages - freed)
        return freed

    @staticmethod
    def _set(seq: SeqKV, pages: PageIds, node: Node | None, computed: int) -> None:
        seq.pages, seq.node, seq.computed, seq.published = pages, node, computed, computed
        seq.view, seq.dropped, seq.last_point, seq.scores = None, 0, 0, None
