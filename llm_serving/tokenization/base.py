"""What every tokenizer shares: the interface the rest of the code uses (`Tokenizer`), the incremental
detokenizer's base (`DetokenizerBase`), the built-in LLaMA-2 chat format over any vocabulary (`llama2_chat_ids`)
and a model directory's chat template (`config_chat_template` of a tokenizer_config.json, `folder_chat_template`).

The readers (sentencepiece.py, hf.py, gguf.py) import this module and nothing else of the package; the loader
(loader.py) imports the readers.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol

__all__ = ["DetokenizerBase", "Detokenizer", "Tokenizer", "config_chat_template", "folder_chat_template",
           "llama2_chat_ids"]


class Detokenizer(Protocol):
    """Turns a growing stream of token ids into text deltas: `push` one id, `flush` at the end; `text` so far."""

    text: str

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    """What the master needs of a model's vocabulary, whatever file it came from (`load_tokenizer` gives one):
    a sentencepiece model (`SentencePieceTokenizer`), a tokenizer.json (`HFTokenizer`) or a GGUF's own
    vocabulary (rebuilt as one of the two). `bos_id` is None for a vocabulary without BOS; `eos_ids` are all the
    ids that end generation (`eos_id` first); `add_bos`: whether prompts start with BOS; `input_suffix`: the ids the
    model's tokenizer appends to a text it encodes whole (a tokenizer.json post-processor's, as Qwen3-Embedding's
    `<|endoftext|>`; a GGUF's add_eos_token): an embedding's input ends with them; `chat_template`: the
    model's own Jinja template, if it ships one; `model_file`: where the vocabulary was read from."""

    vocab_size: int
    bos_id: Optional[int]
    eos_id: int
    eos_ids: list
    pad_id: int
    add_bos: bool
    input_suffix: tuple
    chat_template: Optional[str]
    model_file: str

    def encode(self, text: str, add_bos: bool = True) -> list:
        """Token ids of `text`, after a BOS when add_bos and the model starts prompts with one."""

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Text of `ids`; special tokens left out unless skip_special is False."""

    def token_text(self, token_id: int) -> str:
        """One token's own text, as shown next to its log-probability (with the space it starts with)."""

    def is_special(self, token_id: int) -> bool:
        """Whether the token is a special (control) token, which `decode` leaves out by default."""

    def token_bytes(self, token_id: int) -> bytes:
        """What one token adds to the text, as bytes (a grammar's token masks are computed from these)."""

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary's piece of a token."""

    def special_text(self, token_id: int) -> str:
        """The text that stands for a special token in a rendered chat template ("<s>", "<|im_start|>")."""

    def encode_chat(self, messages: list) -> list:
        """The built-in LLaMA-2 chat format through this vocabulary (see `llama2_chat_ids`)."""

    def detokenizer(self, prompt_ids: Optional[Iterable[int]] = None, skip_special: bool = True) -> Detokenizer:
        """A stream's incremental detokenizer, after `prompt_ids`."""


def llama2_chat_ids(messages: list, encode: Callable[[str], list], bos_id: Optional[int], eos_id: int) -> list[int]:
    """LLaMA-2 chat format: `[{"role": "system"|"user"|"assistant", "content": str}]` ->
    `<s>[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{user} [/INST] {assistant} </s><s>[INST] {user} [/INST]`,
    each turn pair encoded on its own (`encode`, no BOS) between BOS and EOS ids (never from text, so a message
    cannot forge them). A trailing assistant message is a prefix the reply continues (no EOS after it).
    Roles must alternate user/assistant after an optional first system message (ValueError); a vocabulary
    without BOS cannot express the format (ValueError)."""
    if bos_id is None:
        raise ValueError("the tokenizer has no BOS token, which the built-in LLaMA-2 chat format needs; "
                         "set tokenizer.chat_template")
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    ids: list[int] = []
    for i in range(0, len(messages), 2):
        pair = messages[i:i + 2]
        roles = [m["role"] for m in pair]
        if roles not in (["user"], ["user", "assistant"]):
            raise ValueError("messages must alternate user and assistant turns after an optional first "
                             f"system message; got {roles} at message {i + (system is not None)}")
        user = pair[0]["content"].strip()
        if system is not None and i == 0:
            user = f"<<SYS>>\n{system.strip()}\n<</SYS>>\n\n{user}"
        text = f"[INST] {user} [/INST]"
        if len(pair) == 2:
            reply = pair[1]["content"].strip()
            last = i + 2 == len(messages)
            ids += [bos_id] + encode(f"{text} {reply}" if last else f"{text} {reply} ")
            if not last:
                ids.append(eos_id)
        else:
            ids += [bos_id] + encode(text)
    if not ids:
        raise ValueError("messages need at least one user message")
    return ids


def config_chat_template(config: dict) -> Optional[str]:
    """The chat template of a tokenizer_config.json: its `chat_template` string, or of a list of named
    templates ([{"name", "template"}]) the one named `default`; None when there is none."""
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template.strip() else None


def folder_chat_template(folder: Path, config: dict) -> tuple:
    """(template, the file it is from) of a model directory, where each writer of HF directories puts it, in the
    order llama.cpp's converter reads them: tokenizer_config.json's (`config`, read by the caller), else
    `chat_template.jinja` (transformers 5.x, and 4.x's processors from 4.50), else `chat_template.json`'s (the
    processors of older 4.x releases: the vision-language models on the Hub, Gemma 3, SmolVLM, Qwen2.5-VL, ship
    one); (None, None) when there is none. A chat_template.json that is not JSON is a ValueError naming it."""
    template = config_chat_template(config)
    if template:
        return template, str(folder / "tokenizer_config.json")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        text = jinja.read_text(encoding="utf-8")
        return (text, str(jinja)) if text.strip() else (None, None)
    path = folder / "chat_template.json"
    if not path.is_file():
        return None, None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable chat template ({e})") from None
    template = config_chat_template(raw) if isinstance(raw, dict) else None
    return (template, str(path)) if template else (None, None)


class DetokenizerBase:
    """What every incremental detokenizer shares: the text emitted so far (`text`), and no push after `flush`."""

    def __init__(self):
        self._chunks: list[str] = []
        self._flushed = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _record(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta

    def _check_open(self) -> None:
        if self._flushed:
            raise RuntimeError("push() after flush(): the stream has ended")
