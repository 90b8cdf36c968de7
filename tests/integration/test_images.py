"""Images in, end to end (issue 67): the real server on a tiny random Gemma3ForConditionalGeneration that transformers
makes (tests/families.py's `make_gemma3_vl`), image questions through OpenAI's chat API, each reply's greedy tokens
and their log-probabilities transformers' own (its forward with the pixels and the image tokens' bidirectional mask,
`token_type_ids`), with chunked prefill cutting around an image, the prefix cache and the encoded-image cache in play;
the bad images refused with a 400 that says why, and the server serving on."""
from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest

from tests.families import greedy_with_logprobs, make_gemma3_vl, needs_transformers, vision_prompt_ids
from tests.integration.image_chats import chunked_image_args, data_url, png, send_chats, user_message
from tests.integration.server_harness import http, serving

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

NEW_TOKENS = 6
MODEL = "gemma3-vl"            # the served name (--set model_config.model_name)
BOI, IMAGE = 3, 5              # the tiny model's <start_of_image> and <image_soft_token> ids


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("gemma3_vl")
    make_gemma3_vl(directory, seed=6)                  # (a seed whose replies differ by image)
    return directory


def _reference(path, ids: list, images: list) -> tuple:
    """transformers' greedy tokens after `ids` with `images` (PNG bytes), and each one's log-probability: a whole
    forward per token (no cache), the images' pixels from its Gemma 3 processor, token_type_ids marking the image
    tokens (their attention among themselves bidirectional)."""
    torch, transformers = needs_transformers()
    from PIL import Image

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                                        attn_implementation="eager").eval()
    processor = transformers.Gemma3ImageProcessor.from_pretrained(str(path))
    pixels = torch.from_numpy(processor(images=[Image.open(io.BytesIO(d)) for d in images],
                                        return_tensors="np")["pixel_values"])

    def last_logits(context: list):
        x = torch.tensor([context])
        return model(input_ids=x, pixel_values=pixels, token_type_ids=(x == IMAGE).long(),
                     use_cache=False).logits[0, -1]
    return greedy_with_logprobs(last_logits, ids, NEW_TOKENS)


def _body(messages: list) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
            "logprobs": True}


def test_image_questions_get_transformers_tokens_and_logprobs(vl_model, tmp_path):
    """Four image chats at once and one after, chunked prefill in 16-token chunks (an image's placeholders at 29-34
    would be cut at 32: the chunk ends before the image instead), the prefix cache on 8-token blocks (the repeated
    image's conversation reuses its blocks, another image's never) and the encoded-image cache (the repeated image is
    not encoded again): each reply is transformers' greedy tokens, with their log-probabilities."""
    from llm_serving.tokenization import load_tokenizer

    a, b, c = png(0), png(1), png(2, (30, 20, 4))
    chats = [  # (messages, the turns as the template renders them, their images in order)
        ([user_message("What is in this picture?", a)], [("user", "What is in this picture?<start_of_image>")], [a]),
        ([user_message("What is in this picture?", b)], [("user", "What is in this picture?<start_of_image>")], [b]),
        ([user_message("Compare them:", a, c)], [("user", "Compare them:<start_of_image><start_of_image>")], [a, c]),
        ([user_message("Describe", c, image_first=True)], [("user", "<start_of_image>Describe")], [c]),
    ]
    follow = [user_message("What is in this picture?", a), {"role": "assistant", "content": "a cat"},
              {"role": "user", "content": "Are you sure?"}]
    chats.append((follow, [("user", "What is in this picture?<start_of_image>"), ("assistant", "a cat"),
                           ("user", "Are you sure?")], [a]))
    tok = load_tokenizer(str(vl_model / "tokenizer.json"))
    args = chunked_image_args(vl_model, MODEL, 128)
    with serving(args, tmp_path / "server.log") as server:
        first = asyncio.run(send_chats(server.url, [_body(m) for m, _, _ in chats[:4]]))
        last = asyncio.run(send_chats(server.url, [_body(chats[4][0])]))
        stats = http("GET", server.url + "/stats")[1]
        log = (tmp_path / "server.log").read_text()
    for (messages, turns, images), (status, body) in zip(chats, first + last):
        assert status == 200, body
        ids = vision_prompt_ids(vl_model, turns)
        assert ids.count(IMAGE) == 4 * len(images)
        assert body["usage"]["prompt_tokens"] == len(ids)
        want, want_lps = _reference(vl_model, ids, images)
        assert body["choices"][0]["message"]["content"] == tok.decode(want), turns
        got_lps = [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-3, err_msg=str(turns))
    # the three images were each encoded once (the fifth chat's image a came from the cache)
    assert log.count(" encoded in ") == 3, log
    assert stats["prefix_cache_hit_rate"] > 0, stats
    # an image changes the reply: a and b gave other log-probabilities
    lps = [[e["logprob"] for e in r[1]["choices"][0]["logprobs"]["content"]] for r in first[:2]]
    assert np.abs(np.subtract(*lps)).max() > 5 * 2e-3, lps           # (five times the match's tolerance)


