"""Every array the master and agents share for a step, declared once (`ARRAYS`): name, dtype, shape class, who
writes it, who reads it, and what it means. Fixed at start from the config; nothing is allocated per step.

Rows are sequences in the step (row i of every array belongs to the same sequence); `max_rows` is the
largest batch any graph takes and `max_tokens` the largest prefill bucket's tokens per row. The master writes
rows 0..n-1 (and, per row, tokens 0..s-1) and the step frame says the step's kind, n and s (and a decode
run's steps k). Both sides read and write a step through a `StepView` (`StepBuffers.view`): the arrays by
name, sliced to the step's rows and tokens by their shape class:

  shape class  shape                              a step's part
  token        (max_rows, max_tokens)             [:n, :max(s, k)]
  row          (max_rows,)                        [:n]
  table        (max_rows, max_blocks_per_seq)     [:n]
  history      (max_rows, max_context)            [:n]
  verify       (max_rows, max_verify)             [:n, :max(s, k)]  (inputs: verify steps only)
  top          (max_rows, TOP_LOGPROBS)           [:n]
  mask         (max_rows, ceil(vocab_size / 32))  [:n]   (a bit per token of the model's vocabulary)
  bias         (max_rows, MAX_LOGIT_BIAS)         [:n]
  token_top    (max_prefill_rows, max_tokens, TOP_LOGPROBS)  [:n, :s]   (prefill steps only)
  hidden       (max_rows, hidden_size)            [:n]   (embedding steps: a row's pooled hidden state)
  flag         (1,)                               [:1]   (one value for the step)

Readers: `model` arrays are read by every rank's model work (what rank 0 broadcasts to ranks on other nodes,
`step_inputs`); `sampler` arrays by rank 0's sampler only; `trace` arrays by no model (tracing, logits
capture); `master` arrays are outputs, written by rank 0. All are 4-byte types but request_ids.

Logit controls (a row's token mask and bias entries) are the one part written after the step frame is sent: the
master computes them while the agents run the model, and a row's sampler waits for `controls_pending` to fall to 0
before it reads them (models/logit_controls.py); `controls_on` and everything else is written before the frame.

Verify steps (speculative decoding, master/speculative/) sample after every new token of a row, not
only after its last; `max_verify` is the most tokens a speculating row feeds (1 + proposals), or the steps
of a decode run (scheduler_config.decode_steps, whose tokens come back in out_verify_*). A verify row's
verify_parent is j-1 for token j along a chain, and a token tree's parent index otherwise; a decode run's
slot_mapping holds a slot per step, -1 once the row sits the rest of the run out.

The window pool (pa_config.window_blocks > 0, a model with sliding-window layers): the sliding layers keep their
K/V in a cache of their own, whose blocks a row holds only while its window needs them (master/block_manager.py).
window_tables and window_slots are that cache's block_tables and slot_mapping, written like them (a decode run's
window_slots a slot per step too); a row's table entries for blocks its window has left are stale, and no
kernel reads them. With the pool off they are not written, and every layer reads block_tables and slot_mapping.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

TOP_LOGPROBS = 20        # most top log-probabilities a request may ask for (OpenAI's limit)
MAX_LOGIT_BIAS = 1024    # most (token, bias) entries a row's logits get in a step (logit_bias, bans)
BAN_BIAS = -1.0e30       # a bias that keeps a token from being picked (finite: a row all of whose tokens are
                         # banned still has a softmax)


class StepKind(str, enum.Enum):
    """What a step does; set once by the scheduler (ScheduledBatch.kind), carried in the step frame, and
    handled per kind on each side (a `{kind: handler}` table in the engine, the worker and the runner)."""
    PREFILL = "prefill"         # some row feeds more than one token of its own; each row samples after its last
    DECODE = "decode"           # one token per row
    VERIFY = "verify"           # speculative decoding: rows feed proposals too, a token is sampled after each
    DECODE_RUN = "decode_run"   # `steps` greedy decode steps in one graph, each row's token fed to the next
    EMBED = "embed"             # embedding requests' inputs, fed whole: each row's final hidden states pooled into
                                # out_pooled (models/pooling.py), nothing sampled; their KV is not kept after

    @classmethod
    def of_rows(cls, max_query_len: int) -> "StepKind":
        """A plain step's kind from its widest row: a prefill graph when some row feeds more than one token of its
        own, else a decode step (the scheduler's steps and the draft model's alike)."""
        return cls.PREFILL if max_query_len > 1 else cls.DECODE

    @property
    def per_token_outputs(self) -> bool:
        """Its outputs are per new token (verify) or per step (decode run), in out_verify_*."""
        return self in (StepKind.VERIFY, StepKind.DECODE_RUN)

    @property
    def stats_name(self) -> str:
        """The name its steps are counted under in /stats (a decode run counts as a decode step)."""
        return "decode" if self is StepKind.DECODE_RUN else self.value


# Lower runs first in an agent's queue: control commands (0) before prefill (new requests' first token)
# before decode; a verify step is the decode step of speculating requests, a decode run a few decode steps.
STEP_PRIORITY = {StepKind.PREFILL: 1, StepKind.EMBED: 1, StepKind.DECODE: 2, StepKind.VERIFY: 2,
                 StepKind.DECODE_RUN: 2}


@dataclass(frozen=True)
class ArrayDecl:
    """One step array: name, dtype, shape class (see the module docstring), who writes it (the master, or
    rank 0 of the agents: `agent0`), who reads it (model, sampler, trace, master) and what it holds."""
    name: str
    dtype: type
    shape_class: str
    writer: str
    reader: str
    meaning: str

    @property
    def is_input(self) -> bool:
        return self.writer == "master"


# The declarations, one array a line: name, dtype, shape class, writer, reader, meaning.
_DECLARED = """
input_ids            int32    token    master   model    new tokens per row, left-aligned
positions            int32    token    master   model    absolute position of each new token
slot_mapping         int32    token    master   model    KV slot per new token, -1 = padding (a decode run: per step)
block_tables         int32    table    master   model    KV block ids per row, in order
window_slots         int32    token    master   model    the window pool's slot per new token (sliding layers; pa_config.window_blocks > 0)
window_tables        int32    table    master   model    the window pool's block ids per row, by block index (entries below the row's window are stale)
context_lens         int32    row      master   model    tokens in the cache after this step
query_lens           int32    row      master   model    valid new tokens per row (>= 1)
temperature          float32  row      master   model    0 = greedy
top_k                int32    row      master   model    0 = off
top_p                float32  row      master   model    1 = off
random_u             float32  row      master   model    uniform [0, 1) for sampling rows
top_n                int32    row      master   model    top log-probabilities wanted (0 = none)
repetition_penalty   float32  row      master   sampler  1 = off; >1 discourages seen tokens
presence_penalty     float32  row      master   sampler  0 = off; per generated token seen
frequency_penalty    float32  row      master   sampler  0 = off; per occurrence in the output
history              int32    history  master   sampler  the row's tokens so far (prompt + output), rows with a penalty
history_len          int32    row      master   sampler  valid entries of history (0 = none)
prompt_len           int32    row      master   sampler  history[prompt_len:] is the output
min_p                float32  row      master   sampler  0 = off; tokens below min_p x the likeliest's probability are out
controls_on          int32    row      master   sampler  1 = the row has logit controls this step (the arrays below, written after the frame)
controls_pending     int32    flag     master   sampler  1 = the step's logit controls are still being written (the sampler waits for 0)
mask_on              int32    row      master   sampler  1 = token_mask says which tokens the row may pick this step
token_mask           int32    mask     master   sampler  a bit per token, set = allowed (llguidance's bitmask layout)
bias_len             int32    row      master   sampler  entries of bias_ids / bias_values the row has this step
bias_ids             int32    bias     master   sampler  tokens whose logit the row changes (logit_bias, bans)
bias_values          float32  bias     master   sampler  added to their logits (BAN_BIAS: never picked)
prompt_top           int32    row      master   sampler  -1 = none; else the row's prompt log-probabilities are wanted, with this many top ones
prompt_target        int32    token    master   sampler  the prompt token after each new token, whose log-probability is wanted (-1 = none)
lora                 int32    row      master   model    LoRA adapter slot per row (0 = none)
rope_delta           int32    row      master   model    multimodal RoPE (Qwen2.5-VL): added to the row's positions for RoPE, from its images before its first new token (0 = none)
request_ids          int64    row      master   trace    request number per row (tracing, logits capture)
verify_random_u      float32  verify   master   model    uniform [0, 1) per new token of a sampling row
verify_parent        int32    verify   master   model    each new token's parent among its row's new tokens (-1 first)
out_token_ids        int32    row      agent0   master   sampled next token per row
out_logprobs         float32  row      agent0   master   its log-probability
out_top_ids          int32    top      agent0   master   most likely tokens, most likely first (steps with top_n > 0)
out_top_logprobs     float32  top      agent0   master   their log-probabilities
out_verify_ids       int32    verify   agent0   master   the token sampled after each new token (a run: each step's)
out_verify_logprobs  float32  verify   agent0   master   its log-probability
out_prompt_logprobs  float32  token    agent0   master   log-probability of prompt_target after each new token (prefill, rows with prompt_top >= 0)
out_prompt_ranks     int32    token    agent0   master   its rank among the vocabulary (1 = the likeliest)
out_prompt_top_ids   int32    token_top agent0  master   the most likely tokens after each new token, most likely first
out_prompt_top_logprobs float32 token_top agent0 master  their log-probabilities
out_pooled           float32  hidden   agent0   master   an embedding step's row: the sum of its tokens' final (normed) hidden states (mean pooling), its last token's (last) or its first's (cls)
"""
ARRAYS = tuple(ArrayDecl(name, np.dtype(dtype).type, shape_class, writer, reader, meaning)
               for name, dtype, shape_class, writer, reader, meaning
               in (line.split(None, 5) for line in _DECLARED.strip().splitlines()))
INPUT_NAMES = tuple(a.name for a in ARRAYS if a.is_input)
OUTPUT_NAMES = tuple(a.name for a in ARRAYS if not a.is_input)
_NAMES = frozenset(INPUT_NAMES + OUTPUT_NAMES)
_FLAGS = frozenset(a.name for a in ARRAYS if a.shape_class == "flag")


class StepView:
    """One step's arrays by name (the declared ones, `ARRAYS`), as numpy views of its part of the step
    buffers (`StepBuffers.view`) or as arrays a caller made (tests, tools, warmup). This is the object
    `ModelRunner.execute` takes: `kind`, `return_logits` (the logits at each row's last token too, for
    capture), `images` (a prefill step's images, from its frame) and the input arrays; an input not given (a test's penalties, say) is None: the runner's
    default ("off")."""

    def __init__(self, kind, *, return_logits: bool = False, images: tuple = (), **arrays):
        if not _NAMES.issuperset(arrays):
            raise TypeError(f"StepView: no step array named {', '.join(sorted(set(arrays) - _NAMES))}")
        self.kind = StepKind(kind)
        self.return_logits = return_logits
        self.images = images            # a prefill step's images (agents/protocol.py's StepImage): not in shm
        self.__dict__.update(arrays)

    def __getattr__(self, name):         # only reached for an array not given
        if name in _NAMES:
            return None
        raise AttributeError(name)

    @property
    def num_rows(self) -> int:
        return len(self.query_lens) if self.query_lens is not None else np.asarray(self.input_ids).shape[0]

    def rows(self, index) -> "StepView":
        """The same step on some of its rows (an index array), as copies."""
        arrays = {k: v if k in _FLAGS else np.asarray(v)[index] for k, v in vars(self).items()
                  if k in INPUT_NAMES and v is not None}
        return StepView(self.kind, return_logits=self.return_logits, **arrays)


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
    vocab_size: int = 0             # the model's vocabulary (token masks; 0: none, constrained rows refused)
    max_prefill_rows: int = 0       # rows of a prefill step (prompt scores); 0: max_rows
    hidden_size: int = 0            # the model's hidden width (embedding steps' pooled states; 0: none)

    @classmethod
    def from_config(cls, config) -> "StepLayout":
        mc = config.model_config
        return cls(max_rows=max(mc.decode_batch_size[-1], mc.prefill_batch_size[-1]),
                   max_tokens=mc.seq_length[-1], max_blocks_per_seq=config.max_blocks_per_seq,
                   max_context=config.max_blocks_per_seq * config.pa_config.block_size,
                   max_verify=max(config.spec_config.tokens_per_row, config.scheduler_config.decode_steps),
                   vocab_size=mc.vocab_size or 0, max_prefill_rows=mc.prefill_batch_size[-1],
                   hidden_size=mc.hidden_size or 0)

    def shape(self, shape_class: str) -> tuple:
        """The full shape of an array of a shape class."""
        r = self.max_rows
        return {"token": (r, self.max_tokens), "row": (r,), "table": (r, self.max_blocks_per_seq),
                "history": (r, max(self.max_context, 1)), "verify": (r, self.max_verify),
                "top": (r, TOP_LOGPROBS), "mask": (r, self.mask_words), "bias": (r, MAX_LOGIT_BIAS),
                "token_top": (self.max_prefill_rows or r, self.max_tokens, TOP_LOGPROBS), "flag": (1,),
                "hidden": (r, self.hidden_size)}[shape_class]

    @property
    def mask_words(self) -> int:
        """int32 words of a row's token mask."""
        return (self.vocab_size + 31) // 32

    def arrays(self) -> list:
        return [ArraySpec(a.name, a.dtype, self.shape(a.shape_class)) for a in ARRAYS]

    @staticmethod
    def part(decl: ArrayDecl, n: int, s: int, steps: int = 1) -> tuple:
        """The index of a step's part of an array (n rows, s new tokens per row, a decode run's steps)."""
        if decl.shape_class in ("token", "verify", "token_top"):
            return slice(0, n), slice(0, max(s, steps))       # a decode run: a slot (a token) per step
        if decl.shape_class == "flag":
            return (slice(0, 1),)
        return (slice(0, n),)

    @staticmethod
    def in_step(decl: ArrayDecl, kind: StepKind) -> bool:
        """Whether a step of this kind has a part of the array (verify inputs: verify steps only)."""
        return not (decl.is_input and decl.shape_class == "verify" and kind is not StepKind.VERIFY)

    def step_inputs(self, kind: StepKind, n: int, s: int, steps: int = 1) -> list:
        """(array name, index) of every part of the buffers a step of n rows and s new tokens per row (a
        decode run: of `steps` steps) reads for its model work (the `model` inputs), in declaration order:
        what rank 0 broadcasts to ranks on other nodes (models/parallel.py). All are 4-byte types."""
        return [(a.name, self.part(a, n, s, steps)) for a in ARRAYS
                if a.is_input and a.reader == "model" and self.in_step(a, kind)]

    def step_inputs_size(self, kind: StepKind, n: int, s: int, steps: int = 1) -> int:
        """4-byte words in step_inputs(...)'s parts together."""
        shapes = {a.name: self.shape(a.shape_class) for a in ARRAYS}
        total = 0
        for name, index in self.step_inputs(kind, n, s, steps):
            shape = shapes[name]
            dims = [len(range(*sl.indices(d))) for sl, d in zip(index, shape)] + list(shape[len(index):])
            total += int(np.prod(dims))
        return total

    @property
    def max_step_inputs_size(self) -> int:
        """The most words any step's inputs take."""
        return max(self.step_inputs_size(StepKind.PREFILL, self.max_rows, self.max_tokens),
                   self.step_inputs_size(StepKind.VERIFY, self.max_rows, self.max_verify),
                   self.step_inputs_size(StepKind.DECODE_RUN, self.max_rows, 1, self.max_verify))
