"""BERT encoders served for embeddings, on real servers, against transformers (sentence-transformers' pooling
computed with transformers: tests/families.py's `transformers_embedding`), on tiny random BERTs that transformers
makes: all-MiniLM's shape (mean pooling declared in 1_Pooling/config.json) and bge's (the [CLS] token's).

- /v1/embeddings: each input's vector within EMBEDDING_ATOL of transformers' and at a cosine >= 0.9999, for texts
  tokenized by the model's WordPiece tokenizer ([CLS] ... [SEP]; its tokenizer.json's truncation and padding not
  applied) and for token ids; several inputs in one step, and on a server whose step budget (32 tokens) is below an
  input (fed whole, in a step of its own).
- the similarity scores (/v1/rerank by similarity, /score) order the documents as transformers' cosines do.
- every generation route refuses the model with a 400 naming it; Ollama's /api/show says it embeds only.
- an input longer than the context is refused, or cut by truncate_prompt_tokens (its last tokens, as vLLM does).
- a Q8_0 GGUF twin (as llama.cpp's converter writes a bert GGUF): its vocabulary, pooling and stored matrices
  served, each vector the float64 reference's on its dequantized weights.
- MindSpore's ops (layer_kernel off: the graphs Ascend would run) serve the same embeddings.
- in a fleet beside a generating model (stories260K), each is what it is: the encoder embeds and refuses to
  generate, the decoder generates and embeds.

Tolerance: the KV cache is float16 (tests/integration/test_embeddings.py says why 1e-3 of a component holds).
"""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving.reference_llama import ReferenceLlama
from tests.families import ENCODERS, make_bert_model, needs_transformers, transformers_embedding, write_bert_gguf
from tests.integration.server_harness import http, serving

EMBEDDING_ATOL = 1e-3
TEXTS = ["the little cat sat on the mat", "once upon a time there was a girl named lily",
         "lily and ben played in the park with a red ball", "the dog ran",
         "tom had a big box of toys and he shared them with his friend sam at the park every day"]
LONG = " ".join(TEXTS)                  # 88 tokens: past the small server's step budget


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    needs_transformers()
    root = tmp_path_factory.mktemp("encoders")
    return {name: make_bert_model(name, root / name, seed=i) for i, name in enumerate(ENCODERS)}


@pytest.fixture(scope="module")
def mean_server(encoders, tmp_path_factory):
    with serving(["--model", str(encoders["bert"])], tmp_path_factory.mktemp("bert") / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def cls_server(encoders, tmp_path_factory):
    """bge's shape, on a server whose step budget (32 tokens) is below LONG's tokens."""
    small = ["--set", "serving_config.max_num_batched_tokens=32", "--set", "serving_config.max_num_seqs=8",
             "--set", "model_config.seq_length=[16,128]"]
    with serving(["--model", str(encoders["bert-cls"]), *small], tmp_path_factory.mktemp("bert-cls") / "server.log") \
            as server:
        yield server


def ids_of(directory, text: str) -> list:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok.encode(text).ids


def embeddings(server, inputs, **fields) -> list:
    name = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
    status, body = http("POST", server.url + "/v1/embeddings", {"model": name, "input": inputs, **fields})
    assert status == 200, body
    return [np.asarray(item["embedding"], np.float64) for item in body["data"]]


def check_close(got, want, what) -> None:
    assert float(got @ want) >= 0.9999 and np.abs(got - want).max() <= EMBEDDING_ATOL, (what, float(got @ want))


@pytest.mark.parametrize("name", list(ENCODERS))
def test_embeddings_are_sentence_transformers(encoders, mean_server, cls_server, name):
    server = {"bert": mean_server, "bert-cls": cls_server}[name]
    directory, (_, pooling) = encoders[name], ENCODERS[name]
    model = http("GET", server.url + "/v1/models")[1]["data"][0]
    assert model["embedding"] == {"pooling": pooling, "dimensions": ENCODERS[name][0]["hidden_size"]}
    assert model["score_method"] == "similarity"
    texts = TEXTS + [LONG]
    ids = [ids_of(directory, text) for text in texts]
    assert len(ids[-1]) > 64 and all(i[0] == 2 and i[-1] == 3 for i in ids)      # [CLS] ... [SEP], untruncated
    for text, got, want_ids in zip(texts, embeddings(server, texts), ids):
        check_close(got, transformers_embedding(directory, want_ids, pooling), text)
    # token ids as they are (no [CLS]/[SEP] added), and an input alone is the one beside others
    got = embeddings(server, [ids[3][1:-1]])[0]
    check_close(got, transformers_embedding(directory, ids[3][1:-1], pooling), "ids")
    np.testing.assert_allclose(embeddings(server, TEXTS[3])[0], embeddings(server, TEXTS)[3], atol=1e-6)


def test_similarity_orders_documents_as_transformers_cosines_do(encoders, mean_server):
    """Each query's documents by /v1/rerank (similarity): every pair whose transformers' cosines are apart by more
    than the served vectors' error moves one (~1e-4) in transformers' order, and the scores those cosines."""
    directory = encoders["bert"]
    name = http("GET", mean_server.url + "/v1/models")[1]["data"][0]["id"]
    want = {text: transformers_embedding(directory, ids_of(directory, text), "mean") for text in TEXTS}
    checked = 0
    for query in TEXTS:
        documents = [t for t in TEXTS if t != query]
        cosines = [float(want[query] @ want[d]) for d in documents]
        status, body = http("POST", mean_server.url + "/v1/rerank",
                            {"model": name, "query": query, "documents": documents})
        assert status == 200, body
        scores = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert [r["index"] for r in body["results"]] == sorted(scores, key=lambda i: -scores[i])
        np.testing.assert_allclose([scores[i] for i in range(len(documents))], cosines, atol=3e-4)
        for i in range(len(documents)):
            for j in range(len(documents)):
                if cosines[i] - cosines[j] > 5e-4:
                    assert scores[i] > scores[j], (query, documents[i], documents[j])
                    checked += 1
    assert checked >= 20                                          # (an order to check)


GENERATION = [("/v1/completions", {"prompt": "the cat", "max_tokens": 3}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
              ("/v1/responses", {"input": "hi"}),
              ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
              ("/api/generate", {"prompt": "the cat", "stream": False}),
              ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}),
              ("/generate", {"inputs": "the cat", "parameters": {"max_new_tokens": 3}})]


