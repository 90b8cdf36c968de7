"""GGUF checkpoints and the LLaMA family's config.json variants, read by models/weights/ (no MindSpore).

The GGUF files are written here with the `gguf` package the way llama.cpp's converter writes them (metadata under
the architecture's name, tensors renamed, a llama model's q/k rows permuted for llama.cpp's RoPE), from random HF
checkpoints, so each GGUF has a safetensors twin to compare with. What a correct loader must return for a
quantized tensor is computed here on its own: llama.cpp's form of the twin's tensor, quantized and dequantized by
`gguf.quants`, then un-permuted by the inverse written below (not the loader's).

The family's other members (Qwen3, Gemma 3 and its multimodal form, Phi-3, SmolLM3, Mistral's and Qwen2's sliding
windows) are made by transformers itself (tests/families.py, once per module) and written as GGUF twins as
llama.cpp's converter writes them; their internal tensors are checked against the checkpoint's own, mapped here
independently of the readers."""
import dataclasses
import json
import math
import shutil
import tracemalloc

import numpy as np
import pytest

from llm_serving.models.default_model import write_hf_llama
from llm_serving.models.parallel import TensorParallel
from llm_serving.models.weights import (WeightLoadError, expected_shapes, llama3_rope_factors, load_config,
                                        load_llama_weights, load_quantized, model_shape)
from llm_serving.models.weights.gguf import KEPT_QUANTIZED
from tests.families import (FAMILIES, config_json_v4, make_hf_model, needs_transformers, transformers_greedy,
                            transformers_logits)
from tests.families import write_gguf as family_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """GGUF loads cache their float32 tensors under LLM_SERVING_CACHE: a directory of this test's own."""
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=128)
WIDE = dict(hidden_size=256, intermediate_size=256)         # rows of 256: whole blocks of every quantized type
HEAD_DIM = 16


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from rotate-half to interleaved pairs, as its RoPE wants."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The converter's permutation undone: row 2j+h of a head goes back to row h*D/2+j."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, i, rest = hf.split(".", 3)
        return f"blk.{i}.{LAYER_NAMES[rest]}"
    return TOP_NAMES[hf]


def _permuted_heads(name: str, heads=4, kv_heads=2):
    """How many heads llama.cpp permutes tensor `name` (HF) over: q by head_count, k by head_count_kv."""
    if name.endswith("self_attn.q_proj.weight"):
        return heads
    return kv_heads if name.endswith("self_attn.k_proj.weight") else None


