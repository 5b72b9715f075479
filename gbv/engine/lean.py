"""A lean forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3, and the Llama-shaped Gemma 1-3,
Granite, Phi-3 and SmolLM3) and for GPT-NeoX, GPT-2, OPT, GPT-BigCode, StarCoder2, Phi, OLMo 2 / 3 and
GPT-J, over a preallocated KV cache.

Why: an eager transformers decode step of a small model is mostly framework work (about 1,750 aten
ops for the bundled 8-layer target, of which matrix multiplies are 65% of the time; a 1-layer draft
costs 1.2 ms for 0.03 ms of arithmetic). Speculative decoding runs many small forwards, so that
overhead eats the gain. This module runs the same mathematics with the Hugging Face modules' own
weights (in place, or fused and transposed copies for small models) in about 25 ops per layer, and
gives tree verification what it needs:

- a preallocated cache, one tensor pair per layer, shape (B, kv_heads, capacity, head_dim): new
  entries are written into slots, rollback is a length change, and keeping the accepted path of a
  draft tree is one gather/scatter of a few slots (:meth:`KVCache.move`); nothing copies the prefix;
- arbitrary per-query ``positions`` and a boolean attention ``mask`` (B, 1, N, S), so that the nodes of
  a token tree are scored in one pass over one shared prefix.

The plain Hugging Face path (``gbv.engine.decoder``) stays for every other architecture and for
configurations this module does not cover (:func:`lean_unsupported_reason` says why).
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import types
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gbv.engine.host_kernels import (PanelWeight, f16_panels, host_array, host_kernels_unavailable, move_slots,
                                     prefetch_temporal)
from gbv.engine.threads import building_threads, one_torch_thread
from gbv.engine.sampling import SamplingConfig, host_samples
from gbv.engine.static_steps import MAX_QUERIES, StaticSteps, steps_mode
from gbv.engine.static_sampling import plain_loop, sampled_step
from gbv.verify.common import TorchRandom
from gbv.engine.lean_host import (HOST, HOST_TEMPORAL, HOST_TORCH_PRODUCTS, TORCH, HostForward, panels_unfit_reason,
                                  attention_mask, choose_cpu_forward, host_forward_unsupported_reason)

logger = logging.getLogger("gbv")

# Models up to this size get fused (and, on the CPU in float32, transposed) copies of their matrices:
# a second copy of the weights in memory (see LeanCausalLM.__init__).
FUSE_MAX_PARAMETERS = 1_000_000_000
# A bfloat16 model run in float32 of at least this many parameters keeps its matrices as the compiled products'
# panels alone (LeanCausalLM._panels_only): no float32 transposed copies (4 bytes a parameter) beside them. Why
# this size: from about here on torch's forms of a step lost to the compiled one by 1.5-4x wherever they were
# measured (Pythia-70m, SmolLM2-135M and larger shapes: lean_host._CLEAR_LOSS), so timing them, which needs
# those copies, decides nothing; the bundled pair (7.8M) keeps its copies and its measured choice.
PANELS_ONLY_MIN_PARAMETERS = 30_000_000
# Past it, up to this size, a model computed in float32 on the CPU (a bfloat16 one too, run in float32) gets
# them where they and the compiled products' panels fit in memory (large_copies_fit). Why: Llama-3.2-1B,
# TinyLlama-1.1B or Qwen3-1.7B otherwise ran torch's forward over the Hugging Face tensors (a bfloat16 one
# over a float32 copy of them): a Llama-3.2-1B-shaped bfloat16 step took 170 ms there against 87 ms on the
# compiled forward, on two threads (docs/ENGINE.md, "The first call, a shared machine, Qwen3 and models past
# 1B"; its first build 15 s against 8 s).
FUSE_MEMORY_MAX_PARAMETERS = 4_000_000_000

LEAN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                      "GraniteForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM", "GPTNeoXForCausalLM",
                      "GPT2LMHeadModel", "OPTForCausalLM", "GPTBigCodeForCausalLM", "Starcoder2ForCausalLM",
                      "PhiForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "GPTJForCausalLM")
# What the Llama-shaped families change, each taken from the Hugging Face modules (docs/ENGINE.md, "More
# architectures on the lean path"):
# - Gemma: RMSNorms scale by 1 + weight in float32 before their cast (_norm_scale_and_eps), the embedding
#   is multiplied by sqrt(hidden) in the weights' dtype (``embed_tokens.embed_scale``), GELU (tanh);
#   Gemma 2 and 3 also norm each block's output before its residual add (``post_attention_layernorm``,
#   ``post_feedforward_layernorm``; the MLP's input norm is ``pre_feedforward_layernorm``) and slide
#   windows on some layers (``layer_types``); Gemma 2 soft-caps attention scores and logits
#   (``c * tanh(x / c)``); Gemma 3 norms q and k per head and rotates each layer kind by its own base
#   (its 4B+ models load as the multimodal Gemma3ForConditionalGeneration: its text decoder runs here,
#   for text prompts);
# - Granite: the embedding times ``embedding_multiplier``, each block's output times ``residual_multiplier``
#   before the residual add, attention scaled by ``attention_multiplier`` (the module's ``scaling``), the
#   logits divided by ``logits_scaling``;
# - Phi-3: q/k/v and gate/up each one matrix (``qkv_proj``, ``gate_up_proj``), and a rotation of the
#   first ``partial_rotary_factor`` of each head only (Phi-4-mini: 0.75);
# - SmolLM3: no rotation in some layers (``use_rope`` 0, every fourth: "NoPE"): NO_ROTATION;
# - GPT-NeoX (Pythia): LayerNorms with biases, q/k/v one matrix whose rows go head by head (q, k, v of
#   head 0, then of head 1, ...), biases on every matrix, an MLP without a gate (GELU), a rotation of
#   part of each head (``rotary_pct``), and attention and MLP reading the same input where
#   ``use_parallel_residual`` (h + attn(ln1(h)) + mlp(ln2(h)));
# - GPT-2 and OPT: no rotation but learned position embeddings added to the token's (OPT's rows offset by
#   2), LayerNorms with biases, biases on every matrix, an MLP without a gate (GPT-2's tanh GELU in its
#   Python form, OPT's ReLU); GPT-2's matrices are ``Conv1D`` (stored (in, out)) with q/k/v one matrix;
#   OPT scales q after its projection (here the attention's scale: the same product up to rounding);
# - GPT-BigCode (StarCoder, SantaCoder): GPT-2's layout with ``nn.Linear`` matrices and, where
#   ``multi_query``, one kv head (q/k/v one matrix: q, then k, then v; else head by head as GPT-NeoX);
# - StarCoder2: Llama's layout with LayerNorms, biases, an MLP without a gate (tanh GELU) and a sliding
#   window;
# - Phi (phi-1, 1.5, 2): one LayerNorm per layer, read by attention and the MLP in parallel, a partial
#   rotation, biases on every matrix and on the LM head;
# - OLMo (1): Llama's layout with LayerNorms that have no weight nor bias (``OlmoLayerNorm``, eps 1e-5, computed
#   in float32), q/k/v clamped to [-clip_qkv, clip_qkv] after their projection where ``clip_qkv`` is set (OLMo 1.7:
#   ``LeanCausalLM.clip_qkv``, the compiled layers' ``clip``);
# - OLMo 2 / 3: no norm before attention or the MLP, each block's output normed before its residual add
#   (as Gemma 2's), q and k normed over all heads at once (not per head), every RMSNorm scaling before
#   its cast; OLMo 3 slides windows on some layers and rotates each layer kind by its own table;
# - GPT-J: Phi's parallel block (one LayerNorm), and a rotation of adjacent pairs (2i, 2i + 1) of the first
#   ``rotary_dim`` dimensions (``rotate_every_two``), by tables its rotary module gives as (sin, cos) with
#   one entry per pair (``LeanCausalLM.adjacent_pairs``).

# The rotary kind of layers that do not rotate q and k (SmolLM3's NoPE layers, GPT-2's, OPT's): they have no
# table and skip the rotation (LeanCausalLM.rotations).
NO_ROTATION = "none"


def _binding_window(config) -> int | None:
    """The configured sliding window where it can bind: a window at least the context never does, since
    generation keeps every position below the context (gbv.engine.generate, "Context length")."""
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None)
    if not window or not getattr(config, "use_sliding_window", True) or (context and window >= context):
        return None
    return int(window)


def layer_windows(config, num_layers: int) -> list[int | None]:
    """Each layer's sliding window where it can bind (:func:`_binding_window`), else None.

    A query at position ``i`` sees the keys at positions ``> i - window`` (Hugging Face's
    ``sliding_window_overlay``). Models that name each layer's kind (``layer_types``: Qwen2, full unless
    ``use_sliding_window``; Gemma 2 and 3, alternating) slide on their "sliding_attention" layers;
    Mistral and Phi-3 name none, and then every layer slides."""
    window = _binding_window(config)
    kinds = getattr(config, "layer_types", None)
    if window is None:
        return [None] * num_layers
    if not kinds:
        return [window] * num_layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def lean_unsupported_reason(model) -> str | None:
    """None when :class:`LeanCausalLM` can run ``model`` exactly; else why not (one phrase)."""
    name = type(model).__name__
    if name not in LEAN_ARCHITECTURES:
        return f"architecture {name} (lean path: {', '.join(LEAN_ARCHITECTURES)})"
    config = model.config.get_text_config()
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "tensor-parallel pretraining slices"
    rope = getattr(config, "rope_parameters", None) or {}
    # (Gemma 3: one set of parameters per layer kind)
    for parameters in (rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]):
        # (longrope: Phi-3 128k, Phi-3.5, Phi-4-mini. Its module picks the short or long frequencies per call
        # by the call's largest position, and Phi-3's generate drops the cache to recompute every key long
        # once the sequence passes the switch: a law the lean passes would match only with a re-prefill
        # there and no pass across it. docs/ENGINE.md, "More architectures on the lean path".)
        if isinstance(parameters, dict) and parameters.get("rope_type", "default") in ("dynamic", "longrope"):
            return f"rope type {parameters.get('rope_type')} (its frequencies depend on the sequence length)"
    if getattr(config, "add_cross_attention", False):
        return "cross-attention layers"
    if getattr(config, "reorder_and_upcast_attn", False):
        return "attention upcast and reordered (GPT-2's reorder_and_upcast_attn)"
    if name == "OPTForCausalLM" and not getattr(config, "do_layer_norm_before", True):
        return "layer norms after each block (OPT-350m's do_layer_norm_before=False)"
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        return "projections in and out of the embedding (OPT-350m's word_embed_proj_dim)"
    if getattr(config, "_remove_final_layer_norm", False):
        return "no final layer norm"
    if getattr(config, "qk_layernorm", False):
        return "LayerNorms on q and k (Phi's qk_layernorm)"
    inner = text_decoder(model)
    if inner is None or _decoder_layers(inner) is None or not (
            hasattr(inner, "rotary_emb") or _position_embedding_module(inner) is not None):
        return "unexpected module layout"
    return None


def _first_attribute(module, *names: str):
    """The first of ``names`` that ``module`` has (and is not None), else None: the families name the same
    part differently (``self_attn`` / ``attention`` / ``attn``, ...)."""
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value
    return None


def text_decoder(model):
    """The module holding the embedding, the decoder layers, the final norm and the rotary tables:
    ``model.model``, or its ``language_model`` in a multimodal model (Gemma 3's 4B and larger: the
    vision tower is not used for text), or OPT's ``model.decoder``; GPT-NeoX's ``gpt_neox``, GPT-2's
    ``transformer``. None where there is none."""
    inner = getattr(model, "model", None)
    if inner is None:
        return _first_attribute(model, "gpt_neox", "transformer")
    return _first_attribute(inner, "language_model", "decoder") or inner


def _decoder_layers(inner):
    """The decoder layers of a text decoder (``layers``; GPT-2's ``h``); None where it has neither."""
    return _first_attribute(inner, "layers", "h")


def _position_embedding_module(inner):
    """The learned position embedding of a text decoder without rotations (GPT-2's ``wpe``, OPT's
    ``embed_positions``); None elsewhere."""
    return _first_attribute(inner, "wpe", "embed_positions")


def _kv_heads(config) -> int:
    """The number of key/value heads: one where ``multi_query`` (GPT-BigCode), else ``num_key_value_heads``
    (grouped-query attention), else one per query head."""
    if getattr(config, "multi_query", False):
        return 1
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _attention_module(layer):
    """A decoder layer's attention module (``self_attn``; GPT-NeoX's ``attention``, GPT-2's ``attn``)."""
    return _first_attribute(layer, "self_attn", "attention", "attn")


def _embedding_module(inner):
    """The token embedding of a text decoder (``embed_tokens``; GPT-NeoX's ``embed_in``, GPT-2's ``wte``)."""
    return _first_attribute(inner, "embed_tokens", "embed_in", "wte")


def _final_norm_module(inner):
    """The norm after the last layer (``norm``; GPT-NeoX's and OPT's ``final_layer_norm``, Phi's
    ``final_layernorm``, GPT-2's ``ln_f``)."""
    return _first_attribute(inner, "norm", "final_layer_norm", "final_layernorm", "ln_f")


class KVCache:
    """Preallocated keys and values: ``keys[l]``, ``values[l]`` are (B, kv_heads, capacity, head_dim).

    The cache knows nothing of lengths: the decoder tracks which slots hold committed tokens and
    masks the rest, so rolling back rejected tokens costs nothing.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._arrays = None  # numpy views of the tensors (CPU only; see arrays)
        # move() through one compiled call where the host kernels run (the tensors are made contiguous)
        self._compiled_moves = host_kernels_unavailable() is None
        # Static forward steps over these tensors (CUDA graphs: gbv.engine.static_steps), by shape.
        self.steps: dict = {}

    def arrays(self) -> tuple[list, list]:
        """numpy views (B, kv_heads, capacity, head_dim) of every layer's keys and values (CPU only:
        they share the tensors' memory; made again after :meth:`grow`). A bfloat16 cache gives ``uint16``
        views of the bits (numpy has no bfloat16; ``host_kernels.kv_bf16``)."""
        if self._arrays is None:
            self._arrays = (tuple(host_array(t) for t in self.keys), tuple(host_array(t) for t in self.values))
            self._all_arrays = self._arrays[0] + self._arrays[1]  # (move's)
        return self._arrays

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def grow(self, capacity: int) -> None:
        """Reallocate to at least ``capacity`` slots, keeping the contents (amortised: at least doubles)."""
        if capacity <= self.capacity:
            return
        capacity = max(capacity, 2 * self.capacity)
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
                new[:, :, :old.shape[2]] = old
                store[layer] = new
        self._arrays = None
        self.steps = {}  # (they wrote and read the old tensors)

    def move(self, src: Sequence[int] | Tensor, dst: Sequence[int] | Tensor, row: int | Sequence[int] | Tensor = 0
             ) -> None:
        """Copy slots ``src`` to slots ``dst`` (slot indices, lists or 1D long tensors of equal length) in
        batch row ``row`` (an int, or one row per pair), in every layer. The source is read whole before
        the destination is written. Where the host forward has made numpy views of this cache
        (:meth:`arrays`: the CPU), through them, from the callers' lists: 16 torch index ops cost ~200
        us after a forward here, numpy's ~60 us, and where the host kernels run one compiled call for
        every layer from the lists (:func:`~gbv.engine.host_kernels.move_slots`) ~22 us. Elsewhere lists
        become tensors on the device (one copy there for all of them, no host read)."""
        if self._arrays is not None and self._compiled_moves:
            # One compiled call for every layer, from the callers' lists as they are (host_kernels.move_slots;
            # numpy's index arrays cost as much as the copies right after a forward).
            src, dst, row = (index.tolist() if isinstance(index, Tensor) else index for index in (src, dst, row))
            move_slots(self._all_arrays, row, src, dst)
            return
        if self._arrays is not None:
            src_h, dst_h, row_h = (np.asarray(index.numpy() if isinstance(index, Tensor) else index)
                                   for index in (src, dst, row))
            for store in self.arrays():
                for array in store:
                    array[row_h, :, dst_h] = array[row_h, :, src_h]  # (the right side is a copy)
            return
        device = self.keys[0].device
        if any(isinstance(index, Tensor) for index in (src, dst, row)):
            src, dst = (torch.as_tensor(index, dtype=torch.long, device=device) for index in (src, dst))
            if not isinstance(row, int):
                row = torch.as_tensor(row, dtype=torch.long, device=device)
        elif isinstance(row, int):  # lists: one copy of them all (a copy from host memory waits for the device)
            src, dst = torch.tensor([list(src), list(dst)], dtype=torch.long, device=device)
        else:
            src, dst, row = torch.tensor([list(src), list(dst), list(row)], dtype=torch.long, device=device)
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[row, :, dst] = tensor[row, :, src]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` slots of row ``src`` to row ``dst`` (compacting a batch)."""
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[dst, :, :length] = tensor[src, :, :length]


# On CUDA, the norms as ``torch.rms_norm`` (see _rms_norm); a switch for measuring (bench_cuda_graphs.py).
FUSED_NORM_ON_CUDA = True


def _rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Hugging Face's LlamaRMSNorm: normalise in float32, cast back, then scale (``weight`` None: the
    scale was folded into the next matrix, see :func:`_fold_norm_weight`).

    Why not ``torch.rms_norm`` on the CPU: there it runs as about ten small ops (28-50 us for 1-25 rows
    of 256); ``vector_norm``, ``addcmul`` (``eps + |x|^2 / d``), ``rsqrt`` and a multiply take 11-22 us
    for the same rows, equal to it within a few float32 ulps (``eps`` is a 0-dim tensor on ``x``'s
    device, cached per value). On CUDA, where a replayed step (CUDA graphs) costs about its number of
    kernels, ``torch.rms_norm`` is one kernel (it computes in float32 for half-precision inputs too)."""
    # A float32 weight of a half-precision x scales before the cast (Gemma's order: _norm_scale_and_eps).
    scale_first = weight is not None and weight.dtype != x.dtype
    if FUSED_NORM_ON_CUDA and x.is_cuda:
        if scale_first:
            return (torch.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(x.dtype)
        xf = torch.rms_norm(x, (x.shape[-1],), None, eps)
        return xf if weight is None else weight * xf
    xf = x if x.dtype == torch.float32 else x.float()
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
    xf = xf * torch.rsqrt(torch.addcmul(_eps_tensor(eps, x.device), norm, norm, value=1.0 / x.shape[-1]))
    if scale_first:
        return (xf * weight).to(x.dtype)
    if xf.dtype != x.dtype:
        xf = xf.to(x.dtype)
    return xf if weight is None else weight * xf


_EPS_TENSORS: dict[tuple[float, torch.device], Tensor] = {}


def _eps_tensor(eps: float, device: torch.device) -> Tensor:
    key = (eps, device)
    if key not in _EPS_TENSORS:
        _EPS_TENSORS[key] = torch.tensor(eps, dtype=torch.float32, device=device)
    return _EPS_TENSORS[key]


def _is_layer_norm(norm) -> bool:
    """Whether a norm module is a LayerNorm (its input's mean subtracted), not an RMSNorm: torch's (GPT-NeoX, GPT-2,
    OPT, ...), or OLMo 1's ``OlmoLayerNorm`` (no weight nor bias)."""
    return isinstance(norm, torch.nn.LayerNorm) or type(norm).__name__ == "OlmoLayerNorm"


def _norm_scale_and_eps(norm) -> tuple[Tensor | None, float]:
    """An RMSNorm module's scale and epsilon (a LayerNorm's weight, None where it has none). Gemma's norms multiply
    the normalised float32 values by ``1 + weight`` before casting back (GemmaRMSNorm): their scale is that float32
    ``1 + weight``, which :func:`_rms_norm` applies before its cast because its dtype is not the input's (in a
    float32 model the two orders are the same computation)."""
    if type(norm).__name__ == "OlmoLayerNorm":  # (F.layer_norm(x, ..., None, None, eps=1e-5) in float32)
        return None, 1e-5
    eps = getattr(norm, "variance_epsilon", None)
    eps = norm.eps if eps is None else eps
    if type(norm).__name__ in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"):
        return 1.0 + norm.weight.detach().float(), eps
    if type(norm).__name__ in ("Olmo2RMSNorm", "Olmo3RMSNorm"):  # (weight * x_hat in float32, then the cast)
        return norm.weight.detach().float(), eps
    return norm.weight, eps


def _norm_bias(norm) -> Tensor | None:
    """A LayerNorm's bias (GPT-NeoX); None for RMSNorms and LayerNorms without one (OLMo 1's has none)."""
    return getattr(norm, "bias", None) if isinstance(norm, torch.nn.LayerNorm) else None


def _norm(x: Tensor, weight: Tensor | None, eps: float, bias: Tensor | None, layer_norm: bool) -> Tensor:
    """The model's norm over the last dimension: :func:`_rms_norm`, or (``layer_norm``: GPT-NeoX) torch's
    LayerNorm, as ``nn.LayerNorm`` computes it (``weight`` and ``bias`` None where they were folded into
    the matrix after it)."""
    if layer_norm:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return _rms_norm(x, weight, eps)


def _widened_product(weight: Tensor, vector: Tensor) -> Tensor:
    """``W v`` in float64 for an (out, in) ``weight``, ``_WIDEN_BLOCK`` outputs at a time: only a block of W is
    widened at once (the whole of it in float64 was 2.9 s of a 405M-parameter model's lean view, most of it
    in the pages of twice its size)."""
    wide = vector.double()
    out = torch.empty(weight.shape[0], dtype=torch.float64, device=weight.device)
    if weight.device.type == "cpu":  # (a view's build runs on every core: building_threads; its sums on one)
        with one_torch_thread():
            return _widened_blocks(weight, wide, out)
    return _widened_blocks(weight, wide, out)


def _widened_blocks(weight: Tensor, wide: Tensor, out: Tensor) -> Tensor:
    """:func:`_widened_product`'s blocks: ``out = W wide`` in float64, ``_WIDEN_BLOCK`` outputs at a time."""
    stored = weight.t()
    transposed = stored.is_contiguous()  # (a transposed copy's view: its blocks of columns are runs in memory)
    for row in range(0, weight.shape[0], _WIDEN_BLOCK):
        if transposed:
            out[row:row + _WIDEN_BLOCK] = wide @ stored[:, row:row + _WIDEN_BLOCK].double()
        else:
            out[row:row + _WIDEN_BLOCK] = weight[row:row + _WIDEN_BLOCK].double() @ wide
    return out


def _fold_norm_weight(projections: "_Projections | _Linear", weight: Tensor, bias: Tensor | None = None) -> bool:
    """Scale the input columns of a matrix this module owns (a fused or transposed copy) by a norm's
    weight, so that ``norm(x) W^T = (x_hat * w) W^T = x_hat (W diag(w))^T``: one multiply fewer per norm
    (about 4 us here); a LayerNorm's ``bias`` b goes into the matrix's bias, ``W b`` added to it (one
    made where it has none). Only in float32 (in bfloat16 the folded weights would round differently from
    HF's ``weight * x_hat``). Returns whether it folded."""
    parts = projections.parts if isinstance(projections, _Projections) else [projections]
    if weight is None and bias is None:  # (a LayerNorm without affine parameters: OPT's elementwise_affine off)
        return True
    if not all(part.owned and part.upcast is False for part in parts):
        return False
    if any((part.weight_t if part.weight is None else part.weight).dtype != torch.float32 for part in parts):
        return False
    for part in parts:
        if bias is not None:  # (W b with the unscaled W; in float64, rounded once)
            held = part.weight_t.t() if part.weight is None else part.weight
            shift = _widened_product(held, bias).to(held.dtype)
            part.bias = shift if part.bias is None else part.bias + shift  # (a new tensor: not the model's)
        if weight is None:
            continue
        if part.weight is None:
            part.weight_t.mul_(weight[:, None])  # (in, out): scale rows
        else:
            part.weight.mul_(weight[None, :])  # (out, in): scale columns
    return True


def _fold_scale(linears: Sequence["_Linear"], factor: float) -> bool:
    """Multiply matrices this module owns (float32 transposed copies) and their biases by ``factor``, so that
    ``factor * (x W^T + b) = x (factor W)^T + factor b``: Granite's residual multiplier and its logits' divisor
    taken into the copies, for the compiled forward, which has neither. Returns whether it did (not where a
    matrix is the model's own, or not float32: the forward then scales as before)."""
    if not all(linear.owned and linear.weight is None and linear.weight_t.dtype == torch.float32
               for linear in linears):
        return False
    for linear in linears:
        linear.weight_t.mul_(factor)
        if linear.bias is not None:
            linear.bias = linear.bias * factor  # (a new tensor: not the model's)
    return True


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _functional(act):
    """The activation module of an MLP as a plain function where it is one (SiLU: what the Llama family
    uses; GELU's tanh form: Gemma's and StarCoder2's; GELU: GPT-NeoX's; ReLU: OPT's), else the module
    itself. Why: a module call costs several microseconds of Python per layer and forward, about 5% of a
    decode step of a small model."""
    from transformers import activations

    if type(act) in (torch.nn.SiLU, getattr(activations, "SiLUActivation", torch.nn.SiLU)):
        return F.silu
    if type(act) is torch.nn.ReLU:
        return F.relu  # (OPT)
    if type(act) is getattr(activations, "GELUActivation", None) and getattr(act, "act", None) is F.gelu:
        return F.gelu  # (GPT-NeoX: the exact GELU; not its Python form)
    gelu_tanh = getattr(activations, "GELUTanh", None)
    if gelu_tanh is not None and type(act) is gelu_tanh and getattr(act, "act", None) is not None \
            and getattr(act.act, "keywords", None) == {"approximate": "tanh"}:  # (not its Python form)
        return _gelu_tanh
    return act


def _few_query_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float, kv_heads: int,
                         softcap: float | None = None) -> Tensor:
    """``softmax(q k^T * scale + bias) v`` as Hugging Face's eager attention computes it (scores in the
    model's dtype, the softmax in float32): three kernels, for the few queries of a static step.

    Why not SDPA there: over a static step's whole cache (1,024 slots) CUDA's float32 memory-efficient
    kernel took 107 us per layer for one query, 80% of a replayed step of the bundled target (H200,
    scripts/bench_cuda_graphs.py); a batched GEMM, a softmax and a GEMM take a few us each.

    Args: q (B, H, N, D); keys, values (B, kv_heads, S, D); bias (B * kv_heads or 1, groups * N, S),
    from :meth:`LeanCausalLM.attention_bias`. Returns (B, H, N, D). Query head ``h`` reads kv head
    ``h // groups``, as Hugging Face's ``repeat_kv``. ``softcap`` (Gemma 2): the scores capped as
    ``c * tanh(s / c)`` before the bias is added, as :func:`_softcapped_attention` does."""
    batch, heads, n, dim = q.shape
    groups = heads // kv_heads
    q = q.reshape(batch * kv_heads, groups * n, dim)
    keys_t = keys.reshape(batch * kv_heads, -1, dim).transpose(1, 2)
    if softcap is None:
        scores = torch.baddbmm(bias, q, keys_t, alpha=scale)
    else:
        scores = torch.tanh(torch.bmm(q, keys_t) * scale / softcap) * softcap + bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if probs.dtype != q.dtype:
        probs = probs.to(q.dtype)
    return torch.bmm(probs, values.reshape(batch * kv_heads, -1, dim)).view(batch, heads, n, dim)


