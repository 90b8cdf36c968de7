"""A prepared request run on the engine: `submit` queues it n times (its grammar compiled once, off the event loop;
the access log counts them: server/access_log.py), `events` reads their token events as they come. Every API's routes
run their requests through these and release them when their reply is done (Engine.release: a client that went away
frees its blocks)."""
from __future__ import annotations

import asyncio
import dataclasses

from llm_serving.server import access_log
from llm_serving.server.translate import Prepared


async def submit(engine, prepared: Prepared, n: int) -> list:
    """n requests of the prepared prompt (its grammar compiled first, off the event loop, and copied into each;
    with a seed, choice i uses seed + i)."""
    sampling = prepared.sampling
    compiled = await engine.compile_grammar(sampling.grammar) if sampling.grammar is not None else None
    reqs = []
    try:
        for i in range(n):
            sp = sampling if i == 0 or sampling.seed is None else \
                dataclasses.replace(sampling, seed=(sampling.seed + i) % (1 << 63))
            reqs.append(engine.submit(prepared.prompt_ids, sp, adapter=prepared.adapter, grammar=compiled,
                                      images=prepared.images))
    except BaseException:
        for req in reqs:
            engine.release(req)
        raise
    access_log.track(reqs)
    return reqs


async def events(reqs):
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
