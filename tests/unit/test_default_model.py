"""The generated default model: deterministic, HuggingFace-shaped, safe to build concurrently."""
import json
import logging
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from llm_serving.models import default_model
from llm_serving.cache_dir import default_cache_dir
from llm_serving.models.default_model import (DEFAULT_MODEL_NAME, ensure_default_model, generate_story_lines,
                                              write_hf_llama)
from llm_serving.tokenization import SentencePieceTokenizer
from tests.conftest import TOK512

FILES = ("config.json", "model.safetensors", "tokenizer.model")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def expected_shapes(vocab, hidden, inter, layers, kv_dim, tied=False) -> dict:
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def test_two_builds_are_byte_identical(model_dir, tmp_path):
    again = ensure_default_model(tmp_path)
    assert again.name == model_dir.name and again.name.startswith(DEFAULT_MODEL_NAME + "-")
    for name in FILES:
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_config_is_huggingface_llama(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def test_weights_have_huggingface_names_and_shapes(model_dir):
    weights = load_file(str(model_dir / "model.safetensors"))
    assert {n: w.shape for n, w in weights.items()} == expected_shapes(1024, 128, 352, 4, kv_dim=64)
    assert all(w.dtype == np.float32 for w in weights.values())
    assert np.all(weights["model.norm.weight"] == 1.0)
    assert np.all(weights["model.layers.3.post_attention_layernorm.weight"] == 1.0)
    embed = weights["model.embed_tokens.weight"]
    assert abs(float(embed.mean())) < 1e-3 and abs(float(embed.std()) - 0.02) < 1e-3
    assert not np.array_equal(embed, weights["lm_head.weight"])


def test_tokenizer_is_llama_style_and_round_trips_story_text(model_dir):
    tok = SentencePieceTokenizer(model_dir / "tokenizer.model")
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (1024, 1, 2, 0)
    assert tok.is_special(0) and tok.id_to_piece(0) == "<unk>"
    stories = list(generate_story_lines(20, seed=99))  # not the training seed
    for line in stories:
        ids = tok.encode(line)
        assert tok.decode(ids) == line
    # it learned the corpus' words: well under one token per 3 characters
    text = " ".join(stories)
    assert len(tok.encode(text)) < len(text) / 3
    # unseen characters fall back to bytes instead of <unk>
    ids = tok.encode("Zoë saw 你好 🙂")
    assert 0 not in ids and tok.decode(ids) == "Zoë saw 你好 🙂"


def test_second_call_reuses_the_directory(model_dir):
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    assert sorted(p.name for p in model_dir.parent.iterdir()) == [model_dir.name]


def test_warns_that_weights_are_random(model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        ensure_default_model(model_dir.parent)
    assert any(r.levelno == logging.WARNING and "RANDOM" in r.getMessage() for r in caplog.records)


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("LLM_SERVING_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "llm-serving"


def test_losing_the_rename_race_uses_the_winner(monkeypatch, tmp_path):
    build = default_model._build_default_model

    def build_while_another_process_wins(out_dir):
        build(tmp_path / default_model.default_model_dir_name())  # the other process finishes first
        build(out_dir)

    monkeypatch.setattr(default_model, "_build_default_model", build_while_another_process_wins)
    path = ensure_default_model(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # temp copy removed
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)


def _build_in_child(cache_dir, barrier, results):
    barrier.wait()
    results.put(str(ensure_default_model(Path(cache_dir))))


def test_concurrent_builds_in_two_processes(model_dir, tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(tmp_path), barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    paths = {results.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(paths) == 1
    built = Path(paths.pop())
    assert sorted(p.name for p in tmp_path.iterdir()) == [built.name]
    for name in FILES:
        assert (built / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_write_hf_llama_other_shapes_and_tied_embeddings(tmp_path):
    tokenizer_bytes = TOK512.read_bytes()
    out = write_hf_llama(tmp_path / "m", vocab_size=512, hidden_size=64, intermediate_size=96,
                         num_layers=2, num_heads=8, num_kv_heads=4, max_position_embeddings=256,
                         seed=7, tokenizer_model_bytes=tokenizer_bytes, tie_word_embeddings=True)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 4
    weights = load_file(str(out / "model.safetensors"))
    assert {n: w.shape for n, w in weights.items()} == expected_shapes(512, 64, 96, 2, kv_dim=32,
                                                                       tied=True)
    assert (out / "tokenizer.model").exists() == (tokenizer_bytes is not None)
    with pytest.raises(ValueError, match="num_kv_heads"):
        write_hf_llama(tmp_path / "bad", vocab_size=8, hidden_size=64, intermediate_size=96,
                       num_layers=1, num_heads=8, num_kv_heads=3, max_position_embeddings=16, seed=0)
