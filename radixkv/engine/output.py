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

from radixkv.engine.constrain import disallowed
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

    def process(self, rows: torch.Tensor, reqs: list[Request]) -> tuple[torch.Tensor, list[str | None]]:
        """``rows`` (one per request) as the requests' logits processors leave them:
        ``logit_bias`` added, end-of-sequence and stop token ids at -inf until
        ``min_tokens`` are out (unless the grammar allows nothing else: its end wins),
        each constrained request's disallowed tokens at -inf (the batch's masks in one
        tensor: constrain.disallowed). A copy when any of them applies, else ``rows``
        itself. Also per request the error that ends it (its constraint failed: a
        grammar limit hit, or no token can continue), else None."""
        errors: list[str | None] = [None] * len(reqs)
        biased = [j for j, r in enumerate(reqs) if r.params.logit_bias]
        early = [j for j, r in enumerate(reqs) if len(r.output_ids) < r.params.min_tokens]
        cons = [j for j, r in enumerate(reqs) if r.constraint is not None]
        if not (biased or early or cons):
            return rows, errors
        V, dev = rows.shape[1], rows.device
        ninf = torch.tensor(float("-inf"), dtype=rows.dtype, device=dev)
        bad, failed, counts = disallowed([reqs[j].constraint for j in cons], V) if cons else (None, [], [])
        if cons and len(cons) == len(reqs):
            rows = torch.where(bad.to(dev), ninf, rows)  # a new tensor (faster than clone + masked_fill_)
        else:
            rows = rows.clone()
            if cons:
                idx = torch.tensor(cons, device=dev)
                rows[idx] = torch.where(bad.to(dev), ninf, rows[idx])
        for k, j in enumerate(cons):
            if failed[k] is not None:
                errors[j] = f"{reqs[j].constraint.kind}: the constraint failed: {failed[k]}"
        if biased:
            pairs = [(j, t, b) for j in biased for t, b in reqs[j].params.logit_bias if t < V]
            r_idx, c_idx, vals = zip(*pairs) if pairs else ((), (), ())
            rows.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(c_idx, device=dev)),
                            torch.tensor(vals, dtype=rows.dtype, device=dev), accumulate=True)  # fmt: skip
        if early:
            at = {j: k for k, j in enumerate(cons)}
            r_idx, c_idx = [], []
            for j in early:
                banned = [t for t in (*self.eos_token_ids, *reqs[j].params.stop_token_ids) if t < V]
                if j in at and counts[at[j]] <= len(banned) and _only(bad[at[j]], banned):
                    continue  # the grammar allows nothing but these: it ends here
                r_idx += [j] * len(banned)
                c_idx += banned
            if r_idx:
                rows[torch.tensor(r_idx, device=dev), torch.tensor(c_idx, device=dev)] = float("-inf")
        return rows, errors

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
            time.perf_counter(), req.pin,
        ))  # fmt: skip


def _only(bad_row: torch.Tensor, ids: list[int]) -> bool:
    """Whether the tokens a mask allows (``~bad_row``) are all among ``ids``."""
    return set((~bad_row).nonzero().flatten().tolist()) <= set(ids)


def cut_at_stop(req: Request, before: int) -> bool:
    """Cut ``req.text`` at the first stop string that the new text completes."""
    longest = max(map(len, req.params.stop))
    start = max(0, before - longest + 1)
    hits = [i for i in (req.text.find(s, start) for s in req.params.stop) if i >= 0]
    if not hits:
        return False
    req.text = req.text[: min(hits)]
    return True
