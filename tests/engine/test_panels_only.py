"""Large views keep their panels alone (gbv/engine/lean.py, ``PANELS_ONLY_MIN_PARAMETERS``): a view computing in
float32 on the CPU (a float32 model, or a bfloat16 or float16 one run in float32) packs each matrix as soon as it is
folded (a bfloat16 model's rounded), keeps the panels without the float32 transposed copy, and writes its copies in
memory the next ones reuse (``_Staging``). Such a view must compute what a view with its
copies computes, bit for bit, on every path: the host forward's (the same panels) and torch's (the copies unpacked
from the panels where first read). The toys here are small: the size limit is lowered to 0 for them."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import gbv.engine.lean as lean_module
from gbv.engine.generate import generate
from gbv.engine.host_kernels import PANELS_F16, f16_panels, host_kernels_unavailable
from gbv.engine.lean import LeanCausalLM
from gbv.engine.lean_host import HOST, HOST_TEMPORAL, choose_cpu_forward
from gbv.models.loading import ModelPair

from engine_toy import ARCHITECTURES, hf_pair
from test_lean_host import _largest_gap

pytestmark = pytest.mark.skipif(host_kernels_unavailable() is not None,
                                reason="bf16 models run in float32 (and keep panels) only with the compiled kernels")

# llama: the Llama family; qwen2: q/k/v biases; granite: its multipliers and the logits' divisor folded into the
# copies; gptneox: LayerNorm biases folded (a float64 product of the unscaled copy), head-major q/k/v rows; gpt2: a
# Conv1D's matrices; gemma3: a tied head, the final norm folded into it, sandwich norms, windows; olmo2: no norm
# before the blocks
ARCHS = [arch for arch in ("llama", "qwen2", "granite", "gptneox", "gpt2", "gemma3", "olmo2") if arch in ARCHITECTURES]


def _views(model, monkeypatch, host: bool = True):
    """The lean view of ``model`` keeping its panels alone, and one with its copies (the limit lowered, then
    raised past any model); ``host=False``: both on torch's forward."""
    monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", 0)
    only = LeanCausalLM(model)
    monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", 1 << 62)
    copies = LeanCausalLM(model)
    assert only.panels_only and not copies.panels_only
    if not host:
        only.host_forward = copies.host_forward = None
    return only, copies


def _copies_held(lean) -> int:
    """How many of ``lean``'s matrices hold a transposed copy (not unpacked from a panel yet)."""
    return sum("weight_t" in matrix.__dict__ for matrix in lean.matrices())


@pytest.mark.parametrize("dtype,amx", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, False),
                                       (torch.float32, False)])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_view_keeping_its_panels_alone_computes_the_same_bits(arch, dtype, amx, monkeypatch):
    """The same panels as a view with its copies (kind and bits), no copy held, the model's own embedding (a
    bfloat16 or float16 one widened as read), and the same logits, bit for bit, over a prompt, a
    step, a tree pass and a batch: on the host forward, and on torch's forward through copies unpacked from the
    panels (then held: equal to the other view's)."""
    from gbv.engine import host_kernels

    before = host_kernels.amx_products()
    try:
        host_kernels.set_amx_products(amx)
    except ValueError as error:
        pytest.skip(str(error))
    try:
        target, _ = hf_pair(arch, vocab=48, seed=5, target_size=(64, 2))
        model = target.to(dtype)
        only, copies = _views(model, monkeypatch)
        assert _copies_held(only) == 0 and _copies_held(copies) == len(copies.matrices())
        embedding = model.get_input_embeddings().weight
        own = dtype != torch.float16 or f16_panels()  # (float16: read as it is where its panels are float16 too)
        assert only.embed.dtype == (dtype if own else torch.float32)
        assert (only.embed.data_ptr() == embedding.data_ptr()) == own
        assert copies.embed.dtype == torch.float32
        products = [(a, b) for a, b in zip(only.host_forward.products(), copies.host_forward.products(), strict=True)]
        for a, b in products:
            assert a.panel.kind == b.panel.kind and np.array_equal(a.panel.panels, b.panel.panels)
        assert only.host_forward.rounds_inputs == copies.host_forward.rounds_inputs == amx
        assert only.host_forward.lm_head.panel.bf16 == (dtype == torch.bfloat16)
        assert (only.host_forward.lm_head.panel.kind == PANELS_F16) == (dtype == torch.float16 and f16_panels())
        assert _largest_gap(only, copies) == 0.0
        assert _copies_held(only) == 0  # (the host forward reads the panels alone)
        only, copies = _views(model, monkeypatch, host=False)
        assert _largest_gap(only, copies) == 0.0
        assert _copies_held(only) == len(only.matrices())  # (unpacked where torch's products read them)
        for a, b in zip(only.matrices(), copies.matrices()):
            assert torch.equal(a.weight_t, b.weight_t)
    finally:
        host_kernels.set_amx_products(before)


