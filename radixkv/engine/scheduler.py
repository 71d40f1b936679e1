"""Continuous batching over the paged pool, with the radix tree in the loop.

Each step spends one token budget. Running sequences go first, one token each when
decoding or their next prefill chunk; waiting requests are then admitted, longest
highest ``priority`` first, then longest cached prefix while the queue is short (first
come, first served beyond that), skipping a request whose next uncached page a running
request (admitted this step or still prefilling in chunks) is about to compute: it
waits until that page is in the tree instead of computing it a second time beside the
other (questions sent together over one long few-shot prefix compute it once, where a
question admitted between its chunks used to compute those chunks again). There is no
separate decode phase: a step's batch mixes all of these.

Memory: pages come from the pool; when it runs short, unlocked tree leaves are evicted
first, then the running request of the lowest priority (the most recently admitted
among equals) is preempted: its computed pages
go into the tree (so its recompute is mostly a cache hit) and it waits again.

Hints and sessions (radixkv.cache.pins) are advice, ranked by their program's age: an
admission never breaks one while requests run (a request that would need their pages
waits); a running request's growth gives up younger programs' advice, then preempts
younger requests, and only the first-ranked request may take anything (``_make_room``);
with nothing running, a waiting request that only advice keeps out waits ``hint_hold``
seconds (the advice's programs are about to come back), then the advice gives way, so
it never stalls the engine for long. An admitted request uses the hints its cached
prefix reaches, and replaces its session's entry. Pins and TTLs never give way.

Cache lifecycle of a request (``KVCacheManager`` runs it):

    admit:   match prefix -> lock node (its pages are read under the lock)
    chunk:   compute -> the tree adopts the whole computed pages -> lock the deeper
             node, unlock the old
    finish:  the tree adopts the computed whole pages -> unlock -> free own pages
             (the partial last page and copies of pages the tree already had)
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from radixkv.cache.manager import KVCacheManager
from radixkv.model.batch import ForwardBatch, SeqInput
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
    """Which requests run each step, and the KV memory they need, through ``kv`` (the
    ``KVCacheManager``): every page and lock a request holds is taken and given back
    there."""

    def __init__(self, kv: KVCacheManager, max_batch_tokens: int, max_running: int, chunk_size: int | None,
                 hint_hold: float = 0.0):  # fmt: skip
        self.kv = kv
        self.page_size = kv.page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stopped: list[Request] = []  # finished by the scheduler itself; the engine reports them
        self.preemptions = 0
        self._admissions = itertools.count()
        self.hint_hold = hint_hold
        self._stalled: float | None = None  # when the engine went idle with work only advice kept out
        self.holding = False  # this step admitted nothing on purpose: the loop may wait for commands

    # -- queue -------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take ``req`` out wherever it is (running or waiting) and give back all its KV
        memory (its computed whole pages stay cached). The one way a request leaves:
        finished, aborted, failed."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req.kv, req.tokens)

    # -- one step ----------------------------------------------------------------

    def schedule(self) -> list[ScheduledSeq]:
        """Choose this step's work and give every chosen sequence the pages it needs."""
        budget = self.max_batch_tokens
        plan: list[ScheduledSeq] = []
        self.holding = False
        for req in list(self.running):  # oldest first: preemption takes from the end
            if budget <= 0:
                break
            if req not in self.running:  # preempted while making room for an older one
                continue
            count = self._chunk(req, budget)
            if self.kv.reserve(req.kv, count, lambda req=req: self._make_room(req, plan)):
                plan.append(ScheduledSeq(req, req.kv.computed, count))
                budget -= count
            elif len(self.running) == 1:  # alone and still no room: the pool is too small for it
                self.remove(req)
                req.finish_reason = "length"
                self.stopped.append(req)
        if budget > 0:
            self._admit(plan, budget)
            if not self.running and self.waiting and self.kv.pinned.has_soft():
                # idle with work waiting that only advice keeps out: hold for hint_hold seconds
                # (its programs are about to come back), then the advice gives way
                now = time.monotonic()
                self._stalled = now if self._stalled is None else self._stalled
                if now - self._stalled >= self.hint_hold:
                    self._admit(plan, budget, self.kv.drop_hint)
                else:
                    self.holding = True
        if self.running or not self.waiting:
            self._stalled = None
        return plan

    def _admit(self, plan: list[ScheduledSeq], budget: int, make_room=None) -> None:
        if not self.waiting:  # most decode steps: nothing to order, no running request to scan
            return
        order = list(self.waiting)
        cached: dict[int, int] = {}
        if self.kv.tree is not None and len(order) <= CACHE_AWARE_QUEUE_LIMIT:
            cached = {id(r): self.kv.cached_len(r.tokens, r.kv.namespace) for r in order}
            order.sort(key=lambda r: (-r.params.priority, -cached[id(r)]))  # stable: FCFS among equals
        elif any(r.params.priority for r in order):
            order.sort(key=lambda r: -r.params.priority)
        # requests whose prompts are being computed: admitted this step, or prefilling in chunks
        computing = [r for r in self.running if r.kv.computed < len(r.tokens) - 1]
        for req in order:
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            if computing and self.kv.tree is not None:
                own = cached[id(req)] if cached else self.kv.cached_len(req.tokens, req.kv.namespace)
                if self._shares_pending_prefix(req, own, computing):
                    continue  # another request computes it: a cache hit once that chunk is published
            self.kv.admit(req.kv, req.tokens, req.params.prompt_logprobs_from)
            count = self._chunk(req, budget)
            if not self.kv.reserve(req.kv, count, make_room):
                self.kv.release(req.kv, req.tokens)
                break
            self.kv.use_hints(req.kv, req.session_id)
            if req.rank is None:  # its program's place in time, kept across preemptions
                req.rank = (self.kv.pinned.birth(req.session_id), next(self._admissions))
            self.waiting.remove(req)
            self.running.append(req)
            computing.append(req)
            plan.append(ScheduledSeq(req, req.kv.computed, count))
            budget -= count

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens ``req`` computes this step: what is left, within the step's budget and
        the chunk size, ending at the next compression point of its long-context policy."""
        count = min(len(req.tokens) - req.kv.computed, budget, self.chunk_size or budget)
        until = self.kv.until_point(req.kv)
        return count if until is None else min(count, until)

    def _shares_pending_prefix(self, req: Request, cached: int, computing: list[Request]) -> bool:
        """Whether a request that is computing its prompt (admitted this step, or running
        in prefill chunks) computes at least the whole page that follows ``req``'s
        ``cached`` tokens, which ``req`` can then take from the cache once that request's
        chunk is published. A prompt with no such whole page left (e.g. a short prompt, or
        n samples of one) has nothing to wait for: it is admitted beside its twins. Does
        not mutate.

            other:  [ cached | chunk computing now | later chunks ... ]
            req:    [ cached | next page ... same tokens ... | own ]
                             ^ waits while any shared whole page is still to come"""
        end = cached + self.page_size
        if end > self.kv.reusable_tokens(req.tokens, req.params.prompt_logprobs_from):
            return False  # admit would not take that page from the cache: nothing to wait for
        mine = req.tokens[:end]
        return any(o.kv.namespace == req.kv.namespace and o.tokens[:end] == mine for o in computing)

    def _make_room(self, req: Request, plan: list[ScheduledSeq]) -> bool:
        """Memory for a running request's growth once no unlocked page is left. Without
        hints or sessions: preempt (``_preempt_one``). With them, programs rank by
        priority, then age (``Request.rank``: when the request's session, else the
        request, was first seen): ``req`` may give up the advice of younger programs,
        then preempt a younger request; the first-ranked running request, once it runs
        alone, may give up any advice (so the engine always progresses); any other waits
        for this step, holding what it has, while older programs run on:

            give way, in order:  younger programs' hints and sessions -> younger requests
                                 -> (first-ranked, alone) any hint
        """
        if not self.kv.pinned.has_soft():
            return self._preempt_one(req, plan)
        mine = self._rank(req)
        if self.kv.drop_hint(younger_than=req.rank[0]):
            return True
        others = [o for o in self.running if o is not req]
        younger = [o for o in others if self._rank(o) > mine]
        if younger:
            self.preempt(max(younger, key=self._rank), plan)
            return True
        return not others and self.kv.drop_hint()  # alone, it ranks first: any advice gives way

    @staticmethod
    def _rank(req: Request) -> tuple:
        return (-req.params.priority, *req.rank)

    def _preempt_one(self, req: Request, plan: list[ScheduledSeq]) -> bool:
        """Make room for ``req`` by preempting the other running request of the lowest
        priority, the most recently admitted among equals; False when there is none."""
        # min keeps the first of equals: walking newest first, the most recently admitted
        victim = min((o for o in reversed(self.running) if o is not req), key=lambda o: o.params.priority, default=None)
        if victim is None:
            return False
        self.preempt(victim, plan)
        return True

    def preempt(self, req: Request, plan: list[ScheduledSeq]) -> None:
        """Free ``req``'s memory and queue it again at the front; it recomputes later
        (mostly from the cache, where its computed pages now are)."""
        self.running.remove(req)
        plan[:] = [s for s in plan if s.req is not req]
        self.kv.release(req.kv, req.tokens)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def build_batch(self, plan: list[ScheduledSeq], device) -> ForwardBatch:
        """The step's batch. A sequence that dropped pages (long-context policy) has
        fewer KV entries than tokens: its new tokens keep their positions in the
        sequence (with ``kv_rerotate``: positions are KV indices), and their KV goes
        after the entries it kept."""
        seqs = []
        for s in plan:
            kv = s.req.kv
            shift = kv.position_shift
            positions = range(s.start - shift, s.start + s.count - shift) if kv.dropped != shift else None
            seqs.append(SeqInput(s.req.tokens[s.start : s.start + s.count], s.start - kv.dropped, kv.pages, positions,
                                 self.kv.observe_from(kv, s.start, s.count)))  # fmt: skip
        return ForwardBatch.build(seqs, self.page_size, device)

    def advance(self, plan: list[ScheduledSeq], mass: dict[int, object] | None = None) -> list:
        """Record what the step computed; publish finished prefill chunks into the cache;
        add observed attention mass (``mass``: plan index -> per-KV-entry array) to the
        policies' scores, and compress the sequences that reached a point. Returns the
        requests whose compression failed (``kv_rerotate`` without room), with the
        error: they hold no memory, and the caller ends them."""
        failed = []  # (request, error)
        for i, s in enumerate(plan):
            kv = s.req.kv
            self.kv.computed(kv, s.start + s.count)
            if mass and i in mass:
                self.kv.observe(kv, mass[i])
            if s.count > 1:  # a prefill chunk, not a decode step
                self.kv.commit(kv, s.req.tokens)
            if self.kv.at_point(kv):
                try:
                    self.kv.compress(kv, s.req.tokens)
                except MemoryError as e:
                    failed.append((s.req, str(e)))
        return failed

    def requests(self) -> list[Request]:
        """Every request it holds, running then waiting. Does not mutate."""
        return [*self.running, *self.waiting]

    def owners(self) -> list:
        """The KV handles of the requests that hold memory (for ``KVCacheManager.check``)."""
        return [r.kv for r in self.running]
