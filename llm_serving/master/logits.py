"""A request's logit controls on the master's side (`LogitsState`, made by the engine for a request whose
sampling controls its logits): before each step that samples its next token, the row's token mask (its grammar's
next tokens, ANDed with `allowed_token_ids`) and bias entries (`logit_bias`; bans: single-token bad words, the
last token of a bad word whose beginning the output ends with, stop tokens before `min_tokens`), written into
the step buffers (`write`, through step_io.RowWriter); after it, the token it got (`accept`), which advances the
grammar's matcher. The agent applies them (models/logit_controls.py) before sampling or the greedy pick.

A grammar that hits one of llguidance's limits (master/grammar.py: `limits`) computing a mask or taking a token,
or that no token can continue, cannot go on through no fault of the server: the state keeps why (`cut_short`) and
the request ends there with finish reason "length" (its output stops short of the grammar's end, as at max_tokens)
and that message. Any other failure (`error`: a token the grammar refuses although its mask allowed it) ends it
with "error"."""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from llm_serving.master.grammar import GrammarError, one_line, why_stuck
from llm_serving.master.request import SamplingParams
from llm_serving.shm.layout import BAN_BIAS, MAX_LOGIT_BIAS

__all__ = ["LogitsState", "bits_of", "fill_masks"]

_executor = None


def fill_masks(rows: list, token_mask: np.ndarray) -> None:
    """The next-token bitmasks of [(grammar matcher, row)] into rows of `token_mask` (int32, (rows, words)), on
    llguidance's threads (they release the GIL; a step's rows in parallel)."""
    global _executor
    from llguidance import LLExecutor
    from llguidance.numpy import fill_next_token_bitmask_par

    if _executor is None:
        _executor = LLExecutor(num_threads=max(2, min(8, os.cpu_count() or 1)))
    fill_next_token_bitmask_par(_executor, rows, token_mask)


def bits_of(tokens, vocab_size: int) -> np.ndarray:
    """The bitmask (int32 words, llguidance's layout: bit t % 32 of word t // 32) that allows exactly `tokens`."""
    bits = np.zeros(((vocab_size + 31) // 32) * 32, np.uint8)
    bits[np.asarray(list(tokens), np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


class LogitsState:
    """One request's logit controls as its output grows (see the module docstring). `matcher`: its grammar's
    llguidance matcher (master/grammar.py), None without a grammar."""

    @classmethod
    def of_request(cls, sampling: SamplingParams, grammars, stop_token_ids, compiled=None) -> Optional["LogitsState"]:
        """A request's state, or None when its sampling controls no logits. `grammars`: the engine's (None: started
        without the vocabulary size, which controls need: GrammarError); `stop_token_ids`: the model's end tokens,
        which stop unless the request ignores them; `compiled`: its grammar's matcher as the engine compiled it
        (copied, one per request), else compiled now (a cache hit as a rule)."""
        if not sampling.controls_logits:
            return None
        if grammars is None:
            raise GrammarError("logit controls and structured outputs need the model's vocabulary size, which this "
                               "server was started without (model_config.vocab_size)")
        stop = frozenset() if sampling.ignore_eos else frozenset(stop_token_ids)
        matcher = None
        if sampling.grammar is not None:
            matcher = compiled.deep_copy() if compiled is not None else grammars.compile_now(sampling.grammar)
        return cls(sampling, stop | set(sampling.stop_token_ids), grammars.vocab_size, matcher)

    def __init__(self, sampling: SamplingParams, stop_token_ids, vocab_size: int, matcher=None):
        self.matcher = matcher
        self.allowed = bits_of(sampling.allowed_token_ids, vocab_size) if sampling.allowed_token_ids else None
        bias: dict = {}
        for token, value in sampling.logit_bias:
            bias[int(token)] = bias.get(int(token), 0.0) + float(value)
        self.bad_prefixes = []              # (the tokens before, the token banned after them)
        for word in sampling.bad_words:
            if len(word) == 1:
                bias[word[0]] = BAN_BIAS
            else:
                self.bad_prefixes.append((tuple(word[:-1]), word[-1]))
        self.bias = bias
        self.min_tokens = sampling.min_tokens
        self.stop_ids = sorted(stop_token_ids)
        self.error: Optional[str] = None       # the request fails ("error")
        self.cut_short: Optional[str] = None   # its grammar cannot go on: the output ends ("length")

    @property
    def masked(self) -> bool:
        return self.matcher is not None or self.allowed is not None

    def write(self, mask_row: np.ndarray, output_ids: list, filled: bool = False) -> tuple:
        """Before a step that samples the request's next token: its mask into `mask_row` (a view of its row of
        the step's token_mask) when it has one (`filled`: its grammar's part is there already, `fill_masks`);
        returns (masked, bias ids, bias values)."""
        if self.matcher is not None:
            if not filled:
                fill_masks([(self.matcher, 0)], mask_row.reshape(1, -1))
            if self.matcher.is_error():      # (its mask then allows EOS only: the token sampled is not kept)
                self._failed("its grammar could not compute the next token's mask")
            if self.allowed is not None:
                mask_row &= self.allowed
                if self.cut_short is None and not mask_row.any():   # (the token sampled under it is not kept)
                    self.cut_short = ("the output stopped where its grammar could not go on: no token of "
                                      "allowed_token_ids continues it here")
        elif self.allowed is not None:
            mask_row[:] = self.allowed
        bias = self.bias
        if len(output_ids) < self.min_tokens or self.bad_prefixes:
            bias = dict(bias)
            if len(output_ids) < self.min_tokens:
                for token in self.stop_ids:
                    bias[token] = BAN_BIAS
            for prefix, last in self.bad_prefixes:
                k = len(prefix)
                if len(output_ids) >= k and tuple(output_ids[len(output_ids) - k:]) == prefix:
                    bias[last] = BAN_BIAS
        if len(bias) > MAX_LOGIT_BIAS:      # (the routes keep a request well below)
            raise ValueError(f"a row's logits get at most {MAX_LOGIT_BIAS} bias entries, this one {len(bias)}")
        return self.masked, list(bias), list(bias.values())

    def accept(self, token_id: int) -> bool:
        """The token the request got; False (and `error` says why) when its grammar does not allow it."""
        if self.matcher is None:
            return True
        if not self.matcher.consume_token(int(token_id)):
            self._failed(f"the grammar does not allow token {token_id} here")
            return False
        return True

    def _failed(self, what: str) -> None:
        """The matcher is in its error state: keep why, as the grammar's own end (`cut_short`) or as an error."""
        message = self.matcher.get_error()
        stuck = why_stuck(message)
        if stuck is not None:
            self.cut_short = f"the output stopped where its grammar could not go on: {stuck}"
        else:
            self.error = f"{what}: {one_line(message) or 'no token was allowed'}"

    @property
    def complete(self) -> bool:
        """The grammar is matched and takes no more tokens: the request ends here."""
        return self.matcher is not None and self.matcher.is_stopped()
