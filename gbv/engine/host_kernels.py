"""The host forward's compiled kernels (``_host_kernels.c``; CPU, float32, AVX2 + FMA; products of several
rows by AVX-512 tiles where the CPU has AVX-512F: :func:`avx512_tiles`).

Everything is float32 except the weights of the products, which are float32 or bfloat16 panels (a
bfloat16 model runs in float32 over its bf16 weight values: ``gbv.engine.lean.bf16_weights_in_float32_reason``),
and the KV cache, float32 or bfloat16 (that model's: ``LeanCausalLM.cache_dtype``). bfloat16 arrays are
numpy ``uint16`` views of the bits (numpy has no bfloat16): see :func:`kv_bf16`.

- **Products of a few rows** (:class:`PanelWeight`). ``y = x @ W`` for a (K, N) weight and M rows
  costs MKL here about as much per added row as a whole 1-row product (docs/ENGINE.md, "Compiled
  kernels"): 2.5 ms for the bundled target's matrices at 1 row, 6-7 ms at 5 rows, against a memory
  floor of about 1.8 ms. The kernel reads a packed copy of W once per call and uses each value for
  every row, so a pass of 5 tokens costs little more than one.
- **Attention of a few queries** (:func:`attention_into`) over one sequence's cache: torch's SDPA
  costs 50-80 us a call for one query over a few hundred slots, for about 10 us of arithmetic.
- **Threads** (:func:`sync_product_threads`): a product of a large weight splits its columns, and a long
  attention its (sequence, kv head) units, among torch's intra-op thread count (or
  :func:`set_product_threads`'), the same bits at any count (each output is computed by one thread).
- **A whole decoder layer in one call** (:func:`layer_into`): the two above and the norms, the
  rotation, the cache writes and SiLU, for one sequence.
- **One inverse-CDF draw per row** (:func:`draw_rows_host`), the rule of
  :func:`gbv.verify.common.draw_rows` on the same uniforms: 73 -> 46 us a draw at V = 4096 (the
  kernel itself takes about 10 us; the rest is the uniform's ``torch.rand`` and the calls around it).
- **Softmax and draw in one call** (:func:`softmax_into`): ``sampling.process_logits`` for plain
  settings, and the draws of :func:`gbv.engine.sampling.draw_token` / ``sample_into_at``.
- **A whole forward of one sequence in one call** (:func:`forward_into`): embedding, every layer,
  final norm and head, optionally followed by the softmax and the draw of its output rows. Between
  forwards that stream tens of MB of weights, Python and torch run from a cold cache: a bundled
  target step spent ~165 us in the Python around its per-layer calls and ~250 us around the
  forward (ids, softmax, uniform, draw), ~96 us in all with this and uniforms
  drawn 64 at a time (``TorchRandom.uniform``).

The products, the attention and the layer serve the host forward (``lean_host.py``), the draw the
engine's :func:`gbv.engine.sampling.sample`. Where the extension is missing (no C compiler at
install) or the CPU lacks AVX2/FMA, :func:`host_kernels_unavailable` says why and the host forward
keeps torch's products and attention.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import Tensor

from gbv.verify.common import BELOW_ONE

PANEL = 16

try:  # built by setup.py when a C compiler is at hand
    from gbv.engine import _host_kernels
except ImportError:  # pragma: no cover - depends on the install
    _host_kernels = None


def host_kernels_unavailable() -> str | None:
    """None when the compiled kernels can run here; else why not. ``GBV_HOST_KERNELS=0`` in the
    environment turns them off (for before/after measurements)."""
    if os.environ.get("GBV_HOST_KERNELS", "1") == "0":
        return "GBV_HOST_KERNELS=0"
    if _host_kernels is None:
        return "the extension gbv.engine._host_kernels was not built (no C compiler at install?)"
    if not _host_kernels.supported():
        return "this CPU has no AVX2/FMA"
    return None


def set_product_threads(threads: int | None) -> None:
    """The compiled products' threads from now on: ``threads`` (1-64), or None to follow torch's intra-op
    count (``torch.get_num_threads()``, the default). ``gbv.engine.threads.apply_threads`` sets it where
    torch itself keeps one thread (a model of 30-100M parameters, by default)."""
    global _product_threads
    if threads is not None and not 1 <= int(threads) <= 64:
        raise ValueError(f"the products' threads must be 1 to 64, got {threads}")
    _product_threads = None if threads is None else int(threads)


def product_threads() -> int:
    """The compiled products' threads in force: :func:`set_product_threads`' count, else torch's."""
    return min(_product_threads or torch.get_num_threads(), 64)


def sync_product_threads() -> int:
    """Runs the compiled products on :func:`set_product_threads`' count, or on torch's intra-op count where
    none is set, from now on, and returns it; the host forward calls this before each forward. A product
    whose weight streams at least 256 KB splits its columns among that many threads (the caller's
    included), and an attention that reads at least 256 KB of cache its (sequence, kv head) units; smaller
    ones stay on one. Each output column is summed by one thread in one order, so the
    products give the same bits at any count (``tests/engine/test_host_threads.py``). Why threads: a
    model of tens to hundreds of millions of parameters streams its weights from memory every step, and one
    core reads a part of what the memory delivers (docs/ENGINE.md, "The compiled forward on several
    threads"). Where another process takes cores and the threads stop paying, the products run alone for a
    while (``_host_kernels.c``, ``pool_judge``; docs/ENGINE.md, "The first call, a shared machine, Qwen3 and
    models past 1B"). 1 without the kernels."""
    global _threads
    threads = product_threads()
    if threads != _threads and _host_kernels is not None and hasattr(_host_kernels, "set_threads"):
        _host_kernels.set_threads(threads)  # (a module built from an older C file has no threads)
        _threads = threads
    return _threads


