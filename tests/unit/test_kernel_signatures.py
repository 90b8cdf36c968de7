"""The CPU kernels' parameters by name (models/kernels/signatures.py): the call's argument tuple is built from
the declared list, and a library whose own list (the C++ X-macro, exported as text) differs is refused at build
time with the first difference named. No MindSpore needed."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import numpy as np
import pytest

from llm_serving.models.kernels.signatures import (DECODER_LAYER, FINAL_LOGITS, KERNEL_SIGNATURES, MOE_MLP,
                                                   KernelParam, KernelSignatureError, check_iconfig, check_library,
                                                   check_params)

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                    reason="no C++ compiler on this machine")


def exported(signature) -> str:
    return ",".join(p.describe() for p in signature.params)


def with_inputs(signature, inputs):
    """The signature with these inputs (the first as many as it has call inputs are those)."""
    n = len(signature.call_inputs)
    return dataclasses.replace(signature, call_inputs=tuple(inputs[:n]), held_inputs=tuple(inputs[n:]))


def test_a_matching_list_passes():
    check_params(DECODER_LAYER, exported(DECODER_LAYER))
    check_params(FINAL_LOGITS, exported(FINAL_LOGITS))


def test_two_inputs_swapped_are_named():
    p = list(DECODER_LAYER.inputs)
    i, j = DECODER_LAYER.index("o_w"), DECODER_LAYER.index("gate_w")
    p[i], p[j] = p[j], p[i]                                       # o_w <-> gate_w on the Python side
    with pytest.raises(KernelSignatureError, match=rf"parameter {i} is 'o_w' in the C\+\+ list but 'gate_w'"):
        check_params(with_inputs(DECODER_LAYER, p), exported(DECODER_LAYER), "decoder_layer_cpu.cc")


def test_an_input_missing_on_either_side_is_named():
    p = [q for q in DECODER_LAYER.inputs if q.name != "tree_bits"]
    with pytest.raises(KernelSignatureError, match=r"'tree_bits' \(parameter 5 in the C\+\+ list\) is missing from "
                                                   r"kernels/signatures.py"):
        check_params(with_inputs(DECODER_LAYER, p), exported(DECODER_LAYER))
    with pytest.raises(KernelSignatureError, match=r"'tree_bits' \(parameter 5 in kernels/signatures.py\) is "
                                                   r"missing from the C\+\+ list"):
        check_params(DECODER_LAYER, exported(with_inputs(DECODER_LAYER, p)))
    # a new input declared in Python only, at the end of the inputs
    extra = [*DECODER_LAYER.inputs, KernelParam("token_mask", 2, "int32")]
    with pytest.raises(KernelSignatureError,
                       match=rf"'token_mask' \(parameter {len(DECODER_LAYER.inputs)} in kernels/signatures.py\)"):
        check_params(with_inputs(DECODER_LAYER, extra), exported(DECODER_LAYER))


def test_a_rank_or_dtype_difference_is_named():
    p = list(DECODER_LAYER.inputs)
    p[3] = KernelParam("block_tables", 1, "int32")
    with pytest.raises(KernelSignatureError, match=r"parameter 3 is 'block_tables:2:int32' in the C\+\+ list but "
                                                   r"'block_tables:1:int32'"):
        check_params(with_inputs(DECODER_LAYER, p), exported(DECODER_LAYER))


def test_the_held_inputs_are_ordered_by_name_and_the_call_checked():
    held = {p.name: p.name for p in reversed(FINAL_LOGITS.held_inputs)}
    assert FINAL_LOGITS.held(**held) == ("lm_head", "gain", "iconfig", "fconfig")
    with pytest.raises(TypeError, match="no value for its input 'gain'"):
        FINAL_LOGITS.held(lm_head=1, iconfig=2, fconfig=3)
    with pytest.raises(TypeError, match="no input named 'x' here"):
        FINAL_LOGITS.held(**held, x=0)

    class Model:
        def fused_logits(self, x, slots):
            pass

        def swapped(self, slots, x):
            pass

        def short(self, x):
            pass

    FINAL_LOGITS.check_call(Model().fused_logits)
    with pytest.raises(TypeError, match="argument 0 should be 'x', not 'slots'"):
        FINAL_LOGITS.check_call(Model().swapped)
    with pytest.raises(TypeError, match="argument 1 should be 'slots', not None"):
        FINAL_LOGITS.check_call(Model.short)


def test_args_put_each_named_value_in_its_place():
    values = {p.name: np.full(1, i, np.int32) for i, p in enumerate(reversed(FINAL_LOGITS.inputs))}
    args = FINAL_LOGITS.args(**values)
    assert [a is values[p.name] for a, p in zip(args, FINAL_LOGITS.inputs)] == [True] * len(FINAL_LOGITS.inputs)
    assert DECODER_LAYER.index("x") == 0 and DECODER_LAYER.index("out") == len(DECODER_LAYER.inputs)
    values = {p.name: p.name for p in DECODER_LAYER.inputs}
    assert DECODER_LAYER.args(**values)[DECODER_LAYER.index("lora_down_b")] == "lora_down_b"
    del values["lora"]
    with pytest.raises(TypeError, match="no value for its input 'lora'"):
        DECODER_LAYER.args(**values)
    with pytest.raises(TypeError, match="no input named 'loras'"):
        DECODER_LAYER.args(**values, lora=1, loras=2)


@needs_compiler
def test_a_library_with_another_list_is_refused(tmp_path):
    """A small variant of the kernel source: its list has two inputs in the other order; another exports none."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    swapped = exported(DECODER_LAYER).replace("positions:1:int32,slots:1:int32", "slots:1:int32,positions:1:int32")
    sources = {"swapped": f'extern "C" const char* DecoderLayerParams() {{ return "{swapped}"; }}\n',
               "silent": 'extern "C" int DecoderLayer() { return 0; }\n'}
    libs = {}
    for name, text in sources.items():
        (tmp_path / f"{name}.cc").write_text(text)
        libs[name] = tmp_path / f"{name}.so"
        subprocess.run([cxx, "-shared", "-fPIC", "-o", str(libs[name]), str(tmp_path / f"{name}.cc")], check=True)
    with pytest.raises(KernelSignatureError, match="parameter 1 is 'slots' in the C\\+\\+ list but 'positions'"):
        check_library(libs["swapped"], (DECODER_LAYER,), "swapped.cc")
    with pytest.raises(KernelSignatureError, match="swapped.cc exports no FinalLogitsParams"):
        check_library(libs["swapped"], (FINAL_LOGITS,), "swapped.cc")
    with pytest.raises(KernelSignatureError, match="exports no DecoderLayerParams"):
        check_library(libs["silent"], (DECODER_LAYER,))


