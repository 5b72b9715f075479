"""The compiled products on several threads (_host_kernels.c, "Threads for the products";
host_kernels.sync_product_threads): a product of a large weight splits its columns among the threads, so
every output is summed by one thread in one order, and the products, the host forward's logits and a
seed's tokens are the same bits at any thread count. Also where the packed copies are built for models
past PANEL_MAX_PARAMETERS (lean_host.panels_unfit_reason)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import gbv
import gbv.engine.host_kernels as host_kernels
import gbv.engine.lean_host as lean_host
from gbv.engine.host_kernels import PanelWeight, host_kernels_unavailable
from gbv.engine.lean import LeanCausalLM

from gbv.models.loading import ModelPair

from engine_toy import hf_pair

pytestmark = pytest.mark.skipif(host_kernels_unavailable() is not None,
                                reason=f"compiled kernels unavailable: {host_kernels_unavailable()}")


@pytest.fixture
def threads():
    """Sets torch's intra-op threads (which the host forward follows) and the products' for a test, and
    puts both back."""
    before = torch.get_num_threads()

    def use(count: int) -> None:
        torch.set_num_threads(count)
        host_kernels.sync_product_threads()

    yield use
    use(before)


@pytest.fixture(autouse=True)
def threads_always_pay():
    """No verdict against the threads in these tests (pool_judge), which count the products split: two test
    processes on two cores may make the threads not pay. Puts the defaults back after."""
    host_kernels._host_kernels.set_pool_verdict(1e9, 64)
    yield
    host_kernels._host_kernels.set_pool_verdict(1.0, 64)


def _kinds() -> list[tuple[str, bool, bool]]:
    """(name, bf16, amx) of every panel kind this CPU multiplies."""
    kinds = [("float32", False, False), ("bfloat16", True, False)]
    if host_kernels.amx_products() or host_kernels._host_kernels.amx():
        kinds.append(("amx", True, True))
    return kinds


@pytest.mark.parametrize("tiles", ["avx512", "avx2"])
def test_products_on_several_threads_give_one_threads_bits(tiles, threads):
    """Weights of 300-4,096 columns (panels not a multiple of the chunks', nor of four), 1-40 rows, written
    and accumulated, every kind: the products on 2 and 3 threads equal those on one bit for bit, and the
    large ones were split (the count of split products grows); a small weight is not split."""
    had_avx512 = host_kernels.avx512_tiles()
    if tiles == "avx512" and not had_avx512:
        pytest.skip("no AVX-512 tiles on this CPU")
    host_kernels.set_avx512_tiles(tiles == "avx512")
    rng = np.random.default_rng(3)
    try:
        for name, bf16, amx in _kinds():
            for in_features, out_features in [(512, 300), (1024, 1000), (300, 4096)]:
                weight = rng.standard_normal((in_features, out_features)).astype(np.float32)
                if bf16:
                    weight = torch.from_numpy(weight).bfloat16().float().numpy()
                panel = PanelWeight(weight, bf16=bf16, amx=amx)
                for rows in (1, 2, 3, 5, 9, 17, 40):
                    x = rng.standard_normal((rows, in_features)).astype(np.float32)
                    start = rng.standard_normal((rows, out_features)).astype(np.float32)
                    results = {}
                    for count in (1, 2, 3):
                        threads(count)
                        split = host_kernels._host_kernels.split_products()
                        results[count] = (panel.matmul_into(x, np.empty_like(start)),
                                          panel.matmul_into(x, start.copy(), accumulate=True))
                        assert host_kernels._host_kernels.split_products() - split == (0 if count == 1 else 2), \
                            (name, in_features, out_features, rows, count)
                    for count in (2, 3):
                        for got, want in zip(results[count], results[1]):
                            np.testing.assert_array_equal(got, want, err_msg=f"{name} {in_features}x{out_features} "
                                                                            f"{rows} rows, {count} threads")
        threads(2)
        small = PanelWeight(rng.standard_normal((64, 64)).astype(np.float32))  # (16 KB: under POOL_MIN_BYTES)
        split = host_kernels._host_kernels.split_products()
        small.matmul_into(rng.standard_normal((1, 64)).astype(np.float32), np.empty((1, 64), dtype=np.float32))
        assert host_kernels._host_kernels.split_products() == split
    finally:
        host_kernels.set_avx512_tiles(had_avx512)


def test_two_callers_at_once_each_get_their_products(threads):
    """Two Python threads multiplying at once (a server decoding two models): one posts its products to
    the workers, the other multiplies on its own thread meanwhile; both get one thread's bits."""
    threads(2)
    rng = np.random.default_rng(4)
    weights = [PanelWeight(rng.standard_normal((512, 700)).astype(np.float32)) for _ in range(2)]
    xs = [rng.standard_normal((3, 512)).astype(np.float32) for _ in range(2)]
    threads(1)
    want = [w.matmul_into(x, np.empty((3, 700), dtype=np.float32)) for w, x in zip(weights, xs)]
    threads(2)
    failures = []

    def work(index: int) -> None:
        out = np.empty((3, 700), dtype=np.float32)
        for _ in range(300):
            weights[index].matmul_into(xs[index], out)
            if not np.array_equal(out, want[index]):
                failures.append(index)
                return

    workers = [threading.Thread(target=work, args=(index,)) for index in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == []


@pytest.mark.parametrize("arch", ["llama", "gptneox"])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_host_forward_on_two_threads_gives_one_threads_logits(arch, bf16, threads):
    """A toy whose products are split (hidden 256): chains, a tree mask and a batch of two sequences through the
    one-call forward and the batch's layer calls, at one thread and at two: the same logits and caches, bit
    for bit."""
    target, _ = hf_pair(arch, vocab=300, seed=7, target_size=(256, 2))
    if bf16:
        target = target.to(torch.bfloat16)
    threads(1)
    lean = LeanCausalLM(target)
    host = lean.host_forward
    assert host is not None and host.one_call(1)
    gen = torch.Generator().manual_seed(5)
    calls = [(torch.randint(0, 300, (1, 9), generator=gen), None, 0), (torch.randint(0, 300, (1, 1), generator=gen), None, 9),
             (torch.randint(0, 300, (1, 4), generator=gen), torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0],
                                                                          [1, 0, 1, 1]], dtype=torch.bool), 10)]
    results = {}
    for count in (1, 2):
        threads(count)
        split = host_kernels._host_kernels.split_products()
        cache = lean.new_cache(2, 32)
        logits = []
        with torch.inference_mode():
            for tokens, tree, start in calls:
                n = tokens.shape[1]
                mask = None
                if tree is not None:  # (the prefix, then the tree's own mask)
                    mask = torch.cat([torch.ones(n, start, dtype=torch.bool), tree], dim=1)[None, None]
                positions = torch.arange(start, start + n)[None]
                logits.append(host(tokens.numpy(), positions.numpy(), start, cache, mask, causal=mask is None))
            both = torch.randint(0, 300, (2, 3), generator=torch.Generator().manual_seed(1))
            logits.append(host(both.numpy(), np.arange(14, 17)[None].repeat(2, 0), 14, cache, None, causal=True))
        results[count] = (logits, [k.clone() for k in cache.keys], [v.clone() for v in cache.values])
        assert (host_kernels._host_kernels.split_products() > split) == (count > 1)
    for got, want in zip(results[2][0], results[1][0]):
        assert torch.equal(got, want)
    for part in (1, 2):
        for got, want in zip(results[2][part], results[1][part]):
            assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["ar", "block", "gbv"])
