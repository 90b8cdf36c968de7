"""Speculative decoding, the master's part: proposing tokens for decoding requests and keeping the ones the
target model agrees with.

A speculating request feeds, in one *verify* step, its last token and k proposed tokens x1..xk; the agent
samples the target's token y0..yk after each of them (ModelRunner verify steps, each token with the
request's sampling parameters and the uniform number plain decoding would have used at that output
index). The request keeps y0..ya, where a is the number of leading proposals with y(j-1) == xj: its
proposals up to the first one the target disagrees with, and the target's own token after them.

Why this is exact: y(j) is the token plain decoding samples at that position whenever x1..xj were accepted
(same context, same parameters, same uniform number), so greedy output and seeded sampled output are the
same with speculation on and off. For sampled requests this is speculative (rejection) sampling with a
proposal that puts all its mass on one token x: accept x with probability p(x), else sample from p
without x, renormalised — which is what "sample y from p, accept when y == x" does.

Proposers (spec_config.method):
- `ngram`: prompt lookup. The request's last n tokens (n from ngram_max down to ngram_min) are looked up
  in its own earlier tokens (prompt and output); the k tokens that followed the latest match are the
  proposal. No model; it pays when the output copies from the input (summaries, rewrites, code edits).

- `tree`: prompt lookup's several continuations (matches of the longest suffixes, latest first, up to
  tree_width distinct ones) merged into a token tree, serialised depth-first with the best continuation as
  the first-child chain. The verify step runs every node with a tree mask (a node sees its ancestors only;
  ModelRunner's verify_parent); the request walks from its last token to the child whose token is the
  target's sample there, and keeps that path plus the target's token after it (`tree_walk`). Exact for the
  same reason as a chain: each kept token is the target's sample after the path actually taken.
- `draft`, `draft_tree`: a draft model in an agent process of its own proposes greedily (draft.py); a draft
  tree has its tree_width most likely first tokens as branches, each continued greedily.

Speculation happens only in decode steps of at most spec_config.max_batch_size rows (larger steps are
compute-bound, and checking guesses costs more than it saves) and only for requests that allow it (a
request's `speculative` parameter) and need no top log-probabilities or sampling penalties (those come
from the last token's logits only). spec_decode.py plans those steps (limits, blocks, attaching proposals).
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np

from llm_serving.master.request import Request


class LookupProposer:
    """A proposer that looks into each request's own tokens on the master, at once (no model, no blocks before
    proposing): spec_decode's Proposer for lookups. A subclass says what follows a token sequence: `lookup` (a
    chain) and, for token trees (tree_width > 0), `lookup_tree`."""

    reserves_blocks = False             # its proposals take blocks only once kept (spec_decode.attach)
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
        return nodes, list(range(-1, len(nodes) - 1))

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


def tree_from_paths(paths: list) -> tuple:
    """(nodes, parents) of the trie of `paths` (shared prefixes merged), depth-first, children in the order
    their paths came: the first path is the first-child chain."""
    children: dict = {}                    # (parent node or -1, token) -> node, in creation order
    order: dict = {-1: []}
    for path in paths:
        parent = -1
        for tok in path:
            key = (parent, tok)
            if key not in children:
                children[key] = len(children)
                order[parent].append((tok, children[key]))
                order[children[key]] = []
            parent = children[key]
    nodes, parents = [], []

    def visit(node: int, index: int) -> None:
        for tok, child in order[node]:
            nodes.append(tok)
            parents.append(index)
            visit(child, len(nodes) - 1)
    visit(-1, -1)
    return nodes, parents


def tree_walk(nodes: list, parents: list, targets) -> list:
    """The path a verify step keeps: targets[0] is the target's token after the request's last token,
    targets[j + 1] after node j. From the last token, move to the child whose token is the target's there,
    while one is; returns the kept nodes' indices (the target's token after the last of them comes next)."""
    path, at = [], -1
    while True:
        y = int(targets[at + 1])
        nxt = next((j for j in range(len(nodes)) if parents[j] == at and nodes[j] == y), None)
        if nxt is None:
            return path
        path.append(nxt)
        at = nxt


def node_depths(parents: list) -> list:
    """Depth of each node (1 for the children of the request's last token)."""
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


class SpecStats:
    """What speculation did: rounds (a row speculating in a verify step), tokens proposed and accepted, and
    how often the proposal at each position was accepted."""

    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens
        self.rounds = 0
        self.proposed = 0
        self.accepted = 0
        self.accepted_at: Counter = Counter()       # position (1-based) -> rounds that accepted it
        self.verify_steps = 0
        self.other_branch_rounds = 0                # token trees: rounds that kept a path off the first branch

    def record(self, proposed: int, accepted: int, other_branch: bool = False) -> None:
        self.rounds += 1
        self.other_branch_rounds += other_branch
        self.proposed += proposed
        self.accepted += accepted
        for j in range(1, accepted + 1):
            self.accepted_at[j] += 1

    def as_dict(self) -> dict:
        rounds = max(self.rounds, 1)
        return {
            "verify_steps": self.verify_steps,
            "rounds": self.rounds,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "other_branch_rounds": self.other_branch_rounds,
            "acceptance_rate": round(self.accepted / self.proposed, 4) if self.proposed else None,
            # tokens a speculating row gained per verify step: its accepted proposals plus the target's own
            "mean_tokens_per_round": round((self.accepted + self.rounds) / rounds, 4) if self.rounds else None,
            "acceptance_by_position": {str(j): round(self.accepted_at[j] / rounds, 4)
                                       for j in range(1, self.num_tokens + 1)} if self.rounds else {},
        }


def accepted_prefix(proposal: list, targets) -> int:
    """A chain's rule (tree_walk on a tree with one branch): how many leading proposals the target agrees with;
    targets[j] is its token after the row's token j (its last real token, then the proposals)."""
    return len(tree_walk(proposal, list(range(-1, len(proposal) - 1)), targets))


def can_speculate(req: Request) -> bool:
    """The request may speculate: it asks for it and needs nothing only its last token's logits give."""
    sp = req.sampling
    return sp.speculative and not sp.top_logprobs and not sp.adjusts_logits
