"""The CPU forward a lean view runs: the host forward with its compiled products, the same with torch's
products, or torch's forward, whichever a measured one-token step says is the fastest here
(gbv.engine.lean_host.choose_cpu_forward). The suite otherwise keeps the host forward (tests/conftest.py);
these tests lift that setting and slow forms down on purpose."""

from __future__ import annotations

import time

import pytest
import torch

from gbv.engine.generate import generate
from gbv.engine.lean import LeanCausalLM
import gbv.engine.host_kernels as host_kernels
from gbv.engine.lean_host import HOST, HOST_TEMPORAL, HOST_TORCH_PRODUCTS, TORCH, HostForward, choose_cpu_forward
from gbv.models.loading import ModelPair

from engine_toy import TEST_DEVICE, hf_pair, sharpen
from test_engine import PROMPT, greedy_reference

# (tests/engine/conftest.py runs each test on one torch thread, where the host forward's one-call steps run)
pytestmark = pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="the host forward runs on the CPU only")

@pytest.fixture(autouse=True)
def prefetch_hint_unchosen(monkeypatch):
    """Each test starts with the panel kernel's prefetch hint not chosen, and leaves it at the default."""
    monkeypatch.setattr(host_kernels, "_prefetch_temporal", None)
    yield
    if host_kernels.host_kernels_unavailable() is None:
        host_kernels._host_kernels.set_prefetch_temporal(False)


SLOWER_MS = 3.0  # far above a toy step's few tenths of a ms: the choice is not a close call


def _slower_host(monkeypatch):
    for name in ("__call__", "sampled"):  # (a forward, and a forward with its softmax and draw in one call)
        original = getattr(HostForward, name)

        def slow(self, *args, _original=original, **kwargs):
            time.sleep(SLOWER_MS / 1e3)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(HostForward, name, slow)


def _slower_torch(monkeypatch):
    original = LeanCausalLM.forward

    def slow(self, *args, **kwargs):
        if self.host_forward is None:  # (the torch forward: while the host one is measured it is set)
            time.sleep(SLOWER_MS / 1e3)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LeanCausalLM, "forward", slow)


def _slower_compiled_products(monkeypatch):
    """The host forward's step with its compiled products (one compiled call) slower; with torch's
    products it takes the host forward's other path (``__call__``), left as it is."""
    original = HostForward.sampled

    def slow(self, *args, **kwargs):
        time.sleep(SLOWER_MS / 1e3)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(HostForward, "sampled", slow)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_slower_host_forward_is_not_used(monkeypatch, caplog, dtype):
    """Where torch's one-token step is the faster one, the lean view drops its host forward (and the
    bfloat16 cache that was the host forward's) and says so in one log line; in float32, greedy
    decoding still equals the target's argmax."""
    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    _slower_host(monkeypatch)
    target, draft = hf_pair("llama", vocab=32, seed=2)
    sharpen(target, draft)
    target, draft = target.to(dtype), draft.to(dtype)
    with caplog.at_level("INFO", logger="gbv"):
        lean = LeanCausalLM(target)
    if dtype == torch.bfloat16 and not lean.bf16_in_float32:
        pytest.skip("no host forward for bfloat16 here (the compiled kernels are not built)")
    times = lean.forward_times
    assert lean.forward_choice == TORCH and lean.host_forward is None
    assert min(times[HOST], times[HOST_TORCH_PRODUCTS]) > times[TORCH] + SLOWER_MS / 2
    assert lean.cache_dtype == lean.dtype
    assert sum("using the torch forward" in r.getMessage() for r in caplog.records) == 1
    if dtype != torch.float32:  # (bfloat16 weights computed in float32: logits a bf16 ulp from HF's)
        return
    pair = ModelPair(target, draft)
    expected = greedy_reference(target, PROMPT, 10)
    for method in ("ar", "block", "gbv", "traversal"):
        out = generate(pair, prompt_ids=PROMPT, method=method, num_paths=3, block_len=3, temperature=0.0,
                       max_new_tokens=10, eos_token_id=[])
        assert out.token_ids == expected, method


