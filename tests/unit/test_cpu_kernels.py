"""The CPU paged-attention kernel, called through ctypes exactly as MindSpore's AOT Custom op calls it
(nparam, params, ndims, shapes, dtypes), against a numpy softmax attention; and its build/cache rules.
No MindSpore needed."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from llm_serving.models.kernels import KernelBuildError, build_kernel

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler on this machine (the runner falls back to the key gather)")


@pytest.fixture(scope="module")
def kernel():
    spec = build_kernel("paged_attention_cpu", "PagedDecodeAttention")            # the agents' (cached) build
    path, func = spec.rsplit(":", 1)
    return getattr(ctypes.CDLL(path), func)


def call(kernel, q, key_cache, value_cache, block_tables, context_lens, block_size, threads, tree_bits=None,
         window=None):
    """Invoke like MindSpore: inputs then the output, each with its rank, shape and dtype name (a cache may be
    (its bfloat16 bits, "bfloat16")); window: config's third entry (None: a config of two)."""
    from llm_serving.models.kernels.aot_call import invoke
    cfg = np.array([block_size, threads] + ([] if window is None else [window]), np.int32)
    out = np.full_like(q, np.nan)
    bits = np.full(len(q), -1, np.int32) if tree_bits is None else np.asarray(tree_bits, np.int32)
    return invoke(kernel, [q, key_cache, value_cache, block_tables, context_lens, bits, cfg, out]), out


def reference(q, key_cache, value_cache, block_tables, context_lens, block_size, visible=None, window=0, sinks=None):
    """visible[r]: the key indices row r attends to (default all of 0..context_len-1); window > 0: only the last
    `window` of them (sliding-window attention); sinks (KVH, G): each head's logit in its softmax's denominator."""
    b, kvh, g, d = q.shape
    keys = key_cache.reshape(-1, kvh, d)
    values = value_cache.reshape(-1, kvh, d)
    out = np.zeros_like(q, dtype=np.float64)
    for r in range(b):
        slots = (block_tables[r][:, None] * block_size + np.arange(block_size)).reshape(-1)[:context_lens[r]]
        if visible is not None:
            slots = slots[visible[r]]
        if window > 0:
            slots = slots[-window:]
        for h in range(kvh):
            k, v = keys[slots, h].astype(np.float64), values[slots, h].astype(np.float64)
            s = q[r, h].astype(np.float64) @ k.T                       # (G, n)
            top = s.max(-1, keepdims=True)
            p = np.exp(s - top)
            total = p.sum(-1, keepdims=True)
            if sinks is not None:
                total = total + np.exp(np.asarray(sinks[h], np.float64)[:, None] - top)
            out[r, h] = (p / total) @ v
    return out


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("kvh,g,block_size,threads", [(4, 2, 16, 1), (4, 2, 16, 3), (8, 1, 4, 2), (2, 4, 8, 2)])
def test_kernel_matches_softmax_attention(kernel, kvh, g, block_size, threads, cache_dtype):
    """Against float64 attention over the cache's own values (float16, bfloat16, int8: the same values, widened)."""
    from tests.cache_types import Cache
    cache = Cache(cache_dtype)
    rng = np.random.default_rng(kvh * 100 + g * 10 + threads)
    b, d, w, num_blocks = 7, 16, 5, 60
    q = (rng.standard_normal((b, kvh, g, d)) / np.sqrt(d)).astype(np.float32)
    key_cache = cache.store(rng.standard_normal((num_blocks * block_size * kvh, d)))
    value_cache = cache.store(rng.standard_normal((num_blocks * block_size * kvh, d)))
    block_tables = rng.permutation(num_blocks)[:b * w].reshape(b, w).astype(np.int32)   # scattered blocks
    context_lens = np.array([1, 2, block_size, block_size + 1, 3 * block_size - 1, w * block_size, 5], np.int32)
    rc, out = call(kernel, q, cache.arg(key_cache), cache.arg(value_cache), block_tables, context_lens, block_size,
                   threads)
    assert rc == 0
    np.testing.assert_allclose(out, reference(q, cache.values(key_cache), cache.values(value_cache), block_tables,
                                              context_lens, block_size), rtol=1e-5, atol=1e-6)
    if cache.bf16 or cache.int8:
        return
    # a key past context_len never matters: poison every slot a row cannot see
    poisoned_k, poisoned_v = key_cache.copy(), value_cache.copy()
    for r in range(b):
        slots = (block_tables[r][:, None] * block_size + np.arange(block_size)).reshape(-1)[context_lens[r]:]
        rows = (slots[:, None] * kvh + np.arange(kvh)).reshape(-1)
        poisoned_k[rows] = 1e4
        poisoned_v[rows] = np.nan
    shared = set(block_tables.reshape(-1).tolist())
    assert len(shared) == b * w                                # no block is visible to one row, hidden to another
    rc, again = call(kernel, q, poisoned_k, poisoned_v, block_tables, context_lens, block_size, threads)
    assert rc == 0
    np.testing.assert_array_equal(again, out)


