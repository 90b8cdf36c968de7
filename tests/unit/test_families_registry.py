"""The model-family registry (llm_serving/models/families/) against what it describes: every name resolves to its
family and to no other, the tests and code it names exist and are about it, README's family table and format rows
name every family, and the readers give the LlamaConfig fields each family declares (config.json and GGUF metadata
only: no tensors, no torch, no MindSpore)."""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from llm_serving.models import families
from llm_serving.models.families import FAMILIES, FIXED_FIELDS
from llm_serving.models.weights import WeightLoadError, load_config, model_shape
from tests.families import ENCODERS
from tests.families import FAMILIES as TEST_MODELS

ROOT = Path(__file__).resolve().parents[2]
# LLaMA has no tiny model in tests/families.py (the other tests make theirs with write_hf_llama): its config.json
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=64, hidden_size=64,
             intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)


def _configs() -> dict:
    """Every tiny model's config.json by its key (tests/families.py's FAMILIES and ENCODERS, and LLaMA's)."""
    out = {"llama": LLAMA, **TEST_MODELS}
    for key, (settings, _) in ENCODERS.items():
        out[key] = dict(settings, architectures=["BertModel"], model_type="bert")
    return out


def _family_of(key: str) -> families.Family:
    return next(f for f in FAMILIES.values() if key in f.test_models or (key == "llama" and f.name == "llama"))


