"""Tokenizers of the HuggingFace `tokenizers` library: a model directory's `tokenizer.json` (byte-level BPE as in
Llama-3, Qwen2, SmolLM2, GPT-2; or Metaspace/sentencepiece-style as in Mistral's), and the byte-level BPE that
gguf.py builds from a GGUF vocabulary. The `Tokenizer` interface (base.py), as `SentencePieceTokenizer` has it.

Most current models ship only a tokenizer.json, whose encoding (pre-tokenizer regexes, merges, added tokens) is
the library's to get right, so it is used as is: nothing here re-implements BPE. What the library leaves to
transformers is done here from the files beside it: BOS/EOS/pad ids and the BOS rule (tokenizer_config.json,
else the post-processor), every id that ends generation (generation_config.json) and the chat template.

Incremental detokenization, two ways:
- byte-level BPE decodes by concatenating each token's bytes (its characters mapped back through GPT-2's
  byte-to-character table; an added token's bytes are its UTF-8 text), so a stream is each token's bytes fed to
  an incremental UTF-8 decoder: O(1) per token, exact, and a character split across tokens is held back until
  complete (`ByteLevelDetokenizer`).
- any other decoder (Metaspace, byte fallback, ...) goes through a window of the last few tokens, as TGI and vLLM
  do: the text of window + new token minus the text of the window, emitted once it does not end in U+FFFD; the
  window slides forward as text is emitted (`WindowDetokenizer`).
"""
from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

from .base import DetokenizerBase, folder_chat_template, llama2_chat_ids

__all__ = ["HFTokenizer", "ByteLevelDetokenizer", "WindowDetokenizer", "byte_decoder"]


