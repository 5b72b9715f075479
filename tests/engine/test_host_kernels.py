"""The host forward's compiled kernels (gbv/engine/host_kernels.py, _host_kernels.c): products by
panel-packed weights and attention over one sequence's cache. Each must give what numpy / a float64
reference gives, on every shape the host forward can pass, refuse bad buffers with a clear error, and
be used only where it can be."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gbv.engine.host_kernels as host_kernels
from gbv.engine.host_kernels import PanelWeight, attention_into, host_kernels_unavailable
from gbv.engine.lean import LeanCausalLM

from engine_toy import hf_pair

needs_kernels = pytest.mark.skipif(host_kernels_unavailable() is not None,
                                   reason=f"compiled kernels unavailable: {host_kernels_unavailable()}")


def _bf16_values(array: np.ndarray) -> np.ndarray:
    """float32 ``array`` rounded to bfloat16 values (still float32)."""
    return torch.from_numpy(array).to(torch.bfloat16).float().numpy()


def _f16_values(array: np.ndarray) -> np.ndarray:
    """float32 ``array`` rounded to float16 values (still float32)."""
    return array.astype(np.float16).astype(np.float32)


def _packed(weight: np.ndarray, values: str) -> PanelWeight:
    """``weight`` (values of that kind already: :data:`_ROUNDED`) packed as panels of ``values`` ("f32", "bf16" or
    "f16"; not for the AMX products)."""
    return PanelWeight(weight, bf16=values == "bf16", amx=False, f16=values == "f16")


_ROUNDED = {"f32": lambda a: a, "bf16": _bf16_values, "f16": _f16_values}


@pytest.fixture(params=["avx2", "avx512", "avx512-one-panel"])
def tiles(request):
    """The panel kernel's tiles for products of several rows: AVX2 (tiles of 6 rows) or AVX-512 (of 16,
    and from 8 rows on of two panels by up to 14 rows: the default where the CPU has AVX-512F; or of one
    panel only), put back as they were after the test."""
    import gbv.engine.host_kernels as host_kernels
    if host_kernels_unavailable() is not None:
        pytest.skip(host_kernels_unavailable())
    before = host_kernels.avx512_tiles()
    try:
        host_kernels.set_avx512_tiles(request.param != "avx2")
    except ValueError as error:
        pytest.skip(str(error))
    host_kernels.set_two_panel_tiles(request.param != "avx512-one-panel")
    yield request.param
    host_kernels.set_two_panel_tiles(True)
    host_kernels.set_avx512_tiles(before)


@needs_kernels
@pytest.mark.parametrize("values", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("in_features,out_features",
                         [(1, 1), (7, 5), (16, 16), (8, 20), (33, 47), (64, 256), (256, 768)])
def test_panel_products_equal_numpy(in_features, out_features, values, tiles):
    """Every row count the host forward gives the kernel (0 to 17, 25, 28, 29, 33, 37 and 64: tiles of 6,
    14 or 16 and their remainders), widths that are and are not multiples of 16 or 32 (pairs of panels,
    a last odd one, a partial second one), written and accumulated; float32, bfloat16 and float16 panels (the
    latter two of such values: the same sums, bit for bit, as float32 panels of those values); every kind of
    tiles."""
    rng = np.random.default_rng(in_features * 1000 + out_features)
    weight = _ROUNDED[values](rng.standard_normal((in_features, out_features)).astype(np.float32))
    bf16 = values != "f32"  # (whether to compare with float32 panels of the same values)
    if bf16:
        as_float32 = PanelWeight(weight)
    panel = _packed(weight, values)  # (AMX panels: test_amx_products_*)
    assert panel.panels.dtype == {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}[values]
    assert panel.panels.nbytes == (4 if values == "f32" else 2) * panel.panels.size
    for rows in [*range(0, 18), 25, 28, 29, 33, 37, 64]:
        x = rng.standard_normal((rows, in_features)).astype(np.float32)
        exact = x.astype(np.float64) @ weight.astype(np.float64)
        out = np.full((rows, out_features), np.nan, dtype=np.float32)
        panel.matmul_into(x, out)
        tolerance = 1e-5 * np.sqrt(in_features) * (1 + np.abs(exact).max(initial=0))
        np.testing.assert_allclose(out, exact, rtol=0, atol=tolerance)
        if bf16:
            same = np.full((rows, out_features), np.nan, dtype=np.float32)
            np.testing.assert_array_equal(out, as_float32.matmul_into(x, same))
        before = rng.standard_normal((rows, out_features)).astype(np.float32)
        out = before.copy()
        panel.matmul_into(x, out, accumulate=True)
        np.testing.assert_allclose(out, before + exact, rtol=0, atol=tolerance + 1e-6)


@needs_kernels
@pytest.mark.parametrize("values", ["f32", "bf16", "f16"])
def test_a_rows_products_do_not_depend_on_the_row_count_nor_the_tiles(values):
    """Every tile sums each output over k in one accumulator, in order, whatever its height and panel
    count, so a row's products are the same bits in a product of 1 row, of 5 (a block's pass) or of
    102 (a batch), with the AVX-512 tiles of one or two panels and with the AVX2 tiles: a token's
    logits do not depend on what else the pass holds. The comparison can fail: before, the tiles of
    1-3, 4-7 and 8+ rows split k into 4, 2 and 1 sets of sums, and rows differed in the last bits
    between those groups (scripts/product_row_invariance.py)."""
    import gbv.engine.host_kernels as host_kernels
    rng = np.random.default_rng(7)
    weight = _ROUNDED[values](rng.standard_normal((768, 300)).astype(np.float32))  # (300: not a multiple of 4)
    panel = _packed(weight, values)
    x = rng.standard_normal((102, 768)).astype(np.float32)
    had_avx512 = host_kernels.avx512_tiles()
    kinds = ("two", "one", "avx2") if had_avx512 else ("avx2",)
    products = {}
    try:
        for kind in kinds:
            host_kernels.set_two_panel_tiles(kind == "two")
            host_kernels.set_avx512_tiles(kind != "avx2")
            for rows in (1, 2, 3, 4, 5, 7, 8, 13, 14, 15, 25, 29, 64, 102):
                products[kind, rows] = (panel.matmul_into(x[:rows], np.empty((rows, 300), dtype=np.float32)),
                                        panel.matmul_into(x[:rows], np.ones((rows, 300), dtype=np.float32),
                                                          accumulate=True))
    finally:
        host_kernels.set_two_panel_tiles(True)
        host_kernels.set_avx512_tiles(had_avx512)
    reference = products[kinds[0], 102]
    for (kind, rows), (written, added) in products.items():
        np.testing.assert_array_equal(written, reference[0][:rows], err_msg=f"{kind} tiles, {rows} rows")
        np.testing.assert_array_equal(added, reference[1][:rows], err_msg=f"{kind} tiles, {rows} rows")


def test_bf16_panels_hold_the_values_in_the_kernels_column_order():
    """Each stored bf16 panel row is the top half of each float32 weight, columns in the order the
    kernel's widening gives back as 0..15 (0-3, 8-11, 4-7, 12-15); weights that are not bf16 values
    are refused (the panels never round)."""
    weight = _bf16_values(np.arange(3 * 20, dtype=np.float32).reshape(3, 20) * 0.37 + 1)
    panel = PanelWeight(weight, bf16=True, amx=False)
    assert panel.panels.shape == (2, 3, 16)
    widened = (panel.panels.astype(np.uint32) << 16).view(np.float32)
    order = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    np.testing.assert_array_equal(widened[0][:, order.index(5)], weight[:, 5])
    np.testing.assert_array_equal(widened[1][:, order.index(3)], weight[:, 19])
    assert not widened[1][:, [order.index(c) for c in range(4, 16)]].any()  # padding
    with pytest.raises(ValueError, match="bfloat16 values"):
        PanelWeight(weight + np.float32(1e-3), bf16=True)
    one_bit_off = weight.copy()
    one_bit_off.view(np.uint32)[-1, -1] |= 1  # (the last value only: the whole matrix is checked)
    for amx in (False, True) if host_kernels.amx_products() else (False,):
        with pytest.raises(ValueError, match="bfloat16 values"):
            PanelWeight(one_bit_off, bf16=True, amx=amx)


needs_amx = pytest.mark.skipif(host_kernels_unavailable() is not None or not host_kernels._host_kernels.amx(),
                               reason="the AMX products do not run here (no AMX-BF16, or no kernels)")


@needs_amx
@pytest.mark.parametrize("in_features,out_features",
                         [(1, 1), (7, 5), (16, 16), (33, 47), (64, 256), (64, 48), (256, 768), (768, 256)])
def test_amx_products_equal_numpy_of_rounded_inputs(in_features, out_features):
    """The AMX products: every row count (0 to 17, 31-33, 64, 100: one tile of rows or two, a last
    partial one), widths with an odd last panel or a partial one, K not a multiple of 32, written and
    accumulated, equal bf16(x) @ W to float32 rounding. The check can fail: x itself (not rounded)
    is further off than the tolerance at K >= 16."""
    rng = np.random.default_rng(in_features * 1000 + out_features + 1)
    weight = _bf16_values(rng.standard_normal((in_features, out_features)).astype(np.float32))
    panel = PanelWeight(weight, bf16=True, amx=True)
    assert panel.kind == host_kernels.PANELS_AMX
    missed = []
    for rows in [*range(0, 18), 31, 32, 33, 64, 100]:
        x = rng.standard_normal((rows, in_features)).astype(np.float32)
        exact = _bf16_values(x).astype(np.float64) @ weight.astype(np.float64)
        tolerance = 1e-5 * np.sqrt(in_features) * (1 + np.abs(exact).max(initial=0))
        out = np.full((rows, out_features), np.nan, dtype=np.float32)
        panel.matmul_into(x, out)
        np.testing.assert_allclose(out, exact, rtol=0, atol=tolerance)
        before = rng.standard_normal((rows, out_features)).astype(np.float32)
        accumulated = panel.matmul_into(x, before.copy(), accumulate=True)
        np.testing.assert_allclose(accumulated, before + exact, rtol=0, atol=tolerance + 1e-6)
        unrounded = x.astype(np.float64) @ weight.astype(np.float64)
        missed.append(rows > 0 and np.abs(out - unrounded).max() > tolerance)
    assert any(missed) or in_features < 16


@needs_amx
def test_an_amx_rows_products_do_not_depend_on_the_row_count():
    """One row goes through the tiles too (a tile of one row), so a row's AMX products are the same bits
    in a product of 1 row as of 2, 5, 16, 17 or 40. The comparison can fail: AVX512-BF16 dot products,
    which one row took before, round otherwise than the tiles."""
    rng = np.random.default_rng(11)
    weight = _bf16_values(rng.standard_normal((256, 200)).astype(np.float32))
    panel = PanelWeight(weight, bf16=True, amx=True)
    x = rng.standard_normal((40, 256)).astype(np.float32)
    whole = panel.matmul_into(x, np.empty((40, 200), dtype=np.float32))
    for rows in (1, 2, 5, 16, 17, 33):
        np.testing.assert_array_equal(panel.matmul_into(x[:rows], np.empty((rows, 200), dtype=np.float32)),
                                      whole[:rows], err_msg=f"{rows} rows")


def test_amx_panels_hold_pairs_of_k_per_column():
    """The AMX layout: panels in pairs (the odd last one paired with zeros), K padded to 32, and per
    pair and step of 32 values of k, one (16, 32) block per panel whose row j holds W[k + 2j, c] and
    W[k + 2j + 1, c] side by side for each of the panel's 16 columns c. Only bfloat16 weights."""
    weight = _bf16_values(np.arange(40 * 20, dtype=np.float32).reshape(40, 20) * 0.37 + 1)
    panel = PanelWeight(weight, bf16=True, amx=True)
    assert panel.kind == host_kernels.PANELS_AMX
    assert panel.panels.shape == (1, 2, 2, 16, 16, 2)  # (pairs, steps of k, panels, k / 2, columns, 2)
    widened = (panel.panels.astype(np.uint32) << 16).view(np.float32)
    assert widened[0, 0, 0, 3, 5, 1] == weight[7, 5]
    assert widened[0, 1, 1, 2, 3, 0] == weight[36, 19]
    assert not widened[0, 1, :, 4:].any() and not widened[0, :, 1, :, 4:].any()  # padding of k and columns
    with pytest.raises(ValueError, match="bf16=True"):
        PanelWeight(weight, amx=True)


