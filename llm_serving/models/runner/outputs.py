"""A step's outputs from its logits (`StepOutputs`): the model graph's greedy choice, or a sampling graph's when some
row samples, has a penalty or logit controls; the top log-probabilities when some row asks; a prefill step's prompt
log-probabilities (`PromptScores`)."""
from __future__ import annotations

import numpy as np

from llm_serving.shm.layout import StepView

from ..logit_controls import apply_controls, read_controls, uses_controls
from ..step_inputs import StepInputs
from .graphs import RunnerGraphs
from .kv_inputs import pad

__all__ = ["PromptScores", "StepOutputs"]


def _step_error(message: str) -> None:
    raise ValueError(f"ModelRunner.execute: {message}")


class PromptScores:
    """A prefill step's prompt log-probabilities, as the packed calls give every token's logits: after new token j
    of row i, the log-probability of its prompt_target, its rank (1 = the likeliest) and the `top` most likely
    tokens (rank 0 of top: the likeliest). Written into the step's out_prompt_* arrays."""

    BLOCK = 64                          # tokens scored at once (a block's log-softmax is BLOCK x vocab floats)

    def __init__(self, n: int, s: int, top: int):
        self.logprobs = np.zeros((n, s), np.float32)
        self.ranks = np.zeros((n, s), np.int32)
        self.top = top
        self.top_ids = np.zeros((n, s, top), np.int32)
        self.top_logprobs = np.zeros((n, s, top), np.float32)

    def add(self, logits: np.ndarray, rows: np.ndarray, cols: np.ndarray, targets: np.ndarray, tops: np.ndarray):
        """logits (k, V) of k tokens, token t at (rows[t], cols[t]) of the step; the tokens with a target scored in
        blocks of BLOCK rows (float32 log-softmax, vectorised)."""
        want = np.nonzero(targets[rows, cols] >= 0)[0]
        for b0 in range(0, len(want), self.BLOCK):
            t = want[b0:b0 + self.BLOCK]
            i, j = rows[t], cols[t]
            block = logits[t].astype(np.float32)
            block -= block.max(axis=1, keepdims=True)
            block -= np.log(np.exp(block).sum(axis=1, keepdims=True))          # log-softmax, (b, V)
            target = targets[i, j]
            chosen = block[np.arange(len(t)), target]
            self.logprobs[i, j] = chosen
            self.ranks[i, j] = (block > chosen[:, None]).sum(axis=1) + 1
            k = int(tops[i].max()) if len(t) else 0
            if k:
                ids = np.argpartition(-block, k - 1, axis=1)[:, :k]                   # (b, k), unordered
                lps = np.take_along_axis(block, ids, axis=1)
                order = np.argsort(-lps, axis=1, kind="stable")
                self.top_ids[i, j, :k] = np.take_along_axis(ids, order, axis=1)
                self.top_logprobs[i, j, :k] = np.take_along_axis(lps, order, axis=1)

    def write(self, view: StepView) -> None:
        n, s = self.logprobs.shape
        view.out_prompt_logprobs[:n, :s] = self.logprobs
        view.out_prompt_ranks[:n, :s] = self.ranks
        if self.top:
            view.out_prompt_top_ids[:n, :s, :self.top] = self.top_ids
            view.out_prompt_top_logprobs[:n, :s, :self.top] = self.top_logprobs


