"""Each request's stream of events: the text side of a step's outcome. The OutputProcessor has appended a step's
tokens to a request and applied the token-level stops; here each token is detokenized, the request's stop strings
are checked, and its event goes on the request's queue. The last event of a stream carries the finish reason, the
error if any, and the text held back until then (an incomplete character, a possible stop string's start).

The Engine opens a stream when it admits a request that generates, hands each step's results here, and closes
the stream of a request it ends for its own reasons (abort, a failed step, a lost agent)."""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Optional

from llm_serving.master.output_processor import OutputProcessor, RequestOutput
from llm_serving.master.request import Request, TokenEvent
from llm_serving.master.scheduler import Scheduler


class RequestStreams:
    """`on_closed(req)`: called as each stream closes, before its last event is queued (the engine forgets the
    request there); `profile`: the engine's seconds per phase, to which detokenizing adds its own."""

    def __init__(self, tokenizer, scheduler: Scheduler, outputs: OutputProcessor, profile: Counter,
                 on_closed: Callable[[Request], None]):
        self.tokenizer, self.scheduler, self.outputs, self.profile = tokenizer, scheduler, outputs, profile
        self.on_closed = on_closed
        self._detok: dict = {}
        self.num_finished: Counter = Counter()    # finish_reason -> requests
        self.finish_listeners: list = []          # callables(request), called as each request ends (metrics)

    def open(self, req: Request) -> None:
        """A generating request's detokenizer, which starts after its prompt."""
        self._detok[req.req_id] = self.tokenizer.detokenizer(req.prompt_ids,
                                                             skip_special=req.sampling.skip_special_tokens)

    def stream(self, result: RequestOutput) -> None:
        """A request's tokens from a step: detokenize each, check the stop strings, put it on the request's event
        queue; the last one closes the stream when the step ended the request (with the result's `error`, which
        also says why a grammar cut it short), or a stop string ends it there. A request the step ended with an
        error streams none of the step's tokens."""
        req = result.request
        if result.finish_reason == "error":
            self.close(req, "error", error=result.error)
            return
        n = len(result.token_ids)
        if not n:                   # (an embedding's end, or a step that ended the request before any token)
            if result.finish_reason is not None:
                self.close(req, result.finish_reason, error=result.error)
            return
        t0 = time.perf_counter()
        try:
            detok = self._detok[req.req_id]
            for k, (token_id, logprob) in enumerate(zip(result.token_ids, result.logprobs)):
                hidden = token_id in req.stop_token_ids          # a stop token ends the text, never shows in it
                special = hidden or self.tokenizer.is_special(token_id)
                text = "" if hidden else detok.push(token_id)
                stopped = False
                if req.stop_strings is not None:
                    text = req.stop_strings.push(text)
                    stopped = req.stop_strings.stopped
                event = TokenEvent(token_id, text, logprob, special,
                                   top=result.tops[k] if result.tops is not None else None)
                if stopped:              # the output ends at this token: the step's later ones are dropped
                    self.outputs.drop_last(req, n - 1 - k)
                    if result.finish_reason is None:
                        self.scheduler.finish(req, "stop")
                    req.finish_reason = "stop"
                    self.close(req, "stop", last=event)
                    return
                if k == n - 1 and result.finish_reason is not None:
                    self.close(req, result.finish_reason, error=result.error, last=event)
                    return
                req.events.put_nowait(event)
        finally:
            self.profile["detokenize"] += time.perf_counter() - t0

    def close(self, req: Request, reason: str, error: Optional[str] = None,
              last: Optional[TokenEvent] = None) -> None:
        """The stream of a request the scheduler has finished: its final event, the last token (if any) carrying
        the finish reason and the text held back."""
        self.on_closed(req)
        detok = self._detok.pop(req.req_id, None)
        tail = detok.flush() if detok is not None else ""
        if req.stop_strings is not None:          # release what was held back (never a stop string)
            tail = req.stop_strings.push(tail) + req.stop_strings.flush()
        event = last or TokenEvent(-1, "", 0.0, True)
        event.text += tail
        event.finish_reason, event.error = reason, error
        req.events.put_nowait(event)
        req.finish_time = time.monotonic()
        self.num_finished[reason] += 1
        for listener in self.finish_listeners:
            listener(req)