@pytest.mark.parametrize("packer", ["c", "numpy"])
def test_f16_panels_hold_the_values_in_column_order(packer, monkeypatch):
    """Each float16 panel row holds the float16 of each weight, in column order, zeros past the last column;
    weights that are not float16 values are refused (the panels never round), one value off anywhere (the
    compiled check's vector part and its tail) or one past float16's range. ``packer="numpy"``: the packing
    of a module without the compiled one."""
    if packer == "c" and host_kernels_unavailable() is not None:
        pytest.skip(host_kernels_unavailable())
    if packer == "numpy":
        monkeypatch.setattr(host_kernels, "_host_kernels", None)
    weight = _f16_values(np.arange(3 * 20, dtype=np.float32).reshape(3, 20) * 0.37 + 1)
    panel = PanelWeight(weight, f16=True)
    assert panel.panels.shape == (2, 3, 16) and panel.panels.dtype == np.float16
    np.testing.assert_array_equal(panel.panels[0].astype(np.float32), weight[:, :16])
    np.testing.assert_array_equal(panel.panels[1][:, :4].astype(np.float32), weight[:, 16:])
    assert not panel.panels[1][:, 4:].any()  # padding
    for row, column in ((0, 0), (1, 7), (2, 19)):
        off = weight.copy()
        off.view(np.uint32)[row, column] |= 1
        with pytest.raises(ValueError, match="float16 values"):
            PanelWeight(off, f16=True)
    with pytest.raises(ValueError, match="float16 values"):
        PanelWeight(np.full((2, 3), 65520.0, dtype=np.float32), f16=True)
    with pytest.raises(ValueError, match="not both"):
        PanelWeight(weight, bf16=True, f16=True)


