"""Prompt lookup: proposers that look into each request's own tokens on the master, at once (no model, no
blocks reserved before proposing).

- `ngram` (`NgramProposer.lookup`): the request's last n tokens (n from ngram_max down to ngram_min) are looked
  up in its own earlier tokens (prompt and output); the k tokens that followed the latest match are the
  proposal. It pays when the output copies from the input (summaries, rewrites, code edits).
- `tree` (`NgramProposer.lookup_tree`): the several continuations (matches of the longest suffixes, latest
  first, up to tree_width distinct ones) merged into a token tree (tree.py), the best continuation as the
  first-child chain.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from llm_serving.master.speculative.tree import chain, tree_from_paths


class LookupProposer:
    """A proposer that looks into each request's own tokens on the master, at once: the planner's `Proposer` for
    lookups. A subclass says what follows a token sequence: `lookup` (a chain) and, for token trees (tree_width >
    0), `lookup_tree`."""

    reserves_blocks = False             # its proposals take blocks only once kept (SpeculativePlanner.attach)
    agent_step_kind = None              # it runs no agent steps: its time is the schedule phase's

    def __init__(self, num_tokens: int, tree_width: int = 0):
        self.num_tokens = num_tokens    # most tokens proposed per row (a tree: its depth)
        self.tree_width = tree_width    # > 0: up to this many continuations per row, as a token tree

    async def propose(self, requests: list, limits: list) -> list:
        """(nodes, parents) per row: up to limits[i] tokens deep ([], [] where limits[i] is 0)."""
        return [self._propose_row(req.tokens(0, req.num_tokens), k) if k else ([], [])
                for req, k in zip(requests, limits)]

    def _propose_row(self, tokens, k: int) -> tuple:
        if self.tree_width:
            return self.lookup_tree(tokens, k, self.tree_width)
        nodes = self.lookup(tokens, k)
        return nodes, chain(len(nodes))

    def lookup(self, tokens, k: Optional[int] = None) -> list:
        raise NotImplementedError

    def lookup_tree(self, tokens, k: Optional[int] = None, width: int = 2) -> tuple:
        raise NotImplementedError


class NgramProposer(LookupProposer):
    """Prompt lookup: propose what followed the latest earlier occurrence of the request's last n tokens."""

    def __init__(self, num_tokens: int, ngram_max: int, ngram_min: int = 1, tree_width: int = 0):
        if not 1 <= ngram_min <= ngram_max or num_tokens < 1:
            raise ValueError(f"NgramProposer: need 1 <= ngram_min <= ngram_max and num_tokens >= 1, got "
                             f"{ngram_min}, {ngram_max}, {num_tokens}")
        super().__init__(num_tokens, tree_width)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def lookup(self, tokens, k: Optional[int] = None) -> list:
        """Up to k (default num_tokens) tokens to follow `tokens`; [] when no suffix recurs."""
        k = self.num_tokens if k is None else min(k, self.num_tokens)
        seq = np.asarray(tokens, np.int64)
        total = len(seq)
        if k < 1 or total < self.ngram_min + 1:
            return []
        for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
            suffix = seq[total - n:]
            # start positions i < total - n where seq[i:i+n] == suffix (the suffix itself excluded)
            windows = np.lib.stride_tricks.sliding_window_view(seq[:total - 1], n)     # (total - n, n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0]
            if len(hits):
                start = int(hits[-1]) + n          # the latest match: what followed it
                return seq[start:start + k].tolist()
        return []

    def lookup_tree(self, tokens, k: Optional[int] = None, width: int = 2) -> tuple:
        """A token tree of up to `width` continuations of up to k tokens each (k default num_tokens): (nodes,
        parents), nodes in depth-first order, parents[j] the index of node j's parent (-1: the request's last
        token). The first continuation found (longest suffix, latest match) is the first-child chain."""
        k = self.num_tokens if k is None else min(k, self.num_tokens)
        seq = np.asarray(tokens, np.int64)
        total = len(seq)
        found: list = []
        if k >= 1 and total >= self.ngram_min + 1:
            for n in range(min(self.ngram_max, total - 1), self.ngram_min - 1, -1):
                suffix = seq[total - n:]
                windows = np.lib.stride_tricks.sliding_window_view(seq[:total - 1], n)
                for hit in np.nonzero((windows == suffix).all(axis=1))[0][::-1]:
                    cont = tuple(seq[int(hit) + n:int(hit) + n + k].tolist())
                    if cont and not any(f[:len(cont)] == cont for f in found):
                        found.append(cont)
                        if len(found) == width:
                            break
                if len(found) == width:
                    break
        return tree_from_paths(found)
