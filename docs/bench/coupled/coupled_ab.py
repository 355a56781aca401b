"""Seeded sampling by coupled draws against rejection sampling, on the real pair, interleaved prompt by prompt.

For each prompt and variant (plain, the draft model at a fixed k, adaptive draft model + lookup) both ways of
drawing run on the same seed, alternating which goes first: acceptance, tau and tokens/s per way, and whether
the coupled runs equal plain decoding's coupled run token for token (they must).

    .venv/bin/python docs/bench/coupled/coupled_ab.py --limit 3 -n 64 --temp 0.8 > docs/bench/coupled/result.md
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time

from speculant.api import load_backend
from speculant.bench.suite import read_suite, select
from speculant.drafters import CompositeDrafter, LookupDrafter, ModelDrafter
from speculant.engine import Engine
from speculant.verify import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--limit", type=int, default=3)
ap.add_argument("--categories", default="math_reasoning,coding,summarization,translation,qa")
ap.add_argument("-n", type=int, default=64)
ap.add_argument("--temp", type=float, default=0.8)
ap.add_argument("--top-k", type=int, default=0)
ap.add_argument("--top-p", type=float, default=1.0)
ap.add_argument("--k", type=int, default=4)
ap.add_argument("--out", default=None, help="JSON rows")
args = ap.parse_args()

target = load_backend("qwen2.5-coder-1.5b-instruct", threads=2)
draft = load_backend("qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0", threads=2, role="draft")
V = target.n_vocab
engines = {
    "plain": Engine(target),
    f"draft-k{args.k}": Engine(target, ModelDrafter(draft, V), draft_max=args.k),
    "adaptive+lookup": Engine(target, CompositeDrafter(LookupDrafter(), ModelDrafter(draft, V)), draft_max=args.k,
                              adaptive=True),
}
prompts = select(read_suite(), args.categories.split(","), args.limit)
rows = []
for pi, p in enumerate(prompts):
    text = engines["plain"].chat_prompt(p.messages(), p.tools)
    base = SamplingParams(args.temp, args.top_k, args.top_p, seed=1000 + pi)
    ways = [("coupled", base), ("rejection", dataclasses.replace(base, coupled=False))]
    if pi % 2:
        ways.reverse()
    for name, eng in engines.items():
        for way, params in ways:
            t = time.perf_counter()
            r = eng.generate(text, max_tokens=args.n, params=params, is_chat=True)
            s = r.stats
            rows.append({"prompt": p.id, "category": p.category, "engine": name, "way": way,
                         "tokens": r.tokens, "tok_s": s.tokens_per_s, "drafted": s.drafted, "accepted": s.accepted,
                         "calls": s.target_calls, "generated": s.generated_tokens})
    print(f"{pi + 1}/{len(prompts)} {p.category}/{p.id}", file=sys.stderr)

plain_coupled = {r["prompt"]: r["tokens"] for r in rows if r["engine"] == "plain" and r["way"] == "coupled"}
print(f"T = {args.temp}, top-k {args.top_k}, top-p {args.top_p}, {len(prompts)} prompts x {args.n} tokens "
      f"({args.categories}), draft k = {args.k}\n")
print("| method | draws | tok/s (mean over prompts) | vs plain, same draws | acceptance | τ | equal to plain (coupled) |")
print("|---|---|---:|---:|---:|---:|---|")
for name in engines:
    for way in ("coupled", "rejection"):
        sel = [r for r in rows if r["engine"] == name and r["way"] == way]
        plain = {r["prompt"]: r["tok_s"] for r in rows if r["engine"] == "plain" and r["way"] == way}
        tok_s = statistics.mean(r["tok_s"] for r in sel)
        ratio = statistics.mean(r["tok_s"] for r in sel) / statistics.mean(plain[r["prompt"]] for r in sel)
        d, a = sum(r["drafted"] for r in sel), sum(r["accepted"] for r in sel)
        tau = sum(r["generated"] for r in sel) / sum(r["calls"] for r in sel)
        eq = f"{sum(r['tokens'] == plain_coupled[r['prompt']] for r in sel)}/{len(sel)}" if way == "coupled" else "–"
        print(f"| {name} | {way} | {tok_s:.2f} | {ratio:.3f}x | {a / d if d else float('nan'):.3f} | {tau:.2f} | {eq} |")
if args.out:
    with open(args.out, "w") as f:
        json.dump(rows, f)
