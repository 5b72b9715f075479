"""Static steps (gbv/engine/static_steps.py): the lean forward over fixed buffers and the whole cache,
as CUDA graphs record it. On the CPU they run without capturing (``GBV_CUDA_GRAPHS=static``): the same
buffers and code, so everything but the recording is checked here; under ``GBV_TEST_DEVICE=cuda``
(scripts/gpu_check.sh) the same tests record and replay graphs."""

from __future__ import annotations

import gc

import pytest
import torch

import gbv.engine.static_steps as static_steps
from gbv.engine.generate import all_methods, generate
from gbv.engine.lean import LeanCausalLM
from gbv.errors import GbvError
from gbv.models.loading import ModelPair

from transformers import LlamaConfig, LlamaForCausalLM

from engine_toy import NO_SPECIAL, TEST_DEVICE, hf_pair
from test_lean_host import _random_tree_mask

CAPTURE = TEST_DEVICE.type == "cuda"
MODE = "graph" if CAPTURE else "static"


def _eager_and_static(model):
    """Two lean views of ``model`` on the torch path: eager, and through static steps."""
    eager, static = LeanCausalLM(model), LeanCausalLM(model)
    for lean in (eager, static):
        lean.host_forward = None
    eager.steps = None
    static.steps = static_steps.StaticSteps(static, capture=CAPTURE)
    return eager, static


def _tree_mask(n: int, prefix: int, gen: torch.Generator) -> torch.Tensor:
    return _random_tree_mask(n, prefix, gen).to(TEST_DEVICE)


def _calls(gen: torch.Generator, vocab: int):
    """(tokens, positions, start, mask, causal, last_only) of a decoding-like sequence of forwards:
    a prompt chain, single queries, chains after a prefix, tree passes; shapes repeat, so steps are
    reused (and, on CUDA, recorded at their second call, the suite's GBV_RECORD_AT, and replayed)."""
    def ids(n):
        return torch.randint(0, vocab, (1, n), generator=gen).to(TEST_DEVICE)

    def at(start, n):
        return torch.arange(start, start + n, device=TEST_DEVICE)[None]

    calls = [(ids(6), at(0, 6), 0, None, True, True)]
    start = 6
    for round_ in range(3):
        calls.append((ids(1), at(start, 1), start, None, False, False))
        calls.append((ids(3), at(start + 1, 3), start + 1, None, True, round_ % 2 == 0))
        mask = _tree_mask(5, start + 4, gen)
        depth = mask[0, 0, :, start + 4:].sum(-1) - 1
        calls.append((ids(5), (start + 4 + depth)[None], start + 4, mask, False, False))
        start += 4 + 2  # a committed path of two nodes; the rest is dead and overwritten later
    return calls, start + 5


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen3", torch.float32),
                                        ("llama", torch.bfloat16), ("mistral", torch.float32),
                                        ("gemma2", torch.float32), ("gemma3", torch.bfloat16),
                                        ("phi3", torch.bfloat16), ("granite", torch.float32),
                                        ("smollm3", torch.float32), ("gptneox", torch.float32),
                                        ("gptneox-sequential", torch.bfloat16), ("gpt2", torch.float32),
                                        ("opt", torch.bfloat16), ("gpt-bigcode", torch.float32),
                                        ("starcoder2", torch.float32), ("olmo2", torch.float32),
                                        ("olmo3", torch.bfloat16), ("gptj", torch.float32), ("olmo", torch.float32)])
