"""Tokenizer and streaming detokenizer, compared id for id with transformers.

The reference is transformers' tokenizer loaded from the same file: the embedded
SmolLM2 GGUF, GGUF files written here with other pre-tokenizers, a directory saved by
transformers, and SentencePiece models trained here.
"""

import json
import os
import random
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.errors import ModelLoadError
from radixkv.model.gguf_file import metadata
from radixkv.model.registry import resolve_model
from radixkv.model.tokenizer import IncrementalDetokenizer, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

CORPUS = [
    "",
    "Hello world",
    "hello, World! How are you?",
    # unicode: CJK, emoji (with ZWJ sequences, skin tones, flags), combining marks, RTL
    "東京は日本の首都です。",
    "中文测试：你好，世界！",
    "한국어 텍스트",
    "😀 😃 👍🏽 🇫🇷🇯🇵",
    "family 👨‍👩‍👧‍👦 and 🏳️‍🌈 done",
    "e\u0301 n\u0303 a\u0308\u0304 Z\u0335\u0321\u0347a\u0337lgo",
    "مرحبا بالعالم",
    "שלום עולם 123",
    "mixed العربية and English",
    "Ünïcödé façade naïve café",
    "Ελληνικά και кириллица",
    "\u200b\u200c\u200d\ufeff zero width",
    "tab\u00a0nbsp\u2003em\u3000ideographic",
    # digits
    "12345678901234567890",
    "3.14159 2,718 1e-10 0x1F 0b1010",
    "v1.2.3 and 10,000 items at $9.99",
    "a1b2c3 42nd 2024-06-01T12:00:00Z",
    "a  1",
    "x\n\n12",
    # whitespace runs
    " leading space",
    "   three leading",
    "trailing space ",
    "trailing spaces   ",
    "two  spaces   three    four",
    "\ttab\t\ttabs\t",
    "line\nbreak\n\nparagraph\n\n\n",
    "windows\r\nline\r\nends\r\n",
    "\r\r\n\n\r",
    " ",
    "    ",
    "\n",
    # code
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, {"nested": null}], "s": "a\\"b"}',
    "<div class='x'>&amp; &lt;tag&gt;</div>",
    "SELECT * FROM t WHERE id = 3;",
    "    if x:\n\tpass  \n",
    # special tokens inside text
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_end|>",
    " <|im_start|> spaced <|im_end|> ",
    "<|im_start|",
    "<|im_start|><|endoftext|>x",
    "<repo_name>radixkv<file_sep>a.py",
    # apostrophes and contractions
    "don't won't I'm you're they've we'll he'd it's",
    "DON'T I'LL WE'VE",
    "rock 'n' roll ''quoted'' `ticks`",
    "l’apostrophe typographique",
    # misc
    "URL: https://example.com/path?q=1&r=two#frag",
    "email@example.com, @handle, #hashtag",
    "ALLCAPS CamelCase snake_case kebab-case",
    "!!!???...---___***",
    "a" * 200,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "\x00\x01\x7f control",
]


@pytest.fixture(scope="module")
def smollm():
    return resolve_model()


@pytest.fixture(scope="module")
def ours(smollm):
    return Tokenizer.load(smollm)


@pytest.fixture(scope="module")
def ref(smollm):
    return transformers.AutoTokenizer.from_pretrained(str(smollm.path.parent), gguf_file=smollm.path.name)


def test_ids_match_transformers_on_corpus(ours, ref):
    mismatched = [(t, ours.encode(t), ref.encode(t)) for t in CORPUS if ours.encode(t) != ref.encode(t)]
    assert mismatched == []


def test_decode_matches_transformers_and_round_trips(ours, ref):
    for text in CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids) == text == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_add_special_tokens_flag(ours, ref):
    text = "<|im_start|>user\nhi<|im_end|>"
    # SmolLM2's GGUF says add_bos_token = False: nothing is added either way.
    assert ours.encode(text) == ours.encode(text, add_special_tokens=False) == ref.encode(text)
    assert ours.encode(text) == [1, 4093, 198, 6004, 2]


