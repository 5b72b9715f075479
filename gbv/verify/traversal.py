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

The trie has at most ``K * L + 1`` nodes; everything over the vocabulary is vectorised. Two forms of
one law: :func:`verify_traversal_on_host` walks the trie on the host (a read per tested node; what
the CPU runs), :func:`verify_traversal_on_device` is tensor code with one host read per call (what
runs on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gbv.verify.common import (RandomSource, VerifyResult, check_shapes, host_ints, on_path_probs, take_row,
                               uses_device_form)


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
    if uses_device_form(p):  # one host read instead of one per tested node: see verify_traversal_on_device
        return verify_traversal_on_device(draft_tokens, q, p, rng)
    return verify_traversal_on_host(draft_tokens, q, p, rng)


def verify_traversal_on_host(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """The host form (what :func:`verify_traversal` runs on CPU tensors): the trie and the weights on
    the host, one coin read back per tested node, stopping at the first accepted one."""
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


# ---------------------------------------------------------------------- device form
@dataclass
class _SlotTrie:
    """The trie of the K paths as tensors over *slots* ``(k, d)``: the node path ``k`` reaches at
    depth ``d`` (``d = 0`` is the root). Paths with a common prefix share its nodes, so several slots
    name one node; its *canonical* slot is that of its first path (``_Tree.first_path``)."""

    first: Tensor  # (K, L+1) long: the first path through slot (k, d)'s node
    canonical: Tensor  # (K, L+1) bool: first[k, d] == k
    child_of: Tensor  # (K, K, L) bool: slot (j, d+1) is canonical and a child of slot (k, d)'s node
    child_index: Tensor  # (K, L+1) long: the node's position among its parent's children (0 at the root)
    num_children: Tensor  # (K, L+1) long
    post_rank: Tensor  # (K, L+1) long: the node's position in post-order (canonical slots; K(L+1) elsewhere)


def _slot_trie(draft_tokens: Tensor) -> _SlotTrie:
    """:func:`_build_trie` as tensor code (no host read). (K, L) long -> :class:`_SlotTrie`.

    Post-order with children in first-appearance order is the order in which the host form tests
    nodes: after a rejected leaf is deleted, the first leaf in depth-first order is the next node of
    the post-order. Node ``u`` comes before node ``v`` there iff ``v`` is an ancestor of ``u``, or
    neither is an ancestor of the other and, below their last common node, ``u``'s branch has the
    smaller first path."""
    num_paths, block_len = draft_tokens.shape
    device = draft_tokens.device
    paths = torch.arange(num_paths, device=device)
    same = draft_tokens[:, None, :] == draft_tokens[None, :, :]  # (K, K, L)
    agree = torch.cat((torch.ones(num_paths, num_paths, 1, dtype=torch.bool, device=device),
                       same.to(torch.uint8).cumprod(-1).bool()), -1)
    first = agree.to(torch.uint8).argmax(1)  # argmax returns the first maximal index: the smallest j
    canonical = first == paths[:, None]
    child_of = canonical[None, :, 1:] & agree[:, :, :-1]
    no_children = torch.zeros(num_paths, 1, dtype=torch.long, device=device)
    num_children = torch.cat((child_of.sum(1), no_children), -1)
    # Children are ordered by first path: a canonical child (j, d+1) has as many earlier siblings as
    # canonical slots (j', d+1), j' < j, under the same parent. Aliased slots read their node's value.
    earlier = (child_of & (paths[None, :] < paths[:, None])[:, :, None]).sum(1)  # (K, L) at depth d+1
    child_index = torch.cat((no_children, earlier), -1).gather(0, first)

    # Pairwise order over the K(L+1) slots, flattened k-major: slot s = k (L+1) + d.
    depth = torch.arange(block_len + 1, device=device).repeat(num_paths)  # (N,)
    path = paths.repeat_interleave(block_len + 1)  # (N,)
    common = agree[:, :, 1:].sum(-1)[path][:, path]  # (N, N) shared leading tokens of the two paths
    d_u, d_v = depth[:, None], depth[None, :]
    v_above_u = (d_v < d_u) & (common >= d_v)  # v is a proper ancestor of u
    u_above_v = (d_u < d_v) & (common >= d_u)
    branch = (common + 1).clamp_max(block_len)  # depth of the two branches below the last common node
    first_flat = first.reshape(-1)
    branch_u = first_flat[path[:, None] * (block_len + 1) + branch]
    branch_v = first_flat[path[None, :] * (block_len + 1) + branch]
    u_before_v = v_above_u | (~u_above_v & (branch_u < branch_v))
    canonical_flat = canonical.reshape(-1)
    rank = (u_before_v & canonical_flat[:, None]).sum(0)  # canonical nodes before each slot
    post_rank = torch.where(canonical_flat, rank, depth.numel()).reshape(num_paths, block_len + 1)
    return _SlotTrie(first, canonical, child_of, child_index, num_children, post_rank)


def _remove_token_on_device(dist_q: Tensor, tokens: Tensor) -> Tensor:
    """:func:`_remove_token` per row: each row with its token zeroed, renormalised (left all-zero if
    nothing remains). (N, V), (N,) long -> (N, V)."""
    zeroed = dist_q.scatter(1, tokens[:, None], 0.0)
    left = zeroed.sum(1, keepdim=True)
    return torch.where(left > 0.0, zeroed / torch.where(left > 0.0, left, 1.0), zeroed)


def _reject_child_on_device(w: Tensor, dist_p: Tensor, dist_q: Tensor, tokens: Tensor
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """The host form's update of a node after its child of token ``tokens`` is rejected, per row, from
    the node's old values: ``R = (w P - Q)+``, ``w <- Z / (Z + 1 - w)`` (1 if that denominator is 0),
    ``P <- R / Z`` (if ``Z > 0``), ``Q`` without the token. (N,) float64, (N, V), (N, V), (N,) long."""
    res = (w.to(dist_p.dtype)[:, None] * dist_p - dist_q).clamp_min(0.0)
    mass = res.sum(1, keepdim=True)
    mass64 = mass[:, 0].double()
    denom = mass64 + (1.0 - w)  # grouped so that w = 1 gives exactly mass / mass = 1
    new_w = torch.where(denom <= 0.0, 1.0, torch.clamp(mass64 / torch.where(denom > 0.0, denom, 1.0), max=1.0))
    new_p = torch.where(mass > 0.0, res / torch.where(mass > 0.0, mass, 1.0), dist_p)
    return new_w, new_p, _remove_token_on_device(dist_q, tokens)


def verify_traversal_on_device(draft_tokens: Tensor, q: Tensor, p: Tensor, rng: RandomSource) -> VerifyResult:
    """:func:`verify_traversal_on_host` as tensor code with one host read (its form on a GPU): the same
    law, by other means.

    The host form tests nodes in post-order, each with its weight at that moment, and stops at the
    first accepted one. Two facts make that a fixed computation:

    - A node's updates depend only on its own state and its children's tokens: rejecting its j-th
      child maps ``(w_u, P_u, Q_u)`` to the next state whatever happened elsewhere. And while a child's
      subtree is tested, its parent sits in the state "j earlier children rejected", so the child's
      weight on entry is ``min(1, w_u P_u(tok) / Q_u(tok))`` from that state. So every node's states
      follow top-down: a loop over depths, each running the K possible child rejections of all nodes
      at that depth at once (masked past a node's number of children).
    - A node is tested when all its children were rejected, with its final weight (1 for the root).
      The tests are independent coins in a fixed order, so the first accepted node is one categorical
      draw: node ``t`` of the post-order with probability ``w_t prod_{s < t} (1 - w_s)``. The next
      token is drawn from that node's final ``P``.

    Path, accepted length and next token are read back together at the end.
    """
    num_paths, block_len, _ = check_shapes(draft_tokens, q, p)
    trie = _slot_trie(draft_tokens)
    depths = torch.arange(block_len + 1, device=p.device)
    node_p = p[trie.first, depths]  # (K, L+1, V): every slot reads its node's rows (those of its first path)
    node_q = q[trie.first[:, :block_len], depths[:block_len]]  # (K, L, V)
    step_index = torch.arange(num_paths, device=p.device)
    weight = torch.ones(num_paths, dtype=torch.float64, device=p.device)  # entry weights at depth d
    final_w, final_p = [], []
    for d in range(block_len):
        dist_p, dist_q, w = node_p[:, d], node_q[:, d], weight
        child_tok = draft_tokens[:, d]  # the child each path goes on to, and its position among its siblings
        child_pos = trie.child_index[:, d + 1]
        # The token of each node's j-th child: (K, J), j < its number of children.
        jth = trie.child_of[:, :, d, None] & (trie.child_index[None, :, d + 1, None] == step_index[None, None, :])
        jth_tok = (jth * draft_tokens[None, :, d, None]).sum(1)
        parent_w = torch.zeros_like(weight)
        edge_p = torch.zeros(num_paths, dtype=p.dtype, device=p.device)
        edge_q = torch.zeros_like(edge_p)
        for j in range(num_paths):
            # The children at position j see their parent after j rejections: read its state now.
            here = child_pos == j
            parent_w = torch.where(here, w, parent_w)
            edge_p = torch.where(here, dist_p.gather(1, child_tok[:, None])[:, 0], edge_p)
            edge_q = torch.where(here, dist_q.gather(1, child_tok[:, None])[:, 0], edge_q)
            # Reject the j-th child (where the node has one).
            new_w, new_p, new_q = _reject_child_on_device(w, dist_p, dist_q, jth_tok[:, j])
            has_jth = trie.num_children[:, d] > j
            w = torch.where(has_jth, new_w, w)
            dist_p = torch.where(has_jth[:, None], new_p, dist_p)
            dist_q = torch.where(has_jth[:, None], new_q, dist_q)
        final_w.append(w)
        final_p.append(dist_p)
        # Entry weights one level down: _child_weight on the recorded parent states.
        ratio = parent_w * edge_p.double() / torch.where(edge_q > 0.0, edge_q.double(), 1.0)
        weight = torch.where(edge_q > 0.0, torch.clamp(ratio, max=1.0),
                             ((edge_p > 0.0) & (parent_w > 0.0)).double())
    final_w.append(weight)
    final_p.append(node_p[:, block_len])
    test_w = torch.stack(final_w, 1)  # (K, L+1): the weight each node is tested with
    test_w[:, 0] = 1.0  # the root accepts
    test_w = torch.where(trie.canonical, test_w, 0.0).reshape(-1)
    order = torch.argsort(trie.post_rank.reshape(-1), stable=True)
    in_order = test_w[order]
    reached = torch.cat((in_order.new_ones(1), torch.cumprod(1.0 - in_order, 0)[:-1]))
    slot = take_row(order, rng.draw(in_order * reached))  # the first accepted node, as a slot
    next_token = rng.draw(take_row(torch.stack(final_p, 1).reshape(-1, p.shape[-1]), slot))
    return VerifyResult(*host_ints(slot // (block_len + 1), slot % (block_len + 1), next_token))
