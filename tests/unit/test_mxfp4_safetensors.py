"""gpt-oss's MXFP4 experts read from HF safetensors as stored (models/weights/hf.py): the nibble re-layout into
GGML's MXFP4 blocks is bit-exact (the same weights as transformers' own dequantization of the HF blocks and as a
dequantizer of the HF format written here), and a directory as openai ships gpt-oss (uint8 blocks and scales,
`quantization_config` mxfp4; one file or shards) loads: each expert stack offers GGML MXFP4 rows (type 39, kept
as stored by load_quantized) and float32 values, everything else the float directory's own."""
import json

import numpy as np
import pytest

from llm_serving.models.weights import WeightLoadError, expected_shapes, load_llama_weights, load_quantized
from llm_serving.models.weights.gguf import KEPT_QUANTIZED
from llm_serving.models.weights.hf import load_hf, mxfp4_to_ggml, mxfp4_values
from tests.families import make_hf_model, needs_transformers, quantize_mxfp4_hf, write_mxfp4_hf

gguf = pytest.importorskip("gguf")
MXFP4 = gguf.GGMLQuantizationType.MXFP4
PARTS = ("gate_proj", "up_proj", "down_proj")


def _hf_dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The HF format's meaning, written out here: (..., K/32, 16) bytes and (..., K/32) scales -> (..., K) float64,
    weight 2k of a block its byte k's low nibble, weight 2k + 1 the high one, each E2M1 code (sign bit 3, exponent
    bits 2..1, mantissa bit 0) times 2 ** (scale - 127)."""
    codes = np.empty(blocks.shape[:-1] + (32,), np.int64)
    codes[..., 0::2], codes[..., 1::2] = blocks & 15, blocks >> 4
    sign = np.where(codes & 8, -1.0, 1.0)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    magnitude = np.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * np.exp2(exponent - 1.0))
    values = sign * magnitude * np.exp2(scales.astype(np.float64) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def _random_hf_blocks(rng, shape: tuple, k: int) -> tuple:
    """Random HF MXFP4 (every byte value, so every code in either nibble) of shape + (K/32, 16), with scales about
    127 and a few far off (0, 1, 2: subnormal weights, GGML's scale then a subnormal half; 200)."""
    blocks = rng.integers(0, 256, shape + (k // 32, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, shape + (k // 32,), dtype=np.uint8)
    scales.reshape(-1)[:7] = [0, 1, 2, 126, 127, 128, 200]
    return blocks, scales


def test_e2m1_codes_mean_the_ocp_values():
    """The dequantizer written here against the OCP MX table (so the comparisons below are against the format)."""
    blocks = np.array([[[(2 * k + 1) % 16 << 4 | (2 * k) % 16 for k in range(16)]]], np.uint8)
    table = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    np.testing.assert_array_equal(_hf_dequantized(blocks, np.array([[127]], np.uint8))[0], table * 2)
    np.testing.assert_array_equal(_hf_dequantized(blocks, np.array([[130]], np.uint8))[0], np.array(table * 2) * 8)


@pytest.mark.parametrize("source", ["random bytes", "quantized floats"])
def test_the_relayout_is_bit_exact(source):
    """HF's blocks and scales as GGML MXFP4 rows: every byte is the scale or a nibble of the same codes (17 bytes
    a block), and gguf's dequantization of them is transformers' convert_moe_packed_tensors of the HF tensors (and the
    HF format's meaning, written here) exactly; mxfp4_values (hf.py's float32 reading) too."""
    rng = np.random.default_rng(3)
    e, rows, k = 3, 10, 96
    if source == "random bytes":
        blocks, scales = _random_hf_blocks(rng, (e, rows), k)
    else:               # weights of several magnitudes a row, a zero block among them
        w = rng.standard_normal((e, rows, k)) * np.exp2(rng.integers(-6, 4, (e, rows, 1)))
        w[0, 0, :32] = 0
        blocks, scales = quantize_mxfp4_hf(w)
        assert np.abs(_hf_dequantized(blocks, scales) - w).max() <= np.abs(w).max() / 4     # (it quantizes)
    ggml = mxfp4_to_ggml(blocks.reshape(e * rows, k // 32, 16), scales.reshape(e * rows, k // 32))
    assert ggml.dtype == np.uint8 and ggml.shape == (e * rows, k // 32 * 17)
    by_block = ggml.reshape(e, rows, k // 32, 17)
    np.testing.assert_array_equal(by_block[..., 0], scales)
    lo, hi = by_block[..., 1:] & 15, by_block[..., 1:] >> 4             # GGML: weights 0..15 low, 16..31 high
    np.testing.assert_array_equal(lo[..., 0::2] | lo[..., 1::2] << 4, blocks[..., :8])
    np.testing.assert_array_equal(hi[..., 0::2] | hi[..., 1::2] << 4, blocks[..., 8:])
    got = gguf.quants.dequantize(ggml, MXFP4).reshape(e, rows, k)
    want = _hf_dequantized(blocks, scales)
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(mxfp4_values(blocks.reshape(e * rows, k // 32, 16),
                                               scales.reshape(e * rows, k // 32)).reshape(e, rows, k), got)
    torch, _ = needs_transformers()
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(theirs.numpy().transpose(0, 2, 1), got)       # theirs: (E, K, rows)
    assert len(np.unique(got)) > 30                 # (many codes and scales compared)


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """The tiny gpt-oss (tests/families.py) as transformers saves it (float experts), and as openai ships it (MXFP4
    experts) in one file and in two shards."""
    needs_transformers()
    root = tmp_path_factory.mktemp("gptoss")
    hf = make_hf_model("gptoss", root / "float", seed=5)
    return hf, write_mxfp4_hf(hf, root / "mxfp4"), write_mxfp4_hf(hf, root / "mxfp4-shards", shards=2)


def _expected_stacks(mxfp4_dir) -> dict:
    """The expert stacks of an MXFP4 directory, from its blocks and scales by the HF format's meaning (above):
    gate_up's rows (its outputs) interleave gate (even) and up (odd); down's rows are its outputs."""
    from safetensors.numpy import load_file

    files = sorted(mxfp4_dir.glob("model*.safetensors"))
    raw = {n: a for f in files for n, a in load_file(str(f)).items()}
    out = {}
    for name, blocks in raw.items():
        if name.endswith("_blocks"):
            values = _hf_dequantized(blocks, raw[name.replace("_blocks", "_scales")])     # (E, rows, K)
            prefix = name.rsplit(".", 1)[0] + "."
            if "gate_up" in name:
                out[prefix + "gate_proj.weight"] = values[:, 0::2].reshape(-1, values.shape[-1])
                out[prefix + "up_proj.weight"] = values[:, 1::2].reshape(-1, values.shape[-1])
            else:
                out[prefix + "down_proj.weight"] = values.reshape(-1, values.shape[-1])
    return out


@pytest.mark.parametrize("which", [1, 2], ids=["one file", "shards"])
def test_an_mxfp4_directory_loads_with_its_experts_as_stored(gptoss, which):
    hf, mxfp4_dir = gptoss[0], gptoss[which]
    cfg, floats = load_llama_weights(hf)
    cfg2, got = load_llama_weights(mxfp4_dir)
    assert cfg2 == cfg and set(got) == set(floats) == set(expected_shapes(cfg))
    stacks = _expected_stacks(mxfp4_dir)
    assert len(stacks) == 3 * cfg.num_layers
    for name, arr in got.items():
        if name in stacks:      # the float32 path: the stored weights' values, close to the float model's
            np.testing.assert_array_equal(arr, stacks[name].astype(np.float32), err_msg=name)
            assert 0 < np.abs(arr - floats[name]).max() <= np.abs(floats[name]).max() / 4, name
        else:                   # everything else (the experts' biases too) as the float directory has it
            np.testing.assert_array_equal(arr, floats[name], err_msg=name)
    quantized = load_quantized(mxfp4_dir)
    assert {n: q.qtype for n, q in quantized.items()} == {n: KEPT_QUANTIZED["MXFP4"] for n in stacks}
    for name, q in quantized.items():       # the kernels' rows: GGML MXFP4 of the same weights
        assert q.shape == expected_shapes(cfg)[name] and q.data.shape == (q.shape[0], q.shape[1] // 32 * 17)
        np.testing.assert_array_equal(gguf.quants.dequantize(q.data, MXFP4), got[name], err_msg=name)


def test_an_mxfp4_stack_reads_only_the_rows_and_columns_asked_for(gptoss):
    """read(index) and read_blocks(rows) of a part of a stack, a row range (StoredTensor.rows, as split parts
    read), a strided one and a column range, against the whole."""
    _, stored = load_hf(str(gptoss[1]))
    for part in PARTS:
        t = stored[f"model.layers.1.mlp.experts.{part}.weight"]
        assert (t.qtype, t.stored_type) == (KEPT_QUANTIZED["MXFP4"], "MXFP4")
        whole, blocks = t.read((slice(None), slice(None))), t.read_blocks(slice(None))
        assert whole.dtype == np.float32 and whole.shape == t.shape
        np.testing.assert_array_equal(t.read((slice(5, 70, 3), slice(32, 64))), whole[5:70:3, 32:64])
        np.testing.assert_array_equal(t.read_blocks(slice(5, 70, 3)), blocks[5:70:3])
        rows = t.rows(64, 128)          # (expert 1 of the gate and up stacks)
        np.testing.assert_array_equal(rows.read((slice(2, 9),)), whole[66:73])
        np.testing.assert_array_equal(rows.read_blocks(slice(2, 9)), blocks[66:73])


def _rewrite(src, dst, drop=(), config=None, change=None):
    """A copy of directory `src` without the tensors `drop`, `change` ({name: array}) applied, and config.json
    updated by `config`."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {n: a for n, a in load_file(str(src / "model.safetensors")).items() if n not in drop}
    save_file({**tensors, **(change or {})}, str(dst / "model.safetensors"))
    if config:
        raw = json.loads((src / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config}))
    return dst


def test_a_missing_or_wrong_mxfp4_tensor_is_refused_naming_it(gptoss, tmp_path):
    hf, mxfp4_dir = gptoss[0], gptoss[1]
    p = "model.layers.1.mlp.experts."
    cases = [
        # scales missing in an mxfp4 checkpoint
        (_rewrite(mxfp4_dir, tmp_path / "no-scales", drop=[p + "down_proj_scales"]), p + "down_proj_scales is missing"),
        # quantization_config says mxfp4, the experts are float: the blocks are missing
        (_rewrite(hf, tmp_path / "float", config={"quantization_config": {"quant_method": "mxfp4"}}),
         "model.layers.0.mlp.experts.gate_up_proj_blocks is missing"),
        # blocks of the wrong type and shape
        (_rewrite(mxfp4_dir, tmp_path / "f32", change={p + "gate_up_proj_scales": np.zeros((4, 128, 2), np.float32)}),
         p + r"gate_up_proj_scales is F32 \(4, 128, 2\), expected U8 \(4, 128, 2\)"),
        (_rewrite(mxfp4_dir, tmp_path / "shape", change={p + "down_proj_blocks": np.zeros((4, 64, 1, 16), np.uint8)}),
         p + r"down_proj_blocks is U8 \(4, 64, 1, 16\), expected U8 \(4, 64, 2, 16\)"),
    ]
    for path, message in cases:
        with pytest.raises(WeightLoadError, match=message):
            load_llama_weights(path)