def _load(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return load_config(str(tmp_path))


# ------------------------------------------------------------------------------------------ names

def test_every_name_resolves_to_its_family_and_no_name_is_claimed_twice():
    hf = [a for f in FAMILIES.values() for a in f.hf_architectures]
    gguf = [f.gguf_architecture for f in FAMILIES.values() if f.gguf_architecture]
    kinds = [k for f in FAMILIES.values() for k in f.hf_model_types]
    assert len(hf) == len(set(hf)) and len(gguf) == len(set(gguf)) and len(kinds) == len(set(kinds))
    assert families.supported_hf_architectures() == tuple(hf)
    assert families.supported_gguf_architectures() == tuple(gguf)
    for name, family in FAMILIES.items():
        assert family.name == name
        assert importlib.import_module(f"llm_serving.models.families.{name}").FAMILY is family
        assert all(families.by_hf_architecture(a) is family for a in family.hf_architectures)
        assert all(families.by_hf_model_type(k) is family for k in family.hf_model_types)
        if family.gguf_architecture:
            assert families.by_gguf_architecture(family.gguf_architecture) is family
        else:                   # (Mistral, Mixtral: llama.cpp's `llama`, read as LLaMA's)
            owner = FAMILIES[family.gguf_as]
            assert families.by_gguf_architecture(owner.gguf_architecture) is owner
    assert families.by_hf_architecture("Gemma2ForCausalLM") is None and families.by_gguf_architecture("gemma2") is None


def test_an_unknown_architecture_is_refused_naming_every_one_the_registry_has(tmp_path):
    with pytest.raises(WeightLoadError, match="architecture 'Gemma2ForCausalLM' is not supported") as e:
        _load(tmp_path, dict(LLAMA, architectures=["Gemma2ForCausalLM"]))
    assert str(e.value).endswith(f"(supported: {', '.join(families.supported_hf_architectures())})")
    with pytest.raises(WeightLoadError, match="nomic_bert .* is not supported"):
        _load(tmp_path, dict(LLAMA, model_type="nomic_bert"))
    with pytest.raises(WeightLoadError, match="GGUF architecture 'gemma2' is not supported") as e:
        model_shape(_metadata_gguf(tmp_path / "g.gguf", "gemma2"))
    assert str(e.value).endswith(f"(supported: {', '.join(families.supported_gguf_architectures())})")


# ------------------------------------------------------------------------------------------ what it points at

def _mentions(family: families.Family) -> tuple:
    """The words a test or document about `family` names it by."""
    return (family.name, family.title, *family.hf_architectures, *family.test_models,
            *([family.gguf_architecture] if family.gguf_architecture else []))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_familys_tests_code_and_reference_exist_and_are_about_it(name):
    family = FAMILIES[name]
    assert family.tests, name
    for entry in family.tests:
        path, _, test = entry.partition("::")
        text = (ROOT / path).read_text(encoding="utf-8")
        assert any(word in text for word in _mentions(family)), (entry, "does not name", name)
        assert not test or re.search(rf"^def {test}\(", text, re.M), (entry, "has no such test")
    for place in family.chat_code:
        path, _, word = place.partition(":")
        assert word in (ROOT / path).read_text(encoding="utf-8"), place
    source = (ROOT / "llm_serving/models/weights/hf_config.py").read_text(encoding="utf-8") + \
        (ROOT / f"llm_serving/models/families/{name}.py").read_text(encoding="utf-8")
    assert all(f'"{key}"' in source for key in family.config_keys), "a config key nothing reads"
    assert (ROOT / family.reference).is_file()


def test_every_tiny_model_belongs_to_the_family_its_config_names():
    claimed = [key for f in FAMILIES.values() for key in f.test_models]
    assert sorted(claimed) == sorted([*TEST_MODELS, *ENCODERS])
    for key, raw in _configs().items():
        family = _family_of(key)
        assert (families.by_hf_model_type(raw.get("model_type"))
                or families.by_hf_architecture(raw["architectures"][0])) is family, key


# ------------------------------------------------------------------------------------------ README

def _table_rows(text: str, header: str) -> list:
    """The first cells of the rows of README's table whose header starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line.split("|")[1].strip())
    return rows


def test_readmes_family_table_has_every_family_in_one_row_and_only_families():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = _table_rows(text, "| family | what differs from LLaMA")
    named = {f.readme_row for f in FAMILIES.values() if f.readme_row}
    assert len(rows) == len(set(rows)), rows
    assert set(rows) == named, (set(rows) ^ named)
    baseline = [f for f in FAMILIES.values() if f.readme_row is None]
    assert [f.name for f in baseline] == ["llama"]      # the table's header: what differs from LLaMA
    assert baseline[0].title in "what differs from LLaMA"


def test_readmes_format_rows_name_every_architecture_the_registry_reads():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    hf_row = next(line for line in lines if line.startswith("| HuggingFace directory |"))
    gguf_row = next(line for line in lines if line.startswith("| GGUF file |"))
    assert [a for a in families.supported_hf_architectures() if f"`{a}`" not in hf_row] == []
    assert [a for a in families.supported_gguf_architectures() if f"`{a}`" not in gguf_row] == []


# ------------------------------------------------------------------------------------------ what the readers give

@pytest.mark.parametrize("key", list(_configs()))
def test_load_config_gives_the_fields_the_family_declares(tmp_path, key):
    family, raw = _family_of(key), _configs()[key]
    cfg = _load(tmp_path, raw)
    assert cfg.architecture == family.name
    assert {f: getattr(cfg, f) for f in FIXED_FIELDS} == {f: getattr(family, f) for f in FIXED_FIELDS}
    assert (cfg.embed_scale != 1.0) == family.scaled_embedding
    assert (cfg.query_scale is not None) == (family.query_scale is not None)
    assert (cfg.num_experts > 0) == (family.experts is not None) == (family.moe_routing is not None)
    assert not cfg.nope_layers or family.nope_layers is not None
    if family.hf_config is None:                        # (an encoder's config is its own)
        text = dict(raw.get("text_config", raw))
        text.pop("tie_word_embeddings", None)
        assert _load(tmp_path, _with_text(raw, text)).tie_word_embeddings == \
            family.hf_defaults.get("tie_word_embeddings", family.tied_by_default)


def _with_text(raw: dict, text: dict) -> dict:
    """`raw` with its text model's config (itself, or a multimodal config's text_config) replaced by `text`."""
    return {**raw, "text_config": text} if "text_config" in raw else text


def _window_by_rule(family: families.Family, text: dict, num_layers: int) -> tuple:
    """(sliding_window, layer_types) that config `text`'s window of 16 (no layer_types) gives by the family's
    declared rule: none; every layer; its rule for the sliding layers (without one every layer), only with
    use_sliding_window when optional."""
    if family.window == "none" or (family.window == "optional" and not text.get("use_sliding_window")):
        return None, None
    if family.window == "always" or family.sliding_layers is None:
        return 16, None
    kinds = tuple(t.split("_")[0] for t in family.sliding_layers(text, num_layers, ""))
    if "sliding" not in kinds:
        return None, None
    return 16, None if "full" not in kinds else kinds


@pytest.mark.parametrize("use", [None, True], ids=["window", "use_sliding_window"])
@pytest.mark.parametrize("key", [k for k in _configs() if _family_of(k).hf_config is None])
def test_a_window_slides_by_the_familys_rule(tmp_path, key, use):
    family, raw = _family_of(key), _configs()[key]
    text = {k: v for k, v in raw.get("text_config", raw).items() if k not in ("layer_types", "use_sliding_window")}
    text = dict(text, sliding_window=16, **({} if use is None else {"use_sliding_window": use}))
    cfg = _load(tmp_path, _with_text(raw, text))
    assert (cfg.sliding_window, cfg.layer_types) == _window_by_rule(family, text, cfg.num_layers)


def _metadata_gguf(path, arch, layers=4, **keys):
    """A GGUF of metadata (and a token embedding) only: `keys` as GGUFWriter.add_<key>(value)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in dict(block_count=layers, embedding_length=64, feed_forward_length=128, head_count=4,
                           head_count_kv=2, key_length=16, context_length=256, **keys).items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.gguf_architecture and f.gguf_config is None])
def test_a_gguf_reads_as_its_family_with_llama_cpps_rules(tmp_path, monkeypatch, name):
    """What a GGUF's metadata does not say, the family does: its activation, norms and embedding scale, llama.cpp's
    sliding pattern and NoPE interval (attention biases, sinks and q/k norms come from the tensors present)."""
    monkeypatch.setenv("LLM_SERVING_GGUF_CACHE", "0")
    family = FAMILIES[name]
    cfg = model_shape(_metadata_gguf(tmp_path / "m.gguf", family.gguf_architecture, layers=6, sliding_window=16))
    assert (cfg.architecture, cfg.hidden_act, cfg.sandwich_norms) == (name, family.hidden_act, family.sandwich_norms)
    assert (cfg.embed_scale == 8.0) == family.scaled_embedding and (cfg.query_scale is not None) == \
        (family.gguf_query_scale is not None)
    every = family.gguf_window_pattern
    assert cfg.layer_types == (None if every is None else
                               tuple("full" if i % every == every - 1 else "sliding" for i in range(6)))
    nope = family.gguf_nope_interval
    assert cfg.nope_layers == (() if nope is None else tuple(i for i in range(6) if (i + 1) % nope == 0))
