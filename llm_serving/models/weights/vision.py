"""A vision-language checkpoint's vision side: the tower's config and its tensors, under one set of names whatever
wrote them.

`vision_checkpoint(model_dir)`: (`VisionConfig`, {name: StoredTensor}) of a HF directory whose config has a
`vision_config`, or None for a text model. `mmproj_checkpoint(path)`: the same of llama.cpp's mmproj GGUF (the
tower and projector its converter writes beside the text model's GGUF: `v.*` and `mm.*` tensors, `clip.vision.*`
keys; Gemma 3's norm gain stored as 1 + w, as llama.cpp computes it, and taken back to w here). The names: `vision_tower.<...>` (SigLIP's `embeddings.*`, `encoder.layers.N.*`,
`post_layernorm.*`) and `multi_modal_projector.<...>`, with transformers 4.x's `vision_tower.vision_model.` and 5.x's
leading `model.` taken off. SigLIP's pooling head (`vision_tower.head.*`) is not read: the projector takes the last
hidden state. Two families are read here, both SigLIP towers:
- Gemma 3 (`Gemma3ForConditionalGeneration`): a fixed 896-pixel image, its patch grid average-pooled to 256 tokens,
  Gemma's RMS norm and a projection (`projector` "pool"); its image tokens attend to their whole image;
- SmolVLM and Idefics3 (`SmolVLMForConditionalGeneration`, `Idefics3ForConditionalGeneration`): each frame of an
  image (its tiles and the whole image, vision/images.py) through the tower, the patch grid pixel-shuffled by
  `scale_factor` (each s x s block of patches one token of s^2 x the width) and projected without a bias
  (`projector` "shuffle"; `model.vision_model.*` and `model.connector.modality_projection.proj.weight` read as
  `vision_tower.*` and `multi_modal_projector.proj.weight`); its image tokens are causal, as text.
Four more families' towers are another kind (`QwenVisionConfig`, models/vision_qwen.py):
- Qwen2-VL (`Qwen2VLForConditionalGeneration`): Qwen2.5-VL's patches and rotary positions, with LayerNorms (gain
  and bias), full attention in every block, an MLP of fc1, quick GELU (x sigmoid(1.702 x)) and fc2 with biases, and
  the merger with a LayerNorm for ln_q; the tower's width `embed_dim` and its MLP's embed_dim x mlp_ratio (its
  vision_config's hidden_size is the text model's width); its tensors `visual.<...>` (the Hub's) or
  `model.visual.<...>` (5.x's), read as `visual.<...>`; from llama.cpp's `qwen2vl_merger` mmproj too;
- Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): an image at its own size in patches of temporal x patch x patch
  values, RMS norms, 2-D rotary positions, windowed attention but in the `fullatt_block_indexes` layers, a SwiGLU
  MLP with biases, and the merger (each merge x merge patches one token of the text model's width); its tensors
  `visual.<...>` (the Hub's 4.x files; transformers 5.x may write `model.visual.<...>`, read the same);
- Qwen3-VL (`Qwen3VLForConditionalGeneration`): the same patches and rotary positions, with a biased patch
  embedding plus learned position rows, LayerNorms, full attention in every block, a GELU-tanh MLP, a LayerNorm
  merger, and DeepStack mergers after the `deepstack_visual_indexes` blocks (each a row more per token); its tensors
  `model.visual.<...>` (the Hub's and 5.x's), read as `visual.<...>`;
- Mistral 3 (`Mistral3ForConditionalGeneration`, Mistral Small 3.1): a Pixtral tower (the image at its own size,
  patches of C x P x P, ln_pre, RMS norms, its own 2-D rotary positions, full attention, SwiGLU without biases) and
  Mistral 3's projector (RMS norm, the patch merger, linear_1, GELU, linear_2); its tensors `vision_tower.*` and
  `multi_modal_projector.*` (under `model.` in 5.x), read as `visual.<...>` with Qwen's block names (`_pixtral_name`);
  from llama.cpp's `pixtral` mmproj too, its q and k rows put back from interleaved pairs;
- Pixtral 12B (`LlavaForConditionalGeneration` whose vision_config is a `pixtral` one): the same tower, each patch one
  token (no merge), and LLaVA's projector (linear_1, GELU, linear_2, with biases: no norm, no patch merger); its
  tensors named as Mistral 3's; from llama.cpp's `pixtral` mmproj without `mm.input_norm` and `mm.patch_merger`.
A LLaVA 1.5 (`LlavaForConditionalGeneration` whose vision_config is `clip_vision_model`) is a SigLIP-like tower of
CLIP's (a `VisionConfig` with `projector` "llava": its class token, pre-LayerNorm, quick GELU, the layers up to
vision_feature_layer, LLaVA's projector), its tensors named as SigLIP's (`vision_tower.pre_layrnorm.*`,
`vision_tower.embeddings.class_embedding`); any other LLaVA tower is refused naming it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .common import StoredTensor, WeightLoadError, check_tensors, rotate_half_rows
from .hf import _checkpoint_names, _safetensors_header, _shard_files, stored_safetensors

__all__ = ["QwenVisionConfig", "VisionConfig", "mmproj_checkpoint", "mmproj_config", "qwen_vision_shapes",
           "vision_checkpoint", "vision_shapes"]

_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "SmolVLMForConditionalGeneration",
                  "Idefics3ForConditionalGeneration")
_SHUFFLED = ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
# the Qwen families' architectures (and model types, for a config.json without architectures) -> QwenVisionConfig's
# family
_QWEN_ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
                       "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl", "Qwen3VLForConditionalGeneration": "qwen3_vl",
                       "Qwen3VLMoeForConditionalGeneration": "qwen3_vl", "Mistral3ForConditionalGeneration": "pixtral",
                       "LlavaForConditionalGeneration": "pixtral"}
_QWEN_MODEL_TYPES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                     "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                     "mistral3": "Mistral3ForConditionalGeneration", "llava": "LlavaForConditionalGeneration"}
# llama.cpp's mmproj projector types read here -> the architecture whose tower and projector they hold (qwen3vl_merger
# is also Qwen3-VL-MoE's: the same tower; pixtral is also Pixtral 12B's, LlavaForConditionalGeneration)
MMPROJ_PROJECTORS = {"gemma3": "Gemma3ForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration",
                     "qwen2vl_merger": "Qwen2VLForConditionalGeneration",
                     "qwen2.5vl_merger": "Qwen2_5_VLForConditionalGeneration",
                     "qwen3vl_merger": "Qwen3VLForConditionalGeneration",
                     "pixtral": "Mistral3ForConditionalGeneration", "mlp": "LlavaForConditionalGeneration"}


@dataclass(frozen=True)
class VisionConfig:
    """A SigLIP tower and its projector: the image's (or frame's) patches, the tower's width and depth, and what the
    projector makes of its last hidden state (`tokens_per_image` tokens of the text model's width): Gemma 3's
    average pool ("pool") or SmolVLM's pixel shuffle ("shuffle", by `scale_factor`). `bidirectional`: the text
    model's image tokens attend to every token of their image (Gemma 3's), else causally. LLaVA 1.5's CLIP tower
    (`projector` "llava"): a class token before the patches (its own position row), a LayerNorm before the layers
    (`pre_norm`), quick GELU in the MLP (`activation`), `num_layers` the layers whose output is read (the checkpoint's
    less those after vision_feature_layer), no post LayerNorm, the class token's row dropped, and LLaVA's projector
    (linear_1, GELU, linear_2, with biases)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    tokens_per_image: int
    text_hidden_size: int
    image_token_id: Optional[int] = None        # the placeholder the prompt holds once per image token
    boi_token_id: Optional[int] = None          # the tokens around an image's placeholders
    eoi_token_id: Optional[int] = None
    projector: str = "pool"
    scale_factor: int = 1
    bidirectional: bool = True
    activation: str = "gelu_tanh"               # the MLP's: SigLIP's tanh GELU, or CLIP's "quick_gelu"
    projector_bias: bool = True                 # LLaVA's linear_1 and linear_2 with biases

    @property
    def class_token(self) -> bool:
        """Whether the tower puts a class token before the patches (CLIP's: LLaVA 1.5's), whose row the projector
        drops; its layers then run over patches + 1 rows."""
        return self.projector == "llava"

    @property
    def sequence(self) -> int:
        """The rows the tower's layers run over: the patches, and the class token's (CLIP's)."""
        return self.patches_per_side ** 2 + self.class_token

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.tokens_per_image ** 0.5))

    @property
    def pool(self) -> int:
        """The side of the projector's average pooling window (or pixel shuffle's block), in patches."""
        return self.patches_per_side // self.tokens_per_side

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _config(raw: dict, path: str) -> VisionConfig:
    vision, text = raw["vision_config"], raw.get("text_config") or {}
    shuffled = (raw.get("architectures") or [None])[0] in _SHUFFLED
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise WeightLoadError(f"{path}: vision_config.hidden_act {act!r}: the tower runs the tanh GELU only")
    try:
        cfg = VisionConfig(
            hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            num_layers=int(vision["num_hidden_layers"]), num_heads=int(vision["num_attention_heads"]),
            image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
            num_channels=int(vision.get("num_channels", 3)), layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
            tokens_per_image=(shuffled_tokens(vision, raw) if shuffled else int(raw.get("mm_tokens_per_image", 256))),
            text_hidden_size=int(text["hidden_size"]),
            image_token_id=raw.get("image_token_index", raw.get("image_token_id")),
            boi_token_id=raw.get("boi_token_index"), eoi_token_id=raw.get("eoi_token_index"),
            projector="shuffle" if shuffled else "pool", scale_factor=int(raw.get("scale_factor", 1)),
            bidirectional=not shuffled)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise WeightLoadError(f"{path}: vision_config or text_config lacks or mistypes {e}") from None
    side = cfg.tokens_per_side
    if (cfg.image_size % cfg.patch_size or side * side != cfg.tokens_per_image
            or cfg.patches_per_side % side or cfg.hidden_size % cfg.num_heads or cfg.num_channels != 3):
        raise WeightLoadError(f"{path}: a {cfg.image_size}-pixel image in {cfg.patch_size}-pixel patches does not "
                              f"pool to {cfg.tokens_per_image} tokens, or {cfg.num_heads} heads do not divide "
                              f"{cfg.hidden_size}, or the images are not RGB")
    return cfg


