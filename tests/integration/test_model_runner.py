"""ModelRunner on the real stories260K checkpoint: greedy reproduction of llama2.c, paged-cache
layout independence, chunked prefill, in-graph sampling and log-probabilities; plus the weight loader."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_serving.models.runner_spec import RunnerSpec
from llm_serving.models.weights import LlamaConfig, WeightLoadError, load_llama_weights
from llm_serving.shm.layout import StepView
from tests.conftest import FLOAT16_CACHE_LOGPROB_ATOL, STORIES, TOK512

MODEL_DIR = STORIES / "hf"
BOS = 1
TOTAL_STEPS = 200     # llama2.c `steps`: forwards at positions 0..199, BOS and prompt included
# the runner the module's tests build (the fixture's, and the others with one setting changed)
# a float32 cache: these tests hold the paths (kernels, MindSpore's ops, decode runs) to each other within 1e-4; a
# float16 cache's rounding turns their last-bit differences into float16 steps (the default cache is compared
# across paths in test_paged_attention_kernel_matches_the_gather_path, and served in test_correctness)
STORIES_RUNNER = dict(num_blocks=64, block_size=16, max_blocks_per_seq=13, decode_batch_sizes=[1, 2],
                      prefill_batch_sizes=[1, 2], prefill_seq_lens=[16, 32], num_threads=2, kv_cache="float32")


@pytest.fixture(scope="module")
def tokenizer():
    spm = pytest.importorskip("sentencepiece")
    return spm.SentencePieceProcessor(model_file=str(TOK512))


@pytest.fixture(scope="module")
def reference():
    return json.loads((STORIES / "greedy_reference.json").read_text())


@pytest.fixture(scope="module")
def runner():
    pytest.importorskip("mindspore")
    from llm_serving.models.runner import ModelRunner
    return ModelRunner(str(MODEL_DIR), RunnerSpec(**STORIES_RUNNER))


@pytest.fixture(scope="module")
def small_block_runner():
    pytest.importorskip("mindspore")
    from llm_serving.models.runner import ModelRunner
    return ModelRunner(str(MODEL_DIR), RunnerSpec(num_blocks=128, block_size=4, max_blocks_per_seq=52,
                                                  decode_batch_sizes=[1], prefill_batch_sizes=[1],
                                                  prefill_seq_lens=[16], num_threads=2))


# ----------------------------------------------------------------------------------------------- driver
class Seq:
    """A sequence with its own blocks; tracks how many of its tokens are in the cache."""

    def __init__(self, blocks):
        self.blocks = list(blocks)
        self.cached = 0


def step(runner, seqs, new_tokens, *, temperature=None, top_k=None, top_p=None, random_u=None, top_n=None):
    """One execute() over `seqs`, each getting its list of new tokens (left-aligned, padded)."""
    return runner.execute(step_view(runner, seqs, new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                    random_u=random_u, top_n=None if top_n is None else np.asarray(top_n, np.int32)))


def step_view(runner, seqs, new_tokens, *, kind=None, return_logits=False, **arrays):
    """The StepView execute() takes for `seqs` (step_arrays'; arrays: its sampling arrays, and more by name:
    top_n, lora, verify_random_u, ...). Its kind: verify with verify_random_u, else prefill or decode."""
    sampling = {k: arrays.pop(k) for k in ("temperature", "top_k", "top_p", "random_u") if k in arrays}
    step = step_arrays(runner, seqs, new_tokens, **sampling)
    if kind is None:
        kind = ("verify" if "verify_random_u" in arrays else "prefill" if step["input_ids"].shape[1] > 1
                else "decode")
    return StepView(kind, return_logits=return_logits, **step, **arrays)


def run_view(input_ids, positions, slot_mapping, block_tables, context_lens, **arrays):
    """The StepView of a decode run: row i feeds input_ids[i] at positions[i] and its K steps write to
    slot_mapping[i] (n, K)."""
    column = lambda a: np.asarray(a, np.int32).reshape(-1, 1)     # noqa: E731
    return StepView("decode_run", input_ids=column(input_ids), positions=column(positions),
                    slot_mapping=slot_mapping, block_tables=block_tables, context_lens=context_lens, **arrays)


def step_arrays(runner, seqs, new_tokens, *, temperature=None, top_k=None, top_p=None, random_u=None) -> dict:
    """A step's input arrays by name for `seqs` (advancing each seq's cached count)."""
    n, s = len(seqs), max(len(t) for t in new_tokens)
    bs, w = runner.block_size, max(len(q.blocks) for q in seqs)
    ids = np.zeros((n, s), np.int32)
    pos = np.zeros((n, s), np.int32)
    slots = np.full((n, s), -1, np.int32)
    tables = np.zeros((n, w), np.int32)
    ctx = np.zeros(n, np.int32)
    qlen = np.zeros(n, np.int32)
    for i, (seq, toks) in enumerate(zip(seqs, new_tokens)):
        p = np.arange(seq.cached, seq.cached + len(toks))
        ids[i, :len(toks)] = toks
        pos[i, :len(toks)] = p
        slots[i, :len(toks)] = np.asarray(seq.blocks)[p // bs] * bs + p % bs
        tables[i, :len(seq.blocks)] = seq.blocks
        ctx[i] = seq.cached + len(toks)
        qlen[i] = len(toks)
        seq.cached += len(toks)
    f = lambda v, d, dt: np.full(n, d, dt) if v is None else np.asarray(v, dt)  # noqa: E731
    return dict(input_ids=ids, positions=pos, slot_mapping=slots, block_tables=tables, context_lens=ctx,
                query_lens=qlen, temperature=f(temperature, 0.0, np.float32), top_k=f(top_k, 0, np.int32),
                top_p=f(top_p, 1.0, np.float32), random_u=f(random_u, 0.0, np.float32))


def generate(runner, prompts, block_lists, *, max_len=TOTAL_STEPS + 1, max_steps=None):
    """Greedy, llama2.c stopping rule: prefill all prompts in one call, then decode the still-active ones
    together; a sequence stops on BOS or when it holds max_len tokens. Returns (tokens, logprobs) lists."""
    seqs = [Seq(b) for b in block_lists]
    out = [list(p) for p in prompts]
    lps = [[] for _ in prompts]
    nxt, lp = step(runner, seqs, prompts)
    active = list(range(len(prompts)))
    steps = 0
    while active:
        still = []
        for j, i in enumerate(active):
            if nxt[j] == BOS:
                continue
            out[i].append(int(nxt[j]))
            lps[i].append(float(lp[j]))
            if len(out[i]) < max_len:
                still.append(i)
        active = still
        steps += 1
        if not active or (max_steps is not None and steps >= max_steps):
            break
        nxt, lp = step(runner, [seqs[i] for i in active], [[out[i][-1]] for i in active])
    return out, lps


def greedy_logits(runner, prompt, new_tokens: int, *, chunk=None, blocks=(0, 1, 2, 3)):
    """One sequence's `new_tokens` greedy tokens and each one's step logits (new_tokens, V): its prompt in chunks of
    `chunk` tokens (None: whole), then one token a step."""
    seq, tokens, logits = Seq(blocks), [], []
    chunk = chunk or len(prompt)
    chunks = [list(prompt[i:i + chunk]) for i in range(0, len(prompt), chunk)]
    for part in chunks[:-1]:
        runner.execute(step_view(runner, [seq], [part]))
    new = chunks[-1]
    for _ in range(new_tokens):
        token, _, step_logits = runner.execute(step_view(runner, [seq], [new], return_logits=True))
        tokens.append(int(token[0]))
        logits.append(step_logits[0])
        new = [tokens[-1]]
    return tokens, np.array(logits)


def blocks_for(seq_index, n_blocks):
    return list(range(seq_index * n_blocks, (seq_index + 1) * n_blocks))


# ------------------------------------------------------------------------------------- numpy reference
def np_forward_last_logits(cfg: LlamaConfig, w: dict, tokens) -> np.ndarray:
    """Plain float64 HF-LLaMA forward over `tokens`; logits of the last position."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    t, d, nh, kvh = len(tokens), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def norm(x, g):
        return g * x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps)

    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rope(x):  # (T, heads, D)
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos + rot * sin

    x = w["model.embed_tokens.weight"][tokens]
    causal = np.tril(np.ones((t, t), bool))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, d))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kvh, d))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kvh, d)
        k, v = np.repeat(k, nh // kvh, axis=1), np.repeat(v, nh // kvh, axis=1)
        att = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        att = np.where(causal[None], att, -np.inf)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", att, v).reshape(t, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        g, u = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    return norm(x[-1], w["model.norm.weight"]) @ w["lm_head.weight"].T


def np_log_softmax(z):
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def np_sample(logits, temperature, top_k, top_p, u):
    """The sampling rule of sampler.py, in numpy float64."""
    v = len(logits)
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if (top_k <= 0 or top_k >= v) and top_p >= 1.0:
        probs = np.exp(z - z.max())
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), v - 1))
    order = np.argsort(-z, kind="stable")
    zs = z[order]
    k = top_k if top_k > 0 else v
    keep = np.arange(v) < k
    probs = np.where(keep, np.exp(zs - zs.max()), 0.0)
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    keep &= (before < top_p) | (top_p >= 1.0)
    keep[0] = True
    kept = np.where(keep, probs, 0.0)
    cdf = np.cumsum(kept)
    pick = min(np.searchsorted(cdf, u * cdf[-1], side="right"), int(keep.sum()) - 1)
    return int(order[pick])


