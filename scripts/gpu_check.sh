#!/usr/bin/env bash
# GPU check: the engine tests and a short benchmark on CUDA, when a CUDA device is present.
#   bash scripts/gpu_check.sh [OUT_DIR] [PROMPTS]
# Each part runs under its own time limit and writes its own file in OUT_DIR (default runs/gpu_check),
# so that one failing or slow part leaves the others' results:
#   device.txt    the device, torch and transformers versions;
#   graphs.txt    scripts/bench_cuda_graphs.py: CUDA graphs (the engine's default there) against the eager
#                 forward: steps, their variants and kernels, whole generations, recording time;
#   tests.txt     the engine tests built on random Hugging Face models (hf_pair), run on CUDA through
#                 GBV_TEST_DEVICE=cuda: greedy equality with the target's argmax and with
#                 `generate` for every architecture and method, every method sampling on every
#                 architecture, the chi-square law of the engine (test_law_hf_llama) and of the
#                 verifier on the host, as it runs off the CPU (test_verify_on_host.py, a batch row),
#                 the tree pass against plain sequences and the tree engine's law, and the static steps
#                 (CUDA graphs) against the eager forward (test_static_steps.py), and the recorded
#                 drafting and sampled steps against the step-by-step path (test_static_sampling.py),
#                 and the families beyond Llama and sliding windows (test_architectures.py);
#   greedy.txt    greedy decoding of the bundled pair on CUDA against the CPU, every method;
#   syncs.txt     host synchronisations per iteration, as torch.cuda.set_sync_debug_mode sees them,
#                 verifying on the host (the default off the CPU) and on the device;
#   verify-where.txt  tokens/s verifying on the host against the device forms (GBV_VERIFY_ON_DEVICE=1);
#   engine-float32.md, engine-bfloat16.md   scripts/bench_engine.py on CUDA (PROMPTS + PROMPTS prompts,
#                 default 2, in float32; 1 + 1 in bfloat16, with each row's time; 128 tokens, T = 0.2 and 1);
#   verifiers.md  scripts/bench_verifiers.py --device cuda (one verify call per method, V = 32k and 128k);
#   plain-runs.txt  scripts/bench_plain_runs.py: ar's plain steps in runs of one recorded call (1, 4, 8,
#                 16 steps) for ar and auto, T = 0.2 and 1;
#   auto.txt      scripts/bench_auto_vs_block.py on the device, 5 + 5 prompts, T = 1 and 0.2, auto's arms;
#   compile.txt   scripts/bench_compile_cuda.py: inductor's kernels of a static step against the eager ones;
#   batch.txt     scripts/bench_batch.py on the device: batched decoding (1, 4, 16 rows) of ar, BV L = 4, auto;
#   fuzz.txt      scripts/fuzz_engine.py on the device: 12 random request mixes through one batch (crashes).
# GBV_CHECK_DEVICE=cpu runs the same parts on the CPU (a dry run of this script where no GPU is; about 4
# minutes on the 2-core CPU machines). GBV_CHECK_PARTS="graphs tests ..." runs only those parts;
# GBV_CHECK_SYNC_WHERE=host counts syncs with host verification only; GBV_CHECK_BUILD=0 skips building
# the (CPU-only) C helpers; GBV_CHECK_ARCHIVE=FILE.tgz packs OUT_DIR after each part. On a GPU plan
# about 8 minutes: on the H200 with CUDA graphs (third run), graphs 63 s (before its trace of how busy the
# device is was added), tests 53 s, greedy 15 s,
# syncs 15-19 s, engine-float32 56 s, engine-bfloat16 65 s (most of it transformers' assisted
# generation), auto 35 s, compile 39 s; verify-where 29 s (second run).
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
[ "${GBV_CHECK_BUILD:-1}" = 0 ] || python3 -c 'import gbv.engine._host_kernels, gbv.verify._verify_kernels' 2>/dev/null ||
  timeout 120 python3 setup.py -q build_ext --inplace >"$out/build.txt" 2>&1 || echo "build_ext failed (gbv runs without it)"

