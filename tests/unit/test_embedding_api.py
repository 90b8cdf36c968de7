"""Embeddings, rerank and score without a model: the request models' rules (a 400 naming the field), and the routes
(OpenAI's /v1/embeddings, rerank, score, Ollama's /api/embed and /api/embeddings, /v1/models) over a scripted engine
whose embeddings are a text's letter counts, normalized, and whose yes/no judgements are scripted probabilities."""
from __future__ import annotations

import asyncio
import base64
import json
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from llm_serving.master.request import TokenEvent
from llm_serving.models.pooling import EmbeddingSpec
from llm_serving.server.api.base import validate
from llm_serving.server.api.document import openapi
from llm_serving.server.api.embeddings import EmbeddingRequest, RerankRequest, ScoreRequest
from llm_serving.server.api.ollama import EmbeddingsRequest, EmbedRequest
from llm_serving.server.errors import ValidationError
from llm_serving.server.routes_embeddings import judgement_prompt
from tests.apps import app_of_one


# --- the request models ---------------------------------------------------------------------------------------------

def emb(**fields):
    return {"model": "m", "input": "hello", **fields}


@pytest.mark.parametrize("model, body, param, words", [
    (EmbeddingRequest, emb(input=""), "input", "non-empty string"),
    (EmbeddingRequest, emb(input=[]), "input", "non-empty"),
    (EmbeddingRequest, emb(input=["a", ""]), "input", "non-empty strings"),
    (EmbeddingRequest, emb(input=[[1, 2], []]), "input", "list of such lists"),
    (EmbeddingRequest, emb(input=[3, -1]), "input", "token ids (>= 0)"),
    (EmbeddingRequest, emb(input=["a"] * 2049), "input", "1 to 2048"),
    (EmbeddingRequest, emb(input=[1, "a"]), "input", "input[0]"),
    (EmbeddingRequest, emb(input=True), "input", "input"),
    (EmbeddingRequest, {"input": "x"}, "model", "'model' is required"),
    (EmbeddingRequest, emb(model=""), "model", "model"),
    (EmbeddingRequest, emb(encoding_format="float16"), "encoding_format", "'float' or 'base64'"),
    (EmbeddingRequest, emb(dimensions=0), "dimensions", ">= 1"),
    (EmbeddingRequest, emb(dimensions=8.0), "dimensions", "an integer"),
    (EmbeddingRequest, emb(truncate_prompt_tokens=0), "truncate_prompt_tokens", ">= 1, or -1"),
    (EmbeddingRequest, emb(truncate_prompt_tokens=-2), "truncate_prompt_tokens", ">= -1"),
    (EmbeddingRequest, emb(pooling="mean"), "pooling", "unknown field"),
    (RerankRequest, {"query": "q", "documents": []}, "documents", "non-empty"),
    (RerankRequest, {"query": "", "documents": ["a"]}, "query", "query"),
    (RerankRequest, {"query": "q", "documents": ["a", {"text": ""}]}, "documents", "documents[1]"),
    (RerankRequest, {"query": "q", "documents": [{"image": "x"}]}, "documents", "documents[0]"),
    (RerankRequest, {"query": "q", "documents": ["a"] * 1001}, "documents", "at most 1000"),
    (RerankRequest, {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", ">= 0"),
    (RerankRequest, {"query": "q", "documents": ["a"], "instruction": ""}, "instruction", "instruction"),
    (ScoreRequest, {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2", "text_1 has 2 texts and text_2 1"),
    (ScoreRequest, {"text_1": ["a", "b"], "text_2": "c"}, "text_2", "pairwise"),
    (ScoreRequest, {"text_1": [], "text_2": "c"}, "text_1", "non-empty"),
    (ScoreRequest, {"text_1": "a", "text_2": ["c", ""]}, "text_2", "non-empty strings"),
    (ScoreRequest, {"text_1": "a"}, "text_2", "'text_2' is required"),
    (EmbedRequest, {"model": "m", "input": ["a", ""]}, "input", "non-empty strings"),
    (EmbedRequest, {"model": "m", "input": "a", "dimensions": 0}, "dimensions", ">= 1"),
    (EmbedRequest, {"model": "m", "input": "a", "options": {"mirostat": 2}}, "options", "mirostat"),
    (EmbeddingsRequest, {"model": "m", "prompt": 3}, "prompt", "a string"),
])
def test_a_broken_rule_is_a_400_naming_its_field(model, body, param, words):
    with pytest.raises(ValidationError) as info:
        validate(model, body)
    assert info.value.param == param and words in str(info.value), str(info.value)


def test_valid_bodies_give_their_inputs_and_pairs():
    assert validate(EmbeddingRequest, emb()).inputs() == ["hello"]
    assert validate(EmbeddingRequest, emb(input=["a", "b"])).inputs() == ["a", "b"]
    assert validate(EmbeddingRequest, emb(input=[5, 6])).inputs() == [[5, 6]]
    assert validate(EmbeddingRequest, emb(input=[[5], [6, 7]])).inputs() == [[5], [6, 7]]
    r = validate(EmbeddingRequest, emb(encoding_format="base64", dimensions=8, user="u", truncate_prompt_tokens=-1))
    assert (r.encoding_format, r.dimensions, r.truncate_prompt_tokens) == ("base64", 8, -1)
    assert validate(RerankRequest, {"query": "q", "documents": ["a", {"text": "b"}]}).texts() == ["a", "b"]
    assert validate(ScoreRequest, {"text_1": "q", "text_2": ["a", "b"]}).pairs() == [("q", "a"), ("q", "b")]
    assert validate(ScoreRequest, {"text_1": ["q"], "text_2": "a"}).pairs() == [("q", "a")]
    assert validate(ScoreRequest, {"text_1": ["q", "r"], "text_2": ["a", "b"]}).pairs() == [("q", "a"), ("r", "b")]
    assert validate(EmbedRequest, {"model": "m"}).inputs() == []           # Ollama's "load the model"
    assert validate(EmbedRequest, {"model": "m", "input": "", "truncate": False, "keep_alive": "5m",
                                   "options": {"num_ctx": 8}}).inputs() == []
    assert validate(EmbedRequest, {"model": "m", "input": ["a", "b"]}).inputs() == ["a", "b"]


def test_the_judgement_prompt_is_qwen3_rerankers():
    assert judgement_prompt("what?", "this.", "Find it") == (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
        "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n<Instruct>: Find "
        "it\n<Query>: what?\n<Document>: this.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_the_document_lists_the_new_operations_with_the_served_model_alone():
    doc = openapi("1", models=["hf", "lora1"], vocab_size=512, max_model_len=256)
    for path in ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/score", "/v1/score", "/api/embed",
                 "/api/embeddings"):
        op = doc["paths"][path]["post"]
        assert "content" in op["responses"]["200"] and "4XX" in op["responses"], path
    schemas = doc["components"]["schemas"]
    assert schemas["EmbeddingRequest"]["properties"]["model"]["enum"] == ["hf"]          # adapters do not embed
    assert schemas["RerankRequest"]["properties"]["model"]["enum"] == ["hf", None]
    assert schemas["EmbedRequest"]["properties"]["model"]["enum"] == ["hf", "hf:latest"]
    ids = schemas["EmbeddingRequest"]["properties"]["input"]["anyOf"][2]["items"]
    assert ids["maximum"] == 511 and ids["minimum"] == 0
    error = doc["paths"]["/rerank"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/OpenAIError"}
    assert "enum" not in json.dumps(schemas["EmbeddingRequest"]["properties"]["dimensions"])   # (no widths given)


def _dimensions(engine) -> list:
    """The `dimensions` field of OpenAI's and Ollama's embedding bodies in the document `engine`'s server serves."""
    doc = call(engine, "/openapi.json", method="GET")[1]
    return [doc["components"]["schemas"][name]["properties"]["dimensions"] for name in ("EmbeddingRequest",
                                                                                         "EmbedRequest")]


def test_the_served_document_names_the_widths_the_models_embeddings_take():
    assert all(d["enum"] == [DIMS, None] for d in _dimensions(_Engine()))          # (null: the model's own)
    listed = _dimensions(_Engine(embedding=EmbeddingSpec("mean", "default", DIMS, matryoshka=(4, 8))))
    assert all(d["enum"] == [4, 8, DIMS, None] for d in listed), listed
    any_width = _dimensions(_Engine(embedding=EmbeddingSpec("mean", "default", DIMS, matryoshka=None)))
    assert all(d["maximum"] == DIMS and "enum" not in d for d in any_width), any_width
    assert all("enum" not in d and "maximum" not in d for d in _dimensions(_Engine(embedding=None)))


# --- the routes over a scripted engine ------------------------------------------------------------------------------

DIMS = 26                       # a vector per text: its letters' counts, a-z


class _Tokenizer:
    """A character per token (ord + 100); the ChatML markers are specials 1 and 2, "yes" and "no" tokens 3 and 4
    (`words`: which words are single tokens)."""
    vocab_size = 1 << 17
    MARKERS = {"<|im_start|>": 1, "<|im_end|>": 2}

    def __init__(self, words=("yes", "no")):
        self.words = {w: 3 + k for k, w in enumerate(("yes", "no")) if w in words}

    def encode(self, text, add_bos=True):
        if text in self.words:
            return [self.words[text]]
        ids = []
        for part in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            ids += [self.MARKERS[part]] if part in self.MARKERS else [ord(c) + 100 for c in part]
        return ids

    def is_special(self, token_id):
        return token_id in (1, 2)

    def text(self, ids):
        return "".join(chr(i - 100) for i in ids if i >= 100)


def _letters(text: str) -> np.ndarray:
    v = np.zeros(DIMS, np.float32)
    for c in text.lower():
        if "a" <= c <= "z":
            v[ord(c) - 97] += 1
    return v / np.float32(max(np.linalg.norm(v), 1e-6))


class _Engine:
    """Embeds a text as its letter counts (normalized); judges a prompt relevant (P(yes) 0.9) when its document says
    "relevant", else 0.2. `fail`: the engine fails the request of that input (by its text)."""
    model_name, lora_paths, start_time, generates = "m", {"ad": "/adapters/ad"}, 0.0, True
    image_facts = None                  # (a text model)

    def __init__(self, score_method="similarity", embedding=EmbeddingSpec("last", "1_Pooling/config.json", DIMS),
                 words=("yes", "no"), fail=None, max_model_len=64):
        self.score_method, self.embedding, self.fail = score_method, embedding, fail
        self.max_model_len = max_model_len     # (a judgement prompt has ~250 characters: yes_no engines get 512)
        self.tokenizer = _Tokenizer(words)
        self.vocab_size = self.tokenizer.vocab_size
        self.submitted, self.released, self.sampling = [], [], []

    def served_models(self):
        return ["m", "ad"]

    def _req(self, ids):
        req = SimpleNamespace(prompt_ids=list(ids), events=asyncio.Queue(), embedding=None, finished=False)
        self.submitted.append(req)
        return req

    def submit_embedding(self, prompt_ids, req_id=None):
        req = self._req(prompt_ids)
        text = self.tokenizer.text(prompt_ids)
        if self.fail is not None and text == self.fail:
            req.events.put_nowait(TokenEvent(-1, "", 0.0, False, "error", "agent 0 failed the step"))
        else:
            req.embedding = _letters(text)
            req.events.put_nowait(TokenEvent(-1, "", 0.0, False, "stop"))
        return req

    def submit(self, prompt_ids, sampling, req_id=None, adapter=None, grammar=None, images=None):
        req = self._req(prompt_ids)
        self.sampling.append(sampling)
        document = self.tokenizer.text(prompt_ids).split("<Document>: ")[1]
        p_yes = 0.9 if "relevant" in document else 0.2
        no_id, yes_id = sampling.allowed_token_ids
        token, p = (yes_id, p_yes) if p_yes >= 0.5 else (no_id, 1 - p_yes)
        req.events.put_nowait(TokenEvent(token, "", math.log(p), False, "length"))
        return req

    def release(self, req):
        self.released.append(req)


def call(engine, path, body=None, method="POST", key=None, headers=None):
    """(status, JSON body) of one request to the embedding, Ollama and OpenAI routes on `engine`."""
    async def run():
        app = app_of_one(engine, {"api_key": key} if key else None)
        async with TestClient(TestServer(app)) as client:
            response = await client.request(method, path, json=body, headers=headers)
            return response.status, await response.json()
    return asyncio.run(run())


def _vector(item):
    if isinstance(item["embedding"], str):
        return np.frombuffer(base64.b64decode(item["embedding"]), "<f4")
    return np.asarray(item["embedding"], np.float32)


def test_embeddings_come_in_input_order_the_same_as_float_and_as_base64():
    engine = _Engine()
    texts = ["banana", "cab", "zebra"]
    status, body = call(engine, "/v1/embeddings", emb(input=texts))
    assert status == 200 and body["object"] == "list" and body["model"] == "m"
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and all(d["object"] == "embedding" for d in body["data"])
    for item, text in zip(body["data"], texts):
        assert np.array_equal(_vector(item), _letters(text))
    assert body["usage"] == {"prompt_tokens": 14, "total_tokens": 14}
    status, encoded = call(engine, "/v1/embeddings", emb(input=texts, encoding_format="base64"))
    assert status == 200 and all(isinstance(d["embedding"], str) for d in encoded["data"])
    assert all(np.array_equal(_vector(a), _vector(b)) for a, b in zip(body["data"], encoded["data"]))
    assert {id(r) for r in engine.released} == {id(r) for r in engine.submitted}     # every request released
    # token ids are embedded as they are; vLLM's truncate_prompt_tokens keeps the last ones
    status, body = call(engine, "/v1/embeddings", emb(input=[[ord("a") + 100, ord("b") + 100]],
                                                       truncate_prompt_tokens=1))
    assert status == 200 and np.array_equal(_vector(body["data"][0]), _letters("b"))


def test_dimensions_are_refused_by_the_models_reason_and_cut_for_a_matryoshka_model():
    status, body = call(_Engine(), "/v1/embeddings", emb(dimensions=8))
    assert status == 400 and body["error"]["param"] == "dimensions" and "not a Matryoshka model" in \
        body["error"]["message"]
    assert call(_Engine(), "/v1/embeddings", emb(dimensions=DIMS))[0] == 200
    engine = _Engine(embedding=EmbeddingSpec("mean", "default", DIMS, matryoshka=(4, 8)))
    status, body = call(engine, "/v1/embeddings", emb(input="abcdefgh", dimensions=4))
    vector = _vector(body["data"][0])
    assert status == 200 and len(vector) == 4 and abs(float(np.linalg.norm(vector)) - 1) < 1e-6
    assert np.allclose(vector, 0.5)
    status, body = call(engine, "/v1/embeddings", emb(dimensions=5))
    assert status == 400 and "must be one of 4, 8, 26" in body["error"]["message"]


@pytest.mark.parametrize("body, param, words", [
    (emb(input="x" * 65), "input", "has 65 tokens; this model embeds at most 64"),
    (emb(input=["a", "x" * 65]), "input", "input[1] has 65 tokens"),
    (emb(input=[1 << 17]), "input", "is not a token id in 0..131071"),
    (emb(model="ad"), "model", "is a LoRA adapter"),
])
def test_bad_inputs_are_a_400_naming_the_field_and_nothing_is_submitted(body, param, words):
    engine = _Engine()
    status, reply = call(engine, "/v1/embeddings", body)
    assert status == 400 and reply["error"]["param"] == param and words in reply["error"]["message"], reply
    assert reply["error"]["type"] == "invalid_request_error" and engine.submitted == []


def test_an_unknown_model_is_a_404_and_a_server_without_embeddings_a_400():
    status, body = call(_Engine(), "/v1/embeddings", emb(model="other"))
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = call(_Engine(embedding=None), "/v1/embeddings", emb())
    assert status == 400 and body["error"]["param"] == "model" and "without embeddings" in body["error"]["message"]


def test_a_failed_input_fails_the_reply_with_500_and_the_others_are_released():
    engine = _Engine(fail="cab")
    status, body = call(engine, "/v1/embeddings", emb(input=["banana", "cab", "zebra"]))
    assert status == 500 and body["error"]["type"] == "server_error"
    assert body["error"]["message"] == "agent 0 failed the step"
    assert len(engine.submitted) == 3 and {id(r) for r in engine.released} == {id(r) for r in engine.submitted}


def test_rerank_by_similarity_sorts_best_first_and_cuts_to_top_n():
    engine = _Engine()
    documents = ["zzz", "abc", {"text": "abd"}]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        status, body = call(engine, path, {"model": "m", "query": "abc", "documents": documents})
        assert status == 200 and body["model"] == "m" and body["id"].startswith("rerank-")
        assert [r["index"] for r in body["results"]] == [1, 2, 0]
        if path == "/v2/rerank":        # Cohere's v2: index and relevance_score alone
            assert all(set(r) == {"index", "relevance_score"} for r in body["results"])
        else:                           # Jina's: each result's document unless return_documents is false
            assert [r["document"]["text"] for r in body["results"]] == ["abc", "abd", "zzz"]
        assert body["results"][0]["relevance_score"] == pytest.approx(1.0, abs=1e-6)
        assert body["results"][1]["relevance_score"] == pytest.approx(2 / 3, abs=1e-6)
        assert body["usage"] == {"total_tokens": 9}     # each distinct text embedded once (the query and "abc" are one)
    status, body = call(engine, "/rerank", {"query": "abc", "documents": documents, "top_n": 1,
                                            "return_documents": False})
    assert status == 200 and body["results"] == [{"index": 1, "relevance_score": body["results"][0]["relevance_score"]}]
    assert body["model"] == "m"                                 # (the served model, when none is named)
    status, body = call(engine, "/v2/rerank", {"query": "abc", "documents": documents, "return_documents": True})
    assert status == 200 and [r["document"]["text"] for r in body["results"]] == ["abc", "abd", "zzz"]
    status, body = call(engine, "/v2/rerank", {"query": "abc", "documents": documents, "return_documents": "yes"})
    assert status == 400 and body["error"]["param"] == "return_documents"


def test_the_document_says_which_rerank_returns_documents_by_default():
    doc = openapi("1", models=["m"])

    def body_schema(path):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert body_schema("/v1/rerank")["properties"]["return_documents"]["default"] is True
    assert body_schema("/rerank")["properties"]["return_documents"]["default"] is True
    assert body_schema("/v2/rerank")["properties"]["return_documents"]["default"] is False


def test_score_pairs_one_text_against_each_or_pairwise():
    engine = _Engine()
    status, body = call(engine, "/score", {"model": "m", "text_1": "abc", "text_2": ["abc", "xyz"]})
    assert status == 200 and body["object"] == "list" and body["id"].startswith("score-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    assert [d["score"] for d in body["data"]] == pytest.approx([1.0, 0.0], abs=1e-6)
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6, "completion_tokens": 0}
    status, body = call(engine, "/v1/score", {"text_1": ["ab", "xy"], "text_2": ["xy", "xy"]})
    assert status == 200 and [d["score"] for d in body["data"]] == pytest.approx([0.0, 1.0], abs=1e-6)
    status, body = call(engine, "/score", {"text_1": "abc", "text_2": ["abc", "x" * 65]})
    assert status == 400 and body["error"]["param"] == "text_2" and "text_2[1] has 65 tokens" in \
        body["error"]["message"]


def test_rerank_by_a_yes_no_judgement_is_the_probability_of_yes():
    engine = _Engine(score_method="yes_no", embedding=None, max_model_len=512)
    status, body = call(engine, "/rerank", {"query": "q", "documents": ["nothing here", "a relevant one"],
                                            "instruction": "Find it"})
    assert status == 200 and [r["index"] for r in body["results"]] == [1, 0]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([0.9, 0.2])
    assert [r.prompt_ids for r in engine.submitted] == [engine.tokenizer.encode(judgement_prompt("q", d, "Find it"))
                                                        for d in ("nothing here", "a relevant one")]
    assert all((s.max_new_tokens, s.temperature, s.allowed_token_ids) == (1, 0.0, (4, 3)) for s in engine.sampling)
    assert body["usage"]["total_tokens"] == sum(len(r.prompt_ids) for r in engine.submitted)
    assert len(engine.released) == 2
    status, body = call(engine, "/score", {"text_1": "q", "text_2": "relevant"})
    assert status == 200 and body["data"][0]["score"] == pytest.approx(0.9)
    prompt = engine.tokenizer.text(engine.submitted[-1].prompt_ids)
    assert "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n" in prompt


def test_a_yes_no_reranker_without_single_yes_and_no_tokens_is_refused_naming_it():
    engine = _Engine(score_method="yes_no", words=("no",), max_model_len=512)
    status, body = call(engine, "/rerank", {"query": "q", "documents": ["d"]})
    assert status == 400 and body["error"]["param"] == "model" and "'yes' to be a single token" in \
        body["error"]["message"]
    assert engine.submitted == []
    status, body = call(_Engine(score_method="yes_no", max_model_len=512), "/rerank",
                        {"query": "q", "documents": ["d" * 300]})
    assert status == 400 and body["error"]["param"] == "documents" and "judgement prompt has" in \
        body["error"]["message"]


def test_ollama_embed_cuts_to_the_context_by_default_and_refuses_past_it_without_truncate():
    engine = _Engine()
    status, body = call(engine, "/api/embed", {"model": "m:latest", "input": ["abc", "b" * 70]})
    assert status == 200 and body["model"] == "m:latest" and body["prompt_eval_count"] == 3 + 64
    assert np.array_equal(np.asarray(body["embeddings"][0], np.float32), _letters("abc"))
    assert body["load_duration"] == 0 and body["total_duration"] > 0
    status, body = call(engine, "/api/embed", {"model": "m", "input": "b" * 70, "truncate": False})
    assert status == 400 and body == {"error": "input has 70 tokens; this model embeds at most 64 tokens an input"}
    status, body = call(engine, "/api/embed", {"model": "m"})
    assert status == 200 and body["embeddings"] == [] and body["prompt_eval_count"] == 0
    assert call(engine, "/api/embed", {"model": "nope", "input": "a"}) == (404, {"error": "model 'nope' not found"})
    status, body = call(engine, "/api/embed", {"model": "ad", "input": "a"})
    assert status == 400 and "LoRA adapter" in body["error"]
    status, body = call(engine, "/api/embed", {"model": "m", "input": "a", "dimensions": 3})
    assert status == 400 and "Matryoshka" in body["error"]


def test_ollamas_older_embeddings_route_gives_one_vector():
    engine = _Engine()
    status, body = call(engine, "/api/embeddings", {"model": "m", "prompt": "zebra"})
    assert status == 200 and np.array_equal(np.asarray(body["embedding"], np.float32), _letters("zebra"))
    assert call(engine, "/api/embeddings", {"model": "m", "prompt": ""}) == (200, {"embedding": []})


def test_v1_models_says_what_the_model_serves_besides_generation():
    engine = _Engine()
    status, body = call(engine, "/v1/models", method="GET")
    model, adapter = body["data"]
    assert status == 200 and model["embedding"] == {"pooling": "last", "dimensions": DIMS}
    assert model["score_method"] == "similarity" and model["max_model_len"] == 64
    assert adapter["id"] == "ad" and adapter["embedding"] is None and adapter["score_method"] is None
    engine = _Engine(score_method="yes_no", embedding=None, max_model_len=512)
    model = call(engine, "/v1/models", method="GET")[1]["data"][0]
    assert model["embedding"] is None and model["score_method"] == "yes_no"


def test_the_new_routes_need_the_api_key_when_one_is_set():
    for path, body in (("/v1/embeddings", emb()), ("/rerank", {"query": "q", "documents": ["d"]}),
                       ("/score", {"text_1": "a", "text_2": "b"}), ("/api/embed", {"model": "m", "input": "a"})):
        status, reply = call(_Engine(), path, body, key="key-0001")
        assert status == 401, path
        status, reply = call(_Engine(), path, body, key="key-0001", headers={"Authorization": "Bearer key-0001"})
        assert status == 200, (path, reply)


def test_the_replies_follow_the_documents_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    doc = openapi("1", models=["m", "ad"])
    engine = _Engine()
    cases = [("/v1/embeddings", emb(input=["ab", "c"])), ("/v1/embeddings", emb(encoding_format="base64")),
             ("/rerank", {"query": "q", "documents": ["d"], "return_documents": False}),
             ("/v2/rerank", {"query": "q", "documents": ["d", "e"]}), ("/score", {"text_1": "a", "text_2": "b"}),
             ("/api/embed", {"model": "m", "input": "a"}), ("/api/embeddings", {"model": "m", "prompt": "a"})]
    for path, body in cases:
        status, reply = call(engine, path, body)
        schema = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert status == 200 and jsonschema.Draft202012Validator(schema).is_valid(reply), (path, reply)
    status, reply = call(engine, "/v1/models", method="GET")
    schema = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert jsonschema.Draft202012Validator(schema).is_valid(reply), reply
    status, reply = call(engine, "/rerank", {"query": "", "documents": ["d"]})
    schema = {**doc["paths"]["/rerank"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"],
              "components": doc["components"]}
    assert status == 400 and jsonschema.Draft202012Validator(schema).is_valid(reply)


def test_every_input_is_submitted_before_any_is_awaited():
    """One engine request per input, all queued before the route waits on the first: they share the engine's steps."""
    engine = _Engine()
    seen = []                           # how many were submitted when a request was first awaited
    submit = engine.submit_embedding

    def submit_recording(ids, req_id=None):
        req = submit(ids)
        get = req.events.get

        async def get_recording():
            seen.append(len(engine.submitted))
            return await get()
        req.events.get = get_recording
        return req
    engine.submit_embedding = submit_recording
    status, _ = call(engine, "/v1/embeddings", emb(input=["a", "b", "c"]))
    assert status == 200 and seen == [3, 3, 3]


def test_a_chat_models_average_does_not_rank_it_says_what_to_load():
    """A generating model whose pooling is only the default mean: rerank and score are a 400 naming what to serve
    instead; a declared pooling, model_config.pooling, an embedding model or a yes/no reranker rank."""
    from llm_serving.server.routes_embeddings import check_ranks
    chat = _Engine(embedding=EmbeddingSpec("mean", "default", DIMS))
    with pytest.raises(ValidationError) as err:
        check_ranks(chat)
    assert err.value.param == "model" and "is a chat model" in str(err.value) and \
        "model_config.pooling=mean" in str(err.value)
    for ranks in (_Engine(), _Engine(embedding=EmbeddingSpec("mean", "model_config.pooling", DIMS)),
                  _Engine(score_method="yes_no", embedding=EmbeddingSpec("mean", "default", DIMS))):
        check_ranks(ranks)
    encoder = _Engine(embedding=EmbeddingSpec("mean", "default", DIMS))
    encoder.generates = False
    check_ranks(encoder)
