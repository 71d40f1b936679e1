"""The naive baseline as a frontend backend: HF transformers generating request by
request (one at a time, each with a fresh KV cache), greedy, on the same GGUF weights.

This is what a user gets without a serving runtime: no batching across requests and no
prefix reuse. Tokenizing and chat templating use radixkv's tokenizer and template,
which produce the same ids and text as transformers' own (tests/test_tokenizer.py,
tests/test_chat_template.py), so every system receives identical prompts.
"""

from __future__ import annotations

import threading
import time

import torch

from radixkv.frontend.backends import Backend, CallResult, Delta


class TransformersBackend(Backend):
    def __init__(self):
        import transformers

        from radixkv.model import resolve_model
        from radixkv.model.chat_template import ChatTemplate
        from radixkv.model.tokenizer import Tokenizer

        src = resolve_model()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            src.path.parent, gguf_file=src.path.name, dtype=torch.float32
        ).eval()
        self.tokenizer = Tokenizer.load(src)
        self.template = ChatTemplate.from_tokenizer(self.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.max_context = self.model.config.max_position_embeddings
        self._lock = threading.Lock()  # one request at a time

    def tokenize(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens, split_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def generate(self, prompts: list[list[int]], params: dict) -> list[CallResult]:
        return [self._one(p, params) for p in prompts]

    def stream(self, prompt: list[int], params: dict):
        result = self._one(prompt, params)
        yield Delta(result.text, result.token_ids)
        yield result

    @torch.inference_mode()
    def _one(self, prompt: list[int], params: dict) -> CallResult:
        if params.get("temperature", 1.0) != 0 or "prompt_logprobs_from" in params:
            raise ValueError("the transformers baseline runs greedy generation only")
        n = params.get("max_new_tokens", 128)
        ignore_eos = params.get("ignore_eos", False)
        t0 = time.perf_counter()
        with self._lock:
            out = self.model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            token = int(out.logits[0, -1].argmax())
            ttft = time.perf_counter() - t0
            cache, ids = out.past_key_values, [token]
            while len(ids) < n and (ignore_eos or token not in self.eos_token_ids):
                out = self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, int(out.logits[0, -1].argmax())
                ids.append(token)
        stopped = not ignore_eos and ids[-1] in self.eos_token_ids
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
        return CallResult(text, ids, len(prompt), 0, "stop" if stopped else "length", None, ttft)
