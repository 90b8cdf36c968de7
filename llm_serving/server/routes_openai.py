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

import dataclasses
import time
import uuid

from aiohttp import web

from llm_serving.server import streaming
from llm_serving.server.api import base as api
from llm_serving.server.api import openai as openai_api
from llm_serving.server.errors import ModelNotFoundError, ValidationError
from llm_serving.server.served import engine_for, fleet_of
from llm_serving.server.reply import ReplyShape, ReplyStream, read_reply, reply_shape
from llm_serving.server.tools import ToolRequest
from llm_serving.server.generation import events, submit
from llm_serving.server.image_urls import fetch_images
from llm_serving.server.translate import adapter_of, chat_ids, prepare


async def _read(request: web.Request, model_type: type):
    """(engine, the body validated as model_type)."""
    r = await api.read_body(request, model_type)
    return await engine_for(request, getattr(r, "model", None)), r


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
    shape: ReplyShape = ReplyShape()    # chat: how the reply is read into reasoning, content and tool calls


@dataclasses.dataclass(frozen=True)
class _Reply:
    """What every part of one reply shares: its id and time, the API (chat or completions), what was asked of it."""
    reqs: list
    tokenizer: object
    rid: str
    created: int
    model: str
    chat: bool
    include_usage: bool
    logprobs: bool
    scoring: Scoring

    def chunk(self, choices, usage=None) -> bytes:
        """One server-sent event of a streamed reply."""
        payload = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                   "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage
        return streaming.sse(payload)


async def _respond(request, engine, reqs, *, chat: bool, model: str, stream: bool, include_usage: bool,
                   logprobs: bool, scoring: Scoring = Scoring()):
    """The reply to `reqs` (the request's `n` choices), whole or streamed; every request released at its end."""
    reply = _Reply(reqs, engine.tokenizer, ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                   int(time.time()), model, chat, include_usage, logprobs, scoring)
    try:
        return await (_stream(request, reply) if stream else _whole(reply))
    finally:
        for req in reqs:
            engine.release(req)


def _chat_logprob(event, tok) -> dict:
    """A chat reply's log-probability entry for one generated token (and its top alternatives)."""
    return {"token": event.text, "logprob": event.logprob, "bytes": list(event.text.encode()),
            "top_logprobs": [{"token": tok.token_text(i), "logprob": lp,
                              "bytes": list(tok.token_text(i).encode())} for i, lp in event.top or ()]}


async def _whole(reply: _Reply) -> web.Response:
    """A reply not streamed: every choice's events gathered, then one JSON body (a 500 if any choice failed)."""
    reqs, scoring = reply.reqs, reply.scoring
    texts, lps, finals = [[] for _ in reqs], [[] for _ in reqs], [None] * len(reqs)
    async for i, event, _ in events(reqs):
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
    choices = [_whole_choice(reply, i, final, "".join(texts[i]), lps[i]) for i, final in enumerate(finals)]
    body = {"id": reply.rid, "object": "chat.completion" if reply.chat else "text_completion",
            "created": reply.created, "model": reply.model, "choices": choices,
            "usage": _usage(reqs, scoring.score_only)}
    if reply.chat and scoring.prompt_logprobs:       # (vLLM's place for a chat's)
        body["prompt_logprobs"] = streaming.vllm_prompt_logprobs(reqs[0], reply.tokenizer)
    return web.json_response(body)


def _whole_choice(reply: _Reply, i: int, final, text: str, lps: list) -> dict:
    """Choice i of a whole reply: its text (chat: read into reasoning, content and tool calls), log-probabilities
    and finish reason."""
    scoring, tok = reply.scoring, reply.tokenizer
    choice = {"index": i, "finish_reason": _finish_reason(final)}
    if final.error:                  # why it ended there (a grammar that could not go on)
        choice["finish_message"] = final.error
    if reply.chat:
        reasoning, content, calls = read_reply(text, scoring.shape)
        choice["message"] = {"role": "assistant", "content": content}
        if reasoning is not None:
            choice["message"]["reasoning_content"] = reasoning
        if calls:
            choice["message"]["tool_calls"] = calls
            if final.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        choice["logprobs"] = {"content": [_chat_logprob(e, tok) for e in lps]} if reply.logprobs else None
    else:
        choice["text"] = (scoring.echo or "") + text
        choice["logprobs"] = _completion_logprobs(lps, tok, reply.reqs[i] if scoring.echo is not None
                                                  else None) if reply.logprobs else None
        if scoring.prompt_logprobs:
            choice["prompt_logprobs"] = streaming.vllm_prompt_logprobs(reply.reqs[i], tok)
    if scoring.score_only:
        choice["finish_reason"] = "length"
    return choice


