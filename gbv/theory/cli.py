"""``gbv bound``: exact expected accepted length of every verifier, and the LP optimum, on a tiny instance.

    gbv bound INSTANCE.json [--json]
    gbv bound --random --vocab V --block-len L --num-paths K [--seed S] [--kind KIND] [--save FILE] [--json]

Every verifier in :data:`gbv.verify.METHODS` is run exactly (every draft tuple, every random branch;
:func:`gbv.theory.enumerate.exact_analysis`): ``token`` and ``block`` use one path, so they are run
with ``num_paths = 1``, the multi-path methods with the instance's K. The LP optimum is SPEC section 7
(:func:`gbv.theory.lp.lp_optimum`). ``accepted`` is ``E[tau]``; ``block_efficiency`` is ``E[tau] + 1``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gbv.atomic import atomic_write_text
from gbv.errors import GbvError
from gbv.theory.instance import (DISTRIBUTION_KINDS, MAX_DRAFT_TUPLES, InstanceError, TinyInstance, load_instance,
                                 parse_instance, random_instance)
from gbv.verify import METHODS, get_verifier, is_multi_path

# (the enumeration imports torch and the LP scipy, 2.8 s together: both are imported where they run, so that ``gbv
# bound --help`` and a bad flag answer at once)

# The JSON loader's limits (gbv.theory.instance.parse_instance), checked before generating anything.
_LIMITS = {"vocab": 16, "block_len": 8, "num_paths": 16}
LOSSLESS_TOLERANCE = 1e-9


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bound", help="exact accepted lengths of every verifier and the LP optimum on a tiny instance",
        description="Exact expected accepted length E[tau] (and block efficiency E[tau]+1) of every verifier, "
                    "its law error, and the optimum of the information-agnostic LP (docs/SPEC.md section 7), "
                    "on a tiny instance given as JSON or drawn at random.")
    parser.add_argument("instance", nargs="?", metavar="INSTANCE.json",
                        help="instance file: {vocab, block_len, num_paths, target, draft} (see gbv.theory.instance)")
    parser.add_argument("--random", action="store_true", help="draw a random instance instead of reading a file")
    parser.add_argument("--vocab", type=int, metavar="V", help="vocabulary size (with --random)")
    parser.add_argument("--block-len", type=int, metavar="L", help="drafted tokens per path (with --random)")
    parser.add_argument("--num-paths", type=int, metavar="K", help="drafted paths (with --random)")
    parser.add_argument("--seed", type=int, metavar="S", help="random seed (with --random; default 0)")
    parser.add_argument("--kind", choices=DISTRIBUTION_KINDS, metavar="KIND",
                        help=f"random distributions: {', '.join(DISTRIBUTION_KINDS)} (with --random; default mixed)")
    parser.add_argument("--save", metavar="FILE", help="write the (valid) instance as JSON to FILE")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def _random_from_args(args: argparse.Namespace) -> TinyInstance:
    sizes = {"vocab": args.vocab, "block_len": args.block_len, "num_paths": args.num_paths}
    for name, value in sizes.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            raise GbvError(f"--random needs {flag} (and --vocab, --block-len, --num-paths)")
        if value < 1:
            raise InstanceError(f"{flag} must be a positive integer, got {value}")
        if value > _LIMITS[name]:
            raise InstanceError(f"{flag} = {value} is too large for exact analysis (at most {_LIMITS[name]})")
    if args.seed is not None and args.seed < 0:
        raise GbvError(f"--seed must be a non-negative integer, got {args.seed}")
    tuples = args.vocab ** (args.block_len * args.num_paths)
    if tuples > MAX_DRAFT_TUPLES:
        raise InstanceError(f"instance too large to enumerate: V^(L*K) = {args.vocab}^{args.block_len * args.num_paths}"
                            f" = {tuples} draft tuples (at most {MAX_DRAFT_TUPLES})")
    inst = random_instance(args.vocab, args.block_len, args.num_paths, seed=0 if args.seed is None else args.seed,
                           kind=args.kind or "mixed")
    # Through the JSON form, so that results are exactly those of the saved file read back.
    return parse_instance(json.loads(json.dumps(inst.to_json())))


def _load(args: argparse.Namespace) -> TinyInstance:
    if args.random and args.instance is not None:
        raise GbvError("give either INSTANCE.json or --random, not both")
    if args.random:
        return _random_from_args(args)
    if args.instance is None:
        raise GbvError("give an instance file (gbv bound INSTANCE.json) or --random --vocab V --block-len L --num-paths K")
    stray = [flag for flag, value in (("--vocab", args.vocab), ("--block-len", args.block_len),
                                      ("--num-paths", args.num_paths), ("--seed", args.seed), ("--kind", args.kind))
             if value is not None]
    if stray:
        raise GbvError(f"{', '.join(stray)} only apply with --random (an instance file fixes them)")
    return load_instance(args.instance)


def save_instance(inst: TinyInstance, path: str | Path) -> None:
    """Write ``inst`` as JSON atomically (temporary file in the same folder, then rename)."""
    try:
        atomic_write_text(path, json.dumps(inst.to_json(), indent=1) + "\n")
    except OSError as exc:
        raise GbvError(f"cannot write instance file {str(path)!r}: {exc.strerror or exc}") from None


def compute_bounds(inst: TinyInstance) -> dict:
    """Every method's exact results and the LP optimum, as printed by ``gbv bound --json``."""
    from gbv.theory.enumerate import exact_analysis
    from gbv.theory.lp import lp_optimum

    methods = {}
    for name in METHODS:
        paths = inst.num_paths if is_multi_path(name) else 1
        result = exact_analysis(get_verifier(name), inst, num_paths=paths)
        methods[name] = {"accepted": result.expected_accepted, "block_efficiency": result.block_efficiency,
                         "max_law_error": result.max_law_error}
    optimum = lp_optimum(inst)
    return {"vocab": inst.vocab, "block_len": inst.block_len, "num_paths": inst.num_paths,
            "methods": methods, "lp_optimum": {"accepted": optimum, "block_efficiency": optimum + 1.0}}


