"""Radix tree over token runs: the prefix cache.

Each edge holds a run of tokens (a whole number of pages) and the KV pages behind it.
A request's partial last page never enters the tree.

Representation, chosen so that the hot paths run in C:

- a node's tokens are ``bytes`` (int32, native order, 4 bytes a token), so edge
  comparison is one ``bytes.startswith`` call, and a mismatch inside an edge is found
  by a binary search of such calls;
- children are keyed by the bytes of their first page;
- a node's pages are a 1-D ``np.int32`` array (see ``pool.py``);
- candidates for eviction live in a lazy heap: ``match_prefix`` and ``insert`` only
  stamp the deepest node they reach, a removed leaf folds its statistics into its
  parent, and stale heap entries are re-keyed when they surface. Walks touch each node
  on the path once, and no operation a request makes scans the whole tree (only
  ``check_integrity`` and ``nodes`` do);
- which pages the tree holds is one mark per pool page, so ``insert`` checks the pages
  it is about to take (held already? listed twice?) in a few vectorised calls;
- a namespace has a stored root only while it holds a node: the root goes when
  eviction removes its last child, so tenants that come and go leave nothing behind.

Tokens may be given as a list or tuple of ints, an ``array('i')``, a NumPy integer
array or an integer tensor; ``array('i')`` and ``np.int32`` arrays convert without a
Python-level loop, which is what the engine keeps per request.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch

from radixkv.cache.policy import EvictionPolicy, make_policy
from radixkv.cache.pool import PageAllocator, PageIds, as_page_ids
from radixkv.errors import IntegrityError
from radixkv.kernels import pages as page_loops

_TOKEN = 4  # bytes per token in a key
_INT32_MAX = 2**31 - 1
_EMPTY_PAGES = np.empty(0, dtype=np.int32)
_EMPTY_PAGES.flags.writeable = False


def token_key(tokens, field: str = "tokens") -> bytes:
    """Encode token ids as the tree's key: int32 in native byte order.

    Any int32 value is a valid token for the tree. Raises ValueError for anything
    that is not a 1-D run of integers within int32.
    """
    if isinstance(tokens, array) and tokens.typecode == "i":
        return tokens.tobytes()
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{field} must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        if tokens.dtype != np.int32:
            if tokens.size and (tokens.min() < -(2**31) or tokens.max() > _INT32_MAX):
                raise ValueError(f"{field} must fit in int32")
            tokens = tokens.astype(np.int32)
        return tokens.tobytes()
    if isinstance(tokens, (str, bytes, bytearray)):
        raise ValueError(f"{field} must be token ids, not {type(tokens).__name__}")
    try:
        return array("i", tokens).tobytes()
    except (OverflowError, TypeError) as e:
        raise ValueError(f"{field} must be integers that fit in int32: {e}") from None


class Node:
    """One edge of the tree and the node it leads to.

    ``key``: the edge's tokens (int32 bytes); ``pages``: its page ids, one per
    ``page_size`` tokens; ``lock_ref``: how many locks pin this node (a lock pins its
    whole path to the root). The statistics feed the eviction policies, with ``depth``
    (tokens above the edge) and ``generated`` (the edge is mostly generated text).
    """

    __slots__ = (
        "key", "pages", "children", "parent", "lock_ref",
        "last_access", "hits", "created", "priority", "in_heap", "alive", "namespace", "depth", "generated",
    )  # fmt: skip

    def __init__(self, key: bytes, pages: PageIds, parent: Node | None, tick: int, namespace=None, depth: int = 0,
                 generated: bool = False):  # fmt: skip
        self.key = key
        self.pages = pages
        self.children: dict[bytes, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = tick
        self.hits = 0
        self.created = tick
        self.priority = 0
        self.in_heap = False
        self.alive = True
        self.namespace = namespace
        self.depth = depth  # tokens on the path above this edge
        self.generated = generated  # most of the edge's tokens were generated, not prompt

    @property
    def num_tokens(self) -> int:
        return len(self.key) // _TOKEN

    def tokens(self) -> list[int]:
        """This edge's token ids."""
        return array("i", self.key).tolist()

    def _path(self) -> list[Node]:
        """The nodes from the root (included) down to this one."""
        nodes = []
        node = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def path_key(self) -> bytes:
        """All tokens from the root to the end of this node, as a key."""
        return b"".join(n.key for n in self._path())

    def path_pages(self) -> PageIds:
        """All pages from the root to the end of this node, in order (a new array)."""
        nodes = self._path()
        return np.concatenate([n.pages for n in nodes]) if len(nodes) > 1 else _EMPTY_PAGES

    def __repr__(self) -> str:
        return f"Node(tokens={self.num_tokens}, pages={len(self.pages)}, lock_ref={self.lock_ref})"


