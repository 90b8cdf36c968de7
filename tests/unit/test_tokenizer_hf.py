"""HFTokenizer (tokenizer.json through the `tokenizers` library): what the files beside tokenizer.json decide
(BOS rule, EOS ids, chat template), each token's own text, and streaming through the window detokenizer.
Tokenizers are trained here in a temp dir; no MindSpore, nothing from ../shared.

The builders (`train_byte_level`, `llama2_style_tokenizer_json`) are reused by test_tokenizer_gguf.py and
test_chat.py. Basic byte-level round trips and the byte-level stream are in test_tokenizer_formats.py.
"""
import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from llm_serving.tokenization import load_tokenizer

TEXTS = ["Hello world", "The year 2024 had 366 days.", "  leading and   inner  spaces\n\ttab", "line\n\n\nbreaks",
         "中文字符和日本語のテキスト", "emoji 🙂👍🏽 and accents: café naïve", "digits 123456789", "it's we'll THEY'RE"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus(num_lines: int = 400) -> list:
    rng = random.Random(0)
    words = ("the quick brown fox jumps over lazy dog café naïve 中文 字符 日本語 テキスト 🙂 👍🏽 2024 366 12345 "
             "it's we'll they're").split()
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(num_lines)] + TEXTS


def train_byte_level(folder: Path, pre: str = "gpt2", specials=("<s>", "</s>"), vocab_size: int = 600,
                     config: dict = None, post_processor=None) -> Path:
    """A byte-level BPE tokenizer.json trained on `corpus()`, split as `pre` says: "gpt2" (GPT-2's regex),
    "digits" (each digit alone, then GPT-2's: SmolLM's), "llama3" (Llama-3's regex, ignore_merges) or "qwen2"
    (NFC, then Qwen2's regex). Writes tokenizer_config.json from `config` when given."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = Tokenizer(models.BPE(ignore_merges=pre == "llama3"))
    if pre == "gpt2":
        tok.pre_tokenizer = byte_level
    elif pre == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        split = LLAMA3_SPLIT if pre == "llama3" else LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if pre == "qwen2":
            tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if post_processor is not None:
        tok.post_processor = post_processor
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def llama2_style_tokenizer_json(folder: Path) -> Path:
    """A tokenizer.json shaped like LLaMA-2's and Mistral's as transformers converts them: "▁" for spaces
    (normalizer), byte-fallback pieces <0x00>..<0xFF> in the model vocabulary, and the decoder
    Replace("▁", " ") / ByteFallback / Fuse / Strip(one leading space). Not byte-level."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"]))
    raw = json.loads(tok.to_str())
    vocab = raw["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(raw, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


# ------------------------------------------------------------------------------ files beside tokenizer.json

def test_llama3_style_directory_bos_from_the_post_processor_and_every_eos(tmp_path):
    """Llama-3 ships no add_bos_token: BOS comes from its post-processor, a Sequence(ByteLevel, Template)."""
    from tokenizers import processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>"]
    post = processors.Sequence([processors.ByteLevel(trim_offsets=False),
                                processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                              special_tokens=[("<|begin_of_text|>", 0)])])
    folder = train_byte_level(tmp_path, "llama3", specials, config={
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}, post_processor=post)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 3]}))
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    tok = load_tokenizer(str(folder))
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (0, 1, [1, 2, 3], 1)
    assert tok.add_bos and tok.model_file == str(folder / "tokenizer.json")
    assert tok.chat_template == "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert tok.vocab_size == len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 0 and 0 not in ids[1:], text        # the post-processor never adds a second BOS
        assert tok.decode(ids) == text and tok.encode(text, add_bos=False) == ids[1:]
    # the same files without the BOS template: no BOS
    plain = train_byte_level(tmp_path / "plain", "llama3", specials, config={"eos_token": "<|end_of_text|>"})
    assert not load_tokenizer(str(plain)).add_bos


