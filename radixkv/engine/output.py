"""Output processing: what happens to a request between the model's logits and its caller.

The engine loop schedules and runs the model; everything a request's output needs after
that is here: prompt logprobs from a step's rows, constraint masks on the logits, and per
sampled token the stop decision (EOS, stop token ids, a finished constraint, a stop
string, the length limits), incremental detokenization, stop strings cut exactly (also
across tokens) and streaming only text no stop string can still remove. It mutates the
``Request`` it is given and sends messages to the client (``StreamChunk``, ``Finished``;
see messages.py); it never touches the scheduler or KV memory, so ending a request
stays the loop's (``EngineLoop._end``).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from radixkv.engine.messages import Finished, Output
from radixkv.engine.request import CompletionOutput, Request, StreamChunk
from radixkv.engine.sampling import prompt_logprobs


class OutputProcessor:
    """Per-token output work for one engine (its tokenizer's EOS ids, its context);
    ``send`` takes each message for the client."""

    def __init__(self, eos_token_ids, max_context: int, send: Callable[[Output], None]):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_context = max_context
        self.send = send

    # -- before sampling ---------------------------------------------------------------------

    @staticmethod
    def prompt_logprobs(req: Request, start: int, rows: torch.Tensor) -> None:
        """Logprob of each prompt token from ``prompt_logprobs_from`` on, for the step that
        computed prompt positions ``start..start+len(rows)-1`` (row t predicts token t+1)."""
        first = max(req.params.prompt_logprobs_from, 1)
        if not req.prompt_logprobs:
            req.prompt_logprobs = [None] * len(req.prompt_ids)
        count = rows.shape[0]
        targets = [(t, t + 1) for t in range(start, start + count) if first <= t + 1 < len(req.prompt_ids)]
        if targets:
            idx = torch.tensor([t - start for t, _ in targets], device=rows.device)
            ids = torch.tensor([req.prompt_ids[u] for _, u in targets], device=rows.device)
            for (_, u), lp in zip(targets, prompt_logprobs(rows[idx], ids)):
                req.prompt_logprobs[u] = lp

    @staticmethod
    def constraint_error(req: Request, vocab: int) -> str | None:
        """Compute ``req``'s constraint mask (bounded work, see constrain.py); the error
        that ends it when the constraint failed (a grammar limit hit, no token left)."""
        c = req.constraint
        if c is None:
            return None
        allowed = c.allowed()
        if c.error is not None or not bool(allowed[:vocab].any()):
            return f"{c.kind}: the constraint failed: {c.error or 'no token can continue'}"
        return None

    def process(self, rows: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """``rows`` (one per request) as the requests' logits processors leave them:
        ``logit_bias`` added, end-of-sequence and stop token ids at -inf until
        ``min_tokens`` are out, each constrained request's disallowed tokens at -inf.
        A copy when any of them applies, else ``rows`` itself."""
        busy = [j for j, r in enumerate(reqs) if r.constraint is not None or r.params.logit_bias
                or len(r.output_ids) < r.params.min_tokens]  # fmt: skip
        if not busy:
            return rows
        rows = rows.clone()
        V = rows.shape[1]
        ninf = float("-inf")
        for j in busy:
            r, p = reqs[j], reqs[j].params
            if p.logit_bias:
                ids = torch.tensor([t for t, _ in p.logit_bias if t < V], dtype=torch.long, device=rows.device)
                bias = torch.tensor([b for t, b in p.logit_bias if t < V], dtype=rows.dtype, device=rows.device)
                rows[j].index_add_(0, ids, bias)
            if len(r.output_ids) < p.min_tokens:
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < V]
                rows[j, banned] = ninf
            if r.constraint is not None:
                allowed = r.constraint.allowed()[:V].to(rows.device)
                if len(r.output_ids) < p.min_tokens and not bool((allowed & torch.isfinite(rows[j])).any()):
                    rows[j] = torch.where(allowed, rows[j].nan_to_num(neginf=-1e30), rows[j])  # the grammar ends here
                rows[j].masked_fill_(~allowed, ninf)
        return rows

    # -- after sampling ----------------------------------------------------------------------

    def append(self, req: Request, token: int, logprob, top) -> tuple[str | None, bool]:
        """Record a sampled token and decide whether ``req`` stops. Returns ``(reason,
        flush)``: ``reason`` None (then what is safe has been streamed) or "stop" /
        "length"; ``flush`` False when a stop string cut the text (the detokenizer's
        held-back bytes lie past the cut)."""
        params = req.params
        req.tokens.append(token)
        req.output_ids.append(token)
        req.sampler.append(token)
        req.token_times.append(time.perf_counter())
        if params.logprobs:
            req.logprobs.append(logprob)
        if params.top_logprobs:
            req.top_logprobs.append(top)
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        if req.constraint is not None:
            req.constraint.advance(token)
            if req.constraint.done:  # nothing may follow (the match ended, or EOS was taken)
                reason = "stop"
        before = len(req.text)
        req.text += req.detok.add(token)
        cut = bool(params.stop) and cut_at_stop(req, before)
        if cut:
            reason = "stop"
        elif reason is None and (len(req.output_ids) >= params.max_new_tokens
                                   or (len(req.tokens) >= self.max_context and not params.kv_rerotate)):
            reason = "length"
        if reason is None:
            self.emit(req, hold=max(map(len, params.stop), default=1) - 1)
        return reason, not cut

    def emit(self, req: Request, hold: int = 0) -> None:
        """Stream (when ``req.stream``) new token ids and the text except its last
        ``hold`` characters; a chunk with nothing new is not sent."""
        if not req.stream:
            return
        end = max(req.emitted, len(req.text) - hold)
        new = slice(req.emitted_tokens, None)
        text, ids = req.text[req.emitted : end], req.output_ids[new]
        if text or ids or req.finish_reason:
            self.send(StreamChunk(
                req.rid, req.index, text, ids, req.finish_reason,
                req.logprobs[new] if req.params.logprobs else None,
                req.top_logprobs[new] if req.params.top_logprobs else None,
            ))  # fmt: skip
        req.emitted = end
        req.emitted_tokens = len(req.output_ids)

    def deliver(self, req: Request, flush: bool) -> None:
        """A finished request's last text (unless a stop string cut it), then its
        result, to the client."""
        if flush:
            req.text += req.detok.flush()
        self.emit(req)
        params = req.params
        completion = CompletionOutput(
            req.text, list(req.output_ids), req.finish_reason,
            req.logprobs if params.logprobs else None,
            req.top_logprobs if params.top_logprobs else None,
        )  # fmt: skip
        self.send(Finished(
            req.rid, req.index, completion, len(req.prompt_ids), req.kv.cached_tokens or 0,
            req.prompt_logprobs if params.prompt_logprobs_from is not None else None,
            req.error, req.error_param if req.error else None, req.arrival_time, tuple(req.token_times),
            time.perf_counter(),
        ))  # fmt: skip


def cut_at_stop(req: Request, before: int) -> bool:
    """Cut ``req.text`` at the first stop string that the new text completes."""
    longest = max(map(len, req.params.stop))
    start = max(0, before - longest + 1)
    hits = [i for i in (req.text.find(s, start) for s in req.params.stop) if i >= 0]
    if not hits:
        return False
    req.text = req.text[: min(hits)]
    return True
