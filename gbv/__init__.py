"""gbv: lossless multi-path speculative sampling.

    import gbv
    pair = gbv.load_pair("bundled")                 # or load_pair(target="...", draft="...")
    out = gbv.generate(pair, prompt="Question: ...", method="gbv", num_paths=3, block_len=8)
    print(out.text, out.stats.block_efficiency)
    outs = gbv.generate(pair, prompts=["Question: ...", "def f("], seed=0)   # a batch: one output each

Where things are: verifiers in ``gbv/verify/`` (GBV is ``gbv/verify/gbv.py``), exact theory in
``gbv/theory/``, the decoding loop in ``gbv/engine/``, model loading in ``gbv/models/``, prompt sets
in ``gbv/data/``, benchmarks in ``gbv/bench/``, the CLI in ``gbv/cli.py``.
"""

from __future__ import annotations

from gbv._lazy import lazy_names

__version__ = "0.1.0"

# Heavy imports (torch, transformers) happen only when these are first used.
_LAZY = {
    "load_pair": "gbv.models.loading",
    "generate": "gbv.engine.generate",
    "GenerationConfig": "gbv.engine.config",
    "GbvError": "gbv.errors",
}


__getattr__ = lazy_names(__name__, _LAZY)[0]  # (dir(gbv) is its own, below: __all__ and dunders)


def __dir__() -> list[str]:
    """The module's own names plus the lazy ones (so ``dir(gbv)`` and tab completion list them)."""
    return sorted(set(__all__) | {name for name in globals() if name.startswith("__")})


__all__ = ["GbvError", "GenerationConfig", "__version__", "generate", "load_pair"]
