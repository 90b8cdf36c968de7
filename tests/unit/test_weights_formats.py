"""GGUF checkpoints and the LLaMA family's config.json variants, read by models/weights/ (no MindSpore).

The GGUF files are written here with the `gguf` package the way llama.cpp's converter writes them (metadata under
the architecture's name, tensors renamed, a llama model's q/k rows permuted for llama.cpp's RoPE), from random HF
checkpoints, so each GGUF has a safetensors twin to compare with. What a correct loader must return for a
quantized tensor is computed here on its own: llama.cpp's form of the twin's tensor, quantized and dequantized by
`gguf.quants`, then un-permuted by the inverse written below (not the loader's)."""
import json
import tracemalloc

import numpy as np
import pytest

from llm_serving.models.default_model import write_hf_llama
from llm_serving.models.parallel import TensorParallel
from llm_serving.models.weights import (WeightLoadError, llama3_rope_factors, load_config, load_llama_weights,
                                        load_quantized)
from llm_serving.models.weights.gguf import KEPT_QUANTIZED

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
               rope_freqs=None, raw=None, rope_scaling=None):
    """A GGUF of HF-named float32 `weights`; 2-D tensors stored as `qtype`, 1-D ones as F32 (as llama.cpp does).
    `raw`: {GGUF name: (uint8 blocks, type)} stored instead of that tensor (types gguf cannot quantize);
    `rope_scaling`: (type, factor) as `<arch>.rope.scaling.*` metadata."""
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
    for name, arr in weights.items():
        out = gguf_name(name)
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
    qwen = load_config(_config(tmp_path / "c", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                               sliding_window=32768, rope_theta=1e6))
    assert qwen.architecture == "qwen2" and qwen.attention_bias and qwen.sliding_window is None
    mistral = load_config(_config(tmp_path / "d", architectures=["MistralForCausalLM"], sliding_window=64))
    assert mistral.architecture == "mistral" and mistral.sliding_window == 64 and not mistral.attention_bias
    mistral.check_context(64)
    with pytest.raises(WeightLoadError, match="sliding_window=64.*max_generate_length <= 64"):
        mistral.check_context(128)
    with pytest.raises(WeightLoadError, match="GemmaForCausalLM"):
        load_config(_config(tmp_path / "e", architectures=["GemmaForCausalLM"]))
    with pytest.raises(WeightLoadError, match="RoPE scaling type 'yarn'"):
        load_config(_config(tmp_path / "f", rope_scaling={"rope_type": "yarn", "factor": 4.0,
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
    """The cache holds float32 arrays only of what the kernels do not read as stored (here the norms): the Q8_0
    matrices are there as their blocks alone, and a float32 reader dequantizes those."""
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q8_0, rope_freqs=np.linspace(1, 4, 8))
    cfg, first = load_llama_weights(path)
    [entry] = (private_cache / "gguf").iterdir()
    assert (entry / "config.json").is_file()
    assert {p.name for p in entry.glob("*.npy")} == \
        {f"{n}.npy" for n, a in first.items() if a.ndim == 1} | \
        {f"{n}.blocks.npy" for n, a in first.items() if a.ndim == 2}            # Q8_0 kept
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