def test_the_faster_host_forward_is_kept(monkeypatch):
    """Where the host forward's step is the faster one, it is kept (the rule before the measurement)."""
    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    _slower_torch(monkeypatch)
    target, _ = hf_pair("llama", vocab=32, seed=2)
    lean = LeanCausalLM(target)
    assert lean.forward_choice in (HOST, HOST_TORCH_PRODUCTS) and lean.host_forward is not None
    assert lean.forward_times[TORCH] > lean.forward_times[lean.forward_choice] + SLOWER_MS / 2


def test_torch_products_in_the_host_forward(monkeypatch):
    """Where the host forward is fastest with torch's products, it keeps its own attention and glue,
    multiplies by torch's GEMMs (its packed panels dropped), and greedy decoding still equals the
    target's argmax."""
    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    _slower_torch(monkeypatch)
    _slower_compiled_products(monkeypatch)
    target, draft = hf_pair("llama", vocab=32, seed=2)
    sharpen(target, draft)
    lean = LeanCausalLM(target)
    assert lean.forward_choice == HOST_TORCH_PRODUCTS
    host = lean.host_forward
    assert host.panels_off and host.layer_panels is None and host.lm_head.panel is None
    assert not host.one_call(1)
    expected = greedy_reference(target, PROMPT, 10)
    for method in ("ar", "block", "gbv"):
        out = generate(ModelPair(target, draft), prompt_ids=PROMPT, method=method, num_paths=3, block_len=3,
                       temperature=0.0, max_new_tokens=10, eos_token_id=[])
        assert out.token_ids == expected, method


def test_the_host_forward_forced_on_is_not_measured(monkeypatch):
    """``GBV_HOST_FORWARD=1`` keeps the host forward without measuring (``forward_times`` None);
    ``=0`` leaves it out."""
    _slower_host(monkeypatch)
    target, _ = hf_pair("llama", vocab=32, seed=2)
    monkeypatch.setenv("GBV_HOST_FORWARD", "1")
    forced = LeanCausalLM(target)
    assert forced.host_forward is not None and forced.forward_times is None and forced.forward_choice == HOST
    assert choose_cpu_forward(forced, forced.host_forward) == (HOST, None)
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    assert LeanCausalLM(target).host_forward is None


def test_measuring_leaves_the_model_as_it_was(monkeypatch):
    """The measurement runs on scratch caches: the lean view's forward afterwards (whichever was chosen)
    gives the logits of a fresh view of the same model with the torch forward."""
    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    target, _ = hf_pair("llama", vocab=32, seed=2)
    measured = LeanCausalLM(target)
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    reference = LeanCausalLM(target)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        got = measured.chain(ids, 0, measured.new_cache(1, 16), last_only=False)
        want = reference.chain(ids, 0, reference.new_cache(1, 16), last_only=False)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_no_measurement_without_compiled_products(monkeypatch):
    """Where the host forward has no compiled products (a model above PANEL_MAX_PARAMETERS, or no
    kernels built), its products are torch's already: nothing is measured (a large model's steps would
    take seconds) and the host forward stays, as before."""
    import gbv.engine.lean_host as lean_host

    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    monkeypatch.setattr(lean_host, "PANEL_MAX_PARAMETERS", 0)
    monkeypatch.setattr(lean_host, "available_memory", lambda: 0)  # (past the cap: only where the copies fit)
    _slower_host(monkeypatch)  # (would lose a measurement)
    target, _ = hf_pair("llama", vocab=32, seed=2)
    lean = LeanCausalLM(target)
    assert lean.host_forward is not None and lean.host_forward.panels_off
    assert lean.forward_choice == HOST and lean.forward_times is None


