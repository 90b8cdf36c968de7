"""A GGUF file's own vocabulary as a tokenizer (llama.cpp's `tokenizer.ggml.*` metadata).

A GGUF file is the whole model, vocabulary included, and often ships without any tokenizer file beside it, so
the vocabulary is rebuilt from the metadata into what one of the two other readers takes (`load_gguf_vocabulary`;
loader.py makes the tokenizer of it), with the libraries that do the real work (no BPE written here):

- `gpt2` (byte-level BPE: SmolLM2, Llama-3, Qwen2, ...): a `tokenizers` BPE from the tokens and merges, with
  the pre-tokenizer that `tokenizer.ggml.pre` names (its split rules are the model's, so a wrong one changes
  the ids; an unknown name logs a warning and splits as GPT-2 does); control tokens (type 3) become special
  added tokens, user-defined ones (4) added tokens, for `HFTokenizer` (hf.py).
- `bert` (WordPiece: BERT encoders, as convert_hf_to_gguf.py's BertModel writes them: a word's first piece with
  sentencepiece's "▁" in front, a continuation bare, bracketed special tokens as they are): a `tokenizers`
  WordPiece over the pieces in HF's form again (a continuation "##"-prefixed), with BERT's normalizer (lower case,
  as llama.cpp's WPM tokenizer always does) and pre-tokenizer; [CLS] (its BOS) and [SEP] (its EOS) around a text.
- `llama` (sentencepiece BPE: LLaMA-1/2, Mistral, Gemma): a sentencepiece model rebuilt from the pieces, scores
  and types (the types mean the same in both formats), so `SentencePieceTokenizer` and its detokenizer
  apply. Like llama.cpp it keeps repeated spaces (no extra-whitespace removal) unless the metadata says
  `tokenizer.ggml.remove_extra_whitespaces`.

BOS/EOS/pad ids, `add_bos_token` (default: yes for `llama`, no for `gpt2`), end-of-turn ids and the chat
template come from the same metadata.

Reading a large vocabulary's metadata and building its BPE costs seconds of every start (before the agents are
even started), so the result is kept in the cache directory (`<cache>/tokenizers/`, keyed by the file's path,
size and modification time) as the `tokenizers` library's own JSON or the sentencepiece model, which read
ten times faster (docs/benchmarks/JOURNAL.md, start-up).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

from llm_serving.cache_dir import default_cache_dir
from llm_serving.gguf_file import read_gguf

logger = logging.getLogger(__name__)

__all__ = ["GGUFVocabulary", "PRE_TOKENIZER_SPLITS", "load_gguf_vocabulary"]

T = TypeVar("T")

# tokenizer.ggml.pre -> the regular expression its model splits text with before BPE (None: GPT-2's, built into
# the ByteLevel pre-tokenizer; "digits": each digit alone, then GPT-2's). Names as llama.cpp's llama-vocab.cpp
# groups them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"default": None, "gpt-2": None, "gpt2": None,
                        "smollm": "digits", "starcoder": "digits", "refact": "digits",
                        "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
                        "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Llama-3's tokenizer (and llama.cpp for it) takes a split word that is itself a token as that token, merges or
# not ("ignore_merges" in its tokenizer.json); the ids differ without it.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"}
# Qwen2's tokenizer.json normalizes text to NFC before splitting.
_NFC = {"qwen2", "deepseek-r1-qwen"}

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _pre_tokenizer(pre: str, path: str):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZER_SPLITS:
        logger.warning("%s: tokenizer.ggml.pre=%r is not known here; splitting text as GPT-2 does (ids may differ "
                       "from the model's own tokenizer for some text)", path, pre)
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits":     # SmolLM: every digit on its own, then GPT-2's rules
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _byte_level(path: str, meta, tokens: list, types: list):
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    merges = meta("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{path}: a gpt2 GGUF vocabulary needs tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else () for m in merges]
    bad = next((m for m, pair in zip(merges, pairs) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(f"{path}: tokenizer.ggml.merges holds {bad!r}, not a merge such as 'a b'")
    pre = meta("tokenizer.ggml.pre") or "default"
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _IGNORE_MERGES))
    if pre in _NFC:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(pre, path)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tok


def _wordpiece(path: str, meta, tokens: list, types: list):
    """A GGUF `bert` vocabulary as a `tokenizers` WordPiece (see the module's docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {}
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == _CONTROL or (text.startswith("[") and text.endswith("]")):
            piece = text
        elif text.startswith("\u2581"):
            piece = text[1:]
        else:
            piece = "##" + text
        vocab.setdefault(piece, i)
    unk = meta("tokenizer.ggml.unknown_token_id", types.index(_UNKNOWN) if _UNKNOWN in types else None)
    if unk is None:
        raise ValueError(f"{path}: a bert GGUF vocabulary needs tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.WordPiece(vocab, unk_token=tokens[int(unk)]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    return tok


def _sentencepiece_proto(meta, tokens: list, types: list) -> bytes:
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores = meta("tokenizer.ggml.scores") or [0.0] * len(tokens)
    proto = pb.ModelProto()
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = _BYTE in types
    unk = meta("tokenizer.ggml.unknown_token_id", types.index(_UNKNOWN) if _UNKNOWN in types else 0)
    # sentencepiece finds BOS/EOS/pad/unk by piece name (bos_id() looks up `bos_piece`), so the names must be
    # this vocabulary's ("<bos>" in Gemma's), not the default "<s>".
    for name, token_id in (("unk", unk), ("bos", meta("tokenizer.ggml.bos_token_id")),
                           ("eos", meta("tokenizer.ggml.eos_token_id")),
                           ("pad", meta("tokenizer.ggml.padding_token_id"))):
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            setattr(spec, f"{name}_id", int(token_id))
            setattr(spec, f"{name}_piece", tokens[int(token_id)])
        elif name != "unk":
            setattr(spec, f"{name}_id", -1)
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(meta("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = bool(meta("tokenizer.ggml.remove_extra_whitespaces", False))
    norm.escape_whitespaces = True
    for text, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score = text, float(score)
        piece.type = kind if kind in (_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE) else _NORMAL
    return proto.SerializeToString()


@dataclass(frozen=True)
class GGUFVocabulary:
    """A GGUF file's vocabulary, rebuilt: `kind` "gpt2" or "bert" with `built` a `tokenizers.Tokenizer`, or "llama" with
    `built` a serialized sentencepiece model; `facts`: bos, eos, end_ids (more ids that end generation), pad,
    chat_template, add_bos, as the metadata says them."""

    kind: str
    built: object
    facts: dict


def load_gguf_vocabulary(path: str, make: Callable[[str, GGUFVocabulary], T]) -> T:
    """`make(path, vocabulary)` (the tokenizer loader.py makes of it) of a GGUF file's vocabulary (ValueError
    naming what is missing or unsupported): from the cache when this file's was built before (a cached one that
    cannot be read or made is rebuilt), else rebuilt from the metadata and cached."""
    cached = _cache_dir(path)
    if cached is not None and (cached / "meta.json").is_file():
        try:
            return make(path, _from_cache(cached))
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("cached tokenizer %s unusable (%s): rebuilding it", cached, exc)
    vocab = _build(path)
    if cached is not None:
        _save(cached, vocab)
    return make(path, vocab)


def _cache_dir(path: str) -> Optional[Path]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    # the last item is the build's version: bumped whenever building changes, so older caches are not reused
    key = hashlib.sha1(repr((os.path.abspath(path), st.st_size, st.st_mtime_ns, 2)).encode()).hexdigest()[:16]
    return default_cache_dir() / "tokenizers" / key


def _build(path: str) -> GGUFVocabulary:
    """The vocabulary rebuilt from the GGUF metadata."""
    try:
        fields = read_gguf(path, strings=True).fields
    except Exception as exc:      # not GGUF, truncated, unknown version
        raise ValueError(f"{path}: cannot read GGUF file: {exc}") from None

    def meta(key: str, default=None):
        value = fields.get(key)
        return default if value is None else value

    kind = meta("tokenizer.ggml.model")
    tokens = meta("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError(f"{path}: the GGUF has no vocabulary (tokenizer.ggml.model / tokens); pass --tokenizer")
    if kind not in ("gpt2", "llama", "bert"):
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama, bert)")
    types = meta("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    facts = {"bos": meta("tokenizer.ggml.bos_token_id"), "eos": meta("tokenizer.ggml.eos_token_id"),
             "end_ids": [i for i in (meta("tokenizer.ggml.eot_token_id"), meta("tokenizer.ggml.eom_token_id"))
                         if i is not None],
             "pad": meta("tokenizer.ggml.padding_token_id"), "chat_template": meta("tokenizer.chat_template"),
             "add_bos": bool(meta("tokenizer.ggml.add_bos_token", kind in ("llama", "bert"))),
             "add_eos": bool(meta("tokenizer.ggml.add_eos_token", kind == "bert"))}
    if kind == "bert":                      # ([CLS] and [SEP], the converter's BOS and EOS)
        facts["bos"] = meta("tokenizer.ggml.cls_token_id", facts["bos"])
        facts["eos"] = meta("tokenizer.ggml.seperator_token_id", facts["eos"])
        if facts["bos"] is None or facts["eos"] is None:
            raise ValueError(f"{path}: a bert GGUF vocabulary needs its [CLS] and [SEP] ids "
                             "(tokenizer.ggml.cls_token_id / seperator_token_id, or bos / eos)")
        return GGUFVocabulary(kind, _wordpiece(path, meta, tokens, types), facts)
    if kind == "gpt2":
        if facts["eos"] is None:
            raise ValueError(f"{path}: tokenizer.ggml.eos_token_id is missing")
        return GGUFVocabulary(kind, _byte_level(path, meta, tokens, types), facts)
    return GGUFVocabulary(kind, _sentencepiece_proto(meta, tokens, types), facts)


def _save(folder: Path, vocab: GGUFVocabulary) -> None:
    """Write the built tokenizer next to its facts, whole or not at all (a temporary directory renamed)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        if vocab.kind in ("gpt2", "bert"):
            vocab.built.save(str(tmp / "tokenizer.json"))
        else:
            (tmp / "tokenizer.model").write_bytes(vocab.built)
        (tmp / "meta.json").write_text(json.dumps({"kind": vocab.kind, **vocab.facts}))
        try:
            os.rename(tmp, folder)
        except OSError:               # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("cannot cache the GGUF tokenizer in %s: %s", folder, exc)


def _from_cache(folder: Path) -> GGUFVocabulary:
    facts = json.loads((folder / "meta.json").read_text())
    kind = facts.pop("kind")
    if kind in ("gpt2", "bert"):
        from tokenizers import Tokenizer

        built = Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:
        built = (folder / "tokenizer.model").read_bytes()
    return GGUFVocabulary(kind, built, facts)