def test_a_seed_gives_the_same_tokens_on_one_thread_and_on_two(method, threads):
    """End to end: gbv.generate on a pair whose products are split samples the same tokens for a seed at one
    thread and at two (the logits are the same bits, and so is every draw from them)."""
    target, draft = hf_pair("llama", vocab=300, seed=8, target_size=(256, 2))
    pair = ModelPair(target, draft)
    tokens = {}
    for count in (1, 2):
        threads(count)
        out = gbv.generate(pair, prompt_ids=list(range(5, 25)), method=method, num_paths=2, block_len=4,
                           temperature=1.0, max_new_tokens=24, seed=11, eos_token_id=[])
        tokens[count] = out.token_ids
    assert tokens[1] == tokens[2]


def test_packed_copies_past_the_cap_only_where_they_fit(monkeypatch):
    """Up to PANEL_MAX_PARAMETERS every model gets the packed copies; past it, only where they fit in
    PANEL_MEMORY_SHARE of the memory available, and never where that is unknown."""
    cap = lean_host.PANEL_MAX_PARAMETERS
    monkeypatch.setattr(lean_host, "available_memory", lambda: None)
    assert lean_host.panels_unfit_reason(cap, 4 * cap) is None
    assert "unknown" in lean_host.panels_unfit_reason(cap + 1, 4 * (cap + 1))
    monkeypatch.setattr(lean_host, "available_memory", lambda: 10 * 2**30)
    assert lean_host.panels_unfit_reason(cap + 1, 4 * 2**30) is None
    reason = lean_host.panels_unfit_reason(cap + 1, 6 * 2**30)
    assert "do not fit" in reason and "10.0 GiB" in reason
    monkeypatch.undo()
    available = lean_host.available_memory()  # (Linux's /proc/meminfo here)
    assert available is None or available > 0


