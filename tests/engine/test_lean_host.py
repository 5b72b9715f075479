"""The host forward (gbv/engine/lean_host.py): numpy between the matrix products for one sequence on
the CPU in float32. It must compute the torch lean forward's logits and cache entries, on every
shape the engines give it, and be used only where it can be."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import gbv.engine.lean_host as lean_host
from gbv.engine.host_kernels import host_kernels_unavailable
from gbv.engine.generate import generate
from gbv.engine.lean import LeanCausalLM
from gbv.engine.tree import build_tree, prefix_then
from gbv.models.loading import ModelPair

from engine_toy import ARCHITECTURES, hf_pair


def _both(model):
    """The lean view of ``model`` with the host forward, and one without (the torch path)."""
    with_host = LeanCausalLM(model)
    torch_only = LeanCausalLM(model)
    torch_only.host_forward = None
    assert with_host.host_forward is not None
    return with_host, torch_only


def _random_tree_mask(n: int, prefix: int, gen: torch.Generator) -> torch.Tensor:
    parents = [0] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    ancestors = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):
        ancestors[node] |= ancestors[parents[node]]
    return prefix_then(ancestors, prefix)


@pytest.fixture
def amx_products(request):
    """bfloat16 weights packed for the AMX products (True) or for the AVX tiles (False) while the test
    builds its models; skipped where the AMX products cannot run; put back after."""
    from gbv.engine import host_kernels
    before = host_kernels.amx_products()
    try:
        host_kernels.set_amx_products(request.param)
    except ValueError as error:
        pytest.skip(str(error))
    yield request.param
    host_kernels.set_amx_products(before)


# The families whose layers only the compiled kernels compute (LayerNorms, biases, MLPs without a gate,
# parallel blocks, learned positions, multi-query attention, partial and adjacent-pair rotations, Qwen3's
# q/k norms, Gemma's GELU-tanh gate, sliding windows (Mistral, StarCoder2), norms after each block and tables per
# layer kind (Gemma 3, OLMo 3), OLMo 2's q/k norms over all heads, SmolLM3's layers without rotation, Gemma 2's
# soft caps, OLMo 1's LayerNorms without weights).
OTHER_FAMILIES = ("gptneox", "gptneox-sequential", "gpt2", "opt", "gpt-bigcode", "gpt-bigcode-heads", "phi", "gptj",
                  *(arch for arch in ("qwen3", "gemma", "gemma2", "gemma3", "gemma3mm", "olmo", "olmo2", "olmo3",
                                      "starcoder2", "smollm3", "mistral") if arch in ARCHITECTURES))


def _skip_without_kernels(arch: str) -> None:
    if arch in OTHER_FAMILIES and host_kernels_unavailable() is not None:
        pytest.skip(f"{arch} runs on the host forward only with the compiled kernels: {host_kernels_unavailable()}")


@pytest.mark.parametrize("dtype,amx_products", [(torch.float32, False), (torch.bfloat16, False),
                                                (torch.bfloat16, True)], indirect=["amx_products"])
# llama: grouped-query attention; qwen2: q/k/v biases; granite: its multipliers in the copies, its embedding
# scaled; the others: OTHER_FAMILIES' layers
@pytest.mark.parametrize("arch", ["llama", "qwen2", "granite", *OTHER_FAMILIES])
def test_host_forward_equals_the_torch_forward(arch, dtype, amx_products):
    """Chains (causal, from slot 0 and after a prefix), tree passes with random masks, one query, last
    only: the logits and every cache entry written agree with the torch forward to float32 rounding,
    through a cache that grows on the way. A bfloat16 model runs in float32 (bf16 panels) on both, over
    a bfloat16 cache (LeanCausalLM.cache_dtype): the torch forward widens it for its attention.

    With the AMX products every product rounds its input rows to bfloat16, the torch forward's too
    (HostForward.rounds_inputs). The two paths' inputs differ by float32 rounding, and a value that
    close to a bfloat16 rounding boundary rounds to the neighbouring bf16 value on one path (2^-8 away
    relatively): so they agree to 2e-3 there, and without the torch path's rounding they would not
    (test_amx_products_round_every_path)."""
    if dtype == torch.bfloat16 and host_kernels_unavailable() is not None:
        pytest.skip(f"bf16 runs in float32 only with the compiled kernels: {host_kernels_unavailable()}")
    _skip_without_kernels(arch)
    target, _ = hf_pair(arch, vocab=48, seed=5, target_size=(64, 2))
    host, plain = _both(target.to(dtype))
    assert host.dtype == plain.dtype == torch.float32
    assert host.host_forward.rounds_inputs == amx_products
    assert all(matrix.round_inputs == amx_products for matrix in plain.matrices())
    atol = 2e-3 if amx_products else 2e-5
    gen = torch.Generator().manual_seed(0)
    caches = [lean.new_cache(1, 8) for lean in (host, plain)]  # small on purpose: both grow
    prompt = torch.randint(0, 48, (1, 6), generator=gen)
    with torch.inference_mode():
        outs = [lean.forward(prompt, torch.arange(6)[None], 0, cache, None, causal=True)
                for lean, cache in zip((host, plain), caches)]
        torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)
        start = 6
        for n, kind, last_only in [(1, "chain", False), (2, "chain", True), (5, "chain", False),
                                   (1, "tree", False), (7, "tree", False), (25, "tree", False),
                                   (3, "chain", True), (16, "tree", False)]:
            tokens = torch.randint(0, 48, (1, n), generator=gen)
            mask = _random_tree_mask(n, start, gen) if kind == "tree" else None
            positions = torch.arange(start, start + n)[None]
            outs = [lean.forward(tokens, positions, start, cache, mask, causal=mask is None, last_only=last_only)
                    for lean, cache in zip((host, plain), caches)]
            assert outs[0].shape == outs[1].shape == (1, 1 if last_only else n, 48)
            torch.testing.assert_close(outs[0], outs[1], atol=atol, rtol=0)
            start += n
        assert caches[0].capacity == caches[1].capacity >= start
        # (a bfloat16 cache: float32 values a rounding apart may round to neighbouring bf16 values, which
        # are up to 2^-7 apart relatively: 8 significant bits)
        rtol = 2 ** -7 if caches[0].keys[0].dtype == torch.bfloat16 else 0
        for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
            torch.testing.assert_close(a[:, :, :start].float(), b[:, :, :start].float(),
                                       atol=atol if amx_products else 1e-5, rtol=rtol)


@pytest.mark.parametrize("amx_products", [True], indirect=True)
def test_amx_products_round_every_path(amx_products):
    """Where the AMX products run, a bfloat16 model's torch forward rounds each product's input to
    bfloat16 as they do, so that which path a call takes (threads, batch size) does not move its law
    beyond float32 rounding. Their inputs differ by that rounding, and an input that near a bf16
    rounding boundary rounds to the neighbouring bf16 value on one path (2^-8 away relatively): so on
    a 30-token prompt the logits agree to 2e-3 at most and 1e-4 on average. The check can fail: the
    same torch forward with exact inputs is over 2e-4 away on average (0.4e-3 here, 7x)."""
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    host, plain = _both(target.to(torch.bfloat16))
    prompt = torch.randint(0, 48, (1, 30), generator=torch.Generator().manual_seed(0))
    outs = []
    for lean, rounding in ((host, True), (plain, True), (plain, False)):
        for matrix in lean.matrices():
            matrix.round_inputs = rounding
        with torch.inference_mode():
            outs.append(lean.forward(prompt, torch.arange(30)[None], 0, lean.new_cache(1, 64), None, causal=True))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=0)
    assert (outs[1] - outs[0]).abs().mean() < 1e-4 < 2e-4 < (outs[2] - outs[0]).abs().mean()


def test_host_forward_on_the_bundled_pair():
    """The bundled models take the host forward (fp32, CPU) and agree with the torch path on a decode
    step and a tree pass."""
    import gbv

    pair = gbv.load_pair("bundled")
    for model in (pair.target, pair.draft):
        host, plain = _both(model)
        gen = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, 4096, (1, 40), generator=gen)
        caches = [lean.new_cache(1, 80) for lean in (host, plain)]
        with torch.inference_mode():
            for lean, cache in zip((host, plain), caches):
                lean.forward(prompt, torch.arange(40)[None], 0, cache, None, causal=True)
            step = torch.tensor([[17]])
            outs = [lean.forward(step, torch.tensor([[40]]), 40, cache, None, causal=True)
                    for lean, cache in zip((host, plain), caches)]
            torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
            tree = build_tree(17, [[5, 6, 7], [5, 9, 9], [2, 2, 2]])
            outs = [lean.forward(tree.tokens[None], (41 + tree.depth)[None], 41, cache,
                                 prefix_then(tree.ancestors, 41)) for lean, cache in zip((host, plain), caches)]
            torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)


@pytest.mark.skipif(host_kernels_unavailable() is not None, reason="bf16 runs in float32 only with the kernels")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_runs_in_float32(arch, monkeypatch):
    """A bfloat16 model on the CPU, where the compiled kernels run: the lean view computes in float32
    (activations, cache, logits) over the model's bf16 weight values, the norms' weights folded and
    rounded to bf16 once, the panels in bf16. Its logits are those of the same weights in float32 to
    about one bf16 rounding of the folded weights, and within bf16 rounding of Hugging Face's bf16
    forward. The Hugging Face model is left as it was. With GBV_HOST_KERNELS=0 it stays bf16."""
    fp32, _ = hf_pair(arch, vocab=48, seed=7, target_size=(64, 2))
    model = fp32.to(torch.bfloat16)  # (in place: fp32 is the same module)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    lean = LeanCausalLM(model)
    assert lean.bf16_in_float32 and lean.dtype == torch.float32 and lean.weight_dtype == torch.bfloat16
    assert lean.cache_dtype == lean.new_cache(1, 4).keys[0].dtype == torch.bfloat16  # as Hugging Face's
    for matrix in lean.matrices():
        assert matrix.weight_t.dtype == torch.float32
        assert torch.equal(matrix.weight_t, matrix.weight_t.to(torch.bfloat16).float())  # bf16 values
    products = [p for layer in lean.host_forward.layers for p in (layer[0], layer[2], layer[3], layer[4])]
    assert all(p.panel.bf16 and p.panel.panels.dtype == np.uint16 for p in products + [lean.host_forward.lm_head])
    assert all(torch.equal(t, before[name]) and t.dtype == torch.bfloat16 for name, t in model.state_dict().items())
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.inference_mode():
        logits = lean.forward(tokens, torch.arange(10)[None], 0, lean.new_cache(1, 16), None, causal=True)
        hf_bf16 = model(input_ids=tokens).logits.float()
        as_float32 = copy.deepcopy(model).float()(input_ids=tokens).logits
    assert logits.dtype == torch.float32
    scale = float(as_float32.abs().max())
    assert (logits - as_float32).abs().max() < 0.02 * scale
    assert (logits - hf_bf16).abs().max() < 0.05 * scale
    monkeypatch.setenv("GBV_HOST_KERNELS", "0")
    plain = LeanCausalLM(model)
    assert not plain.bf16_in_float32 and plain.dtype == torch.bfloat16


@pytest.mark.skipif(host_kernels_unavailable() is not None, reason="float16 runs in float32 only with the kernels")
@pytest.mark.parametrize("arch", ["llama", "gptneox", "gemma3"])
def test_fp16_runs_in_float32(arch, monkeypatch):
    """A float16 model on the CPU, where the compiled kernels run, is run in float32 over its weight values, its
    matrices packed as float16 panels (half the bytes of float32 panels, the same sums). Its folded copies (a norm's
    weight times a matrix) are rounded to float16 values for them, once; the norms, the embedding and the cache
    stay float32. So its logits are bit for bit those of the same view multiplying float32 panels of those values,
    and within float16 rounding of the float32 model's view and of Hugging Face's float16 forward. With
    ``GBV_HOST_F16_PANELS=0`` its panels are float32 and its logits bit for bit the float32 model's view's (host
    forward and torch's), and it decodes the same tokens. The Hugging Face model is left as it was. With
    GBV_HOST_KERNELS=0 it stays float16."""
    from gbv.engine.host_kernels import PANELS_F16, PanelWeight, f16_panels

    if arch not in ARCHITECTURES:
        pytest.skip(f"no {arch} in this transformers")
    target, draft = hf_pair(arch, vocab=48, seed=7, target_size=(64, 2))
    for module in target.modules():  # (norm weights other than ones, so that folding them makes other values)
        if "norm" in type(module).__name__.lower() and getattr(module, "weight", None) is not None:
            with torch.no_grad():
                module.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    half, half_draft = copy.deepcopy(target).half(), copy.deepcopy(draft).half()
    wide, wide_draft = copy.deepcopy(half).float(), copy.deepcopy(half_draft).float()  # (the same values)
    before = {name: t.clone() for name, t in half.state_dict().items()}
    reference = LeanCausalLM(wide)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.inference_mode():
        logits = reference.forward(tokens, torch.arange(10)[None], 0, reference.new_cache(1, 16), None, causal=True)
        hf_half = half(input_ids=tokens).logits.float()
    assert (logits - hf_half).abs().max() < 0.02 * float(logits.abs().max())

    # float16 panels
    assert f16_panels()
    lean, swapped = LeanCausalLM(half), LeanCausalLM(half)
    assert lean.fp16_in_float32 and lean.f16_panels and not lean.bf16_in_float32 and not reference.fp16_in_float32
    assert lean.dtype == lean.cache_dtype == torch.float32 and lean.host_forward is not None
    assert all(torch.equal(t, before[name]) and t.dtype == torch.float16 for name, t in half.state_dict().items())
    products = lean.host_forward.products()
    assert all(product.panel.kind == PANELS_F16 for product in products)
    for product in products:
        values = product.panel.unpacked()
        assert np.array_equal(values.astype(np.float16).astype(np.float32), values)
        assert np.array_equal(values, product.weight_t.numpy())  # (the copy torch's products read: rounded too)
    swapped.host_forward.set_panels([PanelWeight(torch.from_numpy(product.panel.unpacked()))
                                     for product in swapped.host_forward.products()])
    assert _largest_gap(lean, swapped) == 0.0
    gap = _largest_gap(lean, reference)
    assert 0 < gap < 0.005 * float(logits.abs().max())  # (the rounding of the folded copies: there, and small)
    with torch.inference_mode():
        rounded = lean.forward(tokens, torch.arange(10)[None], 0, lean.new_cache(1, 16), None, causal=True)
    assert (rounded - hf_half).abs().max() < 0.02 * float(logits.abs().max())

    # float32 panels: the float32 model's view, bit for bit
    monkeypatch.setenv("GBV_HOST_F16_PANELS", "0")
    lean = LeanCausalLM(half)
    assert lean.fp16_in_float32 and not lean.f16_panels and lean.host_forward.lm_head.panel.kind != PANELS_F16
    assert _largest_gap(lean, reference) == 0.0
    lean.host_forward = reference.host_forward = None
    assert _largest_gap(lean, reference) == 0.0
    runs = []
    for pair in (ModelPair(half, half_draft), ModelPair(wide, wide_draft)):
        runs.append([generate(pair, prompt_ids=[3, 1, 4], method=method, num_paths=paths, block_len=4,
                              temperature=temperature, max_new_tokens=16, seed=2, eos_token_id=[]).token_ids
                     for method, paths, temperature in (("ar", 1, 0.0), ("block", 1, 1.0), ("gbv", 3, 1.0))])
    assert runs[0] == runs[1]
    from gbv.engine.tree_decoder import _DRAFT_LEAN

    assert _DRAFT_LEAN[half_draft].host_forward.lm_head.panel.bf16  # (the draft rounded, as a float32 one)
    monkeypatch.setenv("GBV_HOST_KERNELS", "0")
    plain = LeanCausalLM(half)
    assert not plain.fp16_in_float32 and plain.dtype == torch.float16


def test_a_broken_host_forward_is_caught(monkeypatch):
    """The comparison can fail: a host forward that writes the new keys one slot too late differs."""
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    host, plain = _both(target)
    real = host.host_forward._forward

    def late(tokens, positions, start, *rest):
        return real(tokens, positions, start + 1, *rest)

    monkeypatch.setattr(host.host_forward, "_forward", late)
    caches = [lean.new_cache(1, 32) for lean in (host, plain)]
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.inference_mode():
        for lean, cache in zip((host, plain), caches):
            lean.forward(prompt, torch.arange(6)[None], 0, cache, None, causal=True)
        outs = [lean.forward(torch.tensor([[2]]), torch.tensor([[6]]), 6, cache, None)
                for lean, cache in zip((host, plain), caches)]
    assert (outs[0] - outs[1]).abs().max() > 1e-3


def _largest_gap(host, plain, vocab: int = 48) -> float:
    """The largest logit gap between two lean views over a causal prompt, a one-query step, a tree pass and
    a batch of two sequences (one compiled call, and a compiled layer per call). The toys' windows (8 slots)
    bind in the tree pass and the batch."""
    gen = torch.Generator().manual_seed(3)
    caches = [lean.new_cache(1, 32) for lean in (host, plain)]
    batch_caches = [lean.new_cache(2, 32) for lean in (host, plain)]
    prompt = torch.randint(0, vocab, (1, 7), generator=gen)
    tokens = torch.randint(0, vocab, (1, 6), generator=gen)
    mask = _random_tree_mask(6, 8, gen)
    pair = torch.randint(0, vocab, (2, 12), generator=gen)
    gaps = []
    with torch.inference_mode():
        runs = [[lean.forward(prompt, torch.arange(7)[None], 0, cache, None, causal=True),
                 lean.forward(prompt[:, :1], torch.tensor([[7]]), 7, cache, None),
                 lean.forward(tokens, 8 + torch.tensor([[0, 1, 1, 2, 2, 3]]), 8, cache, mask),
                 lean.forward(pair, torch.arange(12).expand(2, 12), 0, batch_cache, None, causal=True)]
                for lean, cache, batch_cache in zip((host, plain), caches, batch_caches)]
    for a, b in zip(*runs):
        gaps.append(float((a - b).abs().max()))
    return max(gaps)


@pytest.mark.parametrize("arch,broken", [
    ("gptneox", "parallel"), ("gptneox", "mlp"), ("gptneox", "b_down"), ("gptneox", "final norm"),
    ("gptneox-sequential", "b_o"), ("gpt2", "positions"), ("gpt2", "mlp"), ("opt", "position offset"),
    ("opt", "b_up"), ("phi", "shared norm"), ("phi", "head bias"), ("gptj", "layer norm"),
    *((("qwen3", "qk norm"),) if "qwen3" in ARCHITECTURES else ()), ("gemma", "gated mlp"),
    ("gemma", "embed scale"), ("mistral", "window"), ("starcoder2", "window"), ("gemma3", "window"),
    ("gemma3", "output norms"), ("gemma3", "tables"), ("gemma3", "qk norm"), ("olmo2", "input norm"),
    ("olmo2", "qk norm"), ("olmo2", "output norms"), ("olmo3", "window"), ("smollm3", "tables"),
    ("gemma2", "attention cap"), ("gemma2", "logits cap")])
def test_each_part_of_the_other_families_layers_is_checked(arch, broken):
    """The comparison of the host forward with the torch forward catches each part the compiled layers add
    for the other families, broken one at a time (a control per part): GPT-NeoX's parallel blocks, its
    activation (made ReLU) and the down projection's bias, the final LayerNorm (made an RMSNorm), the
    attention output's bias (sequential GPT-NeoX), GPT-2's learned positions and its activation (made ReLU),
    OPT's position offset and the up projection's bias, Phi's shared norm (made sequential) and head
    bias, GPT-J's LayerNorms (made RMSNorms), Qwen3's q/k norms (left out), Gemma's GELU-tanh gate (made
    SiLU's) and its embedding scale (left out), the sliding windows (Mistral, StarCoder2, Gemma 3, OLMo 3: the
    layers' flag cleared), Gemma 3's and OLMo 2's norms after each block (left out), Gemma 3's rotation tables
    per layer kind (swapped; SmolLM3's: its layers without rotation rotated), Gemma 3's and OLMo 2's q/k norms
    (left out), OLMo 2's missing norm before each block (one put there), Gemma 2's soft caps of the attention
    scores and of the logits (left out). Unbroken, the same gap is within float32 rounding."""
    from gbv.engine import host_kernels

    _skip_without_kernels(arch)
    target, _ = hf_pair(arch, vocab=48, seed=5, target_size=(64, 2))
    host, plain = _both(target)
    assert host.forward_choice == lean_host.HOST
    assert _largest_gap(host, plain) < 2e-5
    forward = host.host_forward
    entries = [list(entry) for entry in forward.layers]
    style = entries[0][11]
    layer_norm, parallel, mlp = style & 1, (style >> 1) & 3, style >> 3
    for entry in entries:
        if broken in ("parallel", "shared norm"):
            entry[11] = host_kernels.layer_style(layer_norm, host_kernels.SEQUENTIAL, mlp)
        elif broken == "mlp":  # (GELU for its tanh form is within this toy's rounding: test_host_kernels checks it)
            entry[11] = host_kernels.layer_style(layer_norm, parallel, host_kernels.MLP_RELU)
        elif broken == "gated mlp":
            assert mlp == host_kernels.MLP_GELU_TANH_GATED
            entry[11] = host_kernels.layer_style(layer_norm, parallel, host_kernels.MLP_SILU_GATED)
        elif broken == "layer norm":
            entry[11] = host_kernels.layer_style(False, parallel, mlp)
        elif broken in ("b_o", "b_up", "b_down", "qk norm"):
            index = {"b_o": 8, "b_up": 9, "b_down": 10, "qk norm": 12}[broken]
            assert entry[index] is not None
            entry[index] = None
            entry[18] &= ~host_kernels.LAYER_QK_ALL_HEADS
        elif broken == "window":
            entry[18] &= ~host_kernels.LAYER_WINDOWED
        elif broken == "output norms":
            assert entry[14] is not None and entry[16] is not None
            entry[14] = entry[16] = None
        elif broken == "tables":
            entry[19] = 1 - entry[19] if arch == "gemma3" else 0  # (SmolLM3: its one table, or -1 for none)
        elif broken == "input norm":
            assert entry[5] == -1.0
            entry[5] = 1e-6
        elif broken == "attention cap":
            assert entry[20] > 0
            entry[20] = 0.0
    if broken in ("window", "tables"):
        assert any(entry != list(layer) for entry, layer in zip(entries, forward.layers))  # (some layer changed)
    forward.layers = [tuple(entry) for entry in entries]
    forward.layer_panels = forward._layer_panels()
    if broken == "final norm":
        forward.layer_norm = False
    elif broken == "positions":
        forward.position_rows = None
    elif broken == "position offset":
        assert forward.position_offset == 2
        forward.position_offset = 0
    elif broken == "head bias":
        assert forward.head_bias is not None
        forward.head_bias = None
    elif broken == "embed scale":
        assert host.embed_scale is not None and forward.embed_scale is not None
        forward.embed_scale = None
    elif broken == "logits cap":
        assert forward.logits_softcap > 0
        forward.logits_softcap = 0.0
    assert _largest_gap(host, plain) > 1e-4


def test_windowed_layers_attend_from_their_first_slot():
    """Past the window, the windowed layers' mask starts at the first slot any query may attend (its least
    position less the window, plus one), and holds lean's ``_within_window`` from there; before it binds,
    none. (test_host_forward_equals_the_torch_forward checks the logits past the toys' window of 8.)"""
    _skip_without_kernels("mistral")
    target, _ = hf_pair("mistral", vocab=48, seed=5, target_size=(64, 2))
    host = LeanCausalLM(target)
    assert host.window == 8 and host.host_forward is not None
    forward = host.host_forward
    assert forward._window_mask(None, np.arange(3, 8)[None], 3, 5) == (None, 0)
    positions = np.array([[20, 21, 21, 22, 23]])
    mask = _random_tree_mask(5, 20, torch.Generator().manual_seed(1))
    window, first = forward._window_mask(mask, positions, 20, 5)
    assert first == 20 - 8 + 1 and window.shape == (1, 5, 25 - first)
    full = host._within_window(mask, False, torch.from_numpy(positions), 20, 5).numpy()[:, 0]
    assert not full[..., :first].any() and (window == full[..., first:]).all()


def test_the_new_layer_entries_and_window_arguments_are_checked():
    """The one-call forward refuses, with one line and before the cache is written: a window's first slot past
    the call's start or without a window mask, a layer's unknown flag, a rotation table it was not given, a
    norm after one block only."""
    _skip_without_kernels("gemma3")
    from gbv.engine.host_kernels import forward_into

    target, _ = hf_pair("gemma3", vocab=48, seed=5, target_size=(64, 3))
    forward = LeanCausalLM(target).host_forward
    cache = forward.lean.new_cache(1, 32)
    keys, values = cache.arrays()
    before = [k.copy() for k in keys]
    n, start = 2, 10

    def call(layers=None, window_mask=None, window_first=0):
        forward.lean.ensure_rotary(start + n)
        return forward_into(np.array([1, 2]), np.array([10, 11]), forward.embed, forward._rotary_tables(start + n),
                            forward.layer_panels if layers is None else layers, keys, values, 0, cache.capacity,
                            None, start, forward.rows(1, n), forward.lm_head.panel,
                            np.empty((1, 48), dtype=np.float32), forward.norm_eps, True, window_mask=window_mask,
                            embed_scale=forward.embed_scale, window_first=window_first)

    entries = [list(entry) for entry in forward.layer_panels]
    assert len(entries[0]) == 21
    with pytest.raises(ValueError, match="window_first"):
        call(window_mask=np.ones((n, start + n), dtype=np.uint8), window_first=start + 1)
    with pytest.raises(ValueError, match="window_first"):
        call(window_first=3)
    for index, bad in ((18, 8), (19, 5), (16, None)):
        broken = [list(entry) for entry in entries]
        broken[1][index] = bad
        with pytest.raises(ValueError, match="flags|rotary|both blocks"):
            call(tuple(tuple(entry) for entry in broken))
    assert all((k == b).all() for k, b in zip(keys, before))  # (nothing written)
    call()  # (the entries as they are: runs)
    assert not all((k == b).all() for k, b in zip(keys, before))


def test_host_forward_is_used_only_where_it_can_be(monkeypatch):
    """fp32 Llama / Qwen2 on the CPU: yes; Qwen3 (q/k norms) where the compiled kernels run. bfloat16 without
    them, or GBV_HOST_FORWARD=0: no.
    One sequence in any cache row takes the host forward: of any length where the compiled kernels
    run (one compiled call), of up to HOST_MAX_QUERIES queries elsewhere; several sequences only where
    the compiled kernels run, each of at most KERNEL_MAX_ROWS queries, whatever their rows in all
    (unless BATCH_MAX_ROWS caps them, as before the thirty-third session)."""
    target, _ = hf_pair("llama", vocab=48, seed=5)
    lean = LeanCausalLM(target)
    assert lean.host_forward is not None
    with monkeypatch.context() as patch:  # (bf16 with the kernels: run in float32, test_bf16_runs_in_float32)
        patch.setenv("GBV_HOST_KERNELS", "0")
        assert lean_host.host_forward_unsupported_reason(
            LeanCausalLM(hf_pair("llama", vocab=48)[0].to(torch.bfloat16))) == "not float32 on the CPU"
    if "qwen3" in ARCHITECTURES:
        qwen3 = LeanCausalLM(hf_pair("qwen3", vocab=48)[0])
        assert (lean_host.host_forward_unsupported_reason(qwen3) is None) == (host_kernels_unavailable() is None)
        with monkeypatch.context() as patch:
            patch.setenv("GBV_HOST_KERNELS", "0")
            assert "q/k norms need the compiled kernels" in lean_host.host_forward_unsupported_reason(
                LeanCausalLM(hf_pair("qwen3", vocab=48)[0]))
    # The other families' layers: on the compiled kernels only (the numpy forward computes the Llama family's),
    # so never with torch's products; at any thread count (the products split their columns among the threads).
    gpt2 = LeanCausalLM(hf_pair("gpt2", vocab=48)[0])
    if host_kernels_unavailable() is None:
        assert gpt2.host_forward is not None and not gpt2.host_forward.llama and lean.host_forward.llama
        assert gpt2.forward_times is None or lean_host.HOST_TORCH_PRODUCTS not in gpt2.forward_times
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert gpt2.host_forward.takes(1, 1) and gpt2.host_forward.one_call(1) and lean.host_forward.takes(2, 1)
            # Built at two threads (a draft beside a target of over 100M parameters, gbv/engine/threads.py),
            # choosing by measurement as outside the tests: both measured, the host forward's compiled call
            # among them. (Before the compiled calls ran on several threads, this build timed a host forward
            # that could not run there, and raised.)
            with monkeypatch.context() as patch:
                patch.delenv("GBV_HOST_FORWARD")
                at_two = LeanCausalLM(hf_pair("gpt2", vocab=48)[0])
                assert at_two.forward_times is not None and lean_host.HOST in at_two.forward_times
                assert LeanCausalLM(target).forward_times is not None  # (Llama: measured, numpy between products)
        finally:
            torch.set_num_threads(threads)
    with monkeypatch.context() as patch:  # (torch's products forced: the torch forward for these layers)
        patch.setenv("GBV_HOST_FORWARD", "torch-products")
        forced = LeanCausalLM(hf_pair("gpt2", vocab=48)[0])
        assert forced.forward_choice == lean_host.TORCH and forced.host_forward is None
    with monkeypatch.context() as patch:
        patch.setenv("GBV_HOST_KERNELS", "0")
        assert lean_host.host_forward_unsupported_reason(gpt2).startswith(
            "LayerNorms, biases, learned positions, MLPs without a gate or q/k norms need the compiled kernels")
        assert lean_host.host_forward_unsupported_reason(lean) is None
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    assert LeanCausalLM(target).host_forward is None
    monkeypatch.delenv("GBV_HOST_FORWARD")

    calls = []
    real = lean.host_forward._forward
    monkeypatch.setattr(lean.host_forward, "_forward", lambda *args: calls.append(args[0].shape) or real(*args))
    with_kernels = lean.host_forward.panels_off is None and lean.host_forward.attention_off is None
    with torch.inference_mode():
        cache = lean.new_cache(2, 160)
        long = lean_host.HOST_MAX_QUERIES + 1
        lean.forward(torch.ones(1, long, dtype=torch.long), torch.arange(long)[None], 0, cache, None, causal=True)
        many = lean_host.KERNEL_MAX_ROWS // 2 + 1  # two sequences, more than KERNEL_MAX_ROWS rows in all
        lean.forward(torch.ones(2, many, dtype=torch.long), torch.arange(many).expand(2, many), 0, cache, None,
                     causal=True)
        assert calls == ([(1, long), (2, many)] if with_kernels else [])
        del calls[:]
        monkeypatch.setattr(lean_host, "BATCH_MAX_ROWS", lean_host.KERNEL_MAX_ROWS)  # (the cap before)
        lean.forward(torch.ones(2, many, dtype=torch.long), torch.arange(many).expand(2, many), 0, cache, None,
                     causal=True)
        monkeypatch.setattr(lean_host, "BATCH_MAX_ROWS", None)
        over = lean_host.KERNEL_MAX_ROWS + 1  # two sequences, one of more queries than the kernels take
        lean.forward(torch.ones(2, over, dtype=torch.long), torch.arange(over).expand(2, over), 0, cache, None,
                     causal=True)
        kernels_off = lean.host_forward.panels_off
        lean.host_forward.panels_off = "off for this test"
        lean.forward(torch.ones(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3), 0, cache, None, causal=True)
        assert calls == []
        lean.host_forward.panels_off = kernels_off
        lean.forward(torch.ones(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3), 0, cache, None, causal=True)
        lean.forward(torch.ones(1, 4, dtype=torch.long), torch.arange(4)[None], 0, cache, None, causal=True,
                     first_row=1)
        lean.forward(torch.ones(1, 1, dtype=torch.long), torch.tensor([[4]]), 4, cache, None)
        layer_panels, lean.host_forward.layer_panels = lean.host_forward.layer_panels, None
        lean.forward(torch.ones(1, long, dtype=torch.long), torch.arange(long)[None], 0, cache, None, causal=True)
        lean.host_forward.layer_panels = layer_panels  # (without the one-call forward: the torch path)
    assert calls == ([(2, 3)] if with_kernels else []) + [(1, 4), (1, 1)]


@pytest.mark.parametrize("arch", ["llama", "gptneox", "gpt2", "opt", "phi", "gptj"])
def test_host_forward_over_several_sequences_equals_the_torch_forward(arch):
    """Rows of a batch (the batch engine's forwards; the engine sends the host forward one sequence
    at a time, so it is called directly here): each row with its own positions, mask and dead slots,
    from a first row other than 0, and a prefill into one row of a shared cache."""
    _skip_without_kernels(arch)
    target, _ = hf_pair(arch, vocab=48, seed=6, target_size=(64, 2))
    host, plain = _both(target)
    direct = host.host_forward

    def host_forward(tokens, positions, start, cache, mask, causal=False, last_only=False, first_row=0):
        return direct(tokens.numpy(), positions.numpy(), start, cache, mask, causal, last_only, first_row)

    host.forward = host_forward
    gen = torch.Generator().manual_seed(2)
    caches = [lean.new_cache(4, 64) for lean in (host, plain)]
    with torch.inference_mode():
        for row, length in ((1, 5), (2, 9), (3, 3)):  # prefill rows 1-3 one by one (first_row), last only
            prompt = torch.randint(0, 48, (1, length), generator=gen)
            outs = [lean.forward(prompt, torch.arange(length)[None], 0, cache, None, causal=True, last_only=True,
                                 first_row=row) for lean, cache in zip((host, plain), caches)]
            torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)
        lengths = torch.tensor([5, 9, 3])
        start = 9
        for n in (1, 4, 7, 25):  # (25: 75 rows in all, more than KERNEL_MAX_ROWS; a batch takes them)
            tokens = torch.randint(0, 48, (3, n), generator=gen)
            positions = lengths[:, None] + torch.arange(n)[None]
            slots = torch.arange(start + n)
            mask = (slots[None, None, :] < lengths[:, None, None]) | (
                (slots[None, None, :] >= start) & (slots[None, None, :] - start <= torch.arange(n)[None, :, None]))
            mask = mask & (torch.rand(3, n, start + n, generator=gen) < 0.8)
            mask[:, torch.arange(n), start + torch.arange(n)] = True
            outs = [lean.forward(tokens, positions, start, cache, mask[:, None], first_row=1)
                    for lean, cache in zip((host, plain), caches)]
            assert outs[0].shape == (3, n, 48)
            torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)
            start += n
        for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
            torch.testing.assert_close(a[:, :, :start], b[:, :, :start], atol=1e-5, rtol=0)


