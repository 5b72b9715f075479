"""``gbv generate PROMPT``: sample from a target model with a draft and a lossless verifier.

    gbv generate "Question: ..." --method gbv --num-paths 3 --block-len 8 --temperature 1
    gbv generate "def f(" --target path/to/target --draft path/to/draft --json

Without ``--target``/``--draft`` the bundled pair is used. ``--json`` prints one object
``{"text", "token_ids", "stats"}``; otherwise the text goes to stdout and a one-line summary to stderr.
With ``--method auto`` (the default) what the policy learns is kept for the next process in
``~/.cache/gbv/auto`` (``GBV_AUTO_CACHE=0``: not kept; ``GBV_AUTO_CACHE=DIR``: kept in DIR).
"""

from __future__ import annotations

import argparse
import json
import sys

from gbv.errors import GbvError


class _MethodsHelp(str):
    """The --method help text, listing the registered verifiers only when help is shown (importing
    the registry imports torch, which a bad --num-paths must not wait for)."""

    def __mod__(self, params):
        from gbv.engine.config import all_methods

        return (f"auto (chooses the method, K and L per iteration from measured speed; the default), ar (target "
                f"only), or a verifier: {', '.join(all_methods()[2:])}")


def register(subparsers) -> None:
    from gbv.engine.config import MAX_BLOCK_LEN, MAX_NUM_PATHS

    parser = subparsers.add_parser("generate", help="sample text from a target model, drafted and verified losslessly",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--target", default=None, help="target model: local directory or cached hub id (default: bundled)")
    parser.add_argument("--draft", default=None, help="draft model: local directory or cached hub id (default: bundled)")
    parser.add_argument("--method", default="auto", help=_MethodsHelp("methods"))
    parser.add_argument("--num-paths", type=int, default=3,
                        help=f"K, drafted paths per iteration, 1 to {MAX_NUM_PATHS} (default 3)")
    parser.add_argument("--block-len", type=int, default=8,
                        help=f"L, drafted tokens per path, 1 to {MAX_BLOCK_LEN} (default 8)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    parser.add_argument("--draft-temperature", type=float, default=None, help="default: --temperature")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0): same seed, same text")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16 (default: checkpoint's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 for models up to 100M parameters, else torch's)")
    parser.add_argument("--allow-download", action="store_true", help="let transformers download missing models")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--stream", action="store_true", help="print text as it is committed")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace):
    """The :class:`GenerationConfig` of the flags; a bad value is a GbvError naming its flag."""
    from gbv.engine.config import ConfigError, GenerationConfig

    try:
        return GenerationConfig(method=args.method, num_paths=args.num_paths, block_len=args.block_len,
                                temperature=args.temperature, draft_temperature=args.draft_temperature,
                                top_k=args.top_k, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                stop_strings=tuple(args.stop or ()), seed=args.seed)
    except ConfigError as exc:
        if exc.field == "method":
            raise
        raise GbvError(f"--{exc.field.replace('_', '-')} {exc.detail}") from None


def _check_args(args: argparse.Namespace):
    """Cheap checks before loading any model, so bad input fails fast; returns the config."""
    if not args.prompt:
        raise GbvError("prompt is empty")
    config = config_from_args(args)
    if args.threads is not None and not 1 <= args.threads <= 256:
        raise GbvError(f"--threads must be an integer from 1 to 256, got {args.threads}")
    if args.target is None and args.draft is not None:
        raise GbvError("--draft needs --target (or give neither, for the bundled pair)")
    if args.target is not None and args.draft is None and args.method not in ("ar", "auto"):
        raise GbvError(f"method {args.method!r} needs --draft with --target (or give neither, for the bundled pair)")
    return config


def run(args: argparse.Namespace) -> int:
    config = _check_args(args)
    from gbv.engine.generate import generate
    from gbv.models.loading import load_pair

    from gbv.engine import auto_store

    auto_store.use_by_default()  # (a CLI process is short: start auto from what earlier ones learned)
    target = args.target if args.target is not None else "bundled"
    pair = load_pair(target=target, draft=args.draft, device=args.device, dtype=args.dtype,
                     allow_download=args.allow_download)
    if pair.tokenizer is None:
        raise GbvError(f"model {pair.names[0]!r} has no tokenizer files; the CLI needs one to encode the prompt")
    from gbv.engine.threads import apply_threads

    apply_threads(args.threads, pair.target, pair.draft)

    def show(chunk) -> None:
        sys.stdout.write(chunk if isinstance(chunk, str) else " ".join(map(str, chunk)))
        sys.stdout.flush()

    stream = show if args.stream and not args.json else None
    out = generate(pair, prompt=args.prompt, config=config, stream=stream)
    if args.json:
        print(json.dumps(out.to_dict()))
    else:
        if stream is None:
            sys.stdout.write(out.text or "")
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(out.stats.summary(), file=sys.stderr)
    return 0
