"""Images in, Qwen2.5-VL (issue 67): the real server on a tiny random Qwen2_5_VLForConditionalGeneration that
transformers makes (tests/families.py's `make_qwen25_vl`: an image resized within 4 to 16 merged patches of 28
pixels, each one token; a windowed tower; a Qwen2 text model with multimodal RoPE). Image questions through OpenAI's
chat API get transformers' greedy tokens and log-probabilities (its forward with its PIL image processor's pixels,
the prompt its processor's expansion, its M-RoPE positions), with chunked prefill cutting between images, the prefix
cache and the encoded-image cache in play, decode runs after an image, and a text-only question too."""
from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from tests.families import greedy_with_logprobs, make_qwen25_vl, needs_transformers
from tests.integration.image_chats import chunked_image_args, png, send_chats, user_message
from tests.integration.server_harness import http, precision_gate, serving

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

NEW_TOKENS = 6
MODEL = "qwen-vl"
PAD = "<|image_pad|>"


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("qwen25vl")
    make_qwen25_vl(directory, seed=3)
    return directory


def _processed(path, images: list, max_pixels=None) -> dict:
    """transformers' PIL image processor on the images (PNG bytes): pixel_values and image_grid_thw (numpy);
    `max_pixels`: its bound lowered to that."""
    _, transformers = needs_transformers()
    from PIL import Image

    kind = getattr(transformers, "Qwen2VLImageProcessorPil", transformers.Qwen2VLImageProcessor)   # (5.x: 4.x)
    processor = kind.from_pretrained(str(path), **({} if max_pixels is None else {"max_pixels": max_pixels}))
    return processor(images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="np")


