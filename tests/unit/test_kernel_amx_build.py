"""The kernel library built with AMX's tiles (LLM_SERVING_KERNEL_MARCH="native -mamx-tile -mamx-int8 -mamx-bf16"),
tested on an AVX-512 machine without them: the build an Intel Xeon with AMX loads, its tile code compiled in and
its tiles off at run time (Linux grants no tile state here), so what such a build does around its tiles runs here:
a model's rows repacked into the AVX2 integer products' panels (RepackRows decides by the model's batch invariance,
since the integer tiles read stored rows and take only steps that are not invariant), the repacked rows' products
and layers equal to the stored rows' to the bit, and batch invariance in any step. The tests are
test_kernel_repack's and test_batch_invariance's, collected again with this module's `library`. Skipped where the
CPU has AMX (its own build is this one: the other modules test it) or no AVX-512 (the tiles' code needs it)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from llm_serving.models.kernels import build_kernel, cpu_flags

from .test_batch_invariance import (invariant,  # noqa: F401  (fixtures and tests collected again)
                                    test_integer_weights_give_a_sequence_the_same_bits_in_any_step_on_any_threads)
from .test_kernel_repack import (  # noqa: F401
    repacks, test_a_layer_on_repacked_rows_gives_the_stored_rows_bits_in_any_step,
    test_a_model_whose_steps_are_not_invariant_keeps_its_rows_where_amx_integer_tiles_read_them,
    test_repacked_products_equal_the_stored_rows_products_to_the_bit, with_product_calls)

MARCH = "native -mamx-tile -mamx-int8 -mamx-bf16"

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                       reason="no C++ compiler on this machine (the runner runs layers op by op)"),
    pytest.mark.skipif("amx_int8" in cpu_flags(),
                       reason="this CPU has AMX: its own build is the AMX build, which the other kernel modules test"),
    pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512_bf16", "avx512vbmi"} <= cpu_flags(),
                       reason="the AMX build's code needs AVX-512 (F, BW, BF16, VBMI), which this CPU lacks"),
    pytest.mark.skipif(bool(os.environ.get("LLM_SERVING_KERNEL_MARCH")),
                       reason="LLM_SERVING_KERNEL_MARCH chooses another build for this run"),
]


@pytest.fixture(scope="module")
def library_path():
    """The library built with AMX's flags (its own cache file: the march is part of the digest)."""
    os.environ["LLM_SERVING_KERNEL_MARCH"] = MARCH
    try:
        return build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    finally:
        del os.environ["LLM_SERVING_KERNEL_MARCH"]


@pytest.fixture(scope="module")
def library(library_path):
    """The AMX build, with the argument types test_kernel_repack's calls need."""
    return with_product_calls(ctypes.CDLL(library_path))


def test_the_build_holds_the_integer_tiles_and_keeps_them_off_here(library_path, library):
    """The library under test is not the native one, its code holds AMX's int8 tile products (TDPBSSD and its
    kin: the flags reached the compiler), and here the tiles are off (KernelInt's bit 1) with the AVX2 integer
    products on (bit 2)."""
    native = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    assert library_path != native
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the library's instructions")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library_path], capture_output=True, text=True,
                          timeout=120).stdout
    assert "tdpbssd" in code or "tdpbsud" in code or "tdpbusd" in code
    assert "tdpbssd" not in subprocess.run(["objdump", "-d", "--no-show-raw-insn", native], capture_output=True,
                                           text=True, timeout=120).stdout
    library.KernelInt.restype = ctypes.c_int
    assert library.KernelInt(-1) == 2

