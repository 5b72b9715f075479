"""The information-agnostic LP of SPEC section 7: the best expected accepted length of *any* lossless
verifier that sees all K drafted paths and every distribution (on- and off-path).

Variables ``pi(X, o) >= 0`` for every K-tuple ``X`` of drafted length-L sequences with positive draft
probability and every candidate output ``o`` = (a prefix of some path of ``X``, the empty prefix
included) + one token; identical prefixes within ``X`` give one candidate, not several.
Constraints:

- draft marginal: ``sum_o pi(X, o) = q(X)`` for every ``X``;
- target matching: ``sum_{X, o prefix of s} pi(X, o) p(s after o | o) <= p(s)`` for every ``s`` in
  ``V^(L+1)`` (stated as ``<=`` as SPEC advises: both sides sum to 1, so every row is tight anyway);
- objective: maximise ``sum pi(X, o) (|o| - 1)``.

Two exact reformulations keep the matrix small (the optimum is unchanged):

- *Aggregated outputs.* The target rows only see ``y(o) = sum_X pi(X, o)``; one auxiliary variable
  ``y(o)`` per output (with the equality row ``y(o) - sum_X pi(X, o) = 0``) replaces ``V^(L+1-|o|)``
  coefficients per ``pi`` by one. Outputs with target probability ``p(o) = 0`` are dropped: the
  target rows force ``y(o) = 0`` for them.
- *Unordered tuples* (``symmetric=True``, the default). Permuting the paths of ``X`` changes
  neither its candidate outputs nor the rows it enters, so averaging any feasible solution over the
  permutations gives a feasible solution with the same objective that depends on the multiset of
  ``X`` only; one ``X`` per multiset, with draft mass ``multinomial * prod_k q(x^k)``, therefore has
  the same optimum and up to ``K!`` times fewer variables. ``symmetric=False`` builds the ordered
  form of SPEC section 7 literally (tests check both agree).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from gbv.errors import GbvError
from gbv.theory.instance import InstanceError, TinyInstance

# Sizes that HiGHS solves in about 30 s of CPU or less (measured on a shared 2-core machine, on the
# estimate of `lp_size`, dense rows; rows with zeros are much faster): V=2 L=7 K=2 (248k variables,
# 498k nonzeros) ~32 s; V=11 L=2 K=2 (407k, 817k) ~77 s, refused. Checked on the cheap estimate,
# before anything large is allocated.
MAX_LP_VARIABLES = 250_000
MAX_LP_NONZEROS = 500_000
# Per HiGHS attempt; a solve that runs out of time is reported as an LPError, never a hang.
HIGHS_TIME_LIMIT_S = 300.0

# HiGHS's default feasibility tolerances (1e-7) leave errors of ~2e-7 in the optimum; 1e-10 gives
# ~1e-9. On large or badly scaled instances HiGHS may give up at 1e-10 (model status "unknown"): the
# defaults are then tried.
_HIGHS_ATTEMPTS = ({"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}, {})


class LPError(GbvError):
    """HiGHS did not return an optimal solution (one-line message)."""


@dataclass(frozen=True)
class LPSize:
    """Dimensions of the LP (``variables`` = pi and y; ``rows`` = equality + inequality rows)."""

    tuples: int
    variables: int
    rows: int
    nonzeros: int


@dataclass
class _Problem:
    c: np.ndarray
    a_eq: sp.csr_matrix
    b_eq: np.ndarray
    a_ub: sp.csr_matrix
    b_ub: np.ndarray
    size: LPSize


def _draft_sequences(inst: TinyInstance) -> tuple[np.ndarray, np.ndarray]:
    """All length-L sequences with positive draft probability: ((n, L) tokens, (n,) probabilities)."""
    vocab, length = inst.vocab, inst.block_len
    seqs = np.array(list(itertools.product(range(vocab), repeat=length)), dtype=np.int64).reshape(-1, length)
    probs = np.ones(len(seqs))
    for i in range(length):
        # q(x_{i+1} | x_{1:i}) for every sequence at once.
        rows = np.stack([inst.draft[tuple(ctx)] for ctx in seqs[:, :i].tolist()]) if i else \
            np.broadcast_to(inst.draft[()], (len(seqs), vocab))
        probs = probs * rows[np.arange(len(seqs)), seqs[:, i]]
    keep = probs > 0.0
    return seqs[keep], probs[keep]


def _count_tuples(num_seqs: int, num_paths: int, symmetric: bool) -> int:
    return math.comb(num_seqs + num_paths - 1, num_paths) if symmetric else num_seqs ** num_paths


def _tuples(num_seqs: int, seq_probs: np.ndarray, num_paths: int, symmetric: bool
            ) -> tuple[np.ndarray, np.ndarray]:
    """((T, K) sequence indices, (T,) draft masses) of the K-tuples (or multisets)."""
    if symmetric:
        idx = np.array(list(itertools.combinations_with_replacement(range(num_seqs), num_paths)),
                       dtype=np.int64).reshape(-1, num_paths)
        mult = np.full(len(idx), float(math.factorial(num_paths)))
        for row_i, row in enumerate(idx):  # multinomial coefficient K! / prod(count!)
            _, counts = np.unique(row, return_counts=True)
            mult[row_i] /= float(np.prod([math.factorial(int(c)) for c in counts]))
    else:
        idx = np.array(list(itertools.product(range(num_seqs), repeat=num_paths)),
                       dtype=np.int64).reshape(-1, num_paths)
        mult = np.ones(len(idx))
    mass = mult * np.prod(seq_probs[idx], axis=1)
    keep = mass > 0.0
    return idx[keep], mass[keep]


def _target_tables(inst: TinyInstance) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``prefix[n][code]`` = target probability of the length-n sequence with base-V ``code``
    (n = 0..L+1) and ``tail[n][s]`` = p(s_{n+1..L+1} | s_{1..n}) for every s in V^(L+1)."""
    vocab, length = inst.vocab, inst.block_len
    cond = []  # cond[n]: (V^n, V) target next-token table at every context of length n
    for n in range(length + 1):
        cond.append(np.stack([inst.target[ctx] for ctx in itertools.product(range(vocab), repeat=n)]))
    prefix = [np.ones(1)]
    for n in range(length + 1):
        prefix.append((prefix[n][:, None] * cond[n]).reshape(-1))
    full = np.arange(vocab ** (length + 1), dtype=np.int64)
    tail = [np.ones(0)] * (length + 2)
    tail[length + 1] = np.ones(len(full))
    for n in range(length, -1, -1):  # multiply in p(s_{n+1} | s_{1..n})
        ctx_code = full // vocab ** (length + 1 - n)
        tok = (full // vocab ** (length - n)) % vocab
        tail[n] = tail[n + 1] * cond[n][ctx_code, tok]
    return prefix, tail


def lp_size(inst: TinyInstance, num_paths: int | None = None, symmetric: bool = True) -> LPSize:
    """Upper bounds on the LP's dimensions, computed without building it (cheap)."""
    num_paths = num_paths or inst.num_paths
    vocab, length = inst.vocab, inst.block_len
    num_seqs = len(_draft_sequences(inst)[0])
    tuples = _count_tuples(num_seqs, num_paths, symmetric)
    nodes = 1 + length * min(num_paths, num_seqs)  # distinct prefixes in one tuple, at most
    pis = tuples * nodes * vocab
    outputs = sum(vocab ** n for n in range(1, length + 2))
    target_rows = vocab ** (length + 1)
    nonzeros = 2 * pis + outputs + (length + 1) * target_rows
    return LPSize(tuples=tuples, variables=pis + outputs, rows=tuples + outputs + target_rows,
                  nonzeros=nonzeros)


def check_lp_size(inst: TinyInstance, num_paths: int | None = None, symmetric: bool = True) -> LPSize:
    """:func:`lp_size`, raising :class:`InstanceError` (one line) when the LP is too large to solve."""
    size = lp_size(inst, num_paths, symmetric)
    if size.variables > MAX_LP_VARIABLES or size.nonzeros > MAX_LP_NONZEROS:
        raise InstanceError(
            f"instance too large for the LP: about {size.variables} variables and {size.nonzeros} nonzeros "
            f"(at most {MAX_LP_VARIABLES} and {MAX_LP_NONZEROS}); use a smaller vocab, block_len or num_paths")
    return size


def build_lp(inst: TinyInstance, num_paths: int | None = None, symmetric: bool = True) -> _Problem:
    """The LP in ``linprog`` form (minimise ``c @ x``): variables are all ``pi`` then all ``y``."""
    num_paths = num_paths or inst.num_paths
    check_lp_size(inst, num_paths, symmetric)
    vocab, length = inst.vocab, inst.block_len
    seqs, seq_probs = _draft_sequences(inst)
    tuple_idx, tuple_mass = _tuples(len(seqs), seq_probs, num_paths, symmetric)
    num_tuples = len(tuple_idx)
    prefix_prob, tail = _target_tables(inst)

    # Prefix (node) ids: a length-m prefix with base-V code c has id node_offset[m] + c.
    node_offset = np.concatenate([[0], np.cumsum([vocab ** m for m in range(length + 1)])])
    seq_nodes = np.zeros((len(seqs), length + 1), dtype=np.int64)
    code = np.zeros(len(seqs), dtype=np.int64)
    for m in range(length + 1):
        seq_nodes[:, m] = node_offset[m] + code
        if m < length:
            code = code * vocab + seqs[:, m]
    # Distinct nodes of each tuple: sort each row, keep the first of every run.
    nodes = np.sort(seq_nodes[tuple_idx].reshape(num_tuples, -1), axis=1)
    first = np.ones_like(nodes, dtype=bool)
    first[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
    pi_tuple = np.nonzero(first)[0]  # row index = tuple of each (tuple, node) pair
    pi_node = nodes[first]
    # Expand by the emitted token; output o = node + token, a sequence of length m + 1.
    node_len = np.searchsorted(node_offset, pi_node, side="right") - 1
    node_code = pi_node - node_offset[node_len]
    pi_tuple = np.repeat(pi_tuple, vocab)
    out_len = np.repeat(node_len + 1, vocab)
    out_code = np.repeat(node_code * vocab, vocab) + np.tile(np.arange(vocab), len(node_code))
    out_prob = np.zeros(len(out_code))
    for n in range(1, length + 2):
        sel = out_len == n
        out_prob[sel] = prefix_prob[n][out_code[sel]]
    keep = out_prob > 0.0
    pi_tuple, out_len, out_code = pi_tuple[keep], out_len[keep], out_code[keep]
    num_pi = len(pi_tuple)

    # One y per distinct output.
    out_offset = np.concatenate([[0], np.cumsum([vocab ** n for n in range(length + 2)])])
    out_id = out_offset[out_len] + out_code
    uniq_out, pi_to_y = np.unique(out_id, return_inverse=True)
    num_y = len(uniq_out)
    y_len = np.searchsorted(out_offset, uniq_out, side="right") - 1
    y_code = uniq_out - out_offset[y_len]

    # Equality rows: draft marginals (num_tuples), then links y(o) - sum pi(X, o) = 0 (num_y).
    eq_rows = np.concatenate([pi_tuple, num_tuples + pi_to_y, num_tuples + np.arange(num_y)])
    eq_cols = np.concatenate([np.arange(num_pi), np.arange(num_pi), num_pi + np.arange(num_y)])
    eq_vals = np.concatenate([np.ones(num_pi), -np.ones(num_pi), np.ones(num_y)])
    a_eq = sp.csr_matrix((eq_vals, (eq_rows, eq_cols)), shape=(num_tuples + num_y, num_pi + num_y))
    b_eq = np.concatenate([tuple_mass, np.zeros(num_y)])

    # Target rows: sum_{o prefix of s} y(o) p(s after o | o) <= p(s).
    ub_rows, ub_cols, ub_vals = [], [], []
    for n in range(1, length + 2):
        sel = np.nonzero(y_len == n)[0]
        if len(sel) == 0:
            continue
        span = vocab ** (length + 1 - n)
        s = (y_code[sel] * span)[:, None] + np.arange(span)[None, :]
        coef = tail[n][s]
        nz = coef > 0.0
        ub_rows.append(s[nz])
        ub_cols.append(np.broadcast_to((num_pi + sel)[:, None], s.shape)[nz])
        ub_vals.append(coef[nz])
    num_s = vocab ** (length + 1)
    a_ub = sp.csr_matrix((np.concatenate(ub_vals), (np.concatenate(ub_rows), np.concatenate(ub_cols))),
                         shape=(num_s, num_pi + num_y))
    b_ub = prefix_prob[length + 1]

    c = np.concatenate([np.zeros(num_pi), -(y_len - 1).astype(np.float64)])  # maximise E[|o| - 1]
    size = LPSize(tuples=num_tuples, variables=num_pi + num_y, rows=num_tuples + num_y + num_s,
                  nonzeros=int(a_eq.nnz + a_ub.nnz))
    return _Problem(c, a_eq, b_eq, a_ub, b_ub, size)


def lp_optimum(inst: TinyInstance, num_paths: int | None = None, symmetric: bool = True) -> float:
    """Optimal expected accepted length ``E[tau]`` of any lossless K-path verifier (SPEC section 7).

    Raises :class:`InstanceError` when the LP is too large and :class:`LPError` when HiGHS fails.
    """
    problem = build_lp(inst, num_paths, symmetric)
    for options in _HIGHS_ATTEMPTS:
        res = linprog(problem.c, A_ub=problem.a_ub, b_ub=problem.b_ub, A_eq=problem.a_eq, b_eq=problem.b_eq,
                      bounds=(0, None), method="highs", options={**options, "time_limit": HIGHS_TIME_LIMIT_S})
        if res.status == 0 and res.x is not None:
            return float(-res.fun)
    message = " ".join(str(res.message).split())
    raise LPError(f"the LP solver (HiGHS) failed on this instance (status {res.status}): {message}")


__all__ = ["LPError", "LPSize", "MAX_LP_NONZEROS", "MAX_LP_VARIABLES", "build_lp", "check_lp_size",
           "lp_optimum", "lp_size"]
