"""Mistral 3's images, the pure logic (issue 67): Pixtral's processor (vision/images.py: `ImageSpec.pixtral`,
`qwen_grid`, `qwen_patches` with its sizes) against transformers' PIL PixtralImageProcessor as Mistral 3's processor
calls it (its patch the merge unit), the prompt's rows of [IMG] with their breaks (vision/model.py's `ImageFacts`:
`expand`, `spans`, `placeholder_ids`, `within`), and a config.json whose tower is not served refused naming why."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.families import needs_transformers, pixtral_pil_processor

pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")
from PIL import Image  # noqa: E402

from llm_serving.vision import ImageSpec, qwen_grid, qwen_patches  # noqa: E402
from llm_serving.vision.model import ImageFacts  # noqa: E402

IMG, BREAK, END = 10, 12, 13                     # (Mistral Small 3.1's ids)


def _spec(longest: int = 64, patch: int = 8, merge: int = 2) -> ImageSpec:
    raw = pixtral_pil_processor(patch_size={"height": patch, "width": patch},
                                size={"longest_edge": longest}).to_dict()
    return dataclasses.replace(ImageSpec.from_config(raw), merge=merge)


def _image(seed: int, width: int, height: int, mode: str = "RGB"):
    array = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    return Image.fromarray(array, mode)


# (width, height, mode): the longest edge 64 pixels, merge units of 16 (an image scaled below one pixel high,
# 3,000 x 20, transformers fails on; the server gives it one unit)
IMAGES = [(64, 64, "RGB"), (130, 40, "RGB"), (30, 64, "RGB"), (9, 7, "RGB"), (700, 500, "RGB"), (101, 77, "RGBA"),
          (3000, 50, "RGB"), (17, 33, "RGB")]


@pytest.mark.parametrize("width,height,mode", IMAGES)
def test_patches_are_transformers_pixel_values(width, height, mode):
    """Each image alone: its size transformers' (the longest edge bounded, each edge floored when scaled, then up to
    whole merge units), its patches transformers' pixel_values to the bit, in merge-unit order."""
    needs_transformers()
    spec = _spec()
    assert spec.pixtral and (spec.patch, spec.merge, spec.temporal, spec.longest_edge) == (8, 2, 1, 64)
    image = _image(width * height, width, height, mode)
    theirs = pixtral_pil_processor(patch_size={"height": 8, "width": 8}, size={"longest_edge": 64})(
        images=[image], patch_size={"height": 16, "width": 16}, return_tensors="np")
    (h, w), = theirs["image_sizes"].tolist()
    assert qwen_grid(width, height, spec) == (h // 8, w // 8)
    ours = qwen_patches(image, spec)
    assert ours.shape == (h // 16, w // 16, 4, 3 * 8 * 8) and ours.dtype == np.float32
    rows, cols = h // 16, w // 16
    laid = ours.reshape(rows, cols, 2, 2, 3, 8, 8).transpose(4, 0, 2, 5, 1, 3, 6).reshape(3, h, w)
    np.testing.assert_array_equal(laid, theirs["pixel_values"][0, :, :h, :w])


def test_the_hub_s_processor_config_and_a_bad_one():
    """Mistral Small 3.1's preprocessor_config.json (patch_size as a dict, size.longest_edge 1,540, bicubic): its
    spec; a photo of 1,024 x 768 is 37 x 28 merge units of 28 pixels; a patch that is not square is refused."""
    hub = {"image_processor_type": "PixtralImageProcessor", "patch_size": {"height": 14, "width": 14},
           "size": {"longest_edge": 1540}, "resample": 3, "rescale_factor": 1 / 255, "do_normalize": True,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    spec = dataclasses.replace(ImageSpec.from_config(hub), merge=2)
    assert (spec.patch, spec.longest_edge, spec.resample) == (14, 1540, 3)
    assert qwen_grid(1024, 768, spec) == (56, 74) and qwen_grid(3080, 100, spec) == (4, 110)
    assert qwen_grid(3000, 20, _spec()) == (2, 8)       # (scaled below a pixel high: one unit, where transformers fails)
    with pytest.raises(ValueError, match="square"):
        ImageSpec.from_config({**hub, "patch_size": {"height": 14, "width": 16}})


def _facts(longest: int = 64) -> ImageFacts:
    return ImageFacts(-1, IMG, "[IMG]", "", "[IMG]", _spec(longest), family="pixtral", row_break_id=BREAK,
                      image_end_id=END)


def test_an_image_s_prompt_is_its_rows_with_their_breaks():
    """`expand` makes an image of 130 x 40 pixels two rows of four [IMG], the first ended by [IMG_BREAK], the last by
    [IMG_END]; `spans` finds the run whole (10 tokens); `placeholder_ids` is that run from the patches' shape; a run
    that is not an image's (a break first, no end) is a ValueError."""
    facts = _facts()
    assert facts.needs_sizes and facts.tokens_of_size(130, 40) == 10
    text = facts.expand("see [IMG] and [IMG]!", [(130, 40), (16, 10)])
    assert text == ("see " + "[IMG]" * 4 + "[IMG_BREAK]" + "[IMG]" * 4 + "[IMG_END]" + " and [IMG][IMG_END]!")
    run = [IMG] * 4 + [BREAK] + [IMG] * 4 + [END]
    ids = [1, 2] + run + [7] + [IMG, END] + [8]
    assert facts.spans(ids) == [(2, 10), (13, 2)]
    patches = np.zeros((2, 4, 4, 192), np.float32)
    assert facts.tokens_of(patches) == 10 and facts.placeholder_ids(patches) == run
    assert facts.rope_advance(patches) == 0
    for bad in ([1, BREAK, IMG, END], [1, IMG, IMG, 7], [IMG, BREAK]):
        with pytest.raises(ValueError, match="not an image's"):
            facts.spans(bad)


def test_within_lowers_the_longest_edge_so_that_any_image_fits_a_call():
    """Calls of at most 20 tokens take a square image of 4 x 4 units (20 tokens with its breaks): 64 pixels stay;
    19 tokens lower the longest edge to 3 units (48 pixels), whose largest image is 12 tokens."""
    facts = _facts()
    assert facts.within(20) is facts and facts.within(0) is facts
    lowered = facts.within(19)
    assert lowered.spec.longest_edge == 48 and lowered.tokens_of_size(500, 500) == 12


def _config(**changes) -> dict:
    raw = {"architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "spatial_merge_size": 2,
           "projector_hidden_act": "gelu", "vision_feature_layer": -1, "multimodal_projector_bias": False,
           "text_config": {"hidden_size": 64, "rms_norm_eps": 1e-5},
           "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "head_dim": 16, "patch_size": 8, "hidden_act": "silu",
                             "rope_theta": 10000.0}}
    for key, value in changes.items():
        if key.startswith("tower_"):                     # (a vision_config key)
            raw["vision_config"][key[len("tower_"):]] = value
        else:
            raw[key] = value
    return raw


def test_the_config_read_and_what_is_refused():
    """The tower's config from a Mistral 3 config.json (Pixtral's eps 1e-5, the projector's the text model's, every
    block full, one frame a patch); a GELU tower MLP, another projector activation or feature layer, and a head size
    that is not the hidden size's share are refused naming the key."""
    from llm_serving.models.weights.common import WeightLoadError
    from llm_serving.models.weights.vision import _pixtral_config

    cfg = _pixtral_config(_config(), "config.json")
    assert (cfg.family, cfg.eps, cfg.merger_eps, cfg.fullatt_block_indexes, cfg.patch_features, cfg.head_dim,
            cfg.image_token_id, cfg.row_width) == ("pixtral", 1e-5, 1e-5, (0, 1), 3 * 8 * 8, 16, 10, 64)
    for changes, why in (({"tower_hidden_act": "gelu"}, "hidden_act"),
                         ({"projector_hidden_act": "relu"}, "projector_hidden_act"),
                         ({"vision_feature_layer": -2}, "vision_feature_layer"),
                         ({"tower_head_dim": 8}, "head_dim")):
        with pytest.raises(WeightLoadError, match=why):
            _pixtral_config(_config(**changes), "config.json")


def test_pixtral_12b_s_llava_config_and_what_is_refused():
    """Pixtral 12B's config.json (a LlavaForConditionalGeneration with a pixtral vision_config): each patch a token
    (no merge), LLaVA's projector without the norm and patch merger, its biases on by LlavaConfig's default; a LLaVA
    whose tower is another (SigLIP's) is refused naming it, and so are LlavaConfig's defaults where the file is
    silent (the second-to-last layer's output, the first patch dropped), which Pixtral's tower does not compute."""
    from llm_serving.models.weights.common import WeightLoadError
    from llm_serving.models.weights.vision import _pixtral_config, qwen_vision_shapes

    llava = _config(architectures=["LlavaForConditionalGeneration"], vision_feature_select_strategy="full",
                    tower_model_type="pixtral")
    del llava["spatial_merge_size"], llava["multimodal_projector_bias"]
    cfg = _pixtral_config(llava, "config.json", llava=True)
    assert (cfg.spatial_merge_size, cfg.patch_merger, cfg.projector_bias, cfg.row_width) == (1, False, True, 64)
    assert sorted(n for n in qwen_vision_shapes(cfg) if "merger" in n) == [
        "visual.merger.linear_1.bias", "visual.merger.linear_1.weight", "visual.merger.linear_2.bias",
        "visual.merger.linear_2.weight"]
    assert qwen_vision_shapes(cfg)["visual.merger.linear_1.weight"] == (64, 32)
    assert not _pixtral_config({**llava, "multimodal_projector_bias": False}, "config.json", llava=True).projector_bias
    siglip = {**llava, "vision_config": {**llava["vision_config"], "model_type": "siglip_vision_model"}}
    with pytest.raises(WeightLoadError, match="'siglip_vision_model' vision tower"):
        _pixtral_config(siglip, "config.json", llava=True)
    for key, why in (("vision_feature_select_strategy", "vision_feature_select_strategy 'default'"),
                     ("vision_feature_layer", "vision_feature_layer -2")):
        silent = {k: v for k, v in llava.items() if k != key}
        with pytest.raises(WeightLoadError, match=why):
            _pixtral_config(silent, "config.json", llava=True)
