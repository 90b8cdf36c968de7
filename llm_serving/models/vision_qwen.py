"""Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and Mistral 3's (Pixtral's) vision towers and mergers: an image's patches to
the text model's embeddings of it, in MindSpore graphs.

What it computes (transformers' Qwen2_5_VisionTransformerPretrainedModel):
- the patches (vision/images.py's `qwen_patches`: merge units row by row, each unit's m x m patches, each patch's
  C x T x P x P values) each a row of one matmul with the 3-D convolution's kernel (stride = kernel, no bias);
- num_layers pre-norm blocks: RMS norm, attention (q|k|v one product with a bias, each head's q and k rotated by the
  patch's row in the first half of the head and its column in the second, 2-D rotary positions), its projection,
  a residual; RMS norm, SwiGLU (gate and up with biases, silu) and down (a bias), a residual. The attention of the
  `fullatt_block_indexes` layers is over every patch of the image; the others' within windows of window_units x
  window_units merge units (the grid cut from its top left, the last row and column of windows partial);
- the merger: RMS norm (ln_q), each unit's m x m patches side by side as one row, Linear, exact (erf) GELU, Linear
  to the text model's width: one token a merge unit, row by row, as the prompt's placeholders take them.

Qwen3-VL's (transformers' Qwen3VLVisionModel; `cfg.family` "qwen3_vl") differs in: the patch embedding's bias, and
each patch's position row added after it, the learned grid of num_position_embeddings rows (side x side)
interpolated bilinearly (align_corners) to the image's patch grid: four rows weighted (`_position_taps`); LayerNorms
(gain and bias) for norm1 and norm2; the MLP linear_fc1, tanh GELU, linear_fc2 (biases, no gate); full attention in
every block (its config's windows are single merge units: the raster order, never padded); the merger's LayerNorm
over each patch (D) before a unit's m x m patches become one row; and DeepStack: after each block of
`deepstack_visual_indexes`, a merger of its own (each unit's m m D values one row first, its LayerNorm over all of
them, Linear, exact GELU, Linear) gives each token a row. An image token's row (row_width values) is the merger's,
then each DeepStack merger's in deepstack_visual_indexes order, side by side.

Qwen2-VL's (transformers' Qwen2VisionTransformerPretrainedModel; `cfg.family` "qwen2_vl") is Qwen3-VL's without the
patch embedding's bias, the position rows and DeepStack, its MLP fc1, quick GELU (x sigmoid(1.702 x)), fc2, and its
merger's LayerNorm named ln_q (and its products mlp.0, mlp.2).

Mistral 3's (transformers' PixtralVisionModel and Mistral3MultiModalProjector; `cfg.family` "pixtral") differs from
Qwen2.5-VL's in: patches of C x P x P (one frame), embedded without a bias and then RMS-normed (ln_pre,
`_NormedEmbed`); its 2-D rotary angles (`_rotary_angles`: the head's own head_dim / 2 frequencies, the even ones
turned by the patch's row and the odd ones by its column, where Qwen's turn head_dim / 4 frequencies each way);
separate q, k, v, o and a SwiGLU without biases (zero biases here); full attention in every block; and its projector
(`_PixtralMerger`): RMS norm over each patch (the text model's eps), each unit's m m patches one row, the patch
merger's product (its matrix's columns read in that row's order: transformers unfolds a unit value by value), then
linear_1, exact GELU, linear_2. Pixtral 12B's (a LLaVA; `cfg.patch_merger` false) is the same tower, each patch a
token (a merge unit of one patch), and LLaVA's projector: linear_1, exact GELU, linear_2 (`_LlavaMerger`).

How: the state between calls is the patches in merge-unit order, (gh2, gw2, m m, D), so the grid travels with it
(the agent keeps it as numpy between steps: `kept`); with DeepStack mergers, a `QwenState` of the patches and the
DeepStack rows of the blocks run so far (each made right after its block, so no block's output outlives the call).
`run_layers` lays the patches out in windows for its layers: every window
padded to window_units^2 units (T = window_units^2 m^2 rows), (W, T, D), the padding rows set to zero before each
layer and masked out of every attention as keys. A windowed layer attends within each of the W windows at once
(W x heads x T x T scores, never patches^2); a full layer over all W T rows, its queries QUERY_ROWS at a time (a
chunk's scores alive, not all of them). The graphs' shapes then depend on the number of windows alone (the
layers') or the grid (the patch embedding's and the merger's), and each image's rotary tables and window layout
are made once per grid (`_Layout`, a few cached). That is the MindSpore ops' path (`_Block`), in float32.

Where the vision kernel library builds (`kernels`), every block runs on it (`_FullBlock`): its four products (q|k|v,
its projection, gate|up or fc1 with its tanh GELU, down or fc2) and the mergers' two are VisionLinear's, on the
matrices in the checkpoint's own type (F16, BF16 or F32 panels) or, with `int16`, on int16 panels (13 bits a column,
x 14 bits per 64 values: kernels/vision_panels.py, as the SigLIP towers' are), their biases added as each block of
the result is made; the attention is VisionAttention's, its scores never written, its values in int16 with `int16`,
q and k rotated by the patches' rotary tables as it reads them: a full block's over every patch in raster order, a
windowed block's within each window of the windowed layout, each window an "image" of T patches whose padding rows
come last and are never keys (`_Layout.keys`); Qwen3-VL's LayerNorms are VisionLayerNorm's, Qwen2.5-VL's RMS norms
VisionRmsNorm's and its SwiGLU VisionGated's. The mergers' norms and GELU and the position rows stay MindSpore's. (On two Zen 5 cores the windowed
blocks on MindSpore's ops took 0.68 s each at 3,996 patches, 0.40 s on the kernels; the rotation and the q|k|v rows
put back together in MindSpore's ops took more than the attention itself: 0.15 s a block at Qwen3-VL's 3,072 patches.)
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mindspore import Tensor, nn, ops

from llm_serving.models.kernels.vision_panels import int16_panels
from llm_serving.models.llama import _gelu_erf, _gelu_tanh, _layer_normalize, _quick_gelu, _rms_normalize
from llm_serving.models.vision_tower import _panels, _reader
from llm_serving.models.weights.vision import QwenVisionConfig, qwen_vision_shapes

__all__ = ["QwenState", "QwenVisionTower"]

# a full-attention layer's queries per chunk (rounded to whole windows): its scores then take heads x QUERY_ROWS x
# patches floats at a time (16 heads, 5,120 patches: 335 MB), not heads x patches^2 (1.7 GB)
QUERY_ROWS = 1024
# what a padding key's score gets: exp of it, less the row's maximum, is exactly 0 (never -inf: no inf - inf)
_MASKED = -1e30


def _tensor(array: np.ndarray):
    return Tensor(np.ascontiguousarray(array, np.float32))


def _position_taps(cfg: QwenVisionConfig, gh2: int, gw2: int) -> tuple:
    """Qwen3-VL's position rows of an image's patches, in their order (units row by row, a unit's patches row by
    row), as transformers' get_vision_interpolation_indices_and_weights makes them (bilinear, align_corners, in
    float32): (N, 4) int32 rows of pos_embed and (N, 4) float32 weights, a patch's position row the weighted sum
    of its four. Per axis, a patch at i of `size` sits at i (side - 1) / (size - 1) of the learned grid, between rows
    floor and floor + 1 (the last clamped to the grid), weighted 1 - its distance to each."""
    m, side = cfg.spatial_merge_size, cfg.position_side
    unit_row, unit_col, k = np.meshgrid(np.arange(gh2), np.arange(gw2), np.arange(m * m), indexing="ij")
    rows, cols = (unit_row * m + k // m).reshape(-1), (unit_col * m + k % m).reshape(-1)

    def axis(index: np.ndarray, size: int) -> tuple:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        taps = np.minimum(floor.astype(np.int32)[:, None] + np.arange(2, dtype=np.int32), side - 1)    # (N, 2)
        distance = np.abs((src - floor)[:, None] - np.arange(2, dtype=np.float32))
        return taps, np.maximum(np.float32(1) - distance, np.float32(0))

    row_taps, row_weights = axis(rows, gh2 * m)
    col_taps, col_weights = axis(cols, gw2 * m)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    return taps.astype(np.int32), (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)


def _rotary_angles(cfg: QwenVisionConfig, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """(N, head_dim / 2) float32 2-D rotary angles of patches at (rows, cols) of the patch grid: the first half of
    them the row's, the second the column's (each used twice over the head: rotate_half's pairs). Qwen's: both
    halves the frequencies of a head_dim / 2 rotary, theta^(-4 j / head_dim); Pixtral's: the head's own frequencies
    theta^(-2 i / head_dim), the even ones turned by the row, the odd ones by the column."""
    if cfg.family == "pixtral":
        inv_freq = np.float32(1.0) / np.float32(cfg.rope_theta) ** (
            np.arange(0, cfg.head_dim, 2, dtype=np.float32) / np.float32(cfg.head_dim))
        row_freq, col_freq = inv_freq[0::2], inv_freq[1::2]
    else:
        half = cfg.head_dim // 2
        row_freq = col_freq = np.float32(1.0) / np.float32(cfg.rope_theta) ** (
            np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
    return np.concatenate([rows[:, None].astype(np.float32) * row_freq, cols[:, None].astype(np.float32) * col_freq],
                          axis=1)


class _Layout:
    """An image's grid of merge units (gh2 x gw2) laid out in windows: `index` (W T,), the raster row (in the
    (gh2 gw2 m m) order) of each window slot's patch, -1 for padding, a window's patches in its first slots (the
    attention within it does not depend on their order) and its padding after them; `keep` (W, T, 1) where a slot
    holds a patch; `key_bias` (W, T), 0 there and _MASKED elsewhere; `cos`, `sin` (W, T, head_dim), each slot's
    rotary table; for VisionAttention, `keys` (W,) each window's patches and `window_rope` (W T, 2 head_dim) the
    slots' cos and sin side by side (the raster order's: `raster_keys`, `raster_rope`). Qwen3-VL's: `taps`,
    `tap_weights` (N, 4), the patches' position rows (`_position_taps`)."""

    def __init__(self, cfg: QwenVisionConfig, gh2: int, gw2: int):
        m, wu, mm = cfg.spatial_merge_size, cfg.window_units, cfg.spatial_merge_size ** 2
        rows_of_windows, cols_of_windows = -(-gh2 // wu), -(-gw2 // wu)
        self.windows, self.per_window = rows_of_windows * cols_of_windows, wu * wu * mm
        a, b, sr, sc, k = np.meshgrid(np.arange(rows_of_windows), np.arange(cols_of_windows), np.arange(wu),
                                      np.arange(wu), np.arange(mm), indexing="ij")     # window, unit in it, patch
        unit_row, unit_col = (a * wu + sr).reshape(-1), (b * wu + sc).reshape(-1)
        k = k.reshape(-1)
        valid = (unit_row < gh2) & (unit_col < gw2)
        # each window's patches first (stable: in their order), its padding after
        first = (np.argsort(~valid.reshape(self.windows, self.per_window), axis=1, kind="stable")
                 + np.arange(self.windows)[:, None] * self.per_window).reshape(-1)
        unit_row, unit_col, k, valid = unit_row[first], unit_col[first], k[first], valid[first]
        self.keys = Tensor(valid.reshape(self.windows, self.per_window).sum(1).astype(np.int32))
        self.index = np.where(valid, (unit_row * gw2 + unit_col) * mm + k, -1)
        self.slots = np.nonzero(valid)[0]                   # the padded slots of the patches
        self.order = np.argsort(self.index[self.slots])     # ... in raster order
        shape = (self.windows, self.per_window)
        self.keep = Tensor(valid.reshape(*shape, 1))
        self.key_bias = _tensor(np.where(valid, 0.0, _MASKED).reshape(shape))
        # the patch's row and column in the grid of patches (the rotary positions)
        rows, cols = (unit_row * m + k // m).reshape(-1), (unit_col * m + k % m).reshape(-1)
        angles = _rotary_angles(cfg, rows, cols)
        angles = np.concatenate([angles, angles], axis=1).reshape(*shape, cfg.head_dim)
        self.cos, self.sin = _tensor(np.cos(angles)), _tensor(np.sin(angles))
        flat = angles.reshape(-1, cfg.head_dim)
        self.window_rope = _tensor(np.concatenate([np.cos(flat), np.sin(flat)], 1))        # (W T, 2 hd)
        # the same rotary tables in raster order (the full-attention blocks on the CPU kernels), and their
        # VisionAttention config: one image of every patch
        raster = self.slots[self.order]
        flat = angles.reshape(-1, cfg.head_dim)[raster]
        self.raster_rope = _tensor(np.concatenate([np.cos(flat), np.sin(flat)], 1))      # (N, 2 hd): cos, sin
        self.patches = len(raster)
        self.raster_keys = Tensor(np.array([self.patches], np.int32))
        if cfg.family == "qwen3_vl":
            taps, weights = _position_taps(cfg, gh2, gw2)
            self.taps, self.tap_weights = Tensor(taps), _tensor(weights)

    def windowed(self, x: np.ndarray) -> np.ndarray:
        """(gh2 gw2 m m, D) raster rows -> (W, T, D), padding zero."""
        out = np.zeros((self.windows * self.per_window, x.shape[-1]), np.float32)
        out[self.slots] = x[self.index[self.slots]]
        return out.reshape(self.windows, self.per_window, -1)

    def raster(self, x: np.ndarray) -> np.ndarray:
        """(W, T, D) -> (gh2 gw2 m m, D): the patches' rows back in raster order."""
        return x.reshape(-1, x.shape[-1])[self.slots[self.order]]


class _Embed(nn.Cell):
    """Patches (gh2, gw2, m m, F) -> (gh2, gw2, m m, D): each patch a row of one matmul with the kernel (D, F)."""

    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, patches, kernel):
        gh2, gw2, mm, f = patches.shape
        return self.matmul(patches.reshape(gh2 * gw2 * mm, f), kernel).reshape(gh2, gw2, mm, kernel.shape[0])


class _NormedEmbed(nn.Cell):
    """Pixtral's: patches (gh2, gw2, m m, F) -> (gh2, gw2, m m, D): each patch a row of one matmul with the kernel
    (D, F), then ln_pre, an RMS norm (its gain) over each patch."""

    def __init__(self, eps: float):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)
        self.eps = eps

    def construct(self, patches, kernel, gain):
        gh2, gw2, mm, f = patches.shape
        x = self.matmul(patches.reshape(gh2 * gw2 * mm, f), kernel)
        return (_rms_normalize(x, self.eps) * gain).reshape(gh2, gw2, mm, kernel.shape[0])