def test_an_image_beside_a_stream_is_encoded_ahead_in_the_stream_s_steps(vl_model, tmp_path):
    """A text stream decodes; an image question comes while it streams: its tower runs ahead of its prefill a layer a
    step (scheduler_config.image_encode_ms=1: at least one layer, no more) in the stream's steps, instead of whole in
    one prefill step that the stream would wait for. The image's reply is transformers' greedy tokens with their
    log-probabilities, the stream's text is what it gets alone, and /stats counts the steps that encoded ahead."""
    import aiohttp

    from llm_serving.tokenization import load_tokenizer

    a = png(3)
    text = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 90,
            "temperature": 0, "ignore_eos": True}
    args = ["--model", str(vl_model), "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=128", "--set", "scheduler_config.image_encode_ms=1",
            "--set", "scheduler_config.decode_steps=1", "--set", "pa_config.kv_cache_dtype=float32"]

    async def beside(url: str) -> tuple:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async def stream() -> str:
                pieces = []
                async with session.post(url + "/v1/chat/completions", json={**text, "stream": True}) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        line = line.decode().strip()
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                        if delta:
                            pieces.append(delta)
                            if len(pieces) == 3:
                                started.set()
                return "".join(pieces)

            async def ask() -> dict:
                await started.wait()                 # (the stream is decoding)
                async with session.post(url + "/v1/chat/completions",
                                        json=_body([user_message("What is in this picture?", a)])) as r:
                    assert r.status == 200, await r.text()
                    return await r.json()
            started = asyncio.Event()
            return await asyncio.gather(stream(), ask())

    with serving(args, tmp_path / "server.log") as server:
        status, alone = http("POST", server.url + "/v1/chat/completions", text)
        assert status == 200, alone
        streamed, answer = asyncio.run(beside(server.url))
        stats = http("GET", server.url + "/stats")[1]
        log = (tmp_path / "server.log").read_text()
    assert streamed == alone["choices"][0]["message"]["content"]
    ids = vision_prompt_ids(vl_model, [("user", "What is in this picture?<start_of_image>")])
    want, want_lps = _reference(vl_model, ids, [a])
    assert answer["choices"][0]["message"]["content"] == load_tokenizer(str(vl_model / "tokenizer.json")).decode(want)
    np.testing.assert_allclose([e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]], want_lps,
                               atol=2e-3)
    # the tiny tower's 2 layers ran in 2 steps ahead of the prefill step, which added the projector
    assert stats["image_encode_ahead_steps"] == 2, stats
    assert log.count(" encoded in ") == 1 and "(over 3 steps: 2 of 2 layers ahead)" in log, log


