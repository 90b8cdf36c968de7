"""The sentencepiece LLaMA tokenizer (`SentencePieceTokenizer`: tokenizer.model, and a GGUF `llama` vocabulary
rebuilt as one) and its incremental detokenization for streaming (`IncrementalDetokenizer`).

Three sentencepiece decoding rules shape the detokenizer (tests/unit/test_tokenizer.py checks the
result against whole-sequence decoding):

- Start of text: the first text piece of a `decode()` call drops its leading "▁" (the dummy-prefix
  space), so "▁world" decoded alone is "world" although mid-text it is " world". Models with
  `remove_extra_whitespaces` (e.g. stories260K's tok512) keep dropping "▁" until some text has
  come out, so the rule can reach past pieces that decode to nothing. Control pieces (<s>, </s>)
  never end the start of text.
- Byte fallback: consecutive byte pieces (<0xE4><0xB8><0xAD> = "中") are joined and decoded as
  UTF-8; each byte that does not belong to a valid character becomes one U+FFFD. So text decoded
  from a shorter sequence is only a prefix of the longer one's text when it does not end partway
  through a character.
- Everything else is per piece: a piece's text does not depend on its neighbours.
"""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Iterable, Optional, Union

import sentencepiece as spm

from .base import DetokenizerBase, folder_chat_template, llama2_chat_ids

__all__ = ["IncrementalDetokenizer", "SentencePieceTokenizer"]

# A UTF-8 character is at most 4 bytes, so at most 3 pending bytes can still be completed.
_MAX_PARTIAL_CHAR_BYTES = 3


