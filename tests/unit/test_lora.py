"""LoRA adapters in PEFT's format (models/lora.py), read and checked against a base model (no MindSpore). The
adapters are written here as PEFT's save_pretrained writes them, from random matrices whose values the tests
know."""
import json
import math

import numpy as np
import pytest

from llm_serving.models.default_model import write_hf_llama
from llm_serving.models.lora import (TARGET_MODULES, LoraError, load_lora_adapter, merge_lora, random_lora_tensors,
                                     write_peft_adapter)
from llm_serving.models.weights import load_llama_weights

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=128)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_hf_llama(tmp_path_factory.mktemp("base") / "hf", seed=1, **SHAPE)
    return load_llama_weights(path)


def test_an_adapter_reads_back_with_its_scale_per_module(base, tmp_path):
    cfg, _ = base
    tensors = random_lora_tensors(cfg, rank=4, seed=2)
    adapter = load_lora_adapter("a", write_peft_adapter(tmp_path / "a", tensors, r=4, lora_alpha=8), cfg)
    assert adapter.rank == 4 and adapter.target_modules == tuple(TARGET_MODULES)
    assert len(adapter.deltas) == 2 * 7
    d = adapter.deltas["model.layers.1.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(d.a, tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"])
    np.testing.assert_array_equal(d.b, tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"])
    assert d.a.shape == (4, 64) and d.b.shape == (2 * 16, 4) and d.scale == 8 / 4
    assert adapter.nbytes == sum(t.nbytes for t in tensors.values())

    # rsLoRA divides by sqrt(r); rank_pattern / alpha_pattern give modules their own r and alpha
    tensors = random_lora_tensors(cfg, rank=4, target_modules=["q_proj", "v_proj"], seed=3)
    tensors.update(random_lora_tensors(cfg, rank=2, target_modules=["down_proj"], seed=4))
    path = write_peft_adapter(tmp_path / "b", tensors, r=4, lora_alpha=16, use_rslora=True,
                              rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 4})
    adapter = load_lora_adapter("b", path, cfg, max_rank=4)
    scales = {n.split(".")[-2]: d.scale for n, d in adapter.deltas.items()}
    assert scales == {"q_proj": 16 / 2, "v_proj": 4 / 2, "down_proj": 16 / math.sqrt(2)}
    assert adapter.target_modules == ("q_proj", "v_proj", "down_proj") and adapter.rank == 4


def test_target_module_forms_and_peft_adapter_names(base, tmp_path):
    """target_modules as a list, 'all-linear' or a regular expression; tensors saved with an adapter name
    (`lora_A.default.weight`) read like unnamed ones."""
    cfg, _ = base
    tensors = random_lora_tensors(cfg, rank=2, target_modules=["o_proj"], seed=5, layers=[0])
    named = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
    for i, (targets, t) in enumerate(((["o_proj"], tensors), ("all-linear", tensors),
                                      (r".*layers\.0\.self_attn\.o_proj", named))):
        adapter = load_lora_adapter("x", write_peft_adapter(tmp_path / str(i), t, r=2, lora_alpha=2,
                                                            target_modules=targets), cfg)
        assert list(adapter.deltas) == ["model.layers.0.self_attn.o_proj.weight"]


def test_merged_weights_are_w_plus_scaled_ba_and_apply_as_the_delta(base, tmp_path):
    cfg, weights = base
    adapter = load_lora_adapter("a", write_peft_adapter(tmp_path / "a", random_lora_tensors(cfg, 4, seed=6),
                                                        r=4, lora_alpha=4), cfg)
    merged = merge_lora(weights, adapter)
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    name = "model.layers.0.mlp.down_proj.weight"
    d = adapter.deltas[name]
    np.testing.assert_allclose(x @ merged[name].T, x @ weights[name].T + d.scale * (x @ d.a.T) @ d.b.T,
                               rtol=1e-4, atol=1e-5)
    assert not np.allclose(merged[name], weights[name])
    untouched = [n for n in weights if n not in adapter.deltas]
    assert untouched and all(merged[n] is weights[n] for n in untouched)