_product_threads: int | None = None  # set_product_threads' count; None: torch's
_threads = 1  # the count set in the extension (its default)


def avx512_tiles() -> bool:
    """Whether the panel kernel's products of 2 rows or more take its AVX-512 tiles (the default where the
    CPU has AVX-512F; on an Intel Xeon with AVX-512 a 25-query pass of the bundled target took 4.3 ms
    against 5.6 with the AVX2 tiles: scripts/bench_avx512_tiles.py), and the attention of 6 queries or
    more its AVX-512 score tiles and weighted sums (the AVX2 ones' sums, bit for bit; 0.85x the time
    at 25 queries). False without the kernels."""
    return _host_kernels is not None and _host_kernels.avx512()


def set_avx512_tiles(on: bool) -> None:
    """Products, and the attention of 6 queries or more, by the AVX-512 tiles (True; a ValueError where
    the CPU lacks AVX-512F) or the AVX2 ones (False), process-wide (the same sums either way). ``GBV_HOST_AVX512=0``
    in the environment sets False at import."""
    _require_kernels()
    _host_kernels.set_avx512(bool(on))


def _require_kernels() -> None:
    """A ValueError saying why, where the compiled kernels cannot run here."""
    reason = host_kernels_unavailable()
    if reason is not None:
        raise ValueError(f"the host kernels do not run here: {reason}")


if _host_kernels is not None and os.environ.get("GBV_HOST_AVX512", "1") == "0":
    _host_kernels.set_avx512(False)


def set_two_panel_tiles(on: bool) -> None:
    """Products of 8 rows or more by AVX-512 tiles of two panels (True, the default) or of one (False),
    process-wide; the same sums, bit for bit. Two panels share each broadcast value of ``x``: on an
    Intel Xeon a 25-query pass of the bundled target ran 1.10x (float32) and 1.16x (bfloat16) faster,
    a 102-token prompt 1.19x and 1.15x (``scripts/bench_avx512_tiles.py --compare one-panel``).
    ``GBV_HOST_TWO_PANEL=0`` in the environment sets False at import. Nothing changes where the
    AVX-512 tiles do not run."""
    _require_kernels()
    _host_kernels.set_two_panel_tiles(bool(on))


if _host_kernels is not None and os.environ.get("GBV_HOST_TWO_PANEL", "1") == "0":
    _host_kernels.set_two_panel_tiles(False)


# The kinds of packed weights (PanelWeight.kind; the C products' last argument).
PANELS_F32, PANELS_BF16, PANELS_AMX, PANELS_F16 = 0, 1, 2, 3

# Whether bfloat16 weights are packed for the AMX products (PanelWeight): None until asked, then what
# _host_kernels.amx() says (GBV_HOST_AMX=0 in the environment: False), or what set_amx_products set.
_amx_products: bool | None = None if os.environ.get("GBV_HOST_AMX", "1") != "0" else False


def amx_products() -> bool:
    """Whether bfloat16 weights are packed for the AMX products from now on (the default where the CPU
    has AMX-BF16 and the kernel lets this process use it): each product then rounds its rows of ``x``
    to bfloat16 and multiplies them on the tiles, as Hugging Face's bfloat16 forward rounds its
    activations (docs/ENGINE.md, "AMX products"). On an Intel Xeon a 25-query pass of the bundled
    bfloat16 target's products took 0.6 ms against 2.5 ms by the AVX-512 tiles. False without the
    kernels."""
    global _amx_products
    if _amx_products is None:
        _amx_products = host_kernels_unavailable() is None and _host_kernels.amx()
    return _amx_products


def set_amx_products(on: bool) -> None:
    """Pack bfloat16 weights for the AMX products (True; a ValueError where they cannot run) or as the
    panels of the AVX tiles, exact in ``x`` (False), from now on: weights packed before keep their
    kind (``HostForward.pack_bf16_panels`` repacks a model's). ``GBV_HOST_AMX=0`` in the environment
    sets False at import."""
    global _amx_products
    _require_kernels()
    if on and not _host_kernels.amx():
        raise ValueError("the AMX products do not run here: this CPU has no AMX-BF16 and AVX512-BF16, or the "
                         "kernel refused this process the tile data")
    _amx_products = bool(on)


def f16_panels() -> bool:
    """Whether a float16 model's weights are packed as float16 panels (``PanelWeight(..., f16=True)``: half
    the bytes of float32 panels, the same sums bit for bit) where its lean view runs in float32: where the
    compiled kernels run and the CPU has F16C, unless ``GBV_HOST_F16_PANELS=0`` (float32 panels, as before:
    for before/after measurements)."""
    return (os.environ.get("GBV_HOST_F16_PANELS", "1") != "0" and host_kernels_unavailable() is None
            and hasattr(_host_kernels, "f16") and _host_kernels.f16())


