"""A float64 numpy vision tower and projector: the yardstick an image's rows are checked against (the precision gate's,
beside reference_llama.py's text model).

Written on its own, sharing nothing with llm_serving/models/ but the checkpoint readers (weights/vision.py), in
transformers' own form: SigLIP's patch embedding (a stride-equal-kernel convolution) plus learned positions, pre-norm
encoder layers (LayerNorm, every patch attending to every patch with biased q/k/v/out, a residual; LayerNorm, fc1, the
tanh GELU, fc2, a residual), the post LayerNorm; then Gemma 3's projector (the patch grid average-pooled, Gemma's RMS
norm with gain 1 + w, the projection) or SmolVLM's / Idefics3's (the pixel shuffle, a projection without bias).
LLaVA 1.5's CLIP tower the same layers with a class token first, no patch bias, the pre-LayerNorm, quick GELU, the
layers up to the one LLaVA reads and no post LayerNorm; LLaVA's projector (linear_1, erf GELU, linear_2) on every
patch's row, the class token's dropped.

Qwen2.5-VL's tower (a `QwenVisionConfig`) is another: the image at its own size, its patches of C x T x P x P values
embedded by the 3-D convolution (a product with the flattened kernel, no bias); the 2-D rotary positions (head_dim / 4
frequencies times the patch's row, the same times its column, that half repeated, q and k rotated by halves);
the patches put in window order (the grid of merge units cut into windows of `window_units` units a side from the top
left, the last ones partial, each window's units row by row); pre-norm blocks (RMS norm, attention with a joined
biased qkv, over every patch in the `fullatt_block_indexes` blocks and within each window in the others, a residual;
RMS norm, the SwiGLU MLP with biases, a residual); the merger (ln_q's RMS norm, each unit's m x m patches side by
side as one row, Linear, the exact erf GELU, Linear); then the window order undone, so the rows are the merge units
row by row, as the prompt's image tokens are.

Qwen3-VL's (`family` "qwen3_vl") keeps the patches in their order (every block attends over every patch): the patch
embedding with its bias, plus each patch's position row (the learned side x side grid interpolated bilinearly with
align_corners to the image's patch grid: at i of n patches an axis samples the grid at i (side - 1) / (n - 1), between
its rows floor and floor + 1 weighted by 1 - the distance); pre-norm blocks (LayerNorm, attention with the same 2-D
rotary positions, a residual; LayerNorm, fc1, the tanh GELU, fc2, a residual); the merger (LayerNorm per patch, a
unit's patches as one row, Linear, erf GELU, Linear), and after each block of deepstack_visual_indexes its DeepStack
merger (a unit's patches as one row, LayerNorm over it, Linear, erf GELU, Linear): a token's row the merger's, then the
DeepStack mergers', side by side.

Qwen2-VL's (`family` "qwen2_vl") is Qwen3-VL's without the patch embedding's bias, the position rows and DeepStack:
its MLP fc1, quick GELU (x sigmoid(1.702 x)), fc2; its merger's LayerNorm ln_q, its products mlp.0 and mlp.2.

Pixtral's (Mistral 3's, `family` "pixtral") keeps the patches in their order too: the patch embedding without bias,
ln_pre (RMS norm); blocks of RMS norms, attention over every patch with separate q, k, v, o without biases and its own
2-D rotary positions (the head's head_dim / 2 frequencies, the even ones times the patch's row and the odd ones times
its column, that half repeated), a SwiGLU MLP without biases; then Mistral 3's projector as transformers writes it:
RMS norm (the text model's eps), each 2 x 2 block of patches unfolded value by value (a value's m m patches
together), the merging Linear, linear_1, erf GELU, linear_2 (Pixtral 12B's, a LLaVA: each patch straight to linear_1,
erf GELU, linear_2). Its rows are given at each of the image's tokens: the
prompt ends each row of merge units with a break token (the last with the image's end), whose row is NaN (the token
keeps its own embedding: reference_llama.py's forward leaves it).

    ref = ReferenceVision(model_dir)                 # or ReferenceVision(None, mmproj="mmproj.gguf")
    rows = ref.encode(pixels)                        # (3, S, S) float32 pixels -> (tokens_per_image, text width)
    rows = ref.encode(patches)                       # Qwen2.5-VL: (gh2, gw2, m m, C T P P) -> (gh2 gw2, text width)
    rows = ref.encode(patches)                       # Qwen3-VL: ... -> (gh2 gw2, text width x (1 + DeepStack layers))
    rows = ref.encode(patches)                       # Pixtral: (gh2, gw2, m m, C P P) -> (gh2 (gw2 + 1), text width),
                                                     # NaN at the row breaks' and end's tokens (their own embeddings)

Pixels are the model's processor's (llm_serving/vision, checked against transformers' processors by the tests; for
Qwen2.5-VL `qwen_patches`'): the reference starts where the tower does.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from llm_serving.models.weights.vision import QwenVisionConfig, mmproj_checkpoint, vision_checkpoint

__all__ = ["ReferenceVision"]


class ReferenceVision:
    """The tower of a HF model directory (`model_path`) or of llama.cpp's mmproj GGUF (`mmproj`), in float64: a
    SigLIP tower and its projector, or Qwen2.5-VL's or Qwen3-VL's tower and mergers (`config` a QwenVisionConfig;
    both readers give Qwen2.5-VL's tensors the same `visual.*` names)."""

    def __init__(self, model_path: Optional[str], mmproj: Optional[str] = None):
        found = mmproj_checkpoint(mmproj) if mmproj else vision_checkpoint(model_path)
        if found is None:
            raise ValueError(f"reference: {model_path} has no vision tower")
        self.config, tensors = found
        self.w = {name: np.asarray(t.read((slice(None),) * len(t.shape)), np.float64) for name, t in tensors.items()}

    @property
    def bidirectional(self) -> bool:
        """Whether the text model's image tokens see their whole image (Gemma 3's mask), not just what precedes."""
        return self.config.bidirectional

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(tokens_per_image, text hidden) float64 rows of one image's (or frame's) pixels (C, S, S); for Qwen2.5-VL
        and Qwen3-VL, (gh2 gw2, row_width) rows of one image's patches (gh2, gw2, m m, C T P P), the merge units row
        by row."""
        if isinstance(self.config, QwenVisionConfig):
            encode = {"qwen3_vl": self._qwen3_encode, "qwen2_vl": self._qwen3_encode,
                      "pixtral": self._pixtral_encode}.get(self.config.family, self._qwen_encode)
            return encode(pixels)
        c, w = self.config, self.w
        g, p, d = c.patches_per_side, c.patch_size, c.hidden_size
        x = np.asarray(pixels, np.float64).reshape(c.num_channels, g, p, g, p).transpose(1, 3, 0, 2, 4)
        kernel = w["vision_tower.embeddings.patch_embedding.weight"].reshape(d, -1)       # (D, C p p)
        x = x.reshape(g * g, -1) @ kernel.T
        if c.projector == "llava":              # (CLIP's: the class token first, no patch bias, the pre-LayerNorm)
            x = np.concatenate([w["vision_tower.embeddings.class_embedding"][None], x])
            x = x + w["vision_tower.embeddings.position_embedding.weight"]
            x = self._layer_norm(x, "vision_tower.pre_layrnorm")
        else:
            x = x + w["vision_tower.embeddings.patch_embedding.bias"] + w[
                "vision_tower.embeddings.position_embedding.weight"]
        for i in range(c.num_layers):
            x = self._layer(x, f"vision_tower.encoder.layers.{i}.")
        if c.projector == "llava":              # (the class token's row dropped; LLaVA's projector, exact GELU)
            h = self._maybe_biased(x[1:], "multi_modal_projector.linear_1")
            h = 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))
            return self._maybe_biased(h, "multi_modal_projector.linear_2")
        x = self._layer_norm(x, "vision_tower.post_layernorm")
        return self._shuffle(x) if c.projector == "shuffle" else self._pool(x)

    def _layer_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        eps = self.config.eps if isinstance(self.config, QwenVisionConfig) else self.config.layer_norm_eps
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * self.w[name + ".weight"] + self.w[name + ".bias"]

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
        if getattr(c, "activation", "gelu_tanh") == "quick_gelu":          # (CLIP's)
            h = h / (1.0 + np.exp(-1.702 * h))
        else:
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

    # ---------------------------------------------------------------------------------------------- Qwen2.5-VL

    def _qwen_encode(self, patches: np.ndarray) -> np.ndarray:
        """The tower on the patches in window order (the module docstring), the merger's rows put back in the
        prompt's order."""
        c, w = self.config, self.w
        gh2, gw2, units = patches.shape[:3]
        m, d = c.spatial_merge_size, c.hidden_size
        if units != m * m or patches.shape[3] != c.patch_features:
            raise ValueError(f"reference: Qwen2.5-VL patches are (gh2, gw2, {m * m}, {c.patch_features}), not "
                             f"{patches.shape}")
        x = np.asarray(patches, np.float64).reshape(-1, c.patch_features)
        x = x @ w["visual.patch_embed.proj.weight"].reshape(d, -1).T                      # (S, D)
        cos, sin = self._qwen_rotary(gh2, gw2)                                             # (S, head_dim) each
        order, windows = self._qwen_windows(gh2, gw2)
        # rows gathered by merge unit: a unit's m m patches stay together, in their own order
        patch_order = (order[:, None] * m * m + np.arange(m * m)).reshape(-1)
        x, cos, sin = x[patch_order], cos[patch_order], sin[patch_order]
        whole = [len(x)]
        for i in range(c.num_layers):
            x = self._qwen_block(x, f"visual.blocks.{i}.", cos, sin,
                                 whole if i in c.fullatt_block_indexes else windows)
        h = self._rms_norm(x, "visual.merger.ln_q").reshape(-1, m * m * d)                 # (units, m m D)
        h = self._linear(h, "visual.merger.mlp.0")
        h = 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))
        merged = self._linear(h, "visual.merger.mlp.2")                                    # (units, out_hidden)
        rows = np.empty_like(merged)
        rows[order] = merged
        return rows

    def _qwen_rotary(self, gh2: int, gw2: int) -> tuple:
        """cos and sin of each patch's angles (in the patches' order: units row by row, a unit's patches row by
        row): head_dim / 4 frequencies times the patch's row, the same times its column, that half repeated."""
        c = self.config
        m, half = c.spatial_merge_size, c.head_dim // 2
        inv_freq = 1.0 / c.rope_theta ** (np.arange(0, half, 2, dtype=np.float64) / half)      # (head_dim / 4,)
        rows, cols = np.meshgrid(np.arange(gh2 * m), np.arange(gw2 * m), indexing="ij")
        rows = rows.reshape(gh2, m, gw2, m).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(gh2, m, gw2, m).transpose(0, 2, 1, 3).reshape(-1)
        angles = np.concatenate([rows[:, None] * inv_freq, cols[:, None] * inv_freq], axis=-1)   # (S, head_dim / 2)
        angles = np.concatenate([angles, angles], axis=-1)                                  # (S, head_dim)
        return np.cos(angles), np.sin(angles)

    def _qwen_windows(self, gh2: int, gw2: int) -> tuple:
        """(the merge units' indices in window order, each window's patch count): windows of window_units units a
        side from the top left, those at the right and bottom edges partial, row of windows by row; a window's
        units row by row."""
        u, per_unit = self.config.window_units, self.config.spatial_merge_size ** 2
        grid = np.arange(gh2 * gw2).reshape(gh2, gw2)
        windows = [grid[top:top + u, left:left + u].reshape(-1)
                   for top in range(0, gh2, u) for left in range(0, gw2, u)]
        return np.concatenate(windows), [len(units) * per_unit for units in windows]

    def _rms_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.config.eps) * self.w[name + ".weight"]

    def _qwen_block(self, x: np.ndarray, at: str, cos: np.ndarray, sin: np.ndarray, lengths: list) -> np.ndarray:
        """One block; attention within each run of `lengths` consecutive patches (the windows, or all as one)."""
        c = self.config
        t, heads, hd = len(x), c.num_heads, c.head_dim
        qkv = self._linear(self._rms_norm(x, at + "norm1"), at + "attn.qkv").reshape(t, 3, heads, hd)
        q, k, v = (qkv[:, j].transpose(1, 0, 2) for j in range(3))                         # (heads, S, hd) each
        q, k = (y * cos + np.concatenate([-y[..., hd // 2:], y[..., :hd // 2]], axis=-1) * sin for y in (q, k))
        attended = np.empty_like(q)
        for start, n in zip(np.cumsum([0] + lengths[:-1]), lengths):
            part = slice(start, start + n)
            scores = q[:, part] @ k[:, part].transpose(0, 2, 1) / math.sqrt(hd)           # (heads, n, n)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            attended[:, part] = (scores / scores.sum(axis=-1, keepdims=True)) @ v[:, part]
        x = x + self._linear(attended.transpose(1, 0, 2).reshape(t, heads * hd), at + "attn.proj")
        h = self._rms_norm(x, at + "norm2")
        gate, up = self._linear(h, at + "mlp.gate_proj"), self._linear(h, at + "mlp.up_proj")
        return x + self._linear(gate / (1.0 + np.exp(-gate)) * up, at + "mlp.down_proj")

    # ---------------------------------------------------------------------------------------------- Pixtral

    def _pixtral_encode(self, patches: np.ndarray) -> np.ndarray:
        """Mistral 3's tower and projector on an image's patches (the module docstring): (gh2 (gw2 + 1), out_hidden)
        rows, a token's at each [IMG] of the image's rows and NaN at each row's break and the image's end."""
        c, w = self.config, self.w
        gh2, gw2, units = patches.shape[:3]
        m, d, hd = c.spatial_merge_size, c.hidden_size, c.head_dim
        if units != m * m or patches.shape[3] != c.patch_features:
            raise ValueError(f"reference: Pixtral patches are (gh2, gw2, {m * m}, {c.patch_features}), not "
                             f"{patches.shape}")
        x = np.asarray(patches, np.float64).reshape(-1, c.patch_features) @ w[
            "visual.patch_embed.proj.weight"].reshape(d, -1).T                               # (S, D)
        x = self._rms_norm(x, "visual.ln_pre")
        rows, cols = np.meshgrid(np.arange(gh2 * m), np.arange(gw2 * m), indexing="ij")
        rows = rows.reshape(gh2, m, gw2, m).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(gh2, m, gw2, m).transpose(0, 2, 1, 3).reshape(-1)
        inv_freq = 1.0 / c.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)          # (head_dim / 2,)
        angles = np.concatenate([rows[:, None] * inv_freq[0::2], cols[:, None] * inv_freq[1::2]], axis=-1)
        angles = np.concatenate([angles, angles], axis=-1)                                  # (S, head_dim)
        cos, sin = np.cos(angles), np.sin(angles)
        for i in range(c.num_layers):
            x = self._pixtral_block(x, f"visual.blocks.{i}.", cos, sin)
        h = x                                       # (Pixtral 12B's LLaVA projector: each patch a token)
        if c.patch_merger:
            eps = c.merger_eps if c.merger_eps is not None else c.eps
            h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w["visual.merger.norm.weight"]
            h = h.reshape(-1, m * m, d).transpose(0, 2, 1).reshape(-1, d * m * m)           # unfold's order
            h = h @ w["visual.merger.merging_layer.weight"].T
        h = self._maybe_biased(h, "visual.merger.linear_1")
        h = 0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0)))
        merged = self._maybe_biased(h, "visual.merger.linear_2")                             # (units, out)
        out = np.full((gh2, gw2 + 1, merged.shape[1]), np.nan)
        out[:, :gw2] = merged.reshape(gh2, gw2, -1)
        return out.reshape(gh2 * (gw2 + 1), -1)

    def _maybe_biased(self, x: np.ndarray, name: str) -> np.ndarray:
        x = x @ self.w[name + ".weight"].T
        return x + self.w[name + ".bias"] if name + ".bias" in self.w else x

    def _pixtral_block(self, x: np.ndarray, at: str, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        c = self.config
        t, heads, hd = len(x), c.num_heads, c.head_dim
        h = self._rms_norm(x, at + "norm1")
        q, k, v = ((h @ self.w[at + f"attn.{n}_proj.weight"].T).reshape(t, heads, hd).transpose(1, 0, 2)
                   for n in "qkv")
        q, k = (y * cos + np.concatenate([-y[..., hd // 2:], y[..., :hd // 2]], axis=-1) * sin for y in (q, k))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)                                   # (heads, S, S)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attended = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        x = x + attended.transpose(1, 0, 2).reshape(t, heads * hd) @ self.w[at + "attn.o_proj.weight"].T
        h = self._rms_norm(x, at + "norm2")
        gate, up = h @ self.w[at + "mlp.gate_proj.weight"].T, h @ self.w[at + "mlp.up_proj.weight"].T
        return x + (gate / (1.0 + np.exp(-gate)) * up) @ self.w[at + "mlp.down_proj.weight"].T

    # ---------------------------------------------------------------------------------------------- Qwen3-VL

    def _qwen3_encode(self, patches: np.ndarray) -> np.ndarray:
        """The tower on the patches in their order (the module docstring): the merger's rows, then the DeepStack
        mergers', side by side (Qwen2-VL's too: no position rows, no DeepStack)."""
        c, w = self.config, self.w
        gh2, gw2, units = patches.shape[:3]
        m, d = c.spatial_merge_size, c.hidden_size
        if units != m * m or patches.shape[3] != c.patch_features:
            raise ValueError(f"reference: Qwen3-VL patches are (gh2, gw2, {m * m}, {c.patch_features}), not "
                             f"{patches.shape}")
        x = np.asarray(patches, np.float64).reshape(-1, c.patch_features)
        x = x @ w["visual.patch_embed.proj.weight"].reshape(d, -1).T
        if c.family == "qwen3_vl":
            x = x + w["visual.patch_embed.proj.bias"] + self._qwen3_positions(gh2, gw2)
        cos, sin = self._qwen_rotary(gh2, gw2)
        deepstack = []
        for i in range(c.num_layers):
            x = self._qwen3_block(x, f"visual.blocks.{i}.", cos, sin)
            if i in c.deepstack_visual_indexes:
                at = f"visual.deepstack_merger_list.{c.deepstack_visual_indexes.index(i)}."
                deepstack.append(self._qwen3_merged(self._layer_norm(x.reshape(-1, m * m * d), at + "norm"), at))
        if c.family == "qwen2_vl":
            h = self._layer_norm(x, "visual.merger.ln_q").reshape(-1, m * m * d)
            merged = self._qwen3_merged(h, "visual.merger.", ("mlp.0", "mlp.2"))
        else:
            merged = self._qwen3_merged(self._layer_norm(x, "visual.merger.norm").reshape(-1, m * m * d),
                                        "visual.merger.")
        return np.concatenate([merged, *deepstack], axis=1)

    def _qwen3_positions(self, gh2: int, gw2: int) -> np.ndarray:
        """(S, D) position rows of the patches (units row by row, a unit's patches row by row): pos_embed's side x
        side grid interpolated bilinearly, corners aligned, to the (2 gh2) x (2 gw2) patch grid."""
        c = self.config
        m, side = c.spatial_merge_size, c.position_side
        grid = self.w["visual.pos_embed.weight"].reshape(side, side, -1)

        def axis(n: int) -> np.ndarray:              # (n, side): each patch's weights over the grid's rows
            src = np.arange(n) * (side - 1) / max(n - 1, 1)
            return np.maximum(0.0, 1.0 - np.abs(src[:, None] - np.arange(side)))

        rows = np.einsum("hi,ijd->hjd", axis(gh2 * m), grid)
        positions = np.einsum("wj,hjd->hwd", axis(gw2 * m), rows)                         # (H, W, D)
        return positions.reshape(gh2, m, gw2, m, -1).transpose(0, 2, 1, 3, 4).reshape(gh2 * gw2 * m * m, -1)

    def _qwen3_block(self, x: np.ndarray, at: str, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """One block: every patch attends to every patch."""
        c = self.config
        t, heads, hd = len(x), c.num_heads, c.head_dim
        qkv = self._linear(self._layer_norm(x, at + "norm1"), at + "attn.qkv").reshape(t, 3, heads, hd)
        q, k, v = (qkv[:, j].transpose(1, 0, 2) for j in range(3))                         # (heads, S, hd) each
        q, k = (y * cos + np.concatenate([-y[..., hd // 2:], y[..., :hd // 2]], axis=-1) * sin for y in (q, k))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd)                                   # (heads, S, S)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attended = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        x = x + self._linear(attended.transpose(1, 0, 2).reshape(t, heads * hd), at + "attn.proj")
        if c.family == "qwen2_vl":
            h = self._linear(self._layer_norm(x, at + "norm2"), at + "mlp.fc1")
            return x + self._linear(h / (1.0 + np.exp(-1.702 * h)), at + "mlp.fc2")             # quick GELU
        h = self._linear(self._layer_norm(x, at + "norm2"), at + "mlp.linear_fc1")
        h = 0.5 * h * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
        return x + self._linear(h, at + "mlp.linear_fc2")

    def _qwen3_merged(self, h: np.ndarray, at: str, names=("linear_fc1", "linear_fc2")) -> np.ndarray:
        """A merger's Linear, exact GELU, Linear on its normed rows (units, m m D), the products `names` under
        `at`."""
        h = self._linear(h, at + names[0])
        return self._linear(0.5 * h * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0))), at + names[1])