class SentencePieceTokenizer:
    """A sentencepiece LLaMA tokenizer.

    Special tokens are the control pieces (<s>, </s>, and a pad piece if the model has one) and
    <unk>, as in HuggingFace's LlamaTokenizer; `decode` leaves them out by default. `pad_id` is
    the model's pad piece, or 0 when it has none (LLaMA's tokenizers have none, so it is <unk>).
    `bos_id` is None for a model without a BOS piece.
    """

    def __init__(self, model_file: Union[str, Path, None] = None, *, model_proto: Optional[bytes] = None,
                 source: Optional[str] = None, add_bos: bool = True, add_eos: bool = False,
                 eos_ids: Iterable[int] = (), chat_template: Optional[str] = None):
        """From a .model file, or from a serialized model (`model_proto`, e.g. rebuilt from a GGUF vocabulary,
        named by `source`). add_bos: whether prompts start with BOS; add_eos: whether a text encoded whole ends with
        EOS (a GGUF's add_eos_token: an embedding's input); eos_ids: more ids that end generation."""
        if model_proto is None and not Path(model_file).is_file():
            raise FileNotFoundError(f"sentencepiece tokenizer model not found: {model_file}")
        self.model_file = str(source or "<model proto>") if model_proto is not None else str(Path(model_file).resolve())
        try:
            self._sp = (spm.SentencePieceProcessor(model_proto=model_proto) if model_proto is not None
                        else spm.SentencePieceProcessor(model_file=str(model_file)))
        except RuntimeError as exc:       # sentencepiece reports a bad model as "INTERNAL: ..."
            raise ValueError(f"{self.model_file}: not a usable sentencepiece tokenizer model ({exc})") from None
        sp = self._sp
        self.vocab_size: int = sp.get_piece_size()
        self.bos_id: Optional[int] = sp.bos_id() if sp.bos_id() >= 0 else None
        self.eos_id: int = sp.eos_id()
        self.eos_ids: list = list(dict.fromkeys([self.eos_id, *map(int, eos_ids)]))
        self.pad_id: int = sp.pad_id() if sp.pad_id() >= 0 else 0
        self.add_bos = bool(add_bos and self.bos_id is not None)
        self.input_suffix = (self.eos_id,) if add_eos else ()
        self.chat_template = chat_template
        self._special_ids = frozenset(
            i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i))
        # byte-fallback piece id -> the byte it stands for; those pieces look like "<0xE4>"
        self._byte_values = {i: int(sp.id_to_piece(i)[3:5], 16)
                             for i in range(self.vocab_size) if sp.is_byte(i)}
        self._anchor_id, self._anchor_text = self._find_anchor()
        self._verbatim = None               # the processor of encode_verbatim, made on first use

    @classmethod
    def from_file(cls, path: str) -> "SentencePieceTokenizer":
        """A tokenizer.model with, beside it, a tokenizer_config.json's BOS rule, the directory's chat template
        (`folder_chat_template`) and a generation_config.json's EOS ids."""
        folder = Path(path).parent
        eos_ids: list = []
        gen = folder / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
            eos_ids = value if isinstance(value, list) else [] if value is None else [value]
        config, raw = folder / "tokenizer_config.json", {}
        if config.is_file():
            raw = json.loads(config.read_text(encoding="utf-8"))
        add_bos = raw.get("add_bos_token", True) is not False
        template = folder_chat_template(folder, raw)[0]
        return cls(path, add_bos=add_bos, eos_ids=eos_ids, chat_template=template)

    def _find_anchor(self) -> tuple[int, str]:
        """A plain piece with non-empty text: decoded first, it ends the start of text, and as it is
        not a byte piece it does not join the bytes after it. See `decode_continuation`."""
        for i in range(self.vocab_size):
            if i in self._special_ids or i in self._byte_values or self._sp.is_unused(i):
                continue
            text = self._sp.decode([i])
            if text:
                return i, text
        raise ValueError("the tokenizer has no piece that decodes to text")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, after a BOS when add_bos and the model starts prompts with one."""
        return self._sp.encode(text, add_bos=add_bos and self.add_bos)

    def special_text(self, token_id: int) -> str:
        """The text that stands for a special token in a rendered chat template ("<s>")."""
        return self._sp.id_to_piece(int(token_id))

    def detokenizer(self, prompt_ids: Optional[Iterable[int]] = None, skip_special: bool = True):
        return IncrementalDetokenizer(self, prompt_ids, skip_special)

    def token_text(self, token_id: int) -> str:
        """One token's own text, as shown next to its log-probability: its piece with sentencepiece's word
        marker as a space (a byte piece stays as its `<0x..>` name)."""
        piece = self._sp.id_to_piece(int(token_id))
        return piece if self._sp.is_byte(int(token_id)) else piece.replace("\u2581", " ")

    def encode_chat(self, messages: list) -> list[int]:
        """The built-in LLaMA-2 chat format; see `llama2_chat_ids`."""
        return llama2_chat_ids(messages, self._sp.encode, self.bos_id, self.eos_id)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`. Special tokens are dropped, as if absent; with `skip_special=False` they
        appear as their piece text ("</s>") and the text between them is decoded piece by piece
        as separate texts (each starts a text, as in HuggingFace's slow LlamaTokenizer)."""
        if skip_special:
            return self._sp.decode(self._without_special(ids))
        parts, segment = [], []
        for token_id in map(int, ids):
            if token_id in self._special_ids:
                parts += [self._sp.decode(segment), self._sp.id_to_piece(token_id)]
                segment = []
            else:
                segment.append(token_id)
        parts.append(self._sp.decode(segment))
        return "".join(parts)

    def decode_continuation(self, ids: Iterable[int]) -> str:
        """Text of `ids` as it appears after some earlier text: "▁world" gives " world".

        This is `decode(earlier + ids)[len(decode(earlier)):]` for any `earlier` with text that
        does not end partway through a character, without decoding `earlier`. Useful for the
        text of one generated token (streaming, logprobs). Special tokens are dropped.
        """
        text = self._sp.decode([self._anchor_id] + self._without_special(ids))
        return text[len(self._anchor_text):]

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def encode_verbatim(self, text: str) -> list[int]:
        """Token ids of `text` exactly as it is, as it continues other text: no space before its first word, no
        whitespace run collapsed (the model's normalizer with both rules off; a grammar's forced text is tokenized
        with it, master/grammar.py)."""
        if self._verbatim is None:
            from sentencepiece import sentencepiece_model_pb2

            proto = sentencepiece_model_pb2.ModelProto()
            proto.ParseFromString(self._sp.serialized_model_proto())
            proto.normalizer_spec.add_dummy_prefix = False
            proto.normalizer_spec.remove_extra_whitespaces = False
            self._verbatim = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
        return self._verbatim.encode(text)

    def token_bytes(self, token_id: int) -> bytes:
        """What one token adds to the text, as bytes: its piece with the word marker as a space, a byte piece's
        byte (a special token: its piece)."""
        value = self._byte_values.get(int(token_id))
        if value is not None:
            return bytes([value])
        return self._sp.id_to_piece(int(token_id)).replace("\u2581", " ").encode("utf-8")

    def byte_value(self, token_id: int) -> Optional[int]:
        """The byte a byte-fallback piece such as <0xE4> stands for; None for any other piece."""
        return self._byte_values.get(int(token_id))

    def _without_special(self, ids: Iterable[int]) -> list[int]:
        return [i for i in map(int, ids) if i not in self._special_ids]


