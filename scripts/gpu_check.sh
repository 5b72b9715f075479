#!/usr/bin/env bash
# GPU check: the engine tests and a short benchmark on CUDA, when a CUDA device is present.
#   bash scripts/gpu_check.sh [OUT_DIR] [PROMPTS]
# Each part runs under its own time limit and writes its own file in OUT_DIR (default runs/gpu_check),
# so that one failing or slow part leaves the others' results:
#   device.txt    the device, torch and transformers versions;
#   tests.txt     the engine tests built on random Hugging Face models (hf_pair), run on CUDA through
#                 GBV_TEST_DEVICE=cuda: greedy equality with the target's argmax and with
#                 `generate` for every architecture and method, every method sampling on every
#                 architecture, and the chi-square law of the engine (test_law_hf_llama);
#   greedy.txt    greedy decoding of the bundled pair on CUDA against the CPU, every method;
#   syncs.txt     host synchronisations per iteration, as torch.cuda.set_sync_debug_mode sees them;
#   engine-float32.md, engine-bfloat16.md   scripts/bench_engine.py on CUDA (PROMPTS + PROMPTS prompts,
#                 default 2, 128 tokens, T = 0.2 and 1);
#   verifiers.md  scripts/bench_verifiers.py --device cuda (one verify call per method, V = 32k and 128k).
# GBV_CHECK_DEVICE=cpu runs the same parts on the CPU (a dry run of this script where no GPU is).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
prompts=${2:-2}
device=${GBV_CHECK_DEVICE:-cuda}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$device" = cuda ] && ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device here; nothing to do" >&2
  exit 0
fi
# The compiled helpers are optional (gbv runs without them); build them in place where a compiler is.
python3 -c 'import gbv.engine._host_kernels, gbv.verify._verify_kernels' 2>/dev/null ||
  timeout 120 python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1 || echo "build_ext failed (gbv runs without it)"

part() {  # part NAME SECONDS COMMAND...: run one part under a time limit, log to OUT/NAME.txt
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  echo "== $name (limit ${seconds}s)"
  timeout "$seconds" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.txt"
  echo "== $name: exit $rc after $((SECONDS - start))s"
}

part device 60 python3 - "$device" <<'PY'
import sys, torch, transformers
device = sys.argv[1]
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
if device == "cuda":
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
import gbv.engine.host_kernels as hk, gbv.verify.common as vc
print("host kernels unavailable:", hk.host_kernels_unavailable())
PY

part tests 150 env GBV_TEST_DEVICE="$device" python3 -m pytest -q -p no:cacheprovider -n 4 \
  tests/engine/test_engine.py tests/engine/test_exactness.py \
  -k "greedy or every_architecture_every_method or draft_equal_to_target or hf_llama or padded_vocab or caches_equal_fresh_prefill or plain_hf_path"

part greedy 120 python3 - "$device" <<'PY'
import sys, gbv
from gbv.engine.generate import all_methods
device = sys.argv[1]
cpu, other = gbv.load_pair("bundled"), gbv.load_pair("bundled", device=device)
prompt = "def fib(n):"
for method in all_methods():
    a = gbv.generate(cpu, prompt=prompt, method=method, temperature=0, max_new_tokens=48, eos_token_id=[]).token_ids
    b = gbv.generate(other, prompt=prompt, method=method, temperature=0, max_new_tokens=48, eos_token_id=[])
    same = next((i for i, (x, y) in enumerate(zip(a, b.token_ids)) if x != y), len(a))
    print(f"greedy {method}: {device} equals CPU on the first {same}/{len(a)} tokens; "
          f"{b.stats.tokens_per_second:.0f} tokens/s on {device}")
PY

part syncs 120 python3 - "$device" <<'PY'
# Host synchronisations per iteration on CUDA, as torch itself sees them (warn mode warns at each one).
import sys, warnings, torch, gbv
device = sys.argv[1]
pair = gbv.load_pair("bundled", device=device)
prompt = "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\nAnswer:"
for temperature in (1.0, 0.2):
    gbv.generate(pair, prompt=prompt, method="block", block_len=4, max_new_tokens=16, eos_token_id=[])
    for method, k, length in (("ar", 1, 1), ("token", 1, 4), ("block", 1, 4), ("gbv", 3, 8), ("gbv-adaptive", 3, 4),
                              ("specinfer", 3, 4), ("spectr", 3, 4), ("traversal", 3, 4), ("auto", 0, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            shape = dict(num_paths=k, block_len=length) if k else {}
            out = gbv.generate(pair, prompt=prompt, method=method, max_new_tokens=64, temperature=temperature,
                               eos_token_id=[], seed=0, **shape)
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        calls = out.stats.target_calls
        print(f"T={temperature} {method} K={k} L={length}: {syncs} synchronisations over {calls} iterations "
              f"({syncs / max(1, calls):.1f} per iteration), {out.stats.new_tokens / max(1, calls):.2f} tokens "
              f"per iteration")
PY

part verifiers 90 python3 scripts/bench_verifiers.py --device "$device" --vocab 32000 128000 --paths 1 4 \
  --instances 10 --out "$out/verifiers.md"

for dtype in bfloat16 float32; do
  part "engine-$dtype" 170 python3 scripts/bench_engine.py --prompts "$prompts" --max-new-tokens 128 \
    --temperature 0.2,1.0 --dtype "$dtype" --device "$device" --out "$out/engine-$dtype.md"
done

