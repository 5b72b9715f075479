"""The token tree of one iteration: K drafted paths merged into a trie, with its attention mask.

The target scores every distinct prefix of the K paths once (one tree node each), over one shared
committed prefix. Node 0 is the root (the pending token); every other node is one distinct prefix
``x^k_{1:i}``, numbered in order of first appearance (path index, then depth), so a parent always
comes before its children.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class TokenTree:
    """A trie over ``K`` paths of ``L`` tokens.

    tokens: (N,) long, the token of each node (node 0: the pending token).
    depth: (N,) long, 0 for the root.
    path_nodes: (K, L+1) long, ``path_nodes[k, i]`` = node of the prefix ``x^k_{1:i}``.
    path_nodes_list: the same as nested lists (host copy, for committing without a device read).
    ancestors: (N, N) bool, ``ancestors[a, b]`` = node ``b`` is node ``a`` or one of its ancestors.
    nodes: the trie's nodes; where it was padded (``build_tree``'s ``multiple``), N is more: the padding
    nodes come last, each its own only ancestor, at depth 0, token 0, and no path goes through them.
    """

    tokens: Tensor
    depth: Tensor
    path_nodes: Tensor
    path_nodes_list: list[list[int]]
    ancestors: Tensor
    nodes: int

    @property
    def num_nodes(self) -> int:
        """The trie's nodes, padding left out."""
        return self.nodes


def build_tree(root_token: int, paths: list[list[int]], device: torch.device | str = "cpu",
               multiple: int = 1) -> TokenTree:
    """Merge ``paths`` (K lists of L tokens, already on the host) under ``root_token``. Built on the
    host with numpy and handed over as tensors (views on the CPU; one copy for all four elsewhere,
    :func:`packed_to`): the same trie as torch code, which took ~240 us for K = 3, L = 8 here (a
    dozen small indexing ops). ``multiple``: pad the node arrays to a multiple of it (see TokenTree)."""
    node_tokens = [root_token]
    parents = [0]
    depths = [0]
    children: dict[tuple[int, int], int] = {}
    path_nodes = []
    for path in paths:
        node, row = 0, [0]
        for token in path:
            key = (node, token)
            child = children.get(key)
            if child is None:
                child = children[key] = len(node_tokens)
                node_tokens.append(token)
                parents.append(node)
                depths.append(depths[node] + 1)
            node = child
            row.append(node)
        path_nodes.append(row)
    n = len(node_tokens)
    padded = -(-n // multiple) * multiple
    node_tokens += [0] * (padded - n)
    depths += [0] * (padded - n)
    # A parent comes before its children, so each node's ancestors are its parent's plus itself.
    ancestors = np.eye(padded, dtype=bool)
    for node in range(1, n):
        ancestors[node] |= ancestors[parents[node]]
    arrays = (np.array(node_tokens, dtype=np.int64), np.array(depths, dtype=np.int64),
              np.array(path_nodes, dtype=np.int64), ancestors)
    if torch.device(device).type == "cpu":
        tokens, depth, nodes, ancestors_t = (torch.from_numpy(a) for a in arrays)  # views, no copy
    else:
        tokens, depth, nodes, ancestors_t = packed_to(arrays, device)
    return TokenTree(tokens=tokens, depth=depth, path_nodes=nodes, path_nodes_list=path_nodes, ancestors=ancestors_t,
                     nodes=n)


def packed_to(arrays: tuple[np.ndarray, ...], device: torch.device | str) -> list[Tensor]:
    """Integer or boolean host arrays as tensors on ``device`` with one copy: packed into one int64
    buffer, copied, and cut into views there (booleans made bool again, one small kernel). Why: a
    copy from pageable host memory synchronises with the device, so four copies were four waits per
    iteration (the first GPU run counted them: docs/ENGINE.md, "The first GPU run")."""
    flat = np.concatenate([a.astype(np.int64, copy=False).ravel() for a in arrays])
    packed = torch.from_numpy(flat).to(device)
    out, offset = [], 0
    for a in arrays:
        view = packed[offset:offset + a.size].view(a.shape)
        out.append(view.bool() if a.dtype == np.bool_ else view)
        offset += a.size
    return out


def prefix_then(tree_mask: Tensor, prefix_len: int) -> Tensor:
    """(Q, T) bool mask over tree slots -> (1, 1, Q, prefix_len + T): every query also sees the prefix."""
    queries = tree_mask.shape[0]
    seen = torch.ones(queries, prefix_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([seen, tree_mask], dim=1)[None, None]
