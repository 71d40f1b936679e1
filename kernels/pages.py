"""Loops over page ids for the page allocator and the radix tree: ``pages.c`` compiled,
or its numpy twin here.

Three operations on int32 arrays, each checking its whole input before it writes and
returning a status (a negative code; see ``pages.c``) instead of raising, so the caller
words the error:

    fill(arr, ids, value)            arr[ids] = value
    hold(held, refs, ids, owned)     mark ids held (nonzero); each unheld, listed once,
                                     and with owned, referenced (refs > 0)
    free_sole(refs, stack, top, ids) counts 1 -> 0, ids pushed on stack[top:] so that
                                     ids[0] ends on top; returns the new top

``native()`` is the compiled module (built by ``radixkv.kernels.build`` on first use),
or this numpy twin when there is no C compiler, the build fails, or
``RADIXKV_NATIVE_PAGES=0``. The two have one contract and the tests run both; the
compiled one does in one pass what numpy does in four to six calls (it makes the whole
per-request KV lifecycle about 40% cheaper at page size 1).
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig
import threading
import types
from pathlib import Path

import numpy as np

from radixkv.kernels import build

SOURCE = Path(__file__).with_name("pages.c")
# pages.c's status codes (its enum), which both implementations return
OUT_OF_RANGE, HELD, TWICE, NOT_OWNED, NOT_SOLE, NO_ROOM = -1, -2, -3, -4, -5, -6
_MARKS = np.arange(1, 1 << 16, dtype=np.int32)


class NumpyPages:
    """``pages.c``'s contract in numpy (the fallback, and the reference in tests)."""

    name = "numpy"

    @staticmethod
    def fill(arr: np.ndarray, ids: np.ndarray, value: int) -> int:
        if ids.size and int(ids.view(np.uint32).max()) >= arr.size:
            return OUT_OF_RANGE
        arr.put(ids, value)
        return 0

    @staticmethod
    def hold(held: np.ndarray, refs: np.ndarray, ids: np.ndarray, owned: bool) -> int:
        if not ids.size:
            return 0
        try:
            was = held.take(ids.view(np.uint32))  # read as unsigned, a negative id is out of range too
            counts = refs.take(ids.view(np.uint32)) if owned else None
        except IndexError:
            return OUT_OF_RANGE
        if np.count_nonzero(was):
            return HELD
        if owned and np.count_nonzero(counts) != ids.size:
            return NOT_OWNED
        # Marks 1..n in list order: an id listed twice reads back its last entry's mark.
        marks = _MARKS[: ids.size] if ids.size <= _MARKS.size else np.arange(1, ids.size + 1, dtype=np.int32)
        held.put(ids, marks)
        if held.take(ids).tobytes() != marks.tobytes():
            held.put(ids, 0)
            return TWICE
        return 0

    @staticmethod
    def free_sole(refs: np.ndarray, stack: np.ndarray, top: int, ids: np.ndarray) -> int:
        if top < 0 or top + ids.size > stack.size:
            return NO_ROOM
        try:
            counts = refs.take(ids.view(np.uint32))
        except IndexError:
            return OUT_OF_RANGE
        if np.count_nonzero(counts != 1):
            return NOT_SOLE
        if ids.size > 1:
            ordered = ids.copy()
            ordered.sort()
            if np.count_nonzero(ordered[1:] == ordered[:-1]):
                return TWICE
        refs.put(ids, 0)
        stack[top : top + ids.size] = ids[::-1]
        return top + ids.size


_lock = threading.Lock()
_native: object = None


def native():
    """The compiled module, else ``NumpyPages`` (see the module docstring)."""
    global _native
    with _lock:
        if _native is None:
            _native = NumpyPages
            if os.environ.get("RADIXKV_NATIVE_PAGES", "1") != "0":
                try:
                    _native = _load()
                except (ImportError, OSError):
                    pass
        return _native


def _load() -> types.ModuleType:
    include = sysconfig.get_paths()["include"]
    abi = sysconfig.get_config_var("EXT_SUFFIX") or ""
    path = build.build("pages", SOURCE, ("-O2", "-fPIC", "-shared", f"-I{include}"), depends_on=(include, abi))
    spec = importlib.util.spec_from_file_location("_radixkv_pages", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.name = "c"
    return module
