"""Tiny explicit models for exact analysis: every target / draft distribution as a table.

An instance holds ``target[ctx]`` for every context of length ``0..L`` and ``draft[ctx]`` for every
context of length ``0..L-1``, where ``ctx`` is the tuple of tokens drafted so far in this iteration
(``()`` is the root). JSON form (``gbv bound``)::

    {"vocab": V, "block_len": L, "num_paths": K,
     "target": {"": [..V probs..], "0": [...], "0,1": [...], ...},
     "draft":  {"": [...], ...}}
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gbv.errors import GbvError

Context = tuple[int, ...]

# Exact enumeration visits V^(L*K) draft tuples; the LP has about that many times V^(L+1) variables.
MAX_DRAFT_TUPLES = 20_000
ROW_SUM_TOLERANCE = 1e-6


class InstanceError(GbvError):
    """A malformed or too-large instance; the message is one line, fit for a CLI."""


@dataclass
class TinyInstance:
    vocab: int
    block_len: int
    num_paths: int
    target: dict[Context, np.ndarray]
    draft: dict[Context, np.ndarray]

    def contexts(self, max_len: int) -> list[Context]:
        """All contexts of length 0..max_len, shortest first."""
        return [ctx for n in range(max_len + 1) for ctx in itertools.product(range(self.vocab), repeat=n)]

    def num_draft_tuples(self, num_paths: int | None = None) -> int:
        return self.vocab ** (self.block_len * (num_paths or self.num_paths))

    def with_paths(self, num_paths: int) -> "TinyInstance":
        return TinyInstance(self.vocab, self.block_len, num_paths, self.target, self.draft)

    # ------------------------------------------------------------------ sequence laws
    def seq_prob(self, table: dict[Context, np.ndarray], seq: Context, start: Context = ()) -> float:
        """Probability that ``table`` continues ``start`` with ``seq``."""
        prob, ctx = 1.0, start
        for tok in seq:
            prob *= float(table[ctx][tok])
            ctx = ctx + (tok,)
        return prob

    def target_law(self) -> np.ndarray:
        """Law of the first L+1 target tokens, indexed like ``itertools.product(range(V), repeat=L+1)``."""
        return np.array([self.seq_prob(self.target, s)
                         for s in itertools.product(range(self.vocab), repeat=self.block_len + 1)])

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        key = lambda ctx: ",".join(map(str, ctx))  # noqa: E731
        return {"vocab": self.vocab, "block_len": self.block_len, "num_paths": self.num_paths,
                "target": {key(c): [float(x) for x in v] for c, v in self.target.items()},
                "draft": {key(c): [float(x) for x in v] for c, v in self.draft.items()}}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _positive_int(obj: dict, name: str, upper: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InstanceError(f"'{name}' must be a positive integer, got {value!r}")
    if value > upper:
        raise InstanceError(f"'{name}' = {value} is too large for exact analysis (at most {upper})")
    return value


def _parse_table(raw: object, name: str, vocab: int, max_len: int) -> dict[Context, np.ndarray]:
    if not isinstance(raw, dict):
        raise InstanceError(f"'{name}' must be an object mapping contexts to probability lists")
    table: dict[Context, np.ndarray] = {}
    for key, row in raw.items():
        try:
            ctx = tuple(int(t) for t in key.split(",")) if key.strip() else ()
        except ValueError:
            raise InstanceError(f"{name} context {key!r} is not comma-separated token ids") from None
        if len(ctx) > max_len or any(t < 0 or t >= vocab for t in ctx):
            raise InstanceError(f"{name} context {key!r} is not a context of length 0..{max_len} over vocab {vocab}")
        if not isinstance(row, list) or len(row) != vocab:
            raise InstanceError(f"{name}[{key!r}] must be a list of {vocab} probabilities (vocab mismatch)")
        try:
            arr = np.array(row, dtype=np.float64)
        except (TypeError, ValueError):
            raise InstanceError(f"{name}[{key!r}] holds a non-number") from None
        if not np.all(np.isfinite(arr)) or np.any(arr < 0):
            raise InstanceError(f"{name}[{key!r}] has a negative or non-finite probability")
        if abs(arr.sum() - 1.0) > ROW_SUM_TOLERANCE:
            raise InstanceError(f"{name}[{key!r}] sums to {arr.sum():.9g}, not 1 (tolerance {ROW_SUM_TOLERANCE})")
        table[ctx] = arr / arr.sum()
    for ctx in (c for n in range(max_len + 1) for c in itertools.product(range(vocab), repeat=n)):
        if ctx not in table:
            raise InstanceError(f"{name} is missing context {','.join(map(str, ctx))!r} "
                                f"(it needs every context of length 0..{max_len})")
    return table


def parse_instance(obj: object) -> TinyInstance:
    """Validate a JSON object and build the instance; raises :class:`InstanceError` (one line)."""
    if not isinstance(obj, dict):
        raise InstanceError("an instance must be a JSON object with vocab, block_len, num_paths, target, draft")
    vocab = _positive_int(obj, "vocab", 16)
    block_len = _positive_int(obj, "block_len", 8)
    num_paths = _positive_int(obj, "num_paths", 16)
    target = _parse_table(obj.get("target"), "target", vocab, block_len)
    draft = _parse_table(obj.get("draft"), "draft", vocab, block_len - 1)
    inst = TinyInstance(vocab, block_len, num_paths, target, draft)
    if inst.num_draft_tuples() > MAX_DRAFT_TUPLES:
        raise InstanceError(f"instance too large to enumerate: V^(L*K) = {vocab}^{block_len * num_paths} = "
                            f"{inst.num_draft_tuples()} draft tuples (at most {MAX_DRAFT_TUPLES})")
    return inst


def load_instance(path: str | Path) -> TinyInstance:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InstanceError(f"cannot read instance file {str(path)!r}: {exc.strerror}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InstanceError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    return parse_instance(obj)


# ---------------------------------------------------------------------- random instances
DISTRIBUTION_KINDS = ("dirichlet", "truncated", "equal", "sharp", "mixed")


def _random_dist(rng: np.random.Generator, vocab: int, kind: str) -> np.ndarray:
    if kind == "sharp":  # softmax of Gaussian logits at a low temperature
        logits = rng.normal(size=vocab) / rng.choice([0.05, 0.1, 0.2])
        dist = np.exp(logits - logits.max())
    else:
        dist = rng.dirichlet(np.full(vocab, rng.choice([0.3, 1.0, 3.0])))
        if kind == "truncated" and vocab > 1:  # top-k-like: zero out some tokens, keep at least one
            keep = rng.integers(1, vocab + 1)
            dist[np.argsort(-dist)[keep:]] = 0.0
    return dist / dist.sum()


def random_instance(vocab: int, block_len: int, num_paths: int, seed: int, kind: str = "mixed") -> TinyInstance:
    """A random tiny instance. ``kind``: dirichlet, truncated (zeros), equal (p = q), sharp, or mixed
    (each row picks one of the others, so one instance mixes zeros, sharp rows and p = q rows)."""
    if kind not in DISTRIBUTION_KINDS:
        raise ValueError(f"unknown instance kind {kind!r}; choose one of {DISTRIBUTION_KINDS}")
    rng = np.random.default_rng(seed)
    target: dict[Context, np.ndarray] = {}
    draft: dict[Context, np.ndarray] = {}
    for n in range(block_len + 1):
        for ctx in itertools.product(range(vocab), repeat=n):
            row_kind = rng.choice(["dirichlet", "truncated", "equal", "sharp"]) if kind == "mixed" else kind
            target[ctx] = _random_dist(rng, vocab, "dirichlet" if row_kind == "equal" else row_kind)
            if n < block_len:
                draft[ctx] = target[ctx].copy() if row_kind == "equal" else _random_dist(rng, vocab, row_kind)
    return TinyInstance(vocab, block_len, num_paths, target, draft)


def context_free_instance(p: list[float], q: list[float], block_len: int, num_paths: int) -> TinyInstance:
    """Same ``p`` and ``q`` at every context (SPEC section 10's example)."""
    vocab = len(p)
    pa, qa = np.array(p, dtype=np.float64), np.array(q, dtype=np.float64)
    ctxs = [c for n in range(block_len + 1) for c in itertools.product(range(vocab), repeat=n)]
    return TinyInstance(vocab, block_len, num_paths, {c: pa.copy() for c in ctxs},
                        {c: qa.copy() for c in ctxs if len(c) < block_len})
