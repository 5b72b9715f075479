"""``gbv`` command line: ``gbv generate | bench | bound``.

Each subcommand lives beside the code it drives and exposes ``register(subparsers)`` (adding its
parser with ``func=run``) and ``run(args) -> int``. Subcommand modules are imported only when
named, so ``gbv bound`` never pays for importing transformers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="gbv", description="Lossless multi-path speculative sampling (GBV and baselines).")
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
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except GbvError as exc:
        print(f"gbv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gbv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
