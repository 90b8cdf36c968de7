"""CPU kernels MindSpore loads as `ops.Custom(func_type="aot")` operators, built here on first use.

Each kernel library is a C++ file next to this module (the headers beside it are shared), with the translation
units SOURCES lists after it. `build_kernel(name, func)` compiles it once per (sources and headers, compiler,
flags, CPU) into `<cache>/kernels/<name>-<digest>.so` (<cache> is $LLM_SERVING_CACHE or ~/.cache/llm-serving) and
returns the "path.so:func" string `ops.Custom` takes. `-march=native` is safe because the CPU's identity is part
of the digest. A kernel whose parameters are declared by name (signatures.py) is checked against the lists its
library exports (its parameters, its iconfig's entries) before it is used: a `KernelSignatureError` names the
first difference.

The build (`build_libraries`): the libraries missing are compiled together, every translation unit of them at
once, one compiler each on as many CPUs as the process may use, then linked. The layer kernel's units are
decoder_layer_cpu.cc, gemm_avx2_int.cc as it is, and gemm_avx2_int.cc once more per integer type it reads
(TYPED_UNITS: Q4_1's products are 4 s of a core, the nine types' 23 s): the runner asks for the types its
checkpoint stores (`types`), so a SmolLM2's first start on a 2-core machine (a Zen 4) compiles for 13 s, not the
18 s of every type, and a model of other types later compiles its types alone. The objects are kept in
`<cache>/kernels/objects/`, named by their own digest, and linked again by each library that needs them (a link:
0.1 s); a library of some types is named by them (`decoder_layer_cpu-<digest>-q4_1+q8_0.so`). Each library goes
to a temporary file renamed into place (an object too), so agents starting together never load a half-written
library, and the build holds the directory's lock (an flock on the directory itself, dropped when its holder
dies), so processes that need the same libraries together (TP ranks, a test run's workers and servers) wait for one
build instead of each compiling them at once; the temporary files of a build whose process was killed are removed
by the next. `llm-serving start` starts the build on a thread of the master before anything else (`prebuild`,
`libraries_for`, the model's types), so that a machine's first start compiles while the master decides and the
agent imports MindSpore; the compilers run on daemon threads, killed at the process's exit rather than waited for.

$LLM_SERVING_KERNEL_MARCH (for example `x86-64-v3` or `znver3`: AVX2 without AVX-512) replaces `native` in
`-march=`: a machine with AVX-512 then builds, runs and measures the AVX2 paths (16 vector registers, no EVEX
encodings), as an AVX2-only CPU runs them. After the name it may add `-m` flags: `native -mamx-tile -mamx-int8
-mamx-bf16` builds AMX's paths on an AVX-512 machine without AMX, where Linux grants no tile state, so the tiles stay
off at run time and the rest of an AMX build runs as it does on an AMX machine whose tiles are off or not chosen
(tests/unit/test_kernel_amx_build.py). The value is part of the digest.

Flags: -O3 plus the floating-point relaxations that let the compiler vectorise the dot products
(reassociation, no errno, no signed zeros, no traps), but not -ffast-math: linking a shared library
with it sets flush-to-zero for the whole process, which would change every other kernel's results.
-fno-gnu-unique: GCC otherwise gives the static locals of inline functions (gemm_cpu.h's table of kernels
chosen for this CPU, attention's buffers) STB_GNU_UNIQUE binding, which the dynamic loader makes one object per
process whatever library defines it: a process that loaded two builds of a library (the tests load the AVX2 build
beside the native one) had the second call the first's kernels on its own layouts, and crashed.
"""
from __future__ import annotations

import atexit
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .signatures import KERNEL_SIGNATURES, KernelSignatureError, check_library

__all__ = ["KernelBuildError", "KernelSignatureError", "build_kernel", "build_libraries", "libraries_for",
           "library_path", "prebuild"]

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-fno-gnu-unique", "-std=c++17", "-shared", "-fPIC", "-pthread"]

# A library's translation units after its own <name>.cc, each compiled on its own core (the longest first)
SOURCES = {"decoder_layer_cpu": ("decoder_layer_cpu.cc", "gemm_avx2_int.cc")}
# A library's unit compiled once more for each integer type it reads (-DLLM_SERVING_INT_TYPE=<code>: that type's
# products, repacking and rows read back); a library links the units of the types asked for (`types`), all of them
# when none are named
TYPED_UNITS = {"decoder_layer_cpu": "gemm_avx2_int.cc"}
# The stored types those units are compiled for, by GGUF name, and their codes (gemm_avx2_int.h: integer_type)
INT_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}


def sources(name: str) -> tuple:
    """The .cc files library `name` is built from (its own first)."""
    return SOURCES.get(name, (f"{name}.cc",))


