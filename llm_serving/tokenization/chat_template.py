"""Chat prompts to token ids: the built-in LLaMA-2 format, or a Jinja chat template (the model's own, from its
GGUF metadata, tokenizer_config.json, chat_template.jinja or chat_template.json, or one given in the config).

Each model is trained on one conversation format, so a chat request is only answered well when its messages
are laid out exactly as the model's template says; HuggingFace and llama.cpp models carry that template as
Jinja, which is rendered here as transformers' `apply_chat_template` does: in an immutable sandbox, with
`messages`, `bos_token`, `eos_token`, `add_generation_prompt` (false when the last message is the assistant's,
which the reply then continues), `raise_exception(msg)` (rejects the conversation with that message),
`strftime_now(fmt)`, a `tojson` that keeps non-ASCII text, and `{% break %}`/`{% continue %}`. A request may add
variables of its own (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), never one of those
(`check_variables`).

The rendered text is split at the BOS and EOS strings (`tokenizer.special_text`, e.g. "<s>", "</s>"), which
become those token ids; the rest is encoded without adding a BOS. A tokenizer.json or GGUF byte-level
vocabulary also turns its other special tokens in the text (ChatML's "<|im_start|>") into their ids.
"""
from __future__ import annotations

import functools
import json
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from .base import folder_chat_template

BUILTIN = "llama2"


class ChatTemplateError(ValueError):
    """The conversation does not fit the template (the message says why)."""


