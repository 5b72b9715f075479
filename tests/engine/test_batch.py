"""Batched decoding (``generate(prompts=[...])``, the server's scheduler): per-row laws stay exact,
rows do not depend on their neighbours, greedy rows equal their batch-of-1 outputs."""

from __future__ import annotations

import pytest
import torch

import gbv
from gbv.engine.batch import BatchTreeDecoder
from gbv.engine.generate import BatchRows, generate, prepare_job
from gbv.engine.host_kernels import host_kernels_unavailable
from gbv.engine.sampling import SamplingConfig

from engine_toy import sharp_llama_pair
from test_exactness import NEW, PROMPT, chi_square, exact_law


@pytest.fixture(scope="module")
def bundled():
    return gbv.load_pair("bundled")


@pytest.fixture(scope="module")
def llama_toy():
    return sharp_llama_pair()


def test_greedy_rows_equal_batch_of_one_on_the_bundled_pair(bundled):
    from gbv.data import load_prompts

    prompts = load_prompts("gsm8k", 10) + load_prompts("humaneval", 10)
    settings = dict(method="gbv", num_paths=3, block_len=4, temperature=0.0, max_new_tokens=24)
    batched = generate(bundled, prompts=prompts, batch_size=8, **settings)
    for prompt, row in zip(prompts, batched):
        assert row.token_ids == generate(bundled, prompt=prompt, **settings).token_ids


@pytest.mark.parametrize("method", ["block", "traversal", "auto"])
def test_sampled_rows_do_not_depend_on_neighbours(llama_toy, method):
    """Each row has its own seeded generator: batch 8 gives each prompt what batch 1 gives it. (For
    ``auto`` the arms chosen depend on the batch size and on timing, so only the law is fixed; its
    batched rows are checked for distinct seeds only.)"""
    prompts = [[1, 2], [3], [4, 4, 1, 0], [2, 2, 2], [0, 1], [1], [3, 4, 0, 1, 2], [4]]
    settings = dict(method=method, num_paths=3, block_len=3, temperature=1.0, max_new_tokens=12, eos_token_id=[],
                    seed=5)
    eight = generate(llama_toy, prompt_ids=prompts, batch_size=8, **settings)
    assert len({tuple(r.token_ids) for r in eight}) > 1
    if method == "auto":
        assert all(r.stats.method == "auto" and sum(r.stats.auto_arms.values()) > 0 for r in eight)
        return
    one = generate(llama_toy, prompt_ids=prompts, batch_size=1, **settings)
    assert [r.token_ids for r in eight] == [r.token_ids for r in one]


def test_row_law_in_a_batch_of_mixed_prompts_lengths_and_methods(llama_toy):
    """The law of one ``auto`` row's first 3 tokens (its arm switches between steps), decoded among
    rows of other prompts, lengths and methods."""
    law = exact_law(llama_toy.target, SamplingConfig(1.0), 5)
    others = [([3, 1, 4, 1], "traversal", 3, 3), ([2], "ar", 1, 1), ([0, 0, 1, 2, 3, 4, 0], "gbv", 2, 2)]
    runs = 600
    counts: dict[tuple[int, ...], int] = {}
    batch = BatchTreeDecoder(llama_toy.target, llama_toy.draft, 5, llama_toy.device, 4)
    rows = BatchRows(llama_toy, batch)
    for seed in range(runs):
        jobs = [(prepare_job(llama_toy, PROMPT, method="auto", max_new_tokens=NEW,
                             eos_token_id=[], seed=seed), "tested")]
        jobs += [(prepare_job(llama_toy, ids, method=m, num_paths=k, block_len=length, max_new_tokens=NEW + seed % 3,
                              eos_token_id=[], seed=10_000 + seed), f"other{i}")
                 for i, (ids, m, k, length) in enumerate(others)]
        done = {}
        for job, key in jobs[seed % 2:] + jobs[:seed % 2]:  # the tested row is not always row 0
            rows.add(key, job, emit=False)
        while rows.active:
            for key, event, value in rows.step():
                assert event != "error", value
                if event == "done":
                    done[key] = value
        seq = tuple(done["tested"].token_ids)
        counts[seq] = counts.get(seq, 0) + 1
    stat, threshold = chi_square(counts, law, runs)
    assert stat < threshold, f"chi2 {stat:.1f} >= {threshold:.1f}"
    assert not batch.rows  # every finished row left the batch