@dataclass(frozen=True)
class _Unit:
    """One compile of a library: its .cc, the integer type it is compiled for (None: as it is), and the object it
    makes, kept for every library that links it (None: a library of one unit, compiled straight to the .so)."""
    source: Path
    int_type: Optional[str] = None
    object: Optional[Path] = None

    def defines(self) -> list:
        return [] if self.int_type is None else [f"-DLLM_SERVING_INT_TYPE={INT_TYPES[self.int_type]}"]


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


def cpu_flags() -> frozenset:
    """This CPU's feature flags as /proc/cpuinfo names them (avx2, avx512f, avx512_vnni, amx_int8, ...): what
    -march=native compiles for; empty where there is no /proc/cpuinfo."""
    for line in _cpu_identity().splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


# GCC's own: clang gives inline functions' statics no STB_GNU_UNIQUE binding, and does not take the flag
_GCC_ONLY = ("-fno-gnu-unique",)


def flags(compiler_version: str = "") -> list:
    """The compiler's flags: FLAGS, with $LLM_SERVING_KERNEL_MARCH in place of -march=native when set, without the
    GCC-only ones for clang (its `--version` text)."""
    march = os.environ.get("LLM_SERVING_KERNEL_MARCH", "").split()
    extra = [f for f in march[1:] if not f.startswith("-m")]
    if march and (march[0].startswith("-") or extra):
        raise KernelBuildError(f"LLM_SERVING_KERNEL_MARCH={' '.join(march)!r}: a -march name, then only -m flags")
    clang = "clang" in compiler_version.lower()
    out = []
    for f in FLAGS:
        if f == "-march=native" and march:
            out += [f"-march={march[0]}", *march[1:]]
        elif not (clang and f in _GCC_ONLY):
            out.append(f)
    return out


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_kernel(name: str, func: str, cache_dir: Optional[Path] = None, types=None) -> str:
    """Compile kernels/<name>.cc and its units (once) and return "<path>.so:<func>" for ops.Custom; KernelBuildError
    if it cannot be built. types: the integer types it reads (INT_TYPES' names; others are ignored), None: all."""
    target, = build_libraries([name], cache_dir, types)
    signatures = KERNEL_SIGNATURES.get(name, ())
    if signatures:
        check_library(target, signatures, sources(name)[0])    # KernelSignatureError: the .cc and Python disagree
    return f"{target}:{func}"


@dataclass(frozen=True)
class _Library:
    units: tuple          # its _Units, its own .cc first
    target: Path          # <cache>/kernels/<name>-<digest>[-<its integer types>].so


def build_libraries(names, cache_dir: Optional[Path] = None, types=None) -> list:
    """The paths of libraries `names`, each built first if it is not yet: those missing are compiled together,
    holding the directory's lock, their units side by side (compile_libraries), the objects of units already
    compiled for another library linked again. types: the integer types the libraries read (INT_TYPES' names;
    others are ignored), None: all. KernelBuildError if one cannot be built (after the others are)."""
    cxx, cxx_flags, out_dir, libraries = _libraries(names, cache_dir, types)
    if not all(lib.target.exists() for lib in libraries):
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            lock = os.open(out_dir, os.O_RDONLY)         # the directory's flock: one build at a time in it
        except OSError as e:
            raise KernelBuildError(f"cannot write the kernel library under {out_dir}: {e}") from e
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            missing = [lib for lib in libraries if not lib.target.exists()]   # (another process may have built
            if missing:                                                     # some while this one waited)
                _remove_leftovers(out_dir)
                what = ", ".join(lib.target.name for lib in missing)
                compiles = [u.source.name for lib in missing for u in lib.units
                            if u.object is None or not u.object.exists()]
                if compiles:
                    logger.info("building the CPU kernels %s for this machine (once: kept in %s; %d unit(s) to "
                                "compile, the layer kernel's 10-40 s on 2 cores)", what, out_dir, len(compiles))
                started = time.perf_counter()
                compile_libraries(cxx, cxx_flags, [(lib.units, lib.target) for lib in missing])
                logger.info("%s the CPU kernels %s in %.1f s", "built" if compiles else "linked the objects kept into",
                            what, time.perf_counter() - started)
        finally:
            os.close(lock)                       # (which releases the lock)
    return [lib.target for lib in libraries]


def library_path(name: str, cache_dir: Optional[Path] = None, types=None) -> Optional[Path]:
    """Where library `name` (reading integer `types`, None: all) is or will be once built for this machine, or None
    when no compiler runs."""
    try:
        return _libraries([name], cache_dir, types)[3][0].target
    except KernelBuildError:
        return None