def test_an_iconfig_is_built_by_its_entries_names():
    values = {name: i for i, name in enumerate(reversed(DECODER_LAYER.iconfig))}
    icfg = DECODER_LAYER.iconfig_array(**values)
    assert icfg.dtype == np.int32 and list(icfg) == [values[n] for n in DECODER_LAYER.iconfig]
    assert icfg[DECODER_LAYER.iconfig_index("window")] == values["window"]
    del values["mlp"]
    with pytest.raises(TypeError, match="DecoderLayer's iconfig: no value for its entry 'mlp'"):
        DECODER_LAYER.iconfig_array(**values)
    with pytest.raises(TypeError, match="no entry named 'mlp_bias' here"):
        DECODER_LAYER.iconfig_array(**values, mlp=1, mlp_bias=0)
    with pytest.raises(KeyError, match="MoeMlp's iconfig has no entry 'window'"):
        MOE_MLP.iconfig_index("window")


def test_an_iconfig_list_that_differs_is_named():
    names = list(DECODER_LAYER.iconfig)
    check_iconfig(DECODER_LAYER, ",".join(names))
    i, j = names.index("qk_norm"), names.index("sandwich_norms")
    swapped = names.copy()
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(KernelSignatureError, match=rf"DecoderLayer's iconfig: entry {i} is 'sandwich_norms' in the "
                                                   r"C\+\+ list but 'qk_norm' in kernels/signatures.py"):
        check_iconfig(DECODER_LAYER, ",".join(swapped))
    with pytest.raises(KernelSignatureError, match=r"'attention_sinks' \(entry 17 in kernels/signatures.py\) is "
                                                   r"missing from the C\+\+ list"):
        check_iconfig(DECODER_LAYER, ",".join(n for n in names if n != "attention_sinks"))
    with pytest.raises(KernelSignatureError, match=r"'rope_scale' \(entry 22 in the C\+\+ list\) is missing from "
                                                   r"kernels/signatures.py"):
        check_iconfig(DECODER_LAYER, ",".join([*names, "rope_scale"]))


@needs_compiler
def test_a_library_with_another_iconfig_list_is_refused(tmp_path):
    """A library whose parameters agree but whose iconfig names another entry (or has no list) is refused by the
    build's check, the entry named."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    params = f'extern "C" const char* DecoderLayerParams() {{ return "{exported(DECODER_LAYER)}"; }}\n'
    renamed = ",".join(DECODER_LAYER.iconfig).replace("gated_mlp", "ungated_mlp")
    sources = {"renamed": params + f'extern "C" const char* DecoderLayerIconfig() {{ return "{renamed}"; }}\n',
               "unlisted": params}
    libs = {}
    for name, text in sources.items():
        (tmp_path / f"{name}.cc").write_text(text)
        libs[name] = tmp_path / f"{name}.so"
        subprocess.run([cxx, "-shared", "-fPIC", "-o", str(libs[name]), str(tmp_path / f"{name}.cc")], check=True)
    at = DECODER_LAYER.iconfig.index("gated_mlp")
    with pytest.raises(KernelSignatureError, match=rf"renamed.cc: DecoderLayer's iconfig: 'gated_mlp' \(entry {at} in "
                                                   r"kernels/signatures.py\) is missing from the C\+\+ list"):
        check_library(libs["renamed"], (DECODER_LAYER,), "renamed.cc")
    with pytest.raises(KernelSignatureError, match="unlisted.cc exports no DecoderLayerIconfig"):
        check_library(libs["unlisted"], (DECODER_LAYER,), "unlisted.cc")


def test_every_kernel_of_the_layer_library_declares_its_iconfig():
    assert all(sig.iconfig for sig in KERNEL_SIGNATURES["decoder_layer_cpu"])
