"""Gemma 3's vision tower (models/vision_tower.py) against transformers' on a tiny random Gemma3ForConditionalGeneration:
an image decoded and made into pixels here (llm_serving/vision), then SigLIP and the projector in MindSpore graphs (on
its ops, and on the CPU kernels), each image's tokens within 1e-5 (relative) of `get_image_features`'s; the checkpoint
read under transformers 5.x's names and 4.x's (`vision_tower.vision_model.*`, `language_model.model.*`); the
checkpoint's faults named."""
from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest

from tests.families import make_gemma3_vl, needs_transformers

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("gemma3_vl")
    return directory, make_gemma3_vl(directory, tokenizer=False)


def _images():
    from PIL import Image

    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (70, 91, 3), dtype=np.uint8))                 # resized down
    drawing = Image.fromarray(rng.integers(0, 256, (30, 20, 4), dtype=np.uint8), "RGBA")        # up, transparent
    out = []
    for image in (photo, drawing):
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def _tower(directory, kernels: bool = False, int16: bool = False):
    from llm_serving.models.mindspore_env import setup_mindspore
    from llm_serving.models.runner.kernels import build_vision_kernels
    from llm_serving.models.vision_tower import VisionTower
    from llm_serving.models.weights.vision import vision_checkpoint

    setup_mindspore("CPU", 0, None, None)
    cfg, weights = vision_checkpoint(str(directory))
    library = build_vision_kernels("CPU", "on") if kernels else None
    return cfg, VisionTower(cfg, weights, kernels=library, threads=3, int16=int16)


@pytest.mark.parametrize("kernels,int16", [(False, False), (True, False), (True, True)],
                         ids=["ops", "kernels", "kernels-int16"])