def _libraries(names, cache_dir: Optional[Path], types=None) -> tuple:
    """(the compiler, its flags, the libraries' directory, a _Library per name: its units and its target, named by
    their sources' digest, and by the integer types it reads unless all)."""
    from llm_serving.cache_dir import default_cache_dir

    cxx = _compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (looked for $CXX, g++, c++, clang++) to build "
                               + ", ".join(sources(n)[0] for n in names))
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelBuildError(f"cannot run the C++ compiler {cxx}: {e}") from e
    out_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "kernels"
    cxx_flags = flags(version)
    common = [*(h.read_bytes() for h in sorted(_HERE.glob("*.h"))),      # what the sources may include
              version.encode(), " ".join(cxx_flags).encode(), _cpu_identity().encode()]
    wanted = sorted(INT_TYPES) if types is None else sorted({str(t).upper() for t in types} & set(INT_TYPES))
    libraries = []
    for name in names:
        files = [_HERE / unit for unit in sources(name)]
        typed = TYPED_UNITS.get(name)
        if len(files) == 1 and typed is None:
            units = (_Unit(files[0]),)
        else:
            units = tuple(_Unit(f, None, _object(f, None, common, out_dir)) for f in files) + tuple(
                _Unit(_HERE / typed, t, _object(_HERE / typed, t, common, out_dir)) for t in (wanted if typed else ()))
        digest = hashlib.sha1()
        for part in (*(f.read_bytes() for f in files), *common):
            digest.update(part)
        suffix = "" if typed is None or len(wanted) == len(INT_TYPES) else "-" + ("+".join(wanted).lower() or "float")
        libraries.append(_Library(units, out_dir / f"{name}-{digest.hexdigest()[:16]}{suffix}.so"))
    return cxx, cxx_flags, out_dir, libraries


def _object(source: Path, int_type: Optional[str], common: list, out_dir: Path) -> Path:
    """Where the object of `source` (compiled for `int_type`) is kept: <dir>/objects/<stem>[-<type>]-<digest>.o."""
    digest = hashlib.sha1(source.read_bytes())
    for part in (*common, (int_type or "").encode()):
        digest.update(part)
    tag = "" if int_type is None else f"-{int_type.lower()}"
    return out_dir / "objects" / f"{source.stem}{tag}-{digest.hexdigest()[:16]}.o"


def compile_libraries(cxx: str, cxx_flags: list, libraries: list) -> None:
    """Compile each (units, target) of `libraries` into its shared library target, through a temporary file in
    its directory renamed into place. A unit is a _Unit or a .cc's Path. Every unit not compiled yet, of every
    library, compiles at once, one compiler each on as many CPUs as this process may use (the largest source
    first): a library of several units into objects then linked (a _Unit's object kept where it says, for the
    next library that links it), one of a single unit straight to its library. KernelBuildError naming the first
    that failed, after the others are built."""
    workers = max(1, len(os.sched_getaffinity(0)))
    compile_only = [f for f in cxx_flags if f != "-shared"] + ["-c"]
    temps, jobs, links = [], {}, []          # jobs: {object or library file: (unit, its compile's arguments)}
    try:
        for units, target in libraries:
            units = [u if isinstance(u, _Unit) else _Unit(Path(u)) for u in units]
            fd, tmp = tempfile.mkstemp(suffix=".so", prefix=f".{target.stem}-", dir=target.parent)
            os.close(fd)
            temps.append(tmp)
            if len(units) == 1 and units[0].object is None:
                jobs[tmp] = (units[0], [*cxx_flags, *units[0].defines(), "-o", tmp, str(units[0].source)])
                links.append((None, tmp, target, [tmp]))
                continue
            scratch = None
            outs = []
            for unit in units:
                if unit.object is None:                         # (a unit of a library built without a cache)
                    scratch = scratch or tempfile.mkdtemp(prefix=f".{target.stem}-", dir=target.parent)
                    tag = f"-{unit.int_type.lower()}" if unit.int_type else ""
                    outs.append(os.path.join(scratch, f"{unit.source.stem}{tag}.o"))
                else:
                    outs.append(str(unit.object))
                if outs[-1] not in jobs and not os.path.exists(outs[-1]):
                    jobs[outs[-1]] = (unit, [*compile_only, *unit.defines()])
            if scratch:
                temps.append(scratch)
            links.append((outs, tmp, target, outs))         # (made: the files its link needs)
    except OSError as e:
        _remove(temps)
        raise KernelBuildError(f"cannot write the kernel library under {libraries[0][1].parent}: {e}") from e
    try:
        order = sorted(jobs, key=lambda out: jobs[out][0].source.stat().st_size, reverse=True)
        failed = _run_jobs(order, lambda out: _compile(cxx, out, *jobs[out]), workers)
        errors = []
        for outs, tmp, target, made in links:
            error = next((failed[out] for out in made if failed.get(out)), None)
            if error is None and outs is not None:
                error = _run(cxx, ["-shared", "-fPIC", "-pthread", "-o", tmp, *outs], target.name)
            if error is None:
                os.replace(tmp, target)
            else:
                errors.append(error)
        if errors:
            raise KernelBuildError(errors[0])
    except OSError as e:
        raise KernelBuildError(f"building {libraries[0][1].name} with {cxx} failed: {e}") from e
    finally:
        _remove(temps)


