"""The serving path end to end: HTTP -> master -> shm + TCP -> agent process -> MindSpore -> back."""
import asyncio
import json
import random
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from llm_serving.agents import protocol as proto
from tests.integration.server_harness import REPO, http, parse_sse

STORY_PROMPTS = ["Once upon a time", "Tom had a red ball", "The cat sat", "Lily wanted to", "One day, a boy",
                 "The sun was", "A little bird", "Sam and Mia", "There was a big", "The dog ran",
                 "Mom said", "In the park", "Ben liked to", "The tree was tall", "Anna found a",
                 "It was a sunny day", "The little fish", "Max was sad", "A girl named Sue", "The box was",
                 "They played with", "Tim saw a", "The car went", "Her friend", "At school,",
                 "The big bear", "Lucy had a", "He wanted", "The moon", "A small frog", "Jack and Jill",
                 "The princess"]


def generate(url, prompt, **params):
    return http("POST", f"{url}/models/hf/generate", {"inputs": prompt, "parameters": params})


def assert_greedy_reference(url, model, stories_dir):
    """Greedy text served for greedy_reference.json's prompts equals llama2.c's (JSON route, then SSE)."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(stories_dir / "tok512.model"))
    cases = json.loads((stories_dir / "greedy_reference.json").read_text())
    assert len(cases) >= 2
    for i, case in enumerate(cases):
        num_prompt = 1 + len(sp.encode(case["prompt"]))          # BOS + prompt, as run.c counts
        # run.c forwards `steps` positions (BOS, prompt, outputs) and prints the token sampled at each,
        # so the last printed token is sampled at position steps - 1 and never forwarded itself
        params = {"max_new_tokens": case["steps_total_incl_prompt_and_bos"] - (num_prompt - 1),
                  "return_full_text": True}
        if i % 2 == 0:
            status, body = http("POST", f"{url}/models/{model}/generate",
                                {"inputs": case["prompt"], "parameters": params})
            assert status == 200, body
            text = body["generated_text"]
        else:  # the same through the streaming route
            status, events = http("POST", f"{url}/models/{model}/generate_stream",
                                  {"inputs": case["prompt"], "parameters": params})
            assert status == 200
            events = parse_sse(events)
            text = events[-1]["generated_text"]
            assert case["prompt"] + "".join(e["token"]["text"] for e in events) == text
        assert text + "\n" == case["greedy_text"]                   # run.c prints a final newline


def test_greedy_output_reproduces_the_reference_implementation(stories_server, stories_dir):
    assert_greedy_reference(stories_server.url, "hf", stories_dir)


async def _stream_all(url, prompts, max_new_tokens):
    async def one(session, prompt):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
                "stream": True}
        events = []
        async with session.post(f"{url}/models/hf/generate", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            async for line in resp.content:
                if line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
        return events

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(one(session, p) for p in prompts))


def test_32_concurrent_streams_batch_together_and_match_sequential_output(stories_server):
    url = stories_server.url
    before = http("GET", url + "/stats")[1]
    results = asyncio.run(_stream_all(url, STORY_PROMPTS, max_new_tokens=48))
    after = http("GET", url + "/stats")[1]
    concurrent_text = []
    for events in results:
        assert len(events) == 48                                    # one event per token, ignore_eos
        final = events[-1]
        assert final["details"]["finish_reason"] == "length"
        assert final["details"]["generated_tokens"] == 48
        assert "".join(e["token"]["text"] for e in events) == final["generated_text"]
        concurrent_text.append(final["generated_text"])
    decode_sizes = {int(k): v - before["batch_sizes"]["decode"].get(k, 0)
                    for k, v in after["batch_sizes"]["decode"].items()}
    assert max(k for k, v in decode_sizes.items() if v > 0) > 1, decode_sizes
    print("decode batch sizes run (rows: steps):", decode_sizes)

    for prompt, expected in zip(STORY_PROMPTS, concurrent_text):
        status, body = generate(url, prompt, max_new_tokens=48, ignore_eos=True)
        assert status == 200
        assert body["generated_text"] == expected, prompt
    stats = http("GET", url + "/stats")[1]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]          # every block came back


@pytest.mark.parametrize("raw, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"\xff\xfe{}", 400, "UTF-8"),
    (b"[1, 2]", 400, "JSON object"),
    (b"{}", 400, "'inputs' is required"),
    (json.dumps({"inputs": 5}).encode(), 400, "inputs must be a string"),
    (json.dumps({"inputs": "   "}).encode(), 400, "'inputs' is empty"),
    (json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": "5"}}).encode(), 400,
     "parameters.max_new_tokens must be an integer"),
    (json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 0}}).encode(), 400, "max_new_tokens"),
    (json.dumps({"inputs": "hi", "parameters": {"top_p": 1.5}}).encode(), 400, "parameters.top_p"),
    (json.dumps({"inputs": "hi", "parameters": {"temperature": -1}}).encode(), 400, "parameters.temperature"),
    (json.dumps({"inputs": "hi", "parameters": {"bogus": 1, "top_k": -2}}).encode(), 400, "parameters.top_k"),
    (json.dumps({"inputs": "hi", "stream": "yes"}).encode(), 400, "stream must be true or false"),
    (json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 100000}}).encode(), 400, "exceeds"),
    (json.dumps({"inputs": "Once upon a time " * 200}).encode(), 400, "prompt has"),
    (json.dumps({"inputs": "hi", "parameters": {"stop": [""]}}).encode(), 400, "parameters.stop: every stop"),
    (json.dumps({"inputs": "hi", "parameters": {"stop": 5}}).encode(), 400, "parameters.stop must be"),
    (json.dumps({"inputs": "hi", "parameters": {"stop_token_ids": [512]}}).encode(), 400, "0..511"),
])
def test_bad_requests_get_a_4xx_naming_the_problem(stories_server, raw, status, needle):
    got, body = http("POST", f"{stories_server.url}/models/hf/generate", raw=raw)
    assert got == status, body
    assert needle in body["error"], body
    assert generate(stories_server.url, "Once upon a time", max_new_tokens=2)[0] == 200


def test_unknown_model_and_model_info(stories_server):
    status, body = http("POST", f"{stories_server.url}/models/gpt-9/generate", {"inputs": "hi"})
    assert status == 404 and "gpt-9" in body["error"]
    status, info = http("GET", f"{stories_server.url}/models/hf")
    assert status == 200 and info["model_id"] == "hf" and info["max_total_tokens"] == 256
    assert info["kv_cache_dtype"] == "float16" and info["kv_block_size"] == 16 and info["kv_cache_blocks"] > 0


def test_tgi_compat_route_serves_huggingface_hubs_client(stories_server):
    """TGI's `POST /` (generate, or a token stream with "stream": true), as huggingface_hub's InferenceClient posts
    it: the same greedy text as /generate, with details, and token by token."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    client = huggingface_hub.InferenceClient(base_url=stories_server.url, timeout=60)
    status, want = http("POST", stories_server.url + "/generate", {"inputs": "Once upon a time",
                                                                  "parameters": {"max_new_tokens": 10}})
    assert status == 200
    assert client.text_generation("Once upon a time", max_new_tokens=10) == want["generated_text"]
    out = client.text_generation("Once upon a time", max_new_tokens=10, details=True)
    assert out.generated_text == want["generated_text"] and len(out.details.tokens) == 10
    tokens = [t.token.text for t in client.text_generation("Once upon a time", max_new_tokens=10, stream=True,
                                                           details=True)]
    assert len(tokens) == 10 and "".join(tokens) == want["generated_text"]


