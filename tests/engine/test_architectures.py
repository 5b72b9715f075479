"""The Llama-shaped families beyond the Llama family on the lean tree engine (Gemma, Granite, Phi-3), and
sliding-window attention (Mistral v0.1, Phi-3): each one's differences from Llama are computed as its
Hugging Face modules compute them, and each test has a control that drops one difference and is
caught. (Greedy equality with Hugging Face and every method's sampling run over every architecture in
test_engine.py; tree passes in test_tree.py.)"""

from __future__ import annotations

import pytest
import torch

from gbv.engine import lean as lean_module
from gbv.engine import lean_host
from gbv.engine.decoder import engine_for
from gbv.engine.generate import generate
from gbv.engine.host_kernels import host_kernels_unavailable
from gbv.engine.lean import LeanCausalLM, _attention_module, _decoder_layers, lean_unsupported_reason, text_decoder
from gbv.models.loading import ModelPair

from engine_toy import hf_pair, sharpen

NEW_FAMILIES = ("gemma", "gemma2", "gemma3", "gemma3mm", "granite", "phi3", "smollm3", "gptneox",
                "gptneox-sequential", "gpt2", "opt", "gpt-bigcode", "gpt-bigcode-heads", "starcoder2",
                "phi", "olmo", "olmo2", "olmo3", "gptj")
TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def _logits(lean: LeanCausalLM, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens], device=lean.device)
    with torch.inference_mode():
        return lean.forward(ids, torch.arange(len(tokens), device=lean.device)[None], 0,
                            lean.new_cache(1, len(tokens)), None, causal=True).float()


def _reference(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens], device=model.device)).logits.float()


def _sharpen_attention(model) -> None:
    """q and k weights times 4: sharper attention, so that the positions (the rotation, the window) weigh
    in the logits."""
    with torch.no_grad():
        for layer in _decoder_layers(text_decoder(model)):
            for name, parameter in _attention_module(layer).named_parameters():  # (GPT-NeoX: q/k/v one matrix)
                if name.startswith(("q", "k", "c_attn")):
                    parameter.mul_(4.0)


def _break(arch: str, lean: LeanCausalLM) -> None:
    """Drop one of the family's differences from Llama in a built view (the controls)."""
    if arch == "gemma":
        lean.embed_scale = None
    elif arch == "granite":  # (its residual multiplier and logits divisor are in the copies: test_granite_*)
        lean.embed_scale = None
    elif arch == "gemma2":  # the soft caps (attention scores and logits)
        lean.logits_softcap = None
        for layer in lean.layers:
            layer.softcap = None
    elif arch == "smollm3":  # every layer rotated, its NoPE layer too
        for layer in lean.layers:
            layer.rope_kind = None
    elif arch in ("gemma3", "gemma3mm"):  # one rotary base for every layer (the sliding layers')
        for layer in lean.layers:
            layer.rope_kind = "sliding_attention"
    elif arch == "gptneox":  # the MLP on the attention's output, not on the layer's input
        for layer in lean.layers:
            layer.parallel = False
    elif arch == "gpt2":  # no learned positions
        lean.position_embed = None
    elif arch == "opt":  # the position rows not offset by 2
        lean.position_offset = 0
    elif arch in ("gpt-bigcode", "gpt-bigcode-heads"):  # positions not added
        lean.position_embed = None
    elif arch == "olmo2":  # the blocks' outputs not normed
        for layer in lean.layers:
            layer.attn_out_norm = layer.mlp_out_norm = None
    elif arch == "olmo3":  # no sliding window
        for layer in lean.layers:
            layer.window = None
    elif arch in ("phi", "gptj"):  # the MLP on the attention's output
        for layer in lean.layers:
            layer.parallel = False
    elif arch in ("gptneox-sequential", "starcoder2", "olmo"):  # RMSNorms for the LayerNorms (weights, biases folded)
        lean.layer_norm = False
        for layer in lean.layers:
            layer.layer_norm = False