def _environment():
    """A sandbox like transformers' for chat templates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(message)

    def tojson(value, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# what every render is given (transformers' names); a request's own variables may not replace them
RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


@functools.lru_cache(maxsize=None)
def reserved_variables() -> frozenset:
    """The names a request's variables may not take: the render's own and the sandbox's functions
    (raise_exception, strftime_now, and Jinja's namespace, range, dict, ...), which templates call."""
    return frozenset(RENDER_VARIABLES) | frozenset(_environment().globals)


def check_variables(variables: Optional[dict]) -> dict:
    """A request's extra template variables (vLLM's `chat_template_kwargs`: {"enable_thinking": false}), checked:
    ChatTemplateError naming a key the render sets itself (`reserved_variables`) or whose value is not JSON (a
    NaN or an infinity, which Python's JSON reader lets through). A variable the template never reads is ignored,
    as vLLM does: a client may send Qwen3's switch to any model."""
    variables = variables or {}
    for key, value in variables.items():
        if key in reserved_variables():
            raise ChatTemplateError(f"chat_template_kwargs.{key}: the chat template's render sets {key!r} itself; "
                                    "a request cannot replace it")
        if not _is_json(value):
            raise ChatTemplateError(f"chat_template_kwargs.{key} must be a JSON value (no NaN or infinity)")
    return variables


def _is_json(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    if isinstance(value, list):
        return all(map(_is_json, value))
    return value is None or isinstance(value, (str, int, bool))


class ChatTemplate:
    """Turns a conversation into prompt ids with one tokenizer and one template (None: the built-in LLaMA-2
    format of `tokenizer.encode_chat`). `source` says where the template came from, for the start-up log."""

    def __init__(self, tokenizer, template: Optional[str] = None, source: str = BUILTIN):
        self.tokenizer = tokenizer
        self.source = source
        self.text = template                 # its Jinja source (None: the built-in format), as /api/show gives it
        self._template = None
        self._takes_tools = False
        self.tool_format = "hermes"          # how the model writes a tool call (server/tools.py reads it)
        # the template marks reasoning with <think> tags (server/reasoning.py splits replies)
        self.reasons = template is not None and "<think>" in template
        # the template renders OpenAI's harmony format (gpt-oss's: each message <|start|>role...<|message|>...;
        # server/harmony.py reads its replies)
        self.harmony = template is not None and "<|start|>" in template and "<|message|>" in template
        if template is not None:
            from jinja2 import TemplateError, meta

            try:
                env = _environment()
                self._template = env.from_string(template)
                self._takes_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
            except TemplateError as exc:
                raise ValueError(f"chat template from {source} is not valid Jinja: {exc}") from None
            if self._takes_tools and "<tool_call>" not in template and '"parameters"' in template:
                self.tool_format = "llama3_json"     # Llama-3.1/3.2: a bare {"name": ..., "parameters": ...}
            self._specials = {tokenizer.special_text(i): i for i in (tokenizer.bos_id, tokenizer.eos_id)
                              if i is not None and tokenizer.special_text(i)}
            self._split = re.compile("(" + "|".join(map(re.escape, self._specials)) + ")") if self._specials else None

    @property
    def takes_tools(self) -> bool:
        """The template renders a `tools` list itself (Qwen2.5's, Llama-3.1's do); else tools are described in a
        system message (server/tools.py)."""
        return self._takes_tools

    def encode(self, messages: list, tools: Optional[list] = None, variables: Optional[dict] = None,
               expand: Optional[Callable[[str], str]] = None) -> list:
        """Token ids of a conversation ([{"role", "content"}], `tools` for a template that takes them, a request's
        extra `variables`; the built-in format has none and ignores them); ChatTemplateError if it does not fit.
        `expand`: the rendered text made what is tokenized (an image's mark made its placeholders: vision/model.py)."""
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        if self._template is None:
            if expand is not None:
                raise ChatTemplateError("the built-in LLaMA-2 chat format places no images")
            check_variables(variables)
            try:
                return self.tokenizer.encode_chat(messages)
            except ValueError as exc:
                raise ChatTemplateError(str(exc)) from None
        ids: list = []
        text = self.render(messages, tools, variables)
        if expand is not None:
            text = expand(text)
        for part in (self._split.split(text) if self._split else [text]):
            if part in self._specials:
                ids.append(self._specials[part])
            elif part:
                ids += self.tokenizer.encode(part, add_bos=False)
        if not ids:
            raise ChatTemplateError("the chat template rendered nothing for these messages")
        return ids

    def render(self, messages: list, tools: Optional[list] = None, variables: Optional[dict] = None) -> str:
        """The template's text for a conversation (Jinja templates only), with a request's extra `variables`
        (`check_variables`)."""
        from jinja2 import TemplateError

        if self._template is None:
            raise ValueError("the built-in LLaMA-2 format has no text form; it is encoded directly")
        bos, eos = (self.tokenizer.special_text(i) if i is not None else ""
                    for i in (self.tokenizer.bos_id, self.tokenizer.eos_id))
        try:
            extra = {**check_variables(variables), **({"tools": tools} if tools else {})}
            return self._template.render(messages=messages, bos_token=bos, eos_token=eos,
                                         add_generation_prompt=messages[-1]["role"] != "assistant", **extra)
        except TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None


def load_chat_template(setting: Optional[str], model_dir: str, tokenizer) -> ChatTemplate:
    """The chat template a config asks for (see TokenizerConfig.chat_template). ValueError if unusable. Unset:
    the tokenizer's own (a GGUF's tokenizer.chat_template, or its directory's: tokenizer_config.json's,
    chat_template.jinja, chat_template.json), else the model directory's (`folder_chat_template`), else the
    built-in LLaMA-2 format."""
    if setting is None and tokenizer.chat_template:
        return ChatTemplate(tokenizer, tokenizer.chat_template, source=tokenizer.model_file)
    if setting is None:
        path = Path(model_dir) / "tokenizer_config.json"
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        template, source = folder_chat_template(Path(model_dir), raw) if Path(model_dir).is_dir() else (None, None)
        return ChatTemplate(tokenizer, template, source=source) if template else ChatTemplate(tokenizer)
    if setting == BUILTIN:
        return ChatTemplate(tokenizer)
    if "{" not in setting:
        path = Path(setting).expanduser()
        if not path.is_file():
            raise ValueError(f"tokenizer.chat_template={setting!r}: not {BUILTIN!r}, not a Jinja template and "
                             "no such file")
        return ChatTemplate(tokenizer, path.read_text(encoding="utf-8"), source=str(path))
    return ChatTemplate(tokenizer, setting, source="tokenizer.chat_template")
