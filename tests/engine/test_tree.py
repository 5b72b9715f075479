"""The tree engine (lean forward, token trie, tree masks): exact logits, exact laws, node counts.

The chi-square laws here run through :class:`gbv.engine.tree_decoder.TreeDecoder` on a tiny random
Llama pair (the ``TableLM`` toy of test_exactness.py runs on the plain Hugging Face path).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gbv.engine.lean as lean_module
import gbv.engine.tree_decoder as tree_decoder
from gbv.engine.decoder import engine_for
from gbv.engine.generate import generate
from gbv.engine.host_kernels import host_kernels_unavailable
from gbv.engine.lean import LeanCausalLM, lean_unsupported_reason
from gbv.engine.tree import TokenTree, build_tree, prefix_then
from gbv.verify import METHODS

from engine_toy import ARCHITECTURES, LEAN, hf_pair, sharp_llama_pair
from test_exactness import check

RUNS = 800
CONTROL_RUNS = 1200  # the negative control needs the power


def test_build_tree_merges_shared_prefixes():
    tree = build_tree(9, [[1, 2, 3], [1, 2, 4], [5, 2, 3], [1, 2, 3]])
    # root, 1, 1-2, 1-2-3, 1-2-4, 5, 5-2, 5-2-3
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 5, 2, 3]
    assert tree.depth.tolist() == [0, 1, 2, 3, 3, 1, 2, 3]
    assert tree.path_nodes.tolist() == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 5, 6, 7], [0, 1, 2, 3]]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for node, chain in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [0, 5], [0, 5, 6],
                                  [0, 5, 6, 7]]):
        expected[node, chain] = True
    assert torch.equal(tree.ancestors, expected)
    mask = prefix_then(tree.ancestors, 3)
    assert mask.shape == (1, 1, 8, 11) and bool(mask[..., :3].all())
    assert tree.num_nodes == 8 and build_tree(9, [[1, 2, 3]] * 2, multiple=8).num_nodes == 4


def test_a_padded_tree_is_the_trie_and_padding_nodes_that_see_only_themselves():
    """Padded to a multiple of 8 nodes (static steps: fewer recorded shapes), the trie's part is as
    before; each padding node is its own only ancestor and no path goes through it."""
    paths = [[1, 2], [1, 3], [4, 5]]  # root, 1, 1-2, 1-3, 4, 4-5
    plain, padded = build_tree(9, paths), build_tree(9, paths, multiple=8)
    assert padded.tokens.shape == (8,) and padded.num_nodes == plain.num_nodes == 6
    n = plain.num_nodes
    assert torch.equal(padded.tokens[:n], plain.tokens) and torch.equal(padded.depth[:n], plain.depth)
    assert torch.equal(padded.path_nodes, plain.path_nodes)
    assert torch.equal(padded.ancestors[:n, :n], plain.ancestors) and not padded.ancestors[:n, n:].any()
    assert torch.equal(padded.ancestors[n:], torch.eye(8, dtype=torch.bool)[n:])
    assert build_tree(9, [[1, 2, 3], [1, 2, 4], [5, 2, 3]], multiple=8).tokens.shape == (8,)  # (8 nodes: as is)


@pytest.mark.parametrize("path", ["compiled", "numpy-views", "tensor-path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_moves_through_numpy_views_equal_torch_indexing(dtype, path):
    """KVCache.move through the host forward's numpy views (the CPU) moves what torch indexing moves:
    one row (a commit whose accepted nodes sit apart), several rows (a batch), overlapping source and
    destination slots (the source read whole first), lists or tensors as indices; one row in one
    compiled call for every layer (host_kernels.move_slots) where the kernels run. So does its tensor
    path (what a GPU runs: lists packed into one index tensor, one copy)."""
    if path == "compiled" and host_kernels_unavailable() is not None:
        pytest.skip(host_kernels_unavailable())
    gen = torch.Generator().manual_seed(4)
    cache = lean_module.KVCache(2, 2, 3, 8, 16, dtype, "cpu")  # layers, rows, kv heads, head dim, slots
    for store in (cache.keys, cache.values):
        for tensor in store:
            tensor.copy_(torch.randn(tensor.shape, generator=gen).to(dtype))
    expected = [t.clone() for t in cache.keys + cache.values]
    if path != "tensor-path":
        cache.arrays()  # what the host forward does before any commit
    assert cache._compiled_moves == (host_kernels_unavailable() is None)
    cache._compiled_moves = path == "compiled"

    def torch_move(src, dst, row):
        index = lambda ids: torch.as_tensor(ids, dtype=torch.long)  # noqa: E731
        for tensor in expected:
            row_index = row if isinstance(row, int) else index(row)
            tensor[row_index, :, index(dst)] = tensor[row_index, :, index(src)]

    for src, dst, row in [([5, 7, 9], [4, 5, 6], 0), ([3, 4], [4, 3], 1), ([10, 12], [2, 3], [0, 1]),
                          (torch.tensor([8, 6]), torch.tensor([6, 7]), torch.tensor([1, 1])),
                          ([9, 11, 13, 15], [12, 13, 14, 15], 1), (torch.tensor([2, 1]), torch.tensor([1, 0]), 0)]:
        cache.move(src, dst, row)
        torch_move(src, dst, row)
        assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, expected)), (src, dst, row)
    if path == "compiled":  # a slot or row outside the cache is an error, not a write past it
        for src, dst, row in [([3], [16], 0), ([3], [2], 2), ([-1], [2], 0)]:
            with pytest.raises(ValueError, match="outside the cache"):
                cache.move(src, dst, row)
        assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, expected))


@pytest.mark.parametrize("arch", LEAN)
def test_tree_pass_logits_equal_plain_sequences(arch):
    """Every node of a tree scored over a cached prefix has the logits of prefix + its own path. (On
    the models' device: with GBV_TEST_DEVICE=cuda the trie goes up as one packed copy.)"""
    if arch not in ARCHITECTURES:
        pytest.skip("no Qwen3 in this transformers")
    target, _ = hf_pair(arch, vocab=32, seed=1)
    dev = target.device
    assert lean_unsupported_reason(target) is None
    lean = LeanCausalLM(target)
    prefix = [3, 1, 4, 1, 5]
    paths = [[9, 2, 6], [9, 2, 7], [8, 8, 8]]
    tree = build_tree(prefix[-1], paths, dev)
    with torch.inference_mode():
        cache = lean.new_cache(1, 4)  # too small on purpose: the cache grows
        lean.forward(torch.tensor([prefix[:-1]], device=dev), torch.arange(4, device=dev)[None], 0, cache, None,
                     causal=True)
        logits = lean.forward(tree.tokens[None], (4 + tree.depth)[None], 4, cache, prefix_then(tree.ancestors, 4))[0]
        for k, path in enumerate(paths):
            full = target(input_ids=torch.tensor([prefix + path], device=dev)).logits[0, len(prefix) - 1:]
            torch.testing.assert_close(logits[tree.path_nodes[k]], full, atol=1e-5, rtol=0)
        # The check can fail: laid out as one flat causal sequence, nodes also see their cousins.
        flat = torch.ones(tree.num_nodes, tree.num_nodes, dtype=torch.bool, device=dev).tril()
        wrong = lean.forward(tree.tokens[None], (4 + tree.depth)[None], 4, cache, prefix_then(flat, 4))[0]
        assert (wrong - logits).abs().max() > 1e-3


def test_one_query_without_a_mask_attends_exactly_its_prefix():
    """A 1-token step (``causal``, no mask: ``ar`` and the draft's one-path steps) attends slots
    ``0 .. start`` and nothing after, even when the later slots hold garbage from rolled-back drafts;
    its logits are those of the plain sequence, and those of the same step with an explicit mask."""
    target, _ = hf_pair("llama", vocab=32, seed=3)
    dev = target.device
    lean = LeanCausalLM(target)
    prefix = [3, 1, 4, 1, 5, 9, 2]
    last, position = torch.tensor([prefix[-1:]], device=dev), torch.tensor([[6]], device=dev)
    with torch.inference_mode():
        cache = lean.new_cache(1, 16)
        lean.forward(torch.tensor([prefix[:-1]], device=dev), torch.arange(6, device=dev)[None], 0, cache, None,
                     causal=True)
        for layer in range(len(cache.keys)):  # rejected drafts leave stale entries after the prefix
            cache.keys[layer][:, :, 7:] = 50.0
            cache.values[layer][:, :, 7:] = -50.0
        step = lean.forward(last, position, 6, cache, None, causal=True)[0, -1]
        masked = lean.forward(last, position, 6, cache,
                              torch.ones(1, 1, 1, 7, dtype=torch.bool, device=dev))[0, -1]
        assert torch.equal(step, masked)
        plain = target(input_ids=torch.tensor([prefix], device=dev)).logits[0, -1]
        torch.testing.assert_close(step, plain, atol=1e-5, rtol=0)
        # The check can fail: the same garbage in one attended slot changes the logits.
        cache.keys[0][:, :, 3] = 50.0
        cache.values[0][:, :, 3] = -50.0
        spoiled = lean.forward(last, position, 6, cache, None, causal=True)[0, -1]
        assert (spoiled - step).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases (the addmm branch)
def test_transposed_weight_copies_give_the_same_logits(arch, monkeypatch):
    """The (in, out) copies of the fp32 CPU path and the Hugging Face (out, in) tensors in place
    compute the same forward; bfloat16 and CUDA keep the Hugging Face layout."""
    assert lean_module.transposed_weights_pay(torch.float32, torch.device("cpu"))
    assert not lean_module.transposed_weights_pay(torch.bfloat16, torch.device("cpu"))
    assert not lean_module.transposed_weights_pay(torch.float32, torch.device("cuda"))
    target, _ = hf_pair(arch, vocab=32, seed=2)
    transposed = LeanCausalLM(target)
    assert transposed.transposed and all(m.weight is None for m in transposed.matrices())
    monkeypatch.setattr(lean_module, "transposed_weights_pay", lambda dtype, device: False)
    in_place = LeanCausalLM(target)
    assert not in_place.transposed and in_place.lm_head.weight is target.lm_head.weight
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.inference_mode():
        logits = [lean.forward(tokens, torch.arange(6)[None], 0, lean.new_cache(1, 8), None, causal=True)
                  for lean in (transposed, in_place)]
        reference = target(input_ids=tokens).logits
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[0], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a in LEAN])
@pytest.mark.parametrize("transposed", [True, False])
def test_norm_weights_fold_into_owned_copies_only(arch, transposed, monkeypatch):
    """In float32 each RMSNorm's weight is folded into the copy of the matrix after it (q/k/v and
    gate/up when fused, the LM head when transposed), never into a Hugging Face tensor used in place:
    the model's weights are unchanged and the logits are still Hugging Face's."""
    monkeypatch.setattr(lean_module, "transposed_weights_pay", lambda dtype, device: transposed)
    target, _ = hf_pair(arch, vocab=32, seed=3)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    lean = LeanCausalLM(target)
    assert all(layer.input_norm is None and layer.post_norm is None for layer in lean.layers)
    # an in-place LM head keeps the norm's own weight (OLMo 1's norms have none)
    assert (lean.norm is None) == (transposed or arch == "olmo")
    assert all(torch.equal(tensor, before[name]) for name, tensor in target.state_dict().items())
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    with torch.inference_mode():
        logits = lean.forward(tokens, torch.arange(7)[None], 0, lean.new_cache(1, 8), None, causal=True)
        torch.testing.assert_close(logits, target(input_ids=tokens).logits, atol=1e-5, rtol=0)
    # o_proj is a copy only when transposed; in place it must refuse (and leave the model as it was)
    assert lean_module._fold_norm_weight(lean.layers[0].o, torch.full((lean.layers[0].o.in_features,), 2.0)) \
        == transposed
    assert all(torch.equal(tensor, before[name]) for name, tensor in target.state_dict().items())


