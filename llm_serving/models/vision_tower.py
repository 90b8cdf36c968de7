"""The vision tower: images' pixels to the text model's embeddings of them, in MindSpore graphs.

Gemma 3's, SmolVLM's and LLaVA 1.5's (`VisionTower`; SmolVLM's frames are its images here, vision/images.py):
- SigLIP: the image cut into patch_size-square patches, each a row of the patch embedding's matrix (the
  checkpoint's stride-equal-kernel convolution, as a matmul), plus a learned position row;
- num_layers pre-norm encoder layers: LayerNorm, bidirectional attention over every patch (biases on q, k, v and
  out), a residual; LayerNorm, fc1, tanh GELU, fc2, a residual; then the post LayerNorm;
- the projector: Gemma 3's patch grid average-pooled to tokens_per_side squared tokens, Gemma's RMS norm (gain
  1 + w), and the projection to the text model's width; or SmolVLM's pixel shuffle (each scale_factor-square block
  of patches one token) and a projection without a bias.

LLaVA 1.5's CLIP tower (`cfg.projector` "llava") is the same layers with a class token's row before the patches (its
own position row; `_ClipPatches`), a LayerNorm before the first layer (pre_layrnorm), quick GELU in the MLP, only the
layers up to the one whose output LLaVA reads (cfg.num_layers), and no post LayerNorm; its projector
(`_LlavaProjector`) drops the class token's row and runs linear_1, exact GELU, linear_2 on each patch's.

Arithmetic in float32 throughout, but for the int16 products below. On MindSpore's ops the weights are widened to
float32 once; on the CPU kernels the layers' matrices stay in the checkpoint's type (F16, BF16), widened a panel's
slice at a time as they are multiplied (`_panels`), or (`int16`, the default where AVX2 has no AVX-512, 1.4x the
float products' rate there, and where AVX-512 has VNNI, 2x on a Zen 4) are quantized once to 13-bit columns and
multiplied by 14-bit x in vpmaddwd's or vpdpwssd's exact integer sums (kernels/vision_panels.py's `int16_panels`),
as the text model's kernels multiply 16-bit x.
`encode(pixels)` runs a batch of images (N, 3, image_size, image_size), each image's tokens in the order the
prompt's placeholders take them (row by row of the pooled grid).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype

from llm_serving.models.kernels.vision_panels import float_panels, int16_panels
from llm_serving.models.llama import _gelu_erf, _gelu_tanh, _layer_normalize, _quick_gelu, _rms_normalize
from llm_serving.models.weights.vision import VisionConfig, vision_shapes

__all__ = ["VisionTower"]


def _tensor(array: np.ndarray):
    return Tensor(np.ascontiguousarray(array, np.float32))


def _layer_norm(x, gain, bias, eps: float):
    return _layer_normalize(x, eps) * gain + bias


# an encoder layer's weights, in the order _EncoderLayer.construct takes them after x
_LAYER_INPUTS = ("norm1_gain", "norm1_bias", "qkv", "qkv_bias", "out", "out_bias", "norm2_gain", "norm2_bias",
                 "fc1", "fc1_bias", "fc2", "fc2_bias")


def _layer_weights(read, index: int, stored_type=None, int16: bool = False) -> tuple:
    """Layer `index`'s weights as _EncoderLayer takes them (_LAYER_INPUTS): q, k and v as one (3D, D) matrix.
    `stored_type(name)`: the type the checkpoint stores a tensor in ("F16", "BF16", ...), given when the layer runs
    on the CPU kernels: the four matrices are then packed for VisionLinear (`_panels`) in that type, or (`int16`)
    quantized to its int16 panels (kernels/vision_panels.py), each bias then (2, N): the bias and the columns' steps.
    Otherwise every matrix is float32 as stored, (out, in): MindSpore's CPU MatMul with transpose_b ran these
    products 5-12% faster than on (in, out) copies (Zen 3, 4,096 patches)."""
    at = f"vision_tower.encoder.layers.{index}."
    names = {"qkv": [at + f"self_attn.{p}_proj.weight" for p in "qkv"], "out": [at + "self_attn.out_proj.weight"],
             "fc1": [at + "mlp.fc1.weight"], "fc2": [at + "mlp.fc2.weight"]}
    w = {"norm1_gain": read(at + "layer_norm1.weight"), "norm1_bias": read(at + "layer_norm1.bias"),
         "norm2_gain": read(at + "layer_norm2.weight"), "norm2_bias": read(at + "layer_norm2.bias"),
         "qkv_bias": np.concatenate([read(at + f"self_attn.{p}_proj.bias") for p in "qkv"]),
         "out_bias": read(at + "self_attn.out_proj.bias"),
         "fc1_bias": read(at + "mlp.fc1.bias"), "fc2_bias": read(at + "mlp.fc2.bias")}
    for key, parts in names.items():
        matrix = np.concatenate([read(name) for name in parts], 0)
        if stored_type is None:
            w[key] = _tensor(matrix)
        elif int16:
            panels, steps = int16_panels(matrix)
            w[key], w[key + "_bias"] = Tensor(panels), np.stack([w[key + "_bias"], steps])
        else:
            w[key] = _panels(matrix, {stored_type(n) for n in parts})
    return tuple(w[name] if isinstance(w[name], Tensor) else _tensor(w[name]) for name in _LAYER_INPUTS)


def _reader(weights: dict, shapes: dict):
    """read(name): a tower tensor of `weights` ({name: StoredTensor} as weights/vision.py gives them, or arrays under
    the same names) whole, as float32 (its shape from `shapes`)."""
    def read(name: str) -> np.ndarray:
        tensor = weights[name]
        array = tensor if isinstance(tensor, np.ndarray) else tensor.read((slice(None),) * len(shapes[name]))
        return np.asarray(array, np.float32)
    return read


def _panels(matrix: np.ndarray, stored: set) -> Tensor:
    """An (N, K) matrix as VisionLinear reads it (kernels/vision_panels.py's float_panels), in the type the
    checkpoint stores it when that is float16 or bfloat16 (both exact from the float32 it was read as; the kernel
    widens a panel's slice at a time), else float32."""
    panels = float_panels(matrix)
    if stored == {"F16"}:
        return Tensor(panels.astype(np.float16))
    if stored == {"BF16"}:
        return Tensor(panels, mstype.bfloat16)
    return Tensor(panels)


class _Patches(nn.Cell):
    """Pixels (N, C, S, S) to the first layer's input (N, G G, D): each patch a row of one matmul, plus its
    position's row."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.matmul = ops.MatMul()

    def construct(self, pixels, patch, patch_bias, positions):
        cfg = self.cfg
        n = pixels.shape[0]
        g, p, c, d = cfg.patches_per_side, cfg.patch_size, cfg.num_channels, cfg.hidden_size
        rows = pixels.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n * g * g, c * p * p)
        return (self.matmul(rows, patch) + patch_bias).reshape(n, g * g, d) + positions


class _ClipPatches(nn.Cell):
    """CLIP's (LLaVA 1.5's): pixels (N, C, S, S) to the first layer's input (N, 1 + G G, D): the class token's row,
    then each patch a row of one matmul (no bias), plus each row's position row, then the pre-LayerNorm."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.matmul = ops.MatMul()

    def construct(self, pixels, patch, class_row, positions, pre_gain, pre_bias):
        cfg = self.cfg
        n = pixels.shape[0]
        g, p, c, d = cfg.patches_per_side, cfg.patch_size, cfg.num_channels, cfg.hidden_size
        rows = pixels.reshape(n, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(n * g * g, c * p * p)
        x = ops.concat((ops.broadcast_to(class_row.reshape(1, 1, d), (n, 1, d)),
                        self.matmul(rows, patch).reshape(n, g * g, d)), axis=1) + positions
        return _layer_norm(x, pre_gain, pre_bias, cfg.layer_norm_eps)


class _EncoderLayer(nn.Cell):
    """One SigLIP encoder layer (see the module docstring), its weights inputs (_LAYER_INPUTS): one graph that
    every layer runs. `kernels`: the path of the CPU kernel library (kernels/vision_layer_cpu.cc), run on `threads`
    threads: VisionLinear's four products on the matrices as `_panels` packed them (the bias added, fc1's GELU
    applied, as each block of the result is made), VisionAttention reading the q|k|v rows as they are and never
    writing the scores, VisionLayerNorm the two LayerNorms; `int16`: the products and the attention's values in
    int16 (the int16 panels; VisionAttention's int16 path), and its scores too with `int16_scores`. None: MindSpore's
    ops (MatMul; the heads split out, the
    (N, heads, T, T) scores written, a softmax, the heads put back; the bias adds', the GELU's and the LayerNorms'
    several passes)."""

    def __init__(self, cfg: VisionConfig, kernels: Optional[str] = None, threads: int = 1, int16: bool = False,
                 int16_scores: bool = False):
        super().__init__()
        self.eps, self.heads, self.head_dim = cfg.layer_norm_eps, cfg.num_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.matmul = ops.MatMul(transpose_b=True)             # (the weights as stored: (out, in))
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.weighted = ops.BatchMatMul()
        self.on_kernels = kernels is not None
        if kernels is not None:
            # x (R, K), the panels, bias (N,) (int16 panels: (2, N), the bias and the steps), [threads, gelu] -> (R, N)
            self.linear = ops.Custom(f"{kernels}:VisionLinear", out_shape=lambda x, w, bias, *_: (x[0], bias[-1]),
                                     out_dtype=lambda x, *_: x, func_type="aot")
            # (N T, 3 D) q|k|v rows and a bias -> (N T, D): the heads side by side, as out_proj reads them
            self.attend = ops.Custom(f"{kernels}:VisionAttention", out_shape=lambda qkv, *_: (qkv[0], qkv[1] // 3),
                                     out_dtype=lambda qkv, *_: qkv, func_type="aot")
            self.layer_norm = ops.Custom(f"{kernels}:VisionLayerNorm", out_shape=lambda x, *_: x,
                                         out_dtype=lambda x, *_: x, func_type="aot")
            self.eps_tensor = Tensor(np.array([cfg.layer_norm_eps], np.float32))
            level = 2 if int16 and int16_scores else 1 if int16 else 0     # VisionAttention's int16 path
            self.attention_config = Tensor(np.array([cfg.sequence, cfg.num_heads, threads, level], np.int32))
            self.no_qkv_bias = Tensor(np.zeros(3 * cfg.hidden_size, np.float32))    # (VisionLinear added it)
            self.threads = Tensor(np.array([threads], np.int32))
            self.plain = Tensor(np.array([threads, 0], np.int32))
            # (fc1's activation: layer_parts_cpu.h's kGeluTanh 1, or kQuickGelu 3 for CLIP's)
            self.gelu = Tensor(np.array([threads, 3 if cfg.activation == "quick_gelu" else 1], np.int32))
        self.quick = cfg.activation == "quick_gelu"

    def construct(self, x, norm1_gain, norm1_bias, qkv_w, qkv_bias, out_w, out_bias, norm2_gain, norm2_bias,
                  fc1, fc1_bias, fc2, fc2_bias):
        n, t, d = x.shape
        if self.on_kernels:
            h = self.layer_norm(x.reshape(n * t, d), norm1_gain, norm1_bias, self.eps_tensor, self.threads)
            qkv = self.linear(h, qkv_w, qkv_bias, self.plain)
            attended = self.attend(qkv, self.no_qkv_bias, self.attention_config)
            x = x + self.linear(attended, out_w, out_bias, self.plain).reshape(n, t, d)
            h = self.layer_norm(x.reshape(n * t, d), norm2_gain, norm2_bias, self.eps_tensor, self.threads)
            h = self.linear(h, fc1, fc1_bias, self.gelu)
            return x + self.linear(h, fc2, fc2_bias, self.plain).reshape(n, t, d)
        h = _layer_norm(x, norm1_gain, norm1_bias, self.eps).reshape(n * t, d)
        qkv = (self.matmul(h, qkv_w) + qkv_bias).reshape(n, t, 3, self.heads, self.head_dim)
        qkv = qkv.transpose(2, 0, 3, 1, 4)                                      # (3, N, heads, T, head_dim)
        probs = ops.softmax(self.scores(qkv[0], qkv[1]) * self.scale, axis=-1)
        attended = self.weighted(probs, qkv[2]).transpose(0, 2, 1, 3).reshape(n * t, d)
        x = x + (self.matmul(attended, out_w) + out_bias).reshape(n, t, d)
        h = self.matmul(_layer_norm(x, norm2_gain, norm2_bias, self.eps).reshape(n * t, d), fc1) + fc1_bias
        h = _quick_gelu(h) if self.quick else _gelu_tanh(h)
        return x + (self.matmul(h, fc2) + fc2_bias).reshape(n, t, d)


class _ShuffleProjector(nn.Cell):
    """SmolVLM's (Idefics3's): the last layer's output (N, G G, D) to (N, (G / s)^2, H): the post LayerNorm, the
    pixel shuffle (each s x s block of patches one row of s^2 D: a block row's s patches side by side, then the
    block's s rows), the projection (no bias)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.matmul = ops.MatMul()

    def construct(self, x, post_gain, post_bias, projection):
        cfg = self.cfg
        n, d, g, s = x.shape[0], cfg.hidden_size, cfg.patches_per_side, cfg.scale_factor
        x = _layer_norm(x, post_gain, post_bias, cfg.layer_norm_eps)
        x = x.reshape(n, g, g // s, d * s).transpose(0, 2, 1, 3).reshape(n, g // s, g // s, d * s * s)
        x = x.transpose(0, 2, 1, 3).reshape(n * (g // s) ** 2, d * s * s)
        return self.matmul(x, projection).reshape(n, (g // s) ** 2, cfg.text_hidden_size)


class _Projector(nn.Cell):
    """The last layer's output (N, G G, D) to the text model's embeddings (N, tokens, H): the post LayerNorm, the
    average pool, Gemma's RMS norm (its gain 1 + w, given whole), the projection."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.matmul = ops.MatMul()

    def construct(self, x, post_gain, post_bias, soft_gain, projection):
        cfg = self.cfg
        n, d = x.shape[0], cfg.hidden_size
        x = _layer_norm(x, post_gain, post_bias, cfg.layer_norm_eps)
        s, k = cfg.tokens_per_side, cfg.pool
        pooled = x.reshape(n, s, k, s, k, d).mean(axis=(2, 4)).reshape(n * s * s, d)
        return self.matmul(_rms_normalize(pooled, cfg.layer_norm_eps) * soft_gain, projection).reshape(n, s * s, cfg.text_hidden_size)


class _LlavaProjector(nn.Cell):
    """LLaVA's (LlavaMultiModalProjector) on CLIP's output (N, 1 + G G, D): the class token's row dropped, then each
    patch's row through linear_1, GELU (erf), linear_2 (the matrices as stored, (out, in)) -> (N, G G, H)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x, fc1, fc1_bias, fc2, fc2_bias):
        cfg = self.cfg
        n, g2 = x.shape[0], cfg.patches_per_side ** 2
        h = _gelu_erf(self.matmul(x[:, 1:].reshape(n * g2, cfg.hidden_size), fc1) + fc1_bias)
        return (self.matmul(h, fc2) + fc2_bias).reshape(n, g2, cfg.text_hidden_size)


class VisionTower:
    """A SigLIP tower and its projector, Gemma 3's or SmolVLM's, or LLaVA 1.5's CLIP tower and projector (the module
    docstring). `weights`: {name:
    StoredTensor} as weights/vision.py's `vision_checkpoint` gives them (or arrays under the same names).
    `kernels`, `threads`: the layers' CPU kernel library and its threads (_EncoderLayer; None: MindSpore's ops);
    `int16`: on the kernels, the layers' products and the attention's values in 16-bit integers
    (vision_panels.int16_panels; the runner's vision_int16); `int16_scores`: the attention's scores too (opt-in:
    vision_int16_scores).

    Three graphs: the patches, one encoder layer (run once per layer, the layer's weights its inputs), the
    projector. A layer at a time keeps one layer's attention scores alive (num_heads x patches^2 floats: 1 GiB at
    Gemma 3's 4,096 patches), where one graph of every layer kept them all."""

    def __init__(self, cfg: VisionConfig, weights: dict, kernels: Optional[str] = None, threads: int = 1,
                 int16: bool = False, int16_scores: bool = False):
        read = _reader(weights, vision_shapes(cfg))
        self.cfg = cfg
        d, p = cfg.hidden_size, cfg.patch_size
        patch = read("vision_tower.embeddings.patch_embedding.weight").reshape(d, cfg.num_channels * p * p)
        positions = _tensor(read("vision_tower.embeddings.position_embedding.weight"))
        stored_type = None if kernels is None else (lambda name: getattr(weights[name], "stored_type", None))
        self.int16 = int16 and kernels is not None
        self.layer_weights = [_layer_weights(read, i, stored_type, self.int16) for i in range(cfg.num_layers)]
        if cfg.projector == "llava":
            self.embed_weights = (_tensor(patch.T), _tensor(read("vision_tower.embeddings.class_embedding")),
                                  positions, _tensor(read("vision_tower.pre_layrnorm.weight")),
                                  _tensor(read("vision_tower.pre_layrnorm.bias")))
            self.patches = _ClipPatches(cfg)
            linear = [(read(f"multi_modal_projector.linear_{k}.weight"),
                       read(f"multi_modal_projector.linear_{k}.bias") if cfg.projector_bias else
                       np.zeros(cfg.text_hidden_size, np.float32)) for k in (1, 2)]
            self.head_weights = tuple(_tensor(t) for pair in linear for t in pair)
            self.projector = _LlavaProjector(cfg)
        else:
            self.embed_weights = (_tensor(patch.T), _tensor(read("vision_tower.embeddings.patch_embedding.bias")),
                                  positions)                                                     # (3PP, D) ...
            self.patches = _Patches(cfg)
            post = (_tensor(read("vision_tower.post_layernorm.weight")),
                    _tensor(read("vision_tower.post_layernorm.bias")))
            if cfg.projector == "shuffle":
                self.head_weights = (*post, _tensor(read("multi_modal_projector.proj.weight").T))    # (s^2 D, H)
                self.projector = _ShuffleProjector(cfg)
            else:
                self.head_weights = (*post, _tensor(1.0 + read("multi_modal_projector.mm_soft_emb_norm.weight")),
                                     _tensor(read("multi_modal_projector.mm_input_projection_weight")))  # (D, H)
                self.projector = _Projector(cfg)
        self.int16_scores = self.int16 and int16_scores
        self.layer = _EncoderLayer(cfg, kernels, threads, self.int16, self.int16_scores)

    @property
    def nbytes(self) -> int:
        """The bytes its weights take."""
        tensors = [*self.embed_weights, *self.head_weights, *(t for w in self.layer_weights for t in w)]
        return sum(t.nbytes for t in tensors)

    def warm(self) -> None:
        """Compile the three graphs and run each once on zeros, one layer's worth (about a 27th of an image's
        arithmetic): the first image then pays its arithmetic only, not the graphs' compile (1-2 s) and their first
        run's allocations (another 3-5 s at Gemma-3-4B's shape on two Zen 3 cores)."""
        cfg = self.cfg
        pixels = Tensor(np.zeros((1, cfg.num_channels, cfg.image_size, cfg.image_size), np.float32))
        x = Tensor(np.zeros((1, cfg.sequence, cfg.hidden_size), np.float32))
        self.patches(pixels, *self.embed_weights).asnumpy()
        self.layer(x, *self.layer_weights[0]).asnumpy()
        self.projector(x, *self.head_weights).asnumpy()

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(N, tokens_per_image, text hidden) float32 embeddings of N images' pixels (N, 3, size, size)."""
        size = self.cfg.image_size
        if pixels.ndim != 4 or pixels.shape[1:] != (self.cfg.num_channels, size, size):
            raise ValueError(f"VisionTower.encode: pixels of shape (N, 3, {size}, {size}), not {pixels.shape}")
        return self.project(self.run_layers(self.embed(pixels), 0, self.cfg.num_layers))

    # An image's encoding in parts, the same graphs on the same values in the same order as `encode`'s (so its rows
    # are the same to the bit): the patches, then layers a..b-1 as often as wanted, then the projector. The agent
    # runs an image's layers a few at a time while other requests decode (runner/images.py's `advance`).

    def embed(self, pixels: np.ndarray):
        """The patches' embeddings of N images' pixels (a MindSpore tensor: the layers' input)."""
        return self.patches(_tensor(pixels), *self.embed_weights)

    def run_layers(self, x, start: int, stop: int):
        """x (a tensor, or its numpy array) through encoder layers start..stop-1."""
        x = _tensor(x) if isinstance(x, np.ndarray) else x
        for weights in self.layer_weights[start:stop]:
            x = self.layer(x, *weights)
        return x

    def kept(self, x) -> np.ndarray:
        """x as the runner keeps it between steps: numpy (an exact copy)."""
        return x if isinstance(x, np.ndarray) else x.asnumpy()

    def project(self, x) -> np.ndarray:
        """The projector's (N, tokens_per_image, text hidden) float32 rows of the last layer's x."""
        return self.projector(x, *self.head_weights).asnumpy()
