"""The float64 reference (llm_serving/reference_llama.py) is checked against run.c's greedy text, so the
precision gate's yardstick is itself anchored to an implementation outside this project."""
import json

import numpy as np
import pytest
import sentencepiece as spm

from llm_serving.precision import served_token_errors, summarize_token_errors
from llm_serving.reference_llama import ReferenceLlama


def test_reference_reproduces_the_c_implementation_greedy_text(stories_dir):
    root = stories_dir
    sp = spm.SentencePieceProcessor(model_file=str(root / "tok512.model"))
    ref = ReferenceLlama(str(root / "hf"))
    for case in json.loads((root / "greedy_reference.json").read_text()):
        ids = [sp.bos_id()] + sp.encode(case["prompt"])
        new = ref.generate_greedy(ids, case["steps_total_incl_prompt_and_bos"])
        assert sp.decode(ids + new) + "\n" == case["greedy_text"]


def test_incremental_forward_equals_one_shot_and_recompute_restarts(stories_dir):
    ref = ReferenceLlama(str(stories_dir / "hf"))
    ids = [1, 403, 407, 261, 378, 600 % 512, 45, 99]
    whole = ref.forward(ref.new_sequence(), ids, 0)
    seq = ref.new_sequence()
    parts = [ref.forward(seq, ids[:5], 0)] + [ref.forward(seq, [t], 5 + i) for i, t in enumerate(ids[5:])]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-12, atol=1e-12)
    again = ref.forward(seq, ids[:3], 0)              # a recomputed prefill drops the cached tail
    np.testing.assert_allclose(again, whole[:3], rtol=1e-12, atol=1e-12)
    assert seq.length == 3


def test_a_reference_held_a_layer_at_a_time_gives_the_resident_logits(stories_dir):
    """A model too large to hold in float64 (a 4B: 32 GB) is read a layer at a time; forward_many scores many
    sequences in one pass over the layers, with forward's values for each, bit for bit."""
    resident = ReferenceLlama(str(stories_dir / "hf"))
    layered = ReferenceLlama(str(stories_dir / "hf"), resident=False)
    assert resident.resident and not layered.resident
    lists = [[1, 403, 407, 261, 378], [1, 45], [1, 99, 98, 97, 96, 95, 94]]
    many = layered.forward_many(lists)
    for ids, logits in zip(lists, many):
        assert np.array_equal(logits, resident.forward(resident.new_sequence(), ids, 0))
    held_layers = {name.split(".")[2] for name in layered.w.held if name.startswith("model.layers.")}
    assert held_layers == {str(layered.config.num_layers - 1)}         # only the last layer's weights stay
    assert layered.generate_greedy([1, 403], 12) == resident.generate_greedy([1, 403], 12)
    with pytest.raises(TypeError, match="a layer at a time"):
        layered.w["model.norm.weight"] = np.zeros(3)


def test_served_token_errors_score_each_token_against_the_reference_after_the_same_prefix():
    vocab, prompt_len = 5, 3
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(prompt_len + 2, vocab))               # rows 2, 3, 4 predict served tokens 0, 1, 2
    log_softmax = ref - np.log(np.exp(ref).sum(axis=-1, keepdims=True))
    greedy = ref.argmax(axis=-1)
    tokens = [int(greedy[2]), int((greedy[3] + 1) % vocab), int(greedy[4])]   # the second is not the argmax
    served_lp = [log_softmax[2 + j, t] + d for j, (t, d) in enumerate(zip(tokens, (0.01, -0.2, 0.0)))]
    e = served_token_errors(ref, prompt_len, tokens, served_lp)
    assert e["agrees"].tolist() == [True, False, True]
    np.testing.assert_allclose(e["lp_error"], [0.01, -0.2, 0.0], atol=1e-12)
    top2 = np.sort(log_softmax[2:], axis=-1)[:, -2:]
    np.testing.assert_allclose(e["margin"], top2[:, 1] - top2[:, 0], atol=1e-12)
    with pytest.raises(ValueError, match="reference rows"):
        served_token_errors(ref[:3], prompt_len, tokens, served_lp)

    summary = summarize_token_errors([e, served_token_errors(ref, prompt_len, tokens[:1], served_lp[:1])])
    assert summary["tokens"] == 4 and summary["disagreements"] == 1
    assert summary["greedy_agreement"] == 0.75
    assert summary["near_ties"] == int(e["margin"][1] <= 0.2)
    assert summary["lp_error_max"] == pytest.approx(0.2)
    assert summary["lp_error_mean"] == pytest.approx((0.01 + 0.2 + 0.0 + 0.01) / 4)
