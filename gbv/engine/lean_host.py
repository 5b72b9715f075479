"""The lean forward with numpy doing the small work between the matrix products (CPU, float32).

Why: a lean decode step is made of small tensor calls, and on this CPU a torch call costs 3-4 us
however little it computes (docs/ENGINE.md, "What bounds the CPU engine"), while a numpy call on the
same few hundred floats costs about 1 us and a reshape 0.5 us. The bundled draft's 1-token forward
was about 45 torch calls around 5 matrix products, the target's about 300 around 33. Here each layer
makes 5 torch calls (the 4 matrix products and the attention) on buffers that numpy and torch share,
and everything between them (the norms, the rotation, the cache writes, SiLU) is numpy on those
buffers, in place.

The mathematics is :meth:`LeanCausalLM.forward`'s, on the same (fused, transposed, norm-folded)
weight copies and the same cache tensors, so a step taken here and a pass taken there see the same
keys and values; only rounding differs (one row's RMS scale is computed in float64 and rounded once).
``tests/engine/test_lean_host.py`` compares the two forwards; every engine test (the chi-square law
tests, greedy equality with Hugging Face) runs through this one.

Where the compiled kernels run (``host_kernels.py``: x86-64 with AVX2; on any number of threads), the products
and the attention go to them instead of torch, and for one sequence the whole forward is a single
compiled call (``forward_into``: every layer as ``layer_into`` computes it, the final norm and the
head), which can also sample from its output rows (:meth:`HostForward.sampled`): the same
mathematics, summed in another order. The compiled layers also compute GPT-NeoX's, GPT-2's, OPT's,
GPT-BigCode's, Phi's and GPT-J's (LayerNorms, biases, MLPs without a gate, parallel blocks, learned
positions: ``host_kernels.layer_style``); those models run here only as compiled calls, since the numpy
forward below computes the Llama family's layers (:func:`_llama_layers`, :meth:`HostForward.takes`).

:meth:`LeanCausalLM.forward` uses it for one sequence (any cache row): of any length where the
compiled kernels run, else of up to ``HOST_MAX_QUERIES`` queries, on the CPU in float32, where the
model has fused interleaved transposed copies (:func:`host_forward_unsupported_reason`); and for
several sequences where the compiled kernels run, each of at most ``KERNEL_MAX_ROWS`` queries
(:meth:`HostForward.takes`; without the kernels, batches of 8 measured 0.96-0.99x the torch forward,
``scripts/bench_host_forward_ab.py --batch 8``). Batches without the kernels, long prompts without
them and CUDA take the torch path: on a GPU no tensor ever leaves the device for this. A small bfloat16 model
on the CPU runs here too, in float32 over its bf16 weight values (``LeanCausalLM.bf16_in_float32``;
the panels then hold bfloat16, half the bytes); where the kernels do not run, bfloat16 takes the
torch path.
"""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gbv.engine import host_kernels
from gbv.engine.sampling import SamplingConfig, draw_token
from gbv.verify.common import TorchRandom
from gbv.engine.host_kernels import (LLAMA_STYLE, MLP_GELU, MLP_GELU_TANH, MLP_GELU_TANH_GATED, MLP_RELU,
                                     MLP_SILU_GATED, PANELS_AMX,
                                     PARALLEL, PARALLEL_SHARED_NORM, SEQUENTIAL, PanelWeight, attention_into,
                                     forward_into, host_kernels_unavailable, kv_bf16, layer_into, layer_style,
                                     prefetch_temporal, rms_into, set_prefetch_temporal, sync_product_threads)


def host_forward_unsupported_reason(lean) -> str | None:
    """None when :class:`HostForward` can run ``lean`` (a ``LeanCausalLM``); else why not.
    ``GBV_HOST_FORWARD=0`` in the environment turns it off (for before/after measurements); whether it
    runs where it can, and with which products, is measured (:func:`choose_cpu_forward`) unless
    ``GBV_HOST_FORWARD=1``."""
    if os.environ.get("GBV_HOST_FORWARD", "1") == "0":
        return "GBV_HOST_FORWARD=0"
    if lean.device.type != "cpu" or lean.dtype != torch.float32:
        return "not float32 on the CPU"
    if not (lean.transposed and lean.interleaved):
        return "no fused transposed copies"
    for layer in lean.layers:
        if layer.q_norm is not None and layer.q_norm_eps != layer.k_norm_eps:
            return "q/k norms of two eps"
        if layer.input_norm is not None or layer.post_norm is not None:
            return "norm weights not folded"
        parts = layer.qkv.parts
        if len(parts) != 1 or len(layer.gate_up.parts) != 1:
            return "unfused projections"
        if _layer_mlp(layer) is None:
            return "an activation the compiled layers lack"
        if layer.residual_multiplier is not None:
            return "residual multipliers not folded (Granite)"
        if (layer.attn_out_norm is None) != (layer.mlp_out_norm is None) or (
                layer.attn_out_norm is not None and layer.parallel):
            return "a norm after one block only, or after parallel blocks"
    if lean.norm is not None or lean.lm_head.weight is not None:  # (weight: the model's own, not a transposed copy)
        return "final norm not folded"
    if lean.logits_divisor is not None:
        return "logits divided (Granite's, not folded)"
    if not _llama_layers(lean):
        # (the numpy forward between torch's products computes the Llama family's layers only)
        unavailable = host_kernels_unavailable()
        if unavailable is not None:
            return (f"LayerNorms, biases, learned positions, MLPs without a gate or q/k norms need the compiled "
                    f"kernels ({unavailable})")
        if lean.head_dim % 8:
            return "head_dim not a multiple of 8 (the compiled attention's)"
        unfit = _panels_unfit(lean)
        if unfit is not None:
            return (f"LayerNorms, biases, learned positions, MLPs without a gate or q/k norms need the compiled "
                    f"products ({unfit})")
    return None


def _panels_unfit(lean) -> str | None:
    """:func:`panels_unfit_reason` for ``lean``'s matrices: their panels hold float32, or bfloat16 (float16)
    where the model is a bfloat16 (float16) one run in float32 (``lean.panel_bytes``)."""
    count = sum(m.in_features * m.out_features for m in lean.matrices())
    return panels_unfit_reason(count, count * lean.panel_bytes)


def _layer_mlp(layer) -> int | None:
    """The compiled layers' MLP for a lean ``layer`` (host_kernels.MLP_*), None where they lack its activation."""
    from gbv.engine.lean import _gelu_tanh  # (lean.py imports this module)

    act = layer.act
    # GELU's tanh form: as a function (Gemma, GPT-BigCode, StarCoder2), or GPT-2's, Phi's and GPT-J's gelu_new
    # module
    gelu_tanh = act is _gelu_tanh or type(act).__name__ == "NewGELUActivation"
    if layer.gated:
        return MLP_SILU_GATED if act is F.silu else MLP_GELU_TANH_GATED if gelu_tanh else None
    if act is F.gelu:
        return MLP_GELU
    if act is F.relu:
        return MLP_RELU
    return MLP_GELU_TANH if gelu_tanh else None