@pytest.mark.parametrize("kind", ["f32", "bf16", "amx", "f16"])
@pytest.mark.parametrize("in_features,out_features", [(1, 1), (5, 7), (31, 16), (33, 17), (64, 48), (70, 130)])
def test_unpacked_panels_are_the_packed_matrix(kind, in_features, out_features):
    """``PanelWeight.unpacked`` inverts the packing of each kind exactly (what a lean view that keeps its
    panels alone gives torch's products), whatever the padding of K and of the columns; the compiled
    packing and numpy's alike. Control: a matrix one value off is not what the panels unpack to."""
    rng = np.random.default_rng(in_features * 131 + out_features)
    weight = _ROUNDED["bf16" if kind == "amx" else kind](rng.standard_normal((in_features, out_features)).astype(np.float32))
    panel = PanelWeight(weight, bf16=kind in ("bf16", "amx"), amx=kind == "amx", f16=kind == "f16")
    unpacked = panel.unpacked()
    assert unpacked.dtype == np.float32 and unpacked.flags.c_contiguous
    assert unpacked.shape == weight.shape and np.array_equal(unpacked, weight)
    if host_kernels_unavailable() is None:  # (the same panels packed by numpy, the tests' reference)
        reference = PanelWeight.__new__(PanelWeight)
        reference.__dict__.update(panel.__dict__)
        width = 2 * host_kernels.PANEL if kind == "amx" else host_kernels.PANEL
        num_panels = -(-out_features // width) * width // host_kernels.PANEL
        depth = -(-in_features // 32) * 32 if kind == "amx" else in_features
        reference.panels = PanelWeight._packed_by_numpy(weight, kind == "amx", kind in ("bf16", "amx"), num_panels,
                                                        depth)
        if kind == "f16":
            reference.panels = reference.panels.astype(np.float16)
        assert np.array_equal(reference.panels, panel.panels)
        assert np.array_equal(reference.unpacked(), weight)
    off = weight.copy()
    off[-1, -1] = np.nextafter(off[-1, -1], np.float32(np.inf)) if kind == "f32" else off[-1, -1] * 2 + 1
    assert not np.array_equal(panel.unpacked(), off)


@needs_kernels
def test_products_refuse_a_kind_they_cannot_run():
    """A panel kind outside 0-3, and AMX panels where the CPU cannot run them, get one clear ValueError."""
    x, y = np.ones((1, 32), dtype=np.float32), np.zeros((1, 32), dtype=np.float32)
    with pytest.raises(ValueError, match="kind must be"):
        host_kernels._host_kernels.matmul(x, np.zeros(2048, dtype=np.uint16), y, 1, 32, 32, False, 4)
    if not host_kernels._host_kernels.amx():
        with pytest.raises(ValueError, match="AMX"):
            host_kernels._host_kernels.matmul(x, np.zeros(1024, dtype=np.uint16), y, 1, 32, 32, False, 2)
        with pytest.raises(ValueError, match="AMX"):
            host_kernels.set_amx_products(True)


def _reference_attention(q, keys, values, allowed, heads, scale):
    """float64: softmax(scale q k^T) over the allowed slots, times v; (n, heads * D)."""
    n = q.shape[0]
    kv_heads, _, head_dim = keys.shape
    out = np.zeros((n, heads * head_dim))
    for h in range(heads):
        g = h // (heads // kv_heads)
        for i in range(n):
            slots = np.flatnonzero(allowed[i])
            scores = scale * (keys[g, slots].astype(np.float64) @ q[i, h * head_dim:(h + 1) * head_dim])
            weights = np.exp(scores - scores.max())
            out[i, h * head_dim:(h + 1) * head_dim] = weights @ values[g, slots] / weights.sum()
    return out


@needs_kernels
@pytest.mark.parametrize("n,heads,kv_heads,head_dim,start,masked", [
    (1, 8, 8, 32, 300, False),   # one decode query over a long cache
    (1, 2, 2, 8, 0, False),      # the first slot only
    (5, 8, 8, 32, 40, False),    # a causal chain after a prefix
    (4, 4, 4, 16, 0, False),     # a causal chain from slot 0
    (7, 8, 2, 32, 20, True),     # a tree mask, grouped-query attention
    (12, 4, 1, 72, 9, True),     # head_dim not a multiple of 32; one kv head
    (3, 2, 2, 8, 5, True),
    (2, 8, 8, 32, 14, False),    # two queries, 16 slots in all (no tail block)
    (25, 8, 8, 32, 150, True),   # a 25-node tree: query tiles of 4 and a tile of 1
    (9, 4, 2, 64, 10, False),    # a causal chain in query tiles (their later slots weigh 0)
    (13, 2, 2, 32, 0, False),    # the same from slot 0
    (3, 2, 1, 72, 20, False),    # per query, head_dim 72: bf16 columns 32 + 32 + 8
    (2, 2, 2, 48, 30, True),     # per query, head_dim 48: bf16 columns 32 + 16
    (1, 4, 2, 24, 33, False),    # one query, head_dim 24: bf16 columns 16 + 8
])
@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_attention_equals_a_float64_reference(n, heads, kv_heads, head_dim, start, masked, cache):
    """Against float64 over the same cached values; a bfloat16 cache (uint16 bits) is read as the float32
    values it stands for (the per-query path and the tiles read it as it is)."""
    rng = np.random.default_rng(n * 100 + head_dim + start)
    end = start + n
    capacity = end + 3  # slots past the end hold values the kernel must not read
    keys = rng.standard_normal((kv_heads, capacity, head_dim)).astype(np.float32)
    values = rng.standard_normal((kv_heads, capacity, head_dim)).astype(np.float32)
    keys[:, end:] = np.nan
    values[:, end:] = np.nan
    qkv = (2 * rng.standard_normal((n, (heads + 2 * kv_heads) * head_dim))).astype(np.float32)
    if masked:
        allowed = rng.random((n, end)) < 0.4
        allowed[np.arange(n), start + np.arange(n)] = True  # every node sees itself
        values[:, np.flatnonzero(~allowed.any(axis=0))] = 1e30  # a slot no query attends must weigh exactly 0
    else:
        allowed = np.arange(end)[None, :] <= start + np.arange(n)[:, None]
    if cache == "bfloat16":
        keys, values = (torch.from_numpy(a).to(torch.bfloat16) for a in (keys, values))
        cached = [t.view(torch.uint16).numpy() for t in (keys, values)]
        keys, values = keys.float().numpy(), values.float().numpy()  # the values the cache stands for
    else:
        cached = [keys, values]
    out = np.full((n, heads * head_dim), np.nan, dtype=np.float32)
    attention_into(qkv, *cached, out, np.ascontiguousarray(allowed) if masked else None, heads, start, end, 0.3)
    exact = _reference_attention(qkv, keys, values, allowed, heads, 0.3)
    np.testing.assert_allclose(out, exact, rtol=0, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 32), (4, 2, 64), (2, 1, 72), (2, 2, 48), (4, 2, 24)])
