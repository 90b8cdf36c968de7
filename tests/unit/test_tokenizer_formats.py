"""Tokenizers beyond a bare sentencepiece model: a HuggingFace tokenizer.json (byte-level BPE, trained here with
the `tokenizers` library), a GGUF's own vocabulary (gpt2 and llama kinds, written here with `gguf`), which file
a model's tokenizer comes from, and chat templates through them. No MindSpore."""
import json
import random

import numpy as np
import pytest

from llm_serving.tokenization import SentencePieceTokenizer, find_tokenizer_file, load_chat_template, load_tokenizer
from tests.conftest import LLAMA2_TOKENIZER, TOK512, restricted_file

TEXTS = ["Hello world", "The year 2024 had 366 days.", "  leading and   inner  spaces\n\ttab",
         "中文字符和日本語のテキスト", "emoji 🙂👍🏽 and accents: café naïve", "digits 123456789"]
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _corpus():
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog café naïve 中文 字符 日本語 テキスト 🙂 👍🏽 2024 366".split()
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)] + TEXTS


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json (GPT-2 style: individual digits like SmolLM's) with BOS/EOS, ChatML
    special tokens, tokenizer_config.json and generation_config.json (two EOS ids)."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    out = tmp_path_factory.mktemp("bytelevel")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True, "chat_template": CHATML}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return out


def test_tokenizer_json_round_trips_and_follows_the_model(byte_level_dir):
    tok = load_tokenizer(str(byte_level_dir))
    assert tok.model_file == str(byte_level_dir / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (0, 1) and tok.eos_ids == [1, 3]
    vocab = json.loads((byte_level_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.vocab_size == len(vocab) and tok.add_bos
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]       # BOS only in front, as the model wants
        assert tok.decode(ids) == text
        assert tok.encode(text, add_bos=False) == ids[1:]
    # special-token strings in text become their ids; decode drops them unless asked
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_bos=False)
    assert ids[0] == 2 and ids[-1] == 3 and tok.is_special(2) and not tok.is_special(ids[1])
    assert tok.decode(ids) == "user\nhi" and tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    assert [tok.decode([i]) for i in tok.encode("2024", add_bos=False)] == ["2", "0", "2", "4"]


def test_add_bos_comes_from_the_post_processor_when_the_config_is_silent(byte_level_dir, tmp_path):
    from tokenizers import processors
    from tokenizers import Tokenizer as HFTok

    for template, expected in (("<s> $A", True), ("$A", False)):
        tok = HFTok.from_file(str(byte_level_dir / "tokenizer.json"))
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0)])
        folder = tmp_path / str(expected)
        folder.mkdir()
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
        loaded = load_tokenizer(str(folder))
        assert loaded.add_bos is expected
        assert loaded.encode("hi")[:1] == ([0] if expected else loaded.encode("hi", add_bos=False)[:1])


def _check_stream(tok, ids, prompt=()):
    """The detokenizer's deltas: never half a character, and they add up to the text decoded at once."""
    det = tok.detokenizer(list(prompt))
    deltas = [det.push(i) for i in ids] + [det.flush()]
    full = tok.decode(list(prompt) + list(ids))[len(tok.decode(list(prompt))):]
    assert "".join(deltas) == full == det.text
    assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in tok.decode(ids)
    return deltas


def test_streaming_never_splits_a_character(byte_level_dir):
    tok = load_tokenizer(str(byte_level_dir))
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        _check_stream(tok, ids)
        _check_stream(tok, ids, prompt=tok.encode("prompt:"))
    # an emoji the training text never had is split over byte tokens: nothing is emitted until it is whole
    emoji_ids = tok.encode("🦙", add_bos=False)
    raw = b"".join(tok.token_bytes(i) for i in emoji_ids)
    assert raw == "🦙".encode() and len(emoji_ids) >= 2
    det = tok.detokenizer()
    assert [det.push(i) for i in emoji_ids] == [""] * (len(emoji_ids) - 1) + ["🦙"]
    # random id sequences, specials included: the invariant holds whatever the model emits
    rng = np.random.default_rng(1)
    for _ in range(200):
        ids = rng.integers(0, tok.vocab_size, rng.integers(1, 12)).tolist()
        _check_stream(tok, ids)