def _layer_style(layer) -> int:
    """A lean ``layer``'s style as the compiled layers take it (host_kernels.layer_style)."""
    parallel = (PARALLEL_SHARED_NORM if layer.shared_norm else PARALLEL) if layer.parallel else SEQUENTIAL
    return layer_style(layer.layer_norm, parallel, _layer_mlp(layer))


def _llama_layers(lean) -> bool:
    """Whether every part of ``lean``'s forward is the Llama family's (RMSNorms before each block, sequential
    blocks, SiLU(gate) * up, no biases but q/k/v's, rotary positions of one table, no head bias, no window):
    what the numpy forward between torch's products computes. The compiled layers compute the rest too
    (GPT-NeoX, GPT-2, OPT, GPT-BigCode, Phi, GPT-J, Gemma, Gemma 3, OLMo 2 / 3, StarCoder2, windows)."""
    return (lean.position_embed is None and not lean.layer_norm and lean.lm_head.bias is None
            and lean.rope_kinds is None and lean.window is None and all(layer.q_norm is None for layer in lean.layers)
            and all(_layer_style(layer) == LLAMA_STYLE and layer.o.bias is None and layer.down.bias is None
                    and layer.gate_up.parts[0].bias is None and layer.attn_out_norm is None
                    and layer.input_eps is not None and layer.post_eps is not None for layer in lean.layers))


# Choosing between the CPU forwards: rounds in rotating order, each form taking a run of this many
# steps of which the last is timed. Why runs: decoding takes one model's steps back to back, so its
# weights are where the last step left them; single steps alternating between four forms timed each
# one after the other three had pushed its weights out (the temporal prefetch's step of the bundled
# target measured 2.57 ms that way, 1.23 ms in decoding).
_CHOICE_ROUNDS = 5
_CHOICE_RUN = 3
# Where every form's step took more than this (a model of tens of millions of parameters or more) in the
# first round, one more round decides: the forms differ by far more than the noise there (a 405M step 45 ms
# on the compiled forward against 90 ms on torch's; Pythia-70m's and SmolLM2-135M's shapes 5.5 and 10 ms
# against 13 and 38-43 ms), and five rounds cost seconds at load (the SmolLM2-360M / 135M pair's two choices
# took 2.64 s against 1.21 s now: scripts/bench_first_call.py --profile).
_SLOW_STEP_S = 0.005
_SLOW_ROUNDS = 2
# There, a form whose first-round step took this many times the fastest one's is not run again: the second
# round would not rank it first (torch's forms of those models took 1.5-4x the compiled one's step).
_CLEAR_LOSS = 1.25
# Another forward replaces the host forward with its compiled products only when its step takes less
# than this fraction of that one's. Why: a one-token step is not all of decoding (a draft depth of K
# tips, a tree pass), and where two are within a few percent the choice flipped between runs; with the
# bundled pair in bfloat16 (host 0.54 ms, torch 0.52 ms for the draft) rows moved by 0.92-1.25x.
_MARGIN = 0.95
# The forwards a lean view can run on the CPU, HOST the default; HOST_TEMPORAL is HOST with the panel
# kernel prefetching its weights into every cache level (a process-wide setting: host_kernels).
HOST, HOST_TORCH_PRODUCTS, TORCH = "host forward", "host forward, torch's products", "torch forward"
HOST_TEMPORAL = "host forward, temporal prefetch"


def choose_cpu_forward(lean, host: "HostForward") -> tuple[str, dict[str, float] | None]:
    """Which forward runs ``lean`` fastest on this machine at the current thread count: ``HOST`` (the
    host forward with its compiled products and attention), ``HOST_TORCH_PRODUCTS`` (the same with
    torch's matrix products) or ``TORCH`` (torch's forward), and the median ms of a one-token step of
    each (None where not measured). A step is taken as the decoders take it (forward, softmax, draw;
    the host forward's one compiled call where it has one), in runs of ``_CHOICE_RUN`` steps per form
    and round after a 32-token prefix on scratch caches; ``HOST`` is kept unless another is faster by
    ``_MARGIN``. Not measured where the host forward has no compiled products (``panels_off``: no
    kernels built, or a model above ``PANEL_MAX_PARAMETERS``): its products are torch's there already.
    ``GBV_HOST_FORWARD=1`` takes ``HOST`` without measuring, ``GBV_HOST_FORWARD=torch-products``
    ``HOST_TORCH_PRODUCTS`` (and ``=0`` makes no host forward: ``TORCH``).

    The first lean view measured in a process whose products are not all AMX ones
    (``HostForward.rounds_inputs``: the hint does not touch them) also chooses the panel kernel's
    prefetch hint for the process (``HOST_TEMPORAL`` timed beside ``HOST``; the temporal hint where it
    is faster by ``_MARGIN``), and ``HOST`` then runs with it.

    Why measure: the compiled kernels were tuned on AMD Zen 3 machines, where they took a step of the
    bundled target in 1.16x its products' time against torch's 1.9x, prefetching their weights
    non-temporally. On an Intel Xeon with AVX-512, AMX and a large L3 that hint kept the weights out of
    the L3 (a float32 step 3.74 ms against 1.21 ms prefetching into every level), and with it torch's
    products (1.5 ms in the host forward) and even torch's forward (2.0 ms) beat the compiled ones
    (docs/ENGINE.md, "Which forward runs on the CPU, and how its kernels prefetch"). Which wins depends
    on the CPU, so it is measured, once per model, in 15 steps of each form (0.04-0.23 s for the bundled
    pair; 6 where every form's first timed step took over ``_SLOW_STEP_S``: a model of tens of millions
    of parameters or more, the second round without the forms that lost the first by ``_CLEAR_LOSS``, and none
    where one form is left)."""
    forced = os.environ.get("GBV_HOST_FORWARD")
    if forced == "1":
        return HOST, None
    if forced == "torch-products":  # (the numpy forward between them computes the Llama family's layers only)
        return (HOST_TORCH_PRODUCTS if host.llama else TORCH), None
    if not host.llama and not host.one_call(1):  # (these layers run as compiled calls only: none here)
        return TORCH, None
    if host.panels_off is not None:  # (its products are torch's already: the AVX2 kernels are not in question,
        return HOST, None            # and a model above PANEL_MAX_PARAMETERS would take seconds to time)
    # A view that keeps its panels alone (lean.PANELS_ONLY_MIN_PARAMETERS) has no copies for torch's forms: the
    # host forward's prefetch hint is all there may be to choose.
    panels_only = getattr(lean, "panels_only", False)
    if panels_only and (prefetch_temporal() is not None or host.rounds_inputs):
        return HOST, None
    prefix = 32
    ids = np.arange(prefix, dtype=np.int64)[None] % lean.embed.shape[0]
    where = np.arange(prefix, dtype=np.int64)[None]
    # (the torch forward's cache in its own dtype: a bfloat16 cache is the host forward's, cache_dtype)
    saved_dtype = lean.cache_dtype
    host_cache = lean.plain_cache(1, prefix + 1)
    lean.cache_dtype = lean.dtype
    torch_cache = lean.plain_cache(1, prefix + 1)
    lean.cache_dtype = saved_dtype
    one = torch.tensor([[int(ids[0, -1])]])
    at = torch.tensor([[prefix]])
    vocab = lean.embed.shape[0]
    config, rng = SamplingConfig(1.0), TorchRandom(torch.Generator().manual_seed(0))
    saved, lean.host_forward = lean.host_forward, None

    def host_step(products_off, temporal=None):
        host.panels_off = products_off
        if temporal is not None:
            set_prefetch_temporal(temporal, chosen=False)
        if host.one_call(1):
            host.sampled(one.numpy()[0], at.numpy()[0], prefix, host_cache, None, True, vocab, 1.0, rng.uniform())
        else:
            draw_token(host(one.numpy(), at.numpy(), prefix, host_cache, None, False, True, 0)[0, -1, :vocab], config,
                       rng)

    steps = {HOST: lambda: host_step(None), TORCH: lambda: draw_token(
                 lean.forward(one, at, prefix, torch_cache, None, last_only=True)[0, -1, :vocab], config, rng),
             HOST_TORCH_PRODUCTS: lambda: host_step("torch's products measured faster here")}
    if not host.llama or panels_only:  # (the numpy forward between torch's products computes the Llama family's
        del steps[HOST_TORCH_PRODUCTS]   # layers only)
    if panels_only:
        del steps[TORCH]
    hint = prefetch_temporal()
    # (the kernel's prefetch hint, not chosen yet in this process: both, once; not by a model whose
    # products are all AMX ones, which the hint does not touch: a later float32 model chooses it)
    choose_hint = hint is None and not host.rounds_inputs
    if choose_hint:
        steps[HOST] = lambda: host_step(None, False)
        steps[HOST_TEMPORAL] = lambda: host_step(None, True)
    try:
        with torch.inference_mode():
            host(ids, where, 0, host_cache, None, True, True, 0)
            if TORCH in steps:
                lean.forward(torch.from_numpy(ids), torch.from_numpy(where), 0, torch_cache, None, causal=True,
                             last_only=True)
            times: dict = {name: [] for name in steps}
            names = list(steps)
            rounds = _CHOICE_ROUNDS
            for repeat in range(_CHOICE_ROUNDS):
                if repeat == rounds:
                    break
                for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                    for step in range(_CHOICE_RUN):  # (a run of steps, as decoding takes them: the last timed)
                        began = time.perf_counter()
                        steps[name]()
                    times[name].append(time.perf_counter() - began)
                fastest = min(values[0] for values in times.values())
                if repeat == 0 and fastest > _SLOW_STEP_S:
                    names = [name for name in names if times[name][0] <= _CLEAR_LOSS * fastest]
                    # (one form left: a second round of it alone decides nothing; a Gemma-3-1B target's
                    # run of steps is 0.2-0.4 s)
                    rounds = _SLOW_ROUNDS if len(names) > 1 else 1
    finally:
        lean.host_forward, host.panels_off = saved, None  # (its compiled products: measured only with them)
        if hint is not None:
            set_prefetch_temporal(hint)
    medians = {name: 1e3 * float(np.median(values)) for name, values in times.items()}
    host_ms = medians[HOST]
    if choose_hint:  # the hint, chosen for the process: the temporal one where it is faster by _MARGIN
        temporal = medians[HOST_TEMPORAL] < _MARGIN * medians[HOST]
        set_prefetch_temporal(temporal)
        host_ms = medians[HOST_TEMPORAL] if temporal else medians[HOST]
    others = {name: ms for name, ms in medians.items() if name in (HOST_TORCH_PRODUCTS, TORCH)}
    if not others:
        return HOST, medians
    best = min(others, key=others.get)
    return (best if others[best] < _MARGIN * host_ms else HOST), medians