# ------------------------------------------------------------------------------------------------ tests
def test_greedy_reproduces_llama2c(runner, tokenizer, reference):
    progress = []
    runner.warmup(progress.append)
    # 2 decode batches (one width: the kernel), packed prefill token buckets 16, 32, 64 (= 2 rows x 32)
    assert runner.prefill_token_sizes == [16, 32, 64]
    assert len(progress) == 2 + 3 and all("ready" in m for m in progress)
    # in the plan's order (models/warmup.py): a first request's entries, the other prefill buckets, the rest
    assert [m.split(": ", 1)[1].split(" ready in ")[0] for m in progress] == [
        "decode bucket (B=1, S=1, W=13)", "prefill bucket (T=16 tokens, 2 rows)", "prefill bucket (T=32 tokens, 2 rows)",
        "prefill bucket (T=64 tokens, 2 rows)", "decode bucket (B=2, S=1, W=13)"], progress
    runner.reset()
    singles = []
    for item in reference:
        assert item["steps_total_incl_prompt_and_bos"] == TOTAL_STEPS
        prompt = [BOS] + tokenizer.encode(item["prompt"])
        (tokens,), _ = generate(runner, [prompt], [blocks_for(0, 13)])
        text = tokenizer.decode(tokens[1:]) + "\n"
        assert text == item["greedy_text"], item["prompt"]
        singles.append(tokens)
    # Both prompts as one batch: prefill together (different lengths, padded), then decode together.
    runner.reset()
    prompts = [[BOS] + tokenizer.encode(item["prompt"]) for item in reference]
    batched, _ = generate(runner, prompts, [blocks_for(0, 13), blocks_for(1, 13)])
    assert batched == singles


# a runner that is cheap to construct (no graph is compiled until it executes)
SMALL_RUNNER = dict(num_blocks=8, block_size=16, max_blocks_per_seq=4, decode_batch_sizes=[1],
                    prefill_batch_sizes=[1], prefill_seq_lens=[16], decode_block_widths=[2])


@pytest.mark.parametrize("cache,atol", [("bfloat16", 3e-2), ("int8", 1e-1)])
def test_a_kernel_only_cache_is_read_by_the_layer_kernel_and_refused_elsewhere(tokenizer, reference, cache, atol):
    """pa_config.kv_cache_dtype bfloat16 or int8: the layer kernel stores and reads it (greedy tokens as with float32
    for 16 tokens or more, their log-probabilities within 3e-2 for bfloat16, which keeps 8 bits of each K/V value,
    1e-1 for int8, a code of 1/127 of the largest of its head vector's 8 values here); it survives a reset; a runner whose steps would also take
    MindSpore's ops (which cannot scatter bfloat16 on the CPU, nor read int8's scales) refuses it at once."""
    from llm_serving.models.runner import ModelRunner
    prompts = [[BOS] + tokenizer.encode(item["prompt"]) for item in reference]
    tables = [[int(b) for b in perm] for perm in np.random.default_rng(5).permutation(64)[:26].reshape(2, 13)]
    results = {}
    for dtype in ("float32", cache):
        runner = ModelRunner(str(MODEL_DIR), RunnerSpec(**{**STORIES_RUNNER, "kv_cache": dtype}))
        assert runner.kernel_serves_all and str(runner.graphs.caches[0].dtype).lower() == dtype
        generate(runner, prompts[:1], tables[:1], max_len=20)
        runner.reset()                                        # (zeros in the cache's own type)
        results[dtype] = generate(runner, prompts, tables, max_len=80)
    (tok32, lp32), (tok16, lp16) = results["float32"], results[cache]
    for t16, t32, a, b in zip(tok16, tok32, lp16, lp32):
        same = next((i for i, (x, y) in enumerate(zip(t16, t32)) if x != y), min(len(t16), len(t32)))
        n = same - len(t16) + len(a)             # generated tokens both chose (lps are of generated tokens)
        assert n >= 16, (n, t16, t32)            # greedy agrees until two candidates within the cache's rounding
        np.testing.assert_allclose(a[:n], b[:n], atol=atol)
        assert not np.allclose(a[:n], b[:n], atol=1e-6)      # the cache's rounding is there
    with pytest.raises(ValueError, match=f"kv_cache_dtype {cache} is read by the CPU layer kernel only"):
        ModelRunner(str(MODEL_DIR), RunnerSpec(**{**STORIES_RUNNER, "kv_cache": cache},
                                               attention_kernel="off"))


