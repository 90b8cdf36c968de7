"""LoRA adapters served end to end: stories260K with two random PEFT adapters (lora_config.adapters), against a
second server whose model is the merged W + scale * B A of one of them. An adapter is picked by the OpenAI
`model` field, by /models/{adapter}/generate and by TGI's parameters.adapter_id; requests of the base model and
both adapters share steps; unknown adapters are 404s; an adapter that does not fit refuses the start."""
from __future__ import annotations

import asyncio
import json
import shutil

import aiohttp
import numpy as np
import pytest
from safetensors.numpy import save_file

from llm_serving.models.lora import load_lora_adapter, merge_lora, random_lora_tensors, write_peft_adapter
from llm_serving.models.weights import load_llama_weights
from tests.integration.server_harness import REPO, ServerProcess, http, leftovers, serving

PROMPTS = ["Once upon a time", "Tom had a red ball", "The little bird"]
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _stories_args(model_dir, *sets):
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(model_dir)]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.fixture(scope="module")
def adapters(stories_dir, tmp_path_factory):
    """Two adapters (all projections, rank 4; q/v/down, rank 8 with rsLoRA) and the merged model of the first."""
    pytest.importorskip("mindspore")
    hf = stories_dir / "hf"
    cfg, weights = load_llama_weights(str(hf))
    tmp = tmp_path_factory.mktemp("lora")
    a = write_peft_adapter(tmp / "tales", random_lora_tensors(cfg, 4, ALL, seed=1, std=0.2), r=4, lora_alpha=8)
    b = write_peft_adapter(tmp / "fables", random_lora_tensors(cfg, 8, ("q_proj", "v_proj", "down_proj"), seed=2,
                                                                std=0.2), r=8, lora_alpha=8, use_rslora=True)
    merged_dir = tmp / "merged"
    merged_dir.mkdir()
    for name in ("config.json", "tokenizer.model"):
        shutil.copy(hf / name, merged_dir / name)
    merged = merge_lora(weights, load_lora_adapter("tales", a, cfg))
    save_file({k: np.ascontiguousarray(v) for k, v in merged.items()}, str(merged_dir / "model.safetensors"),
              metadata={"format": "pt"})
    c = write_peft_adapter(tmp / "rhymes", random_lora_tensors(cfg, 2, ("o_proj", "up_proj"), seed=5, std=0.3),
                           r=2, lora_alpha=4)
    d = write_peft_adapter(tmp / "myths", random_lora_tensors(cfg, 6, ("k_proj", "gate_proj"), seed=6, std=0.2),
                           r=6, lora_alpha=6)
    return hf, {"tales": a, "fables": b, "rhymes": c, "myths": d}, merged_dir


@pytest.fixture(scope="module")
def lora_server(adapters, tmp_path_factory):
    hf, paths, _ = adapters
    spec = json.dumps(paths)
    with serving(_stories_args(hf, f"lora_config.adapters={spec}", "lora_config.max_loras=6"),
                 tmp_path_factory.mktemp("lora_server") / "server.log") as server:
        yield server