def test_the_engine_decodes_through_the_host_forward(monkeypatch):
    """A generation on the tree engine runs its draft steps, tree passes and plain steps through the
    host forward, and greedy decoding gives the tokens the torch path gives."""
    target, draft = hf_pair("llama", vocab=48, seed=7)
    counts = {"n": 0}

    def counting(real):
        def counted(self, *args, **kwargs):
            counts["n"] += 1
            return real(self, *args, **kwargs)
        return counted

    # the host forward's two ways in: a forward, and a one-call forward that samples (HostForward.sampled)
    for name in ("_forward", "_one_call"):
        monkeypatch.setattr(lean_host.HostForward, name, counting(getattr(lean_host.HostForward, name)))
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("GBV_HOST_FORWARD", flag)
        fresh = [m.__class__(m.config).eval() for m in (target, draft)]  # new lean views (cached per model)
        for new, old in zip(fresh, (target, draft)):
            new.load_state_dict(old.state_dict())
        outs[flag] = [generate(ModelPair(*fresh), prompt_ids=[1, 2, 3], method=method, num_paths=3, block_len=4,
                               temperature=0.0, max_new_tokens=24, eos_token_id=[], seed=0).token_ids
                      for method in ("ar", "block", "gbv")]
        if flag == "1":
            assert counts["n"] > 20
            used = counts["n"]
    assert counts["n"] == used  # nothing ran through it with GBV_HOST_FORWARD=0
    assert outs["1"] == outs["0"]
    assert np.all([len(tokens) == 24 for tokens in outs["1"]])