def test_the_tower_s_tokens_are_transformers_for_decoded_images(gemma3_vl, kernels, int16):
    """On MindSpore's ops, on the CPU kernels (kernels/vision_layer_cpu.cc: attention, LayerNorm, GELU), and with
    the kernels' products in int16 (within the quantization's ~1e-3, not float32's 1e-5)."""
    torch, transformers = needs_transformers()
    from llm_serving.vision import ImageSpec, decode, pixels

    directory, model = gemma3_vl
    cfg, tower = _tower(directory, kernels, int16)
    assert tower.int16 == int16
    assert {str(w[2].dtype) for w in tower.layer_weights} == ({"Int16"} if int16 else {"Float32"})
    assert (cfg.tokens_per_image, cfg.pool, cfg.text_hidden_size, cfg.image_token_id) == (4, 2, 64, 5)
    spec = ImageSpec.from_dir(str(directory))
    ours_pixels = np.stack([pixels(decode(data), spec) for data in _images()])
    processor = transformers.Gemma3ImageProcessor.from_pretrained(str(directory))
    theirs_pixels = processor(images=[decode(data) for data in _images()], return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(ours_pixels, theirs_pixels, atol=1e-6)
    ours = tower.encode(ours_pixels)
    with torch.no_grad():
        theirs = model.model.get_image_features(torch.from_numpy(theirs_pixels)).pooler_output.numpy()
    assert ours.shape == theirs.shape == (2, 4, 64)
    scale = np.abs(theirs).max()
    assert scale > 1.0                                  # (random weights: not a projection of zeros)
    np.testing.assert_allclose(ours, theirs, atol=(3e-3 if int16 else 1e-5) * scale)
    if int16:               # ... and not float32's: the int16 products are what runs
        assert np.abs(ours - theirs).max() > 1e-5 * scale
    # one image alone gives its own tokens: nothing of the other image leaks into a batch's rows
    # (int16: a last-bit difference upstream, in MindSpore's patch matmul, may round a value of x to the next step)
    np.testing.assert_allclose(tower.encode(ours_pixels[1:]), ours[1:], atol=(1e-4 if int16 else 1e-6) * scale)


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_a_half_precision_checkpoint_s_matrices_stay_half_on_the_kernels(gemma3_vl, tmp_path, kind):
    """A checkpoint storing the layers' matrices in F16 or BF16: the kernels keep them so (half the float32 tower's
    bytes), and the tokens are transformers' on the same rounded weights."""
    import copy
    import shutil

    from mindspore.common import dtype as mstype
    from safetensors.torch import load_file, save_file

    torch, _ = needs_transformers()
    directory, model = gemma3_vl
    half = torch.float16 if kind == "F16" else torch.bfloat16
    shutil.copytree(directory, tmp_path / "m")
    tensors = load_file(str(directory / "model.safetensors"))
    layers = {name for name, t in tensors.items() if "encoder.layers." in name and t.ndim == 2}
    assert len(layers) == 2 * 6                                  # q, k, v, out, fc1, fc2 of 2 layers
    save_file({name: t.to(half) if name in layers else t for name, t in tensors.items()},
              str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    _, tower = _tower(tmp_path / "m", kernels=True)
    _, float_tower = _tower(directory, kernels=True)
    assert tower.layer_weights[0][2].dtype == (mstype.float16 if kind == "F16" else mstype.bfloat16)
    def matrices(t):                                             # qkv, out, fc1, fc2 (_LAYER_INPUTS)
        return sum(layer[i].nbytes for layer in t.layer_weights for i in (2, 4, 8, 10))

    assert matrices(tower) * 2 == matrices(float_tower)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "encoder.layers." in name and p.ndim == 2:
                p.copy_(p.to(half).to(torch.float32))
    pixels = np.random.default_rng(4).standard_normal((2, 3, 56, 56)).astype(np.float32)
    with torch.no_grad():
        theirs = reference.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    np.testing.assert_allclose(tower.encode(pixels), theirs, atol=1e-5 * np.abs(theirs).max())


def test_transformers_4_names_read_the_same_tower(gemma3_vl, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory, _ = gemma3_vl
    tensors = load_file(str(directory / "model.safetensors"))
    renamed = {}
    for name, array in tensors.items():             # (5.x writes vision_tower.*, language_model.*, or model.<those>)
        name = name[len("model."):] if name.startswith("model.") else name
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        elif name.startswith("language_model.") and not name.startswith("language_model.model."):
            name = "language_model.model." + name[len("language_model."):]
        renamed[name] = array
    assert any(n.startswith("vision_tower.vision_model.") for n in renamed)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    for name in ("config.json", "preprocessor_config.json"):
        (tmp_path / name).write_text((directory / name).read_text())
    pixels = np.random.default_rng(2).standard_normal((1, 3, 56, 56)).astype(np.float32)
    np.testing.assert_array_equal(_tower(tmp_path)[1].encode(pixels), _tower(directory)[1].encode(pixels))


def test_the_checkpoint_s_faults_are_named(gemma3_vl, tmp_path, stories_dir):
    from safetensors.numpy import load_file, save_file

    from llm_serving.models.weights import WeightLoadError
    from llm_serving.models.weights.vision import vision_checkpoint

    directory, _ = gemma3_vl
    assert vision_checkpoint(str(stories_dir / "hf")) is None                 # a text model has no tower
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    save_file({n: a for n, a in tensors.items() if "layers.1.mlp.fc2.weight" not in n or "vision" not in n},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"vision_tower.encoder.layers.1.mlp.fc2.weight.*missing from the vision tower"):
        vision_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "mm_tokens_per_image": 9}))
    with pytest.raises(WeightLoadError, match="does not pool to 9 tokens"):
        vision_checkpoint(str(tmp_path))
    next_config = {**config, "architectures": ["LlavaNextForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(next_config))
    with pytest.raises(WeightLoadError, match="vision tower of LlavaNextForConditionalGeneration is not read here"):
        vision_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match=r"pixels of shape \(N, 3, 56, 56\)"):
        _tower(directory)[1].encode(np.zeros((1, 3, 28, 28), np.float32))


_MMPROJ_LAYER = {"layer_norm1": "ln1", "layer_norm2": "ln2", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.out_proj": "attn_out", "mlp.fc1": "ffn_up",
                 "mlp.fc2": "ffn_down"}


def write_mmproj(hf_dir, path, scale_factor=None):
    """The mmproj GGUF llama.cpp's `convert_hf_to_gguf.py --mmproj --outtype f32` writes of a Gemma 3 (its names,
    keys and types: the projection F16, the soft-embedding norm's gain stored as 1 + w) or of a SmolVLM (projector
    type idefics3: `mm.model.fc.weight` F16, the scale factor and the processor's longest edge), from the HF
    directory; `scale_factor`: Gemma 3's pooling, which only a test model's file states (llama.cpp's tinygemma3)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    smolvlm = config["architectures"][0] == "SmolVLMForConditionalGeneration"
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "idefics3" if smolvlm else "gemma3")
    for key, value in (("projection_dim", config["text_config"]["hidden_size"]), ("image_size", vision["image_size"]),
                       ("patch_size", vision["patch_size"]), ("embedding_length", vision["hidden_size"]),
                       ("feed_forward_length", vision["intermediate_size"]),
                       ("block_count", vision["num_hidden_layers"]),
                       ("attention.head_count", vision["num_attention_heads"])):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision.get("layer_norm_eps", 1e-6))
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    if smolvlm:
        processor = json.loads((hf_dir / "preprocessor_config.json").read_text())
        writer.add_uint32("clip.vision.projector.scale_factor", config["scale_factor"])
        writer.add_uint32("clip.vision.preproc_image_size", processor["size"]["longest_edge"])
    elif scale_factor is not None:
        writer.add_uint32("clip.vision.projector.scale_factor", scale_factor)
    for name, array in load_file(str(hf_dir / "model.safetensors")).items():
        name = name[len("model."):] if name.startswith("model.") else name
        name = name.replace("vision_tower.vision_model.", "vision_tower.").replace("vision_model.", "vision_tower.")
        if name.startswith("vision_tower.encoder.layers."):
            index, _, rest = name[len("vision_tower.encoder.layers."):].partition(".")
            part, _, kind = rest.rpartition(".")
            ours = f"v.blk.{index}.{_MMPROJ_LAYER[part]}.{kind}"
        elif name.startswith("vision_tower.embeddings."):
            ours = name.replace("vision_tower.embeddings.patch_embedding.", "v.patch_embd.").replace(
                "vision_tower.embeddings.position_embedding.", "v.position_embd.")
        elif name.startswith("vision_tower.post_layernorm."):
            ours = name.replace("vision_tower.post_layernorm.", "v.post_ln.")
        elif name == "multi_modal_projector.mm_input_projection_weight":
            ours, array = "mm.input_projection.weight", array.astype(np.float16)
        elif name == "multi_modal_projector.mm_soft_emb_norm.weight":
            ours, array = "mm.soft_emb_norm.weight", array + 1.0
        elif name == "connector.modality_projection.proj.weight":
            ours, array = "mm.model.fc.weight", array.astype(np.float16)
        else:
            continue
        writer.add_tensor(ours, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_mmproj_gguf_reads_the_same_tower(gemma3_vl, tmp_path):
    """llama.cpp's mmproj layout: the tower from it equals the HF directory's, but for the projection's F16 rounding;
    without the scale factor a Gemma 3 pools 4 x 4 patches (here: one token an image), as llama.cpp does."""
    from llm_serving.models.vision_tower import VisionTower
    from llm_serving.models.weights import WeightLoadError
    from llm_serving.models.weights.vision import mmproj_checkpoint

    directory, _ = gemma3_vl
    write_mmproj(directory, tmp_path / "mmproj.gguf", scale_factor=2)
    cfg, weights = mmproj_checkpoint(str(tmp_path / "mmproj.gguf"))
    hf_cfg, hf_tower = _tower(directory)
    assert cfg == dataclasses.replace(hf_cfg, image_token_id=None, boi_token_id=None, eoi_token_id=None,
                                      layer_norm_eps=cfg.layer_norm_eps)     # (the ids are the text model's)
    assert cfg.layer_norm_eps == pytest.approx(hf_cfg.layer_norm_eps)      # (a float32 key)
    pixels = np.random.default_rng(3).standard_normal((2, 3, 56, 56)).astype(np.float32)
    theirs = hf_tower.encode(pixels)
    ours = VisionTower(cfg, weights).encode(pixels)
    np.testing.assert_allclose(ours, theirs, atol=2e-3 * np.abs(theirs).max())
    write_mmproj(directory, tmp_path / "default.gguf")
    assert mmproj_checkpoint(str(tmp_path / "default.gguf"))[0].tokens_per_image == 1
    (tmp_path / "text.gguf").write_bytes((tmp_path / "mmproj.gguf").read_bytes().replace(b"gemma3", b"llava_"))
    with pytest.raises(WeightLoadError, match="not a Gemma 3, SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3, "
                                              "Pixtral 12B or LLaVA 1.5 mmproj"):
        mmproj_checkpoint(str(tmp_path / "text.gguf"))


def test_an_image_encoded_ahead_a_layer_a_step_gives_the_rows_of_one_go(gemma3_vl):
    """ImageEncoder.advance (runner/images.py) with no time budget runs one layer a call, from the pixels' shared
    memory, and says done after the last; `rows` then adds the projector: the rows `encode` gives in one go, to the
    bit (the int16 kernels, this machine's default where AVX2 is). A cached image is done at once; past MAX_PARTIAL
    images under way the oldest is set aside, and its rows are still the tower's (run whole)."""
    from llm_serving.models.runner.images import ImageEncoder
    from llm_serving.shm.images import PixelSegment
    from llm_serving.vision import ImageSpec, decode, pixels

    directory, _ = gemma3_vl
    cfg, tower = _tower(directory, kernels=True, int16=True)
    spec = ImageSpec.from_dir(str(directory))
    images = [pixels(decode(data), spec) for data in _images()]
    images.append(images[0][:, ::-1].copy())
    whole = [tower.encode(p[None])[0] for p in images]
    segments = [PixelSegment.create(p) for p in images]
    try:
        encoder = ImageEncoder(tower, cache_bytes=1 << 20)
        seg = segments[0]
        done = [encoder.advance("a", seg.name, seg.shape, 0.0) for _ in range(cfg.num_layers)]
        assert cfg.num_layers >= 2 and done == [False] * (cfg.num_layers - 1) + [True]
        assert np.array_equal(encoder.rows("a", seg.name, seg.shape), whole[0])
        assert encoder.advance("a", seg.name, seg.shape, 0.0)                        # cached: done, no work
        for key, seg in zip("bcd", segments):                  # three under way: b is set aside, c and d kept
            encoder.advance(key, seg.name, seg.shape, 0.0)
        assert list(encoder._partial) == ["c", "d"]
        for key, seg, want in zip("bcd", segments, whole):
            assert np.array_equal(encoder.rows(key, seg.name, seg.shape), want), key
        assert not encoder._partial                            # nothing kept per image past its rows
    finally:
        for seg in segments:
            seg.unlink()