class StepOutputs:
    """Turns a model graph's outputs into a step's: `finish` (greedy, or sampled), `none` (zeros: a
    tensor-parallel rank other than 0 has no logits, its graph stopping at the hidden state), `scored` (a packed
    call's prompt scores recorded)."""

    def __init__(self, graphs: RunnerGraphs, writes_outputs: bool):
        self.graphs, self.writes_outputs = graphs, writes_outputs
        self.vocab_size, self.top_k = graphs.vocab_size, graphs.top_k_logprobs

    def none(self, n: int, return_logits: bool, wants_top: bool) -> list:
        """All-zero outputs for n rows, shaped as ModelRunner.execute returns them."""
        out = [np.zeros(n, np.int32), np.zeros(n, np.float32)]
        if return_logits:
            out.append(np.zeros((n, self.vocab_size), np.float32))
        if wants_top:
            out += [np.zeros((n, self.top_k), np.int32), np.zeros((n, self.top_k), np.float32)]
        return out

    def finish(self, outputs, n: int, rows: int, per_row: dict, return_logits: bool, live=None):
        """Greedy results of the model graph, or a sampling graph's when some row samples; first n rows. Rows with
        logit controls have them read from `live` (the step view) now, the master having written them meanwhile."""
        if not self.writes_outputs:
            return tuple(self.none(n, return_logits, bool((per_row["top_n"] > 0).any())))
        token, logprob, logits = outputs
        g, T = self.graphs, self.graphs.ms.Tensor
        temperature, top_k, top_p = per_row["temperature"], per_row["top_k"], per_row["top_p"]
        sampling = temperature > 0
        penalized = "history" in per_row
        if penalized:        # penalties change the logits every row's choice comes from (greedy rows too)
            logits = g.call("penalizer", (rows,), g.penalizer, logits, T(pad(per_row["history"], rows, 0)),
                            T(pad(per_row["history_len"], rows, 0)), T(pad(per_row["prompt_len"], rows, 0)),
                            T(pad(per_row["repetition"], rows, 1.0)), T(pad(per_row["presence"], rows, 0.0)),
                            T(pad(per_row["frequency"], rows, 0.0)))
        if "controls_on" in per_row and per_row["controls_on"].any():
            per_row = {**per_row, **read_controls(live, per_row["row_index"], self.vocab_size, _step_error)}
        controlled = uses_controls(per_row)
        if controlled:       # bias, masks, min_p (logit_controls.py), on the host; the sampler then picks every row
            logits = T(apply_controls(logits.asnumpy(), per_row, pad(temperature, rows, 0.0), owned=True))
        if sampling.any() or penalized or controlled:   # a sampling graph on the logits (which stay in MindSpore memory)
            filters = ((top_k[sampling] > 0) & (top_k[sampling] < self.vocab_size)).any() \
                or (top_p[sampling] < 1.0).any()
            kind, cell = ("sampler", g.sampler) if filters else ("plain_sampler", g.plain_sampler)
            token, logprob = g.call(kind, (rows,), cell, logits, T(pad(temperature, rows, 0.0)),
                                    T(pad(top_k, rows, 0)), T(pad(top_p, rows, 1.0)),
                                    T(pad(per_row["random_u"], rows, 0.0)))
        out = [token.asnumpy()[:n].astype(np.int32), logprob.asnumpy()[:n].astype(np.float32)]
        if return_logits:
            out.append(logits.asnumpy()[:n])
        if (per_row["top_n"] > 0).any():
            top_ids, top_lps = g.call("top_logprobs", (rows,), g.top_logprobs, logits)
            out += [top_ids.asnumpy()[:n], top_lps.asnumpy()[:n]]
        return tuple(out)

    def scored(self, outputs, step: StepInputs, flat: tuple, start: int, stop: int, sample_index,
               scores: PromptScores):
        """A packed call's outputs over all its tokens: the prompt tokens' scores recorded, and the outputs of the
        tokens in sample_index (the rows sampled by the call) returned as a sampling call's."""
        token, logprob, logits = outputs
        T = self.graphs.ms.Tensor
        logits = logits.asnumpy()
        valid, row_of = flat[:2]
        cols = np.nonzero(valid)[1][start:stop]
        scores.add(logits[:stop - start], row_of[start:stop], cols, step.prompt_target, step.prompt_top)
        return T(token.asnumpy()[sample_index]), T(logprob.asnumpy()[sample_index]), T(logits[sample_index])

