"""GGUF checkpoints and the LLaMA family's config.json variants, read by models/weights.py (no MindSpore).

The GGUF files are written here with the `gguf` package the way llama.cpp's converter writes them (metadata under
the architecture's name, tensors renamed, a llama model's q/k rows permuted for llama.cpp's RoPE), from random HF
checkpoints, so each GGUF has a safetensors twin to compare with."""
import json
import tracemalloc

import numpy as np
import pytest

from llm_serving.models.default_model import write_hf_llama
from llm_serving.models.parallel import TensorParallel
from llm_serving.models.weights import WeightLoadError, llama3_rope_factors, load_config, load_llama_weights

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """GGUF loads cache their float32 tensors under LLM_SERVING_CACHE: a directory of this test's own."""
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=128)
HEAD_DIM = 16


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from rotate-half to interleaved pairs, as its RoPE wants."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path, weights: dict, *, arch="llama", qtype=Q.F32, theta=10000.0, heads=4, kv_heads=2,
               rope_freqs=None):
    """A GGUF of HF-named float32 `weights`; 2-D tensors stored as `qtype`, 1-D ones as F32 (as llama.cpp does)."""
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
    for name, arr in weights.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            out = f"blk.{i}.{LAYER_NAMES[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                arr = _llama_cpp_permute(arr, heads)
            elif arch == "llama" and rest == "self_attn.k_proj.weight":
                arr = _llama_cpp_permute(arr, kv_heads)
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        arr = np.ascontiguousarray(arr, np.float32)
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


def _hf(tmp_path, tie=False, **overrides):
    out = write_hf_llama(tmp_path / "hf", seed=3, tie_word_embeddings=tie, **{**SHAPE, **overrides})
    return out, load_llama_weights(out)


@pytest.mark.parametrize("tie", [False, True])
def test_f32_gguf_loads_to_its_safetensors_twin(tmp_path, tie):
    hf, (cfg, ref) = _hf(tmp_path, tie=tie)
    stored = {k: v for k, v in ref.items() if not (tie and k == "lm_head.weight")}
    cfg2, got = load_llama_weights(write_gguf(tmp_path / "m.gguf", stored))
    assert set(got) == set(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)   # the q/k permutation undone exactly
    assert (cfg2.num_heads, cfg2.num_kv_heads, cfg2.head_dim, cfg2.tie_word_embeddings) == (4, 2, HEAD_DIM, tie)
    assert (cfg2.vocab_size, cfg2.intermediate_size, cfg2.num_layers) == (64, 96, 2)


@pytest.mark.parametrize("qtype,tolerance", [(Q.F16, 1e-3), (Q.Q8_0, 0.02), (Q.Q4_1, 0.2), (Q.Q5_0, 0.1),
                                             (Q.BF16, 0.01)])
def test_quantized_gguf_dequantizes_to_the_twin(tmp_path, qtype, tolerance):
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)     # K-quants need rows of 256
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=qtype)
    _, got = load_llama_weights(path)
    for name, arr in ref.items():
        err = np.abs(got[name] - arr).max() / np.abs(arr).max()
        assert err <= tolerance, (name, err)
        if arr.ndim == 2 and name != "lm_head.weight":      # rows land where the twin has them: the permutation
            corr = np.corrcoef(got[name].ravel(), arr.ravel())[0, 1]
            assert corr > 0.95, (name, corr)


def test_qwen2_gguf_keeps_hf_layout_and_biases(tmp_path):
    hf, (_, ref) = _hf(tmp_path)
    rng = np.random.default_rng(0)
    for i in range(2):
        for part, rows in (("q", 4 * HEAD_DIM), ("k", 2 * HEAD_DIM), ("v", 2 * HEAD_DIM)):
            ref[f"model.layers.{i}.self_attn.{part}_proj.bias"] = rng.standard_normal(rows).astype(np.float32)
    cfg, got = load_llama_weights(write_gguf(tmp_path / "q.gguf", ref, arch="qwen2", theta=1e6))
    assert cfg.architecture == "qwen2" and cfg.attention_bias and cfg.rope_theta == 1e6
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)