class _PositionedEmbed(nn.Cell):
    """Qwen3-VL's: patches (gh2, gw2, m m, F) -> (gh2, gw2, m m, D): each patch's row of the matmul with the kernel
    (D, F), plus the bias, plus its position row: the rows `taps` (N, 4) of pos_embed weighted by `weights` (N, 4),
    a tap at a time (no (N, 4, D) gather alive)."""

    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, patches, kernel, bias, pos_embed, taps, weights):
        gh2, gw2, mm, f = patches.shape
        n, d = gh2 * gw2 * mm, kernel.shape[0]
        x = self.matmul(patches.reshape(n, f), kernel) + bias                             # (N, D)
        positions = ops.gather(pos_embed, taps[:, 0], 0) * weights[:, 0:1]
        for j in range(1, 4):
            positions = positions + ops.gather(pos_embed, taps[:, j], 0) * weights[:, j:j + 1]
        return (x + positions).reshape(gh2, gw2, mm, d)


# a block's weights, in the order _Block.construct takes them after x and the layout's tensors. A norm: Qwen2.5-VL's
# RMS norm gain (D,), or Qwen3-VL's LayerNorm gain and bias stacked (2, D); up: gate|up (2 I, D) or linear_fc1
# (I, D); down: down_proj or linear_fc2 (D, I)
_BLOCK_INPUTS = ("norm1", "qkv", "qkv_bias", "proj", "proj_bias", "norm2", "up", "up_bias", "down", "down_bias")


