"""``gbv`` command line: ``gbv generate | bench | bound``.

Each subcommand lives beside the code it drives and exposes ``register(subparsers)`` (adding its
parser with ``func=run``) and ``run(args) -> int``. Subcommand modules are imported only when
named, so ``gbv bound`` never pays for importing transformers.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from gbv.errors import GbvError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("gbv.engine.cli", "sample text from a target model, drafted and verified losslessly"),
    "bench": ("gbv.bench.cli", "measure block efficiency and tokens/s over methods, K, L, temperature"),
    "bound": ("gbv.theory.cli", "exact accepted lengths of every verifier and the LP optimum on a tiny instance"),
    "serve": ("gbv.serve.cli", "an OpenAI-compatible HTTP server with iteration-level batching"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2), as for every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


class _StderrLine(logging.Handler):
    """Library warnings (the ``gbv`` logger) as one ``gbv: warning: ...`` line on the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"gbv: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """While a command runs, the ``gbv`` logger's warnings are one stderr line each (and not a second
    copy through a root handler); the logger is restored afterwards."""
    logger = logging.getLogger("gbv")
    handler, propagate = _StderrLine(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _exit_on_interrupt(signum, frame) -> None:
    """Ctrl-C: one line and exit 130 at once. A KeyboardInterrupt raised inside an import (torch,
    transformers, scipy take seconds to import) can leave a half-imported module that transformers'
    lazy loader then reports as an unrelated ImportError traceback, so nothing is raised. Commands
    that must clean up (``gbv bench`` summarising what it finished) restore
    ``signal.default_int_handler`` around their work loop."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os.write(2, b"gbv: interrupted\n")
    os._exit(130)


@contextmanager
def _interrupt_exits() -> Iterator[None]:
    try:
        previous = signal.signal(signal.SIGINT, _exit_on_interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _Version(argparse.Action):
    """``--version``: the version, then whether the engine's compiled CPU kernels and the verifiers'
    compiled helpers run here (a user whose install had no C compiler gets a slower engine, and this
    says so). Imports torch only when asked."""

    def __init__(self, option_strings, version: str, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show the version and whether the compiled kernels run, then exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)
        self.version = version

    def __call__(self, parser, namespace, values, option_string=None):
        from gbv.engine.host_kernels import amx_products, avx512_tiles, f16_panels, host_kernels_unavailable

        from gbv.verify.common import compiled_kernels

        reason = host_kernels_unavailable()
        kernels = "on" if reason is None else f"off: {reason}"
        if reason is None:  # (which tiles: the speed of several rows, and the bf16 products' rounding)
            kernels += f" ({'AVX-512' if avx512_tiles() else 'AVX2'} tiles" + (
                "; bfloat16 weights on AMX, inputs rounded to bfloat16" if amx_products() else "") + (
                "; float16 weights as float16 panels)" if f16_panels() else ")")
        helpers = "on" if compiled_kernels is not None else "off: not built (no C compiler at install); numpy runs"
        sys.stdout.write(f"{self.version}\nCPU kernels: {kernels}\nverifier helpers: {helpers}\n")
        parser.exit()


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from gbv import __version__

    parser = _Parser(prog="gbv", description="Lossless multi-path speculative sampling (GBV and baselines).")
    parser.add_argument("--version", action=_Version, version=f"gbv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    # Register only the named subcommand; the others (all of them for ``gbv --help``) are their one-line help from
    # SUBCOMMANDS, without importing their modules: ``gbv --help`` took 2.8 s, the import of torch that ``gbv
    # bench``'s and ``gbv bound``'s modules make, to print eight lines.
    named = [a for a in argv if a in SUBCOMMANDS][:1]
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
        with _interrupt_exits():
            argv = sys.argv[1:] if argv is None else argv
            parser = build_parser(argv)
            args = parser.parse_args(argv)
            if getattr(args, "func", None) is None:
                parser.print_help()
                return 2
            with _warnings_as_lines():
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


def console() -> None:
    """The ``gbv`` console script: :func:`main`, then the exit handlers (``atexit``: ``auto``'s policy is
    saved there), the standard streams flushed, and the process ended without the interpreter's
    teardown. Why: tearing down torch's and transformers' modules took ~1 s at every exit on the
    2-core test machine (0.4 s for torch alone): a ``gbv generate`` of a GSM8K prompt took 4.95-5.14 s
    instead of 5.65-5.81 s without it. Nothing of gbv's is left to finalise by then (result files are
    closed, or flushed per line). Exits raised
    inside :func:`main` (``--help``, ``--version``, argparse's errors) exit the usual way."""
    code = main()
    atexit._run_exitfuncs()  # (what the interpreter's exit would run first; each handler runs once)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone away: nothing to say it to
            pass
    os._exit(code)


if __name__ == "__main__":
    console()
