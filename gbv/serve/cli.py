"""``gbv serve``: an OpenAI-compatible server (FastAPI + uvicorn) with iteration-level batching.

    gbv serve                                   # bundled pair on http://127.0.0.1:8000
    gbv serve --target DIR --draft DIR --port 8080 --api-key KEY --max-batch 16 --max-queue 64

Endpoints: POST /v1/completions, POST /v1/chat/completions (``stream: true`` for server-sent events),
GET /v1/models, GET /health. Speculative settings per request: ``method``, ``num_paths``,
``block_len`` (the openai client sends them with ``extra_body``); their defaults are the flags below.
See docs/SERVE.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from gbv.errors import GbvError


def register(subparsers) -> None:
    from gbv.serve.schemas import MAX_BLOCK_LEN, MAX_NUM_PATHS
    from gbv.verify import METHODS

    parser = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server with iteration-level batching",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target model: local directory or cached hub id (default: bundled)")
    parser.add_argument("--draft", default=None, help="draft model: local directory or cached hub id (default: bundled)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* (default: none)")
    parser.add_argument("--model-name", default=None, help="model id in /v1/models and responses (default: gbv-<target>)")
    parser.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default 16)")
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    parser.add_argument("--method", default="auto", help=f"default method: auto (the default), ar or one of {', '.join(METHODS)}")
    parser.add_argument("--num-paths", type=int, default=3, help=f"default K (default 3, at most {MAX_NUM_PATHS})")
    parser.add_argument("--block-len", type=int, default=8, help=f"default L (default 8, at most {MAX_BLOCK_LEN})")
    parser.add_argument("--max-tokens", type=int, default=128, help="default max_tokens of a request (default 128)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="auto, float32, float16 or bfloat16 (default: checkpoint's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: 1 for models up to 100M parameters, else torch's)")
    parser.add_argument("--allow-download", action="store_true", help="let transformers download missing models")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    parser.set_defaults(func=run)


def _check_args(args: argparse.Namespace) -> None:
    """Cheap checks before loading any model, so bad flags fail fast (exit code 2)."""
    from gbv.engine.generate import all_methods
    from gbv.serve.schemas import MAX_BLOCK_LEN, MAX_NUM_PATHS

    if args.method not in all_methods():
        raise GbvError(f"unknown method {args.method!r}; choose one of: {', '.join(all_methods())}")
    checks = [
        (1 <= args.num_paths <= MAX_NUM_PATHS, f"--num-paths must be in [1, {MAX_NUM_PATHS}], got {args.num_paths}"),
        (1 <= args.block_len <= MAX_BLOCK_LEN, f"--block-len must be in [1, {MAX_BLOCK_LEN}], got {args.block_len}"),
        (args.max_tokens >= 1, f"--max-tokens must be >= 1, got {args.max_tokens}"),
        (args.max_batch >= 1, f"--max-batch must be >= 1, got {args.max_batch}"),
        (args.max_queue >= 0, f"--max-queue must be >= 0, got {args.max_queue}"),
        (args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}"),
        (0 < args.port < 65536, f"--port must be in [1, 65535], got {args.port}"),
        (args.api_key is None or args.api_key.strip() != "", "--api-key is empty"),
    ]
    for ok, message in checks:
        if not ok:
            raise GbvError(message)
    if args.target is None and args.draft is not None:
        raise GbvError("--draft needs --target (or give neither, for the bundled pair)")
    if args.target is not None and args.draft is None and args.method not in ("ar", "auto"):
        raise GbvError(f"method {args.method!r} needs --draft with --target (or use --method ar)")
    # Fail now, not after loading the models, when the address is taken.
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((args.host, args.port))
        except OSError as exc:
            raise GbvError(f"cannot listen on {args.host}:{args.port} ({exc.strerror}); pick another --port") from None


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    import uvicorn

    from gbv.models.loading import load_pair
    from gbv.serve.app import create_app
    from gbv.serve.schemas import Defaults

    from gbv.engine import auto_store

    auto_store.use_by_default()  # (a CLI process is short: start auto from what earlier ones learned)
    target = args.target if args.target is not None else "bundled"
    pair = load_pair(target=target, draft=args.draft, device=args.device, dtype=args.dtype,
                     allow_download=args.allow_download)
    from gbv.engine.threads import apply_threads

    apply_threads(args.threads, pair.target, pair.draft)
    if pair.tokenizer is None:
        raise GbvError(f"model {pair.names[0]!r} has no tokenizer files; gbv serve needs one")
    target_name = "bundled" if target == "bundled" else os.path.basename(pair.names[0].rstrip("/"))
    model_name = args.model_name or f"gbv-{target_name}"
    defaults = Defaults(method=args.method, num_paths=args.num_paths, block_len=args.block_len,
                        max_tokens=args.max_tokens)
    app = create_app(pair, defaults=defaults, max_batch=args.max_batch, max_queue=args.max_queue,
                     api_key=args.api_key, model_name=model_name)
    print(f"gbv serve: {model_name} on http://{args.host}:{args.port} (max batch {args.max_batch}, "
          f"queue {args.max_queue}{', API key required' if args.api_key else ''})", file=sys.stderr, flush=True)
    # On SIGINT/SIGTERM, open streams get 5 s to end before the process exits.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
