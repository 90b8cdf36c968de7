"""A float64 numpy vision tower and projector: the yardstick an image's rows are checked against (the precision gate's,
beside reference_llama.py's text model).

Written on its own, sharing nothing with llm_serving/models/ but the checkpoint readers (weights/vision.py), in
transformers' own form: SigLIP's patch embedding (a stride-equal-kernel convolution) plus learned positions, pre-norm
encoder layers (LayerNorm, every patch attending to every patch with biased q/k/v/out, a residual; LayerNorm, fc1, the
tanh GELU, fc2, a residual), the post LayerNorm; then Gemma 3's projector (the patch grid average-pooled, Gemma's RMS
norm with gain 1 + w, the projection) or SmolVLM's / Idefics3's (the pixel shuffle, a projection without bias).

    ref = ReferenceVision(model_dir)                 # or ReferenceVision(None, mmproj="mmproj.gguf")
    rows = ref.encode(pixels)                        # (3, S, S) float32 pixels -> (tokens_per_image, text width)

Pixels are the model's processor's (llm_serving/vision, checked against transformers' processors by the tests):
the reference starts where the tower does.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from llm_serving.models.weights.vision import VisionConfig, mmproj_checkpoint, vision_checkpoint

__all__ = ["ReferenceVision"]


class ReferenceVision:
    """The tower of a HF model directory (`model_path`) or of llama.cpp's mmproj GGUF (`mmproj`), in float64."""

    def __init__(self, model_path: Optional[str], mmproj: Optional[str] = None):
        found = mmproj_checkpoint(mmproj) if mmproj else vision_checkpoint(model_path)
        if found is None:
            raise ValueError(f"reference: {model_path} has no vision tower")
        if not isinstance(found[0], VisionConfig):
            raise ValueError(f"reference: {model_path}'s vision tower (Qwen2.5-VL's) has no float64 reference yet; the "
                             "precision gate checks its text model without --images")
        self.config, tensors = found
        self.w = {name: np.asarray(t.read((slice(None),) * len(t.shape)), np.float64) for name, t in tensors.items()}

    @property
    def bidirectional(self) -> bool:
        """Whether the text model's image tokens see their whole image (Gemma 3's mask), not just what precedes."""
        return self.config.bidirectional

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(tokens_per_image, text hidden) float64 rows of one image's (or frame's) pixels (C, S, S)."""
        c, w = self.config, self.w
        g, p, d = c.patches_per_side, c.patch_size, c.hidden_size
        x = np.asarray(pixels, np.float64).reshape(c.num_channels, g, p, g, p).transpose(1, 3, 0, 2, 4)
        kernel = w["vision_tower.embeddings.patch_embedding.weight"].reshape(d, -1)       # (D, C p p)
        x = x.reshape(g * g, -1) @ kernel.T + w["vision_tower.embeddings.patch_embedding.bias"]
        x = x + w["vision_tower.embeddings.position_embedding.weight"]
        for i in range(c.num_layers):
            x = self._layer(x, f"vision_tower.encoder.layers.{i}.")
        x = self._layer_norm(x, "vision_tower.post_layernorm")
        return self._shuffle(x) if c.projector == "shuffle" else self._pool(x)

    def _layer_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + self.config.layer_norm_eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.w[name + ".weight"].T + self.w[name + ".bias"]

    def _layer(self, x: np.ndarray, at: str) -> np.ndarray:
        c = self.config
        t, heads, hd = len(x), c.num_heads, c.head_dim
        h = self._layer_norm(x, at + "layer_norm1")
        q, k, v = (self._linear(h, at + f"self_attn.{n}_proj").reshape(t, heads, hd).transpose(1, 0, 2)
                   for n in "qkv")
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)                               # (heads, T, T)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attended = (scores / scores.sum(axis=-1, keepdims=True)) @ v                      # (heads, T, hd)
        x = x + self._linear(attended.transpose(1, 0, 2).reshape(t, heads * hd), at + "self_attn.out_proj")
        h = self._linear(self._layer_norm(x, at + "layer_norm2"), at + "mlp.fc1")
        h = 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
        return x + self._linear(h, at + "mlp.fc2")

    def _pool(self, x: np.ndarray) -> np.ndarray:
        """Gemma 3's: the (G, G) grid of patches average-pooled in k x k windows, row by row of the pooled grid,
        then x / sqrt(mean(x^2) + eps) (1 + w) and the projection."""
        c = self.config
        g, k, side = c.patches_per_side, c.pool, c.tokens_per_side
        pooled = x.reshape(side, k, side, k, -1).mean(axis=(1, 3)).reshape(side * side, -1)
        gain = 1.0 + self.w["multi_modal_projector.mm_soft_emb_norm.weight"]
        normed = pooled / np.sqrt(np.mean(pooled * pooled, axis=-1, keepdims=True) + c.layer_norm_eps) * gain
        assert g == side * k
        return normed @ self.w["multi_modal_projector.mm_input_projection_weight"]

    def _shuffle(self, x: np.ndarray) -> np.ndarray:
        """Idefics3's pixel shuffle (transformers' `pixel_shuffle`, its views and permutes), then the projection."""
        s, d = self.config.scale_factor, self.config.hidden_size
        side = self.config.patches_per_side
        y = x.reshape(side, side // s, d * s)                 # (height, width / s, D s)
        y = y.transpose(1, 0, 2).reshape(side // s, side // s, d * s * s)
        y = y.transpose(1, 0, 2).reshape(side * side // (s * s), d * s * s)
        return y @ self.w["multi_modal_projector.proj.weight"].T