def test_the_chat_template_is_read_where_each_writer_puts_it(tmp_path, llama_tokenizer_standin):
    """tokenizer_config.json's first, else chat_template.jinja, else chat_template.json's (the processors of older
    transformers 4.x wrote only that one: Gemma 3's, SmolVLM's, Qwen2.5-VL's directories on the Hub have it), as
    llama.cpp's converter reads them; both readers (tokenizer.json and tokenizer.model) and the server's fallback for
    a tokenizer without one (load_chat_template)."""
    import shutil

    from llm_serving.tokenization.chat_template import load_chat_template
    from llm_serving.tokenization.sentencepiece import SentencePieceTokenizer

    in_json = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    in_jinja = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    in_config = "{% for m in messages %}({{ m.content }}){% endfor %}"
    folder = train_byte_level(tmp_path / "hf", config={"bos_token": "<s>", "eos_token": "</s>"})
    assert load_tokenizer(str(folder)).chat_template is None
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": in_json}))
    assert load_tokenizer(str(folder)).chat_template == in_json
    (folder / "chat_template.jinja").write_text(in_jinja)
    assert load_tokenizer(str(folder)).chat_template == in_jinja
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "chat_template": in_config}))
    assert load_tokenizer(str(folder)).chat_template == in_config

    spm = tmp_path / "spm"
    spm.mkdir()
    shutil.copy(llama_tokenizer_standin, spm / "tokenizer.model")
    assert SentencePieceTokenizer.from_file(str(spm / "tokenizer.model")).chat_template is None
    (spm / "chat_template.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                                          {"name": "default", "template": in_json}]}))
    tok = SentencePieceTokenizer.from_file(str(spm / "tokenizer.model"))
    assert tok.chat_template == in_json
    # a tokenizer with no template of its own takes the model directory's
    bare = SentencePieceTokenizer(str(spm / "tokenizer.model"))
    assert bare.chat_template is None
    assert load_chat_template(None, str(spm), bare).text == in_json
    assert load_chat_template(None, str(spm), bare).source == str(spm / "chat_template.json")
    assert load_chat_template(None, str(tmp_path / "nowhere"), bare).text is None       # the built-in format
    (spm / "chat_template.json").write_text("{not json")
    with pytest.raises(ValueError, match="chat_template.json: not a readable chat template"):
        SentencePieceTokenizer.from_file(str(spm / "tokenizer.model"))


def test_what_the_post_processor_appends_to_a_whole_text_is_the_input_suffix(tmp_path):
    """Qwen3-Embedding's tokenizer.json appends <|endoftext|> to a text ("$A <|endoftext|>"), whose state its last-token
    pooling takes: `input_suffix` says so (an embedding's input ends with it), while prompts never get it; a tokenizer
    whose post-processor appends nothing has none."""
    from tokenizers import processors

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    post = processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)])
    folder = train_byte_level(tmp_path, "qwen2", specials, config={"eos_token": "<|im_end|>"}, post_processor=post)
    tok = load_tokenizer(str(folder))
    assert tok.input_suffix == (0,) and not tok.add_bos
    assert 0 not in tok.encode("the cat sat")
    plain = train_byte_level(tmp_path / "plain", "qwen2", specials, config={"eos_token": "<|im_end|>"})
    assert load_tokenizer(str(plain)).input_suffix == ()


def test_a_bert_tokenizer_gives_cls_text_sep_whatever_its_padding_and_truncation(tmp_path):
    """BERT's WordPiece tokenizer.json (tests/families.py's, like all-MiniLM's: a truncation and a fixed padding in the
    file) and a tokenizer_config.json naming no BOS or EOS: [CLS] is the BOS its post-processor puts first, [SEP] the
    EOS it appends (the input suffix), and no encode is padded or truncated: an embedding's ids are the library's
    own encoding with its special tokens."""
    from tokenizers import Tokenizer

    from tests.families import BERT_SPECIALS, _wordpiece_json

    (tmp_path / "tokenizer.json").write_text(_wordpiece_json(320), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
         "tokenizer_class": "BertTokenizer"}))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    cls, sep, pad = (BERT_SPECIALS.index(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos, tuple(tok.input_suffix)) == (cls, sep, pad, True, (sep,))
    library = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    library.no_padding()
    library.no_truncation()
    for text in ("The little cat sat on the mat.", " ".join(["once upon a time there was a girl"] * 4)):
        ids = tok.encode(text, add_bos=True) + list(tok.input_suffix)
        assert ids == library.encode(text).ids and ids[0] == cls and ids[-1] == sep and pad not in ids
    assert len(tok.encode(" ".join(["lily"] * 40), add_bos=False)) == 40      # (the file truncates to 16, pads to 24)


def test_config_decides_add_bos_pad_and_named_chat_templates(tmp_path):
    folder = train_byte_level(tmp_path, "gpt2", ["<s>", "</s>", "<pad>"], config={
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]})
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    tok = load_tokenizer(str(folder))
    assert (tok.bos_id, tok.eos_ids, tok.pad_id, tok.add_bos, tok.chat_template) == (0, [1], 2, False, "chat")
    assert tok.encode("Hello world") == tok.encode("Hello world", add_bos=False)
    assert tok.encode("Hello world")[0] != 0


