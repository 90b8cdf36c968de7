"""CPU kernels MindSpore loads as `ops.Custom(func_type="aot")` operators, built here on first use.

Each kernel is a C++ file next to this module (the headers beside it are shared). `build_kernel(name, func)`
compiles it once per (source and headers, compiler, flags, CPU) into `<cache>/kernels/<name>-<digest>.so`
(<cache> is $LLM_SERVING_CACHE or ~/.cache/llm-serving) and returns the "path.so:func" string `ops.Custom`
takes. `-march=native` is safe because the CPU's identity is part of the digest. The build goes to a temporary file that is renamed into
place, so agents starting together never load a half-written library, and it holds the directory's lock (an
flock on the directory itself: no file left behind, dropped when its holder dies), so processes that need the same
library together (TP ranks, a test run's workers and servers) wait for one build (about a minute on 2 cores for
decoder_layer_cpu.cc) instead of each compiling it at once. A kernel whose parameters are declared
by name (signatures.py) is checked against the lists its library exports (its parameters, its iconfig's entries)
before it is used: a `KernelSignatureError` names the first difference.

$LLM_SERVING_KERNEL_MARCH (for example `x86-64-v3` or `znver3`: AVX2 without AVX-512) replaces `native` in
`-march=`: a machine with AVX-512 then builds, runs and measures the AVX2 paths (16 vector registers, no EVEX
encodings), as an AVX2-only CPU runs them. The value is part of the digest.

Flags: -O3 plus the floating-point relaxations that let the compiler vectorise the dot products
(reassociation, no errno, no signed zeros, no traps), but not -ffast-math: linking a shared library
with it sets flush-to-zero for the whole process, which would change every other kernel's results.
-fno-gnu-unique: GCC otherwise gives the static locals of inline functions (gemm_cpu.h's table of kernels
chosen for this CPU, attention's buffers) STB_GNU_UNIQUE binding, which the dynamic loader makes one object per
process whatever library defines it: a process that loaded two builds of a library (the tests load the AVX2 build
beside the native one) had the second call the first's kernels on its own layouts, and crashed.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from .signatures import KERNEL_SIGNATURES, KernelSignatureError, check_library

__all__ = ["KernelBuildError", "KernelSignatureError", "build_kernel"]

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fno-gnu-unique", "-std=c++17", "-shared", "-fPIC", "-pthread"]


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled (no C++ compiler, or the compiler failed)."""


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    ident += line
                if line.strip() == "":
                    break            # the first processor is enough
    except OSError:
        pass
    return ident


# GCC's own: clang gives inline functions' statics no STB_GNU_UNIQUE binding, and does not take the flag
_GCC_ONLY = ("-fno-gnu-unique",)


def flags(compiler_version: str = "") -> list:
    """The compiler's flags: FLAGS, with $LLM_SERVING_KERNEL_MARCH in place of -march=native when set, without the
    GCC-only ones for clang (its `--version` text)."""
    march = os.environ.get("LLM_SERVING_KERNEL_MARCH", "").strip()
    clang = "clang" in compiler_version.lower()
    return [f"-march={march}" if f == "-march=native" and march else f for f in FLAGS
            if not (clang and f in _GCC_ONLY)]


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_kernel(name: str, func: str, cache_dir: Optional[Path] = None) -> str:
    """Compile kernels/<name>.cc (once) and return "<path>.so:<func>" for ops.Custom; KernelBuildError if it
    cannot be built."""
    from llm_serving.cache_dir import default_cache_dir

    source = _HERE / f"{name}.cc"
    cxx = _compiler()
    if cxx is None:
        raise KernelBuildError(f"no C++ compiler found (looked for $CXX, g++, c++, clang++) to build {source.name}")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx}: {e}") from e
    digest = hashlib.sha1()
    headers = [h.read_bytes() for h in sorted(_HERE.glob("*.h"))]          # what the sources may include
    for part in (source.read_bytes(), *headers, version.encode(), " ".join(flags(version)).encode(),
                 _cpu_identity().encode()):
        digest.update(part)
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "kernels"
    target = out_dir / f"{name}-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            lock = os.open(out_dir, os.O_RDONLY)         # the directory's flock: one build at a time in it
        except OSError as e:
            raise KernelBuildError(f"cannot write the kernel library under {out_dir}: {e}") from e
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not target.exists():              # (another process may have built it while this one waited)
                logger.info("building the CPU kernel %s for this machine (once: kept in %s; the layer kernel takes "
                            "30-60 s on 2 cores)", source.name, out_dir)
                started = time.perf_counter()
                _compile(cxx, flags(version), source, out_dir, target)
                logger.info("built the CPU kernel %s in %.0f s", source.name, time.perf_counter() - started)
        finally:
            os.close(lock)                       # (which releases the lock)
    signatures = KERNEL_SIGNATURES.get(name, ())
    if signatures:
        check_library(target, signatures, source.name)       # KernelSignatureError: the .cc and Python disagree
    return f"{target}:{func}"


def _compile(cxx: str, cxx_flags: list, source: Path, out_dir: Path, target: Path) -> None:
    """Compile `source` into a temporary file under out_dir, then rename it to `target`."""
    try:
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{source.stem}-", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise KernelBuildError(f"cannot write the kernel library under {out_dir}: {e}") from e
    try:
        proc = subprocess.run([cxx, *cxx_flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise KernelBuildError(f"{cxx} failed to build {source.name}:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"building {source.name} with {cxx} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