@pytest.fixture(scope="module")
def gguf_gpt2(byte_level_dir, tmp_path_factory):
    """The same vocabulary as a GGUF gpt2 tokenizer (tokens, merges, types), as llama.cpp's converter writes it."""
    gguf = pytest.importorskip("gguf")
    raw = json.loads((byte_level_dir / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    types = [gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens]
    path = tmp_path_factory.mktemp("gguf") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_byte_level_vocabulary_encodes_like_its_tokenizer_json(byte_level_dir, gguf_gpt2, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path))
    ref = load_tokenizer(str(byte_level_dir))
    built = load_tokenizer(str(gguf_gpt2))
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    cached = load_tokenizer(str(gguf_gpt2))              # the second load reads what the first one cached
    for tok in (built, cached):
        assert tok.model_file == str(gguf_gpt2) and tok.vocab_size == ref.vocab_size
        assert not tok.add_bos and tok.eos_ids == [1]
        for text in TEXTS + ["<|im_start|>user\n2+2=4<|im_end|>"]:
            assert tok.encode(text) == ref.encode(text, add_bos=False), text
            assert tok.decode(tok.encode(text), skip_special=False) == text
        assert all(tok.is_special(i) for i in range(4)) and not tok.is_special(4)
        assert tok.chat_template == CHATML


def _spm_as_gguf(model_file, path):
    """A sentencepiece model's pieces, scores and types as a GGUF llama vocabulary."""
    import gguf
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    n = sp.get_piece_size()
    kind = [gguf.TokenType.CONTROL if sp.is_control(i) else gguf.TokenType.UNKNOWN if sp.is_unknown(i) else
            gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.UNUSED if sp.is_unused(i) else
            gguf.TokenType.NORMAL for i in range(n)]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(kind)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_tensor("token_embd.weight", np.zeros((n, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model", ["tok512", "llama2"])
def test_gguf_llama_vocabulary_is_the_sentencepiece_model(tmp_path, model, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path / "cache"))
    model = TOK512 if model == "tok512" else restricted_file(LLAMA2_TOKENIZER)
    ref = SentencePieceTokenizer(model)
    path = _spm_as_gguf(model, tmp_path / "vocab.gguf")
    for tok in (load_tokenizer(str(path)), load_tokenizer(str(path))):    # built, then from the cache
        assert isinstance(tok, SentencePieceTokenizer) and tok.add_bos
        assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (ref.vocab_size, ref.bos_id, ref.eos_id)
        for text in ["Once upon a time, there was a little dog.", "中文 🙂 bytes", "x = 1; y = 22"]:
            assert tok.encode(text) == ref.encode(text), text
            assert tok.decode(tok.encode(text)) == ref.decode(ref.encode(text))


def test_chat_template_through_byte_level_tokens(byte_level_dir):
    tok = load_tokenizer(str(byte_level_dir))
    template = load_chat_template(None, str(byte_level_dir), tok)      # the tokenizer's own (tokenizer_config)
    ids = template.encode([{"role": "user", "content": "hi"}])
    assert ids[0] == 2 and ids.count(2) == 2 and ids.count(3) == 1     # <|im_start|> twice, <|im_end|> once
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_which_file_a_tokenizer_comes_from(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert find_tokenizer_file(str(tmp_path / "m.gguf")) == str(tmp_path / "m.gguf")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "tokenizer.json").write_text("{}")
    assert find_tokenizer_file(str(hf)) == str(hf / "tokenizer.json")
    (hf / "tokenizer.model").write_bytes(b"")                     # sentencepiece first when both ship
    assert find_tokenizer_file(str(hf)) == str(hf / "tokenizer.model")
    assert find_tokenizer_file(str(tmp_path / "m.gguf"), str(hf)) == str(hf / "tokenizer.json")  # a directory
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        find_tokenizer_file(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        find_tokenizer_file(str(hf), str(tmp_path / "missing.json"))


def test_metaspace_tokenizer_json_streams_through_a_window(tmp_path):
    """A sentencepiece-style tokenizer.json (Metaspace, byte fallback, as Mistral's): not byte-level, so the
    stream decodes a sliding window of tokens; its deltas still add up to the whole text."""
    from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>",
                                                                                          *bytes_]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    loaded = load_tokenizer(str(tmp_path))
    assert not loaded.byte_level
    for text in TEXTS:
        ids = loaded.encode(text, add_bos=False)
        deltas = _check_stream(loaded, ids)
        assert len([d for d in deltas if d]) > 1 or len(ids) == 1        # text arrives as it is generated