@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_a_querys_attention_does_not_depend_on_the_call_nor_the_layout(heads, kv_heads, head_dim, cache):
    """A query's attention is the same bits whether it runs alone or among 3, 7 or 25 queries (the
    per-query path or the tiles), on the AVX-512 or the AVX2 tiles, and whether the slots it attends
    sit after gaps of slots it does not attend (a tree's nodes, a batch row's nodes past other rows'
    longer prefixes) or as one chain with no gap: every sum runs over the list of attended slots in
    order. The comparison can fail: before, the softmax's and the weighted sums' sets of sums went
    by slot index, and the two paths added a key's products over d in different orders."""
    rng = np.random.default_rng(head_dim * 10 + heads)
    prefix, tree, gap = 37, 25, 11  # a committed prefix, a gap of other rows' slots, then a tree's nodes
    end = prefix + gap + tree
    keys, values = (rng.standard_normal((kv_heads, end, head_dim)).astype(np.float32) for _ in range(2))
    qkv = rng.standard_normal((tree, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, tree)]  # node i's parent, a random tree
    allowed = np.zeros((tree, end), dtype=bool)
    allowed[:, :prefix] = True
    for i in range(tree):
        node = i
        while node >= 0:
            allowed[i, prefix + gap + node] = True
            node = parents[node]
    if cache == "bfloat16":
        keys, values = (torch.from_numpy(a).to(torch.bfloat16).view(torch.uint16).numpy() for a in (keys, values))
    width = heads * head_dim
    had_avx512 = host_kernels.avx512_tiles()
    outs = {}
    try:
        for avx512 in ((True, False) if had_avx512 else (False,)):
            host_kernels.set_avx512_tiles(avx512)
            for n in (25, 7, 3, 1):  # the first n nodes in one call: tiles from 6 queries on
                out = np.empty((n, width), dtype=np.float32)
                attention_into(qkv[:n], keys, values, out, np.ascontiguousarray(allowed[:n]), heads, prefix + gap,
                               end, 0.2)
                for i in range(n):
                    outs.setdefault(i, []).append(out[i].copy())
            for i in (0, 1, 5, 24):  # node i as the last of a chain of its attended slots, no mask, no gap
                attended = np.flatnonzero(allowed[i])
                chain_keys, chain_values = (np.ascontiguousarray(a[:, attended]) for a in (keys, values))
                one = qkv[i:i + 1]
                out = np.empty((1, width), dtype=np.float32)
                attention_into(one, chain_keys, chain_values, out, None, heads, len(attended) - 1, len(attended), 0.2)
                outs[i].append(out[0].copy())
    finally:
        host_kernels.set_avx512_tiles(had_avx512)
    for i, found in outs.items():
        for other in found[1:]:
            np.testing.assert_array_equal(other, found[0], err_msg=f"node {i}")