def _llava_clip_config(raw: dict, path: str) -> VisionConfig:
    """The VisionConfig of a LlavaForConditionalGeneration whose tower is CLIP's (LLaVA 1.5's; vision_config
    model_type clip_vision_model), CLIPVisionConfig's and LlavaConfig's defaults where the file is silent (the Hub's
    llava-hf files are): quick GELU, eps 1e-5, the output of layer vision_feature_layer (-2: all but the last) with
    the class token's row dropped (vision_feature_select_strategy "default"), the projector's GELU the exact one."""
    vision, text = raw["vision_config"], raw.get("text_config") or {}
    problems = []
    if vision.get("hidden_act", "quick_gelu") != "quick_gelu":
        problems.append(f"vision_config.hidden_act {vision.get('hidden_act')!r}: CLIP's tower runs quick GELU only")
    if raw.get("projector_hidden_act", "gelu") != "gelu":
        problems.append(f"projector_hidden_act {raw.get('projector_hidden_act')!r}: the projector runs the exact GELU "
                        "only")
    if raw.get("vision_feature_select_strategy", "default") != "default":
        problems.append(f"vision_feature_select_strategy {raw.get('vision_feature_select_strategy')!r}: a CLIP "
                        "tower's class token is dropped ('default') here")
    layer = raw.get("vision_feature_layer", -2)
    try:
        depth = int(vision.get("num_hidden_layers", 24))
        layers = depth + 1 + int(layer) if int(layer) < 0 else int(layer)
    except (TypeError, ValueError):
        layers = 0
    if not 1 <= layers <= depth:
        problems.append(f"vision_feature_layer {layer!r}: one layer's output is read, of the {depth} layers")
    if problems:
        raise WeightLoadError(f"{path}: {'; '.join(problems)}")
    try:
        image, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
        side = image // patch
        cfg = VisionConfig(
            hidden_size=int(vision.get("hidden_size", 768)),
            intermediate_size=int(vision.get("intermediate_size", 3072)),
            num_layers=layers, num_heads=int(vision.get("num_attention_heads", 12)), image_size=image,
            patch_size=patch, num_channels=int(vision.get("num_channels", 3)),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)), tokens_per_image=side * side,
            text_hidden_size=int(text.get("hidden_size", 4096)),
            image_token_id=raw.get("image_token_index", raw.get("image_token_id")), projector="llava",
            bidirectional=False, activation="quick_gelu",
            projector_bias=bool(raw.get("multimodal_projector_bias", True)))
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise WeightLoadError(f"{path}: vision_config or text_config mistypes {e}") from None
    if image % patch or cfg.hidden_size % cfg.num_heads or cfg.num_channels != 3:
        raise WeightLoadError(f"{path}: a {image}-pixel image is not whole {patch}-pixel patches, or "
                              f"{cfg.num_heads} heads do not divide {cfg.hidden_size}, or the images are not RGB")
    return cfg


def shuffled_tokens(vision: dict, raw: dict) -> int:
    """A pixel-shuffled frame's tokens: its patches over scale_factor squared (SmolVLM's image_seq_len)."""
    side = int(vision["image_size"]) // int(vision["patch_size"])
    return side * side // int(raw.get("scale_factor", 1)) ** 2


def vision_shapes(cfg: VisionConfig) -> dict:
    """{name: shape} of every tensor the tower and projector read."""
    d, m, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    shapes = {"vision_tower.embeddings.patch_embedding.weight": (d, cfg.num_channels, p, p),
              "vision_tower.embeddings.position_embedding.weight": (cfg.sequence, d)}
    if cfg.projector == "llava":                # (CLIP's: a class token, the pre-LayerNorm, no post one)
        out = cfg.text_hidden_size
        shapes.update({"vision_tower.embeddings.class_embedding": (d,), "vision_tower.pre_layrnorm.weight": (d,),
                       "vision_tower.pre_layrnorm.bias": (d,), "multi_modal_projector.linear_1.weight": (out, d),
                       "multi_modal_projector.linear_2.weight": (out, out)})
        if cfg.projector_bias:
            shapes.update({f"multi_modal_projector.linear_{k}.bias": (out,) for k in (1, 2)})
    else:
        shapes.update({"vision_tower.embeddings.patch_embedding.bias": (d,), "vision_tower.post_layernorm.weight": (d,),
                       "vision_tower.post_layernorm.bias": (d,)})
    if cfg.projector == "shuffle":
        shapes["multi_modal_projector.proj.weight"] = (cfg.text_hidden_size, d * cfg.scale_factor ** 2)
    elif cfg.projector == "pool":
        shapes["multi_modal_projector.mm_soft_emb_norm.weight"] = (d,)
        shapes["multi_modal_projector.mm_input_projection_weight"] = (d, cfg.text_hidden_size)
    for i in range(cfg.num_layers):
        at = f"vision_tower.encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[at + norm + ".weight"], shapes[at + norm + ".bias"] = (d,), (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[at + f"self_attn.{proj}.weight"], shapes[at + f"self_attn.{proj}.bias"] = (d, d), (d,)
        shapes[at + "mlp.fc1.weight"], shapes[at + "mlp.fc1.bias"] = (m, d), (m,)
        shapes[at + "mlp.fc2.weight"], shapes[at + "mlp.fc2.bias"] = (d, m), (d,)
    return shapes