class Match(NamedTuple):
    """Result of ``match_prefix``.

    ``pages``: page ids of the cached prefix (a fresh int32 array; read-only when empty);
    ``num_tokens``: cached tokens, ``len(pages) * page_size``;
    ``node``: the node where the match ends (a root when nothing matched), to ``lock``.
    """

    pages: PageIds
    num_tokens: int
    node: Node


class Partial(NamedTuple):
    """Result of ``partial_page``: ``page``, the tree's page whose first ``count``
    tokens continue the match; ``node``, the edge that begins with it."""

    page: int
    count: int
    node: Node


class Inserted(NamedTuple):
    """Result of ``insert``.

    ``num_cached``: tokens the tree held already (the caller's pages for them are
    duplicates, the caller's to release); ``node``: the node that ends the inserted
    whole pages, to ``lock`` next (no second walk); a root when nothing was inserted.
    """

    num_cached: int
    node: Node


class TreeStats(NamedTuple):
    """Counters only grow; the page figures are current values."""

    queried_tokens: int
    hit_tokens: int
    inserted_pages: int
    evicted_pages: int
    cached_pages: int
    protected_pages: int
    evictable_pages: int
    num_nodes: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class RadixCache:
    """Prefix cache over whole KV pages, with namespaces and pluggable eviction.

    ``allocator`` is the page pool (``PageAllocator`` or ``KVPool``); the tree holds
    one reference on every page it contains, and each page at most once, whatever its
    namespace. Equal tokens under different ``namespace`` values never share pages.
    """

    def __init__(self, allocator: PageAllocator, page_size: int = 1, policy: str | EvictionPolicy = "lru"):
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if not isinstance(allocator, PageAllocator):
            raise TypeError(f"allocator must be a PageAllocator, got {type(allocator).__name__}")
        self.allocator = allocator
        self.page_size = page_size
        self.policy = make_policy(policy)
        self._width = page_size * _TOKEN  # bytes per page in a key
        self._roots: dict[object, Node] = {}  # only namespaces that hold a node
        self._held = np.zeros(allocator.num_pages, dtype=np.int32)  # page -> in the tree (nonzero)
        self._refs = allocator.refcounts()  # a read-only view, for _hold's ownership check
        self._loops = allocator.loops
        # candidates: one lazy heap per policy class (most policies have one)
        self._heaps: list[list[tuple]] = [[] for _ in range(self.policy.classes)]
        self._entries = 0  # heap entries, stale ones included
        self._observe = self.policy.observes
        self._seq = 0  # heap tie-breaker
        self._tick = 0  # logical clock for access statistics
        self._num_nodes = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.inserted_pages = 0
        self.evicted_pages = 0
        # called with (leaf, keep) before a victim's pages leaf.pages[keep:] are released
        # (the leaf still whole): the tiers demote them (radixkv.cache.tiers)
        self.on_evict: Callable[[Node, int], None] | None = None
        # called with each new leaf once linked (its pages are the ones just added): KV events
        self.on_insert: Callable[[Node], None] | None = None
        self.protected_pages = 0

    # -- queries ---------------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        return self.inserted_pages - self.evicted_pages

    @property
    def evictable_pages(self) -> int:
        return self.cached_pages - self.protected_pages

    def stats(self) -> TreeStats:
        """Current counters. Does not mutate."""
        return TreeStats(
            self.queried_tokens, self.hit_tokens, self.inserted_pages, self.evicted_pages,
            self.cached_pages, self.protected_pages, self.evictable_pages, self._num_nodes,
        )  # fmt: skip

    def root(self, namespace=None) -> Node:
        """The root of ``namespace``'s tree. Does not mutate.

        Only a namespace that holds a node keeps a stored root. For any other (never
        used, or emptied by eviction) this returns a new empty root, linked to nothing,
        which serves every use of a root: matching from it finds nothing, locking and
        unlocking it do nothing, and the first ``insert`` into the namespace stores a
        root of its own.
        """
        root = self._roots.get(namespace)
        if root is None:
            root = Node(b"", _EMPTY_PAGES, None, self._tick, namespace)
        return root

    def nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children. Does not mutate."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    # -- the four operations ---------------------------------------------------

    def match_prefix(self, tokens, namespace=None, record_stats: bool = True) -> Match:
        """Find the longest cached prefix of ``tokens`` made of whole pages.

        Mutates: may split a node so that the match ends exactly at a node, stamps that
        node's access time and hit count, and (unless ``record_stats`` is False, for
        bookkeeping lookups that are not requests) adds to ``queried_tokens`` and
        ``hit_tokens``. Stores nothing for a namespace that holds nothing (the match
        ends at a new empty root, see ``root``). Nothing is locked or referenced:
        ``lock(match.node)`` before any other call that may evict. Raises ValueError for
        empty or invalid tokens.
        """
        key = tokens.tobytes() if type(tokens) is array and tokens.typecode == "i" else token_key(tokens)
        if not key:
            raise ValueError("tokens must not be empty")
        node = self._roots.get(namespace) or self.root(namespace)
        width = self._width
        end = len(key) - len(key) % width
        startswith = key.startswith
        pos = 0
        parts = []
        while pos < end:
            child = node.children.get(key[pos : pos + width])
            if child is None:
                break
            edge = child.key
            if startswith(edge, pos):
                parts.append(child.pages)
                pos += len(edge)
                node = child
                continue
            node = self._split(child, self._common_pages(key, pos, end, edge))
            parts.append(node.pages)
            pos += len(node.key)
            break
        self._tick += 1
        if self._observe and pos and record_stats:
            self.policy.hit(node, self._tick - node.last_access)
        node.last_access = self._tick
        if record_stats:
            node.hits += 1
            self.queried_tokens += len(key) // _TOKEN
            self.hit_tokens += pos // _TOKEN
        if len(parts) > 1:
            pages = np.concatenate(parts)
        else:
            pages = parts[0].copy() if parts else _EMPTY_PAGES
        return Match(pages, pos // _TOKEN, node)

    def partial_page(self, node: Node, tokens, limit: int | None = None, record_stats: bool = True) -> Partial | None:
        """The cached page that best continues a match inside a page: of the edges
        below ``node`` (where ``match_prefix`` of ``tokens`` ended), the one whose first
        page shares the most leading tokens with the ``tokens`` that follow the match, at
        most ``limit`` of them (default: all that follow) and fewer than a page (a
        whole page would have matched). None when no edge shares a token. The caller
        copies those tokens' KV out of ``Partial.page`` (into a page of its own: the
        tree's page is never shared part-way) before anything may evict it.

            tokens  |== match (whole pages) ==|== count ==|...
            edge                              |== count ==|differs ...  (page = its first)

        Mutates: stamps the edge's access time, and (with ``record_stats``) adds
        ``count`` to ``hit_tokens``. ``tokens`` must begin with ``node``'s path."""
        if not node.children:
            return None
        start = node.depth + node.num_tokens
        stop = min(len(tokens), start + self.page_size - 1, len(tokens) if limit is None else start + limit)
        if stop <= start:
            return None
        rest = token_key(tokens[start:stop])  # the tokens that follow the match: under a page
        head = rest[:_TOKEN]
        firsts = [first for first in node.children if first.startswith(head)]
        if not firsts:
            return None
        n = len(rest) // _TOKEN  # tokens each edge's first page shares with rest: all at once
        equal = np.frombuffer(b"".join(f[: len(rest)] for f in firsts), np.int32).reshape(-1, n) == np.frombuffer(
            rest, np.int32)  # fmt: skip
        shared = np.where(equal.all(1), n, equal.argmin(1))
        at = int(shared.argmax())  # the first of the longest
        best, count = node.children[firsts[at]], int(shared[at])
        best.last_access = self._tick
        if record_stats:
            self.hit_tokens += count
        return Partial(int(best.pages[0]), count, best)

    def insert(self, tokens, pages, namespace=None, priority: int = 0, adopt: bool = False,
               generated_from: int | None = None) -> Inserted:  # fmt: skip
        """Cache the whole pages of ``tokens``; return how many tokens were cached
        already and the node that ends them (see ``Inserted``).

        ``pages`` is the sequence's page table (at least one id per whole page; ids
        past the whole pages are ignored). The tree takes a reference on each page it
        adds, or with ``adopt`` takes over the caller's (the caller forgets those
        pages: ``pages[num_cached // page_size : whole pages]``); for the already-cached
        prefix it keeps its own pages, and the caller's copies of those, like
        everything else the caller owns, are the caller's to release:

            tokens   |== cached already ==|====== new whole pages ======|partial|
            pages    | caller's duplicates | tree increfs (or adopts)    | private|
                       not checked           checked: owned, distinct,
                                             held by no node (any namespace)

        ``generated_from``: where generated tokens begin in ``tokens`` (None: all
        prompt); a new leaf that is mostly generated text is marked ``generated``, for
        policies that learn how often such pages come back.

        Mutates: may split a node, adds at most one leaf (and the namespace's root
        if it held nothing), stamps the leaf's access time and raises its ``priority``
        to at least ``priority``. Tokens shorter than a page change nothing. Raises
        ValueError, changing nothing, for empty tokens, too few pages, or new pages
        that are out of range, free (nobody owns them), listed twice, or already held
        by the tree; the message names ``pages`` and the offending ids.
        """
        key = token_key(tokens)
        if not key:
            raise ValueError("tokens must not be empty")
        pages = as_page_ids(pages)
        width = self._width
        num_pages = len(key) // width
        if len(pages) < num_pages:
            raise ValueError(f"pages has {len(pages)} ids but tokens fill {num_pages} whole pages")
        end = num_pages * width
        if not end:
            return Inserted(0, self.root(namespace))
        # Walk without changing anything: to the deepest node the key covers, and the
        # edge below it (`child`) that the key leaves after `cut` of its pages.
        root = node = self._roots.get(namespace)
        child = None
        cut = pos = 0
        if root is not None:
            children = node.children
            while pos < end:
                child = children.get(key[pos : pos + width])
                if child is None:
                    break
                edge = child.key
                if key.startswith(edge, pos):
                    pos += len(edge)
                    node = child
                    children = node.children
                    child = None
                    continue
                cut = self._common_pages(key, pos, end, edge)
                break
        start = pos + cut * width  # where the new pages begin
        new_pages = None
        if start < end:
            new_pages = pages[start // width : num_pages].copy()
            self._hold(new_pages, adopt)  # ValueError for ids out of range, held, repeated, free: no change
            if not adopt:
                try:
                    self.allocator.incref(new_pages)
                except ValueError:
                    self._loops.fill(self._held, new_pages, 0)
                    raise
        # -- validated: mutate from here on --
        if cut:
            node = self._split(child, cut)
        if new_pages is not None:
            if node is None:  # the namespace held nothing: store a root for it
                node = self._roots[namespace] = Node(b"", _EMPTY_PAGES, None, self._tick, namespace)
            first = start // _TOKEN
            generated = generated_from is not None and 2 * generated_from <= first + end // _TOKEN
            leaf = Node(key[start:end], new_pages, node, self._tick, namespace, first, generated)
            node.children[key[start : start + width]] = leaf
            self._num_nodes += 1
            self.inserted_pages += len(new_pages)
            self._push(leaf)
            if self.on_insert is not None:
                self.on_insert(leaf)
            node = leaf
        self._tick += 1
        node.last_access = self._tick
        if priority > node.priority:
            node.priority = priority
        return Inserted(start // _TOKEN, node)

    def _hold(self, pages: PageIds, adopt: bool) -> None:
        """Mark ``pages`` held by the tree. ValueError, changing nothing, unless each id
        is in range, held by no node, listed once and (with ``adopt``) owned by the
        caller. One pass (``radixkv.kernels.pages.hold``)."""
        status = self._loops.hold(self._held, self._refs, pages, adopt)
        if status == page_loops.OUT_OF_RANGE:
            raise ValueError(f"pages must lie in [0, {self.allocator.num_pages}), got {pages.min()}..{pages.max()}")
        if status == page_loops.HELD:
            held = self._held.take(pages)
            raise ValueError(f"pages already held by the tree (in some namespace): {pages[held != 0][:8].tolist()}")
        if status == page_loops.NOT_OWNED:
            free = self._refs.take(pages) == 0
            raise ValueError(f"pages not owned by anybody cannot be adopted: {pages[free][:8].tolist()}")
        if status == page_loops.TWICE:
            ids, counts = np.unique(pages, return_counts=True)
            raise ValueError(f"pages lists ids twice: {ids[counts > 1][:8].tolist()}")

    def lock(self, node: Node) -> None:
        """Pin ``node`` and its path to the root against eviction (counted: lock twice,
        unlock twice). Locking a root does nothing.

        Mutates lock counts. Raises ValueError if ``node`` was evicted.
        """
        if not node.alive:
            raise ValueError("cannot lock a node that was evicted")
        while node.parent is not None:
            if node.lock_ref == 0:
                self.protected_pages += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``. Nodes whose count reaches 0 become evictable.

        An unlocked node left with a single child is merged into that child, so a
        conversation that grows turn by turn stays one edge instead of a chain of
        them: ``node`` itself may be gone afterwards (match again to get a handle).

        Mutates lock counts and may merge nodes. Raises ValueError, changing nothing,
        if ``node`` is not locked or was evicted.
        """
        if not node.alive:
            raise ValueError("cannot unlock a node that was evicted")
        if node.parent is not None and node.lock_ref <= 0:
            raise ValueError("node is not locked")
        while node.parent is not None:
            parent = node.parent
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_pages -= len(node.pages)
                if not node.children:
                    self._push(node)
                elif len(node.children) == 1:
                    self._merge_into_child(node)
            node = parent

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages if unlocked leaves hold them; return how
        many pages went back to the free stack.

        Leaves go in policy order; a leaf holding more than is still needed loses only
        its tail pages, and a parent becomes a candidate once its last child is gone:

            leaf edge  |=========== kept ===========|==== dropped ====|
                        root side                     tail, `need` pages

        Mutates the tree and the allocator. Locked nodes are never touched. Raises
        ValueError for a negative ``num_pages``.
        """
        if not isinstance(num_pages, (int, np.integer)) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        freed = 0
        while freed < num_pages:
            # Collect victims for the whole shortfall, then release their pages in one
            # call; loop again only if some dropped page had another owner.
            dropped = []
            taken = 0
            while freed + taken < num_pages:
                picked = self._next_victim(num_pages - freed - taken)
                if picked is None:
                    break
                leaf, drop = picked
                keep = len(leaf.pages) - drop
                if self._observe:
                    self.policy.evicted(leaf, self._tick - leaf.last_access, drop)
                if self.on_evict is not None:
                    self.on_evict(leaf, keep)
                dropped.append(leaf.pages[keep:])
                taken += drop
                if keep:
                    leaf.pages = leaf.pages[:keep]
                    leaf.key = leaf.key[: keep * self._width]
                    self._push(leaf)
                else:
                    self._remove_leaf(leaf)
            if not dropped:
                break
            self.evicted_pages += taken
            dropped = dropped[0] if len(dropped) == 1 else np.concatenate(dropped)
            self._loops.fill(self._held, dropped, 0)
            freed += self.allocator.release(dropped)
        return freed

    def drop_namespace(self, namespace) -> int:
        """Remove every node of ``namespace`` and release its pages (without demoting
        them: a long-context view's namespace goes with its view). Returns how many
        pages went free.

        Mutates the tree and the allocator. Raises ValueError, changing nothing, if a
        node of the namespace is locked.
        """
        root = self._roots.get(namespace)
        if root is None:
            return 0
        nodes, stack = [], list(root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        if any(n.lock_ref for n in nodes):
            raise ValueError(f"namespace {namespace!r} has locked nodes")
        for node in nodes:
            node.alive = False
        del self._roots[namespace]
        self._num_nodes -= len(nodes)
        pages = np.concatenate([n.pages for n in nodes]) if nodes else _EMPTY_PAGES
        self.evicted_pages += len(pages)
        self._loops.fill(self._held, pages, 0)
        return self.allocator.release(pages)

    def _next_victim(self, need: int) -> tuple[Node, int] | None:
        """The leaf to shrink next and how many tail pages to take from it."""
        policy = self.policy
        if not policy.lazy:
            leaves = [n for n in self.nodes() if not n.children and not n.lock_ref]
            return policy.choose(leaves, need) if leaves else None
        heaps = self._heaps
        if len(heaps) == 1:
            node = self._top(0)
            if node is None:
                return None
            c = 0
        else:
            # Each class's heap orders its leaves; the policy compares the heads.
            best = None
            for c in range(len(heaps)):
                node = self._top(c)
                if node is not None:
                    rank = policy.rank(c, node, self._tick)
                    if best is None or rank < best[0]:
                        best = (rank, c)
            if best is None:
                return None
            c = best[1]
        node = heapq.heappop(heaps[c])[2]
        node.in_heap = False
        self._entries -= 1
        return node, min(need, len(node.pages))

    def _top(self, c: int) -> Node | None:
        """The valid head of class ``c``'s heap (None when it has none): stale entries
        (gone, grown children, locked) drop out, touched or reclassified ones are
        re-ranked into their heap."""
        heap = self._heaps[c]
        key_of, klass = self.policy.key, self.policy.klass
        multi = len(self._heaps) > 1
        while heap:
            stored, _, node = heap[0]
            if not node.alive or node.children or node.lock_ref:
                heapq.heappop(heap)
                node.in_heap = False
                self._entries -= 1
                continue
            key, k = key_of(node), (klass(node) if multi else 0)
            if key != stored or k != c:  # touched since it was pushed: re-rank
                heapq.heappop(heap)
                self._seq += 1
                heapq.heappush(self._heaps[k], (key, self._seq, node))
                continue
            return node
        return None

    # -- internals -------------------------------------------------------------

    def _push(self, node: Node) -> None:
        if node.in_heap or not self.policy.lazy:
            return
        node.in_heap = True
        self._seq += 1
        heapq.heappush(self._heaps[self.policy.klass(node)], (self.policy.key(node), self._seq, node))
        self._entries += 1
        if self._entries > 2 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries: keep one entry per evictable leaf."""
        for heap in self._heaps:
            for _, _, node in heap:
                node.in_heap = False
        heaps: list[list[tuple]] = [[] for _ in self._heaps]
        for node in self.nodes():
            if not node.children and not node.lock_ref:
                node.in_heap = True
                self._seq += 1
                heaps[self.policy.klass(node)].append((self.policy.key(node), self._seq, node))
        for heap in heaps:
            heapq.heapify(heap)
        self._heaps = heaps
        self._entries = sum(map(len, heaps))

    def _common_pages(self, key: bytes, pos: int, end: int, edge: bytes) -> int:
        """Whole pages that ``key[pos:end]`` shares with the start of ``edge`` (>= 1,
        since the first page matched through the children dict). Binary search."""
        width = self._width
        lo, hi = 1, min(len(edge), end - pos) // width
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if key.startswith(edge[: mid * width], pos):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, child: Node, num_pages: int) -> Node:
        """Cut ``child``'s edge after ``num_pages`` pages; return the new upper node.

        The upper node inherits the child's lock count and statistics (every access
        and lock that reached the child passed through it).
        """
        if num_pages >= len(child.pages):
            return child
        cut = num_pages * self._width
        parent = child.parent
        upper = Node(child.key[:cut], child.pages[:num_pages], parent, child.created, child.namespace, child.depth,
                     child.generated)  # fmt: skip
        child.depth += num_pages * self.page_size
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        upper.hits = child.hits
        upper.priority = child.priority
        child.key = child.key[cut:]
        child.pages = child.pages[num_pages:]
        child.parent = upper
        upper.children[child.key[: self._width]] = child
        parent.children[upper.key[: self._width]] = upper
        self._num_nodes += 1
        return upper

    def _merge_into_child(self, node: Node) -> None:
        """Fold an unlocked node with one child into that child (the child object
        survives, so handles to deeper nodes stay valid). Statistics combine the way
        a removed leaf's fold into its parent, so no policy key decreases."""
        (child,) = node.children.values()
        parent = node.parent
        child.key = node.key + child.key
        child.pages = np.concatenate((node.pages, child.pages))
        child.parent = parent
        parent.children[node.key[: self._width]] = child
        child.depth = node.depth
        child.generated = node.generated and child.generated
        if node.last_access > child.last_access:
            child.last_access = node.last_access
        child.hits += node.hits
        if node.priority > child.priority:
            child.priority = node.priority
        if node.created > child.created:
            child.created = node.created
        node.alive = False
        self._num_nodes -= 1

    def _remove_leaf(self, leaf: Node) -> None:
        """Unlink an evicted leaf; a root left without children is dropped too (it stays
        usable as a handle: ``root`` explains why)."""
        parent = leaf.parent
        del parent.children[leaf.key[: self._width]]
        leaf.alive = False
        self._num_nodes -= 1
        if parent.parent is None:
            if not parent.children:
                del self._roots[parent.namespace]
            return
        if leaf.last_access > parent.last_access:
            parent.last_access = leaf.last_access
        parent.hits += leaf.hits
        if leaf.priority > parent.priority:
            parent.priority = leaf.priority
        if not parent.children and not parent.lock_ref:
            self._push(parent)

    # -- checks ----------------------------------------------------------------

    def check_integrity(self, external_refs: dict[int, int] | None = None) -> None:
        """Walk the tree and cross-check it with the allocator.

        Proves: every edge is whole pages and keyed by its first page; each page is in
        the tree at most once and is referenced in the pool; the held-page map lists
        exactly the tree's pages; every stored root has a child and its namespace; lock
        counts cover their children's; the page counters match the walk; the pool's own
        integrity. With
        ``external_refs`` (page id -> references held outside the tree, e.g. by running
        requests), each page's count must equal tree + external exactly, and pages
        nobody lists must be free.

        Does not mutate. Raises IntegrityError describing the first violation.
        """
        self.allocator.check_integrity()
        for namespace, root in self._roots.items():
            if not root.children or root.parent is not None or root.namespace != namespace:
                raise IntegrityError(f"namespace {namespace!r}: stored root is empty or not a root")
        width = self._width
        in_tree = []
        protected = 0
        count = 0
        for node in self.nodes():
            count += 1
            if not node.alive:
                raise IntegrityError("a dead node is still linked")
            if not node.key or len(node.key) % width or len(node.pages) * width != len(node.key):
                raise IntegrityError(f"{node!r}: edge is not a whole number of pages")
            if node.parent.children.get(node.key[:width]) is not node:
                raise IntegrityError(f"{node!r}: not keyed by its first page in its parent")
            below = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < below:
                raise IntegrityError(f"{node!r}: lock count below its children's ({below})")
            if node.lock_ref:
                protected += len(node.pages)
            in_tree.append(node.pages)
        if count != self._num_nodes:
            raise IntegrityError(f"node count {self._num_nodes} but the walk found {count}")
        pages = np.concatenate(in_tree) if in_tree else np.empty(0, dtype=np.int32)
        if np.unique(pages).size != pages.size:
            raise IntegrityError("a page is held by two tree nodes")
        if pages.size != self.cached_pages:
            raise IntegrityError(f"cached_pages {self.cached_pages} but the walk found {pages.size}")
        if protected != self.protected_pages:
            raise IntegrityError(f"protected_pages {self.protected_pages} but the walk found {protected}")
        if np.count_nonzero(self._held) != pages.size or not self._held[pages].all():
            raise IntegrityError("the held-page map does not list exactly the tree's pages")
        refs = self.allocator.refcounts()
        if pages.size and (refs[pages] < 1).any():
            raise IntegrityError("the tree holds a page the pool thinks is free")
        if external_refs is not None:
            expected = np.zeros_like(refs)
            expected[pages] += 1
            for page, n in external_refs.items():
                expected[page] += n
            bad = np.flatnonzero(expected != refs)
            if bad.size:
                p = int(bad[0])
                raise IntegrityError(f"page {p}: refcount {refs[p]} but tree + owners hold {expected[p]}")
