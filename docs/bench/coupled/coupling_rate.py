"""Same contexts, both ways: at each position of sampled outputs, the probability that the draft model's token
is kept. Rejection sampling keeps a sampled draft with sum_x min(p, q) = 1 - TV(p, q) (the best any coupling can
do); coupled draws keep it when argmax q / E = argmax p / E, measured over 400 seeds of the noise.

    .venv/bin/python docs/bench/coupled/coupling_rate.py --limit 2 -n 64 --temp 0.8
"""

import argparse
import statistics

import numpy as np

from speculant.api import load_backend
from speculant.bench.suite import read_suite, select
from speculant.engine import Engine
from speculant.verify import SamplingParams, coupled_draw, probs_from_logits

ap = argparse.ArgumentParser()
ap.add_argument("--limit", type=int, default=2)
ap.add_argument("--categories", default="math_reasoning,coding,summarization,translation,qa,writing")
ap.add_argument("-n", type=int, default=64)
ap.add_argument("--temp", type=float, default=0.8)
ap.add_argument("--seeds", type=int, default=400)
args = ap.parse_args()

target = load_backend("qwen2.5-coder-1.5b-instruct", threads=2)
draft = load_backend("qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0", threads=2, role="draft")
V = target.n_vocab
engine = Engine(target)
params = SamplingParams(args.temp)
print("| category | positions | 1 - TV (rejection) | coupled | coupled / (1 - TV) |")
print("|---|---:|---:|---:|---:|")
totals = {"tv": [], "coupled": []}
for pi, p in enumerate(select(read_suite(), args.categories.split(","), args.limit)):
    text = engine.chat_prompt(p.messages(), p.tools)
    prompt = engine.tokenize_prompt(text, is_chat=True)
    out = engine.generate(prompt, max_tokens=args.n, params=SamplingParams(args.temp, seed=pi)).tokens
    seq = prompt + out
    n = len(out)
    target.rewind(0)
    draft.rewind(0)
    pt = probs_from_logits(target.sync(seq[:-1], n_logits=n), params)  # [n, V] rows predicting out[i]
    pq = probs_from_logits(draft.sync(seq[:-1], n_logits=n)[:, :V], params)
    one_minus_tv = 1.0 - 0.5 * np.abs(pt - pq).sum(-1)  # [n]
    coupled = np.array([np.mean([coupled_draw(pt[i], s, len(prompt) + i) == coupled_draw(pq[i], s, len(prompt) + i)
                                 for s in range(args.seeds)]) for i in range(n)])
    totals["tv"] += list(one_minus_tv)
    totals["coupled"] += list(coupled)
    print(f"| {p.category}/{p.id} | {n} | {one_minus_tv.mean():.3f} | {coupled.mean():.3f} | "
          f"{coupled.mean() / one_minus_tv.mean():.3f} |", flush=True)
tv, cp = np.mean(totals["tv"]), np.mean(totals["coupled"])
print(f"| **all** | {len(totals['tv'])} | {tv:.3f} | {cp:.3f} | {cp / tv:.3f} |")
