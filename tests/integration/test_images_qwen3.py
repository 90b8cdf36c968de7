"""Images in, Qwen3-VL (issue 67): the real server on a tiny random Qwen3VLForConditionalGeneration that transformers
makes (tests/families.py's `make_qwen3_vl`: an image resized within 4 to 16 merged patches of 32 pixels, each one
token; a tower with learned position rows and DeepStack mergers; a Qwen3 text model with interleaved M-RoPE whose
first two layers add the DeepStack rows to the image's tokens). Image questions through OpenAI's chat API get
transformers' greedy tokens and log-probabilities, from the HF directory and from a `qwen3vl` GGUF with its
qwen3vl_merger mmproj, with chunked prefill cutting between images, the prefix cache and the encoded-image cache in
play; the float64 reference places the images and their DeepStack rows as transformers does. The chats, the served
checks and the helpers are test_images_qwen.py's (Qwen2.5-VL's: the same processor, prompt and API)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tests.families import make_qwen3_vl, needs_transformers
from tests.integration.image_chats import png
from tests.integration.test_images_qwen import IMAGE, _processed, _prompt_ids, served_gguf_chats, served_image_chats

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("qwen3vl")
    make_qwen3_vl(directory, seed=5)
    return directory


def test_qwen3_vl_image_questions_get_transformers_tokens_and_logprobs(qwen3_vl, tmp_path):
    """Image chats to a tiny Qwen3-VL (test_images_qwen.py's `served_image_chats`): each reply is transformers'
    greedy tokens with their log-probabilities (its DeepStack rows added after the first two layers, its interleaved
    M-RoPE), with chunked prefill, the prefix cache and the encoded-image cache in play; the precision gate with
    picture prompts passes (the float64 tower's rows, DeepStack's among them)."""
    served_image_chats(qwen3_vl, tmp_path)


def write_qwen3_mmproj(hf_dir, path):
    """The mmproj GGUF llama.cpp's `convert_hf_to_gguf.py --mmproj --outtype f32` writes of a Qwen3-VL (projector
    type qwen3vl_merger: q|k|v as one `attn_qkv`, the MLP `ffn_up` / `ffn_down`, the 3-D patch kernel as two 2-D ones
    `v.patch_embd.weight` and `.weight.1` with its bias, the position rows `v.position_embd`, the merger's norm
    `v.post_ln` and its MLP `mm.0` / `mm.2`, each DeepStack merger `v.deepstack.L.{norm,fc1,fc2}` by its layer L, and
    `clip.vision.is_deepstack_layers` a flag a layer), as the converter's own file of make_qwen3_vl's model has them,
    name by name."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    deep = vision["deepstack_visual_indexes"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "qwen3vl_merger")
    side = int(round(vision["num_position_embeddings"] ** 0.5))
    for key, value in (("projection_dim", vision["out_hidden_size"]), ("image_size", side * vision["patch_size"]),
                       ("patch_size", vision["patch_size"]), ("embedding_length", vision["hidden_size"]),
                       ("feed_forward_length", vision["intermediate_size"]), ("block_count", vision["depth"]),
                       ("attention.head_count", vision["num_heads"]),
                       ("spatial_merge_size", vision["spatial_merge_size"])):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_bool("clip.use_gelu", True)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.is_deepstack_layers", [i in deep for i in range(vision["depth"])])
    layer = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
             "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
    merger = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
    stack = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    for name, array in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("model.")
        if name.startswith("visual.blocks."):
            index, _, rest = name[len("visual.blocks."):].partition(".")
            part, _, kind = rest.rpartition(".")
            writer.add_tensor(f"v.blk.{index}.{layer[part]}.{kind}", array)
        elif name == "visual.patch_embed.proj.weight":
            writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(array[:, :, 0]))
            writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(array[:, :, 1]))
        elif name == "visual.patch_embed.proj.bias":
            writer.add_tensor("v.patch_embd.bias", array)
        elif name == "visual.pos_embed.weight":
            writer.add_tensor("v.position_embd.weight", array)
        elif name.startswith("visual.merger."):
            part, _, kind = name[len("visual.merger."):].rpartition(".")
            writer.add_tensor(f"{merger[part]}.{kind}", array)
        elif name.startswith("visual.deepstack_merger_list."):
            k, _, rest = name[len("visual.deepstack_merger_list."):].partition(".")
            part, _, kind = rest.rpartition(".")
            writer.add_tensor(f"v.deepstack.{deep[int(k)]}.{stack[part]}.{kind}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen3vl_gguf_and_its_mmproj_serve_the_same_image_questions(qwen3_vl, tmp_path):
    """The text model as llama.cpp's `qwen3vl` GGUF (its M-RoPE sections in `rope.dimension_sections`, interleaved as
    llama.cpp computes the architecture; `n_deepstack_layers`) and the tower as its qwen3vl_merger mmproj: the
    tower's config and tensors are the HF directory's, and image questions get transformers' greedy tokens."""
    from llm_serving.models.weights import load_llama_weights
    from llm_serving.models.weights.vision import mmproj_checkpoint, vision_checkpoint
    from tests.families import write_gguf

    text, mmproj = write_gguf(None, qwen3_vl, tmp_path / "qwen3-vl.gguf"), tmp_path / "mmproj.gguf"
    write_qwen3_mmproj(qwen3_vl, mmproj)
    cfg, tensors = mmproj_checkpoint(str(mmproj))
    hf_cfg, hf_tensors = vision_checkpoint(str(qwen3_vl))
    assert cfg == dataclasses.replace(hf_cfg, image_token_id=None, vision_start_token_id=None,
                                      vision_end_token_id=None)      # (an mmproj has no token ids: the text model's)
    assert sorted(tensors) == sorted(hf_tensors)
    for name, tensor in tensors.items():
        index = (slice(None),) * len(tensor.shape)
        np.testing.assert_array_equal(tensor.read(index), hf_tensors[name].read(index), err_msg=name)
    text_cfg = load_llama_weights(str(text))[0]
    assert (text_cfg.mrope_section, text_cfg.mrope_interleaved, text_cfg.deepstack_layers) == ((2, 3, 3), True, 2)
    served_gguf_chats(qwen3_vl, text, mmproj, tmp_path)


def test_the_float64_reference_adds_deepstack_rows_as_transformers_does(qwen3_vl):
    """The precision gate's float64 text model with transformers' own image features (the merger's rows and the two
    DeepStack mergers' side by side) in place of two images' placeholders, fed in two calls: its logits at every
    token are transformers' float64 forward's; without the DeepStack rows, or with the M-RoPE frequencies in runs
    instead of interleaved, they are not (the test can tell)."""
    import dataclasses

    torch, transformers = needs_transformers()
    from llm_serving.reference_llama import ReferenceLlama

    wide, square = png(1, (50, 120, 3)), png(4, (100, 100, 3))
    ids = _prompt_ids(qwen3_vl, [("user", f"Compare:{IMAGE} and{IMAGE} now")], [wide, square])
    out = _processed(qwen3_vl, [wide, square])
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        str(qwen3_vl), dtype=torch.float64, attn_implementation="eager").eval()
    image_id = model.config.image_token_id
    pixels, grid = torch.from_numpy(out["pixel_values"]).double(), torch.from_numpy(out["image_grid_thw"])
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid, use_cache=False,
                     mm_token_type_ids=torch.tensor([[int(t == image_id) for t in ids]])).logits[0].numpy()
        vision = model.model.visual(pixels, grid_thw=grid)
    features = torch.cat([vision.pooler_output, *vision.deepstack_features], -1).numpy()
    sizes = [int(g.prod()) // 4 for g in grid]
    rows = np.split(features, np.cumsum(sizes)[:-1])
    runs = [k for k in range(len(ids)) if ids[k] == image_id and (k == 0 or ids[k - 1] != image_id)]
    grids = [(int(g[1]) // 2, int(g[2]) // 2) for g in grid]
    relative = lambda a: float(np.abs(a - want).max() / np.abs(want).max())       # noqa: E731

    def forward(ref, images_rows):
        seq = ref.new_sequence()
        cut = runs[1] - 1
        return np.concatenate([ref.forward(seq, ids[:cut], 0, [(runs[0], images_rows[0], False, grids[0])]),
                               ref.forward(seq, ids[cut:], cut, [(runs[1] - cut, images_rows[1], False, grids[1])])])
    ref = ReferenceLlama(str(qwen3_vl))
    assert relative(forward(ref, rows)) < 2e-6
    flat = [np.concatenate([r[:, :64], np.zeros_like(r[:, 64:])], 1) for r in rows]
    assert relative(forward(ref, flat)) > 1e-3
    ref.config = dataclasses.replace(ref.config, mrope_interleaved=False)
    assert relative(forward(ref, rows)) > 1e-4


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("qwen3vlmoe")
    make_qwen3_vl(directory, seed=6, moe=True)
    return directory


def test_qwen3_vl_moe_image_questions_get_transformers_tokens_and_logprobs(qwen3_vl_moe, tmp_path):
    """The same image chats to a tiny Qwen3-VL-MoE (make_qwen3_vl's `moe`: layers 0 and 2 mixtures of 4 experts, 2
    chosen a token, their gate and up one fused tensor as transformers 5 saves it; layer 1 dense): each reply is
    transformers' greedy tokens with their log-probabilities, and the precision gate passes."""
    served_image_chats(qwen3_vl_moe, tmp_path)


def test_qwen3_vl_moe_experts_read_the_same_in_the_hubs_orientation(qwen3_vl_moe, tmp_path):
    """The Hub's Qwen3-VL-MoE files store each layer's experts as x @ W (gate_up (E, H, 2I), down (E, I, H)), the
    transposes of what transformers 5 saves; the loader makes the same stacks of both (gate the first half of each
    expert's units, up the second), and where the shapes cannot tell the two apart (H = 2I), config.json's
    transformers_version does."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from llm_serving.models.weights.hf import load_hf

    def stacks(directory):
        _, tensors = load_hf(str(directory))
        return {n: t.read((slice(None),) * len(t.shape)) for n, t in tensors.items() if ".mlp." in n}

    hub = tmp_path / "hub"
    shutil.copytree(qwen3_vl_moe, hub)
    arrays = load_file(str(hub / "model.safetensors"))
    for name in [n for n in arrays if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        arrays[name] = np.ascontiguousarray(arrays[name].transpose(0, 2, 1))
    save_file(arrays, str(hub / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hub / "config.json").read_text())
    config["transformers_version"] = "4.57.1"
    (hub / "config.json").write_text(json.dumps(config))
    ours, theirs = stacks(qwen3_vl_moe), stacks(hub)
    assert sorted(ours) == sorted(theirs)
    assert "model.layers.0.mlp.experts.gate_proj.weight" in ours and "model.layers.1.mlp.gate_proj.weight" in ours
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    gate_up = load_file(str(qwen3_vl_moe / "model.safetensors"))["model.language_model.layers.2.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(ours["model.layers.2.mlp.experts.up_proj.weight"][24:48], gate_up[1, 24:48])

    # H = 2I (64 = 2 x 32): gate_up (E, 64, 64) in either orientation; the version decides (4.x: x @ W, the Hub's)
    square = tmp_path / "square"
    shutil.copytree(hub, square)
    arrays = load_file(str(square / "model.safetensors"))
    config = json.loads((square / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 32
    (square / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    for name in [n for n in arrays if n.endswith("mlp.experts.gate_up_proj")]:
        arrays[name] = rng.standard_normal((4, 64, 64)).astype(np.float32)          # (E, H, 2I) as stored
    for name in [n for n in arrays if n.endswith("mlp.experts.down_proj")]:
        arrays[name] = rng.standard_normal((4, 32, 64)).astype(np.float32)          # (E, I, H)
    save_file(arrays, str(square / "model.safetensors"), metadata={"format": "pt"})
    gate = stacks(square)["model.layers.0.mlp.experts.gate_proj.weight"]
    stored = arrays["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    np.testing.assert_array_equal(gate[32:64], stored[1, :, :32].T)               # expert 1's gate, as x @ W
    config["transformers_version"] = "5.24.0"
    (square / "config.json").write_text(json.dumps(config))
    np.testing.assert_array_equal(stacks(square)["model.layers.0.mlp.experts.gate_proj.weight"][32:64],
                                  stored[1, :32, :])                                # as nn.Linear's rows


def test_a_qwen3vlmoe_gguf_and_its_mmproj_serve_the_same_image_questions(qwen3_vl_moe, tmp_path):
    """The text model as llama.cpp's `qwen3vlmoe` GGUF (the fused experts cut into ffn_gate_exps / ffn_up_exps /
    ffn_down_exps stacks as its converter cuts them) and the tower as the qwen3vl_merger mmproj Qwen3-VL's is: image
    questions get transformers' greedy tokens."""
    from llm_serving.models.weights import load_llama_weights
    from tests.families import write_gguf

    text, mmproj = write_gguf(None, qwen3_vl_moe, tmp_path / "qwen3-vl-moe.gguf"), tmp_path / "mmproj.gguf"
    write_qwen3_mmproj(qwen3_vl_moe, mmproj)
    text_cfg = load_llama_weights(str(text))[0]
    assert (text_cfg.architecture, text_cfg.num_experts, text_cfg.dense_layers, text_cfg.deepstack_layers,
            text_cfg.mrope_interleaved) == ("qwen3vlmoe", 4, (1,), 2, True)
    served_gguf_chats(qwen3_vl_moe, text, mmproj, tmp_path)
