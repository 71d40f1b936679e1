"""The engine on a CUDA GPU with each attention backend, against HF transformers on the
same GPU. Skipped without CUDA (CI has none); run when a GPU is lent.

- float32 (the exact mode): greedy tokens of the torch and triton backends equal
  transformers' on the fidelity chats, batched and from the prefix cache alike.
- bfloat16: FlashInfer reads only half-precision KV, so backends are compared there:
  each one's last-token logits close to the float32 model's (cosine), and the pool
  consistent after.
- native weights (the GGUF's blocks, Triton products): logits against the expanded
  model's, greedy tokens against transformers', the same tokens from the prefix cache.
- int8 and int4 KV through Triton: exact within their format (cache, batch).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from benchmarks.common import FIDELITY_CHATS as CHATS  # noqa: E402
from benchmarks.common import agreement  # noqa: E402
from radixkv.engine.engine import Engine  # noqa: E402
from radixkv.engine.sampling import SamplingParams  # noqa: E402
from radixkv.model import resolve_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

STEPS = 32


def half_backends():
    names = ["torch", "triton"]
    try:
        import flashinfer  # noqa: F401

        names.append("flashinfer")
    except ImportError:
        pass
    return names


@pytest.fixture(scope="module")
def prompts():
    with Engine(kv_cache_tokens=256) as e:  # on the CPU: only its tokenizer and template
        return [e.tokenizer.encode(e.render_chat(c)) for c in CHATS]


@pytest.fixture(scope="module")
def reference(prompts):
    """transformers' greedy tokens on the GPU in float32 (it stops at end of turn)."""
    src = resolve_model()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        src.path.parent, gguf_file=src.path.name, dtype=torch.float32
    ).to("cuda").eval()  # fmt: skip
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=STEPS, do_sample=False, pad_token_id=2)
            outs.append(out[0, len(p) :].tolist())
    del hf
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_float32_greedy_equals_transformers_on_the_gpu(backend, prompts, reference):
    greedy = SamplingParams(temperature=0, max_new_tokens=STEPS)
    with Engine(device="cuda", dtype="float32", attention_backend=backend, kv_cache_tokens=8192) as e:
        assert e.backend.name == backend and e.pool.k[0].is_cuda
        first = e.generate(prompts, greedy)
        again = e.generate(prompts, greedy)  # every prompt now comes from the prefix cache
        e.check_integrity()
    assert [o.error for o in first + again] == [None] * 2 * len(prompts)
    batched = [o.token_ids for o in first]
    assert batched == reference
    assert [o.token_ids for o in again] == reference
    assert all(o.cached_tokens > 0 for o in again)