async def _stream(request: web.Request, reply: _Reply) -> web.StreamResponse:
    """A streamed reply: server-sent events as the choices' tokens come (those that came together written at
    once), an error event if a choice fails, the usage if asked for, then [DONE]."""
    reqs, scoring = reply.reqs, reply.scoring
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    if reply.chat:
        for i in range(len(reqs)):
            await response.write(reply.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]))
    pending = []                             # chunks of events that came together, written at once
    replies = [ReplyStream(scoring.shape) for _ in reqs] if reply.chat else None
    first = [scoring.echo is None and not scoring.prompt_logprobs] * len(reqs)
    async for i, event, more in events(reqs):
        if event.finish_reason == "error":
            pending.append(streaming.sse(streaming.openai_error_body(event.error or "generation failed",
                                                                     "server_error")))
            break
        if not first[i]:                     # the prompt was scored by now: its echo and log-probabilities
            first[i] = True
            pending += _prompt_chunks(reply, i)
        choice = _stream_choice(reply, i, event, replies)
        if choice is not None:
            pending.append(reply.chunk([choice]))
        if pending and not more:
            await response.write(b"".join(pending))
            pending.clear()
    else:                                    # every choice ended without an error
        if reply.include_usage:
            pending.append(reply.chunk([], _usage(reqs)))
    pending.append(b"data: [DONE]\n\n")
    await response.write(b"".join(pending))
    await response.write_eof()
    return response


def _prompt_chunks(reply: _Reply, i: int) -> list:
    """Choice i's chunks about its prompt, once it is scored: its echo (completions) and vLLM's prompt_logprobs."""
    scoring, tok, chunks = reply.scoring, reply.tokenizer, []
    if scoring.echo is not None:
        lp = _completion_logprobs([], tok, reply.reqs[i]) if reply.logprobs else None
        chunks.append(reply.chunk([{"index": i, "text": scoring.echo, "logprobs": lp, "finish_reason": None}]))
    if scoring.prompt_logprobs:
        extra = {"index": i, "prompt_logprobs": streaming.vllm_prompt_logprobs(reply.reqs[i], tok),
                 "finish_reason": None}
        chunks.append(reply.chunk([{**extra, "delta": {}, "logprobs": None} if reply.chat else
                                   {**extra, "text": "", "logprobs": None}]))
    return chunks


def _stream_choice(reply: _Reply, i: int, event, replies) -> "dict | None":
    """The streamed choice one event of choice i makes, or None while its text is held back (stop strings, a
    special token, a tool call not yet whole). Chat: reasoning, content and each tool call once it is whole."""
    reason = _finish_reason(event) if event.finish_reason else None
    text, found, thought = event.text, [], ""
    if replies is not None:
        thought, text, found = replies[i].push(text)
        if reason is not None:
            more_thought, rest, more_calls = replies[i].flush()
            thought, text, found = thought + more_thought, text + rest, found + more_calls
            reason = replies[i].finish_reason(reason)
    if not (text or found or thought or reason is not None):
        return None
    lp = None
    if reply.logprobs and event.token_id >= 0:
        lp = {"content": [_chat_logprob(event, reply.tokenizer)]} if reply.chat else \
            _completion_logprobs([event], reply.tokenizer)
    if reply.chat:
        delta = {"content": text} if text else {}
        if thought:
            delta["reasoning_content"] = thought
        if found:
            base = len(replies[i].calls) - len(found)
            delta["tool_calls"] = [{"index": base + k, **call} for k, call in enumerate(found)]
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
    else:
        choice = {"index": i, "text": event.text, "logprobs": lp, "finish_reason": reason}
    if reason is not None and event.error:
        choice["finish_message"] = event.error
    return choice


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
    engine, r = await _read(request, openai_api.CompletionRequest)
    prepared = prepare(r.to_request(), engine)
    reqs = await submit(engine, prepared, r.n)
    scoring = Scoring(echo=(r.prompt if isinstance(r.prompt, str) else engine.tokenizer.decode(prepared.prompt_ids))
                      if r.echo else None, prompt_logprobs=r.prompt_logprobs is not None, score_only=r.score_only)
    return await _respond(request, engine, reqs, chat=False, model=r.model, stream=r.stream,
                          include_usage=r.include_usage, logprobs=r.logprobs is not None, scoring=scoring)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine, r = await _read(request, openai_api.ChatCompletionRequest)
    req = r.to_request(engine.max_model_len)
    await fetch_images(req, engine.config)
    prepared = prepare(req, engine)
    reqs = await submit(engine, prepared, r.n)
    scoring = Scoring(prompt_logprobs=r.prompt_logprobs is not None, score_only=r.score_only,
                      shape=reply_shape(engine, prepared))
    return await _respond(request, engine, reqs, chat=True, model=r.model, stream=r.stream,
                          include_usage=r.include_usage, logprobs=bool(r.logprobs), scoring=scoring)