def test_host_forward_in_and_out_of_inference_mode():
    """Buffers first made inside inference mode stay writable outside it, and weights that need grad
    (an HF model outside no_grad) do not stop the products written into buffers."""
    target, _ = hf_pair("llama", vocab=48, seed=5)
    host, plain = _both(target)
    tokens, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    with torch.inference_mode():
        inside = host.forward(tokens, positions, 0, host.new_cache(1, 8), None, causal=True)
    outside = host.forward(tokens, positions, 0, host.new_cache(1, 8), None, causal=True)
    reference = plain.forward(tokens, positions, 0, plain.new_cache(1, 8), None, causal=True)
    assert torch.equal(inside, outside)
    torch.testing.assert_close(outside, reference.detach(), atol=2e-5, rtol=0)


@pytest.mark.skipif(host_kernels_unavailable() is not None, reason="compiled kernels unavailable")
def test_a_float32_draft_drafts_with_bf16_rounded_weights(monkeypatch):
    """On the CPU, where the compiled products run, a float32 draft drafts through a view of its own whose
    matrices are bfloat16 values streamed as bfloat16 panels (tree_decoder.draft_lean_model: half the
    bytes a draft step reads). Its logits are the float32 draft's to bfloat16's rounding, the model's
    own view is left exact, and GBV_DRAFT_BF16=0 or a draft that is the target keeps the one view. The
    engine's law through it is checked by test_exactness.py's hf tests, which decode through it."""
    import gbv.engine.tree_decoder as tree_decoder

    target, draft = hf_pair("llama", vocab=40, seed=8)
    plain = tree_decoder.lean_model(draft)
    rounded = tree_decoder.draft_lean_model(draft, target)
    assert rounded is not plain and tree_decoder.draft_lean_model(draft, target) is rounded
    assert tree_decoder.draft_lean_model(draft, draft) is plain
    for matrix in rounded.matrices():
        assert torch.equal(matrix.weight_t, matrix.weight_t.to(torch.bfloat16).float())
    host = rounded.host_forward
    assert all(product.panel.bf16 for product in host.products())
    assert not any(product.panel.bf16 for product in plain.host_forward.products())
    ids = torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        exact = draft(input_ids=ids).logits[0]
        outs = [view.forward(ids, torch.arange(12)[None], 0, view.plain_cache(1, 16), None, causal=True)[0]
                for view in (plain, rounded)]
    torch.testing.assert_close(outs[0], exact, atol=1e-4, rtol=0)
    gap = (outs[1] - exact).abs().max().item()
    assert 1e-6 < gap < 0.05  # (rounded, and by no more than bfloat16's rounding of the weights)
    monkeypatch.setenv("GBV_DRAFT_BF16", "0")
    assert tree_decoder.draft_lean_model(draft, target) is plain


