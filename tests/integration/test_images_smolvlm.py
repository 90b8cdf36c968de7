"""Images in, a family whose image grid varies with the image (issue 67): the real server on a tiny random
SmolVLMForConditionalGeneration that transformers makes (tests/families.py's `make_smolvlm`: an image resized to a
64-pixel longest edge, cut into up to 2 x 2 tiles of 32 pixels plus the whole image, each frame 4 tokens after the
pixel shuffle, a Llama text model). Image questions through OpenAI's chat API get transformers' greedy tokens and
log-probabilities (its forward with its PIL image processor's pixels, the prompt its SmolVLM processor's expansion),
with chunked prefill cutting between frames, the prefix cache and the encoded-frame cache in play; the frames and the
tower on their own equal transformers'."""
from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

from tests.families import SMOLVLM_IMAGE_TOKENS, greedy_with_logprobs, make_smolvlm, needs_transformers
from tests.integration.image_chats import chunked_image_args, png, send_chats, user_message
from tests.integration.server_harness import http, precision_gate, serving

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

NEW_TOKENS = 6
MODEL = "smolvlm"
FAKE, IMAGE, GLOBAL = SMOLVLM_IMAGE_TOKENS[:3]
IMAGE_ID = 4                    # the tiny tokenizer's <image> (after the three ChatML specials and the fake token)


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("smolvlm")
    make_smolvlm(directory, seed=3)
    return directory


def _processor(path):
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    return SmolVLMImageProcessorPil.from_pretrained(str(path))


def _prompt_ids(path, turns: list, images: list) -> list:
    """The prompt transformers' SmolVLM processor makes (the template rendered by hand, each <image> mark made the
    image's tiles and global frame by its `get_image_prompt_string`, the grid its PIL image processor's), tokenized
    by the tokenizers library: nothing of the server's own."""
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns) + "<|im_start|>assistant\n"
    out = _processor(path)(images=[[Image.open(io.BytesIO(d)) for d in images]], return_row_col_info=True)
    parts = text.split(IMAGE)
    assert len(parts) == len(images) + 1
    expanded = parts[0]
    for rows, cols, part in zip(out["rows"][0], out["cols"][0], parts[1:]):
        expanded += get_image_prompt_string(rows, cols, 4, FAKE, IMAGE, GLOBAL) + part
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(expanded).ids


def _reference(path, ids: list, images: list) -> tuple:
    """transformers' greedy tokens after `ids` with `images` (PNG bytes), and each one's log-probability: a whole
    forward per token (no cache), the frames' pixels and their mask from its PIL image processor."""
    torch, transformers = needs_transformers()
    from PIL import Image

    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                                         attn_implementation="eager").eval()
    out = _processor(path)(images=[[Image.open(io.BytesIO(d)) for d in images]], return_tensors="np")
    pixels, mask = torch.from_numpy(out["pixel_values"]), torch.from_numpy(out["pixel_attention_mask"])
    return greedy_with_logprobs(lambda context: model(input_ids=torch.tensor([context]), pixel_values=pixels,
                                                      pixel_attention_mask=mask, use_cache=False).logits[0, -1],
                                ids, NEW_TOKENS)


def _body(messages: list) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": True}


