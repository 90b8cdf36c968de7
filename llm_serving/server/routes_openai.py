"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`.

Streaming and not, `n` choices (each its own request; with a seed, choice i uses seed + i),
`stream_options.include_usage`, `usage`, `logprobs` of the chosen tokens, `stop`, `seed`, `max_tokens`
(`max_completion_tokens` for chat), `temperature` (OpenAI's default 1.0: sampling unless set to 0),
`top_p`, `presence_penalty`, `frequency_penalty`, and the extensions vLLM clients send (`top_k`,
`ignore_eos`, `stop_token_ids`, `repetition_penalty`; and `speculative`: false keeps a request out of
speculative decoding). Errors are
OpenAI-shaped (see app.error_middleware). Chat prompts go through the engine's chat template
(llm_serving/tokenization/chat_template.py: LLaMA-2 built in, or a Jinja template, given the request's
`chat_template_kwargs` as extra variables); a last assistant message is a prefix the reply continues.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from aiohttp import web

from llm_serving.tokenization import ChatTemplateError, check_variables
from llm_serving.master.request import SamplingParams
from llm_serving.server import api_models, schemas, streaming
from llm_serving.server.keys import ENGINE
from llm_serving.server.schemas import ValidationError
from llm_serving.master.grammar import GrammarSpec
from llm_serving.server.harmony import STOPS as HARMONY_STOPS, HarmonyStream, split_harmony
from llm_serving.server.harmony import call_lark as harmony_call_lark
from llm_serving.server.reasoning import AFTER, INSIDE, ReasoningStream, reply_start, split_reasoning
from llm_serving.server.tools import CallStream, ToolRequest, history_as_text, parse_calls

def _model(engine, body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ValidationError("'model' is required: the served model's id (GET /v1/models)", param="model")
    if model not in engine.served_models():
        raise schemas.ModelNotFoundError(f"the model {model!r} does not exist; this server serves "
                                         f"{', '.join(map(repr, engine.served_models()))}")
    return model


def _sampling(r, body: dict, max_tokens_key: str, default_max: int, tokenizer, vocab: int):
    """(SamplingParams, whether max_tokens was given, n, stream, include_usage) of a validated request `r`
    (api_models: types and ranges checked) and its body (what needs the vocabulary, ids below `vocab`, is checked
    here)."""
    max_tokens = getattr(r, max_tokens_key)
    if max_tokens_key != "max_tokens" and max_tokens is None:
        max_tokens = r.max_tokens
    if max_tokens == 0 and r.prompt_logprobs is None and not getattr(r, "echo", False):
        raise ValidationError(f"{max_tokens_key} must be at least 1 (0: only with echo or prompt_logprobs, to score "
                              "the prompt)", param=max_tokens_key)
    if r.stream_options is not None and not r.stream:
        raise ValidationError("stream_options is only allowed with stream: true", param="stream_options")
    greedy = r.temperature == 0.0
    sampling = SamplingParams(
        max_new_tokens=(max_tokens if max_tokens is not None else default_max) or 1, temperature=r.temperature,
        top_k=0 if greedy or r.top_k == -1 else r.top_k, top_p=1.0 if greedy else r.top_p,
        seed=None if r.seed is None else r.seed % (1 << 63), ignore_eos=r.ignore_eos,
        stop=schemas.parse_stop(r.stop, "stop"),
        stop_token_ids=schemas.parse_stop_token_ids(r.stop_token_ids, "stop_token_ids", vocab),
        repetition_penalty=r.repetition_penalty, presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty, speculative=r.speculative, skip_special_tokens=r.skip_special_tokens,
        **schemas.parse_logit_controls(r, tokenizer, vocab, max_tokens=max_tokens),
        grammar=schemas.parse_structured(body), prompt_logprobs=r.prompt_logprobs)
    if max_tokens == 0 and (sampling.grammar is not None or r.stream):
        raise ValidationError(f"{max_tokens_key} 0 (scoring the prompt) goes with neither a grammar nor stream",
                              param=max_tokens_key)
    include_usage = r.stream_options is not None and r.stream_options.include_usage
    return sampling, max_tokens is not None, r.n, r.stream, include_usage


def _prompt_ids(engine, prompt) -> list:
    """Token ids of a completions prompt: a string, a list of one string, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationError("'prompt' is empty", param="prompt")
        return engine.tokenizer.encode(prompt, add_bos=True)
    vocab = engine.vocab_size
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)):
        return list(prompt)
    raise ValidationError(f"'prompt' must be a non-empty string, a list of one string, or a list of token ids in "
                          f"0..{vocab - 1} (one prompt per request)", param="prompt")


def _text(content, where: str) -> str:
    """A message's content: a string or text parts ([{"type": "text", "text": ...}])."""
    if isinstance(content, list):
        if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
            raise ValidationError(f"{where}.content: only text parts are supported", param="messages")
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise ValidationError(f"{where}.content must be a string", param="messages")
    return content


def _tool_calls(calls, where: str) -> list:
    """An assistant message's tool_calls, checked: [{id, type function, function {name, arguments}}]."""
    if not isinstance(calls, list) or not calls:
        raise ValidationError(f"{where}.tool_calls must be a non-empty list", param="messages")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise ValidationError(f"{where}.tool_calls[{k}] must be {{id, type: function, function: {{name, "
                                  "arguments}}}}", param="messages")
        out.append({"id": str(call.get("id") or f"call_{k}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


def _messages(messages) -> list:
    """A chat's messages checked: roles system (developer: the same), user, assistant (content, or tool_calls and
    content null) and tool (its tool_call_id and content)."""
    if not isinstance(messages, list) or not messages:
        raise ValidationError("'messages' must be a non-empty list of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ValidationError(f"{where} must be an object with role system, developer, user, assistant or tool",
                                  param="messages")
        role = "system" if role == "developer" else role
        if role == "assistant" and m.get("tool_calls"):
            message = {"role": role, "content": "" if m.get("content") is None else _text(m["content"], where),
                       "tool_calls": _tool_calls(m["tool_calls"], where)}
        else:
            message = {"role": role, "content": _text(m.get("content"), where)}
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ValidationError(f"{where}: a tool message needs the tool_call_id it answers", param="messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


async def _read(request: web.Request, model_type: type):
    """(engine, the body, it validated as model_type, the model it names)."""
    engine = request.app[ENGINE]
    body = schemas.parse_json_body(await request.read())
    r = api_models.validate(model_type, body)
    return engine, body, r, _model(engine, body)


async def _submit(engine, prompt_ids, sampling, n, model: str) -> list:
    """n requests of the prompt on `model`: the base model, or a LoRA adapter by its name (a grammar compiled
    first, off the event loop, and copied into each)."""
    compiled = await engine.compile_grammar(sampling.grammar) if sampling.grammar is not None else None
    adapter = model if model != engine.model_name else None
    reqs = []
    try:
        for i in range(n):
            sp = sampling if i == 0 or sampling.seed is None else \
                dataclasses.replace(sampling, seed=(sampling.seed + i) % (1 << 63))
            reqs.append(engine.submit(prompt_ids, sp, adapter=adapter, grammar=compiled))
    except BaseException:
        for req in reqs:
            engine.release(req)
        raise
    return reqs


async def _events(reqs):
    """(choice index, event, more) from every request as they come, until each has its final event; `more`:
    another event is already queued (a decode run or a verify step gives several at once), so a stream can
    write them together."""
    if len(reqs) == 1:                  # the common case: no merging task on the per-token path
        events = reqs[0].events
        while True:
            event = await events.get()
            yield 0, event, not events.empty()
            if event.finish_reason is not None:
                return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, req):
        while True:
            event = await req.events.get()
            await queue.put((i, event))
            if event.finish_reason is not None:
                return
    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        for _ in range(len(reqs)):
            while True:
                i, event = await queue.get()
                yield i, event, not queue.empty()
                if event.finish_reason is not None:
                    break
    finally:
        for t in tasks:
            t.cancel()


def _usage(reqs, score_only: bool = False) -> dict:
    prompt = len(reqs[0].prompt_ids)
    completion = 0 if score_only else sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(event):
    return {"abort": "abort", "error": "error"}.get(event.finish_reason, event.finish_reason)


@dataclasses.dataclass(frozen=True)
class Scoring:
    """What a reply says of its prompt: `echo` (completions: the prompt's text, which the reply starts with, its
    tokens' log-probabilities too when logprobs is set), vLLM's `prompt_logprobs`; `score_only`: max_tokens 0,
    the prompt is only scored (the token the step sampled is dropped)."""
    echo: "str | None" = None
    prompt_logprobs: bool = False
    score_only: bool = False
    reasoning: bool = False             # chat: split <think> reasoning into reasoning_content (server/reasoning.py)
    thinking: bool = False              # ... and the prompt opened the tag: the reply starts inside it
    harmony: bool = False               # chat: a harmony reply (gpt-oss's): channels to reasoning, content and tool
                                        # calls (server/harmony.py), its text with the special tokens kept


async def _respond(request, engine, reqs, *, chat: bool, model: str, stream: bool, include_usage: bool,
                   logprobs: bool, tools: "ToolRequest | None" = None, scoring: Scoring = Scoring()):
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"

    tok = engine.tokenizer

    def chat_logprob(event):
        return {"token": event.text, "logprob": event.logprob, "bytes": list(event.text.encode()),
                "top_logprobs": [{"token": tok.token_text(i), "logprob": lp,
                                  "bytes": list(tok.token_text(i).encode())} for i, lp in event.top or ()]}

    try:
        if not stream:
            texts, lps, finals = [[] for _ in reqs], [[] for _ in reqs], [None] * len(reqs)
            async for i, event, _ in _events(reqs):
                if not scoring.score_only:
                    texts[i].append(event.text)
                    if event.token_id >= 0:
                        lps[i].append(event)
                if event.finish_reason is not None:
                    finals[i] = event
            errors = [f for f in finals if f.finish_reason == "error"]
            if errors:
                return web.json_response(streaming.openai_error_body(errors[0].error or "generation failed",
                                                                     "server_error"), status=500)
            choices = []
            for i, final in enumerate(finals):
                text = "".join(texts[i])
                choice = {"index": i, "finish_reason": _finish_reason(final)}
                if chat:
                    reasoning, calls = None, []
                    if scoring.harmony:
                        reasoning, text, calls = split_harmony(text)
                    elif scoring.reasoning:
                        reasoning, text = split_reasoning(text, scoring.thinking)
                    choice["message"] = {"role": "assistant", "content": text}
                    if reasoning is not None:
                        choice["message"]["reasoning_content"] = reasoning
                    if calls:
                        choice["message"]["tool_calls"] = calls
                        choice["finish_reason"] = "tool_calls" if final.finish_reason == "stop" else \
                            choice["finish_reason"]
                    elif tools is not None and not scoring.harmony:
                        content, calls = parse_calls(text, tools.format)
                        if calls:
                            choice["message"].update(content=content, tool_calls=calls)
                            if final.finish_reason == "stop":
                                choice["finish_reason"] = "tool_calls"
                    choice["logprobs"] = {"content": [chat_logprob(e) for e in lps[i]]} if logprobs else None
                else:
                    choice["text"] = (scoring.echo or "") + text
                    choice["logprobs"] = _completion_logprobs(lps[i], tok, reqs[i] if scoring.echo is not None
                                                              else None) if logprobs else None
                    if scoring.prompt_logprobs:
                        choice["prompt_logprobs"] = streaming.vllm_prompt_logprobs(reqs[i], tok)
                if scoring.score_only:
                    choice["finish_reason"] = "length"
                choices.append(choice)
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
                    "usage": _usage(reqs, scoring.score_only)}
            if chat and scoring.prompt_logprobs:       # (vLLM's place for a chat's)
                body["prompt_logprobs"] = streaming.vllm_prompt_logprobs(reqs[0], tok)
            return web.json_response(body)

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, usage=None):
            payload = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return streaming.sse(payload)
        if chat:
            for i in range(len(reqs)):
                await response.write(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]))
        pending = []                             # chunks of events that came together, written at once
        calls = [CallStream(tools.format) for _ in reqs] if tools is not None and not scoring.harmony else None
        first = [scoring.echo is None and not scoring.prompt_logprobs] * len(reqs)
        thinks = [ReasoningStream(scoring.thinking) for _ in reqs] if scoring.reasoning else None
        harmonies = [HarmonyStream() for _ in reqs] if scoring.harmony else None
        async for i, event, more in _events(reqs):
            if event.finish_reason == "error":
                pending.append(streaming.sse(streaming.openai_error_body(event.error or "generation failed",
                                                                         "server_error")))
                break
            reason = _finish_reason(event) if event.finish_reason else None
            text, found, thought = event.text, [], ""
            if thinks is not None:               # reasoning first, then the answer
                thought, text = thinks[i].push(text)
                if reason is not None:
                    more_thought, rest = thinks[i].flush()
                    thought, text = thought + more_thought, text + rest
            if harmonies is not None:            # gpt-oss: each message by its channel and recipient
                thought, text, found = harmonies[i].push(text)
                if reason is not None:
                    more_thought, rest, more_calls = harmonies[i].flush()
                    thought, text, found = thought + more_thought, text + rest, found + more_calls
                    if harmonies[i].calls and reason == "stop":
                        reason = "tool_calls"
            if calls is not None:                # content until a tool call starts; each call once it closes
                text, found = calls[i].push(text)
                if reason is not None:
                    rest, more_calls = calls[i].flush()
                    text, found = text + rest, found + more_calls
                    if calls[i].calls and reason == "stop":
                        reason = "tool_calls"
            if not first[i]:                     # the prompt was scored by now: its echo and log-probabilities
                first[i] = True
                if scoring.echo is not None:
                    lp = _completion_logprobs([], tok, reqs[i]) if logprobs else None
                    pending.append(chunk([{"index": i, "text": scoring.echo, "logprobs": lp, "finish_reason": None}]))
                if scoring.prompt_logprobs:
                    extra = {"index": i, "prompt_logprobs": streaming.vllm_prompt_logprobs(reqs[i], tok),
                             "finish_reason": None}
                    pending.append(chunk([{**extra, "delta": {}, "logprobs": None} if chat else
                                          {**extra, "text": "", "logprobs": None}]))
            if text or found or thought or reason is not None:  # (else held back: stop strings, a special token, a call)
                lp = None
                if logprobs and event.token_id >= 0:
                    lp = {"content": [chat_logprob(event)]} if chat else _completion_logprobs([event], tok)
                if chat:
                    delta = {"content": text} if text else {}
                    if thought:
                        delta["reasoning_content"] = thought
                    if found:
                        base = len((harmonies or calls)[i].calls) - len(found)
                        delta["tool_calls"] = [{"index": base + k, **call} for k, call in enumerate(found)]
                    choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
                else:
                    choice = {"index": i, "text": event.text, "logprobs": lp, "finish_reason": reason}
                pending.append(chunk([choice]))
            if pending and not more:
                await response.write(b"".join(pending))
                pending.clear()
        else:                                    # every choice ended without an error
            if include_usage:
                pending.append(chunk([], _usage(reqs)))
        pending.append(b"data: [DONE]\n\n")
        await response.write(b"".join(pending))
        await response.write_eof()
        return response
    finally:
        for req in reqs:
            engine.release(req)


def _completion_logprobs(events, tokenizer, echoed=None) -> dict:
    """OpenAI's completions logprobs of the generated tokens (`events`), after the prompt's (`echoed`: its
    request, when the reply echoes the prompt): the first prompt token has none."""
    texts, logprobs, tops = [], [], []
    if echoed is not None:
        for token, score in zip(echoed.prompt_ids, echoed.prompt_scores or [None] * len(echoed.prompt_ids)):
            texts.append(tokenizer.token_text(token))
            logprobs.append(None if score is None else score.logprob)
            tops.append(None if score is None else
                        {tokenizer.token_text(token): score.logprob, **_top_dict(score.top, tokenizer)})
    for e in events:
        texts.append(e.text)
        logprobs.append(e.logprob)
        tops.append(_top_dict(e.top or (), tokenizer))
    offsets, pos = [], 0
    for text in texts:
        offsets.append(pos)
        pos += len(text)
    want_top = any(e.top for e in events) or (echoed is not None and echoed.sampling.top_logprobs)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops if want_top else None,
            "text_offset": offsets}


