"""The Ascend branch of the model (ReshapeAndCache / PagedAttention) cannot run on this CPU, but MindSpore
type- and shape-checks a whole graph before it selects kernels. These tests compile the Ascend attention
on the CPU and require that the only complaint is the missing CPU kernel: every shape and dtype handed to
the Ascend primitives passed MindSpore's own inference."""
import subprocess
import sys
import textwrap

import pytest

from tests.integration.server_harness import REPO

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, mindspore as ms
    from mindspore import Tensor, nn
    ms.set_context(mode=ms.GRAPH_MODE); ms.set_device("CPU")
    from llm_serving.models.attention import PagedAttention, paged_metadata

    S = int(sys.argv[1])
    B, NH, KVH, D, BS, BLOCKS = 2, 4, 2, 8, 4, 6

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attn = PagedAttention(NH, KVH, D, (BLOCKS + 1) * BS, layer_id=0, device_target="Ascend",
                                       block_size=BS)

        def construct(self, q, k, v, bt, pos, slot, cl):
            return self.attn(q, k, v, paged_metadata(bt, pos, slot, cl, BS, KVH))

    cell = Step()
    assert cell.attn.key_cache.shape == (BLOCKS + 1, BS, KVH, D) and cell.attn.key_cache.dtype == ms.float16
    f = lambda *shape: Tensor(np.ones(shape, np.float32))
    i = lambda *shape: Tensor(np.zeros(shape, np.int32))
    try:
        cell(f(B * S, NH, D), f(B * S, KVH, D), f(B * S, KVH, D), i(B, 3), i(B, S), i(B, S), Tensor(np.full(B, S, np.int32)))
    except RuntimeError as e:
        print("ERROR:", e)
    else:
        print("RAN")
""")


@pytest.mark.parametrize("s", [1, 3], ids=["decode", "prefill"])
def test_ascend_attention_passes_mindspore_shape_inference(s, tmp_path):
    pytest.importorskip("mindspore")
    script = tmp_path / "ascend_step.py"     # MindSpore graph mode needs its source in a file
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(s)], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path), env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "ERROR:" in out and "Kernel select failed" in out, out[-3000:]
    assert "Unsupported op [ReshapeAndCache] on CPU" in out, out[-3000:]
