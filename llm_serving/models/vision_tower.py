"""The vision tower: images' pixels to the text model's embeddings of them, as one MindSpore graph.

Gemma 3's (`VisionTower`):
- SigLIP: the image cut into patch_size-square patches, each a row of the patch embedding's matrix (the
  checkpoint's stride-equal-kernel convolution, as a matmul), plus a learned position row;
- num_layers pre-norm encoder layers: LayerNorm, bidirectional attention over every patch (biases on q, k, v and
  out), a residual; LayerNorm, fc1, tanh GELU, fc2, a residual; then the post LayerNorm;
- the projector: the patch grid average-pooled to tokens_per_side squared tokens, Gemma's RMS norm (gain 1 + w),
  and the projection to the text model's width.

In float32 throughout, the weights as the checkpoint stores them widened once. `encode(pixels)` runs a batch of
images (N, 3, image_size, image_size), each image's tokens in the order the prompt's placeholders take them (row by
row of the pooled grid).
"""
from __future__ import annotations

import math

import numpy as np

from mindspore import Parameter, Tensor, nn, ops

from llm_serving.models.weights.vision import VisionConfig, vision_shapes

__all__ = ["VisionTower"]


def _param(array: np.ndarray, name: str) -> Parameter:
    return Parameter(Tensor(np.ascontiguousarray(array, np.float32)), name=name, requires_grad=False)


def _layer_norm(x, gain, bias, eps: float):
    mean = x.mean(axis=-1, keep_dims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keep_dims=True)
    return centred * ops.rsqrt(var + eps) * gain + bias


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + ops.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class _EncoderLayer(nn.Cell):
    """One SigLIP encoder layer (see the module docstring); q, k and v as one matrix."""

    def __init__(self, cfg: VisionConfig, read, index: int):
        super().__init__()
        at = f"vision_tower.encoder.layers.{index}."
        self.eps, self.heads, self.head_dim = cfg.layer_norm_eps, cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.norm1_gain, self.norm1_bias = (_param(read(at + f"layer_norm1.{k}"), f"v{index}_n1{k[0]}")
                                            for k in ("weight", "bias"))
        self.norm2_gain, self.norm2_bias = (_param(read(at + f"layer_norm2.{k}"), f"v{index}_n2{k[0]}")
                                            for k in ("weight", "bias"))
        qkv = [read(at + f"self_attn.{p}_proj.weight") for p in "qkv"]
        self.qkv = _param(np.concatenate(qkv, 0).T, f"v{index}_qkv")                           # (D, 3D)
        self.qkv_bias = _param(np.concatenate([read(at + f"self_attn.{p}_proj.bias") for p in "qkv"]),
                               f"v{index}_qkv_b")
        self.out = _param(read(at + "self_attn.out_proj.weight").T, f"v{index}_out")             # (D, D)
        self.out_bias = _param(read(at + "self_attn.out_proj.bias"), f"v{index}_out_b")
        self.fc1 = _param(read(at + "mlp.fc1.weight").T, f"v{index}_fc1")                        # (D, M)
        self.fc1_bias = _param(read(at + "mlp.fc1.bias"), f"v{index}_fc1_b")
        self.fc2 = _param(read(at + "mlp.fc2.weight").T, f"v{index}_fc2")                        # (M, D)
        self.fc2_bias = _param(read(at + "mlp.fc2.bias"), f"v{index}_fc2_b")
        self.matmul = ops.MatMul()
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.weighted = ops.BatchMatMul()

    def construct(self, x):
        n, t, d = x.shape
        h = _layer_norm(x, self.norm1_gain, self.norm1_bias, self.eps).reshape(n * t, d)
        qkv = (self.matmul(h, self.qkv) + self.qkv_bias).reshape(n, t, 3, self.heads, self.head_dim)
        qkv = qkv.transpose(2, 0, 3, 1, 4)                                      # (3, N, heads, T, head_dim)
        probs = ops.softmax(self.scores(qkv[0], qkv[1]) * self.scale, axis=-1)
        attended = self.weighted(probs, qkv[2]).transpose(0, 2, 1, 3).reshape(n * t, d)
        x = x + (self.matmul(attended, self.out) + self.out_bias).reshape(n, t, d)
        h = _layer_norm(x, self.norm2_gain, self.norm2_bias, self.eps).reshape(n * t, d)
        h = _gelu_tanh(self.matmul(h, self.fc1) + self.fc1_bias)
        return x + (self.matmul(h, self.fc2) + self.fc2_bias).reshape(n, t, d)


class VisionTower(nn.Cell):
    """Gemma 3's SigLIP tower and projector (the module docstring). `weights`: {name: StoredTensor} as
    weights/vision.py's `vision_checkpoint` gives them (or arrays under the same names)."""

    def __init__(self, cfg: VisionConfig, weights: dict):
        super().__init__()
        shapes = vision_shapes(cfg)

        def read(name: str) -> np.ndarray:
            tensor = weights[name]
            array = tensor if isinstance(tensor, np.ndarray) else tensor.read((slice(None),) * len(shapes[name]))
            return np.asarray(array, np.float32)

        self.cfg = cfg
        d, p = cfg.hidden_size, cfg.patch_size
        patch = read("vision_tower.embeddings.patch_embedding.weight").reshape(d, cfg.num_channels * p * p)
        self.patch = _param(patch.T, "v_patch")                                           # (3 P P, D)
        self.patch_bias = _param(read("vision_tower.embeddings.patch_embedding.bias"), "v_patch_b")
        self.positions = _param(read("vision_tower.embeddings.position_embedding.weight"), "v_positions")  # (G G, D)
        self.layers = nn.CellList([_EncoderLayer(cfg, read, i) for i in range(cfg.num_layers)])
        self.post_gain = _param(read("vision_tower.post_layernorm.weight"), "v_post_g")
        self.post_bias = _param(read("vision_tower.post_layernorm.bias"), "v_post_b")
        self.soft_gain = _param(1.0 + read("multi_modal_projector.mm_soft_emb_norm.weight"), "v_soft_g")
        self.projection = _param(read("multi_modal_projector.mm_input_projection_weight"), "v_projection")  # (D, H)
        self.matmul = ops.MatMul()

    def construct(self, pixels):
        cfg = self.cfg
        n = pixels.shape[0]
        g, p, c, d = cfg.patches_per_side, cfg.patch_size, cfg.num_channels, cfg.hidden_size
        patches = pixels.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n * g * g, c * p * p)
        x = (self.matmul(patches, self.patch) + self.patch_bias).reshape(n, g * g, d) + self.positions
        for layer in self.layers:
            x = layer(x)
        x = _layer_norm(x, self.post_gain, self.post_bias, cfg.layer_norm_eps)
        s, k = cfg.tokens_per_side, cfg.pool
        pooled = x.reshape(n, s, k, s, k, d).mean(axis=(2, 4)).reshape(n * s * s, d)
        normed = pooled * ops.rsqrt((pooled * pooled).mean(axis=-1, keep_dims=True) + cfg.layer_norm_eps)
        return self.matmul(normed * self.soft_gain, self.projection).reshape(n, s * s, cfg.text_hidden_size)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(N, tokens_per_image, text hidden) float32 embeddings of N images' pixels (N, 3, size, size)."""
        size = self.cfg.image_size
        if pixels.ndim != 4 or pixels.shape[1:] != (self.cfg.num_channels, size, size):
            raise ValueError(f"VisionTower.encode: pixels of shape (N, 3, {size}, {size}), not {pixels.shape}")
        return self(Tensor(np.ascontiguousarray(pixels, np.float32))).asnumpy()

