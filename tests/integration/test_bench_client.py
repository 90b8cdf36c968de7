"""The load client against real servers on loopback: an OpenAI/TGI-compatible stand-in with known token
timings (so the measured TTFT, TPOT and ITL can be checked), failures of every kind, and this project."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.request

import pytest
from aiohttp import web

from tests.integration.server_harness import free_port

TTFT_S, ITL_S = 0.15, 0.05


class StandIn:
    """An aiohttp server in its own thread: /v1/completions and /generate_stream stream `max tokens`
    tokens, the first after TTFT_S, then one every ITL_S. Prompts steer failures: "FAIL500" -> HTTP 500,
    "CUT" -> the connection drops after two tokens, "ERR" -> an error event after two tokens, "SHORT" -> only
    two tokens (as if EOS came early; /v1/completions only)."""

    def __init__(self):
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    async def _tokens(self, request, prompt, n, event):
        if "FAIL500" in prompt:
            return web.json_response({"error": {"message": "internal failure"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(TTFT_S)
        for i in range(n):
            if i == 2 and "CUT" in prompt:
                request.transport.close()
                return resp
            if i == 2 and "ERR" in prompt:
                await resp.write(b'data: {"error": "agent died", "error_type": "generation"}\n\n')
                return resp
            if i:
                await asyncio.sleep(ITL_S)
            await resp.write(b"data: " + json.dumps(event(i, i == n - 1)).encode() + b"\n\n")
        return resp

    async def completions(self, request):
        body = await request.json()
        n = int(body["max_tokens"]) if "SHORT" not in body["prompt"] else 2   # "SHORT": an early EOS

        def chunk(i, last):
            return {"object": "text_completion", "model": body["model"],
                    "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}]}
        resp = await self._tokens(request, body["prompt"], n, chunk)
        if isinstance(resp, web.StreamResponse) and not resp.prepared:
            return resp
        if not request.transport or request.transport.is_closing():
            return resp
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}).encode()
                         + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def tgi(self, request):
        body = await request.json()
        n = int(body["parameters"]["max_new_tokens"])

        def event(i, last):
            return {"token": {"id": i, "text": f" t{i}", "logprob": 0.0, "special": False},
                    "generated_text": "..." if last else None, "details": None}
        return await self._tokens(request, body["inputs"], n, event)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate_stream", self.tgi)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def standin():
    with StandIn() as s:
        yield s


def _sharegpt(path, prompts, reply_words):
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": p},
                                                   {"from": "gpt", "value": " ".join(["w"] * reply_words)}]}
                                for p in prompts]))
    return path


def _bench(tmp_path, *args):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "llm_serving.cli", "bench", "--result-file", str(out),
                           "--no-progress", *args], capture_output=True, text=True, timeout=300)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("backend", ["openai", "tgi"])
def test_measures_known_token_timings_of_another_server(standin, tmp_path, backend):
    data = _sharegpt(tmp_path / "d.json", [f"prompt {i}" for i in range(6)], reply_words=8)
    proc, result = _bench(tmp_path, "--backend", backend, "--url", standin.url, "--dataset", "sharegpt",
                          "--dataset-path", str(data), "-n", "6", "--request-rate", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = result["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (6, 0, 48)
    if backend == "openai":
        assert result["model"] == "standin"                       # asked from /v1/models
    # the stand-in's sleeps are lower bounds; the loaded machine adds, never subtracts
    assert TTFT_S * 1000 <= s["ttft_ms"]["median"] < TTFT_S * 1000 * 1.5
    assert ITL_S * 1000 * 0.9 <= s["itl_ms"]["median"] < ITL_S * 1000 * 1.5
    assert ITL_S * 1000 * 0.9 <= s["tpot_ms"]["median"] < ITL_S * 1000 * 1.5
    expected_e2el = (TTFT_S + 7 * ITL_S) * 1000
    assert expected_e2el * 0.95 <= s["e2el_ms"]["median"] < expected_e2el * 1.5
    assert all(r["output_tokens"] == 8 and len(r["itl"]) == 7 for r in result["requests"])
    # fixed rate 20/s: sends 50 ms apart
    sends = sorted(r["send_time"] for r in result["requests"])
    assert sends[-1] == pytest.approx(0.25, abs=0.1)
    assert "Median TTFT (ms):" in proc.stdout
    assert all(p.endswith(".png") for p in result["plots"]) and len(result["plots"]) == 2


def test_server_errors_mid_run_are_counted_not_fatal(standin, tmp_path):
    prompts = ["ok 1", "FAIL500 a", "ok 2", "CUT b", "ok 3", "ERR c", "ok 4"]
    data = _sharegpt(tmp_path / "d.json", prompts, reply_words=5)
    proc, result = _bench(tmp_path, "--backend", "openai", "--url", standin.url, "--dataset", "sharegpt",
                          "--dataset-path", str(data), "-n", "7", "--max-concurrency", "3")
    assert proc.returncode == 1
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (4, 3)
    errors = " | ".join(s["errors"])
    assert "HTTP 500" in errors and "internal failure" in errors
    assert "agent died" in errors                                    # error event mid-stream
    assert len(s["errors"]) == 3                                     # the dropped stream is the third kind
    failed = [r for r in result["requests"] if not r["ok"]]
    assert sorted(r["prompt_len"] for r in failed) == [2, 2, 2]
    assert "failed x1" in proc.stdout


def test_short_stream_under_ignore_eos_is_a_failure(standin, tmp_path):
    """With ignore_eos the client insists on max_new_tokens; without it an early end is fine."""
    data = _sharegpt(tmp_path / "d.json", ["SHORT hello"], reply_words=3)
    common = ["--backend", "openai", "--url", standin.url, "--dataset", "sharegpt", "--dataset-path", str(data),
              "--model", "other"]
    proc, result = _bench(tmp_path, *common)
    assert proc.returncode == 1 and result["model"] == "other"
    assert result["summary"]["errors"] == {"expected 3 output tokens (ignore_eos), got 2": 1}
    proc, result = _bench(tmp_path, *common, "--no-ignore-eos")
    assert proc.returncode == 0 and result["summary"]["total_output_tokens"] == 2


def test_unreachable_server_gives_a_result_counting_failures(tmp_path):
    data = _sharegpt(tmp_path / "d.json", ["a", "b", "c"], reply_words=2)
    url = f"http://127.0.0.1:{free_port()}"
    proc, result = _bench(tmp_path, "--url", url, "--dataset", "sharegpt", "--dataset-path", str(data))
    assert proc.returncode == 1
    assert result["summary"]["failed"] == 3 and result["summary"]["completed"] == 0
    assert "cannot connect" in next(iter(result["summary"]["errors"]))
    assert "every request failed" in proc.stdout and "Traceback" not in proc.stderr


def test_missing_dataset_and_bad_arguments_exit_2_with_a_message(tmp_path, standin):
    proc, result = _bench(tmp_path, "--backend", "openai", "--url", standin.url,
                          "--dataset-path", str(tmp_path / "nope.json"))
    assert proc.returncode == 2 and "not found" in proc.stderr and "Traceback" not in proc.stderr
    assert result["error"].endswith("not found") and result["completed"] == 0
    proc, _ = _bench(tmp_path, "--backend", "openai", "--url", standin.url, "--dataset", "synthetic",
                     "--duration", "5")
    assert proc.returncode == 2 and "--duration needs a finite --request-rate" in proc.stderr
    proc, _ = _bench(tmp_path, "--backend", "openai", "--url", standin.url, "--dataset", "synthetic",
                     "--goodput", "latency:5")
    assert proc.returncode == 2 and "--goodput" in proc.stderr


def scrape(url: str) -> dict:
    """/metrics as {(name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_against_this_project_with_alpaca(stories_server, alpaca_standin, tmp_path):
    before = scrape(stories_server.url)
    during, done = [], threading.Event()

    def watch():                       # /metrics scraped while the load runs
        while not done.wait(0.05):
            during.append(scrape(stories_server.url))
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        proc, result = _bench(tmp_path, "--url", stories_server.url, "--dataset", "alpaca",
                              "--dataset-path", str(alpaca_standin),
                              "--request-rate", "8", "--duration", "1", "--max-new-tokens", "24", "--profile")
    finally:
        done.set()
        watcher.join()
    after = scrape(stories_server.url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["model"] == "hf" and result["token_counts"] == "exact"    # tokenizer from /info
    # --profile: where the server's steps spent their time during this run
    profile = result["step_profile"]
    # at least the longest request's steps: its prompt, then 23 tokens, up to 8 per step (decode runs)
    assert profile["steps"] >= 1 + -(-(24 - 1) // 8)
    ms = profile["ms_per_step"]
    assert ms["model"] > 0 and ms["loop"] > ms["model"]
    assert ms["loop"] >= sum(ms[k] for k in ("schedule", "shm_write", "round_trip", "agent_other", "model",
                                             "output")) * 0.99
    assert "Step profile" in proc.stdout and "model (ModelRunner.execute)" in proc.stdout
    s = result["summary"]
    assert s["completed"] == 8 and s["failed"] == 0
    expected = sum(min(r["max_new_tokens"], 24) for r in result["requests"])
    assert s["total_output_tokens"] == expected                            # ignore_eos: exact lengths

    # the server's /metrics agree with the load client's totals
    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after[key] - before.get(key, 0.0)
    assert delta("llm_serving_generation_tokens_total") == s["total_output_tokens"]
    assert delta("llm_serving_prompt_tokens_total") == s["total_input_tokens"] + s["completed"]   # + BOS each
    assert delta("llm_serving_requests_finished_total", finish_reason="length") == s["completed"] == 8
    for hist in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"llm_serving_{hist}_count") == 8
    assert 0 < delta("llm_serving_time_to_first_token_seconds_sum") < delta("llm_serving_e2e_request_latency_seconds_sum")
    assert max(m[("llm_serving_num_requests_running", ())] for m in during) >= 1
    assert max(m[("llm_serving_kv_blocks_used", ())] for m in during) >= 1
    assert after[("llm_serving_kv_blocks_used", ())] == 0 and after[("llm_serving_up", ())] == 1
    assert s["ttft_ms"]["median"] > 0 and s["tpot_ms"]["median"] > 0


def test_openai_and_tgi_backends_count_the_same_tokens_as_the_native_one(stories_server, alpaca_standin, tmp_path):
    totals = {}
    for backend in ("llm-serving", "openai", "tgi"):
        proc, result = _bench(tmp_path, "--backend", backend, "--url", stories_server.url, "--model", "hf",
                              "--dataset", "alpaca", "--dataset-path", str(alpaca_standin),
                              "-n", "6", "--request-rate", "inf", "--max-new-tokens", "12", "--seed", "3")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        s = result["summary"]
        assert s["completed"] == 6 and s["failed"] == 0
        totals[backend] = (s["total_input_tokens"], s["total_output_tokens"])
    assert totals["openai"] == totals["tgi"] == totals["llm-serving"], totals
