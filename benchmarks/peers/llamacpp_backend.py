"""llama.cpp as a benchmark peer: llama-cpp-python's OpenAI-compatible server on the
same GGUF file, driven as a frontend backend.

Installed into its own virtualenv by ``bash benchmarks/peers/setup_llamacpp.sh``
(``.peers/llamacpp-venv``; building llama.cpp takes ~8 minutes on 2 cores). It runs the
GGUF's own Q4_1 weights (radixkv dequantizes them to float32). Its server accepts only
text prompts, so the token ids the program built are decoded to text (the same
vocabulary, so the server's tokenizer gives the ids back in all but rare cases);
requests are streamed, so TTFT is the first streamed token, and the generated-token
count is the number of streamed token chunks (the stream carries no usage). The
server serves one request at a time; it keeps the previous request's KV and, with
``--cache``, snapshots of earlier ones for prefix reuse. EOS and the other special
tokens are suppressed with a logit bias where the workload asks for ``ignore_eos``.
"""

from __future__ import annotations

import json
import time
from functools import cached_property
from pathlib import Path

from radixkv.frontend.backends import Backend, BackendError, CallResult, Delta

ROOT = Path(__file__).resolve().parent.parent.parent
PYTHON = ROOT / ".peers" / "llamacpp-venv" / "bin" / "python"


def unavailable() -> str | None:
    """Why the peer cannot run here, or None."""
    import subprocess

    if not PYTHON.exists():
        return "not installed (bash benchmarks/peers/setup_llamacpp.sh)"
    check = subprocess.run([str(PYTHON), "-c", "import llama_cpp.server"], capture_output=True, text=True)
    if check.returncode != 0:
        return f"llama_cpp.server does not import: {check.stderr.strip().splitlines()[-1:]}"
    return None


def version() -> str:
    import subprocess

    out = subprocess.run([str(PYTHON), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip()


class LlamaCppServer:
    """The server process (2 threads, 8k context, one request at a time as it serves
    them) and a backend on it."""

    def __init__(self):
        from radixkv.model import resolve_model
        from radixkv.server.process import launch

        gguf = resolve_model().path
        cmd = [str(PYTHON), "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", "8192", "--n_threads", "2",
               "--n_threads_batch", "2", "--n_batch", "512", "--interrupt_requests", "False", "--logits_all", "False",
               "--cache", "True", "--cache_type", "ram"]  # fmt: skip
        self.proc, url = launch(cmd, "/v1/models", "llama.cpp server", die_with_parent=True)
        self.backend = LlamaCppBackend(url)

    def reset(self) -> None:
        pass

    def close(self) -> None:
        from radixkv.server.process import stop

        self.backend.close()
        stop(self.proc)


def greedy_only(params: dict, who: str) -> None:
    """The served peers run greedy generation without prompt log-probs."""
    if params.get("temperature", 1.0) != 0 or "prompt_logprobs_from" in params:
        raise ValueError(f"the {who} peer runs greedy generation only")


def sse_chunks(response, who: str):
    """The JSON chunks of a streamed answer (``data: ...`` lines), after its status is checked."""
    if response.status_code != 200:
        response.read()
        raise BackendError(f"{who} answered {response.status_code}: {response.text[:300]}")
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


class LlamaCppBackend(Backend):
    def __init__(self, url: str):
        import httpx

        from radixkv.model import resolve_model
        from radixkv.model.chat_template import ChatTemplate
        from radixkv.model.tokenizer import Tokenizer

        self.url = url
        self._http = httpx.Client(base_url=url, timeout=3600)
        self.tokenizer = Tokenizer.load(resolve_model())
        self.template = ChatTemplate.from_tokenizer(self.tokenizer)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        self.max_context = 8192

    @cached_property
    def _no_stop(self) -> dict[str, float]:
        """The logit bias that keeps EOS and the other special tokens out (``ignore_eos``:
        this server has no such field; the servers built on this backend do)."""
        specials = {i for i in range(64) if (self.tokenizer.id_to_token(i) or "").startswith("<")}
        return {str(t): -100.0 for t in sorted(self.eos_token_ids | specials)}

    def tokenize(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens, split_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def generate(self, prompts: list[list[int]], params: dict) -> list[CallResult]:
        results = []
        for p in prompts:
            *_, last = self.stream(p, params)
            results.append(last)
        return results

    def stream(self, prompt: list[int], params: dict):
        greedy_only(params, "llama.cpp")
        body = {"prompt": self.tokenizer.decode(prompt), "max_tokens": params.get("max_new_tokens", 128),
                "temperature": 0.0, "top_k": 1, "stream": True}  # fmt: skip
        if params.get("ignore_eos"):
            body["logit_bias"] = self._no_stop
        t0, ttft, text, tokens, reason = time.perf_counter(), None, [], 0, None
        with self._http.stream("POST", "/v1/completions", json=body) as r:
            for chunk in sse_chunks(r, "llama.cpp"):
                choice = chunk["choices"][0]
                if choice.get("finish_reason"):
                    reason = choice["finish_reason"]
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += 1  # one chunk per generated token
                text.append(choice.get("text") or "")
                yield Delta(choice.get("text") or "")
        full = "".join(text)
        # the program continues from the text, re-tokenized: the server gives out no ids
        yield CallResult(full, self.tokenize(full), len(prompt), 0, reason, None, ttft, tokens)

    def close(self) -> None:
        self._http.close()