@pytest.mark.skipif("qwen3" not in ARCHITECTURES, reason="no Qwen3 in this transformers")
def test_qwen3_qk_norms_on_the_compiled_forward_with_random_weights():
    """Qwen3's q and k norms on the compiled layers, with random norm weights (the toys' are ones, which hide
    their order): the host forward's logits equal Hugging Face's to float32 rounding, and the torch forward's
    over a prompt, a step, a tree pass and a batch. Controls: the q and k weights swapped, or each head's
    weights in Hugging Face's order rather than the rows' interleaved one, are caught by the same gap."""
    _skip_without_kernels("qwen3")
    target, _ = hf_pair("qwen3", vocab=48, seed=11, target_size=(64, 2))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in target.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=gen))
            layer.self_attn.q_proj.weight.mul_(3.0)  # (sharper attention: the norms weigh in the logits)
    host, plain = _both(target)
    assert host.forward_choice == lean_host.HOST and len(host.host_forward.layers[0][12]) == 2 * host.head_dim
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    with torch.inference_mode():
        reference = target(input_ids=torch.tensor([tokens])).logits
        ours = host.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], 0, host.new_cache(1, 16), None,
                            causal=True)
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=0)
    assert _largest_gap(host, plain) < 2e-5
    forward, dim = host.host_forward, host.head_dim
    unbroken = list(forward.layers)
    for broken in ("swapped", "hf order"):
        entries = [list(entry) for entry in unbroken]
        for entry, layer in zip(entries, host.layers):
            if broken == "swapped":
                entry[12] = np.ascontiguousarray(np.concatenate([entry[12][dim:], entry[12][:dim]]))
            else:
                hf = (layer.q_norm.weight, layer.k_norm.weight)
                entry[12] = np.ascontiguousarray(torch.cat(hf).detach().float().numpy())
        forward.layers = [tuple(entry) for entry in entries]
        forward.layer_panels = forward._layer_panels()
        assert _largest_gap(host, plain) > 1e-4, broken


