"""The engine loop: scheduling and the model step, with output processing after it.

``EngineLoop`` owns the model, the KV pool, the prefix cache and the scheduler; it
alone touches them. It takes commands from an inbox and sends outputs to an outbox,
both typed messages (messages.py), and shares no object with the client side: the
``Engine`` runs it in a thread today, and nothing in it assumes the client lives in the
same process.

One iteration: drain every command (add, abort, queries, hints, unpins), release the
pins, hints and sessions whose time is up, then run one step:

    schedule -> build the batch -> model forward -> advance the KV state
             -> prompt logprobs -> constraint masks (computed beside the forward),
                logit_bias, min_tokens -> sample -> per token: stop?
             -> end what stopped (its pages enter the cache), send its Finished
"""

from __future__ import annotations

import logging
import os
import queue
import time
from typing import Callable

import torch

from radixkv.cache.compress import resolve_policy
from radixkv.cache.events import KVEventRecorder, ZmqEventPublisher, hash_of, tree_blocks
from radixkv.cache.formats import load_kv_scales
from radixkv.cache.manager import FLUSH_TIERS, KVCacheManager, SeqKV
from radixkv.cache.pool import KVPool, PoolConfig, available_memory
from radixkv.cache.radix import RadixCache
from radixkv.cache.store import PageStore, open_store
from radixkv.cache.tiers import HostTier, KVTiers, layout, tokenizer_fingerprint, weights_fingerprint
from radixkv.engine.config import EngineConfig
from radixkv.engine.constrain import prefetch
from radixkv.engine.messages import (
    Abort, AbortAll, AddRequests, Close, Command, Hint, NewRequest, Output, Query, QueryDone, Stopped, Unpin,
)  # fmt: skip
from radixkv.engine.output import OutputProcessor
from radixkv.engine.request import Request
from radixkv.engine.sampling import Sampler, SamplerState
from radixkv.engine.scheduler import Scheduler
from radixkv.errors import FieldError
from radixkv.kernels import get_backend
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.model.llama import rerotate_pages
from radixkv.model.loader import as_dtype, load_model
from radixkv.model.registry import resolve_model
from radixkv.model.tp import TensorParallel
from radixkv.model.tokenizer import IncrementalDetokenizer, Tokenizer
from radixkv.validate import ceil_div

logger = logging.getLogger("radixkv.engine")


