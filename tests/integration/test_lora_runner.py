"""LoRA adapters in ModelRunner on the real stories260K checkpoint: rows of one step under different adapters (and
none) each get the logits of the plain model whose weights are the merged W + scale * B A (numpy float64
reference), through the layer kernel (decode, small packed prefill), MindSpore's ops (a prefill above the
kernel's token limit) and decode runs; adapters are written into slots in place, with no recompile."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving.models.lora import load_lora_adapter, merge_lora, random_lora_tensors, write_peft_adapter
from llm_serving.models.weights import load_llama_weights

from llm_serving.models.runner_spec import RunnerSpec

from .test_model_runner import MODEL_DIR, STORIES_RUNNER, Seq, np_forward_last_logits, run_view, step_view


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    pytest.importorskip("mindspore")
    from llm_serving.models.runner import ModelRunner

    cfg, weights = load_llama_weights(str(MODEL_DIR))
    tmp = tmp_path_factory.mktemp("lora")
    adapters = []
    for i, (rank, alpha, targets) in enumerate(((4, 8, None), (8, 4, ["q_proj", "v_proj", "down_proj"]))):
        tensors = random_lora_tensors(cfg, rank, targets or ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"), seed=10 + i, std=0.15)
        path = write_peft_adapter(tmp / f"a{i}", tensors, r=rank, lora_alpha=alpha, use_rslora=i == 1)
        adapters.append(load_lora_adapter(f"a{i}", path, cfg, max_rank=8))
    # steps of more than 16 tokens run MindSpore's ops, smaller ones the layer kernel
    spec = RunnerSpec(**{**STORIES_RUNNER, "decode_batch_sizes": [1, 2, 4], "prefill_batch_sizes": [1, 4]},
                      lora_slots=3, lora_rank=8, layer_kernel_rows=16, decode_run_steps=4, decode_run_rows=4,
                      compile_cache=False)
    runner = ModelRunner(str(MODEL_DIR), spec)
    runner.set_lora(1, adapters[0])
    runner.set_lora(3, adapters[1])
    merged = {0: weights, 1: merge_lora(weights, adapters[0]), 3: merge_lora(weights, adapters[1])}
    return runner, cfg, merged, adapters


def _check_rows(cfg, merged, tokens, slots, logits, tol=2e-3):
    for row, (toks, slot) in enumerate(zip(tokens, slots)):
        want = np_forward_last_logits(cfg, merged[slot], toks)
        np.testing.assert_allclose(logits[row], want, rtol=tol, atol=tol, err_msg=f"row {row} (slot {slot})")


@pytest.mark.parametrize("prompt_len", [4, 30], ids=["kernel-prefill", "mindspore-prefill"])
def test_rows_of_one_step_each_get_their_adapter(lora_setup, prompt_len):
    runner, cfg, merged, _ = lora_setup
    rng = np.random.default_rng(prompt_len)
    slots = [1, 0, 3, 1]
    prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len - i)) for i in range(4)]
    seqs = [Seq(range(i * 3, i * 3 + 3)) for i in range(4)]
    ids, lps, logits = runner.execute(step_view(runner, seqs, prompts, return_logits=True, lora=slots))
    _check_rows(cfg, merged, prompts, slots, logits)
    assert not np.allclose(logits[0], np_forward_last_logits(cfg, merged[0], prompts[0]), atol=0.05)
    tokens = [p + [int(t)] for p, t in zip(prompts, ids)]
    for _ in range(3):                                        # decode steps: the layer kernel, 4 rows
        ids, _, logits = runner.execute(step_view(runner, seqs, [[t[-1]] for t in tokens], return_logits=True,
                                                  lora=slots))
        _check_rows(cfg, merged, tokens, slots, logits)
        tokens = [t + [int(i)] for t, i in zip(tokens, ids)]


def test_a_decode_run_keeps_each_rows_adapter(lora_setup):
    """A decode run of 4 greedy steps gives, row by row, the tokens single steps under the same adapters give."""
    runner, cfg, _, _ = lora_setup
    slots = [3, 1, 0]
    prompts = [[1, 42, 17, 300, 9], [1, 7, 7, 7], [1, 250, 3, 90, 11, 12]]
    results = []
    for use_run in (False, True):
        seqs = [Seq(range(20 + i * 3, 23 + i * 3)) for i in range(3)]
        ids, _ = runner.execute(step_view(runner, seqs, prompts, lora=slots))
        out = [[int(t)] for t in ids]
        if use_run:
            bs = runner.block_size
            pos = np.array([s.cached for s in seqs])
            slot_map = np.stack([np.asarray(s.blocks)[(pos[i] + np.arange(4)) // bs] * bs + (pos[i] + np.arange(4)) % bs
                                 for i, s in enumerate(seqs)]).astype(np.int32)
            tables = np.array([s.blocks for s in seqs], np.int32)
            toks, _ = runner.execute(run_view(ids, pos, slot_map, tables, pos + 1, lora=slots))
            out = [o + [int(t) for t in row] for o, row in zip(out, toks)]
        else:
            for _ in range(4):
                ids, _ = runner.execute(step_view(runner, seqs, [[o[-1]] for o in out], lora=slots))
                out = [o + [int(t)] for o, t in zip(out, ids)]
        results.append(out)
    assert results[0] == results[1]


def test_slots_are_rewritten_in_place_and_checked(lora_setup):
    runner, cfg, merged, adapters = lora_setup
    prompt = [1, 5, 99, 23, 8, 140]

    def last_logits(slot, blocks):
        return runner.execute(step_view(runner, [Seq(blocks)], [prompt], return_logits=True, lora=[slot]))[2][0]

    runner.set_lora(2, adapters[1])                                   # slot 2 now holds adapter a1 as slot 3 does
    np.testing.assert_allclose(last_logits(2, [40]), np_forward_last_logits(cfg, merged[3], prompt), rtol=2e-3,
                               atol=2e-3)
    runner.set_lora(2, None)                                          # emptied: the base model
    np.testing.assert_allclose(last_logits(2, [41]), np_forward_last_logits(cfg, merged[0], prompt), rtol=2e-3,
                               atol=2e-3)
    with pytest.raises(ValueError, match="slot must be in 1..3"):
        runner.set_lora(4, adapters[0])
    with pytest.raises(ValueError, match="lora .adapter slots. must be in \\[0, 3\\]"):
        runner.execute(step_view(runner, [Seq([42])], [prompt], lora=[5]))