class _Sized:
    """A stand-in model of ``count`` parameters on the CPU (an expanded tensor: no memory)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def parameters(self):
        return iter([torch.empty(1).expand(self.count)])


def test_default_threads_keep_torch_on_one_and_split_the_products_of_mid_sized_targets(threads, monkeypatch):
    """By default (``--threads`` not given): a target of up to 30M parameters runs on one thread throughout; one
    of 30-100M keeps torch on one thread (its ops collapse where another process holds a core) and splits its
    compiled products among every core (torch's count as gbv found it, here 3, whatever torch's count at the
    call, and again at a second call); a larger one keeps torch's default, which the products follow. An
    explicit count sets both."""
    from gbv.engine import threads as engine_threads

    monkeypatch.setattr(engine_threads, "_TORCH_THREADS_FOUND", 3)
    torch.set_num_threads(2)
    try:
        assert engine_threads.apply_threads(None, _Sized(8_000_000)) == 1
        assert host_kernels.product_threads() == 1
        for _ in range(2):
            assert engine_threads.apply_threads("auto", _Sized(70_000_000)) == 1
            assert host_kernels.product_threads() == engine_threads.every_core() == 3
        monkeypatch.setattr(engine_threads, "_TORCH_THREADS_FOUND", 100)
        assert engine_threads.every_core() == 64  # (the products' limit)
        torch.set_num_threads(2)
        assert engine_threads.apply_threads(None, _Sized(400_000_000)) == 2
        assert host_kernels.product_threads() == 2
        assert engine_threads.apply_threads(3, _Sized(70_000_000)) == 3
        assert host_kernels.product_threads() == 3
        with pytest.raises(ValueError, match="1 to 64"):
            host_kernels.set_product_threads(0)
    finally:
        host_kernels.set_product_threads(None)


def test_a_large_view_copies_on_every_core_and_folds_on_one(threads, monkeypatch):
    """building_threads: torch on every core while a view of at least 30M parameters copies its weights (the
    count before after it), not for a smaller one, and ``--threads N``'s N where given; the folds' float64
    product (``_widened_product``, whose sums would split among threads) on one thread inside it."""
    from gbv.engine import lean as lean_module
    from gbv.engine import threads as engine_threads

    monkeypatch.setattr(engine_threads, "_TORCH_THREADS_FOUND", 2)
    monkeypatch.setattr(engine_threads, "_requested", None)
    threads(1)
    seen = []
    real = lean_module._widened_blocks

    def spy(*args):
        seen.append(("fold", torch.get_num_threads()))
        return real(*args)

    monkeypatch.setattr(lean_module, "_widened_blocks", spy)
    with engine_threads.building_threads(_Sized(8_000_000)):
        seen.append(torch.get_num_threads())
    with engine_threads.building_threads(_Sized(70_000_000)):
        seen.append(torch.get_num_threads())
        weight, vector = torch.randn(300, 7), torch.randn(7)
        torch.testing.assert_close(lean_module._widened_product(weight, vector), weight.double() @ vector.double())
        seen.append(torch.get_num_threads())
    seen.append(torch.get_num_threads())
    engine_threads.apply_threads(1, _Sized(70_000_000))  # (an explicit count: the build keeps to it)
    try:
        with engine_threads.building_threads(_Sized(70_000_000)):
            seen.append(torch.get_num_threads())
    finally:
        host_kernels.set_product_threads(None)
    assert seen == [1, 2, ("fold", 1), 2, 1, 1]


def test_the_products_run_on_their_own_count_while_torch_keeps_one(threads):
    """set_product_threads: the host forward splits its products on that count whatever torch's (what the
    default gives a 30-100M target), and None follows torch's again."""
    target, _ = hf_pair("llama", vocab=300, seed=7, target_size=(256, 2))
    threads(1)
    lean = LeanCausalLM(target)
    tokens, positions = np.array([[3, 4, 5]]), np.arange(3)[None]
    try:
        host_kernels.set_product_threads(2)
        split = host_kernels._host_kernels.split_products()
        with torch.inference_mode():
            lean.host_forward(tokens, positions, 0, lean.new_cache(1, 8), None, causal=True)
        assert host_kernels._host_kernels.split_products() > split and torch.get_num_threads() == 1
        host_kernels.set_product_threads(None)
        split = host_kernels._host_kernels.split_products()
        with torch.inference_mode():
            lean.host_forward(tokens, positions, 0, lean.new_cache(1, 8), None, causal=True)
        assert host_kernels._host_kernels.split_products() == split
    finally:
        host_kernels.set_product_threads(None)