def test_batch_rows_cancel_frees_the_row(llama_toy):
    batch = BatchTreeDecoder(llama_toy.target, llama_toy.draft, 5, llama_toy.device, 2)
    rows = BatchRows(llama_toy, batch)
    rows.add("a", prepare_job(llama_toy, [1, 2], method="block", block_len=2, max_new_tokens=50), emit=True)
    rows.add("b", prepare_job(llama_toy, [3], method="block", block_len=2, max_new_tokens=5), emit=True)
    assert not rows.has_room()
    rows.step()
    rows.cancel("a")
    assert rows.has_room() and list(rows.active) == ["b"] and len(batch.rows) == 1
    events = []
    while rows.active:
        events += rows.step()
    assert events[-1][:2] == ("b", "done") and len(events[-1][2].token_ids) == 5


def test_batch_rows_reset_drops_every_row_and_the_next_rows_decode_as_alone(llama_toy):
    """What the server does after a shared step failed: every row leaves at once (no cache moves), and
    rows added afterwards, into the same caches, commit what they commit alone."""
    batch = BatchTreeDecoder(llama_toy.target, llama_toy.draft, 5, llama_toy.device, 2)
    rows = BatchRows(llama_toy, batch)
    for key, prompt in (("a", [1, 2, 3, 4]), ("b", [3])):
        rows.add(key, prepare_job(llama_toy, prompt, method="block", block_len=3, max_new_tokens=30), emit=False)
    rows.step()
    rows.step()
    assert sorted(rows.reset()) == ["a", "b"] and not rows.active and not batch.rows and rows.has_room()
    settings = dict(method="gbv", num_paths=2, block_len=3, temperature=1.0, max_new_tokens=12, eos_token_id=[], seed=4)
    alone = generate(llama_toy, prompt_ids=[2, 1], **settings).token_ids
    rows.add("c", prepare_job(llama_toy, [2, 1], **settings), emit=False)
    done = {}
    while rows.active:
        done.update((key, value.token_ids) for key, event, value in rows.step() if event == "done")
    assert done == {"c": alone}


def test_batch_size_is_validated(llama_toy):
    with pytest.raises(gbv.errors.GbvError, match="batch_size"):
        generate(llama_toy, prompt_ids=[[1], [2]], batch_size=0)
    with torch.no_grad():
        assert len(generate(llama_toy, prompt_ids=[[1], [2]], batch_size=2, max_new_tokens=3)) == 2


def _draft_gap(batch, index: int, row, upto: int) -> float:
    """Largest gap between row ``index``'s draft cache and a fresh prefill of its first ``upto`` tokens."""
    fresh = batch.draft.plain_cache(1, upto + 8)
    with torch.inference_mode():
        batch.draft.forward(torch.tensor([row.tokens[:upto]]), torch.arange(upto)[None], 0, fresh, None, causal=True,
                            last_only=True)
    return max((x[index, :, :upto].float() - y[0, :, :upto].float()).abs().max().item()
               for store in ("keys", "values")
               for x, y in zip(getattr(batch.draft_cache, store), getattr(fresh, store)))


def test_catch_up_feeds_each_lagging_draft_as_a_prefill_would(llama_toy):
    """``catch_up_drafts`` (what ``auto`` runs, timed apart, before speculating after plain steps): each
    row's draft cache then holds every token but the pending one, as a fresh prefill of them would.
    The control: before it, the same comparison over those tokens fails (the plain steps left them out)."""
    batch = BatchTreeDecoder(llama_toy.target, llama_toy.draft, 5, llama_toy.device, 2)
    sampling = SamplingConfig(1.0)
    rows = [batch.add_row(ids, "block", 1, 3, sampling, sampling, seed) for seed, ids in enumerate([[1, 2, 3], [4]])]
    for _ in range(6):
        batch.step({id(row): 0 for row in rows})  # plain steps: the drafts lag
    upto = [len(row.tokens) - 1 for row in rows]
    assert all(u - row.draft_len >= 2 for u, row in zip(upto, rows))
    assert all(_draft_gap(batch, i, row, upto[i]) > 1e-3 for i, row in enumerate(rows))
    batch.catch_up_drafts(rows)
    assert [row.draft_len for row in rows] == upto
    assert all(_draft_gap(batch, i, row, upto[i]) < 1e-5 for i, row in enumerate(rows))
    new = batch.step({id(row): 3 for row in rows})  # and the next speculative step runs from there
    assert all(len(new[id(row)]) >= 1 for row in rows)


