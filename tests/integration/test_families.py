"""The dense families beyond LLaMA (Qwen3, Gemma 3, Phi-3/Phi-4-mini, SmolLM3), the sliding windows of Mistral
and Qwen2 and the mixtures of experts (Qwen3-MoE, Mixtral), each a tiny random model that transformers makes
(tests/families.py), through ModelRunner: the greedy tokens equal transformers' own, for a prompt inside the sliding
window and one three windows long (fed in chunks, so a window crosses chunk boundaries), from the HuggingFace
directory and from its GGUF twin, with the default float16 cache and a float32 one, on the layer kernel (every CPU
step) and on MindSpore's ops (the path Ascend runs; a mixture is refused there); the logits are within the precision
gate's 0.5% of the float64 reference (llm_serving/reference_llama.py), which computes each family's differences on its
own. A mixture's rows routed to different experts share a step, and its LoRA rows adapt its attention. gpt-oss
also as openai ships it: its experts MXFP4 blocks and scales in the safetensors, read as stored."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from llm_serving.models.runner_spec import RunnerSpec
from llm_serving.reference_llama import ReferenceLlama
from tests.families import (make_hf_model, needs_transformers, transformers_greedy, transformers_logits, write_gguf,
                            write_mxfp4_hf)
from tests.integration.server_harness import private_cache
from tests.integration.test_model_runner import Seq, greedy_logits, step_view

pytest.importorskip("mindspore")
needs_transformers()

SHORT = [1, 17, 42, 5, 77, 23, 9, 61, 30]                          # inside the 16-key windows
LONG = [1] + [(7 * i * i + 3 * i + 11) % 250 + 3 for i in range(47)]    # three windows
NEW_TOKENS = 12
CHUNK = 16                                                         # the prefill bucket: LONG goes in 3 chunks
FAMILIES = ["qwen3", "gemma3", "gemma3-mm", "phi3", "smollm3", "mistral-swa", "qwen2-swa", "qwen3moe", "mixtral",
            "gptoss"]
GGUF = ["qwen3", "gemma3", "phi3", "smollm3", "mistral-swa", "qwen2-swa", "qwen3moe", "mixtral", "gptoss"]
MOE = ["qwen3moe", "mixtral", "gptoss"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's directory, its GGUF twin (F32) and a Q8_0 one of Gemma 3; gpt-oss's directory with MXFP4
    experts, as openai ships it; the module's own cache directory (a GGUF load writes its float32 tensors there)."""
    root = tmp_path_factory.mktemp("families")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLM_SERVING_CACHE", str(private_cache(root / "cache")))
        out = {}
        for i, family in enumerate(FAMILIES):
            out[family] = str(make_hf_model(family, root / family, seed=i))
        for family in GGUF:
            out[family + "-gguf"] = str(write_gguf(family, out[family], root / f"{family}.gguf"))
        import gguf
        for family in ("gemma3", "qwen3moe"):
            out[f"{family}-gguf-q8_0"] = str(write_gguf(family, out[family], root / f"{family}.Q8_0.gguf",
                                                        qtype=gguf.GGMLQuantizationType.Q8_0))
        out["gptoss-gguf-mxfp4"] = str(write_gguf("gptoss", out["gptoss"], root / "gptoss.MXFP4_MOE.gguf",
                                                  qtype=gguf.GGMLQuantizationType.Q8_0,
                                                  expert_qtype=gguf.GGMLQuantizationType.MXFP4))
        out["gptoss-mxfp4"] = str(write_mxfp4_hf(out["gptoss"], root / "gptoss-mxfp4"))
        yield out


@functools.lru_cache(maxsize=None)
def _expected(path: str, prompt: tuple) -> list:
    return transformers_greedy(path, list(prompt), NEW_TOKENS)


def _clear(path: str, prompt: tuple) -> int:
    """How many of transformers' greedy tokens come before its first near-tie (a top-2 margin under 0.5% of the
    largest logit, the precision gate's bound), where a float16 cache's rounding may choose the other token."""
    tokens = _expected(path, prompt)
    logits = transformers_logits(path, list(prompt) + tokens[:-1])[len(prompt) - 1:]
    top2 = np.sort(logits, axis=1)[:, -2:]
    close = (top2[:, 1] - top2[:, 0]) < 0.005 * np.abs(logits).max(axis=1)
    return int(np.argmax(close)) if close.any() else len(tokens)


