"""The float64 references for images (llm_serving/reference_vision.py's tower, reference_llama.py's forward with image
rows) against transformers run in float64 on tiny random Gemma 3 and SmolVLM models: the tower's rows and every
position's logits of an image prompt agree to 2e-6 (relative: transformers' norms run in float32), and dropping Gemma 3's bidirectional image mask
changes them. No MindSpore: these are the precision gate's yardsticks, not the served model."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.families import make_gemma3_vl, make_smolvlm, needs_transformers


def _float64_model(tmp_path_factory, make, name: str) -> tuple:
    """The tiny model `make` writes (its directory), and a float64 copy of it for the comparisons."""
    torch, _ = needs_transformers()
    directory = tmp_path_factory.mktemp(name)
    return directory, copy.deepcopy(make(directory, tokenizer=False)).to(torch.float64)


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory):
    return _float64_model(tmp_path_factory, make_gemma3_vl, "gemma3_vl_reference")


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    return _float64_model(tmp_path_factory, make_smolvlm, "smolvlm_reference")


# transformers' RMS norms compute in float32 whatever the model's dtype (Gemma's `x.float()`, Llama's `.to(float32)`):
# its float64 model is float64 but for those, about 1e-7 apart
TOLERANCE = 2e-6


def _relative(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_gemma3_s_tower_and_image_prompt_logits_are_transformers(gemma3_vl):
    torch, _ = needs_transformers()
    from llm_serving.reference_llama import ReferenceLlama
    from llm_serving.reference_vision import ReferenceVision

    directory, model = gemma3_vl
    vision = ReferenceVision(str(directory))
    cfg = vision.config
    pixels = np.random.default_rng(0).standard_normal((2, 3, 56, 56))
    with torch.no_grad():
        theirs = model.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    ours = np.stack([vision.encode(p) for p in pixels])
    assert ours.shape == theirs.shape == (2, 4, 64)
    assert _relative(ours, theirs) < TOLERANCE
    assert vision.bidirectional

    # a prompt of two images: text, <start_of_image>, 4 image tokens, <end_of_image>, ... (the processor's layout)
    image, boi, eoi = cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id
    ids = [2, 40, 41, boi] + [image] * 4 + [eoi, 42, 43, 44, boi] + [image] * 4 + [eoi, 45, 46]
    x = torch.tensor([ids])
    with torch.no_grad():
        want = model(input_ids=x, pixel_values=torch.from_numpy(pixels), token_type_ids=(x == image).long(),
                     use_cache=False).logits[0].numpy()
    text = ReferenceLlama(str(directory))
    first, second = [i for i in range(len(ids)) if ids[i] == image and ids[i - 1] != image]
    images = [(first, ours[0], True), (second, ours[1], True)]
    got = text.forward(text.new_sequence(), ids, 0, images)
    assert _relative(got, want) < TOLERANCE
    # fed in two parts, the second image's tokens in the second: the same logits from the cached keys
    seq = text.new_sequence()
    head = text.forward(seq, ids[:second], 0, images[:1])
    tail = text.forward(seq, ids[second:], second, [(0, ours[1], True)])
    assert _relative(np.concatenate([head, tail]), want) < TOLERANCE
    # causal image tokens are another model: the test can tell
    causal = text.forward(text.new_sequence(), ids, 0, [(o, r, False) for o, r, _ in images])
    assert _relative(causal, want) > 1e-3


def test_smolvlm_s_tower_and_image_prompt_logits_are_transformers(smolvlm):
    torch, _ = needs_transformers()
    from llm_serving.reference_llama import ReferenceLlama
    from llm_serving.reference_vision import ReferenceVision

    directory, model = smolvlm
    vision = ReferenceVision(str(directory))
    assert not vision.bidirectional and vision.config.projector == "shuffle"
    frames = np.random.default_rng(1).standard_normal((1, 3, 3, 32, 32))      # one image of three frames
    with torch.no_grad():
        features = model.model.get_image_features(torch.from_numpy(frames)).pooler_output
    theirs = torch.cat([f.reshape(-1, 64) for f in features]).numpy()       # (each frame's 4 tokens, in order)
    ours = np.stack([vision.encode(f) for f in frames[0]])
    assert ours.shape == (3, 4, 64) and theirs.shape == (12, 64)
    assert _relative(ours.reshape(12, 64), theirs) < TOLERANCE

    image = vision.config.image_token_id
    ids = [1, 40, 3] + [image] * 4 + [3] + [image] * 4 + [3, 41] + [image] * 4 + [42, 43]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(frames),
                     use_cache=False).logits[0].numpy()
    starts = [i for i in range(len(ids)) if ids[i] == image and ids[i - 1] != image]
    text = ReferenceLlama(str(directory))
    got = text.forward(text.new_sequence(), ids, 0, [(s, rows, False) for s, rows in zip(starts, ours)])
    assert _relative(got, want) < TOLERANCE
