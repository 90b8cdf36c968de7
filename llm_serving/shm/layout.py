"""Every array the master and agents share for a step: name, dtype and shape, fixed at start from the config.

Rows are sequences in the step (row i of every array belongs to the same sequence); `max_rows` is the
largest batch any graph takes and `max_tokens` the largest prefill bucket's tokens per row. Nothing is
allocated per step: the master writes rows 0..n-1 (and, per row, tokens 0..s-1) and the step frame
says n and s.

  name           dtype    shape                              written by  meaning
  input_ids      int32    (max_rows, max_tokens)             master      new tokens per row, left-aligned
  positions      int32    (max_rows, max_tokens)             master      absolute position of each new token
  slot_mapping   int32    (max_rows, max_tokens)             master      KV slot per new token, -1 = padding
  block_tables   int32    (max_rows, max_blocks_per_seq)     master      KV block ids per row, in order
  context_lens   int32    (max_rows,)                        master      tokens in the cache after this step
  query_lens     int32    (max_rows,)                        master      valid new tokens per row (>= 1)
  temperature    float32  (max_rows,)                        master      0 = greedy
  top_k          int32    (max_rows,)                        master      0 = off
  top_p          float32  (max_rows,)                        master      1 = off
  random_u       float32  (max_rows,)                        master      uniform [0, 1) for sampling rows
  top_n          int32    (max_rows,)                        master      top log-probabilities wanted (0 = none)
  repetition_penalty float32 (max_rows,)                     master      1 = off; >1 discourages seen tokens
  presence_penalty   float32 (max_rows,)                     master      0 = off; per generated token seen
  frequency_penalty  float32 (max_rows,)                     master      0 = off; per occurrence in the output
  history        int32    (max_rows, max_context)            master      the row's tokens so far (prompt +
                                                                         output), kept only for rows with a
                                                                         penalty
  history_len    int32    (max_rows,)                        master      valid entries of history (0 = none)
  prompt_len     int32    (max_rows,)                        master      history[prompt_len:] is the output
  lora           int32    (max_rows,)                        master      LoRA adapter slot per row (0 = none)
  request_ids    int64    (max_rows,)                        master      request number per row (tracing,
                                                                         logits capture; not used by the model)
  out_token_ids  int32    (max_rows,)                        agent 0     sampled next token per row
  out_logprobs   float32  (max_rows,)                        agent 0     its log-probability
  out_top_ids    int32    (max_rows, TOP_LOGPROBS)           agent 0     most likely tokens, most likely first
  out_top_logprobs float32 (max_rows, TOP_LOGPROBS)          agent 0     their log-probabilities
                                                                         (written only in steps where a row
                                                                         has top_n > 0)
Verify steps (speculative decoding, master/speculative.py) sample after every new token of a row, not
only after its last; `max_verify` is the most tokens a speculating row feeds (1 + proposals), or the steps
of a decode run (scheduler_config.decode_steps, whose tokens come back in out_verify_*):
  verify_random_u  float32 (max_rows, max_verify)            master      uniform [0, 1) per new token of a
                                                                         sampling row
  verify_parent    int32    (max_rows, max_verify)           master      each new token's parent among its
                                                                         row's new tokens (-1 first; j-1: a
                                                                         chain; else a token tree)
  out_verify_ids   int32    (max_rows, max_verify)           agent 0     the token sampled after each new token
                                                                         (a decode run: each step's token)
  out_verify_logprobs float32 (max_rows, max_verify)         agent 0     its log-probability
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP_LOGPROBS = 20        # most top log-probabilities a request may ask for (OpenAI's limit)


@dataclass(frozen=True)
class ArraySpec:
    name: str
    dtype: type
    shape: tuple

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class StepLayout:
    max_rows: int
    max_tokens: int
    max_blocks_per_seq: int
    max_context: int = 0            # tokens a sequence may reach (history width)
    max_verify: int = 1             # tokens a speculating row feeds in a verify step, or steps of a decode run

    @classmethod
    def from_config(cls, config) -> "StepLayout":
        mc = config.model_config
        return cls(max_rows=max(mc.decode_batch_size[-1], mc.prefill_batch_size[-1]),
                   max_tokens=mc.seq_length[-1], max_blocks_per_seq=config.max_blocks_per_seq,
                   max_context=config.max_blocks_per_seq * config.pa_config.block_size,
                   max_verify=max(config.spec_config.tokens_per_row, config.scheduler_config.decode_steps))

    def arrays(self) -> list:
        r, t, w, c = self.max_rows, self.max_tokens, self.max_blocks_per_seq, max(self.max_context, 1)
        return [
            ArraySpec("input_ids", np.int32, (r, t)),
            ArraySpec("positions", np.int32, (r, t)),
            ArraySpec("slot_mapping", np.int32, (r, t)),
            ArraySpec("block_tables", np.int32, (r, w)),
            ArraySpec("context_lens", np.int32, (r,)),
            ArraySpec("query_lens", np.int32, (r,)),
            ArraySpec("temperature", np.float32, (r,)),
            ArraySpec("top_k", np.int32, (r,)),
            ArraySpec("top_p", np.float32, (r,)),
            ArraySpec("random_u", np.float32, (r,)),
            ArraySpec("top_n", np.int32, (r,)),
            ArraySpec("repetition_penalty", np.float32, (r,)),
            ArraySpec("presence_penalty", np.float32, (r,)),
            ArraySpec("frequency_penalty", np.float32, (r,)),
            ArraySpec("history", np.int32, (r, c)),
            ArraySpec("history_len", np.int32, (r,)),
            ArraySpec("prompt_len", np.int32, (r,)),
            ArraySpec("lora", np.int32, (r,)),
            ArraySpec("request_ids", np.int64, (r,)),
            ArraySpec("out_token_ids", np.int32, (r,)),
            ArraySpec("out_logprobs", np.float32, (r,)),
            ArraySpec("out_top_ids", np.int32, (r, TOP_LOGPROBS)),
            ArraySpec("out_top_logprobs", np.float32, (r, TOP_LOGPROBS)),
            ArraySpec("verify_random_u", np.float32, (r, self.max_verify)),
            ArraySpec("verify_parent", np.int32, (r, self.max_verify)),
            ArraySpec("out_verify_ids", np.int32, (r, self.max_verify)),
            ArraySpec("out_verify_logprobs", np.float32, (r, self.max_verify)),
        ]

    # The arrays a step's model work reads (what every tensor-parallel rank needs; only rank 0's sampler reads
    # the penalty arrays, only its logits capture the request ids): token arrays, per-row arrays, and a verify step's arrays.
    TOKEN_INPUTS = ("input_ids", "positions", "slot_mapping")
    ROW_INPUTS = ("context_lens", "query_lens", "temperature", "top_k", "top_p", "random_u", "top_n", "lora")
    VERIFY_INPUTS = ("verify_random_u", "verify_parent")

    def step_inputs(self, n: int, s: int, verify: bool = False, run_steps: int = 1) -> list:
        """(array name, index) of every part of the buffers a step of n rows and s new tokens per row (a
        verify step, or a decode run of run_steps steps) reads for its model work, in a fixed order: what
        rank 0 broadcasts to ranks on other nodes (models/parallel.py). All are 4-byte types."""
        width = max(s, run_steps)                 # a decode run's slot_mapping holds a slot per step
        parts = [(name, (slice(0, n), slice(0, width))) for name in self.TOKEN_INPUTS]
        parts.append(("block_tables", (slice(0, n), slice(None))))
        parts += [(name, (slice(0, n),)) for name in self.ROW_INPUTS]
        if verify:
            parts += [(name, (slice(0, n), slice(0, s))) for name in self.VERIFY_INPUTS]
        return parts

    def step_inputs_size(self, n: int, s: int, verify: bool = False, run_steps: int = 1) -> int:
        """4-byte words in step_inputs(...)'s parts together."""
        width = max(s, run_steps)
        return n * (3 * width + self.max_blocks_per_seq + len(self.ROW_INPUTS) + (2 * s if verify else 0))

    @property
    def max_step_inputs_size(self) -> int:
        """The most words any step's inputs take."""
        return max(self.step_inputs_size(self.max_rows, self.max_tokens),
                   self.step_inputs_size(self.max_rows, self.max_verify, verify=True),
                   self.step_inputs_size(self.max_rows, 1, run_steps=self.max_verify))