def test_gguf_rope_freqs_become_the_frequency_divisors(tmp_path):
    _, (_, ref) = _hf(tmp_path)
    factors = np.linspace(1.0, 8.0, HEAD_DIM // 2)
    cfg, _ = load_llama_weights(write_gguf(tmp_path / "m.gguf", ref, rope_freqs=factors))
    np.testing.assert_allclose(cfg.rope_freq_factors, factors, rtol=1e-6)


def test_gguf_tensor_parallel_part_equals_the_cut_of_the_whole(tmp_path):
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    for qtype in (Q.F32, Q.Q8_0):
        path = write_gguf(tmp_path / f"m{qtype.name}.gguf", ref, qtype=qtype)
        _, whole = load_llama_weights(path)
        tp = TensorParallel(rank=1, world=2)
        _, part = load_llama_weights(path, tp)
        assert "lm_head.weight" not in part                        # logits tensors: rank 0 only
        for name, arr in part.items():
            np.testing.assert_array_equal(arr, whole[name][tp.part(name, whole[name].shape)], err_msg=name)


def test_unsupported_gguf_architecture_and_tensor_type_are_refused(tmp_path, monkeypatch):
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    with pytest.raises(WeightLoadError, match="GGUF architecture 'gemma' is not supported"):
        load_llama_weights(write_gguf(tmp_path / "g.gguf", ref, arch="gemma"))
    # every type this gguf version stores it can also dequantize; stand in a package that cannot do Q8_0
    from llm_serving.models import weights_gguf
    monkeypatch.setattr(weights_gguf, "_gguf_dequantizes", lambda qtype: qtype != Q.Q8_0)
    with pytest.raises(WeightLoadError, match="tensor 'token_embd.weight' has type Q8_0, which the gguf package "
                                              "cannot dequantize"):
        load_llama_weights(write_gguf(tmp_path / "q.gguf", ref, qtype=Q.Q8_0))


def test_k_quant_tensors_are_read(tmp_path):
    """The gguf package dequantizes K-quants (it cannot make them): a Q4_K embedding of zero blocks reads as
    zeros of the right shape next to F32 tensors."""
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    path = write_gguf(tmp_path / "m.gguf", ref)
    block, size = gguf.GGML_QUANT_SIZES[Q.Q4_K]
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for field in ("context_length", "embedding_length", "block_count", "feed_forward_length"):
        getattr(w, f"add_{field}")(int(reader.fields[f"llama.{field}"].contents()))
    w.add_head_count(4)
    w.add_head_count_kv(2)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            w.add_tensor(t.name, np.zeros((64, 256 // block * size), np.uint8), raw_dtype=Q.Q4_K)
        else:
            w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed([int(n) for n in t.shape]))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _, got = load_llama_weights(tmp_path / "k.gguf")
    assert got["model.embed_tokens.weight"].shape == (64, 256) and not got["model.embed_tokens.weight"].any()
    np.testing.assert_array_equal(got["model.layers.1.mlp.up_proj.weight"], ref["model.layers.1.mlp.up_proj.weight"])


def _config(tmp_path, **changes) -> str:
    hf, _ = _hf(tmp_path)
    raw = json.loads((hf / "config.json").read_text())
    raw.update(changes)
    (hf / "config.json").write_text(json.dumps(raw))
    return str(hf)


def test_architectures_and_rope_settings_from_config_json(tmp_path):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    v4 = load_config(_config(tmp_path / "a", rope_theta=500000.0, rope_scaling=llama3))
    v5 = load_config(_config(tmp_path / "b", rope_parameters={**llama3, "rope_theta": 500000.0}))
    assert v4 == v5 and v4.rope_theta == 500000.0
    # Llama-3.1's rule written out again: wavelengths past original/low are slowed 8x, under original/high kept
    inv = 1.0 / 500000.0 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    wavelength = 2 * np.pi / inv
    ratio = 32 / wavelength
    smooth = np.clip((ratio - 1.0) / (4.0 - 1.0), 0, 1)
    expected = 1.0 / ((1 - smooth) / 8.0 + smooth)
    np.testing.assert_allclose(v4.rope_freq_factors, expected, rtol=1e-12)
    assert v4.rope_freq_factors[0] == 1.0 and v4.rope_freq_factors[-1] == 8.0     # both ends of the band
    assert llama3_rope_factors(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0, 32) == v4.rope_freq_factors

    qwen = load_config(_config(tmp_path / "c", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                               sliding_window=32768, rope_theta=1e6))
    assert qwen.architecture == "qwen2" and qwen.attention_bias and qwen.sliding_window is None
    mistral = load_config(_config(tmp_path / "d", architectures=["MistralForCausalLM"], sliding_window=64))
    assert mistral.architecture == "mistral" and mistral.sliding_window == 64
    mistral.check_context(64)
    with pytest.raises(WeightLoadError, match="sliding_window=64.*max_generate_length <= 64"):
        mistral.check_context(128)
    with pytest.raises(WeightLoadError, match="GemmaForCausalLM"):
        load_config(_config(tmp_path / "e", architectures=["GemmaForCausalLM"]))
    with pytest.raises(WeightLoadError, match="RoPE scaling type 'yarn'"):
        load_config(_config(tmp_path / "f", rope_scaling={"rope_type": "yarn", "factor": 4.0}))


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
    np.testing.assert_array_equal(got["model.layers.1.self_attn.k_proj.bias"], ref["model.layers.1.self_attn.k_proj.bias"])


def test_loading_a_quantized_gguf_peaks_under_twice_the_float32_model(tmp_path):
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=512, num_layers=4, vocab_size=512)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q4_1)
    size = sum(a.nbytes for a in ref.values())
    del ref
    tracemalloc.start()
    _, got = load_llama_weights(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(a.nbytes for a in got.values()) == size
    assert peak < 2 * size, (peak, size)


def test_a_gguf_is_dequantized_once_then_read_from_the_float32_cache(tmp_path, private_cache, monkeypatch):
    _, (_, ref) = _hf(tmp_path, hidden_size=256, intermediate_size=256)
    path = write_gguf(tmp_path / "m.gguf", ref, qtype=Q.Q8_0, rope_freqs=np.linspace(1, 4, 8))
    cfg, first = load_llama_weights(path)
    [entry] = (private_cache / "gguf").iterdir()
    assert (entry / "config.json").is_file() and len(list(entry.glob("*.npy"))) == len(first)
    from llm_serving.models import weights_gguf
    monkeypatch.setattr(weights_gguf, "_load_gguf", lambda p: pytest.fail("the GGUF was read again"))
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
