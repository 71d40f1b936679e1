"""What every benchmark writes next to its figures."""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import torch


def write_result(path: str | Path, rows, **meta) -> None:
    """Write ``{"meta": {date, machine, **meta}, "rows": rows}`` as JSON and say where."""
    info = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        **meta,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": info, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


@torch.inference_mode()
def transformers_decode_seconds(model, prompts: list[list[int]], steps: int) -> float:
    """Seconds transformers' batched greedy loop takes for ``steps`` one-token steps
    after an untimed prefill of ``prompts`` (all the same length: no padding)."""
    out = model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)
    cache, tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(tokens, past_key_values=cache, use_cache=True)
        cache, tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t0