def _generate(path: str, prompt: list, *, cache: str = "float16", layer_kernel: str = "auto",
              keep_quantized: bool = True):
    """Greedy tokens and each step's logits through a ModelRunner: the prompt in chunks of CHUNK tokens, then one
    token a step."""
    from llm_serving.models.runner import ModelRunner

    runner = ModelRunner(path, RunnerSpec(num_blocks=16, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[1],
                                          prefill_batch_sizes=[1], prefill_seq_lens=[CHUNK], num_threads=2,
                                          kv_cache=cache, layer_kernel=layer_kernel,
                                          layer_kernel_rows=None if layer_kernel != "off" else 0,
                                          keep_quantized=keep_quantized))
    return greedy_logits(runner, prompt, NEW_TOKENS, chunk=CHUNK)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hf_directory_gives_transformers_greedy_tokens(models, family):
    for prompt in (SHORT, LONG):
        tokens, _ = _generate(models[family], prompt)
        assert tokens == _expected(models[family], tuple(prompt)), (family, len(prompt))
    assert len(set(tokens)) > 2                                            # not a degenerate repeat


@pytest.mark.parametrize("family", GGUF)
def test_the_gguf_twin_gives_the_same_tokens(models, family):
    tokens, _ = _generate(models[family + "-gguf"], LONG)
    assert tokens == _expected(models[family], tuple(LONG)), family


@pytest.mark.parametrize("model", ["gemma3-gguf-q8_0", "qwen3moe-gguf-q8_0", "gptoss-gguf-mxfp4"])
def test_a_quantized_gguf_is_read_as_stored_and_stays_within_the_gate(models, model):
    """Q8_0 matrices (the layer kernel reads their stored rows; a mixture's experts as 3-D tensors of the file), and
    gpt-oss's experts in MXFP4 beside Q8_0 attention (llama-quantize's MXFP4_MOE), against the float64 reference of
    the same file."""
    from llm_serving.models.weights import load_quantized

    assert {q.qtype for name, q in load_quantized(models[model]).items() if ".experts." in name} == (
        {39} if "mxfp4" in model else {8} if "qwen3moe" in model else set())          # read as stored
    tokens, logits = _generate(models[model], LONG)
    _check_against_reference(models[model], LONG, tokens, logits)


def test_gptoss_with_mxfp4_experts_from_safetensors_gives_transformers_greedy_tokens(models):
    """gpt-oss's HF directory as openai ships it (experts as MXFP4 blocks and scales, `quantization_config` mxfp4):
    its experts are read as stored (GGML's MXFP4 rows, for MoeMlp), the greedy tokens are transformers' on the same
    directory (which dequantizes MXFP4 itself), and the logits within the gate of the float64 reference (which reads
    the experts' float32 values); with keep_quantized off, the kernels read those float32 values, to the same
    tokens."""
    from llm_serving.models.weights import load_quantized

    path = models["gptoss-mxfp4"]
    assert {name: q.qtype for name, q in load_quantized(path).items()} == {
        f"model.layers.{i}.mlp.experts.{part}.weight": 39 for i in range(2) for part in ("gate_proj", "up_proj",
                                                                                         "down_proj")}
    for prompt in (SHORT, LONG):
        tokens, logits = _generate(path, prompt)
        assert tokens == _expected(path, tuple(prompt)), len(prompt)
    assert tokens != _expected(models["gptoss"], tuple(LONG))            # (MXFP4's model: not the float one's)
    _check_against_reference(path, LONG, tokens, logits)
    assert _generate(path, LONG, keep_quantized=False)[0] == tokens


