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


# bench/make_models.py and bench/peers.py: made models by short name, memory of a process tree, KV sizing

def test_made_models_resolve_by_short_name(tmp_path):
    from bench.make_models import model_path, resolve_short_name, short_name

    made = model_path("1b", "Q4_K_M", tmp_path)
    made.parent.mkdir(parents=True)
    made.write_bytes(b"GGUF")
    assert short_name("1b", "Q4_K_M") == "1b-q4km"
    for name in ("1b-q4km", "1B-Q4_K_M", "1b-q4_k_m"):
        assert resolve_short_name(name, tmp_path) == made
    assert resolve_short_name("2b-q4km", tmp_path) is None                # not a made size
    assert resolve_short_name("model.gguf", tmp_path) is None
    with pytest.raises(FileNotFoundError, match="make_models.py --sizes 3b --type Q4_K_M"):
        resolve_short_name("3b-q4km", tmp_path)
    with pytest.raises(FileNotFoundError, match="--sizes 1b --type Q8_0"):
        resolve_short_name("1b-q80", tmp_path)


def test_peers_model_argument(tmp_path, monkeypatch):
    from bench import peers

    monkeypatch.setenv("LLM_SERVING_PEERS", str(tmp_path))
    made = tmp_path / "models" / "bench-llama-8b-Q4_K_M.gguf"
    made.parent.mkdir(parents=True)
    made.write_bytes(b"GGUF")
    assert peers.resolve_model("8b-q4km") == str(made)
    assert peers.resolve_model(str(made)) == str(made)
    assert peers.resolve_model("builtin:tiny-llama") == "builtin:tiny-llama"
    assert peers.resolve_model(None) is None


def test_made_model_tensors_have_the_llama_bodies():
    from bench.make_models import SIZES, tensor_plan

    plan = tensor_plan(SIZES["1b"], 49152)
    assert len(plan) == 2 + 16 * 9 + 1
    shapes = dict((n, s) for n, s, _ in plan)
    assert shapes["blk.0.attn_q.weight"] == (2048, 2048) and shapes["blk.0.attn_k.weight"] == (512, 2048)
    assert shapes["blk.15.ffn_down.weight"] == (2048, 8192) and shapes["output.weight"] == (49152, 2048)
    params = sum(int(np.prod(s)) for _, s, _ in tensor_plan(SIZES["8b"], 49152))
    assert 7.0e9 < params < 7.6e9                 # Llama-3.1-8B less 128k-49k vocabulary rows, twice


class _FakeProc:
    def __init__(self, pss, rss, gone=False):
        self.pss, self.rss, self.gone = pss, rss, gone

    def memory_full_info(self):
        import psutil
        if self.gone:
            raise psutil.NoSuchProcess(1)
        return type("M", (), {"pss": self.pss, "rss": self.rss})()


def test_memory_sums_over_the_process_tree_and_skips_the_gone():
    import subprocess
    import sys

    from bench.common import sum_memory, tree_memory

    assert sum_memory([_FakeProc(10, 30), _FakeProc(5, 20), _FakeProc(7, 7, gone=True)]) == \
        {"pss": 15, "rss": 50, "processes": 2}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import os
        mine = tree_memory(os.getpid())
        assert mine["processes"] >= 2 and 0 < mine["pss"] <= mine["rss"]
    finally:
        child.kill()
        child.wait()
    assert tree_memory(2 ** 22 + 12345) == {"pss": 0, "rss": 0, "processes": 0}


def test_peers_warm_up_prompts_are_never_measured_ones():
    """Each level warms up with one request a stream and measures max(rounds x streams, 4) requests, of the
    lengths asked for; no measured prompt is a warm-up prompt or another level's (a prompt cache would then time
    the cache, not prefill)."""
    from bench.peers import level_samples
    from tests.conftest import TOK512

    levels = level_samples([1, 4, 8], 2, str(TOK512), 12, 5)
    assert {s: (len(w), len(m)) for s, (w, m) in levels.items()} == {1: (1, 4), 4: (4, 8), 8: (8, 16)}
    seen = []
    for warm, measured in levels.values():
        assert all(x.prompt_len == 12 and x.max_new_tokens == 5 for x in warm + measured)
        seen += [x.prompt for x in warm + measured]
    assert len(set(seen)) == len(seen)


def test_kv_cache_sized_to_the_same_tokens():
    from bench.peers import kv_sets

    assert kv_sets([], 1000, 544) == (["pa_config.num_blocks=63", "model_config.max_generate_length=544"], 16)
    assert kv_sets(["pa_config.block_size=32"], 1000, 544)[0][0] == "pa_config.num_blocks=32"
    assert kv_sets(["pa_config.num_blocks=7", "model_config.max_generate_length=99"], 1000, 544) == ([], 16)


