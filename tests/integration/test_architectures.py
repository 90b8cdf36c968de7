"""The LLaMA family's members through the MindSpore model: a Qwen2-style checkpoint (q/k/v biases, tied
embeddings, rope_theta 1e6), a Llama-3.1-style one (llama3 RoPE scaling that changes the frequencies within the
test's positions, untied) and that Llama-3.1 model's GGUF twins (rope_freqs tensor, q/k rows permuted as llama.cpp
writes them; F32, and Q8_0 as llama.cpp quantizes). Each generates greedily through ModelRunner; the logits of every step are within the precision
gate's 0.5% of the float64 reference (llm_serving/reference_llama.py, which computes the llama3 scaling itself from
config.json), the greedy tokens equal the reference's, and the F32 GGUF twin's text equals the HF form's."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from llm_serving.models.default_model import write_hf_llama
from llm_serving.models.runner_spec import RunnerSpec
from tests.integration.server_harness import private_cache
from tests.integration.test_model_runner import greedy_logits
from llm_serving.reference_llama import ReferenceLlama

pytest.importorskip("mindspore")

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=128)
PROMPT = [1, 17, 42, 5, 77, 23, 9, 61, 30]
NEW_TOKENS = 24
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _checkpoint(path, *, config: dict, tie: bool, biases: bool, scale: float):
    """A random HF checkpoint with weights `scale` times write_hf_llama's std 0.02, large enough that greedy choices
    are clear (near-uniform logits' argmax may break differently in float32 and float64) and varied (the scales
    were chosen by the smallest top-2 margin of the reference's logits: 0.8% and 1.4% of the largest logit)."""
    from safetensors.numpy import load_file, save_file

    write_hf_llama(path, seed=7, tie_word_embeddings=tie, **SHAPE)
    rng = np.random.default_rng(7)
    weights = {k: (v * scale if v.ndim == 2 else v)
               for k, v in load_file(str(path / "model.safetensors")).items()}
    if biases:
        d = SHAPE["hidden_size"] // SHAPE["num_heads"]
        for i in range(SHAPE["num_layers"]):
            for part, heads in (("q", SHAPE["num_heads"]), ("k", SHAPE["num_kv_heads"]), ("v", SHAPE["num_kv_heads"])):
                weights[f"model.layers.{i}.self_attn.{part}_proj.bias"] = \
                    rng.normal(0, 0.5, heads * d).astype(np.float32)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **config}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The checkpoints, and for the module's length a cache directory of its own: a GGUF load writes its float32
    tensors there (models/weights/gguf.py), which would otherwise be ~/.cache/llm-serving, one entry a run."""
    root = tmp_path_factory.mktemp("archs")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLM_SERVING_CACHE", str(private_cache(root / "cache")))
        yield _write_models(root)


def _write_models(root) -> dict:
    import gguf

    qwen2 = _checkpoint(root / "qwen2", tie=True, biases=True, scale=20.0,
                        config={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_theta": 1e6,
                                "use_sliding_window": False, "sliding_window": 4096})
    llama3 = _checkpoint(root / "llama3", tie=False, biases=False, scale=10.0,
                         config={"rope_theta": 500000.0, "rope_scaling": LLAMA3})
    from llm_serving.models.weights import load_llama_weights
    from tests.unit.test_weights_formats import write_gguf
    cfg, weights = load_llama_weights(llama3)
    twin = dict(theta=500000.0, heads=SHAPE["num_heads"], kv_heads=SHAPE["num_kv_heads"],
                rope_freqs=cfg.rope_freq_factors)
    f32 = write_gguf(root / "llama3.gguf", weights, **twin)
    q8 = write_gguf(root / "llama3.Q8_0.gguf", weights, qtype=gguf.GGMLQuantizationType.Q8_0, **twin)
    return {"qwen2": str(qwen2), "llama3": str(llama3), "llama3-gguf": str(f32), "llama3-gguf-q8_0": str(q8)}


@functools.lru_cache(maxsize=None)
def _generate(path: str):
    """Greedy tokens and each step's logits through a ModelRunner (one runner per model in this module)."""
    from llm_serving.models.runner import ModelRunner

    runner = ModelRunner(path, RunnerSpec(num_blocks=8, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[1],
                                          prefill_batch_sizes=[1], prefill_seq_lens=[16], num_threads=2))
    return greedy_logits(runner, PROMPT, NEW_TOKENS)


def _reference(path: str, tokens: list) -> np.ndarray:
    """The float64 reference's logits for the prompt and then the served tokens (teacher-forced)."""
    ref = ReferenceLlama(path)
    seq = ref.new_sequence()
    out = [ref.forward(seq, PROMPT, 0)[-1]]
    for t in tokens[:-1]:
        out.append(ref.forward(seq, [t], seq.length)[-1])
    return np.array(out)


