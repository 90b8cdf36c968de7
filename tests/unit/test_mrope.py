"""Multimodal RoPE (Qwen2.5-VL's M-RoPE), without MindSpore: the config read from either transformers' form, the
tables' rows of a token's (t, h, w) positions, each request's RoPE offset after its images (master/request.py,
master/step_io.py) and the agent's RoPE positions of a prefill step's tokens around an image (models/runner/images.py,
models/step_inputs.py), against transformers' rule (its get_rope_index, restated by hand below)."""
from __future__ import annotations

import json
import types

import numpy as np
import pytest

from llm_serving.agents import protocol as proto
from llm_serving.master.request import PromptImage, Request, SamplingParams
from llm_serving.master.step_io import _rope_delta
from llm_serving.models.rope import mrope_axes, mrope_rows, rope_tables
from llm_serving.models.runner.images import place
from llm_serving.models.weights import LlamaConfig, WeightLoadError
from llm_serving.models.weights.hf_config import load_config


def _cfg(**over) -> LlamaConfig:
    return LlamaConfig(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=16, rope_theta=1e6, mrope_section=(2, 3, 3),
                                 architecture="qwen2"), **over})


def test_a_text_token_s_three_positions_are_plain_rope_to_the_bit():
    cfg = _cfg()
    cos, sin = rope_tables(cfg, 64)
    p = np.array([0, 1, 17, 63])
    got = mrope_rows(cfg, 64, p, p, p)
    assert np.array_equal(got[0], cos[p]) and np.array_equal(got[1], sin[p])


def test_each_section_of_frequencies_turns_by_its_own_position():
    cfg = _cfg()
    t, h, w = np.array([5]), np.array([7]), np.array([11])
    cos, sin = mrope_rows(cfg, 64, t, h, w)
    inv = 1.0 / (1e6 ** (np.arange(0, 16, 2) / 16))                       # 8 frequencies: 2 by t, 3 by h, 3 by w
    angle = np.concatenate([5 * inv[:2], 7 * inv[2:5], 11 * inv[5:]])
    np.testing.assert_allclose(cos[0], np.cos(np.concatenate([angle, angle])), rtol=1e-6)
    np.testing.assert_allclose(sin[0], np.concatenate([-np.sin(angle), np.sin(angle)]), rtol=1e-6, atol=1e-7)


def test_the_config_says_mrope_in_transformers_4_and_5_forms(tmp_path):
    four = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "vocab_size": 64,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rope_theta": 1e6, "max_position_embeddings": 512,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "vision_config": {"depth": 1}}
    text = {k: v for k, v in four.items() if k not in ("architectures", "model_type", "vision_config", "rope_scaling")}
    five = {"architectures": four["architectures"], "model_type": "qwen2_5_vl", "vision_config": {"depth": 1},
            "text_config": {**text, "rope_parameters": {"mrope_section": [2, 3, 3], "rope_theta": 1e6,
                                                        "rope_type": "default", "type": "mrope"}}}
    qwen2 = {**four, "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"}   # (Qwen2-VL's)
    for raw in (four, five, qwen2):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        cfg = load_config(str(tmp_path))
        assert (cfg.architecture, cfg.mrope_section, cfg.attention_bias, cfg.rope_theta) == ("qwen2vl", (2, 3, 3),
                                                                                             True, 1e6)
    (tmp_path / "config.json").write_text(json.dumps({**four, "rope_scaling": {"type": "mrope",
                                                                               "mrope_section": [2, 3, 4]}}))
    with pytest.raises(WeightLoadError, match="summing to half the rotary dimension"):
        load_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**four, "rope_scaling": {"type": "mrope"}}))
    with pytest.raises(WeightLoadError, match="needs mrope_section"):
        load_config(str(tmp_path))


