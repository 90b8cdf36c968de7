"""Speculative decoding with a draft model in its own agent process (spec_config.method draft), served end to
end on stories260K: output identical with speculation on and off, the target as its own draft accepted whole
(the draft's KV bookkeeping is right, or it would guess wrong), a draft cut to the target's first layers, and
a draft agent that is killed or reset costing speed only — requests keep their exact output, the draft comes
back and proposes again."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from tests.integration.server_harness import REPO, http, serving
from tests.integration.test_serving import STORY_PROMPTS, assert_greedy_reference
from tests.integration.test_speculative import MODEL, _gen, _spec, _tokens


@pytest.fixture(scope="module")
def draft_server(stories_dir, tmp_path_factory):
    """stories260K, drafting for itself (spec_config.draft_model unset: the target's own checkpoint)."""
    pytest.importorskip("mindspore")
    with serving(["--config", str(REPO / "configs" / "stories260K.yaml"),
                  "--model", str(stories_dir / "hf"),
                  "--set", "spec_config.method=draft", "--set", "serving_config.agent_restart_backoff_s=0.2"],
                 tmp_path_factory.mktemp("draft") / "server.log") as server:
        yield server


def test_the_target_as_its_own_draft_is_accepted_whole_and_changes_nothing(draft_server, stories_dir):
    url = draft_server.url
    health = http("GET", url + "/health")[1]
    assert health["status"] == "ok" and len(health["agents"]) == 1
    assert [a["role"] for a in health["draft_agents"]] == ["draft"]
    assert health["draft_agents"][0]["pid"] != health["agents"][0]["pid"]
    before = _spec(url)
    assert before["method"] == "draft" and before["draft"]["unavailable_reason"] is None
    for prompt in STORY_PROMPTS[:5]:
        on, off = _gen(url, prompt, max_new_tokens=90), _gen(url, prompt, max_new_tokens=90, speculative=False)
        assert _tokens(on) == _tokens(off) and on["generated_text"] == off["generated_text"]
    greedy = _spec(url)
    proposed = greedy["proposed_tokens"] - before["proposed_tokens"]
    accepted = greedy["accepted_tokens"] - before["accepted_tokens"]
    # the same weights through the draft's graphs: every greedy guess is the target's token (a float near-tie
    # between two graphs could flip one; none does on these prompts)
    assert proposed > 5 * 60 and accepted == proposed
    assert greedy["draft"]["steps"] > before["draft"]["steps"]
    assert_greedy_reference(url, MODEL, stories_dir)
    for params in ({"do_sample": True, "temperature": 0.8, "top_k": 40, "seed": 7},
                   {"do_sample": True, "temperature": 1.0, "top_p": 0.9, "seed": 3}):
        on, off = _gen(url, "Once upon a time", max_new_tokens=60, **params), \
            _gen(url, "Once upon a time", max_new_tokens=60, speculative=False, **params)
        assert _tokens(on) == _tokens(off)
    # sampled rows reject some greedy guesses: acceptance below 1 now, and reported per position
    after = _spec(url)
    assert after["accepted_tokens"] - greedy["accepted_tokens"] < after["proposed_tokens"] - greedy["proposed_tokens"]
    assert set(after["acceptance_by_position"]) == {"1", "2", "3", "4"}


def test_concurrent_requests_with_a_draft_keep_their_own_text(draft_server):
    url = draft_server.url
    prompts = STORY_PROMPTS[:4]
    expected = [_gen(url, p, max_new_tokens=50, speculative=False)["generated_text"] for p in prompts]

    async def run():
        async with aiohttp.ClientSession() as s:
            async def one(p, n):
                async with s.post(f"{url}/models/{MODEL}/generate",
                                  json={"inputs": p, "parameters": {"max_new_tokens": n}}) as r:
                    assert r.status == 200
                    return (await r.json())["generated_text"]
            # 4 rows speculate together; a fifth, shorter one makes the step too big to speculate at times
            return await asyncio.gather(*(one(p, 50) for p in prompts), one(prompts[0], 7))
    got = asyncio.run(run())
    assert got[:4] == expected and expected[0].startswith(got[4])


def test_a_killed_draft_agent_costs_speed_not_output_and_comes_back(draft_server):
    url = draft_server.url
    prompt = STORY_PROMPTS[5]
    expected = _tokens(_gen(url, prompt, max_new_tokens=120, speculative=False))
    draft_pid = http("GET", url + "/health")[1]["draft_agents"][0]["pid"]
    before = _spec(url)

    async def run():                                     # kill the draft mid-generation (10 tokens in)
        ids = []
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/models/{MODEL}/generate_stream",
                              json={"inputs": prompt, "parameters": {"max_new_tokens": 120}}) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data:"):
                        event = json.loads(line[5:])
                        ids.append(event["token"]["id"])
                        if len(ids) == 10:
                            os.kill(draft_pid, signal.SIGKILL)
                        final = event
        return ids, final
    decode_before = http("GET", url + "/stats")[1]["batch_sizes"]["decode"].get("1", 0)
    ids, final = asyncio.run(run())
    assert ids == expected and final["details"]["finish_reason"] == "length"
    # the rest was decoded without proposals while the draft restarted (seconds): the kill hit mid-request
    assert http("GET", url + "/stats")[1]["batch_sizes"]["decode"].get("1", 0) - decode_before > 20
    health = http("GET", url + "/health")[1]
    assert health["status"] == "ok"                      # the target serves on: a draft is no health matter
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        spec = _spec(url)
        if spec["draft"]["restarts"] > before["draft"]["restarts"] and spec["draft"]["unavailable_reason"] is None:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the draft agent did not come back: {_spec(url)['draft']}")
    new_pid = http("GET", url + "/health")[1]["draft_agents"][0]["pid"]
    assert new_pid != draft_pid
    again = _spec(url)
    assert _tokens(_gen(url, prompt, max_new_tokens=120)) == expected
    after = _spec(url)
    assert after["accepted_tokens"] - again["accepted_tokens"] == after["proposed_tokens"] - again["proposed_tokens"] > 0


