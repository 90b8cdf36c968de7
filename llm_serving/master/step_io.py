"""The master's side of the step buffers (shm/layout.py): write a scheduled step's inputs, read its outputs.

`RowWriter` is the one place the master writes a row's inputs; `StepIO` decides what a scheduled step writes and
reads its outputs back. Every step goes through a StepIO: the engine's on the target's buffers, a draft model's
(speculative/draft.py) on its own, whose rows are the requests as the draft sees them.

Per-row state that rarely changes (block table, sampling parameters, request number) is written only when
the row's request or table changed since the last step (`RowState` remembers what each row holds); a
decode step then writes one token id, position and slot per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.master.block_manager import BlockManager
from llm_serving.master.logits import fill_masks
from llm_serving.master.request import PromptLogprob, Request
from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.speculative.tree import node_depths
from llm_serving.shm.buffers import StepBuffers
from llm_serving.shm.layout import StepKind


@dataclass
class RowState:
    """What one shm row holds now."""
    request: Request
    table: list                 # the request's block table (the same list object while it holds it)
    blocks_written: int         # entries of `table` written (tables only grow while a request holds them)
    history_written: int = 0    # tokens of the penalty history written (rows with a sampling penalty)
    released_written: int = 0   # leading window-table entries written as released (a window pool)


@dataclass
class StepOutputs:
    """One step's outputs for rows 0..n-1, as Python lists (token_ids, logprobs) and, when some row asked
    for top log-probabilities, the (n, TOP_LOGPROBS) arrays. In a verify step token_ids[row] and
    logprobs[row] are lists: the token sampled after each of the row's new tokens."""
    token_ids: list
    logprobs: list
    top_ids: Optional[np.ndarray] = None
    top_logprobs: Optional[np.ndarray] = None
    prompt: Optional[tuple] = None      # a prefill step scoring prompts: the out_prompt_* arrays (rows, tokens, ...)
    pooled: Optional[np.ndarray] = None     # an embed step: each row's pooled hidden state (rows, hidden), a copy

    def prompt_logprob(self, row: int, j: int, top: int) -> PromptLogprob:
        """The score of the prompt token after row's new token j."""
        logprobs, ranks, top_ids, top_lps = self.prompt
        return PromptLogprob(float(logprobs[row, j]), int(ranks[row, j]),
                             list(zip(top_ids[row, j, :top].tolist(), top_lps[row, j, :top].tolist())))

    def top(self, row: int, k: int) -> list:
        """[(token id, logprob)] of row's k most likely tokens."""
        return list(zip(self.top_ids[row, :k].tolist(), self.top_logprobs[row, :k].tolist()))