def test_copies_written_over_one_another_are_caught(monkeypatch):
    """Control: where the scratch memory hands every copy out at the same place, a layer's later copies overwrite
    its earlier ones before they are packed, and the comparison of the two views catches it."""
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    model = target.to(torch.bfloat16)
    take = lean_module._Staging.take

    def same_place(self, rows, columns, device):
        self.used = 0
        return take(self, rows, columns, device)

    monkeypatch.setattr(lean_module._Staging, "take", same_place)
    only, copies = _views(model, monkeypatch)
    assert _largest_gap(only, copies) > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_decoding_with_views_keeping_their_panels_alone(dtype, monkeypatch):
    """A pair whose views keep their panels alone decodes the same tokens as with copies (greedy and sampled, BV
    and GBV), and never unpacks a copy: its forward choice times no torch form. A float32 or float16 draft's
    panels are rounded to bfloat16 from its float32 panels (``round_to_bf16_weights``), the same bits as from its
    copies."""
    monkeypatch.delenv("GBV_HOST_FORWARD", raising=False)  # (the tests' conftest takes the host forward unmeasured)
    target, draft = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    target, draft = target.to(dtype), draft.to(dtype)
    runs = {}
    for limit in (0, 1 << 62):
        monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", limit)
        import gbv.engine.tree_decoder as tree_decoder

        tree_decoder._LEAN.clear()
        tree_decoder._DRAFT_LEAN.clear()
        pair = ModelPair(target, draft)
        runs[limit] = [generate(pair, prompt_ids=[3, 1, 4, 1, 5], method=method, num_paths=paths, block_len=4,
                                temperature=temperature, max_new_tokens=20, seed=1, eos_token_id=[]).token_ids
                       for method, paths, temperature in (("block", 1, 0.0), ("block", 1, 1.0), ("gbv", 3, 1.0))]
        views = [tree_decoder._LEAN[target], tree_decoder._DRAFT_LEAN[draft]]
        assert all(view.panels_only == (limit == 0) for view in views)
        draft_panels = [p.panel for p in views[1].host_forward.products()]
        assert all(panel.bf16 for panel in draft_panels)  # (every draft streams bfloat16 panels here)
        runs[limit].append([panel.panels for panel in draft_panels])
        if limit == 0:
            assert sum(_copies_held(view) for view in views) == 0
            choice, times = choose_cpu_forward(views[0], views[0].host_forward)
            assert choice == HOST and (times is None or set(times) <= {HOST, HOST_TEMPORAL})
            assert _copies_held(views[0]) == 0
    assert runs[0][:-1] == runs[1 << 62][:-1]
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][-1], runs[1 << 62][-1], strict=True))
    tree_decoder._LEAN.clear()
    tree_decoder._DRAFT_LEAN.clear()


def test_which_views_keep_their_panels_alone(monkeypatch):
    """Views computing in float32 on the CPU past the limit (float32, bfloat16 and float16 models), not where the
    host forward is off or told to take torch's products."""
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", 0)
    assert LeanCausalLM(target).panels_only  # (float32)
    assert LeanCausalLM(copy.deepcopy(target).half()).panels_only
    model = target.to(torch.bfloat16)
    assert LeanCausalLM(model).panels_only
    for setting in ("0", "torch-products"):
        monkeypatch.setenv("GBV_HOST_FORWARD", setting)
        assert not LeanCausalLM(model).panels_only
    monkeypatch.setenv("GBV_HOST_FORWARD", "1")
    count = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", count + 1)
    assert not LeanCausalLM(model).panels_only