@needs_kernels
@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_attention_tiles_on_avx512_give_the_avx2_tiles_sums_bit_for_bit(cache):
    """Six queries or more: the AVX-512 score tiles and the tile's weighted sums at once add every term
    in the order the AVX2 tiles and the per-query sums do, so the bits are the same (a tree mask, a
    causal chain, grouped-query attention, head_dim 64); no law moves with the CPU's AVX-512."""
    if not host_kernels.avx512_tiles():
        pytest.skip("this CPU has no AVX-512F")
    rng = np.random.default_rng(3)
    outs = {}
    for n, masked in ((6, True), (25, True), (11, False)):
        start, heads, kv_heads, head_dim = 40, 4, 2, 64
        end = start + n
        keys, values = (rng.standard_normal((kv_heads, end, head_dim)).astype(np.float32) for _ in range(2))
        if cache == "bfloat16":
            keys, values = (torch.from_numpy(a).to(torch.bfloat16).view(torch.uint16).numpy() for a in (keys, values))
        qkv = rng.standard_normal((n, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
        allowed = np.ascontiguousarray(rng.random((n, end)) < 0.5) if masked else None
        try:
            for avx512 in (True, False):
                host_kernels.set_avx512_tiles(avx512)
                out = np.empty((n, heads * head_dim), dtype=np.float32)
                outs[n, avx512] = attention_into(qkv, keys, values, out, allowed, heads, start, end, 0.125)
        finally:
            host_kernels.set_avx512_tiles(True)
        np.testing.assert_array_equal(outs[n, True], outs[n, False])


@needs_kernels
def test_kernels_refuse_bad_buffers():
    panel = PanelWeight(np.ones((4, 20), dtype=np.float32))
    with pytest.raises(ValueError, match="y must hold"):
        panel.matmul_into(np.ones((2, 4), np.float32), np.ones((2, 19), np.float32))
    with pytest.raises(ValueError, match="x must hold"):
        host_kernels._host_kernels.matmul(np.ones((2, 3), np.float32), panel.panels, np.ones((2, 20), np.float32),
                                          2, 4, 20, False, False)
    with pytest.raises(ValueError, match="bfloat16 values"):  # float32 panels passed as bf16
        host_kernels._host_kernels.matmul(np.ones((2, 4), np.float32), panel.panels, np.ones((2, 20), np.float32),
                                          2, 4, 20, False, True)
    with pytest.raises(ValueError, match="2-D float32"):
        PanelWeight(np.ones((4, 20)))
    keys = np.zeros((2, 10, 8), np.float32)
    q, out = np.zeros((3, 48), np.float32), np.zeros((3, 16), np.float32)
    with pytest.raises(ValueError, match="slots out of range"):
        attention_into(q, keys, keys, out, None, 2, 8, 11, 1.0)  # end past the capacity
    with pytest.raises(ValueError, match="mask must hold"):
        attention_into(q, keys, keys, out, np.ones((3, 5), bool), 2, 3, 6, 1.0)
    with pytest.raises(ValueError, match="head_dim a multiple of 8"):
        attention_into(np.zeros((1, 12), np.float32), np.zeros((1, 10, 4), np.float32),
                       np.zeros((1, 10, 4), np.float32), np.zeros((1, 4), np.float32), None, 1, 0, 1, 1.0)
    with pytest.raises(ValueError, match="float32, or uint16 holding bfloat16"):
        attention_into(q, keys.astype(np.float64), keys.astype(np.float64), out, None, 2, 8, 9, 1.0)
    with pytest.raises(ValueError, match="bfloat16"):  # values of half the keys' size
        attention_into(q, np.zeros((2, 10, 8), np.uint16), np.zeros((2, 10, 4), np.uint16), out, None, 2, 0, 3, 1.0)


@needs_kernels
def test_host_forward_uses_the_kernels_only_where_it_can(monkeypatch):
    """On one thread with the extension: both kernels. GBV_HOST_KERNELS=0: neither (the reason is kept).
    The logits agree either way to float32 rounding."""
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    with_kernels = LeanCausalLM(target).host_forward
    assert with_kernels.panels_off is None and with_kernels.attention_off is None
    monkeypatch.setenv("GBV_HOST_KERNELS", "0")
    without = LeanCausalLM(target).host_forward
    assert without.panels_off == without.attention_off == "GBV_HOST_KERNELS=0"
    monkeypatch.delenv("GBV_HOST_KERNELS")
    gen = torch.Generator().manual_seed(1)
    caches = [forward.lean.new_cache(1, 64) for forward in (with_kernels, without)]
    tokens = torch.randint(0, 48, (1, 9), generator=gen).numpy()
    positions = np.arange(9)[None]
    with torch.inference_mode():
        outs = [forward(tokens, positions, 0, cache, None, causal=True) for forward, cache in
                zip((with_kernels, without), caches)]
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)
    for layer in range(len(caches[0].keys)):  # the same keys and values written either way
        torch.testing.assert_close(caches[0].keys[layer][:, :, :9], caches[1].keys[layer][:, :, :9], atol=2e-5, rtol=0)
        torch.testing.assert_close(caches[0].values[layer][:, :, :9], caches[1].values[layer][:, :, :9], atol=2e-5,
                                   rtol=0)


def test_without_the_extension_the_host_forward_keeps_torch(monkeypatch):
    """A machine where the extension did not build: the reason is said, and the forward still runs."""
    monkeypatch.setattr(host_kernels, "_host_kernels", None)
    assert "not built" in host_kernels_unavailable()
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    forward = LeanCausalLM(target).host_forward
    assert "not built" in forward.panels_off and "not built" in forward.attention_off
    cache = forward.lean.new_cache(1, 16)
    with torch.inference_mode():
        logits = forward(np.array([[1, 2, 3]]), np.arange(3)[None], 0, cache, None, causal=True)
    assert logits.shape == (1, 3, 48) and torch.isfinite(logits).all()


@needs_kernels
def test_compiled_draw_equals_draw_rows():
    """The same generator state gives the same token as draw_rows, row for row: normalised and
    unnormalised rows, zero masses (never drawn), tiny totals, expanded (non-contiguous) rows, V = 1."""
    from gbv.engine.host_kernels import draw_rows_host
    from gbv.verify.common import draw_rows

    rng = np.random.default_rng(0)
    first, second = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    drawn = 0
    for trial in range(600):
        vocab = 4096 if trial % 7 == 0 else int(rng.integers(1, 40))
        probs = torch.from_numpy(rng.random((int(rng.integers(1, 5)), vocab)).astype(np.float32))
        probs[torch.from_numpy(rng.random(probs.shape) < 0.5)] = 0.0
        probs[:, 0] += (probs.sum(-1) == 0).float()
        if trial % 3 == 0:
            probs = probs / probs.sum(-1, keepdim=True)
        if trial % 5 == 0:
            probs = probs * 1e-30
        if trial % 11 == 0:
            probs = probs[:1].expand(3, -1)
        expected, got = draw_rows(probs, first), draw_rows_host(probs, second)
        assert torch.equal(expected, got), (trial, expected, got)
        assert bool((probs.gather(-1, got[:, None]) > 0).all())  # a token of mass 0 is never drawn
        drawn += len(got)
    assert drawn > 1000
    assert draw_rows_host(torch.ones(2, 3, dtype=torch.float64), first) is None  # not float32: not here


@needs_kernels
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_compiled_softmax_equals_torch_and_draws_by_the_rule(temperature):
    """softmax_into: torch's softmax of logits / T to float rounding (rows that sum to 1, strided
    rows, V not a multiple of 8, -inf logits at 0 and never drawn, a dominant logit); its draws are
    draw_rows' rule on the probabilities it wrote, row for row, and a single row with a float uniform
    returns the same token."""
    from gbv.engine.host_kernels import softmax_into

    rng = np.random.default_rng(1)
    for trial in range(60):
        vocab = 4096 if trial % 10 == 0 else int(rng.integers(1, 70))
        rows = int(rng.integers(1, 5))
        wide = (rng.standard_normal((rows, vocab + 3)) * rng.choice([0.1, 3.0, 30.0])).astype(np.float32)
        if trial % 4 == 0 and vocab > 1:
            wide[:, 1] = -np.inf
        if trial % 6 == 0:
            wide[:, 0] = 80.0
        logits = wide[:, :vocab]  # strided rows, as the engine's first V of a wider head
        probs = np.empty((rows, vocab), np.float32)
        u = rng.random(rows)
        tokens = np.empty(rows, np.int64)
        softmax_into(logits, temperature, probs, u, tokens)
        expected = torch.softmax(torch.from_numpy(logits.copy()) / temperature, -1)
        torch.testing.assert_close(torch.from_numpy(probs), expected, rtol=2e-6, atol=1e-9)
        assert np.allclose(probs.sum(-1), 1.0, atol=1e-5)
        if trial % 4 == 0 and vocab > 1:
            assert (probs[:, 1] == 0).all() and (tokens != 1).all()
        reference = np.empty(rows, np.int64)
        host_kernels._host_kernels.draw_rows(probs, u, reference, rows, vocab, host_kernels.BELOW_ONE)
        assert (tokens == reference).all()
        assert softmax_into(logits[:1], temperature, u=float(u[0])) == tokens[0]



@pytest.mark.parametrize("config", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.0, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9)],
                         ids=["T1", "T0.7", "greedy", "top-k", "top-p"])
