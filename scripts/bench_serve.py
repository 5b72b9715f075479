"""Serving benchmark: aggregate tokens/s and p50/p95 request latency of `gbv serve` at several
concurrencies, with `transformers serve --continuous-batching` on the same target as the peer row.

    python scripts/bench_serve.py                                   # concurrency 1,4,16; 48 requests each
    python scripts/bench_serve.py --requests 8 --concurrency 1,4 --no-peer
    python scripts/bench_serve.py --peer-pythonpath /path/with/accelerate --out runs/serve.json
    python scripts/bench_serve.py --no-peer --offline                 # with gbv.generate's offline rows

Each server is started as a subprocess on a free loopback port (bundled pair; `--threads` torch threads
for both servers), warmed up with one request, then sent the same fixed GSM8K prompts
(`gbv.data.load_prompts("gsm8k")`) at each concurrency through `/v1/completions` (non-streaming,
`max_tokens` fixed, greedy by default), each concurrent request through its own kept client and
connection (made before the clock starts). Latency = one request end to end; tokens/s = completion
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
import queue
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


def one_request(url: str, body: dict, timeout_s: float,
                clients: queue.Queue | None = None) -> tuple[float, int, dict]:
    """One completion request through a client of ``clients`` (made before the level's clock starts, one
    per concurrent request, each keeping its connection, as the openai client does), or a new one.
    Why: ``httpx.post`` makes a client a request, about 20 ms of CPU here (its SSL context), which the
    2-core machine took from the server: gbv serve measured 745 tokens/s at concurrency 1 that way and
    1,028 with kept clients, 1,211 against 1,523 at 16 (thirty-sixth session)."""
    client = clients.get() if clients is not None else httpx.Client(timeout=timeout_s)
    start = time.perf_counter()
    try:
        response = client.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
        latency = time.perf_counter() - start
    finally:
        if clients is not None:
            clients.put(client)
        else:
            client.close()
    response.raise_for_status()
    usage = response.json()["usage"]
    return latency, int(usage["completion_tokens"]), usage


def run_level(url: str, model: str, prompts: list[str], concurrency: int, args: argparse.Namespace,
              extra: dict) -> dict:
    bodies = [{"model": model, "prompt": p, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "seed": i, **extra} for i, p in enumerate(prompts)]
    clients: queue.Queue = queue.Queue()
    for _ in range(concurrency):
        clients.put(httpx.Client(timeout=args.request_timeout))
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda b: one_request(url, b, args.request_timeout, clients), bodies))
    wall = time.perf_counter() - start
    while not clients.empty():
        clients.get().close()
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
    p50, p95 = (f"{row[k]:.2f}" if row.get(k) is not None else "-" for k in ("p50_s", "p95_s"))
    return (f"| {row['server']} | {row['concurrency']} | {row['requests']} | {row['completion_tokens']} | "
            f"{row['tokens_per_s']:.1f} | {p50} | {p95} | {eff} |")


def offline_worker(args: argparse.Namespace) -> None:
    """``--offline``'s process: ``gbv.generate(prompts=..., batch_size=C)`` over the same prompts and
    settings at each concurrency C, one JSON row per line (what the server adds its HTTP, scheduling
    and detokenising to)."""
    import torch

    import gbv

    torch.set_num_threads(args.threads)
    pair = gbv.load_pair("bundled")
    prompts = load_prompts("gsm8k", limit=args.requests)
    settings = dict(method=args.method, num_paths=args.num_paths, block_len=args.block_len,
                    temperature=args.temperature, max_new_tokens=args.max_tokens)
    gbv.generate(pair, prompt=prompts[0], **{**settings, "max_new_tokens": 8})  # (the servers' warm-up request)
    for concurrency in args.concurrency:
        start = time.perf_counter()
        outputs = gbv.generate(pair, prompts=prompts, batch_size=concurrency, **settings)
        wall = time.perf_counter() - start
        tokens = sum(len(o.token_ids) for o in outputs)
        print(json.dumps({"server": f"gbv.generate offline, batch_size={concurrency}", "concurrency": concurrency,
                          "requests": len(prompts), "completion_tokens": tokens, "wall_s": wall,
                          "tokens_per_s": tokens / wall, "p50_s": None, "p95_s": None,
                          "block_efficiency": statistics.mean(o.stats.block_efficiency for o in outputs)}),
              flush=True)


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
    parser.add_argument("--offline", action="store_true",
                        help="also run gbv.generate(prompts=..., batch_size=C) on the same prompts, in a process of "
                             "its own: what the server costs over offline generation")
    parser.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.offline_worker:
        offline_worker(args)
        return 0
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
    if args.offline:
        command = [sys.executable, str(Path(__file__).resolve()), "--offline-worker", "--concurrency",
                   ",".join(map(str, args.concurrency)), "--requests", str(args.requests), "--max-tokens",
                   str(args.max_tokens), "--temperature", str(args.temperature), "--method", args.method,
                   "--num-paths", str(args.num_paths), "--block-len", str(args.block_len),
                   "--threads", str(args.threads)]
        done = subprocess.run(command, env=gbv_env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"the offline run failed: {done.stderr.strip()[-1500:]}")
        for line in done.stdout.splitlines():
            row = json.loads(line)
            rows.append(row)
            print(format_row(row), flush=True)
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
