"""A request's state as the master sees it: tokens, progress through the KV cache, sampling, stream."""
from __future__ import annotations

import asyncio
import enum
import itertools
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.master.stop import StopStrings

_req_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # has KV blocks and takes part in steps
    FINISHED = "finished"


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0           # 0 = greedy
    top_k: int = 0                     # 0 = off
    top_p: float = 1.0                 # 1 = off
    seed: Optional[int] = None
    ignore_eos: bool = False            # EOS does not end the request (stop_token_ids still do)
    stop: tuple = ()                    # stop strings: the text ends before the first one that appears
    stop_token_ids: tuple = ()          # more tokens that end the request, on top of the model's EOS
    top_logprobs: int = 0               # also return this many most likely tokens per step (<= TOP_LOGPROBS)
    repetition_penalty: float = 1.0     # HF/TGI: >1 discourages every token already in prompt or output
    presence_penalty: float = 0.0       # OpenAI: subtracted once from tokens present in the output
    frequency_penalty: float = 0.0      # OpenAI: subtracted per occurrence in the output
    speculative: bool = True            # may decode speculatively when the server does (spec_config)
    skip_special_tokens: bool = True    # the streamed text leaves special tokens out (vLLM's; a harmony reply keeps
                                        # them: server/harmony.py reads its channels by them)
    # logit controls (master/logits.py writes them per step; the agent applies them before the pick)
    min_p: float = 0.0                  # 0 = off; a sampling row keeps tokens at least min_p x the likeliest's probability
    min_tokens: int = 0                 # stop tokens are banned until the output has this many tokens
    logit_bias: tuple = ()              # ((token id, bias added to its logit), ...)
    allowed_token_ids: tuple = ()       # () = all; else the only tokens the request may pick
    bad_words: tuple = ()               # token id sequences the output never contains
    grammar: Optional[object] = None    # master.grammar.GrammarSpec: what the output must match (structured outputs)
    prompt_logprobs: Optional[int] = None   # None = off; else each prompt token's log-probability (given the ones
                                            # before it) with this many top ones (<= TOP_LOGPROBS)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def controls_logits(self) -> bool:
        """The master writes a mask or bias entries for the request's rows (master/logits.py)."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.min_tokens
                    or self.grammar is not None)

    @property
    def adjusts_logits(self) -> bool:
        """The token is picked from changed logits (penalties, logit controls, min_p): the request's rows take
        no part in decode runs or speculation, whose steps pick from the model's own."""
        return self.penalized or self.controls_logits or self.min_p > 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PromptImage:
    """An image in a request's prompt: its `length` placeholder tokens from `start` on, its content `key` (the
    prefix cache's and the agents' encoded-image cache's), and the shared memory holding its pixels (the engine's:
    shm/images.py's PixelSegment, whose `name` and `shape` the step frame carries). `rope_advance`: how much
    further the RoPE positions of the tokens after it are than their places (multimodal RoPE: an image of
    rows x cols tokens advances them by max(rows, cols), not by its token count; 0 elsewhere)."""
    start: int
    length: int
    key: str
    pixels: object
    rope_advance: int = 0