def test_models_past_the_fuse_cap_get_the_copies_only_where_they_fit(monkeypatch):
    """Past FUSE_MAX_PARAMETERS (lowered here to 0, with PANEL_MAX_PARAMETERS, so the toys stand for models of
    billions of parameters), a float32 model on the CPU gets the fused transposed copies, and so the compiled
    forward, where they and the panels (8 bytes a parameter) fit in PANEL_MEMORY_SHARE of the memory available;
    not where they do not, nor past FUSE_MEMORY_MAX_PARAMETERS, nor with GBV_HOST_FORWARD=0. A bfloat16 model
    run in float32 counts 6 bytes a parameter. The logits are Hugging Face's either way."""
    import gbv.engine.lean as lean_module

    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    count = sum(p.numel() for p in target.parameters())
    monkeypatch.setattr(lean_module, "FUSE_MAX_PARAMETERS", 0)
    monkeypatch.setattr(lean_host, "PANEL_MAX_PARAMETERS", 0)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        reference = target(input_ids=torch.tensor([tokens])).logits

    def built(available: int | None) -> LeanCausalLM:
        monkeypatch.setattr(lean_host, "available_memory", lambda: available)
        lean = LeanCausalLM(target)
        with torch.inference_mode():
            logits = lean.forward(torch.tensor([tokens]), torch.arange(len(tokens))[None], 0, lean.new_cache(1, 16),
                                  None, causal=True)
        torch.testing.assert_close(logits, reference, atol=2e-5, rtol=0)
        return lean

    assert built(16 * count).transposed  # (8 bytes a parameter in half of 16)
    unfused = built(16 * count - 16)
    assert not unfused.transposed and unfused.host_forward is None
    assert not built(None).transposed  # (the memory available unknown)
    monkeypatch.setattr(lean_module, "FUSE_MEMORY_MAX_PARAMETERS", count - 1)
    assert not built(100 * count).transposed
    monkeypatch.setattr(lean_module, "FUSE_MEMORY_MAX_PARAMETERS", count)
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    assert not built(100 * count).transposed
    monkeypatch.setenv("GBV_HOST_FORWARD", "1")
    if host_kernels_unavailable() is None:  # (a bfloat16 model runs in float32 only with the kernels)
        bf16 = copy.deepcopy(target).to(torch.bfloat16)
        for available, fused in ((12 * count, True), (12 * count - 12, False)):
            monkeypatch.setattr(lean_host, "available_memory", lambda: available)
            assert LeanCausalLM(bf16).transposed == fused


