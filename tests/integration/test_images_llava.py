"""Images in, LLaVA 1.5 (issue 67): the real server on a tiny random LlavaForConditionalGeneration with a CLIP tower
that transformers makes (tests/families.py's `make_llava`: a 32-pixel image in 8-pixel patches and a class token,
the second-to-last layer's output without the class token's row, 16 tokens an image, LLaVA's projector, a Llama text
model), from its HF directory and as a `llama` GGUF with the mmproj llama.cpp's LLaVA converter writes. Its prompt
puts each image as 16 <image> tokens, two images side by side as one run. Image questions through OpenAI's chat API
get transformers' greedy tokens and log-probabilities (its forward with its PIL LLaVA processor's pixels: padded to
a square, then CLIP's), with chunked prefill, the prefix cache and the encoded-image cache in play, and the precision
gate's picture prompts; the tower (MindSpore's ops, the CPU kernels' float and int16 products) and the float64
reference are transformers'. The served checks are test_images_qwen.py's, given this family's prompt and reference
(`Kit`)."""
from __future__ import annotations

import io

import numpy as np
import pytest

from tests.families import LLAVA_IMAGE_TOKEN, greedy_with_logprobs, make_llava, needs_transformers
from tests.integration.image_chats import png
from tests.integration.test_images_qwen import NEW_TOKENS, Kit, served_image_chats
from tests.integration.test_vision_qwen3 import served_towers

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

TOKENS = 16                 # an image's: (32 / 8)^2 patches, the class token's row dropped


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("llava")
    make_llava(directory, seed=5)
    return directory


def _pixel_values(path, images: list) -> np.ndarray:
    """transformers' PIL LLaVA image processor's pixel_values of the images (PNG bytes): padded to a square, then
    CLIP's."""
    _, transformers = needs_transformers()
    from PIL import Image

    kind = getattr(transformers, "LlavaImageProcessorPil", transformers.LlavaImageProcessor)
    return kind.from_pretrained(str(path))(images=[Image.open(io.BytesIO(d)) for d in images],
                                           return_tensors="np")["pixel_values"]


def _prompt_ids(path, turns: list, images: list) -> list:
    """The prompt transformers' LlavaProcessor makes (the template rendered by hand, each <image> made 16 of it),
    tokenized by the tokenizers library."""
    from tokenizers import Tokenizer

    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"
    assert text.count(LLAVA_IMAGE_TOKEN) == len(images)
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(
        text.replace(LLAVA_IMAGE_TOKEN, LLAVA_IMAGE_TOKEN * TOKENS)).ids


def _reference(path, ids: list, images: list) -> tuple:
    """transformers' greedy tokens after `ids` with `images` (PNG bytes), and each one's log-probability."""
    torch, transformers = needs_transformers()
    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager").eval()
    extra = {"pixel_values": torch.from_numpy(_pixel_values(path, images))} if images else {}

    def logits(context: list):
        return model(input_ids=torch.tensor([context]), use_cache=False, **extra).logits[0, -1]
    return greedy_with_logprobs(logits, ids, NEW_TOKENS)


LLAVA = Kit(LLAVA_IMAGE_TOKEN, _prompt_ids, _reference)


def test_llava_image_questions_get_transformers_tokens_and_logprobs(llava, tmp_path):
    """Image chats to a tiny LLaVA 1.5 (test_images_qwen.py's `served_image_chats`: two images side by side in one
    turn among them): each reply is transformers' greedy tokens with their log-probabilities, with chunked prefill,
    the prefix cache and the encoded-image cache in play; the precision gate with picture prompts passes."""
    served_image_chats(llava, tmp_path, LLAVA)


def test_the_tower_and_the_float64_reference_are_transformers(llava):
    """The served tower (MindSpore's ops, the CPU kernels' float32 products and their int16 ones) and the float64
    reference on the processor's pixels of a wide and a tall image: within float32's (int16's) reach of
    transformers' float64 image features (the second-to-last layer's output, the class token's row dropped,
    LLaVA's projector)."""
    torch, transformers = needs_transformers()

    from llm_serving.models.vision_tower import VisionTower
    from llm_serving.models.weights.vision import vision_checkpoint
    from llm_serving.reference_vision import ReferenceVision

    model = transformers.LlavaForConditionalGeneration.from_pretrained(
        str(llava), dtype=torch.float64, attn_implementation="eager").eval()
    cfg, tensors = vision_checkpoint(str(llava))
    assert (cfg.num_layers, cfg.tokens_per_image, cfg.sequence) == (2, TOKENS, TOKENS + 1)
    towers = served_towers(VisionTower, cfg, tensors)
    reference = ReferenceVision(str(llava))
    for data in (png(0, (40, 130, 3)), png(1, (64, 30, 4))):
        pixel_values = _pixel_values(llava, [data])
        with torch.no_grad():
            want = model.model.get_image_features(
                pixel_values=torch.from_numpy(pixel_values).double()).pooler_output[0].numpy()
        assert want.shape == (TOKENS, 64)
        scale = np.abs(want).max()
        for name, tower, bound in towers:
            got = tower.encode(pixel_values.astype(np.float32))[0]
            assert np.abs(got - want).max() / scale < bound, name
        assert np.abs(reference.encode(pixel_values[0]) - want).max() / scale < 1e-6