@pytest.mark.parametrize("panels_only", [True, False])
def test_a_float16_model_folded_past_float16s_range_keeps_float32_panels(panels_only, monkeypatch):
    """A float16 model whose folded copy (a norm's weight times a matrix) has a value past float16's range is packed
    as float32 panels: a view with its copies rounds none of them, and computes the float32 model's logits bit for
    bit; a view keeping its panels alone packs again those it had packed as float16 (the last layer's up rows are the
    ones past the range, found after the head and the layers before), and computes within float16 rounding of it."""
    from gbv.engine.host_kernels import PANELS_F32

    if not f16_panels():
        pytest.skip("no float16 panels here")
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    last = target.model.layers[-1]
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))  # (rounded folded)
        last.post_attention_layernorm.weight.fill_(1000.0)
        last.mlp.up_proj.weight[3, 5] = 100.0  # (1e5 folded: past float16's 65504)
    half = copy.deepcopy(target).half()
    reference = LeanCausalLM(copy.deepcopy(half).float())
    monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", 0 if panels_only else 1 << 62)
    lean = LeanCausalLM(half)
    assert lean.panels_only == panels_only and lean.fp16_in_float32
    assert not lean.f16_panels and lean.panel_bytes == 4
    assert all(product.panel.kind == PANELS_F32 for product in lean.host_forward.products())
    gap = _largest_gap(lean, reference)
    if panels_only:
        with torch.inference_mode():
            logits = reference.forward(torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5)[None], 0,
                                       reference.new_cache(1, 8), None, causal=True)
        assert 0 < gap < 0.005 * float(logits.abs().max())
        head = lean.lm_head.panel.unpacked()  # (packed first as float16: rounded, then packed again)
        assert np.array_equal(head.astype(np.float16).astype(np.float32), head)
    else:
        assert gap == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_draft_keeping_its_panels_alone_packs_bfloat16_panels_at_once(dtype, monkeypatch):
    """A draft's view built to be rounded (``bf16_draft``, as ``draft_lean_model`` builds it) that keeps its panels
    alone rounds each matrix and packs it as bfloat16 at build, unpacking nothing: the bits of a view with its copies
    rounded after the build, and for a float32 model the bits of the path before, which packed float32 panels and
    unpacked them to round them. Its logits are then those of the view rounded the old way."""
    from gbv.engine.host_kernels import PanelWeight

    _, draft = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    for module in draft.modules():  # (norm weights other than ones: the folded copies are not the matrices)
        if "norm" in type(module).__name__.lower():
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    draft = draft.to(dtype)
    monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", 1 << 62)
    copies = LeanCausalLM(draft, bf16_draft=True)
    assert copies.round_to_bf16_weights() and not copies.f16_panels
    monkeypatch.setattr(lean_module, "PANELS_ONLY_MIN_PARAMETERS", 0)
    before = LeanCausalLM(draft)  # (packed as float32 or float16 panels, then unpacked and rounded)
    assert before.round_to_bf16_weights()

    def no_unpacking(self):
        raise AssertionError("a panel unpacked")

    with monkeypatch.context() as patch:
        patch.setattr(PanelWeight, "unpacked", no_unpacking)
        at_once = LeanCausalLM(draft, bf16_draft=True)
        assert at_once.panels_only and at_once.round_to_bf16_weights()
    embedding = draft.get_input_embeddings().weight  # (the model's own, a float16 one widened as read)
    assert at_once.embed.data_ptr() == embedding.data_ptr() and at_once.embed.dtype == dtype
    for a, b, c in zip(at_once.host_forward.products(), copies.host_forward.products(),
                       before.host_forward.products(), strict=True):
        assert a.panel.bf16 and a.panel.kind == b.panel.kind and np.array_equal(a.panel.panels, b.panel.panels)
        if dtype == torch.float32:
            assert np.array_equal(a.panel.panels, c.panel.panels)
    assert _largest_gap(at_once, copies) == 0.0