def format_table(bounds: dict) -> str:
    """The readable form: one aligned row per method, then the LP optimum."""
    k = bounds["num_paths"]
    optimum = bounds["lp_optimum"]["accepted"]
    lines = [f"instance: vocab {bounds['vocab']}, block_len {bounds['block_len']}, num_paths {k}"
             + ("" if k == 1 else " (token and block use one path)"),
             "E[tau] = expected accepted length; block efficiency = E[tau] + 1; "
             "share = E[tau] / LP optimum; law error = max |emitted law - target law|",
             ""]
    header = ("method", "E[tau]", "block eff.", "share", "law error")
    rows = []
    for name, res in bounds["methods"].items():
        share = f"{100.0 * res['accepted'] / optimum:.1f}%" if optimum > 0 else "-"
        flag = "" if res["max_law_error"] < LOSSLESS_TOLERANCE else "  NOT LOSSLESS"
        rows.append((name, f"{res['accepted']:.6f}", f"{res['block_efficiency']:.6f}", share,
                     f"{res['max_law_error']:.1e}{flag}"))
    rows.append(("LP optimum", f"{optimum:.6f}", f"{optimum + 1.0:.6f}", "100.0%" if optimum > 0 else "-", "-"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    fmt = lambda r: "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:4], widths[1:])]  # noqa: E731
                              + [r[4]]).rstrip()
    lines.append(fmt(header))
    lines.append(fmt(tuple("-" * w for w in widths) + ("-" * 9,)))
    lines.extend(fmt(r) for r in rows[:-1])
    lines.append(fmt(tuple("-" * w for w in widths) + ("-" * 9,)))
    lines.append(fmt(rows[-1]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from gbv.theory.lp import check_lp_size

    inst = _load(args)
    check_lp_size(inst)  # fail fast, before any enumeration or --save
    if args.save:
        save_instance(inst, args.save)
    bounds = compute_bounds(inst)
    if args.json:
        json.dump(bounds, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_table(bounds))
    return 0