def _softcapped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, causal: bool, scale: float,
                          cap: float, kv_heads: int) -> Tensor:
    """Gemma 2's eager attention: scores ``q k^T * scale``, soft-capped as ``cap * tanh(s / cap)``, then
    masked, the softmax in float32 (SDPA has no soft cap).

    Args: q (B, H, N, D); keys, values (B, kv_heads, S, D); mask (B or 1, 1, N, S) bool or None, which
    with ``causal`` is a chain from slot 0 (S = N) and else one query seeing every slot. Returns
    (B, H, N, D)."""
    groups = q.shape[1] // kv_heads
    if groups > 1:  # (Hugging Face's repeat_kv: query head h reads kv head h // groups)
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap
    if mask is None and causal:
        mask = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


def _rotate_every_two(x: Tensor) -> Tensor:
    """GPT-J's turn of adjacent pairs: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, adjacent: bool = False) -> Tensor:
    """Hugging Face's rotation of q or k (..., head_dim) by tables of the rotary width (..., rotary_dim):
    a partial rotation (Phi-3's ``partial_rotary_factor``) turns the first ``rotary_dim`` dimensions and
    passes the rest through. Tables of a wider dtype than ``x`` (OLMo 2 / 3's float32 ones) turn it in
    that dtype, and the result is cast back, as those models do. ``adjacent`` (GPT-J): pairs (2i, 2i + 1)
    turn together (``rotate_every_two``), by tables in that layout (each entry repeated in place)."""
    width = cos.shape[-1]
    turn = _rotate_every_two if adjacent else _rotate_half
    if width == x.shape[-1]:
        rotated = x * cos + turn(x) * sin
    else:
        turned = x[..., :width]
        rotated = torch.cat([turned * cos + turn(turned) * sin, x[..., width:]], dim=-1)
    # (OLMo 2 / 3's tables stay float32: half-precision q and k are turned in float32, then cast back)
    return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)


def transposed_weights_pay(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :class:`_Linear` should hold its weight as a contiguous (in, out) copy.

    Why: with MKL on these CPUs, a product of a few rows by an ``nn.Linear`` weight in its own
    (out, in) layout streams the weight at about 9 GB/s; as ``x @ W_t`` over a contiguous (in, out)
    copy it streams at about 15 GB/s. The bundled target's matrix multiplies drop from 3.5 to 2.2 ms
    per decode step; products of 5 to 25 rows gain less (1.05-1.4x, varying from run to run;
    ``scripts/bench_matmul_layout.py``). In bfloat16 the transposed product is 7x slower (no fast
    kernel), and CUDA's GEMMs take either layout, so only float32 / float64 on the CPU transpose.
    """
    return device.type == "cpu" and dtype in (torch.float32, torch.float64)


# Products of at least this many rows are upcast where bf16_products_upcast says so.
_UPCAST_MIN_ROWS = 3


def bf16_products_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :class:`_Linear` should multiply several rows in float32 (upcasting the weight on the
    fly) rather than in the model's half-precision dtype.

    Why: on a CPU where torch runs without AVX-512 kernels (``get_cpu_capability() == "AVX2"``, as on
    these machines), a bfloat16 product of 5 / 9 / 25 rows by the bundled target's matrices takes
    12.5 / 21.6 / 61 ms against 2.8 ms for one row: there is no fast bf16 GEMM. Upcasting the
    activations and the weight (exact: every bf16 value is a float32) and rounding the product back
    takes 6.5 / 8.3 / 11 ms; one or two rows stay faster in bf16 (NOTES). The product is the same
    float32-accumulated sum as a bf16 GEMM's, up to summation order (and the one rounding to bf16),
    so the model is the same one: as for any change of kernel, logits move by about one bf16 ulp.
    """
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "NO AVX")


def bf16_weights_in_float32_reason(model) -> str | None:
    """None when the lean view of ``model`` should compute in float32 over its bfloat16 weights (the
    compiled kernels reading them as bfloat16 panels); else why not (one phrase).

    Why: on these CPUs torch has no fast bfloat16 kernels (a 1-token step of the bundled target costs
    about 3x the float32 one), while the panel kernel streams bfloat16 weights at half float32's bytes
    and widens them to float32 exactly in registers. So a small bfloat16 model on the CPU, where the
    compiled kernels run, is run as the float32 model with the same weight values: activations and the
    logits are float32, more precise than bfloat16's (the KV cache stays bfloat16: ``cache_dtype``), so
    its logits differ from Hugging Face's bf16 forward by about as much as another kernel's rounding
    would. The norms' weights
    folded into the matrices after them are rounded to bfloat16 once, at load, so that both the torch
    path and the panels hold one and the same bfloat16 matrix. ``GBV_HOST_KERNELS=0`` keeps the model in
    bfloat16 throughout, as before.
    """
    # (its float32 lean copies and bfloat16 panels beside the model: 6 bytes a parameter more than a bfloat16
    # lean view, and a float32 copy of the model while they are built)
    return _widened_reason(model, torch.bfloat16, 6)


def _widened_reason(model, dtype: torch.dtype, bytes_per_parameter: int) -> str | None:
    """None when ``model``'s lean view should compute in float32 over its ``dtype`` weights (on the CPU, with the
    compiled kernels, ``bytes_per_parameter`` of copies and panels fitting in memory); else why not."""
    parameters = list(model.parameters())
    if not parameters or parameters[0].dtype != dtype or parameters[0].device.type != "cpu":
        return f"not {str(dtype).removeprefix('torch.')} on the CPU"
    if os.environ.get("GBV_HOST_FORWARD", "1") == "0":
        return "GBV_HOST_FORWARD=0"
    unavailable = host_kernels_unavailable()
    if unavailable is not None:
        return unavailable
    count = sum(p.numel() for p in parameters)
    return panels_unfit_reason(count, bytes_per_parameter * count)


def fp16_weights_in_float32_reason(model) -> str | None:
    """None when the lean view of ``model`` should compute in float32 over its float16 weights, widened exactly
    (float32 copies and panels, float32 KV cache: a float32 model with these weight values); else why not (one
    phrase). Why: torch has no fast float16 kernels on most CPUs, and float16 checkpoints (Pythia, OPT) load as
    float16 by default: a random Pythia-70m / 14m pair decoded ``ar`` at 64 tokens/s in float16 on torch's
    forward, 195 in float32 on the compiled one (docs/ENGINE.md, "Float16 models run in float32"). The panels hold
    float16 where the CPU has F16C (:func:`host_kernels.f16_panels`; 2 bytes a parameter), else float32.
    ``GBV_HOST_KERNELS=0`` keeps the model in float16 throughout."""
    # (float32 copies and the panels beside the model)
    return _widened_reason(model, torch.float16, 6 if f16_panels() else 8)


def _float32_copy(model, matrices: bool = True, embedding: bool = True):
    """A copy of ``model`` with float32 parameters and buffers, each converted once from the model's own (not a
    copy in the model's dtype first, then converted: for a bfloat16 model of 1.2B parameters, 2.5 GB of new
    memory fewer; the tied head stays tied). ``matrices=False``: the weights of its ``nn.Linear`` and ``Conv1D``
    modules (but an embedding tied to one) stay the model's own, for a view whose transposed copies widen them as
    they are made (:func:`_transposed_copy`): no float32 copy of them at all (5 GB for 1.2B parameters).
    ``embedding=False``: the token embedding (and a head tied to it) stays the model's own too, for a view that
    widens its rows as a call reads them (:meth:`LeanCausalLM._panels_only`; 1.2 GB for Gemma-3-1B's)."""
    memo = {}
    if not embedding:
        kept = _embedding_module(text_decoder(model)).weight
        memo[id(kept)] = kept
    if not matrices:
        embeddings = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if (isinstance(module, torch.nn.Linear) or _is_conv1d(module)) and id(weight) not in embeddings:
                memo[id(weight)] = weight
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in memo:
            wide = tensor.detach().to(torch.float32) if tensor.is_floating_point() else tensor.detach().clone()
            memo[id(tensor)] = torch.nn.Parameter(wide, requires_grad=False) \
                if isinstance(tensor, torch.nn.Parameter) else wide
    return copy.deepcopy(model, memo)


def _round_to_bf16_values(weight: Tensor, rows: int = 256) -> None:
    """Round a float32 ``weight`` to bfloat16 values in place (nearest even, as ``.to(torch.bfloat16)``),
    ``rows`` rows at a time: a whole bfloat16 temporary was 2.5 GB of fresh memory for a 1.2B model."""
    _round_in_place(weight, torch.bfloat16, rows)


def _round_in_place(weight: Tensor, dtype: torch.dtype, rows: int = 256) -> None:
    """Round a float32 ``weight`` to values of ``dtype`` (bfloat16 or float16) in place, ``rows`` rows at a time."""
    for row in range(0, weight.shape[0], rows):
        block = weight[row:row + rows]
        block.copy_(block.to(dtype))


# float16's largest finite value, and the least magnitude that rounds to infinity in float16 (nearest even)
_F16_OVERFLOW = 65520.0


def _round_to_f16_values(weight: Tensor) -> bool:
    """Round a float32 ``weight`` to float16 values in place, where every value's magnitude rounds to a finite
    float16 (returns True); else leave it as it is and return False. For a float16 model's folded copies (a norm's
    weight or a scale times a float16 matrix), packed as float16 panels (``LeanCausalLM.f16_panels``): one rounding
    at load, as a bfloat16 model's folded copies are rounded to bfloat16, and of the size of the one Hugging Face's
    float16 forward makes where it multiplies the norm's output in float16."""
    if not _within_f16_range(weight):
        return False
    _round_in_place(weight, torch.float16)
    return True


def _within_f16_range(weight: Tensor) -> bool:
    """Whether every value of a float32 ``weight`` rounds to a finite float16 (one pass, no temporary: an
    ``abs()`` of each copy was 0.6 s of a float16 Pythia-410m / 70m pair's first call)."""
    if not weight.numel():
        return True
    low, high = torch.aminmax(weight)
    return float(high) < _F16_OVERFLOW and float(low) > -_F16_OVERFLOW


def large_copies_fit(model, count: int, bf16_in_float32: bool, fp16_in_float32: bool, panel_bytes: int) -> bool:
    """Whether a model of ``count`` parameters past ``FUSE_MAX_PARAMETERS`` (``model``: float32, or a bfloat16
    one to run in float32 where ``bf16_in_float32``, a float16 one where ``fp16_in_float32``) should get the lean
    view's fused and transposed copies: up to ``FUSE_MEMORY_MAX_PARAMETERS``, on the CPU, unless
    ``GBV_HOST_FORWARD=0``, where they and the compiled products' panels (4 + ``panel_bytes`` bytes a parameter:
    ``LeanCausalLM.panel_bytes``) fit in ``PANEL_MEMORY_SHARE`` of the memory available
    (:func:`panels_unfit_reason`)."""
    first = next(iter(model.parameters()), None)
    held = torch.bfloat16 if bf16_in_float32 else torch.float16 if fp16_in_float32 else torch.float32
    if (first is None or count > FUSE_MEMORY_MAX_PARAMETERS or first.device.type != "cpu" or first.dtype != held
            or os.environ.get("GBV_HOST_FORWARD", "1") == "0"):
        return False
    return panels_unfit_reason(count, count * (4 + panel_bytes)) is None


# Rows of W copied at a time into W^T by _transposed_copy, and outputs of W v widened at a time by
# _widened_product: blocks that stay in the CPU's caches.
_COPY_BLOCK = 64
_WIDEN_BLOCK = 256


def _transposed_dtype(weight: Tensor) -> torch.dtype:
    """The dtype of a transposed copy of ``weight``: float32 for bfloat16 and float16 (see :func:`_transposed_copy`)."""
    return torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype


def _transposed_copy(weight: Tensor, out: Tensor | None = None) -> Tensor:
    """``W^T`` of an (out, in) ``weight`` as a new contiguous (in, out) tensor: a block of ``_COPY_BLOCK`` rows
    at a time on the CPU (the same values as ``weight.t().contiguous()``, which walked W column by column:
    9.5 ms against 2.3 ms for a 4096 x 1024 float32 matrix here, 3.4 s of the 9.5 s a lean view of a
    405M-parameter model took to build). A GPT-2 ``Conv1D``'s (in, out) tensor (``weight`` its transposed
    view) is cloned: ours to change. A bfloat16 ``weight`` is widened to float32, exactly: only a float32 view
    transposes (:func:`transposed_weights_pay`), and a bfloat16 model's view run in float32 leaves its matrices
    in bfloat16 (:func:`_float32_copy`). ``out``: the (in, out) tensor to write it into (a view of
    :class:`_Staging`'s buffer), returned."""
    dtype = _transposed_dtype(weight)
    if out is not None:
        if weight.t().is_contiguous() or weight.numel() < (1 << 20):
            return out.copy_(weight.t())
    elif weight.t().is_contiguous():
        return weight.t().to(dtype, copy=True)
    elif weight.device.type != "cpu" or weight.numel() < (1 << 20):
        return weight.t().contiguous().to(dtype)
    else:
        out = torch.empty(weight.shape[1], weight.shape[0], dtype=dtype, device=weight.device)
    with torch.no_grad():
        for row in range(0, weight.shape[0], _COPY_BLOCK):
            out[:, row:row + _COPY_BLOCK] = weight[row:row + _COPY_BLOCK].t()
    return out


def _fused_transposed_copy(parts: Sequence[Tensor], order: Tensor, out: Tensor | None = None) -> Tensor:
    """``W^T`` as a new contiguous (in, out) tensor, W the (out, in) matrices ``parts`` stacked and then their rows
    put in ``order`` (row i of W is row ``order[i]`` of the stack): the values of
    ``_transposed_copy(torch.cat(parts)[order])`` (bfloat16 widened as there), written from the parts,
    ``_COPY_BLOCK`` columns of ``W^T`` at a time (their rows of W gathered, where not a run of one part).
    ``out``: the tensor to write it into, as :func:`_transposed_copy`'s."""
    total, width = int(order.numel()), parts[0].shape[1]
    starts = np.cumsum([0] + [part.shape[0] for part in parts])
    rows = order.numpy()
    which = np.searchsorted(starts, rows, side="right") - 1  # (the part of each row of W, and its row there)
    local = rows - starts[which]
    if out is None:
        out = torch.empty(width, total, dtype=_transposed_dtype(parts[0]), device=parts[0].device)
    for column in range(0, total, _COPY_BLOCK):
        end = min(column + _COPY_BLOCK, total)
        part, at = which[column:end], local[column:end]
        if part[0] == part[-1] and (part == part[0]).all():
            source = parts[int(part[0])]
            if at[-1] - at[0] == end - column - 1 and (np.diff(at) == 1).all():  # (a run: a plain slice)
                block = source[int(at[0]):int(at[-1]) + 1]
            else:
                block = source.index_select(0, torch.from_numpy(at))
        else:  # (rows of two parts: a block across their boundary)
            block = torch.cat([parts[int(p)][int(a)][None] for p, a in zip(part, at)])
        out[:, column:end] = block.t()
    return out


class _Staging:
    """Scratch memory for the transposed float32 copies of a view that keeps its panels alone
    (:meth:`LeanCausalLM._panels_only`): each copy is a view of one buffer, and the buffer is taken back
    (:meth:`reuse`) once the copies' panels are packed. Why: a view's copies were 4 bytes a parameter of
    fresh memory, and the first touch of fresh memory is the slowest part of a large view's build on these
    machines (a 1.2 GB copy took 1.0 s where the process held little, 4.8-5.3 s past a few GB, against 0.7 s
    into memory touched before: docs/ENGINE.md, "Large views keep their panels alone")."""

    def __init__(self) -> None:
        self.buffer: Tensor | None = None
        self.used = 0

    def take(self, rows: int, columns: int, device) -> Tensor:
        """A (rows, columns) float32 tensor of the buffer, not handed out since the last :meth:`reuse`."""
        count = rows * columns
        if self.buffer is None or self.used + count > self.buffer.numel():
            # (a larger buffer; views of the last one keep it until they go)
            self.buffer = torch.empty(max(count, 0 if self.buffer is None else self.buffer.numel()),
                                      dtype=torch.float32, device=device)
            self.used = 0
        view = self.buffer[self.used:self.used + count].view(rows, columns)
        self.used += count
        return view

    def reuse(self) -> None:
        """Every view handed out so far is done with: the next ones reuse their memory."""
        self.used = 0


class _Linear:
    """``y = x W^T + b`` for one weight ``W`` of shape (out, in); ``x`` is (..., in).

    ``transpose``: hold ``W^T`` as a contiguous (in, out) copy (see :func:`transposed_weights_pay`);
    else the given tensor is used in place (no copy). ``owned``: the given weight is already this
    module's copy (a fused concatenation); with ``transpose`` the copy is always owned. ``upcast``: products of at least
    ``_UPCAST_MIN_ROWS`` rows run in float32 (see :func:`bf16_products_upcast`). ``weight_t``: that copy,
    made already (``weight`` None; :func:`_fused_transposed_copy`). ``staging``: where the transposed copy is
    written (:class:`_Staging`; None: memory of its own).

    ``panel``: the compiled products' packed copy where it was made with the view (None until then, or
    where it is not: the host forward packs it). After :meth:`release`, the view keeps that alone, and
    ``weight_t`` is unpacked from it where something reads it (torch's products).
    """

    def __init__(self, weight: Tensor | None, bias: Tensor | None, transpose: bool, upcast: bool = False,
                 owned: bool = False, weight_t: Tensor | None = None, staging: _Staging | None = None) -> None:
        self.bias = bias
        self.owned = owned or transpose  # (only owned weights may be changed, e.g. by _fold_norm_weight)
        self.out_features, self.in_features = weight.shape if weight_t is None else weight_t.shape[::-1]
        self.weight = None if transpose else weight
        if weight_t is None and transpose:
            out = None if staging is None else staging.take(self.in_features, self.out_features, weight.device)
            weight_t = _transposed_copy(weight, out)
        self.weight_t = weight_t
        self.panel = None
        self.upcast = upcast  # (only in-place weights are ever upcast: no dtype is both)
        # x rounded to bfloat16 first: set where the host forward's AMX products (which do so) hold this
        # weight, so that every path of the model computes the same products (HostForward.rounds_inputs)
        self.round_inputs = False

    def release(self, panel) -> None:
        """Keep ``panel`` (a ``host_kernels.PanelWeight`` of this transposed copy's values) instead of the copy,
        whose memory may then be reused (:class:`_Staging`)."""
        self.panel = panel
        self.__dict__.pop("weight_t", None)  # (a copy unpacked from an earlier panel too: unpacked again if read)

    def __getattr__(self, name: str):
        # (called only where an attribute is missing: ``weight_t`` after release(), unpacked from the panel, the
        # same values, and kept)
        if name == "weight_t" and self.__dict__.get("panel") is not None:
            self.weight_t = torch.from_numpy(self.panel.unpacked())
            return self.weight_t
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, x: Tensor) -> Tensor:
        if self.round_inputs:
            x = x.to(torch.bfloat16).to(x.dtype)
        if self.weight is not None:
            if self.upcast and x.numel() >= _UPCAST_MIN_ROWS * self.in_features:
                bias = None if self.bias is None else self.bias.float()
                return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        # the forward's rows (2D) in one call (``matmul`` adds a dispatch and two views); others as rows
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = torch.mm(rows, self.weight_t) if self.bias is None else torch.addmm(self.bias, rows, self.weight_t)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)`` for 2D ``x`` (rows, in) and ``residual`` (rows, out): one ``addmm``
        where the weight is a transposed copy without bias (a call fewer, about 5 us here)."""
        if self.weight is None and self.bias is None:
            if self.round_inputs:
                x = x.to(torch.bfloat16).to(x.dtype)
            return torch.addmm(residual, x, self.weight_t)
        return residual + self(x)


class _Projections:
    """Several ``nn.Linear`` that read the same input (q/k/v, or gate/up). Fused, their weights are
    concatenated into one matrix (a copy; one larger matrix multiply instead of several small ones),
    after ``reorder_rows`` (a function of the fused (weight, bias)) when given; else each
    Hugging Face tensor is used as it is (transposed copies only with ``transpose``)."""

    def __init__(self, linears, fuse: bool, transpose: bool = False, reorder_rows=None,
                 upcast: bool = False, sizes: Sequence[int] | None = None,
                 head_major: tuple[int, int] | None = None, staging: _Staging | None = None) -> None:
        # ``sizes``: one given ``nn.Linear`` that already holds the parts (Phi-3's qkv_proj, gate_up_proj),
        # split after the product as the separate ones are. ``head_major`` (heads, head_dim): its rows go
        # head by head, each head's parts in turn (GPT-NeoX's query_key_value: q, k, v of head 0, then of
        # head 1, ...); fused, ``reorder_rows`` is given the rows part by part (see _head_major_rows), and
        # in place the output is split as the model splits it.
        self.sizes = list(sizes) if sizes is not None else [lin.weight.shape[0] for lin in linears]
        self.head_major = None if fuse else head_major
        if sizes is not None and not fuse:  # (in place: one product, as the model runs it)
            self.parts = [_Linear(linears[0].weight, linears[0].bias, transpose, upcast, staging=staging)]
        elif fuse:
            bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
            if transpose and linears[0].weight.device.type == "cpu":
                # (W^T of the fused, reordered matrix written straight from the parts: the concatenation and the
                # reordered copies were two to four more copies of the matrix, 4.2 s of a 1.2B model's view)
                rows = torch.arange(sum(lin.weight.shape[0] for lin in linears), dtype=torch.float64)[:, None]
                if reorder_rows is not None:
                    rows, bias = reorder_rows(rows, bias)
                out = None if staging is None else staging.take(
                    linears[0].weight.shape[1], rows.shape[0], linears[0].weight.device)
                weight_t = _fused_transposed_copy([lin.weight for lin in linears], rows[:, 0].long(), out)
                self.parts = [_Linear(None, bias, True, upcast, owned=True, weight_t=weight_t)]
            else:
                weight = torch.cat([lin.weight for lin in linears])  # (a copy, also of a single matrix)
                if reorder_rows is not None:
                    weight, bias = reorder_rows(weight, bias)
                self.parts = [_Linear(weight, bias, transpose, upcast, owned=True)]
        else:
            self.parts = [_Linear(lin.weight, lin.bias, transpose, upcast, staging=staging) for lin in linears]

    def __call__(self, x: Tensor) -> list[Tensor] | tuple[Tensor, ...]:
        if self.head_major is not None:  # (views (..., heads, head_dim) of each part)
            heads, dim = self.head_major
            return self.parts[0](x).unflatten(-1, (heads, len(self.sizes), dim)).unbind(-2)
        if len(self.parts) == 1:
            return torch.split_with_sizes(self.parts[0](x), self.sizes, dim=-1)  # (Tensor.split is Python)
        return [part(x) for part in self.parts]


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D"


def _conv1d_as_linear(conv):
    """A GPT-2 ``Conv1D`` (``x W + b``, W stored (in, out)) as what :class:`_Linear` and :class:`_Projections`
    read from an ``nn.Linear``: ``weight`` (out, in), a view of the module's tensor, and ``bias``."""
    return types.SimpleNamespace(weight=conv.weight.t(), bias=conv.bias)