def _stale_lone_path(self, row, block):
    """``BatchTreeDecoder._draft_lone_path`` with one fault (the negative control): every depth is fed
    the path's first token instead of the one just drawn."""
    q = torch.empty(1, block, self.vocab, dtype=torch.float32)
    q_rows = q.numpy()[0]
    token = self.draft.sampled_chain(row.tokens[row.draft_len:], row.draft_len, self.draft_cache, self.vocab,
                                     row.draft_sampling, row.rng, q_rows[0])
    if token is None:
        return None
    path = [token]
    for i in range(1, block):
        path.append(self.draft.sampled_chain([path[0]], len(row.tokens) - 1 + i, self.draft_cache, self.vocab,
                                             row.draft_sampling, row.rng, q_rows[i]))
    return path, q


def _batch_tokens(pair, jobs, max_rows: int | None = None) -> list[list[int]]:
    """The rows' tokens when ``jobs`` decode together in one batch (each job its own row) of
    ``max_rows`` rows (default: one per job; fewer: a waiting job takes the first free row)."""
    rows = BatchRows(pair, BatchTreeDecoder(pair.target, pair.draft, jobs[0].vocab, pair.device,
                                            max_rows or len(jobs)))
    waiting = list(enumerate(jobs))
    done = {}
    while waiting or rows.active:
        while waiting and rows.has_room():
            rows.add(*waiting.pop(0), emit=False)
        for key, event, value in rows.step():
            assert event != "error", value
            if event == "done":
                done[key] = value.token_ids
    return [done[i] for i in range(len(jobs))]


def test_a_lone_row_drafts_as_one_sequence_does(bundled, monkeypatch):
    """A batch's only row (``gbv serve`` at concurrency 1, a batch's tail) drafts its path as one
    sequence does, a compiled call a depth (``_draft_lone_path``), and commits the tokens of
    ``generate`` on that prompt alone. The control: the same path fed a stale token commits others."""
    settings = dict(method="block", block_len=4, temperature=1.0, max_new_tokens=40, eos_token_id=[], seed=3)
    alone = generate(bundled, prompt="def fib(n):", **settings).token_ids
    taken = []
    real = BatchTreeDecoder._draft_lone_path

    def counted(self, row, block):
        out = real(self, row, block)
        taken.append(out is not None)
        return out

    def lone_row_tokens():
        job = prepare_job(bundled, bundled.tokenizer.encode("def fib(n):"), **settings)
        return _batch_tokens(bundled, [job], max_rows=4)[0]

    monkeypatch.setattr(BatchTreeDecoder, "_draft_lone_path", counted)
    assert lone_row_tokens() == alone and taken and all(taken)
    monkeypatch.setattr(BatchTreeDecoder, "_draft_lone_path", _stale_lone_path)
    assert lone_row_tokens() != alone


def _early_lone_pass(self, row, block, lone, plain_limit=1):
    """``BatchTreeDecoder._lone_row_pass`` with one fault (the negative control): the target's pass one slot
    (and position) early, over the last committed token's cache entry."""
    committed = len(row.tokens) - 1
    if block == 0:
        new = [self.target.sampled_chain(row.tokens[-1:], committed - 1, self.target_cache, self.vocab,
                                         row.target_sampling, row.rng)]
    else:
        path, q = lone
        p = self.target.sampled_probs([row.tokens[-1], *path], None, committed - 1, self.target_cache, None,
                                      self.vocab, row.target_sampling)
        result = row.verifier(torch.tensor([path]), q, p[None], row.verify_rng)
        new = path[:result.accepted_len] + [int(result.next_token)]
        row.draft_len = committed + 1 + min(result.accepted_len, block - 1)
    row.stats.target_calls += 1
    row.tokens.extend(new)
    return new