class IncrementalDetokenizer(DetokenizerBase):
    """Turns a growing stream of token ids into text deltas for streaming.

    Invariant: the deltas of `push` followed by `flush()` concatenate to `tokenizer.decode(ids)`
    (same `skip_special`) when the stream starts the text, and to
    `decode(prompt_ids + ids)[len(decode(prompt_ids)):]` after a prompt, which must end on a
    character boundary as every `encode` result does. So a generated token that starts a word
    keeps its leading space.

    Work per token is O(1): only the pending tokens are decoded, at most 4 of them (byte pieces
    that may still complete a character are held back; a character is at most 4 bytes). Once the
    text has started they are decoded with `decode_continuation`; before that, with `decode`.
    """

    def __init__(self, tokenizer: SentencePieceTokenizer, prompt_ids: Optional[Iterable[int]] = None,
                 skip_special: bool = True):
        super().__init__()
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        # `_pending`: tokens pushed but not yet emitted. `_started`: whether the text so far is
        # non-empty, i.e. sentencepiece's start-of-text rule no longer applies.
        self._pending: list[int] = []
        self._started = False
        segment = []  # the prompt's text tokens since the last special token shown as text
        for token_id in map(int, prompt_ids or ()):
            if not tokenizer.is_special(token_id):
                segment.append(token_id)
            elif not skip_special:
                segment = []
        self._started = tokenizer.decode(segment) != ""
        self._pending = [] if self._started else segment[-1:]

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became safe to emit ("" if held back)."""
        self._check_open()
        token_id = int(token_id)
        if self._tokenizer.is_special(token_id):
            if self._skip_special:
                return ""
            # Shown as text; the text after it is decoded as a new text, as `decode` does.
            delta = self._emit_pending() + self._tokenizer.id_to_piece(token_id)
            self._pending, self._started = [], False
            return self._record(delta)
        self._pending.append(token_id)
        if self._ends_inside_character():
            return ""
        return self._record(self._emit_pending())

    def flush(self) -> str:
        """End the stream and return what is left; unfinished characters come out as U+FFFD."""
        if self._flushed:
            return ""
        self._flushed = True
        return self._record(self._emit_pending())

    def _emit_pending(self) -> str:
        if self._started:
            delta = self._tokenizer.decode_continuation(self._pending)
            self._pending = []
            return delta
        delta = self._tokenizer.decode(self._pending)
        self._started = delta != ""
        # Pieces that decoded to nothing can still decide whether the next piece's "▁" is
        # dropped; the last one carries that state, so it stays (it adds no text when re-decoded).
        self._pending = [] if self._started else self._pending[-1:]
        return delta

    def _ends_inside_character(self) -> bool:
        """Whether the trailing byte pieces could still be completed into a UTF-8 character."""
        tail = bytearray()
        for token_id in reversed(self._pending[-_MAX_PARTIAL_CHAR_BYTES:]):
            value = self._tokenizer.byte_value(token_id)
            if value is None:
                break
            tail.insert(0, value)
        # An incremental UTF-8 decoder leaves unconsumed exactly a trailing partial character.
        _, num_consumed = codecs.utf_8_decode(bytes(tail), "replace", False)
        return num_consumed < len(tail)