def test_draws_of_many_rows_equal_a_draw_a_row(config):
    """sampling.draw_tokens (a batch step's plain rows, one call) gives each row what draw_token gives it
    alone from its own random source, and leaves every source where draw_token leaves it: sampled rows
    (one compiled call where the kernels are built), greedy ones (one argmax), and top-k / top-p (a call a
    row). Rows with a dominant logit, tied maxima and -inf logits; strided rows."""
    from gbv.engine.sampling import SamplingConfig, draw_token, draw_tokens
    from gbv.verify.common import TorchRandom

    sampling = SamplingConfig(*config)
    rng = np.random.default_rng(3)
    for trial in range(30):
        rows, vocab = int(rng.integers(1, 18)), int(rng.choice([7, 300, 4096]))
        wide = torch.from_numpy((rng.standard_normal((rows, 2, vocab + 5)) * rng.choice([0.3, 4.0])).astype(np.float32))
        wide[0, 0, 2] = 50.0
        wide[rows - 1, 0, :2] = 9.0  # tied maxima (greedy takes the first)
        wide[rows // 2, 0, 1] = -float("inf")
        logits = wide[:, 0, :vocab]
        alone = [TorchRandom(seed=100 * trial + r) for r in range(rows)]
        together = [TorchRandom(seed=100 * trial + r) for r in range(rows)]
        expected = [draw_token(logits[r], sampling, alone[r]) for r in range(rows)]
        assert draw_tokens(logits, sampling, together) == expected, trial
        assert [a.uniform() for a in alone] == [t.uniform() for t in together]  # (the sources moved alike)

@needs_kernels
@needs_kernels
def test_compiled_activations_equal_torch():
    """The compiled layers' activations of MLPs without a gate against torch's: the exact GELU (Abramowitz
    and Stegun's erf, within 1.5e-7 of it), its tanh form and ReLU, over [-12, 12] and random values. The
    check tells the two GELUs apart (they differ by up to 5e-4 here)."""
    from gbv.engine.host_kernels import MLP_GELU, MLP_GELU_TANH, MLP_RELU, activation_into

    x = np.concatenate([np.linspace(-12, 12, 4801, dtype=np.float32),
                        np.random.default_rng(0).standard_normal(1003).astype(np.float32) * 3, [0.0, -0.0]])
    x = x.astype(np.float32)
    t = torch.from_numpy(x)
    expected = {MLP_GELU: torch.nn.functional.gelu(t), MLP_GELU_TANH: torch.nn.functional.gelu(t, approximate="tanh"),
                MLP_RELU: torch.relu(t)}
    for mlp, want in expected.items():
        got = torch.from_numpy(activation_into(x, np.empty_like(x), mlp))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (expected[MLP_GELU] - expected[MLP_GELU_TANH]).abs().max() > 1e-4  # (the check's control)
    with pytest.raises(ValueError, match="mlp must be"):
        activation_into(x, np.empty_like(x), 0)


@needs_kernels
def test_soft_cap_equals_torch_near_zero_too():
    """Gemma 2's soft cap, ``cap * tanh(x / cap)``, against float64 over [-40 cap, 40 cap], near 0 and about
    the switch at |x / cap| = 0.625: within 3 float32 ulp of the value (tanhf's 2, and the division by the cap and
    the product with it round too; 2.3 measured), and in place over any length
    (the tail of a length not a multiple of 8 through the same code). The check is strict enough to need the
    small-value polynomial: ``(1 - e) / (1 + e)`` alone, in float32, is off by 1e-4 relative near 0."""
    from gbv.engine.host_kernels import soft_cap_into

    cap = 50.0
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-40 * cap, 40 * cap, 4003), np.geomspace(1e-6, 1.0, 500) * cap,
                        -np.geomspace(1e-6, 1.0, 500) * cap, 0.625 * cap + np.linspace(-1e-3, 1e-3, 41),
                        rng.standard_normal(1001) * cap, [0.0]]).astype(np.float32)
    want = cap * np.tanh(x.astype(np.float64) / cap)
    got = soft_cap_into(x.copy(), cap).astype(np.float64)
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= 3 * ulp + 1e-30)
    for length in (1, 7, 9, 23):  # (the tail)
        part = x[:length].copy()
        np.testing.assert_array_equal(soft_cap_into(part, cap), soft_cap_into(x.copy(), cap)[:length])
    # the control: the large-value form alone near 0
    small = (np.geomspace(1e-6, 1e-2, 50) * cap).astype(np.float32)
    e = np.exp(np.float32(-2) * (small / np.float32(cap)))
    naive = np.float32(cap) * (np.float32(1) - e) / (np.float32(1) + e)
    exact = cap * np.tanh(small.astype(np.float64) / cap)
    assert np.max(np.abs(naive - exact) / exact) > 1e-4
    with pytest.raises(ValueError, match="above 0"):
        soft_cap_into(x.copy(), 0.0)


@pytest.mark.parametrize("arch", ["llama", "gptneox", "gpt2", "phi"])
@pytest.mark.parametrize("bf16", [False, True])
def test_one_call_forward_equals_the_call_per_layer(bf16, arch):
    """The host forward of one sequence as one compiled call (layer_panels) against one call per layer
    (layer_panels None): chains, tree masks, several queries, last only, a sequence in the second row of
    a two-row cache; the logits agree to float32 rounding (the final norm sums in float64 there) and the
    caches hold the same keys and values. Llama, and layers of the other families (GPT-NeoX: LayerNorms,
    parallel blocks, biases; GPT-2: learned positions, no rotation; Phi: a shared norm, a head bias)."""
    if host_kernels_unavailable() is not None:
        pytest.skip(host_kernels_unavailable())
    target, _ = hf_pair(arch, vocab=48, seed=5, target_size=(64, 2))
    if bf16:
        target = target.to(torch.bfloat16)
    one, per_layer = LeanCausalLM(target).host_forward, LeanCausalLM(target).host_forward
    assert one.layer_panels is not None
    per_layer.layer_panels = None
    gen = torch.Generator().manual_seed(2)
    caches = [forward.lean.new_cache(2, 64) for forward in (one, per_layer)]
    with torch.inference_mode():
        start = 0
        for n, masked, last_only, row in [(6, False, True, 0), (1, False, False, 0), (5, True, False, 0),
                                          (3, False, False, 1), (4, True, True, 1)]:
            tokens = torch.randint(0, 48, (1, n), generator=gen).numpy()
            positions = (start + np.arange(n))[None]
            mask = _random_mask(n, start, gen) if masked else None
            outs = [forward(tokens, positions, start, cache, mask, causal=not masked, last_only=last_only,
                            first_row=row) for forward, cache in zip((one, per_layer), caches)]
            torch.testing.assert_close(outs[0], outs[1], atol=2e-6, rtol=1e-6)
            for layer in range(len(caches[0].keys)):
                assert torch.equal(caches[0].keys[layer][row, :, :start + n], caches[1].keys[layer][row, :, :start + n])
                assert torch.equal(caches[0].values[layer][row, :, :start + n],
                                   caches[1].values[layer][row, :, :start + n])
            start += n


@needs_kernels
@pytest.mark.parametrize("one_call", [True, False])
def test_a_bfloat16_cache_holds_the_new_keys_rounded_as_torch_rounds(one_call):
    """A bfloat16 model's cache is bfloat16; the kernels write each new key and value rounded to nearest
    even, bit for bit what torch's ``.to(torch.bfloat16)`` gives for the float32 values the layer
    computed (the last layer's, left in the work buffer); a cache that truncated would differ."""
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    lean = LeanCausalLM(target.to(torch.bfloat16))
    forward = lean.host_forward
    assert lean.cache_dtype == torch.bfloat16
    if not one_call:
        forward.layer_panels = None
    cache = lean.new_cache(1, 32)
    gen = torch.Generator().manual_seed(4)
    start = 0
    with torch.inference_mode():
        for n, masked in [(9, False), (1, False), (4, True), (1, False)]:
            tokens = torch.randint(0, 48, (1, n), generator=gen)
            mask = _random_mask(n, start, gen) if masked else None
            lean.forward(tokens, torch.arange(start, start + n)[None], start, cache, mask, causal=not masked)
            rows = forward.rows(1, n)
            for stored, new in ((cache.keys[-1], rows.new_k), (cache.values[-1], rows.new_v)):
                rounded = torch.from_numpy(np.ascontiguousarray(new[0])).to(torch.bfloat16)
                assert torch.equal(stored[0, :, start:start + n].view(torch.uint16), rounded.view(torch.uint16))
                truncated = (torch.from_numpy(np.ascontiguousarray(new[0])).view(torch.int32) >> 16).to(torch.int16)
                assert not torch.equal(stored[0, :, start:start + n].view(torch.int16), truncated)
            start += n