def write_gguf(path, weights: dict, *, arch="llama", qtype=Q.F32, theta=10000.0, heads=4, kv_heads=2,
               rope_freqs=None, raw=None, rope_scaling=None, fuse_qkv=False):
    """A GGUF of HF-named float32 `weights`; 2-D tensors stored as `qtype`, 1-D ones as F32 (as llama.cpp does).
    `raw`: {GGUF name: (uint8 blocks, type)} stored instead of that tensor (types gguf cannot quantize);
    `rope_scaling`: (type, factor) as `<arch>.rope.scaling.*` metadata; `fuse_qkv`: each layer's q/k/v (q and k
    permuted first) as one `attn_qkv`, as the converter's --fuse-qkv writes them."""
    raw = raw or {}
    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(weights["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(theta)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    fused = {}
    for name, arr in weights.items():
        out = gguf_name(name)
        if fuse_qkv and out.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
            n_head = _permuted_heads(name, heads, kv_heads) if arch == "llama" else None
            fused.setdefault(out.rsplit(".", 2)[0], {})[out] = _llama_cpp_permute(arr, n_head) if n_head else arr
            continue
        if out in raw:
            blocks, raw_type = raw[out]
            w.add_tensor(out, blocks, raw_dtype=raw_type)
            continue
        n_head = _permuted_heads(name, heads, kv_heads) if arch == "llama" else None
        arr = np.ascontiguousarray(_llama_cpp_permute(arr, n_head) if n_head else arr, np.float32)
        if arr.ndim == 2 and qtype != Q.F32:
            w.add_tensor(out, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(out, arr)
    for layer, parts in fused.items():
        w.add_tensor(f"{layer}.attn_qkv.weight", np.ascontiguousarray(np.concatenate(
            [parts[f"{layer}.attn_{p}.weight"] for p in "qkv"]), np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _through_the_file(name: str, arr: np.ndarray, qtype) -> np.ndarray:
    """What a correct loader returns for HF tensor `name` written by write_gguf as `qtype` (arch llama)."""
    n_head = _permuted_heads(name)
    stored = _llama_cpp_permute(arr, n_head) if n_head else arr
    if arr.ndim == 2 and qtype != Q.F32:
        stored = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(stored), qtype), qtype)
    return _llama_cpp_unpermute(stored, n_head) if n_head else stored


def _random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random K-quant blocks (gguf can dequantize K-quants but not make them) with finite f16 super-block
    scales: bytes 0-3 (d, dmin) of Q4_K/Q5_K, the last two (d) of Q6_K, the last four (d, dmin) of Q2_K."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scale = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    for at in {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (size - 2,), Q.Q2_K: (size - 4, size - 2)}[qtype]:
        blocks[:, at:at + 2] = scale
    return blocks.reshape(rows, cols // block * size)


def _rank1_of_2(name: str, arr: np.ndarray) -> np.ndarray:
    """Megatron's split written out: rank 1 of 2 holds the second half of q/k/v/gate/up rows (and q/k/v biases)
    and of o/down columns; every other tensor whole."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                      "_proj.bias")):
        return arr[arr.shape[0] // 2:]
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return arr[:, arr.shape[1] // 2:]
    return arr


def _hf(tmp_path, tie=False, **overrides):
    out = write_hf_llama(tmp_path / "hf", seed=3, tie_word_embeddings=tie, **{**SHAPE, **overrides})
    return out, load_llama_weights(out)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_f32_gguf_loads_to_its_safetensors_twin(tmp_path, tie):
    hf, (cfg, ref) = _hf(tmp_path, tie=tie)
    stored = {k: v for k, v in ref.items() if not (tie and k == "lm_head.weight")}
    cfg2, got = load_llama_weights(write_gguf(tmp_path / "m.gguf", stored))
    assert set(got) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)   # the q/k permutation undone exactly
    assert (cfg2.num_heads, cfg2.num_kv_heads, cfg2.head_dim, cfg2.tie_word_embeddings) == (4, 2, HEAD_DIM, tie)
    assert (cfg2.vocab_size, cfg2.intermediate_size, cfg2.num_layers) == (64, 96, 2)
    assert (cfg2.rope_theta, cfg2.rope_freq_factors, cfg2.attention_bias, cfg2.architecture) == \
        (10000.0, None, False, "llama")


QUANTIZED = [(Q.F16, 1e-3), (Q.BF16, 0.01), (Q.Q8_0, 0.02), (Q.Q5_0, 0.1), (Q.Q5_1, 0.1), (Q.Q4_0, 0.25),
             (Q.Q4_1, 0.2)]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("qtype,tolerance", QUANTIZED, ids=[q.name for q, _ in QUANTIZED])
def test_quantized_gguf_loads_to_its_dequantized_twin(tmp_path, qtype, tolerance, tie):
    """Each tensor equals gguf's own round trip of it (exactly: the permutation and row placement are right) and
    is within the type's error of the float32 original (relative to the tensor's largest value)."""
    _, (cfg, ref) = _hf(tmp_path, tie=tie, **WIDE)
    stored = {k: v for k, v in ref.items() if not (tie and k == "lm_head.weight")}
    cfg2, got = load_llama_weights(write_gguf(tmp_path / "m.gguf", stored, qtype=qtype))
    assert set(got) == set(ref) and cfg2.tie_word_embeddings == tie
    for name, arr in ref.items():
        np.testing.assert_array_equal(got[name], _through_the_file(name, arr, qtype), err_msg=name)
        err = np.abs(got[name] - arr).max() / np.abs(arr).max()
        assert err <= tolerance, (name, err)
        if arr.ndim == 2 and qtype != Q.F16:        # F16 of 0.02-scale values may be exact for some tensors
            assert err > 0, name                       # really stored quantized, not F32


def test_k_quant_tensors_are_read_in_place(tmp_path, monkeypatch):
    """K-quants (gguf dequantizes them but cannot make them): random Q4_K/Q5_K/Q6_K blocks in q, k, down and the
    embedding come back as gguf's dequantization of them, q/k rows un-permuted, next to F32 tensors; a tensor-
    parallel rank's part of them read from the file itself (no float32 cache) is the cut of the whole."""
    monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    _, (_, ref) = _hf(tmp_path, **WIDE)
    rng = np.random.default_rng(5)
    quantized = {"blk.0.attn_q.weight": (256, 256, Q.Q4_K, 4), "blk.1.attn_k.weight": (128, 256, Q.Q6_K, 2),
                 "blk.0.ffn_down.weight": (256, 256, Q.Q5_K, None), "token_embd.weight": (64, 256, Q.Q4_K, None)}
    raw = {name: (_random_k_blocks(rows, cols, qtype, rng), qtype)
           for name, (rows, cols, qtype, _) in quantized.items()}
    path = write_gguf(tmp_path / "k.gguf", ref, raw=raw)
    _, got = load_llama_weights(path)
    expected = dict(ref)
    for hf in ref:
        if gguf_name(hf) in raw:
            blocks, qtype = raw[gguf_name(hf)]
            whole = gguf.quants.dequantize(blocks, qtype)
            n_head = quantized[gguf_name(hf)][3]
            expected[hf] = _llama_cpp_unpermute(whole, n_head) if n_head else whole
            assert np.isfinite(whole).all() and np.abs(whole).max() > 0
    expected["lm_head.weight"] = ref["lm_head.weight"]
    for name, arr in expected.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)
    _, part = load_llama_weights(path, TensorParallel(rank=1, world=2))
    for name, arr in part.items():
        np.testing.assert_array_equal(arr, _rank1_of_2(name, expected[name]), err_msg=name)


KEPT = [(Q.Q4_0, 2), (Q.Q4_1, 3), (Q.Q5_0, 6), (Q.Q5_1, 7), (Q.Q8_0, 8), (Q.F16, 1), (Q.BF16, 30)]


@pytest.mark.parametrize("cached", [False, True], ids=["from-file", "from-cache"])
@pytest.mark.parametrize("qtype,code", KEPT, ids=[q.name for q, _ in KEPT])
def test_quantized_matrices_are_kept_as_stored(tmp_path, monkeypatch, qtype, code, cached):
    """load_quantized: every 2-D matrix, the embedding too, as the file's blocks, rows in the float32 loader's
    order (q/k un-permuted), so that dequantizing them gives exactly load_llama_weights' rows; the same from the
    cache (which holds only the blocks of these); a tied lm_head is the embedding's blocks, the same object;
    num_layers drops the other layers; `skip` leaves them out of the float32 weights."""
    if not cached:
        monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    _, (_, ref) = _hf(tmp_path, tie=True, **WIDE)
    path = write_gguf(tmp_path / "m.gguf", {k: v for k, v in ref.items() if k != "lm_head.weight"}, qtype=qtype)
    _, f32 = load_llama_weights(path)                     # (writes the cache when it is on)
    kept = load_quantized(path)
    assert set(kept) == {n for n, a in ref.items() if a.ndim == 2} | {"lm_head.weight"}
    assert kept["lm_head.weight"] is kept["model.embed_tokens.weight"]
    for name, t in kept.items():
        assert (t.qtype, t.shape, t.data.dtype) == (code, f32[name].shape, np.uint8), name
        rows = gguf.quants.dequantize(t.data, qtype).reshape(t.shape)
        np.testing.assert_array_equal(rows, f32[name], err_msg=name)
    assert set(load_quantized(path, num_layers=1)) == {n for n in kept if not n.startswith("model.layers.1.")}
    _, rest = load_llama_weights(path, skip=frozenset(kept))
    assert set(rest) == set(f32) - set(kept) and all(a.ndim == 1 for a in rest.values())      # the norms


def test_k_quant_matrices_are_kept_as_stored(tmp_path, monkeypatch):
    """Q4_K/Q5_K/Q6_K matrices (random blocks: gguf cannot make them) are kept as stored too, beside the file's
    Q8_0 ones: q/k rows un-permuted as whole rows of super-blocks, so that dequantizing them gives exactly
    load_llama_weights' rows."""
    monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    _, (_, ref) = _hf(tmp_path, **WIDE)
    rng = np.random.default_rng(7)
    quantized = {"blk.0.attn_q.weight": (256, 256, Q.Q4_K, 12), "blk.1.attn_k.weight": (128, 256, Q.Q6_K, 14),
                 "blk.0.ffn_down.weight": (256, 256, Q.Q5_K, 13)}
    raw = {name: (_random_k_blocks(rows, cols, qtype, rng), qtype) for name, (rows, cols, qtype, _) in quantized.items()}
    path = write_gguf(tmp_path / "k.gguf", ref, qtype=Q.Q8_0, raw=raw)
    _, f32 = load_llama_weights(path)
    kept = load_quantized(path)
    for hf in ref:
        if gguf_name(hf) not in raw:
            continue
        t, (_, _, qtype, code) = kept[hf], quantized[gguf_name(hf)]
        assert (t.qtype, t.shape, t.data.dtype) == (code, ref[hf].shape, np.uint8), hf
        np.testing.assert_array_equal(gguf.quants.dequantize(t.data, qtype).reshape(t.shape), f32[hf], err_msg=hf)
    assert kept["model.layers.1.self_attn.q_proj.weight"].qtype == 8


def test_only_the_kernels_block_types_are_kept(tmp_path):
    """F32 matrices, types the layer kernel does not read (Q2_K here) and other checkpoint formats: not kept."""
    hf, (_, ref) = _hf(tmp_path, **WIDE)
    assert load_quantized(write_gguf(tmp_path / "f32.gguf", ref)) == {}
    assert load_quantized(hf) == {}
    blocks = np.random.default_rng(1).integers(0, 256, (256, 256 // 256 * 84), dtype=np.uint8)
    blocks.reshape(-1, 84)[:, 80:84] = np.full((256, 2), 0.01, np.float16).view(np.uint8)    # Q2_K's d, dmin
    raw = {"blk.0.attn_q.weight": (blocks, Q.Q2_K)}
    kept = load_quantized(write_gguf(tmp_path / "mixed.gguf", ref, qtype=Q.Q8_0, raw=raw))
    assert "model.layers.0.self_attn.q_proj.weight" not in kept
    assert "model.layers.1.self_attn.q_proj.weight" in kept and "lm_head.weight" in kept


def test_the_stored_types_are_the_kept_matrices_types(tmp_path):
    """stored_types (what the layer kernel is built for before the load): the types load_quantized keeps, from
    the header alone; none for a float checkpoint; None for what cannot be read."""
    from llm_serving.models.weights import stored_types
    from llm_serving.models.weights.gguf import KEPT_QUANTIZED

    hf, (_, ref) = _hf(tmp_path, **WIDE)
    blocks = np.random.default_rng(1).integers(0, 256, (256, 256 // 256 * 84), dtype=np.uint8)
    blocks.reshape(-1, 84)[:, 80:84] = np.full((256, 2), 0.01, np.float16).view(np.uint8)    # Q2_K's d, dmin
    mixed = write_gguf(tmp_path / "mixed.gguf", ref, qtype=Q.Q8_0, raw={"blk.0.attn_q.weight": (blocks, Q.Q2_K)})
    kept = {name for t in load_quantized(mixed).values() for name, code in KEPT_QUANTIZED.items() if code == t.qtype}
    assert stored_types(mixed) == kept == {"Q8_0"}                       # (Q2_K: dequantized, not kept)
    assert stored_types(write_gguf(tmp_path / "q41.gguf", ref, qtype=Q.Q4_1)) >= {"Q4_1"}
    assert stored_types(write_gguf(tmp_path / "f32.gguf", ref)) == frozenset() == stored_types(hf)
    assert stored_types(tmp_path / "missing.gguf") is None


def test_a_type_the_kernels_do_not_read_is_dequantized_with_a_logged_line(tmp_path, caplog):
    """A matrix in a type outside KEPT_QUANTIZED (Q2_K here) becomes float32, and the load says so: its type,
    how many, and the memory the copies take; the matrices kept as stored (skipped) are not named."""
    import logging

    hf, (_, ref) = _hf(tmp_path, **WIDE)
    raw = {"blk.0.attn_q.weight": (_random_k_blocks(256, 256, Q.Q2_K, np.random.default_rng(1)), Q.Q2_K)}
    path = write_gguf(tmp_path / "mixed.gguf", ref, qtype=Q.Q8_0, raw=raw)
    kept = load_quantized(path)
    assert "model.layers.0.self_attn.q_proj.weight" not in kept
    with caplog.at_level(logging.INFO, logger="llm_serving.models.weights.loader"):
        _, got = load_llama_weights(path, skip=frozenset(kept))
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (256, 256)
    lines = [r.getMessage() for r in caplog.records if "dequantized to float32" in r.getMessage()]
    assert lines == [f"1 Q2_K matrices dequantized to float32: {256 * 256 * 4 / 1e6:.1f} MB in memory (the CPU "
                     f"kernels read F32, {', '.join(sorted(KEPT_QUANTIZED))} as stored)"]


def test_qwen2_gguf_keeps_hf_layout_and_biases(tmp_path):
    hf, (_, ref) = _hf(tmp_path)
    rng = np.random.default_rng(0)
    for i in range(2):
        for part, rows in (("q", 4 * HEAD_DIM), ("k", 2 * HEAD_DIM), ("v", 2 * HEAD_DIM)):
            ref[f"model.layers.{i}.self_attn.{part}_proj.bias"] = rng.standard_normal(rows).astype(np.float32)
    cfg, got = load_llama_weights(write_gguf(tmp_path / "q.gguf", ref, arch="qwen2", theta=1e6))
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.rope_theta == 1e6
    assert set(got) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_fused_attn_qkv_is_split_and_its_q_k_rows_unpermuted(tmp_path, monkeypatch, arch):
    """llama.cpp's converter fuses q/k/v on request (--fuse-qkv), after permuting q and k: each part is read as its
    own rows, un-permuted for llama's RoPE, and a tensor-parallel rank's part is the cut of the whole."""
    monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    _, (_, ref) = _hf(tmp_path)
    path = write_gguf(tmp_path / "fused.gguf", ref, arch=arch, fuse_qkv=True)
    assert "blk.0.attn_qkv.weight" in {t.name for t in gguf.GGUFReader(str(path)).tensors}
    _, got = load_llama_weights(path)
    assert set(got) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    _, part = load_llama_weights(path, TensorParallel(rank=1, world=2))
    for name, arr in part.items():
        np.testing.assert_array_equal(arr, _rank1_of_2(name, ref[name]), err_msg=name)


def test_gguf_rope_freqs_become_the_frequency_divisors(tmp_path):
    _, (_, ref) = _hf(tmp_path)
    factors = np.linspace(1.0, 8.0, HEAD_DIM // 2)
    cfg, _ = load_llama_weights(write_gguf(tmp_path / "m.gguf", ref, rope_freqs=factors))
    np.testing.assert_allclose(cfg.rope_freq_factors, factors, rtol=1e-6)


def _config_or_refusal(path):
    try:
        return load_llama_weights(path)[0]
    except WeightLoadError as e:
        return e


def test_gguf_rope_scaling_metadata_is_applied_or_refused(tmp_path):
    """llama.cpp writes a linear-scaled model's scaling as `<arch>.rope.scaling.type/factor` (not rope_freqs):
    it must reach rope_freq_factors as the HF form's does (a divisor of 4 for every frequency);
    YaRN, which the HF path refuses, must be refused here too."""
    _, (_, ref) = _hf(tmp_path)
    linear = _config_or_refusal(write_gguf(tmp_path / "linear.gguf", ref, rope_scaling=("linear", 4.0)))
    assert not isinstance(linear, WeightLoadError) and linear.rope_freq_factors == (4.0,) * (HEAD_DIM // 2), linear
    yarn = _config_or_refusal(write_gguf(tmp_path / "yarn.gguf", ref, rope_scaling=("yarn", 4.0)))
    assert isinstance(yarn, WeightLoadError), yarn


@pytest.mark.parametrize("cache", ["off", "on"])
def test_gguf_tensor_parallel_part_equals_the_cut_of_the_whole(tmp_path, monkeypatch, cache):
    """Rank 1 of 2 holds the second half of q/k/v/gate/up rows and o/down columns, for F32 and Q8_0, read from
    the file itself (cache off) or from the float32 cache that its own (first) load writes."""
    if cache == "off":
        monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    _, (_, ref) = _hf(tmp_path, **WIDE)
    for qtype in (Q.F32, Q.Q8_0):
        path = write_gguf(tmp_path / f"m{qtype.name}.gguf", ref, qtype=qtype)
        _, part = load_llama_weights(path, TensorParallel(rank=1, world=2))
        _, whole = load_llama_weights(path)
        assert set(part) == set(whole) - {"lm_head.weight", "model.norm.weight"}   # logits tensors: rank 0 only
        assert part["model.layers.0.self_attn.k_proj.weight"].shape == (64, 256)     # one kv head (of 64 rows) of two
        for name, arr in part.items():
            np.testing.assert_array_equal(arr, _rank1_of_2(name, whole[name]), err_msg=name)


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    _, (_, ref) = _hf(tmp_path)
    with pytest.raises(WeightLoadError, match="GGUF architecture 'gemma' is not supported"):
        load_llama_weights(write_gguf(tmp_path / "g.gguf", ref, arch="gemma"))


def test_a_tensor_type_gguf_cannot_dequantize_is_refused(tmp_path):
    """Q8_1 (llama.cpp's activation type) can be stored in a GGUF but this gguf package cannot dequantize it."""
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), Q.Q8_1)
        pytest.skip("this gguf version dequantizes Q8_1: no stored type is left to refuse")
    except NotImplementedError:
        pass
    _, (_, ref) = _hf(tmp_path, **WIDE)
    raw = {"blk.1.ffn_up.weight": (np.zeros((256, 256 // block * size), np.uint8), Q.Q8_1)}
    with pytest.raises(WeightLoadError, match="tensor 'blk.1.ffn_up.weight' has type Q8_1, which the gguf "
                                              "package cannot dequantize"):
        load_llama_weights(write_gguf(tmp_path / "q.gguf", ref, raw=raw))


def _config(tmp_path, **changes) -> str:
    hf, _ = _hf(tmp_path)
    raw = json.loads((hf / "config.json").read_text())
    raw.update(changes)
    (hf / "config.json").write_text(json.dumps(raw))
    return str(hf)


def _llama31_divisors(head_dim, theta, factor, low, high, original):
    """Llama-3.1's rule (Meta's apply_scaling) written out again, per frequency: wavelengths over original/low
    slowed by `factor`, under original/high kept, between them blended linearly in original/wavelength."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * np.pi / freq
        if wavelength < original / high:
            scaled = freq
        elif wavelength > original / low:
            scaled = freq / factor
        else:
            smooth = (original / wavelength - low) / (high - low)
            scaled = (1 - smooth) * freq / factor + smooth * freq
        out.append(freq / scaled)
    return np.array(out)


def test_llama3_rope_scaling_in_transformers_4_and_5_forms(tmp_path):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}     # wavelengths 16..64 blended: 32.4 is one
    v4 = load_config(_config(tmp_path / "a", rope_theta=500000.0, rope_scaling=llama3))
    v5 = load_config(_config(tmp_path / "b", rope_parameters={**llama3, "rope_theta": 500000.0}))
    assert v4 == v5 and v4.rope_theta == 500000.0
    expected = _llama31_divisors(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0, 64)
    np.testing.assert_allclose(v4.rope_freq_factors, expected, rtol=1e-12)
    assert v4.rope_freq_factors[0] == 1.0 and v4.rope_freq_factors[-1] == 8.0     # both ends of the band
    assert 1.0 < v4.rope_freq_factors[1] < 8.0                                     # and one inside it
    assert llama3_rope_factors(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0, 64) == v4.rope_freq_factors
    # no scaling in either form: theta alone
    plain5 = load_config(_config(tmp_path / "c", rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (plain5.rope_theta, plain5.rope_freq_factors) == (1e6, None)
    linear = load_config(_config(tmp_path / "d", rope_scaling={"type": "linear", "factor": 4.0}))
    assert linear.rope_freq_factors == (4.0,) * (HEAD_DIM // 2)


def test_architectures_and_sliding_windows_from_config_json(tmp_path):
    """Sliding windows are served: Mistral's (every layer), Qwen2's with use_sliding_window (the layers from
    max_window_layers on, 4.x's rule when config.json has no layer_types), Phi-3-mini-4k's 2047 (every layer); a
    Qwen2 config's window without use_sliding_window is not one. Other architectures and RoPE types are refused."""
    qwen = load_config(_config(tmp_path / "c", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                               sliding_window=32768, rope_theta=1e6))
    assert qwen.architecture == "qwen2" and qwen.attention_bias and qwen.sliding_window is None
    mistral = load_config(_config(tmp_path / "d", architectures=["MistralForCausalLM"], sliding_window=64))
    assert mistral.architecture == "mistral" and mistral.sliding_window == 64 and not mistral.attention_bias
    assert mistral.layer_types is None and [mistral.layer_window(i) for i in range(2)] == [64, 64]
    qwen_swa = load_config(_config(tmp_path / "g", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                   sliding_window=8, max_window_layers=1))
    assert (qwen_swa.sliding_window, qwen_swa.layer_types) == (8, ("full", "sliding"))
    assert [qwen_swa.layer_window(i) for i in range(2)] == [None, 8]
    everywhere = load_config(_config(tmp_path / "h", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                                     sliding_window=8, max_window_layers=0))
    assert (everywhere.sliding_window, everywhere.layer_types) == (8, None)
    phi3 = load_config(_config(tmp_path / "i", architectures=["Phi3ForCausalLM"], sliding_window=2047,
                               max_position_embeddings=4096, original_max_position_embeddings=4096, rope_scaling=None))
    assert (phi3.sliding_window, phi3.layer_types, phi3.rope_original_context) == (2047, None, None)
    phi4 = load_config(_config(tmp_path / "j", architectures=["Phi3ForCausalLM"], sliding_window=262144,
                               max_position_embeddings=131072))        # Phi-4-mini's: as long as the context
    assert (phi4.sliding_window, phi4.layer_types) == (None, None)
    with pytest.raises(WeightLoadError, match="GemmaForCausalLM"):
        load_config(_config(tmp_path / "e", architectures=["GemmaForCausalLM"]))
    with pytest.raises(WeightLoadError, match="RoPE scaling type 'dynamic'"):
        load_config(_config(tmp_path / "f", rope_scaling={"rope_type": "dynamic", "factor": 4.0,
                                                          "original_max_position_embeddings": 32}))


def test_qwen2_safetensors_biases_are_required_and_loaded(tmp_path):
    hf, (_, ref) = _hf(tmp_path)
    raw = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(WeightLoadError, match="self_attn.q_proj.bias' is missing"):
        load_llama_weights(hf)
    from safetensors.numpy import save_file
    rng = np.random.default_rng(1)
    for i in range(2):
        for part, rows in (("q", 64), ("k", 32), ("v", 32)):
            ref[f"model.layers.{i}.self_attn.{part}_proj.bias"] = rng.standard_normal(rows).astype(np.float32)
    save_file(ref, str(hf / "model.safetensors"))
    _, got = load_llama_weights(hf)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)


@pytest.mark.parametrize("cache", ["off", "on"])
def test_loading_a_quantized_gguf_peaks_under_twice_the_float32_model(tmp_path, monkeypatch, cache):
    if cache == "off":
        monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=512, num_layers=4, vocab_size=512)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q4_1)
    size = sum(a.nbytes for a in ref.values())
    assert size > 4_000_000
    del ref
    tracemalloc.start()
    _, got = load_llama_weights(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(a.nbytes for a in got.values()) == size
    assert peak < 2 * size, (peak, size)


def test_a_gguf_is_read_once_then_from_the_cache(tmp_path, private_cache, monkeypatch):
    """The cache holds float32 arrays only of what the kernels do not read as stored (here the norms). Of the Q8_0
    matrices it keeps where their bytes lie in the file (regions.json, memory-mapped from the file at load), and the
    bytes themselves only of those whose rows the reader reorders (a llama GGUF's q and k: interleaved RoPE rows put
    in rotate-half order); a float32 reader dequantizes either. So the cache is a small part of the file."""
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q8_0, rope_freqs=np.linspace(1, 4, 8))
    cfg, first = load_llama_weights(path)
    [entry] = (private_cache / "gguf").iterdir()
    assert (entry / "config.json").is_file()
    reordered = {n for n, a in first.items() if a.ndim == 2 and n.endswith(("q_proj.weight", "k_proj.weight"))}
    assert {p.name for p in entry.glob("*.npy")} == \
        {f"{n}.npy" for n, a in first.items() if a.ndim == 1} | {f"{n}.blocks.npy" for n in reordered}
    regions = json.loads((entry / "regions.json").read_text())
    assert set(regions) == {n for n, a in first.items() if a.ndim == 2} - reordered          # Q8_0 kept in place
    written = sum(p.stat().st_size for p in entry.iterdir())
    assert written < 0.35 * path.stat().st_size, (written, path.stat().st_size)
    from llm_serving.models.weights import gguf as gguf_weights
    monkeypatch.setattr(gguf_weights, "_load_gguf", lambda p: pytest.fail("the GGUF was read again"))
    cfg2, again = load_llama_weights(path)
    assert cfg2 == cfg
    for name in first:
        np.testing.assert_array_equal(again[name], first[name], err_msg=name)
    monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")                   # switched off: the file itself is read
    with pytest.raises(pytest.fail.Exception, match="read again"):
        load_llama_weights(path)
    monkeypatch.delenv("LLM_SERVING_GGUF_CACHE")
    path.touch()                                                         # a changed file is a new cache entry
    monkeypatch.undo()
    monkeypatch.setenv("LLM_SERVING_CACHE", str(private_cache))
    load_llama_weights(path)
    assert len(list((private_cache / "gguf").iterdir())) == 2


def test_a_cached_gguf_s_shape_maps_none_of_its_tensors(tmp_path, private_cache, monkeypatch):
    """model_shape (the master's sizing before every load) reads a cached GGUF's config.json alone: none of its
    tensors is memory-mapped. On a first start it fills the cache, and its config is the one the load reads."""
    from llm_serving.models.weights import gguf as gguf_weights
    from llm_serving.models.weights.loader import model_shape

    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q8_0)
    first = model_shape(str(path))
    assert (next((private_cache / "gguf").iterdir()) / "config.json").is_file()
    cfg, _ = load_llama_weights(path)
    assert first == cfg
    monkeypatch.setattr(gguf_weights, "_load_gguf", lambda p: pytest.fail("the GGUF was read again"))
    monkeypatch.setattr(np, "load", lambda *a, **k: pytest.fail("a tensor was mapped"))
    monkeypatch.setattr(np, "memmap", lambda *a, **k: pytest.fail("a tensor was mapped"))
    assert model_shape(str(path)) == cfg


def test_a_cached_gguf_is_mapped_once_for_the_reads_of_one_load(tmp_path, private_cache, monkeypatch):
    """A load reads a GGUF three times (the kernel's types, the matrices kept as stored, the rest as float32): its
    cache entry's arrays are memory-mapped on the first only. Each read gets a dict of its own (a caller adds the
    tied lm_head to it), and a cache entry written anew is mapped anew."""
    from llm_serving.models.weights import gguf as gguf_weights

    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q8_0)
    cfg, first = load_llama_weights(path)                       # (fills the cache)
    maps = []
    real_load = np.load
    monkeypatch.setattr(np, "load", lambda *a, **k: maps.append(a[0]) or real_load(*a, **k))
    monkeypatch.setattr(gguf_weights, "_last_read", None)
    _, one = gguf_weights.load_gguf(str(path))
    mapped = len(maps)
    assert mapped > 0
    one["extra"] = one["model.norm.weight"]
    _, two = gguf_weights.load_gguf(str(path))
    assert len(maps) == mapped and "extra" not in two
    assert two["model.norm.weight"] is one["model.norm.weight"]
    _, again = load_llama_weights(path)
    assert len(maps) == mapped
    for name in first:
        np.testing.assert_array_equal(again[name], first[name], err_msg=name)
    [entry] = (private_cache / "gguf").iterdir()
    config = entry / "config.json"
    text = config.read_text()
    config.unlink()
    config.write_text(text)                                    # (a new file: another inode)
    gguf_weights.load_gguf(str(path))
    assert len(maps) == 2 * mapped


@pytest.mark.parametrize("fmt", ["hf", "llama2c"])
def test_a_layer_cut_keeps_the_first_layers_the_final_norm_and_the_head(stories_dir, fmt):
    """model_config.num_layers (a draft model cut from a checkpoint): the first N layers' tensors, exactly as
    the whole model has them, plus the embedding, final norm and head; deeper layers are not read."""
    path = stories_dir / ("hf" if fmt == "hf" else "stories260K.bin")
    cfg, whole = load_llama_weights(str(path))
    cut_cfg, cut = load_llama_weights(str(path), num_layers=2)
    assert cfg.num_layers == 5 and cut_cfg.num_layers == 2
    assert {k for k in cut if ".layers." in k} == {k for k in whole if k.startswith(("model.layers.0.", "model.layers.1."))}
    for name in cut:
        np.testing.assert_array_equal(cut[name], whole[name])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert name in cut
    with pytest.raises(WeightLoadError, match="first 6 layers .* it has 5"):
        load_llama_weights(str(path), num_layers=6)


# ------------------------------------------------------------------------------------------ the families

_S, _F = "sliding", "full"
_GEMMA3 = dict(architecture="gemma3", vocab_size=384, head_dim=32, qk_norm=True, sandwich_norms=True,
               embed_scale=8.0, hidden_act="gelu_tanh", query_scale=24 ** -0.5, sliding_window=16,
               layer_types=(_S, _F, _S, _F), rope_theta=1e6, local_rope_theta=1e4, rope_freq_factors=(4.0,) * 16,
               tie_word_embeddings=True, attention_bias=False, nope_layers=())
# what each family's readers must give (beside the shapes): the config.json's meaning, written out by hand
FAMILY_CONFIGS = {
    "qwen3": dict(architecture="qwen3", head_dim=32, qk_norm=True, attention_bias=False, rope_theta=1e6,
                  sliding_window=None, tie_word_embeddings=False, hidden_act="silu", query_scale=None),
    "gemma3": _GEMMA3,
    "gemma3-mm": _GEMMA3,
    "phi3": dict(architecture="phi3", head_dim=32, rotary_dim=24, rope_theta=1e4,
                 rope_freq_factors=tuple(1.0 + i / 16 for i in range(12)),
                 rope_long_factors=tuple(1.0 + i * 5 / 8 for i in range(12)), rope_original_context=64,
                 rope_scale=math.sqrt(1 + math.log(256 / 64) / math.log(64)), sliding_window=None,
                 tie_word_embeddings=True, qk_norm=False),
    "smollm3": dict(architecture="smollm3", head_dim=16, nope_layers=(3,), rope_theta=1e5, tie_word_embeddings=True,
                    sliding_window=None),
    "mistral-swa": dict(architecture="mistral", head_dim=32, sliding_window=16, layer_types=None,
                        tie_word_embeddings=False),
    "qwen2-swa": dict(architecture="qwen2", head_dim=32, attention_bias=True, sliding_window=16,
                      layer_types=(_F, _F, _S, _S), rope_theta=1e6, tie_word_embeddings=True),
    "qwen3moe": dict(architecture="qwen3moe", head_dim=32, qk_norm=True, num_experts=8, experts_per_token=2,
                     expert_intermediate_size=32, intermediate_size=128, norm_topk_prob=True, dense_layers=(1,),
                     sliding_window=None, tie_word_embeddings=False),
    "mixtral": dict(architecture="mixtral", head_dim=16, qk_norm=False, num_experts=4, experts_per_token=2,
                    expert_intermediate_size=64, norm_topk_prob=True, dense_layers=(), sliding_window=None),
    "gptoss": dict(architecture="gptoss", head_dim=32, attention_bias=True, o_bias=True, attention_sinks=True,
                   sliding_window=16, layer_types=(_S, _F), num_experts=4, experts_per_token=2,
                   expert_intermediate_size=64, moe_bias=True, expert_act="swiglu_oai", swiglu_alpha=1.702,
                   swiglu_limit=7.0, rope_theta=150000.0, rope_scale=0.1 * math.log(32) + 1),
}
# the architecture a GGUF twin's file names (llama.cpp's: Mistral and Mixtral are `llama`)
_GGUF_ARCHITECTURE = {"mistral-swa": "llama", "mixtral": "llama"}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Every family made once by transformers: {name: (HF directory, its F32 GGUF twin)}."""
    needs_transformers()
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in FAMILIES:
        hf = make_hf_model(name, root / name, seed=0)
        out[name] = (hf, family_gguf(name, hf, root / f"{name}.gguf"))
    return out


def _same(name, expected, got):
    """A config field's value: floats (GGUF stores float32) to 1e-6, the rest exactly."""
    if isinstance(expected, float) or (isinstance(expected, tuple) and expected and isinstance(expected[0], float)):
        assert got is not None, name
        np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)
    else:
        assert got == expected, (name, got, expected)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_loads_the_same_from_its_hf_directory_and_its_gguf(families, name):
    """Every config field (GGUF's float32 metadata to 1e-6; a Mistral GGUF is llama.cpp's `llama`) and every
    tensor, exactly, under the internal names; the config says what the family's config.json means."""
    hf, twin = families[name]
    cfg, got = load_llama_weights(hf)
    for field, value in FAMILY_CONFIGS[name].items():
        _same(field, value, getattr(cfg, field))
    cfg2, got2 = load_llama_weights(twin)
    for field in dataclasses.fields(cfg):
        if field.name == "architecture":
            assert cfg2.architecture == _GGUF_ARCHITECTURE.get(name, cfg.architecture)
        else:
            _same(field.name, getattr(cfg, field.name), getattr(cfg2, field.name))
    assert set(got) == set(got2) == set(expected_shapes(cfg))
    for tensor in got:
        np.testing.assert_array_equal(got2[tensor], got[tensor], err_msg=tensor)


# Gemma's norms (after "model.layers.N.") -> the internal names
_GEMMA_NORMS = {"input_layernorm": "input_layernorm", "pre_feedforward_layernorm": "post_attention_layernorm",
                "post_attention_layernorm": "attn_output_norm", "post_feedforward_layernorm": "mlp_output_norm",
                "self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}


def _internal_from_checkpoint(name: str, hf_dir) -> dict:
    """The internal tensors as the checkpoint's own, mapped here: the text model's names, Gemma's norms renamed
    and + 1, Phi-3's qkv_proj and gate_up_proj cut by rows, a tied lm_head the embedding."""
    from safetensors.numpy import load_file

    raw = json.loads((hf_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    out, experts = {}, {}
    for key, arr in load_file(str(hf_dir / "model.safetensors")).items():
        key = key.replace("language_model.model.", "model.").replace("language_model.lm_head.", "lm_head.")
        if not key.startswith(("model.", "lm_head.")):
            continue                                            # the vision tower and projector
        if name.startswith("gemma3") and key.endswith("norm.weight"):
            arr = arr + np.float32(1.0)
            if key.startswith("model.layers."):
                _, _, layer, rest = key.split(".", 3)
                key = f"model.layers.{layer}.{_GEMMA_NORMS[rest[:-len('.weight')]]}.weight"
        if key.endswith("qkv_proj.weight"):
            q, kv = 4 * 32, 2 * 32
            for part, rows in (("q", arr[:q]), ("k", arr[q:q + kv]), ("v", arr[q + kv:])):
                out[key.replace("qkv_proj", f"{part}_proj")] = rows
        elif key.endswith("gate_up_proj.weight"):
            inter = text["intermediate_size"]
            out[key.replace("gate_up_proj", "gate_proj")], out[key.replace("gate_up_proj", "up_proj")] = \
                arr[:inter], arr[inter:]
        elif key.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):  # gpt-oss: gate/up interleaved
            prefix, bias = key.rsplit(".", 1)[0], key.endswith("_bias")
            for part, offset in (("gate_proj", 0), ("up_proj", 1)):
                out[f"{prefix}.{part}.{'bias' if bias else 'weight'}"] = (
                    arr[:, offset::2].reshape(-1) if bias else
                    np.ascontiguousarray(arr[:, :, offset::2].transpose(0, 2, 1)).reshape(-1, arr.shape[1]))
        elif key.endswith("experts.down_proj"):
            out[key + ".weight"] = np.ascontiguousarray(arr.transpose(0, 2, 1)).reshape(-1, arr.shape[1])
        elif key.endswith("experts.down_proj_bias"):
            out[key.replace("down_proj_bias", "down_proj.bias")] = arr.reshape(-1)
        elif ".experts." in key:                                # one expert's matrix: its rows of the stack
            _, _, layer, rest = key.split(".", 3)
            _, _, expert, part, _ = rest.split(".")
            part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(part, part)
            experts.setdefault(f"model.layers.{layer}.mlp.experts.{part}.weight", {})[int(expert)] = arr
        elif key.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            out[key.split(".mlp.")[0].split(".block_sparse_moe.")[0] + ".mlp.router.weight"] = arr
        else:
            out[key] = arr
    for key, by_expert in experts.items():
        out[key] = np.concatenate([by_expert[e] for e in range(len(by_expert))])
    out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_internal_tensors_are_its_checkpoints_own(families, name):
    """Gemma's gains are 1 + the stored weight (added once), its pre-feedforward norm is the internal
    post_attention_layernorm and its post-attention / post-feedforward norms the sandwich norms; Phi-3's fused
    matrices are cut into q/k/v (rows NH*D, KVH*D, KVH*D) and gate/up (gate first); a multimodal checkpoint's text
    model is read without its vision tower."""
    hf, _ = families[name]
    _, got = load_llama_weights(hf)
    expected = _internal_from_checkpoint(name, hf)
    assert set(got) == set(expected)
    for tensor, arr in expected.items():
        np.testing.assert_array_equal(got[tensor], arr, err_msg=tensor)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_json_in_transformers_4_and_5_forms_reads_the_same(families, name, tmp_path):
    """4.x's rope_theta / rope_scaling / rope_local_base_freq / top-level partial_rotary_factor and original context
    mean what 5.x's rope_parameters (per layer type for Gemma 3) mean."""
    hf, _ = families[name]
    v5 = json.loads((hf / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config_json_v4(v5)))
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    assert load_config(tmp_path) == load_config(hf)


def test_gemma3_multimodal_text_model_under_either_transformers_naming(families, tmp_path):
    """transformers' save_pretrained writes language_model.model.* (4.x and 5.x alike); 5.x's modules are
    model.language_model.*: both read as the same text model, the vision tower's tensors not at all."""
    from safetensors.numpy import load_file, save_file

    hf, _ = families["gemma3-mm"]
    stored = load_file(str(hf / "model.safetensors"))
    assert any(k.startswith("language_model.model.layers.") for k in stored)
    assert any("vision_tower" in k for k in stored)
    renamed = {k.replace("language_model.model.", "model.language_model."): v for k, v in stored.items()}
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / f, tmp_path / f)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg, got = load_llama_weights(hf)
    cfg2, got2 = load_llama_weights(tmp_path)
    assert cfg == cfg2 and set(got) == set(got2) == set(expected_shapes(cfg))
    for tensor in got:
        np.testing.assert_array_equal(got2[tensor], got[tensor], err_msg=tensor)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_q8_0_gguf_is_its_f32_tensors_quantized_row_by_row(families, name, tmp_path):
    """Q8_0 as llama.cpp quantizes (gguf.quants): every matrix, the embedding included, equals its F32 form
    quantized and dequantized (quantization runs along rows, so the converter's row permutations and the
    readers' splits commute with it); 1-D tensors (norms, Gemma's + 1 included) stay F32, exact."""
    hf, twin = families[name]
    _, f32 = load_llama_weights(twin)
    _, q8 = load_llama_weights(family_gguf(name, hf, tmp_path / "q8.gguf", qtype=Q.Q8_0))
    for tensor, arr in f32.items():
        quantized = arr.ndim == 2 and not tensor.endswith("router.weight")      # (a router stays F32, as the converter
        want = gguf.quants.dequantize(gguf.quants.quantize(arr, Q.Q8_0), Q.Q8_0) if quantized else arr  # keeps it)
        np.testing.assert_array_equal(q8[tensor], want, err_msg=tensor)


@pytest.mark.parametrize("fmt", ["hf", "gguf", "gguf-q8_0", "gguf-q8_0-cached"])
def test_phi3_split_parts_read_only_their_rows(families, tmp_path, monkeypatch, fmt):
    """Tensor-parallel rank 1 of 2 reads the second half of q/k/v/gate/up, each a row range of the fused matrix,
    equal to the cut of the whole (from safetensors, an F32 GGUF, and a Q8_0 GGUF read from the file or the
    cache); a Q8_0 file's q/k/v and gate/up are kept as their own rows of blocks (load_quantized)."""
    if fmt != "gguf-q8_0-cached":
        monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    hf, twin = families["phi3"]
    path = {"hf": hf, "gguf": twin}.get(fmt) or family_gguf("phi3", hf, tmp_path / "q8.gguf", qtype=Q.Q8_0)
    _, whole = load_llama_weights(path)
    _, part = load_llama_weights(path, TensorParallel(rank=1, world=2))
    assert part["model.layers.0.self_attn.k_proj.weight"].shape == (32, 128)     # one of the two kv heads
    for tensor, arr in part.items():
        np.testing.assert_array_equal(arr, _rank1_of_2(tensor, whole[tensor]), err_msg=tensor)
    if fmt.startswith("gguf-q8_0"):
        kept = load_quantized(path)
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            t = kept[f"model.layers.1.{proj}.weight"]
            rows = gguf.quants.dequantize(t.data, Q.Q8_0).reshape(t.shape)
            assert t.qtype == 8
            np.testing.assert_array_equal(rows, whole[f"model.layers.1.{proj}.weight"], err_msg=proj)


def test_a_gguf_vocabulary_encodes_as_the_tokenizer_json(families):
    from llm_serving.tokenization import load_tokenizer

    hf, twin = families["phi3"]
    ref, tok = load_tokenizer(str(hf)), load_tokenizer(str(twin))
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.chat_template) == \
        (ref.vocab_size, ref.bos_id, ref.eos_id, ref.chat_template) == (320, 1, 2, ref.chat_template)
    for text in ("Once upon a time, Lily saw a big red ball.", "<|im_start|>user\nhi 123<|im_end|>\n"):
        assert tok.encode(text) == ref.encode(text), text


def _edited(hf, tmp_path, **changes):
    """A copy of `hf`'s config.json (its text config for a multimodal one) with `changes`, in tmp_path."""
    raw = json.loads((hf / "config.json").read_text())
    (raw["text_config"] if "text_config" in raw else raw).update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
REFUSED = [
    ("gemma3", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    ("gemma3-mm", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3", dict(attention_bias=True), "attention_bias"),
    ("gemma3", dict(rope_parameters={"full_attention": {**_YARN, "rope_type": "dynamic"},
                                     "sliding_attention": {"rope_theta": 1e4}}), "RoPE scaling type 'dynamic'"),
    ("gemma3", dict(rope_parameters={"full_attention": {"rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "'linear' on the sliding layers"),
    ("phi3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
    ("phi3", dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
                                   "rope_theta": 1e4}), "need 12 values"),
    ("qwen3", dict(attention_bias=True), "attention_bias"),
    ("qwen3", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen3", dict(rope_parameters={**_YARN, "mscale": 0.707, "mscale_all_dim": 1.0}), "mscale"),
    ("qwen2-swa", dict(layer_types=["full_attention", "chunked_attention", "sliding_attention", "sliding_attention"]),
     "chunked_attention"),
    ("smollm3", dict(mlp_bias=True), "mlp_bias"),
    ("smollm3", dict(no_rope_layers=[1, 1, 0]), "no_rope_layers has 3 entries for 4 layers"),
    ("qwen3", dict(architectures=["DeepseekV3ForCausalLM"]), "architecture 'DeepseekV3ForCausalLM' is not supported"),
    ("qwen3moe", dict(num_experts_per_tok=9), "8 experts need 1 to 8 experts per token"),
    ("qwen3moe", dict(moe_intermediate_size=None, num_experts=0, num_local_experts=0), "num_experts"),
    ("gemma3", dict(architectures=["Gemma2ForCausalLM"]), "architecture 'Gemma2ForCausalLM' is not supported"),
    ("phi3", dict(architectures=["PhiForCausalLM"]), "architecture 'PhiForCausalLM' is not supported"),
]


@pytest.mark.parametrize("name,changes,message", REFUSED, ids=[f"{n}-{'-'.join(c)}" for n, c, _ in REFUSED])
def test_unsupported_options_and_architectures_are_refused_naming_them(families, tmp_path, name, changes, message):
    hf, _ = families[name]
    if "architectures" in changes:          # (the outer config's, for a multimodal one)
        raw = json.loads((hf / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**raw, **changes}))
    else:
        _edited(hf, tmp_path, **changes)
    with pytest.raises(WeightLoadError, match=message):
        load_config(tmp_path)


def test_a_gemma3_config_that_names_only_what_differs_has_transformers_defaults(tmp_path):
    """Gemma 3 4B's config.json as published: its text_config names 5 keys; the rest are Gemma3TextConfig's
    defaults (8 heads of 256, 4 KV heads, query_pre_attn_scalar 256, RoPE bases 1e6 and 1e4, every 6th layer
    full) and the outer config's token ids."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "mm_tokens_per_image": 256, "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024}}))
    cfg = load_config(tmp_path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (8, 4, 256, 262208)
    assert (cfg.query_scale, cfg.embed_scale, cfg.hidden_act) == (1 / 16, math.sqrt(2560), "gelu_tanh")
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_freq_factors) == (1e6, 1e4, (8.0,) * 128)
    assert cfg.sliding_window == 1024 and [i for i, t in enumerate(cfg.layer_types) if t == "full"] == [5, 11, 17,
                                                                                                        23, 29]
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings) == (2, 1, True)
    assert (cfg.qk_norm, cfg.sandwich_norms, cfg.layer_rope(5), cfg.layer_rope(4)) == (True, True, "global", "local")


def test_a_llava_config_that_names_only_what_differs_has_llama_s_defaults(tmp_path):
    """LLaVA 1.5 7B's config.json as the Hub's llava-hf file has it: its Llama text_config names the vocabulary, the
    context and the norm's eps; the rest are LlamaConfig's defaults (32 layers of 4,096, 32 heads, MLP 11,008), read
    as the Mistral family's (no window)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
        "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                        "rms_norm_eps": 1e-05, "vocab_size": 32064},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}))
    cfg = load_config(tmp_path)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
        4096, 32, 32, 32, 11008)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.rope_theta) == (32064, 4096, 1e-5, 1e4)
    assert (cfg.architecture, cfg.sliding_window, cfg.tie_word_embeddings) == ("mistral", None, False)


def test_smollm3_nope_layers_from_the_flags_or_the_interval(families, tmp_path):
    hf, _ = families["smollm3"]
    assert load_config(_edited(hf, tmp_path, no_rope_layers=[1, 0, 1, 1])).nope_layers == (1,)
    assert load_config(_edited(hf, tmp_path, no_rope_layers=None, no_rope_layer_interval=2)).nope_layers == (1, 3)
    cfg = load_config(_edited(hf, tmp_path, no_rope_layers=None))                        # transformers' default: 4
    assert cfg.nope_layers == (3,) and [cfg.layer_rope(i) for i in range(4)] == ["global"] * 3 + ["none"]


def _metadata_gguf(path, arch, layers=2, hidden=64, heads=4, head_dim=16, **keys):
    """A GGUF of metadata (and a token embedding) only: `keys` as GGUFWriter.add_<key>(value)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(128)
    w.add_head_count(heads)
    w.add_head_count_kv(2)
    w.add_key_length(head_dim)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((32, hidden), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_gemma3_without_the_keys_llama_cpp_hardcodes(tmp_path):
    """What llama.cpp assumes when the converter writes nothing: every 6th layer full (sliding_window_pattern 6),
    a local RoPE base of 10000, the attention scale 1/sqrt(head_dim), except for the 27B shape (62 layers):
    1/sqrt(hidden/heads); no sliding layers without `sliding_window`."""
    cfg = model_shape(_metadata_gguf(tmp_path / "a.gguf", "gemma3", layers=7, sliding_window=512))
    assert cfg.layer_types == (_S,) * 5 + (_F, _S) and cfg.local_rope_theta == 1e4
    assert (cfg.query_scale, cfg.embed_scale, cfg.hidden_act, cfg.sandwich_norms) == (0.25, 8.0, "gelu_tanh", True)
    big = model_shape(_metadata_gguf(tmp_path / "b.gguf", "gemma3", layers=62, hidden=128, head_dim=64,
                                     sliding_window=512, rope_freq_base_swa=20000.0))
    assert big.query_scale == (128 / 4) ** -0.5 and big.local_rope_theta == 20000.0
    full = model_shape(_metadata_gguf(tmp_path / "c.gguf", "gemma3", attention_scale=0.125))
    assert (full.sliding_window, full.layer_types, full.local_rope_theta, full.query_scale) == (None, None, None, 0.125)
    smol = model_shape(_metadata_gguf(tmp_path / "d.gguf", "smollm3", layers=8))
    assert smol.nope_layers == (3, 7)                                  # llama.cpp's n_no_rope_layer_step = 4
    phi4 = model_shape(_metadata_gguf(tmp_path / "e.gguf", "phi3", sliding_window=262144, context_length=131072))
    assert phi4.sliding_window is None                                 # a window as long as the context is none
    phi3 = model_shape(_metadata_gguf(tmp_path / "f.gguf", "phi3", sliding_window=2047, context_length=4096))
    assert (phi3.sliding_window, phi3.layer_types) == (2047, None)     # Phi-3-mini-4k's, in every layer


GGUF_REFUSED = [("gemma3", dict(final_logit_softcapping=30.0), "gemma3.final_logit_softcapping=30.0"),
                ("qwen3", dict(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=4.0),
                 "'qwen3.rope.scaling.original_context_length' is missing"),
                ("gemma2", {}, "GGUF architecture 'gemma2' is not supported"),
                ("phi3", dict(rope_scaling_type=gguf.RopeScalingType.LONGROPE), "without its rope_factors")]


@pytest.mark.parametrize("arch,keys,message", GGUF_REFUSED, ids=[a + "-" + "-".join(k) for a, k, _ in GGUF_REFUSED])
def test_unsupported_gguf_options_are_refused_naming_them(tmp_path, arch, keys, message):
    with pytest.raises(WeightLoadError, match=message):
        model_shape(_metadata_gguf(tmp_path / "m.gguf", arch, **keys))


PROMPT = [1, 17, 42, 5, 77, 23, 9, 61, 30, 100, 200, 150]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_greedy_choices_are_clear(families, name):
    """make_hf_model's scales: along a 24-token greedy reply every top-2 margin of transformers' logits is at least
    5e-4 of the largest logit (float16 and float32 paths choose alike), and the reply is not a repeat."""
    hf, _ = families[name]
    tokens = transformers_greedy(hf, PROMPT, 24)
    logits = transformers_logits(hf, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    assert [int(t) for t in logits.argmax(axis=1)] == tokens
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert ((top2[:, 1] - top2[:, 0]) / np.abs(logits).max(axis=1)).min() >= 5e-4
    assert len(set(tokens)) >= 6, tokens


# family -> a config change that undoes its feature, and the first position whose logits it changes
FEATURES = {"gemma3": (dict(sliding_window=1024), 16), "mistral-swa": (dict(sliding_window=1024), 16),
            "qwen2-swa": (dict(sliding_window=1024), 16), "smollm3": (dict(no_rope_layers=[1, 1, 1, 1]), 1),
            "gemma3-mm": (dict(rope_parameters={"full_attention": {"rope_theta": 1e6},
                                                "sliding_attention": {"rope_theta": 1e6}}), 1)}


@pytest.mark.parametrize("name", list(FEATURES))
def test_the_families_exercise_their_features_in_transformers(families, tmp_path, name):
    """The families are worth comparing with: their feature changes transformers' logits within 40 tokens. A
    sliding window of 16 changes nothing before position 16 (the window counts the token's own key: position 15
    sees 16 keys) and changes position 16 on; NoPE and the local RoPE base change every position after the
    first."""
    hf, _ = families[name]
    changes, first = FEATURES[name]
    for f in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / f, tmp_path / f)
    ids = (PROMPT * 4)[:40]
    base, changed = transformers_logits(hf, ids), transformers_logits(_edited(hf, tmp_path, **changes), ids)
    np.testing.assert_array_equal(changed[:first], base[:first])
    assert (np.abs(changed - base).max(axis=1)[first:] > 1e-4 * np.abs(base).max()).all()


def test_yarn_rope_scaling_is_transformers_own(tmp_path):
    """YaRN (gpt-oss's, Qwen3's long-context setting) read as a divisor per frequency and a cos/sin multiplier: the
    inverse frequencies and attention factor transformers computes, with the correction range truncated or not."""
    torch, transformers = needs_transformers()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for truncate in (True, False):
        params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate,
                  "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
        cfg = load_config(_config(tmp_path / str(truncate), architectures=["Qwen3ForCausalLM"], head_dim=48,
                                  rope_parameters=params, max_position_embeddings=131072))
        hf = transformers.AutoConfig.for_model("qwen3", head_dim=48, num_attention_heads=4, hidden_size=64,
                                               rope_parameters=dict(params), max_position_embeddings=131072)
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        base = 1.0 / 150000.0 ** (np.arange(0, 48, 2) / 48)
        np.testing.assert_allclose(base / np.array(cfg.rope_freq_factors), inv_freq.numpy(), rtol=1e-6)
        assert cfg.rope_scale == pytest.approx(attention_factor) == pytest.approx(0.1 * math.log(32) + 1)


def test_read_gguf_gives_the_gguf_packages_fields_and_tensors_but_string_arrays(tmp_path):
    """gguf_file.read_gguf (the weight loader's reader): every field of the gguf package's reader but arrays of
    strings, the same values (arrays of numbers as lists); every tensor's name, type, dimensions, size, offset and
    data (typed for F32/F16, else the rows' bytes); a file cut inside its header or its data refused."""
    from llm_serving.gguf_file import open_gguf, read_gguf

    _, (_, ref) = _hf(tmp_path, hidden_size=64, intermediate_size=128)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q8_0, rope_freqs=np.linspace(1, 4, 8))
    ours, theirs = read_gguf(str(path)), open_gguf(str(path))
    want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")
            and not (f.types[0] == gguf.GGUFValueType.ARRAY and f.types[-1] == gguf.GGUFValueType.STRING)}
    assert ours.fields == want and "tokenizer.ggml.tokens" not in ours.fields
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    kinds = set()
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        kinds.add(a.tensor_type.name)
    assert {"F32", "Q8_0"} <= kinds
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="cut short"):
        read_gguf(str(tmp_path / "cut.gguf"))
    (tmp_path / "short.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="past the end"):
        read_gguf(str(tmp_path / "short.gguf"))


def test_a_ggufs_scalar_metadata_is_read_without_parsing_its_arrays(tmp_path):
    """gguf_file.read_scalars: every number, boolean and string key the gguf package's reader gives, the same
    values, arrays (a vocabulary's tokens, rope tables) skipped; a file that is no GGUF, or is cut short, refused."""
    from llm_serving.gguf_file import open_gguf, read_scalars

    _, (_, ref) = _hf(tmp_path, hidden_size=64, intermediate_size=128)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q8_0, rope_freqs=np.linspace(1, 4, 8))
    fields = open_gguf(str(path)).fields
    scalars = {k: f.contents() for k, f in fields.items()
               if not k.startswith("GGUF.") and f.types and f.types[0] != gguf.GGUFValueType.ARRAY}
    got = read_scalars(str(path))
    assert got == scalars and got["general.architecture"] == "llama" and "llama.block_count" in got
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match="cut short"):
        read_scalars(str(tmp_path / "cut.gguf"))
    (tmp_path / "not.gguf").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        read_scalars(str(tmp_path / "not.gguf"))
