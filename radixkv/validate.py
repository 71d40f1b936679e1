"""Checks of caller-given values, shared by every layer. Each failure is a
``FieldError`` naming the field and the allowed range."""

from __future__ import annotations

from radixkv.errors import FieldError


def is_int(v: object) -> bool:
    """An int that is not a bool (``True`` is an int to Python, never to a caller)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_int(name: str, v: object, lo: int, hi: int | None = None) -> int:
    """``v`` when it is an int in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
    if not is_int(v):
        raise FieldError(name, f"{name} must be an int {rng}, got {v!r} ({type(v).__name__})")
    if v < lo or (hi is not None and v > hi):
        raise FieldError(name, f"{name} must be {'in ' if hi is not None else ''}{rng}, got {v}")
    return v


def check_optional_int(name: str, v: object, lo: int, hi: int | None = None) -> int | None:
    """``check_int`` that also lets None through."""
    if v is None:
        return None
    if not is_int(v):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise FieldError(name, f"{name} must be an int {rng} or None, got {v!r} ({type(v).__name__})")
    return check_int(name, v, lo, hi)


def check_float(name: str, v: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``v`` as a float when it is a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if not is_number(v):
        raise FieldError(name, f"{name} must be a number in {rng}, got {v!r} ({type(v).__name__})")
    f = float(v)
    ok = (lo < f if lo_open else lo <= f) and f <= hi  # False for NaN
    if not ok:
        raise FieldError(name, f"{name} must be in {rng}, got {v}")
    return f


def check_bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise FieldError(name, f"{name} must be a bool (True or False), got {v!r} ({type(v).__name__})")
    return v


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, without floats (pages for ``a`` tokens of ``b`` each)."""
    return -(-a // b)


def token_list(ids: object) -> list[int]:
    """Token ids from a list/tuple/array('i')/NumPy array/1-D tensor, as Python ints."""
    if hasattr(ids, "reshape") and hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # tensor, NumPy
        return [int(t) for t in ids.reshape(-1).tolist()]
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # array('i')
        return [int(t) for t in ids.tolist()]
    return [int(t) for t in ids]  # type: ignore[union-attr]