def test_rms_norm_matches_hugging_face_in_every_dtype():
    """The lean RMSNorm (vector_norm, addcmul, rsqrt) is Hugging Face's LlamaRMSNorm: float32 to a few
    ulps, and the same cast order (normalise in float32, cast, then scale) in bf16 / float64."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float64, 2e-6)):
        norm = LlamaRMSNorm(64, eps=1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(64, generator=gen) + 0.5)
        for scale in (1e-3, 1.0, 30.0):  # eps matters at the small scale
            x = (torch.randn(3, 5, 64, generator=gen) * scale).to(dtype)
            with torch.no_grad():
                expected = norm(x)
            ours = lean_module._rms_norm(x, norm.weight, 1e-5)
            assert ours.dtype == expected.dtype
            torch.testing.assert_close(ours, expected, atol=tol * max(1.0, float(expected.abs().max())), rtol=0)
            folded = lean_module._rms_norm(x, None, 1e-5) * norm.weight  # the folded form, scaled after
            torch.testing.assert_close(folded, expected, atol=tol * max(1.0, float(expected.abs().max())),
                                       rtol=0)
    x = torch.randn(4, 64, generator=gen) * 1e-3
    wrong_eps = lean_module._rms_norm(x, None, 1e-3)  # negative control: the eps is seen
    assert (wrong_eps - lean_module._rms_norm(x, None, 1e-5)).abs().max() > 1e-2


@pytest.mark.parametrize("hidden_act", ["silu", "gelu", "gelu_new"])
def test_activation_runs_as_a_function_where_it_is_silu(hidden_act):
    """SiLU (the Llama family's) and GELU (GPT-NeoX's) run as ``F.silu`` and ``F.gelu``, without the module
    call; any other activation (here GPT-2's tanh GELU in its Python form) keeps the model's own module.
    All give the Hugging Face logits."""
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, hidden_act=hidden_act, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    lean = LeanCausalLM(target)
    act = lean.layers[0].act
    assert (act is torch.nn.functional.silu) == (hidden_act == "silu")
    assert (act is torch.nn.functional.gelu) == (hidden_act == "gelu")
    if hidden_act == "gelu_new":
        assert act is target.model.layers[0].mlp.act_fn
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.inference_mode():
        logits = lean.forward(tokens, torch.arange(6)[None], 0, lean.new_cache(1, 8), None, causal=True)
        torch.testing.assert_close(logits, target(input_ids=tokens).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_products_of_several_rows_run_in_float32(arch, monkeypatch):
    """Where the CPU has no fast bf16 GEMM, products of >= 3 rows are float32 sums of the bf16 values
    rounded back to bf16 (one or two rows stay bf16); the forward agrees with the all-bf16 one."""
    assert not lean_module.bf16_products_upcast(torch.float32, torch.device("cpu"))
    assert not lean_module.bf16_products_upcast(torch.bfloat16, torch.device("cuda"))
    target, _ = hf_pair(arch, vocab=32, seed=2)
    target = target.to(torch.bfloat16)
    monkeypatch.setenv("GBV_HOST_KERNELS", "0")  # (with them, bf16 runs in float32: test_lean_host.py)
    monkeypatch.setattr(lean_module, "bf16_products_upcast", lambda dtype, device: True)
    upcast = LeanCausalLM(target)
    assert all(m.upcast for m in upcast.matrices())
    gen = torch.Generator().manual_seed(0)
    for matrix in upcast.matrices():
        bias = None if matrix.bias is None else matrix.bias.float()
        for rows in (1, 2, 3, 7):
            x = torch.randn(1, rows, matrix.in_features, generator=gen).to(torch.bfloat16)
            expected = (torch.nn.functional.linear(x.float(), matrix.weight.float(), bias).to(torch.bfloat16)
                        if rows >= 3 else torch.nn.functional.linear(x, matrix.weight, matrix.bias))
            assert torch.equal(matrix(x), expected)
    monkeypatch.setattr(lean_module, "bf16_products_upcast", lambda dtype, device: False)
    plain = LeanCausalLM(target)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.inference_mode():
        logits = [lean.forward(tokens, torch.arange(6)[None], 0, lean.new_cache(1, 8), None, causal=True).float()
                  for lean in (upcast, plain)]
    torch.testing.assert_close(logits[0], logits[1], atol=0.1, rtol=0.05)


def test_unsupported_models_fall_back_to_hf():
    for arch in ("bloom", "falcon"):
        assert engine_for(*hf_pair(arch, vocab=32)) == "hf"
    assert engine_for(*hf_pair("llama", vocab=32)) == "tree"


@pytest.fixture(scope="module")
def llama_toy():
    return sharp_llama_pair()


FAST_METHODS = ("block", "gbv", "traversal")  # one path, greedy selection, trie traversal; the rest are slow


@pytest.mark.parametrize("method", [m if m in FAST_METHODS else pytest.param(m, marks=pytest.mark.slow)
                                    for m in ("ar", *METHODS)])
def test_tree_engine_law(llama_toy, method):
    assert engine_for(llama_toy.target, llama_toy.draft) == "tree"
    stat, threshold = check(llama_toy, RUNS, 1.0, method=method, num_paths=3, block_len=3)
    assert stat < threshold, f"{method}: chi2 {stat:.1f} >= {threshold:.1f}"


def test_tree_engine_law_low_temperature_top_k(llama_toy):
    stat, threshold = check(llama_toy, RUNS, 0.4, top_k=3, method="gbv", num_paths=3, block_len=3)
    assert stat < threshold, f"chi2 {stat:.1f} >= {threshold:.1f}"


def test_negative_control_off_by_one_node_gather_is_caught(llama_toy, monkeypatch):
    """Hand the verifier each position's parent node (an off-by-one in the p gather): the law breaks."""
    real = tree_decoder.build_tree

    def shifted(root, paths, device, multiple=1):
        tree = real(root, paths, device, multiple)
        nodes = torch.cat([tree.path_nodes[:, :1], tree.path_nodes[:, :-1]], dim=1)
        return TokenTree(tree.tokens, tree.depth, nodes, tree.path_nodes_list, tree.ancestors, tree.nodes)

    monkeypatch.setattr(tree_decoder, "build_tree", shifted)
    stat, threshold = check(llama_toy, CONTROL_RUNS, 1.0, method="gbv", num_paths=3, block_len=3)
    assert stat > threshold, f"broken gather not detected: chi2 {stat:.1f} < {threshold:.1f}"


def test_shared_prefixes_are_scored_once(llama_toy):
    """At a low temperature most paths coincide: the target scores far fewer than K(L+1) nodes."""
    out = generate(llama_toy, prompt_ids=[1, 2], method="gbv", num_paths=4, block_len=3, temperature=0.2,
                   max_new_tokens=40, eos_token_id=[], seed=0)
    stats = out.stats
    assert stats.tree_calls > 0 and 1 <= stats.mean_tree_nodes < 0.6 * 4 * (3 + 1)
    hot = generate(llama_toy, prompt_ids=[1, 2], method="gbv", num_paths=4, block_len=3, temperature=3.0,
                   max_new_tokens=40, eos_token_id=[], seed=0).stats
    assert hot.mean_tree_nodes > stats.mean_tree_nodes


def test_packed_to_gives_the_arrays_back():
    """What build_tree hands a GPU (one copy of the four arrays, cut into views there), forced on the
    CPU: the same values, shapes and dtypes as the arrays."""
    import numpy as np

    from gbv.engine.tree import packed_to

    arrays = (np.array([7, 3, 9], dtype=np.int64), np.zeros((0,), dtype=np.int64),
              np.arange(6, dtype=np.int64).reshape(2, 3), np.eye(3, dtype=bool) | np.eye(3, k=-1, dtype=bool))
    out = packed_to(arrays, "cpu")
    assert [t.dtype for t in out] == [torch.long, torch.long, torch.long, torch.bool]
    for tensor, array in zip(out, arrays):
        assert tensor.shape == array.shape and np.array_equal(tensor.numpy(), array)
