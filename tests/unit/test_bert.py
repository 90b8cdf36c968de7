"""BERT encoders as data of the one model: config.json read into LlamaConfig's encoder switches, the checkpoint's
tensors under the internal names, and the float64 reference's embeddings against transformers' (sentence-
transformers' pooling computed with transformers) on tiny random BERTs that transformers makes (tests/families.py);
their GGUF twins (as llama.cpp's converter writes a bert GGUF) read as the same model, vocabulary and pooling."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llm_serving.models.weights import WeightLoadError, expected_shapes, load_llama_weights
from llm_serving.models.weights.hf_config import load_config
from llm_serving.reference_llama import ReferenceLlama
from tests.families import ENCODERS, make_bert_model, needs_transformers, transformers_embedding, write_bert_gguf

TEXTS = ["the little cat sat on the mat", "once upon a time there was a girl named lily",
         "lily and ben played in the park with a red ball", "the dog ran"]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """Each ENCODERS model made once by transformers: {name: directory}."""
    needs_transformers()
    root = tmp_path_factory.mktemp("encoders")
    return {name: make_bert_model(name, root / name, seed=i) for i, name in enumerate(ENCODERS)}


def encode(directory, text: str) -> list:
    """The text's ids as BERT's tokenizer gives them: [CLS] ... [SEP] (the library's own, padding and truncation
    off)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok.encode(text).ids


def test_a_bert_config_is_llama_with_the_encoder_switches(encoders):
    cfg = load_config(str(encoders["bert"]))
    settings, _ = ENCODERS["bert"]
    assert (cfg.architecture, cfg.causal, cfg.generates, cfg.norm, cfg.post_norm, cfg.gated_mlp, cfg.mlp_bias) == \
        ("bert", False, False, "layer", True, False, True)
    assert (cfg.attention_bias, cfg.o_bias, cfg.learned_positions, cfg.embed_norm, cfg.hidden_act) == \
        (True, True, True, True, "gelu")
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (64, 4, 4, 16, 96)
    assert (cfg.max_position_embeddings, cfg.type_vocab_size, cfg.rms_norm_eps) == (128, 2, 1e-12)
    assert all(cfg.layer_rope(i) == "none" for i in range(cfg.num_layers))
    shapes = expected_shapes(cfg)
    assert "lm_head.weight" not in shapes and "model.norm.weight" not in shapes
    assert shapes["model.embed_positions.weight"] == (128, 64)
    assert shapes["model.layers.1.mlp.up_proj.bias"] == (96,) and "model.layers.1.mlp.gate_proj.weight" not in shapes
    assert shapes["model.layers.0.attn_output_norm.bias"] == (64,)


def test_a_bert_checkpoint_loads_under_the_internal_names(encoders):
    """Every tensor the model needs, the BertModel's own values under their internal names; a head's checkpoint
    (BertForMaskedLM's `bert.` prefix) reads the same."""
    from safetensors.numpy import load_file, save_file

    directory = encoders["bert"]
    cfg, weights = load_llama_weights(str(directory))
    assert set(weights) == set(expected_shapes(cfg))
    raw = load_file(str(directory / "model.safetensors"))
    np.testing.assert_array_equal(weights["model.layers.1.self_attn.k_proj.bias"],
                                  raw["encoder.layer.1.attention.self.key.bias"])
    np.testing.assert_array_equal(weights["model.layers.0.mlp.down_proj.weight"],
                                  raw["encoder.layer.0.output.dense.weight"])
    np.testing.assert_array_equal(weights["model.layers.0.mlp_output_norm.bias"],
                                  raw["encoder.layer.0.output.LayerNorm.bias"])
    np.testing.assert_array_equal(weights["model.embed_norm.weight"], raw["embeddings.LayerNorm.weight"])
    prefixed = directory.parent / "bert-prefixed"
    prefixed.mkdir()
    save_file({f"bert.{name}": arr for name, arr in raw.items()}, str(prefixed / "model.safetensors"))
    head = json.loads((directory / "config.json").read_text())
    (prefixed / "config.json").write_text(json.dumps({**head, "architectures": ["BertForMaskedLM"]}))
    _, again = load_llama_weights(str(prefixed))
    assert set(again) == set(weights)
    for name, arr in weights.items():
        np.testing.assert_array_equal(again[name], arr, err_msg=name)


