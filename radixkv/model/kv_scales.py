"""Scale files for the fp8 KV formats, measured on text the user chooses.

An fp8 KV cache stores ``x / scale`` with one scale per (layer, KV head) for K and one
for V, read from a file when the engine starts (``--kv-scales``, ``load_kv_scales``);
nothing computes scales on the fly. This module writes such a file: it prefills the
given tokens through a full-precision pool in chunks, as the engine would, and takes
each (layer, KV head)'s largest magnitude of K and of V over every token, so that the
largest value seen maps to the format's largest finite value divided by ``headroom``:

    scale = max |x| * headroom / finfo(fp8).max      (>= 2**-20, so a silent head works)

``radixkv kv-scales --text FILE --out scales.json`` runs it on a text file.
"""

from __future__ import annotations

import torch

from radixkv.cache.formats import KVFormat, kv_format
from radixkv.cache.pool import KVPool, PoolConfig
from radixkv.kernels import get_backend
from radixkv.model.batch import ForwardBatch, SeqInput

_PAGE, _CHUNK, _FLOOR = 16, 512, 2.0**-20


def calibrate(model, ids: list[int], kv_dtype: str | KVFormat = "fp8_e4m3", headroom: float = 1.0) -> dict:
    """The scale file's content (JSON-ready) for ``model`` on ``ids``: ``format``,
    ``k_scale`` and ``v_scale`` (``[num_layers][num_kv_heads]``), ``tokens``. Raises
    ValueError for a format without head scales, fewer than 16 tokens, or a headroom
    below 1."""
    fmt = kv_format(kv_dtype)
    if not fmt.head_scaled:
        raise ValueError(f"kv_dtype {fmt.name} takes no scale file; the fp8 formats do")
    if len(ids) < _PAGE:
        raise ValueError(f"calibration needs at least {_PAGE} tokens, got {len(ids)}")
    if not headroom >= 1.0:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    c = model.config
    pages = -(-len(ids) // _PAGE)
    pool = KVPool(PoolConfig(c.num_layers, c.num_kv_heads, c.head_dim, _PAGE, kv_dtype="fp32", num_pages=pages))
    table = pool.alloc(pages)
    backend = get_backend("torch")
    with torch.inference_mode():
        for start in range(0, len(ids), _CHUNK):
            batch = ForwardBatch.build([SeqInput(ids[start : start + _CHUNK], start, table)], _PAGE, "cpu")
            model.forward(batch, pool, backend)
        slots = pool.slots(table, 0, len(ids))
        amax = {"k": [], "v": []}
        for layer in range(c.num_layers):
            k, v = pool.read_kv(layer, slots)  # [T, H, D]
            amax["k"].append(k.abs().amax(dim=(0, 2)))
            amax["v"].append(v.abs().amax(dim=(0, 2)))
    top = torch.finfo(fmt.dtype).max
    scale = {part: (torch.stack(rows) * headroom / top).clamp_min(_FLOOR) for part, rows in amax.items()}
    return {"format": fmt.name, "k_scale": scale["k"].tolist(), "v_scale": scale["v"].tolist(), "tokens": len(ids),
            "headroom": headroom}  # fmt: skip