def tree_case(rng, committed: int, parents: list, bs: int, w: int, nb: int) -> tuple:
    """A speculative token tree after `committed` keys, its nodes (parents[j]: node j's parent, -1 the root) as
    query rows of one block table: (q, key_cache, value_cache, table, context, tree bits, visible keys per row)."""
    kvh, g, d = 2, 2, 8
    nodes = len(parents)
    table = rng.permutation(nb)[:w].astype(np.int32)
    q = (rng.standard_normal((nodes, kvh, g, d)) / np.sqrt(d)).astype(np.float32)
    key_cache = rng.standard_normal((nb * bs * kvh, d)).astype(np.float32)
    value_cache = rng.standard_normal((nb * bs * kvh, d)).astype(np.float32)
    context = np.array([committed + j + 1 for j in range(nodes)], np.int32)
    bits, visible = [], []
    for j in range(nodes):
        ancestors, a = set(), j
        while a >= 0:
            ancestors.add(a)
            a = parents[a]
        # bit m: key j - m of the row's nodes, m places before node j, visible
        bits.append(~sum(1 << m for m in range(1, j + 1) if j - m not in ancestors))
        visible.append(list(range(committed)) + [committed + a for a in sorted(ancestors)])
    return q, key_cache, value_cache, table, context, bits, visible


def test_tree_bits_hide_the_keys_of_other_branches(kernel):
    """A speculative token tree: root r at key index c-1... each node sees the committed keys, itself and its
    ancestors only. Nodes 0..4 of one row (parents -1, 0, 1, 0, 3: two branches below the root) as five
    query rows sharing a block table, each with context up to itself."""
    bs = 4
    q, key_cache, value_cache, table, context, bits, visible = tree_case(np.random.default_rng(5), 9,
                                                                         [-1, 0, 1, 0, 3], bs, w=6, nb=12)
    nodes = len(context)
    rc, out = call(kernel, q, key_cache, value_cache, np.tile(table, (nodes, 1)), context, bs, 2, bits)
    assert rc == 0
    np.testing.assert_allclose(out, reference(q, key_cache, value_cache, np.tile(table, (nodes, 1)), context, bs,
                                              visible), rtol=1e-5, atol=1e-6)
    # the chain's bits (all set) are plain causal attention, and differ from the tree's for branch nodes
    rc, chain = call(kernel, q, key_cache, value_cache, np.tile(table, (nodes, 1)), context, bs, 2)
    assert rc == 0 and np.allclose(chain[:3], out[:3]) and not np.allclose(chain[3:], out[3:])