part() {  # part NAME SECONDS COMMAND...: run one part under a time limit, log to OUT/NAME.txt
  local name=$1 seconds=$2; shift 2
  case " ${GBV_CHECK_PARTS:-$name} " in *" $name "*) ;; *) echo "== $name: skipped (GBV_CHECK_PARTS)"; return;; esac
  local start=$SECONDS
  echo "== $name (limit ${seconds}s)"
  timeout "$seconds" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.txt"
  echo "== $name: exit $rc after $((SECONDS - start))s"
  # GBV_CHECK_ARCHIVE=FILE.tgz: everything so far in one file after each part (for the device tool, which
  # brings back at most 8 files, and what a run cut short had written)
  [ -z "${GBV_CHECK_ARCHIVE:-}" ] || tar -czf "$GBV_CHECK_ARCHIVE" -C "$out" .
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

# CUDA graphs against the eager forward: steps, generations, recording (the engine's default on CUDA).
part graphs 150 python3 scripts/bench_cuda_graphs.py --device "$device" --prompts "$prompts"

part tests 90 env GBV_TEST_DEVICE="$device" python3 -m pytest -q -p no:cacheprovider -n 4 \
  tests/engine/test_engine.py tests/engine/test_exactness.py tests/engine/test_verify_on_host.py \
  tests/engine/test_batch.py::test_row_law_in_a_batch_of_mixed_prompts_lengths_and_methods \
  tests/engine/test_batch.py::test_sampled_rows_do_not_depend_on_neighbours \
  tests/engine/test_tree.py::test_tree_pass_logits_equal_plain_sequences \
  tests/engine/test_tree.py::test_one_query_without_a_mask_attends_exactly_its_prefix \
  "tests/engine/test_tree.py::test_tree_engine_law[gbv]" "tests/engine/test_tree.py::test_tree_engine_law[traversal]" \
  tests/engine/test_sampling_cache.py tests/engine/test_static_steps.py tests/engine/test_static_sampling.py \
  tests/engine/test_architectures.py \
  -k "lean_forward_is_the_hugging_face or sliding_window_masks or fuse_limit or batched_greedy_rows or static_steps or static_calls_equal or see_their_cousins or move_off_by_one or wrong_slots or pooled_caches or batch_rows_through or every_graph_of_a_cache_died or failed_recording or replicate_select_crop or api_fallback_layers or prompts_or_catch_ups or plain_runs or reuses_a_uniform or auto_runs_its_ar or cache_keyword or greedy or every_architecture_every_method or draft_equal_to_target or hf_llama or padded_vocab or caches_equal_fresh_prefill or plain_hf_path or host_generator or hands_the_verifier or row_law_in_a_batch or do_not_depend_on_neighbours or tree_pass_logits or one_query_without_a_mask or tree_engine_law"

part greedy 40 python3 - "$device" <<'PY'
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

# float32 first: bfloat16 timed out at 170 s in the first GPU run (one prompt done; the row times say where).
part engine-float32 130 python3 scripts/bench_engine.py --prompts "$prompts" --max-new-tokens 128 \
  --temperature 0.2,1.0 --dtype float32 --device "$device" --out "$out/engine-float32.md"
part engine-bfloat16 90 python3 scripts/bench_engine.py --prompts 1 --max-new-tokens 128 --row-times \
  --temperature 0.2,1.0 --dtype bfloat16 --device "$device" --out "$out/engine-bfloat16.md"

# Batched decoding (BatchTreeDecoder: one draft forward a depth, one target forward a step for all rows)
# has not run on a GPU yet: its speed against ar, and random request mixes through it (a crash is a bug;
# rows differing from their lone runs are rounding, docs/ENGINE.md "Many sequences").
part batch 120 python3 scripts/bench_batch.py --device "$device" --batch-sizes 1,4,16 --rows ar,block:4,auto \
  --prompts "$((prompts * 4))" --rounds 2
part fuzz 120 python3 scripts/fuzz_engine.py --device "$device" --trials 12

# ar's plain steps in runs of one recorded call (PlainLoop) against a call per step, ar and auto.
part plain-runs 90 python3 scripts/bench_plain_runs.py --device "$device" --prompts "$prompts"

