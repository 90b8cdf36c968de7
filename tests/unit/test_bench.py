"""The load client's pure parts: datasets, arrival schedules and the metric definitions."""
import json
import math

import numpy as np
import pytest

from llm_serving.loadgen.backends import RequestResult
from llm_serving.loadgen.metrics import format_table, parse_slos, summarize
from llm_serving.loadgen.plots import timeline
from llm_serving.loadgen.workload import (TokenCounter, WorkloadError, arrival_offsets, load_alpaca, load_sharegpt,
                                        synthetic)
from tests.conftest import ALPACA_SAMPLE, restricted_file


@pytest.fixture(scope="module")
def llama_counter(llama_tokenizer_standin):
    return TokenCounter(str(llama_tokenizer_standin))


def test_alpaca_prompt_and_output_length(tmp_path, llama_counter):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([
        {"instruction": "Translate to French", "input": "Good morning", "output": "Bonjour tout le monde"},
        {"instruction": "Name a colour", "input": "", "output": "Blue " * 300},
        {"instruction": "unused", "input": "", "output": "x"}]))
    samples = load_alpaca(str(path), 2, llama_counter, max_new_tokens=256)
    assert [s.prompt for s in samples] == ["Translate to French:Good morning", "Name a colour"]
    assert samples[0].prompt_len == len(llama_counter.encode("Translate to French:Good morning"))
    assert samples[0].max_new_tokens == len(llama_counter.encode("Bonjour tout le monde"))
    assert samples[1].max_new_tokens == 256                                   # capped


@pytest.mark.parametrize("dataset", ["standin", "alpaca_5000"])
def test_an_alpaca_file_loads(dataset, alpaca_standin, llama_counter):
    path = alpaca_standin if dataset == "standin" else restricted_file(ALPACA_SAMPLE)
    samples = load_alpaca(str(path), 300, llama_counter, 128)
    assert len(samples) == 300
    assert all(1 <= s.max_new_tokens <= 128 and s.prompt_len >= 1 for s in samples)
    assert len({s.max_new_tokens for s in samples}) > 20                     # real, varied lengths


def test_sharegpt_takes_the_first_human_turn_and_its_reply(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "gpt", "value": "hi"}]},                      # no human turn: skipped
        {"conversations": [{"from": "human", "value": "tell me a story"},
                           {"from": "gpt", "value": "once there was a fox"},
                           {"from": "human", "value": "again"}, {"from": "gpt", "value": "no"}]}]))
    samples = load_sharegpt(str(path), 10, TokenCounter(None), None)
    assert [(s.prompt, s.prompt_len, s.max_new_tokens) for s in samples] == [("tell me a story", 4, 5)]


def test_synthetic_lengths_are_exact_with_a_tokenizer(llama_counter):
    samples = synthetic(20, 64, 32, 0.5, llama_counter, seed=1)
    for s in samples:
        assert 32 <= s.prompt_len <= 96 and 16 <= s.max_new_tokens <= 48
        assert len(llama_counter.encode(s.prompt)) == s.prompt_len
    assert abs(np.mean([s.prompt_len for s in samples]) - 64) < 16
    fixed = synthetic(5, 40, 10, 0.0, llama_counter, seed=2)
    assert [s.max_new_tokens for s in fixed] == [10] * 5
    assert all(abs(s.prompt_len - 40) <= 2 for s in fixed)


def test_bad_datasets_say_why(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        load_alpaca(str(tmp_path / "missing.json"), 1, TokenCounter(None), None)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_alpaca(str(tmp_path / "bad.json"), 1, TokenCounter(None), None)
    (tmp_path / "other.json").write_text(json.dumps([{"question": "x"}]))
    with pytest.raises(WorkloadError, match="not alpaca"):
        load_alpaca(str(tmp_path / "other.json"), 1, TokenCounter(None), None)
    with pytest.raises(WorkloadError, match="tokenizer"):
        TokenCounter(str(tmp_path / "none.model"))


def test_arrival_schedules():
    assert arrival_offsets(4, 2.0, "fixed") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    poisson = np.diff(arrival_offsets(20000, 10.0, "poisson", seed=3))
    assert abs(poisson.mean() - 0.1) < 0.005 and abs(poisson.std() / poisson.mean() - 1.0) < 0.05
    bursty = np.diff(arrival_offsets(20000, 10.0, "gamma", burstiness=0.25, seed=3))
    assert abs(bursty.mean() - 0.1) < 0.01
    assert abs(bursty.std() / bursty.mean() - 2.0) < 0.15          # CV of gamma = 1/sqrt(shape)
    with pytest.raises(WorkloadError):
        arrival_offsets(3, 0.0)
    with pytest.raises(WorkloadError):
        arrival_offsets(3, 1.0, "uniform")


def _result(send, ttft, gaps, prompt_len=10, ok=True):
    r = RequestResult(prompt_len=prompt_len, max_new_tokens=len(gaps) + 1, send_time=send, ok=ok)
    if ok:
        r.ttft, r.itl = ttft, list(gaps)
        r.output_tokens = len(gaps) + 1
        r.latency = ttft + sum(gaps)
        times = [send + ttft]
        for g in gaps:
            times.append(times[-1] + g)
        r.token_times = times
    else:
        r.error = "HTTP 500: boom"
    return r


def test_metric_definitions_match_vllm():
    results = [_result(0.0, 0.1, [0.02] * 9), _result(0.5, 0.3, [0.04] * 4, prompt_len=20),
               _result(1.0, 0.0, [], ok=False)]
    s = summarize(results, duration_s=2.0, percentiles=[50, 99])
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_output_tokens"] == 15 and s["total_input_tokens"] == 30
    assert s["output_throughput"] == pytest.approx(7.5) and s["request_throughput"] == pytest.approx(1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["median"] == pytest.approx(200.0)
    # TPOT per request = (E2EL - TTFT) / (tokens - 1): 20 ms and 40 ms
    assert s["tpot_ms"]["mean"] == pytest.approx(30.0)
    # ITL pools every gap: nine of 20 ms, four of 40 ms
    assert s["itl_ms"]["mean"] == pytest.approx((9 * 20 + 4 * 40) / 13)
    assert s["itl_ms"]["median"] == pytest.approx(20.0)
    assert s["e2el_ms"]["p99"] == pytest.approx(np.percentile([280.0, 460.0], 99))
    assert s["errors"] == {"HTTP 500: boom": 1}
    table = format_table(s)
    assert "Successful requests:" in table and "Median TPOT (ms):" in table and "HTTP 500" in table


def test_goodput_counts_requests_meeting_every_slo():
    results = [_result(0.0, 0.1, [0.02] * 9), _result(0.5, 0.3, [0.04] * 4)]
    assert parse_slos(["ttft:200", "tpot:50"]) == {"ttft": 200.0, "tpot": 50.0}
    s = summarize(results, 2.0, slos={"ttft": 200.0, "tpot": 50.0})
    assert s["goodput"]["good_requests"] == 1 and s["goodput"]["request_goodput"] == pytest.approx(0.5)
    for bad in (["ttft"], ["speed:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_slos(bad)


def test_timeline_bins_tokens_and_requests_in_flight():
    results = [_result(0.0, 0.1, [0.2] * 9), _result(1.2, 0.1, [0.1] * 4)]
    tl = timeline(results, duration_s=2.0, bin_s=1.0)
    assert tl["t_s"] == [0.5, 1.5]
    assert sum(tl["output_tok_s"]) == 15
    assert tl["running"] == [1, 2]