class RowWriter:
    """The one place the master writes a step's per-row inputs into the step buffers (shm/layout.py names
    them). A row's block table is written first; its tokens' slots are read back through it. With a window pool
    (`window_scratch`: the id of its scratch block, the agents' own), each row's window-pool table and slots too
    (window_tables, window_slots), the same way.

    A window table's entries that its window has left (-1 in the block manager's) are written as the scratch block:
    the attention reads a few keys below a window (a key tile's start) and gives them weight 0, so what they hold
    must be finite, and a block another request now writes could hold anything."""

    def __init__(self, b: StepBuffers, block_size: int, window_scratch: Optional[int] = None):
        self.b = b
        self.block_size = block_size
        self.window_scratch = window_scratch
        self.window = window_scratch is not None

    def table(self, i: int, table: list, written: int = 0, window_table: Optional[list] = None) -> None:
        """Row i's block table (and window-pool table): entries written.. appended, or (written 0) all of it,
        zero-padded."""
        pairs = [(self.b.block_tables, table)]
        if self.window:
            pairs.append((self.b.window_tables, self._window_entries(window_table)))
        for tables, entries in pairs:
            if written:
                tables[i, written:len(entries)] = entries[written:]
                continue
            tables[i] = 0
            tables[i, :len(entries)] = entries

    def released(self, i: int, start: int, stop: int) -> None:
        """Row i's window-table entries start..stop-1 were released: the scratch block from now on."""
        self.b.window_tables[i, start:stop] = self.window_scratch

    def _window_entries(self, window_table: list) -> np.ndarray:
        entries = np.asarray(window_table, np.int32)
        return np.where(entries < 0, self.window_scratch, entries)

    def sampling(self, i: int, *, prompt_len: int, request_id: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, top_n: int = 0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, min_p: float = 0.0, lora: int = 0) -> None:
        """Row i's sampling parameters (defaults: greedy, nothing more), request number and adapter slot; its
        uniform number, penalty history and logit controls start empty (`random_u`, `history`, `controls`)."""
        b = self.b
        b.temperature[i] = temperature
        b.top_k[i] = top_k
        b.top_p[i] = top_p
        b.random_u[i] = 0.0
        b.top_n[i] = top_n
        b.repetition_penalty[i] = repetition_penalty
        b.presence_penalty[i] = presence_penalty
        b.frequency_penalty[i] = frequency_penalty
        b.history_len[i] = 0                        # written per step for rows with a penalty
        b.min_p[i] = min_p
        b.mask_on[i] = 0                            # written per step for rows with logit controls
        b.prompt_top[i] = -1                        # written per step for rows scoring their prompt
        b.bias_len[i] = 0
        b.prompt_len[i] = prompt_len
        b.request_ids[i] = request_id
        b.lora[i] = lora

    def tokens(self, i: int, ids: list, start: int, positions=None, pad_to: Optional[int] = None) -> None:
        """Row i feeds `ids` into the slots of positions start.. of its table (at those positions, or at
        `positions`: a token tree's nodes sit at their depth's); its context reaches start + len(ids). The row is
        padding (id 0, position 0, slot -1) from there to token pad_to (the step's width; None: the row's end)."""
        b, bs = self.b, self.block_size
        q = len(ids)
        slots = np.arange(start, start + q, dtype=np.int32)
        b.input_ids[i, :q] = ids
        b.positions[i, :q] = slots if positions is None else positions
        b.slot_mapping[i, :q] = b.block_tables[i, slots // bs] * bs + slots % bs
        if self.window:
            b.window_slots[i, :q] = b.window_tables[i, slots // bs] * bs + slots % bs
        end = b.input_ids.shape[1] if pad_to is None else pad_to
        if q < end:
            b.input_ids[i, q:end] = 0
            b.positions[i, q:end] = 0
            b.slot_mapping[i, q:end] = -1
            if self.window:
                b.window_slots[i, q:end] = -1
        b.context_lens[i] = start + q
        b.query_lens[i] = q

    def decode(self, n: int, ids: list, positions: list, slots: list, window_slots: Optional[list] = None) -> None:
        """Rows 0..n-1 each feed one token (ids[i] at positions[i], into slots[i] and window_slots[i])."""
        b = self.b
        b.input_ids[:n, 0] = ids
        b.positions[:n, 0] = positions
        b.slot_mapping[:n, 0] = slots
        if self.window:
            b.window_slots[:n, 0] = window_slots
        b.context_lens[:n] = b.positions[:n, 0] + 1
        b.query_lens[:n] = 1

    def run_slots(self, n: int, step: int, slots: list, window_slots: Optional[list] = None) -> None:
        """A decode run: rows 0..n-1's slots (and window-pool slots) for its step `step` (-1: the row sits it
        out)."""
        self.b.slot_mapping[:n, step] = slots
        if self.window:
            self.b.window_slots[:n, step] = window_slots

    def rope_delta(self, i: int, delta: int) -> None:
        """Row i's multimodal RoPE offset (added to its positions for RoPE alone: its slots and context are its
        positions')."""
        self.b.rope_delta[i] = delta

    def random_u(self, i: int, u: float) -> None:
        """Row i's uniform number for sampling its next token."""
        self.b.random_u[i] = u

    def verify(self, i: int, parents: list, us: Optional[list]) -> None:
        """A verify step's row i: each new token's parent among the row's new tokens and (a sampling row)
        the uniform number for the token sampled after it."""
        q = len(parents)
        self.b.verify_parent[i, :q] = parents
        if us is not None:
            self.b.verify_random_u[i, :q] = us

    def controls(self, rows: list) -> None:
        """Logit controls of [(row i, its master.logits.LogitsState, its output ids)] before a step that samples
        their requests' next tokens: the grammars' masks together (`fill_masks`), then each row's own part of
        its mask and its bias entries. A row whose controls cannot be written is left without them and its state
        keeps the reason (`LogitsState.error`): the engine ends that request with an error when its token comes
        back; the others go on."""
        b = self.b
        grammars = [(state.matcher, i) for i, state, _ in rows if state.matcher is not None]
        filled = True
        if grammars:
            try:
                fill_masks(grammars, b.token_mask)
            except Exception:      # noqa: BLE001 - find the row at fault below, one by one
                filled = False
        for i, state, output_ids in rows:
            try:
                masked, ids, values = state.write(b.token_mask[i], output_ids, filled=filled)
            except Exception as exc:   # noqa: BLE001 - this request fails, not the step
                state.error = f"its logit controls could not be written: {exc}"
                masked, ids, values = False, [], []
            b.mask_on[i] = masked
            k = len(ids)
            if k:
                b.bias_ids[i, :k] = ids
                b.bias_values[i, :k] = values
            b.bias_len[i] = k

    def prompt_targets(self, i: int, top: int, targets: Optional[list]) -> None:
        """Row i's prompt tokens to score after each of its new tokens (-1: none) and the top ones wanted; None:
        the row scores nothing this step."""
        self.b.prompt_top[i] = -1 if targets is None else top
        if targets is not None:
            self.b.prompt_target[i, :len(targets)] = targets

    def history(self, i: int, tokens: list, start: int) -> None:
        """Row i's penalty history: tokens appended at start (history_len then counts them all)."""
        stop = start + len(tokens)
        self.b.history[i, start:stop] = tokens
        self.b.history_len[i] = stop


def _rope_delta(req, position: int) -> int:
    """A row's multimodal RoPE offset at its first new token (a draft model's view of a request has none)."""
    return req.rope_delta(position) if getattr(req, "images", ()) else 0


class StepIO:
    """Writes each scheduled step of one agent group into its step buffers; reads the outputs. A row is any
    object with a request's attributes (`Request`, or a draft model's view of one). `window`: the agents' sliding
    layers read the block manager's window pool (a draft's never do: its layers read the main tables)."""

    def __init__(self, block_manager: BlockManager, window: bool = True):
        self.block_manager = block_manager
        self.window = window and block_manager.window_pool is not None
        # the agents' window scratch block: the id after the pool's blocks
        self.window_scratch = block_manager.window_pool.num_blocks if self.window else None
        self._rows: list = []                       # RowState per shm row
        self._buffers: Optional[StepBuffers] = None
        self._writer: Optional[RowWriter] = None
        self._controlled: list = []                 # (row, LogitsState, output ids) of the last step written

    def write_inputs(self, b: StepBuffers, batch: ScheduledBatch) -> None:
        if self._buffers is not b:                  # new buffers (first step, or agents restarted)
            self._rows, self._buffers = [], b
            self._writer = RowWriter(b, self.block_manager.block_size, self.window_scratch)
        if batch.max_query_len == 1:
            self._write_decode(batch)
        else:
            self._write_tokens(batch)
        controlled = self._write_sampling(batch)    # rows whose logits the master controls this step
        self._controlled = controlled              # written by write_controls, once the frame is out
        n = batch.num_rows
        b.controls_on[:n] = 0
        for i, _, _ in controlled:
            b.controls_on[i] = 1
        b.controls_pending[0] = 1 if controlled else 0

    def _write_decode(self, batch: ScheduledBatch) -> None:
        """A decode step's rows: token i feeds position num_computed_tokens; a decode run's later steps get their
        slots too."""
        w, bm, n = self._writer, self.block_manager, batch.num_rows
        tables = bm.block_tables
        ids, pos, slots = [], [], []
        for i, req in enumerate(batch.requests):
            p = req.num_computed_tokens
            ids.append(req.token_at(p))
            pos.append(p)
            slots.append(bm.slot(req.req_id, p))
            self._write_row_state(i, req, tables[req.req_id])
            w.rope_delta(i, _rope_delta(req, p))
        window_slots = [bm.window_slot(req.req_id, p) for req, p in zip(batch.requests, pos)] \
            if self.window else None
        w.decode(n, ids, pos, slots, window_slots)
        for j in range(1, batch.steps):         # a decode run: the slots of its later steps (-1: sat out)
            rows = list(zip(batch.requests, pos, batch.run_lens))
            w.run_slots(n, j, [bm.slot(req.req_id, p + j) if j < steps else -1 for req, p, steps in rows],
                        [bm.window_slot(req.req_id, p + j) if j < steps else -1 for req, p, steps in rows]
                        if self.window else None)

    def _write_tokens(self, batch: ScheduledBatch) -> None:
        """A prefill, embed or verify step's rows: each row's new tokens (a verify row's proposals after its own,
        each node at its depth's position)."""
        w, tables = self._writer, self.block_manager.block_tables
        proposals = batch.proposals or [()] * batch.num_rows
        for i, (req, q, proposal) in enumerate(zip(batch.requests, batch.num_new_tokens, proposals)):
            start = req.num_computed_tokens
            stop = start + q
            self._write_row_state(i, req, tables[req.req_id])
            w.rope_delta(i, _rope_delta(req, start))
            positions = None
            if proposal:                        # each node's position is its depth's (a chain's: its slot's)
                positions = np.arange(start, stop, dtype=np.int32)
                own = q - len(proposal)             # the row's own tokens, then the nodes
                positions[own:] = stop - len(proposal) - 1 + np.asarray(node_depths(batch.parents[i]))
            w.tokens(i, req.tokens(start, stop - len(proposal)) + list(proposal), start, positions,
                     pad_to=batch.max_query_len)    # the agent reads the step's width only

    def _write_sampling(self, batch: ScheduledBatch) -> list:
        """Each row's sampling inputs: a verify row's tree and uniform numbers, a sampled row's uniform number, the
        prompt tokens it scores, its penalty history. Returns (row, LogitsState, output ids) of the rows whose
        logits the master controls this step (those that sample)."""
        w = self._writer
        verify = batch.kind is StepKind.VERIFY
        controlled = []
        for i, (req, q) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if verify:                              # the row's own tokens: each one's parent is the one before
                tree = batch.parents[i]
                own = q - len(tree)
                parents = list(range(-1, own - 1)) + [own + p for p in tree]    # a node's: among new tokens
                us = None
                if not req.sampling.greedy:         # sampled after new token j: output index len(output_ids) + j,
                    ahead = list(range(own)) + [own - 1 + d for d in node_depths(tree)]    # after a node: its depth
                    us = [req.random_u(j) for j in ahead]
                w.verify(i, parents, us)
            elif not req.sampling.greedy:
                w.random_u(i, req.random_u())
            if req.logits is not None and req.num_computed_tokens + q >= req.num_tokens:   # it samples this step
                controlled.append((i, req.logits, req.output_ids))
            if req.prompt_scores is not None:       # after its new token j: prompt token start + j + 1, if any
                start, p = req.num_computed_tokens, len(req.prompt_ids)
                w.prompt_targets(i, req.sampling.prompt_logprobs, [
                    req.prompt_ids[k] if k < p else -1 for k in range(start + 1, start + q + 1)]
                    if batch.kind is StepKind.PREFILL and start < p else None)
            if req.sampling.penalized:              # the tokens the penalties count, appended as they come
                row = self._rows[i]
                total = req.num_tokens
                if row.history_written < total:
                    w.history(i, req.tokens(row.history_written, total), row.history_written)
                    row.history_written = total
        return controlled

    def write_controls(self) -> None:
        """The logit controls of the step write_inputs wrote last (its rows' grammar masks and bias entries), then
        `controls_pending` 0: called while the agents run the model (AgentGroup.step's after_send), whose samplers
        wait for the flag (models/logit_controls.py), so the masks cost the step nothing but the wait, if any."""
        if self._controlled:
            try:
                self._writer.controls(self._controlled)
            finally:
                # The flag's store comes after the controls' in program order, and x86-64 keeps stores in order for
                # every reader (the CPU agents this path serves). A host with a weaker memory model (Arm) would
                # need a release fence here and an acquire fence in read_controls.
                self._buffers.controls_pending[0] = 0
                self._controlled = []

    def _write_row_state(self, i: int, req: Request, table: list) -> None:
        rows = self._rows
        if i == len(rows):
            rows.append(None)
        row = rows[i]
        window_table = self.block_manager.window_tables.get(req.req_id) if self.window else None
        if row is not None and row.request is req and row.table is table:
            if row.blocks_written != len(table):
                self._writer.table(i, table, row.blocks_written, window_table)
                row.blocks_written = len(table)
            if self.window:
                released = self.block_manager.window_released(req.req_id)
                if released > row.released_written:
                    self._writer.released(i, row.released_written, released)
                    row.released_written = released
            return
        self._writer.table(i, table, window_table=window_table)
        sp = req.sampling
        self._writer.sampling(i, prompt_len=len(req.prompt_ids), request_id=req.number, temperature=sp.temperature,
                              top_k=sp.top_k, top_p=sp.top_p, top_n=sp.top_logprobs,
                              repetition_penalty=sp.repetition_penalty, presence_penalty=sp.presence_penalty,
                              frequency_penalty=sp.frequency_penalty, min_p=sp.min_p, lora=req.lora_slot)
        rows[i] = RowState(req, table, len(table),
                           released_written=self.block_manager.window_released(req.req_id) if self.window else 0)

    @staticmethod
    def read_outputs(b: StepBuffers, batch: ScheduledBatch) -> StepOutputs:
        """The batch's outputs, row by row; a verify step's or a decode run's (a token per new token or per step)
        as per-row lists of tokens; an embed step's pooled states."""
        n = batch.num_rows
        if batch.kind is StepKind.EMBED:
            return StepOutputs([], [], pooled=b.out_pooled[:n].copy())
        if batch.kind.per_token_outputs:
            verify_width = max(batch.max_query_len, batch.steps)
            return StepOutputs(b.out_verify_ids[:n, :verify_width].tolist(),
                               b.out_verify_logprobs[:n, :verify_width].tolist())
        out = StepOutputs(b.out_token_ids[:n].tolist(), b.out_logprobs[:n].tolist())
        if b.top_n[:n].any():
            out.top_ids, out.top_logprobs = b.out_top_ids[:n], b.out_top_logprobs[:n]
        if (b.prompt_top[:n] >= 0).any():
            out.prompt = (b.out_prompt_logprobs, b.out_prompt_ranks, b.out_prompt_top_ids, b.out_prompt_top_logprobs)
        return out
