"""A staged start (serving_config.warmup: staged, models/warmup.py) on a real server: on a compile cache a full
warmup filled, the agent is ready once a first request's graphs are read and warms the rest while it serves."""
import asyncio
import time

import aiohttp
import pytest

from tests.conftest import STORIES
from tests.integration.server_harness import private_cache, serving

ARGS = ["--model", str(STORIES / "hf"), "--set", "model_config.decode_batch_size=[1,4,8]",
        "--set", "serving_config.max_num_seqs=8"]
PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, a cat"]


async def _texts(url: str) -> list:
    """The four prompts at once (decode steps of 4 rows), greedy: their texts."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(prompt):
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 24}}
            async with session.post(f"{url}/models/hf/generate", json=body) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["generated_text"]
        return await asyncio.gather(*(one(p) for p in PROMPTS))


def _wait_for_the_rest(server) -> str:
    deadline = time.monotonic() + 60
    while "warmup complete" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    return server.log()


def test_a_staged_start_serves_at_once_and_warms_the_rest_between_steps(tmp_path):
    """The first start on an empty cache is ready after the first request's entries too; its four streams at once
    need a graph no entry run so far called, so the rest of the plan runs first (in order), and the plan is recorded.
    The second start reads the record: ready after the first request's entries, it answers the four streams (graphs
    of later entries read just before their step) with the first start's text, and reads the rest of the plan
    without a request asking."""
    pytest.importorskip("mindspore")
    env = {"LLM_SERVING_CACHE": str(private_cache(tmp_path / "cache"))}
    with serving(ARGS, tmp_path / "cold.log", env=env) as server:
        ready_part = server.log().partition(" ready on ")[0]
        assert "for a first request; the rest when idle" in ready_part, ready_part[-2000:]
        expected = asyncio.run(_texts(server.url))
        assert "warmup complete" in _wait_for_the_rest(server)
    [cache] = (tmp_path / "cache" / "ms_compile").iterdir()
    assert (cache / "plan.json").exists()

    with serving(ARGS, tmp_path / "staged.log", env=env) as server:
        log = server.log()
        ready_part = log.partition(" ready on ")[0]
        assert "for a first request; the rest when idle" in ready_part, ready_part[-2000:]
        total = int(ready_part.split("warmup 1/")[1].split(":")[0])
        assert ready_part.count(" ready in ") < total        # fewer entries than the plan's before ready
        assert asyncio.run(_texts(server.url)) == expected
        log = _wait_for_the_rest(server)
        assert "warmup complete" in log and f"warmup {total}/{total}:" in log
        assert asyncio.run(_texts(server.url)) == expected
