"""Traversal Verification over the trie of the K drafted paths. SPEC section 6.

Weng et al., "Traversal Verification for Speculative Tree Decoding", NeurIPS 2025.

Sequence-level, leaf-to-root verification. The K i.i.d. paths are merged into a trie (identical
prefixes share nodes; children ordered by first appearance, i.e. by the index of the first path that
reaches them). Each node ``u`` holds ``P_u = p(.|u)``, ``Q_u = q(.|u)`` (the law its children were
drawn from) and a weight ``w_u``: ``w_root = 1``, ``w_v = min(1, w_u P_u(tok v) / Q_u(tok v))``.
Then repeatedly take the first leaf ``v`` in depth-first order (always descend into the first
remaining child):

- ``v`` is the root: emit ``Y ~ P_root`` (accepted length 0);
- with probability ``w_v`` accept the whole path root -> ``v`` and emit ``Y ~ P_v``;
- otherwise delete ``v`` and update its parent ``u`` from u's *old* values:
  ``R = (w_u P_u - Q_u)+``, ``Z = sum R``, ``w_u <- Z / (Z + 1 - w_u)`` (1 if the denominator is 0),
  ``P_u <- R / Z`` (if ``Z > 0``), ``Q_u(tok v) <- 0`` and renormalise ``Q_u``; then recompute the
  weights of u's remaining subtree top-down.

A single chain (K = 1, or K equal paths) is exactly Block Verification (SPEC section 2). At
temperature 0 (one-hot ``p``) weights are 1 along argmax-matching prefixes and 0 past the first
mismatch, so the deepest matching prefix over all paths is accepted, then the argmax (SPEC section 8).

The trie has at most ``K * L + 1`` nodes; everything over the vocabulary is vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gbv.verify.common import RandomSource, VerifyResult, check_shapes, on_path_probs


@dataclass
class _Tree:
    """A draft tree in node-id order (a parent's id is smaller than its children's; the root is 0)."""

    parent: list[int]  # -1 for the root
    token: list[int]  # token on the edge into the node; -1 for the root
    depth: list[int]  # number of drafted tokens from the root
    first_path: list[int]  # lowest index of a path through the node
    children: list[list[int]]  # in first-appearance order


def _build_trie(paths: list[list[int]]) -> _Tree:
    """Trie of the K paths: identical prefixes merged, children in order of the first path reaching them."""
    tree = _Tree([-1], [-1], [0], [0], [[]])
    index: dict[tuple[int, int], int] = {}
    for k, path in enumerate(paths):
        node = 0
        for i, tok in enumerate(path):
            child = index.get((node, tok))
            if child is None:
                child = len(tree.parent)
                index[(node, tok)] = child
                tree.parent.append(node)
                tree.token.append(tok)
                tree.depth.append(i + 1)
                tree.first_path.append(k)
                tree.children.append([])
                tree.children[node].append(child)
            node = child
    return tree


def _child_weight(w_parent: float, p_tok: float, q_tok: float) -> float:
    """``min(1, w_parent * P(tok) / Q(tok))``. Drafted tokens have ``Q(tok) > 0``; the guard only avoids 0 / 0."""
    if q_tok <= 0.0:
        return 1.0 if (p_tok > 0.0 and w_parent > 0.0) else 0.0
    return min(1.0, w_parent * p_tok / q_tok)


def _remove_token(q_u: Tensor, tok: int) -> Tensor:
    """``Q_u`` with ``Q_u(tok) = 0``, renormalised (left all-zero if nothing remains). Shape (V,)."""
    q_u = q_u.clone()
    q_u[tok] = 0.0
    total = float(q_u.sum())
    return q_u / total if total > 0.0 else q_u


def verify_traversal(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """Traversal Verification on the trie of the K drafted paths.

    Args:
        draft_tokens: (K, L) long, K paths drawn i.i.d. from the draft.
        q: (K, L, V) draft distributions each token was sampled from.
        p: (K, L+1, V) target distributions after each prefix of each path.
        rng: the random source (``accept`` / ``sample``).
    Returns:
        ``VerifyResult(path, accepted_len, next_token)``; ``path`` is the first (lowest-index) path
        through the accepted node.
    """
    _, block_len, _ = check_shapes(draft_tokens, q, p)
    tree = _build_trie(draft_tokens.tolist())
    num_nodes = len(tree.parent)
    # Per-node distributions: rows of the first path through the node (all its paths share them).
    dist_p = [p[tree.first_path[u], tree.depth[u]] for u in range(num_nodes)]
    dist_q = [q[tree.first_path[u], tree.depth[u]] if tree.depth[u] < block_len else None
              for u in range(num_nodes)]
    # Edge probabilities (P_parent(tok), Q_parent(tok)) of every node, from one gather over all paths.
    on_p, on_q = torch.stack((on_path_probs(p[:, :block_len], draft_tokens),
                              on_path_probs(q, draft_tokens))).tolist()
    edge = [(1.0, 1.0)] + [(on_p[tree.first_path[v]][tree.depth[v] - 1], on_q[tree.first_path[v]][tree.depth[v] - 1])
                           for v in range(1, num_nodes)]
    weight = [1.0] * num_nodes
    for v in range(1, num_nodes):  # parents come first in id order
        weight[v] = _child_weight(weight[tree.parent[v]], *edge[v])

    while True:
        v = 0
        while tree.children[v]:
            v = tree.children[v][0]
        if v == 0:
            return VerifyResult(0, 0, rng.sample(dist_p[0]))
        if rng.accept(weight[v]):
            return VerifyResult(tree.first_path[v], tree.depth[v], rng.sample(dist_p[v]))
        # Reject v: delete it and update its parent u from u's old values.
        u = tree.parent[v]
        tree.children[u].remove(v)
        w_u, p_u, q_u = weight[u], dist_p[u], dist_q[u]
        res = (w_u * p_u - q_u).clamp_min(0.0)
        mass = float(res.sum())
        denom = mass + (1.0 - w_u)  # grouped so that w_u = 1 gives exactly mass / mass = 1
        weight[u] = 1.0 if denom <= 0.0 else min(1.0, mass / denom)
        if mass > 0.0:
            dist_p[u] = res / mass
        dist_q[u] = _remove_token(q_u, tree.token[v])
        # Recompute the weights of u's remaining subtree, top-down.
        kids = tree.children[u]
        if kids:
            toks = [tree.token[c] for c in kids]
            new_p, new_q = torch.stack((dist_p[u][toks], dist_q[u][toks])).tolist()
            for c, p_tok, q_tok in zip(kids, new_p, new_q):
                edge[c] = (p_tok, q_tok)
            stack = list(kids)
            while stack:
                c = stack.pop()
                weight[c] = _child_weight(weight[tree.parent[c]], *edge[c])
                stack.extend(tree.children[c])