def test_float32_copy_and_bf16_rounding_in_place():
    """The float32 copy a bfloat16 model runs from: every parameter and buffer converted once, the tied head
    still tied, the model untouched; and the in-place rounding to bfloat16 values, block by block, rounds as
    ``.to(torch.bfloat16)`` does (nearest even), whatever the block size."""
    from gbv.engine.lean import _float32_copy, _round_to_bf16_values

    model = hf_pair("llama", vocab=48, seed=6)[0]
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(torch.bfloat16)
    wide = _float32_copy(model)
    assert wide.lm_head.weight is wide.model.embed_tokens.weight
    for (name, mine), (_, theirs) in zip(wide.state_dict().items(), model.state_dict().items()):
        assert mine.dtype == (torch.float32 if theirs.is_floating_point() else theirs.dtype), name
        torch.testing.assert_close(mine, theirs.float() if theirs.is_floating_point() else theirs, atol=0, rtol=0)
        assert mine.data_ptr() != theirs.data_ptr()
    assert next(model.parameters()).dtype == torch.bfloat16 and not next(wide.parameters()).requires_grad
    narrow = _float32_copy(model, matrices=False)  # (the matrices left to the transposed copies to widen)
    attention = narrow.model.layers[0].self_attn
    assert attention.q_proj.weight is model.model.layers[0].self_attn.q_proj.weight
    assert attention.q_proj.weight.dtype == torch.bfloat16
    assert narrow.lm_head.weight is narrow.model.embed_tokens.weight  # (tied: an embedding, widened)
    assert narrow.model.embed_tokens.weight.dtype == narrow.model.norm.weight.dtype == torch.float32
    weight = torch.randn(300, 70, generator=torch.Generator().manual_seed(1))
    for rows in (1, 7, 256, 1000):
        rounded = weight.clone()
        _round_to_bf16_values(rounded, rows)
        torch.testing.assert_close(rounded, weight.to(torch.bfloat16).float(), atol=0, rtol=0)