@dataclass
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it, its rank (1 = the likeliest) and the top
    tokens there [(token id, logprob)], most likely first."""
    logprob: float
    rank: int
    top: list


@dataclass
class TokenEvent:
    """One generated token as streamed to the client; `finish_reason` is set on the last one."""

    token_id: int
    text: str
    logprob: float
    special: bool
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    top: Optional[list] = None          # [(token id, logprob)], most likely first, when the request asked


class Request:
    """Tokens so far are prompt_ids + output_ids (num_tokens); the first num_computed_tokens are in the
    KV cache. A step feeds some of tokens [num_computed_tokens, num_tokens) (all of them unless a long
    prompt is chunked) and samples one new token when it reaches the end, so a fresh prompt, a chunk, a
    decode and a preempted request's recompute are the same operation."""

    def __init__(self, prompt_ids: list, sampling: SamplingParams, stop_token_ids: frozenset,
                 req_id: Optional[str] = None, lora_slot: int = 0, lora_root: int = 0,
                 lora_adapter: Optional[str] = None, pooling: Optional[str] = None):
        self.number = next(_req_counter)     # unique in this master; written to shm per row (request_ids)
        self.req_id = req_id or f"req-{self.number}"
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list = []
        self.output_logprobs: list = []
        self.sampling = sampling
        self.lora_adapter = lora_adapter     # its LoRA adapter's name (None: the base model)
        self.lora_slot = lora_slot           # the agents' slot of that adapter (0: the base model; -1: not
                                             # loaded yet: the request is not admitted until it is)
        self.lora_root = lora_root           # its adapter's prefix-cache root (unique per load; 0: the base model)
        self.stop_token_ids = (frozenset() if sampling.ignore_eos else stop_token_ids) | set(sampling.stop_token_ids)
        self.stop_strings = StopStrings(sampling.stop) if sampling.stop else None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0           # tokens whose KV came from the prefix cache (summed over admissions)
        self.num_draft_computed = 0          # tokens in the draft model's KV cache (speculative decoding)
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.arrival_time = time.monotonic()
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.num_preemptions = 0
        self.events: asyncio.Queue = asyncio.Queue()
        self.logits = None                   # master.logits.LogitsState when sampling.controls_logits (the engine's)
        # sampling.prompt_logprobs: per prompt position (None for the first) a PromptLogprob, as prefill steps score them
        self.prompt_scores: Optional[list] = None if sampling.prompt_logprobs is None else [None] * len(prompt_ids)
        self.seed = sampling.seed if sampling.seed is not None else int(np.random.SeedSequence().entropy % (1 << 63))
        # an embedding request (models/pooling.py's pooling: mean, last or cls; None: generation): its input is fed
        # and its final hidden states pooled (embed steps), nothing generated; `embedding` is the normalized result
        self.pooling = pooling
        self.pooled: Optional[np.ndarray] = None      # the pooled state so far (float64; mean: the sum)
        self.embedding: Optional[np.ndarray] = None   # float32, unit norm, set when the request ends with "stop"
        # images in the prompt (PromptImage's, in order): where their placeholder tokens are, what they are
        self.images: tuple = ()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens this request feeds in its next step."""
        return self.num_tokens - self.num_computed_tokens

    def token_at(self, index: int) -> int:
        p = len(self.prompt_ids)
        return self.prompt_ids[index] if index < p else self.output_ids[index - p]

    def cache_tokens(self, start: int, stop: int) -> list:
        """tokens(start, stop) as the prefix cache keys them: an image's placeholder tokens as (its content key, its
        index) each, so the same tokens around another image never share its KV."""
        out = self.tokens(start, stop)
        for image in self.images:
            a, b = max(start, image.start), min(stop, image.start + image.length)
            for k in range(a, b):
                out[k - start] = (image.key, k - image.start)
        return out

    def image_at(self, start: int, stop: int) -> list:
        """The images whose placeholders tokens start..stop-1 hold some of."""
        return [image for image in self.images if image.start < stop and start < image.start + image.length]

    def rope_delta(self, position: int) -> int:
        """What the RoPE position of the token at `position` adds to it: the rope_advance of every image that ends
        before it (multimodal RoPE; 0 for the other families and for a prompt without images)."""
        return sum(image.rope_advance for image in self.images if image.start + image.length <= position)

    def tokens(self, start: int, stop: int) -> list:
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[max(start - p, 0):stop - p]

    def random_u(self, ahead: int = 0) -> float:
        """The uniform number that samples output token number len(output_ids) + ahead: a function of the seed
        and the index only, so seeded output does not depend on batching, bucket, preemption or speculation."""
        return float(np.random.default_rng((self.seed, len(self.output_ids) + ahead)).random())

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
