"""Host reads (device -> host synchronisations on a GPU) per verify call and per engine iteration.

On CPU nothing waits, but every ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)`` of a
tensor is a place where a GPU pipeline would stall; :func:`gbv.bench.host_reads.count_host_reads`
counts them by wrapping those methods.
Budget (issue 8): at most 1 per verify call, at most L + 3 per iteration.
"""

from __future__ import annotations

import pytest
import torch

from gbv.bench.host_reads import count_host_reads, verify_inputs
from gbv.engine.generate import generate
from gbv.models.loading import ModelPair
from gbv.verify import TorchRandom, get_verifier

from engine_toy import hf_pair, sharpen


def test_counter_counts():
    with count_host_reads() as reads:
        torch.ones(3).sum().item()
        bool(torch.tensor(True))
    assert reads["n"] == 2


def test_accept_reads_uniforms_in_blocks():
    """TorchRandom.accept draws its float64 uniforms ACCEPT_BLOCK at a time: 128 undecided coins read
    the host twice (one read per coin before), certain ones (prob <= 0 or >= 1) use no uniform, and
    the coins follow their probabilities."""
    from gbv.verify.common import ACCEPT_BLOCK

    rng = TorchRandom(seed=0)
    with count_host_reads() as reads:
        coins = [rng.accept(0.3) for _ in range(2 * ACCEPT_BLOCK)]
        assert all(rng.accept(1.0) for _ in range(10)) and not any(rng.accept(0.0) for _ in range(10))
    assert reads["n"] == 2
    assert sum(coins) > 0
    many = [rng.accept(0.3) for _ in range(20000)]
    assert abs(sum(many) / len(many) - 0.3) < 0.015


def test_accept_within_decides_as_accept_of_the_exact_probability():
    """The coin with bounds takes the same uniform as accept(exact) and decides the same way, for every
    bound pair around the exact probability; exact is computed only when the uniform falls between
    the bounds' probabilities."""
    gen = torch.Generator().manual_seed(3)
    calls = {"n": 0}
    for trial in range(3000):
        exact = float(torch.rand((), generator=gen))
        spread = float(torch.rand((), generator=gen)) * [0.0, 0.01, 0.3, 1.0][trial % 4]
        low, high = max(0.0, exact - spread), min(1.0, exact + spread * 0.5)
        if trial % 7 == 0:
            exact = low = high = float(trial % 2)  # certain coins use no uniform
        seed = 1000 + trial

        def counted(value=exact):
            calls["n"] += 1
            return value

        assert TorchRandom(seed=seed).accept_within(low, high, counted) == TorchRandom(seed=seed).accept(exact)
    assert 0 < calls["n"] < 3000


def test_accept_within_follows_refinements_with_the_same_uniform():
    """A callback may return tighter bounds and a next step (``Refinement``): the coin still decides as
    accept(exact), and each step is computed only when the uniform falls between the previous bounds
    (BV's stop coins: bounds from the weight, from one node's buckets, then the exact mass)."""
    from gbv.verify.common import Refinement

    gen = torch.Generator().manual_seed(4)
    steps = {"tighter": 0, "exact": 0}
    for trial in range(3000):
        exact = float(torch.rand((), generator=gen))
        wide, narrow = (float(torch.rand((), generator=gen)) * 0.5 for _ in range(2))
        low, high = max(0.0, exact - wide), min(1.0, exact + wide)
        low2, high2 = max(low, exact - narrow * wide), min(high, exact + narrow * wide)

        def final(value=exact):
            steps["exact"] += 1
            return value

        def tighter(lo=low2, hi=high2):
            steps["tighter"] += 1
            return Refinement(lo, hi, final)

        seed = 5000 + trial
        assert TorchRandom(seed=seed).accept_within(low, high, tighter) == TorchRandom(seed=seed).accept(exact)
    assert 0 < steps["exact"] < steps["tighter"] < 3000


def test_replay_random_checks_every_refinements_bounds():
    """The enumerator rejects a refinement whose bounds miss the exact probability, as it rejects
    first bounds that do."""
    from gbv.theory.enumerate import ReplayRandom
    from gbv.verify.common import Refinement

    assert ReplayRandom([]).accept_within(0.0, 0.5, lambda: Refinement(0.1, 0.3, lambda: 0.2)) is True
    with pytest.raises(AssertionError, match="bounds"):
        ReplayRandom([]).accept_within(0.0, 0.5, lambda: Refinement(0.3, 0.4, lambda: 0.2))


@pytest.mark.parametrize("method", ["token", "block", "gbv", "gbv-adaptive"])
def test_verify_call_reads_the_host_once(method, monkeypatch):
    """One path: token and BV, and GBV / gbv-adaptive, which are BV with one path. The device forms of
    token and BV (what runs off the CPU) are forced: their host forms read numpy views of the rows."""
    import gbv.verify.block as block_module
    import gbv.verify.token as token_module

    for module in (block_module, token_module):
        monkeypatch.setattr(module, "uses_device_form", lambda p: True)
    tokens, q, p = verify_inputs()
    verifier = get_verifier(method)
    rng = TorchRandom(seed=0)
    for _ in range(5):
        with count_host_reads() as reads:
            verifier(tokens, q, p, rng)
        assert reads["n"] <= 1, f"{method}: {reads['n']} host reads in one verify call"