def _head_major_rows(weight: Tensor, bias: Tensor | None, heads: int, head_dim: int):
    """A (heads * parts * head_dim, in) matrix whose rows go head by head, each head's parts in turn
    (GPT-NeoX's query_key_value), and its bias, with the rows part by part instead: all heads' q, then
    all heads' k, then v, as separate q/k/v projections stack them."""
    parts = weight.shape[0] // (heads * head_dim)
    weight = weight.reshape(heads, parts, head_dim, -1).transpose(0, 1).reshape(weight.shape)
    if bias is not None:
        bias = bias.reshape(heads, parts, head_dim).transpose(0, 1).reshape(-1)
    return weight, bias


def _interleave_rotary_rows(weight: Tensor, head_dim: int, rotary_dim: int | None = None) -> Tensor:
    """Reorder the output rows of a q or k projection, head by head, from Hugging Face's rotary layout
    (dimension ``i`` pairs with ``i + rotary_dim/2``) to interleaved pairs ``(2i, 2i+1)``, so that the
    rotation is one complex multiply. q and k get the same order, so ``q . k`` is unchanged. With a
    partial rotation (``rotary_dim`` < ``head_dim``) the dimensions past it keep their order, after the
    turned pairs (the rotation multiplies them by 1: :meth:`LeanCausalLM.ensure_rotary`)."""
    half = (rotary_dim or head_dim) // 2
    order = torch.cat([torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1),
                       torch.arange(2 * half, head_dim)])
    rows = weight.reshape(-1, head_dim, *weight.shape[1:])
    return rows[:, order.to(weight.device)].reshape(weight.shape)


