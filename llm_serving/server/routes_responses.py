"""OpenAI's Responses API (what Codex CLI speaks): `POST /v1/responses`, streamed as typed events or not, and
`GET` / `DELETE /v1/responses/{response_id}` of the responses kept in memory (`ResponseStore`).

A request is a chat (api/responses.py translates its items); its reply is read by server/reply.py into reasoning,
text and function calls, which `OutputBuilder` makes the response's output items — reasoning, a message, a
function_call per call, in the order the reply has them — and the stream events that tell them as they come. The
non-streamed reply goes through the same reading and builder, piece by piece as a stream would, so both give the
same response. Errors have OpenAI's shape (routes_openai owns /v1/)."""
from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from aiohttp import web

from llm_serving.server import streaming
from llm_serving.server.api import base as api
from llm_serving.server.api.responses import ResponsesRequest, qualified
from llm_serving.server.generation import events, submit
from llm_serving.server.image_urls import fetch_images
from llm_serving.server.keys import RESPONSES
from llm_serving.server.served import engine_for
from llm_serving.server.reply import ReplyStream, reply_shape
from llm_serving.server.translate import prepare

MAX_STORED_RESPONSES = 1_000
STORED_RESPONSE_MAX_AGE_S = 24 * 3600


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class Stored:
    """A stored response and the chat it ends: the messages before it (instructions left out) and its output."""
    response: dict
    history: tuple
    created_s: float


class ResponseStore:
    """The responses asked to be stored (store: true), for GET, DELETE and previous_response_id: at most
    `max_count`, each for `max_age_s`; the least recently created goes first. A history shares its messages'
    dicts with the responses it continues, so a long chain costs a reference per message, not a copy."""

    def __init__(self, max_count: int = MAX_STORED_RESPONSES, max_age_s: float = STORED_RESPONSE_MAX_AGE_S,
                 clock=time.monotonic):
        self.max_count, self.max_age_s, self.clock = max_count, max_age_s, clock
        self._entries: OrderedDict = OrderedDict()      # id -> Stored, oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response: dict, history: tuple) -> None:
        self._entries[response["id"]] = Stored(response, history, self.clock())
        while len(self._entries) > self.max_count:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[Stored]:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest = self.clock() - self.max_age_s
        while self._entries and next(iter(self._entries.values())).created_s < oldest:
            self._entries.popitem(last=False)


def response_object(r: ResponsesRequest, response_id: str, created_at: int) -> dict:
    """A response as it starts (in_progress, no output): the request's settings echoed as OpenAI does."""
    fmt = r.text.format if r.text is not None and r.text.format is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}}
    if r.text is not None and r.text.verbosity is not None:
        text["verbosity"] = r.text.verbosity
    return {"id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
            "incomplete_details": None, "error": None, "model": r.model, "output": [], "usage": None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None,
                          "summary": r.reasoning.summary if r.reasoning else None},
            "store": r.store, "temperature": r.temperature, "text": text,
            "tool_choice": r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump(),
            "tools": [t.model_dump() for t in r.tools or ()], "top_p": r.top_p, "truncation": "disabled",
            "user": r.user, "metadata": r.metadata or {}}


class OutputBuilder:
    """A response's output items built from its reply's pieces (`push(reasoning, text, calls)`), each call giving
    the stream events that tell what changed, numbered in order. One item is open at a time: reasoning and a
    message take deltas until something else comes; a function call comes whole (its arguments in one delta).
    A message opens at its first non-blank text: blank text before it waits, and is dropped if a call or the end
    comes first (a newline between the reasoning and a call is no message)."""

    def __init__(self, response: dict, call_name=lambda name: {"name": name}):
        self.response = response
        self.call_name = call_name              # a call's name as its item gives it (ResponsesRequest.call_name)
        self.seq = 0
        self.open: Optional[dict] = None        # the item taking deltas (reasoning or message)
        self.blank = ""                         # blank text waiting for a message to open

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list:
        return [self.event("response.created", response=copy.deepcopy(self.response)),
                self.event("response.in_progress", response=copy.deepcopy(self.response))]

    @property
    def output(self) -> list:
        return self.response["output"]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _add(self, item: dict) -> list:
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1,
                           item=copy.deepcopy(item))]

    def _open(self, kind: str) -> list:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _new_id("rs_"), "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _new_id("msg_"), "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        out = self._add(item)
        item["content"].append(part)
        self.open = item
        return out + [self.event("response.content_part.added", **self._where(item), content_index=0,
                                 part=dict(part))]

    def _delta(self, kind: str, text: str) -> list:
        out = self._close() + self._open(kind) if self.open is None or self.open["type"] != kind else []
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self.event(name, **self._where(self.open), content_index=0, delta=text, **extra)]

    def _close(self, status: str = "completed") -> list:
        item, self.open = self.open, None
        if item is None:
            return []
        part, where = item["content"][0], self._where(item)
        if item["type"] == "reasoning":
            done = [self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])]
        else:
            item["status"] = status
            done = [self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                               logprobs=[])]
        return done + [self.event("response.content_part.done", **where, content_index=0, part=dict(part)),
                       self.event("response.output_item.done", output_index=where["output_index"],
                                  item=copy.deepcopy(item))]

    def push(self, reasoning: str, text: str, calls: list) -> list:
        """The events of the reply's next pieces: reasoning, then text, then whole calls (OpenAI's shape)."""
        out = self._delta("reasoning", reasoning) if reasoning else []
        if text:
            if self.open is None or self.open["type"] != "message":
                self.blank += text
                text, self.blank = (self.blank, "") if self.blank.strip() else ("", self.blank)
            if text:
                out += self._delta("message", text)
        for call in calls:
            self.blank = ""
            out += self._close()
            item = {"type": "function_call", "id": _new_id("fc_"), "call_id": call["id"],
                    **self.call_name(call["function"]["name"]), "arguments": "", "status": "in_progress"}
            out += self._add(item)
            item["arguments"], item["status"] = call["function"]["arguments"], "completed"
            where = self._where(item)
            out += [self.event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=where["output_index"],
                               item=copy.deepcopy(item))]
        return out

    def finish(self, reason: str, usage: dict) -> list:
        """The last events: open items done, the response completed (or incomplete: it ran out of tokens)."""
        incomplete = reason == "length"
        out = self._close("incomplete" if incomplete else "completed")
        self.response.update(status="incomplete" if incomplete else "completed", usage=usage,
                             incomplete_details={"reason": "max_output_tokens"} if incomplete else None)
        if not incomplete:
            self.response["completed_at"] = int(time.time())
        kind = "response.incomplete" if incomplete else "response.completed"
        return out + [self.event(kind, response=copy.deepcopy(self.response))]

    def fail(self, message: str) -> list:
        """The engine failed the request: response.failed, with the output so far."""
        self.response.update(status="failed", error={"code": "server_error", "message": message})
        return [self.event("response.failed", response=copy.deepcopy(self.response))]

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")

    def as_message(self) -> Optional[dict]:
        """The output as the assistant's chat message a continuation is given (reasoning left out)."""
        text = "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": qualified(i.get("namespace"), i["name"]), "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]
        message = {"role": "assistant", "content": text}
        return {**message, "tool_calls": calls} if calls else message


def sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: ".encode() + json.dumps(event, ensure_ascii=False).encode() + b"\n\n"


def _usage(req, engine, reasoning: str) -> dict:
    """OpenAI's usage: cached_tokens the prompt's from the prefix cache, reasoning_tokens the reasoning's text's;
    cache_write_tokens (explicit prompt caching, none here) 0, as the SDK's model wants it."""
    reasoning_tokens = len(engine.tokenizer.encode(reasoning, add_bos=False)) if reasoning else 0
    num_input, num_output = len(req.prompt_ids), len(req.output_ids)
    cached = {"cached_tokens": req.num_cached_tokens, "cache_write_tokens": 0}
    return {"input_tokens": num_input, "input_tokens_details": cached,
            "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": num_input + num_output}


def _error(status: int, message: str, param=None, code=None) -> web.Response:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return web.json_response(streaming.openai_error_body(message, kind, param, code), status=status)


def _failure(event) -> Optional[str]:
    """Why the engine ended the request without a reply, or None."""
    if event.finish_reason == "error":
        return event.error or "generation failed"
    return "the request was aborted" if event.finish_reason == "abort" else None


async def create(request: web.Request) -> web.StreamResponse:
    store = request.app[RESPONSES]
    r = await api.read_body(request, ResponsesRequest)
    engine = await engine_for(request, r.model)
    history: tuple = ()
    if r.previous_response_id is not None:      # OpenAI's answer: 400 naming the field, not 404
        previous = store.get(r.previous_response_id)
        if previous is None:
            return _error(400, f"Previous response with id '{r.previous_response_id}' not found.",
                          "previous_response_id", "previous_response_not_found")
        history = previous.history
    req = r.to_request(engine.max_model_len, history)
    await fetch_images(req, engine.config)
    prepared = prepare(req, engine)
    shape = reply_shape(engine, prepared)
    [req] = await submit(engine, prepared, 1)
    builder = OutputBuilder(response_object(r, _new_id("resp_"), int(time.time())), r.call_name)

    def finish(reason: str) -> list:
        out = builder.finish(reason, _usage(req, engine, builder.reasoning_text()))
        if r.store:       # before the last event: a client may continue from it as soon as it reads it
            store.put(builder.response, (*history, *r.input_messages(), builder.as_message()))
        return out
    try:
        if not r.stream:          # built as the stream is (its events left unsent): the same items, in its order
            reply, final = ReplyStream(shape), None
            async for _, event, _ in events([req]):
                builder.push(*reply.push(event.text))
                final = event
            failure = _failure(final)
            if failure is not None:
                return _error(500, failure)
            builder.push(*reply.flush())
            finish(final.finish_reason)
            return web.json_response(builder.response)

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        pending = builder.start()
        reply = ReplyStream(shape)
        async for _, event, more in events([req]):
            failure = _failure(event)
            if failure is not None:
                pending += builder.fail(failure)
                break
            pending += builder.push(*reply.push(event.text))
            if event.finish_reason is not None:
                pending += builder.push(*reply.flush()) + finish(event.finish_reason)
            if not more:
                await response.write(b"".join(sse(e) for e in pending))
                pending = []
        if pending:
            await response.write(b"".join(sse(e) for e in pending))
        await response.write_eof()
        return response
    finally:
        engine.release(req)


async def retrieve(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSES].get(response_id)
    if stored is None:
        return _error(404, f"Response with id '{response_id}' not found.")
    return web.json_response(stored.response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSES].delete(response_id):
        return _error(404, f"Response with id '{response_id}' not found.")
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    app[RESPONSES] = ResponseStore()
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
