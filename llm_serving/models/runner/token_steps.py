"""Prefill, decode and verify steps (`TokenSteps`): a step's rows padded to their (batch, seq) bucket, or, with the
CPU paged-attention kernel, a prefill's and a verify's real tokens packed side by side, then the graphs called and
the outputs sampled.

Packed: token k of row i is a 'row' of a decode-shaped graph (S=1) with row i's block table and context (keys 0 ..
its position), which the paged-attention kernel attends through; the K/V of all of a graph call's tokens are written
before any layer attends, so a token sees the earlier tokens of its own row; max(prefill_batch_sizes) rows sampled.
Without the kernel (no compiler, or Ascend) prefill runs per (batch, seq) bucket.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from llm_serving.shm.layout import StepKind, StepView

from ..buckets import Buckets
from ..step_inputs import StepInputs, StepLimits
from .graphs import RunnerGraphs
from .images import ImageEncoder, Placed, pieces, place
from .kernels import KernelChoice
from .kv_inputs import KvLayout, flat_tokens, pad
from .outputs import PromptScores, StepOutputs

__all__ = ["TokenSteps"]


class TokenSteps:
    """Runs prefill, decode and verify steps on the runner's graphs (ModelRunner.execute describes their inputs and
    outputs)."""

    def __init__(self, buckets: Buckets, limits: StepLimits, layout: KvLayout, kernels: KernelChoice,
                 graphs: RunnerGraphs, outputs: StepOutputs, writes_outputs: bool,
                 images: Optional[ImageEncoder] = None):
        self.buckets, self.limits, self.layout, self.kernels = buckets, limits, layout, kernels
        self.graphs, self.outputs, self.writes_outputs = graphs, outputs, writes_outputs
        self.images = images            # the model's tower and encoded images (None: a model without images)

    @property
    def mrope(self) -> Optional[tuple]:
        """The model's multimodal RoPE rows for image tokens (llama.py's `mrope`: its config, the first scratch row,
        the cos and sin tables), or None."""
        return getattr(getattr(self.graphs, "model", None), "mrope", None)

    def layer_kernel_runs(self, tokens: int) -> bool:
        """Whether a one-token-per-row step of `tokens` rows runs the layer kernel (LlamaForCausalLM's `fused`),
        whose padding rows sit out (slot -1) and cost nothing; MindSpore's ops need them in the scratch block."""
        return self.kernels.layer_kernel is not None and tokens <= self.kernels.layer_kernel_rows

    def execute(self, step: StepView):
        """A prefill or decode step."""
        inputs = StepInputs.make(self.limits, step, sampler=self.writes_outputs)
        images = step.images
        if images and (self.images is None or not self.buckets.packed or step.kind is not StepKind.PREFILL):
            raise ValueError("ModelRunner.execute: this step carries images, which "
                             + ("this model does not take" if self.images is None else
                                "only a prefill step of the CPU kernel's packed path takes"))
        nb, sb = self.buckets.bucket(inputs.n, inputs.s)
        if inputs.scores_prompt:             # (rank 0's: other ranks have no logits and run the step plainly)
            if not self.buckets.packed:
                raise ValueError("ModelRunner.execute: prompt log-probabilities need the CPU kernel's packed prefill "
                                 "(attention_kernel on)")
            scores = PromptScores(inputs.n, inputs.s, int(inputs.prompt_top.max()))
            out = self.packed(inputs, step.return_logits, scores, images)
            if step.out_prompt_logprobs is not None:
                scores.write(step)
            return out
        if (inputs.s > 1 or images) and self.buckets.packed:
            return self.packed(inputs, step.return_logits, images=images)
        outputs = self.call_padded(inputs, nb, sb, all_tokens=False)
        return self.outputs.finish(outputs, inputs.n, nb, inputs.per_row, step.return_logits, inputs.live)

    def call_padded(self, step: StepInputs, nb: int, sb: int, all_tokens: bool):
        """The model graph on the step padded to (nb, sb): outputs at each row's last new token, or with all_tokens
        at every token (nb * sb rows, row-major). Padding rows and tokens write to the scratch block."""
        n, s = step.n, step.s
        cl, ql = step.context_lens, step.query_lens
        w = self.buckets.width(sb, -(-int(cl.max()) // self.layout.block_size))
        ids_p = np.zeros((nb, sb), np.int32)
        pos_p = np.zeros((nb, sb), np.int32)
        ids_p[:n, :s] = step.input_ids
        pos_p[:n, :s] = np.where(np.arange(s)[None, :] < step.query_lens[:, None],
                                 step.rope_positions(step.positions, np.arange(n)[:, None]), step.positions)
        kernel = sb == 1 and self.layer_kernel_runs(nb)
        g, T = self.graphs, self.graphs.ms.Tensor
        slot_p, bt_p, window_slot_p, window_bt_p = g.tensors(self.layout.inputs(
            step.slot_mapping, step.block_tables, step.window_slots, step.window_tables, (nb, sb), w, kernel), (nb, sb))
        sample_index = np.arange(nb * sb if all_tokens else nb, dtype=np.int32)
        return g.call("verify" if all_tokens else "model", (nb, sb), g.model, T(ids_p), T(pos_p), slot_p, bt_p,
                      T(pad(cl, nb, 1)), T(pad(ql, nb, 1)), T(sample_index), T(np.full(nb, -1, np.int32)),
                      T(pad(step.lora, nb, 0)), window_slot_p, window_bt_p)

    def packed(self, step: StepInputs, return_logits: bool, scores: Optional[PromptScores] = None,
               images: tuple = ()):
        """A prefill step as its real tokens side by side, run as one or more graph calls in order
        (`Buckets.token_pieces`); each call samples the rows whose last token it holds (sample_index). Padding
        tokens write to the scratch block and attend to nothing. With `scores` (a step that scores prompt tokens)
        every call returns the logits of all its tokens, from which `scores` takes the prompt tokens'
        log-probabilities and the rows' samplers their last token's. `images` (StepImage's): their tokens take the
        tower's rows and see their whole image, each image within one call (runner/images.py)."""
        ql, per_row = step.query_lens, step.per_row
        t = int(ql.sum())
        flat = flat_tokens(step)
        last = np.cumsum(ql) - 1                                                       # (n,) each row's last token
        rows = self.buckets.prefill_batch_sizes[-1]
        rope, mrope = None, self.mrope is not None       # multimodal RoPE: (t,) its positions (place moves some)
        if mrope or step.rope_delta is not None:
            rope = np.array(step.rope_positions(flat[3], flat[1]), np.int32)
        placed = place(images, self.images, ql, flat[3], flat[5], rope if mrope else None) if images else None
        if placed is None:
            calls, start = [], 0
            for tb in self.buckets.token_pieces(t):
                calls.append((start, min(start + tb, t), tb))
                start += tb
        else:
            calls = pieces(t, self.buckets.prefill_token_sizes, placed.spans)
        results, failure = [], None
        for start, stop, tb in calls:
            mine = np.nonzero((last >= start) & (last < stop))[0]                      # rows sampled by this call
            sample_index = pad((last[mine] - start).astype(np.int32), rows, 0)
            if scores is None:
                outputs = self.call_packed(step, flat, start, stop, tb, sample_index, placed=placed, rope=rope)
            else:                       # every token's logits: the prompt's scores, then the rows' last tokens'
                outputs = self.call_packed(step, flat, start, stop, tb, np.arange(tb, dtype=np.int32), placed=placed,
                                           rope=rope)
                outputs = self.outputs.scored(outputs, step, flat, start, stop, sample_index, scores)
            if failure is not None:
                continue
            sub = {key: arr[mine] for key, arr in per_row.items()}
            try:
                results.append((mine, self.outputs.finish(outputs, len(mine), rows, sub, return_logits, step.live)))
            except Exception as exc:      # noqa: BLE001 - re-raised below
                if self.graphs.all_reduce is None:
                    raise
                # rank 0's sampling failed (it has no all-reduce); the peers are already in the next piece's
                # all-reduces: run the remaining model pieces with them, then fail the step, in step
                failure = exc
        if failure is not None:
            raise failure
        out = self.outputs.none(step.n, return_logits, step.wants_top)   # (calls without a top_n row leave it zero)
        for mine, res in results:
            for arr, part in zip(out, res):
                arr[mine] = part
        return tuple(out)

    def call_packed(self, step: StepInputs, flat: tuple, start: int, stop: int, tb: int, sample_index,
                    tree_bits: Optional[np.ndarray] = None, placed: Optional[Placed] = None,
                    rope: Optional[np.ndarray] = None):
        """The model graph of `tb` tokens on the step's real tokens start..stop-1 (`flat`: flat_tokens(step)),
        padding after them; tree_bits: each real token's visible keys (a token tree's nodes; default all); placed:
        the step's image tokens (their rows and contexts); rope: the step's tokens' RoPE positions where they are
        not their positions (multimodal RoPE)."""
        ids, pos, kv, context, lora = self.packed_inputs(step, flat, start, stop, tb)
        if rope is not None:
            pos[:stop - start] = rope[start:stop]
        if placed is not None:
            context[:stop - start] = placed.context[start:stop]
            placed.fill(start, stop, ids, self.graphs.model.image_buffer, self.graphs.vocab_size, pos, self.mrope)
        bits = np.full(tb, -1, np.int32)
        if tree_bits is not None:
            bits[:stop - start] = tree_bits[start:stop]
        return self.run_packed(tb, ids, pos, kv, context, sample_index, bits, lora)

    def packed_inputs(self, step: StepInputs, flat: tuple, start: int, stop: int, tb: int) -> tuple:
        """(ids, positions, KV inputs, context, LoRA slot) of the step's real tokens start..stop-1 padded to `tb`:
        each token its row's tables (padded as call_padded's), context 0 for padding, each token its adapter."""
        row_of, ids, pos, slots, context = (a[start:stop] for a in flat[1:6])
        window_slots = None if flat[6] is None else flat[6][start:stop]
        window_tables = None if window_slots is None else step.window_tables[row_of]
        kv = self.layout.inputs(slots, step.block_tables[row_of], window_slots, window_tables, (tb,),
                                self.limits.max_blocks_per_seq, self.layer_kernel_runs(tb))
        return pad(ids, tb, 0), pad(pos, tb, 0), kv, pad(context, tb, 0), pad(step.lora[row_of], tb, 0)

    def run_packed(self, tb, ids, pos, kv, context, sample_index, tree_bits=None, lora=None,
                   compile_only: bool = False):
        """The model graph of tb packed tokens; kv: KvLayout.inputs' (tb,) slots and (tb, max_blocks_per_seq)
        tables; compile_only (warmup): compiled (or loaded from the compile cache), not run."""
        g, T = self.graphs, self.graphs.ms.Tensor
        bits = np.full(tb, -1, np.int32) if tree_bits is None else tree_bits
        lora = np.zeros(tb, np.int32) if lora is None else lora
        slots, tables, window_slots, window_tables = g.tensors(kv, (tb, 1))
        args = (T(ids.reshape(tb, 1)), T(pos.reshape(tb, 1)), slots, tables, T(context),
                T(np.ones(tb, np.int32)), T(sample_index), T(bits), T(lora), window_slots, window_tables)
        shape = (tb, sample_index.shape[0])
        if compile_only:
            return g.compile("packed", shape, g.model, *args)
        return g.call("packed", shape, g.model, *args)

    def verify(self, view: StepView):
        """A verify step: the rows' new tokens run as in a prefill step (packed, or padded to (batch,
        verify_width)), and the sampler sees every token's logits, each token with its row's sampling parameters
        and its own uniform number."""
        step = StepInputs.make(self.limits, view)
        n, s = step.n, step.s
        tokens = flat_tokens(step)
        valid, row_of = tokens[:2]                                                      # (n, s), (t,)
        t = len(row_of)
        size = self.buckets.verify_bucket(n, t)
        per_token = {key: arr[row_of] for key, arr in step.per_row.items() if key != "random_u"}
        per_token["random_u"] = step.verify_u[valid]                                     # (t,) each
        if self.buckets.packed:
            rows, flat = size, np.arange(t)
            bits = step.tree_bits() if step.verify_parent is not None else None
            outputs = self.call_packed(step, tokens, 0, t, size, np.arange(size, dtype=np.int32), bits,
                                       rope=step.rope_positions(tokens[3], tokens[1]))
        elif step.verify_parent is not None:
            raise ValueError("ModelRunner.execute: token trees need the CPU paged-attention kernel (packed verify "
                             "steps); this runner pads verify steps (attention_kernel off, or Ascend)")
        else:
            sb = self.buckets.verify_width
            if s > sb:
                raise ValueError(f"ModelRunner.execute: a verify row feeds at most {sb} tokens, got {s}")
            rows, flat = size * sb, (np.arange(n)[:, None] * sb + np.arange(s)[None, :])[valid]   # (t,)
            outputs = self.call_padded(step, size, sb, all_tokens=True)
        padded = {key: np.zeros(rows, arr.dtype) for key, arr in per_token.items()}
        padded["top_p"][:] = 1.0
        for key, arr in per_token.items():
            padded[key][flat] = arr
        token, logprob = self.outputs.finish(outputs, rows, rows, padded, False)
        ids, lps = np.zeros((n, s), np.int32), np.zeros((n, s), np.float32)
        ids[valid], lps[valid] = token[flat], logprob[flat]
        return ids, lps