def _our_name(name: str) -> Optional[str]:
    """A checkpoint name as the tower knows it, or None for a tensor not the vision side's."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("vision_tower.vision_model."):
        name = "vision_tower." + name[len("vision_tower.vision_model."):]
    if name.startswith("vision_model."):                                    # SmolVLM's, Idefics3's
        name = "vision_tower." + name[len("vision_model."):]
    if name == "connector.modality_projection.proj.weight":
        return "multi_modal_projector.proj.weight"
    if name.startswith("vision_tower.head."):
        return None
    return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None


def vision_checkpoint(model_dir: str) -> Optional[tuple]:
    """(config, {name: StoredTensor}) of a HF model directory's vision tower and projector, every shape checked,
    nothing read yet: a `VisionConfig` (SigLIP's towers) or, for a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Mistral 3, a
    `QwenVisionConfig`;
    None when its config.json has no vision_config. WeightLoadError for a family whose tower is not read here, a
    config the tower cannot run, a missing tensor or a wrong shape."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise WeightLoadError(f"{path}: cannot read it ({e})") from None
    if not isinstance(raw.get("vision_config"), dict):
        return None
    arch = (raw.get("architectures") or [_QWEN_MODEL_TYPES.get(raw.get("model_type"), "?")])[0]
    if arch not in _ARCHITECTURES + tuple(_QWEN_ARCHITECTURES):
        raise WeightLoadError(f"{path}: the vision tower of {arch} is not read here (served: "
                              f"{', '.join(_ARCHITECTURES + tuple(_QWEN_ARCHITECTURES))})")
    if arch == "LlavaForConditionalGeneration" and raw["vision_config"].get("model_type") == "clip_vision_model":
        cfg = _llava_clip_config(raw, path)
        return cfg, _stored(model_dir, _our_name, vision_shapes(cfg))
    if arch in ("Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration"):
        cfg = _pixtral_config(raw, path, llava=arch == "LlavaForConditionalGeneration")
        return cfg, _stored(model_dir, _pixtral_name, qwen_vision_shapes(cfg))
    if arch in _QWEN_ARCHITECTURES:
        cfg = _qwen_config(raw, path, _QWEN_ARCHITECTURES[arch])
        return cfg, _stored(model_dir, _qwen_name, qwen_vision_shapes(cfg))
    cfg = _config(raw, path)
    return cfg, _stored(model_dir, _our_name, vision_shapes(cfg))


def _stored(model_dir: str, our_name, shapes: dict) -> dict[str, StoredTensor]:
    """{our name: StoredTensor} of the checkpoint's tensors `our_name` maps (None: not the vision side's), with the
    half-precision types they are stored in, checked against `shapes`."""
    files = _shard_files(model_dir)
    names = {name: ours for name in _checkpoint_names(files) if (ours := our_name(name))}
    stored = stored_safetensors(files, set(names))
    kinds = _safetensors_types(files, set(stored))
    tensors = {names[name]: dataclasses.replace(tensor, stored_type=kinds.get(name)) for name, tensor in stored.items()}
    check_tensors(tensors, shapes, f"the vision tower in {model_dir}")
    return tensors


def _safetensors_types(files: dict[str, str], names: set) -> dict:
    """{name: "F16" or "BF16"} of the named tensors the checkpoint stores in half precision (the tower's CPU kernels
    then keep its matrices so, vision_tower._panels)."""
    kinds = {}
    for fpath in {files.get(name, files.get("")) for name in names} - {None}:
        try:
            header = _safetensors_header(fpath)[1]
        except (OSError, ValueError, struct.error) as e:
            raise WeightLoadError(f"{fpath}: cannot read safetensors file: {e}") from e
        kinds.update({name: info["dtype"] for name, info in header.items()
                      if name in names and isinstance(info, dict) and info.get("dtype") in ("F16", "BF16")})
    return kinds


@dataclass(frozen=True)
class QwenVisionConfig:
    """A Qwen-VL-like tower and merger (the module docstring; `family` "qwen2_vl", "qwen2_5_vl", "qwen3_vl" or
    "pixtral"):
    patches of num_channels x temporal_patch_size x patch_size x patch_size values embedded to hidden_size,
    num_layers blocks of num_heads heads (full attention in `fullatt_block_indexes`, else within windows of
    `window_size` pixels a side), spatial_merge_size squared patches merged into one token of out_hidden_size (the
    text model's width). `eps`: every norm's (transformers fixes it at 1e-6); `rope_theta`: the 2-D rotary
    positions' base. The token ids: the placeholder the prompt holds once per image token, and the tokens around an
    image's placeholders. Qwen3-VL's: every block full (`fullatt_block_indexes` all of them, `window_size` one merge
    unit: its windows are the merge units in raster order, never padded), `num_position_embeddings` learned position
    rows (a square grid), and a DeepStack merger after each block of `deepstack_visual_indexes` (increasing)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    window_size: int
    fullatt_block_indexes: tuple
    out_hidden_size: int
    num_channels: int = 3
    eps: float = 1e-6
    image_token_id: Optional[int] = None
    vision_start_token_id: Optional[int] = None
    vision_end_token_id: Optional[int] = None
    rope_theta: float = 10000.0
    family: str = "qwen2_5_vl"
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple = ()
    merger_eps: Optional[float] = None      # Pixtral's: the projector's RMS norm's (the text model's rms_norm_eps)
    projector_bias: bool = False            # Pixtral's: the projector's linear_1 and linear_2 with biases
    patch_merger: bool = True               # Pixtral's: Mistral 3's projector (RMS norm, patch merger, linear_1,
                                            # GELU, linear_2); False: LLaVA's (Pixtral 12B: linear_1, GELU, linear_2)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_norms(self) -> bool:
        """Whether the blocks' norms and the merger's are LayerNorms with a bias (Qwen2-VL's, Qwen3-VL's), not RMS
        norms."""
        return self.family in ("qwen2_vl", "qwen3_vl")

    @property
    def mlp_activation(self) -> str:
        """The blocks' MLP: "silu" (SwiGLU: gate and up), else fc1, this activation, fc2: "gelu_tanh" (Qwen3-VL's)
        or "quick_gelu" (Qwen2-VL's, x sigmoid(1.702 x))."""
        return {"qwen2_vl": "quick_gelu", "qwen3_vl": "gelu_tanh"}.get(self.family, "silu")

    @property
    def deepstack_layers(self) -> int:
        """The DeepStack mergers (Qwen3-VL's; none for Qwen2.5-VL): each gives every image token a row more."""
        return len(self.deepstack_visual_indexes)

    @property
    def row_width(self) -> int:
        """The width of an image token's row from the tower: the merger's out_hidden_size, then each DeepStack
        merger's, side by side."""
        return self.out_hidden_size * (1 + self.deepstack_layers)

    @property
    def position_side(self) -> int:
        """The side of Qwen3-VL's learned grid of position rows (0: none)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_features(self) -> int:
        """The values of one patch (a row of the processor's pixel_values): C x T x P x P."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def bidirectional(self) -> bool:
        """The Qwen-VL families' (and Pixtral's) image tokens attend causally in the text model, as its text does."""
        return False

    @property
    def window_units(self) -> int:
        """A window's side in merge units (transformers' vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size


def _pixtral_config(raw: dict, path: str, llava: bool = False) -> QwenVisionConfig:
    """The QwenVisionConfig (family "pixtral") of a Mistral3ForConditionalGeneration's config.json (Mistral Small
    3.1's: the Hub's 4.x file or 5.x's, the vision rotary base in vision_config.rope_theta or rope_parameters): a
    Pixtral tower (patches of C x P x P, its RMS norm ln_pre, full attention in every block, 2-D rotary positions of
    its own, SwiGLU without biases) and Mistral 3's projector (RMS norm of the text model's eps, the patch merger of
    spatial_merge_size^2 patches, linear_1, GELU, linear_2). Only the last layer's output is read
    (vision_feature_layer -1, every Mistral 3's); the projector's activation must be the exact GELU. With `llava`, a
    LlavaForConditionalGeneration's (Pixtral 12B's): the same tower, each patch a token, LLaVA's projector (linear_1,
    GELU, linear_2; its biases unless multimodal_projector_bias is false), LlavaConfig's defaults where the file is
    silent (vision_feature_layer -2, vision_feature_select_strategy "default": refused, as is any tower but
    Pixtral's)."""
    vision = raw["vision_config"]
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    rope = vision.get("rope_parameters") or {}
    problems = []
    if llava:
        kind = vision.get("model_type", "clip_vision_model")
        if kind != "pixtral":
            raise WeightLoadError(f"{path}: a LlavaForConditionalGeneration with a {kind!r} vision tower is not read "
                                  "here; Pixtral 12B's ('pixtral') and LLaVA 1.5's ('clip_vision_model') are")
        if raw.get("vision_feature_select_strategy", "default") != "full":
            problems.append(f"vision_feature_select_strategy {raw.get('vision_feature_select_strategy', 'default')!r}: "
                            "a Pixtral tower's every patch is a token ('full')")
    if vision.get("hidden_act", "silu") != "silu":
        problems.append(f"vision_config.hidden_act {vision.get('hidden_act')!r}: the tower's MLP runs SwiGLU (silu) "
                        "only")
    if raw.get("projector_hidden_act", "gelu") != "gelu":
        problems.append(f"projector_hidden_act {raw.get('projector_hidden_act')!r}: the projector runs the exact GELU "
                        "only")
    if raw.get("vision_feature_layer", -2 if llava else -1) != -1:
        problems.append(f"vision_feature_layer {raw.get('vision_feature_layer', -2)!r}: only the last layer's "
                        "output (-1) is read")
    if problems:
        raise WeightLoadError(f"{path}: {'; '.join(problems)}")
    try:
        hidden, heads = int(vision["hidden_size"]), int(vision["num_attention_heads"])
        patch, merge = int(vision["patch_size"]), 1 if llava else int(raw.get("spatial_merge_size", 2))
        depth, head_dim = int(vision["num_hidden_layers"]), int(vision.get("head_dim") or 0)
        out = int(text.get("hidden_size", 0))
        raw_qwen = {"vision_config": {
            "hidden_size": hidden, "intermediate_size": int(vision["intermediate_size"]), "depth": depth,
            "num_heads": heads, "patch_size": patch, "temporal_patch_size": 1, "spatial_merge_size": merge,
            "window_size": patch * merge, "fullatt_block_indexes": list(range(depth)), "out_hidden_size": out,
            "in_channels": int(vision.get("num_channels", 3)),
            "rope_parameters": {"rope_theta": float(rope.get("rope_theta", vision.get("rope_theta", 10000.0)))}},
            "text_config": text, "image_token_id": raw.get("image_token_index", raw.get("image_token_id"))}
        own = dict(eps=1e-5, merger_eps=float(text.get("rms_norm_eps", 1e-5)),      # (ln_pre's and the blocks' fixed)
                   projector_bias=bool(raw.get("multimodal_projector_bias", llava)), patch_merger=not llava)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightLoadError(f"{path}: vision_config or text_config lacks or mistypes {e}") from None
    if head_dim and head_dim * heads != hidden:
        raise WeightLoadError(f"{path}: vision_config.head_dim {head_dim} is not hidden_size {hidden} over {heads} "
                              "heads")
    return dataclasses.replace(_qwen_config(raw_qwen, path, "pixtral"), **own)


# each Qwen family's vision MLP activation (the only one its tower runs) and what that MLP is
_QWEN_ACTIVATIONS = {"qwen2_vl": ("quick_gelu", "quick GELU"), "qwen2_5_vl": ("silu", "SwiGLU (silu)"),
                     "qwen3_vl": ("gelu_pytorch_tanh", "the tanh GELU"), "pixtral": ("silu", "SwiGLU (silu)")}


def _qwen_config(raw: dict, path: str, family: str = "qwen2_5_vl") -> QwenVisionConfig:
    """The QwenVisionConfig of a Qwen2.5-VL config.json: 5.x's (text_config nested, the vision rotary base in
    vision_config.rope_parameters) or the Hub's 4.x (the text model's keys at the top, `in_chans`); or (`family`
    "qwen3_vl") of a Qwen3-VL one: 5.x's or the Hub's (text_config nested in both, the Hub's without a vision
    rotary base: 10,000 as its code fixes), every block full, its position grid and DeepStack layers checked; or
    (`family` "qwen2_vl") of a Qwen2-VL one, 4.x's or 5.x's: the tower's width `embed_dim`, its MLP's embed_dim x
    `mlp_ratio`, the text model's width its `hidden_size`, every block full."""
    vision = raw["vision_config"]
    if family == "qwen2_vl":                    # (its keys as Qwen2.5-VL's name them)
        try:
            width = int(vision["embed_dim"])
            vision = {**vision, "hidden_size": width, "out_hidden_size": vision["hidden_size"],
                      "intermediate_size": vision.get("intermediate_size") or int(width * float(vision["mlp_ratio"]))}
        except (KeyError, TypeError, ValueError) as e:
            raise WeightLoadError(f"{path}: vision_config lacks or mistypes {e}") from None
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    want, mlp = _QWEN_ACTIVATIONS[family]
    act = vision.get("hidden_act", want)
    if act != want:
        raise WeightLoadError(f"{path}: vision_config.hidden_act {act!r}: the tower's MLP runs {mlp} only")
    rope = vision.get("rope_parameters") or {}
    try:
        if family in ("qwen2_vl", "qwen3_vl"):
            unit, depth = int(vision["spatial_merge_size"]) * int(vision["patch_size"]), int(vision["depth"])
            own = dict(window_size=unit, fullatt_block_indexes=tuple(range(depth)))
            if family == "qwen3_vl":
                own.update(num_position_embeddings=int(vision["num_position_embeddings"]),
                           deepstack_visual_indexes=tuple(int(i) for i in vision["deepstack_visual_indexes"]))
        else:
            own = dict(window_size=int(vision["window_size"]),
                       fullatt_block_indexes=tuple(int(i) for i in vision["fullatt_block_indexes"]))
        cfg = QwenVisionConfig(
            hidden_size=int(vision["hidden_size"]), intermediate_size=int(vision["intermediate_size"]),
            num_layers=int(vision["depth"]), num_heads=int(vision["num_heads"]),
            patch_size=int(vision["patch_size"]), temporal_patch_size=int(vision["temporal_patch_size"]),
            spatial_merge_size=int(vision["spatial_merge_size"]), out_hidden_size=int(vision["out_hidden_size"]),
            num_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            image_token_id=raw.get("image_token_id"), vision_start_token_id=raw.get("vision_start_token_id"),
            vision_end_token_id=raw.get("vision_end_token_id"),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))), family=family, **own)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightLoadError(f"{path}: vision_config lacks or mistypes {e}") from None
    if min(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.patch_size,
           cfg.temporal_patch_size, cfg.spatial_merge_size, cfg.window_size, cfg.out_hidden_size) < 1:
        raise WeightLoadError(f"{path}: vision_config: every size must be positive ({cfg})")
    unit = cfg.spatial_merge_size * cfg.patch_size
    problems = []
    if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
        problems.append(f"{cfg.num_heads} heads of hidden_size {cfg.hidden_size} are not heads of a multiple of 4 "
                        "values (the 2-D rotary positions take a quarter of a head each way, twice)")
    if cfg.window_size % unit or cfg.window_size < unit:
        problems.append(f"window_size {cfg.window_size} is not a whole number of merge units of {unit} pixels")
    for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if any(not 0 <= i < cfg.num_layers for i in getattr(cfg, key)):
            problems.append(f"{key} {list(getattr(cfg, key))} name a layer outside the {cfg.num_layers} (0 to "
                            f"{cfg.num_layers - 1})")
    if list(cfg.deepstack_visual_indexes) != sorted(set(cfg.deepstack_visual_indexes)):
        problems.append(f"deepstack_visual_indexes {list(cfg.deepstack_visual_indexes)} are not increasing (the "
                        "DeepStack rows come in the order of the layers)")
    if family == "qwen3_vl" and (cfg.num_position_embeddings < 1
                                 or cfg.position_side ** 2 != cfg.num_position_embeddings):
        problems.append(f"num_position_embeddings {cfg.num_position_embeddings} is not a square grid of position "
                        "rows")
    if cfg.num_channels != 3:
        problems.append(f"the images have {cfg.num_channels} channels, not RGB's 3")
    if text.get("hidden_size") is not None and int(text["hidden_size"]) != cfg.out_hidden_size:
        problems.append(f"out_hidden_size {cfg.out_hidden_size} is not the text model's hidden_size "
                        f"{text['hidden_size']}")
    if problems:
        raise WeightLoadError(f"{path}: vision_config: {'; '.join(problems)}")
    return cfg


