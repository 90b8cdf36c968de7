"""Embeddings, rerank and score on real servers.

On the shared stories260K server (mean pooling: its directory declares none; score_method similarity): the openai
SDK's `embeddings.create` (float and base64 give one vector; a batch in input order; a text twice gives the same bits;
unit norms; an embedding while generation streams run is the one alone, to the bit), Ollama's client's `embed` and
`embeddings`, and the errors (dimensions refused, empty input, an input past the context, an unknown model); its
rerank and score refused (a chat model's average: the 400 says what to load). The same model started with
`model_config.pooling=mean` (a declared pooling) ranks: rerank and score replies in their shapes and order.

Against transformers, on a tiny random Qwen3 (tests/families.py) whose tokenizer has "yes" and "no" as single tokens
(families.py's 320-token BPE has neither: this module trains its own BPE of the same size with them in the corpus):
- served with a sentence-transformers declaration (modules.json naming a Pooling module at 1_Pooling, whose
  config.json says pooling_mode_lasttoken) and `score_method=yes_no`: /v1/embeddings is transformers' AutoModel last
  hidden state (after the final norm) at the last token, normalized; /rerank's scores are transformers'
  softmax([logit_no, logit_yes]) at the last position of the same judgement prompt;
- the same directory without the declaration: the mean over the tokens, normalized.

Tolerances (the server's KV cache is float16): each K/V value is stored to within float16's rounding (2^-12 of it),
which moves a unit vector's components by 1.3e-4 at most here (measured); EMBEDDING_ATOL, 1e-3, is 4 float16 rounding
steps of a component and still far below what a wrong pooling or position gives (mean against last: a cosine of
0.35-0.54 on these models). A relevance score is exp(log P(yes)), so its error is at most its log-probability's, for
which the tests hold FLOAT16_CACHE_LOGPROB_ATOL (tests/conftest.py); measured here: 1e-4.
"""
from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest

from llm_serving.server.api.embeddings import DEFAULT_INSTRUCTION
from llm_serving.server.routes_embeddings import judgement_prompt
from tests.conftest import FLOAT16_CACHE_LOGPROB_ATOL
from tests.integration.server_harness import http, serving

openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

EMBEDDING_ATOL = 1e-3
TEXTS = ["Once upon a time, there was a little girl named Lily.", "The dog ran to the park with his red ball.",
         "Tom had a big box of toys."]


