"""The scheduler under real load, through the real server: preemption, prefix caching, chunked prefill and
policies must not change greedy output; overload is refused with 429; abort frees a request's blocks."""
import asyncio
import json
import time

import aiohttp
import pytest

from tests.integration.server_harness import REPO, ServerProcess, http, leftovers, parse_sse, precision_gate
from tests.conftest import STORIES
from tests.integration.test_serving import STORY_PROMPTS

STORY_CONFIG = str(REPO / "configs" / "stories260K.yaml")
NEW_TOKENS = 24
# a shared opening of ~40 tokens (more than two 16-token KV blocks) followed by different endings
OPENING = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
           "with her friends and her dog.")


def workload() -> list:
    """100 prompts: 60 short story starts and 40 that share a long opening."""
    endings = ["One day", "Then she", "But the dog", "Her mom said", "The sun", "A bird", "They all",
               "Lily saw", "It was", "So they"]
    prompts = [p + s for s in ("", " and", ",") for p in STORY_PROMPTS][:60]
    prompts += [f"{OPENING} {e}{s}" for s in ("", " and", " then", ",") for e in endings]
    return prompts


async def _generate_all(url, prompts, *, stream=False, max_new_tokens=NEW_TOKENS):
    async def one(session, prompt):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
                "stream": stream}
        async with session.post(f"{url}/models/hf/generate", json=body) as resp:
            text = await resp.text()
            return resp.status, (parse_sse(text) if stream and resp.status == 200 else json.loads(text))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one(session, p) for p in prompts))


def serve(tmp_path, name, *overrides):
    args = ["--config", STORY_CONFIG, "--model", str(STORIES / "hf")]
    for o in overrides:
        args += ["--set", o]
    return ServerProcess(args, tmp_path / f"{name}.log")


@pytest.fixture(scope="module")
def reference_texts(stories_server):
    """The workload's greedy texts from the default server (plenty of KV, whole prompts, prefix caching)."""
    results = asyncio.run(_generate_all(stories_server.url, workload()))
    assert all(status == 200 for status, _ in results), results[:3]
    stats = http("GET", stories_server.url + "/stats")[1]
    assert stats["prefix_cache_hit_rate"] > 0.05, stats        # the shared opening was found in the cache
    return [body["generated_text"] for _, body in results]


def run_and_compare(server, reference, *, stream=False):
    results = asyncio.run(_generate_all(server.url, workload(), stream=stream))
    texts = []
    for status, body in results:
        assert status == 200, body
        if stream:
            assert len(body) == NEW_TOKENS and body[-1]["details"]["finish_reason"] == "length"
            texts.append(body[-1]["generated_text"])
        else:
            assert body["details"]["generated_tokens"] == NEW_TOKENS
            texts.append(body["generated_text"])
    mismatched = [i for i, (a, b) in enumerate(zip(texts, reference)) if a != b]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. #{mismatched[0]}"
    stats = http("GET", server.url + "/stats")[1]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]          # every block came back
    return stats


def test_preemption_under_a_tiny_kv_cache_keeps_every_request_and_its_output(reference_texts, tmp_path):
    # 24 blocks of 8 tokens: one request needs up to 10 blocks, 32 would need ~250 -> constant preemption
    with serve(tmp_path, "tiny-kv", "pa_config.num_blocks=24", "pa_config.block_size=8",
               "model_config.max_generate_length=128",
               "scheduler_config.enable_prefix_caching=false", "scheduler_config.kv_watermark=0") as server:
        stats = run_and_compare(server, reference_texts, stream=True)
    assert leftovers(server) == []
    assert stats["num_preemptions"] > 10, stats
    print("preemptions:", stats["num_preemptions"], "steps:", stats["num_steps"])


def test_chunked_prefill_fcfs_and_longest_output_first_give_the_same_output(reference_texts, alpaca_standin, tmp_path):
    with serve(tmp_path, "chunked", "scheduler_config.policy=fcfs", "scheduler_config.chunked_prefill=true",
               "scheduler_config.max_chunk_tokens=16", "serving_config.max_num_batched_tokens=40") as server:
        stats = run_and_compare(server, reference_texts)
        # the precision gate under chunking: a chunk inside a prompt is compared too, but samples nothing
        proc, result = precision_gate(server.url, tmp_path, "-n", "3", "--max-new-tokens", "4",
                                      "--prompts", str(alpaca_standin))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["sampled_rows"] == result["generated_tokens"] == 3 * 4 < result["rows"]
    assert result["greedy_agreement"] == 1.0
    assert stats["policy"] == "fcfs" and stats["chunked_prefill"] is True
    assert stats["prefix_cache_hit_rate"] > 0.05
    with serve(tmp_path, "lof", "scheduler_config.policy=longest_output_first",
               "scheduler_config.enable_prefix_caching=false") as server:
        stats = run_and_compare(server, reference_texts)
    assert stats["prefix_cache_hit_rate"] is None


