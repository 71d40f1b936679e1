"""``text`` and ``messages`` trace lines as prompt ids, the way `radixkv serve` turns
the same requests into ids (a ``radixkv.cache.traces.PromptEncoder``):

- ``text``: a /v1/completions prompt: ``Engine.encode(text)``, the tokenizer's special
  tokens added (``add_special_tokens=True``);
- ``messages``: a /v1/chat/completions request: text parts joined, ``developer`` as
  ``system``, tool results and calls as the server writes them for the template (its
  tool format), rendered with the generation prompt; special-token text inside messages
  stays plain text (``ChatTemplate.encode``, as ``Engine.chat_prompt_ids``).

The tokenizer is loaded on first use, so a trace of ids never reads the model.
"""

from __future__ import annotations

ROLES = ("system", "developer", "user", "assistant", "tool")


class ModelPromptEncoder:
    """Encodes prompts with the tokenizer and chat template of ``model`` (a registry
    name, GGUF file or HF directory; None: the embedded model). Raises ValueError
    (ModelLoadError) when the model cannot be read, or for messages the template
    refuses."""

    def __init__(self, model: str | None = None):
        self.model = model
        self._tokenizer = None
        self._template = None

    def _load(self):
        if self._tokenizer is None:
            from radixkv.model import resolve_model
            from radixkv.model.chat_template import ChatTemplate
            from radixkv.model.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.load(resolve_model(self.model) if self.model else resolve_model())
            self._template = ChatTemplate.from_tokenizer(self._tokenizer) if self._tokenizer.chat_template else None
        return self._tokenizer

    def encode_text(self, text: str) -> list[int]:
        return self._load().encode(text, True)

    def encode_messages(self, messages: list) -> list[int]:
        from radixkv.server.tools import generic_messages, tool_format

        tokenizer = self._load()
        if self._template is None:
            raise ValueError(f"the model {self.model or '(embedded)'} has no chat template")
        chat = []
        for i, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):  # fmt: skip
                    raise ValueError(f"messages[{i}].content: only text parts are supported")
                content = "".join(p["text"] for p in content)
            elif content is not None and not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string, a list of text parts or null")
            msg = {"role": "system" if role == "developer" else role, "content": content or ""}
            for key in ("name", "tool_calls", "tool_call_id"):
                if m.get(key) is not None:
                    msg[key] = m[key]
            chat.append(msg)
        if tool_format(tokenizer.chat_template) != "hermes":
            chat = generic_messages(chat, None)
        return self._template.encode(tokenizer, chat, add_generation_prompt=True)
