"""What every benchmark writes next to its figures."""

from __future__ import annotations

import json
import os
import platform
from datetime import date
from pathlib import Path


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