def _run_jobs(items: list, run, workers: int) -> dict:
    """{item: run(item)}, `workers` at a time, on daemon threads: a process that exits during a build (a config
    error after `prebuild` began, a signal) is not held until its compilers finish, as a ThreadPoolExecutor's
    threads would hold it (the interpreter joins them at exit); the atexit hook kills the compilers instead."""
    results, queue, lock = {}, list(items), threading.Lock()

    def work() -> None:
        while True:
            with lock:
                if not queue:
                    return
                item = queue.pop(0)
            try:
                results[item] = run(item)
            except OSError as e:            # (a temporary file that cannot be written: the job's error)
                results[item] = f"building {item} failed: {e}"
    threads = [threading.Thread(target=work, name="kernel-compile", daemon=True)
               for _ in range(min(len(items), workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _compile(cxx: str, out: str, unit: _Unit, args: list) -> Optional[str]:
    """One unit's compile to `out`: a library (args end with its -o and source) or an object, written to a
    temporary file beside it renamed into place (a kept object is whole or absent). None, or what went wrong."""
    what = unit.source.name + (f" for {unit.int_type}" if unit.int_type else "")
    if args[-1] == str(unit.source):
        return _run(cxx, args, what)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".o", prefix=".", dir=os.path.dirname(out))
    os.close(fd)
    try:
        error = _run(cxx, [*args, "-o", tmp, str(unit.source)], what)
        if error is None:
            os.replace(tmp, out)
        return error
    finally:
        _remove([tmp])


_COMPILERS: set = set()       # the compilers this process is running, killed if it exits first
_COMPILERS_LOCK = threading.Lock()
_EXITING = False              # the process is exiting: no compiler starts (one started now would outlive it)


def _run(cxx: str, args: list, what: str) -> Optional[str]:
    """One compiler run: None, or what went wrong (the end of its errors)."""
    with _COMPILERS_LOCK:     # (a start and the exit's kills never interleave: no compiler is left running)
        if _EXITING:
            return f"building {what}: the process is exiting"
        try:
            proc = subprocess.Popen([cxx, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            return f"building {what} with {cxx} failed: {e}"
        _COMPILERS.add(proc)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"{cxx} took more than 300 s to build {what}"
    finally:
        _COMPILERS.discard(proc)
    return None if proc.returncode == 0 else f"{cxx} failed to build {what}:\n{err.strip()[-2000:]}"


@atexit.register
def _stop_compilers() -> None:
    global _EXITING
    with _COMPILERS_LOCK:
        _EXITING = True
        for proc in list(_COMPILERS):
            proc.kill()


def _remove(paths) -> None:
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.exists(path):
            os.unlink(path)


def _remove_leftovers(out_dir: Path) -> None:
    """The temporary files and object directories of builds that did not finish (their process killed), beside
    the libraries and the kept objects: with the directory's lock held, no build is running in it."""
    for folder in (out_dir, out_dir / "objects"):
        try:
            names = [entry for entry in os.listdir(folder) if entry.startswith(".")]
        except OSError:
            continue
        _remove(folder / entry for entry in names)


def libraries_for(device_target: str, attention_kernel: str, layer_kernel: str, ranks: int = 1) -> tuple:
    """The libraries an agent of these settings builds at load (runner/kernels.py's choose_kernels): on a CPU,
    the paged-attention kernel unless it is off, and the layer kernel unless it is off or the model is split over
    ranks (tensor parallelism)."""
    if device_target != "CPU" or attention_kernel == "off":
        return ()
    if layer_kernel == "off" or ranks > 1:
        return ("paged_attention_cpu",)
    return ("paged_attention_cpu", "decoder_layer_cpu")


def prebuild(names, types_of=None) -> Optional[threading.Thread]:
    """Start building libraries `names` on a thread of this process, when some are not built yet: `llm-serving
    start` calls it first, so that the build of a machine's first start runs while the master decides and its
    agent imports MindSpore, and the agent finds the libraries built (or waits on the directory's lock for this
    build to end). types_of: called on the thread, the integer types they read (the model's: the agent builds
    the same; None: every type). A failure is only logged here: the agent's own build then says what went wrong."""
    if not names:
        return None

    def build() -> None:
        try:
            build_libraries(names, types=None if types_of is None else types_of())
        except Exception as e:  # noqa: BLE001 (the agent's build reports it)
            logger.debug("building the CPU kernels ahead of the agent failed: %s", e)
    thread = threading.Thread(target=build, name="kernel-build", daemon=True)
    thread.start()
    return thread