def _prompt_ids(path, turns: list, images: list, max_pixels=None) -> list:
    """The prompt transformers' Qwen2.5-VL processor makes (the template rendered by hand, each <|image_pad|> made as
    many as the image's grid of merged patches holds, the grid its PIL image processor's), tokenized by the
    tokenizers library: nothing of the server's own."""
    from tokenizers import Tokenizer

    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"
    parts = text.split(PAD)
    assert len(parts) == len(images) + 1
    grids = _processed(path, images, max_pixels)["image_grid_thw"].tolist() if images else []
    expanded = parts[0]
    for (t, gh, gw), part in zip(grids, parts[1:]):
        expanded += PAD * (t * gh * gw // 4) + part
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(expanded).ids


def _reference(path, ids: list, images: list, max_pixels=None) -> tuple:
    """transformers' greedy tokens after `ids` with `images` (PNG bytes), and each one's log-probability (the model
    its config.json's architecture: Qwen2.5-VL's or Qwen3-VL's): a whole forward per token (no cache: its M-RoPE positions made afresh from the ids and the images' grids each time)."""
    import json

    torch, transformers = needs_transformers()
    kind = getattr(transformers, json.loads((path / "config.json").read_text())["architectures"][0])
    model = kind.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    extra = {}
    if images:
        out = _processed(path, images, max_pixels)
        extra = {"pixel_values": torch.from_numpy(out["pixel_values"]),
                 "image_grid_thw": torch.from_numpy(out["image_grid_thw"])}
    image_id = model.config.image_token_id

    def logits(context: list):
        # (transformers 5.x computes M-RoPE positions only when told which tokens are an image's: the processor's
        # mm_token_type_ids, 1 at each <|image_pad|>)
        types = {"mm_token_type_ids": torch.tensor([[int(t == image_id) for t in context]])} if images else {}
        return model(input_ids=torch.tensor([context]), use_cache=False, **extra, **types).logits[0, -1]
    return greedy_with_logprobs(logits, ids, NEW_TOKENS)


def _body(messages: list) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": True}


IMAGE = f"<|vision_start|>{PAD}<|vision_end|>"


@dataclass(frozen=True)
class Kit:
    """What the served-chat checks need of a family whose image's tokens follow its size: how its template marks an
    image in a turn, transformers' prompt ids of turns with images ((path, turns, images) -> ids), and transformers'
    greedy tokens and log-probabilities after them ((path, ids, images) -> (tokens, logprobs))."""
    image: str
    prompt_ids: Callable
    reference: Callable


QWEN = Kit(IMAGE, _prompt_ids, _reference)


def check_replies(path, chats: list, replies: list, kit: Kit = QWEN) -> None:
    """Each reply (status, body) to chats' (messages, turns as the template renders them, images) is transformers'
    greedy tokens with their log-probabilities, its prompt as many tokens as transformers' processor makes."""
    from llm_serving.tokenization import load_tokenizer

    tok = load_tokenizer(str(path / "tokenizer.json"))
    for (_, turns, images), (status, body) in zip(chats, replies):
        assert status == 200, body
        ids = kit.prompt_ids(path, turns, images)
        assert body["usage"]["prompt_tokens"] == len(ids), turns
        want, want_lps = kit.reference(path, ids, images)
        assert body["choices"][0]["message"]["content"] == tok.decode(want), turns
        np.testing.assert_allclose([e["logprob"] for e in body["choices"][0]["logprobs"]["content"]], want_lps,
                                   atol=2e-3, err_msg=str(turns))


def served_image_chats(path, tmp_path, kit: Kit = QWEN) -> None:
    """Three image chats at once (a wide image, then text; a tall one and a small transparent one in one turn; the
    small one alone), a text-only chat, then a follow-up re-sending the first picture, to the tiny Qwen-VL model at
    `path`: chunked prefill in 16-token chunks (never inside an image), the prefix cache on 8-token blocks, the
    encoded-image cache. Each reply is transformers' (`check_replies`); the precision gate with two picture prompts
    passes (the reference's float64 tower on the captured patches, its text model placing them by their grids, every
    row within 0.5%); three images are encoded, each once (the follow-up's from the cache); /v1/models says images."""
    wide, tall, small = png(0, (40, 130, 3)), png(1, (120, 50, 3)), png(2, (30, 20, 4))
    image = kit.image
    chats = [  # (messages, the turns as the template renders them, their images in order)
        ([user_message("What is in this picture? Say it briefly.", wide)],
         [("user", f"What is in this picture? Say it briefly.{image}")], [wide]),
        ([user_message("Compare them:", tall, small)], [("user", f"Compare them:{image}{image}")], [tall, small]),
        ([user_message("What is it?", small)], [("user", f"What is it?{image}")], [small]),
        ([{"role": "user", "content": "Name three colors."}], [("user", "Name three colors.")], []),
    ]
    follow = [user_message("What is in this picture? Say it briefly.", wide), {"role": "assistant", "content": "a cat"},
              {"role": "user", "content": "Are you sure?"}]
    chats.append((follow, [("user", f"What is in this picture? Say it briefly.{image}"), ("assistant", "a cat"),
                           ("user", "Are you sure?")], [wide]))
    args = chunked_image_args(path, MODEL)
    with serving(args, tmp_path / "server.log") as server:
        first = asyncio.run(send_chats(server.url, [_body(m) for m, _, _ in chats[:4]]))
        last = asyncio.run(send_chats(server.url, [_body(chats[4][0])]))
        models = http("GET", server.url + "/v1/models")[1]
        log = (tmp_path / "server.log").read_text()
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("what is this\nname three colors\ndescribe it\n")
        (tmp_path / "gate").mkdir()
        proc, gate = precision_gate(server.url, tmp_path / "gate", "-n", "3", "--images", "2", "--max-new-tokens", "3",
                                    "--prompts", str(prompts))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (gate["image_prompts"], gate["images_encoded"]) == (2, 2) and gate["max_rel_error"] < 5e-3, gate
    check_replies(path, chats, first + last, kit)
    assert log.count(" encoded in ") == 3, log
    assert models["data"][0].get("input_modalities", ["text"]).count("image") == 1, models


def served_gguf_chats(path, text, mmproj, tmp_path, kit: Kit = QWEN) -> None:
    """Two image chats (one image; two in a turn) to the tiny Qwen-VL model at `path` served as the GGUF `text` with
    its `mmproj` beside it: each reply is transformers' (`check_replies`; images whose grids llama.cpp's bounds, 8
    to 4,096 tokens, leave as the tiny processor's)."""
    wide, square = png(1, (50, 120, 3)), png(4, (100, 100, 3))
    chats = [([user_message("What is it?", wide)], [("user", f"What is it?{kit.image}")], [wide]),
             ([user_message("Compare:", square, wide)], [("user", f"Compare:{kit.image}{kit.image}")], [square, wide])]
    args = ["--model", str(text), "--set", f"model_config.mmproj={mmproj}", "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=256", "--set", "pa_config.kv_cache_dtype=float32"]
    with serving(args, tmp_path / "server.log") as server:
        replies = asyncio.run(send_chats(server.url, [_body(m) for m, _, _ in chats]))
    check_replies(path, chats, replies, kit)


def test_qwen_vl_image_questions_get_transformers_tokens_and_logprobs(qwen_vl, tmp_path):
    """Image chats to a tiny Qwen2.5-VL (`served_image_chats`): each reply is transformers' greedy tokens with their
    log-probabilities (its M-RoPE positions: the image's tokens by their row and column, the text after an image
    from the grid's larger side), with chunked prefill, the prefix cache and the encoded-image cache in play; the
    precision gate with picture prompts passes."""
    served_image_chats(qwen_vl, tmp_path)


def test_an_image_past_the_agents_largest_call_is_made_smaller_and_a_bad_one_is_a_400(qwen_vl, tmp_path):
    """Graph calls of 8 tokens at most: an image of 16 tokens by the processor's bounds is resized within 8 tokens'
    pixels (the processor's max_pixels lowered: transformers' answer for that bound), and an image too narrow for
    the grid (its long edge 300 times its short one) is a 400 naming it while the server goes on serving."""
    from llm_serving.tokenization import load_tokenizer

    big = png(4, (100, 100, 3))
    args = ["--model", str(qwen_vl), "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=128", "--set", "model_config.seq_length=[8]",
            "--set", "serving_config.max_num_batched_tokens=8", "--set", "serving_config.max_num_seqs=4",
            "--set", "scheduler_config.chunked_prefill=true",
            "--set", "scheduler_config.max_chunk_tokens=8", "--set", "pa_config.kv_cache_dtype=float32"]
    with serving(args, tmp_path / "server.log") as server:
        status, body = http("POST", server.url + "/v1/chat/completions", _body([user_message("What is it?", big)]))
        narrow_status, narrow = http("POST", server.url + "/v1/chat/completions",
                                     _body([user_message("And this?", png(5, (1, 300, 3)))]))
        again = http("POST", server.url + "/v1/chat/completions", _body([user_message("What is it?", big)]))
    assert status == 200, body
    turns = [("user", f"What is it?{IMAGE}")]
    assert len(_prompt_ids(qwen_vl, turns, [big])) == body["usage"]["prompt_tokens"] + 16 - 4   # 4 tokens, not 16
    ids = _prompt_ids(qwen_vl, turns, [big], max_pixels=8 * 28 * 28)
    assert body["usage"]["prompt_tokens"] == len(ids)
    want, want_lps = _reference(qwen_vl, ids, [big], max_pixels=8 * 28 * 28)
    assert body["choices"][0]["message"]["content"] == load_tokenizer(str(qwen_vl / "tokenizer.json")).decode(want)
    assert narrow_status == 400 and "image 1 of 1" in narrow["error"]["message"], narrow
    assert again[0] == 200 and again[1]["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


def write_qwen_mmproj(hf_dir, path):
    """The mmproj GGUF llama.cpp's `convert_hf_to_gguf.py --mmproj --outtype f32` writes of a Qwen2.5-VL (projector
    type qwen2.5vl_merger: q, k and v apart, the 3-D patch kernel as two 2-D ones `v.patch_embd.weight` and
    `.weight.1`, the merger's norm `v.post_ln`, its MLP `mm.0` and `mm.2`; `n_wa_pattern` for the full-attention
    layers), checked name by name and value by value against the converter's own file of make_qwen25_vl's model.
    One key more than the converter writes: `clip.vision.window_size`, which llama.cpp reads where it is given and
    takes as 112 (every Qwen2.5-VL's) where it is not: the tiny model's windows are 56 pixels."""
    import json

    import gguf

    config = json.loads((hf_dir / "config.json").read_text())
    vision = config["vision_config"]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "qwen2.5vl_merger")
    for key, value in (("projection_dim", vision["out_hidden_size"]), ("image_size", 560),
                       ("patch_size", vision["patch_size"]), ("embedding_length", vision["hidden_size"]),
                       ("feed_forward_length", vision["intermediate_size"]), ("block_count", vision["depth"]),
                       ("attention.head_count", vision["num_heads"]),
                       ("n_wa_pattern", vision["fullatt_block_indexes"][0] + 1),
                       ("window_size", vision["window_size"])):
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_bool("clip.use_silu", True)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
    writer.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
    add_qwen_vl_tensors(writer, hf_dir, {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out",
                                         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                                         "mlp.down_proj": "ffn_down"})


def add_qwen_vl_tensors(writer, hf_dir, layer: dict) -> None:
    """The tower's tensors of a Qwen2-VL or Qwen2.5-VL directory as the converter's Qwen2VLVisionModel writes them
    (q, k and v apart, the 3-D patch kernel as two 2-D ones, the merger's `ln_q` as `v.post_ln`, its MLP `mm.0` and
    `mm.2`; a block's other parts by `layer`: our name -> the converter's), then the file written and closed."""
    from safetensors.numpy import load_file

    for name, array in load_file(str(hf_dir / "model.safetensors")).items():
        name = name.removeprefix("model.")
        if name.startswith("visual.blocks."):
            index, _, rest = name[len("visual.blocks."):].partition(".")
            part, _, kind = rest.rpartition(".")
            if part == "attn.qkv":
                for k, piece in enumerate(np.split(array, 3, 0)):
                    writer.add_tensor(f"v.blk.{index}.attn_{'qkv'[k]}.{kind}", np.ascontiguousarray(piece))
                continue
            writer.add_tensor(f"v.blk.{index}.{layer[part]}.{kind}", array)
        elif name == "visual.patch_embed.proj.weight":
            writer.add_tensor("v.patch_embd.weight", np.ascontiguousarray(array[:, :, 0]))
            writer.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(array[:, :, 1]))
        elif name.startswith("visual.merger."):
            writer.add_tensor(name.replace("visual.merger.ln_q.", "v.post_ln.").replace("visual.merger.mlp.", "mm."),
                              array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_and_its_mmproj_serve_the_same_image_questions(qwen_vl, tmp_path):
    """The text model as llama.cpp's `qwen2vl` GGUF (its M-RoPE sections in `rope.dimension_sections`) and the tower
    as its qwen2.5vl_merger mmproj: the tower's tensors are the HF directory's, and image questions get transformers'
    greedy tokens (images whose grids llama.cpp's bounds, 8 to 4,096 tokens, leave as the tiny processor's)."""
    from llm_serving.models.weights import load_llama_weights
    from llm_serving.models.weights.vision import mmproj_checkpoint, vision_checkpoint
    from tests.families import write_gguf

    text, mmproj = write_gguf(None, qwen_vl, tmp_path / "qwen-vl.gguf"), tmp_path / "mmproj.gguf"
    write_qwen_mmproj(qwen_vl, mmproj)
    cfg, tensors = mmproj_checkpoint(str(mmproj))
    hf_cfg, hf_tensors = vision_checkpoint(str(qwen_vl))
    assert cfg.fullatt_block_indexes == hf_cfg.fullatt_block_indexes and cfg.window_size == hf_cfg.window_size
    assert sorted(tensors) == sorted(hf_tensors)
    for name, tensor in tensors.items():
        index = (slice(None),) * len(tensor.shape)
        np.testing.assert_array_equal(tensor.read(index), hf_tensors[name].read(index), err_msg=name)
    assert load_llama_weights(str(text))[0].mrope_section == (2, 3, 3)
    served_gguf_chats(qwen_vl, text, mmproj, tmp_path)          # (2 x 4 and 4 x 4 tokens either way)


def test_the_float64_reference_places_images_as_transformers_does(qwen_vl):
    """The precision gate's float64 text model (reference_llama.py) with transformers' own image features in place
    of two images' placeholders: its logits at every token, fed in three calls (text and the first image; the
    second image; a token after), are transformers' float64 forward's, M-RoPE positions and all."""
    torch, transformers = needs_transformers()
    from llm_serving.reference_llama import ReferenceLlama

    wide, square = png(1, (50, 120, 3)), png(4, (100, 100, 3))
    ids = _prompt_ids(qwen_vl, [("user", f"Compare:{IMAGE} and{IMAGE} now")], [wide, square])
    out = _processed(qwen_vl, [wide, square])
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(qwen_vl), dtype=torch.float64, attn_implementation="eager").eval()
    image_id = model.config.image_token_id
    pixels, grid = torch.from_numpy(out["pixel_values"]).double(), torch.from_numpy(out["image_grid_thw"])
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid, use_cache=False,
                     mm_token_type_ids=torch.tensor([[int(t == image_id) for t in ids]])).logits[0].numpy()
        features = model.model.get_image_features(pixels, grid)
    features = getattr(features, "pooler_output", features)
    rows = [np.asarray(f, np.float64) for f in (features if isinstance(features, (list, tuple)) else
                                                torch.split(features, [int(g.prod()) // 4 for g in grid]))]
    runs = [k for k in range(len(ids)) if ids[k] == image_id and (k == 0 or ids[k - 1] != image_id)]
    grids = [(int(g[1]) // 2, int(g[2]) // 2) for g in grid]
    ref = ReferenceLlama(str(qwen_vl))
    seq = ref.new_sequence()
    cut = runs[1] - 1                       # the first call: up to the token before the second image
    got = [ref.forward(seq, ids[:cut], 0, [(runs[0], rows[0], False, grids[0])]),
           ref.forward(seq, ids[cut:-1], cut, [(runs[1] - cut, rows[1], False, grids[1])]),
           ref.forward(seq, ids[-1:], len(ids) - 1)]
    relative = lambda a: float(np.abs(a - want).max() / np.abs(want).max())       # noqa: E731
    # (transformers turns float64 queries by float32 angles: ~1e-7 apart, as the other families' reference tests)
    assert relative(np.concatenate(got)) < 2e-6
    # the images' tokens placed as text (no grid) are another model: the test can tell
    plain = ref.forward(ref.new_sequence(), ids, 0, [(runs[0], rows[0], False), (runs[1], rows[1], False)])
    assert relative(plain) > 1e-3