def test_interleaved_sections_turn_frequencies_t_h_w_in_turn_as_transformers_qwen3_vl():
    """Qwen3-VL's interleaved M-RoPE (transformers' recomposition: h at frequencies 1, 4, .. below 3 x its section,
    w at 2, 5, .., t the rest): the Hub's sections (24, 20, 20) and the tiny model's (2, 3, 3), whose w runs out
    first; a token's three equal positions still give plain RoPE to the bit."""
    for section in ((24, 20, 20), (2, 3, 3)):
        cfg = _cfg(head_dim=2 * sum(section), mrope_section=section, mrope_interleaved=True)
        want = np.zeros(sum(section), np.int64)             # transformers': freqs_thw[..., offset:3 * n:3] = freq[dim]
        for axis, offset in ((1, 1), (2, 2)):
            want[offset:3 * section[axis]:3] = axis
        assert np.array_equal(mrope_axes(cfg), want), section
        assert np.bincount(mrope_axes(cfg), minlength=3)[1] == section[1]      # (h's all there; w's may run out)
        t, h, w = np.array([5]), np.array([7]), np.array([11])
        inv = 1.0 / (1e6 ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim))
        angle = np.array([5, 7, 11])[mrope_axes(cfg)] * inv
        cos, sin = mrope_rows(cfg, 64, t, h, w)
        np.testing.assert_allclose(cos[0], np.cos(np.concatenate([angle, angle])), rtol=1e-6)
        p = np.array([0, 3, 63])
        table = rope_tables(cfg, 64)
        got = mrope_rows(cfg, 64, p, p, p)
        assert np.array_equal(got[0], table[0][p]) and np.array_equal(got[1], table[1][p])
    assert np.array_equal(mrope_axes(_cfg()), np.repeat([0, 1, 2], (2, 3, 3)))     # (Qwen2.5-VL's runs)


def test_a_qwen3_vl_config_says_interleaved_mrope_and_deepstack_in_both_forms(tmp_path):
    """The Hub's config.json (text_config with rope_scaling, 4.x) and transformers 5.x's (rope_parameters): qwen3vl
    with q/k norms, interleaved M-RoPE and one DeepStack layer per vision_config.deepstack_visual_indexes entry; a
    DeepStack deeper than the text model is refused naming it."""
    text = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
            "model_type": "qwen3_vl_text"}
    vision = {"deepstack_visual_indexes": [1, 2], "depth": 4, "model_type": "qwen3_vl"}
    hub = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "vision_config": vision,
           "text_config": {**text, "rope_theta": 5e6, "rope_scaling": {"mrope_interleaved": True,
                                                                       "mrope_section": [2, 3, 3],
                                                                       "rope_type": "default"}}}
    five = {**hub, "text_config": {**text, "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 3, 3],
                                                               "rope_theta": 5e6, "rope_type": "default"}}}
    for raw in (hub, five):
        (tmp_path / "config.json").write_text(json.dumps(raw))
        cfg = load_config(str(tmp_path))
        assert (cfg.architecture, cfg.qk_norm, cfg.mrope_section, cfg.mrope_interleaved, cfg.deepstack_layers,
                cfg.rope_theta) == ("qwen3vl", True, (2, 3, 3), True, 2, 5e6)
    (tmp_path / "config.json").write_text(json.dumps({**five, "vision_config": {
        **vision, "deepstack_visual_indexes": [0, 1, 2, 3]}}))
    with pytest.raises(WeightLoadError, match="4 DeepStack layers, but the model has 3 decoder layers"):
        load_config(str(tmp_path))


