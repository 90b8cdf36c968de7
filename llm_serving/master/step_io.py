"""The master's side of the step buffers (shm/layout.py): write a scheduled step's inputs, read its outputs.

Per-row state that rarely changes (block table, sampling parameters, request number) is written only when
the row's request or table changed since the last step (`RowState` remembers what each row holds); a
decode step then writes one token id, position and slot per row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.master.block_manager import BlockManager
from llm_serving.master.request import Request
from llm_serving.master.scheduler import ScheduledBatch
from llm_serving.master.speculative import node_depths
from llm_serving.shm.buffers import StepBuffers


@dataclass
class RowState:
    """What one shm row holds now."""
    request: Request
    table: list                 # the request's block table (the same list object while it holds it)
    blocks_written: int         # entries of `table` written (tables only grow while a request holds them)
    history_written: int = 0    # tokens of the penalty history written (rows with a sampling penalty)


@dataclass
class StepOutputs:
    """One step's outputs for rows 0..n-1, as Python lists (token_ids, logprobs) and, when some row asked
    for top log-probabilities, the (n, TOP_LOGPROBS) arrays. In a verify step token_ids[row] and
    logprobs[row] are lists: the token sampled after each of the row's new tokens."""
    token_ids: list
    logprobs: list
    top_ids: Optional[np.ndarray] = None
    top_logprobs: Optional[np.ndarray] = None

    def top(self, row: int, k: int) -> list:
        """[(token id, logprob)] of row's k most likely tokens."""
        return list(zip(self.top_ids[row, :k].tolist(), self.top_logprobs[row, :k].tolist()))


class StepIO:
    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self._rows: list = []                       # RowState per shm row
        self._buffers: Optional[StepBuffers] = None

    def write_inputs(self, b: StepBuffers, batch: ScheduledBatch) -> None:
        if self._buffers is not b:                  # new buffers (first step, or agents restarted)
            self._rows, self._buffers = [], b
        bm = self.block_manager
        bs = bm.block_size
        n, s = batch.num_rows, batch.max_query_len
        tables = bm.block_tables
        if s == 1:                                  # decode: token i feeds position num_computed_tokens
            ids, pos, slots = [], [], []
            for i, req in enumerate(batch.requests):
                p = req.num_computed_tokens
                ids.append(req.token_at(p))
                pos.append(p)
                slots.append(bm.slot(req.req_id, p))
                self._write_row_state(b, i, req, tables[req.req_id])
            b.input_ids[:n, 0] = ids
            b.positions[:n, 0] = pos
            b.slot_mapping[:n, 0] = slots
            for j in range(1, batch.steps):         # a decode run: the slots of its later steps (-1: sat out)
                b.slot_mapping[:n, j] = [bm.slot(req.req_id, p + j) if j < steps else -1
                                         for req, p, steps in zip(batch.requests, pos, batch.run_lens)]
            b.context_lens[:n] = b.positions[:n, 0] + 1
            b.query_lens[:n] = 1
        else:
            b.input_ids[:n, :s] = 0
            b.positions[:n, :s] = 0
            b.slot_mapping[:n, :s] = -1
            proposals = batch.proposals or [()] * n
            for i, (req, q, proposal) in enumerate(zip(batch.requests, batch.num_new_tokens, proposals)):
                start = req.num_computed_tokens
                stop = start + q
                self._write_row_state(b, i, req, tables[req.req_id])
                b.input_ids[i, :q] = req.tokens(start, stop - len(proposal)) + list(proposal)
                slots = np.arange(start, stop, dtype=np.int32)
                # BlockManager.slot for every token at once, through the row's table just written
                b.slot_mapping[i, :q] = b.block_tables[i, slots // bs] * bs + slots % bs
                b.positions[i, :q] = slots
                if proposal:                        # each node's position is its depth's (a chain's: its slot's)
                    own = q - len(proposal)             # the row's own tokens, then the nodes
                    b.positions[i, own:q] = stop - len(proposal) - 1 + np.asarray(node_depths(batch.parents[i]))
                b.context_lens[i] = stop
                b.query_lens[i] = q
        verify = batch.is_verify
        if verify:                                  # the row's own tokens: each one's parent is the one before
            b.verify_parent[:n, :s] = np.arange(-1, s - 1, dtype=np.int32)
        for i, (req, q) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            tree = batch.parents[i] if verify else []
            own = q - len(tree)
            if tree:                                # node j's parent, as an index among the row's new tokens
                b.verify_parent[i, own:q] = [own + p for p in tree]
            if verify and not req.sampling.greedy:  # sampled after new token j: output index len(output_ids) + j,
                ahead = list(range(own)) + [own - 1 + d for d in node_depths(tree)]    # after a node: its depth
                b.verify_random_u[i, :q] = [req.random_u(j) for j in ahead]
            elif not req.sampling.greedy:
                b.random_u[i] = req.random_u()
            if req.sampling.penalized:              # the tokens the penalties count, appended as they come
                row = self._rows[i]
                total = req.num_tokens
                if row.history_written < total:
                    b.history[i, row.history_written:total] = req.tokens(row.history_written, total)
                    b.history_len[i] = row.history_written = total

    def _write_row_state(self, b: StepBuffers, i: int, req: Request, table: list) -> None:
        rows = self._rows
        if i == len(rows):
            rows.append(None)
        row = rows[i]
        if row is not None and row.request is req and row.table is table:
            if row.blocks_written != len(table):
                b.block_tables[i, row.blocks_written:len(table)] = table[row.blocks_written:]
                row.blocks_written = len(table)
            return
        b.block_tables[i] = 0
        b.block_tables[i, :len(table)] = table
        sp = req.sampling
        b.temperature[i] = sp.temperature
        b.top_k[i] = sp.top_k
        b.top_p[i] = sp.top_p
        b.random_u[i] = 0.0
        b.top_n[i] = sp.top_logprobs
        b.repetition_penalty[i] = sp.repetition_penalty
        b.presence_penalty[i] = sp.presence_penalty
        b.frequency_penalty[i] = sp.frequency_penalty
        b.history_len[i] = 0                        # written per step for rows with a penalty
        b.prompt_len[i] = len(req.prompt_ids)
        b.request_ids[i] = req.number
        b.lora[i] = req.lora_slot
        rows[i] = RowState(req, table, len(table))

    @staticmethod
    def read_outputs(b: StepBuffers, n: int, verify_width: int = 0) -> StepOutputs:
        """Rows 0..n-1's outputs; a verify step's or a decode run's (verify_width tokens per row) as per-row
        lists of tokens."""
        if verify_width:
            return StepOutputs(b.out_verify_ids[:n, :verify_width].tolist(),
                               b.out_verify_logprobs[:n, :verify_width].tolist())
        out = StepOutputs(b.out_token_ids[:n].tolist(), b.out_logprobs[:n].tolist())
        if b.top_n[:n].any():
            out.top_ids, out.top_logprobs = b.out_top_ids[:n], b.out_top_logprobs[:n]
        return out