def _random_mask(n: int, prefix: int, gen: torch.Generator) -> torch.Tensor:
    """(1, 1, n, prefix + n) bool: every query sees the prefix and a random set of the earlier queries."""
    from gbv.engine.tree import prefix_then

    own = torch.rand(n, n, generator=gen) < 0.5
    own = (own.tril(-1) | torch.eye(n, dtype=torch.bool))
    return prefix_then(own, prefix)


@needs_kernels
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_sampled_forward_draws_what_process_logits_and_sample_give(temperature):
    """LeanCausalLM.sampled_chain / sampled_tips (forward, softmax and draw in one call) and
    sampled_probs (a block's or a tree's pass) against the forward, then process_logits and the draw
    rule on the same uniforms: the same probabilities, the same tokens (greedy: the first argmax, a
    one-hot row)."""
    from gbv.engine.sampling import SamplingConfig, process_logits
    from gbv.verify.common import TorchRandom
    from gbv.engine.tree import prefix_then

    target, _ = hf_pair("llama", vocab=48, seed=7, target_size=(64, 2))
    lean = LeanCausalLM(target)
    config = SamplingConfig(temperature)
    vocab = 40  # the first 40 of the head's 48 logits, as a pair with a smaller draft vocabulary
    sampled_cache, plain_cache = lean.new_cache(1, 64), lean.new_cache(1, 64)
    ours, theirs = TorchRandom(torch.Generator().manual_seed(4)), TorchRandom(torch.Generator().manual_seed(4))
    with torch.inference_mode():
        for start, ids in [(0, [3, 1, 4, 1, 5]), (5, [9]), (6, [2, 6])]:
            probs = torch.empty(vocab)
            token = lean.sampled_chain(ids, start, sampled_cache, vocab, config, ours, probs)
            logits = lean.chain(ids, start, plain_cache)[0, -1, :vocab]
            expected = process_logits(logits, config)
            torch.testing.assert_close(probs, expected, rtol=0, atol=0)
            if temperature == 0.0:
                assert token == int(logits.argmax())
            else:
                reference = np.empty(1, np.int64)
                host_kernels._host_kernels.draw_rows(expected[None].numpy(), np.array([theirs.uniform()]), reference, 1,
                                                     vocab, host_kernels.BELOW_ONE)
                assert token == reference[0]
        rows, start = 3, 8
        tips = torch.tensor([7, 8, 9])
        mask = prefix_then(torch.eye(rows, dtype=torch.bool), start)
        probs = torch.empty(rows, 2, vocab)[:, 1]  # strided rows, as q[:, i]
        uniforms = torch.from_numpy(ours.uniforms(rows))[:, None]
        drawn = lean.sampled_tips(tips, start, start, sampled_cache, mask, vocab, config, uniforms, probs)
        logits = lean.forward(tips[None], torch.full((1, rows), start), start, plain_cache, mask)[0, :, :vocab]
        expected = process_logits(logits, config)
        torch.testing.assert_close(probs, expected, rtol=0, atol=0)
        if temperature == 0.0:
            assert torch.equal(drawn, logits.argmax(-1))
        else:
            reference = np.empty(rows, np.int64)
            host_kernels._host_kernels.draw_rows(np.ascontiguousarray(expected.numpy()), theirs.uniforms(rows),
                                                 reference, rows, vocab, host_kernels.BELOW_ONE)
            assert drawn.tolist() == reference.tolist()
        # the target's passes: a block (a chain) and a tree, probabilities only
        got = lean.sampled_probs([5, 6, 7], None, 11, sampled_cache, None, vocab, config)
        logits = lean.chain([5, 6, 7], 11, plain_cache, last_only=False)[0, :, :vocab]
        torch.testing.assert_close(got, process_logits(logits, config), rtol=0, atol=0)
        ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        tree, depth, mask = torch.tensor([2, 3, 4]), torch.tensor([14, 15, 15]), prefix_then(ancestors, 14)
        got = lean.sampled_probs(tree, depth, 14, sampled_cache, mask, vocab, config)
        logits = lean.forward(tree[None], depth[None], 14, plain_cache, mask)[0, :, :vocab]
        torch.testing.assert_close(got, process_logits(logits, config), rtol=0, atol=0)


@needs_kernels
def test_one_call_kernels_refuse_bad_input(monkeypatch):
    from gbv.engine.host_kernels import softmax_into

    with pytest.raises(ValueError, match="logits must be"):
        host_kernels._host_kernels.softmax_draw(np.ones((2, 5), np.float32), None, None, None, 2, 6, 1.0, 0.9)
    with pytest.raises(ValueError, match="float32"):
        softmax_into(np.ones((2, 5)), 1.0)  # float64
    with pytest.raises(ValueError, match="together"):
        softmax_into(np.ones((2, 5), np.float32), 1.0, u=np.ones(2))
    with pytest.raises(ValueError, match="temperature > 0"):
        softmax_into(np.ones((1, 5), np.float32), 0.0)
    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    forward = LeanCausalLM(target).host_forward
    cache = forward.lean.new_cache(1, 16)
    with torch.inference_mode(), pytest.raises(ValueError, match="out of range"):
        forward(np.array([[48]]), np.array([[0]]), 0, cache, None, causal=True)  # no token 48
    embed = forward.embed
    for short in (embed.view(np.uint16)[:, :-1].copy(), embed.astype(np.float16)[:, :-1].copy()):
        forward.embed = short  # (bfloat16 bits, float16: a row one value short of H)
        with torch.inference_mode(), pytest.raises(ValueError, match="embed and position rows must be"):
            forward(np.array([[1]]), np.array([[0]]), 0, cache, None, causal=True)
    forward.embed = embed
    with monkeypatch.context() as patch:  # (a kind of embedding rows the compiled forward does not know)
        patch.setitem(host_kernels.EMBED_KINDS, np.dtype(np.float32), 3)
        with torch.inference_mode(), pytest.raises(ValueError, match="embed_kind must be"):
            forward(np.array([[1]]), np.array([[0]]), 0, cache, None, causal=True)
    panels = forward.layer_panels
    broken = list(panels)
    broken[0] = broken[0][:7]
    forward.layer_panels = tuple(broken)
    with torch.inference_mode(), pytest.raises(ValueError, match="each layer must be"):
        forward(np.array([[1]]), np.array([[0]]), 0, cache, None, causal=True)
    broken[0] = (*panels[0], None, None, None, 99)  # (a style that names no layer)
    forward.layer_panels = tuple(broken)
    with torch.inference_mode(), pytest.raises(ValueError, match="style must be"):
        forward(np.array([[1]]), np.array([[0]]), 0, cache, None, causal=True)