class _Layer:
    """The weights of one decoder layer; with ``fuse``, 4 matrix multiplies per layer instead of 7,
    and (``interleave``) q/k rows in interleaved rotary order for the complex-multiply rotation."""

    def __init__(self, layer, fuse: bool, interleave: bool = False, head_dim: int = 0,
                 transpose: bool = False, upcast: bool = False, heads: tuple[int, int] = (0, 0),
                 rotary_dim: int | None = None, window: int | None = None, rope_kind: str | None = None,
                 adjacent_pairs: bool = False, staging: _Staging | None = None) -> None:
        attn = _attention_module(layer)
        self.window = window  # the sliding window this layer attends within (None: all of its prefix)
        self.rope_kind = rope_kind  # the rotation's table (Gemma 3: per layer kind; None: the model's one)
        # Gemma 2 / 3 norm each block's output before its residual add ("sandwich" norms): there
        # post_attention_layernorm is the attention output's norm and pre_feedforward_layernorm the MLP's
        # input norm (Llama's post_attention_layernorm); None elsewhere.
        # OLMo 2 / 3 norm only the blocks' outputs (no input_layernorm, no pre_feedforward_layernorm: None).
        self.attn_out_norm = self.mlp_out_norm = None
        if hasattr(layer, "post_feedforward_layernorm"):
            self.attn_out_norm, self.attn_out_eps = _norm_scale_and_eps(layer.post_attention_layernorm)
            self.mlp_out_norm, self.mlp_out_eps = _norm_scale_and_eps(layer.post_feedforward_layernorm)
            input_norm = getattr(layer, "input_layernorm", None)
            post_norm = getattr(layer, "pre_feedforward_layernorm", None)
        elif hasattr(layer, "ln_1"):  # (GPT-2; GPT-J: ln_1 alone, for attention and the MLP, as Phi)
            input_norm, post_norm = layer.ln_1, getattr(layer, "ln_2", layer.ln_1)
        elif hasattr(layer, "self_attn_layer_norm"):  # (OPT: the MLP's is the layer's final_layer_norm)
            input_norm, post_norm = layer.self_attn_layer_norm, layer.final_layer_norm
        elif not hasattr(layer, "post_attention_layernorm"):  # (Phi: one norm, for attention and the MLP)
            input_norm = post_norm = layer.input_layernorm
        else:
            input_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        # GPT-NeoX, GPT-2, OPT, ...: LayerNorms (with biases) rather than RMSNorms; GPT-NeoX where
        # ``use_parallel_residual``, and Phi: attention and the MLP both read the layer's input,
        # h + attn(ln1(h)) + mlp(ln2(h)) (Phi: ln1 = ln2).
        self.layer_norm = _is_layer_norm(input_norm)
        self.shared_norm = input_norm is not None and post_norm is input_norm  # (Phi: the MLP reads attention's x)
        self.parallel = bool(getattr(layer, "use_parallel_residual", False)) or self.shared_norm
        self.input_bias, self.post_bias = _norm_bias(input_norm), _norm_bias(post_norm)
        # (eps None: no norm there, OLMo 2 / 3)
        self.input_norm, self.input_eps = _norm_scale_and_eps(input_norm) if input_norm is not None else (None, None)
        self.post_norm, self.post_eps = _norm_scale_and_eps(post_norm) if post_norm is not None else (None, None)
        # Gemma 2: attention scores soft-capped, c * tanh(s / c), before the mask (None: not capped)
        self.softcap = getattr(attn, "attn_logit_softcapping", None)
        head_major = None
        if hasattr(attn, "qkv_proj"):  # Phi-3: one matrix, q then k then v rows
            q_size, kv_size = heads[0] * head_dim, heads[1] * head_dim
            qkv_linears, qkv_sizes = [attn.qkv_proj], (q_size, kv_size, kv_size)
        elif hasattr(attn, "query_key_value"):  # GPT-NeoX: one matrix, head by head (no grouped kv heads)
            qkv_linears, qkv_sizes = [attn.query_key_value], (heads[0] * head_dim,) * 3
            head_major = (heads[0], head_dim)
        elif hasattr(attn, "c_attn"):  # GPT-2 (a Conv1D), GPT-BigCode: one matrix
            q_size, kv_size = heads[0] * head_dim, heads[1] * head_dim
            qkv_linears, qkv_sizes = [attn.c_attn], (q_size, kv_size, kv_size)
            if _is_conv1d(attn.c_attn):  # (GPT-2: q then k then v columns)
                qkv_linears = [_conv1d_as_linear(attn.c_attn)]
            elif not getattr(attn, "multi_query", False):  # (GPT-BigCode without multi-query: head by head)
                head_major = (heads[0], head_dim)
        else:
            qkv_linears, qkv_sizes = [attn.q_proj, attn.k_proj, attn.v_proj], None
        qk = sum(qkv_sizes[:2]) if qkv_sizes else attn.q_proj.weight.shape[0] + attn.k_proj.weight.shape[0]

        def reorder_qkv(weight: Tensor, bias: Tensor | None):
            # the fused copy is ours to reorder: GPT-NeoX's rows part by part; q and k rows (and biases)
            # interleaved for the rotation, not v
            if head_major is not None:
                weight, bias = _head_major_rows(weight, bias, *head_major)
            if not interleave or adjacent_pairs:  # (GPT-J's q/k rows are in interleaved order already)
                return weight, bias
            weight = torch.cat([_interleave_rotary_rows(weight[:qk], head_dim, rotary_dim), weight[qk:]])
            if bias is not None:
                bias = torch.cat([_interleave_rotary_rows(bias[:qk], head_dim, rotary_dim), bias[qk:]])
            return weight, bias

        self.qkv = _Projections(qkv_linears, fuse, transpose,
                                reorder_qkv if (interleave and not adjacent_pairs) or head_major else None,
                                upcast, qkv_sizes, head_major, staging)
        out_proj = _first_attribute(attn, "o_proj", "dense", "out_proj", "c_proj")
        if _is_conv1d(out_proj):  # (GPT-2)
            out_proj = _conv1d_as_linear(out_proj)
        self.o = _Linear(out_proj.weight, out_proj.bias, transpose, upcast, staging=staging)
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3, Gemma 3: RMSNorm over the head dimension
        self.k_norm = getattr(attn, "k_norm", None)
        # OLMo 2 / 3: q and k normed over all heads at once (their norms' width), before the split into heads
        self.qk_norm_all_heads = self.q_norm is not None and self.q_norm.weight.shape[0] != head_dim
        self.interleaved = interleave
        if interleave and self.q_norm is not None:  # RMS is order-free; its weight follows the rows
            q_scale, self.q_norm_eps = _norm_scale_and_eps(self.q_norm)
            k_scale, self.k_norm_eps = _norm_scale_and_eps(self.k_norm)
            self.q_norm_weight = _interleave_rotary_rows(q_scale, head_dim, rotary_dim)
            self.k_norm_weight = _interleave_rotary_rows(k_scale, head_dim, rotary_dim)
        self.scaling = attn.scaling
        # The MLP: gated, act(gate) * up, or (GPT-NeoX, GPT-2, OPT, GPT-BigCode, StarCoder2, Phi) act(up),
        # where gate_up holds the up projection alone. OPT's MLP matrices sit on the layer itself.
        mlp = getattr(layer, "mlp", layer)
        ungated = next(((up, down) for up, down in (("dense_h_to_4h", "dense_4h_to_h"), ("c_fc", "c_proj"),
                                                    ("fc1", "fc2"), ("fc_in", "fc_out")) if hasattr(mlp, up)), None)
        self.gated = ungated is None
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: one matrix, gate then up rows
            half = mlp.gate_up_proj.weight.shape[0] // 2
            self.gate_up = _Projections([mlp.gate_up_proj], fuse, transpose, upcast=upcast, sizes=(half, half),
                                        staging=staging)
        elif not self.gated:
            up, down = (getattr(mlp, name) for name in ungated)
            if _is_conv1d(up):  # (GPT-2)
                up, down = _conv1d_as_linear(up), _conv1d_as_linear(down)
            self.gate_up = _Projections([up], fuse, transpose, upcast=upcast, staging=staging)
        else:
            self.gate_up = _Projections([mlp.gate_proj, mlp.up_proj], fuse, transpose, upcast=upcast,
                                        staging=staging)
        # Granite: each block's output times this before the residual add (None: 1)
        multiplier = getattr(layer, "residual_multiplier", None)
        self.residual_multiplier = None if multiplier in (None, 1, 1.0) else float(multiplier)
        # The norms' weights go into the matrices after them where those are our copies (float32);
        # the forward then passes weight None.
        if _fold_norm_weight(self.qkv, self.input_norm, self.input_bias):
            self.input_norm = self.input_bias = None
        if _fold_norm_weight(self.gate_up, self.post_norm, self.post_bias):
            self.post_norm = self.post_bias = None
        if self.gated:
            down = mlp.down_proj
        self.down = _Linear(down.weight, down.bias, transpose, upcast, staging=staging)
        # Granite's residual multiplier goes into the o and down copies where they are ours, as the norms' weights
        # do (the forward then adds their outputs as they are)
        if self.residual_multiplier is not None and _fold_scale([self.o, self.down], self.residual_multiplier):
            self.residual_multiplier = None
        self.act = _functional(_first_attribute(mlp, "act_fn", "activation_fn", "act"))

    def matrices(self) -> list[_Linear]:
        """Every matrix multiply of the layer, in the order the forward runs them."""
        return [*self.qkv.parts, self.o, *self.gate_up.parts, self.down]

    def mlp_hidden(self, x: Tensor) -> Tensor:
        """What the MLP's down projection reads: act(gate) * up, or act(up) where it has no gate."""
        if self.gated:
            gate, up = self.gate_up(x)
            return self.act(gate) * up
        return self.act(self.gate_up(x)[0])