def test_special_tokens_and_ids(ours, ref):
    assert ours.vocab_size == len(ref) == 49152
    assert (ours.bos_token, ours.bos_token_id) == ("<|im_start|>", 1) == (ref.bos_token, ref.bos_token_id)
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2) == (ref.eos_token, ref.eos_token_id)
    assert ours.pad_token_id == ref.pad_token_id == 2
    assert dict(ours.special_tokens_map) == ref.special_tokens_map
    assert ours.special_tokens["<|endoftext|>"] == 0
    assert ours.special_tokens["<|im_start|>"] == 1
    assert len(ours.special_tokens) == 17  # every control token of the GGUF
    assert {t.content: i for i, t in ref.added_tokens_decoder.items()} == dict(ours.special_tokens)
    im_end = ours.token_to_id("<|im_end|>")
    assert im_end in ours.eos_token_ids
    assert ours.eos_token_ids == {2, 0}  # <|im_end|> (eos) and <|endoftext|>
    assert ours.id_to_token(19556) == "Hello" and ours.token_to_id("Ġworld") == 905
    assert ours.id_to_token(10**6) is None and ours.token_to_id("no such token") is None
    assert ours.chat_template == ref.chat_template


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(
            st.text(max_size=12),
            st.sampled_from(["<|im_start|>", "<|im_end|>", " ", "  ", "\n", "\r\n", "7", "'s", "😀"]),
        ),
        max_size=8,
    ).map("".join)
)
def test_ids_match_transformers_on_random_text(ours, ref, text):
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    # Not always `text`: SmolLM2's vocabulary lacks 21 byte tokens (0xF1, 0xF2, ...), so
    # characters of some planes lose bytes, in transformers as here.
    assert ours.decode(ids) == ref.decode(ids)


def _stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_deltas_concatenate_to_decode_on_corpus(ours, skip):
    prompt = ours.encode("<|im_start|>assistant\n")
    for text in CORPUS:
        ids = ours.encode(text)
        full = ours.decode(ids, skip_special_tokens=skip)
        for prompt_ids in (None, prompt):
            deltas = _stream(ours, ids, prompt_ids=prompt_ids, skip_special_tokens=skip)
            assert "".join(deltas) == full
            assert not any("\ufffd" in d for d in deltas)


def test_incremental_holds_back_split_characters(ours):
    ids = ours.encode("👨‍👩‍👧")  # 18 bytes in 11 byte-level tokens
    deltas = _stream(ours, ids)
    assert "".join(deltas) == "👨‍👩‍👧"
    assert [d for d in deltas if d] == ["👨", "\u200d", "👩", "\u200d", "👧"]


def test_incremental_random_ids(ours):
    rng = random.Random(1234)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.randrange(ours.vocab_size) for _ in range(6)]
        for skip in (False, True):
            full = ours.decode(ids, skip_special_tokens=skip)
            for prompt_ids in (None, prompt):
                deltas = _stream(ours, ids, prompt_ids=prompt_ids, skip_special_tokens=skip)
                assert "".join(deltas) == full
                if "\ufffd" not in full:
                    assert not any("\ufffd" in d for d in deltas)


def test_incremental_decodes_only_a_small_window(ours, monkeypatch):
    ids = ours.encode(" ".join(CORPUS) * 4)
    assert len(ids) > 2500
    longest = 0
    decode = ours.decode

    def spy(token_ids, skip_special_tokens=False):
        nonlocal longest
        longest = max(longest, len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(ours, "decode", spy)
    assert "".join(_stream(ours, ids)) == decode(ids)
    assert longest <= 16


# --- HF directories -------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_dir(ref, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    ref.save_pretrained(folder)
    return folder


def test_from_hf_dir_matches_transformers(saved_dir, ours):
    loaded = Tokenizer.from_hf_dir(saved_dir)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(saved_dir))
    for text in CORPUS:
        assert loaded.encode(text) == reloaded.encode(text) == ours.encode(text)
    assert loaded.chat_template == reloaded.chat_template == ours.chat_template
    assert dict(loaded.special_tokens) == dict(ours.special_tokens)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)
    assert loaded.eos_token_ids == ours.eos_token_ids


