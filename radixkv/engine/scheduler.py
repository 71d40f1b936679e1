"""Continuous batching over the paged pool, with the radix tree in the loop.

Each step spends one token budget. Running sequences go first, one token each when
decoding or their next prefill chunk; waiting requests are then admitted, longest
cached prefix first while the queue is short (first come, first served beyond that),
skipping for one step a request whose uncached prefix another admission is about to
compute. There is no separate decode phase: a step's batch mixes all of these.

Memory: pages come from the pool; when it runs short, unlocked tree leaves are evicted
first, then the most recently admitted running request is preempted: its computed pages
go into the tree (so its recompute is mostly a cache hit) and it waits again.

Cache lifecycle of a request:

    admit:   match prefix -> lock node -> own the matched pages (incref)
    chunk:   compute -> insert whole computed pages -> lock the deeper node, unlock old
    finish:  insert computed whole pages -> unlock -> release own pages
             (the partial last page and pages the tree already had go free)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from radixkv.cache.pool import KVPool
from radixkv.cache.radix import RadixCache
from radixkv.engine.batch import ForwardBatch, SeqInput
from radixkv.engine.request import Request

CACHE_AWARE_QUEUE_LIMIT = 128  # beyond this many waiting requests, plain FCFS


@dataclass
class ScheduledSeq:
    req: Request
    start: int  # first token computed this step
    count: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a token is sampled."""
        return self.start + self.count == len(self.req.tokens)


