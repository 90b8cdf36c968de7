"""Embed steps (`EmbedSteps`): every token's final hidden state through the Embedder graph, in packed pieces as a
packed prefill runs them, then on the host the final norm and each row's pooling (models/pooling.py)."""
from __future__ import annotations

import numpy as np

from llm_serving.shm.layout import StepView

from ..buckets import Buckets
from ..step_inputs import StepInputs
from ..weights import LlamaConfig
from .graphs import RunnerGraphs
from .kv_inputs import KvLayout, flat_tokens
from .token_steps import TokenSteps

__all__ = ["EmbedSteps"]


class EmbedSteps:
    """Runs embed steps (`execute`); `warm` compiles (and runs the smallest of) the Embedder's buckets."""

    def __init__(self, cfg: LlamaConfig, buckets: Buckets, layout: KvLayout, graphs: RunnerGraphs,
                 tokens: TokenSteps, writes_outputs: bool):
        self.cfg, self.buckets, self.layout, self.graphs = cfg, buckets, layout, graphs
        self.tokens, self.writes_outputs = tokens, writes_outputs
        self.final_norm = not cfg.post_norm        # (post norms: the last layer's output is normalized already)

    def execute(self, step: StepView) -> np.ndarray:
        """An embed step: every token's final hidden state, through the Embedder graph in packed pieces as a packed
        prefill runs them (their K/V written as any step's: a row's later chunk attends to them), then on the host the
        final norm (RMS; a model of post norms has none) and each row's pooling (`RunnerGraphs.pooling`): mean, the
        sum of its new tokens' states (the master divides the whole input's sum by its count); last, its last new
        token's; cls, its first token's when the step feeds position 0. Returns (n, H) float32 (zeros on
        tensor-parallel ranks other than 0, which run the graph for its all-reduces). Each row's sum is one
        reduction over its own tokens in order, so it is the same whatever else the step holds (with
        batch-invariant steps, to the bit).
        A bidirectional encoder's rows are whole inputs (the scheduler feeds them whole), each token seeing all of
        its input's keys (its context: the row's), and each row runs within one graph call (`Buckets.row_pieces`):
        its keys must all be written before any of its tokens attends."""
        if not self.buckets.packed:
            raise ValueError("ModelRunner.execute: embeddings need the CPU kernel's packed prefill (attention_kernel "
                             "on)")
        inputs = StepInputs.make(self.tokens.limits, step, sampler=False)
        flat, pieces = self._pieces(inputs)
        t = int(inputs.query_lens.sum())
        states = np.empty((t, self.cfg.hidden_size), np.float32)
        for start, stop, tb in pieces:
            states[start:stop] = self._call(inputs, flat, start, stop, tb)[:stop - start]
        if not self.writes_outputs:
            return np.zeros((inputs.n, self.cfg.hidden_size), np.float32)
        return self._pool(inputs, states)

    def _pieces(self, inputs: StepInputs) -> tuple:
        """(the step's flat tokens, its graph calls as (start, stop, bucket) pieces): a causal model's tokens in
        token buckets; an encoder's rows whole, each token's context every key of its input."""
        flat = flat_tokens(inputs)
        t = int(inputs.query_lens.sum())
        if self.cfg.causal:
            pieces, start = [], 0
            for tb in self.buckets.token_pieces(t):
                pieces.append((start, min(start + tb, t), tb))
                start += tb
            return flat, pieces
        if (inputs.context_lens != inputs.query_lens).any():
            raise ValueError("ModelRunner.execute: a bidirectional encoder's embed step feeds whole inputs (each "
                             "row's context its query length)")
        flat = flat[:5] + (inputs.context_lens[flat[1]].astype(np.int32),) + flat[6:]    # every key of its input
        return flat, self.buckets.row_pieces(inputs.query_lens)

    def _pool(self, inputs: StepInputs, states: np.ndarray) -> np.ndarray:
        """(n, H): each row's pooling of its tokens' states, after the final norm."""
        pooled = np.zeros((inputs.n, self.cfg.hidden_size), np.float32)
        if self.final_norm:
            eps = self.cfg.rms_norm_eps
            states *= (1.0 / np.sqrt(np.mean(states * states, axis=1, keepdims=True, dtype=np.float64) + eps)
                       ).astype(np.float32)
            states *= self.graphs.final_norm_gain
        ends = np.cumsum(inputs.query_lens)
        pooling = self.graphs.pooling
        for i, (a, b) in enumerate(zip(ends - inputs.query_lens, ends)):
            if pooling == "mean":
                pooled[i] = states[a:b].sum(axis=0, dtype=np.float64)
            elif pooling == "last":
                pooled[i] = states[b - 1]
            elif inputs.positions[i, 0] == 0:            # cls: the input's first token is in this step
                pooled[i] = states[a]
        return pooled

    def _call(self, step: StepInputs, flat: tuple, start: int, stop: int, tb: int) -> np.ndarray:
        """The Embedder graph of `tb` tokens on the step's real tokens start..stop-1 (inputs as a packed call's);
        (tb, H)."""
        ids, pos, kv, context, lora = self.tokens.packed_inputs(step, flat, start, stop, tb)
        return self._run(tb, ids, pos, kv, context, lora).asnumpy()

    def _run(self, tb: int, ids, pos, kv, context, lora, compile_only: bool = False):
        g, T = self.graphs, self.graphs.ms.Tensor
        slots, tables, window_slots, window_tables = g.tensors(kv, (tb, 1))
        args = (T(ids.reshape(tb, 1)), T(pos.reshape(tb, 1)), slots, tables, T(context),
                T(np.full(tb, -1, np.int32)), T(lora), window_slots, window_tables)
        if compile_only:
            return g.compile("embed", (tb,), g.embedder, *args)
        return g.call("embed", (tb,), g.embedder, *args)

    def warm(self, tokens: int, compile_only: bool = False) -> None:
        """The Embedder graph of `tokens` padding tokens (nothing written but the scratch block, nothing attended);
        with compile_only only compiled (the larger buckets: running them costs a deep model seconds)."""
        kv = self.layout.padding_inputs((tokens,), self.tokens.limits.max_blocks_per_seq,
                                        self.tokens.layer_kernel_runs(tokens))
        zeros = np.zeros(tokens, np.int32)
        self._run(tokens, zeros, zeros, kv, zeros, zeros, compile_only)