def test_from_hf_dir_config_flags_and_generation_config(saved_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(saved_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(add_bos_token=True, add_eos_token=True, bos_token="<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    pad = {"content": "<empty_output>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    (folder / "special_tokens_map.json").write_text(json.dumps({"pad_token": pad}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = Tokenizer.from_hf_dir(folder)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in ["Hello world", "", "<|im_start|>x"]:
        assert loaded.encode(text) == reloaded.encode(text)
        assert loaded.encode(text, add_special_tokens=False) == reloaded.encode(text, add_special_tokens=False)
    # tokenizer.json's post-processor wins over the config's add_bos_token/add_eos_token.
    assert loaded.encode("Hi") == [26843]
    assert (loaded.bos_token, loaded.bos_token_id) == ("<|endoftext|>", 0)
    assert loaded.pad_token_id == reloaded.pad_token_id == 16
    assert loaded.eos_token_ids == {0, 2, 5}


def test_chat_template_jinja_file_wins_over_config(saved_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(saved_dir, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_hf_dir(folder).chat_template == "D"
    (folder / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_hf_dir(folder).chat_template == "J"


# --- GGUF files with other pre-tokenizers ---------------------------------------------


def _write_gguf(path, tokens, types, merges, **fields):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in [("context_length", 256), ("embedding_length", 64), ("block_count", 1),
                       ("feed_forward_length", 128), ("attention.head_count", 4),
                       ("attention.head_count_kv", 4)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(f"tokenizer.ggml.{key}", value)
        elif isinstance(value, int):
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
        else:
            writer.add_string(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def small_vocab(smollm):
    """SmolLM2's control tokens, the 256 byte tokens and the first 3000 merges, plus a
    user-defined ``<think>`` and a control token spelled outside the byte alphabet."""
    meta = metadata(smollm.path)
    merges = meta["tokenizer.ggml.merges"][:3000]
    bytes_ = [t for t in meta["tokenizer.ggml.tokens"] if len(t) == 1]
    normal = list(dict.fromkeys([*bytes_, *(m.replace(" ", "") for m in merges)]))
    tokens = meta["tokenizer.ggml.tokens"][:17] + normal + ["<think>", "▁mislabelled"]
    types = [3] * 17 + [1] * len(normal) + [4, 3]
    return tokens, types, merges


def _small_vocab_pair(small_vocab, tmp_path, pre):
    """Ours and transformers' tokenizer of one small GGUF vocabulary with BOS added."""
    tokens, types, merges = small_vocab
    path = _write_gguf(tmp_path / "t.gguf", tokens, types, merges, model="gpt2", pre=pre, bos_token_id=1,
                       eos_token_id=2, add_bos_token=True)
    return Tokenizer.from_gguf(path), transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o", "smollm"])
def test_gguf_pre_tokenizers_match_transformers(small_vocab, tmp_path, pre):
    loaded, reference = _small_vocab_pair(small_vocab, tmp_path, pre)
    texts = [*CORPUS, "<think>reason</think>", "x ▁mislabelled"]
    mismatched = [t for t in texts if loaded.encode(t) != reference.encode(t)]
    assert mismatched == []
    assert loaded.encode("Hi")[0] == 1  # add_bos_token
    assert "<think>" not in loaded.special_tokens and "▁mislabelled" not in loaded.special_tokens
    ids = loaded.encode("<think>a</think>")
    assert loaded.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


# --- SentencePiece ----------------------------------------------------------------------


SPM_WORDS = (
    "the quick brown fox jumps over lazy dog hello world token radix cache prefix tree page pool "
    "model server request batch kernel über café naïve 東京 日本語 emoji 2024 3.14"
).split()


def _train_spm(folder, model_type, **options):
    spm = pytest.importorskip("sentencepiece")
    rng = random.Random(0)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(" ".join(rng.choice(SPM_WORDS) for _ in range(10)) for _ in range(1500)))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), model_type=model_type, vocab_size=400,
        hard_vocab_limit=False, character_coverage=1.0, minloglevel=2, **{"byte_fallback": True, **options},
    )
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))


SPM_CORPUS = [t for t in CORPUS if "<|" not in t] + [
    "<s>hello world</s> again",
    "hi <s> hello",
    "hi<s>  hello",
    "<unk>x",
    "a</s>",
    "x<s> ",
]


@pytest.fixture(scope="module")
def llama_style_spm(tmp_path_factory):
    """A BPE SentencePiece model trained like Llama's: no normalization, spaces kept."""
    folder = tmp_path_factory.mktemp("spm_bpe")
    sp = _train_spm(folder, "bpe", normalization_rule_name="identity", remove_extra_whitespaces=False,
                    split_digits=True, allow_whitespace_only_pieces=True)
    return folder, sp


def test_sentencepiece_bpe_matches_transformers(llama_style_spm):
    pytest.importorskip("google.protobuf")  # transformers needs it to read tokenizer.model
    folder, sp = llama_style_spm
    loaded = Tokenizer.from_hf_dir(folder)
    reference = transformers.LlamaTokenizer.from_pretrained(str(folder))
    for text in SPM_CORPUS:
        ids = loaded.encode(text)
        if text[:1].isspace():
            # Differs on purpose: SentencePiece puts its "▁" prefix before a leading space,
            # transformers' Metaspace does not (and so decodes " x" back to "x").
            assert ids == sp.encode(text)
        else:
            assert ids == reference.encode(text), text
        assert loaded.decode(ids) == reference.decode(ids)
        assert loaded.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert dict(loaded.special_tokens) == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.eos_token_ids) == (1, 2, {2})


def test_sentencepiece_text_round_trips_and_streams(llama_style_spm):
    folder, sp = llama_style_spm
    loaded = Tokenizer.from_hf_dir(folder)
    for text in SPM_CORPUS:
        ids = loaded.encode(text)
        assert loaded.decode(ids) == text
        assert "".join(_stream(loaded, ids)) == text
    # With prompt context the stream keeps the space of a first "▁word" token, which a
    # decode of the generated ids alone drops.
    ids = loaded.encode("hello world")
    assert "".join(_stream(loaded, ids, prompt_ids=loaded.encode("x"))) == " hello world"


def test_sentencepiece_config_flags(llama_style_spm, tmp_path):
    folder, _ = llama_style_spm
    shutil.copy(folder / "tokenizer.model", tmp_path / "tokenizer.model")
    config = {
        "add_bos_token": True, "legacy": True,
        "added_tokens_decoder": {"400": {"content": "<tool>", "special": False},
                                 "401": {"content": "<|eot_id|>", "special": True}},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    sp = loaded._backend._sp
    assert loaded.vocab_size == 402
    assert loaded.encode("a<tool>hello<|eot_id|>") == [1, *sp.encode("a"), 400, *sp.encode("hello"), 401]
    assert loaded.decode([1, *sp.encode("hello"), 400, 401], skip_special_tokens=True) == "hello<tool>"
    assert loaded.eos_token_ids == {2, 401}


def test_sentencepiece_unigram_with_normalization_matches_sentencepiece(tmp_path):
    sp = _train_spm(tmp_path, "unigram")  # default nmt_nfkc normalization, extra spaces removed
    loaded = Tokenizer.from_hf_dir(tmp_path)
    for text in [t for t in SPM_CORPUS if "<" not in t]:
        assert loaded.encode(text) == sp.encode(text), text
        assert loaded.decode(loaded.encode(text)) == sp.decode(sp.encode(text))


def _write_spm_gguf(path, sp, add_space_prefix=None, user_defined=()):
    """``sp``'s vocabulary as llama.cpp's converter writes a SentencePiece model into a
    GGUF (``_create_vocab_sentencepiece``): every piece with its score and type, then
    added tokens as user-defined ones; bos/eos/unk ids; add_space_prefix only when given
    (Gemma's converter writes false)."""
    gguf = pytest.importorskip("gguf")
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 1)  # fmt: skip
    for token in user_defined:
        tokens, scores, types = [*tokens, token], [*scores, -1000.0], [*types, 4]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    for add, token_id in [(w.add_bos_token_id, sp.bos_id()), (w.add_eos_token_id, sp.eos_id()),
                          (w.add_unk_token_id, sp.unk_id())]:  # fmt: skip
        if token_id >= 0:
            add(token_id)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GGUF_SPM_TEXTS = [t for t in CORPUS if "<" not in t] + [
    "  two leading", " ", "\n", "a\n b\n\n c", "x\x00y\x7f", "☃ snowman ⛄", "東京 über naïve", "🦀🦀 crab",
]


def _no_dummy_prefix(sp):
    """``sp`` without its "▁" prefix (an appended NormalizerSpec with add_dummy_prefix false)."""
    spm = pytest.importorskip("sentencepiece")
    return spm.SentencePieceProcessor(model_proto=sp.serialized_model_proto() + b"\x1a\x02\x18\x00")


@pytest.mark.parametrize("add_space_prefix", [None, False], ids=["prefix", "no-prefix"])
def test_gguf_sentencepiece_matches_sentencepiece(llama_style_spm, tmp_path, add_space_prefix):
    """A GGUF 'llama' tokenizer encodes as SentencePiece encodes the same model, id for id
    (spaces, leading spaces, newlines, unicode, bytes no piece covers) and decodes alike;
    with add_space_prefix false (Gemma's files) as SentencePiece without its dummy prefix."""
    _, sp = llama_style_spm
    loaded = Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "spm.gguf", sp, add_space_prefix))
    reference = sp if add_space_prefix is None else _no_dummy_prefix(sp)
    for text in GGUF_SPM_TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert loaded.decode(ids) == reference.decode(ids) == text, text
        assert "".join(_stream(loaded, ids)) == text
    assert any(sp.is_byte(i) for i in loaded.encode("☃", add_special_tokens=False))  # byte fallback was taken
    assert loaded.encode("hi")[0] == sp.bos_id() and loaded.encode("hi")[1:] == reference.encode("hi")  # bos added
    assert dict(loaded.special_tokens) == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.vocab_size) == (1, 2, sp.get_piece_size())


def test_gguf_sentencepiece_runs_after_special_tokens_get_the_prefix_as_in_llama_cpp(llama_style_spm, tmp_path):
    """Control and user-defined tokens are matched whole; llama.cpp then encodes each run
    of text between them on its own, with the "▁" prefix (transformers' Metaspace gives it
    to the first run only): the expected ids are SentencePiece's of each run. Checked once
    against llama.cpp's own tokenizer too (llama-server's /tokenize, 130 strings)."""
    _, sp = llama_style_spm
    loaded = Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "spm.gguf", sp, user_defined=["<tool>"]))
    tool = sp.get_piece_size()
    cases = {
        "<s>hello world</s> again": [1, *sp.encode("hello world"), 2, *sp.encode(" again")],
        "hi<s>  hello": [*sp.encode("hi"), 1, *sp.encode("  hello")],
        "a<tool>b": [*sp.encode("a"), tool, *sp.encode("b")],
        "<tool>": [tool],
    }
    for text, ids in cases.items():
        assert loaded.encode(text, add_special_tokens=False) == ids, text
    assert "<tool>" not in loaded.special_tokens
    assert loaded.encode("<s>", add_special_tokens=False, split_special_tokens=True) == sp.encode("<s>")


