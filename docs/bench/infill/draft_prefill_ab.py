"""A/B of the draft model's prompt processing being priced against what drafting can save over the answer
(policy.wants_draft_prefill with the costs: "new") and not ("old": it runs whenever drafting may pay), in one
process, interleaved, on suite prompts (N per category, default 2) as chat, 128 tokens, greedy, lookup then the
draft model (adaptive). Each engine has its own draft model (its own cache, as a server's); the target's cache
is emptied before each run, so wall time counts the prompt processing. Outputs must be identical.
Usage: python docs/bench/infill/draft_prefill_ab.py [N]
"""
import sys, time, collections
from speculant import models
from speculant.api import load_backend, load_drafter
from speculant.engine import Engine
from speculant.policy import AdaptivePolicy
from speculant.bench.suite import read_suite

orig = AdaptivePolicy.wants_draft_prefill
def old(self, source, sharing=1, **kw):
    return orig(self, source, sharing)  # without the costs the check is not made
class OldPolicy(AdaptivePolicy):
    wants_draft_prefill = old

target = load_backend(models.DEFAULT_TARGET, n_ctx=4096, threads=2)
engines = {}
for name in ("new", "old"):
    e = Engine(target, load_drafter(target, models.DEFAULT_DRAFT, lookup=True, threads=2), draft_max=4, adaptive=True)
    if name == "old":
        p = e.policy
        e.policy = OldPolicy(k_max=p.k_max, k_min=p.k_min, cost_prior=target.cost_profile())
    engines[name] = e
prompts = read_suite()
by_cat = collections.defaultdict(list)
for p in prompts:
    by_cat[p.category].append(p)
picked = [p for c in by_cat.values() for p in c[:int(sys.argv[1]) if len(sys.argv) > 1 else 2]]
wall = {n: 0.0 for n in engines}; toks = {n: 0 for n in engines}
for i, p in enumerate(picked):
    order = list(engines) if i % 2 == 0 else list(engines)[::-1]
    got = {}
    for n in order:
        e = engines[n]
        prompt = e.chat_prompt(p.messages())
        target.rewind(0)
        t = time.perf_counter()
        r = e.generate(prompt, max_tokens=128, is_chat=True)
        wall[n] += time.perf_counter() - t; toks[n] += r.stats.generated_tokens; got[n] = r
    assert got["new"].tokens == got["old"].tokens
    print(f"{p.category:14s} {len(got['new'].tokens):4d} tok  new {got['new'].stats.prefill_time:.2f}+{got['new'].stats.decode_time:.2f}s  old {got['old'].stats.prefill_time:.2f}+{got['old'].stats.decode_time:.2f}s", flush=True)
print({n: round(toks[n] / wall[n], 2) for n in engines}, "new/old wall:", round(wall["old"] / wall["new"], 3))
