"""Which tokenizer a model uses: the file it is read from (`find_tokenizer_file`) and the reader for that file
(`load_tokenizer`). The one place that knows the readers; each reader knows only base.py.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Optional

from .base import Tokenizer
from .gguf import GGUFVocabulary, load_gguf_vocabulary
from .hf import HFTokenizer
from .sentencepiece import SentencePieceTokenizer

__all__ = ["find_tokenizer_file", "load_tokenizer"]


def find_tokenizer_file(model_path: str, vocab_file: Optional[str] = None) -> str:
    """The file a model's tokenizer is read from: `vocab_file` when given (a sentencepiece .model, a
    tokenizer.json or a directory holding one, a .gguf); else a GGUF model's own file; else, in the model's
    directory, tokenizer.model, tokenizer.json, or the only *.model. FileNotFoundError saying what was looked
    for otherwise."""
    if vocab_file:
        path = Path(vocab_file).expanduser()
        if path.is_dir():
            if (path / "tokenizer.json").is_file():
                return str((path / "tokenizer.json").resolve())
            raise FileNotFoundError(f"tokenizer.vocab_file={vocab_file!r} is a directory without tokenizer.json "
                                    "(pass the tokenizer file itself: a .model, tokenizer.json or .gguf)")
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.vocab_file={vocab_file!r}: no such file (expected a sentencepiece "
                                    ".model, a tokenizer.json or a .gguf)")
        return str(path.resolve())
    model_path = os.fspath(model_path)
    if model_path.endswith(".gguf") and os.path.isfile(model_path):
        return str(Path(model_path).resolve())
    folder = Path(model_path if os.path.isdir(model_path) else os.path.dirname(os.path.abspath(model_path)))
    for name in ("tokenizer.model", "tokenizer.json"):
        if (folder / name).is_file():
            return str((folder / name).resolve())
    found = glob.glob(str(folder / "*.model"))
    if len(found) == 1:
        return str(Path(found[0]).resolve())
    raise FileNotFoundError(f"no tokenizer.model, tokenizer.json or single *.model next to {model_path}"
                            + (f" ({len(found)} *.model files)" if found else "") + "; pass --tokenizer FILE")

def load_tokenizer(model_path: str, vocab_file: Optional[str] = None) -> Tokenizer:
    """The tokenizer of a model (see `find_tokenizer_file` for which file): `SentencePieceTokenizer` (a .model,
    with the tokenizer_config.json and generation_config.json beside it), `HFTokenizer` (tokenizer.json), or a
    GGUF's own vocabulary rebuilt as one of the two."""
    path = find_tokenizer_file(model_path, vocab_file)
    if path.endswith(".gguf"):
        return load_gguf_vocabulary(path, _gguf_tokenizer)
    if path.endswith(".json"):
        return HFTokenizer.from_directory(os.path.dirname(path), path)
    return SentencePieceTokenizer.from_file(path)


def _gguf_tokenizer(path: str, vocab: GGUFVocabulary) -> Tokenizer:
    facts = vocab.facts
    if vocab.kind in ("gpt2", "bert"):
        return HFTokenizer(vocab.built, model_file=path, bos_id=facts["bos"], eos_id=int(facts["eos"]),
                           eos_ids=facts["end_ids"], pad_id=facts["pad"], add_bos=facts["add_bos"],
                           chat_template=facts["chat_template"],
                           input_suffix=(int(facts["eos"]),) if facts.get("add_eos") else ())
    return SentencePieceTokenizer(model_proto=vocab.built, source=path, add_bos=facts["add_bos"],
                                  add_eos=bool(facts.get("add_eos")),
                                  eos_ids=facts["end_ids"], chat_template=facts["chat_template"])