class LeanCausalLM:
    """The forward pass of a Hugging Face causal LM of the lean families (``LEAN_ARCHITECTURES``), over a
    :class:`KVCache`.

    ``model`` must pass :func:`lean_unsupported_reason`. The Hugging Face model is kept and stays
    usable as it was. Models up to ``FUSE_MAX_PARAMETERS`` get fused (and, where
    :func:`transposed_weights_pay`, transposed) copies of their matrices, taken when this view is
    built: later in-place changes to the Hugging Face weights are not seen. Larger models use the
    Hugging Face tensors in place, unless the copies fit in memory (:func:`large_copies_fit`).

    ``bf16_draft``: the view will draft with its matrices rounded to bfloat16 values (``round_to_bf16_weights``,
    which ``tree_decoder.draft_lean_model`` calls next). A view keeping its panels alone then rounds each matrix
    and packs it as bfloat16 at once, not as float32 (or float16) panels unpacked again to be rounded: the same
    bits, and for a 70M-parameter draft 1.4 s less of its first call. A float16 model's copies are not rounded to
    float16 first (the bfloat16 values of its folded copies, as a view with its copies gives them).
    """

    # (no_grad: the copies, folds and reorders of the model's parameters would otherwise be recorded by
    # autograd, each op with its graph: the Pythia-410m / 70m pair's views took 12.2 s against 4.2 s, and
    # peak memory was 8.6 GB against 5.5; scripts/bench_first_call.py --profile)
    @torch.no_grad()
    def __init__(self, model, bf16_draft: bool = False) -> None:
        self.bf16_draft = bf16_draft
        # The weights' copies with torch on every core (threads.building_threads: the same values at any
        # count); what follows, the forward choice above all, at the counts in force.
        with building_threads(model):
            self._build(model)
        # The KV cache's dtype: a bfloat16 model run in float32 by the compiled kernels keeps bfloat16
        # keys and values, as its Hugging Face forward does. Why: attention of one query reads every
        # cached key and value once, cold (the weights streamed between two steps push them out of the
        # CPU's caches): 16 KB a slot for the bundled target in float32, 4 MB a step at 250 slots against
        # its 15.7 MB of bf16 weights, and a step cost ~30% more at 256 slots than at 16. The kernels
        # widen bf16 to float32 exactly; the values are rounded once, as written (docs/ENGINE.md,
        # "A bfloat16 KV cache"). Elsewhere the cache has the forward's dtype.
        self.cache_dtype = self.dtype
        if self.bf16_in_float32 and self.host_forward is not None and self.host_forward.attention_off is None:
            self.cache_dtype = torch.bfloat16
        # Forwards of up to MAX_QUERIES queries as CUDA graphs, replayed (gbv.engine.static_steps); None
        # where they do not run (the CPU, GBV_CUDA_GRAPHS=0).
        mode = steps_mode(self.device)
        self.steps = None if mode is None else StaticSteps(self, capture=mode == "graph")
        # Of the CPU's forwards, the fastest here: measured, once per model (choose_cpu_forward); TORCH
        # where there is no host forward. forward_times: the median ms of a one-token step of each form,
        # None where not measured.
        self.forward_choice, self.forward_times = TORCH, None
        if self.host_forward is not None:
            self.forward_choice, self.forward_times = choose_cpu_forward(self, self.host_forward)
            if self.forward_times is not None and (self.forward_choice != HOST or HOST_TEMPORAL in self.forward_times):
                logger.info("gbv: one-token steps measured here: %s; using the %s, the compiled kernels "
                            "prefetching %s (GBV_HOST_FORWARD=1 keeps the host forward's compiled products)",
                            ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.forward_times.items()),
                            self.forward_choice, "temporally" if prefetch_temporal() else "non-temporally")
            if self.forward_choice == HOST_TORCH_PRODUCTS:
                self.host_forward.use_torch_products("torch's products measured faster here")
            elif self.forward_choice == TORCH:
                self.host_forward = None
                self.cache_dtype = self.dtype  # (a bfloat16 cache was the host forward's)

    def _build(self, model) -> None:
        """The view's weights, tables and host forward (its panels) of ``model``: the first part of
        :meth:`__init__`."""
        reason = lean_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no lean forward for this model: {reason}")
        self.model = model
        config = model.config.get_text_config()
        # OLMo 1.7's bound on q, k and v after their projection (None: not clamped): every forward clamps them (the
        # compiled layers' ``clip``).
        clip = getattr(config, "clip_qkv", None)
        self.clip_qkv = None if clip is None else float(clip)
        # The dtype the matrices' values are (bfloat16 ones may be run in float32: see
        # bf16_weights_in_float32_reason); ``self.dtype`` is the one the forward computes in.
        held = _embedding_module(text_decoder(model)).weight
        self.weight_dtype = held.dtype
        self.bf16_in_float32 = bf16_weights_in_float32_reason(model) is None
        self.fp16_in_float32 = fp16_weights_in_float32_reason(model) is None
        # A float16 model's panels hold float16 (half the bytes of float32's, the same sums): host_kernels.f16_panels;
        # not for a draft that will be rounded to bfloat16 values (bf16_draft).
        self.f16_panels = self.fp16_in_float32 and f16_panels() and not self.bf16_draft
        # (bytes of a panel's value: bfloat16 and float16 panels 2, float32 ones 4)
        self.panel_bytes = 2 if self.bf16_in_float32 or self.f16_panels else 4
        widened = self.bf16_in_float32 or self.fp16_in_float32  # (computed in float32 from a float32 copy)
        # Fusing copies the q/k/v and gate/up weights: worth it for small models, whose forward is
        # dominated by per-call overhead; large models keep the Hugging Face tensors (no extra memory)
        # unless the copies fit (large_copies_fit).
        count = sum(p.numel() for p in model.parameters())
        fuse = count <= FUSE_MAX_PARAMETERS or large_copies_fit(model, count, self.bf16_in_float32,
                                                                self.fp16_in_float32, self.panel_bytes)
        # (the dtype the forward computes in)
        dtype, device = torch.float32 if widened else held.dtype, held.device
        # Transposed copies of every matrix (a second copy of the weights, as fusing already makes of
        # most of them): only where they pay, and under the same size limit.
        self.transposed = fuse and transposed_weights_pay(dtype, device)
        # A large view keeps its matrices as the compiled products' panels alone, each packed as soon as it is
        # folded (and rounded), its transposed copy written in memory the next one reuses; a bfloat16 one (a float16
        # one with float16 panels) reads the model's own embedding, whose rows are widened as a call reads them (see
        # _panels_only).
        self.panels_only = self._panels_only(count)
        if widened:  # a float32 copy to take the (exact) weights from; dropped after. (Fused, its matrices are
            # widened as they are transposed.)
            # (a float16 embedding is read as it is wherever the kernels widen float16: a bf16_draft's too)
            own_embedding = self.bf16_in_float32 or (self.fp16_in_float32 and f16_panels())
            model = _float32_copy(model, matrices=not fuse, embedding=not (self.panels_only and own_embedding))
        inner = text_decoder(model)
        embedding = _embedding_module(inner)
        self.embed = embedding.weight
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # The complex-multiply rotation needs a complex dtype: float32 / float64 weights only.
        self.interleaved = fuse and dtype in (torch.float32, torch.float64)
        decoder_layers = _decoder_layers(inner)
        # GPT-2 and OPT rotate nothing: their positions are learned rows added to the token's (OPT's at
        # position + 2). Their layers take NO_ROTATION; None elsewhere.
        self.rotary = getattr(inner, "rotary_emb", None)
        # GPT-J turns adjacent pairs (2i, 2i + 1): its q/k rows are in the interleaved order already, and
        # the cos/sin path takes tables with each entry repeated in place (``rotate_every_two``).
        self.adjacent_pairs = type(self.rotary).__name__ == "GPTJRotaryEmbedding"
        positions = _position_embedding_module(inner) if self.rotary is None else None
        self.position_embed = None if positions is None else positions.weight
        self.position_offset = int(getattr(positions, "offset", 0))
        # Gemma 3 rotates each layer kind by its own base: its rotary module takes the kind, and every
        # kind gets a table. SmolLM3's layers without rotation (``use_rope`` 0) take NO_ROTATION. None:
        # one table for every layer.
        per_kind = self.rotary is not None and "layer_type" in inspect.signature(self.rotary.forward).parameters
        kinds = [NO_ROTATION if self.rotary is None or not getattr(_attention_module(layer), "use_rope", True)
                 else kind
                 for layer, kind in zip(decoder_layers, config.layer_types if per_kind else [None] * len(decoder_layers))]
        self.rope_kinds = kinds if any(kind is not None for kind in kinds) else None
        # How many dimensions of each head the rotation turns (all but Phi-3's and GPT-NeoX's partial
        # rotations): the width of the model's own tables.
        self.rotary_dim = head_dim
        if self.rotary is not None:
            probe_cos, _ = self._rotary_module(torch.empty((), dtype=dtype, device=device),
                                               torch.zeros(1, 1, dtype=torch.long, device=device),
                                               config.layer_types[0] if per_kind else None)
            self.rotary_dim = probe_cos.shape[-1]
        num_heads = config.num_attention_heads
        heads = (num_heads, _kv_heads(config))
        windows = layer_windows(config, len(decoder_layers))
        # bfloat16 products of several rows in float32 where this CPU has no fast kernel for them.
        self.upcast = bf16_products_upcast(dtype, device)
        staging = _Staging() if self.panels_only else None
        # A view keeping its panels alone builds its head first: its copy is the largest, and the layers' then
        # fit in the memory it leaves. (Others after the layers, as their copies have always been laid out.)
        if staging is not None:
            self._build_head(model, inner, config, staging)
        self.layers = []
        for index, layer in enumerate(decoder_layers):
            self.layers.append(_Layer(layer, fuse, self.interleaved, head_dim, self.transposed, self.upcast, heads,
                                      self.rotary_dim, windows[index],
                                      self.rope_kinds[index] if self.rope_kinds else None, self.adjacent_pairs,
                                      staging))
            if staging is not None:
                self._pack_and_release(self.layers[-1].matrices(), staging)
        if staging is None:
            self._build_head(model, inner, config, None)
        del staging
        # The embedding's scale: Gemma's sqrt(hidden) as a tensor in the weights' dtype (as its embedding
        # module multiplies), Granite's ``embedding_multiplier`` as a number; None where it is 1.
        self.embed_scale = None
        embed_scale = getattr(embedding, "embed_scale", None)
        if isinstance(embed_scale, Tensor):
            self.embed_scale = embed_scale.to(self.weight_dtype).to(device=device, dtype=dtype)
        elif getattr(inner, "embedding_multiplier", 1.0) not in (None, 1, 1.0):
            self.embed_scale = float(inner.embedding_multiplier)
        # Gemma 2 soft-caps its logits, c * tanh(logits / c) (None: not capped).
        self.logits_softcap = getattr(config, "final_logit_softcapping", None)
        if self.bf16_in_float32 and not self.panels_only:  # folded weights back to bfloat16 values (one
            for matrix in self.matrices():                    # rounding, at load; _pack_and_release's own)
                held = matrix.weight_t if matrix.weight is None else matrix.weight
                _round_to_bf16_values(held)
        if self.f16_panels and not self.panels_only:  # folded weights back to float16 values, all or none
            held = [matrix.weight_t if matrix.weight is None else matrix.weight for matrix in self.matrices()]
            if all(_within_f16_range(weight) for weight in held):
                for weight in held:
                    _round_in_place(weight, torch.float16)
            else:
                self._f16_panels_off()
        self.num_heads = config.num_attention_heads
        self.kv_heads = _kv_heads(config)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.dtype, self.device = dtype, device  # (a bfloat16 embedding is widened as read: embed_rows)
        self._cos = self._sin = None  # rotary tables, (positions, head_dim), grown on demand
        self._table_rows = 0  # (the positions the tables cover; none where no layer rotates: GPT-2, OPT)
        # (cos, sin, rot) by rotary kind (None: the only one; Gemma 3: per kind); _cos, _sin, _rot are its first.
        # Each growth makes a new dict, so one kept by a recorded graph keeps that graph's tables alive.
        self._kind_tables: dict = {}
        self._rot = None  # the same as complex rotations, (positions, head_dim / 2), when interleaved
        self.rotary_numpy = None  # a numpy view of _rot on the CPU (for the host forward)
        # The sliding window of the layers that have one where it binds (Mistral v0.1 and Phi-3 4k: every
        # layer; Gemma 2 / 3: some; None: none). :meth:`forward` and the static steps (static_forward)
        # then mask, for those layers, the slots before it, and so does the host forward (its windowed
        # layers' mask from :meth:`_within_window`, from the first slot a query may attend).
        self.window = next((layer.window for layer in self.layers if layer.window is not None), None)
        # One sequence on the CPU in float32 runs through numpy between its matrix products (lean_host.py).
        self.host_forward = HostForward(self) if host_forward_unsupported_reason(self) is None else None

    def _build_head(self, model, inner, config, staging: _Staging | None) -> None:
        """The final norm and the head (``model`` the float32 copy where one is made), the norm's weight and
        Granite's logits divisor folded into the head's copy where they can be; packed and released where
        ``staging`` is given (:meth:`_pack_and_release`)."""
        final = _final_norm_module(inner)
        final_norm, self.norm_eps = _norm_scale_and_eps(final)
        self.norm_bias = _norm_bias(final)
        self.layer_norm = _is_layer_norm(final)  # (the final norm's kind: its layers' too)
        self.lm_head = _Linear(model.lm_head.weight, getattr(model.lm_head, "bias", None), self.transposed,
                               self.upcast, staging=staging)
        self.norm = final_norm
        if _fold_norm_weight(self.lm_head, final_norm, self.norm_bias):
            self.norm = self.norm_bias = None
        # Granite divides its logits by ``logits_scaling`` (None: no division).
        divisor = getattr(config, "logits_scaling", None) if type(self.model).__name__ == "GraniteForCausalLM" else None
        self.logits_divisor = None if divisor in (None, 1, 1.0) else float(divisor)
        if self.logits_divisor is not None and _fold_scale([self.lm_head], 1.0 / self.logits_divisor):
            self.logits_divisor = None  # (in the head's copy, as the residual multiplier in o's and down's)
        if staging is not None:
            self._pack_and_release([self.lm_head], staging)

    def _panels_only(self, count: int) -> bool:
        """Whether this view (being built from a model of ``count`` parameters) keeps its matrices as the
        compiled products' panels alone (:meth:`_pack_and_release`): a view of at least
        ``PANELS_ONLY_MIN_PARAMETERS`` computing in float32 on the CPU with fused transposed copies (a float32
        model, or a bfloat16 or float16 one run in float32), where the compiled kernels run and their panels fit,
        unless ``GBV_HOST_FORWARD`` is ``0`` or ``torch-products``. Such a view's forward choice does not time
        torch's forms (:func:`choose_cpu_forward`)."""
        return (self.transposed and count >= PANELS_ONLY_MIN_PARAMETERS
                and os.environ.get("GBV_HOST_FORWARD", "1") not in ("0", "torch-products")
                and host_kernels_unavailable() is None and panels_unfit_reason(count, self.panel_bytes * count) is None)

    def _pack_and_release(self, matrices: Sequence[_Linear], staging: _Staging) -> None:
        """Pack ``matrices`` (their transposed copies, folded) as the host forward would, keep the panels alone
        (``_Linear.release``) and let the next copies reuse the memory. A bfloat16 model's are rounded to
        bfloat16 values first and packed as bfloat16 panels (``PanelWeight(weight_t, bf16=True)``: AMX panels
        where the CPU multiplies on them); a float16 model's as float16 panels (``f16_panels``); others as
        float32 panels."""
        # (a draft to be rounded to bfloat16 values: rounded and packed so at once, see bf16_draft)
        bf16 = self.bf16_in_float32 or self.bf16_draft
        for matrix in matrices:
            if bf16:
                _round_to_bf16_values(matrix.weight_t)
            if self.f16_panels and not _round_to_f16_values(matrix.weight_t):
                self._f16_panels_off()
            matrix.release(PanelWeight(matrix.weight_t, bf16=bf16, f16=self.f16_panels))
        staging.reuse()

    def _f16_panels_off(self) -> None:
        """Pack this float16 model's matrices as float32 panels after all: a folded copy has a value past
        float16's range (a norm's weight of thousands, which a float16 forward could hardly run with). Those
        packed as float16 panels so far are packed again as float32 panels of the same values."""
        self.f16_panels, self.panel_bytes = False, 4
        built = [m for layer in getattr(self, "layers", []) for m in layer.matrices()] + [getattr(self, "lm_head", None)]
        for matrix in built:
            if matrix is not None and matrix.panel is not None:
                matrix.release(PanelWeight(torch.from_numpy(matrix.panel.unpacked())))

    def round_to_bf16_weights(self) -> bool:
        """Round this view's matrices to bfloat16 values and stream them as bfloat16 panels (half the bytes),
        still computing in float32; the embedding and the norms keep their float32 values. For a float32
        draft on the CPU (``draft_lean_model``): a draft step is bound by reading its weights (0.32 ms for
        the bundled draft in float32 against 0.18 ms in bfloat16 on the Xeon of the twenty-eighth
        session), and any draft keeps decoding lossless, since the drafts are drawn from the laws q the
        verifier is given. Returns whether it did: only where the host forward's compiled products run
        over this view's own transposed copies of float32 weights (or their float32 panels, where the view
        keeps those alone: each is unpacked, rounded and packed again; a view built with ``bf16_draft`` packed
        them as bfloat16 already, and they are left as they are)."""
        if not self.can_round_to_bf16_weights():
            return False
        with torch.no_grad(), building_threads(self.model):
            for matrix in self.matrices():
                if self.panels_only and matrix.panel.bf16:  # (rounded and packed so at build: bf16_draft)
                    continue
                if self.panels_only:  # (one matrix's copy at a time, from its panel)
                    weight_t = torch.from_numpy(matrix.panel.unpacked())
                    _round_to_bf16_values(weight_t)
                    matrix.release(PanelWeight(weight_t, bf16=True))
                else:
                    _round_to_bf16_values(matrix.weight_t)  # (the view's own copies)
            return self.host_forward.pack_bf16_panels()

    def can_round_to_bf16_weights(self) -> bool:
        """Whether :meth:`round_to_bf16_weights` applies: float32 weights of this view's own transposed
        copies, multiplied by the host forward's compiled products."""
        host = self.host_forward
        return (host is not None and host.layer_panels is not None and self.dtype == torch.float32
                and not self.bf16_in_float32 and self.transposed)

    def matrices(self) -> list[_Linear]:
        """Every matrix multiply of a forward, in order (for measuring their share of its time)."""
        return [m for layer in self.layers for m in layer.matrices()] + [self.lm_head]

    def new_cache(self, batch: int, capacity: int, owner=None) -> KVCache:
        """A cache of ``batch`` rows and at least ``capacity`` slots. Given an ``owner`` (a decoder) where
        static steps run (CUDA graphs), one from this model's pool, lent to ``owner`` while it lives, so
        that the graphs recorded over it serve the next generation too."""
        if owner is not None and self.steps is not None:
            return self.steps.cache(batch, capacity, owner)
        return self.plain_cache(batch, capacity)

    def plain_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(len(self.layers), batch, self.kv_heads, self.head_dim, capacity, self.cache_dtype,
                       self.device)

    def ensure_rotary(self, upto: int) -> None:
        """Grow the rotary tables to cover positions ``0 .. upto-1`` (computed by the model's own rotary
        module, so every rope scaling type it supports is honoured)."""
        if self._table_rows < upto:
            size = max(upto, 2 * self._table_rows, 256)
            if self.max_positions:
                size = max(upto, min(size, self.max_positions))
            ids = torch.arange(size, device=self.device)[None]
            probe = torch.empty((), dtype=self.dtype, device=self.device)
            # (the layers without rotation have no table: :meth:`rotations` gives them none)
            kinds = [kind for kind in (dict.fromkeys(self.rope_kinds) if self.rope_kinds else [None])
                     if kind != NO_ROTATION]
            # Each pair's entry: at i (and i + rotary_dim / 2) in Hugging Face's usual layout, at 2i (and 2i + 1)
            # in GPT-J's.
            per_pair = slice(None, None, 2) if self.adjacent_pairs else slice(0, self.rotary_dim // 2)
            self._kind_tables = {}
            for kind in kinds:
                cos, sin = self._rotary_module(probe, ids, kind)
                cos, sin, rot = cos[0], sin[0], None
                if self.interleaved:  # e^{i theta} per frequency (HF repeats each frequency twice)
                    rot = torch.complex(cos[:, per_pair], sin[:, per_pair])
                    if self.rotary_dim < self.head_dim:  # (a partial rotation: the other pairs times 1, exactly)
                        ones = torch.ones(rot.shape[0], (self.head_dim - self.rotary_dim) // 2, dtype=rot.dtype,
                                          device=rot.device)
                        rot = torch.cat([rot, ones], dim=1)
                self._kind_tables[kind] = (cos, sin, rot)
            self._table_rows = size
            if kinds:
                self._cos, self._sin, self._rot = self._kind_tables[kinds[0]]
            if self._rot is not None and self._rot.device.type == "cpu":
                self.rotary_numpy = self._rot.numpy()  # (positions, head_dim / 2) complex64

    def _rotary_module(self, probe: Tensor, ids: Tensor, kind: str | None) -> tuple[Tensor, Tensor]:
        """The model's own rotary tables (1, positions, rotary_dim) at ``ids``, of layer kind ``kind`` where
        the module takes one (Gemma 3): in Hugging Face's usual layout (each pair's entry at ``i`` and
        ``i + rotary_dim / 2``), or GPT-J's (at ``2i`` and ``2i + 1``, as its rotation repeats the (sin, cos)
        of one entry per pair its module gives)."""
        if self.adjacent_pairs:
            # (its table holds max_position_embeddings rows; a batch's slots may pass that while every
            # position stays below it, so the rows past it, never read, repeat its last)
            sin, cos = self.rotary(probe, ids.clamp(max=self.rotary.embed_positions.shape[0] - 1))
            return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        return self.rotary(probe, ids) if kind is None else self.rotary(probe, ids, kind)

    def _rotary(self, positions: Tensor, upto: int, kind: str | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin of shape (*positions.shape, head_dim) (interleaved: the complex rotation, None), of the
        layers of rotary kind ``kind`` (None: the first kind's, every layer's but in Gemma 3)."""
        self.ensure_rotary(upto)
        cos, sin, rot = (self._cos, self._sin, self._rot) if kind is None else self._kind_tables[kind]
        if self.interleaved:
            return rot[positions], None
        return cos[positions], sin[positions]

    def rotations(self, positions: Tensor, upto: int) -> tuple[Tensor | None, Tensor | None, dict | None]:
        """What :meth:`_layers` takes for queries at ``positions``: (cos, sin, None) where one table serves
        every layer (:meth:`_rotary`), else (None, None, {kind: (cos, sin)}) for each rotary kind
        (Gemma 3's bases), with (None, None) for the layers without rotation (SmolLM3's NoPE layers, GPT-2's
        and OPT's): they skip it (the same bits as a multiply by the identity, which it was)."""
        if self.rope_kinds is None:
            cos, sin = self._rotary(positions, upto)
            return cos, sin, None
        return None, None, {kind: (None, None) if kind == NO_ROTATION else self._rotary(positions, upto, kind)
                            for kind in set(self.rope_kinds)}

    def _qkv_interleaved(self, layer: _Layer, x: Tensor, rot: Tensor | None, batch: int, n: int):
        """q, k, v as (B, heads, N, D) with the rotation applied to q and k together: one complex
        multiply instead of six ops each (rows in interleaved rotary order, see _interleave_rotary_rows);
        ``rot`` None: a layer without rotation."""
        heads = self.num_heads + 2 * self.kv_heads
        qkv = layer.qkv.parts[0](x).view(batch, n, heads, self.head_dim)  # x: (B * N, hidden)
        if self.clip_qkv is not None:  # (OLMo 1.7; elementwise, so the interleaved order does not matter)
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        qk = qkv[:, :, :self.num_heads + self.kv_heads]
        if layer.q_norm is not None:
            q_part, k_part = qk[:, :, :self.num_heads], qk[:, :, self.num_heads:]
            if layer.qk_norm_all_heads:  # (OLMo 2 / 3: over every head's dimensions at once)
                q_part = _rms_norm(q_part.flatten(2), layer.q_norm_weight, layer.q_norm_eps).view(q_part.shape)
                k_part = _rms_norm(k_part.flatten(2), layer.k_norm_weight, layer.k_norm_eps).view(k_part.shape)
            else:
                q_part = _rms_norm(q_part, layer.q_norm_weight, layer.q_norm_eps)
                k_part = _rms_norm(k_part, layer.k_norm_weight, layer.k_norm_eps)
            qk = torch.cat([q_part, k_part], dim=2)
        rotated = qk if rot is None else torch.view_as_real(torch.view_as_complex(
            qk.reshape(batch, n, -1, self.head_dim // 2, 2)) * rot).flatten(-2)
        q = rotated[:, :, :self.num_heads].transpose(1, 2)
        k = rotated[:, :, self.num_heads:].transpose(1, 2)
        v = qkv[:, :, self.num_heads + self.kv_heads:].transpose(1, 2)
        return q, k, v

    def chain(self, ids: list[int], start: int, cache: KVCache, last_only: bool = True, static: bool = True) -> Tensor:
        """:meth:`forward` of one sequence's chain ``ids`` at slots (= positions) ``start ..``, causal.
        Where the host forward takes it, its ids and positions go as numpy arrays: two torch tensors
        made and read back cost ~60 us a plain step here, from a cold cache. ``static=False``: never
        through static steps (a prompt, met once: recorded, its pieces would cost ~7 ms each on a GPU)."""
        n = len(ids)
        if self.host_forward is not None and self.host_forward.takes(1, n):
            return self.host_forward(np.array([ids], dtype=np.int64), np.arange(start, start + n, dtype=np.int64)[None],
                                     start, cache, None, True, last_only, 0)
        if self.steps is not None and static and last_only and n <= MAX_QUERIES and n & (n - 1):
            # Static steps (CUDA graphs): a chain in pieces of a power of two queries, largest first, so
            # that 7 shapes serve every length up to MAX_QUERIES (the draft's lags after ``auto``'s plain
            # steps), where a shape per length would cost a recording (~7 ms on an H200) for lengths met
            # once or twice. Each piece attends what the pieces before it wrote.
            piece = 1 << (n.bit_length() - 1)
            self.chain(ids[:piece], start, cache)
            return self.chain(ids[piece:], start + piece, cache)
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + n, device=self.device)[None]
        return self.forward(tokens, positions, start, cache, None, causal=True, last_only=last_only, static=static)

    def _sampling_host(self, n: int, config: SamplingConfig, vocab: int) -> HostForward | None:
        """The host forward where ``n`` queries run as one compiled call that samples under ``config``
        (:meth:`HostForward.one_call`, ``host_samples``); None elsewhere."""
        host = self.host_forward
        return host if host is not None and host.one_call(n) and host_samples(config, vocab) else None

    def sampled_chain(self, ids: list[int], start: int, cache: KVCache, vocab: int, config: SamplingConfig,
                      rng: TorchRandom, probs: Tensor | np.ndarray | None = None) -> int | None:
        """:meth:`chain` and one token drawn from its last position's first ``vocab`` logits under
        ``config``, by the law and rule of ``sample(process_logits(...))``, in one compiled call, its
        uniform from ``rng.uniform()`` (a CPU generator's); ``probs`` ((vocab,) or (1, vocab) float32, a
        tensor or a numpy array), when given, receives the probabilities. None where that call does
        not run here (no one-call forward, top-k or top-p): the caller takes :meth:`chain`."""
        host = self._sampling_host(len(ids), config, vocab)
        if host is None:
            return None if probs is not None else self._static_sampled_chain(ids, start, cache, vocab, config, rng)
        return host.sampled(np.array(ids, dtype=np.int64), np.arange(start, start + len(ids), dtype=np.int64), start,
                            cache, None, True, vocab, config.temperature, None if config.greedy else rng.uniform(),
                            probs.numpy() if isinstance(probs, Tensor) else probs)

    def window_binds(self, end: int) -> bool:
        """Whether a sliding window binds on a forward whose last query sits in slot ``end - 1`` (a query there
        could otherwise attend a slot past its layer's window; slots stand for positions)."""
        return self.window is not None and end > self.window

    def sampled_path(self, ids: list[int], start: int, cache: KVCache, vocab: int, config: SamplingConfig,
                     rng: TorchRandom, probs: np.ndarray | None, steps: int,
                     stop: np.ndarray | None = None) -> list[int] | None:
        """``steps`` tokens drawn one after another as one compiled call: the first by :meth:`sampled_chain` of
        ``ids`` at slots ``start ..``, each later one from the forward of the token before it at the next slot
        (a chain of one), each step's law into ``probs`` row s ((steps, vocab) float32 numpy), its uniform the
        s-th of ``steps`` taken from ``rng`` first, in order: the tokens, laws and cache entries of ``steps``
        calls of :meth:`sampled_chain`, bit for bit. Why one call: a draft's step is a few tens of microseconds
        of arithmetic on a small model, and each call's Python and argument checks cost about a fifth of a
        bundled-draft step. ``probs`` None: no laws kept. ``stop`` ((k,) int64 or None): the steps end after the
        first that draws one of these tokens, and fewer tokens come back. None where that call does not run here
        (no one-call forward, top-k or top-p, a sliding window binding on the way), before anything is drawn or
        written."""
        host = self._sampling_host(len(ids), config, vocab)
        if host is None or self.window_binds(start + len(ids) + steps - 1):
            return None
        drawn = np.empty(steps, dtype=np.int64)
        uniforms = None if config.greedy else rng.uniforms(steps)
        ran = host.sampled_steps(np.array(ids, dtype=np.int64), start, cache, steps, vocab, config.temperature,
                                 uniforms, probs, drawn, stop)
        return drawn[:ran].tolist()

    def _static_sampled_chain(self, ids: list[int], start: int, cache: KVCache, vocab: int, config: SamplingConfig,
                              rng: TorchRandom) -> int | None:
        """:meth:`sampled_chain` as one static call (CUDA graphs: forward, law and draw recorded
        together), its uniform where ``draw_token`` takes its own (:func:`fill_token_uniform`); None
        where no static step runs."""
        step = sampled_step(self, cache, len(ids), False, start, vocab, config, draw=True)
        if step is None:
            return None
        return int(step.chain(ids, start, cache, None if config.greedy else rng)[0])

    def sampled_run(self, first: int, start: int, count: int, cache: KVCache, vocab: int, config: SamplingConfig,
                    rng: TorchRandom, stop: np.ndarray | None = None) -> list[int] | None:
        """``count`` (>= 2) plain steps from the pending token ``first`` at slot ``start`` as one call: the
        tokens ``count`` calls of :meth:`sampled_chain` would draw, from the same uniforms (``count`` taken
        from ``rng`` first, in order), read back once. On the host forward (:meth:`sampled_path`'s call, no
        laws kept) the run ends after a token of ``stop`` ((k,) int64, or None: an EOS, after which the
        generation keeps nothing), so it may return fewer; a static call (CUDA graphs,
        :class:`~gbv.engine.static_sampling.PlainLoop`) runs all ``count`` (the caller throws away what
        follows a stop). None where neither runs (the caller steps one at a time)."""
        if self._sampling_host(1, config, vocab) is not None:  # (the host forward: the pending token's path)
            return self.sampled_path([first], start, cache, vocab, config, rng, None, count, stop)
        loop = plain_loop(self, cache, count, start, vocab, config)
        if loop is None:
            return None
        return loop(first, start, None if config.greedy else rng, cache).tolist()

    def sampled_tips(self, tokens: Tensor, position: int, start: int, cache: KVCache, mask: Tensor | None, vocab: int,
                     config: SamplingConfig, uniforms: Tensor | None, probs: Tensor) -> Tensor | None:
        """One drafting depth in one compiled call: the forward of the R path tips ``tokens`` ((R,) long,
        all at rotary ``position``, slots ``start ..``, ``mask`` (1, 1, R, start + R) bool or None for one
        tip), their probabilities into ``probs`` ((R, vocab) float32, rows may be strided) and one token
        drawn from each row as in :meth:`sampled_chain`, from ``uniforms`` ((R, 1) float64 on the host;
        None when greedy). Returns the (R,) tokens; None where that call does not run here (the caller
        takes :meth:`forward`)."""
        rows = tokens.shape[0]
        host = self._sampling_host(rows, config, vocab)
        if host is None:
            return None
        drawn = np.empty(rows, dtype=np.int64)
        host.sampled(tokens.numpy(), np.full(rows, position, dtype=np.int64), start, cache, mask, False, vocab,
                     config.temperature, None if config.greedy else uniforms.reshape(-1).numpy(), probs.numpy(), drawn)
        return torch.from_numpy(drawn)

    def sampled_probs(self, ids: list[int] | Tensor, positions: Tensor | None, start: int, cache: KVCache,
                      mask: Tensor | None, vocab: int, config: SamplingConfig) -> Tensor | None:
        """The target's pass over a block or a tree in one compiled call: the forward of one sequence's
        queries ``ids`` (a list, or a (N,) long tensor) at ``positions`` ((N,) long; None: the chain
        ``start ..``, causal), slots ``start ..`` (``mask`` (1, 1, N, start + N) or None for the chain),
        and ``process_logits`` of each query's first ``vocab`` logits. Returns (N, vocab) float32;
        None where that call does not run here (the caller takes :meth:`forward`)."""
        n = len(ids)
        host = self._sampling_host(n, config, vocab)
        if host is None:  # (CUDA graphs: the forward and the laws as one recorded call)
            step = sampled_step(self, cache, n, mask is not None, start, vocab, config, draw=False)
            if step is None:
                return None
            if mask is None:  # (a chain: its ids come as a list from the decoders; a tensor is read back)
                return step.chain(ids if isinstance(ids, list) else ids.tolist(), start, cache)
            tokens = torch.tensor([ids], device=self.device) if isinstance(ids, list) else ids[None]
            return step(tokens, positions[None], start, mask, cache)
        tokens = np.array(ids, dtype=np.int64) if isinstance(ids, list) else ids.numpy()
        where = np.arange(start, start + n, dtype=np.int64) if positions is None else positions.numpy()
        probs = torch.empty(n, vocab, dtype=torch.float32)
        host.sampled(tokens, where, start, cache, mask, False, vocab, config.temperature, None, probs.numpy())
        return probs

    def sampled_probs_after(self, first: int, rest: Tensor, start: int, cache: KVCache, vocab: int,
                            config: SamplingConfig) -> Tensor | None:
        """:meth:`sampled_probs` of the chain ``[first, *rest]`` from slot ``start``, ``rest`` ((N - 1,)
        long) on the device, where a static sampled step runs it (CUDA graphs) without reading ``rest``
        back first (:meth:`SampledStep.chain_after`); None elsewhere (the caller reads ``rest`` and takes
        :meth:`sampled_probs`)."""
        if self._sampling_host(rest.shape[0] + 1, config, vocab) is not None:
            return None
        step = sampled_step(self, cache, rest.shape[0] + 1, False, start, vocab, config, draw=False)
        return None if step is None else step.chain_after(first, rest, start, cache)

    def forward(self, tokens: Tensor, positions: Tensor, start: int, cache: KVCache, mask: Tensor | None,
                causal: bool = False, last_only: bool = False, first_row: int = 0, static: bool = True) -> Tensor:
        """Run ``tokens`` and write their keys/values into slots ``start .. start+N-1`` of cache rows
        ``first_row .. first_row+B-1`` (views of the cache: nothing is gathered or copied).

        Args:
            tokens: (B, N) long. positions: (B, N) long, the rotary positions.
            start: first slot written (the same for every row).
            mask: (B, 1, N, start+N) bool, True where a query may attend a slot; None means every
                query attends every slot before ``start`` and itself and nothing after (a chain whose
                queries are also causal among themselves when ``causal``; a single query otherwise).
            last_only: return the logits of the last query only.
            static: through a static step where the model has them (CUDA graphs); False: eagerly.
        Returns:
            (B, N, V) logits (N = 1 with ``last_only``), in the model's dtype.
        """
        batch, n = tokens.shape
        # One sequence, or a few rows in all where the compiled kernels run (HostForward.takes).
        if self.host_forward is not None and self.host_forward.takes(batch, n):
            return self.host_forward(tokens.numpy(), positions.numpy(), start, cache, mask, causal, last_only,
                                     first_row)
        if self.steps is not None and static:  # (CUDA: a graph of this call's shape, replayed)
            step = self.steps.get(cache, batch, n, mask is not None, causal, last_only, first_row, start)
            if step is not None:
                return step(tokens, positions, start, mask, cache)
        end = start + n
        if end > cache.capacity:
            cache.grow(end)
        cos, sin, by_kind = self.rotations(positions, end)  # invariant: every position < end (positions <= slots)
        # The hidden states are 2D, (B * N, hidden), between the attention blocks: every product is one
        # mm / addmm call on them (a 3D input costs matmul's dispatch and two views, ~7 us a product).
        hidden = self.embed_rows(tokens.reshape(-1), positions.reshape(-1))
        mask, use_causal = attention_mask(mask, causal, start, n, tokens.device)
        window_mask = None  # (the sliding layers' mask, where their window binds)
        if self.window_binds(end):
            window_mask = self._within_window(mask, use_causal, positions, start, n)
        hidden = self._layers(hidden, batch, n, cos, sin, cache, first_row, start, None, mask, use_causal,
                              window_mask=window_mask, rotations=by_kind)
        return self._head(hidden, batch, n, last_only)

    def _within_window(self, mask: Tensor | None, causal: bool, positions: Tensor, start: int, n: int) -> Tensor:
        """``mask`` (what :func:`attention_mask` gave: None for one query or a causal chain from slot 0)
        as a (B or 1, 1, N, start + N) bool mask that also drops every slot at or before each query's
        position minus the window. Why slots stand for positions here: every committed token sits in the
        slot of its position (the decoders keep them so), and the nodes a pass writes after them are
        within the block's depth of their queries, inside any window longer than a block."""
        if mask is None:
            slots = torch.arange(start + n, device=positions.device)
            mask = (slots[None, :] <= slots[start:, None] if causal
                    else torch.ones(n, start + n, dtype=torch.bool, device=positions.device))[None, None]
        return self.windowed(mask, positions)

    def windowed(self, mask: Tensor, positions: Tensor) -> Tensor:
        """A (B or 1, 1, N, S) bool ``mask`` over slots ``0 .. S-1`` without the slots at or before each
        query's position ((B, N) ``positions``) minus the window (see :meth:`_within_window`)."""
        slots = torch.arange(mask.shape[-1], device=positions.device)
        return mask & (slots > positions[:, None, :, None] - self.window)

    def embed_rows(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """The input rows (N, hidden) of (N,) long ``tokens`` at (N,) long ``positions``: scaled where the
        model scales them, plus the learned rows of their positions where it has them (GPT-2, OPT)."""
        hidden = torch.embedding(self.embed, tokens)  # (F.embedding's checks cost per call)
        if hidden.dtype != self.dtype:  # (the bfloat16 embedding of a view keeping its panels alone: exact)
            hidden = hidden.to(self.dtype)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if self.position_embed is not None:
            rows = positions if not self.position_offset else positions + self.position_offset
            hidden = hidden + torch.embedding(self.position_embed, rows)
        return hidden

    def _layers(self, hidden: Tensor, batch: int, n: int, cos: Tensor, sin: Tensor | None, cache: KVCache,
                first_row: int, start: int, slots: Tensor | None, mask: Tensor | None, use_causal: bool,
                bias: Tensor | None = None, window_mask: Tensor | None = None,
                rotations: dict | None = None, window_bias: Tensor | None = None) -> Tensor:
        """The decoder layers over ``hidden`` (B * N, hidden). ``cos``, ``sin``: the rotary tables at the
        queries' positions (interleaved: the complex rotation and None; both None where ``rotations`` is
        given: :meth:`rotations`). Keys and values go to slots ``start ..`` and attention reads slots
        ``.. start + N`` (``slots`` None); or, given ``slots``
        ((N,) long, on the device), to those slots, attention reading every slot of the cache under
        ``mask`` ((B or 1, 1, N, capacity) bool): the form of :mod:`gbv.engine.static_steps`, whose
        shapes do not depend on ``start``. Given ``bias`` (:meth:`attention_bias` of that mask), attention
        is :func:`_few_query_attention` instead of SDPA. ``window_mask``: the mask of the layers with a
        sliding window, where it binds (:meth:`_within_window`), and ``window_bias`` its bias where
        ``bias`` is given. ``rotations``: (cos, sin) by rotary kind (Gemma 3), each layer taking its
        kind's."""
        end = start + n

        def laid_out(cos, sin):  # interleaved: the complex rotation (B, N, 1, D/2), None; else (B, 1, N, D) each
            if cos is None:  # (no rotation)
                return None, None
            return (cos[:, :, None], None) if self.interleaved else (cos[:, None], sin[:, None])

        tables = {None: laid_out(cos, sin)} if rotations is None else {
            kind: laid_out(*pair) for kind, pair in rotations.items()}
        for index, layer in enumerate(self.layers):
            cos, sin = tables[layer.rope_kind]
            rot = cos  # (interleaved)
            residual = hidden
            x = hidden if layer.input_eps is None else _norm(hidden, layer.input_norm, layer.input_eps,
                                                             layer.input_bias, layer.layer_norm)
            if layer.interleaved:
                q, k, v = self._qkv_interleaved(layer, x, rot, batch, n)
            else:
                q, k, v = layer.qkv(x)
                if self.clip_qkv is not None:  # (OLMo 1.7)
                    q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
                if layer.qk_norm_all_heads:  # (OLMo 2 / 3: before the split into heads)
                    q, k = layer.q_norm(q), layer.k_norm(k)
                q = q.reshape(batch, n, self.num_heads, self.head_dim)
                k = k.reshape(batch, n, self.kv_heads, self.head_dim)
                v = v.reshape(batch, n, self.kv_heads, self.head_dim)
                if layer.q_norm is not None and not layer.qk_norm_all_heads:
                    q, k = layer.q_norm(q), layer.k_norm(k)
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                if cos is not None:  # (None: a layer without rotation)
                    q, k = _rotate(q, cos, sin, self.adjacent_pairs), _rotate(k, cos, sin, self.adjacent_pairs)
            keys, values = cache.keys[index], cache.values[index]
            if first_row or batch != keys.shape[0]:  # (a slice is a call: only when it selects)
                keys = keys[first_row:first_row + batch]
                values = values[first_row:first_row + batch]
            if slots is None:
                keys[:, :, start:end] = k  # (rounded to the cache's dtype, if it is another)
                values[:, :, start:end] = v
                keys, values = keys[:, :, :end], values[:, :, :end]
            else:
                keys.index_copy_(2, slots, k.to(keys.dtype))
                values.index_copy_(2, slots, v.to(values.dtype))
            if keys.dtype != q.dtype:  # a bfloat16 cache of a model run in float32 (cache_dtype)
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            layer_mask, layer_causal = mask, use_causal
            if window_mask is not None and layer.window is not None:
                layer_mask, layer_causal = window_mask, False
            if bias is not None:
                layer_bias = window_bias if window_bias is not None and layer.window is not None else bias
                attn = _few_query_attention(q, keys, values, layer_bias, layer.scaling, self.kv_heads, layer.softcap)
            elif layer.softcap is not None:
                attn = _softcapped_attention(q, keys, values, layer_mask, layer_causal, layer.scaling, layer.softcap,
                                             self.kv_heads)
            else:
                attn = F.scaled_dot_product_attention(
                    q, keys, values, attn_mask=layer_mask, is_causal=layer_causal,
                    scale=layer.scaling, enable_gqa=self.kv_heads != self.num_heads)
            attn = attn.transpose(1, 2).reshape(batch * n, -1)
            if layer.parallel:  # (GPT-NeoX: the MLP reads the layer's input; HF's sum order, mlp + attn + h)
                attn = layer.o(attn)
                if not layer.shared_norm:  # (Phi: the same norm of the same input, already in x)
                    x = _norm(residual, layer.post_norm, layer.post_eps, layer.post_bias, layer.layer_norm)
                hidden = layer.down(layer.mlp_hidden(x)) + attn + residual
                continue
            if layer.attn_out_norm is not None:  # (Gemma 2 / 3: the block's output normed, then added)
                hidden = residual + _rms_norm(layer.o(attn), layer.attn_out_norm, layer.attn_out_eps)
            elif layer.residual_multiplier is None:
                hidden = layer.o.add_to(residual, attn)
            else:  # (Granite: the product, times the multiplier, then the add, as its modules do)
                hidden = residual + layer.o(attn) * layer.residual_multiplier
            x = hidden if layer.post_eps is None else _norm(hidden, layer.post_norm, layer.post_eps, layer.post_bias,
                                                            layer.layer_norm)
            mlp_hidden = layer.mlp_hidden(x)
            if layer.mlp_out_norm is not None:
                hidden = hidden + _rms_norm(layer.down(mlp_hidden), layer.mlp_out_norm, layer.mlp_out_eps)
            elif layer.residual_multiplier is None:
                hidden = layer.down.add_to(hidden, mlp_hidden)
            else:
                hidden = hidden + layer.down(mlp_hidden) * layer.residual_multiplier
        return hidden

    def attention_bias(self, mask: Tensor, batch: int) -> Tensor:
        """The additive form of a (B or 1, 1, N, S) bool attention mask of ``batch`` = B rows (True -> 0,
        False -> -inf, in the forward's dtype) laid out for :func:`_few_query_attention`:
        (B * kv_heads or 1, groups * N, S)."""
        bias = mask.to(self.dtype).log_()
        rows, _, n, width = bias.shape
        groups = self.num_heads // self.kv_heads
        if rows == 1 and groups == 1:
            return bias.view(1, n, width)  # (broadcast over the rows and kv heads)
        return bias[:, :, None].expand(batch, self.kv_heads, groups, n, width).reshape(-1, groups * n, width)

    def _head(self, hidden: Tensor, batch: int, n: int, last_only: bool) -> Tensor:
        """The final norm and the LM head: (B, N, V) logits (N = 1 with ``last_only``)."""
        if last_only:
            hidden = hidden.view(batch, n, -1)[:, -1] if n > 1 else hidden
        hidden = _norm(hidden, self.norm, self.norm_eps, self.norm_bias, self.layer_norm)
        logits = self.lm_head(hidden).view(batch, 1 if last_only else n, -1)
        if self.logits_softcap is not None:  # (Gemma 2)
            return torch.tanh(logits / self.logits_softcap) * self.logits_softcap
        return logits if self.logits_divisor is None else logits / self.logits_divisor