def test_fused_transposed_copy_equals_the_concatenation_reordered_and_transposed():
    """W^T of stacked parts in a row order, written from the parts (lean._fused_transposed_copy): the same values
    as the concatenation, reordered, then transposed, for the orders the lean view makes (none, a rotation's
    interleaving, GPT-NeoX's heads) and a random one, parts of uneven rows, and a part that is a transposed view
    (GPT-2's Conv1D). A control order is caught."""
    from gbv.engine.lean import _fused_transposed_copy, _interleave_rotary_rows, _head_major_rows

    gen = torch.Generator().manual_seed(2)
    parts = [torch.randn(rows, 40, generator=gen) for rows in (128, 32, 32)]
    total = 192
    identity = torch.arange(total)
    interleaved = torch.cat([_interleave_rotary_rows(identity[:160].double()[:, None], 16)[:, 0].long(),
                             identity[160:]])
    heads = _head_major_rows(identity.double()[:, None], None, 4, 16)[0][:, 0].long()
    for order in (identity, interleaved, heads, torch.randperm(total, generator=gen)):
        want = torch.cat(parts)[order].t().contiguous()
        assert torch.equal(_fused_transposed_copy(parts, order), want)
    narrow = [part.bfloat16() for part in parts]  # (a bfloat16 model's matrices: widened, exactly)
    widened = _fused_transposed_copy(narrow, interleaved)
    assert widened.dtype == torch.float32
    assert torch.equal(widened, torch.cat(narrow).float()[interleaved].t().contiguous())
    conv = torch.randn(40, 96, generator=gen)  # (a Conv1D's (in, out) tensor: its weight is the view conv.t())
    assert torch.equal(_fused_transposed_copy([conv.t()], identity[:96]), conv)
    assert not torch.equal(_fused_transposed_copy(parts, interleaved), torch.cat(parts).t().contiguous())


