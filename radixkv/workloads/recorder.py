"""Traces of the workloads for ``radixkv sim``: run a workload's programs against a
backend with the model's real tokenizer and chat template but no model (placeholder
outputs), and record every call as a trace request."""

from __future__ import annotations

import json
import threading
from array import array
from dataclasses import replace
from pathlib import Path

from radixkv.cache.traces import TraceRequest
from radixkv.frontend.backends import Backend, CallResult, Delta
from radixkv.workloads.programs import Workload, run


class RecordingBackend(Backend):
    """No model: real tokenizer and chat template, and ``max_new_tokens`` placeholder
    output tokens per call (distinct per call, so they never falsely share a prefix).
    Records every call as a trace request."""

    def __init__(self, tokenizer, chat_template, max_context: int = 8192):
        self.tokenizer, self.template = tokenizer, chat_template
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.max_context = max_context
        self.requests: list[dict] = []
        self._lock = threading.Lock()

    def tokenize(self, text, add_special_tokens=False, split_special_tokens=False):
        return self.tokenizer.encode(text, add_special_tokens, split_special_tokens)

    def render_chat(self, messages, add_generation_prompt):
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            n = params.get("max_new_tokens", 1)
            with self._lock:
                k = len(self.requests)
                ids = [1000 + (k * 7919 + j * 104729) % 40000 for j in range(n)]  # placeholders: plain word pieces
                self.requests.append({"tokens": list(prompt), "output_tokens": ids})
            out.append(CallResult(self.tokenizer.decode(ids), ids, len(prompt), 0, "length"))
        return out

    def stream(self, prompt, params):
        (result,) = self.generate([prompt], params)
        yield Delta(result.text, result.token_ids)
        yield result


def record(workload: Workload, model: str | None = None) -> list[dict]:
    """The workload's requests, ``{"tokens": [...], "output_tokens": [...]}`` each, with
    the tokenizer and chat template of ``model`` (default: the embedded one). Runs are
    replayed one at a time (``threads=1``) so the order is fixed."""
    from radixkv.model import resolve_model
    from radixkv.model.chat_template import ChatTemplate
    from radixkv.model.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model(model) if model else resolve_model())
    backend = RecordingBackend(tok, ChatTemplate.from_tokenizer(tok))
    run(replace(workload, threads=1), backend, threads=1)
    return backend.requests


def trace(workload: Workload, model: str | None = None) -> list[TraceRequest]:
    """``record`` as ``TraceRequest``s, ready for ``radixkv.cache.sim``."""
    return [TraceRequest(array("i", r["tokens"]), output_tokens=array("i", r["output_tokens"]))
            for r in record(workload, model)]  # fmt: skip


def export_trace(workload: Workload, path: str | Path, model: str | None = None) -> int:
    """Write the workload's requests as a ``radixkv sim`` JSONL trace; returns the count."""
    requests = record(workload, model)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(r) + "\n")
    return len(requests)
