"""The embedded SmolLM2 model against HF transformers loading the same GGUF file."""

import os

import numpy as np
import pytest
import torch

from benchmarks.common import FIDELITY_CHATS as CHATS
from radixkv.cache import KVPool, PoolConfig
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.model import load_model, load_state_dict, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")



@pytest.fixture(scope="module")
def source():
    return resolve_model()


@pytest.fixture(scope="module")
def hf(source):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source.path.parent, gguf_file=source.path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_tok(source):
    return transformers.AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)


@pytest.fixture(scope="module")
def model():
    return load_model()


def new_pool(model, num_pages=256, page_size=4, kv_dtype="fp32"):
    c = model.config
    return KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, page_size, kv_dtype=kv_dtype, num_pages=num_pages))


def test_weights_equal_transformers_tensor_by_tensor(source, hf):
    config, ours = load_state_dict(source)
    theirs = hf.state_dict()
    assert config.tie_word_embeddings and "lm_head.weight" not in ours
    assert set(theirs) == set(ours) | {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_logits_match_transformers_and_do_not_depend_on_batching(model, hf, hf_tok):
    texts = ["The capital of France is Paris, and the capital of Italy is", "def fib(n):\n    return", "Hi"]
    ids = [hf_tok(t).input_ids for t in texts]
    with torch.no_grad():
        ref = [hf(torch.tensor([t])).logits[0] for t in ids]
    pool = new_pool(model)
    tables = [pool.alloc(-(-len(t) // 4)) for t in ids]
    # Sequence 0's first 9 tokens go in first (a cached prefix), then a batch mixes its
    # extension with two sequences that have no cache.
    first = model.forward(ForwardBatch.build([SeqInput(ids[0][:9], 0, tables[0])], 4), pool, all_logits=True)
    batch = [SeqInput(ids[0][9:], 9, tables[0]), SeqInput(ids[1], 0, tables[1]), SeqInput(ids[2], 0, tables[2])]
    mixed = model.forward(ForwardBatch.build(batch, 4), pool, all_logits=True)
    ours = [torch.cat([first, mixed[: len(ids[0]) - 9]]), mixed[len(ids[0]) - 9 : -1], mixed[-1:]]
    for mine, theirs in zip(ours, ref):
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max() < 1e-4
    last = model.forward(ForwardBatch.build(batch, 4), pool)  # rewrites the same K/V: idempotent
    assert last.shape == (3, model.config.vocab_size)
    for row, theirs in zip(last, ref):
        assert (row - theirs[-1]).abs().max() < 1e-4
    alone = model.forward(ForwardBatch.build([SeqInput(ids[1], 0, tables[1])], 4), new_pool(model))
    assert (last[1] - alone[0]).abs().max() < 1e-4
    pool.decref(np.concatenate(tables))
    pool.check_integrity()


def greedy(model, prompts, steps, page_size=4):
    """Greedy decoding through the paged pool: one prefill batch, then batched decode."""
    pool = new_pool(model, num_pages=2048, page_size=page_size)
    tables = [pool.alloc(-(-(len(p) + steps) // page_size)) for p in prompts]
    logits = model.forward(ForwardBatch.build([SeqInput(p, 0, t) for p, t in zip(prompts, tables)], page_size), pool)
    outs = [[int(x)] for x in logits.argmax(-1)]
    for _ in range(steps - 1):
        seqs = [SeqInput([o[-1]], len(p) + len(o) - 1, t) for p, o, t in zip(prompts, outs, tables)]
        logits = model.forward(ForwardBatch.build(seqs, page_size), pool)
        for o, x in zip(outs, logits.argmax(-1)):
            o.append(int(x))
    pool.decref(np.concatenate(tables))
    pool.check_integrity()
    return outs


def test_greedy_32_tokens_token_exact_with_transformers(model, hf, hf_tok):
    prompts = [hf_tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in CHATS]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    ours = greedy(model, prompts, 32)
    for prompt, mine in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=2)
        theirs = out[0, len(prompt) :].tolist()
        assert mine[: len(theirs)] == theirs  # transformers stops early at an end-of-turn token
        assert len(theirs) == 32 or theirs[-1] in (2, hf_tok.convert_tokens_to_ids("<|im_end|>"))


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_is_the_same_for_any_page_size(model, hf_tok, page_size):
    prompts = [hf_tok(t).input_ids for t in ("Hello, my name is", "1, 2, 3, 4,")]
    assert greedy(model, prompts, 8, page_size) == greedy(model, prompts, 8, 4)


def test_half_precision_runs_close_to_float32(model, hf_tok):
    ids = hf_tok("The quick brown fox jumps over the").input_ids
    bf16 = load_model(dtype="bfloat16")
    assert bf16.embed.dtype == torch.bfloat16
    pool = new_pool(bf16, num_pages=64, kv_dtype="bf16")
    table = pool.alloc(-(-len(ids) // 4))
    low = bf16.forward(ForwardBatch.build([SeqInput(ids, 0, table)], 4), pool)[0]
    high = model.forward(ForwardBatch.build([SeqInput(ids, 0, table)], 4), new_pool(model))[0]
    assert torch.isfinite(low).all()
    assert torch.nn.functional.cosine_similarity(low, high, dim=0) > 0.99


def test_triton_backend_runs_the_real_model_like_torch(model, hf_tok):
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # compiled Triton takes CUDA tensors only; tests/test_gpu.py runs it there
        pytest.skip("this model is on the CPU, where Triton runs only in its interpreter (no CUDA)")
    from radixkv.kernels import get_backend

    ids = hf_tok("The three primary colors are").input_ids
    results = {}
    for name in ("torch", "triton"):
        backend = get_backend(name)
        pool = new_pool(model)
        table = pool.alloc(-(-(len(ids) + 2) // 4))
        first = model.forward(ForwardBatch.build([SeqInput(ids, 0, table)], 4), pool, backend)
        token = int(first.argmax(-1))
        second = model.forward(ForwardBatch.build([SeqInput([token], len(ids), table)], 4), pool, backend)
        results[name] = (first, second)
    for a, b in zip(results["torch"], results["triton"]):
        assert (a - b).abs().max() < 1e-4
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_rope_takes_the_given_positions_not_the_kv_index(model, hf_tok):
    """Two new tokens at positions (10, 11) instead of (0, 1) give the same logits (RoPE
    depends on the distance only); at (0, 5) different ones: the positions reach RoPE
    while the K/V go to KV entries 0 and 1 either way."""
    ids = hf_tok("The sea").input_ids[:2]

    def logits(positions):
        pool = new_pool(model)
        table = pool.alloc(1)
        out = model.forward(ForwardBatch.build([SeqInput(ids, 0, table, positions)], 4), pool, all_logits=True)
        pool.decref(table)
        return out

    base = logits(None)
    assert (logits([10, 11]) - base).abs().max() < 1e-3
    assert (logits([0, 5])[1] - base[1]).abs().max() > 1e-2


def test_kv_format_apart_from_the_weights(model, hf_tok):
    """float32 weights over a bf16 KV pool: the pool holds bf16 (half the bytes per page),
    the logits move by bf16 rounding of the cached K/V only, and a decode step reading
    that cache back agrees with one reading an fp32 cache on the next token."""
    ids = hf_tok("The capital of France is Paris, and the capital of Italy is").input_ids
    out = {}
    for kv_dtype in ("fp32", "bf16"):
        pool = new_pool(model, kv_dtype=kv_dtype)
        table = pool.alloc(-(-(len(ids) + 1) // 4))
        first = model.forward(ForwardBatch.build([SeqInput(ids, 0, table)], 4), pool)
        nxt = int(first.argmax(-1))
        second = model.forward(ForwardBatch.build([SeqInput([nxt], len(ids), table)], 4), pool)
        out[kv_dtype] = (first, second, pool)
    pool32, pool16 = out["fp32"][2], out["bf16"][2]
    assert pool16.k[0].dtype == torch.bfloat16 and 2 * pool16.config.bytes_per_page == pool32.config.bytes_per_page
    assert torch.equal(pool16.k[0], pool32.k[0].to(torch.bfloat16))  # layer 0: the same K, rounded when stored
    for a, b in zip(out["fp32"][:2], out["bf16"][:2]):
        assert not torch.equal(a, b)  # the format took effect
        assert int(a.argmax(-1)) == int(b.argmax(-1)) and (a - b).abs().max() < 0.5