@pytest.mark.skipif(host_kernels_unavailable() is not None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("arch", ["llama", "gptneox", "gpt2", *(a for a in ("gemma3", "mistral") if a in ARCHITECTURES)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_drafted_path_in_one_call_equals_a_call_per_step(arch, dtype, temperature):
    """``LeanCausalLM.sampled_path`` (the draft's ``block`` steps as one compiled call: ``forward_into``'s
    ``steps``) draws the tokens, writes the laws and the cache entries, and takes the uniforms of as many
    calls of ``sampled_chain``, bit for bit: from a chain of two unseen tokens, then one token a step, over
    learned positions (GPT-2), tables per layer kind and a scaled embedding (Gemma 3) and a sliding window
    (Mistral). Where the window would bind on the way it declines before drawing anything."""
    from gbv.engine.sampling import SamplingConfig
    from gbv.verify.common import TorchRandom

    vocab, steps = 40, 5
    model = hf_pair(arch, vocab=vocab, seed=11)[0].to(dtype)
    lean = LeanCausalLM(model)
    assert lean.host_forward is not None and lean.host_forward.one_call(1)
    prefix = 9 if lean.window is None else lean.window - 7  # (the windowed ones: every slot within the window)
    config = SamplingConfig(temperature)
    ids = torch.randint(0, vocab, (prefix + 2,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = []
    for one_call in (True, False):
        cache = lean.new_cache(1, 64)
        with torch.inference_mode():
            lean.forward(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], 0, cache, None, causal=True)
        rng, probs = TorchRandom(seed=5), np.full((steps, vocab), np.nan, dtype=np.float32)
        if one_call:
            path = lean.sampled_path(ids[prefix:], prefix, cache, vocab, config, rng, probs, steps)
        else:
            path = [lean.sampled_chain(ids[prefix:], prefix, cache, vocab, config, rng, probs[0])]
            for s in range(1, steps):
                path.append(lean.sampled_chain([path[-1]], prefix + 1 + s, cache, vocab, config, rng, probs[s]))
        keys, values = cache.arrays()
        runs.append((path, probs, [np.array(k[:, :, :prefix + 1 + steps]) for k in keys + values], rng.uniform()))
    (path, probs, kv, after), (path_ref, probs_ref, kv_ref, after_ref) = runs
    assert path == path_ref and after == after_ref
    assert np.array_equal(probs, probs_ref) and not np.isnan(probs).any()
    assert all(np.array_equal(a, b) for a, b in zip(kv, kv_ref))
    if temperature > 0:  # (each step's own law: the token fed moved on; greedy rows are one-hot, and may repeat)
        assert len({tuple(row) for row in probs}) == steps
        # negative control: the same path one slot early (its positions off by one) is told apart
        cache, late = lean.new_cache(1, 64), np.zeros_like(probs)
        with torch.inference_mode():
            lean.forward(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], 0, cache, None, causal=True)
        lean.sampled_path(ids[prefix:], prefix - 1, cache, vocab, config, TorchRandom(seed=5), late, steps)
        assert not np.array_equal(late, probs_ref)
    if lean.window is not None:  # (Mistral: a path past its window declines, before any draw)
        rng = TorchRandom(seed=5)
        cache = lean.new_cache(1, 64)
        assert lean.sampled_path(ids[:2], lean.window - 2, cache, vocab, config, rng, probs, steps) is None
        assert rng.uniform() == TorchRandom(seed=5).uniform()
        with pytest.raises(ValueError, match="sliding window"):  # (the host's steps refuse it too, before running)
            lean.host_forward.sampled_steps(np.array(ids[:2]), lean.window - 2, cache, steps, vocab, temperature,
                                            np.full(steps, 0.5), probs, np.zeros(steps, np.int64))


@pytest.mark.skipif(host_kernels_unavailable() is not None, reason="compiled kernels unavailable")
def test_steps_are_refused_where_they_do_not_apply():
    """``forward_into``'s ``steps`` runs only the causal chain of one output row with a draw of every step: a
    mask, every query's logits, or no tokens to draw into are refused with one line, before anything runs."""
    model = hf_pair("llama", vocab=40, seed=11)[0]
    host = LeanCausalLM(model).host_forward
    tokens, positions = np.array([3, 4], dtype=np.int64), np.array([0, 1], dtype=np.int64)
    probs, drawn, u = np.zeros((3, 40), np.float32), np.zeros(3, np.int64), np.full(3, 0.5)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    for kwargs in (dict(mask=mask, last_only=True, tokens_out=drawn), dict(mask=None, last_only=False, tokens_out=drawn),
                   dict(mask=None, last_only=True, tokens_out=None)):
        cache = host.lean.new_cache(1, 16)
        with pytest.raises(ValueError, match="steps > 1 needs"):
            host._one_call(tokens, positions, 0, cache, draw_vocab=40, u=u, probs=probs, steps=3, **kwargs)
    with pytest.raises(ValueError, match="stop tokens need steps > 1"):  # (a stop list with one step)
        host._one_call(tokens, positions, 0, host.lean.new_cache(1, 16), None, True, draw_vocab=40, u=u,
                       probs=probs, tokens_out=drawn, steps=1, stop=np.array([3], np.int64))


@pytest.mark.skipif(host_kernels_unavailable() is not None, reason="compiled kernels unavailable")
@pytest.mark.parametrize("arch", ["llama", "gpt2", *(a for a in ("mistral",) if a in ARCHITECTURES)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_run_of_plain_steps_in_one_call_equals_a_call_per_step_and_ends_at_a_stop_token(arch, dtype, temperature):
    """``LeanCausalLM.sampled_run`` on the host forward (``ar``'s steps as one compiled call, no laws kept) draws
    the tokens, writes the cache entries and takes the uniforms of as many calls of ``sampled_chain``, bit for bit.
    With stop tokens it ends right after the first step that draws one of them: the tokens and cache entries up
    to there are the same, and nothing past them is written. A stop token that is never drawn changes nothing."""
    from gbv.engine.sampling import SamplingConfig
    from gbv.verify.common import TorchRandom

    vocab, count = 40, 7
    model = hf_pair(arch, vocab=vocab, seed=11)[0].to(dtype)
    lean = LeanCausalLM(model)
    prefix = 9 if lean.window is None else lean.window - count  # (every slot within the window)
    config = SamplingConfig(temperature)
    ids = torch.randint(0, vocab, (prefix + 1,), generator=torch.Generator().manual_seed(3)).tolist()

    def decode(one_call: bool, stop: list[int] | None):
        cache = lean.new_cache(1, 64)
        with torch.inference_mode():
            lean.forward(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], 0, cache, None, causal=True)
        rng = TorchRandom(seed=7)
        if one_call:
            drawn = lean.sampled_run(ids[prefix], prefix, count, cache, vocab, config, rng,
                                     None if stop is None else np.array(stop, dtype=np.int64))
        else:
            drawn = [ids[prefix]]
            for s in range(count):
                drawn.append(lean.sampled_chain(drawn[-1:], prefix + s, cache, vocab, config, rng))
            drawn = drawn[1:]
        keys, values = cache.arrays()
        return drawn, [np.array(k[:, :, :prefix + count + 1]) for k in keys + values], rng.uniform()

    reference, kv_ref, after_ref = decode(False, None)
    drawn, kv, after = decode(True, None)
    assert drawn == reference and after == after_ref
    assert all(np.array_equal(a, b) for a, b in zip(kv, kv_ref))
    unseen = [t for t in range(vocab) if t not in reference][:2]
    assert decode(True, unseen)[0] == reference  # (stop tokens never drawn: the whole run)
    stop = reference[3]
    ends = reference.index(stop) + 1  # (the first step that draws it; a greedy path may repeat a token)
    drawn, kv, _ = decode(True, [unseen[0], stop])
    assert drawn == reference[:ends] and ends < count
    written = prefix + ends  # (slots of the prefix, the pending token and the steps that fed a drawn token)
    assert all(np.array_equal(a[:, :, :written], b[:, :, :written]) for a, b in zip(kv, kv_ref))
    assert all(not a[:, :, written:].any() for a in kv)  # (the steps after the stop never ran)
    # negative control: a run fed one slot early (its positions off by one) is told apart
    cache = lean.new_cache(1, 64)
    with torch.inference_mode():
        lean.forward(torch.tensor([ids[:prefix]]), torch.arange(prefix)[None], 0, cache, None, causal=True)
    early = lean.sampled_run(ids[prefix], prefix - 1, count, cache, vocab, config, TorchRandom(seed=7))
    keys, values = cache.arrays()
    assert not all(np.array_equal(np.array(a[:, :, :prefix + count + 1]), b) for a, b in zip(keys + values, kv_ref))
    assert early is not None
    if lean.window is not None:  # (Mistral: a run past its window declines, before any draw)
        rng = TorchRandom(seed=7)
        assert lean.sampled_run(ids[prefix], prefix + 1, count, lean.new_cache(1, 64), vocab, config, rng) is None
        assert rng.uniform() == TorchRandom(seed=7).uniform()
