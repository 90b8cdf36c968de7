"""One streaming request against a server, timed token by token.

Backends (all streaming, greedy):
- `llm-serving`: POST {url}/models/{model}/generate  {"inputs", "parameters", "stream": true}; one SSE event
  per token (`token` not null), a final event with `generated_text`, or `{"error"}`;
- `tgi`: POST {url}/generate_stream, the same event shapes (TGI's, which this project's server also speaks);
- `openai`: POST {url}/v1/completions {"model", "prompt", "max_tokens", "stream": true, ...}; chunks with
  `choices[0].text`, ended by `data: [DONE]`; `usage.completion_tokens` is used when the server sends it
  (vLLM, llama.cpp's server). `ignore_eos` is sent as the vLLM/llama.cpp extension field.

Output tokens are counted from the stream: one per token event (llm-serving, TGI) or one per non-empty
text chunk unless usage says otherwise (OpenAI). With ignore_eos, a request that did not produce exactly
max_new_tokens is a failure, so runs stay comparable.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import aiohttp

from .workload import Sample

BACKENDS = ("llm-serving", "tgi", "openai")


@dataclass
class RequestResult:
    prompt_len: int
    max_new_tokens: int
    send_time: float = 0.0           # seconds since the run started
    ok: bool = False
    error: Optional[str] = None
    ttft: Optional[float] = None     # seconds from send to the first token
    latency: Optional[float] = None  # seconds from send to the end of the stream (E2EL)
    output_tokens: int = 0
    itl: list = field(default_factory=list)          # gaps between successive token chunks, seconds
    token_times: list = field(default_factory=list)  # arrival of each token chunk, seconds since the run started

    @property
    def tpot(self) -> Optional[float]:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


def _payload(backend: str, model: Optional[str], sample: Sample, ignore_eos: bool) -> tuple:
    if backend == "openai":
        body = {"model": model, "prompt": sample.prompt, "max_tokens": sample.max_new_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if ignore_eos:
            body["ignore_eos"] = True
        return "/v1/completions", body
    params = {"max_new_tokens": sample.max_new_tokens, "do_sample": False}
    if ignore_eos:
        params["ignore_eos"] = True
    if backend == "tgi":
        return "/generate_stream", {"inputs": sample.prompt, "parameters": params}
    return f"/models/{model}/generate", {"inputs": sample.prompt, "parameters": params, "stream": True}


def _error_text(payload) -> Optional[str]:
    err = payload.get("error") if isinstance(payload, dict) else None
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def send(session: aiohttp.ClientSession, backend: str, url: str, model: Optional[str], sample: Sample,
               *, ignore_eos: bool, t0: float) -> RequestResult:
    """Send one request; never raises for server or network failures (they land in `error`)."""
    res = RequestResult(sample.prompt_len, sample.max_new_tokens)
    path, body = _payload(backend, sample.model or model, sample, ignore_eos)
    start = time.perf_counter()
    res.send_time = start - t0
    last = None
    usage_tokens = None
    try:
        async with session.post(url.rstrip("/") + path, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                res.error = f"HTTP {resp.status}: {text}"
                return res
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        payload = json.loads(data)
                        err = _error_text(payload)
                        if err is not None:
                            res.error = f"server error mid-stream: {err}"
                            return res
                        if backend == "openai":
                            if payload.get("usage") and payload["usage"].get("completion_tokens") is not None:
                                usage_tokens = int(payload["usage"]["completion_tokens"])
                            choices = payload.get("choices") or []
                            n = 1 if choices and choices[0].get("text") else 0
                        else:
                            n = 1 if payload.get("token") is not None else 0
                        if n:
                            now = time.perf_counter()
                            if last is None:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
                            res.token_times.append(now - t0)
                            res.output_tokens += n
        res.latency = time.perf_counter() - start
        if usage_tokens is not None:
            res.output_tokens = usage_tokens
        if res.output_tokens == 0:
            res.error = "the stream ended without a token"
        elif ignore_eos and res.output_tokens != sample.max_new_tokens:
            res.error = (f"expected {sample.max_new_tokens} output tokens (ignore_eos), "
                         f"got {res.output_tokens}")
        else:
            res.ok = True
    except aiohttp.ClientConnectorError as e:
        res.error = f"cannot connect to {url}: {e.os_error or e}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except json.JSONDecodeError as e:
        res.error = f"malformed event in the stream: {e}"
    return res