class EngineLoop:
    """The model, KV memory and scheduler of one engine, driven by ``run``.

    ``tokenizer``: for detokenization and the EOS ids (loaded from the config's model
    when not given). ``send`` takes every output message; call nothing else on this
    object from another thread except the read-only ``stats`` (a snapshot that may
    straddle a step).
    """

    def __init__(self, config: EngineConfig, send: Callable[[Output], None], tokenizer: Tokenizer | None = None):
        self.config = cfg = config
        if cfg.threads is not None:  # before anything runs a kernel: the weights' loaders use them too
            torch.set_num_threads(cfg.threads)
        self.threads = torch.get_num_threads()
        source = resolve_model(cfg.model)
        native = cfg.native_weights(source)
        if cfg.activation_bits != 16 and not native:
            raise ValueError(f"activation_bits {cfg.activation_bits} needs native weights; {source.path.name} runs "
                             "expanded (not a quantized GGUF of a native architecture, or dtype is not float32)")  # fmt: skip
        self.model = load_model(source.path, cfg.dtype, cfg.device, native=native, activation_bits=cfg.activation_bits)
        self.weights = self.model.weights_summary()  # for stats: how the weights are held
        self.tokenizer = tokenizer or Tokenizer.load(source)
        mc = self.model.config
        pool_cfg = dict(num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                        page_size=cfg.page_size, kv_dtype=cfg.kv_format, device=cfg.device,
                        commit=cfg.commits_upfront)  # fmt: skip
        if cfg.kv_scales is not None:  # read once, here: nothing ever computes or rewrites them
            pool_cfg["kv_scales"] = load_kv_scales(cfg.kv_scales, mc.num_layers, mc.num_kv_heads, cfg.kv_format.name)
        # with a share: of the memory left with the weights loaded (available_memory: None when unknown)
        self.available_memory = available_memory(cfg.device) if cfg.kv_share is not None else None
        if cfg.kv_cache_tokens is not None:
            pool_cfg["num_pages"] = ceil_div(cfg.kv_cache_tokens, cfg.page_size)
        else:
            pool_cfg["memory_bytes"] = cfg.kv_pool_bytes(self.available_memory)
        pool_config = PoolConfig(**pool_cfg)  # the whole model's
        self.tp = None  # with tp > 1: rank 0 of the model (radixkv.model.tp); workers start last
        if cfg.tp > 1:
            self.tp = TensorParallel(self.model, source.path, pool_config, cfg.attention_backend, cfg.dtype,
                                     cfg.device, cfg.tp)  # fmt: skip
            self.model, pool_config = self.tp.model, self.tp.pool_config
        self.pool = KVPool(pool_config)
        self.tree = RadixCache(self.pool, cfg.page_size, cfg.policy) if cfg.enable_prefix_cache else None
        self.backend = get_backend(cfg.attention_backend, cfg.device, cfg.kv_format.dtype, as_dtype(cfg.dtype))
        self.tiers = self._tiers() if (cfg.host_cache_bytes or cfg.kv_store) else None
        if cfg.context_length is not None and cfg.context_length > mc.max_position_embeddings:
            raise ValueError(f"context_length {cfg.context_length} is past the model's trained context "
                             f"({mc.max_position_embeddings} positions)")  # fmt: skip
        # KV events for routers: the recorder follows the tree and tiers, the publisher sends a batch a step
        self.events = KVEventRecorder(cfg.page_size) if cfg.kv_events is not None else None
        self.kv = KVCacheManager(self.pool, self.tree, cfg.page_size, self.tiers, self._rerotate, cfg.max_pinned_share,
                                 self.events, cfg.copies_partial_pages)  # fmt: skip
        self.publisher = None
        if cfg.kv_events is not None:
            self.publisher = ZmqEventPublisher(cfg.kv_events, cfg.kv_events_replay, cfg.kv_events_topic,
                                               cfg.kv_events_buffer, form=cfg.kv_events_format)  # fmt: skip
        self.scheduler = Scheduler(self.kv, cfg.max_batch_tokens, cfg.max_running,
                                   cfg.chunked_prefill_size, cfg.hint_hold)  # fmt: skip
        self.sampler = Sampler()
        self.send = send
        self.output = OutputProcessor(self.tokenizer.eos_token_ids, self.max_context, send)
        self.steps = 0
        self.generated_tokens = 0
        if self.tp is not None:
            self.tp.start()

    def _rerotate(self, src, dst, shifts) -> None:
        """The manager's hook for kv_rerotate: moves kept keys to their positions within
        the cache with this model's rotary frequencies."""
        rerotate_pages(self.pool, self.model.config.inv_freq(), src, dst, shifts)

    def _tiers(self) -> KVTiers:
        """The tiers below the pool (host, store), keyed by this model's weights and
        tokenizer as loaded; a store's entries signed with $RADIXKV_KV_STORE_SECRET when
        set."""
        cfg = self.config
        host = HostTier(cfg.host_cache_bytes) if cfg.host_cache_bytes else None
        weights = weights_fingerprint(self.model)
        vocab = tokenizer_fingerprint(self.tokenizer, self.model.config.vocab_size)
        store = None
        if cfg.kv_store:
            secret = os.environ.get("RADIXKV_KV_STORE_SECRET")
            store = PageStore(open_store(cfg.kv_store, cfg.kv_store_bytes), layout(self.pool),
                              secret.encode() if secret else None)  # fmt: skip
        return KVTiers(self.pool, weights, vocab, host, store, cfg.kv_store_write)

    # -- what the client needs to check prompts ---------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_context(self) -> int:
        """Positions a sequence may use: ``context_length``, or the model's trained context."""
        return self.config.context_length or self.model.config.max_position_embeddings

    @property
    def capacity_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.pool.num_pages * self.pool.page_size

    # -- the loop ------------------------------------------------------------------------------

    def run(self, inbox: queue.Queue) -> None:
        """Serve commands from ``inbox`` until ``Close``; then end every request
        ("abort") and send ``Stopped``. A step that raises fails the requests it had,
        and the loop goes on; anything else that raises is logged and stops the loop
        (``Stopped`` is still sent)."""
        try:
            while True:
                if self.publisher is not None:  # what the last step or command changed, as one batch
                    self.publisher.publish(self.events.take())
                idle = not self.scheduler.has_work() or self.scheduler.holding  # holding: wait for commands
                try:
                    command = inbox.get(timeout=0.05) if idle else inbox.get_nowait()
                except queue.Empty:
                    command = None
                if command is not None:
                    if isinstance(command, Close):
                        self._end(self.scheduler.requests(), "abort")
                        return
                    self._run_command(command)
                    continue  # drain all commands before the next step
                self.kv.expire(time.monotonic())
                if self.scheduler.has_work():
                    try:
                        self._step()
                    except Exception as e:  # a bug must not take the engine down: fail what is queued
                        logger.exception("engine step failed")
                        self._end(self.scheduler.requests(), "error", f"{type(e).__name__}: {e}")
                elif self.config.debug:
                    self._check()
        except Exception:  # outside a step: the loop cannot go on; the client fails what waits
            logger.exception("engine loop failed")
        finally:
            if self.tp is not None:  # the workers end with the loop
                self.tp.close()
            if self.publisher is not None:
                self.publisher.publish(self.events.take())
                self.publisher.close()
            self.send(Stopped())

    def _run_command(self, command: Command) -> None:
        if isinstance(command, AddRequests):
            for new in command.reqs:
                self._add(self._request(new))
        elif isinstance(command, (Hint, Unpin)):
            try:
                self.send(QueryDone(command.qid, self._pin_command(command)))
            except Exception as e:  # delivered to the caller's thread
                self.send(QueryDone(command.qid, error=e))
        elif isinstance(command, AbortAll):
            self._end(self.scheduler.requests(), "abort")
        elif isinstance(command, Abort):
            self._end([r for r in self.scheduler.requests() if r.rid == command.rid], "abort")
        elif isinstance(command, Query):
            try:
                self.send(QueryDone(command.qid, self.QUERIES[command.what](self)))
            except Exception as e:  # delivered to the caller's thread
                self.send(QueryDone(command.qid, error=e))
        else:
            raise TypeError(f"unknown engine command {type(command).__name__}")

    def _request(self, new: NewRequest) -> Request:
        """The loop's state for a new completion."""
        ids = list(new.prompt_ids)
        return Request(
            rid=new.rid, index=new.index, stream=new.stream, prompt_ids=ids, params=new.params,
            sampler=SamplerState(new.params, ids, seed_offset=new.index),
            detok=IncrementalDetokenizer(self.tokenizer, ids, new.params.skip_special_tokens),
            kv=SeqKV(new.namespace, new.params.priority, policy=self._policy(new.params, len(ids))),
            constraint=new.constraint,
            arrival_time=new.arrival_time,
            cache_control=new.cache_control,
            session_id=new.session_id,
        )  # fmt: skip

    def _add(self, req: Request) -> None:
        """Queue a new request; one whose pin would pass the cap ends at once with the
        error (nothing computed), else its pins hold their claims until it ends."""
        try:
            for i, c in enumerate(req.cache_control):
                if not c.hint:
                    claim = self.kv.claim_pin(req.prompt_ids[: c.upto or len(req.prompt_ids)], req.kv.namespace,
                                              "cache_control")  # fmt: skip
                    if claim is not None:
                        req.claims[i] = claim
        except FieldError as e:
            self._release_claims(req)
            req.error_param = e.field
            self._end([req], "error", str(e))
            return
        self.scheduler.add(req)

    def _pin_command(self, command: Hint | Unpin):
        if isinstance(command, Unpin):
            if command.pin_id is not None:
                return self.kv.unpin(command.pin_id)
            return self.kv.end_session(command.session_id)
        ttl = self.config.hint_ttl if command.ttl is None else command.ttl
        return self.kv.hint(command.tokens, command.namespace, ttl, time.monotonic(), command.uses, command.session_id)

    def _keep(self, req: Request, computed: int) -> None:
        """What ``req`` leaves protected as it ends (its pages published and unlocked just
        before, so its prefix is all in the tree): each CacheControl's prompt prefix,
        pinned or hinted, and with a session_id its whole computed prefix as the session's
        entry (prompt and output, whole pages):

            tokens  |== prompt[:upto]: pin / ttl / hint ==|== rest of the prompt ==|== output ==|
                    |======== session entry: every whole page computed ========|partial|
        """
        now = time.monotonic()
        prompt = req.prompt_ids
        for i, c in enumerate(req.cache_control):
            part = prompt[: c.upto or len(prompt)]
            if c.hint:
                self.kv.hint(part, req.kv.namespace, c.ttl or self.config.hint_ttl, now, c.uses, req.session_id)
                continue
            try:
                info = self.kv.pin(part, req.kv.namespace, c.ttl, now, "cache_control", req.claims.pop(i, None))
            except FieldError as e:  # nothing of it cached (it ended early), or shorter than a page
                logger.info("request %s: nothing pinned: %s", req.rid, e)
                continue
            if req.pin is None or info.tokens > req.pin.tokens:
                req.pin = info
        self._release_claims(req)
        if req.session_id is not None and computed:
            self.kv.hint(req.tokens[:computed], req.kv.namespace, self.config.session_ttl, now,
                         session=req.session_id, kind="session")  # fmt: skip

    def _release_claims(self, req: Request) -> None:
        for claim in req.claims.values():
            self.kv.release_claim(claim)
        req.claims.clear()

    def _policy(self, params, prompt_len: int):
        """The request's long-context policy for this pool's pages (checked by the client)."""
        return resolve_policy(params.kv_policy, params.kv_budget, params.kv_compress_at, self.config.page_size,
                              prompt_len, params.kv_rerotate, self.max_context)  # fmt: skip

    def _end(self, reqs: list[Request], reason: str, error: str | None = None, flush: bool = True) -> None:
        """The one way a request ends (length, stop, abort, error): take ``reqs`` out of
        the scheduler wherever they are (their computed pages still enter the cache),
        record ``reason`` and send their final output."""
        for req in reqs:
            computed = req.kv.computed
            self.scheduler.remove(req)
            req.finish_reason, req.error = reason, error
            if reason == "error":
                self._release_claims(req)
            elif req.cache_control or req.session_id is not None:
                self._keep(req, computed)
            self.output.deliver(req, flush)

    def _step(self) -> None:
        sched = self.scheduler
        plan = sched.schedule()
        for req in sched.stopped:
            self.output.deliver(req, flush=True)
        sched.stopped.clear()
        if not plan:
            if not sched.running and sched.waiting and not sched.holding:  # nothing fits even in an empty pool
                self._end([sched.waiting[0]], "error", "not enough KV cache for this request")
            return
        batch = sched.build_batch(plan, self.config.device)
        prompt_lp = [s for s in plan if s.req.params.prompt_logprobs_from is not None and s.start < len(s.req.prompt_ids)]
        if batch.input_ids.device.type != "cpu":  # the device computes; this core is free for the masks meanwhile
            prefetch([s.req.constraint for s in plan if s.req.constraint is not None and s.samples])
        try:
            forward = self.model.forward if self.tp is None else self.tp.forward  # tp: every rank, in step
            logits = forward(batch, self.pool, self.backend, all_logits=bool(prompt_lp))
        except Exception as e:  # the model failed: fail this step's requests, keep serving
            self._end([s.req for s in plan], "error", f"{type(e).__name__}: {e}")
            return
        mass = getattr(self.backend, "mass", None)
        if batch.observe and mass:  # per observed sequence: attention mass of each KV entry
            mass = {i: m.cpu().numpy() for (i, _), m in zip(batch.observe, mass)}
        else:
            mass = None
        failed = sched.advance(plan, mass)
        for req, error in failed:
            self._end([req], "error", error)
        self.steps += 1
        if prompt_lp:
            ends = batch.qo_indptr[1:].tolist()
            for s, end in zip(plan, ends):
                if s in prompt_lp:
                    self.output.prompt_logprobs(s.req, s.start, logits[end - s.count : end])
            logits = logits[torch.tensor(ends, device=logits.device) - 1]
        sampling = [i for i, s in enumerate(plan) if s.samples and not s.req.finished]  # not ended above
        if not sampling:
            return
        reqs = [plan[i].req for i in sampling]
        rows, errors = self.output.process(logits[sampling], reqs)
        if any(errors):  # a constraint failed: that request ends, the others sample
            for req, error in zip(reqs, errors):
                if error is not None:
                    req.error_param = req.constraint.kind
                    self._end([req], "error", error)
            keep = [j for j, e in enumerate(errors) if e is None]
            if not keep:
                return
            reqs, rows = [reqs[j] for j in keep], rows[keep]
        result = self.sampler.sample(rows, [r.sampler for r in reqs])
        for j, req in enumerate(reqs):
            reason, flush = self.output.append(req, result.tokens[j], result.logprobs[j], result.top_logprobs[j])
            self.generated_tokens += 1
            if reason is not None:
                self._end([req], reason, flush=flush)

    # -- queries (run between steps) -------------------------------------------------------------

    def _flush(self, tiers: str = "memory") -> bool:
        if self.scheduler.has_work():
            return False
        self.kv.flush(tiers)
        return True

    def stats(self) -> dict:
        """Counters and gauges. Read-only: between steps (a ``stats`` query) it is
        consistent; from another thread fields may come from either side of a step."""
        tree = None
        if self.tree is not None:
            stats = self.tree.stats()
            tree = {**stats._asdict(), "hit_rate": stats.hit_rate}
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.scheduler.preemptions,
            "weights": self.weights,
            "threads": self.threads,
            "pool": {"pages": self.pool.num_pages, "free": self.pool.num_free(), "page_size": self.pool.page_size,
                     "kv_format": self.pool.identity, "bytes_per_page": self.pool.config.bytes_per_page,
                     "staged_pages": self.pool.sealer.staged_pages() if self.pool.sealer else 0},
            "cache": tree,
            "views": self.kv.views.stats() if self.kv.views is not None else None,
            "tiers": self.tiers.snapshot() if self.tiers is not None else None,
            "pins": self._pins_stats(),
            "kv_events": None if self.publisher is None else {
                "endpoint": self.config.kv_events, "replay_endpoint": self.config.kv_events_replay,
                "topic": self.config.kv_events_topic, "format": self.config.kv_events_format,
                "batches": self.publisher.sent,
                "events": self.events.published_events},
        }

    def _pins_stats(self) -> dict:
        """Pins, TTLs, hints and sessions: pages under each class and every entry (the
        listing is copied in one call: a snapshot from another thread reads it safely)."""
        reg, now = self.kv.pinned, time.monotonic()
        entries = list(reg.entries.values())
        return {"pinned_pages": reg.pinned_pages, "max_pinned_pages": self.kv.max_pinned_pages,
                "hinted_pages": reg.hinted_pages, "hints_used": reg.used, "hints_dropped": reg.dropped,
                "expired": reg.expired, "entries": [e.info().describe(now) for e in entries]}  # fmt: skip

    def _kv_blocks(self) -> dict:
        """The block hashes a router fed by this engine's events should hold: ``GPU``
        recomputed from the tree's paths, ``CPU`` the host tier's as recorded."""
        if self.events is None:
            raise ValueError("this engine publishes no KV events (kv_events)")
        return {"GPU": sorted(tree_blocks(self.tree)), "CPU": sorted(map(hash_of, self.events.host.values())),
                "page_size": self.pool.page_size}  # fmt: skip

    def _check(self) -> None:
        self.kv.check(self.scheduler.owners())

    def _warm_up(self) -> int:
        """One prefill chunk (``chunked_prefill_size`` tokens, whole pages, at most what the
        pool has free and the context holds) through the model into pages taken and given
        back here: the first real request then finds the threads, buffers and weights it
        needs already there. Nothing reaches the tree, the counters or the events. Returns
        the tokens run (0 when the pool has no page free, or requests are queued: they warm
        it themselves)."""
        if self.scheduler.has_work():
            return 0
        ps = self.config.page_size
        tokens = min(self.config.chunked_prefill_size or self.config.max_batch_tokens, self.max_context)
        pages = min(tokens // ps, self.pool.num_free())
        if pages < 1:
            return 0
        table = self.pool.alloc(pages)
        try:
            batch = ForwardBatch.build([SeqInput([0] * (pages * ps), 0, table)], ps, self.config.device)
            (self.model.forward if self.tp is None else self.tp.forward)(batch, self.pool, self.backend)
        finally:
            self.pool.free(table)
        return pages * ps

    # what a Query may name; "flush:<tiers>" per name in FLUSH_TIERS
    QUERIES = {"stats": stats, "check": _check, "kv_blocks": _kv_blocks, "warm_up": _warm_up, **{f"flush:{t}": lambda self, t=t: self._flush(t) for t in FLUSH_TIERS}}