def test_static_steps_equal_the_eager_forward(arch, dtype):
    """Logits and every cache entry written agree with the eager forward, through a cache that grows
    on the way (its steps dropped and made again). llama: grouped-query attention, interleaved
    rotation in float32; qwen3: q/k norms; bfloat16: the cos/sin rotation; mistral, gemma2, gemma3:
    sliding windows (8 positions) passed (every layer's, some layers'), gemma2's soft caps, gemma3's
    rotation per layer kind; phi3: a partial rotation; granite: its multipliers; smollm3: a layer
    without rotation; gptneox: LayerNorms, biases, attention and MLP in parallel, an MLP without a gate
    (and in bfloat16 the norms unfolded, the layers in sequence); gpt2, opt: learned positions (opt's
    rows offset by 2), no rotation; gpt-bigcode: one kv head; starcoder2: LayerNorms and a window; olmo2, olmo3: q/k norms over all heads,
    norms after each block only; gptj: adjacent pairs turned."""
    target, _ = hf_pair(arch, vocab=40, seed=3, target_size=(64, 2))
    target = target.to(device=TEST_DEVICE, dtype=dtype)
    eager, static = _eager_and_static(target)
    caches = [lean.plain_cache(1, 8) for lean in (eager, static)]  # small on purpose: both grow
    calls, end = _calls(torch.Generator().manual_seed(1), 40)
    atol = 2e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        for tokens, positions, start, mask, causal, last_only in calls:
            outs = [lean.forward(tokens, positions, start, cache, mask, causal=causal, last_only=last_only)
                    for lean, cache in zip((eager, static), caches)]
            torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=atol, rtol=0)
    for layer in range(len(eager.layers)):
        for store in ("keys", "values"):
            a, b = (getattr(cache, store)[layer][:, :, :end].float() for cache in caches)
            torch.testing.assert_close(b, a, atol=atol, rtol=0)
    assert caches[1].capacity > 8 and caches[1].steps  # it grew, and the steps were made again after
    assert set(caches[1].steps) <= {(1, 0, c[0].shape[1], c[3] is not None, c[5]) for c in calls}
    if CAPTURE:
        assert static.steps.captures > 0


