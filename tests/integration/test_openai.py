"""The official `openai` client against the server: completions and chat, streaming and not, usage,
logprobs, n, seed, stop, errors. Greedy text is checked against the llm-serving route's."""
import openai
import pytest

from llm_serving.tokenization import SentencePieceTokenizer
from tests.integration.server_harness import http, parse_sse

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(stories_server):
    return openai.OpenAI(base_url=stories_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return SentencePieceTokenizer(str(stories_dir / "hf" / "tokenizer.model"))


def native(url, prompt, n_tokens):
    """(text, [logprobs], prompt tokens) of a greedy request through /generate_stream."""
    status, body = http("POST", url + "/generate_stream", {"inputs": prompt, "parameters": {
        "max_new_tokens": n_tokens, "ignore_eos": True}})
    events = parse_sse(body)
    return (events[-1]["generated_text"], [e["token"]["logprob"] for e in events if e["token"]],
            events[-1]["details"]["prompt_tokens"])


def test_models_and_greedy_completion_with_usage_and_logprobs(client, stories_server):
    assert [m.id for m in client.models.list().data] == ["hf"]
    text, logprobs, prompt_tokens = native(stories_server.url, PROMPT, 12)
    out = client.completions.create(model="hf", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and out.object == "text_completion"
    assert out.usage.prompt_tokens == prompt_tokens and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == prompt_tokens + 12
    assert choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert "".join(choice.logprobs.tokens) == text and choice.logprobs.text_offset[0] == 0

    chunks = list(client.completions.create(model="hf", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_uses_the_llama2_format_streaming_and_not(client, stories_server, tokenizer):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A cat"},
                {"role": "assistant", "content": "The cat sat."}, {"role": "user", "content": "And then?"}]
    ids = tokenizer.encode_chat(messages)
    # the same prompt ids through /v1/completions give the same greedy reply as the chat route
    expected = client.completions.create(model="hf", prompt=ids, max_tokens=10, temperature=0).choices[0].text
    assert expected.strip()
    out = client.chat.completions.create(model="hf", messages=messages, max_tokens=10, temperature=0, logprobs=True)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    assert out.usage.prompt_tokens == len(ids) and out.object == "chat.completion"
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
    assert all(e.logprob <= 0 for e in out.choices[0].logprobs.content)
    stream = client.chat.completions.create(model="hf", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_seeded_sampling_n_choices_and_stop(client):
    def sample():
        out = client.completions.create(model="hf", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234, n=3)
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    first = sample()
    assert sample() == first and len(set(first)) > 1            # reproducible, and the choices differ
    out = client.completions.create(model="hf", prompt=PROMPT, max_tokens=40, temperature=0, stop=[" named Li"])
    assert out.choices[0].text == ", there was a little girl" and out.choices[0].finish_reason == "stop"


def test_errors_are_openai_shaped(client, stories_server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt=PROMPT)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="hf", prompt=PROMPT, temperature=5)
    assert err.value.body["param"] == "temperature" and "temperature" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="hf", messages=[{"role": "assistant", "content": "hi"}])
    assert "alternate" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="hf", prompt=PROMPT, max_tokens=100000)
    assert err.value.body["param"] == "max_tokens"
    status, body = http("POST", stories_server.url + "/v1/completions", raw=b"{nope")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_chat_template_kwargs_through_the_client(client, stories_server):
    """vLLM's chat_template_kwargs, as the openai client sends it (extra_body): the built-in LLaMA-2 format reads no
    variables, so Qwen3's switch changes neither the prompt nor the reply; a variable the render sets itself is a
    400 naming it (the template-reading side: tests/integration/test_reasoning.py)."""
    ask = dict(model="hf", messages=[{"role": "user", "content": "A cat"}], max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**ask)
    off = client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == plain.choices[0].message.content
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ask, extra_body={"chat_template_kwargs": {"bos_token": "<s>"}})
    assert err.value.body["param"] == "chat_template_kwargs" and "chat_template_kwargs.bos_token" in \
        err.value.body["message"]


def test_top_logprobs_on_every_api(client, stories_server):
    text, logprobs, _ = native(stories_server.url, PROMPT, 6)
    out = client.completions.create(model="hf", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-4)   # greedy: the top one
        assert sorted(top.values(), reverse=True) == list(top.values())
    chat = client.chat.completions.create(model="hf", messages=[{"role": "user", "content": "A cat"}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=4)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 4 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="hf", messages=[{"role": "user", "content": "A"}], top_logprobs=2)
    # TGI: top_n_tokens, streaming and not
    status, body = http("POST", stories_server.url + "/generate_stream", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "ignore_eos": True, "top_n_tokens": 2}})
    events = parse_sse(body)
    assert all(len(e["top_tokens"]) == 2 and e["top_tokens"][0]["id"] == e["token"]["id"]
               and e["top_tokens"][0]["logprob"] >= e["top_tokens"][1]["logprob"] for e in events)
    status, body = http("POST", stories_server.url + "/generate", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "ignore_eos": True, "top_n_tokens": 2}})
    assert status == 200 and len(body["details"]["top_tokens"]) == 6
    assert [t[0]["logprob"] for t in body["details"]["top_tokens"]] == pytest.approx(logprobs, abs=1e-4)


