"""Anthropic's Messages API: `POST /v1/messages` (a reply as content blocks — thinking, text, tool_use — whole, or
streamed as Anthropic's server-sent events) and `POST /v1/messages/count_tokens`, with Anthropic's error shape on
every path under /v1/messages. The request's shape and its translation are api/anthropic.py's; the reply is read into
reasoning, text and tool calls by reply.py, as every chat API's is, and only written here."""
from __future__ import annotations

import json
import uuid

from aiohttp import web

from llm_serving.server.api import base as api
from llm_serving.server.api.anthropic import CountTokensRequest, MessagesRequest
from llm_serving.server.generation import events, submit
from llm_serving.server.image_urls import fetch_images
from llm_serving.server.served import engine_for
from llm_serving.server.reply import ReplyStream, read_reply, reply_shape
from llm_serving.server.tools import ToolRequest
from llm_serving.server.translate import adapter_of, chat_ids, prepare

# Anthropic's error type for a status app.py chose (its clients pick an exception by the status and retry 429 and 5xx):
# a full queue is 429, a server without agents or shutting down 503, both passed as "try again later"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def owns(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(status: int, message: str, kind: str, param=None) -> dict:
    """Anthropic's error shape, which has no `param`: a message without its field's path gets the field before it."""
    if param and param not in message:
        message = f"{param}: {message}"
    return _error(ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"), message)


def _error(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _failed(event) -> dict:
    """The error of a request the engine ended without a reply: its agent failed, or it was aborted."""
    what = "the request was aborted" if event.finish_reason == "abort" else "generation failed"
    return _error("api_error", f"{what}: {event.error}" if event.error else what)


def _sse(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def tool_use(call: dict) -> dict:
    """A tool call (OpenAI's shape, its arguments JSON text) as a tool_use block; arguments that are not an object
    (a model calling freely may write any JSON) are given as {}."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        arguments = None
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


def content_blocks(reasoning, content, calls) -> list:
    """A whole reply's content blocks: its reasoning, its text (neither when blank), its tool calls."""
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning and reasoning.strip() else []
    if content and content.strip():
        blocks.append({"type": "text", "text": content})
    return blocks + [tool_use(c) for c in calls]


def stop_reason(req, finish_reason: str, called: bool) -> tuple:
    """(stop_reason, stop_sequence) of a finished request: a stop string is told from EOS, and named, by the
    engine's StopStrings of the request (master/stop.py)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if req.stop_strings is None or req.stop_strings.matched is None:
        return "end_turn", None
    return "stop_sequence", req.stop_strings.matched


def _usage(req) -> dict:
    return {"input_tokens": len(req.prompt_ids), "output_tokens": len(req.output_ids)}


def _message(msg_id: str, model: str, content: list, stop: tuple, usage: dict) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}


class BlockStream:
    """A streamed reply's content blocks as Anthropic's events. A thinking or text block opens on its first text that
    is not blank (as a whole reply leaves blank ones out) and closes when another block starts; a tool call is one
    block, its whole input in one input_json_delta."""

    def __init__(self):
        self.index = -1
        self.open = None                           # the open block's type
        self.held = {"thinking": "", "text": ""}   # blank text of a block not open yet

    def push(self, thought: str, text: str, calls: list) -> list:
        out = self._piece("thinking", thought) + self._piece("text", text)
        for call in calls:
            block = tool_use(call)
            out += self._start({**block, "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"],
                                                                                         ensure_ascii=False)}))
            out += self.close()
        return out

    def close(self) -> list:
        if self.open is None:
            return []
        self.open = None
        return [_sse({"type": "content_block_stop", "index": self.index})]

    def _piece(self, kind: str, text: str) -> list:
        out = []
        if text and self.open != kind:
            self.held[kind] += text
            if not self.held[kind].strip():
                return []
            text, self.held[kind] = self.held[kind], ""
            out = self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                              else {"type": "text", "text": ""})
        return out + [self._delta({"type": f"{kind}_delta", kind: text})] if text else out

    def _start(self, block: dict) -> list:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [_sse({"type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> bytes:
        return _sse({"type": "content_block_delta", "index": self.index, "delta": delta})


async def messages(request: web.Request) -> web.StreamResponse:
    r = await api.read_body(request, MessagesRequest)
    engine = await engine_for(request, r.model)
    req = r.to_request()
    await fetch_images(req, engine.config)
    prepared = prepare(req, engine)
    shape = reply_shape(engine, prepared)
    (req,) = await submit(engine, prepared, 1)
    msg_id = "msg_" + uuid.uuid4().hex[:24]
    try:
        if r.stream:
            return await _stream(request, engine, req, shape, _message(msg_id, r.model, [], (None, None), {
                "input_tokens": len(req.prompt_ids), "output_tokens": 0}))
        texts = []
        async for _, event, _ in events([req]):
            texts.append(event.text)
        if event.finish_reason in ("error", "abort"):
            return web.json_response(_failed(event), status=500)
        reasoning, content, calls = read_reply("".join(texts), shape)
        stop = stop_reason(req, event.finish_reason, bool(calls))
        return web.json_response(_message(msg_id, r.model, content_blocks(reasoning, content, calls), stop,
                                          _usage(req)))
    finally:
        engine.release(req)


async def _stream(request, engine, req, shape, start: dict) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    pending = [_sse({"type": "message_start", "message": start})]     # events that came together, written at once
    reply, blocks = ReplyStream(shape), BlockStream()
    async for _, event, more in events([req]):
        if event.finish_reason in ("error", "abort"):
            pending.append(_sse(_failed(event)))
            break
        thought, text, calls = reply.push(event.text)
        if event.finish_reason is not None:
            more_thought, rest, more_calls = reply.flush()
            thought, text, calls = thought + more_thought, text + rest, calls + more_calls
        pending += blocks.push(thought, text, calls)
        if event.finish_reason is not None:
            stop = stop_reason(req, event.finish_reason, bool(reply.calls))
            pending += blocks.close()
            pending.append(_sse({"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                 "usage": {"output_tokens": len(req.output_ids)}}))
            pending.append(_sse({"type": "message_stop"}))
        if pending and not more:
            await response.write(b"".join(pending))
            pending.clear()
    if pending:
        await response.write(b"".join(pending))
    await response.write_eof()
    return response


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as /v1/messages would feed it: the chat template with the system prompt and tools."""
    r = await api.read_body(request, CountTokensRequest)
    engine = await engine_for(request, r.model)
    adapter_of(engine, r.model)
    tools = ToolRequest.of(r.tool_dicts(), r.choice, r.parallel, engine.chat_template)
    return web.json_response({"input_tokens": len(chat_ids(engine, r.chat_messages(), tools, r.variables()))})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
