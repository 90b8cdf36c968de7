"""The float64 reference (llm_serving/reference_llama.py) is checked against run.c's greedy text, so the
precision gate's yardstick is itself anchored to an implementation outside this project."""
import json

import numpy as np
import sentencepiece as spm

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