def test_penalties_discourage_repetition_and_neutral_values_change_nothing(client, stories_server):
    def tgi(**params):
        """(text, token ids) of a greedy 120-token request through /generate_stream."""
        status, body = http("POST", stories_server.url + "/generate_stream", {"inputs": PROMPT, "parameters": {
            "max_new_tokens": 120, "ignore_eos": True, **params}})
        assert status == 200, body
        events = parse_sse(body)
        return events[-1]["generated_text"], [e["token"]["id"] for e in events if e["token"]]
    plain, plain_ids = tgi()
    assert tgi(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)[0] == plain
    # a strong penalty on every repeat: more distinct tokens than plain greedy (whose stories repeat)
    for params in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        text, ids = tgi(**params)
        assert text != plain and len(set(ids)) > len(set(plain_ids)), (params, len(set(ids)), len(set(plain_ids)))
        assert tgi(**params)[0] == text                                       # greedy: deterministic
    ask = dict(model="hf", prompt=PROMPT, max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(frequency_penalty=2.0, **ask).choices[0].text == tgi(frequency_penalty=2.0)[0]
    assert client.completions.create(presence_penalty=0.0, frequency_penalty=0.0, **ask).choices[0].text == plain
    with pytest.raises(openai.BadRequestError):
        client.completions.create(frequency_penalty=3.0, **ask)


def test_tokenize_and_detokenize_in_vllms_shapes(client, stories_server, tokenizer):
    """POST /tokenize (a prompt, or a chat through the template: the ids the chat route feeds, so their count is
    its usage.prompt_tokens) and /detokenize, vLLM's shapes; bad bodies get OpenAI-shaped 400s naming the field."""
    url = stories_server.url
    status, body = http("POST", url + "/tokenize", {"model": "hf", "prompt": PROMPT, "return_token_strs": True})
    assert status == 200, body
    assert body["tokens"] == tokenizer.encode(PROMPT, add_bos=True) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == http("GET", url + "/v1/models")[1]["data"][0]["max_model_len"]
    assert body["token_strs"] == [tokenizer.id_to_piece(i) for i in body["tokens"]]
    status, bare = http("POST", url + "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert bare["tokens"] == body["tokens"][1:] and bare["token_strs"] is None
    messages = [{"role": "user", "content": "Tell me a story."}]
    status, chat = http("POST", url + "/tokenize", {"model": "hf", "messages": messages})
    reply = client.chat.completions.create(model="hf", messages=messages, max_tokens=2, temperature=0)
    assert status == 200 and chat["count"] == reply.usage.prompt_tokens
    status, text = http("POST", url + "/detokenize", {"model": "hf", "tokens": bare["tokens"]})
    assert status == 200 and text == {"prompt": PROMPT}
    for path, bad, param in (("/tokenize", {"prompt": PROMPT, "messages": messages}, "prompt"),
                             ("/tokenize", {"prompt": 7}, "prompt"),
                             ("/tokenize", {"prompt": PROMPT, "model": "nope"}, None),
                             ("/tokenize", {"messages": messages, "add_generation_prompt": False},
                              "add_generation_prompt"),
                             ("/tokenize", {"prompt": PROMPT, "add_special_tokens": "yes"}, "add_special_tokens"),
                             ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
                             ("/detokenize", {"tokens": "1 2"}, "tokens")):
        status, err = http("POST", url + path, bad)
        assert status in (400, 404) and "message" in err["error"], (path, bad, err)
        assert param is None or err["error"]["param"] == param, (path, bad, err)


def test_the_openapi_document_describes_the_request_bodies_and_they_are_checked_by_them(stories_server):
    """GET /openapi.json: an OpenAPI 3.1 document whose request schemas are the models the routes validate with
    (server/api/): a body that breaks one (a type, a range, an unknown field) is refused naming the field,
    in each API's own error shape."""
    url = stories_server.url
    status, doc = http("GET", url + "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert {"messages", "tools", "response_format", "logit_bias", "min_p", "prompt_logprobs",
            "chat_template_kwargs"} <= set(chat["properties"])
    assert "enable_thinking" in chat["properties"]["chat_template_kwargs"]["description"]
    assert "chat_template_kwargs" in schemas["TokenizeRequest"]["properties"]
    assert chat["properties"]["temperature"]["maximum"] == 2.0 and "messages" in chat["required"]
    assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {"/generate", "/tokenize", "/health", "/v1/models"} <= set(doc["paths"])
    tgi = schemas["TGIParameters"]["properties"]
    assert {"grammar", "decoder_input_details", "top_n_tokens"} <= set(tgi)
    for path, body, param, words in (
            ("/v1/completions", {"model": "hf", "prompt": "x", "temperature": 3}, "temperature", "<= 2.0"),
            ("/v1/completions", {"model": "hf", "prompt": "x", "n": "2"}, "n", "must be an integer"),
            ("/v1/chat/completions", {"model": "hf", "messages": [{"role": "robot", "content": "x"}]}, "messages",
             "messages[0].role must be"),
            ("/v1/chat/completions", {"model": "hf", "messages": [], "top_k": 1}, "messages", "non-empty"),
            ("/v1/completions", {"model": "hf", "prompt": "x", "colour": "red", "top_p": 0}, "top_p", "> 0")):
        status, err = http("POST", url + path, body)
        assert status == 400 and err["error"]["param"] == param and words in err["error"]["message"], (body, err)
    status, err = http("POST", url + "/generate", {"inputs": "x", "parameters": {"top_k": -1}})
    assert status == 400 and "parameters.top_k must be >= 0" in err["error"], err
