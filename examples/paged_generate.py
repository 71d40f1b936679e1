"""Greedy generation with the model layer: tokenizer, chat template, paged KV pool, forward.

The Engine (continuous batching, the prefix cache in the loop, sampling) builds on exactly
these pieces. Run: .venv/bin/python examples/paged_generate.py
"""

from radixkv.cache import KVPool, PoolConfig
from radixkv.model.batch import ForwardBatch, SeqInput
from radixkv.model import load_model, resolve_model
from radixkv.model.tokenizer import Tokenizer, IncrementalDetokenizer
from radixkv.model.chat_template import ChatTemplate

source = resolve_model("smollm2-135m-instruct")   # or a .gguf path, or an HF directory
model = load_model(source.path, dtype="float32")
tok = Tokenizer.load(source)
template = ChatTemplate.from_tokenizer(tok)
# the template's markers as special tokens, message text as text (markers written in it stay text)
prompt = template.encode(tok, [{"role": "user", "content": "Name a color."}], add_generation_prompt=True)

c = model.config
pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, page_size=16, num_pages=64))
table = pool.alloc(8)                                     # room for 128 tokens
detok = IncrementalDetokenizer(tok)
logits = model.forward(ForwardBatch.build([SeqInput(prompt, 0, table)], 16), pool)
pos = len(prompt)
for _ in range(20):
    token = int(logits.argmax(-1))
    if token in tok.eos_token_ids:
        break
    print(detok.add(token), end="", flush=True)
    logits = model.forward(ForwardBatch.build([SeqInput([token], pos, table)], 16), pool)
    pos += 1
print(detok.flush())
pool.check_integrity()
pool.decref(table)
