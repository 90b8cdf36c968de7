"""Streams write the events that came together (a decode run, a verify step) at once: generation.events says
when another event is already queued. No MindSpore, no server."""
import asyncio
from types import SimpleNamespace

from llm_serving.master.request import TokenEvent
from llm_serving.server.generation import events as _events


def _request(*events):
    queue = asyncio.Queue()
    for e in events:
        queue.put_nowait(e)
    return SimpleNamespace(events=queue)


def _event(text, final=False):
    return TokenEvent(1, text, -0.1, False, finish_reason="length" if final else None)


async def _collect(reqs, later=()):
    """_events over reqs; `later` (request index, event) pairs arrive after the first event was taken."""
    out = []
    async for i, event, more in _events(reqs):
        out.append((i, event.text, more))
        for j, e in later:
            reqs[j].events.put_nowait(e)
        later = ()
    return out


def test_one_request_says_when_more_events_are_queued():
    req = _request(_event("a"), _event("b"), _event("c"))
    out = asyncio.run(_collect([req], later=[(0, _event("d", final=True))]))
    # a, b, c came together (a run of three); d came later, alone, and is the last
    assert out == [(0, "a", True), (0, "b", True), (0, "c", True), (0, "d", False)]


def test_several_choices_merge_and_say_when_more_are_queued():
    async def run():
        reqs = [_request(_event("x"), _event("y", final=True)), _request()]
        out = []
        async for i, event, more in _events(reqs):
            out.append((i, event.text))
            if len(out) == 1:
                reqs[1].events.put_nowait(_event("z", final=True))
        return out
    out = asyncio.run(run())
    assert sorted(out) == [(0, "x"), (0, "y"), (1, "z")]
