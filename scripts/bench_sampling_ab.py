"""Before/after in one run (1 thread, bundled pair): exponential-race sampling and torch.multinomial (before) vs inverse-CDF sampling (after)."""
import statistics, time, torch, gbv
import gbv.engine.sampling as S, gbv.verify.common as C
from prompt_sets import benchmark_prompts
torch.set_num_threads(1)
icdf = C.draw_rows
def race(probs, generator):
    dev = generator.device if generator is not None else probs.device
    r = torch.empty(probs.shape, dtype=torch.float64, device=dev).exponential_(generator=generator)
    return (probs.double() / r.to(probs.device)).argmax(-1)
class OldRandom(C.TorchRandom):
    def sample(self, dist):
        return int(torch.multinomial(dist, 1, generator=self.generator).item())
def use(before):
    S.draw_rows = C.draw_rows = race if before else icdf
    C.TorchRandom.sample = OldRandom.sample if before else NEW_SAMPLE
NEW_SAMPLE = C.TorchRandom.sample
pair = gbv.load_pair("bundled")
prompts = benchmark_prompts(10)
rows = [("ar", {}), ("block", dict(block_len=4)), ("gbv", dict(num_paths=3, block_len=8)), ("gbv-adaptive", dict(num_paths=3, block_len=4)), ("auto", {})]
gbv.generate(pair, prompt=prompts[0], method="block", block_len=2, max_new_tokens=8, eos_token_id=[])
rate = {}
for i, p in enumerate(prompts):
    for before in (True, False):
        use(before)
        for m, kw in rows:
            o = gbv.generate(pair, prompt=p, method=m, temperature=1.0, max_new_tokens=128, eos_token_id=[], seed=i, **kw)
            rate.setdefault((before, m), []).append((o.stats.new_tokens, o.stats.time_total, o.stats.target_calls))
names = [m for m, _ in rows]
print("| method (T = 1) | before tok/s | after tok/s | after/before | ms per iteration before / after | block eff. before / after |\n|---|---:|---:|---:|---:|---:|")
for m in names:
    b = rate[(True, m)]; a = rate[(False, m)]
    rb = sum(x[0] for x in b) / sum(x[1] for x in b); ra = sum(x[0] for x in a) / sum(x[1] for x in a)
    ib = 1e3 * sum(x[1] for x in b) / sum(x[2] for x in b); ia = 1e3 * sum(x[1] for x in a) / sum(x[2] for x in a)
    eb = sum(x[0] for x in b) / sum(x[2] for x in b); ea = sum(x[0] for x in a) / sum(x[2] for x in a)
    print(f"| {m} | {rb:.1f} | {ra:.1f} | {ra/rb:.3f} | {ib:.2f} / {ia:.2f} | {eb:.2f} / {ea:.2f} |")