part syncs 40 python3 - "$device" <<'PY'
# Host synchronisations per iteration on CUDA, as torch itself sees them (warn mode warns at each one,
# device-to-host reads and host-to-device copies of pageable memory alike), with the verifier on the host
# (the default off the CPU) and on the device (GBV_VERIFY_ON_DEVICE=1), and the lines that synchronise most.
import collections, os, sys, warnings, torch, gbv
device = sys.argv[1]
pair = gbv.load_pair("bundled", device=device)
prompt = "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\nAnswer:"
for where in os.environ.get("GBV_CHECK_SYNC_WHERE", "host device").split():
    os.environ["GBV_VERIFY_ON_DEVICE"] = "1" if where == "device" else "0"
    for temperature in (1.0, 0.2):
        gbv.generate(pair, prompt=prompt, method="block", block_len=4, max_new_tokens=16, eos_token_id=[])
        for method, k, length in (("ar", 1, 1), ("token", 1, 4), ("block", 1, 4), ("gbv", 3, 8),
                                  ("gbv-adaptive", 3, 4), ("specinfer", 3, 4), ("spectr", 3, 4), ("traversal", 3, 4),
                                  ("auto", 0, 0)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode("warn")
                shape = dict(num_paths=k, block_len=length) if k else {}
                out = gbv.generate(pair, prompt=prompt, method=method, max_new_tokens=64, temperature=temperature,
                                   eos_token_id=[], seed=0, **shape)
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            calls = out.stats.target_calls
            lines = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in syncs).most_common(4)
            print(f"verify on {where}, T={temperature} {method} K={k} L={length}: {len(syncs)} synchronisations over "
                  f"{calls} iterations ({len(syncs) / max(1, calls):.1f} per iteration), "
                  f"{out.stats.new_tokens / max(1, calls):.2f} tokens per iteration; most at {lines}")
os.environ.pop("GBV_VERIFY_ON_DEVICE")
PY

part verify-where 50 python3 - "$device" <<'PY'
# The verifier on the host (the default off the CPU) against its device form (GBV_VERIFY_ON_DEVICE=1):
# tokens/s of whole generations, both settings alternating in one process, 2 rounds x 2 prompts (on the CPU
# both run the same code: a dry run's ratios show the noise).
import os, sys, gbv
device = sys.argv[1]
pair = gbv.load_pair("bundled", device=device)
prompts = ["Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\nAnswer:",
           "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
rows = (("block", 1, 4), ("gbv", 3, 4), ("gbv", 3, 8), ("gbv-adaptive", 3, 4), ("specinfer", 3, 4), ("spectr", 3, 4),
        ("traversal", 3, 4))
for temperature in (1.0, 0.2):
    seconds, tokens = {}, {}
    gbv.generate(pair, prompt=prompts[0], method="gbv", num_paths=2, block_len=2, max_new_tokens=16, eos_token_id=[])
    for round_ in range(2):  # each generation's two settings back to back, so that drift hits both alike
        for method, k, length in rows:
            for seed, prompt in enumerate(prompts):
                for where in ("host", "device")[::1 if round_ % 2 == 0 else -1]:  # either one first
                    os.environ["GBV_VERIFY_ON_DEVICE"] = "1" if where == "device" else "0"
                    out = gbv.generate(pair, prompt=prompt, method=method, num_paths=k, block_len=length,
                                       temperature=temperature, max_new_tokens=128, eos_token_id=[], seed=seed)
                    key = (method, k, length, where)
                    seconds[key] = seconds.get(key, 0.0) + out.stats.time_total
                    tokens[key] = tokens.get(key, 0) + out.stats.new_tokens
    for method, k, length in rows:
        host, dev = (tokens[(method, k, length, w)] / seconds[(method, k, length, w)] for w in ("host", "device"))
        print(f"T={temperature} {method} K={k} L={length}: {host:.1f} tokens/s verifying on the host, "
              f"{dev:.1f} on the device: {host / dev:.2f}x")
os.environ.pop("GBV_VERIFY_ON_DEVICE")
PY

# auto against ar and every block length of BV, over more prompts than the engine table (auto learns
# over the run: its exploration is in its time), at both temperatures.
part auto 90 bash -c "python3 scripts/bench_auto_vs_block.py --device $device --prompts 5 --temperature 1.0 --log-policy &&
  python3 scripts/bench_auto_vs_block.py --device $device --prompts 5 --temperature 0.2 --log-policy"

# torch.compile (inductor) of the static forward, replayed as a graph, against the engine's graph of eager
# kernels: what fusing the step's ~150 small kernels would give, and what compiling costs.
part compile 150 python3 scripts/bench_compile_cuda.py --device "$device"

part verifiers 90 python3 scripts/bench_verifiers.py --device "$device" --vocab 32000 128000 --paths 1 4 \
  --instances 10 --out "$out/verifiers.md"
