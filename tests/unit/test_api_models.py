"""The API request models (server/api/): every rule about a request's shape is checked by validation alone, with
no model or engine, as a ValidationError naming the request's field; a valid body translates into the internal
request (server/translate.py's ApiRequest) the engine-facing `prepare` takes."""
from __future__ import annotations

import json
import re

import pytest

from llm_serving.master.grammar import GrammarError
from llm_serving.server.api.anthropic import MessagesRequest
from llm_serving.server.api.base import read_json, validate
from llm_serving.server.api.document import openapi
from llm_serving.server.apis import APIS, error_shape
from llm_serving.server.api.ollama import ShowRequest
from llm_serving.server.api.openai import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from llm_serving.server.api.tgi import GenerateRequest
from llm_serving.server.errors import ValidationError

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def chat(**fields):
    return {"model": "m", "messages": USER, **fields}


@pytest.mark.parametrize("model, body, param, words", [
    (ChatCompletionRequest, chat(messages=[{"role": "tool", "content": "x"}]), "messages",
     "messages[0]: a tool message needs the tool_call_id"),
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages",
     "'messages[0].content[0].image_url' is required"),
    (ChatCompletionRequest, chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "messages",
     "messages[0].content[0].type must be 'text' or 'image_url'"),
    (ChatCompletionRequest, chat(messages=[{"role": "user"}]), "messages", "null only for an assistant's tool calls"),
    (ChatCompletionRequest, chat(messages=[{"role": "assistant", "tool_calls": [{"function": {}}]}]), "messages",
     "messages[0].tool_calls[0].function.name"),
    (ChatCompletionRequest, chat(tool_choice="auto"), "tool_choice", "needs tools"),
    (ChatCompletionRequest, chat(parallel_tool_calls=False), "parallel_tool_calls", "needs tools"),
    (ChatCompletionRequest, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools", "must match"),
    (ChatCompletionRequest, chat(tools=[WEATHER, WEATHER]), "tools", "given twice"),
    (ChatCompletionRequest, chat(tools=[WEATHER] * 129), "tools", "at most 128"),
    (ChatCompletionRequest, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
     "tool_choice", "not one of the tools"),
    (ChatCompletionRequest, chat(tools=[WEATHER], tool_choice="required", guided_regex="a+"), "tool_choice",
     "cannot also follow guided_regex"),
    (ChatCompletionRequest, chat(tools=[WEATHER], tool_choice="required", max_tokens=0, prompt_logprobs=0),
     "max_tokens", "cannot force a tool call"),
    (ChatCompletionRequest, chat(top_logprobs=2), "top_logprobs", "needs logprobs"),
    (ChatCompletionRequest, chat(stream_options={"include_usage": True}), "stream_options", "stream: true"),
    (ChatCompletionRequest, chat(max_completion_tokens=0), "max_completion_tokens", "at least 1"),
    (ChatCompletionRequest, chat(max_tokens=0, prompt_logprobs=1, stream=True), "max_tokens", "neither a grammar"),
    (ChatCompletionRequest, chat(stop=["x"] * 17), "stop", "at most 16"),
    (ChatCompletionRequest, chat(stop=""), "stop", "1 to 256 characters"),
    (ChatCompletionRequest, chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "sets 'messages'"),
    (ChatCompletionRequest, chat(response_format={"type": "json_schema"}), "response_format", "json_schema must be"),
    (ChatCompletionRequest, chat(structured_outputs={}), "structured_outputs", "exactly one of"),
    (ChatCompletionRequest, chat(guided_choice=["a", ""]), "guided_choice", "non-empty strings"),
    (ChatCompletionRequest, chat(guided_regex="a", guided_json={}), "guided_regex", "at most one of"),
    (ChatCompletionRequest, chat(logit_bias={"-1": 2}), "logit_bias", "not a token id"),
    (ChatCompletionRequest, chat(logit_bias={"3": 100.5}), "logit_bias", "[-100, 100]"),
    (ChatCompletionRequest, chat(min_tokens=5, max_tokens=4), "min_tokens", "more than the most"),
    (ChatCompletionRequest, chat(allowed_token_ids=[]), "allowed_token_ids", "non-empty"),
    (ChatCompletionRequest, chat(stop_token_ids=[-1]), "stop_token_ids", ">= 0"),
    (ChatCompletionRequest, chat(model=""), "model", None),
    (CompletionRequest, {"model": "m", "prompt": ""}, "prompt", "non-empty string"),
    (CompletionRequest, {"model": "m", "prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    (CompletionRequest, {"model": "m", "prompt": [1, -2]}, "prompt", "token ids"),
    (CompletionRequest, {"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens", "echo or prompt_logprobs"),
    (TokenizeRequest, {"prompt": "x", "messages": USER}, "prompt", "exactly one of"),
    (TokenizeRequest, {"prompt": "x", "tools": [WEATHER]}, "tools", "goes with 'messages'"),
    (TokenizeRequest, {"messages": USER, "add_special_tokens": True}, "add_special_tokens", "goes with 'prompt'"),
    (TokenizeRequest, {"messages": USER, "add_generation_prompt": False}, "add_generation_prompt", "not supported"),
    (GenerateRequest, {"inputs": " "}, "inputs", "'inputs' is empty"),
    (GenerateRequest, {"inputs": "x", "parameters": {"stop": ["x"] * 17}}, "stop", "parameters.stop"),
    (GenerateRequest, {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": ""}}}, "grammar",
     "non-empty string"),
    (GenerateRequest, {"inputs": "x", "parameters": {"adapter_id": ""}}, "adapter_id", None),
])
def test_a_rule_about_a_requests_shape_is_a_400_naming_its_field_without_a_model(model, body, param, words):
    with pytest.raises(ValidationError) as info:
        validate(model, body, unknown="parameter" if model is GenerateRequest else "field")
    assert info.value.param == param, str(info.value)
    assert words is None or words in str(info.value), str(info.value)


def test_a_schema_that_is_not_json_is_named_by_its_own_field():
    with pytest.raises(GrammarError) as info:
        validate(CompletionRequest, {"model": "m", "prompt": "x", "guided_json": "{oops"})
    assert info.value.param == "guided_json"


def test_a_valid_chat_becomes_the_internal_request():
    messages = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sun"}]
    r = validate(ChatCompletionRequest, chat(messages=messages, tools=[WEATHER], tool_choice="required",
                                             temperature=0, seed=-1, stop="x", bad_words=["no"], reasoning_effort="low",
                                             max_completion_tokens=7, top_k=-1, logprobs=True, top_logprobs=2))
    req = r.to_request(max_model_len=100)
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"},
                            {"role": "assistant", "content": "", "tool_calls": [
                                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                            {"role": "tool", "content": "sun", "tool_call_id": "c1"}]
    assert req.tools == [WEATHER] and req.tool_choice == "required" and req.parallel_tool_calls
    assert req.variables == {"reasoning_effort": "low"} and req.bad_words == ("no",)
    sp = req.sampling
    assert (sp.max_new_tokens, sp.temperature, sp.top_k, sp.seed, sp.stop, sp.top_logprobs) == \
        (7, 0.0, 0, (1 << 63) - 1, ("x",), 2)
    assert req.max_tokens_field == "max_completion_tokens" and req.max_tokens_given
    # no length given: the context's, to be fitted by prepare
    assert validate(ChatCompletionRequest, chat()).to_request(100).sampling.max_new_tokens == 100


def test_generate_translates_tgis_sampling_rule_and_the_routes_stream_default():
    r = validate(GenerateRequest, {"inputs": "x", "parameters": {"top_k": 5, "decoder_input_details": True}})
    req = r.to_request(stream_default=False, model=None)
    assert req.sampling.temperature == 1.0 and req.sampling.top_k == 5 and req.sampling.prompt_logprobs == 0
    assert not req.max_tokens_given and req.sampling.max_new_tokens == 64
    with pytest.raises(ValidationError) as info:       # a _stream route: details of the prompt are not streamed
        r.to_request(stream_default=True, model=None)
    assert info.value.param == "decoder_input_details"
    assert validate(GenerateRequest, {"inputs": "x", "parameters": None}).to_request(False, None).sampling.greedy


def test_generate_takes_tgis_markdown_images_for_a_model_that_takes_images():
    """TGI's `![](url)` in inputs: for a model that takes images, the raw prompt's parts (a data: URL's bytes, an
    http(s) URL kept to be fetched, the text between them in order); for a text model, the text as it is; a data:
    URL that is not a base64 image is a 400 naming inputs."""
    import base64

    png = b"\x89PNG fake bytes"
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    inputs = f"Look ![a photo]({url}) and ![](https://example.com/b.png)?"
    r = validate(GenerateRequest, {"inputs": inputs})
    req = r.to_request(False, None, takes_images=True)
    assert req.prompt is None and req.prompt_parts == [
        "Look ", {"type": "image", "image": png}, " and ", {"type": "image", "url": "https://example.com/b.png"}, "?"]
    text = r.to_request(False, None)
    assert text.prompt == inputs and text.prompt_parts is None
    plain = validate(GenerateRequest, {"inputs": "no ![image] (here) [x](y)"}).to_request(False, None, True)
    assert plain.prompt == "no ![image] (here) [x](y)" and plain.prompt_parts is None
    with pytest.raises(ValidationError) as info:
        validate(GenerateRequest, {"inputs": "![](data:text/plain;base64,aGk=)"}).to_request(False, None, True)
    assert info.value.param == "inputs" and "not an image" in str(info.value)


def test_bodies_that_are_not_json_objects_are_refused_saying_what_they_are():
    for raw, words in ((b"\xff", "UTF-8"), (b" ", "empty"), (b"{", "not valid JSON"), (b"[1]", "JSON object")):
        with pytest.raises(ValidationError, match=words):
            read_json(raw)


def test_the_document_lists_each_route_with_its_model():
    doc = openapi("1")
    assert doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = doc["components"]["schemas"]
    assert {"ChatMessage", "TextPart", "TGIParameters"} <= set(schemas)
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc))
    assert refs and set(refs) <= set(schemas)           # every reference resolves (names of two APIs told apart)
    assert not [n for n in schemas if "__" in n]


# --- the OpenAPI document says what validation takes ----------------------------------------------------------------

SERVED = {"models": ["hf", "lora1"], "vocab_size": 512, "max_model_len": 256}


def _body_schema(doc: dict, model: type) -> dict:
    """The document's schema of `model`'s bodies (at its first route)."""
    path = next(path for api in APIS for path, m, _ in api.bodies.ROUTES if m is model)
    return {**doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"],
            "components": doc["components"]}


def test_the_served_documents_fields_name_the_served_model_and_bound_its_vocabulary_and_context():
    doc = openapi("1", **SERVED)
    schemas = doc["components"]["schemas"]
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["enum"] == ["hf", "lora1"]
    assert schemas["TokenizeRequest"]["properties"]["model"]["enum"] == ["hf", "lora1", None]     # (null: the model)
    assert schemas["TGIParameters"]["properties"]["adapter_id"]["enum"] == ["lora1", None]
    assert schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["maximum"] == 255
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] == {"type": "integer", "minimum": 0,
                                                                              "maximum": 511}
    assert doc["paths"]["/models/{model}/generate"]["post"]["parameters"][0]["schema"]["enum"] == ["hf", "lora1"]
    show = json.dumps(schemas["ShowRequest"])
    assert '"enum": ["hf", "lora1", "hf:latest", "lora1:latest"]' in show
    # a document built without a server has no served values, and no marks left
    unserved = json.dumps(openapi("1"))
    assert '"x-served"' not in unserved and '"x-served"' not in json.dumps(doc) and '"hf"' not in unserved


# bodies validation takes: the document takes them too
TAKEN = [
    (CompletionRequest, {"model": "hf", "prompt": "x", "stop": ["a", "b"], "logit_bias": {" 5 ": -100, "-0": 1}}),
    (CompletionRequest, {"model": "hf", "prompt": ["x"], "response_format": {"type": "text"}, "guided_regex": "a"}),
    (CompletionRequest, {"model": "hf", "prompt": [1, 511], "stream": True, "stream_options": {"include_usage": True}}),
    (ChatCompletionRequest, {"model": "lora1", "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "c", "content": ""}], "logprobs": True, "top_logprobs": 3}),
    (TokenizeRequest, {"messages": USER, "tools": [WEATHER], "tool_choice": "required", "model": None}),
    (TokenizeRequest, {"prompt": "x", "add_special_tokens": True, "tool_choice": None}),
    (GenerateRequest, {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": "{}"}, "stop": "x"}}),
    (ShowRequest, {"model": "hf:latest", "name": "any name"}),
    (ShowRequest, {"name": "lora1"}),
]
# bodies validation refuses, by a rule the document states
REFUSED = [
    (CompletionRequest, {"model": "hf", "prompt": ["a", "b"]}),
    (CompletionRequest, {"model": "hf", "prompt": "x", "stop": [""]}),
    (CompletionRequest, {"model": "hf", "prompt": "x", "logit_bias": {"-1": 2}}),
    (CompletionRequest, {"model": "hf", "prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}),
    (CompletionRequest, {"model": "hf", "prompt": "x", "stream_options": {"include_usage": True}}),
    (ChatCompletionRequest, {"model": "hf", "messages": [{"role": "user"}]}),
    (ChatCompletionRequest, {"model": "hf", "messages": [{"role": "tool", "content": "x"}]}),
    (ChatCompletionRequest, {"model": "hf", "messages": USER, "top_logprobs": 2}),
    (ChatCompletionRequest, {"model": "hf", "messages": USER, "chat_template_kwargs": {"messages": []}}),
    (TokenizeRequest, {"prompt": "x", "messages": USER}),
    (TokenizeRequest, {"prompt": "x", "tools": [WEATHER]}),
    (TokenizeRequest, {"messages": USER, "tool_choice": "auto"}),
    (GenerateRequest, {"inputs": " "}),
    (GenerateRequest, {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": " "}}}),
    (ShowRequest, {"name": None}),
]
# bodies validation takes and the routes refuse, for what only the served model knows: the document refuses them
NOT_SERVED = [
    (CompletionRequest, {"model": "other", "prompt": "x"}),
    (CompletionRequest, {"model": "hf", "prompt": [512]}),
    (CompletionRequest, {"model": "hf", "prompt": "x", "max_tokens": 256}),
    (GenerateRequest, {"inputs": "x", "parameters": {"adapter_id": "hf"}}),
    (ShowRequest, {"model": "hf:v2", "name": "hf"}),
]


def _documented(model, body) -> bool:
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator(_body_schema(openapi("1", **SERVED), model)).is_valid(body)


def _validates(model, body) -> bool:
    try:
        validate(model, body, unknown="parameter" if model is GenerateRequest else "field")
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("model, body", TAKEN)
def test_the_served_document_takes_what_validation_takes(model, body):
    assert _validates(model, body) and _documented(model, body)


@pytest.mark.parametrize("model, body", REFUSED)
def test_the_served_document_states_the_rules_validation_refuses_by(model, body):
    assert not _validates(model, body) and not _documented(model, body)


@pytest.mark.parametrize("model, body", NOT_SERVED)
def test_the_served_document_refuses_what_only_the_served_model_refuses(model, body):
    assert _validates(model, body) and not _documented(model, body)


def test_each_apis_error_body_is_the_shape_its_routes_document():
    jsonschema = pytest.importorskip("jsonschema")
    from llm_serving.server import routes_anthropic, routes_ollama, routes_openai, streaming
    doc = openapi("1")
    shapes = {"/v1/chat/completions": routes_openai.error_body(400, "bad", "validation", "stop"),
              "/tokenize": routes_openai.error_body(404, "no such model", "not_found"),
              "/v1/responses": routes_openai.error_body(400, "bad", "validation", None),
              "/generate": streaming.error_body("bad", "validation"),
              "/v1/messages": routes_anthropic.error_body(400, "bad", "validation", "max_tokens"),
              "/api/chat": routes_ollama.error_body(400, "bad", "validation", "format")}
    for path, body in shapes.items():
        schema = doc["paths"][path]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]
        assert jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).is_valid(body), path
    anthropics = doc["paths"]["/v1/messages"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]
    assert not jsonschema.Draft202012Validator({**anthropics, "components": doc["components"]}).is_valid(
        shapes["/generate"])


def test_each_apis_paths_get_the_error_shape_its_row_documents():
    """The document gives an API's operations its row's error shape; the app shapes a path's errors by the API that
    owns it (apis.error_shape): the two agree on every path the document lists."""
    for api in APIS:
        paths = [path for path, _, _ in api.bodies.ROUTES] + \
            [path for _, path, _ in getattr(api.bodies, "OPERATIONS", ())]
        assert paths and all(error_shape(path) is api.error for path in paths), api.name
    assert error_shape("/health").name == "TGIError" and error_shape("/v1/models").name == "OpenAIError"


def test_schemathesis_can_generate_every_request_the_document_describes():
    """Rules between fields are intersections a JSON schema generator must combine: too many in one body and it
    gives up (schemathesis: 'outgrew_intersections'), and the route cannot be fuzzed (test_openapi_fuzz.py)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    schema = schemathesis.openapi.from_dict(openapi("1", **SERVED))
    bodies = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.body:
            @settings(max_examples=1, database=None, phases=[Phase.generate], deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE))
            def draw(case):
                bodies[op.label] = case.body
            draw()
    assert set(bodies) == {f"POST {path}" for api in APIS for path, _, _ in api.bodies.ROUTES}
    assert bodies["POST /v1/chat/completions"]["model"] in SERVED["models"]


def test_a_content_block_whose_type_is_no_string_is_a_400_naming_its_field():
    """Found by schemathesis (test_openapi_fuzz.py): an object as a block's type was looked up in a dict, and the
    TypeError (unhashable) was a 500."""
    for system in ([{"type": {}, "text": ""}], [{"type": ["text"], "text": ""}]):
        with pytest.raises(ValidationError) as info:
            validate(MessagesRequest, {"model": "m", "max_tokens": 1, "messages": USER, "system": system})
        assert info.value.param == "system" and "unknown content block type" in str(info.value), str(info.value)
    with pytest.raises(ValidationError) as info:
        validate(MessagesRequest, {"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": {"a": 1}}]}]})
    assert info.value.param == "messages" and "messages[0].content[0]" in str(info.value), str(info.value)
