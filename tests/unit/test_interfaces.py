"""The interfaces of the tokenization and weights packages: every tokenizer reader has the whole `Tokenizer`
interface, every format `detect_format` names has a reader, and the shared helpers do what their names say.
No MindSpore."""
import inspect

import numpy as np
import pytest

from llm_serving.models.default_model import ensure_default_model
from llm_serving.models.weights import rotate_half_rows
from llm_serving.models.weights.loader import READERS, detect_format
from llm_serving.tokenization import HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer
from tests.unit.test_tokenizer_hf import llama2_style_tokenizer_json, train_byte_level


def _interface_names() -> set:
    members = {name for name, _ in inspect.getmembers(Tokenizer, inspect.isfunction) if not name.startswith("_")}
    return members | set(Tokenizer.__annotations__)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """One tokenizer of each reader: a sentencepiece model, a byte-level tokenizer.json and a Metaspace one."""
    root = tmp_path_factory.mktemp("tok")
    return {"sentencepiece": load_tokenizer(str(ensure_default_model(root / "cache"))),
            "byte-level": load_tokenizer(str(train_byte_level(root / "bl", "gpt2", ["<s>", "</s>"],
                                                              config={"bos_token": "<s>", "eos_token": "</s>"}))),
            "metaspace": load_tokenizer(str(llama2_style_tokenizer_json(root / "sp")))}


@pytest.mark.parametrize("kind", ["sentencepiece", "byte-level", "metaspace"])
def test_every_reader_has_the_whole_tokenizer_interface(tokenizers, kind):
    tok = tokenizers[kind]
    assert isinstance(tok, SentencePieceTokenizer if kind == "sentencepiece" else HFTokenizer)
    missing = {name for name in _interface_names() if not hasattr(tok, name)}
    assert not missing, f"{type(tok).__name__} lacks {sorted(missing)}"
    det = tok.detokenizer(tok.encode("Once upon", add_bos=False))
    ids = tok.encode(" a time", add_bos=False)
    assert "".join(det.push(i) for i in ids) + det.flush() == det.text != ""


def test_every_detected_format_has_a_reader(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    (tmp_path / "mf").mkdir()
    (tmp_path / "mf" / "m.ckpt").write_bytes(b"")
    files = {"m.gguf": "gguf", "m.bin": "llama2c", "m.ckpt": "mindformers"}
    for name in files:
        (tmp_path / name).write_bytes(b"")
    found = {detect_format(str(tmp_path / "hf")), detect_format(str(tmp_path / "mf"))}
    found |= {detect_format(str(tmp_path / name)) for name in files}
    assert found == set(READERS) == {"hf", "gguf", "llama2c", "mindformers"}


def test_rotate_half_rows_turns_interleaved_pairs_into_halves():
    head_dim, num_heads = 4, 2
    w = np.arange(head_dim * num_heads, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)   # (8, 3)
    out = rotate_half_rows(w, num_heads)
    # per head: rows (0,1),(2,3) are pairs (x0, y0), (x1, y1) -> first halves x0, x1, then y0, y1
    assert out[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert out.shape == w.shape and out.flags.c_contiguous

