"""Chat prompts to token ids: the built-in LLaMA-2 format, or a Jinja template (the `chat_template` of a
HuggingFace tokenizer_config.json, or one given in the config).

A template renders `messages`, `bos_token`, `eos_token` and `add_generation_prompt` (false when the last
message is the assistant's, which the reply then continues) to text, in a sandbox; `raise_exception(msg)`
in a template rejects the conversation with that message. The rendered text is split at the BOS and EOS
piece strings ("<s>", "</s>"), which become those token ids; the rest is encoded without adding a BOS (a
tokenizer.json or GGUF byte-level vocabulary also turns its other special tokens, e.g. ChatML's
"<|im_start|>", into their ids).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from llm_serving.tokenizer import Tokenizer

BUILTIN = "llama2"


class ChatTemplateError(ValueError):
    """The conversation does not fit the template (the message says why)."""


class ChatTemplate:
    def __init__(self, tokenizer: Tokenizer, template: Optional[str] = None, source: str = BUILTIN):
        self.tokenizer = tokenizer
        self.source = source            # where the template came from, for the start-up log
        self._template = None
        if template is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise ChatTemplateError(message)
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(template)
            except TemplateError as exc:
                raise ValueError(f"chat template from {source} is not valid Jinja: {exc}") from None
            self._specials = {tokenizer.special_text(i): i for i in (tokenizer.bos_id, tokenizer.eos_id)
                              if i is not None}
            self._split = re.compile("(" + "|".join(map(re.escape, self._specials)) + ")")

    def encode(self, messages: list) -> list:
        """Token ids of a conversation ([{"role", "content"}]); ChatTemplateError if it does not fit."""
        if self._template is None:
            try:
                return self.tokenizer.encode_chat(messages)
            except ValueError as exc:
                raise ChatTemplateError(str(exc)) from None
        from jinja2 import TemplateError

        bos, eos = (self.tokenizer.special_text(i) if i is not None else ""
                    for i in (self.tokenizer.bos_id, self.tokenizer.eos_id))
        try:
            text = self._template.render(messages=messages, bos_token=bos, eos_token=eos,
                                         add_generation_prompt=messages[-1]["role"] != "assistant")
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
        ids: list = []
        for part in self._split.split(text):
            if part in self._specials:
                ids.append(self._specials[part])
            elif part:
                ids += self.tokenizer.encode(part, add_bos=False)
        if not ids:
            raise ChatTemplateError("the chat template rendered nothing for these messages")
        return ids


def load_chat_template(setting: Optional[str], model_dir: str, tokenizer: Tokenizer) -> ChatTemplate:
    """The chat template a config asks for (see TokenizerConfig.chat_template). ValueError if unusable. Unset:
    the tokenizer's own (a GGUF's tokenizer.chat_template, tokenizer_config.json's, chat_template.jinja), else
    the model directory's tokenizer_config.json's, else the built-in LLaMA-2 format."""
    if setting is None and tokenizer.chat_template:
        return ChatTemplate(tokenizer, tokenizer.chat_template, source=tokenizer.model_file)
    if setting is None:
        path = Path(model_dir) / "tokenizer_config.json"
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if isinstance(template, list):    # named templates: the default one
                template = next((t.get("template") for t in template if t.get("name") == "default"), None)
            if isinstance(template, str) and template.strip():
                return ChatTemplate(tokenizer, template, source=str(path))
        return ChatTemplate(tokenizer)
    if setting == BUILTIN:
        return ChatTemplate(tokenizer)
    if "{" not in setting:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ValueError(f"tokenizer.chat_template={setting!r}: not {BUILTIN!r}, not a Jinja template and "
                             "no such file")
        return ChatTemplate(tokenizer, path.read_text(), source=str(path))
    return ChatTemplate(tokenizer, setting, source="tokenizer.chat_template")
