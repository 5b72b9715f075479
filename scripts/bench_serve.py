"""Serving benchmark: aggregate tokens/s and p50/p95 request latency of `gbv serve` at several
concurrencies, with `transformers serve --continuous-batching` on the same target as the peer row.

    python scripts/bench_serve.py                                   # concurrency 1,4,16; 48 requests each
    python scripts/bench_serve.py --requests 8 --concurrency 1,4 --no-peer
    python scripts/bench_serve.py --peer-pythonpath /path/with/accelerate --out runs/serve.json

Each server is started as a subprocess on a free loopback port (bundled pair; `--threads` torch threads
for both servers), warmed up with one request, then sent the same fixed GSM8K prompts
(`gbv.data.load_prompts("gsm8k")`) at each concurrency through `/v1/completions` (non-streaming,
`max_tokens` fixed, greedy by default). Latency = one request end to end; tokens/s = completion
tokens of all requests / wall time of the level. With greedy decoding both servers produce the same
tokens (same target), so the token counts are comparable even though EOS may stop a request early.

The peer needs `transformers serve` (transformers' CLI) and the `accelerate` package, which gbv does
not depend on; without them the peer row says why it did not run. It runs offline (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gbv.data import load_prompts  # noqa: E402
from gbv.models.bundled import bundled_paths  # noqa: E402

START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A server subprocess; ``stop()`` ends it (by its own pid)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-serve-{name}-", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: "
                                   f"{Path(self.log.name).read_text(errors='replace')[-1500:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer /health within {START_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        self.log.close()
        os.unlink(self.log.name)


def one_request(url: str, body: dict, timeout_s: float) -> tuple[float, int, dict]:
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    latency = time.perf_counter() - start
    response.raise_for_status()
    usage = response.json()["usage"]
    return latency, int(usage["completion_tokens"]), usage


def run_level(url: str, model: str, prompts: list[str], concurrency: int, args: argparse.Namespace,
              extra: dict) -> dict:
    bodies = [{"model": model, "prompt": p, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "seed": i, **extra} for i, p in enumerate(prompts)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda b: one_request(url, b, args.request_timeout), bodies))
    wall = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    efficiencies = [r[2]["block_efficiency"] for r in results if "block_efficiency" in r[2]]
    return {"concurrency": concurrency, "requests": len(bodies), "completion_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "p50_s": statistics.median(latencies),
            "p95_s": latencies[min(len(latencies) - 1, int(round(0.95 * (len(latencies) - 1))))],
            "block_efficiency": statistics.mean(efficiencies) if efficiencies else None}


def peer_problem(env: dict[str, str]) -> str | None:
    """Why `transformers serve` cannot run here, or None."""
    if shutil.which("transformers") is None:
        return "the `transformers` CLI is not on PATH"
    check = subprocess.run([sys.executable, "-c", "import accelerate, fastapi, uvicorn"], env=env,
                           capture_output=True, text=True)
    if check.returncode != 0:
        return ("`transformers serve` needs the `accelerate` package (it loads models with a device_map); "
                "install it, or pass --peer-pythonpath DIR holding it: "
                + (check.stderr.strip().splitlines() or ["import failed"])[-1])
    return None


def bench_server(name: str, command: list[str], env: dict[str, str], port: int, model: str, prompts: list[str],
                 args: argparse.Namespace, extra: dict) -> list[dict]:
    server = ServerProcess(name, command, env, port)
    try:
        server.wait_ready()
        one_request(server.url, {"model": model, "prompt": prompts[0], "max_tokens": 8, "temperature": 0, **extra},
                    args.request_timeout)  # warm-up
        rows = []
        for concurrency in args.concurrency:
            row = {"server": name, **run_level(server.url, model, prompts, concurrency, args, extra)}
            rows.append(row)
            print(format_row(row), flush=True)
        return rows
    finally:
        server.stop()


def format_row(row: dict) -> str:
    if "skipped" in row:
        return f"| {row['server']} | - | - | - | - | - | - | {row['skipped']} |"
    eff = f"{row['block_efficiency']:.2f}" if row.get("block_efficiency") is not None else "-"
    return (f"| {row['server']} | {row['concurrency']} | {row['requests']} | {row['completion_tokens']} | "
            f"{row['tokens_per_s']:.1f} | {row['p50_s']:.2f} | {row['p95_s']:.2f} | {eff} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrencies (default 1,4,16)")
    # 48 = three waves at concurrency 16: with one wave, the level ends in a tail where only the
    # slowest few requests are left running and the batch is nearly empty.
    parser.add_argument("--requests", type=int, default=48, help="requests per concurrency level (default 48)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy: same tokens on both)")
    parser.add_argument("--method", default="auto")
    parser.add_argument("--num-paths", type=int, default=3)
    parser.add_argument("--block-len", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server (default 1)")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--no-peer", action="store_true", help="skip `transformers serve`")
    parser.add_argument("--peer-pythonpath", default=None, help="extra PYTHONPATH for the peer (e.g. where accelerate is)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    prompts = load_prompts("gsm8k", limit=args.requests)
    target_dir = str(bundled_paths()[0])
    threads_env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    print(f"bundled pair, {len(prompts)} GSM8K prompts per level, max_tokens {args.max_tokens}, "
          f"temperature {args.temperature}, {args.threads} torch thread(s) per server, "
          f"gbv: {args.method} K={args.num_paths} L={args.block_len}, max batch {args.max_batch}", flush=True)
    print("| server | concurrency | requests | tokens | tokens/s | p50 s | p95 s | block eff. |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows: list[dict] = []
    # auto's policies start from nothing (GBV_AUTO_CACHE=0): not from files an earlier run left in
    # ~/.cache/gbv/auto, which would make one run depend on the runs before it
    gbv_env = {**os.environ, **threads_env, "PYTHONPATH": str(ROOT), "GBV_AUTO_CACHE": "0"}
    gbv_cmd = [sys.executable, "-m", "gbv", "serve", "--threads", str(args.threads), "--max-batch", str(args.max_batch),
               "--max-queue", str(max(64, args.requests))]
    port = free_port()
    rows += bench_server("gbv serve", [*gbv_cmd, "--port", str(port)], gbv_env, port, "gbv-bundled", prompts, args,
                         {"method": args.method, "num_paths": args.num_paths, "block_len": args.block_len})
    if not args.no_peer:
        peer_env = {**os.environ, **threads_env}
        if args.peer_pythonpath:
            peer_env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.peer_pythonpath, peer_env.get("PYTHONPATH")]))
        problem = peer_problem(peer_env)
        if problem is None:
            port = free_port()
            peer_cmd = ["transformers", "serve", "--continuous-batching", "--device", "cpu", "--host", "127.0.0.1",
                        "--port", str(port), target_dir]
            try:
                rows += bench_server("transformers serve --continuous-batching", peer_cmd, peer_env, port,
                                     target_dir, prompts, args, {})
            except (RuntimeError, httpx.HTTPError) as exc:
                problem = f"failed: {exc}"
        if problem is not None:
            row = {"server": "transformers serve --continuous-batching", "skipped": problem}
            rows.append(row)
            print(format_row(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