@pytest.mark.parametrize("family", MOE)
def test_rows_routed_to_different_experts_in_one_step_get_their_own_tokens(models, family):
    """Four sequences prefilled together and decoded together, rows whose tokens choose different experts in the
    same step (checked by the reference's router): each row's greedy tokens are transformers' for its prompt alone,
    and its logits the float64 reference's within the gate."""
    from llm_serving.models.runner import ModelRunner

    path = models[family]
    prompts = [SHORT, LONG[:20], LONG[7:30], [1, 200, 13, 77, 4, 150]]
    runner = ModelRunner(path, RunnerSpec(num_blocks=32, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[4],
                                          prefill_batch_sizes=[4], prefill_seq_lens=[32], num_threads=2,
                                          kv_cache="float32"))
    ref = ReferenceLlama(path)
    states = [ref.new_sequence() for _ in prompts]
    seqs = [Seq([4 * i + j for j in range(4)]) for i in range(len(prompts))]
    new, fed, tokens, routes = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts], set()
    for _ in range(NEW_TOKENS):
        ids, _, logits = runner.execute(step_view(runner, seqs, new, return_logits=True))
        for row, toks in enumerate(new):
            want = ref.forward(states[row], toks, fed[row])[-1]
            fed[row] += len(toks)
            assert np.abs(logits[row] - want).max() <= 5e-3 * np.abs(want).max(), (family, row)
            tokens[row].append(int(ids[row]))
            routes.add(tuple(chosen[-1] for chosen in ref.routes.values()))     # its last token's, every layer
        new = [[int(t)] for t in ids]
    for row, prompt in enumerate(prompts):
        assert tokens[row] == _expected(path, tuple(prompt)), (family, row)
    assert len(routes) >= 4, routes                    # the rows' last tokens chose different experts


@pytest.mark.parametrize("family", ["gemma3", "phi3", "qwen2-swa", "qwen3moe", "gptoss"])
def test_a_float32_cache_gives_the_same_tokens(models, family):
    tokens, _ = _generate(models[family], LONG, cache="float32")
    assert tokens == _expected(models[family], tuple(LONG)), family


@pytest.mark.parametrize("family", ["gemma3", "phi3", "smollm3", "qwen3"])
def test_mindspore_ops_give_the_same_tokens(models, family):
    """The op-by-op path (Ascend's; here on the CPU with the layer kernel off): each family's differences there too."""
    tokens, _ = _generate(models[family], LONG, cache="float32", layer_kernel="off")
    assert tokens == _expected(models[family], tuple(LONG)), family


def _check_against_reference(path: str, prompt: list, tokens: list, logits: np.ndarray) -> None:
    ref = ReferenceLlama(path)
    seq = ref.new_sequence()
    want = [ref.forward(seq, prompt, 0)[-1]]
    for t in tokens[:-1]:
        want.append(ref.forward(seq, [t], seq.length)[-1])
    want = np.array(want)
    rel = np.abs(logits - want).max(axis=1) / np.abs(want).max(axis=1)
    assert rel.max() <= 0.005, rel


@pytest.mark.parametrize("family", MOE)
def test_a_mixture_on_mindspores_ops_is_refused_naming_the_layer_kernel(models, family):
    """The op-by-op path (Ascend's, tensor parallelism's) has no mixture-of-experts layer yet: the runner refuses
    it at start, saying where mixtures run."""
    with pytest.raises(ValueError, match="mixture of experts, which runs on the CPU layer kernel only"):
        _generate(models[family], SHORT, layer_kernel="off")


@pytest.mark.parametrize("family", ["gemma3", "phi3", "smollm3", "qwen3", "mistral-swa", "qwen3moe", "mixtral",
                                    "gptoss"])
def test_logits_are_within_the_precision_gate_of_the_float64_reference(models, family):
    tokens, logits = _generate(models[family], LONG)
    _check_against_reference(models[family], LONG, tokens, logits)
    assert [int(t) for t in tokens] == _expected(models[family], tuple(LONG))


SERVED = ["qwen3", "gemma3", "phi3", "smollm3", "mistral-swa", "qwen3moe", "mixtral", "gptoss"]
# plain-text prompts for the precision gate: each longer than the 16-key windows in the tiny models' vocabulary
GATE_PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside.",
                "The dog ran to the park with his red ball and his friend.",
                "Tom had a big box of toys. One day he wanted to share them."]


