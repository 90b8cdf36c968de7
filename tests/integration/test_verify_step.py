"""ModelRunner verify steps (speculative decoding) on the real stories260K checkpoint: the token sampled after
each new token of a row is the one plain decoding samples at that position (greedy and seeded sampling),
on the packed (CPU kernel) and the padded (key-gather) paths, with rows of different lengths side by side."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving.models.runner_spec import RunnerSpec
from llm_serving.shm.layout import StepView
from tests.integration.test_model_runner import MODEL_DIR, Seq, step, step_arrays, step_view

PROMPTS = [[1, 403, 407, 261, 378, 436, 261, 271, 280], [1, 67, 86, 427, 261, 407, 368]]
WIDTH = 5          # a speculating row feeds its last token and 4 proposals


@pytest.fixture(scope="module", params=["on", "off"], ids=["packed", "padded"])
def runner(request):
    pytest.importorskip("mindspore")
    from llm_serving.models.runner import ModelRunner
    r = ModelRunner(str(MODEL_DIR), RunnerSpec(num_blocks=64, block_size=16, max_blocks_per_seq=8,
                                               decode_batch_sizes=[1, 2, 4], prefill_batch_sizes=[1, 2],
                                               prefill_seq_lens=[16, 32], num_threads=2,
                                               attention_kernel=request.param, verify_width=WIDTH, verify_rows=4))
    assert r.buckets.packed == (request.param == "on")
    return r


def decode_reference(runner, prompt, blocks, n, temperature=0.0, seed=0):
    """Plain decoding: prompt, then n tokens one step at a time (token i sampled with uniform u[i])."""
    u = np.random.default_rng(seed).random(n).astype(np.float32)
    seq = Seq(blocks)
    out = []
    tok, _ = step(runner, [seq], [prompt], temperature=[temperature], random_u=[u[0]])
    out.append(int(tok[0]))
    for i in range(1, n):
        tok, _ = step(runner, [seq], [[out[-1]]], temperature=[temperature], random_u=[u[i]])
        out.append(int(tok[0]))
    return out, u


def verify(runner, seqs, new_tokens, temperature, verify_u):
    args = step_arrays(runner, seqs, new_tokens, temperature=temperature)
    n, s = args["input_ids"].shape
    vu = np.zeros((n, s), np.float32)
    for i, row in enumerate(verify_u):
        vu[i, :len(row)] = row
    return runner.execute(StepView("verify", **args, verify_random_u=vu))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_verify_samples_what_decoding_samples(runner, temperature):
    """Row 0 proposes its true continuation (all accepted), row 1 a wrong token as proposal 2: every verify
    token that sees no wrong proposal equals plain decoding's; a one-token row rides along as a plain
    decode row."""
    n = 7
    ref = [decode_reference(runner, p, list(range(8 * i, 8 * i + 8)), n, temperature, seed=i)
           for i, p in enumerate(PROMPTS)]
    # fresh blocks: prefill each prompt and its first token's sampling, then verify the next 5 positions
    seqs = [Seq(list(range(16 + 8 * i, 24 + 8 * i))) for i in range(3)]
    first, _ = step(runner, seqs[:2], PROMPTS, temperature=[temperature] * 2,
                    random_u=[ref[0][1][0], ref[1][1][0]])
    assert first.tolist() == [ref[0][0][0], ref[1][0][0]]
    step(runner, seqs[2:], [PROMPTS[0]])
    good = ref[0][0][:WIDTH]                                    # last token + 4 right proposals
    bad = list(ref[1][0][:WIDTH])
    bad[2] = (bad[2] + 1) % 512                                 # proposal 2 is wrong
    ids, lps = verify(runner, seqs, [good, bad, [ref[0][0][0]]], [temperature] * 3,
                      [ref[0][1][1:WIDTH + 1], ref[1][1][1:WIDTH + 1], ref[0][1][1:2]])
    assert ids.shape == (3, WIDTH) and lps.shape == (3, WIDTH)
    assert ids[0].tolist() == ref[0][0][1:WIDTH + 1]            # all 4 accepted, plus the next token
    assert ids[1, :2].tolist() == ref[1][0][1:3]                # up to the wrong proposal: decoding's tokens
    assert ids[1, 1] != bad[2]                                  # (which is where acceptance stops)
    assert ids[2, 0] == ref[0][0][1] and (ids[2, 1:] == 0).all()
    assert np.isfinite(lps[:, 0]).all() and (lps[0] <= 0).all() and (lps[0] < 0).any()


def test_verify_step_log_probabilities_match_decoding(runner):
    seq_a, seq_b = Seq(list(range(0, 8))), Seq(list(range(8, 16)))
    tok, _ = step(runner, [seq_a], [PROMPTS[0]])
    cont = [int(tok[0])]
    lps = []
    for _ in range(WIDTH):
        tok, lp = step(runner, [seq_a], [[cont[-1]]])
        cont.append(int(tok[0]))
        lps.append(float(lp[0]))
    step(runner, [seq_b], [PROMPTS[0]])
    ids, vlps = verify(runner, [seq_b], [cont[:WIDTH]], [0.0], [np.zeros(WIDTH)])
    assert ids[0].tolist() == cont[1:WIDTH + 1]
    # the verify step's K/V of the 5 tokens are computed together, decoding's one at a time: over the float16
    # cache a few land on the other side of a rounding midpoint (FLOAT16_CACHE_LOGPROB_ATOL says why); over these
    # 5 positions that moved a log-probability by 2e-4 (AVX2), a fifth of this bound
    np.testing.assert_allclose(vlps[0], lps, rtol=1e-4, atol=1e-3)


def test_verify_step_refuses_what_it_cannot_do(runner):
    seq = Seq(list(range(40, 48)))
    step(runner, [seq], [PROMPTS[0]])
    with pytest.raises(ValueError, match="top log-probabilities, sampling penalties"):
        runner.execute(step_view(runner, [Seq(list(range(40, 48)))], [[5, 6]], top_n=np.ones(1, np.int32),
                                 verify_random_u=np.zeros((1, 2), np.float32)))
    with pytest.raises(ValueError, match="verify_u has shape"):
        runner.execute(step_view(runner, [Seq(list(range(40, 48)))], [[5, 6]],
                                 verify_random_u=np.zeros((1, 3), np.float32)))
    with pytest.raises(ValueError, match="verify"):
        seqs = [Seq(list(range(8 * i, 8 * i + 8))) for i in range(5)]
        # 5 speculating rows; the buckets hold 4
        runner.execute(step_view(runner, seqs, [[5] * WIDTH] * 5, verify_random_u=np.zeros((5, WIDTH), np.float32)))


def test_speculative_sampling_keeps_the_target_distribution(runner):
    """400 rounds of one proposal x (the target's second most likely token) after the prompt, verified with
    temperature 1: the first emitted token follows p(. | prompt) exactly (chi-square against the model's own
    probabilities), x is kept with probability p(x), and the token after a kept x follows p(. | prompt, x)."""
    from llm_serving.master.speculative.tree import accepted_prefix
    from tests.integration.test_speculative import gof_p

    prompt = PROMPTS[1]
    seq = Seq(list(range(0, 8)))
    *_, logits = runner.execute(step_view(runner, [seq], [prompt], return_logits=True))
    p0 = np.exp(logits[0] - logits[0].max())
    p0 /= p0.sum()
    x = int(np.argsort(-p0)[1])
    step(runner, [seq], [[x]])
    *_, logits = runner.execute(step_view(runner, [Seq(list(range(0, 8)))], [prompt + [x]], return_logits=True))
    p1 = np.exp(logits[0] - logits[0].max())
    p1 /= p1.sum()
    rng = np.random.default_rng(0)
    first, after_x = [], []
    for _ in range(100):                                    # 4 rows per verify step, each its own blocks
        seqs = [Seq(list(range(8 + 8 * i, 16 + 8 * i))) for i in range(4)]
        step(runner, seqs[:2], [prompt[:-1]] * 2)
        step(runner, seqs[2:], [prompt[:-1]] * 2)
        ids, _ = verify(runner, seqs, [[prompt[-1], x]] * 4, [1.0] * 4, rng.random((4, 2)))
        for row in ids:
            kept = accepted_prefix([x], row)
            first.append(int(row[0]))
            if kept:
                after_x.append(int(row[1]))

    assert gof_p(first, p0) > 1e-3
    rate, n = len(after_x) / len(first), len(first)
    assert abs(rate - p0[x]) < 4 * np.sqrt(p0[x] * (1 - p0[x]) / n) + 1e-9, (rate, p0[x])
    assert len(after_x) >= 20 and gof_p(after_x, p1) > 1e-3


def test_a_token_tree_verifies_every_branch_as_its_own_chain(runner):
    """One row feeds a token tree: its last token, then two branches of two tokens (parents -1, 0, 1, 0, 3),
    each node at its depth's position and in a slot of its own. The token sampled after each node is the one
    plain decoding samples after that node's own path — the other branch is invisible to it. The padded
    path (no kernel) refuses trees."""
    prompt = PROMPTS[0]
    ref, _ = decode_reference(runner, prompt, list(range(0, 8)), 4)          # t0, then its continuation
    t0, a1, a2 = ref[0], ref[1], ref[2]
    b1 = (a1 + 7) % 512                                                      # a second candidate for depth 1
    side = Seq(list(range(8, 16)))
    step(runner, [side], [prompt])
    c, _ = step(runner, [side], [[t0, b1]])                                  # decoding after t0, b1
    b2 = int(c[0])
    d, _ = step(runner, [side], [[b2]])
    tree, parents, depths = [t0, a1, a2, b1, b2], [-1, 0, 1, 0, 3], [0, 1, 2, 1, 2]
    seq = Seq(list(range(16, 24)))
    step(runner, [seq], [prompt])
    args = step_arrays(runner, [seq], [tree])
    args["positions"] = np.asarray([[len(prompt) + dep for dep in depths]], np.int32)  # positions: by depth
    vu = np.zeros((1, len(tree)), np.float32)
    if not runner.buckets.packed:
        with pytest.raises(ValueError, match="token trees need"):
            runner.execute(StepView("verify", **args, verify_random_u=vu, verify_parent=[parents]))
        return
    ids, _ = runner.execute(StepView("verify", **args, verify_random_u=vu, verify_parent=[parents]))
    assert ids[0].tolist() == [a1, a2, ref[3], b2, int(d[0])]
    # the same tokens as a chain (no parents): the first branch, which sees only its ancestors either way, agrees
    seq2 = Seq(list(range(24, 32)))
    step(runner, [seq2], [prompt])
    args2 = step_arrays(runner, [seq2], [tree])
    args2["positions"] = args["positions"]
    chain, _ = runner.execute(StepView("verify", **args2, verify_random_u=vu))
    assert chain[0, :3].tolist() == [a1, a2, ref[3]]