def test_the_precision_gate_covers_image_prompts(vl_model, tmp_path):
    """`llm-serving precision --images`: image prompts through the chat API, chunked prefill cutting around the
    images, the captured pixels through the float64 reference tower (reference_vision.py): every row within the
    gate's 0.5%; against a reference whose projector is another (x 1.5), the gate fails: the tower is checked."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from tests.integration.server_harness import precision_gate

    altered = tmp_path / "altered"
    shutil.copytree(vl_model, altered)
    tensors = load_file(str(altered / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("mm_input_projection_weight"))
    save_file({**tensors, name: tensors[name] * 1.5}, str(altered / "model.safetensors"), metadata={"format": "pt"})
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("what is this\nname three colors\ndescribe it\ncount to five\n")
    args = ["--model", str(vl_model), "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=128", "--set", "pa_config.block_size=8",
            "--set", "scheduler_config.chunked_prefill=true", "--set", "scheduler_config.max_chunk_tokens=16",
            "--set", "serving_config.max_num_batched_tokens=32", "--set", "serving_config.max_num_seqs=8",
            "--set", "scheduler_config.enable_prefix_caching=true"]
    gate = ["-n", "4", "--images", "2", "--max-new-tokens", "4", "--prompts", str(prompts)]
    (tmp_path / "altered_run").mkdir()
    with serving(args, tmp_path / "server.log") as server:
        proc, result = precision_gate(server.url, tmp_path, *gate)
        failed, other = precision_gate(server.url, tmp_path / "altered_run", *gate, "--model", str(altered),
                                       "--image-seed", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (result["image_prompts"], result["images_encoded"]) == (2, 2), result
    assert result["max_rel_error"] < 5e-3 and result["greedy_agreement"] == 1.0, result
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert other["images_encoded"] == 2 and other["max_rel_error"] > 5e-3, other


def test_bad_images_are_refused_by_name_and_every_api_carries_an_image(vl_model, tmp_path):
    """Each bad image is a 400 that says what is wrong with it; a good request after them is answered, and the same
    image question through OpenAI's chat and Responses, Anthropic's Messages and Ollama's chat and generate gets the
    same reply, and so does TGI's generate with a markdown image in its raw prompt; /v1/models and /api/show say the
    model takes images."""
    good = png(0)
    truncated = good[:len(good) // 2]
    cases = [
        (_body([user_message("x", b"not an image at all")]), "not an image"),
        (_body([user_message("x", truncated)]), "image 1 of 1"),
        (_body([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]),
         "data: URL"),
        (_body([{"role": "user", "content": [{"type": "image_url", "image_url": "data:text/plain;base64,aGk="}]}]),
         "not an image"),
        (_body([user_message("x", good, good, good)]), "at most 2"),
        (_body([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": data_url(good)}}]}]), "user messages"),
        (_body([user_message("x", png(4, (700, 700, 3)))]), "max_image_bytes"),
        ({"inputs": "x ![](data:text/plain;base64,aGk=)", "route": "/generate"}, "not an image"),
        ({"inputs": "x ![](https://example.com/a.png)", "route": "/generate"}, "data: URL"),
        ({"inputs": "spelled <image_soft_token><image_soft_token>", "route": "/generate"}, "but no image"),
        (_body([{"role": "user", "content": "spelled <image_soft_token>"}]), "1 image placeholder tokens"),
    ]
    args = ["--model", str(vl_model), "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=128", "--set", "serving_config.max_images=2", "--set", "serving_config.max_image_bytes=1000000"]
    with serving(args, tmp_path / "server.log") as server:
        for body, says in cases:
            status, reply = http("POST", server.url + body.pop("route", "/v1/chat/completions"), body)
            assert status == 400, (says, reply)
            assert says in json.dumps(reply), (says, reply)
        status, reply = http("POST", server.url + "/v1/chat/completions", _body([user_message("x", good)]))
        assert status == 200, reply
        assert reply["usage"]["completion_tokens"] == NEW_TOKENS
        # every API that carries an image: the same question gets the same reply (Ollama's images come before the
        # text, as its templates place them)
        b64 = base64.b64encode(good).decode()
        replies = {}
        for name, path, body, pick in [
            ("openai", "/v1/chat/completions", _body([user_message("What is it?", good)]),
             lambda r: r["choices"][0]["message"]["content"]),
            ("openai first", "/v1/chat/completions", _body([user_message("What is it?", good, image_first=True)]),
             lambda r: r["choices"][0]["message"]["content"]),
            ("anthropic", "/v1/messages", {"model": MODEL, "max_tokens": NEW_TOKENS, "temperature": 0, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image", "source": {
                    "type": "base64", "media_type": "image/png", "data": b64}}]}]}, lambda r: r["content"][0]["text"]),
            ("responses", "/v1/responses", {"model": MODEL, "max_output_tokens": NEW_TOKENS, "temperature": 0,
                                            "input": [{"role": "user", "content": [
                                                {"type": "input_text", "text": "What is it?"},
                                                {"type": "input_image", "image_url": data_url(good)}]}]},
             lambda r: r["output"][-1]["content"][0]["text"]),
            ("ollama chat", "/api/chat", {"model": MODEL, "stream": False, "options": {
                "temperature": 0, "num_predict": NEW_TOKENS}, "messages": [
                {"role": "user", "content": "What is it?", "images": [b64]}]}, lambda r: r["message"]["content"]),
            ("ollama generate", "/api/generate", {"model": MODEL, "stream": False, "prompt": "What is it?",
                                                  "images": [b64], "options": {"temperature": 0,
                                                                               "num_predict": NEW_TOKENS}},
             lambda r: r["response"]),
            ("tgi generate", f"/models/{MODEL}/generate", {  # (TGI's markdown image, in the template's text by hand)
                "inputs": f"<|im_start|>user\nWhat is it?![]({data_url(good)})<|im_end|>\n<|im_start|>assistant\n",
                "parameters": {"max_new_tokens": NEW_TOKENS}}, lambda r: r["generated_text"]),
        ]:
            status, reply = http("POST", server.url + path, body)
            assert status == 200, (name, reply)
            replies[name] = pick(reply)
        models = http("GET", server.url + "/v1/models")[1]["data"]
        shown = http("POST", server.url + "/api/show", {"model": MODEL})[1]
        # what the image question's prompt is counted as, by every route that counts one: the same
        question = [user_message("What is it?", good)]
        asked = http("POST", server.url + "/v1/chat/completions", _body(question))[1]["usage"]["prompt_tokens"]
        tokenized = http("POST", server.url + "/tokenize", {"model": MODEL, "messages": question})[1]["count"]
        counted = http("POST", server.url + "/v1/messages/count_tokens", {"model": MODEL, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": b64}}]}]})[1]["input_tokens"]
    assert replies["openai"] == replies["anthropic"] == replies["responses"] == replies["tgi generate"], replies
    assert replies["openai first"] == replies["ollama chat"] == replies["ollama generate"], replies
    assert asked == tokenized == counted, (asked, tokenized, counted)
    assert models[0]["input_modalities"] == ["text", "image"]
    assert "vision" in shown["capabilities"]


def test_image_urls_are_fetched_only_from_the_allowed_hosts(vl_model, tmp_path):
    """serving_config.image_url_hosts: an image URL on a listed host (a loopback HTTP server here) is fetched and
    answers as its data: URL does, through OpenAI's chat, Anthropic's url source, the Responses API and TGI's
    markdown image (its 404 a 400 too); a host not
    listed, a 404, a redirect, an image over max_image_bytes and a server slower than image_fetch_timeout_s are each a
    400 naming the URL; a server without the setting refuses every URL."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    good, big = png(0), png(4, (700, 700, 3))

    class Images(BaseHTTPRequestHandler):
        def do_GET(self):              # noqa: N802 - the standard library's name
            if self.path == "/slow.png":
                time.sleep(3)
            body = {"/a.png": good, "/slow.png": good, "/big.png": big}.get(self.path)
            if self.path == "/moved.png":
                self.send_response(302)
                self.send_header("Location", "/a.png")
                self.end_headers()
                return
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    images = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{images.server_address[1]}"

    def chat(url):
        return _body([{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                   {"type": "image_url", "image_url": {"url": url}}]}])

    args = ["--model", str(vl_model), "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=128", "--set", "serving_config.max_image_bytes=1000000",
            "--set", "serving_config.image_url_hosts=[127.0.0.1]", "--set", "serving_config.image_fetch_timeout_s=1"]
    try:
        with serving(args, tmp_path / "server.log") as server:
            want = http("POST", server.url + "/v1/chat/completions", chat(data_url(good)))[1]
            got = http("POST", server.url + "/v1/chat/completions", chat(base + "/a.png"))[1]
            anthropic = http("POST", server.url + "/v1/messages", {
                "model": MODEL, "max_tokens": NEW_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "What is it?"},
                    {"type": "image", "source": {"type": "url", "url": base + "/a.png"}}]}]})[1]
            responses = http("POST", server.url + "/v1/responses", {
                "model": MODEL, "max_output_tokens": NEW_TOKENS, "temperature": 0, "input": [{"role": "user", "content": [
                    {"type": "input_text", "text": "What is it?"}, {"type": "input_image", "image_url": base + "/a.png"}]}]})[1]
            refusals = {}
            for name, url in [("other host", f"http://localhost:{images.server_address[1]}/a.png"),
                              ("404", base + "/none.png"), ("redirect", base + "/moved.png"),
                              ("too large", base + "/big.png"), ("slow", base + "/slow.png")]:
                refusals[name] = http("POST", server.url + "/v1/chat/completions", chat(url))
            after = http("POST", server.url + "/v1/chat/completions", chat(base + "/a.png"))
            prompt = "<|im_start|>user\nWhat is it?![]({})<|im_end|>\n<|im_start|>assistant\n"
            tgi = http("POST", server.url + "/generate", {"inputs": prompt.format(base + "/a.png"),
                                                          "parameters": {"max_new_tokens": NEW_TOKENS}})
            tgi_404 = http("POST", server.url + "/generate", {"inputs": prompt.format(base + "/none.png")})
        text = want["choices"][0]["message"]["content"]
        assert tgi[0] == 200 and tgi[1]["generated_text"] == text, tgi
        assert tgi_404[0] == 400 and "answered 404" in tgi_404[1]["error"], tgi_404        # (TGI's error body)
        assert got["choices"][0]["message"]["content"] == text
        assert anthropic["content"][0]["text"] == text and responses["output"][-1]["content"][0]["text"] == text
        for name, says in [("other host", "image_url_hosts"), ("404", "answered 404"), ("redirect", "answered 302"),
                           ("too large", "more than 1000000 bytes"), ("slow", "did not answer within 1")]:
            status, reply = refusals[name]
            assert status == 400 and says in json.dumps(reply), (name, reply)
        assert after[0] == 200
        with serving(["--model", str(vl_model), "--set", f"model_config.model_name={MODEL}",
                      "--set", "model_config.max_generate_length=128"], tmp_path / "server2.log") as server:
            status, reply = http("POST", server.url + "/v1/chat/completions", chat(base + "/a.png"))
        assert status == 400 and "images are not fetched" in json.dumps(reply), reply
    finally:
        images.shutdown()


