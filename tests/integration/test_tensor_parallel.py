"""Tensor parallelism through the real server: two agents, each holding half of stories260K's heads and
MLP units, all-reducing through shared memory inside their MindSpore graphs. Greedy output must be the
reference implementation's and TP=1's, logits must pass the precision gate, and losing one rank under
load must behave like losing the only agent (its requests fail with the reason, the group restarts).
The same group over MindSpore's own collectives (`all_reduce: mindspore`, the Ascend path with HCCL; here
its CPU backend), in a MindSpore dynamic cluster the master sets up, is held to the reference and to
the same supervision."""
import asyncio
import json
import os
import stat
import subprocess
import sys
import time

import psutil
import pytest

from tests.integration.server_harness import REPO, ServerProcess, http, leftovers, project_shm_segments
from tests.integration.test_faults import _final_event, _kill_agent_under_load
from tests.integration.test_serving import STORY_PROMPTS, assert_greedy_reference

STORIES = ["--config", str(REPO / "configs" / "stories260K.yaml")]
# fewer buckets than the stories config (compile time: this server is cold in CI); outputs do not depend on them
TP2 = ["serving_config.agent_ports=[0,0]", "model_config.decode_batch_size=[1,8,16]",
       "model_config.prefill_batch_size=[1,2]", "serving_config.max_num_seqs=16", "serving_config.agent_restart_backoff_s=0.2"]


def _args(stories_dir, sets):
    args = STORIES + ["--model", str(stories_dir / "hf")]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.fixture(scope="module")
