"""One internal request behind every API: an API's validated model (server/api/) says what it asks for as an
`ApiRequest` (its `to_request()`), and `prepare` applies what needs the served model — the model or adapter it
names, token ids below the vocabulary, bad words as token sequences, the chat template with the tools, a harmony
chat's stops, the grammar that forces a tool call, the prompt's length against the context — and gives what the
engine is handed (`Prepared`). Every rule that needs no model is the API models' (checked once, by pydantic)."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from typing import Optional, Union

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.images import PromptImageInput
from llm_serving.master.request import SamplingParams
from llm_serving.server.errors import ModelNotFoundError, ValidationError
from llm_serving.server.harmony import STOPS as HARMONY_STOPS
from llm_serving.server.harmony import call_lark as harmony_call_lark
from llm_serving.server.tools import ToolRequest, history_as_text
from llm_serving.tokenization import ChatTemplateError
from llm_serving.vision import ImageError, decode, image_size


@dataclass
class ApiRequest:
    """What an API's request asks for, its shape checked, in the engine's terms; `prepare` applies the model."""
    sampling: SamplingParams          # every field but those the vocabulary decides (checked or made by prepare)
    prompt: Union[str, list, None] = None     # a completion's text (the BOS added) or its token ids
    prompt_parts: Optional[list] = None       # or a raw prompt with images (TGI's markdown images): its text pieces
                                              # and {"type": "image", "image": bytes} ({"url"} until fetched) parts,
                                              # in order; each image where the model's template would mark it
    messages: Optional[list] = None           # or a chat: [{role, content, tool_calls?, tool_call_id?}] (developer:
                                              # system), rendered by the chat template; a user turn's content may
                                              # be parts, {"type": "text", "text"} and {"type": "image", "image": its
                                              # file's bytes}
    variables: Optional[dict] = None          # the chat template's extra variables (chat_template_kwargs)
    tools: Optional[list] = None              # [{"type": "function", "function": {name, description, parameters}}]
    tool_choice: str = "auto"                 # auto, required, none, or a tool's name
    parallel_tool_calls: bool = True
    bad_words: tuple = ()                     # words the reply never contains (made token sequences by prepare)
    model: Optional[str] = None               # the model or LoRA adapter it names (None: the served model)
    max_tokens_field: str = "max_tokens"      # the API's name for the reply's length (errors name it)
    max_tokens_given: bool = True             # else the default length is fitted into what the context leaves
    max_tokens_ceiling: bool = False          # the length given is a ceiling, cut to what the context leaves
                                              # (Anthropic's max_tokens: required, and clients ask 32,000)
    n: int = 1
    stream: bool = False


@dataclass
class Prepared:
    """What the engine is handed: prompt ids, sampling (with its grammar spec), the LoRA adapter (None: the base
    model), and for a chat its tools and whether its reply is harmony (gpt-oss's channels)."""
    prompt_ids: list
    sampling: SamplingParams
    adapter: Optional[str] = None
    tools: Optional[ToolRequest] = None
    harmony: bool = False
    images: Optional[list] = None             # master/images.py's PromptImageInput's (None: no image)


def adapter_of(engine, model: Optional[str]) -> Optional[str]:
    """The LoRA adapter a request's model names (None: the base model), or ModelNotFoundError."""
    if model is None or model == engine.model_name:
        return None
    if model not in engine.served_models():
        raise ModelNotFoundError(f"the model {model!r} does not exist; this server serves "
                                 f"{', '.join(map(repr, engine.served_models()))}")
    return model


def prepare(req: ApiRequest, engine) -> Prepared:
    """`req` on the served model: a ValidationError (400) naming the field for what the model refuses (an embedding
    model refuses every generation, first). The prompt's length is checked as soon as the prompt is made, before
    anything else a long request (an agent's: thousands of tokens of tools) might fail on, so that a prompt the model
    cannot take is what its error says."""
    engine.check_generates()
    adapter = adapter_of(engine, req.model)
    tools, harmony, images = None, False, None
    if req.messages is not None:
        template = engine.chat_template
        tools = ToolRequest.of(req.tools, req.tool_choice, req.parallel_tool_calls, template)
        files = message_images(req.messages)
        decoded = decode_images(engine, files)
        prompt_ids = chat_ids(engine, req.messages, tools, req.variables)
        harmony = template.harmony
        if files:
            images = place_images(engine, prompt_ids, files, decoded)
    elif req.prompt_parts is not None:
        files = tuple(p.get("image") for p in req.prompt_parts if isinstance(p, dict))
        decoded = decode_images(engine, files, "inputs")
        prompt_ids = raw_image_ids(engine, req.prompt_parts, files)
        images = place_images(engine, prompt_ids, files, decoded, "inputs")
    else:
        prompt_ids = prompt_ids_of(engine, req.prompt)
    if images is None:
        check_no_placeholders(engine, prompt_ids, "messages" if req.messages is not None else "prompt")
    check_context(len(prompt_ids), engine.max_model_len, "messages" if req.messages is not None else "prompt")
    sp = replace(req.sampling, **_vocabulary_fields(req, engine.tokenizer, engine.vocab_size))
    if harmony:                 # gpt-oss: its channels are special tokens; <|return|>, <|call|> end the reply
        ends = [ids[0] for ids in (engine.tokenizer.encode(s, add_bos=False) for s in HARMONY_STOPS) if len(ids) == 1]
        sp = replace(sp, skip_special_tokens=False, stop_token_ids=tuple(dict.fromkeys((*sp.stop_token_ids, *ends))))
    if tools is not None and tools.forced:      # a call is forced by its grammar
        sp = replace(sp, grammar=tools.grammar() if not harmony else GrammarSpec(
            "grammar", harmony_call_lark([t["function"] for t in tools.allowed]), "tools"))
    if not req.max_tokens_given and engine.default_max_tokens is not None:
        sp.max_new_tokens = min(sp.max_new_tokens, engine.default_max_tokens)
    sp.max_new_tokens = fit_length(sp.max_new_tokens, req.max_tokens_given and not req.max_tokens_ceiling,
                                   len(prompt_ids), engine.max_model_len, req.max_tokens_field)
    return Prepared(prompt_ids, sp, adapter, tools, harmony, images)


def message_images(messages: list) -> tuple:
    """The files of a chat's images ({"type": "image", "image": bytes} parts; None for one given by a URL not
    fetched: server/image_urls.py), in order."""
    return tuple(p.get("image") for m in messages if isinstance(m.get("content"), list)
                 for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


def served_image_facts(engine, param: str = "messages"):
    """The served model's ImageFacts (vision/model.py), or a ValidationError: it takes no images."""
    facts = engine.image_facts
    if facts is None:
        raise ValidationError(f"model {engine.model_name!r} does not take images (a text model, or one whose vision "
                              "tower is not served)", param=param)
    return facts


def decode_images(engine, images: tuple, param: str = "messages") -> list:
    """The chat's images decoded (Pillow images), each checked: a ValidationError for a model that takes none,
    more than serving_config.max_images, or an image larger than serving_config.max_image_bytes, that is not one,
    is cut short, or has more pixels than serving_config.max_image_pixels."""
    if not images:
        return []
    served_image_facts(engine, param)
    limits = engine.config.serving_config
    if len(images) > limits.max_images:
        raise ValidationError(f"the request has {len(images)} images; at most {limits.max_images} are taken "
                              "(serving_config.max_images)", param=param)
    out = []
    for k, data in enumerate(images):
        if data is None:
            raise ValidationError(f"image {k + 1} of {len(images)} is a URL this route does not fetch; send it as a "
                                  "base64 data: URL", param=param)
        if len(data) > limits.max_image_bytes:
            raise ValidationError(f"image {k + 1} of {len(images)} has {len(data)} bytes; at most "
                                  f"{limits.max_image_bytes} are taken (serving_config.max_image_bytes)",
                                  param=param)
        try:
            out.append(decode(data, max_pixels=limits.max_image_pixels))
        except ImageError as e:
            raise ValidationError(f"image {k + 1} of {len(images)}: {e}", param=param) from None
    return out


def place_images(engine, prompt_ids: list, images: tuple, decoded: list, param: str = "messages") -> list:
    """The images' placeholders found in the prompt (in order, one run per frame: a Gemma 3 image is one frame, a
    SmolVLM image its tiles and the whole; a template that leaves an image out, or a prompt that spells placeholder
    tokens itself, is a ValidationError), and each frame's pixels, keyed by its image's content and its place."""
    facts = engine.image_facts
    try:
        spans = facts.spans(prompt_ids)
    except ValueError as e:
        raise ValidationError(str(e), param=param) from None
    try:
        frames = [(hashlib.sha256(data).hexdigest(), k, pixels)
                  for data, image in zip(images, decoded) for k, pixels in enumerate(facts.frames(image))]
    except ImageError as e:
        raise ValidationError(f"an image cannot be made the model's pixels: {e}", param=param) from None
    if len(spans) != len(frames):
        raise ValidationError(f"the chat template placed {len(spans)} of the request's {len(frames)} image frames "
                              f"({len(images)} images; its messages' image parts must be in user turns)",
                              param=param)
    for (start, length), (_, _, pixels) in zip(spans, frames):
        if length != facts.tokens_of(pixels):
            raise ValidationError(f"the prompt holds {length} image placeholder tokens in a row at {start}; its "
                                  f"image is {facts.tokens_of(pixels)}", param=param)
        if prompt_ids[start:start + length] != facts.placeholder_ids(pixels):
            raise ValidationError(f"the image placeholder tokens at {start} are not laid out as the image's "
                                  f"{pixels.shape[0]} x {pixels.shape[1]} grid of tokens", param=param)
    return [PromptImageInput(start, length, digest if k == 0 else f"{digest}/{k}", pixels, facts.rope_advance(pixels))
            for (start, length), (digest, k, pixels) in zip(spans, frames)]


def image_sizes(images: tuple, param: str = "messages") -> list:
    """(width, height) of each image's file from its header (SmolVLM's prompt needs its grid before the pixels are
    made); a ValidationError naming the image that is not one, or a URL not fetched."""
    out = []
    for k, data in enumerate(images):
        if data is None:
            raise ValidationError(f"image {k + 1} of {len(images)} is a URL this route does not fetch; send it as a "
                                  "base64 data: URL", param=param)
        try:
            out.append(image_size(data))
        except ImageError as e:
            raise ValidationError(f"image {k + 1} of {len(images)}: {e}", param=param) from None
    return out


def _vocabulary_fields(req: ApiRequest, tokenizer, vocab: int) -> dict:
    """The sampling fields the vocabulary decides: stop_token_ids, logit_bias's and allowed_token_ids' ids below
    it, bad words as token sequences (each as it starts the text and as it follows a space)."""
    sp = req.sampling
    for field, ids in (("stop_token_ids", sp.stop_token_ids), ("allowed_token_ids", sp.allowed_token_ids),
                       ("logit_bias", [t for t, _ in sp.logit_bias])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValidationError(f"{field} must be token ids in 0..{vocab - 1}; {bad[0]} is not", param=field)
    sequences: dict = {}
    for word in req.bad_words:
        for text in (word, word if word.startswith(" ") else " " + word):
            ids = tuple(tokenizer.encode(text, add_bos=False))
            if ids:
                sequences[ids] = None
    return {"bad_words": tuple(sequences)} if req.bad_words else {}


def check_no_placeholders(engine, prompt_ids: list, param: str) -> None:
    """A ValidationError for a prompt without images that holds the served model's image placeholder tokens (a text
    that spells them, or ids): they would reach the model as its embeddings of those tokens, not as an image."""
    facts = engine.image_facts
    if facts is None or facts.image_token_id not in prompt_ids:
        return
    raise ValidationError(f"the prompt holds {prompt_ids.count(facts.image_token_id)} image placeholder tokens "
                          f"({facts.image_token!r}) but no image; send an image as its API carries one (a chat's image "
                          "part, a generate prompt's markdown image), and its placeholders are made for it", param=param)


def expansion_sizes(facts, images: tuple, param: str) -> tuple:
    """The images' sizes `facts.expand` needs (none where it needs none), each checked to make its tokens (Qwen-VL's
    grid: an image too narrow for one is a ValidationError naming it)."""
    sizes = image_sizes(images, param) if facts.needs_sizes else ()
    for k, size in enumerate(sizes):
        try:
            facts.tokens_of_size(*size)
        except ImageError as e:
            raise ValidationError(f"image {k + 1} of {len(images)}: {e}", param=param) from None
    return sizes


def raw_image_ids(engine, parts: list, files: tuple) -> list:
    """A raw prompt's ids with its images (`ApiRequest.prompt_parts`): each image's part the model's template mark
    (ImageFacts.mark), made its placeholders as a chat's are (the BOS added, as a completion's text)."""
    facts = served_image_facts(engine, "inputs")
    sizes = expansion_sizes(facts, files, "inputs")
    text = "".join(p if isinstance(p, str) else facts.mark for p in parts)
    return engine.tokenizer.encode(facts.expand(text, sizes), add_bos=True)


def prompt_ids_of(engine, prompt) -> list:
    """A completion prompt's token ids: its text's (the BOS added), or its ids, each below the vocabulary."""
    if isinstance(prompt, str):
        return engine.tokenizer.encode(prompt, add_bos=True)
    vocab = engine.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise ValidationError(f"'prompt': {bad[0]} is not a token id in 0..{vocab - 1}", param="prompt")
    return list(prompt)


def chat_ids(engine, messages: list, tools: Optional[ToolRequest], variables: Optional[dict]) -> list:
    """A chat's prompt ids: through the chat template, with the tools (server/tools.py) and the request's extra
    template variables; a history of tool calls and results as text for a template that does not take them; its
    images' marks made their placeholders (vision/model.py: what /tokenize and count_tokens count too), or a
    ValidationError for images to a model that takes none."""
    template = engine.chat_template
    expand, images = None, message_images(messages)
    if images:
        facts = served_image_facts(engine)
        sizes = expansion_sizes(facts, images, "messages")
        expand = lambda text: facts.expand(text, sizes)                   # noqa: E731
    rendered = None
    if tools is not None:
        messages, rendered = tools.conversation(messages)
    elif not template.takes_tools and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = history_as_text(messages)
    try:
        return template.encode(messages, rendered, variables, expand)
    except ChatTemplateError as exc:
        folded = fold_system_messages(messages)
        if folded == messages:
            raise ValidationError(str(exc), param="messages") from None
    try:        # a template that takes the system prompt only first (most do): the later ones folded in
        return template.encode(folded, rendered, variables, expand)
    except ChatTemplateError as exc:
        raise ValidationError(str(exc), param="messages") from None


def fold_system_messages(messages: list) -> list:
    """The conversation with one system message at most, first: the system messages that open it joined, and each
    later one (Claude Code's and Codex's instructions mid-conversation) put before the text of the user turn that
    follows it (after the last one's, when none follows), where a template that refuses them mid-conversation still
    shows them in their place."""
    out: list = []
    pending: list = []          # later system texts waiting for the next user turn
    for m in messages:
        if m["role"] == "system" and all(o["role"] == "system" for o in out):
            out = [{"role": "system", "content": "\n\n".join([*(o["content"] for o in out), _text_of(m)])}]
        elif m["role"] == "system":
            pending.append(_text_of(m))
        elif m["role"] == "user" and pending:
            out.append(_with_text(m, "\n\n".join(pending), before=True))
            pending = []
        else:
            out.append(m)
    if pending:
        last = max((k for k, m in enumerate(out) if m["role"] == "user"), default=None)
        if last is None:
            out.append({"role": "user", "content": "\n\n".join(pending)})
        else:
            out[last] = _with_text(out[last], "\n\n".join(pending), before=False)
    return out


def _with_text(message: dict, text: str, before: bool) -> dict:
    """A user message with `text` joined before or after its own (a message of parts, images among them, keeps
    them: the text is a part of its own)."""
    content = message.get("content")
    if isinstance(content, list) and any(p.get("type") == "image" for p in content if isinstance(p, dict)):
        part = {"type": "text", "text": text}
        return {**message, "content": [part, *content] if before else [*content, part]}
    joined = [text, _text_of(message)] if before else [_text_of(message), text]
    return {**message, "content": "\n\n".join(joined)}


def _text_of(message: dict) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content
                                                            if isinstance(p, dict))


def check_context(num_prompt_tokens: int, max_model_len: int, param: Optional[str] = None) -> None:
    """A prompt the model cannot take: a ValidationError saying its tokens, the limit and what to do."""
    if num_prompt_tokens >= max_model_len:
        raise ValidationError(
            f"prompt has {num_prompt_tokens} tokens; this model accepts at most {max_model_len - 1} prompt tokens "
            f"({max_model_len} tokens per request, prompt + new tokens). Shorten the prompt (fewer or shorter "
            "messages, fewer tools), or serve a model with a longer context", param=param)


def fit_length(max_new_tokens: int, given: bool, num_prompt_tokens: int, max_model_len: int,
               field: str = "max_new_tokens") -> int:
    """The reply's length in what the context leaves (the prompt fits: `check_context`): a length the request gave
    must fit, a default one is cut to fit."""
    room = max_model_len - num_prompt_tokens
    if not given:
        return min(max_new_tokens, room)
    if max_new_tokens > room:
        raise ValidationError(f"prompt ({num_prompt_tokens} tokens) + {field} ({max_new_tokens}) exceeds the "
                              f"model's {max_model_len}-token limit; ask for at most {room} new tokens", param=field)
    return max_new_tokens


def request_id(value: Optional[str]) -> Optional[str]:
    """A client-chosen request id (header X-Request-Id): 1-128 visible ASCII characters, or None."""
    if value is None:
        return None
    if not 1 <= len(value) <= 128 or not re.fullmatch(r"[!-~]+", value):
        raise ValidationError("header X-Request-Id must be 1 to 128 visible ASCII characters (no spaces)")
    return value
