"""The request bodies of embeddings, rerank and score: OpenAI's `POST /v1/embeddings` (with vLLM's
`truncate_prompt_tokens`), the Jina/Cohere rerank body vLLM serves at `/v1/rerank`, `/rerank` and `/v2/rerank`, and
vLLM's `/score`. Every rule about their shape is here; what needs the served model (token ids below its vocabulary,
an input's length against the context, the widths its embeddings may be cut to, whether it can pool or judge) is the
routes' (server/routes_embeddings.py, server/embedding.py)."""
from __future__ import annotations

from typing import Annotated, List, Literal, Optional, Union

from pydantic import ConfigDict, Field, field_validator, model_validator

from llm_serving.server.api.base import BASE_MODEL, DIMENSIONS, TOKEN_ID, Body, rules, when
from llm_serving.server.errors import ValidationError

MAX_INPUTS = 2048           # OpenAI's: inputs of one embeddings request
MAX_DOCUMENTS = 1000        # Cohere's: documents of one rerank (and pairs of one score)
# Qwen3-Reranker's instruction when a request gives none
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

_TEXT = {"type": "string", "minLength": 1}
_IDS = {"type": "array", "items": TOKEN_ID, "minItems": 1}
NonEmpty = Annotated[str, Field(min_length=1)]
_INSTRUCTION = ("the judgement prompt's instruction (a yes_no reranker's: Qwen3-Reranker's <Instruct>; default "
                f"{DEFAULT_INSTRUCTION!r}); a similarity score does not read it")


class EmbeddingRequest(Body):
    """POST /v1/embeddings: each input embedded by the served model's pooling (GET /v1/models), L2-normalized."""
    model: str = Field(min_length=1, description="the served model's id (LoRA adapters do not embed)",
                       json_schema_extra=BASE_MODEL)
    input: Union[str, List[str], List[int], List[List[int]]] = Field(
        description=f"a string, a list of strings, token ids, or a list of token-id lists (at most {MAX_INPUTS} "
                    "inputs, none empty)",
        json_schema_extra={"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_INPUTS},
                                     _IDS, {"type": "array", "items": _IDS, "minItems": 1, "maxItems": MAX_INPUTS}]})
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes, base64-encoded (the openai SDK's "
                             "default, which it decodes)")
    dimensions: Optional[int] = Field(None, ge=1, le=1 << 20, description="a Matryoshka model's width to cut the "
                                      "vectors to (normalized again); any other model only its own",
                                      json_schema_extra=DIMENSIONS)
    user: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = Field(
        None, ge=-1, le=1 << 20, description="vLLM's: keep each input's last this many tokens (-1: as many as the "
                                             "context takes)", json_schema_extra={"not": {"const": 0}})

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        if isinstance(value, str):
            if value:
                return value
        elif value and all(isinstance(v, int) for v in value):
            if all(v >= 0 for v in value):
                return value
        elif value and len(value) <= MAX_INPUTS and all(value):
            if all(isinstance(v, str) or all(t >= 0 for t in v) for v in value):
                return value
        raise ValidationError(f"'input' must be a non-empty string, a list of 1 to {MAX_INPUTS} non-empty strings, "
                              "a non-empty list of token ids (>= 0), or a list of such lists", param="input")

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, value):
        if value == 0:
            raise ValidationError("truncate_prompt_tokens must be >= 1, or -1 (the context's length)",
                                  param="truncate_prompt_tokens")
        return value

    def inputs(self) -> list:
        """The inputs, each a string or a list of token ids."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        return list(self.input)


class RerankDocument(Body):
    """A document as Jina's clients send it: {"text": ...}."""
    text: str = Field(min_length=1)


class RerankRequest(Body):
    """POST /v1/rerank, /rerank (Jina's and Cohere's body, as vLLM serves it): the documents by their relevance to the
    query, most relevant first."""
    model: Optional[str] = Field(None, description="the served model's id (default: it)", json_schema_extra=BASE_MODEL)
    query: str = Field(min_length=1)
    documents: List[Union[NonEmpty, RerankDocument]] = Field(min_length=1, max_length=MAX_DOCUMENTS,
                                                             description="strings, or objects with `text`")
    top_n: Optional[int] = Field(None, ge=0, le=MAX_DOCUMENTS, description="the results to return, the best; "
                                                                          "null or 0: all")
    return_documents: bool = Field(True, description="each result carries its document's text")
    instruction: Optional[str] = Field(None, min_length=1, description=_INSTRUCTION)

    def texts(self) -> list:
        return [d.text if isinstance(d, RerankDocument) else d for d in self.documents]


class CohereRerankRequest(RerankRequest):
    """POST /v2/rerank: as /v1/rerank, but its results are Cohere's v2: each result's index and relevance_score, its
    document only when `return_documents` is true (Cohere's v2 API has no such field and never returns them; the
    field is kept for the clients that send it)."""
    return_documents: bool = Field(False, description="each result carries its document's text (Cohere's v2: not "
                                                      "unless asked)")


class ScoreRequest(Body):
    """POST /score, /v1/score (vLLM's): text_1 against each text_2, or pairwise when both are lists of one length."""
    model_config = ConfigDict(json_schema_extra=rules(
        when("text_1", {"type": "array", "minItems": 2}, {"properties": {"text_2": {"type": "array",
                                                                                    "minItems": 2}}})))
    model: Optional[str] = Field(None, description="the served model's id (default: it)", json_schema_extra=BASE_MODEL)
    text_1: Union[str, List[str]] = Field(
        description="a string (the query), or a list: of one, scored against each text_2, or as long as text_2, "
                    "scored pairwise",
        json_schema_extra={"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1,
                                             "maxItems": MAX_DOCUMENTS}]})
    text_2: Union[str, List[str]] = Field(
        description="a string or a list (the documents)",
        json_schema_extra={"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "minItems": 1,
                                             "maxItems": MAX_DOCUMENTS}]})
    instruction: Optional[str] = Field(None, min_length=1, description=_INSTRUCTION)

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts(cls, value, info):
        items = [value] if isinstance(value, str) else value
        if not items or len(items) > MAX_DOCUMENTS or not all(items):
            raise ValidationError(f"{info.field_name} must be a non-empty string or a list of 1 to {MAX_DOCUMENTS} "
                                  "non-empty strings", param=info.field_name)
        return value

    @model_validator(mode="after")
    def _pairs(self):
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(first) > 1 and len(first) != len(second):
            raise ValidationError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 (scored "
                                  "against each text_2) or as many as text_2 (scored pairwise)", param="text_2")
        return self

    def pairs(self) -> list:
        """[(text_1, text_2)] in the reply's order."""
        first = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        second = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        return [(first[0] if len(first) == 1 else first[k], t) for k, t in enumerate(second)]


ROUTES = [("/v1/embeddings", EmbeddingRequest, "OpenAI embeddings: the served model's pooling, normalized"),
          ("/v1/rerank", RerankRequest, "rerank (Jina's and Cohere's shape): documents by relevance to a query"),
          ("/rerank", RerankRequest, "rerank, as /v1/rerank"),
          ("/v2/rerank", CohereRerankRequest, "rerank (Cohere's v2): as /v1/rerank, its results without their "
                                              "documents unless return_documents is true"),
          ("/score", ScoreRequest, "vLLM: the relevance of text pairs"),
          ("/v1/score", ScoreRequest, "vLLM: the relevance of text pairs, as /score")]