# How the panel kernel prefetches its weights, process-wide: non-temporally (False, its default) or into
# every cache level (True); None until gbv.engine.lean_host.choose_cpu_forward has measured which one
# this machine wants (on the Zen 3 machines the non-temporal hint was the faster one, on an Intel Xeon
# with AVX-512 and a large L3 the other, by 3.1x for a float32 step of the bundled target:
# scripts/bench_prefetch_hint.py; docs/ENGINE.md, "Which forward runs on the CPU, and how its kernels
# prefetch").
_prefetch_temporal: bool | None = None


def prefetch_temporal() -> bool | None:
    """The panel kernel's prefetch hint as chosen in this process (None: not chosen, the default)."""
    return _prefetch_temporal


def set_prefetch_temporal(temporal: bool, chosen: bool = True) -> None:
    """Prefetch the weights into every cache level (True) or non-temporally (False); ``chosen``:
    record it as this process's choice (False while measuring)."""
    global _prefetch_temporal
    _host_kernels.set_prefetch_temporal(bool(temporal))
    if chosen:
        _prefetch_temporal = bool(temporal)


# The column order of a bfloat16 panel row as stored: the kernel widens the 16 values to float32 with
# two interleaves, which take words 0-3 and 8-11 to columns 0-7 and words 4-7 and 12-15 to columns 8-15.
_BF16_ORDER = np.array([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])