@pytest.mark.parametrize("arch", NEW_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lean_forward_is_the_hugging_face_forward(arch, dtype, monkeypatch):
    """Logits of the lean view against the model's own forward, float32 (to float32 rounding) and
    bfloat16 with the compiled kernels off (the model computes in bfloat16 throughout: Gemma's norms
    scale before their cast there). In float32 a control without one of the family's differences fails."""
    if dtype == "bfloat16":
        monkeypatch.setenv("GBV_HOST_KERNELS", "0")
    target, draft = hf_pair(arch, vocab=32, seed=4)
    for model in (target, draft):
        _sharpen_attention(model)
        model = model.to(getattr(torch, dtype))
        assert lean_unsupported_reason(model) is None
        lean = LeanCausalLM(model)
        assert lean.dtype == model.dtype
        expected = _reference(model, TOKENS)
        tolerance = 2e-5 if dtype == "float32" else 2e-2 * float(expected.abs().max())
        torch.testing.assert_close(_logits(lean, TOKENS), expected, atol=tolerance, rtol=0)
        if dtype == "float32":  # (the controls where the tolerance is tight)
            # (on the torch forward, which reads the view's attributes _break changes; the host forward's
            # compiled layers have their own controls: test_lean_host.py)
            lean.host_forward = None
            _break(arch, lean)
            if arch == "phi3":  # the rotation of the whole head, not of its first rotary_dim dimensions
                with monkeypatch.context() as patch:
                    patch.setattr(lean_module, "_interleave_rotary_rows",
                                  lambda weight, head_dim, rotary_dim=None, real=lean_module._interleave_rotary_rows:
                                  real(weight, head_dim))
                    lean = LeanCausalLM(model)
            assert (_logits(lean, TOKENS) - expected).abs().max() > 10 * tolerance


def test_granite_multipliers_in_the_copies_or_applied(monkeypatch):
    """Granite's residual multiplier and logits divisor go into the float32 copies of o, down and the head
    (lean._fold_scale), so that the compiled forward, which has neither, runs it; where the view holds the
    model's own tensors (past the fuse limits here) the forward applies them. Hugging Face's logits either way;
    controls: the divisor taken back out of the head's copy, and left unapplied in place."""
    target, _ = hf_pair("granite", vocab=32, seed=4)
    expected = _reference(target, TOKENS)
    lean = LeanCausalLM(target)
    assert lean.logits_divisor is None and lean.embed_scale == 3.0
    assert all(layer.residual_multiplier is None for layer in lean.layers)
    if host_kernels_unavailable() is None:
        assert lean.host_forward is not None and lean.host_forward.one_call(1)
    torch.testing.assert_close(_logits(lean, TOKENS), expected, atol=2e-5, rtol=0)
    lean.host_forward = None
    torch.testing.assert_close(_logits(lean, TOKENS), expected, atol=2e-5, rtol=0)
    lean.lm_head.weight_t.mul_(2.5)  # control
    torch.testing.assert_close(_logits(lean, TOKENS), expected * 2.5, atol=5e-5, rtol=0)
    monkeypatch.setattr(lean_module, "FUSE_MAX_PARAMETERS", 0)
    monkeypatch.setattr(lean_module, "FUSE_MEMORY_MAX_PARAMETERS", 0)
    in_place = LeanCausalLM(target)
    assert in_place.logits_divisor == 2.5 and {layer.residual_multiplier for layer in in_place.layers} == {0.7}
    torch.testing.assert_close(_logits(in_place, TOKENS), expected, atol=2e-5, rtol=0)
    in_place.logits_divisor = None  # control
    torch.testing.assert_close(_logits(in_place, TOKENS), expected * 2.5, atol=5e-5, rtol=0)


def test_which_forward_runs_each_family():
    """float32 on the CPU: Phi-3 (SiLU, no scales; its partial rotation is a table of ones past the
    turned pairs) and Granite (its multipliers in the copies) run on the compiled host forward, and so do
    GPT-NeoX, GPT-2, OPT, GPT-BigCode, Phi, GPT-J, Gemma, Gemma 2 / 3, StarCoder2, SmolLM3 and OLMo 2 / 3
    (LayerNorms, biases, MLPs without a gate, parallel blocks, learned positions, a GELU-tanh gate, sliding
    windows, norms after each block, rotation tables per layer kind, q/k norms over all heads, soft caps: the
    compiled layers only, so where the kernels run)."""
    reasons = {arch: lean_host.host_forward_unsupported_reason(LeanCausalLM(hf_pair(arch, vocab=32)[0]))
               for arch in NEW_FAMILIES}
    unavailable = host_kernels_unavailable()
    compiled = None if unavailable is None else (
        f"LayerNorms, biases, learned positions, MLPs without a gate or q/k norms need the compiled kernels "
        f"({unavailable})")
    assert reasons == {"gemma": compiled, "granite": None, "gemma2": compiled,
                       "gemma3": compiled, "gemma3mm": compiled, "starcoder2": compiled, "smollm3": compiled,
                       "gptneox": compiled, "gptneox-sequential": compiled, "phi": compiled,
                       "gpt2": compiled, "opt": compiled, "gpt-bigcode": compiled, "gpt-bigcode-heads": compiled,
                       "olmo": compiled, "olmo2": compiled, "olmo3": compiled, "gptj": compiled,
                       "phi3": lean_host.host_forward_unsupported_reason(LeanCausalLM(hf_pair("llama", vocab=32)[0]))}
    gemma = LeanCausalLM(hf_pair("gemma", vocab=32)[0])
    assert gemma.layers[0].act is lean_module._gelu_tanh
    phi3 = LeanCausalLM(hf_pair("phi3", vocab=32)[0])
    assert (phi3.rotary_dim, phi3.head_dim) == (8, 16)


def test_gelu_tanh_runs_as_a_function_and_its_python_form_as_the_module():
    from transformers.activations import GELUTanh

    assert lean_module._functional(GELUTanh()) is lean_module._gelu_tanh
    python_form = GELUTanh(use_gelu_tanh_python=True)
    assert lean_module._functional(python_form) is python_form
    x = torch.randn(5, 7)
    torch.testing.assert_close(lean_module._gelu_tanh(x), GELUTanh()(x), atol=0, rtol=0)


def test_exact_gelu_runs_as_a_function_and_its_python_form_as_the_module():
    """GPT-NeoX's GELU (``hidden_act="gelu"``) runs as ``F.gelu``; its Python form (erf written out, which
    rounds otherwise) stays the module."""
    from transformers.activations import GELUActivation

    assert lean_module._functional(GELUActivation()) is torch.nn.functional.gelu
    python_form = GELUActivation(use_gelu_python=True)
    assert lean_module._functional(python_form) is python_form
    x = torch.randn(5, 7)
    torch.testing.assert_close(torch.nn.functional.gelu(x), GELUActivation()(x), atol=0, rtol=0)
    neox = LeanCausalLM(hf_pair("gptneox", vocab=32)[0])
    assert all(layer.act is torch.nn.functional.gelu and not layer.gated for layer in neox.layers)
    assert all(layer.parallel for layer in neox.layers) and neox.layer_norm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_norms_without_affine_parameters(dtype, monkeypatch):
    """OPT with ``layer_norm_elementwise_affine`` off: LayerNorms without weight or bias, in float32 (where
    the norms fold) and bfloat16 (where they do not)."""
    from transformers import OPTConfig, OPTForCausalLM

    monkeypatch.setenv("GBV_HOST_KERNELS", "0")
    torch.manual_seed(2)
    model = OPTForCausalLM(OPTConfig(vocab_size=32, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                     num_attention_heads=2, max_position_embeddings=128, word_embed_proj_dim=32,
                                     layer_norm_elementwise_affine=False, bos_token_id=None, eos_token_id=None,
                                     pad_token_id=None)).eval().to(getattr(torch, dtype))
    _sharpen_attention(model)
    expected = _reference(model, TOKENS)
    tolerance = 2e-5 if dtype == "float32" else 2e-2 * float(expected.abs().max())
    torch.testing.assert_close(_logits(LeanCausalLM(model), TOKENS), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_models_past_the_fuse_limit_run_the_hugging_face_tensors_in_place(arch, monkeypatch):
    """A model past FUSE_MAX_PARAMETERS whose copies do not fit (past FUSE_MEMORY_MAX_PARAMETERS here; on a GPU;
    a real Gemma 2, Granite or Phi-3 in float32 on most machines) keeps its own tensors:
    Phi-3's q/k/v and gate/up matrices each one product, split after it; the rotation in Hugging Face's
    layout (``_rotate``, partial for Phi-3). A control rotating the whole head is caught."""
    target, _ = hf_pair(arch, vocab=32, seed=5)
    _sharpen_attention(target)
    monkeypatch.setattr(lean_module, "FUSE_MAX_PARAMETERS", 0)
    monkeypatch.setattr(lean_module, "FUSE_MEMORY_MAX_PARAMETERS", 0)
    lean = LeanCausalLM(target)
    assert not lean.interleaved and lean.host_forward is None
    if arch == "phi3":
        attn = text_decoder(target).layers[0].self_attn
        assert [part.weight for part in lean.layers[0].qkv.parts] == [attn.qkv_proj.weight]
        assert lean.layers[0].qkv.sizes == [32, 16, 16]
    if arch.startswith("gptneox"):  # (its query_key_value one product, split head by head as the model does)
        attn = text_decoder(target).layers[0].attention
        assert [part.weight for part in lean.layers[0].qkv.parts] == [attn.query_key_value.weight]
        assert lean.layers[0].qkv.head_major == (2, 16) and lean.layers[0].input_norm is not None
    expected = _reference(target, TOKENS)
    torch.testing.assert_close(_logits(lean, TOKENS), expected, atol=2e-5, rtol=0)
    if arch == "gpt2":  # (its Conv1D tensors in place, as views: no copy)
        attn = text_decoder(target).h[0].attn
        assert lean.layers[0].qkv.parts[0].weight.data_ptr() == attn.c_attn.weight.data_ptr()
    if arch == "gpt-bigcode":  # (multi-query: one kv head; q, k, v blocks of one product)
        assert lean.kv_heads == 1 and lean.layers[0].qkv.sizes == [32, 16, 16]
    if arch == "gptj":  # (adjacent pairs turned in place: rotate_every_two); control: halves turned
        assert lean.adjacent_pairs
        lean.adjacent_pairs = False
        assert (_logits(lean, TOKENS) - expected).abs().max() > 2e-4
    if arch in ("gptneox", "gpt-bigcode-heads"):  # control: q, k, v split as three blocks of rows
        lean.layers[0].qkv.head_major = None
        assert (_logits(lean, TOKENS) - expected).abs().max() > 2e-4
    if arch == "phi3":
        def whole_head(x, cos, sin, adjacent=False):
            pad = x.shape[-1] - cos.shape[-1]
            cos = torch.cat([cos, cos.new_ones(cos.shape[:-1] + (pad,))], -1)
            sin = torch.cat([sin, sin.new_zeros(sin.shape[:-1] + (pad,))], -1)
            return x * cos + lean_module._rotate_half(x) * sin
        monkeypatch.setattr(lean_module, "_rotate", whole_head)
        assert (_logits(lean, TOKENS) - expected).abs().max() > 2e-4


@pytest.mark.parametrize("arch", NEW_FAMILIES + ("mistral",))
def test_batched_greedy_rows_equal_lone_runs(arch):
    """Rows of one batch (the batch engine's masks and per-row positions) decode what each decodes alone;
    for Mistral's toy, past its sliding window (the rows' committed slots are their positions)."""
    target, draft = sharpen(*hf_pair(arch, vocab=32, seed=7))
    pair = ModelPair(target, draft)
    assert engine_for(target, draft) == "tree"
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [12, 13]]
    for method, paths, block in (("block", 1, 4), ("gbv", 3, 3)):
        settings = dict(method=method, num_paths=paths, block_len=block, temperature=0.0, max_new_tokens=14,
                        eos_token_id=[])
        batched = generate(pair, prompt_ids=prompts, batch_size=4, **settings)
        assert [row.token_ids for row in batched] == [generate(pair, prompt_ids=ids, **settings).token_ids
                                                    for ids in prompts]


def test_which_sliding_windows_the_lean_path_takes():
    """Every layer sliding (Mistral and Phi-3 name no layer kinds; Qwen2 with all its layers past
    ``max_window_layers``) or some (Qwen2's layers past ``max_window_layers``, Gemma 2 / 3's
    ``layer_types``): the lean path, masking those layers by the window. A window at least the context
    never binds: no window."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    phi3, _ = hf_pair("phi3", vocab=32)
    phi3.config.sliding_window = 64  # (context 128)
    assert lean_unsupported_reason(phi3) is None and LeanCausalLM(phi3).window == 64
    phi3.config.sliding_window = 128
    assert LeanCausalLM(phi3).window is None
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128)
    mistral = LeanCausalLM(MistralForCausalLM(MistralConfig(sliding_window=64, **small)))
    assert mistral.window == 64 and mistral.steps is None
    # (windows run on the compiled host forward, where the kernels run)
    assert (mistral.host_forward is None) == (host_kernels_unavailable() is not None)
    assert LeanCausalLM(MistralForCausalLM(MistralConfig(sliding_window=None, **small))).window is None
    every = Qwen2ForCausalLM(Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=0, **small))
    assert [layer.window for layer in LeanCausalLM(every).layers] == [64, 64]
    some = Qwen2ForCausalLM(Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=1, **small))
    assert engine_for(some, None) == "tree" and [layer.window for layer in LeanCausalLM(some).layers] == [None, 64]
    assert LeanCausalLM(Qwen2ForCausalLM(Qwen2Config(sliding_window=64, **small))).window is None  # (off)


@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma2", "gemma3", "gemma3mm", "starcoder2", "olmo3"])
def test_a_sliding_window_masks_the_slots_before_it(arch):
    """A prompt chain longer than the window, one-token steps after it and a tree pass: each query's
    logits are those of the model's own forward over the whole sequence, which applies the window. The
    control (the window ignored) is caught."""
    from engine_toy import TOY_WINDOW
    from gbv.engine.tree import build_tree, prefix_then

    target, _ = hf_pair(arch, vocab=32, seed=8)
    target.config.sliding_window = TOY_WINDOW
    _sharpen_attention(target)
    lean = LeanCausalLM(target)
    assert lean.window == TOY_WINDOW
    sequence = [(7 * i + 3) % 32 for i in range(20)]
    paths = [[9, 2, 6], [9, 2, 7], [8, 8, 8]]
    expected = _reference(target, sequence)[0]

    dev = lean.device

    def run(window):
        lean.window = window
        with torch.inference_mode():
            cache = lean.new_cache(1, 8)
            prompt = lean.forward(torch.tensor([sequence[:12]], device=dev), torch.arange(12, device=dev)[None], 0,
                                  cache, None, causal=True)[0]
            steps = [lean.forward(torch.tensor([[sequence[i]]], device=dev), torch.tensor([[i]], device=dev), i, cache,
                                  None, causal=True)[0, 0] for i in range(12, 20)]
            tree = build_tree(sequence[-1], paths, lean.device)
            nodes = lean.forward(tree.tokens[None], (19 + tree.depth)[None], 19, cache,
                                 prefix_then(tree.ancestors, 19))[0]
        return torch.cat([prompt, torch.stack(steps)]).float(), nodes.float(), tree

    logits, nodes, tree = run(TOY_WINDOW)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)
    for k, path in enumerate(paths):
        full = _reference(target, sequence + path)[0, len(sequence) - 1:]
        torch.testing.assert_close(nodes[tree.path_nodes[k]], full, atol=2e-5, rtol=0)
    unwindowed, _, _ = run(None)  # control
    assert (unwindowed - expected).abs().max() > 1e-3
    torch.testing.assert_close(unwindowed[:TOY_WINDOW], expected[:TOY_WINDOW], atol=2e-5, rtol=0)


def test_the_hugging_face_path_keeps_every_position_of_a_sliding_model(monkeypatch):
    """On the plain Hugging Face path (GBV_ENGINE=hf) a sliding-window model gets a cache of full layers,
    which rejected drafts can be cropped from past the window; its greedy output is the model's. The
    control (transformers' sliding layers) fails once past the window."""
    from engine_toy import TOY_WINDOW
    from test_engine import greedy_reference

    from gbv.engine import cache as kv

    monkeypatch.setenv("GBV_ENGINE", "hf")
    target, draft = sharpen(*hf_pair("mistral", vocab=32, seed=9))
    pair = ModelPair(target, draft)
    prompt, new = [1, 2, 3, 4, 5], 3 * TOY_WINDOW
    expected = greedy_reference(target, prompt, new)
    for method in ("ar", "block", "gbv"):
        out = generate(pair, prompt_ids=prompt, method=method, num_paths=3, block_len=3, temperature=0.0,
                       max_new_tokens=new, eos_token_id=[])
        assert out.token_ids == expected, method
    from transformers import DynamicCache

    monkeypatch.setattr(kv, "new_cache", lambda model: DynamicCache(config=model.config))
    with pytest.raises(RuntimeError, match="crop"):
        generate(pair, prompt_ids=prompt, method="block", block_len=3, temperature=0.0, max_new_tokens=new,
                 eos_token_id=[])


def test_gemma_norms_scale_before_their_cast():
    """In bfloat16 Gemma's norm multiplies the float32 normalised values by 1 + weight and then rounds
    (GemmaRMSNorm); the lean norm does the same: equal bits here, where Llama's order (round, then scale
    by the rounded weight) differs in about a third of the entries (the control)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = GemmaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    x = (torch.randn(200, 64, generator=gen) * 3).to(torch.bfloat16)
    scale, eps = lean_module._norm_scale_and_eps(norm)
    assert scale.dtype == torch.float32 and eps == 1e-6
    with torch.no_grad():
        expected = norm(x)
    ours = lean_module._rms_norm(x, scale, eps)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, expected)
    llama_order = lean_module._rms_norm(x, None, eps) * scale.to(torch.bfloat16)
    assert (llama_order != expected).float().mean() > 0.1


def test_longrope_stays_on_the_plain_path():
    """Phi-3's ``longrope`` (128k models, Phi-3.5, Phi-4-mini) picks its frequencies per call, and its
    ``generate`` recomputes every key once past the switch: declined, with the reason."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                        original_max_position_embeddings=16,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                         "long_factor": [3.0] * 8, "original_max_position_embeddings": 16},
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = Phi3ForCausalLM(config)
    assert lean_unsupported_reason(model) == "rope type longrope (its frequencies depend on the sequence length)"
    assert engine_for(model, None) == "hf"


def test_olmo_clip_qkv_on_the_lean_path(monkeypatch):
    """OLMo 1.7's ``clip_qkv`` (OLMo-7B-0424's 8) clamps q, k and v after their projection. The lean view clamps them
    on every forward: torch's (both q/k/v layouts) and the compiled one (its layers' ``clip``: one call per forward,
    a layer per call for a batch, a tree pass). The logits are Hugging Face's, and a control without the clamp on
    either path is not; greedy decoding gives Hugging Face's tokens."""
    from test_lean_host import _largest_gap
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(0)
    config = OlmoConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, clip_qkv=0.05,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = OlmoForCausalLM(config).eval()
    assert lean_unsupported_reason(model) is None and engine_for(model, None) == "tree"
    lean, plain = LeanCausalLM(model), LeanCausalLM(model)
    assert lean.clip_qkv == 0.05 and lean.interleaved
    plain.host_forward = None
    with monkeypatch.context() as patch:  # (a view of the model's own tensors: q, k and v apart, not interleaved)
        patch.setattr(lean_module, "FUSE_MAX_PARAMETERS", 0)
        patch.setattr(lean_module, "FUSE_MEMORY_MAX_PARAMETERS", 0)
        in_place = LeanCausalLM(model)
    assert not in_place.interleaved
    expected = _reference(model, TOKENS)
    views = (plain, in_place) if lean.host_forward is None else (lean, plain, in_place)
    for view in views:
        torch.testing.assert_close(_logits(view, TOKENS), expected, atol=1e-5, rtol=0)
    for view in (plain, in_place):
        view.clip_qkv = None
        assert (_logits(view, TOKENS) - expected).abs().max() > 1e-3
        view.clip_qkv = 0.05
    if lean.host_forward is not None:
        assert _largest_gap(lean, plain) < 1e-4  # (a prompt, a step, a tree pass, a batch of two)
        forward = lean.host_forward
        assert forward.clips and all(len(entry) == 22 for entry in forward.layer_panels)
        forward.layers = [(*entry[:-1], 0.0) for entry in forward.layers]
        forward.layer_panels = forward._layer_panels()
        assert (_logits(lean, TOKENS) - expected).abs().max() > 1e-3
    out = generate(ModelPair(model, model), prompt_ids=[3, 1, 4], method="block", block_len=3, temperature=0.0,
                   max_new_tokens=8, eos_token_id=[])
    with torch.inference_mode():
        greedy = model.generate(torch.tensor([[3, 1, 4]]), max_new_tokens=8, do_sample=False)[0, 3:].tolist()
    assert out.token_ids == greedy


def test_gptj_tree_passes_reach_past_its_rotary_table():
    """GPT-J's rotary table has ``max_position_embeddings`` rows (the others compute any position). A tree
    pass near the context writes its nodes at slots past that while their positions stay below it: the
    lean view asks for a table that long, and must not index the module's past its rows (it raised
    IndexError). Sampled paths (T = 1) part, so a pass has many nodes; greedy output equals Hugging Face's
    up to the context."""
    target, draft = sharpen(*hf_pair("gptj", vocab=32, seed=7))
    pair = ModelPair(target, draft)
    prompt = [(3 * i) % 32 for i in range(110)]  # (the toys' context: 128 positions; up to 4 x 6 nodes a pass)
    sampled = generate(pair, prompt_ids=prompt, method="gbv", num_paths=4, block_len=6, temperature=1.0,
                       max_new_tokens=18, eos_token_id=[], seed=3)
    assert len(sampled.token_ids) == 18 and sampled.stats.to_dict()["mean_tree_nodes"] > 7  # (paths parted)
    out = generate(pair, prompt_ids=prompt, method="gbv", num_paths=4, block_len=6, temperature=0.0,
                   max_new_tokens=18, eos_token_id=[])
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(out.token_ids),
                                   do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == expected and len(out.token_ids) == 18


def test_transposed_copies_and_widened_folds_are_the_plain_ones():
    """The blocked transposed copy (matrices of 1M values and more) holds ``W.t().contiguous()``'s values, a
    new tensor also for a GPT-2 Conv1D's view; the block-by-block float64 ``W b`` of a LayerNorm's bias fold
    rounds to what the whole product in float64 rounds to, from a matrix or from its transposed copy's view."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1500, 1024, generator=gen)  # (past the 1M values where the blocks start; rows not a
    copy = lean_module._transposed_copy(weight)       # multiple of the block)
    assert copy.is_contiguous() and torch.equal(copy, weight.t().contiguous())
    stored = torch.randn(64, 48, generator=gen)  # (a Conv1D's (in, out) tensor; the weight is its view)
    conv = lean_module._transposed_copy(stored.t())
    assert torch.equal(conv, stored) and conv.data_ptr() != stored.data_ptr()
    bias = torch.randn(1024, generator=gen)
    whole = (weight.double() @ bias.double()).float()
    assert torch.equal(lean_module._widened_product(weight, bias).float(), whole)
    assert torch.equal(lean_module._widened_product(copy.t(), bias).float(), whole)