def tp_server(stories_dir, tmp_path_factory, stories_server):
    """(stories_server, the TP=1 twin, is started first so that its segments are not taken for leftovers.)"""
    pytest.importorskip("mindspore")
    shm_before = set(project_shm_segments())
    server = ServerProcess(_args(stories_dir, TP2), tmp_path_factory.mktemp("tp2") / "server.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
    assert leftovers(server) == [], server.log()
    assert set(project_shm_segments()) - shm_before == set()    # the group's all-reduce segment included


def _tp_segments() -> list:
    return [s for s in project_shm_segments() if s.endswith("_tp")]


def _greedy_texts(url: str, prompts: list, max_new_tokens: int) -> list:
    async def run():
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one(prompt):
                body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                                         "details": True}}
                async with session.post(f"{url}/models/hf/generate", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    out = await resp.json()
                    return out["generated_text"], out["details"]["generated_tokens"]
            return await asyncio.gather(*(one(p) for p in prompts))
    return asyncio.run(run())


def test_two_ranks_serve_the_reference_greedy_text(tp_server, stories_dir):
    status, info = http("GET", tp_server.url + "/info")
    assert status == 200 and info["tensor_parallel_size"] == 2
    assert info["batch_invariant"] is False         # 'auto': MindSpore's op-by-op layers under tensor parallelism
    status, health = http("GET", tp_server.url + "/health")
    assert [a["rank"] for a in health["agents"]] == [0, 1]
    assert_greedy_reference(tp_server.url, "hf", stories_dir)


def test_two_ranks_match_one_agent_token_for_token_under_concurrency(tp_server, stories_server):
    prompts = STORY_PROMPTS[:16]
    tp2 = _greedy_texts(tp_server.url, prompts, 40)
    tp1 = _greedy_texts(stories_server.url, prompts, 40)
    assert tp2 == tp1
    assert all(n == 40 and text for text, n in tp2)


def test_two_ranks_speculate_and_keep_their_output(tp_server):
    """n-gram speculation (on by default) under tensor parallelism: verify steps run on both ranks (their
    graphs all-reduce too), and greedy output is the same with speculation on and off."""
    before = http("GET", tp_server.url + "/stats")[1]["speculative"]
    for prompt in STORY_PROMPTS[:4]:
        texts = []
        for speculative in (True, False):
            status, body = http("POST", tp_server.url + "/models/hf/generate",
                                {"inputs": prompt, "parameters": {"max_new_tokens": 80, "speculative": speculative}})
            assert status == 200, body
            texts.append(body["generated_text"])
        assert texts[0] == texts[1]
    after = http("GET", tp_server.url + "/stats")[1]["speculative"]
    assert after["method"] == "ngram" and after["verify_steps"] > before["verify_steps"]
    assert after["accepted_tokens"] > before["accepted_tokens"]


def test_two_ranks_pass_the_precision_gate(tp_server, alpaca_standin, tmp_path):
    out = tmp_path / "precision.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "precision.py"), "--url", tp_server.url,
                           "--out", str(out), "-n", "12", "--max-new-tokens", "16", "--rate", "40",
                           "--prompts", str(alpaca_standin)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["passed"] and result["max_rel_error"] <= 0.005, result
    assert result["rows"] == result["generated_tokens"] > 0


def test_a_failure_on_rank_0_alone_after_the_model_graph_ends_only_its_step(tp_server, stories_dir, tmp_path):
    """Logits capture (rank 0 only) into a directory that then disappears: rank 0 fails each step after its
    model graph, rank 1 succeeds. Both made the same all-reduces (collective_calls), so the group is in
    step: those requests fail with the reason, nothing restarts, and once capture is off it serves again."""
    from llm_serving.agents import protocol as proto
    from llm_serving.agents.control import ControlClient

    health = http("GET", tp_server.url + "/health")[1]
    restarts = http("GET", tp_server.url + "/stats")[1]["num_agent_restarts"]
    rank0 = next(a for a in health["agents"] if a["rank"] == 0)
    body = {"inputs": STORY_PROMPTS[0], "parameters": {"max_new_tokens": 8}}
    with ControlClient(rank0["port"]) as ctl:
        ctl.request(proto.Capture(dir=str(tmp_path / "cap"), max_steps=1000))
        (tmp_path / "cap").rmdir()
        status, answer = http("POST", tp_server.url + "/models/hf/generate", body)
        assert status == 500 and answer["details"]["finish_reason"] == "error", answer
        assert "agent 0" in answer["error"] and "FileNotFoundError" in answer["error"], answer
        assert http("GET", tp_server.url + "/health")[0] == 200
        ctl.request(proto.Capture(dir=None))
    assert_greedy_reference(tp_server.url, "hf", stories_dir)
    stats = http("GET", tp_server.url + "/stats")[1]
    assert stats["num_agent_restarts"] == restarts and stats["num_free_blocks"] == stats["num_blocks"]
    assert http("GET", tp_server.url + "/health")[1]["agents"] == health["agents"]     # the same processes


def test_killing_one_rank_under_load_fails_its_requests_and_restarts_the_group(tp_server, stories_dir):
    # the group's segment: private to the user, one per group
    [segment] = _tp_segments()
    assert stat.S_IMODE(os.stat(f"/dev/shm/{segment}").st_mode) == 0o600
    health = http("GET", tp_server.url + "/health")[1]
    rank1 = next(a["pid"] for a in health["agents"] if a["rank"] == 1)
    tp_server.refresh_children()
    n, max_new = 48, 32
    t0 = time.monotonic()
    results, states, killed = asyncio.run(_kill_agent_under_load(tp_server, n, max_new, agent_pid=rank1,
                                                                 after_done=8))
    # rank 0 waits for the dead rank in the all-reduce; the master must not wait for rank 0's step timeout
    # (120 s) before failing the step: the whole load, restart included, takes ~10 s here
    assert time.monotonic() - t0 < 90
    assert killed == rank1
    finals = [_final_event(events) for events in results]
    failed = [f for f in finals if f.get("details", {}).get("finish_reason") == "error"]
    finished = [f for f in finals if f.get("details", {}).get("finish_reason") == "length"]
    assert len(failed) + len(finished) == n
    assert 1 <= len(failed) <= 16                                   # at most max_num_seqs were running
    for f in failed:   # the lost rank is named, whether its exit or its dropped connection was seen first
        assert "agent failure: agent 1" in f["error"], f
        assert "exited with code -9" in f["error"] or "connection lost" in f["error"], f
    assert all(f["details"]["generated_tokens"] == max_new for f in finished) and len(finished) > 8
    statuses = [s for s, _ in states]
    assert statuses[0] == 200 and 503 in statuses and statuses[-1] == 200, states

    # both ranks were replaced (rank 0 was stuck waiting for rank 1 in the all-reduce), with a new segment
    stats = http("GET", tp_server.url + "/stats")[1]
    assert stats["num_agent_restarts"] == 1 and stats["num_running"] == 0
    new = http("GET", tp_server.url + "/health")[1]["agents"]
    assert {a["pid"] for a in new}.isdisjoint({a["pid"] for a in health["agents"]})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _tp_segments() == [segment]:
        time.sleep(0.1)
    assert len(_tp_segments()) == 1 and _tp_segments() != [segment]
    tp_server.refresh_children()
    assert_greedy_reference(tp_server.url, "hf", stories_dir)


def test_a_model_that_does_not_split_evenly_is_refused_at_start(stories_dir, tmp_path):
    """stories260K has 4 KV heads: three ranks cannot share them. The start-up fails with the numbers."""
    pytest.importorskip("mindspore")
    shm_before = set(project_shm_segments())
    server = ServerProcess(_args(stories_dir, ["serving_config.agent_ports=[0,0,0]"]), tmp_path / "server.log")
    try:
        assert server.proc.wait(300) == 1
    finally:
        server.stop()
    log = server.log()
    assert "tensor parallel over 3 agents" in log and "num_kv_heads=4" in log, log[-3000:]
    assert leftovers(server) == []
    deadline = time.monotonic() + 5          # the master's resource tracker unlinks a moment after its exit
    while time.monotonic() < deadline and set(project_shm_segments()) - shm_before:
        time.sleep(0.1)
    assert set(project_shm_segments()) - shm_before == set()


# the smallest bucket set: MindSpore's CPU all-reduce is ~1 ms a call, this server only has to be right
MS_TP2 = ["serving_config.agent_ports=[0,0]", "model_config.all_reduce=mindspore",
          "model_config.decode_batch_size=[1,8]", "model_config.prefill_batch_size=[1]", "serving_config.max_num_seqs=8",
          "serving_config.agent_restart_backoff_s=0.2"]


def assert_rank_1_loss(results, states, n: int, max_new: int, max_running: int) -> None:
    """After _kill_agent_under_load killed rank 1: every request ended, those that failed (at most the running
    ones) name agent 1, the others have all their tokens, and health came back."""
    finals = [_final_event(events) for events in results]
    failed = [f for f in finals if f.get("details", {}).get("finish_reason") == "error"]
    finished = [f for f in finals if f.get("details", {}).get("finish_reason") == "length"]
    assert len(failed) + len(finished) == n and 1 <= len(failed) <= max_running
    assert all("agent failure: agent 1" in f["error"] for f in failed), failed[:2]
    assert all(f["details"]["generated_tokens"] == max_new for f in finished)
    assert [s for s, _ in states][-1] == 200


def _schedulers(server) -> list:
    return [p.pid for p in server.refresh_children() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "llm_serving.models.parallel" in " ".join(p.cmdline())]


def test_mindspore_collectives_serve_the_reference_and_survive_losing_a_rank(stories_dir, tmp_path):
    pytest.importorskip("mindspore")
    shm_before = set(project_shm_segments())
    server = ServerProcess(_args(stories_dir, MS_TP2), tmp_path / "server.log")
    try:
        server.wait_ready()
        info = http("GET", server.url + "/info")[1]
        assert info["tensor_parallel_size"] == 2 and info["tensor_parallel_all_reduce"] == "mindspore"
        assert set(_tp_segments()) - shm_before == set()          # no shared-memory all-reduce in this group
        [scheduler] = _schedulers(server)
        assert_greedy_reference(server.url, "hf", stories_dir)

        health = http("GET", server.url + "/health")[1]
        rank1 = next(a["pid"] for a in health["agents"] if a["rank"] == 1)
        n, max_new = 24, 24
        results, states, killed = asyncio.run(_kill_agent_under_load(server, n, max_new, agent_pid=rank1,
                                                                     after_done=4))
        assert_rank_1_loss(results, states, n, max_new, max_running=8)
        # a new group: both ranks and the cluster's scheduler replaced (the old cluster lost a member)
        new = http("GET", server.url + "/health")[1]["agents"]
        assert {a["pid"] for a in new}.isdisjoint({a["pid"] for a in health["agents"]})
        assert len(_schedulers(server)) == 1 and _schedulers(server) != [scheduler]
        assert_greedy_reference(server.url, "hf", stories_dir)

        # the cluster's scheduler is part of the group: its death, with both ranks alive, restarts the group
        [scheduler] = _schedulers(server)
        agents = {a["pid"] for a in http("GET", server.url + "/health")[1]["agents"]}
        os.kill(scheduler, 9)
        reasons, deadline = set(), time.monotonic() + 120
        while time.monotonic() < deadline:
            status, health = http("GET", server.url + "/health")
            if status == 503:
                reasons.add(health["reason"])
            elif reasons:
                break
            time.sleep(0.05)
        # (noticed as the scheduler's exit, not later as a rank's, when its MindSpore gives up on the cluster)
        assert "agents restarting after a failure: the tensor-parallel cluster scheduler exited with code -9" \
            in reasons, reasons
        assert http("GET", server.url + "/stats")[1]["num_agent_restarts"] == 2
        assert {a["pid"] for a in health["agents"]}.isdisjoint(agents)
        assert len(_schedulers(server)) == 1 and _schedulers(server) != [scheduler]
        assert_greedy_reference(server.url, "hf", stories_dir)
    finally:
        server.stop()
    assert leftovers(server) == [], server.log()[-3000:]
    assert set(project_shm_segments()) - shm_before == set()