async def models(request: web.Request) -> web.Response:
    """Every model the server serves, with its state (loaded, loading, unloaded, failed: its error too), and a loaded
    one's LoRA adapters (as vLLM lists them); a loaded model says its context and what it serves besides generation:
    its `embedding` (pooling, dimensions; null when this server cannot embed), how rerank and score score
    (`score_method`: yes_no or similarity) and what its prompts may hold (`input_modalities`: text, and image for a
    vision-language model whose tower is served). An adapter serves neither embeddings nor scores (both null)."""
    fleet = fleet_of(request)
    data = []
    for name, entry in fleet.entries.items():
        if entry.state == "loaded":
            model, *adapters = _loaded_model(entry.engine, entry.state)
            data += [{**model, "size_bytes": entry.size_bytes}, *adapters]
        else:
            data.append({"id": name, "object": "model", "created": None, "owned_by": "llm-serving",
                         "state": entry.state, **({"error": entry.error} if entry.error else {})})
    return web.json_response({"object": "list", "data": data})


def _loaded_model(engine, state: str) -> list:
    base = {"id": engine.model_name, "object": "model", "created": int(engine.start_time), "owned_by": "llm-serving",
            "max_model_len": engine.max_model_len, "state": state}
    spec = engine.embedding
    base["input_modalities"] = ["text", "image"] if getattr(engine, "image_facts", None) is not None else ["text"]
    served = {"embedding": None if spec is None else {"pooling": spec.pooling, "dimensions": spec.dimensions},
              "score_method": engine.score_method}
    adapters = [{**base, "id": name, "parent": engine.model_name, "root": engine.model_name, "embedding": None,
                 "score_method": None} for name in engine.lora_paths]
    return [{**base, **served}, *adapters]


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's route: {"lora_name", "lora_path"} -> the adapter is served as model lora_name."""
    engine, r = await _read(request, openai_api.LoadLoraRequest)
    loaded = await engine.load_lora(r.lora_name, r.lora_path)
    return web.json_response({"object": "lora_adapter", "id": loaded["lora_name"], "parent": engine.model_name,
                              **loaded})


async def unload_lora_adapter(request: web.Request) -> web.Response:
    engine, r = await _read(request, openai_api.UnloadLoraRequest)
    try:
        await engine.unload_lora(r.lora_name)
    except KeyError:
        raise ModelNotFoundError(f"LoRA adapter {r.lora_name!r} is not served here") from None
    return web.json_response({"object": "lora_adapter", "id": r.lora_name, "deleted": True})


ROOT_ROUTES = ("/tokenize", "/detokenize")     # vLLM's, outside /v1/, with OpenAI's error shape
# OpenAI's error `type` for a status (its clients read error.type and error.code)
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable"}


def owns(path: str) -> bool:
    """OpenAI's error shape: every path under /v1/ (and vLLM's /tokenize, /detokenize)."""
    return path.startswith("/v1/") or path in ROOT_ROUTES


def error_body(status: int, message: str, kind: str, param=None) -> dict:
    return streaming.openai_error_body(message, OPENAI_TYPES.get(status, "invalid_request_error"), param,
                                       "model_not_found" if kind == "not_found" else None)


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's POST /tokenize: the token ids of a `prompt` (string; `add_special_tokens`, default true, adds the
    BOS) or of chat `messages` (with `tools`, `chat_template_kwargs`) through the model's chat template, as the
    chat route would feed them;
    {count, max_model_len, tokens, token_strs (with `return_token_strs`: each token's piece, else null)}."""
    engine, r = await _read(request, openai_api.TokenizeRequest)
    adapter_of(engine, r.model)
    if r.prompt is not None:
        ids = engine.tokenizer.encode(r.prompt, add_bos=r.add_special_tokens is not False)
    else:
        tools = ToolRequest.of(r.tool_dicts(), r.choice, True, engine.chat_template)
        ids = chat_ids(engine, [m.as_dict() for m in r.messages], tools, r.chat_template_kwargs)
    return web.json_response({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                              "token_strs": [engine.tokenizer.id_to_piece(i) for i in ids] if r.return_token_strs
                              else None})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": their text}, special tokens included."""
    engine, r = await _read(request, openai_api.DetokenizeRequest)
    adapter_of(engine, r.model)
    vocab = engine.tokenizer.vocab_size
    if not all(0 <= t < vocab for t in r.tokens):
        raise ValidationError(f"'tokens' must be a list of token ids in 0..{vocab - 1}", param="tokens")
    return web.json_response({"prompt": engine.tokenizer.decode(r.tokens, skip_special=False)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
