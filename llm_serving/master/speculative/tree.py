"""Token trees: how proposals are shaped, trimmed and walked, and the rule that keeps what the target agrees with.

A row's proposals are a token tree serialised depth-first: `nodes[j]` a token, `parents[j]` the index of its
parent among the nodes (-1: the request's last token). A chain is the one-branch tree [-1, 0, 1, ...], so every
verify step goes through the same code. The first-child chain is the likeliest branch: its nodes sit in the row's
next slots in order, so after a verify step only the kept nodes on it have their KV in place.
"""
from __future__ import annotations

from dataclasses import dataclass


def chain(n: int) -> list:
    """The parents of a chain of n proposals: [-1, 0, 1, ..., n - 2]."""
    return list(range(-1, n - 1))


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


def node_depths(parents: list) -> list:
    """Depth of each node (1 for the children of the request's last token)."""
    depth = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def trim_tree(nodes: list, parents: list, depth: int, room: int) -> tuple:
    """The first `room` nodes of a depth-first token tree that are at most `depth` deep (depth-first order keeps
    every kept node's parent before it), with parents renumbered."""
    depths, keep = node_depths(parents), []
    for j, p in enumerate(parents):
        if depths[j] <= depth and (p < 0 or p in keep) and len(keep) < room:
            keep.append(j)
    index = {j: n for n, j in enumerate(keep)}
    return [nodes[j] for j in keep], [index.get(parents[j], -1) for j in keep]


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


@dataclass(frozen=True)
class Acceptance:
    """What a verify row keeps: `kept` proposals (node indices, root to leaf), the indices into the row's targets
    of the tokens it gets (`emit`: the target's token after its last token and after each kept node, so
    len(kept) + 1 of them), and how many kept nodes have their KV in place (`in_place`: the leading run of
    kept nodes on the first-child chain; the others are fed again in the row's next step)."""
    kept: list
    emit: list
    in_place: int

    @property
    def off_first_branch(self) -> bool:
        return self.in_place < len(self.kept)


def accept(nodes: list, parents: list, targets) -> Acceptance:
    """The acceptance rule of a verify row (why it is exact: speculative/__init__.py): walk the proposals from
    the request's last token to the child whose token the target sampled there (`tree_walk`; a chain: up to the
    first proposal the target disagrees with), and keep that path and the target's token after it."""
    kept = tree_walk(nodes, parents, targets)
    # nodes are in slots in depth-first order: the first-child chain is nodes 0, 1, 2, ...
    in_place = next((n for n, j in enumerate(kept) if j != n), len(kept))
    return Acceptance(kept, [0] + [j + 1 for j in kept], in_place)


def accepted_prefix(proposal: list, targets) -> int:
    """A chain's rule (`accept` on a tree with one branch): how many leading proposals the target agrees with;
    targets[j] is its token after the row's token j (its last real token, then the proposals)."""
    return len(tree_walk(proposal, chain(len(proposal)), targets))
