"""Images in, Mistral 3 (issue 67): the real server on a tiny random Mistral3ForConditionalGeneration that
transformers makes (tests/families.py's `make_mistral3`: an image's longest edge at most 64 pixels, in merge units of
16 pixels, each a token; a Pixtral tower; a Mistral text model). Its prompt puts an image as rows of [IMG] tokens,
each row ended by [IMG_BREAK] and the last by [IMG_END], tokens of the text's own in the middle of the image. Image
questions through OpenAI's chat API get transformers' greedy tokens and log-probabilities (its forward with its PIL
image processor's pixels, the prompt as its PixtralProcessor expands it), with chunked prefill cutting between
images, the prefix cache and the encoded-image cache in play, and the precision gate's picture prompts; the tower and
the float64 reference are transformers'; a prompt that spells an image's tokens in another layout is a 400. The
served checks are test_images_qwen.py's, given this family's prompt and reference (`Kit`)."""
from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest

from tests.families import MISTRAL3_IMAGE_TOKENS, greedy_with_logprobs, make_mistral3, needs_transformers
from tests.integration.image_chats import png, user_message
from tests.integration.server_harness import http, serving
from tests.integration.test_images_qwen import MODEL, NEW_TOKENS, Kit, _body, served_gguf_chats, served_image_chats
from tests.integration.test_vision_qwen3 import served_towers

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

IMG, BREAK, END = MISTRAL3_IMAGE_TOKENS


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("mistral3")
    make_mistral3(directory, seed=7)
    return directory


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _unit(path) -> int:
    """A token's side in pixels: the patch times Mistral 3's merge (Pixtral 12B's, a LLaVA: none)."""
    config = _config(path)
    return config["vision_config"]["patch_size"] * config.get("spatial_merge_size", 1)


def _model_class(path):
    """transformers' class of the tiny model at `path`: Mistral3ForConditionalGeneration, or (Pixtral 12B's)
    LlavaForConditionalGeneration."""
    _, transformers = needs_transformers()
    return getattr(transformers, _config(path)["architectures"][0])


def _processed(path, images: list) -> dict:
    """transformers' PIL Pixtral image processor on the images (PNG bytes) as Mistral 3's processor calls it (its
    patch the merge unit): pixel_values (padded to the largest) and image_sizes."""
    _, transformers = needs_transformers()
    from PIL import Image

    kind = getattr(transformers, "PixtralImageProcessorPil", transformers.PixtralImageProcessor)
    unit = _unit(path)
    return kind.from_pretrained(str(path))(images=[Image.open(io.BytesIO(d)) for d in images],
                                           patch_size={"height": unit, "width": unit}, return_tensors="np")


