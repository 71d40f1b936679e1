"""Tokenizers: text to token ids and back, and streaming detokenization.

One `Tokenizer` over three kinds of files:

- a GGUF file with ``tokenizer.ggml.model == "gpt2"``: the byte-level BPE is rebuilt
  from the file's vocabulary and merges with the ``tokenizers`` package, the way
  transformers' GGUF loader rebuilds it (transformers is the reference the tests
  compare against, id for id);
- a GGUF file with ``tokenizer.ggml.model == "llama"`` (a SentencePiece BPE model, as
  llama.cpp's converter writes it: pieces, scores and types): rebuilt with ``tokenizers``
  to encode as llama.cpp's SentencePiece tokenizer does, which is SentencePiece's own
  encoding of each run of text (the tests compare with ``sentencepiece`` id for id);
- an HF directory with ``tokenizer.json``: loaded by ``tokenizers`` as it is;
- an HF directory with only a SentencePiece ``tokenizer.model``: encoded by the
  ``sentencepiece`` package itself, with added tokens such as ``<s>`` matched whole.

Special-token text (``<|im_end|>``) in the text becomes the special token's id, unless
the caller says it is plain text: all of it (``split_special_tokens``, as in
transformers) or only where it lies inside given character ranges (`Tokenizer.encode_literal`,
which chat prompts use so that text from messages never turns into role markers).

`IncrementalDetokenizer` turns generated ids into text deltas for streaming.
"""

from __future__ import annotations

import bisect
import json
import re
from functools import cached_property, lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping, Protocol, Sequence

from radixkv.errors import ModelLoadError
from radixkv.model.gguf_file import metadata
from radixkv.model.registry import ModelSource

# Tokens that close a chat turn in the formats we know. Generation stops on the eos token
# and on any of these that the vocabulary holds as a special token.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")

# llama.cpp's token types in ``tokenizer.ggml.token_type``.
_GGUF_NORMAL, _GGUF_UNKNOWN, _GGUF_CONTROL, _GGUF_USER_DEFINED = 1, 2, 3, 4  # (5: unused, 6: byte)

# How text is cut into words before BPE, per ``tokenizer.ggml.pre``. These are the split
# patterns the models were trained with (Llama 3's, Qwen2's, ...); a ``pre`` not listed
# here (gpt2, smollm, ...) gets GPT-2's own pattern, which is what transformers does too.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GGUF_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values: bytes that are printable Latin-1
    characters stand for themselves, the rest take code points 256, 257, ... in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelling):
        spelling[b] = chr(256 + n)
    return spelling