@pytest.mark.parametrize("cache_dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("window", [1, 4, 16, 17, 60, 1000])
def test_a_sliding_window_sees_the_last_keys(kernel, cache_dtype, window):
    """config (3,) [block_size, threads, window]: each row attends over its last `window` keys (contexts 1 .. 60
    around the window: smaller, equal, larger); window 0 and a config of two entries are no window."""
    from tests.cache_types import Cache
    cache = Cache(cache_dtype)
    rng = np.random.default_rng(window)
    kvh, g, d, bs, w, num_blocks = 2, 3, 16, 8, 8, 80
    context_lens = np.array([1, 3, 4, 5, 16, 17, 18, 33, 60], np.int32)
    b = len(context_lens)
    q = (rng.standard_normal((b, kvh, g, d)) / np.sqrt(d)).astype(np.float32)
    key_cache = cache.store(rng.standard_normal((num_blocks * bs * kvh, d)))
    value_cache = cache.store(rng.standard_normal((num_blocks * bs * kvh, d)))
    tables = rng.permutation(num_blocks)[:b * w].reshape(b, w).astype(np.int32)
    keys, values = cache.values(key_cache), cache.values(value_cache)
    rc, out = call(kernel, q, cache.arg(key_cache), cache.arg(value_cache), tables, context_lens, bs, 2, window=window)
    assert rc == 0
    np.testing.assert_allclose(out, reference(q, keys, values, tables, context_lens, bs, window=window), rtol=1e-5,
                               atol=1e-6)
    rc, none = call(kernel, q, cache.arg(key_cache), cache.arg(value_cache), tables, context_lens, bs, 2)
    wide = context_lens <= window
    np.testing.assert_array_equal(out[wide], none[wide])
    assert (~wide).sum() == 0 or not np.isclose(out[~wide], none[~wide], rtol=1e-4).all(axis=(1, 2, 3)).any()
    rc, zero = call(kernel, q, cache.arg(key_cache), cache.arg(value_cache), tables, context_lens, bs, 2, window=0)
    assert rc == 0 and np.array_equal(zero, none)


@pytest.mark.parametrize("window", [1, 2, 3, 5, 12, 40])
def test_a_token_trees_window_counts_its_visible_keys(kernel, window):
    """A tree node's window is the last `window` of the keys it sees (itself, its ancestors, the committed keys),
    the hidden ones not counted: test_tree_bits_hide_the_keys_of_other_branches' tree under a window."""
    bs = 4
    q, key_cache, value_cache, table, context, bits, visible = tree_case(np.random.default_rng(window), 30,
                                                                         [-1, 0, 1, 0, 3, 4], bs, w=12, nb=16)
    tables = np.tile(table, (len(context), 1))
    rc, out = call(kernel, q, key_cache, value_cache, tables, context, bs, 2, bits, window=window)
    assert rc == 0
    np.testing.assert_allclose(out, reference(q, key_cache, value_cache, tables, context, bs, visible, window),
                               rtol=1e-5, atol=1e-6)


def test_a_config_of_another_length_or_a_negative_window_is_refused(kernel):
    q = np.zeros((2, 2, 1, 8), np.float32)
    cache, tables, lens = np.zeros((32, 8), np.float32), np.zeros((2, 2), np.int32), np.ones(2, np.int32)
    from llm_serving.models.kernels.aot_call import invoke
    for cfg in ([4, 1, -1], [4], [4, 1, 0, 0]):
        out = np.zeros_like(q)
        args = [q, cache, cache, tables, lens, np.full(2, -1, np.int32), np.array(cfg, np.int32), out]
        assert invoke(kernel, args) == 2, cfg


def test_kernel_rejects_mixed_or_unknown_cache_dtypes(kernel):
    """Keys and values of different dtypes, or a dtype the kernel cannot read (float64 here), are refused before
    any read."""
    q = np.zeros((2, 2, 1, 8), np.float32)
    tables, lens = np.zeros((2, 2), np.int32), np.ones(2, np.int32)
    for k, v in ((np.zeros((32, 8), np.float32), np.zeros((32, 8), np.float16)),
                 (np.zeros((32, 8), np.float64), np.zeros((32, 8), np.float64))):
        rc, _ = call(kernel, q, k, v, tables, lens, 4, 1)
        assert rc != 0
    rc, out = call(kernel, q, np.ones((32, 8), np.float16), np.full((32, 8), 0.5, np.float16), tables, lens, 4, 1)
    assert rc == 0 and np.array_equal(out, np.full_like(q, 0.5))     # each row sees one key: its value


def test_kernel_rejects_wrong_ranks(kernel):
    q = np.zeros((2, 2, 1, 8), np.float32)
    cache = np.zeros((32, 8), np.float32)
    rc, _ = call(kernel, q.reshape(2, 2, 8), cache, cache, np.zeros((2, 2), np.int32), np.ones(2, np.int32), 4, 1)
    assert rc != 0                                             # MindSpore raises on a non-zero return


def test_processes_building_the_same_kernel_together_compile_it_once(tmp_path):
    """Two processes asking for a library that is not built yet: one compiles it while the other waits on the
    directory's lock, then finds it built; both get the same path, and no lock or temporary file is left."""
    import subprocess
    import sys

    compiler = shutil.which("g++") or os.environ["CXX"]
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"                   # the compiler, logging each compile (not --version)
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo compile >> {log};; esac\nexec {compiler} "$@"\n')
    wrapper.chmod(0o755)
    out = tmp_path / "kernels"
    code = ("import sys; from llm_serving.models.kernels import build_kernel; "
            f"print(build_kernel('paged_attention_cpu', 'PagedDecodeAttention', {str(out)!r}))")
    env = {**os.environ, "CXX": str(wrapper)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    paths = {p.communicate(timeout=300)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0, 0] and len(paths) == 1
    assert log.read_text().splitlines() == ["compile"]
    assert [f.name for f in out.iterdir()] == [os.path.basename(paths.pop().rsplit(":", 1)[0])]


def test_build_is_cached_and_reports_compiler_failures(tmp_path, monkeypatch):
    first = build_kernel("paged_attention_cpu", "PagedDecodeAttention", tmp_path)
    path = first.rsplit(":", 1)[0]
    mtime = os.stat(path).st_mtime_ns
    assert build_kernel("paged_attention_cpu", "PagedDecodeAttention", tmp_path) == first
    assert os.stat(path).st_mtime_ns == mtime                  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]   # no temporary left behind
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KernelBuildError, match="no-such-compiler"):
        build_kernel("paged_attention_cpu", "PagedDecodeAttention", tmp_path / "other")
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    with pytest.raises(KernelBuildError, match="failed to build"):
        build_kernel("paged_attention_cpu", "PagedDecodeAttention", tmp_path / "other")
    assert not any((tmp_path / "other").glob("*.so"))


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch):
    """kernels/ replaced by two tiny libraries: `two` of two units (one calling a hidden function of the other) and
    `one` of one; the compiler a wrapper that logs each run's start and end (by its last argument), a second
    apart."""
    from llm_serving.models import kernels

    src = tmp_path / "src"
    src.mkdir()
    (src / "shared.h").write_text("#pragma GCC visibility push(hidden)\nint helper();\n#pragma GCC visibility pop\n")
    (src / "two.cc").write_text('#include "shared.h"\nextern "C" int Two() { return helper() + 1; }\n')
    (src / "part.cc").write_text('#include "shared.h"\nint helper() { return 41; }\n')
    (src / "one.cc").write_text('extern "C" int One() { return 1; }\n')
    monkeypatch.setattr(kernels, "_HERE", src)
    monkeypatch.setattr(kernels, "SOURCES", {"two": ("two.cc", "part.cc")})
    compiler = shutil.which("g++") or os.environ["CXX"]
    log = tmp_path / "compiles.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*)\n  unit=$(basename "$(eval echo \\${{$#}})")\n'
                       f'  echo "start $unit $(date +%s.%N)" >> {log}; sleep 1\n'
                       f'  {compiler} "$@"; rc=$?\n  echo "end $unit $(date +%s.%N)" >> {log}; exit $rc;;\nesac\n'
                       f'exec {compiler} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})      # three compilers at once
    return src, log


def _times(log) -> dict:
    """{(start|end, unit): time} from the wrapper's log."""
    return {(kind, unit): float(at) for kind, unit, at in (line.split() for line in log.read_text().splitlines())}


def test_a_library_of_several_units_compiles_them_at_once_then_links_them(tiny_sources, tmp_path):
    from llm_serving.models.kernels import build_libraries

    _, log = tiny_sources
    out = tmp_path / "kernels"
    two, one = build_libraries(["two", "one"], out)
    assert ctypes.CDLL(str(two)).Two() == 42 and ctypes.CDLL(str(one)).One() == 1
    times = _times(log)
    units = ("two.cc", "part.cc", "one.cc")
    assert set(times) >= {(kind, unit) for kind in ("start", "end") for unit in units}
    assert max(times["start", u] for u in units) < min(times["end", u] for u in units)   # all three side by side
    [link] = [t for (kind, unit), t in times.items() if kind == "start" and unit.endswith(".o")]   # (its last
    assert link >= max(times["end", "two.cc"], times["end", "part.cc"])                         # argument: an object)
    assert sorted(p.name for p in out.iterdir()) == sorted([two.name, one.name, "objects"])      # no temporary left,
    assert sorted(p.name.split("-")[0] for p in (out / "objects").iterdir()) == ["part", "two"]  # two's objects kept
    assert not hasattr(ctypes.CDLL(str(two)), "_Z6helperv")    # hidden: another build's would not be called


def test_a_unit_that_fails_names_itself_and_the_other_libraries_are_still_built(tiny_sources, tmp_path):
    from llm_serving.models.kernels import build_libraries

    src, _ = tiny_sources
    (src / "part.cc").write_text("int helper() { return }\n")
    out = tmp_path / "kernels"
    with pytest.raises(KernelBuildError, match=r"failed to build part\.cc:(.|\n)*error"):
        build_libraries(["two", "one"], out)
    [built] = out.glob("*.so")                                # one's library, none of two's
    assert built.name.startswith("one-") and ctypes.CDLL(str(built)).One() == 1
    assert [p.name.split("-")[0] for p in (out / "objects").iterdir()] == ["two"]   # (what compiled is kept)


def test_a_killed_builds_temporary_files_are_removed_by_the_next_build(tiny_sources, tmp_path):
    from llm_serving.models.kernels import build_libraries

    out = tmp_path / "kernels"
    out.mkdir()
    (out / ".two-dead.so").write_bytes(b"")                  # what a build killed half-way leaves
    (out / ".two-dead").mkdir()
    (out / ".two-dead" / "part.o").write_bytes(b"")
    [one] = build_libraries(["one"], out)
    assert [p.name for p in out.iterdir()] == [one.name]


def _typed_unit(src, monkeypatch) -> None:
    """`two` with a unit compiled per integer type (three of them), defining Type<code>() in each."""
    from llm_serving.models import kernels

    (src / "typed.cc").write_text('#define NAME2(c) Type##c\n#define NAME(c) NAME2(c)\n'
                                  'extern "C" int NAME(LLM_SERVING_INT_TYPE)() { return LLM_SERVING_INT_TYPE; }\n')
    monkeypatch.setattr(kernels, "TYPED_UNITS", {"two": "typed.cc"})
    monkeypatch.setattr(kernels, "INT_TYPES", {"Q4_1": 3, "Q8_0": 8, "Q4_K": 12})


def test_a_library_links_the_units_of_the_integer_types_asked_for_each_compiled_once(tiny_sources, tmp_path,
                                                                                     monkeypatch):
    """A unit compiled once per integer type (TYPED_UNITS, -DLLM_SERVING_INT_TYPE=<code>): a library of some types
    links theirs alone, named by them; another set compiles only the types not compiled yet, and links the objects
    kept; all types (None) is the library without a suffix."""
    from llm_serving.models import kernels

    src, log = tiny_sources
    _typed_unit(src, monkeypatch)
    out = tmp_path / "kernels"

    def compiled() -> list:             # the compiles since the last call, by source (and the log emptied)
        runs = sorted(unit for kind, unit in (line.split()[:2] for line in log.read_text().splitlines())
                      if kind == "start" and unit.endswith(".cc"))
        log.write_text("")
        return runs

    [lean] = kernels.build_libraries(["two"], out, types={"q4_1", "F32"})      # (F32: not an integer type)
    assert lean.name.endswith("-q4_1.so") and compiled() == ["part.cc", "two.cc", "typed.cc"]
    lib = ctypes.CDLL(str(lean))
    assert lib.Two() == 42 and lib.Type3() == 3 and not hasattr(lib, "Type8")
    [both] = kernels.build_libraries(["two"], out, types={"Q8_0", "Q4_1"})
    assert both.name.endswith("-q4_1+q8_0.so") and compiled() == ["typed.cc"]         # Q8_0's unit only
    assert ctypes.CDLL(str(both)).Type8() == 8
    [every] = kernels.build_libraries(["two"], out)
    assert every.name.startswith(lean.name.split("-q4_1")[0]) and every.name.count("-") == 1
    assert compiled() == ["typed.cc"] and ctypes.CDLL(str(every)).Type12() == 12      # Q4_K's unit only
    assert kernels.build_libraries(["two"], out, types=set())[0].name.endswith("-float.so")


def test_the_libraries_an_agent_builds_and_their_build_ahead_of_it(tiny_sources, tmp_path, monkeypatch):
    from llm_serving.models.kernels import build_libraries, libraries_for, prebuild

    assert libraries_for("CPU", "auto", "auto") == ("paged_attention_cpu", "decoder_layer_cpu")
    assert libraries_for("CPU", "on", "off") == ("paged_attention_cpu",)
    assert libraries_for("CPU", "auto", "auto", ranks=2) == ("paged_attention_cpu",)    # tensor parallel
    assert libraries_for("CPU", "off", "auto") == () and libraries_for("Ascend", "auto", "auto") == ()
    assert prebuild(()) is None
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path / "cache"))
    _typed_unit(tiny_sources[0], monkeypatch)
    thread = prebuild(("two", "one"), lambda: {"Q4_1"})        # (the model's types, found on the thread)
    thread.join(timeout=120)
    assert not thread.is_alive()
    built = sorted(p.name for p in (tmp_path / "cache" / "kernels").glob("*.so"))
    assert built == sorted(p.name for p in build_libraries(["two", "one"], types={"Q4_1"}))   # the same paths, not
    assert built[1].endswith("-q4_1.so")                                                        # rebuilt
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    failing = prebuild(("one",))                 # (a failure is the agent's to report: the thread only ends)
    failing.join(timeout=60)
    assert not failing.is_alive()


def test_a_process_that_exits_during_a_build_is_not_held_by_its_compilers(tmp_path):
    """`prebuild` began, then the process ends (a config error found after it): the exit kills the compilers
    instead of waiting for them (a compiler here: 60 s of sleep)."""
    slow = tmp_path / "cxx"
    slow.write_text('#!/bin/sh\ncase "$*" in *--version*) echo "g++ (slow) 1"; exit 0;; esac\nexec sleep 60\n')
    slow.chmod(0o755)
    env = {**os.environ, "CXX": str(slow), "LLM_SERVING_CACHE": str(tmp_path / "cache")}
    code = ("import time\nfrom llm_serving.models import kernels\n"
            "kernels.prebuild(('paged_attention_cpu', 'decoder_layer_cpu'))\ntime.sleep(1)\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.monotonic() - started < 30, "the exit waited for the compilers"
    # (killed at the exit; the kernel may take a moment to reap them on a loaded machine: a few seconds' grace)
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in psutil.process_iter(["cmdline", "status"])
                if (p.info["cmdline"] or [])[:2] == ["sleep", "60"] and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, left


def test_the_march_setting_names_a_march_then_only_m_flags(monkeypatch):
    """$LLM_SERVING_KERNEL_MARCH replaces -march=native's name and may add -m flags (the AMX build tested on a
    machine without AMX); anything else in it is refused by name rather than handed to the compiler."""
    from llm_serving.models.kernels import flags

    monkeypatch.delenv("LLM_SERVING_KERNEL_MARCH", raising=False)
    native = flags("g++ (Debian 12.2.0) 12.2.0")
    assert "-march=native" in native
    monkeypatch.setenv("LLM_SERVING_KERNEL_MARCH", "x86-64-v3")
    assert flags("g++") == [("-march=x86-64-v3" if f == "-march=native" else f) for f in native]
    monkeypatch.setenv("LLM_SERVING_KERNEL_MARCH", " native  -mamx-tile -mamx-int8 ")
    got = flags("g++")
    at = got.index("-march=native")
    assert got[at:at + 3] == ["-march=native", "-mamx-tile", "-mamx-int8"] and len(got) == len(native) + 2
    for bad in ("native -O0", "-mavx2", "znver4 -fno-strict-aliasing"):
        monkeypatch.setenv("LLM_SERVING_KERNEL_MARCH", bad)
        with pytest.raises(KernelBuildError, match="LLM_SERVING_KERNEL_MARCH"):
            flags("g++")
