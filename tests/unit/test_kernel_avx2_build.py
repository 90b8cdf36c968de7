"""The kernel library built for an AVX2-only CPU (LLM_SERVING_KERNEL_MARCH=x86-64-v3: AVX2 and FMA, no AVX-512, no
VNNI), tested on a machine whose own build takes the AVX-512 paths: many users' CPUs run the AVX2 code (the
attention tiles' FMAs, the integer products without VNNI, the row-interleaved panels' passes), and the other test
modules only run the build this machine's agents load. The tests are theirs, collected again here with this
module's `library`: attention tiles against the float64 reference, batch invariance in any step, and the
repacked rows' products and layers equal to the stored rows' to the bit. Skipped where the native build is the
AVX2 one already (those modules test it)."""
from __future__ import annotations

import ctypes
import os
import shutil

import pytest

from llm_serving.models.kernels import build_kernel, cpu_flags

from .test_batch_invariance import (invariant,  # noqa: F401  (fixtures and tests collected again)
                                    test_a_sequence_gives_the_same_bits_in_any_step,
                                    test_integer_weights_give_a_sequence_the_same_bits_in_any_step_on_any_threads)
from .test_kernel_repack import (repacks, test_a_layer_on_repacked_rows_gives_the_stored_rows_bits_in_any_step,  # noqa: F401
                                 test_repacked_products_equal_the_stored_rows_products_to_the_bit, with_product_calls)
from .test_layer_kernel import (fastest_paths, invariant_mode,  # noqa: F401
                                test_a_prompts_rows_attend_together_as_tiles)

MARCH = "x86-64-v3"


def _native_has_avx512() -> bool:
    return "avx512f" in cpu_flags()


pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                       reason="no C++ compiler on this machine (the runner runs layers op by op)"),
    pytest.mark.skipif(not _native_has_avx512(),
                       reason="this machine's own build is AVX2 already: the other kernel modules test it"),
]


@pytest.fixture(scope="module")
def library_path():
    """The library built with -march=x86-64-v3 (its own cache file: the march is part of the digest)."""
    before = os.environ.get("LLM_SERVING_KERNEL_MARCH")
    os.environ["LLM_SERVING_KERNEL_MARCH"] = MARCH
    try:
        return build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    finally:
        if before is None:
            del os.environ["LLM_SERVING_KERNEL_MARCH"]
        else:
            os.environ["LLM_SERVING_KERNEL_MARCH"] = before


@pytest.fixture(scope="module")
def library(library_path):
    """The AVX2 build, with the argument types test_kernel_repack's calls need."""
    return with_product_calls(ctypes.CDLL(library_path))


def test_the_build_is_avx2s(library_path):
    """The library under test is not the native one: the march reached the compiler (a different cache file)."""
    native = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    assert os.path.exists(library_path) and library_path != native


_TWO_BUILDS = """
import ctypes, sys
import numpy as np
from llm_serving.models.kernels.aot_call import invoke
from tests.unit.test_layer_kernel import logits_args
rng = np.random.default_rng(3)
x = rng.standard_normal((64, 256)).astype(np.float32)
w = rng.standard_normal((1000, 256)).astype(np.float32)
want = (x / np.sqrt((x.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-5)) @ w.T.astype(np.float64)
for path in sys.argv[1:]:
    lib = ctypes.CDLL(path)
    lib.KernelInvariant.argtypes = [ctypes.c_int]
    lib.KernelInvariant(0)
    out = np.empty((64, 1000), np.float32), np.empty(64, np.int32), np.empty(64, np.float32)
    cfg = [np.array([2, 0], np.int32), np.array([1e-5], np.float32)]
    assert invoke(lib.FinalLogits, logits_args(x, w, np.ones(256, np.float32), np.arange(64, dtype=np.int32),
                                               cfg, *out)) == 0
    assert np.abs(out[0] - want).max() < 1e-3 * np.abs(want).max(), path
"""


def test_two_builds_in_one_process_keep_their_own_kernels(library_path):
    """The AVX2 build loaded first, then the native one, in one process (as a test worker that ran this module
    and then another does): each calls its own kernels. Built with GCC's default STB_GNU_UNIQUE statics, the
    native library took the AVX2 library's table of float GEMM kernels (gemm_cpu.h's kernel_for) and crashed on
    its first batched lm_head; -fno-gnu-unique keeps each library's statics its own."""
    import subprocess
    import sys
    from pathlib import Path

    native = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _TWO_BUILDS, library_path, native], cwd=root, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