def _top_dict(top, tokenizer) -> dict:
    """{token text: logprob}, most likely first (two tokens with one text: the likelier)."""
    step: dict = {}
    for i, lp in top:
        step.setdefault(tokenizer.token_text(i), lp)
    return step


async def completions(request: web.Request) -> web.StreamResponse:
    engine, body, r, model = await _read(request, api_models.CompletionRequest)
    logprobs = r.logprobs
    prompt_ids = _prompt_ids(engine, r.prompt)
    sampling, given, n, stream, include_usage = _sampling(r, body, "max_tokens", 16, engine.tokenizer,
                                                          engine.vocab_size)
    sampling.top_logprobs = logprobs or 0
    asked = sampling.prompt_logprobs
    if r.echo and logprobs is not None:     # the echoed prompt's tokens carry their log-probabilities too
        sampling.prompt_logprobs = max(logprobs, sampling.prompt_logprobs or 0)
    _fit(engine, sampling, given, prompt_ids, "max_tokens")
    reqs = await _submit(engine, prompt_ids, sampling, n, model)
    prompt = r.prompt[0] if isinstance(r.prompt, list) and len(r.prompt) == 1 else r.prompt
    scoring = Scoring(echo=(prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt_ids))
                      if r.echo else None, prompt_logprobs=asked is not None, score_only=r.max_tokens == 0)
    return await _respond(request, engine, reqs, chat=False, model=model, stream=stream,
                          include_usage=include_usage, logprobs=logprobs is not None, scoring=scoring)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine, body, r, model = await _read(request, api_models.ChatCompletionRequest)
    if r.top_logprobs and not r.logprobs:
        raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
    messages = _messages(body["messages"])
    tools = ToolRequest.parse(body, engine.chat_template)
    variables = r.chat_template_kwargs
    if r.reasoning_effort is not None:          # (the template's variable; chat_template_kwargs may set it too)
        variables = {"reasoning_effort": r.reasoning_effort, **(variables or {})}
    prompt_ids = _chat_ids(engine, messages, tools, variables)
    key = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    sampling, given, n, stream, include_usage = _sampling(r, body, key, engine.max_model_len, engine.tokenizer,
                                                          engine.vocab_size)
    sampling.top_logprobs = r.top_logprobs
    harmony = engine.chat_template.harmony
    if harmony:                                 # gpt-oss: its channels are special tokens; <|return|>, <|call|> end it
        sampling.skip_special_tokens = False
        ends = [ids[0] for ids in (engine.tokenizer.encode(s, add_bos=False) for s in HARMONY_STOPS) if len(ids) == 1]
        sampling.stop_token_ids = tuple(dict.fromkeys((*sampling.stop_token_ids, *ends)))
    if tools is not None and tools.forced:      # a call is forced by its grammar
        if sampling.grammar is not None:
            raise ValidationError(f"tool_choice {tools.choice!r} forces a tool call; it cannot also follow "
                                  f"{sampling.grammar.field}", param="tool_choice")
        if getattr(r, key) == 0:
            raise ValidationError(f"{key} 0 (scoring the prompt) cannot force a tool call", param=key)
        sampling.grammar = tools.grammar() if not harmony else GrammarSpec(
            "grammar", harmony_call_lark([t["function"] for t in tools.allowed]), "tools")
    _fit(engine, sampling, given, prompt_ids, key)
    reqs = await _submit(engine, prompt_ids, sampling, n, model)
    # where the reply starts: inside the reasoning (the prompt opened <think>), after it (the prompt closed an empty
    # one: Qwen3's enable_thinking false), or before (the model may open it)
    start = reply_start(engine.tokenizer.decode(prompt_ids[-32:], skip_special=False)) \
        if engine.chat_template.reasons else AFTER
    # a grammar constrains the reply from its first token: its output is the answer, unless it spells the reasoning
    # out itself (its text has the closing tag)
    reasons = start != AFTER and (sampling.grammar is None or "</think>" in str(sampling.grammar.value))
    scoring = Scoring(prompt_logprobs=sampling.prompt_logprobs is not None, score_only=getattr(r, key) == 0,
                      reasoning=reasons and not harmony, thinking=reasons and start == INSIDE, harmony=harmony)
    return await _respond(request, engine, reqs, chat=True, model=model, stream=stream,
                          include_usage=include_usage, logprobs=bool(r.logprobs), tools=tools, scoring=scoring)


