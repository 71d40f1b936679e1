"""Long-context KV eviction at page granularity: policies, budgets and views.

A sequence under a policy keeps only some of its past pages. Whole pages are kept or
dropped (all layers and heads of a page together, so the memory really goes), the kept
keys keep the rotary positions they were computed at, and the sequence's new tokens
attend to exactly the pages its table lists (positions apart from KV indices: see
``radixkv.model.batch``).

When a sequence compresses (at a *point*, always a page boundary), its table is cut to
the policy's choice:

    table before  |sink|........ middle pages ........|== recent ==|   (kv entries = point - dropped)
    kept (window)                                      |== recent ==|
    kept (streaming)  |sink|                           |== recent ==|
    kept (scored)  the top-scoring pages, plus the observation window's pages, in table order

Points. Prefill-time: with an explicit point (``kv_compress_at``, or a ratio budget,
whose default point is the prompt's end), the context is compressed once, after its
prefill and before the question; what follows grows freely (as kvpress's presses do).
Decode-time: with a token budget and no explicit point, every time the table would grow
past ``budget + interval`` tokens it is cut back to the budget, during prefill and
decode alike (long generations, endless chats; kvpress's DecodingPress). Points depend
only on the tokens and the policy, never on how the scheduler chunks the work: a chunk
ends at the next point.

Views. A page computed after an eviction saw a reduced context: it is valid only under
that exact selection. Each compression is stored as a ``View``: the state of the
sequence at the point (its kept pages, in order, one reference each) keyed by the cache
namespace, the policy, the explicit points and a hash of the tokens up to the point.
Pages computed on a view live in the tree under the view's own namespace
(``ViewNamespace``), whose keys start at the point. A later request with the same
policy matches: the deepest view on its tokens, then that view's subtree, so a second
question on a compressed document reuses both the compression and whatever the
questions share. Nothing computed on a reduced context is matched as exact (plain
namespaces never hold such pages) and the reverse (a view's namespace holds only pages
computed on it). Views are evicted like pages (least recently used, unlocked), with
their namespace's subtree.

Positions. Kept keys keep the rotary positions they were computed at, so a sequence's
positions grow with its tokens and end at the model's trained context. With
``kv_rerotate`` (decode-time budgets only) a compression also moves the kept pages to
consecutive positions from 0 (StreamingLLM's positions within the cache): each page that
moves gets its keys rotated by its shift (the engine's hook,
``radixkv.model.llama.rerotate_pages``), in place where the
sequence holds the page alone, else into a copy, so the tree's pages never change. Its
positions then equal its KV indices and stay below ``budget + interval``: a chat or a
generation runs past the trained context. A view's key names the option, so pages of
the two position schemes never meet.

Scores. ``snapkv`` and ``h2o`` read each KV entry's attention probability mass, which
the attention backend sums while it attends (``ForwardBatch.observe``); ``keydiff``
reads the keys from the pool at the point; ``window`` and ``streaming`` need nothing.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from radixkv.errors import FieldError, IntegrityError
from radixkv.validate import is_int

SINK_TOKENS = 4  # StreamingLLM's attention sinks
OBSERVE_TOKENS = 64  # SnapKV's observation window (kvpress's default), kept in every scored policy
INTERVAL_SHARE = 8  # decode-time eviction runs when the table exceeds budget + budget / 8 (>= one page)
_HASH = 16  # bytes of a prefix hash


# ---------------------------------------------------------------- policies


@dataclass(frozen=True)
class Policy:
    """How one policy chooses pages. ``observe``: which queries' attention mass it
    scores with (``"none"``, ``"window"``: the last ``OBSERVE_TOKENS`` before a point,
    ``"all"``: every query, accumulated), ``keys``: whether it scores the keys
    themselves; ``sinks``: pages kept from the start; ``recent``: share of the kept
    pages taken from the end (besides the observation window's)."""

    name: str
    observe: str = "none"
    keys: bool = False
    sinks: bool = False
    recent: float = 0.0


POLICIES: dict[str, Policy] = {
    "window": Policy("window", recent=1.0),
    "streaming": Policy("streaming", sinks=True, recent=1.0),
    "h2o": Policy("h2o", observe="all", recent=0.5),  # heavy hitters and a recent half, as H2O
    "snapkv": Policy("snapkv", observe="window"),
    "keydiff": Policy("keydiff", keys=True),
}


@dataclass(frozen=True)
class KVPolicySpec:
    """A request's policy, resolved for a page size: ``budget`` tokens kept after a
    compression (whole pages: ``budget // page_size``), or ``ratio`` of the tokens
    before the explicit point; ``compress_at`` the explicit point (page-aligned,
    None: only decode-time eviction); ``interval`` tokens the table may grow past the
    budget before the next eviction; ``rerotate``: compressions move the kept pages to
    consecutive positions (positions = KV indices)."""

    policy: Policy
    page_size: int
    budget: int | None
    ratio: float | None
    compress_at: int | None
    interval: int
    rerotate: bool = False

    @property
    def name(self) -> str:
        return self.policy.name

    def kept_pages(self) -> int:
        """Whole pages a compression keeps: the token budget's, or the ratio of the
        pages before the explicit point."""
        if self.budget is not None:
            return max(1, self.budget // self.page_size)
        return max(1, round(self.ratio * self.compress_at / self.page_size))

    def key(self) -> tuple:
        """What identifies the selection (a view's key)."""
        return (self.policy.name, self.budget, self.ratio, self.interval, self.rerotate)

    def max_position(self) -> int:
        """With ``rerotate``: the highest position the sequence ever uses (kept pages
        plus the interval, less one)."""
        return self.kept_pages() * self.page_size + self.interval - 1


def check_policy(name, budget, compress_at=None, rerotate=False) -> None:
    """FieldError naming the field unless ``name`` is a policy (or None with no budget),
    ``budget`` an int of tokens >= 1 or a ratio in (0, 1), ``compress_at`` an int >= 1,
    ``rerotate`` a bool, true only with a token budget and no ``compress_at``."""
    if not isinstance(rerotate, bool):
        raise FieldError("kv_rerotate", f"kv_rerotate must be a bool, got {rerotate!r}")
    if name is None:
        if budget is not None or compress_at is not None or rerotate:
            field_ = "kv_budget" if budget is not None else "kv_compress_at" if compress_at is not None else "kv_rerotate"
            raise FieldError(field_, f"{field_} needs kv_policy (one of {', '.join(POLICIES)})")
        return
    if not isinstance(name, str) or name not in POLICIES:
        raise FieldError("kv_policy", f"kv_policy must be one of {', '.join(POLICIES)}, got {name!r}")
    if budget is None:
        raise FieldError("kv_budget", "kv_policy needs kv_budget: tokens kept (an int >= 1) or a ratio in (0, 1)")
    if is_int(budget):
        if budget < 1:
            raise FieldError("kv_budget", f"kv_budget in tokens must be >= 1, got {budget}")
    elif isinstance(budget, float) and not isinstance(budget, bool):
        if not 0.0 < budget < 1.0:
            raise FieldError("kv_budget", f"kv_budget as a ratio must lie in (0, 1), got {budget}")
    else:
        raise FieldError("kv_budget", f"kv_budget must be an int (tokens) or a float ratio in (0, 1), got {budget!r}")
    if compress_at is not None and (not is_int(compress_at) or compress_at < 1):
        raise FieldError("kv_compress_at", f"kv_compress_at must be an int >= 1 (prompt tokens), got {compress_at!r}")
    if rerotate and (compress_at is not None or not is_int(budget)):
        raise FieldError("kv_rerotate", "kv_rerotate applies to a decode-time budget: kv_budget in tokens (an int) "
                         "and no kv_compress_at")  # fmt: skip


def resolve_policy(name, budget, compress_at, page_size: int, prompt_len: int, rerotate: bool = False,
                   max_positions: int | None = None) -> KVPolicySpec | None:
    """The spec of a request's policy for ``page_size`` (None without a policy). A ratio
    applies at the explicit point, by default the prompt's last page boundary (before
    its last token); a token budget below one page is one page. Raises FieldError as
    ``check_policy``, for a ratio on a prompt shorter than two pages, and for a
    ``rerotate`` budget whose positions would not fit ``max_positions``."""
    check_policy(name, budget, compress_at, rerotate)
    if name is None:
        return None
    ratio = budget if isinstance(budget, float) else None
    tokens = None if ratio is not None else max(int(budget), page_size)
    point = None
    if compress_at is not None:
        point = min(int(compress_at), prompt_len - 1) // page_size * page_size
    elif ratio is not None:
        point = (prompt_len - 1) // page_size * page_size
    if ratio is not None and (point is None or point < 2 * page_size):
        raise FieldError("kv_budget", f"a ratio kv_budget needs at least {2 * page_size} prompt tokens before the "
                         f"compression point, got {point or 0}")  # fmt: skip
    if point is not None and point < page_size:
        point = None  # nothing whole to compress there
    if tokens is not None:
        interval = max(page_size, tokens // INTERVAL_SHARE // page_size * page_size)
    else:
        interval = max(page_size, round(ratio * point) // INTERVAL_SHARE // page_size * page_size)
    spec = KVPolicySpec(POLICIES[name], page_size, tokens, ratio, point, interval, rerotate)
    if rerotate and max_positions is not None and spec.max_position() >= max_positions:
        raise FieldError("kv_budget", f"with kv_rerotate the positions reach kv_budget + {interval} (the interval) - 1 = "
                         f"{spec.max_position()}: the model's context is {max_positions}")  # fmt: skip
    return spec


def select_pages(spec: KVPolicySpec, num_pages: int, keep: int, scores: np.ndarray | None) -> np.ndarray:
    """Indices (sorted, int64) of the ``keep`` pages to keep of a table of ``num_pages``
    whole pages, by ``spec``'s policy; ``scores`` (one per page, higher is kept first)
    for the scored policies. Pure.

        window     |..........................|== keep ==|
        streaming  |sink|.....................|== rest ==|
        scored     observation window's pages + recent share + top scores of the rest
    """
    if keep >= num_pages:
        return np.arange(num_pages)
    policy, ps = spec.policy, spec.page_size
    chosen = np.zeros(num_pages, dtype=bool)
    if policy.sinks:
        chosen[: min(keep, math.ceil(SINK_TOKENS / ps))] = True
    recent = 0
    if policy.observe != "none" or policy.keys:
        recent = min(keep, math.ceil(OBSERVE_TOKENS / ps))
    recent = max(recent, int(policy.recent * keep))
    left = keep - int(chosen.sum())
    if recent and left > 0:
        tail = np.flatnonzero(~chosen)[-min(recent, left) :]
        chosen[tail] = True
    left = keep - int(chosen.sum())
    if left > 0:
        rest = np.flatnonzero(~chosen)
        if scores is None:  # no scores: the most recent of the rest
            chosen[rest[-left:]] = True
        else:
            order = np.argsort(-scores[rest], kind="stable")  # ties: the earlier page
            chosen[rest[order[:left]]] = True
    return np.flatnonzero(chosen)


def page_sums(values: np.ndarray, page_size: int) -> np.ndarray:
    """Per-token ``values`` (length a multiple of the page size, or padded with zeros)
    summed per page."""
    pages = -(-len(values) // page_size)
    padded = np.zeros(pages * page_size, dtype=np.float64)
    padded[: len(values)] = values
    return padded.reshape(pages, page_size).sum(1)


def keydiff_scores(read_keys: Callable[[int], np.ndarray], num_layers: int, page_size: int) -> np.ndarray:
    """KeyDiff's page scores: per layer and KV head, each key's cosine similarity to the
    mean key; the less similar a page's keys, the higher its score (the mean over its
    tokens, summed over layers and heads). ``read_keys(layer)`` gives ``[L, H, D]``."""
    total = None
    for layer in range(num_layers):
        k = read_keys(layer).astype(np.float64)  # [L, H, D]
        k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
        mean = k.mean(0, keepdims=True)
        mean = mean / np.maximum(np.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)
        score = -(k * mean).sum(-1).sum(-1)  # [L]: minus the cosine, summed over heads
        total = score if total is None else total + score
    return page_sums(total, page_size) / page_size


# ---------------------------------------------------------------- views


@dataclass(frozen=True)
class ViewNamespace:
    """The tree namespace of pages computed on a view (keys start at the view's point).
    Never equal to a user's cache salt (a str)."""

    view_id: int


def chain_hashes(tokens, page_size: int, upto: int) -> list[bytes]:
    """``h[i]``: the hash of ``tokens[: (i + 1) * page_size]``, for every whole page
    before ``upto`` (BLAKE2b chained over each page's int32 bytes)."""
    ids = np.asarray(tokens[:upto], dtype=np.int32)
    raw = ids.tobytes()
    width = page_size * 4
    out, h = [], b""
    for i in range(upto // page_size):
        h = hashlib.blake2b(h + raw[i * width : (i + 1) * width], digest_size=_HASH).digest()
        out.append(h)
    return out


@dataclass(eq=False)
class View:
    """A compressed state: the kept pages (in order, one reference each) of a sequence
    that reached ``point`` tokens under a policy. ``scores``: the kept pages' scores
    where the policy accumulates them (h2o), else None. ``dropped``: tokens before the
    point whose KV is not kept (``point - len(pages) * page_size``)."""

    key: tuple
    point: int
    pages: np.ndarray
    scores: np.ndarray | None
    namespace: ViewNamespace
    dropped: int
    lock_ref: int = 0
    last_access: int = 0
    alive: bool = True


class ViewIndex:
    """The views of one pool, by key. Holds one pool reference per listed page of each
    view; ``evict`` drops least recently used unlocked views and the tree subtree of
    their namespace. Not thread-safe (the engine loop owns it)."""

    def __init__(self, pool, tree, page_size: int):
        self.pool = pool
        self.tree = tree
        self.page_size = page_size
        self._views: dict[tuple, View] = {}
        self._ids = itertools.count(1)
        self._tick = 0
        self.created = 0
        self.evicted = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._views)

    def __iter__(self):
        return iter(list(self._views.values()))

    @property
    def pages(self) -> int:
        """Page references the views hold."""
        return sum(len(v.pages) for v in self._views.values())

    def get(self, key: tuple) -> View | None:
        """The view under ``key``, touched (most recently used), or None."""
        view = self._views.get(key)
        if view is not None:
            self._tick += 1
            view.last_access = self._tick
        return view

    def add(self, key: tuple, point: int, pages: np.ndarray, scores: np.ndarray | None) -> View:
        """Store a new view (taking a reference on each page), or return the one already
        under ``key``. Mutates the pool's reference counts."""
        view = self.get(key)
        if view is not None:
            return view
        pages = np.array(pages, dtype=np.int32)
        self.pool.incref(pages)
        self._tick += 1
        dropped = point - len(pages) * self.page_size
        view = View(key, point, pages, scores, ViewNamespace(next(self._ids)), dropped, last_access=self._tick)
        self._views[key] = view
        self.created += 1
        return view

    def lock(self, view: View) -> None:
        if not view.alive:
            raise ValueError("cannot lock a view that was evicted")
        view.lock_ref += 1

    def unlock(self, view: View) -> None:
        if view.lock_ref <= 0:
            raise ValueError("view is not locked")
        view.lock_ref -= 1

    def evict(self, num_pages: int) -> int:
        """Drop unlocked views, least recently used first, until ``num_pages`` pages went
        free or none is left; each takes its namespace's subtree with it. Returns the
        pages freed. Mutates views, the tree and the pool."""
        freed = 0
        victims = sorted((v for v in self._views.values() if not v.lock_ref), key=lambda v: v.last_access)
        for view in victims:
            if freed >= num_pages:
                break
            freed += self.drop(view)
        return freed

    def drop(self, view: View) -> int:
        """Remove one unlocked view; returns the pages that went free."""
        if view.lock_ref:
            raise ValueError("cannot drop a locked view")
        del self._views[view.key]
        view.alive = False
        self.evicted += 1
        freed = self.tree.drop_namespace(view.namespace) if self.tree is not None else 0
        return freed + self.pool.release(view.pages)

    def clear(self) -> int:
        """Drop every unlocked view; returns the pages that went free."""
        return sum(self.drop(v) for v in list(self._views.values()) if not v.lock_ref)

    def owners(self) -> dict[int, int]:
        """Page id -> references the views hold."""
        if not self._views:
            return {}
        ids, counts = np.unique(np.concatenate([v.pages for v in self._views.values()]), return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist()))

    def check(self) -> None:
        """Every view alive, non-negative locks, pages listed once. Raises IntegrityError."""
        for key, view in self._views.items():
            if not view.alive or view.key != key or view.lock_ref < 0:
                raise IntegrityError(f"view {view.namespace}: stale entry")
            if len(np.unique(view.pages)) != len(view.pages):
                raise IntegrityError(f"view {view.namespace}: a page listed twice")

    def stats(self) -> dict:
        return {"views": len(self._views), "pages": self.pages, "created": self.created,
                "evicted": self.evicted, "hits": self.hits}  # fmt: skip