def test_decode_runs_give_the_text_of_single_steps(tmp_path):
    """Requests one at a time (nothing waits, so greedy decode steps become runs of 8 on the runs server):
    the texts, token counts and finish reasons of single steps, with a request's end (a stop string, a stop
    token) falling inside a run and its last tokens (fewer than a run) in a run that ends early; sampled and
    top-logprob requests take single steps."""
    requests = [{"inputs": p, "parameters": {"max_new_tokens": n, **extra}} for p, n, extra in [
        ("Once upon a time", 37, {"stop": ["Lily"]}), ("The cat sat", 150, {"stop_token_ids": [388]}),
        ("Tom had a red ball", 29, {}),
        ("Lily wanted to", 20, {"ignore_eos": True}), ("The dog ran", 12, {"top_n_tokens": 2}),
        ("Sam and Mia", 16, {"do_sample": True, "temperature": 0.8, "seed": 5})]]

    def run(server):
        out = []
        for body in requests:
            status, answer = http("POST", server.url + "/models/hf/generate", body)
            assert status == 200, answer
            out.append((answer["generated_text"], answer["details"]["generated_tokens"],
                        answer["details"]["finish_reason"]))
        return out, http("GET", server.url + "/stats")[1]

    with serve(tmp_path, "single", "scheduler_config.decode_steps=1") as server:
        single, single_stats = run(server)
    with serve(tmp_path, "runs") as server:
        runs, stats = run(server)
    assert runs == single
    assert [reason for _, _, reason in single] == ["stop", "stop", "length", "length", "length", "length"]
    assert [n for _, n, _ in single] == [10, 32, 29, 20, 12, 16]          # both stops fall inside a run
    assert single_stats["decode_runs"]["runs"] == 0
    assert stats["decode_runs"]["steps"] == 8 and stats["decode_runs"]["runs"] >= 5     # (n-gram verify steps too)
    # by default runs take every decode batch the layer kernel does: up to the config's largest bucket (32)
    assert stats["decode_runs"]["max_rows"] == 32
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_overload_gets_429_and_impossible_requests_400(tmp_path):
    with serve(tmp_path, "small-queue", "serving_config.max_num_seqs=1", "serving_config.max_waiting_requests=2",
               "model_config.decode_batch_size=[1]") as server:
        # 30 requests at once, 10x what the server holds (1 running + 2 queued): the 2 queue places (plus the
        # running one, if the engine admitted a request before the rest arrived) are served, the others refused
        results = asyncio.run(_generate_all(server.url, (STORY_PROMPTS * 2)[:30], max_new_tokens=16))
        codes = [status for status, _ in results]
        assert 2 <= codes.count(200) <= 3 and codes.count(429) == 30 - codes.count(200), codes
        assert set(codes) <= {200, 429}
        for status, body in results:
            if status == 429:
                assert body["error_type"] == "overloaded" and "max_waiting_requests=2" in body["error"]
            else:
                assert body["details"]["generated_tokens"] == 16
        status, body = http("POST", server.url + "/models/hf/generate",
                            {"inputs": "Once", "parameters": {"max_new_tokens": 500}})
        assert status == 400 and "exceeds" in body["error"]
        stats = http("GET", server.url + "/stats")[1]
        assert stats["num_free_blocks"] == stats["num_blocks"]


async def _abort_scenarios(url):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 200, "ignore_eos": True},
                "stream": True}
        # explicit abort by id: the stream ends with finish_reason "abort"
        async with session.post(f"{url}/models/hf/generate", json=body,
                                headers={"X-Request-Id": "story-1"}) as resp:
            assert resp.status == 200 and resp.headers["X-Request-Id"] == "story-1"
            events = []
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    async with session.post(f"{url}/models/hf/generate", json=body,
                                            headers={"X-Request-Id": "story-1"}) as dup:
                        assert dup.status == 409 and "already in use" in (await dup.json())["error"]
                    async with session.post(f"{url}/abort/story-1") as abort:
                        assert abort.status == 200 and (await abort.json())["aborted"] is True
        assert events[-1]["details"]["finish_reason"] == "abort"
        assert len(events) < 200
        async with session.post(f"{url}/abort/story-1") as again:
            assert again.status == 404
        async with session.post(f"{url}/models/hf/generate", json=body, headers={"X-Request-Id": "bad id"}) as bad:
            assert bad.status == 400 and "X-Request-Id" in (await bad.json())["error"]

        # a client that disconnects mid-stream: its request ends and its blocks are freed
        async with session.get(f"{url}/stats") as r:
            steps_before = (await r.json())["num_steps"]
        resp = await session.post(f"{url}/models/hf/generate", json=body)
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: ")
            if seen == 3:
                break
        resp.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            async with session.get(f"{url}/stats") as r:
                stats = await r.json()
            if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]:
                break
            await asyncio.sleep(0.05)
        # no work goes on for the client that left: far fewer steps than its 200 tokens, and none after the
        # one that was running when it left (a decode run may still have been on the agent)
        await asyncio.sleep(0.3)
        async with session.get(f"{url}/stats") as r:
            settled = await r.json()
        await asyncio.sleep(0.3)
        async with session.get(f"{url}/stats") as r:
            later = await r.json()
        assert later["num_steps"] == settled["num_steps"] <= stats["num_steps"] + 1 \
            and stats["num_steps"] - steps_before < 100, \
            (steps_before, stats["num_steps"], settled["num_steps"], later["num_steps"])
        return stats


def test_abort_by_id_and_disconnect_free_the_blocks(stories_server):
    stats = asyncio.run(_abort_scenarios(stories_server.url))
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