def _chat_ids(engine, messages: list, tools: "ToolRequest | None", variables: "dict | None") -> list:
    """A chat's prompt ids: through the chat template, with the tools (server/tools.py) and the request's
    `chat_template_kwargs` (`variables`); a history of tool calls and results as text for a template that does not
    take them."""
    try:
        check_variables(variables)
    except ChatTemplateError as exc:
        raise ValidationError(str(exc), param="chat_template_kwargs") from None
    template = engine.chat_template
    rendered = None
    if tools is not None:
        messages, rendered = tools.conversation(messages)
    elif not template.takes_tools and any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = history_as_text(messages)
    try:
        return template.encode(messages, rendered, variables)
    except ChatTemplateError as exc:
        raise ValidationError(str(exc), param="messages") from None


def _fit(engine, sampling, given: bool, prompt_ids: list, field: str) -> None:
    gen = schemas.GenerateRequest(inputs="", sampling=sampling, stream=False, return_full_text=False, details=False,
                                  max_new_tokens_given=given)
    schemas.check_lengths(gen, len(prompt_ids), engine.max_model_len, field=field)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    base = {"id": engine.model_name, "object": "model", "created": int(engine.start_time), "owned_by": "llm-serving",
            "max_model_len": engine.max_model_len}
    adapters = [{**base, "id": name, "parent": engine.model_name, "root": engine.model_name}
                for name in engine.lora_paths]                  # LoRA adapters, as vLLM lists them
    return web.json_response({"object": "list", "data": [base, *adapters]})


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's route: {"lora_name", "lora_path"} -> the adapter is served as model lora_name."""
    engine = request.app[ENGINE]
    r = api_models.validate(api_models.LoadLoraRequest, schemas.parse_json_body(await request.read()))
    loaded = await engine.load_lora(_nonempty(r.lora_name, "lora_name"), _nonempty(r.lora_path, "lora_path"))
    return web.json_response({"object": "lora_adapter", "id": loaded["lora_name"], "parent": engine.model_name,
                              **loaded})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    r = api_models.validate(api_models.UnloadLoraRequest, schemas.parse_json_body(await request.read()))
    name = _nonempty(r.lora_name, "lora_name")
    try:
        await engine.unload_lora(name)
    except KeyError:
        raise schemas.ModelNotFoundError(f"LoRA adapter {name!r} is not served here") from None
    return web.json_response({"object": "lora_adapter", "id": name, "deleted": True})


