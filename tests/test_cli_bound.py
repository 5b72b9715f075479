"""``gbv bound``: SPEC section 10's table reproduced end to end, the readable table, one-line errors, --save."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

import gbv.theory.lp as lp_module
from gbv.cli import main
from gbv.theory import context_free_instance, random_instance

# SPEC section 10: E[tau] on the context-free example (V = 2, L = 2), by K.
F = lambda a, b: a / b  # noqa: E731
SPEC_TABLE = {
    1: {"token": F(10, 9), "block": F(11, 9), "specinfer": F(10, 9), "spectr": F(10, 9), "traversal": F(11, 9),
        "gbv": F(11, 9), "lp": F(11, 9)},
    2: {"specinfer": F(4, 3), "spectr": 1.405487, "traversal": F(115, 81), "gbv": F(131, 81), "lp": F(131, 81)},
    3: {"specinfer": F(1087, 729), "spectr": 1.593306, "traversal": F(1136, 729), "gbv": F(1289, 729),
        "lp": F(1351, 729)},
}
# token and block always run with one path, whatever K is.
for _k in (2, 3):
    SPEC_TABLE[_k].update(token=F(10, 9), block=F(11, 9))


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``gbv.cli.main(argv)`` in-process: (exit code, stdout, stderr). argparse errors exit via SystemExit."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def spec_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    files = {}
    for k in (1, 2, 3):
        files[k] = folder / f"spec_k{k}.json"
        context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], block_len=2, num_paths=k).save(files[k])
    return files


@pytest.fixture(scope="module")
def spec_results(spec_files):
    results = {}
    for k, path in spec_files.items():
        code, out, err = run_cli(["bound", str(path), "--json"])
        assert code == 0, err
        results[k] = json.loads(out)
    return results


@pytest.mark.parametrize("k,name", [(k, name) for k in SPEC_TABLE for name in SPEC_TABLE[k]])
def test_spec_table(spec_results, k, name):
    res = spec_results[k]
    assert (res["vocab"], res["block_len"], res["num_paths"]) == (2, 2, k)
    tolerance = 1e-6 if name == "spectr" and k > 1 else 1e-9  # spectr's K > 1 values have 6 decimals
    entry = res["lp_optimum"] if name == "lp" else res["methods"][name]
    assert entry["accepted"] == pytest.approx(SPEC_TABLE[k][name], abs=tolerance)
    assert entry["block_efficiency"] == pytest.approx(entry["accepted"] + 1.0, abs=1e-12)
    if name != "lp":
        assert entry["max_law_error"] < 1e-9
        assert set(entry) == {"accepted", "block_efficiency", "max_law_error"}


def test_every_method_is_reported(spec_results):
    from gbv.verify import METHODS

    for res in spec_results.values():
        assert list(res["methods"]) == list(METHODS)
        assert res["lp_optimum"]["accepted"] >= max(m["accepted"] for m in res["methods"].values()) - 1e-9


def test_console_script(spec_files, spec_results):
    script = shutil.which("gbv")
    command = [script] if script else [sys.executable, "-m", "gbv"]
    proc = subprocess.run(command + ["bound", str(spec_files[2]), "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == spec_results[2]


def test_readable_table(spec_files, spec_results):
    code, out, err = run_cli(["bound", str(spec_files[3])])
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "num_paths 3" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in spec_results[3]["methods"]}
    assert list(rows) == list(spec_results[3]["methods"])
    lp_row = next(line for line in lines if line.startswith("LP optimum"))
    assert f"{1351 / 729:.6f}" in lp_row and "100.0%" in lp_row
    gbv_row = rows["gbv"]
    assert gbv_row[1] == f"{1289 / 729:.6f}" and gbv_row[3] == f"{100 * 1289 / 1351:.1f}%"
    # Aligned: the E[tau] column ends at the same offset on every row.
    ends = {line.index(f"{v['accepted']:.6f}") + 8 for v in spec_results[3]["methods"].values()
            for line in lines if f"{v['accepted']:.6f}" in line}
    assert len(ends) == 1


# ---------------------------------------------------------------------- malformed input: exit 2, one line
def _spec_json(k: int = 2) -> dict:
    return context_free_instance([1 / 3, 2 / 3], [2 / 3, 1 / 3], block_len=2, num_paths=k).to_json()


def _edit(fn):
    obj = _spec_json()
    fn(obj)
    return obj


BAD_INSTANCES = {
    "missing-context": _edit(lambda o: o["target"].pop("0,1")),
    "missing-draft-context": _edit(lambda o: o["draft"].pop("1")),
    "negative": _edit(lambda o: o["target"].__setitem__("0", [-0.5, 1.5])),
    "row-sum": _edit(lambda o: o["draft"].__setitem__("", [0.5, 0.5 + 2e-6])),
    "vocab-mismatch": _edit(lambda o: o["target"].__setitem__("1", [0.2, 0.3, 0.5])),
    "bad-context": _edit(lambda o: o["target"].__setitem__("0,x", [0.5, 0.5])),
    "non-number": _edit(lambda o: o["target"].__setitem__("0", ["a", 0.5])),
    "zero-paths": _edit(lambda o: o.__setitem__("num_paths", 0)),
    "not-an-object": [1, 2, 3],
    "too-large-to-enumerate": random_instance(4, 3, 3, seed=0, kind="dirichlet").to_json(),
}


@pytest.fixture()
def bad_file(tmp_path):
    def write(obj, text=None):
        path = tmp_path / "bad.json"
        path.write_text(text if text is not None else json.dumps(obj))
        return str(path)
    return write


def assert_one_line_error(code: int, out: str, err: str) -> None:
    assert code == 2, (code, err)
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and err.startswith("gbv")


@pytest.mark.parametrize("case", list(BAD_INSTANCES))
def test_malformed_instance_file(bad_file, case):
    assert_one_line_error(*run_cli(["bound", bad_file(BAD_INSTANCES[case]), "--json"]))


def test_bad_json(bad_file):
    assert_one_line_error(*run_cli(["bound", bad_file(None, text='{"vocab": 2,\n "block_len": }')]))


def test_missing_file(tmp_path):
    assert_one_line_error(*run_cli(["bound", str(tmp_path / "nope.json")]))


def test_too_large_for_the_lp(spec_files, monkeypatch):
    monkeypatch.setattr(lp_module, "MAX_LP_NONZEROS", 50)
    code, out, err = run_cli(["bound", str(spec_files[2])])
    assert_one_line_error(code, out, err)
    assert "too large for the LP" in err


def test_solver_failure_is_one_line(spec_files, monkeypatch):
    from scipy.optimize import OptimizeResult

    monkeypatch.setattr(lp_module, "linprog", lambda *a, **k: OptimizeResult(status=2, x=None, fun=None,
                                                                            message="infeasible\nmodel"))
    assert_one_line_error(*run_cli(["bound", str(spec_files[1])]))


BAD_ARGV = {
    "neither": ["bound"],
    "both": ["bound", "FILE", "--random", "--vocab", "2", "--block-len", "2", "--num-paths", "2"],
    "missing-vocab": ["bound", "--random", "--block-len", "2", "--num-paths", "2"],
    "missing-block-len": ["bound", "--random", "--vocab", "2", "--num-paths", "2"],
    "missing-num-paths": ["bound", "--random", "--vocab", "2", "--block-len", "2"],
    "zero-vocab": ["bound", "--random", "--vocab", "0", "--block-len", "2", "--num-paths", "2"],
    "negative-paths": ["bound", "--random", "--vocab", "2", "--block-len", "2", "--num-paths", "-1"],
    "vocab-over-limit": ["bound", "--random", "--vocab", "17", "--block-len", "1", "--num-paths", "1"],
    "too-large": ["bound", "--random", "--vocab", "4", "--block-len", "3", "--num-paths", "3"],
    "negative-seed": ["bound", "--random", "--vocab", "2", "--block-len", "2", "--num-paths", "2", "--seed", "-3"],
    "non-integer": ["bound", "--random", "--vocab", "two", "--block-len", "2", "--num-paths", "2"],
    "bad-kind": ["bound", "--random", "--vocab", "2", "--block-len", "2", "--num-paths", "2", "--kind", "spiky"],
    "size-with-file": ["bound", "FILE", "--num-paths", "3"],
    "unknown-option": ["bound", "FILE", "--frobnicate"],
}


@pytest.mark.parametrize("case", list(BAD_ARGV))
def test_bad_arguments(spec_files, case):
    argv = [str(spec_files[2]) if a == "FILE" else a for a in BAD_ARGV[case]]
    assert_one_line_error(*run_cli(argv))


# ---------------------------------------------------------------------- --save
RANDOM = ["bound", "--random", "--vocab", "3", "--block-len", "2", "--num-paths", "2", "--seed", "7",
          "--kind", "sharp"]


def test_save_round_trips(tmp_path):
    path = tmp_path / "inst.json"
    code, out, err = run_cli(RANDOM + ["--save", str(path), "--json"])
    assert code == 0, err
    assert path.exists() and os.listdir(tmp_path) == ["inst.json"]  # no temporary file left behind
    generated = json.loads(out)
    code, out, err = run_cli(["bound", str(path), "--json"])
    assert code == 0, err
    assert json.loads(out) == generated
    assert json.loads(path.read_text())["vocab"] == 3
    # The same seed gives the same instance; --save overwrites in place.
    assert run_cli(RANDOM + ["--save", str(path), "--json"])[1] == out
    assert os.listdir(tmp_path) == ["inst.json"]


def test_random_table_runs_with_default_seed_and_kind():
    code, out, err = run_cli(["bound", "--random", "--vocab", "2", "--block-len", "2", "--num-paths", "2"])
    assert code == 0, err
    assert "LP optimum" in out and "gbv" in out


@pytest.mark.parametrize("extra", [["--vocab", "0"], ["--vocab", "4", "--block-len", "3", "--num-paths", "3"]])
def test_save_skipped_for_invalid_instance(tmp_path, extra):
    path = tmp_path / "inst.json"
    argv = ["bound", "--random", "--vocab", "2", "--block-len", "2", "--num-paths", "2", *extra, "--save", str(path)]
    assert_one_line_error(*run_cli(argv))
    assert not path.exists() and os.listdir(tmp_path) == []


def test_save_skipped_when_too_large_for_the_lp(tmp_path, monkeypatch):
    monkeypatch.setattr(lp_module, "MAX_LP_NONZEROS", 50)
    path = tmp_path / "inst.json"
    assert_one_line_error(*run_cli(RANDOM + ["--save", str(path)]))
    assert not path.exists()


def test_save_to_missing_folder_is_one_line(tmp_path):
    assert_one_line_error(*run_cli(RANDOM + ["--save", str(tmp_path / "no" / "such" / "inst.json")]))
