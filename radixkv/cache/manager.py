"""KVCacheManager: the one owner of KV memory at the level of sequences.

The page allocator counts references and the radix tree holds cached prefixes; this
class is the only code that drives both for sequences (the engine's scheduler and
``radixkv sim`` alike), so the simulator replays exactly what the engine does. A
sequence's state is a ``SeqKV`` handle, which only the manager changes:

    tokens   |============= prompt =============|======= output =======|
             |== published: whole pages in the tree, path locked ==|
             |================ computed: KV in pages =================|todo|
    pages    |== the tree's pages (shared) ==|== own pages ==|partial|

Life of a sequence:

    admit    match tokens[:-1] in the tree, lock the match, take a reference on its pages
    reserve  grow the page table for the next chunk (evict first; else the caller's
             make_room frees memory, e.g. by preempting; else refuse)
    (the caller computes KV and calls ``computed``)
    commit   publish the whole computed pages into the tree (a prefill chunk); where
             the tree already held those tokens, take its pages and free the own copies
    release  publish, unlock, drop every reference (the partial last page goes free);
             the handle is empty again and can be admitted anew (preemption)

The last prompt token is never matched: its logits are needed to sample the first
output token. With ``recompute_from`` (prompt logprobs), prompt positions from there on
are computed again, and only the pages before them are taken from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from radixkv.cache.pool import PageAllocator, PageIds
from radixkv.cache.radix import Node, RadixCache
from radixkv.errors import IntegrityError
from radixkv.validate import ceil_div

_EMPTY = np.empty(0, dtype=np.int32)


@dataclass(eq=False)
class SeqKV:
    """One sequence's KV memory. Read its fields; only ``KVCacheManager`` writes them.

    ``pages``: the page table (int32, one reference held on each); ``node``: the locked
    tree node that ends the published pages (None when nothing is locked);
    ``computed``: tokens whose KV is in ``pages``; ``published``: tokens whose whole
    pages the tree holds through ``node``; ``cached_tokens``: prompt tokens served from
    the cache at the first admission (None before it).
    """

    namespace: object = None
    priority: int = 0
    pages: PageIds = field(default_factory=lambda: _EMPTY)
    node: Node | None = None
    computed: int = 0
    published: int = 0
    cached_tokens: int | None = None


class KVCacheManager:
    """Sequences' KV over one ``PageAllocator`` (a ``KVPool`` in the engine) and an
    optional ``RadixCache`` (None: no prefix cache, every sequence computes all).

    Every method says what it mutates; none is thread-safe (one thread owns memory).
    """

    def __init__(self, pool: PageAllocator, tree: RadixCache | None, page_size: int):
        if tree is not None and tree.page_size != page_size:
            raise ValueError(f"page_size {page_size} but the tree's pages hold {tree.page_size} tokens")
        self.pool = pool
        self.tree = tree
        self.page_size = page_size

    # -- queries -------------------------------------------------------------------------

    def cached_len(self, tokens, namespace=None) -> int:
        """Tokens ``admit`` would take from the cache now (whole pages of ``tokens[:-1]``).
        May split a tree node (as ``match_prefix`` does); counts no statistics."""
        if self.tree is None or len(tokens) < 2:
            return 0
        return self.tree.match_prefix(tokens[:-1], namespace, record_stats=False).num_tokens

    def pages_needed(self, seq: SeqKV, count: int) -> int:
        """More pages ``seq`` needs to compute ``count`` more tokens. Does not mutate."""
        return ceil_div(seq.computed + count, self.page_size) - len(seq.pages)

    # -- the lifecycle ---------------------------------------------------------------------

    def admit(self, seq: SeqKV, tokens, recompute_from: int | None = None) -> int:
        """Take the cached prefix of ``tokens[:-1]``: lock it and reference its pages.

        With ``recompute_from``, only the whole pages before that prompt position are
        taken (and locked); the rest of the cached copy stays evictable, so a prompt
        computed again never holds the pool twice. Returns ``seq.computed``.

        Mutates ``seq`` (which must be empty: fresh or released), the tree's lock
        counts, access times and statistics (on the first admission only, so a
        preempted sequence is not counted twice), and reference counts. Raises
        ValueError for a sequence that still holds memory.
        """
        if len(seq.pages) or seq.node is not None:
            raise ValueError("admit takes an empty sequence (fresh, or released)")
        if self.tree is None or len(tokens) < 2:
            self._set(seq, _EMPTY, None, 0)
            return 0
        first = seq.cached_tokens is None
        m = self.tree.match_prefix(tokens[:-1], seq.namespace, record_stats=first)
        node, pages = (m.node if len(m.pages) else None), m.pages
        keep = len(pages) if recompute_from is None else max(0, recompute_from - 1) // self.page_size
        if keep < len(pages):
            #   cached  |== kept, locked ==|===== recomputed; the tree's copy unlocked =====|
            pages = pages[:keep]
            node = None
            if keep:
                node = self.tree.match_prefix(tokens[: keep * self.page_size], seq.namespace, record_stats=False).node
        if node is not None:
            self.tree.lock(node)
        self.pool.incref(pages)
        self._set(seq, pages, node, len(pages) * self.page_size)
        if first:
            seq.cached_tokens = seq.computed
        return seq.computed

    def reserve(self, seq: SeqKV, count: int, make_room: Callable[[], bool] | None = None) -> bool:
        """Grow ``seq``'s page table to hold ``count`` more tokens. When the pool is
        short, evicts unlocked tree leaves first, then calls ``make_room()`` (which
        frees memory some other way, e.g. preempting a sequence, and returns False when
        it cannot) until there is room. Returns False, with ``seq`` unchanged, when
        there is none.

        Mutates the pool (allocation), the tree (eviction) and ``seq.pages``.
        """
        need = self.pages_needed(seq, count)
        while need > self.pool.num_free():
            if self.tree is not None and self.tree.evict(need - self.pool.num_free()):
                continue
            if make_room is None or not make_room():
                return False
        if need > 0:
            seq.pages = np.concatenate([seq.pages, self.pool.alloc(need)])
        return True

    def computed(self, seq: SeqKV, upto: int) -> None:
        """Record that KV for ``tokens[:upto]`` is now in ``seq``'s pages. Raises
        ValueError past the page table."""
        if not seq.computed <= upto <= len(seq.pages) * self.page_size:
            raise ValueError(f"computed must grow within the page table: {seq.computed} -> {upto}, "
                             f"{len(seq.pages)} pages")  # fmt: skip
        seq.computed = upto

    def commit(self, seq: SeqKV, tokens) -> None:
        """Publish ``seq``'s whole computed pages (``tokens[:computed]``) into the tree
        and move its lock to the node that ends them. Where the tree already held those
        tokens (a prompt recomputed for its logprobs, a sequence resumed after
        preemption), ``seq`` takes the tree's pages and its own copies go free:

            seq.pages  |== own copies of cached tokens ==|== new ==|partial|
                        -> the tree's pages (own freed)     -> tree

        Mutates the tree, reference counts and ``seq``. No-op without a tree or when
        nothing new is whole.
        """
        whole = seq.computed // self.page_size * self.page_size
        if self.tree is None or whole <= seq.published:
            return
        inserted = self.tree.insert(tokens[:whole], seq.pages, seq.namespace, seq.priority)
        node = inserted.node
        if inserted.num_cached > seq.published:  # the tree had some of these: own copies may be dupes
            n = whole // self.page_size
            held = node.path_pages()[:n]
            dupes = seq.pages[:n] != held
            if dupes.any():
                self.pool.incref(held[dupes])
                self.pool.decref(seq.pages[:n][dupes])
                seq.pages = np.concatenate([held, seq.pages[n:]])
        self.tree.lock(node)
        if seq.node is not None:
            self.tree.unlock(seq.node)
        seq.node = node
        seq.published = whole

    def release(self, seq: SeqKV, tokens) -> None:
        """``seq`` is done (or preempted): publish its whole computed pages, unlock, drop
        every reference; the partial last page and pages the tree had already go free:

            tokens  |===== computed, whole pages =====|partial|not computed|
                    |-> tree (dupes of tree pages go)  |-> free            |

        Mutates the tree, reference counts and ``seq`` (empty afterwards, ``computed``
        0, ready to be admitted again).
        """
        if self.tree is not None and seq.computed >= self.page_size:
            self.tree.insert(tokens[: seq.computed], seq.pages, seq.namespace, seq.priority)
        if seq.node is not None:
            self.tree.unlock(seq.node)
        self.pool.decref(seq.pages)
        self._set(seq, _EMPTY, None, 0)

    def flush(self) -> int:
        """Evict every unlocked page of the tree; return how many went free."""
        return self.tree.evict(self.tree.cached_pages) if self.tree is not None else 0

    # -- checks ------------------------------------------------------------------------------

    @staticmethod
    def owners(seqs: Iterable[SeqKV]) -> dict[int, int]:
        """Page id -> references the sequences hold (for ``check``). Does not mutate."""
        tables = [s.pages for s in seqs if len(s.pages)]
        if not tables:
            return {}
        ids, counts = np.unique(np.concatenate(tables), return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist()))

    def check(self, seqs: Sequence[SeqKV]) -> None:
        """Pool and tree invariants with the sequences' references counted exactly:
        every reference is the tree's or a listed sequence's. Raises IntegrityError."""
        if self.tree is not None:
            self.tree.check_integrity(external_refs=self.owners(seqs))
        else:
            self.pool.check_integrity()
            refs = self.pool.refcounts()
            expected = np.zeros_like(refs)
            for page, n in self.owners(seqs).items():
                expected[page] = n
            if not np.array_equal(refs, expected):
                bad = int(np.flatnonzero(refs != expected)[0])
                raise IntegrityError(f"page {bad}: refcount {refs[bad]} but sequences hold {expected[bad]}")

    # -- internals ---------------------------------------------------------------------------

    @staticmethod
    def _set(seq: SeqKV, pages: PageIds, node: Node | None, computed: int) -> None:
        seq.pages, seq.node, seq.computed, seq.published = pages, node, computed, computed