@pytest.mark.parametrize("form", ["gbv", "gbv-adaptive", "specinfer", "spectr", "traversal"])
@pytest.mark.parametrize("num_paths", [2, 3, 8])
def test_device_forms_read_the_host_once(num_paths, form):
    """The device forms (what the multi-path verifiers run on a GPU) with several paths: selection,
    law, level decisions and draws as tensor code, one read for the result."""
    from gbv.verify.gbv import verify_gbv_on_device
    from gbv.verify.gbv_adaptive import verify_gbv_adaptive_on_device
    from gbv.verify.specinfer import verify_specinfer_on_device
    from gbv.verify.spectr import verify_spectr_on_device
    from gbv.verify.traversal import verify_traversal_on_device

    verifier = {"gbv": verify_gbv_on_device, "gbv-adaptive": verify_gbv_adaptive_on_device,
                "specinfer": verify_specinfer_on_device, "spectr": verify_spectr_on_device,
                "traversal": verify_traversal_on_device}[form]
    rng = TorchRandom(seed=0)
    for seed in range(5):
        tokens, q, p = verify_inputs(num_paths, seed=seed)
        with count_host_reads() as reads:
            verifier(tokens, q, p, rng)
        assert reads["n"] <= 1, f"{reads['n']} host reads in one verify call"


@pytest.mark.parametrize("steps", ["eager", "static"])
@pytest.mark.parametrize("arch,method,num_paths", [
    *[("llama", method, num_paths) for method, num_paths in (
        ("ar", 1), ("token", 1), ("block", 1), ("gbv", 3), ("gbv-adaptive", 3), ("specinfer", 3), ("spectr", 3),
        ("traversal", 3))],
    ("gemma2", "ar", 1), ("gemma2", "block", 1), ("gemma2", "gbv", 3)])
def test_engine_iteration_host_reads(arch, method, num_paths, steps, monkeypatch):
    """A whole tree-engine iteration (draft, trie, target pass, verify, commit) stays within L + 3
    (issue 8's budget) and in fact reads twice; the multi-path verifiers with their device forms
    (what runs on a GPU), forced here on CPU tensors. ``static``: through the static calls a GPU
    records (gbv/engine/static_steps.py, static_sampling.py), run here without recording. gemma2:
    sliding windows (passed by the 40 new tokens), soft caps and per-layer masks add no read."""
    monkeypatch.setenv("GBV_CUDA_GRAPHS", "static" if steps == "static" else "0")
    import gbv.engine.tree_decoder as tree_decoder
    import gbv.verify.block as block_module
    import gbv.verify.gbv as gbv_module
    import gbv.verify.gbv_adaptive as gbv_adaptive_module
    import gbv.verify.specinfer as specinfer_module
    import gbv.verify.spectr as spectr_module
    import gbv.verify.token as token_module
    import gbv.verify.traversal as traversal_module

    for module in (block_module, token_module, gbv_module, gbv_adaptive_module, specinfer_module, spectr_module, traversal_module):
        monkeypatch.setattr(module, "uses_device_form", lambda p: True)
    # The host forward (lean_host.py) reads its tokens and the attention through numpy: free on the CPU,
    # and never used on a GPU. Counted here is what a GPU runs: the torch forward.
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    # Likewise the compiled draw (host_kernels.draw_rows_host): CPU tensors only.
    monkeypatch.setenv("GBV_HOST_KERNELS", "0")

    target, draft = hf_pair(arch, vocab=64, seed=2)
    sharpen(target, draft, scale=3.0)
    block_len = 4
    counts = []
    real_step = tree_decoder.TreeDecoder.step

    def counted_step(self, *args, **kwargs):
        with count_host_reads() as reads:
            out = real_step(self, *args, **kwargs)
        counts.append(reads["n"])
        return out

    monkeypatch.setattr(tree_decoder.TreeDecoder, "step", counted_step)
    generate(ModelPair(target, draft), prompt_ids=[1, 2, 3], method=method, num_paths=num_paths,
             block_len=block_len, max_new_tokens=40, eos_token_id=[], seed=0)
    assert counts and max(counts) <= block_len + 3, counts
    # What the tree path does today: the drafts read once (to build the trie) and the verify result.
    assert max(counts) <= 2, counts
    if steps == "static":  # (the recorded forms ran: the draft's loops, the target's sampled steps)
        kinds = {key[0] for model in (target, draft) for cache, _ in tree_decoder.lean_model(model).steps._caches
                 for key in cache.steps if isinstance(key[0], str)}
        # (ar: its steps in runs of PlainLoop, one read of the run's tokens each)
        assert kinds == ({"plain"} if method == "ar" else {"sampled", "draft"} | ({"move"} if num_paths > 1 else set()))