def test_gguf_sentencepiece_without_byte_fallback_uses_the_unknown_token(tmp_path):
    sp = _train_spm(tmp_path, "bpe", normalization_rule_name="identity", remove_extra_whitespaces=False,
                    byte_fallback=False)  # fmt: skip
    loaded = Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "spm.gguf", sp))
    for text in ["☃☃ snow ⛄ x", "東京 ☃", "hello"]:
        assert loaded.encode(text, add_special_tokens=False) == sp.encode(text), text
    assert sp.unk_id() in loaded.encode("☃☃", add_special_tokens=False)


# --- errors -----------------------------------------------------------------------------


def test_missing_and_empty_paths_raise_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        Tokenizer.from_hf_dir(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="not found"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")


def test_unreadable_files_raise_model_load_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="SentencePiece"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unsupported_gguf_tokenizers_raise_model_load_error(tmp_path):
    t5_gguf = _write_gguf(tmp_path / "t5.gguf", ["<pad>", "</s>", "▁a"], [3, 3, 1], None, model="t5")
    with pytest.raises(ModelLoadError, match="'t5' is not supported, only 'gpt2' .* and 'llama'"):
        Tokenizer.from_gguf(t5_gguf)
    no_scores = _write_gguf(tmp_path / "spm.gguf", ["<unk>", "<s>", "</s>", "▁a"], [2, 3, 3, 1], None, model="llama")
    with pytest.raises(ModelLoadError, match="SentencePiece tokenizer needs tokenizer.ggml.tokens, .scores"):
        Tokenizer.from_gguf(no_scores)
    no_merges = _write_gguf(tmp_path / "nomerges.gguf", ["a", "b"], [1, 1], None, model="gpt2")
    with pytest.raises(ModelLoadError, match="merges"):
        Tokenizer.from_gguf(no_merges)


def test_encode_rejects_non_text(ours):
    with pytest.raises(TypeError, match="str"):
        ours.encode(b"bytes")


# --- special-token text as plain text ----------------------------------------------------


def test_split_special_tokens_matches_transformers(ours, ref):
    for text in CORPUS:
        ids = ours.encode(text, split_special_tokens=True)
        assert ids == ref.encode(text, split_special_tokens=True), text
        assert ours.decode(ids) == ref.decode(ids)
        if not any(t in text for t in ours.special_tokens):
            assert ids == ours.encode(text)  # nothing to split: the same ids
    ids = ours.encode("hi<|im_end|>\n<|im_start|>system", split_special_tokens=True)
    assert not set(ids) & set(ours.special_tokens.values())
    assert ours.decode(ids) == "hi<|im_end|>\n<|im_start|>system"


def test_encode_literal_splits_only_special_text_inside_the_spans(ours):
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>x<|im_end|>\n"
    assert ours.encode_literal(text, []) == ours.encode(text)
    # the first "<|im_end|>\n<|im_start|>" (inside the content "hi...x") is text
    a = text.index("<|im_end|>")
    b = text.index("<|im_start|>", a)
    spans = [(a, a + len("<|im_end|>")), (b, b + len("<|im_start|>"))]
    cut = len("<|im_start|>")
    head, content, tail = text[:cut], text[cut : text.rindex("<|im_end|>")], "<|im_end|>\n"
    want = ours.encode(head) + ours.encode(content, split_special_tokens=True) + ours.encode(tail)
    assert ours.encode_literal(text, spans) == want
    assert want.count(1) == 1 and want.count(2) == 1
    assert ours.decode(want) == text
    # a span that covers only part of a special token does not split it
    assert ours.encode_literal(text, [(a + 1, a + 4)]) == ours.encode(text)
    assert ours.encode_literal(text, [(0, len(text))]) == ours.encode(text, split_special_tokens=True)


@pytest.mark.parametrize("pre", ["llama-bpe", "smollm"])
def test_split_and_literal_with_bos_and_non_special_added_tokens(small_vocab, tmp_path, pre):
    loaded, reference = _small_vocab_pair(small_vocab, tmp_path, pre)
    for text in [*CORPUS, "<think>a<|im_end|></think>"]:
        split = loaded.encode(text, split_special_tokens=True)
        assert split == reference.encode(text, split_special_tokens=True), text
        assert loaded.encode_literal(text, []) == loaded.encode(text)
        assert loaded.encode_literal(text, [(0, len(text))]) == split
    assert loaded.encode("<think>", split_special_tokens=True) == [1, small_vocab[0].index("<think>")]  # not special


def test_sentencepiece_split_special_tokens_and_literal_spans(llama_style_spm, tmp_path):
    folder, _ = llama_style_spm
    shutil.copy(folder / "tokenizer.model", tmp_path / "tokenizer.model")
    config = {"added_tokens_decoder": {"400": {"content": "<tool>", "special": False},
                                       "401": {"content": "<|eot_id|>", "special": True}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    sp = loaded._backend._sp
    # special text is plain text; a non-special added token still matches (as in transformers)
    assert loaded.encode("a<|eot_id|>b", split_special_tokens=True) == sp.encode("a<|eot_id|>b")
    inner = loaded._backend._sp_inner  # SentencePiece without the dummy prefix: text after an added token
    assert loaded.encode("a<tool><s>", split_special_tokens=True) == [*sp.encode("a"), 400, *inner.encode("<s>")]
    text = "x<|eot_id|>y<|eot_id|>"
    assert loaded.encode_literal(text, [(1, 11)]) == [*sp.encode("x<|eot_id|>y"), 401]
    assert loaded.encode_literal(text, []) == loaded.encode(text)
