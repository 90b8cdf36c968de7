"""The activations the model's MindSpore graphs compute (models/llama.py's: the tanh GELU of Gemma's MLP and the
SigLIP towers, the exact GELU of BERT and the mergers, the quick GELU of Qwen2-VL's tower) against their float64
formulas, over the range a layer's products take: within float32's own error (a few units in the last place), where
the tanh GELU as 0.5 x (1 + tanh(u)) on MindSpore's CPU tanh was up to 1.9e-4 off."""
from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("mindspore")

XS = np.concatenate([np.linspace(-12, 12, 20001), [-300.0, -30.0, 0.0, 30.0, 300.0]]).astype(np.float32)
FORMULAS = {
    "_gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
    "_gelu_erf": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "_quick_gelu": lambda x: x / (1 + np.exp(-1.702 * x)),
}


@pytest.mark.parametrize("name", list(FORMULAS))
def test_each_activation_is_its_float64_formula(name):
    from mindspore import Tensor

    from llm_serving.models import llama
    from llm_serving.models.mindspore_env import setup_mindspore

    setup_mindspore("CPU", 0, None, None)
    with np.errstate(over="ignore"):
        want = FORMULAS[name](XS.astype(np.float64))
    got = getattr(llama, name)(Tensor(XS)).asnumpy().astype(np.float64)
    assert np.all(np.isfinite(got)), name
    # float32's rounding of a few steps (here: within 3e-6 of the value, 8e-7 absolute), with room for another
    # CPU's vector exp; the tanh form was 1.9e-4 off (at a GELU of about 0.007, 3% of it)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=name)