def test_f32_copy_left_out_for_k_quants_and_big_files(tmp_path, monkeypatch):
    import gguf

    from bench import peers

    def write(path, qtype, row_bytes):
        w = gguf.GGUFWriter(str(path), arch="llama")
        w.add_tensor("a.weight", np.zeros((2, row_bytes), np.uint8), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write(tmp_path / "k.gguf", gguf.GGMLQuantizationType.Q4_K, 144)
    write(tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0, 34)
    assert "K-quant tensors (Q4_K)" in peers.f32_copy_skip_reason(str(tmp_path / "k.gguf"))
    assert peers.f32_copy_skip_reason(str(tmp_path / "q8.gguf")) is None
    monkeypatch.setattr(peers, "F32_COPY_MAX_BYTES", 64)
    assert "GiB file" in peers.f32_copy_skip_reason(str(tmp_path / "q8.gguf"))


def test_kv_tokens_padded_as_llama_cpp_pads_a_slot(tmp_path):
    from bench.peers import kv_tokens_for, llama_kv_line

    assert kv_tokens_for(529, [1]) == 768
    assert kv_tokens_for(176, [1, 16, 64]) == 256 * 64
    assert kv_tokens_for(529, [1, 8], asked=1000) == 1024
    log = tmp_path / "l.log"
    log.write_text("0.05.412 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 768, kv_unified = 'false'\n")
    assert llama_kv_line(log) == "4 x 768 tokens"
    assert llama_kv_line(tmp_path / "none.log") is None


FAKE_LLAMA_SERVER = """#!{python}
import http.server, os, signal, sys
if "--no-repack" not in sys.argv and "{mode}" == "signal":
    os.kill(os.getpid(), signal.SIGSEGV)        # as a build whose AMX repacking the host refuses
if "{mode}" == "exit":
    sys.exit(1)
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{{}}")

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.mark.parametrize("mode", ["signal", "exit"])
def test_llama_server_dying_of_a_signal_at_start_is_retried_with_no_repack(tmp_path, mode):
    """bench.common.with_llama_server: a server killed by a signal at start runs again with --no-repack, and the
    caller learns the flag; one that exits with an error is not retried (its error is the caller's)."""
    import sys

    from bench.common import http, with_llama_server
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, mode=mode))
    fake.chmod(0o755)
    work = lambda peer: http("GET", peer.url + "/health")[0]          # noqa: E731
    if mode == "exit":
        with pytest.raises(RuntimeError, match="exited with 1"):
            with_llama_server([str(fake), "-m", "model.gguf"], tmp_path / "log", work)
        return
    assert with_llama_server([str(fake), "-m", "model.gguf"], tmp_path / "log", work) == (200, ["--no-repack"])
    # given the flag, the next server starts with it at once
    assert with_llama_server([str(fake)], tmp_path / "log", work, ["--no-repack"]) == (200, ["--no-repack"])


def test_made_qwen3_and_gemma3_bodies_have_their_architectures_tensors(tmp_path):
    from bench.make_models import SIZES, resolve_short_name, tensor_plan

    qwen = dict((n, s) for n, s, _ in tensor_plan(SIZES["qwen3-4b"], 49152))
    assert qwen["blk.0.attn_q_norm.weight"] == (128,) and qwen["blk.35.attn_k_norm.weight"] == (128,)
    assert "output.weight" not in qwen and qwen["blk.0.attn_q.weight"] == (4096, 2560)      # tied; 32 x 128 heads
    gemma = dict((n, s) for n, s, _ in tensor_plan(SIZES["gemma3-4b"], 49152))
    assert gemma["blk.33.post_ffw_norm.weight"] == (2560,) and gemma["blk.0.attn_q_norm.weight"] == (256,)
    assert len(gemma) == 1 + 34 * 13 + 1
    params = sum(int(np.prod(s)) for s in gemma.values())
    assert 3.2e9 < params < 3.5e9                 # Gemma-3-4B (3.88e9) less 213k of its 262k vocabulary rows
    with pytest.raises(FileNotFoundError, match="--sizes gemma3-4b --type Q4_K_M"):
        resolve_short_name("gemma3-4b-q4km", tmp_path)


def test_made_qwen3_moe_body_has_a_router_and_expert_stacks_per_layer(tmp_path):
    """Qwen3-30B-A3B cut to 8 layers: each layer's router (128, 2048) and gate/up (128, 768, 2048) and down
    (128, 2048, 768) expert stacks in place of the dense MLP, q/k head norms, an untied output; 5.2 G values."""
    from bench.make_models import SIZES, resolve_short_name, tensor_plan, tensor_values

    plan = tensor_plan(SIZES["qwen3moe-30b"], 49152)
    moe = dict((n, s) for n, s, _ in plan)
    assert moe["blk.7.ffn_gate_inp.weight"] == (128, 2048) and moe["blk.0.ffn_up_exps.weight"] == (128, 768, 2048)
    assert moe["blk.0.ffn_down_exps.weight"] == (128, 2048, 768) and moe["blk.0.attn_k_norm.weight"] == (128,)
    assert "blk.0.ffn_gate.weight" not in moe and moe["output.weight"] == (49152, 2048)
    assert len(moe) == 1 + 8 * 12 + 2           # per layer 2 + 1 + 4 + 1 norms and attention, 4 of the MoE
    assert 5.1e9 < sum(int(np.prod(s)) for s in moe.values()) < 5.3e9
    stack = tensor_values("blk.0.ffn_down_exps.weight", (3, 4, 5), "matrix", 0)      # a 3-D stack, filled whole
    assert stack.shape == (3, 4, 5) and stack.dtype == np.float16 and np.all(stack != 0)
    with pytest.raises(FileNotFoundError, match="--sizes qwen3moe-30b --type Q4_K_M"):
        resolve_short_name("qwen3moe-30b-q4km", tmp_path)