def test_a_draft_reset_behind_the_masters_back_is_caught_up(draft_server):
    url = draft_server.url
    prompt = " ".join(STORY_PROMPTS[:6])
    expected = _tokens(_gen(url, prompt, max_new_tokens=60, speculative=False))
    port = http("GET", url + "/health")[1]["draft_agents"][0]["port"]
    before = _spec(url)
    out = subprocess.run([sys.executable, "-m", "llm_serving.cli", "agent-ctl", "--port", str(port), "reset"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert _tokens(_gen(url, prompt, max_new_tokens=60)) == expected
    after = _spec(url)
    assert after["draft"]["cache_resets"] == before["draft"]["cache_resets"] + 1
    # the reset cost one round; then every request caught up from scratch and the draft is right again
    assert after["accepted_tokens"] > before["accepted_tokens"]


def test_a_draft_cut_to_the_targets_first_layers(stories_dir, tmp_path):
    """model_config.num_layers through the draft's agent: output unchanged, acceptance whatever the cut
    reaches (reported), and a cut deeper than the checkpoint refused at start with the reason."""
    pytest.importorskip("mindspore")
    hf = str(stories_dir / "hf")
    with serving(["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", hf,
                  "--set", "spec_config.method=draft", "--set", "spec_config.draft_num_layers=4",
                  "--set", f"spec_config.draft_model={hf}"], tmp_path / "server.log") as server:
        for prompt in STORY_PROMPTS[:3]:
            on, off = _gen(server.url, prompt, max_new_tokens=60), \
                _gen(server.url, prompt, max_new_tokens=60, speculative=False)
            assert _tokens(on) == _tokens(off)
        spec = _spec(server.url)
        assert spec["draft"]["num_layers"] == 4 and spec["proposed_tokens"] > 0
        assert spec["accepted_tokens"] < spec["proposed_tokens"]      # 4 of 5 layers guess some tokens wrong
    out = subprocess.run([sys.executable, "-m", "llm_serving.cli", "start", "--config",
                          str(REPO / "configs" / "stories260K.yaml"), "--model", hf, "--port", "0",
                          "--set", "spec_config.method=draft", "--set", "spec_config.draft_num_layers=9"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode != 0 and "first 9 layers" in out.stderr and "it has 5" in out.stderr


def test_a_draft_tree_from_a_cut_drafts_top_tokens(stories_dir, tmp_path):
    """spec_config.method draft_tree: the cut draft's 3 most likely first tokens, each continued greedily, are
    verified as one token tree. Output unchanged (greedy and seeded sampling), and some rounds keep a path
    off the draft's first choice — what a tree adds over a chain."""
    pytest.importorskip("mindspore")
    hf = str(stories_dir / "hf")
    with serving(["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", hf,
                  "--set", "spec_config.method=draft_tree", "--set", "spec_config.draft_num_layers=2",
                  "--set", "spec_config.tree_width=3", "--set", "spec_config.num_speculative_tokens=3"],
                 tmp_path / "server.log") as server:
        for prompt in STORY_PROMPTS[:4]:
            on, off = _gen(server.url, prompt, max_new_tokens=60), \
                _gen(server.url, prompt, max_new_tokens=60, speculative=False)
            assert _tokens(on) == _tokens(off) and on["generated_text"] == off["generated_text"]
        params = {"do_sample": True, "temperature": 0.9, "top_k": 40, "seed": 11}
        on, off = _gen(server.url, "Once upon a time", max_new_tokens=60, **params), \
            _gen(server.url, "Once upon a time", max_new_tokens=60, speculative=False, **params)
        assert _tokens(on) == _tokens(off)
        spec = _spec(server.url)
        assert spec["method"] == "draft_tree" and spec["draft"]["num_layers"] == 2
        assert spec["other_branch_rounds"] > 0 and spec["accepted_tokens"] > 0
        # a round proposes up to 3 branches of up to 3 tokens: more than a chain's 3 on average
        assert spec["proposed_tokens"] > 3 * spec["rounds"]
