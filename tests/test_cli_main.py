"""The ``gbv`` command as a process: --version, exit codes, Ctrl-C during start-up, a closed stdout,
``dir(gbv)``. Each error is one line on stderr, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gbv
from gbv.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _gbv(*argv: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this tree's gbv, whatever is installed
    return subprocess.Popen([sys.executable, "-m", "gbv", *argv], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    version, kernels, helpers = capsys.readouterr().out.strip().split("\n")
    assert version == f"gbv {gbv.__version__}"
    from gbv.engine.host_kernels import amx_products, avx512_tiles, f16_panels, host_kernels_unavailable
    from gbv.verify.common import compiled_kernels
    reason = host_kernels_unavailable()
    if reason is None:
        assert kernels.startswith(f"CPU kernels: on ({'AVX-512' if avx512_tiles() else 'AVX2'} tiles")
        assert ("AMX" in kernels) == amx_products()
        assert ("float16 panels" in kernels) == f16_panels() and kernels.endswith(")")
    else:
        assert kernels == f"CPU kernels: off: {reason}"
    assert helpers.startswith("verifier helpers: on" if compiled_kernels is not None else "verifier helpers: off")


def test_caps_fail_fast_with_the_allowed_range():
    """A value past the caps is refused before torch is even imported (exit 2, the range in the text)."""
    for flag, value, allowed in (("--num-paths", "100000", "from 1 to 16"), ("--block-len", "1000", "from 1 to 32")):
        proc = _gbv("generate", "hi", flag, value, stdout=subprocess.PIPE)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and err.count("\n") == 1 and flag in err and allowed in err, err
    probe = subprocess.run([sys.executable, "-c", "import sys; from gbv.cli import main; main(['generate', 'hi', "
                            "'--num-paths', '0']) == 2 and print('torch' in sys.modules)"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr


@pytest.mark.parametrize("delay", [0.6, 2.0])
def test_ctrl_c_during_start_up_exits_130_with_one_line(delay):
    """Early (importing torch / transformers) or later (loading, generating): one line, exit 130."""
    proc = _gbv("generate", "Question: 1 + 1?", "--max-new-tokens", "100000", stdout=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "gbv: interrupted\n", err


def test_a_finished_command_runs_its_exit_handlers_and_flushes_before_its_fast_exit(tmp_path):
    """``gbv`` ends with ``os._exit`` (no interpreter teardown, gbv.cli.console): ``auto``'s policy must
    still be saved by its exit handler, and the whole output reach a pipe."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), GBV_AUTO_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "gbv", "generate", "Question: 1 + 1?", "--max-new-tokens", "12",
                           "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)  # (all of it: a lost buffer would cut the object)
    assert record["stats"]["method"] == "auto" and len(record["token_ids"]) == 12
    assert len(list(tmp_path.glob("policy-*.json"))) == 1


def test_closed_stdout_exits_quietly():
    """``gbv bound ... --json | head -c 0``: the reader is gone before the output is written."""
    read, write = os.pipe()
    os.close(read)
    proc = _gbv("bound", "--random", "--vocab", "2", "--block-len", "1", "--num-paths", "2", "--json", stdout=write)
    os.close(write)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == "", err


def test_bound_json_is_still_printed(capsys):
    assert main(["bound", "--random", "--vocab", "2", "--block-len", "1", "--num-paths", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_paths"] == 2


def test_dir_lists_lazy_names():
    names = dir(gbv)
    for name in ("generate", "load_pair", "GenerationConfig", "GbvError", "__version__"):
        assert name in names
    assert gbv.GenerationConfig().num_paths == 3  # and each resolves


def _help_without_torch(*argv: str) -> list[str]:
    """``gbv ARGV`` (a --help) in a fresh process: its output lines, after checking it exited 0 without torch."""
    code = (f"import sys; from gbv.cli import main\ntry:\n    main({list(argv)!r})\nexcept SystemExit as exc:\n"
            "    assert exc.code in (0, None), exc.code\nprint('torch' in sys.modules)")
    probe = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = probe.stdout.strip().splitlines()
    assert probe.returncode == 0 and lines[-1] == "False", (argv, probe.stderr[-2000:])
    return lines[:-1]


@pytest.mark.parametrize("command", ["generate", "bench", "bound", "serve"])
def test_a_commands_help_does_not_import_torch(command):
    """``gbv COMMAND --help`` answers in a fraction of a second: torch (1.4 s to import here, 2-3 s with what it
    brings) is imported where a command runs, not where its flags are described. ``gbv generate --help`` lists the
    verifiers from the registry, which needs no torch (gbv.verify's shared types are imported when asked for);
    ``gbv bound --help`` imports neither the enumeration (torch) nor the LP (scipy)."""
    text = " ".join(_help_without_torch(command, "--help"))
    assert f"usage: gbv {command}" in text
    if command == "generate":
        from gbv.verify import METHODS

        assert all(name in text for name in METHODS)


def test_the_lazy_names_of_gbv_verify_and_gbv_theory_resolve():
    """``from gbv.verify import TorchRandom`` and every name of ``gbv.theory.__all__`` still work (imported from
    their modules when asked for), and ``dir()`` lists them."""
    import gbv.theory
    import gbv.verify
    from gbv.theory import enumerate as theory_enumerate  # (submodules import through ``from`` as before)
    from gbv.verify import block, common

    for module in (gbv.theory, gbv.verify):
        for name in module.__all__:
            assert getattr(module, name) is not None, (module.__name__, name)
        assert set(module.__all__) <= set(dir(module))
    assert gbv.verify.TorchRandom is common.TorchRandom and gbv.theory.exact_analysis is theory_enumerate.exact_analysis
    assert block.verify_block is gbv.verify.get_verifier("block")
    with pytest.raises(AttributeError):
        gbv.verify.no_such_name  # noqa: B018


def test_the_top_level_help_lists_every_command_without_importing_torch():
    """``gbv --help`` prints each command's one-line help from ``SUBCOMMANDS`` without importing the commands' modules
    (``gbv bench``'s and ``gbv bound``'s import torch: 2.8 s for eight lines). The one-line help each module
    registers is the same text, so ``gbv --help`` says what ``gbv COMMAND --help`` would."""
    import argparse

    from gbv.cli import SUBCOMMANDS, build_parser

    lines = _help_without_torch("--help")
    help_text = " ".join(" ".join(lines).split())
    for name, (_, one_line) in SUBCOMMANDS.items():
        assert f"{name} {one_line}" in help_text
        registered = argparse.ArgumentParser().add_subparsers()
        __import__(SUBCOMMANDS[name][0], fromlist=["register"]).register(registered)
        assert registered._choices_actions[0].help == one_line, name
    assert build_parser(["bound", "x.json"])._subparsers._group_actions[0].choices["bound"].description