@pytest.mark.parametrize("cache,atol", [("float32", 1e-5), ("float16", FLOAT16_CACHE_LOGPROB_ATOL)])
def test_paged_attention_kernel_matches_the_gather_path(tokenizer, reference, cache, atol):
    """Decode through the C++ kernel (g++ is on every machine here) and through the key gather give the same
    tokens and log-probabilities, for a batch of rows with different contexts whose blocks are scattered over
    the cache. A float16 cache (the default): the two paths' float32 K/V differ in their last bits, which the
    cache's rounding can turn into a float16 step (2^-11 of the value) for a few of them: log-probabilities
    within FLOAT16_CACHE_LOGPROB_ATOL (tests/conftest.py says why)."""
    from llm_serving.models.runner import ModelRunner
    runner = ModelRunner(str(MODEL_DIR), RunnerSpec(**{**STORIES_RUNNER, "kv_cache": cache}))
    assert runner.decode_kernel is not None and runner.decode_kernel.endswith(":PagedDecodeAttention")
    assert runner.decode_block_widths == [13]            # the kernel reads real context only: one width
    gather = ModelRunner(str(MODEL_DIR), RunnerSpec(**{**STORIES_RUNNER, "kv_cache": cache},
                                                    attention_kernel="off"))
    assert gather.decode_kernel is None
    assert {str(r.graphs.caches[0].dtype) for r in (runner, gather)} == {"Float16" if cache == "float16" else "Float32"}
    prompts = [[BOS] + tokenizer.encode(item["prompt"]) for item in reference]
    tables = [[int(b) for b in perm] for perm in np.random.default_rng(5).permutation(64)[:26].reshape(2, 13)]
    results = []
    for r in (runner, gather):
        r.reset()
        results.append(generate(r, prompts, tables, max_len=120))
    (tok_k, lp_k), (tok_g, lp_g) = results
    assert tok_k == tok_g and min(len(t) for t in tok_k) > 60
    for a, b in zip(lp_k, lp_g):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)
    # one packed prefill step (kernel) vs one padded step (gather): a row feeding a single token next to a
    # row whose chunk continues a cached prefix, over scattered blocks
    mixed = []
    for r in (runner, gather):
        r.reset()
        rows = [Seq(tables[0]), Seq(tables[1])]
        step(r, rows, [prompts[0][:3], prompts[1][:2]])
        mixed.append(step(r, rows, [prompts[0][3:4], prompts[1][2:]]))
    assert mixed[0][0].tolist() == mixed[1][0].tolist()
    np.testing.assert_allclose(mixed[0][1], mixed[1][1], rtol=1e-4, atol=atol)
    # 25 + 15 tokens run as two packed graph calls (32 + 16 tokens, not one of 64): row 0 ends in the first
    # call, row 1 straddles both; the result is the padded path's
    assert runner.buckets.token_pieces(40) == [32, 16]
    assert [runner.buckets.token_pieces(t) for t in (1, 16, 17, 33, 48, 64)] == [[16], [16], [32], [32, 16], [64], [64]]
    long_rows = [list(np.random.default_rng(11).integers(3, 500, size=k)) for k in (25, 15)]
    split = []
    for r in (runner, gather):
        r.reset()
        split.append(step(r, [Seq(tables[0]), Seq(tables[1])], long_rows))
    assert split[0][0].tolist() == split[1][0].tolist()
    np.testing.assert_allclose(split[0][1], split[1][1], rtol=1e-4, atol=atol)
    with pytest.raises(ValueError, match="attention_kernel"):
        ModelRunner(str(MODEL_DIR), RunnerSpec(**SMALL_RUNNER, attention_kernel="fast"))
    with pytest.raises(ValueError, match="layer_kernel"):
        ModelRunner(str(MODEL_DIR), RunnerSpec(**SMALL_RUNNER, layer_kernel="fast"))