def _refusal(tmp_path, cfg, mutate=None, config=None, max_rank=None, **kw):
    tensors = random_lora_tensors(cfg, rank=4, target_modules=["q_proj", "gate_proj"], seed=7)
    if mutate:
        mutate(tensors)
    path = write_peft_adapter(tmp_path / "bad", tensors, r=4, lora_alpha=8, **kw)
    if config:
        cfg_file = path + "/adapter_config.json"
        body = json.loads(open(cfg_file).read())
        body.update(config)
        open(cfg_file, "w").write(json.dumps(body))
    with pytest.raises(LoraError) as e:
        load_lora_adapter("bad", path, cfg, max_rank=max_rank)
    return str(e.value)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize("case,kw,needles", [
    ("A's input width", dict(mutate=lambda t: t.update({Q_A: np.zeros((4, 32), np.float32)})), [Q_A, "(r, 64)"]),
    ("B's output width", dict(mutate=lambda t: t.update({Q_B: np.zeros((60, 4), np.float32)})), [Q_B, "(64, 4)"]),
    ("rank above the maximum", dict(max_rank=2), ["rank 4", "max_lora_rank (2)"]),
    ("a layer the base lacks", dict(mutate=lambda t: t.update(
        {Q_A.replace("layers.0", "layers.5"): np.zeros((4, 64), np.float32),
         Q_B.replace("layers.0", "layers.5"): np.zeros((64, 4), np.float32)})), ["layers.5", "has 2 layers"]),
    ("an embedding adapter", dict(mutate=lambda t: t.update(
        {"base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 64), np.float32)})),
     ["embed_tokens.lora_embedding_A", "is not a LoRA A/B matrix"]),
    ("A without B", dict(mutate=lambda t: t.pop(Q_B)), [Q_A, "no lora_B partner"]),
    ("an unknown target module", dict(target_modules=["q_proj", "lm_head"]), ["lm_head", "cannot be adapted"]),
    ("a module the config does not target", dict(target_modules=["gate_proj"]), [Q_A, "do not name"]),
    ("the rank the config says", dict(config={"r": 8}), ["lora_A.weight' has rank 4", "says 8"]),
    ("DoRA", dict(config={"use_dora": True}), ["use_dora", "DoRA"]),
    ("trained biases", dict(config={"bias": "lora_only"}), ["bias", "'none'"]),
    ("modules saved whole", dict(config={"modules_to_save": ["lm_head"]}), ["modules_to_save"]),
    ("another PEFT method", dict(config={"peft_type": "IA3"}), ["peft_type", "only LoRA"]),
    ("a non-float tensor", dict(mutate=lambda t: t.update({Q_A: np.zeros((4, 64), np.int32)})), [Q_A, "I32"]),
    ("NaN values", dict(mutate=lambda t: t[Q_B].__setitem__((0, 0), np.nan)), [Q_B, "NaN"]),
])
def test_an_adapter_that_does_not_fit_is_refused_naming_what(base, tmp_path, case, kw, needles):
    message = _refusal(tmp_path, base[0], **kw)
    for needle in needles:
        assert needle in message, (case, message)


def test_missing_files_are_refused_with_what_to_do(base, tmp_path):
    cfg, _ = base
    with pytest.raises(LoraError, match="not a directory"):
        load_lora_adapter("x", tmp_path / "nowhere", cfg)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="adapter_config.json: missing"):
        load_lora_adapter("x", tmp_path / "empty", cfg)
    path = write_peft_adapter(tmp_path / "pickled", random_lora_tensors(cfg, 2, ["q_proj"]), r=2, lora_alpha=2)
    (tmp_path / "pickled" / "adapter_model.safetensors").rename(tmp_path / "pickled" / "adapter_model.bin")
    with pytest.raises(LoraError, match="pickle.*safe_serialization=True"):
        load_lora_adapter("x", path, cfg)
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"not safetensors")
    (tmp_path / "pickled" / "adapter_model.bin").rename(tmp_path / "pickled" / "adapter_model.safetensors")
    with pytest.raises(LoraError, match="cannot read safetensors"):
        load_lora_adapter("x", path, cfg)


def test_a_fused_qkv_and_gate_up_adapter_is_cut_into_its_parts(base, tmp_path):
    """Phi-3's checkpoints (and so its adapters) fuse q/k/v and gate/up: lora_B's rows are cut into the parts the
    model keeps, each with the shared lora_A, so the fused delta is the parts' deltas stacked."""
    cfg, _ = base
    rng = np.random.default_rng(9)
    nq, nkv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    pre = "base_model.model.model.layers.1."
    tensors = {pre + "self_attn.qkv_proj.lora_A.weight": rng.standard_normal((3, 64)).astype(np.float32),
               pre + "self_attn.qkv_proj.lora_B.weight": rng.standard_normal((nq + 2 * nkv, 3)).astype(np.float32),
               pre + "mlp.gate_up_proj.lora_A.weight": rng.standard_normal((3, 64)).astype(np.float32),
               pre + "mlp.gate_up_proj.lora_B.weight": rng.standard_normal((2 * inter, 3)).astype(np.float32)}
    adapter = load_lora_adapter("phi", write_peft_adapter(tmp_path / "phi", tensors, r=3, lora_alpha=6), cfg)
    d = adapter.deltas
    assert sorted(n.split(".")[-2] for n in d) == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    fused_b = tensors[pre + "self_attn.qkv_proj.lora_B.weight"]
    stacked = np.concatenate([d[f"model.layers.1.self_attn.{m}_proj.weight"].b for m in "qkv"])
    np.testing.assert_array_equal(stacked, fused_b)
    assert d["model.layers.1.mlp.up_proj.weight"].b.shape == (inter, 3) and d["model.layers.1.mlp.up_proj.weight"].scale == 2
    np.testing.assert_array_equal(d["model.layers.1.self_attn.v_proj.weight"].a,
                                  tensors[pre + "self_attn.qkv_proj.lora_A.weight"])
    bad = dict(tensors)
    bad[pre + "self_attn.qkv_proj.lora_B.weight"] = fused_b[:-1]
    with pytest.raises(LoraError, match="qkv_proj.lora_B.*expected"):
        load_lora_adapter("bad", write_peft_adapter(tmp_path / "bad", bad, r=3, lora_alpha=6), cfg)