class PanelWeight:
    """A (K, N) float32 weight (``y = x @ W``) packed for the compiled products, once; ``weight`` itself
    is not kept. ``kind`` says how:

    - ``PANELS_F32``: (ceil(N / 16), K, 16) float32 column panels, zero-padded on the right;
    - ``PANELS_BF16`` (``bf16``): the same panels in bfloat16 (half the bytes to stream; the kernel
      widens each value to the float32 it stands for and sums in float32, exact in ``x``), each panel
      row in the column order ``_BF16_ORDER``;
    - ``PANELS_AMX`` (``bf16`` where :func:`amx_products`, or ``amx=True``): bfloat16 for the AMX tiles,
      which round ``x`` to bfloat16: panels in pairs (an odd last one paired with zeros), K padded
      with zeros to a multiple of 32, and per pair and step of 32 values of k two blocks of
      (16, 32): row j holds (W[k + 2j, c], W[k + 2j + 1, c]) for the panel's 16 columns c;
    - ``PANELS_F16`` (``f16``): the float32 panels in float16, in column order (a float16 model's weights:
      half the bytes, and the kernel widens each value to the float32 it stands for, so that the sums are
      those of float32 panels of the same values, bit for bit).

    ``bf16`` (``f16``): every value of ``weight`` must be a bfloat16 (float16) value already (raises
    otherwise): the panels never round.
    """

    def __init__(self, weight: Tensor | np.ndarray, bf16: bool = False, amx: bool | None = None,
                 f16: bool = False) -> None:
        w = weight.detach().cpu().numpy() if isinstance(weight, Tensor) else np.asarray(weight)
        if w.ndim != 2 or w.dtype != np.float32:
            raise ValueError(f"a panel weight is a 2-D float32 matrix, got {w.dtype} {w.shape}")
        if amx and not bf16:
            raise ValueError("AMX panels hold bfloat16 weights: pass bf16=True")
        if f16 and bf16:
            raise ValueError("panels hold bfloat16 or float16, not both: pass one of bf16=True and f16=True")
        amx = bf16 and (amx_products() if amx is None else amx)
        self.kind = PANELS_AMX if amx else PANELS_BF16 if bf16 else PANELS_F16 if f16 else PANELS_F32
        self.in_features, self.out_features = w.shape
        packs = _host_kernels is not None and hasattr(_host_kernels, "pack")  # (which checks the values itself)
        if bf16 and not packs and np.any(w.view(np.uint32) & 0xFFFF):
            raise ValueError("bf16 panels need weights that are bfloat16 values (round them first)")
        if f16 and not packs:
            with np.errstate(over="ignore"):  # (a value past float16's range is refused below)
                round_trip = w.astype(np.float16).astype(np.float32)
            if not np.array_equal(round_trip.view(np.uint32), w.view(np.uint32)):
                raise ValueError("float16 panels need weights that are float16 values")
        width = 2 * PANEL if amx else PANEL
        num_panels = -(-self.out_features // width) * width // PANEL
        depth = -(-self.in_features // 32) * 32 if amx else self.in_features
        if packs:
            # (one pass in C, on the products' threads: numpy's padded and transposed copies of a 405M-parameter
            # model took 4.5 s on one thread)
            shape = (num_panels // 2, depth // 32, 2, 16, PANEL, 2) if amx else (num_panels, depth, PANEL)
            self.panels = np.empty(shape, dtype=np.uint16 if bf16 else np.float16 if f16 else np.float32)
            sync_product_threads()
            _host_kernels.pack(np.ascontiguousarray(w), self.panels, self.in_features, self.out_features, self.kind)
            return
        self.panels = self._packed_by_numpy(w, amx, bf16, num_panels, depth)
        if f16:
            self.panels = self.panels.astype(np.float16)

    @staticmethod
    def _packed_by_numpy(w: np.ndarray, amx: bool, bf16: bool, num_panels: int, depth: int) -> np.ndarray:
        """The packing in numpy (a module built from an older C file has no ``pack``; the tests' reference)."""
        padded = np.zeros((depth, num_panels * PANEL), dtype=np.float32)
        padded[:w.shape[0], :w.shape[1]] = w
        if amx:  # (pairs, steps, 2 panels, 16 pairs of k, 16 columns, 2 values of k)
            panels = padded.reshape(depth // 32, 16, 2, num_panels // 2, 2, PANEL).transpose(3, 0, 4, 1, 5, 2)
        else:
            panels = padded.reshape(depth, num_panels, PANEL).transpose(1, 0, 2)
            if bf16:
                panels = panels[:, :, _BF16_ORDER]
        if bf16:
            panels = (np.ascontiguousarray(panels).view(np.uint32) >> 16).astype(np.uint16)
        return np.ascontiguousarray(panels)

    def unpacked(self) -> np.ndarray:
        """The (K, N) float32 matrix these panels were packed from, a new array: the packing's inverse, exact
        (bfloat16 panels hold bfloat16 values, which widen to themselves). For a lean view that keeps its
        panels alone (``lean._Linear.release``): torch's products read this where they run."""
        if self.kind == PANELS_AMX:  # (pairs, steps, 2 panels, 16 pairs of k, 16 columns, 2 values of k)
            pairs, steps = self.panels.shape[:2]
            wide = self.panels.transpose(1, 3, 5, 0, 2, 4).reshape(steps * 32, pairs * 2 * PANEL)
        else:
            panels = self.panels[:, :, np.argsort(_BF16_ORDER)] if self.kind == PANELS_BF16 else self.panels
            wide = panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)
        wide = wide[:self.in_features, :self.out_features]
        if self.bf16:
            return widened_bf16(wide)
        return np.ascontiguousarray(wide, dtype=np.float32)  # (float16 panels: widened, exactly)

    @property
    def bf16(self) -> bool:
        """Whether the panels hold bfloat16 (for the AVX tiles or the AMX products)."""
        return self.kind in (PANELS_BF16, PANELS_AMX)

    def matmul_into(self, x: np.ndarray, out: np.ndarray, accumulate: bool = False) -> np.ndarray:
        """``out = x @ W`` (or ``out += x @ W``) in place; ``x`` (M, K) and ``out`` (M, N) C-contiguous
        float32 arrays (AMX panels: ``x`` rounded to bfloat16 first). Returns ``out``."""
        _host_kernels.matmul(x, self.panels, out, x.shape[0], self.in_features, self.out_features, accumulate,
                             self.kind)
        return out


# A batch step whose keys and values (every layer's, every row's, up to its last slot) come to more
# than this many bytes prefetches each head's values while it scores its keys (layer_into's
# ``prefetch_values``; _host_kernels.c, prefetch_lines). Why this size: on the Xeon, bundled pair, whole
# batched generations (prefills included) with every step prefetching took 0.80-1.00x the time of none
# where a step read 38-207 MiB, and 0.93-1.04x, mostly above 1, where it read 5-36 MiB, which the caches
# partly hold between steps (`python scripts/bench_kv_prefetch.py`; docs/ENGINE.md, "Values prefetched
# in long batch steps").
KV_PREFETCH_MIN_BYTES = 32 << 20


def kv_step_bytes(layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, itemsize: int) -> int:
    """Bytes of keys and values a step of ``batch`` sequences reads over ``slots`` slots of every layer's
    cache (what :data:`KV_PREFETCH_MIN_BYTES` is compared with)."""
    return 2 * layers * batch * kv_heads * slots * head_dim * itemsize


# The compiled forward's kinds of embedding rows (its ``embed_kind``), by the numpy dtype of the embedding: float32,
# bfloat16 bits (uint16: host_array) and float16, the latter two widened as read.
EMBED_KINDS = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.float16): 2}


def host_array(tensor: Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (sharing its memory): bfloat16 as ``uint16`` bits, since numpy has no
    bfloat16 (the kernels take such arrays: :func:`kv_bf16` caches, a bfloat16 embedding)."""
    return (tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def widened_bf16(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 ``bits`` (uint16, as :func:`host_array` gives them), exactly: a new
    C-contiguous array."""
    wide = bits.astype(np.uint32, order="C")
    wide <<= 16
    return wide.view(np.float32)


def kv_bf16(keys: np.ndarray) -> bool:
    """Whether cache arrays hold bfloat16 (their ``uint16`` bits, the view ``KVCache.arrays`` gives of
    bfloat16 tensors) rather than float32."""
    if keys.dtype == np.uint16:
        return True
    if keys.dtype != np.float32:
        raise ValueError(f"cache arrays must be float32, or uint16 holding bfloat16, got {keys.dtype}")
    return False


def _kv_flag(keys: np.ndarray) -> tuple:
    """The kernels' trailing ``kv_bf16`` argument: given only when it is set, so that a module built
    from an older C file (``scripts/kernels_at.py``, for before/after runs) takes float32 caches as
    it did."""
    return (True,) if kv_bf16(keys) else ()


def move_slots(arrays: tuple[np.ndarray, ...], rows, src, dst) -> None:
    """In every one of ``arrays`` (C-contiguous (batch, kv_heads, capacity, head_dim) float32 or
    bfloat16-bits caches of one shape), copy slot ``src[j]`` of batch row ``rows[j]`` (``rows`` an int:
    every pair's) to slot ``dst[j]`` of the same row (sequences of ints: lists, or int64 arrays); every
    source slot is read before any destination is written. :meth:`gbv.engine.lean.KVCache.move`'s host
    form: one call for every layer."""
    batch, kv_heads, capacity, head_dim = arrays[0].shape
    _host_kernels.move_slots(arrays, rows, src, dst, batch, kv_heads, capacity, head_dim, arrays[0].itemsize)


def attention_into(q: np.ndarray, keys: np.ndarray, values: np.ndarray, out: np.ndarray,
                   mask: np.ndarray | None, heads: int, start: int, end: int, scale: float,
                   softcap: float = 0.0) -> np.ndarray:
    """Attention of one sequence's n queries over slots ``0 .. end-1`` of its cache, into ``out``.

    Args:
        q: (n, width) float32, C-contiguous rows whose first ``heads * D`` values are the query (the
            host forward passes its fused q/k/v rows as they are).
        keys, values: (kv_heads, capacity, D) float32, or uint16 bfloat16 bits (:func:`kv_bf16`),
            C-contiguous (one sequence of the cache).
        out: (n, heads * D) float32, C-contiguous.
        mask: (n, end) bool/uint8, C-contiguous, True where query i may attend slot j; or None, where
            query i attends every slot up to ``start + i`` (one query: every slot).
    Returns ``out``. Softmax of ``scale * q k^T`` over the allowed slots, times ``values``; with
    ``softcap`` > 0 (Gemma 2) of ``softcap * tanh(scale * q k^T / softcap)``.
    """
    kv_heads, _, head_dim = keys.shape
    _host_kernels.attention(q, q.shape[1], keys, values, out, mask, q.shape[0], heads, kv_heads, head_dim,
                            start, end, scale, *_trailing((kv_bf16(keys), False), (softcap, 0.0)))
    return out


# A host layer's MLP (layer_style): SiLU(gate) * up (the Llama family) or GELU's tanh form of the gate times up
# (Gemma), or an activation of the up projection alone: GELU (GPT-NeoX), GELU's tanh form (GPT-2's and Phi's
# gelu_new, GPT-BigCode, StarCoder2, GPT-J) or ReLU (OPT).
MLP_SILU_GATED, MLP_GELU, MLP_GELU_TANH, MLP_RELU, MLP_GELU_TANH_GATED = 0, 1, 2, 3, 4
# The flags of a layer's 21-item entry (forward_into): q/k normed over all heads (OLMo 2 / 3), a windowed layer.
LAYER_QK_ALL_HEADS, LAYER_WINDOWED = 1, 2
# How attention and the MLP sit in a host layer (layer_style): one after the other, or both reading the
# layer's input, each through its own norm (GPT-NeoX's parallel residual) or through attention's (Phi, GPT-J).
SEQUENTIAL, PARALLEL, PARALLEL_SHARED_NORM = 0, 1, 2
# The Llama family's layer: RMSNorms, sequential, SiLU(gate) * up.
LLAMA_STYLE = 0


def layer_style(layer_norm: bool, parallel: int = SEQUENTIAL, mlp: int = MLP_SILU_GATED) -> int:
    """A host layer's style as the compiled layer takes it (``style`` of :func:`layer_into` and of each
    layer of :func:`forward_into`): LayerNorms rather than RMSNorms, ``parallel`` (SEQUENTIAL, PARALLEL or
    PARALLEL_SHARED_NORM) and ``mlp`` (MLP_SILU_GATED, MLP_GELU_TANH_GATED: Gemma's GELU-tanh(gate) * up;
    MLP_GELU, MLP_GELU_TANH or MLP_RELU without a gate)."""
    if parallel not in (SEQUENTIAL, PARALLEL, PARALLEL_SHARED_NORM) or mlp not in range(5):
        raise ValueError(f"no host layer style with parallel={parallel}, mlp={mlp}")
    return int(bool(layer_norm)) | parallel << 1 | mlp << 3


def layer_into(rows, w_qkv: PanelWeight, b_qkv: np.ndarray | None, w_o: PanelWeight, w_gate_up: PanelWeight,
               w_down: PanelWeight, rotation: np.ndarray | None, keys: np.ndarray, values: np.ndarray,
               mask: np.ndarray | None, start: int, eps_in: float, eps_post: float, scale: float,
               batch: int = 1, prefetch_values: bool = False, b_o: np.ndarray | None = None,
               b_up: np.ndarray | None = None, b_down: np.ndarray | None = None, style: int = LLAMA_STYLE,
               qk_norm: np.ndarray | None = None, qk_eps: float = 0.0, attn_out_norm: np.ndarray | None = None,
               attn_out_eps: float = 0.0, mlp_out_norm: np.ndarray | None = None, mlp_out_eps: float = 0.0,
               qk_all_heads: bool = False, softcap: float = 0.0, attend_first: int = 0, clip: float = 0.0) -> None:
    """One decoder layer of the host forward for the n rows of one sequence, in place on
    ``rows.hidden`` (n, H) (``rows``: the host forward's work buffers, lean_host._Rows), in one call;
    with ``batch`` > 1, for ``batch`` sequences of n rows each (``rows.hidden`` (batch * n, H),
    ``keys``/``values`` (batch, kv_heads, capacity, D), one cache row each, ``mask`` (batch, n,
    start+n) or None): the products over all their rows at once, each sequence's attention over its
    own cache row. ``prefetch_values`` (batch > 1): each head's first query prefetches the values of the
    slots it scores, for steps whose keys and values do not stay in the caches (see
    :data:`KV_PREFETCH_MIN_BYTES`).

    The layer as :class:`gbv.engine.lean_host.HostForward` computes it (norm weights folded, q/k/v and
    gate/up fused, rotary pairs interleaved): rms norm, q/k/v product (+ bias), the rotation
    ``rotation`` ((n, 1, D/2) complex64, one row per query) on q and k, k and v into slots
    ``start .. start+n-1`` of ``keys``/``values`` ((kv_heads, capacity, D) of this sequence; bfloat16
    ones get the float32 values rounded to nearest even, as torch rounds), attention
    as :func:`attention_into` (``mask`` (n, start+n) or None), o product added, rms norm, gate/up
    product, SiLU(gate) * up, down product added.

    ``style`` (:func:`layer_style`) names the other layers it computes: LayerNorms (the mean taken out;
    their weights and biases folded into the next matrix and its bias), an MLP of the up projection
    alone (``w_gate_up`` then holds it; ``rows.gate_up`` (rows, I)), attention and the MLP in parallel
    (``h + attn(norm(h)) + mlp(norm'(h))``; the sums in another order than the model's modules: float
    rounding). ``b_o``, ``b_up``, ``b_down``: the products' biases, or None. ``rotation`` None: no
    rotation (GPT-2, OPT, GPT-BigCode: learned positions, added to the embedding rows). ``qk_norm``
    (Qwen3, Gemma 3): the q and k norms' weights, a (2 * D,) float32 array in the rows' interleaved order (q's,
    then k's): each q and k head is RMS-normed over its D values (eps ``qk_eps``) and scaled before the rotation;
    with ``qk_all_heads`` (OLMo 2 / 3) a ((heads + kv_heads) * D,) array, q normed over all its heads' values at
    once and k over all of its own. ``attn_out_norm`` and ``mlp_out_norm`` (Gemma 2 / 3, OLMo 2 / 3; both or
    neither, sequential layers only): (H,) float32 weights of RMSNorms (eps ``attn_out_eps``, ``mlp_out_eps``)
    of each block's output before its residual add. ``eps_in`` or ``eps_post`` below 0: no norm before that
    block (OLMo 2 / 3). ``mask`` is the layer's own: a windowed layer's holds its window. ``softcap`` > 0
    (Gemma 2): the attention scores capped as :func:`attention_into` caps them. ``attend_first`` > 0 (a windowed
    layer past its window): no query attends a slot before it, and ``mask`` (then required) covers slots
    ``attend_first .. start + n - 1`` only, (``[batch,]`` n, start + n - attend_first). ``clip`` > 0 (OLMo 1.7's
    ``clip_qkv``): q, k and v clamped to [-clip, clip] after their product (and bias).
    """
    total, hidden = rows.hidden.shape
    n = total // batch
    kv_heads, _, head_dim = keys.shape[-3:]
    kind = w_qkv.kind
    if not w_o.kind == w_gate_up.kind == w_down.kind == kind:
        raise ValueError("a layer's four panel weights must all be packed alike (one PanelWeight.kind)")
    _host_kernels.layer(rows.hidden, rows.normed, rows.qkv, rows.attn, rows.gate_up, rows.act, w_qkv.panels, b_qkv,
                        w_o.panels, w_gate_up.panels, w_down.panels, rotation, keys, values, mask, n, hidden,
                        rows.attn.shape[1] // head_dim, kv_heads, head_dim, rows.act.shape[1], start, eps_in,
                        eps_post, scale, kind, *_trailing((kv_bf16(keys), False), (batch, 1), (prefetch_values, False),
                                                          (b_o, None), (b_up, None), (b_down, None), (style, LLAMA_STYLE),
                                                          (qk_norm, None), (qk_eps, 0.0), (attn_out_norm, None),
                                                          (attn_out_eps, 0.0), (mlp_out_norm, None),
                                                          (mlp_out_eps, 0.0), (qk_all_heads, False), (softcap, 0.0),
                                                          (attend_first, 0), (clip, 0.0)))


def _trailing(*given: tuple) -> tuple:
    """The optional trailing arguments of a kernel call, ``(value, default)`` pairs in order, without the
    run of defaults at the end: a module built from an older C file (``scripts/kernels_at.py``, for
    before/after runs), which lacks the later ones, takes the calls it knows as it did."""
    values = [value for value, _ in given]
    while given and (values[-1] is None if given[-1][1] is None else values[-1] == given[-1][1]):
        values.pop()
        given = given[:-1]
    return tuple(values)


def draw_rows_host(probs: Tensor, generator) -> Tensor | None:
    """:func:`gbv.verify.common.draw_rows` by the compiled kernel, on the same uniforms (one
    ``torch.rand`` of the same shape from the same generator, so the random stream and every draw
    are the same); None where it does not apply (not float32 on the CPU, or no kernels here).
    ``probs``: (..., V); returns (...) long."""
    if not _draws_here(probs) or (generator is not None and generator.device.type != "cpu"):
        return None  # (checked before drawing: the caller then draws the same uniforms itself)
    return draw_rows_host_at(probs, torch.rand((*probs.shape[:-1], 1), generator=generator, dtype=torch.float64))


def _draws_here(probs: Tensor) -> bool:
    """Whether the compiled draw takes ``probs``: float32 CPU values, no gradient, the kernels built."""
    return (probs.device.type == "cpu" and probs.dtype == torch.float32 and not probs.requires_grad
            and host_kernels_unavailable() is None)


def draw_rows_host_at(probs: Tensor, u: Tensor) -> Tensor | None:
    """:func:`gbv.verify.common.draw_rows_at` (the uniforms ``u`` (..., 1) float64 given) by the
    compiled kernel; None where it does not apply (as :func:`draw_rows_host`)."""
    if not _draws_here(probs) or u.device.type != "cpu":
        return None
    vocab = probs.shape[-1]
    rows = probs.detach().numpy()
    if not rows.flags.c_contiguous:  # (the first depth's row expanded over the paths)
        rows = np.ascontiguousarray(rows)
    tokens = np.empty(probs.shape[:-1], dtype=np.int64)
    _host_kernels.draw_rows(rows, np.ascontiguousarray(u.numpy(), dtype=np.float64), tokens, tokens.size, vocab,
                            BELOW_ONE)
    return torch.from_numpy(tokens)


def activation_into(x: np.ndarray, out: np.ndarray, mlp: int) -> np.ndarray:
    """``out = act(x)`` over contiguous float32 values, ``act`` the compiled layers' activation of an MLP
    without a gate (``MLP_GELU``, ``MLP_GELU_TANH`` or ``MLP_RELU``): what each of their rows goes through."""
    _host_kernels.activation(x, out, x.size, mlp)
    return out


def rms_into(x: np.ndarray, out: np.ndarray, eps: float, layer_norm: bool = False) -> np.ndarray:
    """``out = x / sqrt(eps + mean(x^2))`` per row of (rows, H) float32 ``x`` (contiguous), as the
    compiled layers norm (the mean in float64, each value rounded once): a row's norm is the same bits
    in a batch as in one sequence's one-call forward. With ``layer_norm``, ``(x - mean(x)) / sqrt(eps +
    var(x))`` (a LayerNorm's, its weight and bias folded into the next matrix)."""
    rows, width = x.shape
    _host_kernels.rms(x, out, rows, width, float(eps), layer_norm)
    return out


def soft_cap_into(x: np.ndarray, cap: float) -> np.ndarray:
    """``x = cap * tanh(x / cap)`` in place over a contiguous float32 array (Gemma 2's logits), as the one-call
    forward caps them: a batch row's logits are its lone run's bits."""
    _host_kernels.soft_cap(x, float(cap))
    return x


def softmax_into(logits: np.ndarray, temperature: float, probs: np.ndarray | None = None,
                 u: np.ndarray | float | None = None, tokens: np.ndarray | None = None) -> int | None:
    """``probs = softmax(logits / temperature)`` per row, and with ``u`` and ``tokens`` one draw per row
    from those probabilities by :func:`gbv.verify.common.draw_rows`' rule, in one compiled call.

    logits: (rows, V) float32, contiguous along V (rows may be strided). probs: the same shape,
    written, or None (a scratch row: only the draw is wanted). u: (rows,) float64 uniforms;
    tokens: (rows,) int64, written. One row may take ``u`` as a float without ``tokens``: its token is
    returned. The exponential is the attention kernel's (about 1 ulp), the sum float64: the
    probabilities differ from torch's softmax by float rounding only.
    """
    rows, vocab = logits.shape
    return _host_kernels.softmax_draw(logits, probs, u, tokens, rows, vocab, temperature, BELOW_ONE)


def forward_into(tokens: np.ndarray, positions: np.ndarray, embed: np.ndarray, rotary: np.ndarray,
                 layers: tuple, keys: tuple, values: tuple, first_row: int, capacity: int,
                 mask: np.ndarray | None, start: int, rows, head: PanelWeight, logits: np.ndarray,
                 final_eps: float, last_only: bool, draw_vocab: int = 0, temperature: float = 1.0,
                 u: np.ndarray | None = None, probs: np.ndarray | None = None,
                 tokens_out: np.ndarray | None = None, position_rows: np.ndarray | None = None,
                 position_offset: int = 0, final_layer_norm: bool = False,
                 head_bias: np.ndarray | None = None, window_mask: np.ndarray | None = None,
                 logits_softcap: float = 0.0, embed_scale: float = 1.0, window_first: int = 0,
                 steps: int = 1, stop: np.ndarray | None = None) -> int | None:
    """The whole host forward of one sequence of n queries in one compiled call: embedding rows,
    every layer as :func:`layer_into`, the final norm and the head product into ``logits``.

    tokens, positions: (n,) int64. embed: (V, H) float32, uint16 holding bfloat16, or float16 (widened as read).
    rotary: (P, D/2) complex64, the rotation of each position, or None (no rotation), or a tuple of such tables where
    each layer's entry names its own
    (Gemma 3's per layer kind, SmolLM3's none in some layers). position_rows: (P', H) float32, the learned rows added at
    ``position + position_offset`` (GPT-2, OPT), or None. layers: one ``(w_qkv, b_qkv, w_o, w_gate_up,
    w_down, eps_in, eps_post, scale, b_o, b_up, b_down, style[, qk_norm, qk_eps])`` per layer, the weights as
    panel arrays (``PanelWeight.panels``, all of one kind like ``head``), the biases float32 arrays or None,
    ``style`` :func:`layer_style`'s (every layer's MLP gated, or none), ``qk_norm`` and ``qk_eps`` Qwen3's q/k
    norms as :func:`layer_into` takes them, then optionally ``attn_out_norm, attn_out_eps, mlp_out_norm,
    mlp_out_eps, flags, rotary, softcap`` (a 21-item entry: the block output norms as :func:`layer_into`
    takes them, ``flags`` LAYER_QK_ALL_HEADS | LAYER_WINDOWED, ``rotary`` the index of the layer's table in the
    tuple ``rotary``, or -1 for none, ``softcap`` Gemma 2's cap of the attention scores, 0 for none), and then
    ``clip`` (a 22-item entry: OLMo 1.7's bound on q, k and v, as :func:`layer_into` takes it).
    window_mask: (n, start + n - window_first) bool/uint8, the mask of the windowed layers where their window
    binds, over slots ``window_first ..`` (none before it is attended: their attention reads from there), or
    None (they take ``mask``). logits_softcap > 0 (Gemma 2): the logits capped (:func:`soft_cap_into`) before any draw.
    embed_scale: the embedding rows' factor (Gemma's sqrt(H), Granite's multiplier), in float32 as the torch
    forward multiplies them (1: none).
    final_layer_norm: the final norm is a
    LayerNorm; head_bias: (V_head,) float32 or None. keys, values: per layer the cache's
    (rows, kv_heads, capacity, D) arrays, float32 or bfloat16 (:func:`kv_bf16`); this sequence is row
    ``first_row``. mask: (n, start + n)
    bool/uint8, or None for the causal chain after ``start``. rows: the work buffers (lean_host._Rows)
    of n rows. logits: (n, V_head) float32, or (1, V_head) with ``last_only`` (the last query only).

    With ``draw_vocab`` > 0 the same call samples from each output row, as :func:`softmax_into` on its
    first ``draw_vocab`` logits (``temperature`` 0: greedy, a one-hot row at the first largest logit):
    the probabilities go to ``probs`` ((rows, draw_vocab), rows may be strided) when given, and with
    ``tokens_out`` ((rows,) int64) one token per row is drawn with the uniforms ``u`` ((rows,) float64;
    unused when greedy). One output row may take ``u`` as a float without ``tokens_out``: its token
    is then returned. Returns that token, else None.

    ``steps`` > 1 (the causal chain, ``mask`` and ``window_mask`` None, one output row, a draw): the same call
    then runs ``steps - 1`` more forwards of one query, each of the token the step before drew at the next
    position and slot, as that many calls of one query would (the same sums); ``probs`` ((steps, draw_vocab))
    row s, ``tokens_out`` ((steps,)) entry s and ``u`` ((steps,); unused when greedy) entry s are step s's.
    ``stop`` ((k,) int64, or None; only with ``steps`` > 1): the steps end after the first that draws one of
    these tokens (an EOS, after which a generation keeps nothing). With ``steps`` > 1 the call returns how many
    steps ran.
    """
    n, hidden = rows.hidden.shape
    kv_heads, head_dim = keys[0].shape[1], keys[0].shape[3]
    # (the trailing arguments as one tuple, without a loop over defaults: this runs every step; an older C
    # module takes the calls it knows, scripts/kernels_at.py)
    embed_kind = EMBED_KINDS.get(embed.dtype, 0)  # (another dtype: refused by the call's size check)
    more_steps = steps > 1 or stop is not None  # (stop with one step: refused by the call)
    later = window_mask is not None or logits_softcap or embed_scale != 1.0 or window_first or embed_kind or more_steps
    if (position_rows is None and not position_offset and not final_layer_norm and head_bias is None
            and not later):
        extra = _kv_flag(keys[0])  # (the Llama family's call as it was)
    elif not later:
        extra = (kv_bf16(keys[0]), position_rows, position_offset, final_layer_norm, head_bias)
    else:
        extra = (kv_bf16(keys[0]), position_rows, position_offset, final_layer_norm, head_bias, window_mask,
                 float(logits_softcap), float(embed_scale), int(window_first),
                 *((embed_kind,) if embed_kind or more_steps else ()),
                 *((int(steps),) if more_steps else ()), *((stop,) if stop is not None else ()))
    return _host_kernels.forward(tokens, positions, embed, rotary, layers, keys, values, first_row, capacity, mask,
                                 start, rows.hidden, rows.normed, rows.qkv, rows.attn, rows.gate_up, rows.act,
                                 head.panels, logits, n, hidden, rows.attn.shape[1] // head_dim, kv_heads, head_dim,
                                 rows.act.shape[1], head.out_features, final_eps, head.kind, last_only, draw_vocab,
                                 temperature, u, probs, tokens_out, BELOW_ONE, *extra)