def _get_rope_index(ids: list, image_id: int, grids: list) -> np.ndarray:
    """transformers' Qwen2.5-VL get_rope_index for one prompt of images (rows, cols of merged patches each),
    restated: text goes on from the last position + 1 (t = h = w); an image's tokens sit at its start + (0, row,
    col); (3, len(ids))."""
    out, k, at, image = [], 0, 0, 0
    while k < len(ids):
        if ids[k] == image_id:
            rows, cols = grids[image]
            for j in range(rows * cols):
                out.append((at, at + j // cols, at + j % cols))
            at += max(rows, cols)
            k += rows * cols
            image += 1
        else:
            out.append((at, at, at))
            at += 1
            k += 1
    return np.array(out).T


def test_a_request_s_rope_offset_after_its_images_is_transformers_positions():
    img = 9
    grids = [(2, 3), (2, 2)]
    ids = [1, 2] + [img] * 6 + [3, 4, 5] + [img] * 4 + [6]
    req = Request(ids, SamplingParams(), frozenset())
    req.images = (PromptImage(2, 6, "a", None, rope_advance=3 - 6), PromptImage(11, 4, "b", None, rope_advance=2 - 4))
    want = _get_rope_index(ids, img, grids)
    for p in range(len(ids)):
        if ids[p] != img:                         # a text token: its three positions are its place + the offset
            assert want[0, p] == want[1, p] == want[2, p] == p + req.rope_delta(p), p
    assert req.rope_delta(len(ids)) == -5 and _rope_delta(req, 9) == -3
    assert _rope_delta(types.SimpleNamespace(), 4) == 0            # (a draft model's view of a request: none)


class _GridEncoder:
    """A Qwen2.5-VL tower's stand-in: an image's tokens are its grid's rows x cols (its pixels' shape's first two),
    row i of image `key` holds key x 10 + i."""
    tokens_per_image = -1
    cfg = types.SimpleNamespace(bidirectional=False)

    def grid(self, shape):
        return int(shape[0]), int(shape[1])

    def tokens_of(self, shape):
        return int(shape[0] * shape[1])

    def token_rows(self, shape):
        return np.arange(self.tokens_of(shape))

    def rows(self, key, segment, shape):
        return np.array([[float(key) * 10 + i] * 3 for i in range(self.tokens_of(shape))], np.float32)


def test_a_prefill_step_s_rope_positions_around_images_are_transformers():
    # row 0: 2 text tokens, image "1" of 2 x 3 whole, 2 text tokens (no offset before); row 1: 3 text tokens of a
    # request whose earlier image moved it by -3; row 2: the last two tokens of image "2" (2 x 2, a prefix-cache hit
    # stopped inside it), then a text token
    query_lens = np.array([10, 3, 3])
    positions = np.concatenate([np.arange(10), np.arange(20, 23), np.arange(30, 33)]).astype(np.int32)
    rope_delta = np.array([0, -3, 0], np.int32)
    row_of = np.repeat(np.arange(3), query_lens)
    rope = positions + rope_delta[row_of]
    images = [proto.StepImage(0, 2, 0, 6, 6, "1", "s", [2, 3, 4, 8]),
              proto.StepImage(2, 0, 2, 2, 4, "2", "s", [2, 2, 4, 8])]
    placed = place(images, _GridEncoder(), query_lens, positions, positions + 1, rope)
    want0 = _get_rope_index([0, 0] + [9] * 6 + [0, 0], 9, [(2, 3)])
    assert rope[[0, 1, 8, 9]].tolist() == want0[0, [0, 1, 8, 9]].tolist() == [0, 1, 5, 6]
    assert placed.grid[:6].T.tolist() == want0[:, 2:8].tolist()
    assert rope[10:13].tolist() == [17, 18, 19]
    # image "2" starts at position 28: its tokens 2 and 3 at row 1, columns 0 and 1; the text after it 28 + 2
    assert placed.grid[6:].tolist() == [[28, 29, 28], [28, 29, 29]] and rope[15] == 30
    # a graph call of all 16 tokens: the image tokens take the scratch rows after the table's 64 positions, whose
    # cos / sin are their (t, h, w)'s
    cfg = _cfg()
    tables = tuple(np.zeros((64 + 8, 16), np.float32) for _ in range(2))
    ids, pos, buffer = np.zeros(16, np.int32), rope.copy(), np.zeros((8, 3), np.float32)
    placed.fill(0, 16, ids, buffer, 50, pos, (cfg, 64, tables))
    image = placed.source >= 0
    assert pos[image].tolist() == list(range(64, 72)) and ids[image].tolist() == list(range(50, 58))
    assert pos[~image].tolist() == rope[~image].tolist()
    cos, sin = mrope_rows(cfg, 64, *placed.grid.T)
    assert np.array_equal(tables[0][64:], cos) and np.array_equal(tables[1][64:], sin)


def test_qwen_vl_image_facts_expand_by_each_image_s_size():
    """Qwen2.5-VL's marks become one <|image_pad|> per token of the image's merged grid, its runs any length (held
    to their images' by the server), its RoPE advance the grid's larger side less its tokens, and agents whose graph
    calls hold 8 tokens at most lower the processor's max_pixels to 8 tokens' pixels."""
    from llm_serving.vision import ImageFacts, ImageSpec

    spec = ImageSpec.from_config({"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56,
                                  "max_pixels": 28 * 28 * 16, "patch_size": 14, "merge_size": 2,
                                  "temporal_patch_size": 2})
    pad = "<|image_pad|>"
    facts = ImageFacts(-1, 7, pad, "", pad, spec, family="qwen2_5_vl")
    assert facts.needs_sizes
    assert [facts.tokens_of_size(*size) for size in ((56, 56), (112, 56), (10, 10), (1000, 1000))] == [4, 8, 4, 16]
    text = f"a<|vision_start|>{pad}<|vision_end|>b<|vision_start|>{pad}<|vision_end|>"
    assert facts.expand(text, [(56, 56), (112, 56)]) == (f"a<|vision_start|>{pad * 4}<|vision_end|>b"
                                                         f"<|vision_start|>{pad * 8}<|vision_end|>")
    assert facts.spans([1, 7, 7, 7, 7, 2, 7, 7]) == [(1, 4), (6, 2)]
    patches = np.zeros((2, 3, 4, 1176), np.float32)
    assert facts.tokens_of(patches) == 6 and facts.rope_advance(patches) == 3 - 6
    small = facts.within(8)
    assert small.spec.max_pixels == 8 * 28 * 28 and small.tokens_of_size(1000, 1000) <= 8
    assert facts.within(32) is facts and facts.within(0) is facts