@pytest.mark.parametrize("backend", half_backends())
def test_bfloat16_backends_stay_close_to_float32(backend, prompts):
    from radixkv.cache import KVPool, PoolConfig
    from radixkv.model.batch import ForwardBatch, SeqInput
    from radixkv.kernels import get_backend
    from radixkv.model import load_model

    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(dtype=dtype, device="cuda")
        c = model.config
        pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, kv_dtype=dtype, device="cuda", num_pages=512))
        impl = get_backend("torch" if dtype == torch.float32 else backend)
        tables = [pool.alloc(-(-(len(p) + 1) // 16)) for p in prompts]
        first = model.forward(ForwardBatch.build([SeqInput(p, 0, t) for p, t in zip(prompts, tables)], 16, "cuda"), pool, impl)
        nxt = first.argmax(-1).tolist() if dtype == torch.float32 else logits[torch.float32][2]
        seqs = [SeqInput([n], len(p), t) for n, p, t in zip(nxt, prompts, tables)]
        second = model.forward(ForwardBatch.build(seqs, 16, "cuda"), pool, impl)  # a decode step
        logits[dtype] = (first, second, nxt)
        for t in tables:
            pool.decref(t)
        pool.check_integrity()
    for hi, lo in zip(logits[torch.float32][:2], logits[torch.bfloat16][:2]):
        assert torch.isfinite(lo).all()
        assert torch.nn.functional.cosine_similarity(hi, lo, dim=-1).min() > 0.99


def test_native_weights_on_the_gpu_compute_the_dequantized_product():
    """The packed model on CUDA (Triton products on the GGUF blocks, never expanded)
    against the expanded model on the same GPU: in float32 the same function up to
    summation order; in bfloat16 close; the packed matrices take under 40% of the bytes."""
    from radixkv.cache import KVPool, PoolConfig
    from radixkv.kernels import get_backend
    from radixkv.model import load_model
    from radixkv.model.batch import ForwardBatch, SeqInput

    with Engine(kv_cache_tokens=256) as cpu:
        prompt = cpu.tokenizer.encode(cpu.render_chat(CHATS[0]))
    dense = load_model(dtype=torch.float32, device="cuda")
    first = {}
    for name, model in [("dense", dense), ("native32", load_model(dtype=torch.float32, device="cuda", native=True)),
                        ("native16", load_model(dtype=torch.bfloat16, device="cuda", native=True))]:  # fmt: skip
        c = model.config
        kv = model.dtype
        pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, 16, kv_dtype=kv, device="cuda", num_pages=64))
        table = pool.alloc(-(-len(prompt) // 16))
        first[name] = model.forward(ForwardBatch.build([SeqInput(prompt, 0, table)], 16, "cuda"), pool,
                                    get_backend("triton"), all_logits=True)  # fmt: skip
        pool.decref(table)
        pool.check_integrity()
        if name != "dense":
            summary = model.weights_summary()
            assert summary["mode"] == "native" and summary["bytes"] < dense.weights_summary()["bytes"] / 2.5
    ref = first["dense"]
    rel32 = ((first["native32"] - ref).norm() / ref.norm()).item()
    assert rel32 < 1e-4, rel32
    assert torch.isfinite(first["native16"]).all()
    assert torch.nn.functional.cosine_similarity(first["native16"], ref, dim=-1).min() > 0.99
    assert (first["native32"].argmax(-1) == ref.argmax(-1)).float().mean() > 0.98


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_weights_greedy_on_the_gpu(dtype, prompts, reference):
    """Engine with native weights on CUDA: served from the prefix cache the same tokens;
    float32 greedy agrees with transformers' float32 (printed; the summation order differs
    from cuBLAS, so ties may turn)."""
    greedy = SamplingParams(temperature=0, max_new_tokens=STEPS)
    with Engine(device="cuda", dtype=dtype, weights="native", attention_backend="triton", kv_cache_tokens=8192) as e:
        assert e.stats()["weights"]["mode"] == "native"
        first = e.generate(prompts, greedy)
        again = e.generate(prompts, greedy)
        e.check_integrity()
    assert [o.error for o in first + again] == [None] * 2 * len(prompts)
    outs = [o.token_ids for o in first]
    agree, total = sum(map(agreement, outs, reference)), sum(len(r) for r in reference)
    print(f"native {dtype} on {torch.cuda.get_device_name()}: {agree}/{total} tokens agree with transformers float32")
    assert all(o.cached_tokens > 0 for o in again)
    if dtype == "float32":
        assert agree >= 0.9 * total
        assert [o.token_ids for o in again] == outs


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_kv_on_the_gpu_is_exact_within_its_format(kv_dtype, prompts, reference):
    """Triton over int8 / int4 pages in the engine on CUDA: from the prefix cache and alone
    the same greedy tokens as batched without a cache; close to the float32 cache."""
    greedy = SamplingParams(temperature=0, max_new_tokens=STEPS)
    settings = dict(device="cuda", dtype="float32", kv_dtype=kv_dtype, attention_backend="triton", kv_cache_tokens=8192)
    with Engine(**settings, enable_prefix_cache=False) as cold:
        batched = [o.token_ids for o in cold.generate(prompts, greedy)]
        alone = [cold.generate(p, greedy).token_ids for p in prompts[:2]]
        cold.check_integrity()
    with Engine(**settings) as warm:
        warm.generate(prompts, greedy)
        cached = warm.generate(prompts, greedy)
        warm.check_integrity()
    assert alone == batched[:2]
    assert all(o.cached_tokens > 0 for o in cached)
    assert [o.token_ids for o in cached] == batched
    agree, total = sum(map(agreement, batched, reference)), sum(len(r) for r in reference)
    print(f"{kv_dtype} KV on {torch.cuda.get_device_name()}: {agree}/{total} tokens agree with float32 (transformers)")
    assert agree >= (0.5 if kv_dtype == "int8" else 0.25) * total