@pytest.mark.parametrize("method", ["ar", "block"])
def test_a_lone_rows_pass_is_one_sequences_pass(bundled, monkeypatch, method):
    """A batch's only row runs the target's pass, the verification and the commit as one sequence does, one
    compiled call of the host forward (``_lone_row_pass``: the draw of a plain step, or p of the pending token
    and the path), and commits the tokens of ``generate`` on that prompt alone. The control: the same pass one
    slot early commits others."""
    settings = dict(method=method, block_len=4, temperature=1.0, max_new_tokens=40, eos_token_id=[], seed=3)
    alone = generate(bundled, prompt="def fib(n):", **settings).token_ids
    taken = []
    real = BatchTreeDecoder._lone_row_pass

    def counted(self, row, block, lone, plain_limit=1):
        out = real(self, row, block, lone, plain_limit)
        taken.append(out is not None)
        committed.append(0 if out is None else len(out))
        return out

    def lone_row_tokens():
        job = prepare_job(bundled, bundled.tokenizer.encode("def fib(n):"), **settings)
        return _batch_tokens(bundled, [job], max_rows=4)[0]

    committed = []
    monkeypatch.setattr(BatchTreeDecoder, "_lone_row_pass", counted)
    assert lone_row_tokens() == alone and taken and all(taken)
    if method == "ar":  # (plain steps in runs, as for one sequence: 8 a call, the last cut by the cap)
        assert committed == [8] * 5
    monkeypatch.setattr(BatchTreeDecoder, "_lone_row_pass", _early_lone_pass)
    assert lone_row_tokens() != alone


def test_a_lone_rows_run_of_plain_steps_ends_at_its_eos(bundled):
    """A lone row's run of plain steps ends at its generation's EOS inside the call: the tokens of ``generate``
    alone, cut after the EOS, and no target step past it; an ``auto`` row counts each step of a run."""
    settings = dict(method="ar", temperature=1.0, max_new_tokens=40, seed=5)
    ids = bundled.tokenizer.encode("def fib(n):")
    base = generate(bundled, prompt_ids=ids, eos_token_id=[], **settings).token_ids
    eos = base[11]
    cut = base[:base.index(eos) + 1]
    job = prepare_job(bundled, ids, eos_token_id=[eos], **settings)
    rows = BatchRows(bundled, BatchTreeDecoder(bundled.target, bundled.draft, job.vocab, bundled.device, 4))
    rows.add(0, job, emit=False)
    out = None
    while rows.active:
        for _, event, value in rows.step():
            if event == "done":
                out = value
    assert out.token_ids == cut and out.stats.stop_reason == "eos"
    assert out.stats.to_dict()["target_calls"] == len(cut)
    job = prepare_job(bundled, ids, **{**settings, "method": "auto"}, eos_token_id=[])
    rows.add(1, job, emit=False)
    while rows.active:
        for _, event, value in rows.step():
            if event == "done":
                out = value
    assert sum(out.stats.auto_arms.values()) == out.stats.to_dict()["target_calls"]


def test_rows_of_one_path_draw_a_depth_in_one_call(bundled, monkeypatch):
    """Rows that all draft one path under the same settings draw each depth in one call over the
    batch (one ``sample_into_at`` of n rows), and p of all rows' nodes comes from one softmax; rows of
    different settings fall back to a call a row. Either way each row commits what it commits alone.
    The control: the one call given the uniforms one row off commits other tokens."""
    import gbv.engine.batch as batch_module
    from gbv.data import load_prompts

    prompts = [bundled.tokenizer.encode(p) for p in load_prompts("gsm8k", 4)]
    common = dict(method="block", block_len=4, max_new_tokens=24, eos_token_id=[])
    same = [prepare_job(bundled, ids, temperature=1.0, seed=i, **common) for i, ids in enumerate(prompts)]
    mixed = [prepare_job(bundled, ids, temperature=(1.0, 0.6)[i % 2], seed=i, **common)
             for i, ids in enumerate(prompts)]
    alone = {(i, t): generate(bundled, prompt_ids=ids, temperature=t, seed=i, **common).token_ids
             for i, ids in enumerate(prompts) for t in (1.0, 0.6)}
    real = batch_module.sample_into_at
    widths = []

    def counted(logits, config, probs, u):
        widths.append(logits.shape[0])
        return real(logits, config, probs, u)

    monkeypatch.setattr(batch_module, "sample_into_at", counted)
    assert _batch_tokens(bundled, same) == [alone[i, 1.0] for i in range(4)]
    assert max(widths) == 4  # (all rows at once)
    del widths[:]
    assert _batch_tokens(bundled, mixed) == [alone[i, (1.0, 0.6)[i % 2]] for i in range(4)]
    assert max(widths) == 1  # (a call a row)
    top_k = [prepare_job(bundled, ids, temperature=1.0, top_k=5, seed=i, **common) for i, ids in enumerate(prompts)]
    assert _batch_tokens(bundled, top_k) == [  # (the one call on torch's softmax: top-k)
        generate(bundled, prompt_ids=ids, temperature=1.0, top_k=5, seed=i, **common).token_ids
        for i, ids in enumerate(prompts)]

    def rows_off_by_one(logits, config, probs, u):
        if u is not None and logits.shape[0] > 1:
            u = u.roll(1, 0)
        return real(logits, config, probs, u)

    monkeypatch.setattr(batch_module, "sample_into_at", rows_off_by_one)
    assert _batch_tokens(bundled, same) != [alone[i, 1.0] for i in range(4)]