def qwen_vision_shapes(cfg: QwenVisionConfig) -> dict:
    """{name: shape} of every tensor a Qwen-VL-like tower and its mergers read (`visual.<...>`)."""
    d, m, c = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2 * cfg.hidden_size
    out = cfg.out_hidden_size
    if cfg.family == "pixtral":
        shapes = {"visual.patch_embed.proj.weight": (d, cfg.num_channels, cfg.patch_size, cfg.patch_size),
                  "visual.ln_pre.weight": (d,), "visual.merger.linear_1.weight": (out, d),
                  "visual.merger.linear_2.weight": (out, out)}
        if cfg.patch_merger:
            shapes.update({"visual.merger.norm.weight": (d,), "visual.merger.merging_layer.weight": (d, c)})
        if cfg.projector_bias:
            shapes.update({"visual.merger.linear_1.bias": (out,), "visual.merger.linear_2.bias": (out,)})
        for i in range(cfg.num_layers):
            at = f"visual.blocks.{i}."
            shapes.update({at + "norm1.weight": (d,), at + "norm2.weight": (d,),
                           **{at + f"attn.{p}_proj.weight": (d, d) for p in "qkvo"},
                           at + "mlp.gate_proj.weight": (m, d), at + "mlp.up_proj.weight": (m, d),
                           at + "mlp.down_proj.weight": (d, m)})
        return shapes
    shapes = {"visual.patch_embed.proj.weight": (d, cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size,
                                                 cfg.patch_size)}
    if cfg.family == "qwen3_vl":
        shapes.update({"visual.patch_embed.proj.bias": (d,),
                       "visual.pos_embed.weight": (cfg.num_position_embeddings, d)})
        mergers = [("visual.merger.", d)] + [(f"visual.deepstack_merger_list.{k}.", c)
                                             for k in range(cfg.deepstack_layers)]
        for at, norm in mergers:                # (the DeepStack mergers' LayerNorm over a unit's m m patches)
            shapes.update({at + "norm.weight": (norm,), at + "norm.bias": (norm,),
                           at + "linear_fc1.weight": (c, c), at + "linear_fc1.bias": (c,),
                           at + "linear_fc2.weight": (out, c), at + "linear_fc2.bias": (out,)})
    else:
        shapes.update({"visual.merger.ln_q.weight": (d,),
                       "visual.merger.mlp.0.weight": (c, c), "visual.merger.mlp.0.bias": (c,),
                       "visual.merger.mlp.2.weight": (out, c), "visual.merger.mlp.2.bias": (out,)})
        if cfg.family == "qwen2_vl":
            shapes["visual.merger.ln_q.bias"] = (d,)
    for i in range(cfg.num_layers):
        at = f"visual.blocks.{i}."
        shapes.update({at + "norm1.weight": (d,), at + "norm2.weight": (d,),
                       at + "attn.qkv.weight": (3 * d, d), at + "attn.qkv.bias": (3 * d,),
                       at + "attn.proj.weight": (d, d), at + "attn.proj.bias": (d,)})
        if cfg.layer_norms:                     # (Qwen3-VL's MLP linear_fc1 / 2, Qwen2-VL's fc1 / 2)
            fc = "linear_fc" if cfg.family == "qwen3_vl" else "fc"
            shapes.update({at + "norm1.bias": (d,), at + "norm2.bias": (d,),
                           at + f"mlp.{fc}1.weight": (m, d), at + f"mlp.{fc}1.bias": (m,),
                           at + f"mlp.{fc}2.weight": (d, m), at + f"mlp.{fc}2.bias": (d,)})
        else:
            shapes.update({at + "mlp.gate_proj.weight": (m, d), at + "mlp.gate_proj.bias": (m,),
                           at + "mlp.up_proj.weight": (m, d), at + "mlp.up_proj.bias": (m,),
                           at + "mlp.down_proj.weight": (d, m), at + "mlp.down_proj.bias": (d,)})
    return shapes


