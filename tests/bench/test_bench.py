"""``gbv bench``: a smoke run on tiny random models (output files well-formed), the ``--exact`` tables
(LP ceiling above every method), and bad arguments (one line on stderr, exit 2, nothing written)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from gbv.bench.compare import compare
from gbv.bench.grid import Setting, expand_settings
from gbv.bench.report import SUMMARY_COLUMNS, held_out_best, summarize
from gbv.cli import main

EOS = "<|eos|>"


def _png_ok(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _md_table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]


# ---------------------------------------------------------------------------------- tiny model pair
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    """Two tiny random Llama models sharing a small byte-level BPE tokenizer, saved like real ones."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny_pair")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Question: how many apples are there? Answer: 42.", "def f(x):\n    return x"],
                            trainer=trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    eos_id = hf_tok.eos_token_id
    dirs = []
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                          tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
        model = LlamaForCausalLM(cfg)
        with torch.no_grad():  # sharper than the default init, so drafts are sometimes accepted
            model.lm_head.weight.mul_(20.0)
        path = root / name
        model.save_pretrained(path)
        hf_tok.save_pretrained(path)
        dirs.append(str(path))
    return dirs[0], dirs[1]


def test_smoke_run_writes_well_formed_outputs(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    out = tmp_path / "run"
    code = main(["bench", "--target", target, "--draft", draft, "--dataset", "gsm8k,humaneval", "--prompts", "2",
                 "--methods", "ar,gbv,hf-assisted", "--num-paths", "1,2", "--block-len", "3",
                 "--temperature", "1.0", "--max-new-tokens", "8", "--seed", "1", "--threads", "1",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    for name in ("results.jsonl", "summary.csv", "summary.md", "meta.json", "block_efficiency_vs_K.png",
                 "tokens_per_s_vs_K.png"):
        assert (out / name).is_file(), name
    assert not (out / "block_efficiency_vs_temperature.png").exists()  # one temperature: no empty plot
    assert not list(out.glob(".*")), "temporary files left behind"

    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # 2 datasets x 2 prompts x (ar + gbv K=1,2 + hf-assisted) settings.
    assert len(records) == 2 * 2 * 4
    for rec in records:
        assert 1 <= rec["new_tokens"] <= 8
        assert rec["target_calls"] >= 1
        assert rec["time_total"] > 0 and rec["tokens_per_second"] > 0
        if rec["method"] == "gbv":
            assert rec["L"] == 3 and rec["K"] in (1, 2)
            assert len(rec["accepted_lengths"]) >= 1 and all(0 <= a <= 3 for a in rec["accepted_lengths"])
            assert rec["time_draft"] is not None and rec["time_verify"] is not None
        if rec["method"] != "hf-assisted":  # (end to end: the engine's prefill and generation fit inside)
            assert 0 < rec["time_prefill"] + rec["time_decode"] <= rec["time_total"]
        if rec["method"] == "ar":
            assert rec["L"] is None and rec["target_calls"] == rec["new_tokens"]
    # Same seed per prompt across methods, different across prompts.
    seeds = {(r["dataset"], r["prompt_index"]): set() for r in records}
    for r in records:
        seeds[(r["dataset"], r["prompt_index"])].add(r["seed"])
    assert all(len(s) == 1 for s in seeds.values()) and len({next(iter(s)) for s in seeds.values()}) == 4

    with open(out / "summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0].keys()) == SUMMARY_COLUMNS
    assert len(rows) == 3 * 4  # gsm8k, humaneval and both pooled ("all")
    pooled = {(r["method"], r["K"]): r for r in rows if r["dataset"] == "all"}
    assert int(pooled[("gbv", "2")]["new_tokens"]) == sum(r["new_tokens"] for r in records
                                                          if r["method"] == "gbv" and r["K"] == 2)
    for row in rows:
        assert float(row["block_efficiency"]) >= 1.0 - 1e-9
        assert float(row["tokens_per_s"]) > 0
        if row["method"] == "ar":
            assert float(row["speedup_vs_ar"]) == pytest.approx(1.0)
        if row["method"] == "hf-assisted":
            assert float(row["speedup_vs_hf_assisted"]) == pytest.approx(1.0)

    md = (out / "summary.md").read_text()
    assert "block eff. (tokens/target call)" in md and "mean accepted length" in md
    table = _md_table_rows(md)
    assert len({len(r) for r in table}) == 1 and len(table) == 3 * (1 + 4)  # header + 4 rows per table
    for name in ("block_efficiency_vs_K.png", "tokens_per_s_vs_K.png"):
        assert _png_ok(out / name), name

    # --merge rebuilds the same report from results.jsonl without running anything.
    merged = tmp_path / "merged"
    assert main(["bench", "--merge", str(out), "--out", str(merged)]) == 0
    assert (merged / "summary.csv").read_text() == (out / "summary.csv").read_text()
    assert _png_ok(merged / "block_efficiency_vs_K.png")
    capsys.readouterr()
    assert main(["bench", "--merge", str(tmp_path / "nothing"), "--out", str(merged)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

    # --resume after an interruption: the 5 finished results are kept (a cut-off sixth line dropped),
    # only the other 11 run again, and the run ends with every result once.
    lines = (out / "results.jsonl").read_text().splitlines()
    (out / "results.jsonl").unlink()
    (out / ".results.jsonl.partial").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])
    from gbv.bench import runner

    calls = []
    original = runner.run_one
    runner.run_one = lambda *a, **k: calls.append(a[2]) or original(*a, **k)
    try:
        argv = ["bench", "--target", target, "--draft", draft, "--dataset", "gsm8k,humaneval", "--prompts", "2",
                "--methods", "ar,gbv,hf-assisted", "--num-paths", "1,2", "--block-len", "3", "--temperature", "1.0",
                "--max-new-tokens", "8", "--seed", "1", "--threads", "1", "--out", str(out), "--no-progress"]
        assert main(argv + ["--resume"]) == 0, capsys.readouterr().err
    finally:
        runner.run_one = original
    assert len(calls) - 2 == 16 - 5  # after 2 warm-up runs (engine, hf-assisted)
    resumed = (out / "results.jsonl").read_text().splitlines()
    assert resumed[:5] == lines[:5] and len(resumed) == 16 and not (out / ".results.jsonl.partial").exists()
    capsys.readouterr()
    other_seed = list(argv)
    other_seed[other_seed.index("--seed") + 1] = "2"
    assert main(other_seed + ["--resume"]) == 2  # another seed: not this run's results
    assert "would not produce" in capsys.readouterr().err


def test_time_budget_stops_after_complete_prompts(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    out = tmp_path / "budget"
    code = main(["bench", "--target", target, "--draft", draft, "--dataset", "gsm8k,math500", "--prompts", "3",
                 "--methods", "ar,block", "--block-len", "2", "--temperature", "1", "--max-new-tokens", "4",
                 "--max-minutes", "0.00001", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["stopped_early"] and meta["prompts_completed"] == {"gsm8k": 1, "math500": 1}
    assert "stopped early" in (out / "summary.md").read_text()


def test_ctrl_c_in_the_loop_summarises_complete_prompts(tiny_pair, tmp_path, capsys, monkeypatch):
    from gbv.bench import runner

    target, draft = tiny_pair
    calls = []
    original = runner.run_one

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # warm-up, prompt 0 (ar, block), then Ctrl-C in prompt 1
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "run_one", interrupted)
    out = tmp_path / "stopped"
    code = main(["bench", "--target", target, "--draft", draft, "--dataset", "gsm8k", "--prompts", "2",
                 "--methods", "ar,block", "--block-len", "2", "--temperature", "1", "--max-new-tokens", "4",
                 "--out", str(out), "--no-progress"])
    assert code == 130
    assert "interrupted" in capsys.readouterr().err
    assert json.loads((out / "meta.json").read_text())["prompts_completed"] == {"gsm8k": 1}


def test_out_with_results_needs_resume_or_overwrite(tmp_path, capsys):
    """A second run into a results folder is refused (exit 2, nothing touched); --overwrite replaces
    it, and a plot the new run does not draw (one temperature) does not survive from the old run."""
    out = tmp_path / "exact"
    argv = ["bench", "--exact", "--vocab", "2", "--block-len", "1", "--num-paths", "1,2", "--instances", "1",
            "--methods", "block,gbv", "--out", str(out), "--no-progress"]
    assert main(argv + ["--temperature", "0.5,1"]) == 0
    assert (out / "accepted_vs_temperature.png").is_file()
    before = (out / "summary.csv").read_text()
    capsys.readouterr()
    assert main(argv + ["--temperature", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "already holds results" in err and "--overwrite" in err
    assert (out / "summary.csv").read_text() == before
    assert main(argv + ["--temperature", "1", "--resume"]) == 2  # an exact run is recomputed, not resumed
    assert main(argv + ["--temperature", "1", "--overwrite"]) == 0
    assert (out / "summary.csv").read_text() != before
    assert not (out / "accepted_vs_temperature.png").exists() and (out / "accepted_vs_K.png").is_file()
    assert main(["bench", "--exact", "--resume", "--out", str(tmp_path / "new"), "--no-progress"]) == 2


def test_a_registered_verifier_is_benchmarked_without_bench_changes(tmp_path, monkeypatch, capsys):
    """Methods come from gbv.verify's registry: a new entry (with a hyphen) is accepted, listed, run
    as a multi-path method, and appears in the tables."""
    import gbv.verify as verify
    from gbv.bench import grid

    registry = dict(verify._REGISTRY, **{"gbv-adaptive": ("gbv.verify.gbv", "verify_gbv", True)})
    monkeypatch.setattr(verify, "_REGISTRY", registry)
    monkeypatch.setattr(verify, "METHODS", tuple(registry))
    assert "gbv-adaptive" in grid.all_methods() and "gbv-adaptive" in grid.exact_methods()
    assert not grid.is_single_path("gbv-adaptive") and grid.is_single_path("block")
    assert len([s for s in expand_settings(["gbv-adaptive"], [1, 2], [4], [1.0])]) == 2
    out = tmp_path / "exact"
    assert main(["bench", "--exact", "--vocab", "2", "--block-len", "1", "--num-paths", "1,2", "--instances", "1",
                 "--temperature", "1", "--methods", "block,gbv-adaptive", "--out", str(out), "--no-progress"]) == 0
    rows = list(csv.DictReader(open(out / "summary.csv", newline="")))
    assert {(r["method"], r["K"]) for r in rows} >= {("gbv-adaptive", "1"), ("gbv-adaptive", "2")}


def test_progress_label_has_no_block_len_for_ar():
    from gbv.bench.cli import _progress_label

    assert _progress_label("gsm8k", 3, Setting("ar", 1, None, 1.0)) == "gsm8k #3 ar T=1"
    assert _progress_label("gsm8k", 3, Setting("gbv", 2, 8, 0.5)) == "gsm8k #3 gbv K=2 L=8 T=0.5"


def test_exact_tables_are_below_the_lp(tmp_path, capsys):
    out = tmp_path / "exact"
    code = main(["bench", "--exact", "--vocab", "2", "--block-len", "2", "--num-paths", "1,2",
                 "--temperature", "0.5,1.0", "--instances", "2", "--methods", "token,block,gbv",
                 "--seed", "3", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    # per (instance, T): token K=1, block K=1, gbv K=1,2, lp K=1,2
    assert len(records) == 2 * 2 * 6
    lp = {(r["instance"], r["T"], r["K"]): r["expected_accepted"] for r in records if r["method"] == "lp"}
    for r in records:
        assert r["expected_accepted"] <= lp[(r["instance"], r["T"], r["K"])] + 1e-7, r
        if r["method"] != "lp":
            assert r["max_law_error"] < 1e-9
        if r["method"] in ("block", "gbv") and r["K"] == 1:  # BV is optimal for one path
            assert r["expected_accepted"] == pytest.approx(lp[(r["instance"], r["T"], 1)], abs=1e-7)
    with open(out / "summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["method"] for r in rows} == {"token", "block", "gbv", "lp"}
    for row in rows:
        assert float(row["fraction_of_lp"]) <= 1.0 + 1e-7
    assert "LP optimum" in (out / "summary.md").read_text()
    assert _png_ok(out / "accepted_vs_K.png") and _png_ok(out / "accepted_vs_temperature.png")


# ---------------------------------------------------------------------------------- bad arguments
BAD_ARGS = [
    ["--dataset", "imagenet"],
    ["--methods", "ar,bogus"],
    ["--num-paths", "0,2"],
    ["--num-paths", "x"],
    ["--block-len", "0"],
    ["--block-len", "4,,8"],
    ["--temperature", "-0.5"],
    ["--temperature", "nan"],
    ["--prompts", "0"],
    ["--max-new-tokens", "0"],
    ["--threads", "0"],
    ["--target", "some/model"],  # without --draft
    ["--draft", "some/model"],  # without --target
    ["--max-minutes", "0"],
    ["--exact", "--methods", "hf-ar"],
    ["--exact", "--vocab", "50"],
    ["--exact", "--vocab", "4", "--block-len", "3", "--num-paths", "1,3"],
    ["--exact", "--instances", "0"],
    ["--num-paths", "17"],
    ["--block-len", "33"],
    ["--resume"],  # nothing to resume
    ["--resume", "--overwrite"],
]


@pytest.mark.parametrize("extra", BAD_ARGS, ids=lambda a: " ".join(a))
def test_bad_arguments_fail_with_one_line(extra, tmp_path, capsys, monkeypatch):
    import gbv

    def no_load(*a, **k):  # a bad argument must fail before any model loads
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(gbv, "load_pair", no_load, raising=False)
    out = tmp_path / "out"
    code = main(["bench", "--out", str(out), "--no-progress", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "error" in err, err
    assert not out.exists()


def test_out_path_that_is_a_file_is_rejected(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("x")
    for out in (target, target / "sub"):
        assert main(["bench", "--exact", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--out" in err
    assert target.read_text() == "x"


def test_missing_out_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--exact"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------- grid and summary
def test_grid_runs_single_path_methods_once_per_block_len():
    settings = expand_settings(["ar", "token", "gbv", "hf-assisted", "hf-ar"], [1, 2, 3], [4, 8], [0.2, 1.0])
    keys = [s.key() for s in settings]
    assert len(keys) == len(set(keys))
    per_t = [s for s in settings if s.temperature == 0.2]
    assert [s for s in per_t if s.method == "ar"] == [Setting("ar", 1, None, 0.2)]
    assert [s for s in per_t if s.method == "hf-ar"] == [Setting("hf-ar", 1, None, 0.2)]
    assert sorted(s.block_len for s in per_t if s.method == "token") == [4, 8]
    assert all(s.num_paths == 1 for s in per_t if s.method in ("token", "hf-assisted"))
    assert len([s for s in per_t if s.method == "gbv"]) == 6


def test_summary_ratios():
    def rec(method, k, l, new, calls, t, idx=0, acc=None):
        return {"dataset": "d", "prompt_index": idx, "method": method, "K": k, "L": l, "T": 1.0,
                "new_tokens": new, "target_calls": calls, "time_total": t, "accepted_lengths": acc}

    records = [rec("ar", 1, None, 10, 10, 2.0), rec("ar", 1, None, 10, 10, 2.0, 1),
               rec("block", 1, 4, 10, 5, 1.0, 0, [1, 1, 1, 1, 1]), rec("block", 1, 4, 10, 4, 1.0, 1, [2, 1, 2, 1]),
               rec("gbv", 2, 4, 12, 4, 1.0, 0, [2, 2, 2, 2]), rec("gbv", 2, 4, 12, 4, 1.0, 1, [3, 1, 3, 1]),
               rec("hf-assisted", 1, 4, 10, None, 2.0)]
    rows = {(r["method"], r["K"]): r for r in summarize(records)}
    assert rows[("ar", 1)]["block_efficiency"] == 1.0
    assert rows[("ar", 1)]["tokens_per_s"] == pytest.approx(5.0)
    assert rows[("block", 1)]["block_efficiency"] == pytest.approx(20 / 9)
    assert rows[("block", 1)]["mean_accepted_length"] == pytest.approx(11 / 9)
    assert rows[("gbv", 2)]["block_efficiency"] == pytest.approx(3.0)
    assert rows[("gbv", 2)]["block_efficiency_std"] == pytest.approx(0.0)
    assert rows[("gbv", 2)]["speedup_vs_ar"] == pytest.approx(12 / 5)
    assert rows[("gbv", 2)]["speedup_vs_hf_assisted"] == pytest.approx(12 / 5)
    assert rows[("gbv", 2)]["block_efficiency_vs_block"] == pytest.approx(3.0 / (20 / 9))
    assert rows[("hf-assisted", 1)]["block_efficiency"] is None  # target calls unknown
    assert rows[("hf-assisted", 1)]["mean_accepted_length"] is None


def test_compare_paired_ratios():
    recs = []
    for idx in range(6):
        for method, k, calls, t in (("block", 1, 10, 1.0), ("gbv", 2, 8, 2.0), ("ar", 1, 20, 1.0)):
            recs.append({"dataset": "d", "prompt_index": idx, "method": method, "K": k,
                         "L": None if method == "ar" else 4, "T": 1.0, "new_tokens": 20, "target_calls": calls,
                         "time_total": t})
    text = compare(recs, "gbv", ["block", "ar"], resamples=50)
    assert "| 1 | 4 | 2 | 1.250 [1.25, 1.25] | 2.500 [2.50, 2.50] |" in text
    text = compare(recs, "block", ["ar"], metric="tokens_per_s", resamples=50)
    assert "| 1 | 4 | 1 | 1.000 [1.00, 1.00] |" in text


def test_held_out_best_measures_each_fold_with_the_row_the_other_fold_picked():
    def row(seconds):  # 10 tokens a prompt, in the given seconds
        return [{"tokens": 10, "seconds": s} for s in seconds]

    # a wins the even prompts by luck, b the odd ones; over both, a looks best (in-sample 20 / 3.6 = 5.56)
    rows = {"a": row([0.5, 1.3, 0.5, 1.3]), "b": row([1.2, 0.8, 1.2, 0.8]), "c": row([2.0, 2.0, 2.0, 2.0])}
    rate, chosen = held_out_best(rows, ["a", "b", "c"])
    # even prompts get b (the odd ones' best), odd prompts get a: 40 tokens in 1.2 + 1.2 + 1.3 + 1.3 s
    assert chosen == ["b", "a"]
    assert rate == pytest.approx(40 / 5.0)
    in_sample = max(sum(r["tokens"] for r in rows[k]) / sum(r["seconds"] for r in rows[k]) for k in rows)
    assert rate < in_sample
    # a row that wins every prompt is chosen for every fold, at its own rate
    rows["d"] = row([0.4, 0.4, 0.4, 0.4])
    rate, chosen = held_out_best(rows, ["a", "b", "c", "d"], folds=3)
    assert chosen == ["d", "d", "d"] and rate == pytest.approx(25.0)
    # another clock
    rate, _ = held_out_best({"a": [{"tokens": 4, "seconds": 9, "wall": 2}] * 2}, ["a"], key="wall")
    assert rate == pytest.approx(2.0)
    with pytest.raises(ValueError, match="same number of prompts"):
        held_out_best({"a": row([1.0, 1.0]), "b": row([1.0])}, ["a", "b"])