def test_pan_and_scan_gives_a_wide_images_crops_transformers_tokens(vl_model, tmp_path):
    """The model's processor config with do_pan_and_scan (crops of at least 16 pixels): a wide image's mark becomes
    Gemma3Processor's "Here is the original image ... and here are some crops ..." with three crops, a near-square
    image's stays one frame; each reply is transformers' greedy tokens and log-probabilities with its processor's
    pixels (the crops among them) and its prompt; every frame is encoded once. With `model_config.pan_and_scan=off`
    the wide image is one frame again."""
    import shutil

    _, transformers = needs_transformers()
    from types import SimpleNamespace

    from tokenizers import Tokenizer

    from llm_serving.tokenization import load_tokenizer
    from tests.families import GEMMA3_IMAGE_TOKENS

    model = tmp_path / "model"
    shutil.copytree(vl_model, model)
    config = json.loads((model / "preprocessor_config.json").read_text())
    config.update(do_pan_and_scan=True, pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=4,
                  pan_and_scan_min_ratio_to_activate=1.2)
    (model / "preprocessor_config.json").write_text(json.dumps(config))
    wide, square = png(3, (40, 130, 3)), png(4, (55, 60, 3))
    boi, eoi, image = GEMMA3_IMAGE_TOKENS
    full = SimpleNamespace(full_image_sequence=f"\n\n{boi}{image * 4}{eoi}\n\n")

    def prompt_ids(text: str, crops: list) -> list:
        # the template rendered by hand, each mark made what Gemma3Processor makes of it for its image's crops
        parts = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n".split(boi)
        out = parts[0]
        for n, part in zip(crops, parts[1:]):
            out += transformers.Gemma3Processor.replace_image_token(full, {"num_crops": [n]}, 0) + part
        return Tokenizer.from_file(str(model / "tokenizer.json")).encode(out).ids

    chats = [("What is it?", [wide], [3]), ("Compare:", [square, wide], [0, 3])]
    args = ["--model", str(model), "--set", f"model_config.model_name={MODEL}",
            "--set", "model_config.max_generate_length=384", "--set", "pa_config.kv_cache_dtype=float32"]
    with serving(args, tmp_path / "server.log") as server:
        replies = [http("POST", server.url + "/v1/chat/completions", _body([user_message(text, *images)]))
                   for text, images, _ in chats]          # (in turn: the second reuses the wide image's frames)
        log = (tmp_path / "server.log").read_text()
    with serving(args + ["--set", "model_config.pan_and_scan=off"], tmp_path / "off.log") as server:
        off = http("POST", server.url + "/v1/chat/completions", _body([user_message("What is it?", wide)]))
    tok = load_tokenizer(str(model / "tokenizer.json"))
    for (text, images, crops), (status, body) in zip(chats, replies):
        assert status == 200, body
        ids = prompt_ids(text + boi * len(images), crops)
        assert ids.count(IMAGE) == 4 * (len(images) + sum(crops))
        assert body["usage"]["prompt_tokens"] == len(ids), text
        want, want_lps = _reference(model, ids, images)
        assert body["choices"][0]["message"]["content"] == tok.decode(want), text
        np.testing.assert_allclose([e["logprob"] for e in body["choices"][0]["logprobs"]["content"]], want_lps,
                                   atol=2e-3, err_msg=text)
    assert "pan-and-scan on" in log and log.count(" encoded in ") == 5, log     # (the wide one's 4 frames, once)
    assert off[0] == 200 and off[1]["usage"]["prompt_tokens"] == len(prompt_ids("What is it?" + boi, [0])), off