async def _completions(url: str, model: str, prompts: list) -> list:
    import aiohttp

    async def one(session, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        async with session.post(url + "/v1/completions", json=body) as resp:
            return resp.status, await resp.json()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        import asyncio
        return await asyncio.gather(*(one(session, p) for p in prompts))


# (family, the window pool's blocks: 0 off; 9 for 16-key windows in blocks of 8 is a few more than one request needs,
# so the pool runs out before the main one and preempts too)
SERVED_POOLS = [(family, 0) for family in SERVED] + [("gemma3", 9), ("mistral-swa", 9), ("gptoss", 9)]


@pytest.mark.parametrize("family, window_blocks", SERVED_POOLS)
def test_served_with_chunks_preemption_prefix_cache_and_ngram_speculation(models, family, window_blocks, tmp_path):
    """The real server on a family's directory, with everything that moves a request's tokens between steps and
    blocks: chunked prefill (16-token chunks, a window crossing them), a KV cache too small for the requests
    together (preemption, recomputation), the prefix cache (the long prompt twice) and n-gram speculation (the
    default; verify steps of proposed tokens); for sliding-window models also with their window pool, whose blocks
    leave a request as its window moves. Each request's text is transformers' greedy text, and the precision gate
    passes."""
    import asyncio

    from tokenizers import Tokenizer

    from tests.integration.server_harness import http, leftovers, precision_gate, serving

    path = models[family]
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    prompts = [SHORT, LONG, LONG, LONG[:30], [1] + LONG[20:], SHORT + LONG[5:20]]
    args = ["--model", path, "--set", "model_config.max_generate_length=64", "--set", "pa_config.block_size=8",
            "--set", "pa_config.num_blocks=20", "--set", "scheduler_config.kv_watermark=0",
            "--set", "scheduler_config.chunked_prefill=true", "--set", "scheduler_config.max_chunk_tokens=16",
            "--set", "serving_config.max_num_batched_tokens=24", "--set", "serving_config.max_num_seqs=6",
            "--set", f"pa_config.window_blocks={window_blocks}"]
    with serving(args, tmp_path / "server.log") as server:
        name = http("GET", server.url + "/info")[1]["model_id"]
        results = asyncio.run(_completions(server.url, name, prompts))
        for prompt, (status, body) in zip(prompts, results):
            assert status == 200, body
            # the tokens up to a near-tie (as the server writes them: no special tokens)
            # (a cut inside a character's bytes decodes to U+FFFD, which the server's text, going on, completes)
            want = tok.decode(_expected(path, tuple(prompt))[:_clear(path, tuple(prompt))],
                              skip_special_tokens=True).rstrip("\ufffd")
            assert body["choices"][0]["text"].startswith(want), (family, len(prompt))
        assert sum(_clear(path, tuple(p)) for p in prompts) >= len(prompts) * NEW_TOKENS // 3   # many compared
        stats = http("GET", server.url + "/stats")[1]
        gate_file = tmp_path / "prompts.txt"
        gate_file.write_text("\n".join(GATE_PROMPTS) + "\n")
        proc, result = precision_gate(server.url, tmp_path, "-n", "3", "--max-new-tokens", "8",
                                      "--prompts", str(gate_file))
    assert leftovers(server) == []
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    if window_blocks:                       # the pool served, and every block came back
        assert stats["window_pool"] == {"window": 16, "num_blocks": window_blocks, "num_free_blocks": window_blocks}
    else:
        assert stats["window_pool"] is None
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["greedy_agreement"] == 1.0 and result["max_rel_error"] < 5e-3


@pytest.mark.parametrize("family", ["phi3", "gemma3"])
def test_lora_rows_get_the_merged_models_logits(models, family, tmp_path):
    """A LoRA adapter on every projection, rows with and without it in one step, through MindSpore's ops (a
    prefill above the layer kernel's 16 tokens) and the layer kernel (decode): each row's logits are the float64
    reference's of its own weights (merged W + scale * B A, or the base). Phi-3's partial rotation reorders q/k
    rows at load, and their LoRA rows with them; Gemma 3's q/k and sandwich norms sit around the adapted products."""
    from llm_serving.models.lora import load_lora_adapter, merge_lora, random_lora_tensors, write_peft_adapter
    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.weights import load_llama_weights

    path = models[family]
    cfg, weights = load_llama_weights(path)
    tensors = random_lora_tensors(cfg, 4, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"), seed=3, std=0.15)
    adapter = load_lora_adapter("a", write_peft_adapter(tmp_path / "a", tensors, r=4, lora_alpha=8), cfg, max_rank=4)
    runner = ModelRunner(path, RunnerSpec(num_blocks=16, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[2],
                                          prefill_batch_sizes=[2], prefill_seq_lens=[32], num_threads=2,
                                          kv_cache="float32", lora_slots=1, lora_rank=4, layer_kernel_rows=16))
    runner.set_lora(1, adapter)
    refs = [ReferenceLlama(path), ReferenceLlama(path)]
    refs[1].w = {k: np.asarray(v, np.float64) for k, v in merge_lora(weights, adapter).items()}
    seqs, slots = [Seq([0, 1, 2]), Seq([3, 4, 5])], [1, 0]
    prompts = [LONG[:30], LONG[10:38]]
    states = [ref.new_sequence() for ref in (refs[1], refs[0])]
    new, fed = prompts, [0, 0]
    for step_index in range(4):
        ids, _, logits = runner.execute(step_view(runner, seqs, new, return_logits=True, lora=slots))
        for row, (slot, toks) in enumerate(zip(slots, new)):
            ref = refs[slot]
            want = ref.forward(states[row], toks, fed[row])[-1]
            fed[row] += len(toks)
            scale = np.abs(want).max()
            assert np.abs(logits[row] - want).max() <= 2e-3 * scale, (family, step_index, row)
        new = [[int(t)] for t in ids]
    base = ReferenceLlama(path).forward(ReferenceLlama(path).new_sequence(), prompts[0], 0)[-1]
    adapted = refs[1].forward(refs[1].new_sequence(), prompts[0], 0)[-1]
    assert np.abs(base - adapted).max() > 0.05 * np.abs(base).max()          # the adapter matters


@pytest.mark.parametrize("family", MOE)
def test_a_mixtures_lora_rows_get_the_merged_models_logits(models, family, tmp_path):
    """An adapter on every attention projection (and on the dense MLP of Qwen3-MoE's layer 1), rows with and without
    it in each step, all on the layer kernel (a mixture's only path): each row's logits are the float64 reference's
    of its own weights. An adapter on a mixture layer's MLP is refused, naming the layer."""
    from llm_serving.models.lora import (LoraError, load_lora_adapter, merge_lora, random_lora_tensors,
                                         write_peft_adapter)
    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.weights import load_llama_weights

    path = models[family]
    cfg, weights = load_llama_weights(path)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    tensors = random_lora_tensors(cfg, 4, attention, seed=3, std=0.15)
    dense = [i for i in range(cfg.num_layers) if not cfg.layer_moe(i)]
    tensors.update(random_lora_tensors(cfg, 4, ("gate_proj", "up_proj", "down_proj"), seed=4, std=0.15, layers=dense))
    adapter = load_lora_adapter("a", write_peft_adapter(tmp_path / "a", tensors, r=4, lora_alpha=8), cfg, max_rank=4)
    runner = ModelRunner(path, RunnerSpec(num_blocks=16, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[2],
                                          prefill_batch_sizes=[2], prefill_seq_lens=[32], num_threads=2,
                                          kv_cache="float32", lora_slots=1, lora_rank=4))
    runner.set_lora(1, adapter)
    refs = [ReferenceLlama(path), ReferenceLlama(path)]
    refs[1].w = {k: np.asarray(v, np.float64) for k, v in merge_lora(weights, adapter).items()}
    seqs, slots = [Seq([0, 1, 2]), Seq([3, 4, 5])], [1, 0]
    states = [refs[1].new_sequence(), refs[0].new_sequence()]
    new, fed = [LONG[:30], LONG[10:38]], [0, 0]
    for _ in range(4):
        ids, _, logits = runner.execute(step_view(runner, seqs, new, return_logits=True, lora=slots))
        for row, (slot, toks) in enumerate(zip(slots, new)):
            want = refs[slot].forward(states[row], toks, fed[row])[-1]
            fed[row] += len(toks)
            assert np.abs(logits[row] - want).max() <= 2e-3 * np.abs(want).max(), (family, row)
        new = [[int(t)] for t in ids]
    base = ReferenceLlama(path).forward(ReferenceLlama(path).new_sequence(), LONG[:30], 0)[-1]
    adapted = refs[1].forward(refs[1].new_sequence(), LONG[:30], 0)[-1]
    assert np.abs(base - adapted).max() > 0.05 * np.abs(base).max()          # the adapter matters
    moe_layer = next(i for i in range(cfg.num_layers) if cfg.layer_moe(i))
    expert_mlp = random_lora_tensors(cfg, 4, ("up_proj",), layers=[moe_layer]) if dense else {
        f"base_model.model.model.layers.{moe_layer}.mlp.up_proj.lora_{ab}.weight": np.zeros(shape, np.float32)
        for ab, shape in (("A", (4, cfg.hidden_size)), ("B", (cfg.expert_intermediate_size, 4)))}
    with pytest.raises(LoraError, match=f"adapts layer {moe_layer}'s MLP, a mixture of experts"):
        load_lora_adapter("b", write_peft_adapter(tmp_path / "b", expert_mlp, r=4, lora_alpha=8), cfg)