def test_unreadable_or_incomplete_directories_are_clear_errors(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a HuggingFace tokenizer.json"):
        load_tokenizer(str(tmp_path / "bad"))
    folder = train_byte_level(tmp_path / "noeos", "gpt2", ["<s>"], config={"bos_token": "<s>"})
    with pytest.raises(ValueError, match="no EOS token"):
        load_tokenizer(str(folder))


# ------------------------------------------------------------------------------ one token's text

def test_token_text_is_what_the_token_adds_to_the_text(tmp_path):
    byte_level = load_tokenizer(str(train_byte_level(tmp_path / "bl", "gpt2", ["<s>", "</s>"],
                                                     config={"bos_token": "<s>", "eos_token": "</s>"})))
    ids = byte_level.encode("Hello world", add_bos=False)
    assert [byte_level.token_text(i) for i in ids] == ["Hello", " world"]
    llama = byte_level.encode("🦙", add_bos=False)                    # not in the training text: byte tokens
    assert len(llama) > 1 and "".join(byte_level.token_text(i) for i in llama) == "\ufffd" * len(llama)
    assert byte_level.token_text(1) == "</s>" and byte_level.id_to_piece(1) == "</s>"

    sp_style = load_tokenizer(str(llama2_style_tokenizer_json(tmp_path / "sp")))
    ids = sp_style.encode("Hello world", add_bos=False)
    assert "".join(sp_style.token_text(i) for i in ids) == " Hello world"    # "▁" shows as a space
    byte_ids = sp_style.encode("🦙", add_bos=False)
    assert [sp_style.token_text(i) for i in byte_ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert sp_style.token_text(2) == "</s>" and sp_style.is_special(2)


def test_builtin_llama2_chat_format_through_a_tokenizer_json(tmp_path):
    tok = load_tokenizer(str(llama2_style_tokenizer_json(tmp_path)))
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [1] + tok.encode("[INST] hi [/INST]", add_bos=False)


# ------------------------------------------------------------------------------ streaming through a window

def _valid_byte_runs(tok, ids) -> bool:
    """Whether every run of byte-fallback pieces in `ids` is valid UTF-8 (see WindowDetokenizer: the library
    replaces a whole invalid run)."""
    run = b""
    for i in [*ids, None]:
        piece = tok.id_to_piece(i) if i is not None else ""
        if len(piece) == 6 and piece.startswith("<0x"):
            run += bytes([int(piece[3:5], 16)])
            continue
        try:
            run.decode("utf-8")
        except UnicodeDecodeError:
            return False
        run = b""
    return True


@pytest.fixture(scope="module")
def sp_style(tmp_path_factory):
    return load_tokenizer(str(llama2_style_tokenizer_json(tmp_path_factory.mktemp("sp"))))


def test_llama2_style_tokenizer_json_round_trips_text(sp_style):
    assert not sp_style.byte_level and (sp_style.bos_id, sp_style.eos_id) == (1, 2)
    for text in TEXTS + ["🦙 never seen"]:
        assert sp_style.decode(sp_style.encode(text)) == text, text


def test_window_stream_adds_up_to_decode_for_random_ids(sp_style):
    tok = sp_style
    rng = np.random.default_rng(0)
    text_ids = [tok.encode(t, add_bos=False) for t in TEXTS + ["🦙🦙 中"]]
    num_checked = 0
    for _ in range(600):
        ids = rng.integers(0, tok.vocab_size, rng.integers(0, 8)).tolist()
        ids[rng.integers(0, len(ids) + 1):0] = random.Random(len(ids)).choice(text_ids)[:int(rng.integers(1, 12))]
        prompt = rng.integers(0, tok.vocab_size, rng.integers(0, 6)).tolist() + tok.encode("prompt", add_bos=False)
        if not (_valid_byte_runs(tok, ids) and _valid_byte_runs(tok, prompt)):
            continue
        for skip in (True, False):
            det = tok.detokenizer(prompt, skip_special=skip)
            deltas = [det.push(i) for i in ids] + [det.flush()]
            before = tok.decode(prompt, skip)
            assert "".join(deltas) == det.text == tok.decode(prompt + ids, skip)[len(before):], (prompt, ids)
            num_checked += 1
    assert num_checked > 300


def test_window_stream_holds_back_split_characters_and_stays_small(sp_style):
    tok = sp_style
    ids = tok.encode("🦙 and 中文", add_bos=False)
    det = tok.detokenizer()
    deltas = [det.push(i) for i in ids]
    assert all(unicodedata.category(c) != "Cs" and c != "\ufffd" for d in deltas for c in d)
    assert [tok.id_to_piece(i) for i in ids[:5]] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert deltas[:5] == ["", "", "", "", "🦙"] and "".join(deltas) + det.flush() == "🦙 and 中文"
    # a long stream with runs of 300 skipped special tokens: every decode call stays a few tokens long
    calls = []
    decode = tok.decode
    tok.decode = lambda ids, skip=True: calls.append(len(ids)) or decode(ids, skip)
    try:
        det = tok.detokenizer(tok.encode("a prompt of a few words"))
        for i in range(1200):
            det.push(2 if (i // 300) % 2 else ids[i % len(ids)])
    finally:
        del tok.decode
    assert max(calls) <= 12
