"""``gbv`` command line: ``gbv generate | bench | bound``.

Each subcommand lives beside the code it drives and exposes ``register(subparsers)`` (adding its
parser with ``func=run``) and ``run(args) -> int``. Subcommand modules are imported only when
named, so ``gbv bound`` never pays for importing transformers.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from gbv.errors import GbvError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("gbv.engine.cli", "sample text from a target model, drafted and verified losslessly"),
    "bench": ("gbv.bench.cli", "measure block efficiency and tokens/s over methods, K, L, temperature"),
    "bound": ("gbv.theory.cli", "exact accepted lengths of every verifier and the LP optimum on a tiny instance"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), as for every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _StderrLine(logging.Handler):
    """Library warnings (the ``gbv`` logger) as one ``gbv: warning: ...`` line on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"gbv: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


def _install_warning_handler() -> None:
    logger = logging.getLogger("gbv")
    if not any(isinstance(h, _StderrLine) for h in logger.handlers):
        logger.addHandler(_StderrLine(logging.WARNING))
    logger.propagate = False  # one line, not a second copy from a root handler


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from gbv import __version__

    parser = _Parser(prog="gbv", description="Lossless multi-path speculative sampling (GBV and baselines).")
    parser.add_argument("--version", action="version", version=f"gbv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # Register only the named subcommand when there is one, all of them for --help.
    named = [a for a in argv if a in SUBCOMMANDS][:1] or list(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        module_name, help_text = SUBCOMMANDS[name]
        if name in named:
            importlib.import_module(module_name).register(subparsers)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code: 0 ok, 2 bad input (one line on stderr), 130 Ctrl-C
    (also during start-up: imports and model loading), 141 when stdout is closed early (``| head``)."""
    try:
        argv = sys.argv[1:] if argv is None else argv
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        _install_warning_handler()
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit flush
        return code
    except GbvError as exc:
        print(f"gbv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gbv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (e.g. `gbv bound ... --json | head -1`): stop quietly. Point stdout at
        # /dev/null so that the interpreter's final flush does not complain a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a tool killed by the signal reports


if __name__ == "__main__":
    sys.exit(main())