@lru_cache(maxsize=1)
def byte_decoder() -> dict:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for themselves; the other 68
    bytes (controls, space, ...) are mapped, in byte order, to the characters U+0100, U+0101, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _token_content(value) -> Optional[str]:
    """A token named in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


class HFTokenizer:
    """A `tokenizers.Tokenizer` with the model's BOS/EOS, BOS rule and chat template.

    `encode` never lets the library's post-processor add tokens: BOS is added here, when the model wants it
    (`add_bos`). Special-token strings in the text are recognised as their ids, as the library does.
    `vocab_size` is the largest id (model vocabulary or added token) + 1; `pad_id` is the EOS id when the
    model names no pad token."""

    def __init__(self, tok, *, model_file: str, bos_id: Optional[int], eos_id: int, eos_ids: Iterable[int] = (),
                 pad_id: Optional[int] = None, add_bos: bool = False, chat_template: Optional[str] = None,
                 input_suffix: Optional[tuple] = None):
        # a tokenizer.json may carry a truncation and a padding (all-MiniLM's: 128 tokens, padded to 128), which the
        # library would apply to every encode: lengths are this server's to decide (the context, truncate options)
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        self.model_file = model_file
        added = tok.get_added_tokens_decoder()                        # id -> AddedToken
        self._added = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size: int = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eos_ids = list(dict.fromkeys([eos_id, *eos_ids]))
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        # what the library's post-processor appends to a text (given: a GGUF's add_eos_token); the text "a" with and
        # without it tells
        if input_suffix is None:
            plain = tok.encode("a", add_special_tokens=False).ids
            full = tok.encode("a", add_special_tokens=True).ids
            at = next((k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain), None)
            input_suffix = tuple(full[at + len(plain):]) if plain and at is not None else ()
        self.input_suffix = tuple(input_suffix)
        from tokenizers import decoders

        # (the decoder object, not the tokenizer's JSON: serializing a large vocabulary is a cost of every start)
        self.byte_level = isinstance(tok.decoder, decoders.ByteLevel)
        self._bytes = byte_decoder()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_directory(cls, directory: str, tokenizer_json: Optional[str] = None) -> "HFTokenizer":
        """`tokenizer.json` with `tokenizer_config.json` (bos/eos/pad tokens, add_bos_token, chat_template) and
        `generation_config.json` (eos_token_id: an id or a list, all of which end generation) beside it. A BERT
        tokenizer names no BOS or EOS: its cls_token ([CLS], which its post-processor puts first) stands for BOS and
        its sep_token ([SEP], last) for EOS."""
        from tokenizers import Tokenizer as _Tok

        folder = Path(directory)
        path = Path(tokenizer_json) if tokenizer_json else folder / "tokenizer.json"
        try:
            tok = _Tok.from_file(str(path))
        except Exception as exc:    # the library raises a bare Exception for a malformed file
            raise ValueError(f"{path}: not a HuggingFace tokenizer.json ({exc})") from None
        folder = path.parent
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        model_cfg = _read_json(folder / "config.json")

        def token_id(name: str) -> Optional[int]:
            content = _token_content(cfg.get(name))
            return tok.token_to_id(content) if content is not None else None

        bos = token_id("bos_token")
        eos = token_id("eos_token")
        gen_eos = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
        gen_eos = gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
        if bos is None:
            bos = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
        if bos is None:
            bos = token_id("cls_token")
        if eos is None and not gen_eos:
            eos = token_id("sep_token")
        if eos is None:
            if not gen_eos:
                raise ValueError(f"{folder}: no EOS token (tokenizer_config.json eos_token, or eos_token_id in "
                                 "generation_config.json / config.json)")
            eos = gen_eos[0]
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and _post_processor_starts_with(tok, bos)
        template = folder_chat_template(folder, cfg)[0]
        return cls(tok, model_file=str(path.resolve()), bos_id=bos, eos_id=int(eos), eos_ids=map(int, gen_eos),
                   pad_id=token_id("pad_token"), add_bos=bool(add_bos), chat_template=template or None)

    # ------------------------------------------------------------------ the Tokenizer interface
    def encode(self, text: str, add_bos: bool = True) -> list:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.add_bos else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def id_to_piece(self, token_id: int) -> str:
        return self._tok.id_to_token(int(token_id)) or ""

    def special_text(self, token_id: int) -> str:
        """The text that stands for a special token in a rendered template (e.g. "<|im_start|>")."""
        return self.id_to_piece(token_id)

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """What one token adds to the text, as bytes: byte-level BPE's bytes; otherwise the piece with
        sentencepiece's word marker as a space, a byte-fallback piece ("<0x0A>") its byte; an added token's text."""
        token_id = int(token_id)
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id) or ""
        if self.byte_level:
            return bytes(self._bytes.get(c, 0x3F) for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """One token's own text, as shown next to its log-probability, with the space it starts with.

        Byte-level BPE: its bytes as UTF-8, the bytes of a character split over tokens each shown as U+FFFD
        (what the token adds to the text, without making up a character). Otherwise: an added token's text,
        or the piece with sentencepiece's word marker as a space ("▁world" -> " world"; a byte-fallback piece
        stays "<0xE4>"), as `SentencePieceTokenizer` shows it; decoding the token alone would drop the
        space a word starts with."""
        token_id = int(token_id)
        if self.byte_level:
            return self.token_bytes(token_id).decode("utf-8", errors="replace")
        if token_id in self._added:
            return self._added[token_id]
        return self.id_to_piece(token_id).replace("\u2581", " ")

    def encode_chat(self, messages: list) -> list:
        """The built-in LLaMA-2 chat format (`llama2_chat_ids`) through this vocabulary; BOS/EOS as ids."""
        return llama2_chat_ids(messages, lambda text: self.encode(text, add_bos=False), self.bos_id, self.eos_id)

    def detokenizer(self, prompt_ids: Optional[Iterable[int]] = None, skip_special: bool = True):
        if self.byte_level:
            return ByteLevelDetokenizer(self, skip_special)
        return WindowDetokenizer(self, prompt_ids, skip_special)


def _post_processor_starts_with(tok, token_id: int) -> bool:
    """Whether the tokenizer.json post-processor puts `token_id` in front of a single text (a TemplateProcessing
    such as "<|begin_of_text|> $A", alone or inside a Sequence as in Llama-3's): what the model was trained on
    when tokenizer_config.json does not say `add_bos_token`."""
    post = json.loads(tok.to_str()).get("post_processor") or {}
    steps = post.get("processors", []) if post.get("type") == "Sequence" else [post]
    for step in steps:
        if step.get("type") == "TemplateProcessing":
            first = (step.get("single") or [{}])[0]
            return "SpecialToken" in first and tok.token_to_id(first["SpecialToken"]["id"]) == token_id
    return False


class ByteLevelDetokenizer(DetokenizerBase):
    """Byte-level BPE: each token's bytes through an incremental UTF-8 decoder (held back mid-character)."""

    def __init__(self, tokenizer: HFTokenizer, skip_special: bool = True):
        super().__init__()
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        self._check_open()
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._record(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def flush(self) -> str:
        if self._flushed:
            return ""
        self._flushed = True
        return self._record(self._utf8.decode(b"", final=True))


class WindowDetokenizer(DetokenizerBase):
    """Any other decoder: text(window + new tokens) - text(window), emitted when it does not end in U+FFFD.
    The window starts at the last few prompt tokens (their context decides, e.g., a leading space) and moves
    to the emitted tokens, so each push decodes a few tokens, never the whole text. Skipped special tokens
    never enter it (decode drops them anyway), so a run of them cannot make the window grow.

    One departure from `decode`: the library's ByteFallback decoder turns a whole run of byte tokens that is
    not valid UTF-8 into one U+FFFD per byte, even the characters in it that were complete, while the stream
    has already sent those characters; so for invalid byte runs (garbage output) the streamed text keeps them
    where `decode` shows U+FFFD. For valid text the deltas add up to `decode` exactly."""

    _CONTEXT = 5

    def __init__(self, tokenizer: HFTokenizer, prompt_ids: Optional[Iterable[int]] = None, skip_special: bool = True):
        super().__init__()
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids = [i for i in map(int, prompt_ids or ()) if not self._skipped(i)][-self._CONTEXT:]
        self._prefix = 0                       # window start
        self._read = len(self._ids)            # tokens before this are emitted

    def push(self, token_id: int) -> str:
        self._check_open()
        if self._skipped(int(token_id)):
            return ""
        self._ids.append(int(token_id))
        return self._record(self._emit(final=False))

    def _skipped(self, token_id: int) -> bool:
        return self._skip_special and self._tokenizer.is_special(token_id)

    def flush(self) -> str:
        if self._flushed:
            return ""
        self._flushed = True
        return self._record(self._emit(final=True))

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], self._skip_special)
        after = decode(self._ids[self._prefix:], self._skip_special)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > self._CONTEXT:       # keep the list short: only the window matters
            cut = self._prefix - self._CONTEXT
            del self._ids[:cut]
            self._prefix -= cut
            self._read -= cut
        return delta