@pytest.mark.parametrize("path,body", GENERATION, ids=[p for p, _ in GENERATION])
def test_generation_routes_refuse_an_embedding_model(mean_server, path, body):
    name = http("GET", mean_server.url + "/v1/models")[1]["data"][0]["id"]
    status, reply = http("POST", mean_server.url + path, {"model": name, **body})
    assert status == 400, reply
    assert f"model '{name}' is an embedding model; it does not generate" in str(reply)


def test_ollama_serves_it_as_an_embedding_model(encoders, mean_server):
    name = http("GET", mean_server.url + "/v1/models")[1]["data"][0]["id"]
    status, show = http("POST", mean_server.url + "/api/show", {"model": name})
    assert status == 200 and show["capabilities"] == ["embedding"]
    status, body = http("POST", mean_server.url + "/api/embed", {"model": name, "input": TEXTS[:2]})
    assert status == 200, body
    for text, got in zip(TEXTS, body["embeddings"]):
        check_close(np.asarray(got), transformers_embedding(encoders["bert"], ids_of(encoders["bert"], text), "mean"),
                    text)


def test_an_input_past_the_context_is_refused_or_truncated(encoders, mean_server):
    """The context is the model's 128 positions: a longer input is a 400 naming it; truncate_prompt_tokens keeps its
    last tokens, whose embedding is transformers' of those ids."""
    directory = encoders["bert"]
    name = http("GET", mean_server.url + "/v1/models")[1]["data"][0]["id"]
    assert http("GET", mean_server.url + "/v1/models")[1]["data"][0]["max_model_len"] == 128
    text = " ".join([LONG] * 2)                  # 176 tokens
    ids = ids_of(directory, text)
    assert len(ids) > 128
    status, body = http("POST", mean_server.url + "/v1/embeddings", {"model": name, "input": text})
    assert status == 400 and "at most 128 tokens" in body["error"]["message"], body
    got = embeddings(mean_server, text, truncate_prompt_tokens=100)[0]
    check_close(got, transformers_embedding(directory, ids[-100:], "mean"), "truncated")


def test_a_quantized_gguf_twin_serves_the_references_embeddings(encoders, tmp_path_factory):
    import gguf

    root = tmp_path_factory.mktemp("bert-gguf")
    twin = write_bert_gguf(encoders["bert-cls"], root / "bert-cls-q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    ref = ReferenceLlama(str(twin))
    with serving(["--model", str(twin)], root / "server.log") as server:
        model = http("GET", server.url + "/v1/models")[1]["data"][0]
        assert model["embedding"]["pooling"] == "cls"                   # its bert.pooling_type
        for text, got in zip(TEXTS, embeddings(server, TEXTS)):
            check_close(got, ref.embed(ids_of(encoders["bert-cls"], text), "cls"), text)


def test_mindspores_ops_serve_the_same_embeddings(encoders, tmp_path_factory):
    """layer_kernel off: every layer as MindSpore's ops (LayerNorm post norms, biases, the ungated GELU-erf MLP, the
    attention over each token's whole input), its vectors transformers' as the kernel's are."""
    directory = encoders["bert"]
    with serving(["--model", str(directory), "--set", "model_config.layer_kernel=off"],
                 tmp_path_factory.mktemp("bert-ops") / "server.log") as server:
        for text, got in zip(TEXTS, embeddings(server, TEXTS)):
            check_close(got, transformers_embedding(directory, ids_of(directory, text), "mean"), text)


def test_in_a_fleet_the_encoder_embeds_beside_a_model_that_generates(encoders, stories_dir, tmp_path_factory):
    args = ["--model", str(stories_dir / "hf"), "--model", str(encoders["bert"])]
    with serving(args, tmp_path_factory.mktemp("fleet-encoder") / "server.log") as server:
        status, body = http("POST", server.url + "/v1/embeddings", {"model": "bert", "input": TEXTS[:2]})
        assert status == 200, body
        check_close(np.asarray(body["data"][1]["embedding"]),
                    transformers_embedding(encoders["bert"], ids_of(encoders["bert"], TEXTS[1]), "mean"), TEXTS[1])
        status, body = http("POST", server.url + "/v1/completions", {"model": "bert", "prompt": "a", "max_tokens": 2})
        assert status == 400 and "'bert' is an embedding model" in body["error"]["message"]
        status, body = http("POST", server.url + "/v1/completions", {"model": "hf", "prompt": "Once", "max_tokens": 4})
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        status, body = http("POST", server.url + "/v1/embeddings", {"model": "hf", "input": "Once upon a time"})
        assert status == 200 and len(body["data"][0]["embedding"]) == 64, body
        tasks = {m["id"]: m.get("embedding") for m in http("GET", server.url + "/v1/models")[1]["data"]}
        assert tasks["bert"] == {"pooling": "mean", "dimensions": 64}
