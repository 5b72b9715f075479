"""Exact law of any verifier on a tiny instance, by replaying every random branch.

:class:`ReplayRandom` implements the verifier's random source (``accept``, ``sample``) by following a
script of branch choices; :func:`enumerate_branches` runs the verifier once per leaf of its
decision tree (depth-first, re-running from the start for each leaf), so the very code the engine
uses is what the tests prove lossless. :func:`exact_analysis` does this for every K-tuple of drafted
paths of a :class:`~gbv.theory.instance.TinyInstance` and returns the completed law of the emitted
tokens (SPEC section 0) and the exact expected accepted length.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from gbv.theory.instance import Context, TinyInstance
from gbv.verify.common import Verifier, VerifyResult, resolve_refinements

# A verifier may only sample from a normalised distribution; anything further off is a bug.
SAMPLE_SUM_TOLERANCE = 1e-9
# The bounds of accept_within may miss the exact probability by rounding only.
BOUND_TOLERANCE = 1e-12


class ReplayRandom:
    """Random source that follows ``script`` (branch indices) and then always takes branch 0,
    recording the options of every new decision so the caller can visit the others. The vectorised
    primitives (``coins``, ``draw``) replay every joint outcome the same way, one decision each."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.choices: list[int] = []
        self.num_options: list[int] = []
        self.prob = 1.0

    def _choose(self, weights: list[float]) -> int:
        options = [i for i, w in enumerate(weights) if w > 0.0]
        if not options:
            raise AssertionError("verifier made a decision with no possible outcome")
        pos = len(self.choices)
        branch = self.script[pos] if pos < len(self.script) else 0
        self.choices.append(branch)
        self.num_options.append(len(options))
        chosen = options[branch]
        self.prob *= weights[chosen]
        return chosen

    def accept(self, prob: float) -> bool:
        prob = min(1.0, max(0.0, float(prob)))
        return self._choose([prob, 1.0 - prob]) == 0

    def accept_within(self, low: float, high: float, exact) -> bool:
        """The exact probability, branched on as by :meth:`accept`; the bounds, and those of every
        refinement on the way to it, must contain it (a verifier whose bounds did not would decide
        some coins wrongly in production)."""
        prob, bounds = resolve_refinements(low, high, exact)
        for lo, hi in bounds:
            if not lo - BOUND_TOLERANCE <= prob <= hi + BOUND_TOLERANCE:
                raise AssertionError(f"verifier's bounds [{lo!r}, {hi!r}] do not contain its probability {prob!r}")
        return self.accept(prob)

    def coins(self, probs: Tensor) -> Tensor:
        """Independent coins: one decision per coin (the deterministic ones, p in {0, 1}, branch once)."""
        outcomes = [self.accept(prob) for prob in probs.reshape(-1).tolist()]
        return torch.tensor(outcomes, dtype=torch.bool, device=probs.device).reshape(probs.shape)

    def draw(self, dist: Tensor) -> Tensor:
        return torch.tensor(self.sample(dist), dtype=torch.long, device=dist.device)

    def sample(self, dist: Tensor) -> int:
        dist = dist.double()
        if torch.any(dist < 0):
            raise AssertionError("verifier sampled from a distribution with negative entries")
        total = float(dist.sum())
        if abs(total - 1.0) > SAMPLE_SUM_TOLERANCE:
            raise AssertionError(f"verifier sampled from an unnormalised distribution (sum {total!r})")
        return self._choose((dist / total).tolist())


def enumerate_branches(verifier: Verifier, draft_tokens: Tensor, q: Tensor, p: Tensor
                       ) -> list[tuple[VerifyResult, float]]:
    """Every outcome of ``verifier`` on fixed inputs, with its probability (these sum to 1)."""
    leaves: list[tuple[VerifyResult, float]] = []
    stack: list[list[int]] = [[]]
    while stack:
        script = stack.pop()
        rng = ReplayRandom(script)
        result = verifier(draft_tokens, q, p, rng)
        leaves.append((result, rng.prob))
        # Decisions past the script were new: queue their other branches.
        for pos in range(len(script), len(rng.choices)):
            for alt in range(1, rng.num_options[pos]):
                stack.append(rng.choices[:pos] + [alt])
    return leaves


@dataclass
class ExactAnalysis:
    """Exact results of one verifier on one instance."""

    expected_accepted: float  # E[tau]
    max_law_error: float  # max over s in V^(L+1) of |completed law(s) - target law(s)|
    emitted_law: dict[Context, float]  # law of the emitted tokens (prefix + next token)

    @property
    def block_efficiency(self) -> float:
        return self.expected_accepted + 1.0


def _path_tensors(inst: TinyInstance, seq: Context) -> tuple[Tensor, Tensor]:
    """(L, V) draft and (L+1, V) target distributions along one drafted sequence."""
    q = np.stack([inst.draft[seq[:i]] for i in range(inst.block_len)])
    p = np.stack([inst.target[seq[:i]] for i in range(inst.block_len + 1)])
    return torch.from_numpy(q), torch.from_numpy(p)


def exact_analysis(verifier: Verifier, inst: TinyInstance, num_paths: int | None = None) -> ExactAnalysis:
    """Run ``verifier`` on every K-tuple of drafted paths and every random branch.

    The emitted tokens, completed by plain target sampling to L+1 tokens, must have exactly the target
    law; ``max_law_error`` measures how far they are.
    """
    num_paths = num_paths or inst.num_paths
    length = inst.block_len
    seqs = [(s, inst.seq_prob(inst.draft, s)) for s in itertools.product(range(inst.vocab), repeat=length)]
    seqs = [(s, prob) for s, prob in seqs if prob > 0.0]
    tensors = {s: _path_tensors(inst, s) for s, _ in seqs}

    emitted: dict[Context, float] = defaultdict(float)
    expected_accepted = 0.0
    for combo in itertools.product(seqs, repeat=num_paths):
        tuple_prob = float(np.prod([prob for _, prob in combo]))
        if tuple_prob == 0.0:
            continue
        paths = [s for s, _ in combo]
        draft_tokens = torch.tensor(paths, dtype=torch.long).reshape(num_paths, length)
        q = torch.stack([tensors[s][0] for s in paths])
        p = torch.stack([tensors[s][1] for s in paths])
        for result, prob in enumerate_branches(verifier, draft_tokens, q, p):
            if not (0 <= result.path < num_paths and 0 <= result.accepted_len <= length
                    and 0 <= result.next_token < inst.vocab):
                raise AssertionError(f"verifier returned an out-of-range result {result}")
            out = paths[result.path][: result.accepted_len] + (result.next_token,)
            emitted[out] += tuple_prob * prob
            expected_accepted += tuple_prob * prob * result.accepted_len

    completed = np.zeros(inst.vocab ** (length + 1))
    for out, mass in emitted.items():
        rest = length + 1 - len(out)
        for tail in itertools.product(range(inst.vocab), repeat=rest):
            index = 0
            for tok in out + tail:
                index = index * inst.vocab + tok
            completed[index] += mass * inst.seq_prob(inst.target, tail, start=out)
    max_law_error = float(np.max(np.abs(completed - inst.target_law())))
    return ExactAnalysis(expected_accepted, max_law_error, dict(emitted))