def test_a_plain_row_past_the_drafts_rotary_table_beside_a_drafting_row(bundled):
    """An ``ar`` row (or an ``auto`` row in plain steps) never feeds the draft, so its draft length
    stays at its prompt while its committed length grows. While a neighbour drafts, the idle row's
    draft queries (ignored, masked) must not take positions past the draft's rotary table: a served
    ``ar`` request that ran past position 256 beside a speculative one raised IndexError in
    ``HostForward._forward`` and failed every request of the batch. Both rows commit what they
    commit alone."""
    tokenizer = bundled.tokenizer
    long_prompt = tokenizer.encode(" ".join(["Question: Natalia sold clips to 48 of her friends."] * 20))[:240]
    short_prompt = tokenizer.encode("def fib(n):")
    requests = [(long_prompt, dict(method="ar")), (short_prompt, dict(method="block", block_len=4))]
    common = dict(temperature=1.0, max_new_tokens=48, eos_token_id=[], seed=5)
    alone = [generate(bundled, prompt_ids=ids, **method, **common).token_ids for ids, method in requests]
    jobs = [prepare_job(bundled, ids, **method, **common) for ids, method in requests]
    assert _batch_tokens(bundled, jobs) == alone


@pytest.mark.skipif(host_kernels_unavailable() is not None, reason="the compiled CPU kernels are not built here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_rows_commit_what_they_commit_alone_bit_for_bit_on_the_kernels(dtype):
    """On the compiled kernels a token's logits do not depend on the pass it is in (every sum runs in
    one order, whatever the row count and slot layout: docs/ENGINE.md, "One sum order for every
    pass"), so sampled rows of mixed methods, K, L, temperatures and prompt lengths, in one batch with
    continuous batching, commit exactly the tokens of ``generate`` alone. The comparison can fail:
    before, p and q were equal to rounding only, and 1 of these 12 rows went another way in float32,
    1 in bfloat16 (the code of 90fc94b)."""
    from gbv.data import load_prompts

    torch.set_num_threads(1)
    pair = gbv.load_pair("bundled", dtype=dtype)
    texts = load_prompts("gsm8k", 6) + load_prompts("humaneval", 6)
    methods = [("block", 1, 4), ("gbv", 3, 4), ("specinfer", 2, 3), ("traversal", 3, 2), ("block", 1, 8),
               ("token", 1, 3), ("gbv-adaptive", 2, 5), ("spectr", 3, 3), ("ar", 1, 1), ("block", 1, 2),
               ("gbv", 4, 6), ("specinfer", 3, 8)]
    requests = []
    for i, (text, (method, num_paths, block_len)) in enumerate(zip(texts, methods)):
        ids = pair.tokenizer.encode(text)[:[5, 40, 120, 255][i % 4]]
        settings = dict(method=method, num_paths=num_paths, block_len=block_len, temperature=[1.0, 0.7, 0.2][i % 3],
                        max_new_tokens=48, eos_token_id=[], seed=100 + i)
        requests.append((ids, settings))
    batched = _batch_tokens(pair, [prepare_job(pair, ids, **settings) for ids, settings in requests], max_rows=5)
    for (ids, settings), tokens in zip(requests, batched):
        assert tokens == generate(pair, prompt_ids=ids, **settings).token_ids, settings
