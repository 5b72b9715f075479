"""Where ``auto``'s wall time goes against its arms' own clocks, beside fixed rows, in one process (a check that
``auto`` rates an arm as the arm runs alone).

    python scripts/auto_clock_vs_rows.py DTYPE TEMPERATURE PROMPTS    # e.g. float32 0.2 10

Rows ``ar``, BV L = 2, BV L = 4 and ``auto`` over PROMPTS GSM8K and PROMPTS HumanEval prompts (128 tokens, EOS off,
1 thread, alternating order). For each row: tokens/s, wall time, the time of one-token generations of the same
prompts (its prefills), target calls, and (wall - prefills) per call. For ``auto``: every iteration its policy
recorded (arm, tokens, seconds), summed per arm, against its wall time, and what its policy rates the arms of L <= 4
at the end. docs/ENGINE.md, "A drafted path in one compiled call", "Tried and not kept", and "`ar` measured
again".
"""
import collections, sys, time, torch
from gbv.engine import auto
from gbv.engine.generate import generate
from gbv.models.loading import load_pair
from prompt_sets import benchmark_prompt_ids
if len(sys.argv) != 4:
    raise SystemExit("usage: python scripts/auto_clock_vs_rows.py DTYPE TEMPERATURE PROMPTS (e.g. float32 0.2 10)")
dtype, temp, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
pair = load_pair("bundled", dtype=dtype)
prompts = benchmark_prompt_ids(pair.tokenizer, n)
ROWS = [("ar", 1), ("block", 2), ("block", 4), ("auto", 1)]
st = dict(temperature=temp, eos_token_id=[])
for m, L in ROWS:
    generate(pair, prompt_ids=prompts[0], method=m, block_len=L, max_new_tokens=16, **st)
log = []
rec = auto.AutoPolicy._record
def logged(self, i, tokens, seconds, switching=0.0, *rest):
    log.append((self.arms[i].label, tokens, seconds, switching)); return rec(self, i, tokens, seconds, switching, *rest)
auto.AutoPolicy._record = logged
wall = collections.Counter(); toks = collections.Counter(); iters = collections.Counter(); pre = collections.Counter()
for seed, ids in enumerate(prompts):
    for m, L in (ROWS if seed % 2 == 0 else ROWS[::-1]):
        t = time.perf_counter()
        out = generate(pair, prompt_ids=ids, method=m, block_len=L, max_new_tokens=128, seed=seed, **st)
        wall[(m, L)] += time.perf_counter() - t
        toks[(m, L)] += out.stats.new_tokens; iters[(m, L)] += out.stats.target_calls
        # prefill alone, the same prompt (timed separately)
        t = time.perf_counter()
        generate(pair, prompt_ids=ids, method=m, block_len=L, max_new_tokens=1, seed=seed, **st)
        pre[(m, L)] += time.perf_counter() - t
for r in ROWS:
    print(f"{r}: {toks[r]/wall[r]:.0f} tok/s, wall {wall[r]:.3f}s, 1-token gens {pre[r]:.3f}s, iters {iters[r]}, "
          f"(wall-prefill)/iter {(wall[r]-pre[r])/max(iters[r],1)*1e3:.3f} ms, tokens/iter {toks[r]/max(iters[r],1):.2f}")
arms = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
for a, t, s, sw in log:
    x = arms[a]; x[0] += 1; x[1] += t; x[2] += s; x[3] += sw
tot = sum(x[2] + x[3] for x in arms.values())
print(f"auto: logged step seconds {sum(x[2] for x in arms.values()):.3f}, switching {sum(x[3] for x in arms.values()):.3f}, wall {wall[('auto',1)]:.3f}")
for a, (c, t, s, sw) in sorted(arms.items(), key=lambda kv: -kv[1][0]):
    print(f"  {a}: {c} iters, {t/c:.2f} tok/iter, {s/c*1e3:.3f} ms/iter, {t/s:.0f} tok/s, switching {sw*1e3:.1f} ms")
# What the policy rates each arm at the end (its estimate of an arm's seconds an iteration, against the fixed rows'
# (wall - prefill) per call above), and where ar's settled seconds came from (docs/ENGINE.md, "`ar` measured again").
policy = next(iter(auto._POLICIES[pair.target].values()))
policy.flush()
policy.close_stretch()
for i, arm in enumerate(policy.arms):
    if policy.trials[i] > 0 and arm.block_len <= 4:
        print(f"  policy's {arm.label}: {policy.rate(i):.0f} tok/s, {policy.mean_seconds(i) * 1e3:.3f} ms/iter, "
              f"{policy.expected_tokens(i):.2f} tok/iter, switching cost {policy.switch_cost(i) * 1e3:.2f} ms")