@pytest.mark.parametrize("name", ["qwen2", "llama3", "llama3-gguf", "llama3-gguf-q8_0"])
def test_greedy_tokens_and_logits_match_the_float64_reference(models, name):
    tokens, logits = _generate(models[name])
    ref = _reference(models[name], tokens)
    rel = np.abs(logits - ref).max(axis=1) / np.abs(ref).max(axis=1)
    assert rel.max() <= 0.005, rel
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 1e-3 * np.abs(ref).max(axis=1)    # steps whose argmax is not a near-tie
    assert clear.sum() >= NEW_TOKENS - 2
    assert [t for t, c in zip(tokens, clear) if c] == [int(r) for r, c in zip(ref.argmax(axis=1), clear) if c]
    assert len(set(tokens)) > 3                                                 # not a degenerate repeat


def test_gguf_twin_generates_the_same_text_as_its_hf_form(models):
    """llama.cpp's q/k permutation undone at load: the same weights in both forms give the same tokens."""
    hf_tokens, hf_logits = _generate(models["llama3"])
    gguf_tokens, gguf_logits = _generate(models["llama3-gguf"])
    assert gguf_tokens == hf_tokens
    np.testing.assert_allclose(gguf_logits, hf_logits, rtol=1e-5, atol=1e-4 * np.abs(hf_logits).max())


def test_rope_scaling_and_biases_matter(models):
    """The checks above could pass with the scaling or the biases ignored on both sides: the reference itself
    must change when they are dropped."""
    tokens, _ = _generate(models["llama3"])
    ref = _reference(models["llama3"], tokens)
    plain = ReferenceLlama(models["llama3"])
    plain.inv_freq = 1.0 / (500000.0 ** (np.arange(0, 16, 2) / 16))
    seq = plain.new_sequence()
    unscaled = plain.forward(seq, PROMPT + tokens[:-1], 0)
    assert np.abs(unscaled[len(PROMPT) - 1:] - ref).max() > 0.01 * np.abs(ref).max()
    qwen = ReferenceLlama(models["qwen2"])
    with_bias = qwen.forward(qwen.new_sequence(), PROMPT, 0)
    for k in [k for k in qwen.w if k.endswith("_proj.bias")]:
        qwen.w[k] = np.zeros_like(qwen.w[k])
    assert np.abs(qwen.forward(qwen.new_sequence(), PROMPT, 0) - with_bias).max() > 0.01 * np.abs(with_bias).max()


def test_a_qwen2_directory_with_tokenizer_json_serves(tmp_path):
    """`llm-serving start --model DIR` for a HuggingFace Qwen2 directory whose tokenizer is a byte-level BPE
    tokenizer.json with a ChatML template: TGI and OpenAI chat requests are answered, and the stream adds up."""
    from tokenizers import Tokenizer as HFTok, decoders, models as tok_models, pre_tokenizers, trainers

    from tests.integration.server_harness import http, parse_sse, serving

    words = "the quick brown fox jumps over the lazy dog 中文 🙂 2024".split()
    tok = HFTok(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = tmp_path / "tiny-qwen2"
    write_hf_llama(model, seed=3, tie_word_embeddings=True, **{**SHAPE, "vocab_size": tok.get_vocab_size()})
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1e6}))
    from safetensors.numpy import load_file, save_file
    weights = load_file(str(model / "model.safetensors"))
    for i in range(SHAPE["num_layers"]):
        for part, rows in (("q", 64), ("k", 32), ("v", 32)):
            weights[f"model.layers.{i}.self_attn.{part}_proj.bias"] = np.zeros(rows, np.float32)
    save_file(weights, str(model / "model.safetensors"))
    tok.save(str(model / "tokenizer.json"))
    template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
                "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    small = ["--model", str(model), "--set", "model_config.seq_length=[32]", "--set", "model_config.prefill_batch_size=[1]",
             "--set", "model_config.decode_batch_size=[1]", "--set", "model_config.max_generate_length=32",
             "--set", "serving_config.max_num_seqs=1", "--set", "pa_config.num_blocks=8"]
    with serving(small, tmp_path / "server.log") as server:
        status, info = http("GET", server.url + "/info")
        assert info["model_id"] == "tiny-qwen2" and info["tokenizer_path"].endswith("tokenizer.json")
        params = {"max_new_tokens": 8, "ignore_eos": True}
        status, body = http("POST", server.url + "/generate", {"inputs": "the quick 中文", "parameters": params})
        assert status == 200 and body["details"]["generated_tokens"] == 8, body
        assert body["details"]["prompt_tokens"] == len(tok.encode("the quick 中文").ids)     # no BOS: none wanted
        status, text = http("POST", server.url + "/generate_stream", {"inputs": "the quick 中文", "parameters": params})
        assert "".join(e["token"]["text"] for e in parse_sse(text)) == body["generated_text"]
        status, chat = http("POST", server.url + "/v1/chat/completions", {
            "model": "tiny-qwen2", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200, chat
        expected = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n").ids
        assert chat["usage"]["prompt_tokens"] == len(expected) and expected.count(1) == 2     # ChatML as ids