def test_health_lists_live_agents(stories_server):
    status, body = http("GET", stories_server.url + "/health")
    assert status == 200 and body["status"] == "ok"
    assert [a["pid"] for a in body["agents"]] == stories_server.agent_pids()
    # agents start with their memory in huge pages (serving_config.agent_huge_pages auto: a small checkpoint)
    for pid in stories_server.agent_pids():
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        assert any(v.startswith(b"GLIBC_TUNABLES=") and b"glibc.malloc.hugetlb=1" in v for v in environ)


def _agent_port(server) -> int:
    return http("GET", server.url + "/health")[1]["agents"][0]["port"]


def test_agent_ctl_health_and_reset(stories_server):
    port = _agent_port(stories_server)
    out = subprocess.run([sys.executable, "-m", "llm_serving.cli", "agent-ctl", "--port", str(port), "health"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    health = json.loads(out.stdout)
    assert health["ok"] and health["rank"] == 0 and health["steps"] > 0
    out = subprocess.run([sys.executable, "-m", "llm_serving.cli", "agent-ctl", "--port", str(port), "reset"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    reset = json.loads(out.stdout)
    assert reset["ok"] and reset["cache_epoch"] >= 1
    # the master still serves after a reset (new requests write the KV they read)
    status, body = generate(stories_server.url, "Once upon a time", max_new_tokens=8)
    assert status == 200 and body["generated_text"].startswith(",")


def test_a_reset_behind_the_masters_back_loses_no_cached_prefix_and_no_running_request(stories_server):
    """agent-ctl reset zeroes the KV cache the master's prefix cache and running requests point at: the
    master learns it from the next step reply, discards that step and computes again what it had, so
    greedy text is the same as without the reset."""
    from concurrent.futures import ThreadPoolExecutor

    from llm_serving.agents.control import ControlClient

    url = stories_server.url
    prefix = " ".join(STORY_PROMPTS[:12])           # > 3 blocks of 16 tokens: cached after the first request
    stats0 = http("GET", url + "/stats")[1]
    status, first = generate(url, prefix, max_new_tokens=60)
    assert status == 200
    assert generate(url, prefix, max_new_tokens=60)[1] == first          # served from the prefix cache
    stats1 = http("GET", url + "/stats")[1]
    assert stats1["num_cached_prompt_tokens"] - stats0["num_cached_prompt_tokens"] >= 48
    with ControlClient(_agent_port(stories_server)) as ctl:
        assert ctl.request(proto.Reset()).cache_epoch == ctl.info.cache_epoch + 1
    assert generate(url, prefix, max_new_tokens=60)[1] == first          # the cached blocks held zeros
    stats2 = http("GET", url + "/stats")[1]
    assert stats2["num_cache_resets"] == stats1["num_cache_resets"] + 1
    # a reset while requests are running: they recompute their KV and finish with the same text
    with ThreadPoolExecutor(4) as pool:
        runs = [pool.submit(generate, url, p, max_new_tokens=200) for p in STORY_PROMPTS[:4]]
        with ControlClient(_agent_port(stories_server)) as ctl:
            while http("GET", url + "/stats")[1]["num_running"] == 0 and not all(r.done() for r in runs):
                time.sleep(0.005)
            ctl.request(proto.Reset())
        during = [r.result(timeout=120) for r in runs]
    alone = [generate(url, p, max_new_tokens=200) for p in STORY_PROMPTS[:4]]
    assert [d[0] for d in during] == [200] * 4 and during == alone
    assert http("GET", url + "/stats")[1]["num_cache_resets"] == stats2["num_cache_resets"] + 1


def test_agent_refuses_commands_before_connect_and_bad_tokens_and_bad_frames(stories_server):
    port = _agent_port(stories_server)

    def exchange(frames: list) -> list:
        replies = []
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            try:
                for f in frames:
                    sock.sendall(f)
                sock.shutdown(socket.SHUT_WR)  # a truncated frame must not leave the agent waiting for the rest
            except OSError:                    # the agent already refused a frame and closed the connection
                pass
            try:
                while True:
                    replies.append(proto.recv_frame(sock).payload)
            except (ConnectionError, OSError):
                pass
        return replies

    replies = exchange([proto.encode(1, proto.Step(kind="decode", step=0, num_rows=1))])
    assert len(replies) == 1 and not replies[0]["ok"] and "not connected" in replies[0]["error"]
    replies = exchange([proto.encode(1, proto.Connect(token="guess"))])
    assert not replies[0]["ok"] and "wrong token" in replies[0]["error"]
    replies = exchange([proto.HEADER.pack(12) + b"Zgarbage!!!!"])
    assert not replies[0]["ok"] and "unknown command" in replies[0]["error"]
    replies = exchange([proto.HEADER.pack(proto.MAX_FRAME_BYTES + 1)])
    assert not replies[0]["ok"] and "frame length" in replies[0]["error"]
    assert exchange([proto.HEADER.pack(100) + b'*{"seq": 1']) == []       # truncated: dropped, logged
    # random bytes (a port scanner, a confused client): refused or dropped, never a crash
    rng = random.Random(7)
    for _ in range(100):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        replies = exchange([blob])
        assert all(r["ok"] is False for r in replies), (blob, replies)
    log = stories_server.log_path.read_text(errors="replace")
    assert "truncated frame" in log and "rejected frame" in log and "before connect refused" in log
    # none of that disturbed the master's connection
    assert generate(stories_server.url, "Tom had a red ball", max_new_tokens=4)[0] == 200


def test_stop_strings_across_token_boundaries_and_stop_token_ids(stories_server):
    url = stories_server.url
    # greedy: ", there was a little girl named Lily. She loved to play outside in the park."
    for stream in (False, True):
        status, body = http("POST", f"{url}/generate", {"inputs": "Once upon a time", "stream": stream,
                                                         "parameters": {"max_new_tokens": 40,
                                                                        "stop": [" named Li", "zzz"]}})
        assert status == 200
        if stream:
            events = parse_sse(body)
            shown = "".join(e["token"]["text"] for e in events if e["token"])
            body = events[-1]
            assert shown == body["generated_text"]               # nothing of the stop string was streamed
        assert body["generated_text"] == ", there was a little girl"
        assert body["details"]["finish_reason"] == "stop" and body["details"]["generated_tokens"] < 40

    status, body = http("POST", f"{url}/generate_stream", {"inputs": "Once upon a time",
                                                            "parameters": {"max_new_tokens": 8}})
    tokens = [e["token"] for e in parse_sse(body) if e["token"]]
    stop_id = tokens[3]["id"]
    first = next(i for i, t in enumerate(tokens) if t["id"] == stop_id)
    status, body = generate(url, "Once upon a time", max_new_tokens=8, stop_token_ids=[stop_id])
    assert status == 200 and body["details"]["finish_reason"] == "stop"
    assert body["details"]["generated_tokens"] == first + 1
    assert body["generated_text"] == "".join(t["text"] for t in tokens[:first])
