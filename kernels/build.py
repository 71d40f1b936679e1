"""Compile a C source of this package once and cache the shared object.

Used by the CPU attention kernel (``cpu_decode.c``, loaded with ctypes) and by the
page-array loops (``pages.c``, a CPython extension). The system C compiler (``$CC``,
else ``cc``, ``gcc``, ``clang``) builds into ``$RADIXKV_CACHE_DIR`` (default
``~/.cache/radixkv``); the file is named by a hash of the source, the compiler's
version, the flags and whatever else the caller says the binary depends on (the CPU for
``-march=native``, the Python ABI for an extension), so later processes load it
without compiling and a change to any of them builds anew. Concurrent builders each
install a whole file (write to a temporary name, then an atomic rename).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("RADIXKV_CACHE_DIR") or Path.home() / ".cache" / "radixkv")


def compiler() -> str:
    """The C compiler's path; ImportError when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise ImportError("radixkv's C code needs a C compiler (set CC, or install gcc)")


def cpu_id() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


ARCH_ENV = "RADIXKV_MARCH"  # what -march=native becomes in every build (default: native)


def arch_flag() -> str:
    """The ``-march`` the kernels build with: ``$RADIXKV_MARCH`` (a GCC/Clang CPU name such
    as ``x86-64-v3``: AVX2, FMA and F16C, no AVX-512), else ``native``. One value across
    machines builds them the same vector code paths (the decode kernel's sums differ
    between AVX-512 and AVX2 builds), and lets an AVX-512 machine run the AVX2 kernels.
    ValueError for a value that is not a CPU name."""
    value = os.environ.get(ARCH_ENV) or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", value):
        raise ValueError(f"{ARCH_ENV} must be a compiler CPU name such as native or x86-64-v3, got {value!r}")
    return f"-march={value}"


def local_includes(source: Path) -> list[Path]:
    """The headers beside ``source`` that it includes (``#include "NAME"``): part of
    what a build depends on (one that is missing fails the build, with the compiler's
    message)."""
    names = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', source.read_bytes(), re.M)
    return [h for h in (source.parent / n.decode() for n in names) if h.is_file()]


def build(name: str, source: Path, flags: tuple[str, ...], depends_on: tuple[str, ...] = (),
          libs: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """The shared object ``NAME-HASH.so`` compiled from ``source`` with ``flags`` (built
    now unless cached; keyed by the source and its local includes too; ``-march=native``
    becomes ``arch_flag()``). Raises ImportError without a compiler or when the build fails (leaving no
    partial file); OSError for an unwritable cache directory."""
    cc = compiler()
    flags = tuple(arch_flag() if f == "-march=native" else f for f in flags)  # $RADIXKV_MARCH
    text = source.read_bytes() + b"".join(h.read_bytes() for h in local_includes(source))
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except subprocess.SubprocessError as e:
        raise ImportError(f"cannot run the C compiler {cc}: {e}") from e
    parts = [text, version.encode(), " ".join(flags).encode(), platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts + [d.encode() for d in depends_on])).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, str(source), *libs], capture_output=True, text=True)
            if done.returncode != 0:
                raise ImportError(f"building {source.name} failed:\n{done.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target