def test_batch_rows_through_static_steps():
    """Two of three batch rows (first_row 1), a tree mask per row, then a causal chain of both: as the
    eager forward, on a Llama of 4 query heads over 2 kv heads (the additive mask laid out per kv head
    and row)."""
    torch.manual_seed(4)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                          **NO_SPECIAL)).eval()
    eager, static = _eager_and_static(target.to(TEST_DEVICE))
    caches = [lean.plain_cache(3, 32) for lean in (eager, static)]
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 40, (2, 7), generator=gen).to(TEST_DEVICE)
    with torch.inference_mode():
        for lean, cache in zip((eager, static), caches):
            lean.forward(prompt, torch.arange(7, device=TEST_DEVICE).expand(2, 7), 0, cache, None, causal=True,
                         first_row=1)
        for start in (7, 11, 15):  # the same shape three times: made, (recorded,) replayed
            mask = torch.cat([_tree_mask(4, start, gen) for _ in range(2)])
            depth = mask[:, 0, :, start:].sum(-1) - 1
            tokens = torch.randint(0, 40, (2, 4), generator=gen).to(TEST_DEVICE)
            outs = [lean.forward(tokens, start + depth, start, cache, mask, first_row=1)
                    for lean, cache in zip((eager, static), caches)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
        for start in (19, 22):  # a causal chain of both rows (one mask for both), as a prompt's is
            tokens = torch.randint(0, 40, (2, 3), generator=gen).to(TEST_DEVICE)
            positions = torch.arange(start, start + 3, device=TEST_DEVICE).expand(2, 3)
            outs = [lean.forward(tokens, positions, start, cache, None, causal=True, first_row=1)
                    for lean, cache in zip((eager, static), caches)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
    assert list(caches[1].steps) == [(2, 1, 7, False, False), (2, 1, 4, True, False), (2, 1, 3, False, False)]
    assert static.num_heads == 2 * static.kv_heads == 4


def test_a_step_writing_the_wrong_slots_is_caught(monkeypatch):
    """Negative control: a step whose slots are off by one gives other logits than the eager forward,
    and the comparison above sees it."""
    target, _ = hf_pair("llama", vocab=40, seed=3, target_size=(64, 2))
    eager, static = _eager_and_static(target.to(TEST_DEVICE))
    original = static_steps.StaticStep.__call__

    def off_by_one(self, tokens, positions, start, mask, cache):
        if mask is None and self.n == 1 and start > 0:
            start -= 1  # writes the query's keys over the previous slot, attends one slot fewer
        return original(self, tokens, positions, start, mask, cache)

    monkeypatch.setattr(static_steps.StaticStep, "__call__", off_by_one)
    caches = [lean.plain_cache(1, 64) for lean in (eager, static)]
    calls, _ = _calls(torch.Generator().manual_seed(1), 40)
    gaps = []
    with torch.inference_mode():
        for tokens, positions, start, mask, causal, last_only in calls:
            outs = [lean.forward(tokens, positions, start, cache, mask, causal=causal, last_only=last_only)
                    for lean, cache in zip((eager, static), caches)]
            gaps.append((outs[1] - outs[0]).abs().max().item())
    assert max(gaps) > 1e-2


def test_a_failed_recording_falls_back_to_the_eager_forward(monkeypatch, caplog):
    """Where recording a graph fails (an older torch or driver), the call still returns the eager
    forward's logits, one warning says so, and the model's later forwards run eagerly."""
    target, _ = hf_pair("llama", vocab=40, seed=3, target_size=(64, 2))
    eager, static = _eager_and_static(target.to(TEST_DEVICE))
    static.steps.capture = True  # (on the CPU: as if on CUDA, with a recording that fails)

    def failing(self, cache):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\n(details)")

    monkeypatch.setattr(static_steps.StaticStep, "_capture", failing)
    caches = [lean.plain_cache(1, 32) for lean in (eager, static)]
    one, at = torch.tensor([[5]], device=TEST_DEVICE), torch.tensor([[6]], device=TEST_DEVICE)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="gbv"):
        for lean, cache in zip((eager, static), caches):
            lean.forward(torch.arange(6, device=TEST_DEVICE)[None], torch.arange(6, device=TEST_DEVICE)[None], 0, cache,
                         None, causal=True)
        for _ in range(3):  # made (run unrecorded), recording fails, eager from then on
            outs = [lean.forward(one, at, 6, cache, None) for lean, cache in zip((eager, static), caches)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
    assert static.steps is None
    assert [r.getMessage() for r in caplog.records].count(
        "gbv: recording a CUDA graph failed (CUDA error: operation not permitted when stream is capturing); this "
        "model's forwards run without graphs from now on (GBV_CUDA_GRAPHS=0 skips trying)") == 1


def test_pooled_caches_are_lent_to_one_owner_at_a_time():
    """A live owner keeps its cache; a dead owner's cache is lent again (the smallest that fits), its
    steps with it; capacities are powers of two of at least MIN_CAPACITY slots."""
    target, _ = hf_pair("llama", vocab=40, seed=3, target_size=(64, 2))
    lean = LeanCausalLM(target)
    lean.steps = static_steps.StaticSteps(lean, capture=False)

    class Owner:
        pass

    first, second = Owner(), Owner()
    a = lean.new_cache(1, 100, owner=first)
    b = lean.new_cache(1, 100, owner=second)
    assert a is not b and a.capacity == b.capacity == static_steps.MIN_CAPACITY
    a.steps["marker"] = object()
    del first
    gc.collect()
    third = Owner()
    assert lean.new_cache(1, 600, owner=third) is a and "marker" in a.steps  # lent again, steps kept
    assert lean.new_cache(1, static_steps.MIN_CAPACITY + 1, owner=Owner()).capacity == 2 * static_steps.MIN_CAPACITY
    assert lean.new_cache(2, 10, owner=Owner()).keys[0].shape[0] == 2  # another batch size: another cache
    assert lean.new_cache(1, 10) not in (a, b)  # no owner: a plain cache of its own
    assert lean.new_cache(1, 10).capacity == 10


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_through_static_steps_equals_eager(monkeypatch, temperature, arch):
    """Every method, greedy and sampled with one seed, gives the same tokens through static steps (on a
    GPU: CUDA graphs) as through the eager forward; twice over, the second generation on the pooled
    caches and steps of the first. gemma2: soft caps, and windows (8 positions) on alternate layers,
    passed by the 24 new tokens."""
    monkeypatch.setenv("GBV_HOST_FORWARD", "0")  # (on the CPU: the torch path, where the steps run)
    outputs = {}
    for mode in ("0", MODE):
        monkeypatch.setenv("GBV_CUDA_GRAPHS", mode)
        target, draft = hf_pair(arch, vocab=40, seed=6)  # new models: new lean views, which read the mode
        pair = ModelPair(target=target.to(TEST_DEVICE), draft=draft.to(TEST_DEVICE), tokenizer=None)
        for method in all_methods():
            if method == "auto":  # (its choices follow measured times: runs differ; tests/engine/test_auto.py)
                continue
            for repeat in range(2):
                out = generate(pair, prompt_ids=[1, 2, 3, 4], method=method, num_paths=3, block_len=4,
                               temperature=temperature, max_new_tokens=24, eos_token_id=[], seed=repeat)
                outputs.setdefault((method, repeat), []).append(out.token_ids)
            # a batch (the batch decoder's forwards: several rows, per-row masks over shared slots)
            outs = generate(pair, prompt_ids=[[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]], method=method,
                            num_paths=3, block_len=4, temperature=temperature, max_new_tokens=16, eos_token_id=[],
                            seed=7)
            outputs.setdefault((method, "batch"), []).append([o.token_ids for o in outs])
        if mode != "0":
            from gbv.engine.tree_decoder import lean_model
            assert lean_model(pair.target).steps is not None and lean_model(pair.target).steps._caches
    for key, (eager, static) in outputs.items():
        assert static == eager, key


@pytest.mark.skipif(not CAPTURE, reason="records CUDA graphs: run with GBV_TEST_DEVICE=cuda (scripts/gpu_check.sh)")
def test_recording_after_every_graph_of_a_cache_died():
    """A model's graphs share one memory pool. Recording again after every graph recorded over a cache
    had died with it (a benchmark's micro-measurements on caches of their own) failed in torch's
    allocator on an H200 until the pool's first graph was kept (StaticSteps._anchor)."""
    target, _ = hf_pair("llama", vocab=40, seed=3, target_size=(64, 2))
    eager, static = _eager_and_static(target.to(TEST_DEVICE))
    one, at = torch.tensor([[5]], device=TEST_DEVICE), torch.tensor([[6]], device=TEST_DEVICE)
    with torch.inference_mode():
        for round_ in range(2):
            caches = [lean.plain_cache(1, 32) for lean in (eager, static)]
            for lean, cache in zip((eager, static), caches):
                lean.forward(torch.arange(6, device=TEST_DEVICE)[None], torch.arange(6, device=TEST_DEVICE)[None], 0,
                             cache, None, causal=True)
            for _ in range(3):  # made, recorded, replayed
                outs = [lean.forward(one, at, 6, cache, None) for lean, cache in zip((eager, static), caches)]
                torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
            del caches, outs
            gc.collect()
    assert static.steps.captures >= 2


@pytest.mark.parametrize("lengths", [(13, 5, 17, 1, 64), (3, 7, 33)])
def test_chains_run_in_pieces_of_a_power_of_two(lengths):
    """Through static steps a chain runs in pieces of a power of two queries, largest first: the last
    query's logits and every cache entry as the eager forward's single call, and only those shapes made
    (7 serve every length up to MAX_QUERIES; a shape per length was recorded before)."""
    target, _ = hf_pair("llama", vocab=40, seed=3, target_size=(64, 2))
    eager, static = _eager_and_static(target.to(TEST_DEVICE))
    caches = [lean.plain_cache(1, 256) for lean in (eager, static)]
    gen = torch.Generator().manual_seed(5)
    start = 0
    with torch.inference_mode():
        for n in lengths:
            ids = torch.randint(0, 40, (n,), generator=gen).tolist()
            outs = [lean.chain(ids, start, cache) for lean, cache in zip((eager, static), caches)]
            assert outs[1].shape == outs[0].shape == (1, 1, 40)
            torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
            start += n
    for layer in range(len(eager.layers)):
        for store in ("keys", "values"):
            a, b = (getattr(cache, store)[layer][:, :, :start] for cache in caches)
            torch.testing.assert_close(b, a, atol=2e-5, rtol=0)
    sizes = {key[2] for key in caches[1].steps}
    assert sizes <= {1, 2, 4, 8, 16, 32, 64} and max(sizes) == 1 << (max(lengths).bit_length() - 1)


def test_a_shape_is_recorded_at_its_record_at_use(monkeypatch):
    """A static call runs eagerly until the RECORD_AT-th use of its shape (the first by default; the
    suite sets 2), its time counted as first_use_seconds, is recorded then, and replayed after: at 4, a
    shape met three times is never recorded. A bad GBV_RECORD_AT is one clear error."""
    monkeypatch.delenv("GBV_RECORD_AT")
    assert static_steps._record_at() == 1
    monkeypatch.setenv("GBV_RECORD_AT", "0")
    with pytest.raises(GbvError, match="GBV_RECORD_AT must be a whole number of at least 1"):
        static_steps._record_at()  # (a GbvError: the CLI prints it as one line, exit 2)
    target, _ = hf_pair("llama", vocab=40, seed=3, target_size=(64, 2))
    eager, static = _eager_and_static(target.to(TEST_DEVICE))
    recorded_at = []

    def record(self, cache):  # (as on CUDA: a warm-up run for real; replays then run the call again)
        recorded_at.append(self.calls)
        warm = self._run(cache)
        self.graph = type("Replay", (), {"replay": lambda _: setattr(self, "output", self._run(cache))})()
        return warm

    monkeypatch.setattr(static_steps.StaticStep, "_capture", record)
    static.steps.capture, static.steps.record_at = True, 4
    caches = [lean.plain_cache(1, 64) for lean in (eager, static)]
    with torch.inference_mode():
        for lean, cache in zip((eager, static), caches):
            lean.chain(list(range(1, 7)), 0, cache)  # 4 + 2: two shapes, each used once
        for position in range(6, 12):
            outs = [lean.chain([position % 40], position, cache) for lean, cache in zip((eager, static), caches)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)
    one = caches[1].steps[(1, 0, 1, False, True)]
    assert recorded_at == [4] and one.graph is not None and one.calls == 6
    assert static.steps.first_use_seconds > 0.0  # (the eager uses before, timed for auto: not an arm's cost)
    assert all(step.graph is None for key, step in caches[1].steps.items() if key[2] != 1)


def test_a_batch_records_no_shape_for_its_prompts_or_catch_ups(monkeypatch):
    """A batch's rows are prefilled (and, under ``auto``, their drafts caught up) eagerly, as one
    sequence's prompt is: on CUDA a graph per prompt length and row is a recording (~7 ms) for a call
    met once, and 128 of them filled a cache's steps (MAX_STEPS_PER_CACHE), leaving later decoding
    steps unrecorded. The control: the steps of the batch's iterations are kept."""
    from gbv.engine.batch import BatchTreeDecoder
    from gbv.engine.sampling import SamplingConfig

    monkeypatch.setenv("GBV_HOST_FORWARD", "0")
    monkeypatch.setenv("GBV_CUDA_GRAPHS", MODE)
    target, draft = hf_pair("llama", vocab=40, seed=6)
    batch = BatchTreeDecoder(target, draft, 40, TEST_DEVICE, 3)
    sampling = SamplingConfig(1.0)
    rows = [batch.add_row(ids, "block", 1, 3, sampling, sampling, seed)
            for seed, ids in enumerate([[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]])]
    prompt_shapes = {(1, row, len(ids) - 1, False, True) for row, ids in enumerate([[0] * 6, [0] * 3, [0] * 10])}
    for cache in (batch.target_cache, batch.draft_cache):
        assert not set(cache.steps) & prompt_shapes
    for _ in range(4):
        batch.step({id(row): 0 for row in rows})  # plain steps: the drafts lag
    batch.catch_up_drafts(rows)
    batch.step({id(row): 3 for row in rows})
    for cache in (batch.target_cache, batch.draft_cache):
        assert cache.steps and all(key[0] == len(rows) for key in cache.steps if isinstance(key[0], int)), cache.steps
