"""Checkpoint formats: llama2.c .bin, HuggingFace safetensors and MindFormers .ckpt load to the same
tensors and logits; broken checkpoints fail at load with a message naming the tensor."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from llm_serving.models.weights import WeightLoadError, expected_shapes, load_llama_weights
from tests.integration.server_harness import REPO, ServerProcess, leftovers
from tests.integration.test_model_runner import Seq, step_view
from tests.integration.test_serving import assert_greedy_reference

CFG = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=32, max_position_embeddings=64, rms_norm_eps=1e-5,
           rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


def _random_hf_tensors(tied: bool, seed: int = 0) -> dict:
    from llm_serving.models.weights import LlamaConfig

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=4, max_position_embeddings=64, tie_word_embeddings=tied)
    rng = np.random.default_rng(seed)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(cfg).items()}
    if tied:
        del tensors["lm_head.weight"]
    return tensors


# ----------------------------------------------------------------------------------------- llama2.c
def _interleave_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half rows -> llama2.c interleaved rows, written out element by element."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def _write_llama2c(path: Path, t: dict, *, shared: bool, seq_len: int = 64, header=None) -> Path:
    L, nh, kvh, d = 2, 4, 2, 4
    layer = lambda name: np.stack([t[f"model.layers.{i}.{name}"] for i in range(L)])  # noqa: E731
    angles = np.outer(np.arange(seq_len), 10000.0 ** (-np.arange(0, d, 2) / d))
    parts = [t["model.embed_tokens.weight"], layer("input_layernorm.weight"),
             np.stack([_interleave_rows(t[f"model.layers.{i}.self_attn.q_proj.weight"], nh) for i in range(L)]),
             np.stack([_interleave_rows(t[f"model.layers.{i}.self_attn.k_proj.weight"], kvh) for i in range(L)]),
             layer("self_attn.v_proj.weight"), layer("self_attn.o_proj.weight"),
             layer("post_attention_layernorm.weight"), layer("mlp.gate_proj.weight"),
             layer("mlp.down_proj.weight"), layer("mlp.up_proj.weight"), t["model.norm.weight"],
             np.cos(angles), np.sin(angles)]
    if not shared:
        parts.append(t["lm_head.weight"])
    header = header or (16, 24, L, nh, kvh, 32 if shared else -32, seq_len)
    with open(path, "wb") as f:
        f.write(struct.pack("<7i", *header))
        for p in parts:
            f.write(np.ascontiguousarray(p, dtype="<f4").tobytes())
    return path


@pytest.mark.parametrize("shared", [True, False])
def test_llama2c_bin_loads_into_hf_layout(tmp_path, shared):
    t = _random_hf_tensors(tied=shared)
    cfg, w = load_llama_weights(str(_write_llama2c(tmp_path / "m.bin", t, shared=shared)))
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (16, 2, 4, 2, 4)
    assert cfg.tie_word_embeddings == shared and cfg.max_position_embeddings == 64
    for name, value in t.items():
        np.testing.assert_array_equal(w[name], value, err_msg=name)
    np.testing.assert_array_equal(w["lm_head.weight"], t["model.embed_tokens.weight" if shared else "lm_head.weight"])


def test_llama2c_bin_that_does_not_match_its_header_is_refused(tmp_path):
    t = _random_hf_tensors(tied=True)
    path = _write_llama2c(tmp_path / "m.bin", t, shared=True)
    data = path.read_bytes()
    (tmp_path / "short.bin").write_bytes(data[:-4])
    with pytest.raises(WeightLoadError, match=r"short\.bin: \d+ bytes, but .*dim.*truncated"):
        load_llama_weights(str(tmp_path / "short.bin"))
    (tmp_path / "v1.bin").write_bytes(struct.pack("<Ii", 0x616B3432, 1) + data[8:])
    with pytest.raises(WeightLoadError, match="version 1 is not supported"):
        load_llama_weights(str(tmp_path / "v1.bin"))
    _write_llama2c(tmp_path / "odd.bin", t, shared=True, header=(16, 24, 2, 3, 2, 32, 64))
    with pytest.raises(WeightLoadError, match="inconsistent"):
        load_llama_weights(str(tmp_path / "odd.bin"))


def test_stories260k_bin_and_hf_directory_hold_identical_tensors(stories_dir):
    cfg_bin, w_bin = load_llama_weights(str(stories_dir / "stories260K.bin"))
    cfg_hf, w_hf = load_llama_weights(str(stories_dir / "hf"))
    assert cfg_bin == cfg_hf
    assert sorted(w_bin) == sorted(w_hf)
    for name in w_hf:
        np.testing.assert_array_equal(w_bin[name], w_hf[name], err_msg=name)


def _greedy_logits(runner, prompt_ids, steps):
    """Prefill then `steps` greedy decodes of one sequence in block 0..; the logits of every step."""
    ids, out = list(prompt_ids), []
    seq = Seq([0, 1])
    _, _, logits = runner.execute(step_view(runner, [seq], [ids], return_logits=True))
    out.append(logits[0])
    for _ in range(steps):
        ids.append(int(np.argmax(out[-1])))
        _, _, logits = runner.execute(step_view(runner, [seq], [[ids[-1]]], return_logits=True))
        out.append(logits[0])
    return np.stack(out)


def test_stories260k_bin_and_hf_directory_give_identical_logits(stories_dir):
    pytest.importorskip("mindspore")
    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.runner_spec import RunnerSpec

    kw = dict(num_blocks=4, block_size=16, max_blocks_per_seq=2, decode_batch_sizes=[1],
              prefill_batch_sizes=[1], prefill_seq_lens=[16], num_threads=2)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(stories_dir / "tok512.model"))
    prompt = [1] + sp.encode("Once upon a time")
    logits = [_greedy_logits(ModelRunner(str(stories_dir / m), RunnerSpec(**kw)), prompt, 12)
              for m in ("stories260K.bin", "hf")]
    assert logits[0].shape == (13, 512)
    np.testing.assert_array_equal(logits[0], logits[1])


def test_server_started_on_the_bin_file_reproduces_llama2c(stories_dir, tmp_path):
    pytest.importorskip("mindspore")
    server = ServerProcess(["--config", str(REPO / "configs" / "stories260K.yaml"),
                            "--model", str(stories_dir / "stories260K.bin"),
                            "--set", "serving_config.agent_ports=[0]"], tmp_path / "server.log")
    try:
        server.wait_ready()
        assert_greedy_reference(server.url, "stories260K", stories_dir)   # served under the file's stem
    finally:
        server.stop()
    assert leftovers(server) == []


# -------------------------------------------------------------------------------------- MindFormers
def _to_mindformers(t: dict, fused: bool) -> dict:
    mf = {"model.tok_embeddings.embedding_weight": t["model.embed_tokens.weight"],
          "model.norm_out.weight": t["model.norm.weight"]}
    if "lm_head.weight" in t:
        mf["lm_head.weight"] = t["lm_head.weight"]
    for i in range(2):
        h, m = f"model.layers.{i}.", f"model.layers.{i}."
        mf[m + "attention_norm.weight"] = t[h + "input_layernorm.weight"]
        mf[m + "ffn_norm.weight"] = t[h + "post_attention_layernorm.weight"]
        mf[m + "attention.wo.weight"] = t[h + "self_attn.o_proj.weight"]
        mf[m + "feed_forward.w2.weight"] = t[h + "mlp.down_proj.weight"]
        if fused:
            mf[m + "attention.w_qkv.weight"] = np.concatenate(
                [t[h + f"self_attn.{x}_proj.weight"] for x in "qkv"])
            mf[m + "feed_forward.w_gate_hidden.weight"] = np.concatenate(
                [t[h + "mlp.gate_proj.weight"], t[h + "mlp.up_proj.weight"]])
        else:
            for x in "qkv":
                mf[m + f"attention.w{x}.weight"] = t[h + f"self_attn.{x}_proj.weight"]
            mf[m + "feed_forward.w1.weight"] = t[h + "mlp.gate_proj.weight"]
            mf[m + "feed_forward.w3.weight"] = t[h + "mlp.up_proj.weight"]
    return mf


def _write_mindformers(root: Path, mf: dict, *, yaml_config: bool, tied: bool) -> Path:
    import mindspore as ms

    root.mkdir(parents=True, exist_ok=True)
    params = [{"name": k, "data": ms.Tensor(v)} for k, v in mf.items()]
    params.append({"name": "adam_m.model.norm_out.weight", "data": ms.Tensor(np.zeros(16, np.float32))})
    params.append({"name": "global_step", "data": ms.Tensor(np.array([7], np.int32))})
    ms.save_checkpoint(params, str(root / "llama.ckpt"))
    if yaml_config:   # MindFormers' own config; intermediate size by LLaMA's rule: 2/3*4*16*0.5 = 21 -> 24
        (root / "predict_llama.yaml").write_text(
            "model:\n  model_config:\n    type: LlamaConfig\n    hidden_size: 16\n    num_layers: 2\n"
            "    num_heads: 4\n    n_kv_heads: 2\n    vocab_size: 32\n    multiple_of: 8\n    ffn_dim_multiplier: 0.5\n"
            "    seq_length: 64\n    rms_norm_eps: 1.0e-5\n    theta: 10000.0\n"
            f"    tie_word_embeddings: {str(tied).lower()}\n  arch:\n    type: LlamaForCausalLM\n")
    else:
        (root / "config.json").write_text(json.dumps(dict(CFG, tie_word_embeddings=tied)))
    return root


@pytest.mark.parametrize("fused,yaml_config,tied", [(False, False, False), (True, True, True)])
def test_mindformers_ckpt_written_by_mindspore_loads_back(tmp_path, fused, yaml_config, tied):
    pytest.importorskip("mindspore")
    t = _random_hf_tensors(tied=tied)
    root = _write_mindformers(tmp_path / "mf", _to_mindformers(t, fused), yaml_config=yaml_config, tied=tied)
    cfg, w = load_llama_weights(str(root))
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads) == (16, 24, 4, 2)
    for name, value in t.items():
        np.testing.assert_array_equal(w[name], value, err_msg=name)
    assert load_llama_weights(str(root / "llama.ckpt"))[0] == cfg       # the .ckpt file itself works too


def test_broken_mindformers_ckpt_names_the_tensor(tmp_path):
    pytest.importorskip("mindspore")
    mf = _to_mindformers(_random_hf_tensors(tied=False), fused=False)
    missing = dict(mf)
    del missing["model.layers.1.feed_forward.w3.weight"]
    root = _write_mindformers(tmp_path / "missing", missing, yaml_config=False, tied=False)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing.*\(24, 16\)"):
        load_llama_weights(str(root))
    wrong = dict(mf, **{"model.layers.0.attention.wk.weight": np.zeros((16, 16), np.float32)})
    root = _write_mindformers(tmp_path / "shape", wrong, yaml_config=False, tied=False)
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\(16, 16\), expected \(8, 16\)"):
        load_llama_weights(str(root))
    ints = dict(mf, **{"model.norm_out.weight": np.arange(16, dtype=np.int32)})
    root = _write_mindformers(tmp_path / "int", ints, yaml_config=False, tied=False)
    with pytest.raises(WeightLoadError, match=r"model\.norm_out\.weight.*dtype Int32"):
        load_llama_weights(str(root))


# --------------------------------------------------------------------------------- HF and detection
def test_integer_safetensors_tensor_is_named(tmp_path):
    from safetensors.numpy import save_file

    t = _random_hf_tensors(tied=True)
    t["model.layers.0.mlp.up_proj.weight"] = np.ones((24, 16), np.int8)
    (tmp_path / "config.json").write_text(json.dumps(dict(CFG, tie_word_embeddings=True)))
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*dtype I8"):
        load_llama_weights(str(tmp_path))


def test_unrecognised_paths_say_what_is_expected(tmp_path):
    with pytest.raises(WeightLoadError, match="no such file"):
        load_llama_weights(str(tmp_path / "nothing"))
    with pytest.raises(WeightLoadError, match="not a model directory"):
        load_llama_weights(str(tmp_path))
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(WeightLoadError, match=r"\.bin or a MindFormers \.ckpt"):
        load_llama_weights(str(tmp_path / "weights.pt"))


# ------------------------------------------------------------------------- a tensor-parallel rank's part
def _save_bf16(path: Path, tensors: dict) -> dict:
    """A safetensors file of BF16 tensors (numpy has no bfloat16: the layout written by hand, each float32
    truncated to its top 16 bits); returns the float32 values a reader must give back."""
    header, blobs, at, exact = {}, [], 0, {}
    for name, value in tensors.items():
        top = (np.ascontiguousarray(value, np.float32).view(np.uint32) >> 16).astype("<u2")
        exact[name] = (top.astype(np.uint32) << 16).view(np.float32)
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [at, at + top.nbytes]}
        blobs.append(top.tobytes())
        at += top.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return exact


def _checkpoint(kind: str, root: Path) -> tuple[Path, dict]:
    """A checkpoint of the small test model in one format, and the float32 tensors it must load to."""
    from safetensors.numpy import save_file

    tied = kind in ("llama2c-shared", "mindformers-fused")
    t = _random_hf_tensors(tied=tied, seed=3)
    root.mkdir(parents=True, exist_ok=True)
    if kind.startswith("llama2c"):
        return _write_llama2c(root / "m.bin", t, shared=tied), t
    if kind.startswith("mindformers"):
        pytest.importorskip("mindspore")
        return _write_mindformers(root, _to_mindformers(t, fused=True), yaml_config=False, tied=tied), t
    (root / "config.json").write_text(json.dumps(dict(CFG, tie_word_embeddings=tied)))
    if kind == "hf-bf16":
        return root, _save_bf16(root / "model.safetensors", t)
    names = sorted(t)                              # hf-f16: two shards and an index, float16 tensors
    halves = {f"model-0000{j + 1}-of-00002.safetensors": names[j::2] for j in range(2)}
    for fname, part in halves.items():
        save_file({k: t[k].astype(np.float16) for k in part}, str(root / fname))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, part in halves.items() for k in part}}))
    return root, {k: v.astype(np.float16).astype(np.float32) for k, v in t.items()}


@pytest.mark.parametrize("kind", ["hf-f16", "hf-bf16", "llama2c-shared", "llama2c-separate", "mindformers-fused"])
def test_each_rank_loads_exactly_its_part_of_every_format(tmp_path, kind):
    from llm_serving.models.parallel import TensorParallel, split_axis

    path, expected = _checkpoint(kind, tmp_path / kind)
    cfg, full = load_llama_weights(str(path))
    if "lm_head.weight" not in expected:
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    assert set(full) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(full[name], value, err_msg=name)
    ranks = [load_llama_weights(str(path), TensorParallel(r, 2))[1] for r in range(2)]
    assert "lm_head.weight" in ranks[0] and "model.norm.weight" in ranks[0]
    assert set(ranks[1]) == set(full) - {"lm_head.weight", "model.norm.weight"}     # no logits on rank 1
    for name, value in full.items():
        axis = split_axis(name)
        if axis is None:
            np.testing.assert_array_equal(ranks[1].get(name, value), value, err_msg=name)
            continue
        assert ranks[0][name].shape[axis] == value.shape[axis] // 2, name
        np.testing.assert_array_equal(np.concatenate([ranks[0][name], ranks[1][name]], axis=axis), value,
                                      err_msg=name)
    with pytest.raises(ValueError, match="tensor parallel over 4 agents.*num_kv_heads=2"):
        load_llama_weights(str(path), TensorParallel(0, 4))


def test_a_rank_reads_only_its_part_of_the_checkpoint(tmp_path):
    """Host memory while loading: a rank of two allocates about half of what loading the whole model does
    (the safetensors slices and the llama2.c memory map read only the rows and columns asked for)."""
    import tracemalloc
    from safetensors.numpy import save_file

    from llm_serving.models.parallel import TensorParallel
    from llm_serving.models.weights import LlamaConfig

    cfg = LlamaConfig(vocab_size=32, hidden_size=128, intermediate_size=512, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=32)
    rng = np.random.default_rng(0)
    t = {k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(cfg).items()}
    root = tmp_path / "hf"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(dict(
        CFG, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2)))
    save_file(t, str(root / "model.safetensors"))

    def peak(tp) -> int:
        tracemalloc.start()
        try:
            load_llama_weights(str(root), tp)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    whole = sum(v.nbytes for v in t.values())
    full, half = peak(None), peak(TensorParallel(1, 2))
    assert full >= whole                      # every tensor, in float32
    assert half < 0.6 * full, (half, full)    # its half of the layers (embedding and norms are replicated)
