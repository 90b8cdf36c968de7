"""Images in, Pixtral 12B (issue 67): the real server on a tiny random LlavaForConditionalGeneration of Pixtral 12B's
kind that transformers makes (tests/families.py's `make_pixtral`: Mistral 3's Pixtral tower with each 8-pixel patch a
token, LLaVA's projector, an image's longest edge at most 48 pixels, a Mistral text model). Its prompt puts an image as
Mistral 3's does: rows of [IMG], each ended by [IMG_BREAK] and the last by [IMG_END]. Image questions through OpenAI's
chat API, from the HF directory and from a `llama` GGUF with llama.cpp's pixtral mmproj beside it, get transformers'
greedy tokens and log-probabilities; the served tower and the float64 reference are transformers'. The checks are
test_images_mistral3.py's, given this model."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from tests.families import make_pixtral, needs_transformers
from tests.integration.test_images_mistral3 import MISTRAL3, tower_matches_transformers, write_mistral3_mmproj
from tests.integration.test_images_qwen import served_gguf_chats, served_image_chats

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")


@pytest.fixture(scope="module")
def pixtral(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("pixtral")
    make_pixtral(directory, seed=11)
    return directory


def test_pixtral_12b_image_questions_get_transformers_tokens_and_logprobs(pixtral, tmp_path):
    """Image chats to a tiny Pixtral 12B (test_images_qwen.py's `served_image_chats`): each reply is transformers'
    greedy tokens with their log-probabilities, every patch a token between the row breaks, with chunked prefill, the
    prefix cache and the encoded-image cache in play; the precision gate with picture prompts passes."""
    served_image_chats(pixtral, tmp_path, MISTRAL3)


def test_the_tower_and_the_float64_reference_are_transformers(pixtral):
    """The served tower (MindSpore's ops, the CPU kernels' float32 and int16 products) and the float64 reference on
    the processor's patches: within float32's (int16's) reach of transformers' float64 image features, LLaVA's
    projector on every patch."""
    tower_matches_transformers(pixtral)


def test_a_llama_gguf_and_its_pixtral_mmproj_serve_the_same_image_questions(pixtral, tmp_path):
    """The text model as llama.cpp's converter writes it (a `llama` GGUF) and the tower as its pixtral mmproj without
    a projector norm, patch merger or merge size: the tower's config and tensors are the HF directory's, and image
    questions get transformers' greedy tokens. A pixtral mmproj with a merge but no patch merger, or with the norm
    and not the merger, is refused naming what it lacks."""
    import gguf

    from llm_serving.models.weights.common import WeightLoadError
    from llm_serving.models.weights.vision import mmproj_checkpoint, vision_checkpoint
    from tests.families import edited_gguf, write_gguf

    text, mmproj = write_gguf(None, pixtral, tmp_path / "pixtral.gguf"), tmp_path / "mmproj.gguf"
    write_mistral3_mmproj(pixtral, mmproj)
    fields = {f.name for f in gguf.GGUFReader(str(mmproj)).fields.values()}
    assert "clip.vision.spatial_merge_size" not in fields
    cfg, tensors = mmproj_checkpoint(str(mmproj))
    hf_cfg, hf_tensors = vision_checkpoint(str(pixtral))
    assert cfg == dataclasses.replace(hf_cfg, image_token_id=None)       # (an mmproj has no token ids: the text's)
    assert not cfg.patch_merger and cfg.spatial_merge_size == 1
    assert sorted(tensors) == sorted(hf_tensors)
    for name, tensor in tensors.items():
        index = (slice(None),) * len(tensor.shape)
        np.testing.assert_array_equal(tensor.read(index), hf_tensors[name].read(index), err_msg=name)
    served_gguf_chats(pixtral, text, mmproj, tmp_path, MISTRAL3)

    width = json.loads((pixtral / "config.json").read_text())["vision_config"]["hidden_size"]
    edited_gguf(mmproj, tmp_path / "merge.gguf", fields={"clip.vision.spatial_merge_size": 2})
    edited_gguf(mmproj, tmp_path / "norm.gguf", tensors={"mm.input_norm.weight": np.ones(width, np.float32)})
    with pytest.raises(WeightLoadError, match="without mm.input_norm.weight and mm.patch_merger.weight, with "
                                              "spatial_merge_size 2"):
        mmproj_checkpoint(str(tmp_path / "merge.gguf"))
    with pytest.raises(WeightLoadError, match="without mm.patch_merger.weight"):
        mmproj_checkpoint(str(tmp_path / "norm.gguf"))
