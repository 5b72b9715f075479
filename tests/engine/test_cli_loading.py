"""``gbv generate`` and ``gbv.load_pair``: model directories saved with save_pretrained, bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gbv
from gbv.cli import main
from gbv.errors import GbvError
from gbv.models.loading import ModelPair, load_pair

from engine_toy import save_pair

BUNDLED = Path(gbv.__file__).parent / "models" / "bundled" / "target" / "config.json"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pair"), max_positions=64)


def run_cli(capsys, *argv):
    try:
        rc = main(["generate", *argv])
    except SystemExit as exc:  # argparse errors exit directly
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_load_pair_from_directories(model_dirs):
    pair = load_pair(target=model_dirs[0], draft=model_dirs[1])
    assert isinstance(pair, ModelPair) and pair.tokenizer is not None and len(pair.tokenizer) == 32
    assert not pair.target.training and not pair.draft.training
    out = gbv.generate(pair, prompt="hello", method="gbv", max_new_tokens=8, seed=0)
    assert isinstance(out.text, str) and len(out.token_ids) <= 8


def test_load_pair_errors(tmp_path, model_dirs):
    with pytest.raises(GbvError, match="does not exist"):
        load_pair(target=str(tmp_path / "missing"), draft=model_dirs[1])
    with pytest.raises(GbvError, match="config.json"):
        load_pair(target=str(tmp_path), draft=model_dirs[1])
    with pytest.raises(GbvError, match="dtype"):
        load_pair(target=model_dirs[0], draft=model_dirs[1], dtype="float7")
    with pytest.raises(GbvError, match="nothing is downloaded without --allow-download") as exc:
        load_pair(target="no-such-org/no-such-model", draft=model_dirs[1])
    assert "connect" not in str(exc.value).lower()  # no lookup happened, so no connection error is quoted


def test_cli_json_and_text(capsys, model_dirs):
    rc, out, err = run_cli(capsys, "hello there", "--target", model_dirs[0], "--draft", model_dirs[1],
                           "--max-new-tokens", "10", "--json", "--seed", "3")
    assert rc == 0, err
    result = json.loads(out)
    assert set(result) == {"text", "token_ids", "stats"}
    assert result["stats"]["method"] == "auto" and result["stats"]["new_tokens"] == len(result["token_ids"])
    rc, out, err = run_cli(capsys, "hello there", "--target", model_dirs[0], "--draft", model_dirs[1],
                           "--max-new-tokens", "10", "--seed", "3", "--method", "block", "--stream")
    assert rc == 0 and len(err.strip().splitlines()) == 1 and "block efficiency" in err


@pytest.mark.parametrize("extra, match", [
    (["--method", "nope"], "unknown method"),
    (["--num-paths", "0"], "num-paths"),
    (["--num-paths", "17"], "--num-paths must be an integer from 1 to 16"),
    (["--block-len", "0"], "block-len"),
    (["--block-len", "33"], "--block-len must be an integer from 1 to 32"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--top-k", "-2"], "top-k"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--dtype", "float7"], "dtype"),
    (["--device", "nonsense"], "device"),
])
def test_cli_bad_inputs(capsys, model_dirs, extra, match):
    rc, out, err = run_cli(capsys, "hello", "--target", model_dirs[0], "--draft", model_dirs[1], *extra)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and match in err, err


def test_cli_bad_prompts_and_paths(capsys, tmp_path, model_dirs):
    cases = [
        (["", "--target", model_dirs[0], "--draft", model_dirs[1]], "empty"),
        (["x" * 80, "--target", model_dirs[0], "--draft", model_dirs[1]], "context"),
        (["hello", "--target", str(tmp_path / "nope"), "--draft", model_dirs[1]], "does not exist"),
        (["hello", "--target", model_dirs[0], "--method", "gbv"], "--draft"),
        (["hello", "--draft", model_dirs[1]], "--target"),
        (["hello", "--num-paths", "x"], "invalid int"),
    ]
    for argv, match in cases:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and match in err, (argv, err)
    # auto (the default) runs without a draft: it can only choose plain decoding then
    rc, out, err = run_cli(capsys, "hello", "--target", model_dirs[0], "--max-new-tokens", "5", "--json")
    assert rc == 0 and json.loads(out)["stats"]["auto_arms"] == {"ar": 5}, err


def test_cli_subprocess_exit_code(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "gbv", "generate", "hi", "--target", str(tmp_path / "a"),
                           "--draft", str(tmp_path / "b")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr


@pytest.mark.skipif(not BUNDLED.is_file(), reason="bundled models not present")
def test_over_long_prompt_is_one_line(capsys):
    """The tokenizer's own 'sequence length is longer than...' warning must not precede our error
    (it goes through transformers' logger, whose own handler prints it: listen there)."""
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    listener = Records()
    logging.getLogger("transformers").addHandler(listener)
    try:
        rc = main(["generate", "x " * 1500])
    finally:
        logging.getLogger("transformers").removeHandler(listener)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "context" in err, err
    assert not [m for m in listener.messages if "sequence length" in m], listener.messages


@pytest.mark.skipif(not BUNDLED.is_file(), reason="bundled models not present")
def test_bundled_pair(capsys):
    pair = load_pair("bundled")
    out = gbv.generate(pair, prompt="Question: 2 + 3 = ?\nAnswer:", max_new_tokens=16, seed=0)
    assert out.stats.new_tokens >= 1 and isinstance(out.text, str)
    rc, stdout, err = run_cli(capsys, "Question: what is 2 + 2?", "--max-new-tokens", "8", "--json")
    assert rc == 0, err