@pytest.fixture(scope="module")
def client(stories_server):
    return openai.OpenAI(base_url=stories_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def _vectors(response) -> list:
    return [np.asarray(d.embedding, np.float32) for d in response.data]


# --- the stories server: the APIs' shapes and the engine's embeddings ------------------------------------------------

def test_the_sdks_float_and_base64_give_one_vector_per_input_in_order(client, stories_server):
    model = http("GET", stories_server.url + "/v1/models")[1]["data"][0]
    assert model["embedding"] == {"pooling": "mean", "dimensions": 64} and model["score_method"] == "similarity"
    floats = client.embeddings.create(model="hf", input=TEXTS, encoding_format="float")
    encoded = client.embeddings.create(model="hf", input=TEXTS)          # (the SDK asks for base64 and decodes it)
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.model == "hf"
    for a, b in zip(_vectors(floats), _vectors(encoded)):
        assert a.shape == (64,) and np.array_equal(a, b)
        assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-6
    alone = [_vectors(client.embeddings.create(model="hf", input=t, encoding_format="float"))[0] for t in TEXTS]
    for k, vector in enumerate(_vectors(floats)):                       # each input's own vector, at its index
        assert float(vector @ alone[k]) > 0.9999 and all(float(vector @ alone[j]) < 0.999 for j in range(3) if j != k)
    counts = [http("POST", stories_server.url + "/tokenize", {"prompt": t})[1]["count"] for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(counts)
    ids = client.embeddings.create(model="hf", input=[http("POST", stories_server.url + "/tokenize",
                                                           {"prompt": TEXTS[0]})[1]["tokens"]], encoding_format="float")
    assert float(_vectors(ids)[0] @ alone[0]) > 0.9999                  # token ids are the text's


def test_a_text_twice_gives_the_same_bits_in_one_request_and_in_two(client):
    once = _vectors(client.embeddings.create(model="hf", input=[TEXTS[0], TEXTS[0]], encoding_format="float"))
    assert np.array_equal(once[0], once[1])
    first, second = (_vectors(client.embeddings.create(model="hf", input=TEXTS[1], encoding_format="float"))[0]
                     for _ in range(2))
    assert np.array_equal(first, second)


async def _embedding_among_streams(url: str, num_streams: int):
    """The vector of TEXTS[2] asked for while `num_streams` greedy completion streams are running (after each sent
    its first tokens), and the streams' texts."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        started = asyncio.Event()
        running = []

        async def stream(k):
            body = {"model": "hf", "prompt": f"Once upon a time {k}", "max_tokens": 120, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                chunks = 0
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        chunks += 1
                        if chunks == 4:
                            running.append(k)
                            if len(running) == num_streams:
                                started.set()
                return chunks

        tasks = [asyncio.create_task(stream(k)) for k in range(num_streams)]
        await asyncio.wait_for(started.wait(), 60)
        async with session.post(url + "/v1/embeddings", json={"model": "hf", "input": TEXTS[2]}) as resp:
            body = await resp.json()
        mid_stream = [t for t in tasks if not t.done()]
        counts = await asyncio.gather(*tasks)
        return np.asarray(body["data"][0]["embedding"], np.float32), len(mid_stream), counts


def test_an_embedding_among_generation_streams_is_the_one_alone_to_the_bit(client, stories_server):
    alone = _vectors(client.embeddings.create(model="hf", input=TEXTS[2], encoding_format="float"))[0]
    among, still_streaming, counts = asyncio.run(_embedding_among_streams(stories_server.url, 8))
    assert still_streaming >= 4, "the embedding was not served while the streams ran"
    assert all(c == 120 for c in counts)
    assert np.array_equal(among, alone)


@pytest.fixture(scope="module")
def pooled_stories(stories_dir, tmp_path_factory):
    """stories260K told to rank by its mean (model_config.pooling: a declared pooling)."""
    from tests.integration.server_harness import REPO
    with serving(["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
                  "--set", "model_config.pooling=mean"], tmp_path_factory.mktemp("pooled") / "server.log") as server:
        yield server


def test_a_chat_models_rerank_and_score_say_what_to_load(stories_server):
    for path, body in (("/v1/rerank", {"query": "pets", "documents": ["a cat", "taxes"]}),
                       ("/score", {"text_1": "pets", "text_2": ["a cat"]})):
        status, err = http("POST", stories_server.url + path, body)
        assert status == 400 and err["error"]["param"] == "model", err
        assert "is a chat model" in err["error"]["message"] and "model_config.pooling=mean" in err["error"]["message"]


def test_rerank_and_score_replies_by_similarity(pooled_stories):
    stories_server = pooled_stories
    client = openai.OpenAI(base_url=stories_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    query, documents = "The dog ran to the park.", ["Tom had a big box of toys.", TEXTS[1], {"text": "A dog ran."}]
    texts = [documents[0], documents[1], "A dog ran."]
    vectors = _vectors(client.embeddings.create(model="hf", input=[query, *texts], encoding_format="float"))
    want = [float(vectors[0] @ v) for v in vectors[1:]]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        status, body = http("POST", stories_server.url + path, {"model": "hf", "query": query, "documents": documents})
        assert status == 200 and set(body) == {"id", "model", "usage", "results"}, body
        results = body["results"]
        assert [r["index"] for r in results] == sorted(range(3), key=lambda k: -want[k])
        assert [r["relevance_score"] for r in results] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
        if path == "/v2/rerank":        # Cohere's v2: no documents unless asked
            assert all(set(r) == {"index", "relevance_score"} for r in results), results
        else:
            assert [r["document"]["text"] for r in results] == [texts[r["index"]] for r in results]
        assert body["model"] == "hf" and body["usage"]["total_tokens"] > 0
    status, body = http("POST", stories_server.url + "/v2/rerank", {"query": query, "documents": documents,
                                                                    "return_documents": True})
    assert status == 200 and [r["document"]["text"] for r in body["results"]] == \
        [texts[r["index"]] for r in body["results"]]
    status, body = http("POST", stories_server.url + "/rerank", {"query": query, "documents": documents, "top_n": 2,
                                                                 "return_documents": False})
    assert status == 200 and len(body["results"]) == 2 and "document" not in body["results"][0]
    status, body = http("POST", stories_server.url + "/score", {"model": "hf", "text_1": query,
                                                                "text_2": [documents[0], TEXTS[1]]})
    assert status == 200 and body["object"] == "list" and body["model"] == "hf"
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    assert [d["score"] for d in body["data"]] == pytest.approx(want[:2], abs=1e-5)
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] > 0
    status, body = http("POST", stories_server.url + "/v1/score", {"text_1": [query, TEXTS[1]],
                                                                   "text_2": [TEXTS[1], TEXTS[1]]})
    assert status == 200 and [d["score"] for d in body["data"]] == pytest.approx([want[1], 1.0], abs=1e-5)


def test_ollamas_embed_and_embeddings(client, stories_server):
    ollama_client = ollama.Client(host=stories_server.url, timeout=60)
    reply = ollama_client.embed(model="hf", input=TEXTS)
    want = _vectors(client.embeddings.create(model="hf", input=TEXTS, encoding_format="float"))
    assert reply.model == "hf" and len(reply.embeddings) == 3
    assert all(np.array_equal(np.asarray(e, np.float32), w) for e, w in zip(reply.embeddings, want))
    assert reply.prompt_eval_count == client.embeddings.create(model="hf", input=TEXTS).usage.prompt_tokens
    assert reply.load_duration == 0 and reply.total_duration > 0
    one = ollama_client.embed(model="hf:latest", input=TEXTS[0])
    assert np.allclose(one.embeddings[0], want[0], atol=1e-5)
    older = ollama_client.embeddings(model="hf", prompt=TEXTS[0])
    assert np.array_equal(np.asarray(older.embedding, np.float32), np.asarray(one.embeddings[0], np.float32))
    long_text = "Once upon a time " * 100                                 # ~500 tokens: past the 256-token context
    cut = ollama_client.embed(model="hf", input=long_text)                # truncate (default): the first 256
    assert cut.prompt_eval_count == 256
    with pytest.raises(ollama.ResponseError) as info:
        ollama_client.embed(model="hf", input=long_text, truncate=False)
    assert info.value.status_code == 400 and "this model embeds at most 256 tokens" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        ollama_client.embed(model="nope", input="a")
    assert info.value.status_code == 404


@pytest.mark.parametrize("fields, status, param, words", [
    ({"input": "a cat", "dimensions": 32}, 400, "dimensions", "not a Matryoshka model"),
    ({"input": ""}, 400, "input", "non-empty string"),
    ({"input": []}, 400, "input", "non-empty"),
    ({"input": ["a cat", "Once upon a time " * 100]}, 400, "input", "input[1] has"),
    ({"input": [[1, 600]]}, 400, "input", "600 is not a token id in 0..511"),
    ({"input": "a cat", "model": "gpt-4"}, 404, None, "does not exist"),
])
def test_errors_are_openais_naming_the_field(client, fields, status, param, words):
    with pytest.raises(openai.APIStatusError) as info:
        client.embeddings.create(**{"model": "hf", "encoding_format": "float", **fields})
    error = info.value.body
    assert info.value.status_code == status and error["param"] == param and words in error["message"], error


def test_score_and_rerank_errors_name_the_field(pooled_stories):
    stories_server = pooled_stories
    status, body = http("POST", stories_server.url + "/rerank", {"query": "a", "documents": ["Once upon " * 200]})
    assert status == 400 and body["error"]["param"] == "documents" and "documents[0] has" in body["error"]["message"]
    status, body = http("POST", stories_server.url + "/score", {"text_1": ["a", "b"], "text_2": ["c"]})
    assert status == 400 and body["error"]["param"] == "text_2"
    status, body = http("POST", stories_server.url + "/rerank", {"model": "x", "query": "a", "documents": ["b"]})
    assert status == 404 and body["error"]["code"] == "model_not_found"


# --- a tiny Qwen3 against transformers -------------------------------------------------------------------------------

def _tokenizer_with_yes_and_no(vocab_size: int) -> str:
    """families.py's byte-level BPE (its specials, the 256 bytes, merges) trained on its corpus plus lines of "yes
    no", so that both words are single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from llm_serving.models.default_model import generate_story_lines
    from tests.families import SPECIAL_TOKENS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = list(generate_story_lines(2000, 7)) + ["yes no"] * 2000
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == vocab_size
    return tok.to_str()


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory):
    """(a tiny Qwen3 declaring last-token pooling as sentence-transformers does, the same without the declaration)."""
    from tests.families import FAMILIES, make_hf_model, needs_transformers

    pytest.importorskip("mindspore")
    needs_transformers()
    root = tmp_path_factory.mktemp("embedding-qwen3")
    plain = make_hf_model("qwen3", root / "qwen3-mean", seed=3)
    (plain / "tokenizer.json").write_text(_tokenizer_with_yes_and_no(FAMILIES["qwen3"]["vocab_size"]),
                                          encoding="utf-8")
    declared = root / "qwen3-last"
    shutil.copytree(plain, declared)
    (declared / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (declared / "1_Pooling").mkdir()
    (declared / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": FAMILIES["qwen3"]["hidden_size"], "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}))
    return declared, plain