# a block's matrices (after its name in _BLOCK_INPUTS) and the checkpoint tensors they are made of, by family
_MATRICES = {"qwen2_5_vl": {"qkv": ("attn.qkv",), "proj": ("attn.proj",), "up": ("mlp.gate_proj", "mlp.up_proj"),
                            "down": ("mlp.down_proj",)},
             "qwen3_vl": {"qkv": ("attn.qkv",), "proj": ("attn.proj",), "up": ("mlp.linear_fc1",),
                          "down": ("mlp.linear_fc2",)},
             "qwen2_vl": {"qkv": ("attn.qkv",), "proj": ("attn.proj",), "up": ("mlp.fc1",), "down": ("mlp.fc2",)},
             "pixtral": {"qkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj"), "proj": ("attn.o_proj",),
                         "up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}}


def _matrix(read, names: list, stored_type=None, int16: bool = False, biased: bool = True, columns=None) -> tuple:
    """(matrix, bias) of the products `names` (checkpoint prefixes of a .weight and a .bias each; without `biased`,
    a .weight alone and the bias zeros) joined by rows: (out, in) float32 and its bias as stored (stored_type None:
    MindSpore's MatMul), or as VisionLinear reads them: panels of the checkpoint's type (vision_tower.py's
    `_panels`), or (`int16`) int16 panels with the bias (2, N), the bias and the columns' steps. `columns`: the
    matrix's columns taken in that order (Pixtral's patch merger: its inputs as the state lays a unit out)."""
    matrix = np.concatenate([read(name + ".weight") for name in names])
    if columns is not None:
        matrix = np.ascontiguousarray(matrix[:, columns])
    bias = np.concatenate([read(name + ".bias") if biased else np.zeros(read(name + ".weight").shape[0], np.float32)
                           for name in names])
    if stored_type is None:
        return matrix, bias
    if int16:
        panels, steps = int16_panels(matrix)
        return Tensor(panels), np.stack([bias, steps])
    return _panels(matrix, {stored_type(name + ".weight") for name in names}), bias


def _merger_weights(read, names: tuple, stored_type=None, int16: bool = False, products: int = 2, biases=None,
                    columns=None) -> tuple:
    """A merger's weights as _Merger / _LayerNormMerger / _PixtralMerger take them: its norm's (a gain, or a gain and
    a bias), then its last `products` names' products as `_matrix` makes them (on the kernels: VisionLinear's
    panels), each with its bias where `biases` (a flag a product; None: every one) says, the first one's columns in
    the order `columns` gives."""
    norm, matrices = names[:-products], names[-products:]
    biases = (True,) * products if biases is None else biases
    out = [read(name) for name in norm]
    for k, name in enumerate(matrices):
        out.extend(_matrix(read, [name], stored_type, int16, biases[k], columns if k == 0 else None))
    return tuple(t if isinstance(t, Tensor) else _tensor(t) for t in out)


def _block_weights(read, cfg: QwenVisionConfig, index: int, stored_type=None, int16: bool = False) -> tuple:
    """Block `index`'s weights as _Block takes them (_BLOCK_INPUTS): matrices (out, in) as stored, gate and up as one
    (2 I, D), a LayerNorm's gain and bias as one (2, D). `stored_type(name)`: the type the checkpoint stores a tensor
    in, given when the block runs on the CPU kernels: the matrices are then VisionLinear's panels of that type
    (vision_tower.py's `_panels`), or (`int16`) its int16 panels, each bias then (2, N): the bias and the columns'
    steps."""
    at = f"visual.blocks.{index}."
    biased = cfg.family != "pixtral"
    if cfg.layer_norms:
        w = {norm: np.stack([read(at + norm + ".weight"), read(at + norm + ".bias")]) for norm in ("norm1", "norm2")}
    else:
        w = {norm: read(at + norm + ".weight") for norm in ("norm1", "norm2")}
    for key, parts in _MATRICES[cfg.family].items():
        w[key], w[key + "_bias"] = _matrix(read, [at + part for part in parts], stored_type, int16, biased)
    return tuple(w[name] if isinstance(w[name], Tensor) else _tensor(w[name]) for name in _BLOCK_INPUTS)


class _Block(nn.Cell):
    """One block (the module docstring) on MindSpore's ops (where the vision kernels do not build: on them every
    block is _FullBlock's), on the windowed layout (W, T, D); `full`: its attention over every row of every window
    (the padding masked), in chunks of whole windows of about QUERY_ROWS queries; else within each window."""

    def __init__(self, cfg: QwenVisionConfig, full: bool):
        super().__init__()
        self.full, self.eps = full, cfg.eps
        self.heads, self.head_dim, self.inner = cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        self.layer_norms = cfg.layer_norms
        self.gated, self.tanh = cfg.mlp_activation == "silu", cfg.mlp_activation == "gelu_tanh"
        self.scale = cfg.head_dim ** -0.5
        self.chunk_windows = max(1, QUERY_ROWS // (cfg.window_units ** 2 * cfg.spatial_merge_size ** 2))
        self.matmul = ops.MatMul(transpose_b=True)             # (the weights as stored: (out, in))
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.weighted = ops.BatchMatMul()

    def _product(self, x, w, bias):
        # x (R, K) times the matrix (N, K) plus its bias
        return self.matmul(x, w) + bias

    def _norm(self, x, norm):
        # Qwen2-VL's and Qwen3-VL's LayerNorm (norm: gain and bias, (2, D)), else Qwen2.5-VL's RMS norm (its gain)
        if self.layer_norms:
            return _layer_normalize(x, self.eps) * norm[0] + norm[1]
        return _rms_normalize(x, self.eps) * norm

    def _mlp(self, h, up, up_bias, down, down_bias):
        # h (R, D) -> (R, D): Qwen3-VL's fc1, tanh GELU, fc2 (Qwen2-VL's quick GELU); Qwen2.5-VL's gate|up,
        # silu(gate) up, down
        if not self.gated:
            fc1 = self._product(h, up, up_bias)
            return self._product(_gelu_tanh(fc1) if self.tanh else _quick_gelu(fc1), down, down_bias)
        gate_up = self._product(h, up, up_bias)                                              # (R, 2 I)
        return self._product(ops.silu(gate_up[:, :self.inner]) * gate_up[:, self.inner:], down, down_bias)

    def _rotated(self, x, cos, sin):
        # x (W, T, heads, hd); cos, sin (W, T, 1, hd): x cos + rotate_half(x) sin
        half = self.head_dim // 2
        return x * cos + ops.concat((-x[..., half:], x[..., :half]), -1) * sin

    def _attend_windows(self, q, k, v, key_bias):
        # q, k, v (W, T, heads, hd) -> (W T, D): each window's queries over its keys
        w, t = q.shape[0], q.shape[1]
        q, k, v = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)   # (W, heads, T, hd)
        scores = self.scores(q, k) * self.scale + key_bias.reshape(w, 1, 1, t)                # (W, heads, T, T)
        out = self.weighted(ops.softmax(scores, axis=-1), v)                                  # (W, heads, T, hd)
        return out.transpose(0, 2, 1, 3).reshape(w * t, self.heads * self.head_dim)

    def _attend_all(self, q, k, v, key_bias):
        # q, k, v (W, T, heads, hd) -> (W T, D): every query over every key, chunk_windows windows of queries a time
        w, t = q.shape[0], q.shape[1]
        q = q.reshape(w * t, self.heads, self.head_dim).transpose(1, 0, 2)                   # (heads, W T, hd)
        k = k.reshape(w * t, self.heads, self.head_dim).transpose(1, 0, 2)
        v = v.reshape(w * t, self.heads, self.head_dim).transpose(1, 0, 2)
        bias = key_bias.reshape(1, 1, w * t)
        rows = self.chunk_windows * t
        outs = []
        for start in range(0, w * t, rows):
            scores = self.scores(q[:, start:start + rows], k) * self.scale + bias                 # (heads, rows, WT)
            outs.append(self.weighted(ops.softmax(scores, axis=-1), v))                          # (heads, rows, hd)
        out = outs[0] if len(outs) == 1 else ops.concat(outs, 1)
        return out.transpose(1, 0, 2).reshape(w * t, self.heads * self.head_dim)

    def construct(self, x, keep, key_bias, cos, sin, norm1, qkv_w, qkv_bias, proj_w, proj_bias, norm2, up, up_bias,
                  down, down_bias):
        w, t, d = x.shape
        x = ops.select(keep, x, ops.zeros_like(x))             # (the padding rows: zero whatever came before)
        h = self._norm(x, norm1).reshape(w * t, d)
        qkv = self._product(h, qkv_w, qkv_bias).reshape(w, t, 3, self.heads, self.head_dim)
        cos, sin = cos.reshape(w, t, 1, self.head_dim), sin.reshape(w, t, 1, self.head_dim)
        q, k = self._rotated(qkv[:, :, 0], cos, sin), self._rotated(qkv[:, :, 1], cos, sin)  # (W, T, heads, hd)
        attend = self._attend_all if self.full else self._attend_windows
        attended = attend(q, k, qkv[:, :, 2], key_bias)                                      # (W T, D)
        x = x + self._product(attended, proj_w, proj_bias).reshape(w, t, d)
        h = self._norm(x, norm2).reshape(w * t, d)
        return x + self._mlp(h, up, up_bias, down, down_bias).reshape(w, t, d)


class _FullBlock(nn.Cell):
    """A block on the CPU kernels: full attention in raster order (N, D), or windowed attention on the windowed
    layout (W T, D), each window an image of T patches to VisionAttention, its padding rows last and never its keys
    (`_Layout.keys`; they are rows like any other to the rest, and never reach a patch's): the products on
    VisionLinear (Qwen3-VL's fc1 with its tanh GELU), the attention VisionAttention's (every patch over every patch,
    its scores never written, so that no buffer of heads x patches^2 exists for any image size; q and k rotated by
    the patches' rotary tables `rope` (N, 2 hd) as the kernel reads them: as MindSpore's ops, the rotation and
    the q|k|v rows put back together took more time than the attention), Qwen3-VL's LayerNorms VisionLayerNorm's;
    Qwen2.5-VL's RMS norms VisionRmsNorm's and its SwiGLU VisionGated's."""

    def __init__(self, cfg: QwenVisionConfig, kernels: str, threads: int, level: int):
        super().__init__()
        self.eps, self.heads, self.head_dim, self.inner = cfg.eps, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
        self.layer_norms, self.gated = cfg.layer_norms, cfg.mlp_activation == "silu"
        self.linear = ops.Custom(f"{kernels}:VisionLinear", out_shape=lambda x, w, bias, *_: (x[0], bias[-1]),
                                 out_dtype=lambda x, *_: x, func_type="aot")
        # (N T, 3 D) q|k|v rows and a bias, [T, heads, threads, level], rotary tables (N T, 2 hd), each image's keys
        # (N,) -> (N T, D): one image of every patch (raster order), or each window an image of T (its padding last)
        self.attend = ops.Custom(f"{kernels}:VisionAttention", out_shape=lambda qkv, *_: (qkv[0], qkv[1] // 3),
                                 out_dtype=lambda qkv, *_: qkv, func_type="aot")
        # x (R, D), gain, bias, [eps], [threads] -> (R, D)
        self.layer_norm = ops.Custom(f"{kernels}:VisionLayerNorm", out_shape=lambda x, *_: x,
                                     out_dtype=lambda x, *_: x, func_type="aot")
        # x (R, D), gain, [eps], [threads] -> (R, D); gate|up (R, 2 I), [threads, activation] -> (R, I)
        self.rms_norm = ops.Custom(f"{kernels}:VisionRmsNorm", out_shape=lambda x, *_: x,
                                   out_dtype=lambda x, *_: x, func_type="aot")
        self.gated_product = ops.Custom(f"{kernels}:VisionGated", out_shape=lambda gu, *_: (gu[0], gu[1] // 2),
                                out_dtype=lambda gu, *_: gu, func_type="aot")
        self.silu = Tensor(np.array([threads, 0], np.int32))
        self.eps_tensor = Tensor(np.array([cfg.eps], np.float32))
        self.plain = Tensor(np.array([threads, 0], np.int32))
        # fc1's activation (VisionLinear's code: layer_parts_cpu.h's kGeluTanh 1, kQuickGelu 3)
        self.fc1_activation = Tensor(np.array([threads, 3 if cfg.mlp_activation == "quick_gelu" else 1], np.int32))
        self.threads_tensor = Tensor(np.array([threads], np.int32))
        self.no_bias = Tensor(np.zeros(3 * cfg.hidden_size, np.float32))
        self.threads, self.level = threads, level

    def _norm(self, x, norm):
        if self.layer_norms:
            return self.layer_norm(x, norm[0], norm[1], self.eps_tensor, self.threads_tensor)
        return self.rms_norm(x, norm, self.eps_tensor, self.threads_tensor)

    def _mlp(self, h, up, up_bias, down, down_bias):
        if not self.gated:
            return self.linear(self.linear(h, up, up_bias, self.fc1_activation), down, down_bias, self.plain)
        gate_up = self.linear(h, up, up_bias, self.plain)                                    # (R, 2 I)
        return self.linear(self.gated_product(gate_up, self.silu), down, down_bias, self.plain)

    def construct(self, x, rope, config, keys, norm1, qkv_w, qkv_bias, proj_w, proj_bias, norm2, up, up_bias, down,
                  down_bias):
        qkv = self.linear(self._norm(x, norm1), qkv_w, qkv_bias, self.plain)                   # (N, 3 D)
        x = x + self.linear(self.attend(qkv, self.no_bias, config, rope, keys), proj_w, proj_bias, self.plain)
        return x + self._mlp(self._norm(x, norm2), up, up_bias, down, down_bias)


class _MergerProducts(nn.Cell):
    """A merger's two products (x W^T + b): VisionLinear on the kernels' panels (`kernels`), else MindSpore's MatMul
    on the matrices as stored. (As MindSpore's float32 MatMul, a Qwen3-VL-4B's four mergers took 0.55 s an image of
    768 tokens on two Zen 5 cores: 4,096 x 4,096 each.)"""

    def __init__(self, kernels=None, threads: int = 1):
        super().__init__()
        self.on_kernels = kernels is not None
        self.matmul = ops.MatMul(transpose_b=True)
        if kernels is not None:
            self.linear = ops.Custom(f"{kernels}:VisionLinear", out_shape=lambda x, w, bias, *_: (x[0], bias[-1]),
                                     out_dtype=lambda x, *_: x, func_type="aot")
            self.plain = Tensor(np.array([threads, 0], np.int32))

    def product(self, x, w, bias):
        if self.on_kernels:
            return self.linear(x, w, bias, self.plain)
        return self.matmul(x, w) + bias


class _Merger(nn.Cell):
    """The last block's output (gh2, gw2, m m, D) -> (1, gh2 gw2, out_hidden): ln_q, each unit's patches as one row
    of m m D, Linear, GELU (erf), Linear (the products _MergerProducts')."""

    def __init__(self, cfg: QwenVisionConfig, kernels=None, threads: int = 1):
        super().__init__()
        self.eps = cfg.eps
        self.products = _MergerProducts(kernels, threads)

    def construct(self, x, ln_q, fc1, fc1_bias, fc2, fc2_bias):
        gh2, gw2, mm, d = x.shape
        h = (_rms_normalize(x, self.eps) * ln_q).reshape(gh2 * gw2, mm * d)
        h = _gelu_erf(self.products.product(h, fc1, fc1_bias))
        out = self.products.product(h, fc2, fc2_bias)
        return out.reshape(1, gh2 * gw2, out.shape[-1])


class _LayerNormMerger(nn.Cell):
    """Qwen3-VL's merger (Qwen3VLVisionPatchMerger; Qwen2-VL's PatchMerger is the same): a block's output
    (gh2, gw2, m m, D) -> (gh2 gw2, out_hidden). LayerNorm over each patch, each unit's patches as one row of m m D;
    or (`postshuffle`, the DeepStack mergers') the row first, then its LayerNorm over all m m D; then Linear, GELU
    (erf), Linear (the products _MergerProducts')."""

    def __init__(self, cfg: QwenVisionConfig, postshuffle: bool, kernels=None, threads: int = 1):
        super().__init__()
        self.eps, self.postshuffle = cfg.eps, postshuffle
        self.products = _MergerProducts(kernels, threads)

    def construct(self, x, gain, bias, fc1, fc1_bias, fc2, fc2_bias):
        gh2, gw2, mm, d = x.shape
        if self.postshuffle:
            h = _layer_normalize(x.reshape(gh2 * gw2, mm * d), self.eps) * gain + bias
        else:
            h = (_layer_normalize(x, self.eps) * gain + bias).reshape(gh2 * gw2, mm * d)
        return self.products.product(_gelu_erf(self.products.product(h, fc1, fc1_bias)), fc2, fc2_bias)


class _PixtralMerger(nn.Cell):
    """Mistral 3's projector (Mistral3MultiModalProjector): the last block's output (gh2, gw2, m m, D) -> (1, gh2 gw2,
    out_hidden): RMS norm over each patch (the text model's eps), each unit's m m patches one row of m m D (the patch
    merger's matrix read with its columns in that order: transformers' unfold lays a unit out value by value, each
    value's m m patches together), the merging product, linear_1, GELU (erf), linear_2 (the products
    _MergerProducts')."""

    def __init__(self, cfg: QwenVisionConfig, kernels=None, threads: int = 1):
        super().__init__()
        self.eps = cfg.merger_eps if cfg.merger_eps is not None else cfg.eps
        self.products = _MergerProducts(kernels, threads)

    def construct(self, x, gain, merging, merging_bias, fc1, fc1_bias, fc2, fc2_bias):
        gh2, gw2, mm, d = x.shape
        h = (_rms_normalize(x, self.eps) * gain).reshape(gh2 * gw2, mm * d)
        h = _gelu_erf(self.products.product(self.products.product(h, merging, merging_bias), fc1, fc1_bias))
        out = self.products.product(h, fc2, fc2_bias)
        return out.reshape(1, gh2 * gw2, out.shape[-1])


class _LlavaMerger(nn.Cell):
    """Pixtral 12B's projector (LlavaMultiModalProjector): the last block's output (gh, gw, 1, D), each patch a token,
    -> (1, gh gw, out_hidden): linear_1, GELU (erf), linear_2 (the products _MergerProducts')."""

    def __init__(self, kernels=None, threads: int = 1):
        super().__init__()
        self.products = _MergerProducts(kernels, threads)

    def construct(self, x, fc1, fc1_bias, fc2, fc2_bias):
        gh, gw, one, d = x.shape
        h = _gelu_erf(self.products.product(x.reshape(gh * gw, one * d), fc1, fc1_bias))
        out = self.products.product(h, fc2, fc2_bias)
        return out.reshape(1, gh * gw, out.shape[-1])


def pixtral_merger_columns(cfg: QwenVisionConfig) -> np.ndarray:
    """The columns of Pixtral's patch merger matrix (D, D m m) in the order of a unit's row here (its patches k, each
    patch's D values: k D + d), from transformers' order (each value d's m m patches: d m m + k)."""
    mm, d = cfg.spatial_merge_size ** 2, cfg.hidden_size
    return (np.arange(d)[None, :] * mm + np.arange(mm)[:, None]).reshape(-1)


@dataclass(frozen=True)
class QwenState:
    """An image between `run_layers` calls of a tower with DeepStack mergers (Qwen3-VL's): `x` its patches
    (gh2, gw2, m m, D), a tensor (or numpy, as the runner keeps it between steps: `QwenVisionTower.kept`); `deepstack`
    the DeepStack mergers' rows of the blocks run so far, (gh2 gw2, out_hidden) float32 numpy each, in
    deepstack_visual_indexes order. (A tower without them passes the patches alone.)"""
    x: object
    deepstack: tuple = ()


def _numpy(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.asnumpy()


class QwenVisionTower:
    """A Qwen-VL-like tower and its mergers: Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's or Pixtral's (the module
    docstring; `cfg.family`). `weights`: {name:
    StoredTensor} as weights/vision.py's `vision_checkpoint` gives them (or arrays under the same names). The
    interface the runner uses is the SigLIP tower's (`embed`, `run_layers`, `project`, `kept`, `encode`, `warm`,
    `nbytes`), on one image at a time whose grid its state carries: (gh2, gw2, m m, D), in a `QwenState` with the
    DeepStack rows made so far where the tower has DeepStack mergers. `kernels`, `threads`: the CPU vision kernel
    library its blocks' products run on and its threads (None: MindSpore's ops); `int16`: those products on int16
    panels (the runner's vision_int16)."""

    MAX_LAYOUTS = 8             # grids whose window layout and rotary tables are kept

    def __init__(self, cfg: QwenVisionConfig, weights: dict, kernels=None, threads: int = 1, int16: bool = False):
        read = _reader(weights, qwen_vision_shapes(cfg))
        self.cfg = cfg
        self.positioned = cfg.family == "qwen3_vl"           # (a biased patch embedding plus position rows)
        self.int16 = int16 and kernels is not None
        stored_type = None if kernels is None else (lambda name: getattr(weights[name], "stored_type", None))
        kernel = _tensor(read("visual.patch_embed.proj.weight").reshape(cfg.hidden_size, cfg.patch_features))
        self.layer_weights = [_block_weights(read, cfg, i, stored_type, self.int16) for i in range(cfg.num_layers)]
        self.deepstack_weights = []
        if cfg.family == "pixtral":
            self.embed_weights = (kernel, _tensor(read("visual.ln_pre.weight")))
            self.embedding = _NormedEmbed(cfg.eps)
            if cfg.patch_merger:
                merger = ("norm.weight", "merging_layer", "linear_1", "linear_2")
                self.merger_weights = _merger_weights(
                    read, tuple(f"visual.merger.{n}" for n in merger), stored_type, self.int16, products=3,
                    biases=(False, cfg.projector_bias, cfg.projector_bias), columns=pixtral_merger_columns(cfg))
            else:                           # (Pixtral 12B's: LLaVA's projector)
                self.merger_weights = _merger_weights(
                    read, ("visual.merger.linear_1", "visual.merger.linear_2"), stored_type, self.int16,
                    biases=(cfg.projector_bias, cfg.projector_bias))
            self.merger = (_PixtralMerger(cfg, kernels, threads) if cfg.patch_merger
                           else _LlavaMerger(kernels, threads))
        elif cfg.family == "qwen2_vl":
            self.embed_weights = (kernel,)
            self.embedding = _Embed()
            merger = ("ln_q.weight", "ln_q.bias", "mlp.0", "mlp.2")
            self.merger_weights = _merger_weights(read, tuple(f"visual.merger.{n}" for n in merger), stored_type,
                                                  self.int16)
            self.merger = _LayerNormMerger(cfg, False, kernels, threads)
        elif self.positioned:
            self.embed_weights = (kernel, _tensor(read("visual.patch_embed.proj.bias")),
                                  _tensor(read("visual.pos_embed.weight")))
            self.embedding = _PositionedEmbed()
            merger = ("norm.weight", "norm.bias", "linear_fc1", "linear_fc2")
            self.merger_weights = _merger_weights(read, tuple(f"visual.merger.{n}" for n in merger), stored_type,
                                                  self.int16)
            self.deepstack_weights = [_merger_weights(read, tuple(f"visual.deepstack_merger_list.{k}.{n}"
                                                                  for n in merger), stored_type, self.int16)
                                      for k in range(cfg.deepstack_layers)]
            self.merger = _LayerNormMerger(cfg, False, kernels, threads)
            self.deepstack_merger = _LayerNormMerger(cfg, True, kernels, threads)
        else:
            self.embed_weights = (kernel,)
            self.embedding = _Embed()
            self.merger_weights = _merger_weights(read, ("visual.merger.ln_q.weight", "visual.merger.mlp.0",
                                                         "visual.merger.mlp.2"), stored_type, self.int16)
            self.merger = _Merger(cfg, kernels, threads)
        windowed = len(set(cfg.fullatt_block_indexes)) < cfg.num_layers         # (Qwen3-VL's: none)
        # (on the kernels every block is _FullBlock's: the full ones in raster order, the windowed on the windows)
        self.window_block = _Block(cfg, full=False) if windowed and kernels is None else None
        self.full_block = _Block(cfg, full=True) if kernels is None else None
        self.threads, self.level = threads, 1 if self.int16 else 0     # (VisionAttention's int16 values with int16)
        self.full_kernel_block = None if kernels is None else _FullBlock(cfg, kernels, threads, self.level)
        self._layouts: OrderedDict = OrderedDict()

    @property
    def nbytes(self) -> int:
        """The bytes its weights take."""
        tensors = [*self.embed_weights, *self.merger_weights, *(t for w in self.deepstack_weights for t in w),
                   *(t for w in self.layer_weights for t in w)]
        return sum(t.nbytes for t in tensors)

    def _layout(self, gh2: int, gw2: int) -> _Layout:
        layout = self._layouts.get((gh2, gw2))
        if layout is None:
            layout = self._layouts[(gh2, gw2)] = _Layout(self.cfg, gh2, gw2)
            while len(self._layouts) > self.MAX_LAYOUTS:
                self._layouts.popitem(last=False)
        self._layouts.move_to_end((gh2, gw2))
        return layout

    def warm(self) -> None:
        """Compile the graphs and run each once on one merge unit of zeros (one window): the patch embedding, a
        windowed and a full block, the mergers. Another image's number of windows (or grid, for the embedding and
        the mergers) compiles its graphs when it first comes."""
        cfg = self.cfg
        state = self.embed(np.zeros((1, 1, cfg.spatial_merge_size ** 2, cfg.patch_features), np.float32))
        windowed = [i for i in range(cfg.num_layers) if i not in cfg.fullatt_block_indexes][:1]
        for i in windowed + list(cfg.fullatt_block_indexes[:1]):     # (Qwen3-VL's: block 0, before any DeepStack)
            self.run_layers(state, i, i + 1)
        x = self._unpacked(state)[0]
        self.merger(x, *self.merger_weights).asnumpy()
        for weights in self.deepstack_weights[:1]:
            self.deepstack_merger(x, *weights).asnumpy()

    def encode(self, patches: np.ndarray) -> np.ndarray:
        """(1, gh2 gw2, row_width) float32 rows of one image's patches (gh2, gw2, m m, C T P P), as vision/images.py's
        `qwen_patches` makes them: a token a merge unit, row by row; each row the merger's (out_hidden), then each
        DeepStack merger's (Qwen3-VL's), side by side."""
        cfg = self.cfg
        mm = cfg.spatial_merge_size ** 2
        if patches.ndim != 4 or patches.shape[2:] != (mm, cfg.patch_features) or min(patches.shape[:2]) < 1:
            raise ValueError(f"QwenVisionTower.encode: patches of shape (gh2, gw2, {mm}, {cfg.patch_features}), "
                             f"not {patches.shape}")
        return self.project(self.run_layers(self.embed(patches), 0, cfg.num_layers))

    # An image's encoding in parts, the same graphs on the same values in the same order as `encode`'s (so its rows
    # are the same to the bit): the patches, then layers a..b-1 as often as wanted, then the mergers. The agent
    # runs an image's layers a few at a time while other requests decode (runner/images.py's `advance`), keeping
    # the state between steps as `kept` gives it.

    def _state(self, x, deepstack=()):
        # what embed and run_layers give: the patches, with the DeepStack rows so far where the tower makes them
        return QwenState(x, tuple(deepstack)) if self.deepstack_weights else x

    @staticmethod
    def _unpacked(state) -> tuple:
        # (the patches, the DeepStack rows so far) of a state
        return (state.x, state.deepstack) if isinstance(state, QwenState) else (state, ())

    def kept(self, state):
        """`state` as the runner keeps it between steps: its tensors as numpy (exact copies)."""
        x, deepstack = self._unpacked(state)
        return self._state(_numpy(x), deepstack)

    def embed(self, patches: np.ndarray):
        """The patches' embeddings (gh2, gw2, m m, D) (a MindSpore tensor: the first layer's input; in a QwenState
        with DeepStack mergers)."""
        if self.positioned:
            layout = self._layout(*patches.shape[:2])
            x = self.embedding(_tensor(patches), *self.embed_weights, layout.taps, layout.tap_weights)
        else:
            x = self.embedding(_tensor(patches), *self.embed_weights)
        return self._state(x)

    def run_layers(self, state, start: int, stop: int):
        """`state` (the patches (gh2, gw2, m m, D), a tensor or its numpy array; a QwenState with DeepStack mergers)
        through blocks start..stop-1: a state of the same kind, its patches a tensor, with the rows of the
        DeepStack mergers of those blocks added. Each call lays the patches out in windows and back (exact copies),
        the padding zero where it lays them out (and, on MindSpore's ops, at every block's start; on the kernels no
        padding row reaches a patch's), so a block's output is the same whichever call runs it."""
        x, deepstack = self._unpacked(state)
        made = sum(i < start for i in self.cfg.deepstack_visual_indexes)
        if len(deepstack) != made:
            raise ValueError(f"run_layers from block {start}: the state holds {len(deepstack)} DeepStack rows, not "
                             f"the {made} of the blocks before it")
        if start >= stop:
            return self._state(_tensor(x) if isinstance(x, np.ndarray) else x, deepstack)
        array = _numpy(x)
        gh2, gw2, mm, d = array.shape
        layout = self._layout(gh2, gw2)
        raster, h = array.reshape(gh2 * gw2 * mm, d), None     # the state: raster rows (numpy) or windows (tensor)
        deepstack = list(deepstack)
        heads = self.cfg.num_heads       # VisionAttention's configs: every patch one image, or each window one
        full_config = Tensor(np.array([layout.patches, heads, self.threads, self.level], np.int32))
        window_config = Tensor(np.array([layout.per_window, heads, self.threads, self.level], np.int32))
        for i in range(start, stop):
            full = i in self.cfg.fullatt_block_indexes
            if self.full_kernel_block is not None:             # (VisionAttention: over every patch in raster order,
                if full:                                       # or within each window, the windowed layout's rows)
                    if h is not None:
                        raster, h = layout.raster(h.asnumpy()), None
                    raster = self.full_kernel_block(_tensor(raster), layout.raster_rope, full_config,
                                                    layout.raster_keys, *self.layer_weights[i]).asnumpy()
                else:
                    if h is None:
                        h = _tensor(layout.windowed(raster).reshape(-1, d))
                    h = self.full_kernel_block(h, layout.window_rope, window_config, layout.keys,
                                               *self.layer_weights[i])
            else:
                if h is None:
                    h = _tensor(layout.windowed(raster))
                block = self.full_block if full else self.window_block
                h = block(h, layout.keep, layout.key_bias, layout.cos, layout.sin, *self.layer_weights[i])
            if i in self.cfg.deepstack_visual_indexes:         # (its merger on the block's output, in raster order)
                if h is not None:
                    raster, h = layout.raster(h.asnumpy()), None
                weights = self.deepstack_weights[self.cfg.deepstack_visual_indexes.index(i)]
                deepstack.append(self.deepstack_merger(_tensor(raster.reshape(gh2, gw2, mm, d)), *weights).asnumpy())
        if h is not None:
            raster = layout.raster(h.asnumpy())
        return self._state(_tensor(raster.reshape(gh2, gw2, mm, d)), deepstack)

    def project(self, state) -> np.ndarray:
        """The (1, gh2 gw2, row_width) float32 rows of the last block's state: the merger's rows of its patches
        (gh2, gw2, m m, D), then (Qwen3-VL's) the DeepStack rows, side by side."""
        x, deepstack = self._unpacked(state)
        if len(deepstack) != self.cfg.deepstack_layers:
            raise ValueError(f"project: the state holds {len(deepstack)} DeepStack rows, not "
                             f"{self.cfg.deepstack_layers}: its blocks have not all run")
        x = _tensor(x) if isinstance(x, np.ndarray) else x
        rows = self.merger(x, *self.merger_weights).asnumpy()
        if not isinstance(self.merger, _LayerNormMerger):
            return rows                                                                 # (1, units, out_hidden)
        return np.concatenate([rows, *deepstack], axis=1)[None]                           # (units, ...) side by side