def test_made_gpt_oss_body_has_biases_sinks_and_expert_stacks():
    """gpt-oss-20b cut to 6 layers: q/k/v/o biases, a sink per head and the expert biases (F32 zeros), the MLP norm
    as post_attention_norm, 32 expert stacks of 2,880 x 2,880; 5.2 G values."""
    from bench.make_models import SIZES, tensor_plan, tensor_values

    plan = tensor_plan(SIZES["gptoss-20b"], 49152)
    oss = {n: (s, k) for n, s, k in plan}
    assert oss["blk.5.attn_sinks.weight"] == ((64,), "bias") and oss["blk.0.attn_q.bias"] == ((4096,), "bias")
    assert oss["blk.0.ffn_up_exps.bias"] == ((32, 2880), "bias") and oss["blk.0.ffn_gate_inp.bias"] == ((32,), "bias")
    assert oss["blk.0.ffn_down_exps.weight"] == ((32, 2880, 2880), "matrix")
    assert "blk.0.ffn_norm.weight" not in oss and oss["blk.0.post_attention_norm.weight"] == ((2880,), "norm")
    assert 5.1e9 < sum(int(np.prod(s)) for s, _ in oss.values()) < 5.3e9
    assert not tensor_values("blk.0.attn_q.bias", (4,), "bias", 0).any()


def test_retrieval_scores_rank_each_querys_own_document(tmp_path):
    """bench/retrieval.py: recall@k and MRR from the cosine ranks (query i's document is i), and the sample: seeded,
    outputs too short or repeated left out, an input joined to its instruction."""
    import numpy as np

    from bench.retrieval import sample, scores

    docs = np.eye(4)
    queries = docs[[0, 1, 3, 2]] * 0.9 + 0.1 * docs                # queries 2 and 3 nearest the other's document
    assert scores(queries / np.linalg.norm(queries, axis=1, keepdims=True), docs) == {
        "recall@1": 0.5, "recall@5": 1.0, "mrr": 0.75}
    records = [{"instruction": f"Q{i}", "input": "ctx" if i == 1 else "", "output": f"an answer long enough {i}"}
               for i in range(6)] + [{"instruction": "Short", "input": "", "output": "No"},
                                     {"instruction": "Again", "input": "", "output": "an answer long enough 0"}]
    (tmp_path / "alpaca.json").write_text(__import__("json").dumps(records))
    q, d = sample(tmp_path / "alpaca.json", 6, seed=1)
    assert sorted(d) == sorted(f"an answer long enough {i}" for i in range(6))
    assert all(qi == f"Q{di[-1]}" + ("\nctx" if di.endswith("1") else "") for qi, di in zip(q, d))
    assert sample(tmp_path / "alpaca.json", 6, seed=1) == (q, d)


def test_a_start_is_settled_once_its_warmup_rest_and_its_panels_write_are_done():
    from bench.common import start_settled

    ready = "agent 0: warmup done in 0.1 s for a first request; the rest when idle\n"
    assert start_settled("agent 0: warmup done in 9.0 s\n")                       # not staged, nothing written
    assert not start_settled(ready)
    assert start_settled(ready + "agent 0: warmup complete\n")
    writing = ("repacked weights: 0.00 GB memory-mapped as an earlier start kept them, 2.27 GB repacked into files "
               "kept for the next (/c/panels/k)\n")
    assert not start_settled(ready + "agent 0: warmup complete\n" + writing)
    assert start_settled(ready + writing + "agent 0: warmup complete\nrepacked weights kept on disk for the next "
                                           "start: 2.27 GB in 4.5 s (/c/panels/k)\n")
    assert start_settled(writing.replace("2.27 GB repacked", "0.00 GB repacked"))     # all read: nothing to write
    # repacked after the load (kernels/repack.py's LaterRepacks): settled once repacked, and the panels written
    nothing_kept = writing.replace("2.27 GB repacked", "0.00 GB repacked")
    later = "2.17 GB to repack after the load, on background threads; the stored rows serve until then\n"
    done = "repacked after the load: 2.17 GB in 3.9 s\n"
    assert not start_settled(later)
    assert start_settled(later + done)
    # (its line comes once the panels kept are written, the load's own too: nothing more to wait for)
    assert not start_settled(writing + later)
    assert start_settled(writing + later + "repacked weights kept on disk for the next start: 2.27 GB in 7.5 s "
                                           "(/c/panels/k)\n" + done)
    assert start_settled(nothing_kept + later + done)
