#!/usr/bin/env bash
# GPU check: the engine tests and a short benchmark on CUDA, when a CUDA device is present.
#   bash scripts/gpu_check.sh [OUT_DIR]
# Prints the device, checks that greedy decoding on CUDA gives the CPU's tokens for every method (the
# test suite itself runs on CPU), counts host synchronisations per iteration with
# torch.cuda.set_sync_debug_mode, times one verify call per method (scripts/bench_verifiers.py
# --device cuda), and runs scripts/bench_engine.py on the bundled pair in float32
# and bfloat16 (10 + 10 prompts, 128 tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
mkdir -p "$out"
if ! python - <<'PY'
import sys, torch
sys.exit(0 if torch.cuda.is_available() else 1)
PY
then
  echo "gpu_check: no CUDA device here; nothing to do" >&2
  exit 0
fi
python - <<'PY' | tee "$out/device.txt"
import torch
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
PY
python - <<'PY' 2>&1 | tee "$out/greedy.txt"
import gbv
from gbv.engine.generate import all_methods
cpu, gpu = gbv.load_pair("bundled"), gbv.load_pair("bundled", device="cuda")
prompt = "def fib(n):"
for method in all_methods():
    a = gbv.generate(cpu, prompt=prompt, method=method, temperature=0, max_new_tokens=48, eos_token_id=[]).token_ids
    b = gbv.generate(gpu, prompt=prompt, method=method, temperature=0, max_new_tokens=48, eos_token_id=[]).token_ids
    same = sum(x == y for x, y in zip(a, b))
    print(f"greedy {method}: CUDA equals CPU on {same}/{len(a)} tokens")
PY
python - <<'PY' 2>&1 | tee "$out/syncs.txt"
# Host synchronisations per iteration on CUDA, as torch itself sees them (warn mode prints each one).
import warnings, torch, gbv
pair = gbv.load_pair("bundled", device="cuda")
prompt = "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\nAnswer:"
gbv.generate(pair, prompt=prompt, method="block", block_len=4, max_new_tokens=16, eos_token_id=[])
for method, k, length in (("block", 1, 4), ("gbv", 3, 8), ("gbv-adaptive", 3, 4), ("specinfer", 3, 4),
                          ("spectr", 3, 4), ("traversal", 3, 4), ("ar", 1, 1)):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        out = gbv.generate(pair, prompt=prompt, method=method, num_paths=k, block_len=length, max_new_tokens=64,
                           eos_token_id=[])
        torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    print(f"{method} K={k} L={length}: {syncs} synchronisations over {out.stats.target_calls} iterations "
          f"({syncs / max(1, out.stats.target_calls):.1f} per iteration), {out.stats.tokens_per_second:.0f} tokens/s")
PY
# One verify call per method on the GPU, the device and host forms of the multi-path verifiers included.
python scripts/bench_verifiers.py --device cuda --vocab 32000 128000 --paths 1 4 --instances 10 \
  --out "$out/verifiers.md" 2>/dev/null | tail -30
python scripts/bench_engine.py --prompts 10 --max-new-tokens 128 --temperature 0.2,1.0 --dtype float32,bfloat16 \
  --device cuda --out "$out/engine.md" 2>/dev/null | tail -60
