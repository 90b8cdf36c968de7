"""Response shapes (TGI's, which llm-serving clients also read): one SSE `data:` event per token, and a
final event carrying the whole text and the details."""
from __future__ import annotations

import json
from typing import Optional

from llm_serving.master.request import Request, TokenEvent


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode("utf-8") + b"\n\n"


def details(req: Request, finish_reason: Optional[str], message: Optional[str] = None) -> dict:
    """TGI's details of a finished request; `finish_message` says why when the engine says (a grammar that could not
    go on ends with "length" and the limit it hit)."""
    out = {"finish_reason": finish_reason, "generated_tokens": len(req.output_ids),
           "prompt_tokens": len(req.prompt_ids), "seed": req.seed if not req.sampling.greedy else None}
    if message:
        out["finish_message"] = message
    return out


def token_details(event: TokenEvent, tokenizer) -> dict:
    """TGI's entry of one generated token in `details.tokens`."""
    return {"id": event.token_id, "text": tokenizer.token_text(event.token_id), "logprob": event.logprob,
            "special": event.special}


def top_tokens(event: TokenEvent, tokenizer) -> list:
    """TGI's `top_tokens` of one step: the most likely tokens, most likely first."""
    return [{"id": i, "text": tokenizer.token_text(i), "logprob": lp, "special": tokenizer.is_special(i)}
            for i, lp in event.top or ()]


def token_event(event: TokenEvent, generated_text: Optional[str], req: Request, tokenizer=None) -> dict:
    token = None
    if event.token_id >= 0:
        token = {"id": event.token_id, "text": event.text, "logprob": event.logprob, "special": event.special}
    final = event.finish_reason is not None
    out = {"token": token,
           "generated_text": generated_text if final else None,
           "details": details(req, event.finish_reason, event.error) if final else None}
    if req.sampling.top_logprobs and tokenizer is not None:
        out["top_tokens"] = top_tokens(event, tokenizer)
    return out


def prefill_details(req: Request, tokenizer) -> list:
    """TGI's `details.prefill` (decoder_input_details): each prompt token with its log-probability given the ones
    before it (null for the first)."""
    scores = req.prompt_scores or [None] * len(req.prompt_ids)
    return [{"id": t, "text": tokenizer.token_text(t), "logprob": None if s is None else s.logprob}
            for t, s in zip(req.prompt_ids, scores)]


def vllm_prompt_logprobs(req: Request, tokenizer) -> list:
    """vLLM's `prompt_logprobs`: per prompt position null (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's token there and the top ones asked for."""
    out: list = []
    for token, score in zip(req.prompt_ids, req.prompt_scores or [None] * len(req.prompt_ids)):
        if score is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": score.logprob, "rank": score.rank, "decoded_token": tokenizer.token_text(token)}}
        for rank, (i, lp) in enumerate(score.top, 1):
            entry.setdefault(str(i), {"logprob": lp, "rank": rank, "decoded_token": tokenizer.token_text(i)})
        out.append(entry)
    return out


def error_body(message: str, error_type: str) -> dict:
    return {"error": message, "error_type": error_type}


def failed_body(req: Request, message: str) -> dict:
    """A request that ended with finish_reason "error" (its agent failed): TGI's error shape plus the details,
    so clients that read either see why and how far it got."""
    return {**error_body(message, "generation"), "details": details(req, "error")}


def openai_error_body(message: str, error_type: str, param=None, code=None) -> dict:
    """OpenAI's error shape (its clients read error.type, error.param and error.code)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