TINY = ["--set", "model_config.max_generate_length=256"]


@pytest.fixture(scope="module")
def reranker(qwen3_dirs, tmp_path_factory):
    with serving(["--model", str(qwen3_dirs[0]), "--set", "model_config.score_method=yes_no", *TINY],
                 tmp_path_factory.mktemp("qwen3-last") / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def mean_server(qwen3_dirs, tmp_path_factory):
    with serving(["--model", str(qwen3_dirs[1]), *TINY], tmp_path_factory.mktemp("qwen3-mean") / "server.log") \
            as server:
        yield server


def _hidden_states(path, ids: list) -> np.ndarray:
    """transformers' last hidden state (after the final norm) of `ids`: (len(ids), hidden)."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()


def _tokenizer(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json"))


def _check_embeddings(server, path, pool) -> None:
    tok = _tokenizer(path)
    name = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
    status, body = http("POST", server.url + "/v1/embeddings", {"model": name, "input": TEXTS})
    assert status == 200, body
    for text, item in zip(TEXTS, body["data"]):
        hidden = _hidden_states(path, tok.encode(text).ids)
        want = pool(hidden)
        want = want / np.linalg.norm(want)
        got = np.asarray(item["embedding"], np.float32)
        assert float(got @ want) > 0.9999 and np.abs(got - want).max() <= EMBEDDING_ATOL, (text, float(got @ want))


def test_a_declared_last_token_pooling_is_transformers_last_hidden_state(reranker, qwen3_dirs):
    model = http("GET", reranker.url + "/v1/models")[1]["data"][0]
    assert model["embedding"] == {"pooling": "last", "dimensions": 64} and model["score_method"] == "yes_no"
    _check_embeddings(reranker, qwen3_dirs[0], lambda hidden: hidden[-1])
    # an embedding model, as Ollama says it (its clients then embed with it rather than chat)
    assert ollama.Client(host=reranker.url, timeout=60).show(model["id"]).capabilities == ["embedding"]
    status, body = http("POST", reranker.url + "/v1/embeddings", {"model": model["id"], "input": "a", "dimensions": 8})
    assert status == 400 and body["error"]["param"] == "dimensions"


def test_without_a_declaration_the_pooling_is_the_mean_over_the_tokens(mean_server, qwen3_dirs):
    model = http("GET", mean_server.url + "/v1/models")[1]["data"][0]
    assert model["embedding"] == {"pooling": "mean", "dimensions": 64} and model["score_method"] == "similarity"
    shown = ollama.Client(host=mean_server.url, timeout=60).show(model["id"])
    assert shown.capabilities[0] == "completion" and "embedding" not in shown.capabilities
    _check_embeddings(mean_server, qwen3_dirs[1], lambda hidden: hidden.mean(axis=0))


def test_a_yes_no_rerankers_scores_are_transformers_probability_of_yes(reranker, qwen3_dirs):
    import torch
    import transformers

    path = qwen3_dirs[0]
    tok = _tokenizer(path)
    no_id, yes_id = (tok.encode(w).ids for w in ("no", "yes"))
    assert len(no_id) == len(yes_id) == 1, "the tokenizer has no single token for yes or no"
    assert [tok.encode(m).ids for m in ("<|im_start|>", "<|im_end|>")] == [[1], [2]]   # its specials, as specials
    query, documents = "Where is the cat?", ["The cat sat on the mat.", "yes", "A dog ran in the park.", "no no no"]
    status, body = http("POST", reranker.url + "/rerank", {"query": query, "documents": documents})
    assert status == 200, body
    scores = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert [r["relevance_score"] for r in body["results"]] == sorted(scores.values(), reverse=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    prompts = [tok.encode(judgement_prompt(query, d, DEFAULT_INSTRUCTION)).ids for d in documents]
    assert body["usage"]["total_tokens"] == sum(map(len, prompts))      # the server's tokens are these
    for k, ids in enumerate(prompts):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
        want = float(torch.softmax(logits[[no_id[0], yes_id[0]]], 0)[1])
        assert abs(scores[k] - want) <= FLOAT16_CACHE_LOGPROB_ATOL, (k, scores[k], want)
    spread = max(scores.values()) - min(scores.values())
    assert spread > 10 * FLOAT16_CACHE_LOGPROB_ATOL, scores            # (the documents are told apart)
    status, body = http("POST", reranker.url + "/score", {"text_1": query, "text_2": documents[0],
                                                          "instruction": "Find the cat"})
    ids = tok.encode(judgement_prompt(query, documents[0], "Find the cat")).ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    assert status == 200 and body["usage"]["prompt_tokens"] == len(ids)
    assert abs(body["data"][0]["score"] - float(torch.softmax(logits[[no_id[0], yes_id[0]]], 0)[1])) <= \
        FLOAT16_CACHE_LOGPROB_ATOL