class Scheduler:
    def __init__(self, pool: KVPool, tree: RadixCache | None, max_batch_tokens: int, max_running: int,
                 chunk_size: int | None):  # fmt: skip
        self.pool = pool
        self.tree = tree
        self.page_size = pool.page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stopped: list[Request] = []  # finished by the scheduler itself; the engine reports them
        self.preemptions = 0

    # -- queue -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        """Stop ``req`` now, wherever it is; its computed pages still enter the cache."""
        if req in self.running:
            self.running.remove(req)
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish_reason = "abort"

    # -- one step ----------------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        """Choose this step's work and give every chosen sequence the pages it needs."""
        budget = self.max_batch_tokens
        plan: list[ScheduledSeq] = []
        for req in list(self.running):  # oldest first: preemption takes from the end
            if budget <= 0:
                break
            if req not in self.running:  # preempted while making room for an older one
                continue
            count = min(len(req.tokens) - req.num_computed, budget, self.chunk_size or budget)
            if self._reserve(req, count, plan):
                plan.append(ScheduledSeq(req, req.num_computed, count))
                budget -= count
            elif len(self.running) == 1:  # alone and still no room: the pool is too small for it
                self.finish(req)
                req.finish_reason = "length"
                self.stopped.append(req)
        if budget > 0:
            self._admit(plan, budget)
        return plan

    def _admit(self, plan: list[ScheduledSeq], budget: int) -> None:
        order = list(self.waiting)
        cached: dict[int, int] = {}
        if self.tree is not None and len(order) <= CACHE_AWARE_QUEUE_LIMIT:
            cached = {id(r): self._cached_len(r) for r in order}
            order.sort(key=lambda r: -cached[id(r)])  # stable: FCFS among equals
        admitted: list[Request] = []
        for req in order:
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if admitted and self.tree is not None:
                own = cached[id(req)] if cached else self._cached_len(req)
                if self._shares_pending_prefix(req, own, admitted):
                    continue  # computed by an earlier admission this step; hit the cache next step
            self._attach_prefix(req)
            count = min(len(req.tokens) - req.num_computed, budget, self.chunk_size or budget)
            if not self._reserve(req, count, plan, may_preempt=False):
                self._release(req)
                req.num_computed = 0
                break
            self.waiting.remove(req)
            self.running.append(req)
            admitted.append(req)
            plan.append(ScheduledSeq(req, req.num_computed, count))
            budget -= count

    def _cached_len(self, req: Request) -> int:
        key = req.tokens[:-1] if len(req.tokens) > 1 else req.tokens
        return self.tree.match_prefix(key, req.namespace, record_stats=False).num_tokens

    def _shares_pending_prefix(self, req: Request, cached: int, admitted: list[Request]) -> bool:
        """Whether an admission of this step computes at least the whole page that follows
        ``req``'s ``cached`` tokens, which ``req`` could then take from the cache next step.
        A prompt with no such whole page left (e.g. a short prompt, or n samples of one)
        has nothing to wait for: it is admitted beside its twins."""
        end = cached + self.page_size
        if end > len(req.tokens) - 1:  # its match key is tokens[:-1]: no whole page to gain
            return False
        mine = req.tokens[:end]
        return any(o.namespace == req.namespace and o.tokens[:end] == mine for o in admitted)

    def _attach_prefix(self, req: Request) -> None:
        """Take the cached prefix: lock its node and own its pages."""
        if self.tree is None or len(req.tokens) < 2:
            return
        m = self.tree.match_prefix(req.tokens[:-1], req.namespace, record_stats=req.cached_tokens is None)
        node, pages = m.node, m.pages
        start = req.params.prompt_logprobs_from
        keep = len(pages) if start is None else max(0, start - 1) // self.page_size
        if keep < len(pages):
            # Prompt positions from ``start`` on need their logits: they are recomputed, and
            # only the pages before them are taken and locked, so the rest of the cached
            # copy stays evictable (else the prompt would hold the pool twice).
            #   cached  |== kept, locked ==|====== recomputed; the tree's copy unlocked ======|
            pages = pages[:keep]
            node = None
            if keep:
                node = self.tree.match_prefix(req.tokens[: keep * self.page_size], req.namespace, record_stats=False).node
        if node is not None:
            self.tree.lock(node)
        self.pool.incref(pages)
        req.node = node
        req.pages = pages
        req.num_computed = len(pages) * self.page_size
        if req.cached_tokens is None:
            req.cached_tokens = req.num_computed

    def _reserve(self, req: Request, count: int, plan: list[ScheduledSeq], may_preempt: bool = True) -> bool:
        """Grow ``req``'s page table to cover ``count`` more tokens. Evicts unlocked tree
        leaves, then (``may_preempt``) preempts running requests admitted after it."""
        need = -(-(req.num_computed + count) // self.page_size) - len(req.pages)
        while need > self.pool.num_free():
            if self.tree is not None and self.tree.evict(need - self.pool.num_free()):
                continue
            victim = self._victim(req) if may_preempt else None
            if victim is None:
                return False
            self.preempt(victim, plan)
        if need > 0:
            req.pages = np.concatenate([req.pages, self.pool.alloc(need)])
        return True

    def _victim(self, req: Request) -> Request | None:
        for other in reversed(self.running):
            if other is not req:
                return other
        return None

    def preempt(self, req: Request, plan: list[ScheduledSeq]) -> None:
        """Free ``req``'s memory and queue it again at the front; it recomputes later."""
        self.running.remove(req)
        plan[:] = [s for s in plan if s.req is not req]
        self._release(req)
        req.num_computed = 0
        self.waiting.appendleft(req)
        self.preemptions += 1

    def build_batch(self, plan: list[ScheduledSeq], device) -> ForwardBatch:
        seqs = [SeqInput(s.req.tokens[s.start : s.start + s.count], s.start, s.req.pages) for s in plan]
        return ForwardBatch.build(seqs, self.page_size, device)

    def advance(self, plan: list[ScheduledSeq]) -> None:
        """Record what the step computed; put finished prefill chunks into the cache."""
        for s in plan:
            s.req.num_computed = s.start + s.count
            if self.tree is not None and s.count > 1:  # a prefill chunk, not a decode step
                self._cache_progress(s.req)

    def _cache_progress(self, req: Request) -> None:
        """Insert the whole computed pages and move the lock to the node that ends them.
        Where the tree already held pages for these tokens (a prompt recomputed for its
        logprobs, a request preempted and resumed), the request takes the tree's pages
        and frees its own copies, so a prefix never occupies the pool twice:

            req.pages  |== own copies of cached tokens ==|== new ==|partial|
                        -> tree's pages (own freed)       -> tree
        """
        whole = req.num_computed // self.page_size * self.page_size
        if whole == 0 or (req.node is not None and whole <= self._locked_len(req)):
            return
        tokens = req.tokens[:whole]
        self.tree.insert(tokens, req.pages, req.namespace, req.priority)
        m = self.tree.match_prefix(tokens, req.namespace, record_stats=False)
        n = len(m.pages)
        dupes = req.pages[:n] != m.pages
        if dupes.any():
            self.pool.incref(m.pages[dupes])
            self.pool.decref(req.pages[:n][dupes])
            req.pages = np.concatenate([m.pages, req.pages[n:]])
        self.tree.lock(m.node)
        if req.node is not None:
            self.tree.unlock(req.node)
        req.node = m.node

    def _locked_len(self, req: Request) -> int:
        n, node = 0, req.node
        while node is not None and node.parent is not None:
            n += node.num_tokens
            node = node.parent
        return n

    def finish(self, req: Request) -> None:
        """``req`` is done: cache its pages, release everything it holds."""
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        """Insert computed whole pages (for later reuse), unlock, drop own references.

            tokens  |===== computed, whole pages =====|partial|not computed|
                    |-> tree (dupes of tree pages go)  |-> free            |
        """
        if self.tree is not None and req.num_computed >= self.page_size:
            self.tree.insert(req.tokens[: req.num_computed], req.pages, req.namespace, req.priority)
        if req.node is not None:
            self.tree.unlock(req.node)
            req.node = None
        self.pool.decref(req.pages)
        req.pages = np.empty(0, dtype=np.int32)

    def owners(self) -> dict[int, int]:
        """Page id -> references held by requests (for ``check_integrity``)."""
        refs: dict[int, int] = {}
        for req in self.running:
            for p in req.pages.tolist():
                refs[p] = refs.get(p, 0) + 1
        return refs