@pytest.mark.skipif(host_kernels.host_kernels_unavailable() is not None, reason="the compiled kernels are not built")
def test_the_prefetch_hint_is_chosen_once_and_changes_no_result(monkeypatch):
    """The first lean view measured in a process times its host forward with both prefetch hints and
    sets the hint for the process; the next one times one host form only. Either hint gives the same
    logits, bit for bit (a prefetch moves no data the kernel computes with)."""
    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    target, draft = hf_pair("llama", vocab=32, seed=2)
    first = LeanCausalLM(target)
    assert HOST_TEMPORAL in first.forward_times and host_kernels.prefetch_temporal() is not None
    second = LeanCausalLM(draft)
    assert second.forward_times is None or HOST_TEMPORAL not in second.forward_times
    monkeypatch.setenv("GBV_HOST_FORWARD", "1")
    lean = LeanCausalLM(target)
    outputs = []
    with torch.inference_mode():
        for temporal in (False, True):
            host_kernels.set_prefetch_temporal(temporal, chosen=False)
            outputs.append(lean.chain([3, 1, 4, 1, 5, 9, 2, 6], 0, lean.new_cache(1, 16), last_only=False))
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.skipif(host_kernels.host_kernels_unavailable() is not None or not host_kernels._host_kernels.amx(),
                    reason="the AMX products do not run here")
def test_a_model_of_amx_products_leaves_the_prefetch_hint_to_the_next(monkeypatch):
    """A bfloat16 model whose products are all AMX ones (which the hint does not touch) does not
    choose the prefetch hint: timed by it, the choice was noise, and a non-temporal hint left for a
    float32 model loaded later cost that model's steps 3x on an Intel Xeon. The next float32 model
    chooses it."""
    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    monkeypatch.setattr(host_kernels, "_amx_products", True)
    target, draft = hf_pair("llama", vocab=32, seed=2)
    amx = LeanCausalLM(target.to(torch.bfloat16))
    assert amx.host_forward.rounds_inputs and amx.forward_times is not None
    assert HOST_TEMPORAL not in amx.forward_times and host_kernels.prefetch_temporal() is None
    plain = LeanCausalLM(draft)
    assert HOST_TEMPORAL in plain.forward_times and host_kernels.prefetch_temporal() is not None


def test_slow_steps_are_timed_in_fewer_rounds(monkeypatch):
    """Where every form's first timed step takes over _SLOW_STEP_S (a model of hundreds of millions of
    parameters), the choice stops after _SLOW_ROUNDS rounds instead of _CHOICE_ROUNDS: the clock is read as many
    times fewer (counted where choose_cpu_forward reads it). A form that lost the first round by _CLEAR_LOSS is
    not run again (at 1.0, every form but the fastest: then no second round at all)."""
    import sys
    import time as real_time

    import gbv.engine.lean_host as lean_host

    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)
    reads = []

    class Clock:
        @staticmethod
        def perf_counter():
            if sys._getframe(1).f_code.co_name == "choose_cpu_forward":
                reads.append(1)
            return real_time.perf_counter()

    monkeypatch.setattr(lean_host, "time", Clock)
    counts = {}
    for name, slow, clear_loss in (("fast", 1e9, 1e9), ("slow", 0.0, 1e9), ("pruned", 0.0, 1.0)):
        monkeypatch.setattr(lean_host, "_SLOW_STEP_S", slow)
        monkeypatch.setattr(lean_host, "_CLEAR_LOSS", clear_loss)
        del reads[:]
        lean = LeanCausalLM(hf_pair("llama", vocab=32, seed=3)[0])
        assert lean.forward_times is not None
        counts[name] = (len(reads), len(lean.forward_times))  # (the hint's form in the process's first only)
    run_reads = lean_host._CHOICE_RUN + 1  # (a clock read per step, and one at the run's end)
    (fast, forms), (slow, slow_forms), (pruned, pruned_forms) = counts["fast"], counts["slow"], counts["pruned"]
    assert min(forms, slow_forms, pruned_forms) >= 3
    assert fast == forms * lean_host._CHOICE_ROUNDS * run_reads
    assert slow == slow_forms * lean_host._SLOW_ROUNDS * run_reads
    assert pruned == pruned_forms * run_reads
