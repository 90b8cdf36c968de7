"""A GGUF file's own vocabulary as a tokenizer (llama.cpp's `tokenizer.ggml.*` metadata).

- `gpt2` (byte-level BPE: SmolLM2, Llama-3, Qwen2, ...): a `tokenizers` BPE from the tokens and merges, with
  the pre-tokenizer that `tokenizer.ggml.pre` names (its split rules are the model's, so a wrong one changes
  the ids); control tokens (type 3) become special added tokens, user-defined ones (4) added tokens.
- `llama` (sentencepiece BPE: LLaMA-1/2, Mistral): a sentencepiece model rebuilt from the pieces, scores and
  types (the types mean the same in both formats), so the sentencepiece `Tokenizer` and its detokenizer apply.

BOS/EOS/pad ids, `add_bos_token` (default: yes for `llama`, no for `gpt2`), end-of-turn ids and the chat
template come from the same metadata.

Reading a 49k-token vocabulary's metadata and building its BPE takes ~2 s of every start (before the agents are
even started), so the result is kept in the cache directory (`<cache>/tokenizers/`, keyed by the file's path,
size and modification time) as the `tokenizers` library's own JSON or the sentencepiece model, read in ~0.2 s.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["load_gguf_tokenizer", "PRE_TOKENIZER_SPLITS"]

# tokenizer.ggml.pre -> the regular expression its model splits text with before BPE (None: GPT-2's, built into
# the ByteLevel pre-tokenizer)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"default": None, "gpt-2": None, "gpt2": None, "smollm": "digits",
                        "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

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
    from tokenizers import AddedToken, Tokenizer, decoders, models

    merges = meta("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{path}: a gpt2 GGUF vocabulary needs tokenizer.ggml.merges")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = _pre_tokenizer(meta("tokenizer.ggml.pre") or "default", path)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return tok


def _sentencepiece_proto(meta, tokens: list, types: list) -> bytes:
    from sentencepiece import sentencepiece_model_pb2 as pb

    scores = meta("tokenizer.ggml.scores") or [0.0] * len(tokens)
    proto = pb.ModelProto()
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = _BYTE in types
    spec.unk_id = int(meta("tokenizer.ggml.unknown_token_id", 0))
    spec.bos_id = int(meta("tokenizer.ggml.bos_token_id", -1))
    spec.eos_id = int(meta("tokenizer.ggml.eos_token_id", -1))
    spec.pad_id = int(meta("tokenizer.ggml.padding_token_id", -1))
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(meta("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    for text, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score = text, float(score)
        piece.type = kind if kind in (_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE) else _NORMAL
    return proto.SerializeToString()


def load_gguf_tokenizer(path: str):
    """The tokenizer of a GGUF file's metadata (ValueError naming what is missing or unsupported), from the cache
    when this file's was built before."""
    cached = _cache_dir(path)
    if cached is not None and (cached / "meta.json").is_file():
        try:
            return _from_cache(path, cached)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("cached tokenizer %s unusable (%s): rebuilding it", cached, exc)
    kind, built, meta = _build(path)
    if cached is not None:
        _save(cached, kind, built, meta)
    return _make(path, kind, built, meta)


def _cache_dir(path: str) -> Optional[Path]:
    from llm_serving.models.default_model import default_cache_dir

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = hashlib.sha1(repr((os.path.abspath(path), st.st_size, st.st_mtime_ns, 1)).encode()).hexdigest()[:16]
    return default_cache_dir() / "tokenizers" / key


def _build(path: str) -> tuple:
    """(kind, tokenizers.Tokenizer or sentencepiece model bytes, the facts beside it) from the GGUF metadata."""
    from llm_serving.gguf_file import open_gguf

    try:
        reader = open_gguf(path)
    except Exception as exc:      # not GGUF, truncated, unknown version
        raise ValueError(f"{path}: cannot read GGUF file: {exc}") from None

    def meta(key: str, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    kind = meta("tokenizer.ggml.model")
    tokens = meta("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ValueError(f"{path}: the GGUF has no vocabulary (tokenizer.ggml.model / tokens); pass --tokenizer")
    if kind not in ("gpt2", "llama"):
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    types = meta("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    facts = {"bos": meta("tokenizer.ggml.bos_token_id"), "eos": meta("tokenizer.ggml.eos_token_id"),
             "end_ids": [i for i in (meta("tokenizer.ggml.eot_token_id"), meta("tokenizer.ggml.eom_token_id"))
                         if i is not None],
             "pad": meta("tokenizer.ggml.padding_token_id"), "chat_template": meta("tokenizer.chat_template"),
             "add_bos": bool(meta("tokenizer.ggml.add_bos_token", kind == "llama"))}
    if kind == "gpt2":
        if facts["eos"] is None:
            raise ValueError(f"{path}: tokenizer.ggml.eos_token_id is missing")
        return kind, _byte_level(path, meta, tokens, types), facts
    return kind, _sentencepiece_proto(meta, tokens, types), facts


def _make(path: str, kind: str, built, facts: dict):
    if kind == "gpt2":
        from llm_serving.tokenizer_hf import HFTokenizer

        return HFTokenizer(built, model_file=path, bos_id=facts["bos"], eos_id=int(facts["eos"]),
                           eos_ids=facts["end_ids"], pad_id=facts["pad"], add_bos=facts["add_bos"],
                           chat_template=facts["chat_template"])
    from llm_serving.tokenizer import Tokenizer

    return Tokenizer(model_proto=built, source=path, add_bos=facts["add_bos"], eos_ids=facts["end_ids"],
                     chat_template=facts["chat_template"])


def _save(folder: Path, kind: str, built, facts: dict) -> None:
    """Write the built tokenizer next to its facts, whole or not at all (a temporary directory renamed)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        if kind == "gpt2":
            built.save(str(tmp / "tokenizer.json"))
        else:
            (tmp / "tokenizer.model").write_bytes(built)
        (tmp / "meta.json").write_text(json.dumps({"kind": kind, **facts}))
        try:
            os.rename(tmp, folder)
        except OSError:               # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        logger.warning("cannot cache the GGUF tokenizer in %s: %s", folder, exc)


def _from_cache(path: str, folder: Path):
    facts = json.loads((folder / "meta.json").read_text())
    kind = facts.pop("kind")
    if kind == "gpt2":
        from tokenizers import Tokenizer

        built = Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:
        built = (folder / "tokenizer.model").read_bytes()
    return _make(path, kind, built, facts)