def test_tile_switches_say_why_where_the_kernels_cannot_run(monkeypatch):
    """Without the compiled kernels, switching their tiles is one clear error, not an AttributeError."""
    import gbv.engine.host_kernels as host_kernels
    monkeypatch.setattr(host_kernels, "_host_kernels", None)
    for switch in (host_kernels.set_two_panel_tiles, host_kernels.set_avx512_tiles, host_kernels.set_amx_products):
        with pytest.raises(ValueError, match="not built"):
            switch(True)


@needs_kernels
@pytest.mark.parametrize("bf16", [False, True])
def test_a_batch_layer_call_equals_the_calls_per_product(bf16, monkeypatch):
    """Several sequences' forward with each layer as one compiled call (lean_host.BATCH_LAYERS: the
    products over all rows, each sequence's attention over its own cache row under its own mask)
    against a call per product and per sequence's attention (the form before): the logits agree to
    float32 rounding and every cache row holds the same keys and values (bf16: within one rounding).
    Negative control: the batch call with the sequences' masks in the wrong rows differs."""
    import gbv.engine.lean_host as lean_host

    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    if bf16:
        target = target.to(torch.bfloat16)
    batch, n, start = 3, 4, 10
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 48, (batch, n), generator=gen).numpy()
    positions = (np.arange(n)[None] + np.array([[4], [9], [7]])).astype(np.int64)  # rows of their own lengths
    mask = torch.cat([_random_mask(n, start, gen) for _ in range(batch)])  # (batch, 1, n, start + n)
    prefix = torch.randint(0, 48, (1, start), generator=gen)

    calls = []
    real = lean_host.layer_into
    monkeypatch.setattr(lean_host, "layer_into", lambda *args, **kw: calls.append(args[14]) or real(*args, **kw))

    def run(batch_layers: bool, rows_mask: torch.Tensor):
        monkeypatch.setattr(lean_host, "BATCH_LAYERS", batch_layers)
        forward = LeanCausalLM(target).host_forward
        cache = forward.lean.new_cache(batch + 1, 64)
        with torch.inference_mode():
            for row in range(batch):
                forward(prefix.numpy(), np.arange(start)[None], 0, cache, None, causal=True, first_row=row + 1)
            logits = forward(tokens, positions, start, cache, rows_mask, first_row=1)
        return logits, cache

    (fused, fused_cache), (split, split_cache) = run(True, mask), run(False, mask)
    assert calls.count(batch) == len(target.model.layers)  # (a batch call a layer, in the first run only)
    torch.testing.assert_close(fused, split, atol=2e-5 if bf16 else 2e-6, rtol=1e-5)
    for store in ("keys", "values"):
        for x, y in zip(getattr(fused_cache, store), getattr(split_cache, store)):
            torch.testing.assert_close(x[1:, :, :start + n].float(), y[1:, :, :start + n].float(),
                                       atol=1e-2 if bf16 else 1e-6, rtol=1e-2 if bf16 else 1e-6)
    swapped, _ = run(True, mask[[1, 2, 0]])
    assert (swapped - split).abs().max() > 1e-3


@needs_kernels
@pytest.mark.parametrize("method,num_paths,block_len", [("traversal", 3, 4), ("gbv", 3, 8), ("block", 1, 6),
                                                       ("specinfer", 4, 5)])
def test_greedy_speculation_commits_greedy_ar_tokens_in_bfloat16(method, num_paths, block_len):
    """A tree pass computes each node's logits as a one-token step computes that token's (the products'
    and the attention's sums in one order whatever the pass holds), so greedy speculative decoding
    commits exactly greedy ``ar``'s tokens in bfloat16 too, where near-ties are common. The
    comparison can fail: before, traversal K = 3, L = 4 went another way at token 5 of this prompt
    (scripts/fuzz_engine.py --mode single --dtype bfloat16, seed 0, trial 137)."""
    import gbv
    from gbv.engine.generate import generate

    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype="bfloat16")
    settings = dict(temperature=0.0, max_new_tokens=64, eos_token_id=[], top_k=100)
    for prompt_ids in ([14, 221], pair.tokenizer.encode("Question: Peter plans to go to the movies this week.")):
        ar = generate(pair, prompt_ids=prompt_ids, method="ar", **settings).token_ids
        speculative = generate(pair, prompt_ids=prompt_ids, method=method, num_paths=num_paths, block_len=block_len,
                               **settings).token_ids
        assert speculative == ar


@pytest.mark.parametrize("bf16", [False, True])
def test_a_batch_step_prefetching_its_values_computes_the_same_bits(bf16, monkeypatch):
    """A batch step whose keys and values pass ``host_kernels.KV_PREFETCH_MIN_BYTES`` prefetches each
    head's values as it scores its keys (layer_into's ``prefetch_values``), one under it does not, and
    the logits and caches are the same bits either way: prefetches move no sum. Checked with the
    threshold at 0 (every batch step prefetches) and at its default (this small model's steps do not)."""
    import gbv.engine.lean_host as lean_host

    target, _ = hf_pair("llama", vocab=48, seed=5, target_size=(64, 2))
    if bf16:
        target = target.to(torch.bfloat16)
    batch, start = 5, 40
    gen = torch.Generator().manual_seed(4)
    prefixes = torch.randint(0, 48, (batch, start), generator=gen).numpy()
    flags = []
    real = lean_host.layer_into
    monkeypatch.setattr(lean_host, "layer_into", lambda *args, **kw: flags.append(args[15]) or real(*args, **kw))

    def run(threshold: int):
        monkeypatch.setattr(host_kernels, "KV_PREFETCH_MIN_BYTES", threshold)
        forward = LeanCausalLM(target).host_forward
        cache = forward.lean.new_cache(batch, 128)
        with torch.inference_mode():
            for row in range(batch):
                forward(prefixes[row:row + 1], np.arange(start)[None], 0, cache, None, causal=True, first_row=row)
            steps, at = [], start
            for step, n in enumerate((1, 1, 3, 7)):  # the per-query path (1-5 queries), then a tile of 7
                tokens = torch.randint(0, 48, (batch, n), generator=torch.Generator().manual_seed(step)).numpy()
                positions = np.tile(np.arange(at, at + n), (batch, 1))
                steps.append(forward(tokens, positions, at, cache, None, causal=True))
                at += n
        return steps, cache

    default = host_kernels.KV_PREFETCH_MIN_BYTES
    flags.clear()
    (eager, eager_cache) = run(0)
    assert flags and all(flags)
    flags.clear()
    (plain, plain_cache) = run(default)
    assert flags and not any(flags)
    for a, b in zip(eager, plain):
        assert torch.equal(a, b)
    for store in ("keys", "values"):
        for x, y in zip(getattr(eager_cache, store), getattr(plain_cache, store)):
            assert torch.equal(x, y)