class _Backend(Protocol):
    vocab_size: int
    special_tokens: Mapping[str, int]

    def encode(self, text: str, add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]: ...
    def encode_literal(self, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...
    def id_to_token(self, token_id: int) -> str | None: ...
    def token_to_id(self, token: str) -> int | None: ...


class _TokenizersBackend:
    """A ``tokenizers.Tokenizer``, finished (added tokens, post-processor) before wrapping."""

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        added = sorted(tok.get_added_tokens_decoder().items())
        self.special_tokens = {t.content: i for i, t in added if t.special}
        self._special_ids = frozenset(self.special_tokens.values())

    @cached_property
    def _split_tok(self):
        """A copy that encodes special-token text as plain text (``encode_special_tokens``
        is a setting of the whole tokenizer, and the original is shared between threads)."""
        from tokenizers import Tokenizer as RawTokenizer

        tok = RawTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode(self, text: str, add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
        tok = self._split_tok if split_special_tokens else self._tok
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_literal(self, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool) -> list[int]:
        """``tokenizers`` splits text at special tokens and encodes the runs between them
        one by one. So: encode the whole text, cut it at the special tokens outside the
        spans, and re-encode (special text as plain text) only the runs that hold a special
        token inside a span; every other run keeps the ids of the whole text's encoding.
        (A re-encoded run is encoded on its own: a pre-tokenizer that marks only the start
        of the whole text, Metaspace's prepend_scheme "first", takes it for a start.)
        (Spaces below only for the picture.)

            text   <|im_start|> user hi <|im_end|> x <|im_end|> !
            spans                       ~~~~~~~~~~                   special text from a message
            cuts   ^^^^^^^^^^^^                      ^^^^^^^^^^      special tokens outside spans
            runs               [---- re-encoded ------]          [kept]
        """
        full = self._tok.encode(text, add_special_tokens=add_special_tokens)
        in_text = [i for i, seq in enumerate(full.sequence_ids) if seq is not None]  # not bos/eos put around it
        if not in_text:
            return full.ids
        lo, hi = in_text[0], in_text[-1] + 1
        special = self._special_ids
        cuts = [i for i in range(lo, hi) if full.ids[i] in special and not _inside(spans, *full.offsets[i])]
        ids, first, start = full.ids[:lo], lo, 0
        for cut in [*cuts, hi]:
            end = full.offsets[cut][0] if cut < hi else len(text)
            if any(full.ids[i] in special for i in range(first, cut)):  # a literal special token in this run
                ids += self._split_tok.encode(text[start:end], add_special_tokens=False).ids
            else:
                ids += full.ids[first:cut]
            if cut < hi:
                ids.append(full.ids[cut])
                first, start = cut + 1, full.offsets[cut][1]
        return ids + full.ids[hi:]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        return self._tok.to_str()


class _SentencePieceBackend:
    """A SentencePiece model run by the ``sentencepiece`` package, with what
    ``tokenizer_config.json`` adds to it.

    Added tokens (the model's control pieces such as ``<s>``, its unknown piece, and the
    config's ``added_tokens_decoder``) are matched whole in the text; the text between
    them goes to SentencePiece. As in transformers (config ``legacy`` false, the default),
    only text at the very start gets SentencePiece's dummy "▁" prefix, text after an added
    token does not; ``legacy`` true prefixes every piece of text. ``named`` holds the
    config's bos/eos/unk/pad tokens completed with the model's own; encode puts bos/eos
    around a sequence if the config's ``add_bos_token``/``add_eos_token`` say so.
    """

    def __init__(self, path: Path, config: Mapping, named: Mapping[str, str | None]):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise ModelLoadError(f"{path} is not a readable SentencePiece model: {e}") from None
        # The same model without the dummy prefix. Appending a NormalizerSpec (ModelProto
        # field 3) that holds only add_dummy_prefix (its field 3) = false overrides that one
        # setting: protobuf merges a message field that appears twice.
        self._sp_inner = sentencepiece.SentencePieceProcessor(
            model_proto=self._sp.serialized_model_proto() + b"\x1a\x02\x18\x00"
        )
        self._pieces = self._sp.get_piece_size()
        own = [i for i in range(self._pieces) if self._sp.is_control(i) or self._sp.is_unknown(i)]
        added = {self._sp.id_to_piece(i): i for i in own}
        special = set(own)
        for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, Mapping) and isinstance(entry.get("content"), str):
                added[entry["content"]] = int(token_id)
                if entry.get("special"):
                    special.add(int(token_id))
        self._added = {t: i for t, i in added.items() if t}  # an empty token would match everywhere
        self._added_by_id = {i: t for t, i in self._added.items()}
        self.special_tokens = {self._added_by_id[i]: i for i in sorted(special) if i in self._added_by_id}
        self._special_ids = frozenset(self.special_tokens.values())
        self.vocab_size = max(self._pieces, max(self._added_by_id, default=-1) + 1)
        self._split = _alternation(self._added)
        self._split_plain = _alternation(t for t, i in self._added.items() if i not in self._special_ids)
        self._legacy = bool(config.get("legacy", False))

        own_named = {"bos_token": self._sp.bos_id(), "eos_token": self._sp.eos_id(),
                     "unk_token": self._sp.unk_id(), "pad_token": self._sp.pad_id()}
        self.named = {name: named.get(name) or (self._sp.id_to_piece(i) if i >= 0 else None)
                      for name, i in own_named.items()}
        bos, eos = (self.token_to_id(self.named[k] or "") for k in ("bos_token", "eos_token"))
        self._prefix_ids = [bos] if config.get("add_bos_token") and bos is not None else []
        self._suffix_ids = [eos] if config.get("add_eos_token") and eos is not None else []

    def encode(self, text: str, add_special_tokens: bool, split_special_tokens: bool = False) -> list[int]:
        return self._encode(text, add_special_tokens, self._split_plain if split_special_tokens else self._split, ())

    def encode_literal(self, text: str, spans: Sequence[tuple[int, int]], add_special_tokens: bool) -> list[int]:
        return self._encode(text, add_special_tokens, self._split, spans)

    def _encode(self, text: str, add_special_tokens: bool, split: re.Pattern | None,
                spans: Sequence[tuple[int, int]]) -> list[int]:  # fmt: skip
        """Added tokens that ``split`` matches are their ids, but special ones inside
        ``spans`` stay in the text around them."""
        ids: list[int] = []
        start = 0
        for match in split.finditer(text) if split else ():
            if self._added[match.group()] in self._special_ids and _inside(spans, *match.span()):
                continue
            ids += self._encode_text(text[start : match.start()], at_start=start == 0)
            ids.append(self._added[match.group()])
            start = match.end()
        ids += self._encode_text(text[start:], at_start=start == 0)
        return self._prefix_ids + ids + self._suffix_ids if add_special_tokens else ids

    def _encode_text(self, text: str, at_start: bool) -> list[int]:
        if not text:
            return []
        return (self._sp if at_start or self._legacy else self._sp_inner).encode(text)

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        # SentencePiece drops the dummy prefix's space only at the start of the text.
        parts: list[str] = []
        run: list[int] = []

        def end_run():
            if run:
                parts.append((self._sp_inner if parts else self._sp).decode(run))
                run.clear()

        for i in ids:
            if i in self._added_by_id:
                if not (skip_special_tokens and i in self._special_ids):
                    end_run()
                    parts.append(self._added_by_id[i])
            elif 0 <= i < self._pieces:
                run.append(i)
        end_run()
        return "".join(parts)

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added_by_id:
            return self._added_by_id[token_id]
        return self._sp.id_to_piece(token_id) if 0 <= token_id < self._pieces else None

    def token_to_id(self, token: str) -> int | None:
        if token in self._added:
            return self._added[token]
        token_id = self._sp.piece_to_id(token)  # the unknown piece's id when there is no such piece
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a piece stands for: "▁" is a space, ``<0xNN>`` one byte."""
        if token_id in self._added_by_id:
            return self._added_by_id[token_id].encode()
        if not 0 <= token_id < self._pieces or self._sp.is_control(token_id) or self._sp.is_unknown(token_id):
            return b""
        if self._sp.is_byte(token_id):
            return bytes([int(self._sp.id_to_piece(token_id)[3:5], 16)])
        return self._sp.id_to_piece(token_id).replace("\u2581", " ").encode()


class Tokenizer:
    """Text to token ids and back, and the special tokens that generation and chat
    formatting need. Build one with `load`, `from_gguf` or `from_hf_dir`.

    Attributes: ``vocab_size``; ``bos_token``/``eos_token``/``pad_token`` (strings or None)
    and their ``*_id``; ``eos_token_ids``, the ids generation stops on (eos plus the
    end-of-turn tokens of `END_OF_TURN_TOKENS` the vocabulary holds, plus the eos ids of
    ``generation_config.json``); ``special_tokens``, control tokens by text (matched whole
    in text, dropped by ``decode(skip_special_tokens=True)``); ``special_tokens_map``, the
    named ones (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) as a chat
    template sees them; ``chat_template`` (Jinja source or None); ``source``, where it
    was loaded from.
    """

    def __init__(self, backend: _Backend, named: Mapping[str, str | None], chat_template: str | None,
                 source: str, extra_eos_ids: Iterable[int] = ()):
        self._backend = backend
        self.source = source
        self.vocab_size: int = backend.vocab_size
        self.special_tokens: Mapping[str, int] = MappingProxyType(dict(backend.special_tokens))
        self.special_tokens_map: Mapping[str, str] = MappingProxyType(
            {name: token for name, token in named.items() if token is not None}
        )
        self.bos_token: str | None = named.get("bos_token")
        self.eos_token: str | None = named.get("eos_token")
        self.pad_token: str | None = named.get("pad_token")
        self.bos_token_id = self._id_or_none(self.bos_token)
        self.eos_token_id = self._id_or_none(self.eos_token)
        self.pad_token_id = self._id_or_none(self.pad_token)
        self.chat_template = chat_template
        end_of_turn = (self.special_tokens[t] for t in END_OF_TURN_TOKENS if t in self.special_tokens)
        stops = {self.eos_token_id, *extra_eos_ids, *end_of_turn}
        self.eos_token_ids: frozenset[int] = frozenset(i for i in stops if i is not None)

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become
        their ids, or with ``split_special_tokens`` (transformers' option of that name) are
        encoded as plain text; added tokens that are not special match either way.
        ``add_special_tokens`` adds what the tokenizer adds around a sequence (a bos token
        for some models, nothing for SmolLM2). Raises TypeError for non-str."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens, split_special_tokens)

    def encode_literal(self, text: str, spans: Iterable[tuple[int, int]], add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` where special-token text lying wholly inside one of
        ``spans`` (character ranges ``(start, end)``) is plain text, as with
        ``split_special_tokens``, and special-token text elsewhere is the special token.
        Chat prompts use it: the template's markers are tokens, text from messages is text.

        The text between two special tokens that stay tokens is encoded as a whole, as
        ``encode`` encodes it; so without spans, or with spans that hold no special-token
        text, the ids are exactly ``encode(text)``'s. Raises TypeError for non-str."""
        if not isinstance(text, str):
            raise TypeError(f"encode_literal() takes a str, got {type(text).__name__}")
        return self._backend.encode_literal(text, _merged(spans), add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; bytes that do not form valid UTF-8 come out as U+FFFD and ids
        outside the vocabulary are skipped. ``skip_special_tokens`` leaves out control tokens."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as stored (byte-level spelling such as
        ``Ġthe`` for BPE), or None outside the vocabulary."""
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry as stored, or None if there is none."""
        return self._backend.token_to_id(token)

    def tokenizers_json(self) -> str | None:
        """The HF ``tokenizers`` serialization (tokenizer.json text) when this tokenizer
        runs on that library, else None (SentencePiece)."""
        return self._backend.to_json() if isinstance(self._backend, _TokenizersBackend) else None

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, for grammar engines that walk the vocabulary; only for
        tokenizers without a ``tokenizers_json`` (raises TypeError otherwise)."""
        if not isinstance(self._backend, _SentencePieceBackend):
            raise TypeError("token_bytes is for SentencePiece tokenizers; use tokenizers_json")
        return [self._backend.token_bytes(i) for i in range(self.vocab_size)]

    @classmethod
    def load(cls, source: ModelSource) -> Tokenizer:
        """The tokenizer of a resolved model (see ``registry.resolve_model``). Raises
        ModelLoadError as the constructors do."""
        if source.format == "gguf":
            return cls.from_gguf(source.path)
        return cls.from_hf_dir(source.path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata: byte-level BPE
        (``tokenizer.ggml.model == "gpt2"``) or SentencePiece BPE (``"llama"``; bos added
        unless ``tokenizer.ggml.add_bos_token`` says otherwise, as llama.cpp does). Raises
        ModelLoadError for a missing or unreadable file, a file without a tokenizer, another
        tokenizer model (such as ``t5``'s Unigram), or a missing vocabulary, merges
        (``gpt2``) or scores (``llama``)."""
        meta = metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        if kind is None:
            raise ModelLoadError(f"{path}: the GGUF file holds no tokenizer (no tokenizer.ggml.model)")
        if kind not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"{path}: GGUF tokenizer model {kind!r} is not supported, only 'gpt2' (byte-level BPE) and 'llama' "
                "(SentencePiece BPE); load the model's HF directory (tokenizer.json or tokenizer.model) instead"
            )
        tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type") or []
        if kind == "gpt2":
            merges = meta.get("tokenizer.ggml.merges")
            if not tokens or not merges:
                raise ModelLoadError(f"{path}: a byte-level BPE tokenizer needs tokenizer.ggml.tokens and .merges")
            tok = _byte_level_bpe(tokens, merges, types, meta.get("tokenizer.ggml.pre"), path)
        else:
            scores = meta.get("tokenizer.ggml.scores")
            if not tokens or not scores or len(scores) != len(tokens) or len(types) not in (0, len(tokens)):
                raise ModelLoadError(f"{path}: a SentencePiece tokenizer needs tokenizer.ggml.tokens, .scores and "
                                     ".token_type of one length")  # fmt: skip
            unk = meta.get("tokenizer.ggml.unknown_token_id")
            tok = _sentencepiece_bpe(tokens, scores, types, unk, meta.get("tokenizer.ggml.add_space_prefix", True))

        def token_named(key: str) -> str | None:
            token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

        named = {
            "bos_token": token_named("bos"),
            "eos_token": token_named("eos"),
            "unk_token": token_named("unknown"),
            "pad_token": token_named("padding"),
        }
        _add_named_tokens(tok, named)
        tok.post_processor = _bos_eos_processor(
            tok,  # llama.cpp adds bos to a SentencePiece vocabulary unless the file says not to
            named["bos_token"] if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") else None,
            named["eos_token"] if meta.get("tokenizer.ggml.add_eos_token", False) else None,
        )
        extra_eos = [meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta]
        return cls(_TokenizersBackend(tok), named, meta.get("tokenizer.chat_template"), str(path), extra_eos)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of an HF model directory: ``tokenizer.json`` if present, else a
        SentencePiece ``tokenizer.model``. Named special tokens, added tokens, bos/eos flags
        (``tokenizer.model`` only: ``tokenizer.json`` has its own) and the chat template come
        from ``tokenizer_config.json`` (and, for configs without ``added_tokens_decoder``,
        ``special_tokens_map.json``) and ``chat_template.jinja`` if present; extra stop ids
        from ``generation_config.json``. Raises ModelLoadError for a missing directory, no
        tokenizer file, or an unreadable file."""
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(f"{folder}: not a directory")
        config = _read_json(folder / "tokenizer_config.json")
        # Like transformers: special_tokens_map.json only counts for configs that predate
        # added_tokens_decoder, and then it overrides them.
        special_map = {} if "added_tokens_decoder" in config else _read_json(folder / "special_tokens_map.json")
        named = {name: _token_text(special_map.get(name) or config.get(name)) for name in _NAMED_TOKENS}
        if (folder / "tokenizer.json").is_file():
            backend = _tokenizer_json(folder / "tokenizer.json", named)
        elif (folder / "tokenizer.model").is_file():
            backend = _SentencePieceBackend(folder / "tokenizer.model", config, named)
            named = backend.named
        else:
            raise ModelLoadError(f"{folder}: no tokenizer.json or tokenizer.model")
        eos_ids = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos_ids = [i for i in (eos_ids if isinstance(eos_ids, list) else [eos_ids]) if isinstance(i, int)]
        return cls(backend, named, _hf_chat_template(folder, config), str(folder), eos_ids)


def _alternation(tokens: Iterable[str]) -> re.Pattern | None:
    """A pattern that matches any of ``tokens``, the longest one where several start at the
    same place; None for no tokens."""
    longest_first = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, longest_first))) if longest_first else None


def _inside(spans: Sequence[tuple[int, int]], start: int, end: int) -> bool:
    """Whether [start, end) lies wholly inside one of ``spans`` (sorted, disjoint)."""
    k = bisect.bisect_right(spans, (start, float("inf"))) - 1
    return k >= 0 and spans[k][0] <= start and end <= spans[k][1]


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, with overlapping or touching ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        elif a < b:
            out.append((a, b))
    return out


def _byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str | None, path):
    """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF vocabulary, merges and token types.

    Entries spelled outside GPT-2's byte alphabet are respelled byte by byte. Control
    tokens become special added tokens, except ones with characters outside the alphabet
    (mislabelled entries); user-defined ones become plain added tokens.
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spelled(token): i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise ModelLoadError(f"{path}: merge {bad!r} is not two tokens separated by one space")
    model = models.BPE(
        vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
    )
    tok = RawTokenizer(model)
    split = _GGUF_SPLITS.get(pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types) if kind == _GGUF_CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, kind in zip(tokens, types) if kind == _GGUF_USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk_id: int | None,
                       add_space_prefix: bool):  # fmt: skip
    """A ``tokenizers.Tokenizer`` that encodes a GGUF SentencePiece vocabulary as
    llama.cpp does, which is SentencePiece's BPE encoding of each run of text:

    - a run of text (the whole text, and each stretch after a control or user-defined
      token matched whole) gets SentencePiece's "▁" prefix when ``add_space_prefix``
      (the GGUF's ``tokenizer.ggml.add_space_prefix``, default true), even before a
      leading space, and its spaces become "▁" (a normalizer, not transformers'
      ``Metaspace``, which prefixes only the first run and never a leading space);
    - its characters then merge, best first, into the pieces of the vocabulary, the
      better piece being the one with the higher score: merges derived from the normal
      pieces, ranked by their scores (ties: the longer left part first, as transformers
      orders them);
    - what no piece covers falls back to its UTF-8 bytes (``<0xNN>`` tokens), else the
      unknown token (consecutive ones fused into one, as SentencePiece does).

    Decoding turns "▁" back into spaces, byte tokens into bytes, and drops the prefix's
    space at the start."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as RawTokenizer

    types = types or [_GGUF_NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)  # a piece listed twice keeps its first id
    normal = {t: score for t, score, kind in zip(tokens, scores, types) if kind == _GGUF_NORMAL}
    merges = []
    for piece, score in normal.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in normal and piece[k:] in normal]
        merges += [(left, right, score) for left, right in sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    if unk_id is None or not 0 <= unk_id < len(tokens):
        unk_id = next((i for i, kind in enumerate(types) if kind == _GGUF_UNKNOWN), None)
    model = models.BPE(vocab=vocab, merges=[(left, right) for left, right, _ in merges], dropout=None,
                       unk_token=None if unk_id is None else tokens[unk_id], fuse_unk=True, byte_fallback=True)  # fmt: skip
    tok = RawTokenizer(model)
    spaces = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces]) if add_space_prefix else spaces
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if add_space_prefix else steps)
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == _GGUF_CONTROL])  # fmt: skip
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == _GGUF_USER_DEFINED])  # fmt: skip
    return tok


def _add_named_tokens(tok, named: Mapping[str, str | None]) -> None:
    """Make the named special tokens (bos, eos, ...) special added tokens if they are not
    added tokens yet, so that they match whole in text and ``skip_special_tokens`` drops them."""
    from tokenizers import AddedToken

    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys(named.values()) if t is not None and t not in added]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in missing])


def _bos_eos_processor(tok, bos: str | None, eos: str | None):
    """A post-processor that puts ``bos`` before and ``eos`` after a sequence (None: nothing)."""
    from tokenizers import processors

    single = [t for t in (bos, "$A", eos) if t is not None]
    ends = [(t, tok.token_to_id(t)) for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, special_tokens=ends)


def _tokenizer_json(path: Path, named: Mapping[str, str | None]) -> _TokenizersBackend:
    """``tokenizer.json`` as it is: its post-processor decides what encode adds around a
    sequence (transformers too ignores the config's add_bos_token next to this file)."""
    from tokenizers import Tokenizer as RawTokenizer

    try:
        tok = RawTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ModelLoadError(f"{path} is not a readable tokenizer.json: {e}") from None
    _add_named_tokens(tok, named)
    return _TokenizersBackend(tok)


def _read_json(path: Path) -> dict:
    """A JSON object file's contents, {} if the file does not exist. Raises ModelLoadError
    if it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value) -> str | None:
    """A token as HF configs write it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(folder: Path, config: Mapping) -> str | None:
    """``chat_template.jinja`` if present, else the config's template; of named templates
    (a list of ``{name, template}``) the one named ``default``."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}.get("default")
    return template if isinstance(template, str) else None


_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Text deltas for a stream of generated token ids.

    Each `add` decodes a small window: the ids of the last emitted delta (left context,
    so that merges and SentencePiece's leading-space rule see what comes before) plus the
    ids not emitted yet, and returns what the window adds beyond the context. While the
    window's text ends in U+FFFD (a character whose bytes span tokens not all here yet),
    nothing is emitted. `flush` emits what is still held back at the end.

    The deltas of every `add` plus `flush` concatenate to ``decode(generated_ids)``.
    With ``prompt_ids``, the last few prompt ids are the first context: the stream then
    continues the prompt's text, which for byte-level BPE is the same text, and for
    SentencePiece keeps a first "▁word" token's space that a decode of the generated ids
    alone would drop at the start.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or ())[-_CONTEXT_TOKENS:]
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt that ends inside a character gives no clean left edge
        self._ids = context
        self._start = 0  # the window starts here
        self._emitted = len(context)  # ids before this index are emitted (or context)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Take one generated id; return the text it completes ("" while held back)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return the text still held back (an incomplete character shows as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._emitted == len(self._ids):
            return ""
        seen = self._decode(self._ids[self._start : self._emitted])
        text = self._decode(self._ids[self._start :])
        if not final and text.endswith(_REPLACEMENT):
            return ""
        self._start, self._emitted = self._emitted, len(self._ids)
        return text[len(seen) :]