def test_a_large_target_on_the_compiled_forward_keeps_torch_on_one_thread(threads, monkeypatch):
    """Past 100M parameters (the cap lowered here to the toys' size), the default keeps torch's own count unless
    the target runs on the compiled host forward: then torch takes one thread and the products every core.
    Without a host forward (``GBV_HOST_FORWARD=0``) torch keeps its count."""
    from gbv.engine import threads as engine_threads

    monkeypatch.setattr(engine_threads, "SMALL_MODEL_PARAMETERS", 0)
    monkeypatch.setattr(engine_threads, "SPLIT_MODEL_PARAMETERS", 0)
    monkeypatch.setattr(engine_threads, "_TORCH_THREADS_FOUND", 2)
    try:
        target, draft = hf_pair("llama", vocab=300, seed=9, target_size=(256, 2))
        threads(2)
        assert engine_threads.apply_threads(None, target, draft) == 1
        assert host_kernels.product_threads() == 2
        assert engine_threads.apply_threads(None, target, draft) == 1  # (a second call: torch on one already)
        assert host_kernels.product_threads() == 2
        monkeypatch.setenv("GBV_HOST_FORWARD", "0")
        target, draft = hf_pair("llama", vocab=300, seed=10, target_size=(256, 2))
        threads(2)
        assert engine_threads.apply_threads("auto", target, draft) == 2
        assert host_kernels.product_threads() == 2 and host_kernels._product_threads is None
    finally:
        host_kernels.set_product_threads(None)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")
def test_a_forked_child_multiplies_on_threads_of_its_own(threads):
    """A child forked after the pool has run (a server's worker processes, a DataLoader) starts workers of
    its own: its products on two threads equal one thread's, and it does not wait for the parent's workers."""
    import os

    threads(2)
    rng = np.random.default_rng(6)
    weight = PanelWeight(rng.standard_normal((512, 900)).astype(np.float32))
    x = rng.standard_normal((2, 512)).astype(np.float32)
    want = weight.matmul_into(x, np.empty((2, 900), dtype=np.float32))  # (the parent's pool runs)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report 1 where its products on two threads equal the parent's
        try:
            split = host_kernels._host_kernels.split_products()
            ok = all(np.array_equal(weight.matmul_into(x, np.empty((2, 900), dtype=np.float32)), want)
                     for _ in range(50))
            ok = ok and host_kernels._host_kernels.split_products() == split + 50
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    import select
    import signal

    ready, _, _ = select.select([read], [], [], 60)  # (a child stuck waiting for workers it has not: killed)
    answer = os.read(read, 1) if ready else b"timed out"
    os.close(read)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert answer == b"1"


@pytest.mark.parametrize("bf16", [False, True])
def test_attention_over_a_long_context_on_two_threads_gives_one_threads_bits(bf16, threads):
    """Attention that reads at least 256 KB of cache (a long context, a batch) is split among the threads by
    sequence and kv head: a 600-token prompt into each of two cache rows, then steps of one query, a tree
    and a batch of both rows, give the same logits and caches at one thread and at two, bit for bit (a
    bfloat16 model: a bfloat16 cache)."""
    target, _ = hf_pair("llama", vocab=300, seed=12, target_size=(256, 2))
    if bf16:
        target = target.to(torch.bfloat16)
    threads(1)
    lean = LeanCausalLM(target)
    host = lean.host_forward
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 300, (1, 600), generator=gen).numpy()
    step = torch.randint(0, 300, (2, 4), generator=gen).numpy()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    results = {}
    for count in (1, 2):
        threads(count)
        cache = lean.new_cache(2, 640)
        logits = []
        with torch.inference_mode():
            for row in (0, 1):
                logits.append(host(prompt, np.arange(600)[None], 0, cache, None, causal=True, last_only=True,
                                   first_row=row))
            logits.append(host(step[:1, :1], np.array([[600]]), 600, cache, None))
            mask = torch.cat([torch.ones(4, 601, dtype=torch.bool), tree], dim=1)[None, None]
            logits.append(host(step[:1], np.arange(601, 605)[None], 601, cache, mask))
            logits.append(host(step[:, :1], np.array([[605], [605]]), 605, cache, None))
        results[count] = (logits, [k.clone() for k in cache.keys], [v.clone() for v in cache.values])
    for got, want in zip(results[2][0], results[1][0]):
        assert torch.equal(got, want)
    for part in (1, 2):
        for got, want in zip(results[2][part], results[1][part]):
            assert torch.equal(got, want)