def test_frames_and_tower_are_transformers(smolvlm):
    """Our frames (vision/images.py) are its PIL image processor's pixels, tile by tile and the global frame, for
    wide, tall, small and transparent images; the tower's tokens for them are `get_image_features`'s."""
    torch, transformers = needs_transformers()
    from PIL import Image

    from llm_serving.models.mindspore_env import setup_mindspore
    from llm_serving.models.runner.kernels import build_vision_kernels
    from llm_serving.models.vision_tower import VisionTower
    from llm_serving.models.weights.vision import vision_checkpoint
    from llm_serving.vision import ImageSpec, decode, frames

    spec = ImageSpec.from_dir(str(smolvlm))
    processor = _processor(smolvlm)
    setup_mindspore("CPU", 0, None, None)
    cfg, weights = vision_checkpoint(str(smolvlm))
    assert (cfg.projector, cfg.tokens_per_image, cfg.bidirectional) == ("shuffle", 4, False)
    tower = VisionTower(cfg, weights, kernels=build_vision_kernels("CPU", "on"), threads=2)
    model = transformers.SmolVLMForConditionalGeneration.from_pretrained(str(smolvlm)).eval()
    counts = []
    for seed, shape in enumerate([(50, 70, 3), (100, 10, 3), (20, 30, 4), (31, 65, 3)]):
        data = png(seed, shape)
        ours = np.stack(frames(decode(data), spec))
        theirs = processor(images=[[Image.open(io.BytesIO(data))]], return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
        counts.append(len(ours))
        with torch.no_grad():
            want = model.model.get_image_features(torch.from_numpy(theirs[None])).pooler_output[0].numpy()
        got = tower.encode(ours).reshape(want.shape)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    assert counts == [5, 3, 5, 3]          # 2 x 2 tiles, 2 x 1, 2 x 2 (upscaled), 1 x 2; each with its global frame


def test_smolvlm_image_questions_get_transformers_tokens_and_logprobs(smolvlm, tmp_path):
    """Three image chats at once and a follow-up after: a wide image (2 x 2 tiles), a tall one (2 x 1) with a
    transparent small one (2 x 2, upscaled), chunked prefill in 16-token chunks (cut between frames, never inside
    one), the prefix cache on 8-token blocks and the encoded-frame cache: each reply is transformers' greedy tokens,
    with their log-probabilities, and its prompt as many tokens as transformers' processor makes; then the precision
    gate with picture prompts passes."""
    from llm_serving.tokenization import load_tokenizer

    wide, tall, small = png(0, (50, 70, 3)), png(1, (100, 10, 3)), png(2, (20, 30, 4))
    chats = [  # (messages, the turns as the template renders them, their images in order)
        ([user_message("What is in this picture?", wide)], [("user", "What is in this picture?<image>")], [wide]),
        ([user_message("Compare them:", tall, small)], [("user", "Compare them:<image><image>")], [tall, small]),
        ([user_message("What is in this picture?", small)], [("user", "What is in this picture?<image>")], [small]),
    ]
    follow = [user_message("What is in this picture?", wide), {"role": "assistant", "content": "a cat"},
              {"role": "user", "content": "Are you sure?"}]
    chats.append((follow, [("user", "What is in this picture?<image>"), ("assistant", "a cat"),
                           ("user", "Are you sure?")], [wide]))
    tok = load_tokenizer(str(smolvlm / "tokenizer.json"))
    args = chunked_image_args(smolvlm, MODEL)
    with serving(args, tmp_path / "server.log") as server:
        first = asyncio.run(send_chats(server.url, [_body(m) for m, _, _ in chats[:3]]))
        last = asyncio.run(send_chats(server.url, [_body(chats[3][0])]))
        models = http("GET", server.url + "/v1/models")[1]
        log = (tmp_path / "server.log").read_text()
        # the precision gate with two picture prompts (each 4 + 1 frames, causal): the reference's float64 tower on
        # the captured frames, every row within 0.5%
        prompts = tmp_path / "prompts.txt"
        prompts.write_text("what is this\nname three colors\ndescribe it\n")
        (tmp_path / "gate").mkdir()
        proc, gate = precision_gate(server.url, tmp_path / "gate", "-n", "3", "--images", "2", "--max-new-tokens", "3",
                                    "--prompts", str(prompts))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (gate["image_prompts"], gate["images_encoded"]) == (2, 10) and gate["max_rel_error"] < 5e-3, gate
    for (messages, turns, images), (status, body) in zip(chats, first + last):
        assert status == 200, body
        ids = _prompt_ids(smolvlm, turns, images)
        assert body["usage"]["prompt_tokens"] == len(ids)
        want, want_lps = _reference(smolvlm, ids, images)
        assert body["choices"][0]["message"]["content"] == tok.decode(want), turns
        got_lps = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-3, err_msg=str(turns))
    # 13 frames of three images, each encoded once (the follow-up's wide image came from the cache)
    assert log.count(" encoded in ") == 5 + 3 + 5, log
    assert models["data"][0].get("input_modalities", ["text"]).count("image") == 1, models


def test_an_mmproj_gguf_reads_the_same_smolvlm(smolvlm, tmp_path):
    """llama.cpp's idefics3 mmproj layout (tests/integration/test_vision_tower.py's `write_mmproj`): the same tower
    config, the tower's tokens equal the HF directory's but for the projection's F16 rounding, and the same image
    facts (the tiling from `clip.vision.preproc_image_size`, the tokens from the text model's vocabulary)."""
    import dataclasses

    from llm_serving.models.mindspore_env import setup_mindspore
    from llm_serving.models.vision_tower import VisionTower
    from llm_serving.models.weights.vision import mmproj_checkpoint, vision_checkpoint
    from llm_serving.tokenization import load_tokenizer
    from llm_serving.vision import image_facts
    from tests.integration.test_vision_tower import write_mmproj

    write_mmproj(smolvlm, tmp_path / "mmproj.gguf")
    setup_mindspore("CPU", 0, None, None)
    cfg, weights = mmproj_checkpoint(str(tmp_path / "mmproj.gguf"))
    hf_cfg, hf_weights = vision_checkpoint(str(smolvlm))
    assert cfg == dataclasses.replace(hf_cfg, image_token_id=None, layer_norm_eps=cfg.layer_norm_eps)
    pixels = np.random.default_rng(3).standard_normal((3, 3, 32, 32)).astype(np.float32)
    theirs = VisionTower(hf_cfg, hf_weights).encode(pixels)
    ours = VisionTower(cfg, weights).encode(pixels)
    np.testing.assert_allclose(ours, theirs, atol=2e-3 * np.abs(theirs).max())
    tokenizer = load_tokenizer(str(smolvlm / "tokenizer.json"))
    assert image_facts("model.gguf", str(tmp_path / "mmproj.gguf"), tokenizer) == image_facts(str(smolvlm), None,
                                                                                               tokenizer)
