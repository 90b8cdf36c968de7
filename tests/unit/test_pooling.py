"""models/pooling.py: the pooling a sentence-transformers model declares, the widths a request may ask, and how
/rerank scores, read from the checkpoint's files."""
import json

from llm_serving.models.pooling import declared_pooling, embedding_spec, score_method


def _declare(path, **modes):
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))


def test_the_declared_pooling_is_read_and_a_setting_overrides_it(tmp_path):
    assert declared_pooling(str(tmp_path)) is None
    assert embedding_spec("auto", str(tmp_path), 64).pooling == "mean"          # nothing declared: mean
    _declare(tmp_path, pooling_mode_lasttoken=True, pooling_mode_mean_tokens=False)
    assert declared_pooling(str(tmp_path)) == ("last", "1_Pooling/config.json")
    spec = embedding_spec("auto", str(tmp_path), 64)
    assert (spec.pooling, spec.source, spec.dimensions) == ("last", "1_Pooling/config.json", 64)
    assert embedding_spec("cls", str(tmp_path), 64).pooling == "cls"
    assert embedding_spec("auto", str(tmp_path / "model.gguf"), 64).pooling == "mean"   # a file: nothing declared


def test_dimensions_are_refused_unless_the_model_is_matryoshka(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    plain = embedding_spec("auto", str(tmp_path), 64)
    assert plain.check_dimensions(64) is None
    assert "not a Matryoshka model" in plain.check_dimensions(32)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "is_matryoshka": True}))
    any_width = embedding_spec("auto", str(tmp_path), 64)
    assert any_width.check_dimensions(32) is None and "between 1 and 64" in any_width.check_dimensions(65)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "matryoshka_dimensions": [16, 32]}))
    listed = embedding_spec("auto", str(tmp_path), 64)
    assert listed.check_dimensions(16) is None and listed.check_dimensions(64) is None
    assert "one of 16, 32, 64" in listed.check_dimensions(20)


def test_a_reranker_is_known_by_its_name_unless_the_setting_says():
    assert score_method("auto", "/models/Qwen3-Reranker-0.6B", None) == "yes_no"
    assert score_method("auto", "/models/hf", "my-reranker") == "yes_no"
    assert score_method("auto", "/models/Qwen3-Embedding-0.6B", "Qwen3-Embedding-0.6B") == "similarity"
    assert score_method("similarity", "/models/Qwen3-Reranker-0.6B", None) == "similarity"