def attention_mask(mask: Tensor | None, causal: bool, start: int, n: int, device) -> tuple[Tensor | None, bool]:
    """What SDPA gets for ``n`` queries written from slot ``start`` (both forwards):
    ``(mask, is_causal)``. A given mask as it is. None for one query: it attends every slot up to its
    own, which is all of them (a mask of all True costs its construction and SDPA's float conversion
    in every layer). A causal chain from slot 0: SDPA's own causal flag. A causal chain after a
    prefix: the mask "slot <= own slot"."""
    if mask is not None or n == 1:
        return mask, False
    if not causal:
        raise ValueError("several queries need a mask or causal=True")
    if start == 0:
        return None, True
    slots = torch.arange(start + n, device=device)
    return (slots[None, :] <= slots[start:, None])[None, None], False


# Calls with more queries than this take the torch path where the compiled kernels do not run: a
# long prompt's chain, where the matrix products dominate anyway; the buffers stay small.
HOST_MAX_QUERIES = 64
# Calls of up to this many query rows in all use the compiled kernels (host_kernels.py), for several
# sequences or one; one sequence of more rows (a long prompt) does too, in one compiled call
# (:meth:`HostForward.one_call`) on buffers it does not keep. Whole bundled-target passes over a
# 150-slot prefix, kernels against torch's products and SDPA, measured (eighteenth session,
# ``scripts/bench_host_kernels.py`` table 4, float32): 1.8x at 1 row, 3.6x at 5, 1.9x at 17, 1.7x at
# 25-33, 1.3x at 64; a causal prompt chain of 96-400 tokens 1.1-1.3x. (The limit was 24 rows while
# the products of 25 rows ran at half the core's rate, before the seventeenth session's tiles.)
KERNEL_MAX_ROWS = 64
# Several sequences (a batch) take the compiled kernels whatever their rows in all (None), each
# sequence of up to KERNEL_MAX_ROWS queries. Why no cap: a batch's layers are one compiled call each
# (BATCH_LAYERS), and past 64 rows the torch path cost 1.5-1.8x their time in bfloat16 (AMX products
# against oneDNN's and SDPA) and about the same in float32: ``scripts/bench_batch.py --batch-max-rows
# on,off``, whose "off" is the cap of 64 rows in all that stood before the thirty-third session
# (16 rows of BV L = 4 are 80; of GBV K = 3, L = 8 up to 400).
BATCH_MAX_ROWS: int | None = None
# Several sequences' layers as one compiled call each (host_kernels.layer_into with a batch), where
# both kernels run; False: a call per product and per sequence's attention, numpy between them (the
# form before the thirty-second session, for before/after measurements: scripts/bench_batch.py).
BATCH_LAYERS = True
# Panel copies are a further copy of the weights (and a bfloat16 model's host forward a float32 copy of
# it: lean.bf16_weights_in_float32_reason). Models up to this many parameters get them; larger ones where
# the copies fit in PANEL_MEMORY_SHARE of the memory available at load (panels_unfit_reason). Why larger
# ones at all: on several threads the compiled products split their columns (host_kernels.sync_product_threads),
# and a 360M-parameter bfloat16 step took 48 ms on one thread against torch's 100 ms (57 ms on two).
PANEL_MAX_PARAMETERS = 100_000_000
PANEL_MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes of memory available to this process now (Linux's ``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def panels_unfit_reason(parameters: int, extra_bytes: int) -> str | None:
    """None where a model of ``parameters`` parameters may take the compiled products' copies, which need
    ``extra_bytes`` more memory; else why not: above ``PANEL_MAX_PARAMETERS`` only where the copies fit
    in ``PANEL_MEMORY_SHARE`` of the memory available now (never where that is unknown)."""
    if parameters <= PANEL_MAX_PARAMETERS:
        return None
    available = available_memory()
    if available is None:
        return f"more than {PANEL_MAX_PARAMETERS:,} parameters, and the memory available is unknown"
    if extra_bytes > PANEL_MEMORY_SHARE * available:
        return (f"more than {PANEL_MAX_PARAMETERS:,} parameters, and the packed copies ({extra_bytes / 2**30:.1f} GiB) "
                f"do not fit in {PANEL_MEMORY_SHARE:.0%} of the memory available ({available / 2**30:.1f} GiB)")
    return None


# Buffer sets kept per model, one per (sequences, queries) shape seen; past this many they are dropped.
_MAX_SHAPES = 128


class _Rows:
    """The float32 work buffers for ``batch`` sequences of ``n`` queries (``batch * n`` rows), each seen
    as a numpy array and as a torch tensor (shared memory): written in place by numpy and by
    ``torch.mm(..., out=)`` alike."""

    def __init__(self, batch: int, n: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, up_width: int | None = None) -> None:
        rows = batch * n

        def pair(width: int) -> tuple[np.ndarray, Tensor]:
            array = np.zeros((rows, width), dtype=np.float32)
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                return array, torch.from_numpy(array)

        self.hidden, self.hidden_t = pair(hidden)  # the residual stream
        self.normed, self.normed_t = pair(hidden)
        self.qkv, self.qkv_t = pair((heads + 2 * kv_heads) * head_dim)
        # (gate and up, or the up projection alone in an MLP without a gate: up_width)
        self.gate_up, self.gate_up_t = pair(2 * intermediate if up_width is None else up_width)
        self.act, self.act_t = pair(intermediate)
        self.attn, self.attn_t = pair(heads * head_dim)  # the attention output, (rows, heads * head_dim)
        # the same as (batch, n, heads, head_dim), to copy SDPA's (batch, heads, n, head_dim) into
        self.attn_heads = self.attn.reshape(batch, n, heads, head_dim)
        qk = (heads + kv_heads) * head_dim
        # q and k as complex pairs per head (rotated in place: interleaved rotary rows)
        self.qk_complex = self.qkv[:, :qk].view(np.complex64).reshape(rows, heads + kv_heads, head_dim // 2)
        # the query as SDPA wants it, (batch, heads, n, head_dim): a view of the buffer
        with torch.inference_mode(False):
            self.query = self.qkv_t[:, :heads * head_dim].view(batch, n, heads, head_dim).transpose(1, 2)
        # the new keys and values as the cache holds them, (batch, kv_heads, n, head_dim): views
        self.new_k = self.qkv[:, heads * head_dim:qk].reshape(batch, n, kv_heads, head_dim).transpose(0, 2, 1, 3)
        self.new_v = self.qkv[:, qk:].reshape(batch, n, kv_heads, head_dim).transpose(0, 2, 1, 3)
        self.gate = self.gate_up[:, :intermediate]
        self.up = self.gate_up[:, intermediate:]
        self.sumsq = np.zeros(rows, dtype=np.float32)


class _Product:
    """One weight of the host forward, ``y = x @ W`` for the (K, N) ``weight_t`` of a lean view's transposed
    copy ``linear``: torch's GEMM, or the panel kernel on a packed copy (``panel``, None where the kernels are
    not used: the linear's own where the view packed it, ``lean.LeanCausalLM.panels_only``)."""

    def __init__(self, linear, panels: bool, bf16: bool = False, f16: bool = False) -> None:
        self.linear = linear
        self.out_features = linear.out_features
        if linear.panel is None:  # (else weight_t is unpacked from its panel where torch's products read it)
            self.weight_t = linear.weight_t
        self.panel = None if not panels else linear.panel if linear.panel is not None else PanelWeight(
            self.weight_t, bf16, f16=f16)
        # x rounded to bfloat16 on torch's path too, where the panels are the AMX products' (which round it)
        self.round_inputs = self.panel is not None and self.panel.kind == PANELS_AMX

    def into(self, x: np.ndarray, x_t: Tensor, out: np.ndarray, out_t: Tensor, accumulate: bool,
             panels: bool) -> None:
        """``out = x @ W`` (``out += x @ W`` when accumulating); ``x``/``x_t`` and ``out``/``out_t`` are
        the numpy and torch views of the same buffers."""
        if panels and self.panel is not None:
            self.panel.matmul_into(x, out, accumulate)
            return
        if self.round_inputs:
            x_t = x_t.to(torch.bfloat16).float()
        if accumulate:
            out_t.addmm_(x_t, self.weight_t)
        else:
            torch.mm(x_t, self.weight_t, out=out_t)

    def __getattr__(self, name: str):
        # (``weight_t`` of a view that keeps its panels alone: the linear's, unpacked where first read; not kept
        # here, so that it follows the linear's panel, which LeanCausalLM.round_to_bf16_weights may replace)
        if name == "weight_t":
            return self.__dict__["linear"].weight_t
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _store(cached: np.ndarray, new: np.ndarray) -> None:
    """``cached[...] = new`` for float32 ``new``; a bfloat16 cache (``uint16`` bits) gets it rounded to
    nearest even by torch, as the kernels and the torch forward round it."""
    if kv_bf16(cached):
        torch.from_numpy(cached).view(torch.bfloat16).copy_(torch.from_numpy(new))
    else:
        cached[...] = new


def _as_float32(cached: np.ndarray) -> Tensor:
    """A float32 tensor of cache values (a view of float32 ones, a widened copy of bfloat16 ones)."""
    tensor = torch.from_numpy(cached)
    return tensor.view(torch.bfloat16).float() if kv_bf16(cached) else tensor


class HostForward:
    """:meth:`LeanCausalLM.forward` for up to ``HOST_MAX_QUERIES`` query rows, with numpy doing the
    work between the matrix products.

    Call: ``forward(tokens, positions, start, cache, mask, causal, last_only, first_row)`` with
    ``tokens`` and ``positions`` as (B, N) integer numpy arrays and the rest as in
    ``LeanCausalLM.forward``; returns (B, N, V) logits (N = 1 with ``last_only``), a fresh tensor.
    """

    def __init__(self, lean) -> None:
        reason = host_forward_unsupported_reason(lean)
        if reason is not None:
            raise ValueError(f"no host forward for this model: {reason}")
        self.lean = lean
        self.heads, self.kv_heads, self.head_dim = lean.num_heads, lean.kv_heads, lean.head_dim
        self.hidden = lean.embed.shape[1]
        # (float32 rows, or the bits of the bfloat16 embedding a view keeping its panels alone reads, uint16, or the
        # float16 one such a view of a float16 model reads)
        self.embed = host_kernels.host_array(lean.embed.detach())
        # The embedding rows' factor where the torch forward scales them (Gemma, Granite): applied to each
        # call's rows (a scaled copy of a 262k-row Gemma 3 table took 1.9 s and 1.2 GB at its first call).
        self.embed_scale = None if lean.embed_scale is None else float(lean.embed_scale)
        # Why the compiled kernels are not used (None when they are, at any thread count; see
        # host_kernels.py): the products' (``panels_off``) and the attention's (``attention_off``).
        unavailable = host_kernels_unavailable()
        self.compiled_norm = unavailable is None  # (_rms_into)
        self.attention_off = unavailable
        if self.attention_off is None and self.head_dim % 8:
            self.attention_off = "head_dim not a multiple of 8"
        self.panels_off = unavailable
        if self.panels_off is None:
            self.panels_off = _panels_unfit(lean)
        panels = self.panels_off is None
        # A bfloat16 model run in float32 (lean.bf16_in_float32): its panels hold bfloat16, half the bytes; a
        # float16 one's float16 (lean.f16_panels).
        bf16, f16 = lean.bf16_in_float32, lean.f16_panels
        # Layers other than the Llama family's (LayerNorms, biases, MLPs without a gate, parallel blocks,
        # learned positions) run on the compiled kernels only (host_forward_unsupported_reason): takes().
        self.llama = _llama_layers(lean)

        def array(bias: Tensor | None) -> np.ndarray | None:
            return None if bias is None else bias.detach().numpy()

        # The rotary kinds whose tables the layers take, in order, where the layers do not share one table
        # (Gemma 3's bases; SmolLM3's layers without one): each layer's entry holds its index here, -1 for
        # none (see _rotary_tables). None: one table for every layer, or none.
        from gbv.engine.lean import NO_ROTATION  # (lean.py imports this module)

        self.table_kinds = None
        if lean.rope_kinds is not None and set(lean.rope_kinds) != {NO_ROTATION}:
            self.table_kinds = [kind for kind in dict.fromkeys(lean.rope_kinds) if kind != NO_ROTATION]
        self._tables: tuple[int, tuple] | None = None  # (rows, the numpy tables) of the last call

        def float_array(weight: Tensor | None) -> np.ndarray | None:
            return None if weight is None else np.ascontiguousarray(weight.detach().float().numpy())

        # per layer: (qkv, b_qkv, o, gate_up, down, eps_in, eps_post, scaling, b_o, b_up, b_down, style, qk_norm,
        # qk_eps, attn_out_norm, attn_out_eps, mlp_out_norm, mlp_out_eps, flags, rotary, softcap, clip):
        # - qk_norm: the q and k norm weights, one (2 * head_dim,) array in the rows' interleaved order (Qwen3,
        #   Gemma 3; OLMo 2 / 3's over all heads: flags LAYER_QK_ALL_HEADS), or None;
        # - eps_in, eps_post: -1 where no norm comes before the block (OLMo 2 / 3);
        # - attn_out_norm, mlp_out_norm: the blocks' output norms (Gemma 2 / 3, OLMo 2 / 3), or None;
        # - flags: LAYER_QK_ALL_HEADS, LAYER_WINDOWED;
        # - rotary: the layer's table in table_kinds (see above), else 0, or -1 for none;
        # - softcap: Gemma 2's cap of the attention scores (0: none);
        # - clip: OLMo 1.7's bound on q, k and v after their product (0: none).
        self.layers = []
        for layer in lean.layers:
            qkv = layer.qkv.parts[0]
            qk_norm, qk_eps = None, 0.0
            if layer.q_norm is not None:
                qk_norm = float_array(torch.cat([layer.q_norm_weight, layer.k_norm_weight]))
                qk_eps = float(layer.q_norm_eps)
            flags = ((host_kernels.LAYER_QK_ALL_HEADS if layer.q_norm is not None and layer.qk_norm_all_heads else 0)
                     | (host_kernels.LAYER_WINDOWED if layer.window is not None else 0))
            if self.table_kinds is not None:
                table = self.table_kinds.index(layer.rope_kind) if layer.rope_kind != NO_ROTATION else -1
            else:
                table = 0 if lean.rotary is not None else -1
            self.layers.append((_Product(qkv, panels, bf16, f16), array(qkv.bias),
                                _Product(layer.o, panels, bf16, f16),
                                _Product(layer.gate_up.parts[0], panels, bf16, f16),
                                _Product(layer.down, panels, bf16, f16),
                                -1.0 if layer.input_eps is None else float(layer.input_eps),
                                -1.0 if layer.post_eps is None else float(layer.post_eps), float(layer.scaling),
                                array(layer.o.bias), array(layer.gate_up.parts[0].bias), array(layer.down.bias),
                                _layer_style(layer), qk_norm, qk_eps, float_array(layer.attn_out_norm),
                                float(layer.attn_out_eps) if layer.attn_out_norm is not None else 0.0,
                                float_array(layer.mlp_out_norm),
                                float(layer.mlp_out_eps) if layer.mlp_out_norm is not None else 0.0, flags, table,
                                float(layer.softcap or 0.0), float(lean.clip_qkv or 0.0)))
        # whether the layers need the 21-item entries (forward_into): output norms, flags, tables by kind, caps;
        # and the 22-item ones, with the bound on q, k and v (clips)
        self.clips = lean.clip_qkv is not None
        self.extra_entries = any(entry[14] is not None or entry[18] or entry[20] for entry in self.layers) or (
            self.table_kinds is not None) or self.clips
        self.logits_softcap = float(lean.logits_softcap or 0.0)  # (Gemma 2's cap of the logits; 0: none)
        # the MLP's width, and the up projection's (gate and up: twice it)
        gated = not self.layers or lean.layers[0].gated
        self.up_width = self.layers[0][3].out_features if self.layers else 0
        self.intermediate = self.up_width // 2 if gated else self.up_width
        self.lm_head = _Product(lean.lm_head, panels, bf16, f16)
        self.head_bias = array(lean.lm_head.bias)
        self.norm_eps = float(lean.norm_eps)
        self.layer_norm = bool(lean.layer_norm)  # (the final norm's kind)
        # GPT-2's, OPT's and GPT-BigCode's learned position rows (added at position + offset), else None
        self.position_rows = array(lean.position_embed)
        self.position_offset = lean.position_offset
        # What the one-call forward of a sequence (host_kernels.forward_into) takes per layer; None
        # where the kernels do not run.
        self.layer_panels = None
        if panels and self.attention_off is None:
            self.layer_panels = self._layer_panels()
        self._share_rounding()
        self._rows: dict[tuple[int, int], _Rows] = {}
        self._lock = threading.Lock()  # the buffers are shared: one forward at a time per model

    def _layer_panels(self) -> tuple:
        """What forward_into takes per layer: (w_qkv, b_qkv, w_o, w_gate_up, w_down, eps_in, eps_post, scale),
        and (b_o, b_up, b_down, style) after it for layers other than the Llama family's, and (qk_norm, qk_eps)
        after those for Qwen3's, and (attn_out_norm, attn_out_eps, mlp_out_norm, mlp_out_eps, flags, rotary,
        softcap) after those where the layers need them (:attr:`extra_entries`), and (clip,) after those where
        they clamp q, k and v (:attr:`clips`)."""
        return tuple((w_qkv.panel.panels, b_qkv, w_o.panel.panels, w_gate_up.panel.panels, w_down.panel.panels,
                      eps_in, eps_post, scaling, *(() if self.llama else (b_o, b_up, b_down, style)),
                      *(() if qk_norm is None and not self.extra_entries else (qk_norm, qk_eps)),
                      *(() if not self.extra_entries else extra if self.clips else extra[:-1]))
                     for (w_qkv, b_qkv, w_o, w_gate_up, w_down, eps_in, eps_post, scaling, b_o, b_up, b_down, style,
                          qk_norm, qk_eps, *extra) in self.layers)

    def _rotary_tables(self, end: int):
        """What forward_into takes as ``rotary`` for positions below ``end``: the lean view's one table (None
        without rotation), or a tuple of its tables by kind (:attr:`table_kinds`), numpy views of its own."""
        lean = self.lean
        lean.ensure_rotary(end)
        if self.table_kinds is None:
            return lean.rotary_numpy
        rows = lean._table_rows
        if self._tables is None or self._tables[0] != rows:  # (views kept until the tables grow)
            self._tables = (rows, tuple(lean._kind_tables[kind][2].numpy() for kind in self.table_kinds))
        return self._tables[1]

    def _window_mask(self, mask: Tensor | None, positions: np.ndarray, start: int,
                     n: int) -> tuple[np.ndarray | None, int]:
        """The windowed layers' mask where their window binds, and its first slot: lean's ``_within_window``
        of the call's ``mask`` (causal where None) over slots ``first .. start + n - 1``, (B or 1, n, start + n
        - first) uint8, ``first`` the first slot any query may attend (its least position less the window, plus
        one; slots stand for positions, see there). Why from there: past the window, the windowed layers'
        attention reads the cache from it on (a Gemma 3 layer of window 512 at 4,000 tokens, an eighth of it).
        (None, 0) where the window does not bind."""
        lean = self.lean
        if not lean.window_binds(start + n):
            return None, 0
        window = lean._within_window(mask, mask is None, torch.from_numpy(positions).view(-1, n), start, n)
        first = min(max(int(positions.min()) - lean.window + 1, 0), start)
        return np.ascontiguousarray(window.numpy()[:, 0, :, first:]), first

    def products(self) -> list[_Product]:
        """Every product of a forward, in order: each layer's q/k/v, o, gate/up and down, then the head."""
        return [product for layer in self.layers for product in (layer[0], layer[2], layer[3], layer[4])] + [self.lm_head]

    def pack_bf16_panels(self) -> bool:
        """Repack every product's panels as bfloat16 (its weights must be bfloat16 values already: see
        ``LeanCausalLM.round_to_bf16_weights``); False where the compiled products do not run."""
        if self.layer_panels is None or self.panels_off is not None:
            return False
        # (a view keeping its panels alone has packed them already: lean.LeanCausalLM.round_to_bf16_weights)
        self.set_panels([product.linear.panel if self.lean.panels_only else PanelWeight(product.weight_t, True)
                         for product in self.products()])
        return True

    def set_panels(self, panels: list[PanelWeight]) -> None:
        """Multiply by these packed weights, one per product in :meth:`products`' order (the same
        matrices, packed as any kind: ``scripts/bench_avx512_tiles.py --compare amx`` swaps two)."""
        for product, panel in zip(self.products(), panels, strict=True):
            product.panel, product.round_inputs = panel, panel.kind == PANELS_AMX
        self.layer_panels = self._layer_panels()
        self._share_rounding()

    @property
    def rounds_inputs(self) -> bool:
        """Whether this model's products round their rows of x to bfloat16: where its panels are the
        AMX products' (``host_kernels.amx_products``), whose tiles multiply bfloat16 by bfloat16. Every
        path of the model then does, torch's products too (``_Product.round_inputs``,
        ``lean._Linear.round_inputs``), so that the forward's law does not hang on which path a call
        takes (threads, batch sizes)."""
        return self.lm_head.round_inputs

    def _share_rounding(self) -> None:
        """The lean view's torch products round their inputs where these products do."""
        for matrix in self.lean.matrices():
            matrix.round_inputs = self.rounds_inputs

    def use_torch_products(self, reason: str) -> None:
        """Multiply by torch's GEMMs from now on (``reason``: why), and drop the packed panels."""
        self.panels_off = reason
        self.layer_panels = None
        for product in self.products():  # (round_inputs kept: the model's products stay the same)
            product.panel = None

    def takes(self, batch: int, n: int) -> bool:
        """Whether :meth:`LeanCausalLM.forward` should run ``batch`` sequences of ``n`` queries here: one
        sequence of up to ``HOST_MAX_QUERIES``, or of any length as one compiled call
        (:meth:`one_call`), or several where the compiled kernels run, of up to ``KERNEL_MAX_ROWS``
        queries each (and ``BATCH_MAX_ROWS`` rows in all, where set). (Without the kernels, batches of
        8 measured 0.96-0.99x the torch forward: torch's products dominate either way.)"""
        if batch == 1:
            return self.one_call(n) or (self.llama and n <= HOST_MAX_QUERIES)
        return (n <= KERNEL_MAX_ROWS and (BATCH_MAX_ROWS is None or batch * n <= BATCH_MAX_ROWS)
                and self.panels_off is None and self.attention_off is None and (self.llama or BATCH_LAYERS))

    def rows(self, batch: int, n: int) -> _Rows:
        """The work buffers for ``batch`` sequences of ``n`` queries: kept per shape for the decoding
        shapes, fresh for more than ``HOST_MAX_QUERIES`` rows (a long prompt's chain, whose arithmetic
        dwarfs the allocation; kept, every prompt length would hold megabytes)."""
        if batch * n > HOST_MAX_QUERIES:
            return _Rows(batch, n, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                         self.up_width)
        buffers = self._rows.get((batch, n))
        if buffers is None:
            if len(self._rows) >= _MAX_SHAPES:
                self._rows.clear()
            buffers = self._rows[batch, n] = _Rows(batch, n, self.hidden, self.heads, self.kv_heads,
                                                   self.head_dim, self.intermediate, self.up_width)
        return buffers

    def _rms_into(self, rows: _Rows, eps: float) -> None:
        """``normed = hidden / sqrt(eps + mean(hidden^2))`` per row (the norm's weight is folded into the
        next matrix), or a LayerNorm's ``(hidden - mean) / sqrt(eps + var)`` where the model has them
        (compiled only). With the compiled kernels, theirs (:func:`host_kernels.rms_into`: the one-call
        forward's, so a batch row's final norm is its lone run's, bit for bit; numpy's float32 norm of
        several rows was 1 ulp off, which a bfloat16-rounded product can widen to 1e-3 of a logit).
        Without: one row's scale in float64, rounded once; several in float32, as torch's."""
        x = rows.hidden
        if self.compiled_norm:
            rms_into(x, rows.normed, eps, self.layer_norm)
            return
        assert self.llama  # (a LayerNorm model runs on the compiled kernels only: host_forward_unsupported_reason)
        if x.shape[0] == 1:
            row = x[0]
            np.multiply(x, 1.0 / math.sqrt(eps + float(np.dot(row, row)) / row.shape[0]), out=rows.normed)
            return
        scale = rows.sumsq
        np.einsum("ij,ij->i", x, x, out=scale)
        scale *= 1.0 / x.shape[1]
        scale += eps
        np.sqrt(scale, out=scale)
        np.divide(x, scale[:, None], out=rows.normed)

    def __call__(self, tokens: np.ndarray, positions: np.ndarray, start: int, cache, mask: Tensor | None,
                 causal: bool = False, last_only: bool = False, first_row: int = 0) -> Tensor:
        # (no_grad: the products write into buffers, which autograd refuses for weights that need grad)
        with self._lock, torch.no_grad():
            sync_product_threads()
            return self._forward(tokens, positions, start, cache, mask, causal, last_only, first_row)

    def one_call(self, n: int) -> bool:
        """Whether a sequence of ``n`` queries runs as one compiled call (:meth:`sampled`): wherever the
        compiled kernels run, whatever ``n`` (``panels_off`` and ``attention_off``, which benchmarks set
        to switch the kernels off, switch it off too)."""
        return self.layer_panels is not None and self.panels_off is None and self.attention_off is None

    def sampled(self, tokens: np.ndarray, positions: np.ndarray, start: int, cache, mask: Tensor | None,
                last_only: bool, draw_vocab: int = 0, temperature: float = 1.0,
                u: np.ndarray | float | None = None, probs: np.ndarray | None = None,
                tokens_out: np.ndarray | None = None) -> int | None:
        """The forward of one sequence (cache row 0) of n queries (:meth:`one_call` must hold) as one
        compiled call, ``host_kernels.forward_into``, causal where ``mask`` is None; with ``draw_vocab``
        the same call also samples from its output rows (see there). Returns what it returns: the
        token of a single output row drawn with a float ``u`` (or greedily) without ``tokens_out``.

        Why one call: between forwards that stream tens of MB of weights, Python and torch run from a
        cold cache. A bundled-target step spent ~165 us in the Python around its layer calls, and
        ~190 us more in the softmax and the draw on torch."""
        with self._lock:
            sync_product_threads()
            return self._one_call(tokens, positions, start, cache, mask, last_only, draw_vocab, temperature, u, probs,
                                  tokens_out)[1]

    def sampled_steps(self, tokens: np.ndarray, start: int, cache, steps: int, draw_vocab: int, temperature: float,
                      u: np.ndarray | None, probs: np.ndarray | None, tokens_out: np.ndarray,
                      stop: np.ndarray | None = None) -> int:
        """The causal chain ``tokens`` ((n,) int64, positions = slots ``start ..``) and ``steps - 1`` more queries
        of one token each, each the token the step before drew, as one compiled call (``forward_into``'s
        ``steps``): step s's law into ``probs`` row s ((steps, draw_vocab) float32, rows may be strided; None:
        not kept) and its token into ``tokens_out[s]`` ((steps,) int64), drawn with ``u[s]`` ((steps,) float64;
        None when greedy). What ``steps`` calls of :meth:`sampled` would write and draw, up to the first step
        that draws a token of ``stop`` ((k,) int64 or None), which ends the call. Returns how many steps ran.
        :meth:`one_call` must hold, ``steps`` > 1, and no sliding window may bind on the way
        (``LeanCausalLM.window_binds``; the later steps pass no window mask): a ValueError before anything runs
        else (``LeanCausalLM.sampled_path`` declines first, before its draws)."""
        n = tokens.shape[-1]
        if self.lean.window_binds(start + n + steps - 1):
            raise ValueError("steps of one call need every query within the sliding window")
        with self._lock:
            sync_product_threads()
            return self._one_call(tokens, np.arange(start, start + n, dtype=np.int64), start, cache, None, True,
                                  draw_vocab, temperature, u, probs, tokens_out, steps=steps, stop=stop)[1]

    def _one_call(self, tokens: np.ndarray, positions: np.ndarray, start: int, cache, mask: Tensor | None,
                  last_only: bool, draw_vocab: int = 0, temperature: float = 1.0,
                  u: np.ndarray | float | None = None, probs: np.ndarray | None = None,
                  tokens_out: np.ndarray | None = None, first_row: int = 0,
                  steps: int = 1, stop: np.ndarray | None = None) -> tuple[np.ndarray, int | None]:
        """(logits, returned value) of ``forward_into`` on cache row ``first_row`` (``steps`` and ``stop``: see
        there; the logits are then the last step's, the value the number of steps that ran)."""
        lean = self.lean
        n = tokens.shape[-1]
        end = start + n + steps - 1  # (the slots the last step reaches)
        if end > cache.capacity:
            cache.grow(end)
        rotary = self._rotary_tables(end)
        window_mask, window_first = self._window_mask(mask, positions, start, n)
        logits = np.empty((1 if last_only else n, self.lm_head.panel.out_features), dtype=np.float32)
        all_keys, all_values = cache.arrays()
        token = forward_into(np.ascontiguousarray(tokens.reshape(-1)), np.ascontiguousarray(positions.reshape(-1)),
                             self.embed, rotary, self.layer_panels, all_keys, all_values, first_row,
                             cache.capacity, None if mask is None else np.ascontiguousarray(mask.numpy()[0, 0]), start,
                             self.rows(1, n), self.lm_head.panel, logits, self.norm_eps, last_only, draw_vocab,
                             temperature, u, probs, tokens_out, self.position_rows, self.position_offset,
                             self.layer_norm, self.head_bias, None if window_mask is None else window_mask[0],
                             self.logits_softcap, 1.0 if self.embed_scale is None else self.embed_scale,
                             window_first, steps, stop)
        return logits, token

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, start: int, cache, mask: Tensor | None,
                 causal: bool, last_only: bool, first_row: int) -> Tensor:
        lean = self.lean
        batch, n = tokens.shape
        if batch == 1 and self.one_call(n):
            if mask is None and not causal and n > 1:
                raise ValueError("several queries need a mask or causal=True")
            logits = self._one_call(tokens, positions, start, cache, mask, last_only, first_row=first_row)[0]
            return torch.from_numpy(logits).view(1, 1 if last_only else n, -1)
        end = start + n
        if end > cache.capacity:
            cache.grow(end)
        tables = self._rotary_tables(end)
        # (B * N, 1, D/2) complex64 per table (each layer's: its entry's last item); None without rotation
        # (learned positions: added to the rows below)
        if self.table_kinds is None:
            tables = () if tables is None else (tables,)
        rotations = [table[positions.reshape(-1)][:, None] for table in tables]
        rotation = rotations[0] if rotations else None
        all_keys, all_values = cache.arrays()
        sequences = slice(first_row, first_row + batch)
        rows = self.rows(batch, n)
        if self.embed.dtype == np.uint16:  # (bfloat16 rows, widened exactly)
            rows.hidden[...] = host_kernels.widened_bf16(np.take(self.embed, tokens.reshape(-1), axis=0))
        elif self.embed.dtype == np.float16:  # (float16 rows, widened exactly)
            rows.hidden[...] = np.take(self.embed, tokens.reshape(-1), axis=0)
        else:
            np.take(self.embed, tokens.reshape(-1), axis=0, out=rows.hidden)
        if self.embed_scale is not None:  # (float32 products, as the torch forward's and the one-call forward's)
            rows.hidden *= np.float32(self.embed_scale)
        if self.position_rows is not None:
            rows.hidden += self.position_rows[positions.reshape(-1) + self.position_offset]
        panels = self.panels_off is None and self.lm_head.panel is not None  # (packed at build)
        def panels_for(product_rows: int) -> bool:
            # One sequence's products of more than KERNEL_MAX_ROWS rows go to torch's GEMM (where this
            # loop runs a long prompt: without the one-call forward); a batch's stay on the kernels.
            return panels and (batch > 1 or product_rows <= KERNEL_MAX_ROWS)

        loop_panels = panels_for(batch * n)
        if self.attention_off is None and n <= KERNEL_MAX_ROWS:
            if mask is None and not causal and n > 1:
                raise ValueError("several queries need a mask or causal=True")
            # the kernel's own rule without a mask: query i attends slots 0 .. start + i
            kernel_masks = None if mask is None else np.ascontiguousarray(mask.numpy()[:, 0])  # (B, N, end)
            # (the windowed layers' where it binds, over slots window_first ..)
            window_masks, window_first = self._window_mask(mask, positions, start, n)
            if window_masks is not None and window_masks.shape[0] != batch:
                window_masks = np.ascontiguousarray(np.broadcast_to(window_masks, (batch, *window_masks.shape[1:])))
            attend = True
        else:
            mask, is_causal = attention_mask(mask, causal, start, n, cache.keys[0].device)
            kernel_masks, window_masks, window_first = None, None, 0  # (the kernels': unused on this path)
            attend = False
        enable_gqa = self.kv_heads != self.heads

        def layer_mask(flags: int) -> tuple[np.ndarray | None, int]:  # ((B, N, end - first) or None, first)
            if flags & host_kernels.LAYER_WINDOWED and window_masks is not None:
                return window_masks, window_first
            return kernel_masks, 0

        if panels and attend and batch == 1:
            # Both kernels on one sequence: each layer is one compiled call (host_kernels.layer_into).
            for index, (w_qkv, b_qkv, w_o, w_gate_up, w_down, eps_in, eps_post, scaling, b_o, b_up, b_down,
                        style, qk_norm, qk_eps, attn_out_norm, attn_out_eps, mlp_out_norm, mlp_out_eps, flags,
                        table, softcap, clip) in enumerate(self.layers):
                masks, first = layer_mask(flags)
                layer_into(rows, w_qkv.panel, b_qkv, w_o.panel, w_gate_up.panel, w_down.panel,
                           rotations[table] if table >= 0 else None,
                           all_keys[index][first_row], all_values[index][first_row],
                           None if masks is None else masks[0], start, eps_in, eps_post, scaling,
                           b_o=b_o, b_up=b_up, b_down=b_down, style=style, qk_norm=qk_norm, qk_eps=qk_eps,
                           attn_out_norm=attn_out_norm, attn_out_eps=attn_out_eps, mlp_out_norm=mlp_out_norm,
                           mlp_out_eps=mlp_out_eps, qk_all_heads=bool(flags & host_kernels.LAYER_QK_ALL_HEADS),
                           softcap=softcap, attend_first=first, clip=clip)
            layers = ()
        elif panels and attend and BATCH_LAYERS:
            # Several sequences (a batch): each layer is one compiled call too, the products over all
            # their rows and each one's attention over its own cache row. Why: the numpy and Python
            # between the kernels below were about a quarter of a 16-row bfloat16 step of the bundled
            # target (128 attention calls a step, the norms, the SiLU, the stores).
            # (the step's keys and values, every layer's up to its last slot: past KV_PREFETCH_MIN_BYTES they
            # come from memory, and the values are prefetched as the keys are scored)
            _, kv_heads, _, head_dim = all_keys[0].shape
            kv_bytes = host_kernels.kv_step_bytes(len(self.layers), batch, kv_heads, end, head_dim,
                                                  all_keys[0].itemsize)
            prefetch_values = kv_bytes > host_kernels.KV_PREFETCH_MIN_BYTES
            for index, (w_qkv, b_qkv, w_o, w_gate_up, w_down, eps_in, eps_post, scaling, b_o, b_up, b_down,
                        style, qk_norm, qk_eps, attn_out_norm, attn_out_eps, mlp_out_norm, mlp_out_eps, flags,
                        table, softcap, clip) in enumerate(self.layers):
                masks, first = layer_mask(flags)
                layer_into(rows, w_qkv.panel, b_qkv, w_o.panel, w_gate_up.panel, w_down.panel,
                           rotations[table] if table >= 0 else None,
                           all_keys[index][sequences], all_values[index][sequences], masks, start, eps_in,
                           eps_post, scaling, batch, prefetch_values, b_o, b_up, b_down, style, qk_norm, qk_eps,
                           attn_out_norm, attn_out_eps, mlp_out_norm, mlp_out_eps,
                           bool(flags & host_kernels.LAYER_QK_ALL_HEADS), softcap, first, clip)
            layers = ()
        else:
            # (the Llama family's layers, numpy between the products: takes() gives the others no call here)
            assert self.llama, "a host forward of LayerNorm layers without the compiled layers"
            layers = self.layers
        for index, (w_qkv, b_qkv, w_o, w_gate_up, w_down, eps_in, eps_post, scaling, *_) in enumerate(layers):
            self._rms_into(rows, eps_in)
            w_qkv.into(rows.normed, rows.normed_t, rows.qkv, rows.qkv_t, False, loop_panels)
            if b_qkv is not None:
                rows.qkv += b_qkv
            rows.qk_complex *= rotation
            keys, values = all_keys[index][sequences], all_values[index][sequences]
            _store(keys[:, :, start:end], rows.new_k)
            _store(values[:, :, start:end], rows.new_v)
            if attend:
                for b in range(batch):
                    attention_into(rows.qkv[b * n:(b + 1) * n], keys[b], values[b], rows.attn[b * n:(b + 1) * n],
                                   None if kernel_masks is None else kernel_masks[b], self.heads, start, end,
                                   scaling)
            else:
                attn = torch.nn.functional.scaled_dot_product_attention(
                    rows.query, _as_float32(keys[:, :, :end]), _as_float32(values[:, :, :end]),
                    attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=enable_gqa)  # (B, heads, N, D)
                np.copyto(rows.attn_heads, attn.numpy().transpose(0, 2, 1, 3))
            w_o.into(rows.attn, rows.attn_t, rows.hidden, rows.hidden_t, True, loop_panels)
            self._rms_into(rows, eps_post)
            w_gate_up.into(rows.normed, rows.normed_t, rows.gate_up, rows.gate_up_t, False, loop_panels)
            act = rows.act  # SiLU(g) * u = g * u / (1 + exp(-g))
            np.negative(rows.gate, out=act)
            np.exp(act, out=act)
            act += 1.0
            np.divide(rows.gate, act, out=act)
            act *= rows.up
            w_down.into(rows.act, rows.act_t, rows.hidden, rows.hidden_t, True, loop_panels)
        if last_only and n > 1:
            last = self.rows(batch, 1)
            np.copyto(last.hidden, rows.hidden.reshape(batch, n, -1)[:, -1])
            rows, n = last, 1
        self._rms_into(rows, self.norm_eps)
        # The logits leave in a fresh tensor (the caller keeps them).
        logits = np.empty((rows.normed.shape[0], self.lm_head.out_features), dtype=np.float32)
        logits_t = torch.from_numpy(logits)
        self.lm_head.into(rows.normed, rows.normed_t, logits, logits_t, False, panels_for(rows.normed.shape[0]))
        if self.head_bias is not None:
            logits += self.head_bias
        if self.logits_softcap:  # (Gemma 2: compiled only, as the one-call forward caps them)
            host_kernels.soft_cap_into(logits, self.logits_softcap)
        return logits_t.view(batch, n, -1)