def _nonempty(value: str, key: str) -> str:
    if not value:
        raise ValidationError(f"'{key}' must be a non-empty string", param=key)
    return value


ROOT_ROUTES = ("/tokenize", "/detokenize")     # vLLM's, outside /v1/, with OpenAI's error shape


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's POST /tokenize: the token ids of a `prompt` (string; `add_special_tokens`, default true, adds the
    BOS) or of chat `messages` (with `tools`, `chat_template_kwargs`) through the model's chat template, as the
    chat route would feed them;
    {count, max_model_len, tokens, token_strs (with `return_token_strs`: each token's piece, else null)}."""
    engine = request.app[ENGINE]
    body = schemas.parse_json_body(await request.read())
    r = api_models.validate(api_models.TokenizeRequest, body)
    if r.model is not None:
        _model(engine, body)
    if (r.prompt is None) == (r.messages is None):
        raise ValidationError("give exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt")
    if r.prompt is not None:
        for field in ("add_generation_prompt", "chat_template_kwargs"):
            if getattr(r, field) is not None:
                raise ValidationError(f"{field} goes with 'messages'", param=field)
        ids = engine.tokenizer.encode(r.prompt, add_bos=r.add_special_tokens is not False)
    else:
        messages = _messages(body["messages"])
        if r.add_special_tokens:
            raise ValidationError("add_special_tokens goes with 'prompt': a chat's special tokens are its "
                                  "template's", param="add_special_tokens")
        if r.add_generation_prompt is False and messages[-1]["role"] != "assistant":
            raise ValidationError("add_generation_prompt false is not supported: the chat template opens the "
                                  "assistant's turn after a last user or system message (and continues a last "
                                  "assistant message)", param="add_generation_prompt")
        ids = _chat_ids(engine, messages, ToolRequest.parse(body, engine.chat_template), r.chat_template_kwargs)
    return web.json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                              "token_strs": [engine.tokenizer.id_to_piece(i) for i in ids] if r.return_token_strs
                              else None})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": their text}, special tokens included."""
    engine = request.app[ENGINE]
    body = schemas.parse_json_body(await request.read())
    r = api_models.validate(api_models.DetokenizeRequest, body)
    if r.model is not None:
        _model(engine, body)
    vocab = engine.tokenizer.vocab_size
    if not all(0 <= t < vocab for t in r.tokens):
        raise ValidationError(f"'tokens' must be a list of token ids in 0..{vocab - 1}", param="tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(r.tokens, skip_special=False)})


async def openapi(request: web.Request) -> web.Response:
    """The OpenAPI document of the HTTP API, built from the request models (server/api_models.py)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        served = version("llm-serving")
    except PackageNotFoundError:
        served = "0"
    return web.json_response(api_models.openapi(served))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