def _greedy(url, model, prompt, n=24, route="openai"):
    if route == "openai":
        status, body = http("POST", url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                                              "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        return body["choices"][0]["text"]
    path, params = (f"/models/{model}/generate", {}) if route == "path" else ("/generate", {"adapter_id": model})
    status, body = http("POST", url + path, {"inputs": prompt, "parameters": {"max_new_tokens": n,
                                                                               "ignore_eos": True, **params}})
    assert status == 200, body
    return body["generated_text"]


def test_adapters_are_listed_as_models_of_the_base(lora_server):
    status, body = http("GET", lora_server.url + "/v1/models")
    assert status == 200
    assert [(m["id"], m.get("parent")) for m in body["data"]] == \
        [("hf", None), ("tales", "hf"), ("fables", "hf"), ("rhymes", "hf"), ("myths", "hf")]
    assert "LoRA adapter 'tales' (rank 4" in lora_server.log()


def test_an_adapter_gives_the_merged_models_greedy_text(lora_server, adapters, tmp_path):
    _, _, merged_dir = adapters
    with serving(_stories_args(merged_dir), tmp_path / "merged.log") as merged:
        want = [_greedy(merged.url, "merged", p) for p in PROMPTS]
    for prompt, text in zip(PROMPTS, want):
        assert _greedy(lora_server.url, "tales", prompt) == text
        assert _greedy(lora_server.url, "tales", prompt, route="path") == text
        assert _greedy(lora_server.url, "tales", prompt, route="adapter_id") == text
    base = [_greedy(lora_server.url, "hf", p) for p in PROMPTS]
    assert base != want                                   # the adapter changes what the model says


def test_base_and_adapters_share_steps_each_row_its_own(lora_server):
    """Ten requests at once (the base model and four adapters, two prompts): each gets the text it gets alone."""
    url = lora_server.url
    models = ("hf", "tales", "fables", "rhymes", "myths")
    jobs = [(m, p) for p in PROMPTS[:2] for m in models]
    alone = {job: _greedy(url, *job, n=32) for job in jobs}
    for p in PROMPTS[:2]:
        assert len({alone[(m, p)] for m in models}) == 5, alone       # five different models

    async def together():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one(model, prompt):
                async with session.post(url + "/v1/completions", json={
                        "model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0,
                        "ignore_eos": True}) as r:
                    return (await r.json())["choices"][0]["text"]
            return await asyncio.gather(*(one(*job) for job in jobs))

    _, before = http("GET", url + "/stats")
    texts = asyncio.run(together())
    assert dict(zip(jobs, texts)) == alone
    _, after = http("GET", url + "/stats")
    shared = {int(k) for k, v in after["batch_sizes"].get("decode", {}).items()
              if v > before["batch_sizes"].get("decode", {}).get(k, 0)}
    assert max(shared) >= 5, after["batch_sizes"]   # rows of three models or more (two rows each) in one step


def test_unknown_adapters_are_404_in_each_api(lora_server):
    url = lora_server.url
    status, body = http("POST", url + "/v1/completions", {"model": "nope", "prompt": "Hi", "max_tokens": 2})
    assert status == 404 and "'nope' does not exist" in body["error"]["message"] and "'tales'" in body["error"]["message"]
    status, body = http("POST", url + "/models/nope/generate", {"inputs": "Hi"})
    assert status == 404 and "'nope'" in body["error"]
    status, body = http("POST", url + "/generate", {"inputs": "Hi", "parameters": {"adapter_id": "nope"}})
    assert status == 404 and "adapter_id" in body["error"]
    status, body = http("POST", url + "/models/tales/generate", {"inputs": "Hi",
                                                                  "parameters": {"adapter_id": "fables"}})
    assert status in (400, 422) and "differs from the path" in body["error"], body


def test_an_adapter_that_does_not_fit_refuses_the_start(adapters, tmp_path):
    hf, _, _ = adapters
    cfg, _ = load_llama_weights(str(hf))
    tensors = random_lora_tensors(cfg, 4, ("o_proj",), seed=3)
    name = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
    tensors[name] = np.zeros((4, cfg.hidden_size + 8), np.float32)
    bad = write_peft_adapter(tmp_path / "bad", tensors, r=4, lora_alpha=4)
    server = ServerProcess(_stories_args(hf, f"lora_config.adapters={{odd: {bad}}}"), tmp_path / "bad.log")
    try:
        assert server.proc.wait(120) == 2
    finally:
        server.stop()
    log = server.log()
    assert "lora_config.adapters.odd" in log and name in log and f"(r, {cfg.hidden_size})" in log, log
    assert leftovers(server) == []


def test_adapters_load_and_unload_at_run_time(lora_server, adapters, tmp_path):
    """vLLM's routes: an adapter loaded into a free slot is served at once (and listed), names and slots are
    not double-booked, one that does not fit changes nothing; an unloaded one is gone, and the adapter loaded
    next into its slot does not reuse the KV its prompts left in the prefix cache."""
    url = lora_server.url
    hf, paths, _ = adapters
    prompt = "Once upon a time there was a little girl named Lily. She liked to play in the park with"

    def load(name, path):
        return http("POST", url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def unload(name):
        return http("POST", url + "/v1/unload_lora_adapter", {"lora_name": name})

    status, body = load("tales2", paths["tales"])
    assert status == 200 and body["slot"] == 5 and body["rank"] == 4, body
    assert "tales2" in [m["id"] for m in http("GET", url + "/v1/models")[1]["data"]]
    tales_text = _greedy(url, "tales", prompt)
    assert _greedy(url, "tales2", prompt) == tales_text
    assert load("tales2", paths["fables"])[0] == 409 and load("hf", paths["fables"])[0] == 409

    cfg, _ = load_llama_weights(str(hf))
    tensors = random_lora_tensors(cfg, 4, ("q_proj",), seed=4)
    bad_name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors[bad_name] = np.zeros((cfg.hidden_size - 8, 4), np.float32)
    status, body = load("odd", write_peft_adapter(tmp_path / "odd", tensors, r=4, lora_alpha=4))
    assert status == 400 and bad_name in body["error"]["message"], body
    status, body = load("odd", tmp_path / "missing")
    assert status == 400 and "not a directory" in body["error"]["message"], body

    assert load("x", paths["fables"])[0] == 200                               # slot 6: every slot is used now
    status, body = load("y", paths["tales"])                                   # served, loaded on first use
    assert status == 200 and body["slot"] is None, body
    assert _greedy(url, "y", prompt) == tales_text                             # into the slot used longest ago
    assert unload("y")[0] == 200

    assert unload("tales2")[0] == 200 and unload("tales2")[0] == 404
    assert http("POST", url + "/v1/completions", {"model": "tales2", "prompt": "Hi", "max_tokens": 2})[0] == 404
    status, body = load("z", paths["fables"])                                  # into the slot tales2 left
    assert status == 200 and body["slot"] is not None
    assert _greedy(url, "z", prompt) == _greedy(url, "fables", prompt) != tales_text
    assert unload("x")[0] == 200 and unload("z")[0] == 200
    assert [m["id"] for m in http("GET", url + "/v1/models")[1]["data"]] == ["hf", *paths]


def test_more_adapters_than_slots_take_turns_in_one_slot(adapters, tmp_path):
    """max_loras 1 and two adapters: a request whose adapter is in no slot waits until the slot's adapter has no
    running request, then it is loaded there (the longest unused goes); every request gets its own text, alone
    or all at once, and the prefix cache never gives one adapter's KV to the other."""
    hf, paths, _ = adapters
    two = {m: paths[m] for m in ("tales", "fables")}
    with serving(_stories_args(hf, f"lora_config.adapters={json.dumps(two)}", "lora_config.max_loras=1"),
                 tmp_path / "server.log") as server:
        url = server.url
        prompt = "Once upon a time there was a little girl named Lily. She liked to play in the park with"
        alone = {m: _greedy(url, m, prompt, n=20) for m in ("tales", "fables", "hf", "tales")}
        assert len(set(alone.values())) == 3
        jobs = [m for _ in range(3) for m in ("tales", "fables", "hf")]

        async def together():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                async def one(model):
                    async with session.post(url + "/v1/completions", json={
                            "model": model, "prompt": prompt, "max_tokens": 20, "temperature": 0,
                            "ignore_eos": True}) as r:
                        return (await r.json())["choices"][0]["text"]
                return await asyncio.gather(*(one(m) for m in jobs))

        assert asyncio.run(together()) == [alone[m] for m in jobs]
        log = server.log()
        assert "LoRA adapter 'tales' leaves slot 1 (used longest ago)" in log, log
        assert "LoRA adapter 'fables' (rank 8, q_proj/v_proj/down_proj) in slot 1" in log, log


def test_a_restarted_agent_serves_the_adapters_loaded_at_run_time(lora_server, adapters):
    """The supervisor starts a new agent from the LoRA registry's snapshot, which holds the adapters loaded since."""
    import os
    import signal
    import time

    url = lora_server.url
    _, paths, _ = adapters
    status, body = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": paths["fables"]})
    assert status == 200, body
    want = _greedy(url, "late", PROMPTS[0])
    assert want == _greedy(url, "fables", PROMPTS[0])
    [agent] = lora_server.agent_pids()
    os.kill(agent, signal.SIGKILL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        status, stats = http("GET", url + "/stats")
        if status == 200 and stats["num_agent_restarts"] == 1 and stats["unavailable_reason"] is None:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the agent did not come back: {stats}")
    assert _greedy(url, "late", PROMPTS[0]) == want
    assert _greedy(url, "tales", PROMPTS[0]) != want
    assert http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200


def test_two_tensor_parallel_ranks_serve_the_adapters_as_one_agent_does(lora_server, adapters, tmp_path):
    """Each rank holds B's rows of its heads and units for q/k/v and gate/up and A's columns of its input for o
    and down; the greedy text under every adapter is the one agent's."""
    hf, paths, _ = adapters
    want = {(m, p): _greedy(lora_server.url, m, p) for m in ("hf", *paths) for p in PROMPTS[:2]}
    tp2 = ["serving_config.agent_ports=[0,0]", "model_config.decode_batch_size=[1,8,16]",
           "serving_config.max_num_seqs=16", f"lora_config.adapters={json.dumps(paths)}", "lora_config.max_loras=6"]
    with serving(_stories_args(hf, *tp2), tmp_path / "tp.log") as tp:
        got = {(m, p): _greedy(tp.url, m, p) for m in ("hf", *paths) for p in PROMPTS[:2]}
    assert got == want