def _qwen_name(name: str) -> Optional[str]:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint name as the tower knows it (`visual.<...>`: Qwen2-VL's and
    Qwen2.5-VL's on the Hub; `model.visual.<...>`, 5.x's and Qwen3-VL's on the Hub, too), or None for the text
    model's."""
    if name.startswith("model.visual."):
        name = name[len("model."):]
    return name if name.startswith("visual.") else None


# a Mistral 3 checkpoint's vision side (after `vision_tower.` or `multi_modal_projector.`) -> ours (`visual.`), and
# the parts of a Pixtral layer (after `transformer.layers.N.`) -> a block's
_PIXTRAL_NAMES = {"vision_tower.patch_conv.": "visual.patch_embed.proj.", "vision_tower.ln_pre.": "visual.ln_pre.",
                  "multi_modal_projector.norm.": "visual.merger.norm.",
                  "multi_modal_projector.patch_merger.merging_layer.": "visual.merger.merging_layer.",
                  "multi_modal_projector.linear_1.": "visual.merger.linear_1.",
                  "multi_modal_projector.linear_2.": "visual.merger.linear_2."}
_PIXTRAL_LAYER = {"attention_norm.": "norm1.", "ffn_norm.": "norm2.", "attention.": "attn.", "feed_forward.": "mlp."}


def _pixtral_name(name: str) -> Optional[str]:
    """A Mistral 3 checkpoint name (the Hub's 4.x `vision_tower.*` / `multi_modal_projector.*`; 5.x's under `model.`)
    as the tower knows it (`visual.*`: a block's `norm1`, `attn.q_proj`, ..., `mlp.gate_proj`, ...), or None for the
    text model's."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower.transformer.layers."):
        index, _, rest = name[len("vision_tower.transformer.layers."):].partition(".")
        return next((f"visual.blocks.{index}.{ours}{rest[len(theirs):]}" for theirs, ours in _PIXTRAL_LAYER.items()
                     if rest.startswith(theirs)), None)
    return next((ours + name[len(theirs):] for theirs, ours in _PIXTRAL_NAMES.items() if name.startswith(theirs)),
                None)


# llama.cpp's mmproj names (its converter's, for Gemma 3) -> ours; `blk.N.` parts of a layer's
_MMPROJ_NAMES = {"v.patch_embd.": "vision_tower.embeddings.patch_embedding.",
                 "v.position_embd.": "vision_tower.embeddings.position_embedding.",
                 "v.post_ln.": "vision_tower.post_layernorm.",
                 "mm.input_projection.weight": "multi_modal_projector.mm_input_projection_weight",
                 "mm.model.fc.weight": "multi_modal_projector.proj.weight",              # SmolVLM's, Idefics3's
                 "mm.soft_emb_norm.": "multi_modal_projector.mm_soft_emb_norm."}
_MMPROJ_LAYER = {"ln1.": "layer_norm1.", "ln2.": "layer_norm2.", "attn_q.": "self_attn.q_proj.",
                 "attn_k.": "self_attn.k_proj.", "attn_v.": "self_attn.v_proj.", "attn_out.": "self_attn.out_proj.",
                 "ffn_up.": "mlp.fc1.", "ffn_down.": "mlp.fc2."}


def _mmproj_name(name: str) -> Optional[str]:
    if name.startswith("v.blk."):
        index, _, rest = name[len("v.blk."):].partition(".")
        for theirs, ours in _MMPROJ_LAYER.items():
            if rest.startswith(theirs):
                return f"vision_tower.encoder.layers.{index}.{ours}{rest[len(theirs):]}"
        return None
    for theirs, ours in _MMPROJ_NAMES.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return None


def _mmproj_fields(path: str, contents=None):
    """An mmproj GGUF's read contents (gguf_file.read_gguf's), checked to be an mmproj of a projector type read
    here (MMPROJ_PROJECTORS)."""
    from llm_serving.gguf_file import read_gguf

    if contents is None:
        try:
            contents = read_gguf(path)
        except Exception as e:          # noqa: BLE001 - not GGUF, truncated, unknown version: said with its name
            raise WeightLoadError(f"{path}: cannot read GGUF file: {e}") from e
    fields = contents.fields
    kind = (fields.get("general.architecture"), fields.get("clip.projector_type"))
    if kind[0] != "clip" or kind[1] not in MMPROJ_PROJECTORS:
        raise WeightLoadError(f"{path}: not a Gemma 3, SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3, Pixtral "
                              f"12B or LLaVA 1.5 mmproj GGUF (general.architecture {kind[0]!r}, clip.projector_type "
                              f"{kind[1]!r}; served: clip "
                              f"with {', '.join(MMPROJ_PROJECTORS)})")
    return contents


def mmproj_config(path: str, contents=None):
    """The VisionConfig of llama.cpp's mmproj GGUF of a Gemma 3 (`clip.projector_type` gemma3) or a SmolVLM
    (idefics3). The image tokens' pooling or pixel shuffle: `clip.vision.projector.scale_factor` patches a side, 4
    (every Gemma 3's) when the file does not say. The placeholder token ids are the text model's (its vocabulary),
    not known here. A Qwen2-VL's (qwen2vl_merger), Qwen2.5-VL's (qwen2.5vl_merger) or Qwen3-VL's (qwen3vl_merger): its
    QwenVisionConfig
    (`_qwen_mmproj_config`, `_qwen3_mmproj_config`). WeightLoadError for a file that is not such an mmproj."""
    contents = _mmproj_fields(path, contents)
    fields = contents.fields
    if fields["clip.projector_type"] == "qwen2.5vl_merger":
        return _qwen_mmproj_config(path, fields)
    if fields["clip.projector_type"] == "qwen2vl_merger":
        return _qwen2_mmproj_config(path, fields, contents.tensors)
    if fields["clip.projector_type"] == "qwen3vl_merger":
        return _qwen3_mmproj_config(path, fields, contents.tensors)
    if fields["clip.projector_type"] == "pixtral":
        return _pixtral_mmproj_config(path, fields, contents.tensors)
    if fields["clip.projector_type"] == "mlp":
        return _llava_mmproj_config(path, fields, contents.tensors)
    try:
        image, patch = int(fields["clip.vision.image_size"]), int(fields["clip.vision.patch_size"])
        pool = int(fields.get("clip.vision.projector.scale_factor", 4))
        side = image // patch // pool if pool > 0 else 0
        shuffled = fields["clip.projector_type"] == "idefics3"
        return _config({"architectures": [MMPROJ_PROJECTORS[fields["clip.projector_type"]]],
                        **({"scale_factor": pool} if shuffled else {}), "vision_config": {
            "hidden_size": fields["clip.vision.embedding_length"],
            "intermediate_size": fields["clip.vision.feed_forward_length"],
            "num_hidden_layers": fields["clip.vision.block_count"],
            "num_attention_heads": fields["clip.vision.attention.head_count"],
            "image_size": image, "patch_size": patch,
            "layer_norm_eps": fields.get("clip.vision.attention.layer_norm_epsilon", 1e-6)},
            "text_config": {"hidden_size": fields["clip.vision.projection_dim"]},
            "mm_tokens_per_image": side * side}, path)
    except KeyError as e:
        raise WeightLoadError(f"{path}: GGUF metadata {e} is missing") from None


def _qwen_mmproj_config(path: str, fields: dict) -> QwenVisionConfig:
    """A Qwen2.5-VL mmproj's tower, from its `clip.vision.*` keys as llama.cpp's converter writes them: the full-
    attention layers every `n_wa_pattern`-th (the converter's one rule for fullatt_block_indexes), the windows
    `window_size` pixels (112, every Qwen2.5-VL's, when the file does not say, as llama.cpp assumes), the merge
    `spatial_merge_size` (2), the temporal patch the two kernels `v.patch_embd.weight` and `.weight.1`."""
    try:
        layers, pattern = int(fields["clip.vision.block_count"]), int(fields["clip.vision.n_wa_pattern"])
        return _qwen_config({"vision_config": {
            "hidden_size": fields["clip.vision.embedding_length"],
            "intermediate_size": fields["clip.vision.feed_forward_length"], "depth": layers,
            "num_heads": fields["clip.vision.attention.head_count"], "patch_size": fields["clip.vision.patch_size"],
            "temporal_patch_size": 2, "spatial_merge_size": fields.get("clip.vision.spatial_merge_size", 2),
            "window_size": fields.get("clip.vision.window_size", 112),
            "fullatt_block_indexes": [i for i in range(layers) if pattern > 0 and (i + 1) % pattern == 0],
            "out_hidden_size": fields["clip.vision.projection_dim"]}}, path)
    except KeyError as e:
        raise WeightLoadError(f"{path}: GGUF metadata {e} is missing") from None


def _qwen2_mmproj_config(path: str, fields: dict, tensors) -> QwenVisionConfig:
    """A Qwen2-VL mmproj's tower (projector qwen2vl_merger), from llama.cpp's converter's keys: its MLP's width from
    `v.blk.0.ffn_up.weight` (the converter writes the text model's width as the feed-forward length), every block's
    attention full, the merge `spatial_merge_size` (2). Its MLP's activation is Qwen2-VL's quick GELU, as llama.cpp
    runs it for a file that sets neither clip.use_gelu nor clip.use_silu (the converter's)."""
    up = next((t for t in tensors if t.name == "v.blk.0.ffn_up.weight"), None)
    if up is None:
        raise WeightLoadError(f"{path}: a qwen2vl_merger mmproj without v.blk.0.ffn_up.weight")
    if fields.get("clip.use_silu"):
        raise WeightLoadError(f"{path}: a qwen2vl_merger mmproj with clip.use_silu: Qwen2-VL's tower runs quick GELU")
    try:
        return _qwen_config({"vision_config": {
            "embed_dim": fields["clip.vision.embedding_length"], "intermediate_size": int(up.shape[-1]),
            "depth": fields["clip.vision.block_count"], "num_heads": fields["clip.vision.attention.head_count"],
            "patch_size": fields["clip.vision.patch_size"], "temporal_patch_size": 2,
            "spatial_merge_size": fields.get("clip.vision.spatial_merge_size", 2),
            "hidden_size": fields["clip.vision.projection_dim"]}}, path, "qwen2_vl")
    except KeyError as e:
        raise WeightLoadError(f"{path}: GGUF metadata {e} is missing") from None


def _qwen3_mmproj_config(path: str, fields: dict, tensors) -> QwenVisionConfig:
    """A Qwen3-VL mmproj's tower (projector qwen3vl_merger), from llama.cpp's converter's keys: the DeepStack layers
    `is_deepstack_layers` (a flag a layer), the learned position rows `v.position_embd.weight`'s (the file keeps
    only the derived image_size), the merge `spatial_merge_size` (2), every block's attention full."""
    try:
        layers = int(fields["clip.vision.block_count"])
        deep = [bool(v) for v in fields.get("clip.vision.is_deepstack_layers", [])]
        positions = next((t for t in tensors if t.name == "v.position_embd.weight"), None)
        if positions is None:
            raise WeightLoadError(f"{path}: a qwen3vl_merger mmproj without v.position_embd.weight")
        return _qwen_config({"vision_config": {
            "hidden_size": fields["clip.vision.embedding_length"],
            "intermediate_size": fields["clip.vision.feed_forward_length"], "depth": layers,
            "num_heads": fields["clip.vision.attention.head_count"], "patch_size": fields["clip.vision.patch_size"],
            "temporal_patch_size": 2, "spatial_merge_size": fields.get("clip.vision.spatial_merge_size", 2),
            "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": int(positions.shape[-1]),
            "deepstack_visual_indexes": [i for i, flag in enumerate(deep) if flag],
            "out_hidden_size": fields["clip.vision.projection_dim"]}}, path, "qwen3_vl")
    except KeyError as e:
        raise WeightLoadError(f"{path}: GGUF metadata {e} is missing") from None


def _pixtral_mmproj_config(path: str, fields: dict, tensors) -> QwenVisionConfig:
    """A Mistral 3 mmproj's tower (projector pixtral, as llama.cpp's converter writes Mistral Small 3.1's): the
    `clip.vision.*` keys as a Mistral3ForConditionalGeneration's config (the MLP SwiGLU with `clip.use_silu`, the
    merge `spatial_merge_size`, the projector's norm eps the tower's `layer_norm_epsilon` (every Mistral 3's 1e-5),
    its biases where `mm.1.bias` is, llama.cpp's rotary base 10,000). Pixtral 12B's, a LLaVA (neither the
    projector's norm `mm.input_norm` nor its patch merger `mm.patch_merger`: each patch a token, as llama.cpp merges
    nothing where the file sets no spatial_merge_size); one of the two without the other, or a merge without them,
    is refused naming what is missing."""
    names = {t.name for t in tensors}
    merger = [n for n in ("mm.input_norm.weight", "mm.patch_merger.weight") if n in names]
    llava = not merger
    merge = int(fields.get("clip.vision.spatial_merge_size", 1))
    if len(merger) == 1 or (llava and merge != 1):
        missing = [n for n in ("mm.input_norm.weight", "mm.patch_merger.weight") if n not in names]
        raise WeightLoadError(f"{path}: a pixtral mmproj without {' and '.join(missing)}, with spatial_merge_size "
                              f"{merge}: neither Mistral Small 3.1's projector (its RMS norm and patch merger) nor "
                              "Pixtral 12B's (neither, and no merge)")
    try:
        eps = float(f"{float(fields.get('clip.vision.attention.layer_norm_epsilon', 1e-5)):.7g}")   # (float32's)
        return _pixtral_config({
            "spatial_merge_size": merge, "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
            "multimodal_projector_bias": "mm.1.bias" in names,
            "vision_config": {
                "hidden_size": fields["clip.vision.embedding_length"],
                "intermediate_size": fields["clip.vision.feed_forward_length"],
                "num_hidden_layers": fields["clip.vision.block_count"],
                "num_attention_heads": fields["clip.vision.attention.head_count"],
                "patch_size": fields["clip.vision.patch_size"], "image_size": fields["clip.vision.image_size"],
                "hidden_act": "silu" if fields.get("clip.use_silu", True) else "gelu", "rope_theta": 10000.0,
                "model_type": "pixtral"},
            "text_config": {"hidden_size": fields["clip.vision.projection_dim"], "rms_norm_eps": eps}}, path, llava)
    except KeyError as e:
        raise WeightLoadError(f"{path}: GGUF metadata {e} is missing") from None


def _llava_mmproj_config(path: str, fields: dict, tensors) -> VisionConfig:
    """A LLaVA 1.5 mmproj's tower (projector mlp, as llama.cpp's LLaVA converter writes it: the CLIP tower's layers
    up to the one LLaVA reads, `clip.vision.block_count` of them, no post LayerNorm, the projector `mm.0` and `mm.2`):
    its `clip.vision.*` keys as a LlavaForConditionalGeneration's config reading the last of those layers, the text
    model's width `mm.2.weight`'s (the file's projection_dim is CLIP's own, unused by LLaVA). What the
    tower here does not compute is refused naming it: a GELU MLP (`clip.use_gelu`), several feature layers, a post
    LayerNorm, a patch bias, or llava-1.6's image grid (`clip.vision.image_grid_pinpoints`)."""
    names = {t.name: t for t in tensors}
    if "mm.2.weight" not in names:
        raise WeightLoadError(f"{path}: an mlp mmproj without mm.2.weight (LLaVA's projector's second product)")
    try:
        layers = int(fields["clip.vision.block_count"])
        feature = [int(v) for v in fields.get("clip.vision.feature_layer", [])]
        problems = []
        if fields.get("clip.use_gelu"):
            problems.append("clip.use_gelu (CLIP's quick GELU is the MLP run here)")
        if feature and feature != [layers]:
            problems.append(f"clip.vision.feature_layer {feature} (one layer's output is read: the last of the "
                            f"{layers})")
        if fields.get("clip.vision.image_grid_pinpoints"):
            problems.append("clip.vision.image_grid_pinpoints (llava-1.6's image grid)")
        problems += [f"{n} (not in LLaVA 1.5's tower)" for n in ("v.post_ln.weight", "v.patch_embd.bias") if n in names]
        if problems:
            raise WeightLoadError(f"{path}: an mlp mmproj with {'; '.join(problems)}")
        return _llava_clip_config({
            "vision_feature_layer": layers, "multimodal_projector_bias": "mm.0.bias" in names,
            "vision_config": {
                "hidden_size": fields["clip.vision.embedding_length"],
                "intermediate_size": fields["clip.vision.feed_forward_length"], "num_hidden_layers": layers,
                "num_attention_heads": fields["clip.vision.attention.head_count"],
                "image_size": fields["clip.vision.image_size"], "patch_size": fields["clip.vision.patch_size"],
                "layer_norm_eps": float(f"{float(fields.get('clip.vision.attention.layer_norm_epsilon', 1e-5)):.7g}")},
            "text_config": {"hidden_size": int(names["mm.2.weight"].shape[-1])}}, path)
    except KeyError as e:
        raise WeightLoadError(f"{path}: GGUF metadata {e} is missing") from None


# a LLaVA 1.5 mmproj's names (llama.cpp's LLaVA converter's) -> ours: `v.blk.N.` parts (its MLP's two by their
# shapes: the converter names fc1 ffn_down and fc2 ffn_up, as llama.cpp's loader knows), then the rest
_LLAVA_MMPROJ_LAYER = {"ln1.": "layer_norm1.", "ln2.": "layer_norm2.", "attn_q.": "self_attn.q_proj.",
                       "attn_k.": "self_attn.k_proj.", "attn_v.": "self_attn.v_proj.",
                       "attn_out.": "self_attn.out_proj."}
_LLAVA_MMPROJ_NAMES = {"v.class_embd": "vision_tower.embeddings.class_embedding",
                       "v.patch_embd.weight": "vision_tower.embeddings.patch_embedding.weight",
                       "v.position_embd.weight": "vision_tower.embeddings.position_embedding.weight",
                       "v.pre_ln.": "vision_tower.pre_layrnorm.", "mm.0.": "multi_modal_projector.linear_1.",
                       "mm.2.": "multi_modal_projector.linear_2."}


def _llava_mmproj_name(name: str, shape: tuple, cfg: VisionConfig) -> Optional[str]:
    """A LLaVA 1.5 mmproj tensor's name as the tower knows it (`vision_tower.*`, `multi_modal_projector.*`), or None;
    `shape` its (numpy-order) shape, which tells the MLP's fc1 (intermediate x hidden) from fc2."""
    if name.startswith("v.blk."):
        index, _, rest = name[len("v.blk."):].partition(".")
        at = f"vision_tower.encoder.layers.{index}."
        if rest.startswith(("ffn_up.", "ffn_down.")):
            part, _, kind = rest.partition(".")
            if cfg.intermediate_size != cfg.hidden_size:        # (fc1's rows are the MLP's width)
                first = shape[0] == cfg.intermediate_size
            else:                                               # (square: the converter's own names)
                first = part == "ffn_down"
            return at + ("mlp.fc1." if first else "mlp.fc2.") + kind
        return next((at + ours + rest[len(theirs):] for theirs, ours in _LLAVA_MMPROJ_LAYER.items()
                     if rest.startswith(theirs)), None)
    return next((ours + name[len(theirs):] for theirs, ours in _LLAVA_MMPROJ_NAMES.items()
                 if name.startswith(theirs)), None)


# a Mistral 3 mmproj's names (llama.cpp's converter's) -> ours: `v.blk.N.` parts, then the rest; its q and k rows are
# each head's rotary pairs interleaved (the converter's LlamaModel.permute), put back in halves as they are read
_PIXTRAL_MMPROJ_LAYER = {"ln1.": "norm1.", "ln2.": "norm2.", "attn_q.": "attn.q_proj.", "attn_k.": "attn.k_proj.",
                         "attn_v.": "attn.v_proj.", "attn_out.": "attn.o_proj.", "ffn_gate.": "mlp.gate_proj.",
                         "ffn_up.": "mlp.up_proj.", "ffn_down.": "mlp.down_proj."}
_PIXTRAL_MMPROJ_NAMES = {"v.patch_embd.": "visual.patch_embed.proj.", "v.pre_ln.": "visual.ln_pre.",
                         "mm.input_norm.": "visual.merger.norm.", "mm.patch_merger.": "visual.merger.merging_layer.",
                         "mm.1.": "visual.merger.linear_1.", "mm.2.": "visual.merger.linear_2."}


def _pixtral_mmproj_tensors(contents, path: str, cfg: QwenVisionConfig) -> dict:
    """Our `visual.*` tensors of a Mistral 3 mmproj, each read from the memory-mapped file only when the tower reads
    it (as `_qwen_mmproj_tensors`'), q and k rows back in rotate-half order (`v.token_embd.img_break`, llama.cpp's
    copy of the row break's embedding, is not read: the break token keeps the text model's own)."""
    out = {}
    for tensor in contents.tensors:
        name, ours = tensor.name, None
        if name.startswith("v.blk."):
            index, _, rest = name[len("v.blk."):].partition(".")
            ours = next((f"visual.blocks.{index}.{o}{rest[len(t):]}" for t, o in _PIXTRAL_MMPROJ_LAYER.items()
                         if rest.startswith(t)), None)
        else:
            ours = next((o + name[len(t):] for t, o in _PIXTRAL_MMPROJ_NAMES.items() if name.startswith(t)), None)
        if ours is None:
            continue
        stored = _mmproj_stored(tensor, path)
        if ours.endswith(("attn.q_proj.weight", "attn.k_proj.weight")) and len(stored.shape) == 2:
            stored = StoredTensor(stored.shape, lambda index, read=stored.read: rotate_half_rows(
                read((slice(None), slice(None))), cfg.num_heads)[index], stored_type=stored.stored_type)
        out[ours] = stored
    return out


# a Qwen-VL mmproj's names (llama.cpp's converter's) -> ours: `v.blk.N.` parts, then the rest (Qwen2.5-VL's, and
# what Qwen3-VL's name otherwise; its DeepStack mergers `v.deepstack.L.` by their layer L)
_QWEN_MMPROJ_LAYER = {"ln1.": "norm1.", "ln2.": "norm2.", "attn_out.": "attn.proj.", "attn_qkv.": "attn.qkv.",
                      "ffn_gate.": "mlp.gate_proj.", "ffn_up.": "mlp.up_proj.", "ffn_down.": "mlp.down_proj."}
_QWEN3_MMPROJ_LAYER = {**_QWEN_MMPROJ_LAYER, "ffn_up.": "mlp.linear_fc1.", "ffn_down.": "mlp.linear_fc2."}
_QWEN2_MMPROJ_LAYER = {**_QWEN_MMPROJ_LAYER, "ffn_up.": "mlp.fc1.", "ffn_down.": "mlp.fc2."}
_QWEN_MMPROJ_NAMES = {"v.post_ln.": "visual.merger.ln_q.", "mm.0.": "visual.merger.mlp.0.",
                      "mm.2.": "visual.merger.mlp.2."}
_QWEN3_MMPROJ_NAMES = {"v.post_ln.": "visual.merger.norm.", "mm.0.": "visual.merger.linear_fc1.",
                       "mm.2.": "visual.merger.linear_fc2.", "v.patch_embd.bias": "visual.patch_embed.proj.bias",
                       "v.position_embd.": "visual.pos_embed."}
_QWEN3_DEEPSTACK = {"norm.": "norm.", "fc1.": "linear_fc1.", "fc2.": "linear_fc2."}


def _joined(parts: list, axis: int, stored: Optional[str]) -> StoredTensor:
    """The tensors `parts` (StoredTensors) as one, joined along `axis` (concatenated: 0; stacked: a new axis), read
    when the tower reads it: nothing of it is held in memory until then."""
    if axis == 0:
        shape = (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])
    else:
        shape = tuple(parts[0].shape[:axis]) + (len(parts),) + tuple(parts[0].shape[axis:])

    def read(index):
        whole = [p.read((slice(None),) * len(p.shape)) for p in parts]
        return (np.concatenate(whole, 0) if axis == 0 else np.stack(whole, axis))[index]
    return StoredTensor(shape, read, stored_type=stored)


def _qwen_mmproj_tensors(contents, path: str, cfg: QwenVisionConfig) -> dict:
    """Our `visual.*` tensors of a Qwen-VL mmproj (its GGUF tensors, memory-mapped), each read as float32 only when
    the tower reads it (the file's F16 matrices stay in the file until then: no float32 copy of the whole tower):
    Qwen2-VL's and Qwen2.5-VL's q, k and v joined into qkv (the converter splits them), the two temporal slices of
    the patch kernel stacked back into its 3-D kernel; each matrix's `stored_type` its file's ("F16", ...; q|k|v's
    where all three agree), so that the tower's CPU kernels keep the halves as stored."""
    qwen3 = cfg.family == "qwen3_vl"
    layer_names, names = {"qwen3_vl": (_QWEN3_MMPROJ_LAYER, _QWEN3_MMPROJ_NAMES),
                          "qwen2_vl": (_QWEN2_MMPROJ_LAYER, _QWEN_MMPROJ_NAMES)}.get(
        cfg.family, (_QWEN_MMPROJ_LAYER, _QWEN_MMPROJ_NAMES))
    deep = {layer: k for k, layer in enumerate(cfg.deepstack_visual_indexes)}
    tensors = {t.name: t for t in contents.tensors}
    stored = {name: _mmproj_stored(t, path) for name, t in tensors.items()}
    out = {}
    for name in tensors:
        ours = None
        if name.startswith("v.blk."):
            index, _, rest = name[len("v.blk."):].partition(".")
            ours = next((f"visual.blocks.{index}.{o}{rest[len(t):]}" for t, o in layer_names.items()
                         if rest.startswith(t)), None)
        elif name.startswith("v.deepstack.") and qwen3:
            layer, _, rest = name[len("v.deepstack."):].partition(".")
            if not layer.isdigit() or int(layer) not in deep:
                raise WeightLoadError(f"{path}: {name} is a DeepStack merger of a layer clip.vision."
                                      "is_deepstack_layers does not flag")
            ours = next((f"visual.deepstack_merger_list.{deep[int(layer)]}.{o}{rest[len(t):]}"
                         for t, o in _QWEN3_DEEPSTACK.items() if rest.startswith(t)), None)
        elif not name.startswith("v.patch_embd.weight"):
            ours = next((o + name[len(t):] for t, o in names.items() if name.startswith(t)), None)
        if ours is not None:
            out[ours] = stored[name]
    for name in [n for n in tensors if n.startswith("v.blk.") and ".attn_q." in n]:
        parts = [stored.get(name.replace(".attn_q.", f".attn_{p}.")) for p in "qkv"]
        if any(p is None for p in parts):
            raise WeightLoadError(f"{path}: {name} without its attn_k and attn_v")
        index, kind = name.split(".")[2], name.rsplit(".", 1)[1]
        kinds = {p.stored_type for p in parts}
        out[f"visual.blocks.{index}.attn.qkv.{kind}"] = _joined(parts, 0, kinds.pop() if len(kinds) == 1 else None)
    if "v.patch_embd.weight" in stored and "v.patch_embd.weight.1" in stored:
        out["visual.patch_embed.proj.weight"] = _joined([stored["v.patch_embd.weight"],
                                                         stored["v.patch_embd.weight.1"]], 2, None)   # (D, C, T, P, P)
    return out


def _mmproj_stored(tensor, path: str) -> StoredTensor:
    """One mmproj tensor, in the HF layout's order of dimensions (GGUF lists them innermost first), read as float32
    when asked (F32 and F16 from the memory-mapped file; another type dequantized then); a matrix's `stored_type`
    its file's."""
    dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type.name
    return StoredTensor(dims, lambda index: _mmproj_array(tensor, path)[index],
                        stored_type=kind if len(dims) >= 2 else None)


def mmproj_checkpoint(path: str) -> tuple:
    """(config, {name: StoredTensor}) of llama.cpp's mmproj GGUF of a Gemma 3 or SmolVLM (`mmproj_config`), or of a
    Qwen2.5-VL (a QwenVisionConfig; its tensors under the HF directory's names), every shape checked; the tensors
    read as float32 (F32, F16 and the types the gguf package dequantizes). WeightLoadError for a file that is not
    such an mmproj, a missing tensor or a wrong shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    contents = _mmproj_fields(path)
    cfg = mmproj_config(path, contents)
    if isinstance(cfg, QwenVisionConfig):
        read = _pixtral_mmproj_tensors if cfg.family == "pixtral" else _qwen_mmproj_tensors
        tensors = read(contents, path, cfg)
        check_tensors(tensors, qwen_vision_shapes(cfg), f"the vision tower in {path}")
        return cfg, tensors
    tensors = {}
    for tensor in contents.tensors:
        dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        name = _llava_mmproj_name(tensor.name, dims, cfg) if cfg.projector == "llava" else _mmproj_name(tensor.name)
        if name is None:
            continue
        if tensor.tensor_type == GGMLQuantizationType.F16 and len(dims) >= 2:
            # a matrix's float16 values, memory-mapped: read as float32 where they are used, kept as float16 by the
            # tower's CPU kernels (stored_type)
            half = np.asarray(tensor.data).reshape(dims)
            tensors[name] = StoredTensor(dims, lambda index, a=half: np.asarray(a[index], np.float32), stored_type="F16")
            continue
        if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.asarray(tensor.data, np.float32).reshape(dims)
        else:
            try:
                array = dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(dims)
            except (NotImplementedError, ValueError) as e:
                raise WeightLoadError(f"{path}: tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be "
                                      f"read: {e}") from None
        if name == "multi_modal_projector.mm_soft_emb_norm.weight":
            array = array - 1.0                                 # (llama.cpp stores Gemma's gain 1 + w)
        tensors[name] = StoredTensor.of(np.ascontiguousarray(array, np.float32))
    check_tensors(tensors, vision_shapes(cfg), f"the vision tower in {path}")
    return cfg, tensors


def _mmproj_array(tensor, path: str) -> np.ndarray:
    """An mmproj tensor's values as float32, in the HF layout's order of dimensions (GGUF lists them innermost
    first)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    dims = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(tensor.data, np.float32).reshape(dims)
    try:
        return dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(dims)
    except (NotImplementedError, ValueError) as e:
        raise WeightLoadError(f"{path}: tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be read: "
                              f"{e}") from None
