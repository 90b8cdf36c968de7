"""Images in, Qwen2-VL (issue 67): a tiny random Qwen2VLForConditionalGeneration that transformers makes
(tests/families.py's `make_qwen2_vl`: a tower of LayerNorms, full attention in every block and a quick-GELU MLP, 14-
pixel patches merged 2 x 2; a Qwen2 text model with M-RoPE). Its tower (models/vision_qwen.py, `family` "qwen2_vl")
gives transformers' rows on MindSpore's ops, on the CPU kernels' float panels and on their int16 panels within their
level, run whole or a block at a time; the real server answers image questions through OpenAI's chat API with
transformers' greedy tokens and log-probabilities, from the HF directory (chunked prefill, the prefix cache, the
encoded-image cache and the precision gate in play) and from a `qwen2vl` GGUF with its qwen2vl_merger mmproj. The
chats, the served checks and the helpers are test_images_qwen.py's (Qwen2.5-VL's: the same processor, prompt and
API)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.families import make_qwen2_vl, needs_transformers
from tests.integration.image_chats import png
from tests.integration.test_images_qwen import add_qwen_vl_tensors, served_gguf_chats, served_image_chats

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

# (height, width, channels) of the tower's test images -> their merge units (28-pixel units, 4 to 16 of them): a
# square, one row of units, a tall one, a transparent one raised to the processor's least area
SHAPES = {(100, 100, 3): (4, 4), (40, 130, 3): (1, 5), (120, 50, 3): (4, 2), (20, 30, 4): (2, 3)}
WIDTH = 64                                  # the text model's


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """The model's directory, its images' patches (SHAPES' order) and transformers' rows of them."""
    torch, _ = needs_transformers()
    from llm_serving.vision import ImageSpec, decode, qwen_patches

    directory = tmp_path_factory.mktemp("qwen2vl")
    model = make_qwen2_vl(directory, seed=7)
    spec = ImageSpec.from_dir(str(directory))
    patches = [qwen_patches(decode(png(k, shape)), spec) for k, shape in enumerate(SHAPES)]
    assert [p.shape[:2] for p in patches] == list(SHAPES.values())
    rows = np.concatenate([p.reshape(-1, p.shape[-1]) for p in patches])
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(rows), torch.tensor([[1, 2 * p.shape[0], 2 * p.shape[1]]
                                                                       for p in patches]))
    theirs = np.split(out.pooler_output.numpy(), np.cumsum([p.shape[0] * p.shape[1] for p in patches])[:-1])
    return directory, patches, theirs


def _tower(directory, **kernels):
    from llm_serving.models.mindspore_env import setup_mindspore
    from llm_serving.models.vision_qwen import QwenVisionTower
    from llm_serving.models.weights.vision import vision_checkpoint

    setup_mindspore("CPU", 0, None, None)
    cfg, weights = vision_checkpoint(str(directory))
    return cfg, QwenVisionTower(cfg, weights, **kernels)


@pytest.mark.parametrize("on", ["mindspore", "kernels", "int16"])
def test_the_tower_s_rows_are_transformers_whole_and_a_block_at_a_time(qwen2_vl, on):
    """Each image's rows (merge units row by row) against transformers' of a batch of all of them: within 1e-5 of
    the largest on MindSpore's ops and the float kernels (their AMX bound where they run on AMX tiles), 5e-3 on the
    int16 panels; the quick GELU checked to matter (the tanh GELU's rows are further off than the bound). Run a
    block at a time from the patches, the state kept as numpy between blocks (as the agent keeps it between
    steps), the rows are `encode`'s to the bit."""
    from llm_serving.models.runner.kernels import build_vision_kernels
    from tests.integration.test_vision_qwen3 import float_kernels_bound

    directory, patches, theirs = qwen2_vl
    kernels = build_vision_kernels("CPU", "on")
    cfg, tower = _tower(directory, **({} if on == "mindspore" else {"kernels": kernels, "threads": 2,
                                                                     "int16": on == "int16"}))
    assert (cfg.family, cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size) == ("qwen2_vl", 32, 64, WIDTH)
    assert (cfg.layer_norms, cfg.mlp_activation, cfg.row_width, cfg.window_units) == (True, "quick_gelu", WIDTH, 1)
    assert cfg.fullatt_block_indexes == (0, 1, 2, 3) and tower.nbytes > 0
    bound = {"mindspore": 1e-5, "kernels": float_kernels_bound(kernels, 1e-5), "int16": 5e-3}[on]
    for shape, image, want in zip(SHAPES, patches, theirs):
        whole = tower.encode(image)
        assert whole.shape == (1, image.shape[0] * image.shape[1], WIDTH) and whole.dtype == np.float32
        scale = np.abs(want).max()
        assert scale > 1.0                          # (random weights: not a projection of zeros)
        np.testing.assert_allclose(whole[0], want, atol=bound * scale, rtol=0, err_msg=f"{shape} on {on}")
        state = tower.kept(tower.embed(image))
        for block in range(cfg.num_layers):
            state = tower.kept(tower.run_layers(state, block, block + 1))
        assert np.array_equal(tower.project(state), whole), shape
    tower.warm()


def test_the_quick_gelu_is_what_makes_the_rows_transformers(qwen2_vl, monkeypatch):
    """The same tower with the tanh GELU in its MLP (a config that says so) is further from transformers' rows than
    the bound the quick GELU meets: the test above would see the wrong activation."""
    from llm_serving.models.weights import vision

    directory, patches, theirs = qwen2_vl
    monkeypatch.setattr(vision.QwenVisionConfig, "mlp_activation", property(lambda self: "gelu_tanh"))
    cfg, tower = _tower(directory)
    assert cfg.mlp_activation == "gelu_tanh"
    errors = [np.abs(tower.encode(p)[0] - want).max() / np.abs(want).max() for p, want in zip(patches, theirs)]
    assert min(errors) > 1e-3, errors


def test_qwen2_vl_image_questions_get_transformers_tokens_and_logprobs(qwen2_vl, tmp_path):
    """Image chats to the tiny Qwen2-VL (test_images_qwen.py's `served_image_chats`): each reply is transformers'
    greedy tokens with their log-probabilities (its M-RoPE positions), with chunked prefill, the prefix cache and the
    encoded-image cache in play; the precision gate with picture prompts passes (the float64 tower's rows)."""
    served_image_chats(qwen2_vl[0], tmp_path)


def write_qwen2_mmproj(hf_dir, path, use_silu: bool = False):
    """The mmproj GGUF llama.cpp's `convert_hf_to_gguf.py --mmproj --outtype f32` writes of a Qwen2-VL (projector
    type qwen2vl_merger: q, k and v apart, the MLP `ffn_up` / `ffn_down`, the LayerNorms `ln1` / `ln2` with their
    biases, the 3-D patch kernel as two 2-D ones `v.patch_embd.weight` and `.weight.1`, the merger's LayerNorm
    `v.post_ln` and its MLP `mm.0` / `mm.2`; neither clip.use_gelu nor clip.use_silu, so llama.cpp runs the quick
    GELU; `feed_forward_length` the vision config's hidden_size, which is the text model's width), as the converter's
    own file of make_qwen2_vl's model has them, key by key and name by name (checked against it, 2026-12-02).
    `use_silu`: clip.use_silu set too (no converter writes it for this projector)."""
    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    for key, value in (("projection_dim", config["text_config"]["hidden_size"]), ("image_size", 560),
                       ("patch_size", vision["patch_size"]), ("embedding_length", vision["embed_dim"]),
                       ("feed_forward_length", vision["hidden_size"]), ("block_count", vision["depth"]),
                       ("attention.head_count", vision["num_heads"])):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    writer.add_string("clip.projector_type", "qwen2vl_merger")
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    if use_silu:
        writer.add_bool("clip.use_silu", True)
    add_qwen_vl_tensors(writer, hf_dir, {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.fc1": "ffn_up",
                                         "mlp.fc2": "ffn_down"})


def test_a_qwen2vl_gguf_and_its_mmproj_serve_the_same_image_questions(qwen2_vl, tmp_path):
    """The text model as llama.cpp's `qwen2vl` GGUF and the tower as its qwen2vl_merger mmproj: the mmproj's config
    is the HF directory's (its MLP's width from the tensors: the file's feed-forward length is the text model's
    width), its tensors the same values under the same names; image questions get transformers' greedy tokens. An
    mmproj that sets clip.use_silu is refused naming it."""
    import dataclasses

    from llm_serving.models.weights import WeightLoadError
    from llm_serving.models.weights.vision import mmproj_checkpoint, vision_checkpoint
    from tests.families import write_gguf

    directory = qwen2_vl[0]
    text, mmproj = write_gguf(None, directory, tmp_path / "qwen2-vl.gguf"), tmp_path / "mmproj.gguf"
    write_qwen2_mmproj(directory, mmproj)
    cfg, tensors = mmproj_checkpoint(str(mmproj))
    hf_cfg, hf_tensors = vision_checkpoint(str(directory))
    assert cfg == dataclasses.replace(hf_cfg, image_token_id=None, vision_start_token_id=None, vision_end_token_id=None)
    assert sorted(tensors) == sorted(hf_tensors)
    for name, tensor in tensors.items():
        index = (slice(None),) * len(tensor.shape)
        np.testing.assert_array_equal(tensor.read(index), hf_tensors[name].read(index), err_msg=name)
    served_gguf_chats(directory, text, mmproj, tmp_path)
    write_qwen2_mmproj(directory, tmp_path / "silu.gguf", use_silu=True)
    with pytest.raises(WeightLoadError, match="clip.use_silu: Qwen2-VL's tower runs quick GELU"):
        mmproj_checkpoint(str(tmp_path / "silu.gguf"))