def test_layer_kernel_matches_mindspore_ops_and_is_used_up_to_its_limit(runner, tokenizer, reference):
    """The whole-layer kernel (the fixture's runner: every step, by default) against the same model run op by
    op in MindSpore (with the paged-attention kernel): the same greedy tokens and log-probabilities for two rows
    decoding together (llama2.c's reference text), and for a packed prefill step; with a limit of 16 tokens the
    larger piece of that step runs MindSpore's ops, the smaller the kernel, with the same results; 'on' without
    the attention kernel is refused."""
    from llm_serving.models.runner import ModelRunner
    assert runner.layer_kernel is not None and runner.kernel_serves_all
    assert runner.layer_kernel_rows >= max(runner.prefill_token_sizes)
    ops_runner = ModelRunner(str(MODEL_DIR), RunnerSpec(**STORIES_RUNNER, layer_kernel="off"))
    assert ops_runner.layer_kernel is None and ops_runner.decode_kernel is not None
    prompts = [[BOS] + tokenizer.encode(item["prompt"]) for item in reference]
    tables = [blocks_for(0, 13), blocks_for(1, 13)]
    results = []
    for r in (runner, ops_runner):
        r.reset()
        results.append(generate(r, prompts, tables))
    (tok_k, lp_k), (tok_o, lp_o) = results
    assert tok_k == tok_o
    for tokens, item in zip(tok_k, reference):
        assert tokenizer.decode(tokens[1:]) + "\n" == item["greedy_text"]
    for a, b in zip(lp_k, lp_o):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    small = ModelRunner(str(MODEL_DIR), RunnerSpec(**STORIES_RUNNER, layer_kernel="on", layer_kernel_rows=16))
    assert not small.kernel_serves_all and small.layer_kernel_rows == 16
    long_rows = [list(np.random.default_rng(12).integers(3, 500, size=k)) for k in (30, 9)]   # pieces 32 + 16
    outs = []
    for r in (small, runner, ops_runner):
        r.reset()
        outs.append(step(r, [Seq(tables[0]), Seq(tables[1])], long_rows))
    for out in outs[:2]:
        assert out[0].tolist() == outs[2][0].tolist()
        np.testing.assert_allclose(out[1], outs[2][1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="layer_kernel"):
        ModelRunner(str(MODEL_DIR), RunnerSpec(**SMALL_RUNNER, attention_kernel="off", layer_kernel="on"))


def test_decode_run_gives_the_tokens_of_single_steps(runner, tokenizer, reference):
    """A decode run (K greedy steps in one graph) against the fixture's single decode steps: two rows with
    different contexts, continued from the same cache state, give the same tokens (llama2.c's text) and
    log-probabilities; malformed runs are refused."""
    from llm_serving.models.runner import ModelRunner
    k = 4
    runs = ModelRunner(str(MODEL_DIR), RunnerSpec(**STORIES_RUNNER, decode_run_steps=k, decode_run_rows=2))
    assert runs.decode_run_batch_sizes() == [1, 2] and runner.decode_run_batch_sizes() == []
    prompts = [[BOS] + tokenizer.encode(item["prompt"]) for item in reference]
    tables = [blocks_for(0, 13), blocks_for(1, 13)]
    seqs = [Seq(t) for t in tables]
    first, _ = step(runs, seqs, prompts)                        # the prompts' K/V, and each row's first token
    pos = np.array([s.cached for s in seqs])
    bs = runs.block_size
    slots = np.array([[t[(p + j) // bs] * bs + (p + j) % bs for j in range(k)] for t, p in zip(tables, pos)])
    tokens, logprobs = runs.execute(run_view(first, pos, slots, np.array(tables), pos + 1))
    assert tokens.shape == logprobs.shape == (2, k)
    single, single_lps, cur = [], [], list(first)
    for _ in range(k):                                           # the same K steps one by one (same cache state)
        cur, lp = step(runs, seqs, [[t] for t in cur])
        single.append(cur)
        single_lps.append(lp)
    assert tokens.tolist() == np.array(single).T.tolist()
    np.testing.assert_allclose(logprobs, np.array(single_lps).T, rtol=1e-5, atol=1e-6)
    for row, item in enumerate(reference):                     # llama2.c's greedy text goes on the same way
        assert item["greedy_text"].startswith(tokenizer.decode(prompts[row][1:] + [int(first[row])] +
                                                               tokens[row].tolist()))
    # a run whose rows end early (slots -1 from then on): 2 and 3 of its k steps, the rest sat out
    pos, lens = np.array([s.cached for s in seqs]), [2, 3]
    slots = np.array([[t[(p + j) // bs] * bs + (p + j) % bs if j < n else -1 for j in range(k)]
                      for t, p, n in zip(tables, pos, lens)])
    tokens, logprobs = runs.execute(run_view(cur, pos, slots, np.array(tables), pos + 1))
    single = []
    for _ in range(3):
        cur, _ = step(runs, seqs, [[t] for t in cur])
        single.append(cur)
    single = np.array(single).T
    assert tokens.tolist() == [single[0, :2].tolist() + [-1] * (k - 2), single[1].tolist() + [-1] * (k - 3)]
    assert (logprobs[0, 2:] == 0).all() and (logprobs[0, :2] < 0).all()
    with pytest.raises(ValueError, match="each row's slots"):
        runs.execute(run_view(cur, pos, slots[:, ::-1].copy(), np.array(tables), pos + 1))
    with pytest.raises(ValueError, match="runs take 1..2"):
        runs.execute(run_view([5] * 3, [3] * 3, slots[[0, 0, 0]], np.array(tables)[[0, 0, 0]], [4] * 3))
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        runs.execute(run_view(first, pos, slots[:, :2], np.array(tables), pos + 1))
    # rows of different lengths near the model's length: row 0 at its last two positions takes 2 steps, row 1 all
    # k; each row is held to its own limit and the tables' width to its own last step (both were taken from the
    # other row once: a refusal, then an index past the widths)
    near = runs.max_context - 2
    pos, lens = np.array([near, 5]), [2, k]
    slots = np.array([[t[(p + j) // bs] * bs + (p + j) % bs if j < n else -1 for j in range(k)]
                      for t, p, n in zip(tables, pos, lens)])
    tokens, _ = runs.execute(run_view(cur, pos, slots, np.array(tables), pos + 1))
    assert (tokens[0, 2:] == -1).all() and (tokens[0, :2] >= 0).all() and (tokens[1] >= 0).all()
    last = runs.max_context - 1                   # row 0's 2 steps would need position max_context
    with pytest.raises(ValueError, match=f"positions <=.*row 0 has s=2, position {last}"):
        runs.execute(run_view(first[:1], [last], slots[:1], np.array(tables)[:1], [last + 1]))
    with pytest.raises(ValueError, match="no decode runs"):
        runner.execute(run_view(first, pos, slots, np.array(tables), pos + 1))


def test_graph_calls_skip_cell_call_once_a_shape_is_compiled(runner, monkeypatch):
    """GraphCalls: the first call of a shape compiles through Cell.__call__, later ones of that shape go to the
    compiled graph directly (Cell.__call__ is not reached), a new shape goes through Cell.__call__ again; the
    runner's steps use it."""
    from mindspore import Tensor, nn
    from llm_serving.models.mindspore_env import GraphCalls

    class Scale(nn.Cell):
        def construct(self, x, y):
            return x * 2 + y

    cell, calls = Scale(), GraphCalls()
    x, y = Tensor(np.arange(4, dtype=np.float32)), Tensor(np.ones(4, np.float32))
    assert calls(cell, x, y).asnumpy().tolist() == [1, 3, 5, 7]

    def refuse(*_):
        raise AssertionError("Cell.__call__ reached")
    monkeypatch.setattr(Scale, "__call__", refuse)
    assert calls(cell, y, x).asnumpy().tolist() == [2, 3, 4, 5]          # same shapes: the compiled graph
    with pytest.raises(AssertionError, match="reached"):
        calls(cell, Tensor(np.ones(5, np.float32)), Tensor(np.ones(5, np.float32)))
    monkeypatch.undo()
    runner.warm.step(1, 1, 0.0)
    runner.warm.step(1, 1, 0.0)
    assert runner.graphs.graph_calls._phases                                           # the runner's graphs, called directly


def test_without_a_compiler_auto_falls_back_and_on_fails(monkeypatch, tmp_path, caplog):
    from llm_serving.models.kernels import KernelBuildError
    from llm_serving.models.runner import ModelRunner
    monkeypatch.setenv("CXX", str(tmp_path / "missing-g++"))
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path))
    with caplog.at_level("WARNING", logger="llm_serving.models.runner"):
        fallback = ModelRunner(str(MODEL_DIR), RunnerSpec(**SMALL_RUNNER, attention_kernel="auto"))
    assert fallback.decode_kernel is None and fallback.decode_block_widths == [2, 4]
    assert "missing-g++" in caplog.text and "gather keys instead" in caplog.text
    with pytest.raises(KernelBuildError, match="missing-g"):
        ModelRunner(str(MODEL_DIR), RunnerSpec(**SMALL_RUNNER, attention_kernel="on"))


def test_decode_block_width_buckets_give_the_same_text(tokenizer, reference):
    from llm_serving.models.runner import ModelRunner
    narrow = ModelRunner(str(MODEL_DIR), RunnerSpec(num_blocks=64, block_size=16, max_blocks_per_seq=13,
                                                    decode_batch_sizes=[1], prefill_batch_sizes=[1],
                                                    prefill_seq_lens=[16, 32], decode_block_widths=[2, 5],
                                                    num_threads=2, attention_kernel="off"))
    assert narrow.decode_block_widths == [2, 5, 13]
    assert [narrow.buckets.width(1, n) for n in (1, 2, 3, 5, 6, 13)] == [2, 2, 5, 5, 13, 13]
    assert narrow.buckets.width(16, 1) == 13                    # prefill graphs keep the full width
    with pytest.raises(ValueError, match="decode_block_widths"):
        ModelRunner(str(MODEL_DIR), RunnerSpec(num_blocks=64, block_size=16, max_blocks_per_seq=13,
                                               decode_batch_sizes=[1], prefill_batch_sizes=[1], prefill_seq_lens=[16],
                                               decode_block_widths=[20]))
    for item in reference:                               # 200 positions: the run crosses all three widths
        prompt = [BOS] + tokenizer.encode(item["prompt"])
        narrow.reset()
        (tokens,), _ = generate(narrow, [prompt], [blocks_for(0, 13)])
        assert tokenizer.decode(tokens[1:]) + "\n" == item["greedy_text"], item["prompt"]


def test_logprob_matches_numpy_forward(runner, tokenizer, reference):
    cfg, weights = load_llama_weights(str(MODEL_DIR))
    for item in reference:
        prompt = [BOS] + tokenizer.encode(item["prompt"])
        logits = np_forward_last_logits(cfg, weights, prompt)
        runner.reset()
        tok, lp = step(runner, [Seq(blocks_for(0, 13))], [prompt])
        assert tok[0] == int(np.argmax(logits))
        expected = np_log_softmax(logits)[tok[0]]
        assert lp[0] <= 0.0 and lp.dtype == np.float32 and tok.dtype == np.int32
        assert abs(lp[0] - expected) <= 1e-3 * abs(expected) + 1e-6
        assert np.isclose(np.exp(lp[0]), np.exp(np_log_softmax(logits)).max(), rtol=1e-3)
        # top log-probabilities: the reference's most likely tokens, in order, with their values; a row that
        # did not ask (top_n 0) shares the step
        runner.reset()
        seqs = [Seq(blocks_for(0, 13)), Seq(blocks_for(1, 13))]
        tok, lp, top_ids, top_lps = step(runner, seqs, [prompt, prompt], top_n=[5, 0])
        ref = np_log_softmax(logits)
        order = np.argsort(-ref, kind="stable")[:top_ids.shape[1]]
        # (the greedy logprob comes from the layer kernel's log-sum-exp, the top ones from MindSpore's log_softmax,
        # which is off from float64 by a few 1e-6 here)
        assert top_ids.shape == (2, 20) and top_ids[0, 0] == tok[0]
        assert top_lps[0, 0] == pytest.approx(lp[0], rel=1e-4, abs=1e-5)
        assert top_ids[0, :5].tolist() == order[:5].tolist()
        np.testing.assert_allclose(top_lps[0], ref[order], rtol=1e-3, atol=1e-5)
        assert (np.diff(top_lps[0]) <= 0).all()


def np_penalize(logits, history, prompt_len, repetition, presence, frequency):
    out = logits.astype(np.float64).copy()
    seen = np.unique(history)
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    counts = np.bincount(history[prompt_len:], minlength=len(out))
    return out - frequency * counts - presence * (counts > 0)


def test_penalties_match_numpy_and_leave_other_rows_alone(runner, tokenizer, reference):
    cfg, weights = load_llama_weights(str(MODEL_DIR))
    prompt = [BOS] + tokenizer.encode(reference[0]["prompt"])
    logits = np_forward_last_logits(cfg, weights, prompt)
    greedy = int(np.argmax(logits))
    history = np.asarray(prompt + [greedy, greedy], np.int32)   # as if the greedy token had come out twice
    plen = len(prompt) - 1                  # ... after the prompt's last token, also counted as output
    runner.reset()
    seqs = [Seq(blocks_for(0, 13)), Seq(blocks_for(1, 13))]
    pen = {"history": np.stack([history, history]), "history_len": [len(history), 0], "prompt_len": [plen, 0],
           "repetition_penalty": [1.3, 1.0], "presence_penalty": [0.4, 0.0], "frequency_penalty": [0.3, 0.0]}
    tok, lp, top_ids, top_lps = runner.execute(step_view(runner, seqs, [prompt, prompt], top_n=np.array([3, 0]),
                                                         **pen))
    ref = np_log_softmax(np_penalize(logits, history, plen, 1.3, 0.4, 0.3))
    assert tok[0] == int(np.argmax(ref)) != greedy                      # the penalty changed the choice
    assert lp[0] == pytest.approx(ref[tok[0]], rel=1e-3)
    assert top_ids[0, :3].tolist() == np.argsort(-ref)[:3].tolist()
    assert tok[1] == greedy                                             # the row without penalty: plain greedy


def test_paged_cache_is_layout_independent(small_block_runner, tokenizer, reference):
    runner = small_block_runner
    prompt = [BOS] + tokenizer.encode(reference[0]["prompt"])
    runner.reset()
    (contiguous,), (lp_contiguous,) = generate(runner, [prompt], [list(range(52))], max_len=60)
    shuffled_ids = [int(b) for b in np.random.default_rng(7).permutation(128)[:52]]
    assert shuffled_ids != sorted(shuffled_ids)
    runner.reset()
    (shuffled,), (lp_shuffled,) = generate(runner, [prompt], [shuffled_ids], max_len=60)
    assert shuffled == contiguous
    np.testing.assert_allclose(lp_shuffled, lp_contiguous, rtol=1e-5, atol=1e-6)
    assert reference[0]["greedy_text"].startswith(tokenizer.decode(contiguous[1:]))


def test_chunked_prefill_matches_one_shot(small_block_runner, tokenizer, reference):
    """A prefill whose first positions are already cached (prefix caching / chunked prefill)."""
    runner = small_block_runner
    prompt = [BOS] + tokenizer.encode(reference[1]["prompt"])   # 9 tokens
    blocks = [int(b) for b in np.random.default_rng(3).permutation(128)[:52]]
    runner.reset()
    one_tok, one_lp = step(runner, [Seq(blocks)], [prompt])
    runner.reset()
    seq = Seq(blocks)
    step(runner, [seq], [prompt[:5]])
    two_tok, two_lp = step(runner, [seq], [prompt[5:]])
    assert two_tok[0] == one_tok[0]
    np.testing.assert_allclose(two_lp, one_lp, rtol=1e-4)


def test_sampling(runner, tokenizer, reference):
    prompts = [[BOS] + tokenizer.encode(item["prompt"]) for item in reference]
    tables = [blocks_for(0, 13), blocks_for(1, 13)]
    runner.reset()
    greedy_tok, greedy_lp = step(runner, [Seq(t) for t in tables], prompts)

    def run(**kw):
        runner.reset()
        return step(runner, [Seq(t) for t in tables], prompts, **kw)

    # Reproducible from the host's random numbers.
    kw = dict(temperature=[0.9, 1.3], top_k=[0, 40], top_p=[1.0, 0.9], random_u=[0.37, 0.81])
    a, b = run(**kw), run(**kw)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    # top_k=1 is greedy whatever u; so is a tiny top_p.
    for u in (0.0, 0.5, 0.999):
        tok, lp = run(temperature=[1.0, 0.7], top_k=[1, 1], top_p=[1.0, 1.0], random_u=[u, u])
        np.testing.assert_array_equal(tok, greedy_tok)
        # (sampler: MindSpore's log_softmax; greedy: the layer kernel's float-exact log-sum-exp, which agrees with
        # float64 to ~1e-7 where log_softmax is off by a few 1e-6)
        np.testing.assert_allclose(lp, greedy_lp, rtol=1e-4, atol=1e-5)
        tok, _ = run(temperature=[1.0, 0.7], top_k=[0, 0], top_p=[1e-6, 1e-6], random_u=[u, u])
        np.testing.assert_array_equal(tok, greedy_tok)
    # A greedy row next to a sampling row is unaffected; the logprob is of the raw logits.
    tok, lp = run(temperature=[0.0, 5.0], random_u=[0.9, 0.999])
    assert tok[0] == greedy_tok[0] and lp[0] == pytest.approx(greedy_lp[0], rel=1e-4, abs=1e-5)
    # The sampled token and its logprob agree with a numpy forward + numpy sampling rule.
    cfg, weights = load_llama_weights(str(MODEL_DIR))
    logits = np_forward_last_logits(cfg, weights, prompts[1])
    for t, k, p, u in [(1.0, 0, 1.0, 0.3), (1.0, 0, 1.0, 0.93), (0.8, 50, 1.0, 0.6), (1.2, 0, 0.8, 0.75),
                       (0.5, 10, 0.9, 0.2), (2.0, 0, 1.0, 0.5)]:
        tok, lp = run(temperature=[0.0, t], top_k=[0, k], top_p=[1.0, p], random_u=[0.0, u])
        assert tok[1] == np_sample(logits, t, k, p, u), (t, k, p, u)
        assert lp[1] == pytest.approx(np_log_softmax(logits)[tok[1]], rel=1e-3, abs=1e-5)


def test_execute_rejects_what_no_bucket_fits(runner):
    one = dict(temperature=np.zeros(3, np.float32), top_k=np.zeros(3, np.int32),
               top_p=np.ones(3, np.float32), random_u=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="decode_batch_sizes"):
        runner.execute(StepView("decode", input_ids=np.ones((3, 1), np.int32), positions=np.zeros((3, 1), np.int32),
                                slot_mapping=np.zeros((3, 1), np.int32), block_tables=np.zeros((3, 1), np.int32),
                                context_lens=np.ones(3, np.int32), query_lens=np.ones(3, np.int32), **one))
    one = {k: v[:1] for k, v in one.items()}
    with pytest.raises(ValueError, match="prefill_seq_lens"):
        runner.execute(StepView("prefill", input_ids=np.ones((1, 40), np.int32),
                                positions=np.arange(40, dtype=np.int32)[None],
                                slot_mapping=np.full((1, 40), -1, np.int32),
                                block_tables=np.zeros((1, 3), np.int32), context_lens=np.array([40], np.int32),
                                query_lens=np.array([40], np.int32), **one))
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        runner.execute(StepView("decode", input_ids=np.ones((1, 1), np.int32), positions=np.zeros((1, 1), np.int32),
                                slot_mapping=np.zeros((1, 1), np.int32), block_tables=np.zeros((1, 14), np.int32),
                                context_lens=np.ones(1, np.int32), query_lens=np.ones(1, np.int32), **one))


def test_reset_zeroes_the_cache(runner):
    step(runner, [Seq([5])], [[BOS, 20, 30]])
    assert any(np.abs(p.asnumpy()).max() > 0 for p in runner.graphs.caches)
    runner.reset()
    assert all(np.abs(p.asnumpy()).max() == 0 for p in runner.graphs.caches)


# ------------------------------------------------------------------------------------- weight loading
def _write_checkpoint(root: Path, *, tied: bool, sharded: bool, drop=None, reshape=None) -> Path:
    from safetensors.numpy import save_file

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8, intermediate_size=12,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=16,
               max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
               tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (8,), p + "post_attention_layernorm.weight": (8,),
                       p + "self_attn.q_proj.weight": (8, 8), p + "self_attn.k_proj.weight": (4, 8),
                       p + "self_attn.v_proj.weight": (4, 8), p + "self_attn.o_proj.weight": (8, 8),
                       p + "mlp.gate_proj.weight": (12, 8), p + "mlp.up_proj.weight": (12, 8),
                       p + "mlp.down_proj.weight": (8, 12)})
    if not tied:
        shapes["lm_head.weight"] = (16, 8)
    if reshape:
        shapes[reshape[0]] = reshape[1]
    tensors = {k: rng.standard_normal(s).astype(np.float16 if "norm" in k else np.float32)
               for k, s in shapes.items() if k != drop}
    if sharded:
        names = sorted(tensors)
        parts = [names[: len(names) // 2], names[len(names) // 2:]]
        weight_map = {}
        for j, part in enumerate(parts):
            fname = f"model-{j + 1:05d}-of-00002.safetensors"
            save_file({k: tensors[k] for k in part}, str(root / fname))
            weight_map.update({k: fname for k in part})
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(tensors, str(root / "model.safetensors"))
    return root


def test_weights_sharded_untied_and_tied(tmp_path):
    cfg, w = load_llama_weights(str(_write_checkpoint(tmp_path / "a", tied=False, sharded=True)))
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 1, 4)
    assert cfg.bos_token_id == 1 and cfg.eos_token_id == 2
    assert all(v.dtype == np.float32 for v in w.values())
    assert not np.array_equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    cfg, w = load_llama_weights(str(_write_checkpoint(tmp_path / "b", tied=True, sharded=False)))
    assert cfg.tie_word_embeddings
    np.testing.assert_array_equal(w["lm_head.weight"], w["model.embed_tokens.weight"])


def test_weights_missing_or_misshapen_tensor_is_named(tmp_path):
    bad = _write_checkpoint(tmp_path / "c", tied=True, sharded=False, drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(12, 8\)"):
        load_llama_weights(str(bad))
    bad = _write_checkpoint(tmp_path / "d", tied=False, sharded=True,
                            reshape=("model.layers.0.self_attn.k_proj.weight", (8, 8)))
    with pytest.raises(WeightLoadError, match=r"k_proj\.weight.*\(8, 8\).*\(4, 8\)"):
        load_llama_weights(str(bad))
    assert issubclass(WeightLoadError, ValueError)


_CACHED_RUN = r"""
import json, sys
import numpy as np
from llm_serving.models.runner import ModelRunner
from llm_serving.models.runner_spec import RunnerSpec
from llm_serving.shm.layout import StepView
NAMES = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_lens", "temperature",
         "top_k", "top_p", "random_u")
def view(kind, *arrays):
    return StepView(kind, return_logits=True, **dict(zip(NAMES, arrays)))
decode = json.loads(sys.argv[2])
r = ModelRunner(sys.argv[1], RunnerSpec(num_blocks=8, block_size=16, max_blocks_per_seq=2, decode_batch_sizes=decode,
                                        prefill_batch_sizes=[1], prefill_seq_lens=[16], num_threads=2,
                                        compile_cache=True, batch_invariant=json.loads(sys.argv[4])))
assert r.batch_invariant == (sys.argv[4] != "false")
r.warmup()
ids = [1, 403, 407, 261, 378]
_, _, logits = r.execute(view("prefill", [ids], [list(range(5))], [list(range(5))], [[0]], [5], [5], [0.0], [0],
                              [1.0], [0.0]))
out = [logits[0]]
for b in decode:   # a decode step at every batch bucket (row 0 real, the rest scratch)
    tok = int(np.argmax(out[-1]))
    _, _, lg = r.execute(view("decode", [[tok]] * b, [[5]] * b, [[5]] + [[-1]] * (b - 1), [[0]] * b, [6] * b,
                              [1] * b, [0.0] * b, [0] * b, [1.0] * b, [0.0] * b))
    out.append(lg[0])
np.save(sys.argv[3], np.stack(out))
"""


def test_compile_cache_survives_a_change_of_buckets(tmp_path):
    """Agents keep compiled graphs on disk. MindSpore names them by compile order, so a server restarted
    with other buckets must not pick up the graphs of the old ones (it once did, and crashed); nor, since a graph
    holds the kernels' config as constants, one started with batch invariance off the graphs of one with it on
    (it once did, and ran batch-invariant steps)."""
    pytest.importorskip("mindspore")
    import os
    import subprocess
    import sys

    from tests.integration.server_harness import private_cache
    env = {**os.environ, "LLM_SERVING_CACHE": str(private_cache(tmp_path / "cache")), "GLOG_v": "3"}
    script = tmp_path / "cached_run.py"      # MindSpore hashes the entry script into the cache's key
    script.write_text(_CACHED_RUN)
    results = []
    for i, (decode, invariant) in enumerate((([1], '"auto"'), ([1, 2], '"auto"'), ([1], '"auto"'), ([1], "false"))):
        out = tmp_path / f"run{i}.npy"
        proc = subprocess.run([sys.executable, str(script), str(MODEL_DIR), json.dumps(decode), str(out), invariant],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(np.load(out))
    caches = list((tmp_path / "cache" / "ms_compile").iterdir())
    assert len(caches) == 3                     # one per bucket set and invariance; run 2 reused run 0's
    assert all(any(c.rglob("*.mindir")) for c in caches)
    np.testing.assert_array_equal(results[0], results[2])      # loaded from the cache: same graphs
    np.testing.assert_allclose(results[1][:2], results[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(results[3], results[0], rtol=1e-5, atol=1e-5)


_STAGED_RUN = r"""
import json, sys
from pathlib import Path
import numpy as np
from llm_serving.models.runner import ModelRunner
from llm_serving.models.runner_spec import RunnerSpec
from llm_serving.shm.layout import StepView
NAMES = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "query_lens", "temperature",
         "top_k", "top_p", "random_u")
def view(kind, *arrays):
    return StepView(kind, return_logits=True, **dict(zip(NAMES, arrays)))
r = ModelRunner(sys.argv[1], RunnerSpec(num_blocks=8, block_size=16, max_blocks_per_seq=2,
                                        decode_batch_sizes=[1, 2, 4, 8], prefill_batch_sizes=[1], prefill_seq_lens=[16],
                                        num_threads=2, compile_cache=True))
r.warmup(staged=sys.argv[2] == "staged")
plan = r.warmup_plan
out = {"labels": [e.label for e in plan.entries], "first": sum(e.first for e in plan.entries), "done": [plan.done]}
ids = [1, 403, 407, 261, 378]
_, _, lg = r.execute(view("prefill", [ids], [list(range(5))], [list(range(5))], [[0]], [5], [5], [0.0], [0], [1.0],
                          [0.0]))
logits, tok = [lg[0]], int(np.argmax(lg[0]))
_, _, lg = r.execute(view("decode", [[tok]], [[5]], [[5]], [[0]], [6], [1], [0.0], [0], [1.0], [0.0]))
logits.append(lg[0])
out["done"].append(plan.done)
# a top-k draw: its sampler is in no entry (compiled outside the cache, taking no compile index)
toks, _, lg = r.execute(view("decode", [[int(np.argmax(lg[0]))]], [[6]], [[6]], [[0]], [7], [1], [1.0], [3], [1.0],
                             [0.3]))
logits.append(lg[0])
out["done"].append(plan.done)
out["sampled"] = tok = int(toks[0])
# three rows: the B=4 bucket (rows 1-2 write the scratch block)
_, _, lg = r.execute(view("decode", [[tok]] * 3, [[7]] * 3, [[7], [-1], [-1]], [[0]] * 3, [8] * 3, [1] * 3, [0.0] * 3,
                          [0] * 3, [1.0] * 3, [0.0] * 3))
logits.append(lg[0])
out["done"].append(plan.done)
while r.warm_next():
    pass
out["done"].append(plan.done)
out["warming"] = r.warming
out["mindir"] = len(list(Path(r._cache_dir).rglob("*.mindir")))
np.save(sys.argv[3], np.stack(logits))
Path(sys.argv[4]).write_text(json.dumps(out))
"""


def test_a_staged_warmup_compiles_the_rest_in_the_caches_order_whatever_the_steps_ask(tmp_path):
    """On an empty compile cache a staged warmup compiles a first request's graphs, and the whole rest before a graph
    no entry run so far called (it has no record of which entry calls what). On a cache a warmup filled and
    recorded (plan.json), a staged warmup reads only a first request's graphs (models/warmup.py); a step that
    needs a later entry's graph runs the plan through that entry first, a graph in no entry compiles outside the cache, and the rest follow by warm_next. MindSpore names
    cached graphs by compile index with no shape check, so one graph out of order would hand every later call the
    wrong graph: the logits, the sampled token and the files on disk are those of a full warmup, to the bit."""
    pytest.importorskip("mindspore")
    import os
    import subprocess
    import sys

    from tests.integration.server_harness import private_cache
    env = {**os.environ, "LLM_SERVING_CACHE": str(private_cache(tmp_path / "cache")), "GLOG_v": "3"}
    script = tmp_path / "staged_run.py"      # MindSpore hashes the entry script into the cache's key
    script.write_text(_STAGED_RUN)
    runs = []
    for i, mode in enumerate(("staged", "staged", "full")):  # an empty cache first: staged, nothing recorded yet
        logits, facts = tmp_path / f"run{i}.npy", tmp_path / f"run{i}.json"
        proc = subprocess.run([sys.executable, str(script), str(MODEL_DIR), mode, str(logits), str(facts)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((np.load(logits), json.loads(facts.read_text())))
    [cache] = (tmp_path / "cache" / "ms_compile").iterdir()
    assert (cache / "plan.json").exists()
    (cold, cold_facts), (staged, facts), (full, full_facts) = runs
    total = len(facts["labels"])
    assert full_facts["done"] == [total] * 5
    # the empty cache, staged: the first entries at start, as the prefill and a one-row decode need; the top-k draw's
    # sampler no entry run so far called, and without a record the plan cannot know that no later entry does: the
    # rest ran first, in order (then the sampler compiled outside the cache)
    assert cold_facts["done"] == [cold_facts["first"]] * 2 + [total] * 3, cold_facts
    # staged: the first request's entries at start; the prefill and a one-row decode need nothing more
    firsts = facts["labels"][:facts["first"]]
    assert "decode bucket (B=1, S=1" in " ".join(firsts) and any(e.startswith("prefill bucket") for e in firsts)
    assert all(e.startswith(("decode run", "decode bucket (B=1,", "prefill bucket")) for e in firsts), firsts
    assert 1 <= facts["first"] < total and facts["done"][:2] == [facts["first"]] * 2, facts
    assert facts["done"][2] == facts["first"], facts         # the top-k draw: no entry
    # three rows: the plan ran through the B=4 decode bucket's entry, no further (B=8's is left)
    b4 = next(i for i, e in enumerate(facts["labels"]) if e.startswith("decode bucket (B=4"))
    assert facts["done"][3] == b4 + 1 < total, facts
    assert facts["done"][4] == total and not facts["warming"]
    np.testing.assert_array_equal(staged, cold)
    np.testing.assert_array_equal(full, cold)
    assert facts["sampled"] == cold_facts["sampled"] == full_facts["sampled"]
    assert facts["mindir"] == cold_facts["mindir"] == full_facts["mindir"] > 0


def test_weight_parameters_share_the_loaded_arrays_memory():
    """The model's Parameters are the loaded arrays themselves, not copies: a copy doubled the agent's memory at
    start (an 18 GB mixture of experts needed 36 GB and was killed by the OOM killer before it served)."""
    pytest.importorskip("mindspore")
    from llm_serving.models.llama import _param, _stored_param

    floats = np.arange(12, dtype=np.float32).reshape(3, 4)
    stored = np.arange(24, dtype=np.uint8).reshape(2, 12)
    p, q = _param(floats, "f"), _stored_param(stored, "s")
    assert p.shape == (3, 4) and q.shape == (2, 12) and not p.has_init and not q.has_init
    np.testing.assert_array_equal(q.asnumpy(), stored)
    floats[1, 2], stored[1, 3] = -7.0, 200          # written after: seen through the Parameters
    assert p.asnumpy()[1, 2] == -7.0 and q.asnumpy()[1, 3] == 200


# ----------------------------------------------------------------------------------------------- embed steps
def _embed(runner, seqs, new_tokens):
    """An embed step's pooled states (n, H) for `seqs` feeding `new_tokens`."""
    return runner.execute(step_view(runner, seqs, new_tokens, kind="embed"))


def test_an_embed_step_pools_the_final_hidden_states_as_transformers_computes_them(runner, tokenizer):
    """An embed step (mean pooling: stories260K declares none) writes each row's sum of its tokens' final-normed
    hidden states: divided by the count and normalized, it is transformers' mean-pooled last_hidden_state (the float32
    cache here: within 1e-4 of it). A row's sum is the same to the bit whatever row is beside it, and an input fed
    in two chunks sums to the whole within float32 rounding."""
    from tests.families import needs_transformers
    torch, transformers = needs_transformers()
    assert runner.pooling == "mean"
    texts = ["Once upon a time, there was a little girl", "The cat sat"]
    ids = [[BOS] + tokenizer.encode(t) for t in texts]
    together = _embed(runner, [Seq([1, 2]), Seq([3, 4])], ids)
    model = transformers.AutoModel.from_pretrained(str(MODEL_DIR), torch_dtype=torch.float32)
    for row, toks in enumerate(ids):
        with torch.no_grad():
            hidden = model(torch.tensor([toks])).last_hidden_state[0].numpy()             # (T, H), final-normed
        want = hidden.mean(axis=0)
        got = together[row] / len(toks)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    alone = _embed(runner, [Seq([5, 6])], [ids[1]])
    assert np.array_equal(alone[0], together[1])                 # the same bits beside another row or alone
    seq = Seq([7, 8])
    first, second = _embed(runner, [seq], [ids[0][:5]]), _embed(runner, [seq], [ids[0][5:]])
    np.testing.assert_allclose(first[0] + second[0], together[0], rtol=1e-5, atol=1e-5)
