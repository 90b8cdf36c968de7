"""models/rope.py: each layer's kind of RoPE, the tables, and the reordering that runs a partial rotation as a whole
one. Checked against RoPE written out as transformers applies it (pairs (i, i + r/2) of a head's first r
dimensions), through the quantity attention uses: q . k for every pair of positions."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from llm_serving.models.rope import rope_tables, rotary_permutation
from llm_serving.models.weights import LlamaConfig, WeightLoadError

CFG = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=16, rope_theta=10000.0)


def hf_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """x (T, D): the first 2 * len(inv_freq) dimensions rotated in pairs (i, i + r/2), the rest passed through."""
    r = 2 * len(inv_freq)
    angle = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle) * scale, np.sin(angle) * scale
    x1, x2 = x[:, :r // 2], x[:, r // 2:r]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[:, r:]], axis=-1)


def served_rope(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The kernels' and the ops' formula: x * cos + swap_halves(x) * sin, on rows in the model's order."""
    d = x.shape[-1]
    swapped = np.concatenate([x[:, d // 2:], x[:, :d // 2]], axis=-1)
    return x * cos[positions] + swapped * sin[positions]


def scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    return q @ k.T


@pytest.mark.parametrize("rotary", [16, 12, 8])
def test_a_partial_rotation_reordered_gives_transformers_scores(rotary):
    cfg = dataclasses.replace(CFG, rotary_dim=rotary)
    rng = np.random.default_rng(0)
    pos = np.arange(40)
    q, k = rng.normal(size=(40, 16)), rng.normal(size=(40, 16))
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, rotary, 2) / rotary)
    want = scores(hf_rope(q, pos, inv_freq), hf_rope(k, pos, inv_freq))
    perm = rotary_permutation(cfg)
    assert (perm is None) == (rotary == 16)
    order = np.arange(16) if perm is None else perm
    assert sorted(order.tolist()) == list(range(16))
    cos, sin = rope_tables(cfg, 64)
    got = scores(served_rope(q[:, order], pos, cos, sin), served_rope(k[:, order], pos, cos, sin))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_layer_kinds_and_their_tables():
    cfg = dataclasses.replace(CFG, sliding_window=8, layer_types=("sliding", "full", "sliding", "full"),
                              local_rope_theta=100.0, rope_theta=1e6, nope_layers=(3,),
                              rope_freq_factors=(8.0,) * 8)
    assert [cfg.layer_rope(i) for i in range(4)] == ["local", "global", "local", "none"]
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]
    pos = np.arange(20)
    x = np.random.default_rng(1).normal(size=(20, 16))
    for kind, theta, factor in (("local", 100.0, 1.0), ("global", 1e6, 8.0)):
        cos, sin = rope_tables(cfg, 32, kind)
        inv_freq = 1.0 / theta ** (np.arange(0, 16, 2) / 16) / factor
        np.testing.assert_allclose(served_rope(x, pos, cos, sin), hf_rope(x, pos, inv_freq), atol=1e-5)
    cos, sin = rope_tables(cfg, 32, "none")
    np.testing.assert_array_equal(served_rope(x, pos, cos, sin), x)
    # without layer_types every layer of a model with a window slides (Mistral), and none without one
    assert [dataclasses.replace(CFG, sliding_window=8).layer_window(i) for i in range(4)] == [8] * 4
    assert CFG.layer_window(0) is None and [CFG.layer_rope(i) for i in range(4)] == ["global"] * 4


def test_longrope_takes_its_long_factors_past_the_original_context_and_scales_cos_and_sin():
    short, long = tuple(np.linspace(1, 2, 8)), tuple(np.linspace(1, 40, 8))
    cfg = dataclasses.replace(CFG, rope_freq_factors=short, rope_long_factors=long, rope_original_context=64,
                              rope_scale=1.2)
    pos = np.arange(30)
    x = np.random.default_rng(2).normal(size=(30, 16))
    base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    for served, factors in ((64, short), (65, long)):
        cos, sin = rope_tables(cfg, served)
        want = hf_rope(x, pos, base / np.asarray(factors), scale=1.2)
        np.testing.assert_allclose(served_rope(x, pos, cos, sin), want, atol=1e-5)


def test_bad_layer_settings_are_refused_naming_them():
    with pytest.raises(WeightLoadError, match="layer_types"):
        dataclasses.replace(CFG, sliding_window=8, layer_types=("sliding", "full"))
    with pytest.raises(WeightLoadError, match="rotary dimension 7"):
        dataclasses.replace(CFG, rotary_dim=7)
    with pytest.raises(WeightLoadError, match="hidden activation 'relu'"):
        dataclasses.replace(CFG, hidden_act="relu")
    with pytest.raises(WeightLoadError, match="nope_layers"):
        dataclasses.replace(CFG, nope_layers=(4,))