def _prompt_ids(path, turns: list, images: list) -> list:
    """The prompt transformers' PixtralProcessor makes (the template rendered by hand, each [IMG] made the image's
    rows of [IMG], each row ended by [IMG_BREAK], the last by [IMG_END]), tokenized by the tokenizers library."""
    from tokenizers import Tokenizer

    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"
    parts = text.split(IMG)
    assert len(parts) == len(images) + 1
    sizes = _processed(path, images)["image_sizes"].tolist() if images else []
    unit = _unit(path)
    expanded = parts[0]
    for (height, width), part in zip(sizes, parts[1:]):
        rows = [[IMG] * (width // unit) + [BREAK] for _ in range(height // unit)]
        rows[-1][-1] = END
        expanded += "".join(t for row in rows for t in row) + part
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(expanded).ids


def _reference(path, ids: list, images: list) -> tuple:
    """transformers' greedy tokens after `ids` with `images` (PNG bytes), and each one's log-probability: a whole
    forward per token."""
    torch, _ = needs_transformers()
    model = _model_class(path).from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    extra = {}
    if images:
        out = _processed(path, images)
        extra = {"pixel_values": torch.from_numpy(out["pixel_values"]),
                 "image_sizes": torch.from_numpy(out["image_sizes"])}

    def logits(context: list):
        return model(input_ids=torch.tensor([context]), use_cache=False, **extra).logits[0, -1]
    return greedy_with_logprobs(logits, ids, NEW_TOKENS)


MISTRAL3 = Kit(IMG, _prompt_ids, _reference)


def test_mistral3_image_questions_get_transformers_tokens_and_logprobs(mistral3, tmp_path):
    """Image chats to a tiny Mistral 3 (test_images_qwen.py's `served_image_chats`): each reply is transformers'
    greedy tokens with their log-probabilities, the row breaks and the image's end embedded as the text's own tokens
    between the tower's rows, with chunked prefill, the prefix cache and the encoded-image cache in play; the
    precision gate with picture prompts passes (the float64 tower's rows at the image's [IMG] tokens)."""
    served_image_chats(mistral3, tmp_path, MISTRAL3)


def test_the_tower_and_the_float64_reference_are_transformers(mistral3):
    """The served tower (MindSpore's ops, the CPU kernels' float32 products and their int16 ones) and the float64
    reference on the processor's patches of a wide and a tall image: within float32's (int16's) reach of
    transformers' float64 image features (the reference within its float32 rotary angles' 1e-7), the reference's
    rows at the image's [IMG] tokens and NaN at its breaks and end."""
    tower_matches_transformers(mistral3)


def tower_matches_transformers(path) -> None:
    """test_the_tower_and_the_float64_reference_are_transformers's checks on the tiny Pixtral-tower model at
    `path` (Mistral 3's or Pixtral 12B's)."""
    torch, _ = needs_transformers()
    from PIL import Image

    from llm_serving.models.vision_qwen import QwenVisionTower
    from llm_serving.models.weights.vision import vision_checkpoint
    from llm_serving.reference_vision import ReferenceVision
    from llm_serving.vision.images import qwen_patches
    from llm_serving.vision.model import image_facts
    from llm_serving.tokenization import load_tokenizer

    model = _model_class(path).from_pretrained(str(path), dtype=torch.float64, attn_implementation="eager").eval()
    facts = image_facts(str(path), None, load_tokenizer(str(path / "tokenizer.json")))
    cfg, tensors = vision_checkpoint(str(path))
    towers = served_towers(QwenVisionTower, cfg, tensors)
    reference = ReferenceVision(str(path))
    for data in (png(0, (40, 130, 3)), png(1, (64, 30, 3))):
        out = _processed(path, [data])
        with torch.no_grad():
            want = model.model.get_image_features(
                pixel_values=torch.from_numpy(out["pixel_values"]).double(),
                image_sizes=torch.from_numpy(out["image_sizes"])).pooler_output[0].numpy()
        patches = qwen_patches(Image.open(io.BytesIO(data)), facts.spec)
        rows, cols = patches.shape[:2]
        assert want.shape[0] == rows * cols and facts.tokens_of(patches) == rows * (cols + 1)
        scale = np.abs(want).max()
        for name, tower, bound in towers:
            got = tower.encode(patches)[0]
            assert np.abs(got - want).max() / scale < bound, name
        ref = reference.encode(patches).reshape(rows, cols + 1, -1)
        assert np.isnan(ref[:, cols]).all() and not np.isnan(ref[:, :cols]).any()
        # (transformers turns its float64 patches by float32 rotary angles: ~1e-7 apart, as Qwen2.5-VL's)
        assert np.abs(ref[:, :cols].reshape(rows * cols, -1) - want).max() / scale < 1e-6


def test_a_prompt_spelling_image_tokens_is_a_400(mistral3, tmp_path):
    """A chat whose text spells image tokens beside its image (an [IMG] and a row break before the picture) is a 400
    naming the image tokens, and the server goes on answering image questions: the wide image's prompt as
    transformers' processor makes it (2 rows of 4 merge units: one row break, one end)."""
    from tokenizers import Tokenizer

    wide = png(0, (40, 130, 3))
    spelled = user_message(f"Look: {IMG}{BREAK}", wide)
    args = ["--model", str(mistral3), "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=128", "--set", "pa_config.kv_cache_dtype=float32"]
    with serving(args, tmp_path / "server.log") as server:
        bad = http("POST", server.url + "/v1/chat/completions", _body([spelled]))
        fine = http("POST", server.url + "/v1/chat/completions", _body([user_message("What is it?", wide)]))
    assert bad[0] == 400 and "image" in bad[1]["error"]["message"], bad
    assert fine[0] == 200, fine
    ids = _prompt_ids(mistral3, [("user", f"What is it?{IMG}")], [wide])
    assert fine[1]["usage"]["prompt_tokens"] == len(ids)
    tok = Tokenizer.from_file(str(mistral3 / "tokenizer.json"))
    assert [ids.count(tok.token_to_id(t)) for t in (IMG, BREAK, END)] == [8, 1, 1]


def write_mistral3_mmproj(hf_dir, path):
    """The mmproj GGUF llama.cpp's `convert_hf_to_gguf.py --mmproj --outtype f32` writes of a Mistral 3 (projector
    type pixtral: each block's q, k (their rows permuted to interleaved rotary pairs, the converter's
    LlamaModel.permute), v, out, the gate/up/down MLP, norms ln1/ln2; the patch kernel `v.patch_embd`, ln_pre
    `v.pre_ln`, the projector's norm `mm.input_norm`, its patch merger `mm.patch_merger`, linear_1 and linear_2
    `mm.1` / `mm.2`), as the converter's own file of make_mistral3's model has them, key by key, name by name and
    value by value; and one tensor more than the converter (of llama-cpp-python 0.3's sources) writes of a HF
    directory: `v.token_embd.img_break`, the text model's embedding row of [IMG_BREAK], which its code means to
    copy (its mmproj pass never sees the text's tensors) and llama.cpp's loader requires."""
    import gguf
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    from tests.families import _llama_cpp_permute

    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    for key, value in (("projection_dim", config["text_config"]["hidden_size"]), ("image_size", vision["image_size"]),
                       ("patch_size", vision["patch_size"]), ("embedding_length", vision["hidden_size"]),
                       ("feed_forward_length", vision["intermediate_size"]),
                       ("block_count", vision["num_hidden_layers"]),
                       ("attention.head_count", vision["num_attention_heads"])):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    writer.add_string("clip.projector_type", "pixtral")
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_bool("clip.use_silu", True)
    if "spatial_merge_size" in config:          # (Pixtral 12B's, a LLaVA, has none: the converter writes none)
        writer.add_uint32("clip.vision.spatial_merge_size", config["spatial_merge_size"])
    layer = {"attention_norm": "ln1", "ffn_norm": "ln2", "attention.q_proj": "attn_q", "attention.k_proj": "attn_k",
             "attention.v_proj": "attn_v", "attention.o_proj": "attn_out", "feed_forward.gate_proj": "ffn_gate",
             "feed_forward.up_proj": "ffn_up", "feed_forward.down_proj": "ffn_down"}
    rest = {"vision_tower.patch_conv": "v.patch_embd", "vision_tower.ln_pre": "v.pre_ln",
            "multi_modal_projector.norm": "mm.input_norm",
            "multi_modal_projector.patch_merger.merging_layer": "mm.patch_merger",
            "multi_modal_projector.linear_1": "mm.1", "multi_modal_projector.linear_2": "mm.2"}
    heads = vision["num_attention_heads"]
    breaks = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).token_to_id(BREAK)
    for name, array in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("model.")
        part, _, kind = name.rpartition(".")
        if name.startswith("vision_tower.transformer.layers."):
            index, _, inner = part[len("vision_tower.transformer.layers."):].partition(".")
            if inner in ("attention.q_proj", "attention.k_proj"):
                array = _llama_cpp_permute(array, heads)
            writer.add_tensor(f"v.blk.{index}.{layer[inner]}.{kind}", np.ascontiguousarray(array))
        elif part in rest:
            writer.add_tensor(f"{rest[part]}.{kind}", array)
        elif name.endswith("embed_tokens.weight"):
            writer.add_tensor("v.token_embd.img_break", np.ascontiguousarray(array[breaks]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_llama_gguf_and_its_pixtral_mmproj_serve_the_same_image_questions(mistral3, tmp_path):
    """The text model as llama.cpp's converter writes Mistral 3's (a `llama` GGUF) and the tower as its pixtral
    mmproj: the tower's config and tensors are the HF directory's (q and k rows back in halves), and image questions
    get transformers' greedy tokens (Pixtral 12B's projector, and mmprojs of neither kind: test_images_pixtral.py)."""
    from llm_serving.models.weights.vision import mmproj_checkpoint, vision_checkpoint
    from tests.families import write_gguf

    text, mmproj = write_gguf(None, mistral3, tmp_path / "mistral3.gguf"), tmp_path / "mmproj.gguf"
    write_mistral3_mmproj(mistral3, mmproj)
    cfg, tensors = mmproj_checkpoint(str(mmproj))
    hf_cfg, hf_tensors = vision_checkpoint(str(mistral3))
    assert cfg == dataclasses.replace(hf_cfg, image_token_id=None)       # (an mmproj has no token ids: the text's)
    assert sorted(tensors) == sorted(hf_tensors)
    for name, tensor in tensors.items():
        index = (slice(None),) * len(tensor.shape)
        np.testing.assert_array_equal(tensor.read(index), hf_tensors[name].read(index), err_msg=name)
    served_gguf_chats(mistral3, text, mmproj, tmp_path, MISTRAL3)
