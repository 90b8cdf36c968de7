"""Prompt log-probabilities (what lm-evaluation-harness's log-likelihood tasks read) on the pretrained stories260K
model, against the float64 reference: OpenAI's echo with logprobs (max_tokens 0 and 1), vLLM's prompt_logprobs
(completions and chat), TGI's decoder_input_details; a prompt prefilled in chunks, and one whose blocks the prefix
cache holds, are scored whole."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving.reference_llama import ReferenceLlama
from tests.integration.server_harness import http

TOLERANCE = 0.02        # nats: the float16 KV cache and float32 arithmetic against float64


@pytest.fixture(scope="module")
def reference(stories_dir):
    return ReferenceLlama(str(stories_dir / "hf"))


def _reference_logprobs(reference, ids) -> np.ndarray:
    """log p(ids[p] | ids[:p]) for p >= 1, float64."""
    logits = reference.forward(reference.new_sequence(), ids, 0)
    logits = logits - logits.max(axis=1, keepdims=True)
    lsm = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return np.array([lsm[p - 1, ids[p]] for p in range(1, len(ids))]), lsm


def _ids(url, text):
    status, body = http("POST", url + "/tokenize", {"prompt": text})
    assert status == 200, body
    return body["tokens"]


def test_echo_with_logprobs_scores_the_prompt_as_the_reference_does(stories_server, reference):
    url = stories_server.url
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    ids = _ids(url, text)
    expected, lsm = _reference_logprobs(reference, ids)
    for max_tokens in (0, 1):
        status, body = http("POST", url + "/v1/completions", {"model": "hf", "prompt": ids, "echo": True,
                                                              "logprobs": 2, "max_tokens": max_tokens,
                                                              "temperature": 0})
        assert status == 200, body
        choice = body["choices"][0]
        lp = choice["logprobs"]
        n = len(ids)
        assert len(lp["tokens"]) == n + max_tokens and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        np.testing.assert_allclose(lp["token_logprobs"][1:n], expected, atol=TOLERANCE)
        for p in range(1, n):               # the top two after each prompt token: the reference's likeliest first
            assert abs(max(lp["top_logprobs"][p].values()) - lsm[p - 1].max()) < TOLERANCE
        assert choice["text"].startswith(text)
        assert body["usage"]["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert choice["text"] == text and choice["finish_reason"] == "length"


def test_vllm_prompt_logprobs_tgi_prefill_and_chunked_or_cached_prompts(stories_server, reference):
    url = stories_server.url
    # 300+ tokens: more than one prefill chunk of this config (max_num_batched_tokens 256)
    text = " ".join(["The cat sat on the mat and the dog ran to the park."] * 24)
    ids = _ids(url, text)[:250]
    expected, lsm = _reference_logprobs(reference, ids)
    for attempt in range(2):            # the second time the prefix cache holds the prompt's blocks
        status, body = http("POST", url + "/v1/completions", {"model": "hf", "prompt": ids, "max_tokens": 2,
                                                              "prompt_logprobs": 1, "temperature": 0})
        assert status == 200, body
        scores = body["choices"][0]["prompt_logprobs"]
        assert len(scores) == len(ids) and scores[0] is None
        got = np.array([scores[p][str(ids[p])]["logprob"] for p in range(1, len(ids))])
        np.testing.assert_allclose(got, expected, atol=TOLERANCE)
        for p in range(1, len(ids)):       # its rank: the reference's, up to near-ties
            target, rank = lsm[p - 1, ids[p]], scores[p][str(ids[p])]["rank"]
            assert (lsm[p - 1] > target + TOLERANCE).sum() + 1 <= rank <= (lsm[p - 1] > target - TOLERANCE).sum() + 1
    status, body = http("POST", url + "/v1/chat/completions", {"model": "hf", "prompt_logprobs": 0, "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == \
        body["usage"]["prompt_tokens"], body
    status, body = http("POST", url + "/generate", {"inputs": text[:80], "parameters": {
        "max_new_tokens": 1, "decoder_input_details": True}})
    assert status == 200, body
    prefill = body["details"]["prefill"]
    short = _ids(url, text[:80])
    assert [t["id"] for t in prefill] == short and prefill[0]["logprob"] is None
    np.testing.assert_allclose([t["logprob"] for t in prefill[1:]], _reference_logprobs(reference, short)[0],
                               atol=TOLERANCE)
    for body, param in (({"model": "hf", "prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"model": "hf", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"model": "hf", "prompt": "x", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens")):
        status, answer = http("POST", url + "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


def test_smollm2_scores_prompts_across_chunks_and_rows_as_the_reference_does(smollm2_server):
    """SmolLM2 served with 128-token prefill chunks: a 200-token prompt is scored over two chunks (the chunk's last
    token scores the next chunk's first), two prompts at once share steps; against the float64 reference of the
    same GGUF."""
    from concurrent.futures import ThreadPoolExecutor

    url = smollm2_server.url
    status, info = http("GET", url + "/info")
    reference = ReferenceLlama(info["model_path"])
    texts = [" ".join(f"Item {i} costs {i * 3} dollars." for i in range(30)),
             "The quick brown fox jumps over the lazy dog. " * 6]
    prompts = [_ids(url, t) for t in texts]
    assert len(prompts[0]) > 150

    def score(ids):
        return http("POST", url + "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": ids,
                                                      "max_tokens": 0, "echo": True, "logprobs": 0})
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(score, prompts))
    for ids, (status, body) in zip(prompts, answers):
        assert status == 200, body
        got = body["choices"][0]["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == len(ids)
        np.testing.assert_allclose(got[1:], _reference_logprobs(reference, ids)[0], atol=0.05)


def test_agents_that_pad_prefill_refuse_prompt_scores_with_a_400_and_serve_the_rest(stories_dir, tmp_path):
    """Without the CPU paged-attention kernel (as on Ascend) prefill steps are padded, not packed, and carry no
    logits but each row's last: a request for prompt log-probabilities is refused naming the field, before it can
    share (and fail) a step with others."""
    from tests.integration.server_harness import REPO, serving
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
            "--set", "model_config.attention_kernel=off", "--set", "model_config.seq_length=[16,64]",
            "--set", "model_config.max_generate_length=64"]
    with serving(args, tmp_path / "server.log") as server:
        for path, body in (("/v1/completions", {"model": "hf", "prompt": "Once upon", "max_tokens": 1,
                                                "prompt_logprobs": 1}),
                           ("/v1/completions", {"model": "hf", "prompt": "Once upon", "max_tokens": 0, "echo": True,
                                                "logprobs": 0})):
            status, err = http("POST", server.url + path, body)
            assert status == 400 and err["error"]["param"] == "prompt_logprobs", err
            assert "packed prefill" in err["error"]["message"]
        status, err = http("POST", server.url + "/generate", {"inputs": "Once upon", "parameters": {
            "max_new_tokens": 2, "decoder_input_details": True}})
        assert status == 400 and "packed prefill" in err["error"], err
        status, body = http("POST", server.url + "/v1/completions", {"model": "hf", "prompt": "Once upon a time",
                                                                     "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