def test_a_llava_with_another_tower_or_feature_is_refused_naming_it(llava, tmp_path):
    """A LLaVA whose config.json asks for what the tower does not compute (the class token's row kept, a layer past
    the tower's, a SigLIP tower) is refused by the tower's reader naming the key or the tower."""
    import json
    import shutil

    from llm_serving.models.weights.common import WeightLoadError
    from llm_serving.models.weights.vision import vision_checkpoint

    for changes, why in (({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
                         ({"vision_feature_layer": 7}, "vision_feature_layer 7"),
                         ({"vision_config": {"model_type": "siglip_vision_model"}}, "'siglip_vision_model'")):
        other = tmp_path / why.split()[0].strip("'")
        shutil.copytree(llava, other)
        config = json.loads((other / "config.json").read_text())
        for key, value in changes.items():
            config[key] = {**config[key], **value} if isinstance(value, dict) else value
        (other / "config.json").write_text(json.dumps(config))
        with pytest.raises(WeightLoadError, match=why):
            vision_checkpoint(str(other))


def write_llava_mmproj(hf_dir, path):
    """The mmproj GGUF llama.cpp's LLaVA converter (tools/mtmd/legacy-models' convert_image_encoder_to_gguf.py,
    --llava-projector, --use-f32) writes of a LLaVA 1.5: projector type mlp; the CLIP tower's layers but the last
    (`clip.vision.block_count` one fewer), its names as the converter makes them (`v.class_embd`, `v.patch_embd`,
    `v.position_embd`, `v.pre_ln`, `v.blk.N.attn_q` ..., fc1 as `ffn_down` and fc2 as `ffn_up`), no post LayerNorm,
    LLaVA's projector as `mm.0` and `mm.2`; the keys it writes, CLIP's own projection_dim among them. Checked against
    the converter's own file of make_llava's tower and projector (llama-cpp-python 0.3's sources, run under
    transformers 5 with its CLIPVisionModel given back a `vision_model`): the same keys, names and values, but that
    it stores the patch kernel and the projector's two matrices in F16 even with --use-f32, which this writes in F32
    so that the served tokens hold to transformers' float32 forward."""
    import json

    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    layers = vision["num_hidden_layers"] - 1
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_bool("clip.has_text_encoder", False)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_file_type(0)
    writer.add_description("image encoder for LLaVA")
    writer.add_string("clip.projector_type", "mlp")
    for key, value in (("image_size", vision["image_size"]), ("patch_size", vision["patch_size"]),
                       ("embedding_length", vision["hidden_size"]),
                       ("feed_forward_length", vision["intermediate_size"]),
                       ("projection_dim", vision["projection_dim"]),
                       ("attention.head_count", vision["num_attention_heads"]), ("block_count", layers)):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision["layer_norm_eps"])
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    writer.add_bool("clip.use_gelu", False)
    for name, array in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("model.")
        if name.startswith("multi_modal_projector."):
            writer.add_tensor(name.replace("multi_modal_projector", "mm").replace("linear_1", "0")
                              .replace("linear_2", "2"), array)
            continue
        if not name.startswith("vision_tower.") or "post_layernorm" in name:
            continue
        name = "v." + name.removeprefix("vision_tower.").removeprefix("vision_model.")    # (5.x's, 4.x's)
        if name.startswith("v.encoder.layers.") and int(name.split(".")[3]) >= layers:
            continue                                # (the converter drops the layers past LLaVA's)
        for theirs, ours in (("encoder.layers", "blk"), ("embeddings.", ""), ("_proj", ""), ("self_attn.", "attn_"),
                             ("layer_norm", "ln"), ("mlp.fc1", "ffn_down"), ("mlp.fc2", "ffn_up"),
                             ("embedding", "embd"), ("layrnorm", "ln")):
            name = name.replace(theirs, ours)
        writer.add_tensor(name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_gguf_and_its_mlp_mmproj_serve_the_same_image_questions(llava, tmp_path):
    """The text model as a `llama` GGUF and the tower as llama.cpp's LLaVA converter writes its mlp mmproj (the last
    layer dropped, fc1 and fc2 under each other's names): the tower's config and tensors are the HF directory's, and
    image questions get transformers' greedy tokens (the image padded to a square, as llama.cpp and the tiny model's
    LlavaImageProcessor both do). An mmproj with a GELU MLP, a post LayerNorm or llava-1.6's image grid is refused
    naming it."""
    import dataclasses

    from llm_serving.models.weights.common import WeightLoadError
    from llm_serving.models.weights.vision import mmproj_checkpoint, vision_checkpoint, vision_shapes
    from tests.families import edited_gguf, write_gguf
    from tests.integration.test_images_qwen import served_gguf_chats

    text, mmproj = write_gguf(None, llava, tmp_path / "llava.gguf"), tmp_path / "mmproj.gguf"
    write_llava_mmproj(llava, mmproj)
    cfg, tensors = mmproj_checkpoint(str(mmproj))
    hf_cfg, hf_tensors = vision_checkpoint(str(llava))
    assert cfg == dataclasses.replace(hf_cfg, image_token_id=None)       # (an mmproj has no token ids: the text's)
    assert sorted(tensors) == sorted(vision_shapes(cfg))     # (the last layer and the post LayerNorm not written)
    for name, tensor in tensors.items():
        index = (slice(None),) * len(tensor.shape)
        np.testing.assert_array_equal(tensor.read(index), hf_tensors[name].read(index), err_msg=name)
    served_gguf_chats(llava, text, mmproj, tmp_path, LLAVA)

    for bad, fields, tensors, why in (
            ("gelu", {"clip.use_gelu": True}, None, "clip.use_gelu"),
            ("post_ln", None, {"v.post_ln.weight": np.ones(32, np.float32)}, "v.post_ln.weight"),
            ("pinpoints", {"clip.vision.image_grid_pinpoints": [336, 672, 672, 336]}, None, "image_grid_pinpoints")):
        edited_gguf(mmproj, tmp_path / f"{bad}.gguf", fields, tensors)
        with pytest.raises(WeightLoadError, match=why):
            mmproj_checkpoint(str(tmp_path / f"{bad}.gguf"))
