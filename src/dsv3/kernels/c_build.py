"""Building and loading the kernels' C libraries: compiled with the system C compiler at first use, cached
under a name that hashes the source and the flags, and refused when the library's calling interface (its
ABI number) is not the one the Python side declares. Every C library of ``dsv3.kernels`` loads through
``load``, so each one fails the same way: ``(None, why)``, and the PyTorch references run instead."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-shared")


def cache_dir() -> Path:
    return Path(os.environ.get("DSV3_CACHE", Path.home() / ".cache" / "dsv3")) / "kernels"


def cpu_supported() -> str | None:
    """None when this CPU runs the kernels, else why not."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"needs x86-64 Linux, this is {platform.system()} {platform.machine()}"
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "cannot read the CPU flags from /proc/cpuinfo"
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags.split()]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def library_path(source: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Where the build of ``source`` with these flags is cached: named by a hash of the source, the headers it
    includes from its own folder (``#include "int_groups.h"``) and the flags."""
    text = source.read_bytes()
    headers = [source.with_name(name.decode()) for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.M)]
    text += b"".join(h.read_bytes() for h in headers if h.is_file())
    digest = hashlib.sha256(text + " ".join(FLAGS + extra_flags).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{digest}.so"


def build(target: Path, source: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile ``source`` into ``target`` atomically (a concurrent build or a killed one never leaves a
    half-written library under the final name). ``extra_flags``: a library's own (``-mf16c``), or the
    variants benchmarks and tests build (``-DDSV3_BLOCK_PROFILE``, another ABI number)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, *extra_flags, str(source), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def abi_mismatch(lib: ctypes.CDLL, symbol: str, abi: int) -> str | None:
    """Why a loaded library's calling interface is not ``abi`` (what its ``symbol`` function returns), or
    None. A library of another interface would be handed arguments it reads otherwise (a stale build under
    the cached name, a library copied from another version): it is refused."""
    try:
        fn = getattr(lib, symbol)
    except AttributeError:
        return f"it has no {symbol} (a build older than ABI {abi})"
    fn.argtypes, fn.restype = [], ctypes.c_int64
    got = fn()
    return None if got == abi else f"its ABI is {got}, this dsv3 calls ABI {abi}"


def load(source: Path, abi_symbol: str, abi: int, declare: Callable[[ctypes.CDLL], ctypes.CDLL], what: str,
         extra_flags: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, str]:
    """(the library with its functions declared, "ok"), or (None, why not): disabled by
    ``DSV3_DECODE_KERNELS=0``, a CPU without AVX2/FMA/F16C, no compiler, a failed build, another ABI."""
    if os.environ.get("DSV3_DECODE_KERNELS", "1") == "0":
        return None, "disabled by DSV3_DECODE_KERNELS=0"
    reason = cpu_supported()
    if reason:
        return None, reason
    target = library_path(source, extra_flags)
    try:
        if not target.exists():
            build(target, source, extra_flags)
        lib = ctypes.CDLL(str(target))
        mismatch = abi_mismatch(lib, abi_symbol, abi)
        if mismatch:
            return None, f"refused {target.name}: {mismatch}"
        return declare(lib), "ok"
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"{what} could not be built or loaded: {exc}"