@pytest.mark.parametrize("change,words", [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ({"is_decoder": True}, "decoder"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"model_type": "nomic_bert", "architectures": ["NomicBertModel"]}, "nomic_bert"),
])
def test_bert_options_it_would_compute_wrong_are_refused_by_name(encoders, tmp_path, change, words):
    raw = json.loads((encoders["bert"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(WeightLoadError, match=words):
        load_config(str(tmp_path))


@pytest.mark.parametrize("name", list(ENCODERS))
def test_the_reference_embeds_as_transformers_does(encoders, name):
    """Mean pooling (all-MiniLM's) and the [CLS] token's (bge's), each input's vector within 1e-9 of
    transformers' float32 one: the encoder's every part (positions, token type 0, the LayerNorms and biases, the
    bidirectional attention, GELU) is computed as transformers computes it."""
    directory = encoders[name]
    ref = ReferenceLlama(str(directory))
    _, pooling = ENCODERS[name]
    for text in TEXTS:
        ids = encode(directory, text)
        assert ids[0] == 2 and ids[-1] == 3 and len(ids) > 3           # [CLS] ... [SEP]
        want = transformers_embedding(directory, ids, pooling)
        got = ref.embed(ids, pooling)
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_the_encoders_attention_is_bidirectional(encoders):
    """Changing the last token changes the first token's state (a causal model's would not), and the reference
    refuses to continue an input (an encoder computes it whole) or to give logits (it has no lm_head)."""
    ref = ReferenceLlama(str(encoders["bert-cls"]))
    ids = encode(encoders["bert-cls"], TEXTS[0])
    first = ref.embed(ids, "cls")
    changed = ref.embed(ids[:-2] + [ids[-2] + 1, ids[-1]], "cls")
    assert np.abs(first - changed).max() > 1e-3
    seq = ref.new_sequence()
    with pytest.raises(ValueError, match="lm_head"):
        ref.forward(seq, ids, 0)
    with pytest.raises(ValueError, match="whole input"):
        ref._hidden(seq, ids[2:], 2)


@pytest.mark.parametrize("name", list(ENCODERS))
def test_a_bert_gguf_is_the_same_model_vocabulary_and_pooling(encoders, name, tmp_path):
    """The F32 GGUF twin: every config field and tensor the HF directory's (exactly), the pooling its pooling_type
    declares, and its rebuilt WordPiece vocabulary (phantom-space pieces back in HF's form) giving each text the HF
    tokenizer's ids, [CLS] ... [SEP]."""
    import dataclasses

    from llm_serving.models.pooling import declared_pooling
    from llm_serving.tokenization import load_tokenizer

    directory = encoders[name]
    twin = write_bert_gguf(directory, tmp_path / f"{name}.gguf")
    cfg, weights = load_llama_weights(str(directory))
    cfg2, weights2 = load_llama_weights(str(twin))
    for field in dataclasses.fields(cfg):          # (GGUF keeps floats as float32: the epsilon to 1e-6)
        want, got = getattr(cfg, field.name), getattr(cfg2, field.name)
        assert got == pytest.approx(want, rel=1e-6) if isinstance(want, float) else got == want, field.name
    assert set(weights2) == set(weights)
    for tensor, arr in weights.items():
        np.testing.assert_array_equal(weights2[tensor], arr, err_msg=tensor)
    assert declared_pooling(str(twin))[0] == ENCODERS[name][1]
    tok = load_tokenizer(str(twin))
    for text in TEXTS + ["Lily's dog, Max, ran FAST!"]:
        assert tok.encode(text, add_bos=True) + list(tok.input_suffix) == encode(directory, text), text


def test_a_quantized_bert_gguf_keeps_its_matrices_as_stored_and_its_tables_float32(encoders, tmp_path):
    """Q8_0: the layers' matrices and the word embedding are the CPU kernels' stored rows; the position and token
    type rows (the embedding's float32 tables) are not; the reference on the dequantized weights stays close to
    transformers' (Q8_0's rounding)."""
    import gguf

    from llm_serving.models.weights import load_quantized

    twin = write_bert_gguf(encoders["bert"], tmp_path / "bert-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    stored = load_quantized(str(twin))
    assert "model.layers.0.mlp.up_proj.weight" in stored and "model.embed_tokens.weight" in stored
    assert not {"model.embed_positions.weight", "model.embed_token_types.weight"} & set(stored)
    ids = encode(encoders["bert"], TEXTS[1])
    got = ReferenceLlama(str(twin)).embed(ids, "mean")
    assert float(got @ transformers_embedding(encoders["bert"], ids, "mean")) > 0.999