def test_panels_packed_in_c_equal_numpys_packing(threads):
    """PanelWeight packs in one compiled pass, on the products' threads for large weights: the same panels,
    bit for bit, as numpy's padded and transposed copies (the packing a module without ``pack`` uses), for
    every kind, shapes not a multiple of 16, 32 or the chunks', at one thread and at two."""
    rng = np.random.default_rng(8)
    for count in (1, 2):
        threads(count)
        for name, bf16, amx in _kinds():
            for in_features, out_features in [(1, 1), (7, 33), (40, 17), (512, 300), (300, 1000), (1024, 4096)]:
                weight = rng.standard_normal((in_features, out_features)).astype(np.float32)
                if bf16:
                    weight = torch.from_numpy(weight).bfloat16().float().numpy()
                packed = PanelWeight(weight, bf16=bf16, amx=amx)
                width = 32 if amx else 16
                num_panels = -(-out_features // width) * width // 16
                depth = -(-in_features // 32) * 32 if amx else in_features
                want = PanelWeight._packed_by_numpy(weight, amx, bf16, num_panels, depth)
                assert packed.panels.shape == want.shape and packed.panels.dtype == want.dtype
                assert np.array_equal(packed.panels, want), (name, in_features, out_features, count)


def test_products_run_alone_for_a_while_where_the_threads_do_not_pay(threads):
    """A window of split products that took more than the verdict's share of the caller's estimate alone
    (a share of 0: any window) makes the next ones run alone, with the same bits, for a backoff that doubles
    at each verdict against the threads; a share no window reaches never does. Bad settings are refused."""
    kernels = host_kernels._host_kernels
    rng = np.random.default_rng(5)
    weight = rng.standard_normal((512, 1024)).astype(np.float32)
    panel = PanelWeight(weight)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    threads(1)
    want = panel.matmul_into(x, np.empty((3, 1024), np.float32))
    threads(2)
    window = 4
    kernels.set_pool_verdict(0.0, window)
    against, _ = kernels.pool_verdicts()

    def split_until_a_verdict() -> int:
        """Products until the window's verdict, each split; how many. (A product whose chunks the worker took
        every one of is not judged: the caller has no time of its own to estimate from, so this may take more
        than ``window``, on a busy machine.)"""
        split, verdicts = kernels.split_products(), kernels.pool_verdicts()[0]
        for count in range(1, 50 * window):
            np.testing.assert_array_equal(panel.matmul_into(x, np.empty_like(want)), want)
            assert kernels.split_products() - split == count
            if kernels.pool_verdicts()[0] > verdicts:
                assert count >= window
                return count
        raise AssertionError("no verdict against the threads at a share of 0")

    split_until_a_verdict()
    verdicts, alone_left = kernels.pool_verdicts()
    assert verdicts == against + 1 and alone_left > 0
    split = kernels.split_products()
    for _ in range(alone_left):  # (the backoff: alone)
        np.testing.assert_array_equal(panel.matmul_into(x, np.empty_like(want)), want)
    assert kernels.split_products() == split and kernels.pool_verdicts() == (verdicts, 0)
    split_until_a_verdict()  # (split again, and a second verdict with a backoff twice as long)
    assert kernels.pool_verdicts() == (verdicts + 1, 2 * alone_left)

    kernels.set_pool_verdict(1e9, window)
    split = kernels.split_products()
    for _ in range(5 * window):
        np.testing.assert_array_equal(panel.matmul_into(x, np.empty_like(want)), want)
    assert kernels.split_products() - split == 5 * window and kernels.pool_verdicts() == (verdicts + 1, 0)
    for worth, size in ((-1.0, 64), (float("nan"), 64), (0.9, 0)):
        with pytest.raises(ValueError, match="verdict"):
            kernels.set_pool_verdict(worth, size)
