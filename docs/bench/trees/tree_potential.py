"""What token trees (several drafted continuations verified in one pass) could add over a drafted chain, on the
real pair, before anyone builds the tree attention they need.

For each prompt the target decodes greedily (its exact tokens y); the draft model then reads prompt + y in one
teacher-forced pass, which gives, at every output position, the rank of the target's token among the draft's
candidates *after the true prefix*. A static tree (Medusa, Sequoia) is a prefix-closed set of rank paths: the
node (r1, ..., rd) is the draft's r_d-th candidate after the tree's path of candidates r1..r_{d-1}. A step
starting at position t accepts the longest prefix of the true ranks (rank(y_t), rank(y_t+1), ...) that is a node,
because along the true path the draft reads the true prefix. So for every tree, the mean accepted length over
the starting positions is exact (it weighs every position alike, as Leviathan's expected-length formula does),
and the best tree of B nodes is the B most frequent rank paths (a path is never more frequent than its prefix).

Costs per step, in target one-token passes:
- CPU (this machine, measured here): verify r(1 + B) of the target's pass over 1 + B tokens; the draft runs one
  pass per tree level over that level's nodes that have children, c * r_d(nodes), c its one-token pass over the
  target's (a leaf costs its verification only: its candidates come from its parent's pass).
- GPU (prediction from the H200 run of 2026-12-04, BENCHMARKS.md: 32B-shape target 24.04 ms a pass of its fixed
  16-row width, so 1 + B tokens take ceil((1 + B) / 16) of them; 0.5B-shape draft 1.82 / 2.15 / 2.18 ms at
  n = 1 / 8 / 16, interpolated).
Speedup = tau / cost with tau = 1 + mean accepted drafts (the bonus token). Dynamic trees (EAGLE-2) and the
adaptive policy's per-step lengths do better than any static shape; this bounds neither, it compares shapes.

    .venv/bin/python docs/bench/trees/tree_potential.py --limit 2 -n 128 > docs/bench/trees/result.md
"""

import argparse
import collections
import json
import statistics
import sys
import time

import numpy as np

from speculant.api import load_backend
from speculant.bench.suite import read_suite, select
from speculant.engine import Engine
from speculant.verify import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--suite", default=None)
ap.add_argument("--categories", default=None)
ap.add_argument("--limit", type=int, default=2)
ap.add_argument("-n", type=int, default=128)
ap.add_argument("--depth", type=int, default=12, help="longest rank path counted")
ap.add_argument("--rank-cap", type=int, default=8, help="ranks at or past this are misses")
ap.add_argument("--budgets", default="1,2,3,4,6,8,12,16,24,32")
ap.add_argument("--out", default=None, help="JSON of the rank sequences and pass costs")
ap.add_argument("--ranks", default=None, help="report from a JSON that --out wrote (no models run)")
args = ap.parse_args()


SIZES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 33]


def interp(table, n):
    ns = sorted(table)
    return float(np.interp(n, ns, [table[m] for m in ns]))


def pass_ms(backend, n, context, rounds=5):
    """Median ms of one pass over n new tokens after `context`."""
    times = []
    for _ in range(rounds):
        backend.rewind(len(context))
        t = time.perf_counter()
        backend.eval(list(range(1000, 1000 + n)), n_logits=n)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def measure():
    """(category -> rank sequences, target ms by pass size, draft ms by pass size) on the real pair."""
    target = load_backend("qwen2.5-coder-1.5b-instruct", threads=2)
    draft = load_backend("qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0", threads=2, role="draft")
    plain = Engine(target)
    warm = list(range(2000, 2200))  # the costs after 200 cached positions
    for b in (target, draft):
        b.rewind(0)
        b.eval(warm, n_logits=0)
    t_ms = {n: pass_ms(target, n, warm) for n in SIZES}
    d_ms = {n: pass_ms(draft, n, warm) for n in SIZES}
    prompts = select(read_suite(args.suite), args.categories.split(",") if args.categories else None, args.limit)
    ranks_by_cat = collections.defaultdict(list)
    for i, p in enumerate(prompts):
        text = plain.chat_prompt(p.messages(), p.tools)
        prompt_ids = plain.tokenize_prompt(text, is_chat=True)
        target.rewind(0)
        out = plain.generate(text, max_tokens=args.n, params=SamplingParams(0.0), is_chat=True).tokens
        if not out:
            continue
        draft.rewind(0)
        logits = draft.sync(prompt_ids + out[:-1], n_logits=len(out))[:, :target.n_vocab]  # [n, V]: after each prefix
        true = logits[np.arange(len(out)), out]
        ranks = (logits > true[:, None]).sum(axis=1)  # 0: the draft's first choice
        ranks_by_cat[p.category].append([int(r) for r in ranks])
        print(f"{i + 1}/{len(prompts)} {p.category}/{p.id}: {len(out)} tokens, first choice {np.mean(ranks == 0):.2f}",
              file=sys.stderr)
    return ranks_by_cat, t_ms, d_ms


if args.ranks:
    saved = json.load(open(args.ranks))
    ranks_by_cat = saved["ranks"]
    t_ms = {int(n): v for n, v in saved["target_ms"].items()}
    d_ms = {int(n): v for n, v in saved["draft_ms"].items()}
else:
    ranks_by_cat, t_ms, d_ms = measure()


def path_counts(seqs):
    """rank path -> how many starting positions accept it (as a prefix of their true ranks), and the starts."""
    counts, starts = collections.Counter(), 0
    for ranks in seqs:
        for t in range(len(ranks)):
            starts += 1
            path = ()
            for r in ranks[t : t + args.depth]:
                if r >= args.rank_cap:
                    break
                path += (r,)
                counts[path] += 1
    return counts, starts


def tree(counts, budget):
    """The budget most frequent paths (prefix-closed: a path is never ahead of its prefix; ties by length)."""
    return sorted(counts, key=lambda p: (-counts[p], len(p), p))[:budget]


def cost(nodes, where):
    """A step's cost in target one-token passes: the draft's passes (one per level, over its nodes) + verify."""
    # a draft pass per level over that level's nodes with children in the tree (a leaf needs no pass: the
    # candidates at a level all come from the pass over their parents); level 0 is the root, the last token
    parents = collections.Counter(len(p) - 1 for p in set(p[:-1] for p in nodes if len(p) > 1))
    depth = max((len(p) for p in nodes), default=0)
    per_level = [1] + [parents[d] for d in range(1, depth)]
    if where == "cpu":
        c = d_ms[1] / t_ms[1]
        return sum(c * interp(d_ms, n) / d_ms[1] for n in per_level[:depth]) + interp(t_ms, 1 + len(nodes)) / t_ms[1]
    gpu_draft = {1: 1.82, 8: 2.15, 16: 2.18, 64: 2.18}
    passes = -(-(1 + len(nodes)) // 16)  # the target's fixed 16-row passes
    return sum(interp(gpu_draft, n) for n in per_level[:depth]) / 24.04 + passes


def grown(counts, starts, where, limit=32):
    """A tree grown one node at a time, each time the node (a child of the tree or of the root) that raises
    tau / cost the most, while one does: the shape that pays most on `where`, chain or not."""
    nodes, best = [], 1.0 / cost([], where)
    while len(nodes) < limit:
        have = set(nodes)
        frontier = [p for p in counts if p not in have and (len(p) == 1 or p[:-1] in have)]
        scored = [((1 + sum(counts[q] for q in nodes + [p]) / starts) / cost(nodes + [p], where), p)
                  for p in frontier]
        if not scored:
            break
        speed, p = max(scored)
        if speed <= best:
            break
        nodes, best = nodes + [p], speed
    return nodes


def shape(nodes):
    """The tree written as its rank paths, siblings beside the first choice: 0-0-0 +1@1 (a second choice at depth 1)."""
    chain = max((len(p) for p in nodes if set(p) == {0}), default=0)
    extra = sorted(p for p in nodes if set(p) != {0})
    return f"chain {chain}" + "".join(f" +{'-'.join(map(str, p))}" for p in extra)


def report(name, seqs):
    counts, starts = path_counts(seqs)
    first = counts[(0,)] / starts if starts else 0.0
    print(f"\n### {name}: {starts} positions, draft's first choice = target's token at {first:.3f}\n")
    print("| tree | nodes | depth | tau | CPU cost | CPU speedup | GPU cost | GPU speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for k in (1, 2, 3, 4, 6, 8):
        chain = [(0,) * d for d in range(1, k + 1)]
        rows.append((f"chain k={k}", chain))
    for b in map(int, args.budgets.split(",")):
        rows.append((f"best static, {b} nodes", tree(counts, b)))
    for where in ("cpu", "gpu"):
        nodes = grown(counts, starts, where)
        rows.append((f"grown for {where.upper()}: {shape(nodes)}", nodes))
    for label, nodes in rows:
        tau = 1 + sum(counts[p] for p in nodes) / starts
        cc, gc = cost(nodes, "cpu"), cost(nodes, "gpu")
        depth = max((len(p) for p in nodes), default=0)
        print(f"| {label} | {len(nodes)} | {depth} | {tau:.2f} | {cc:.2f} | {tau / cc:.2f}x | {gc:.3f} | "
              f"{tau / gc:.2f}x |")


print("Target pass ms by n (this machine): " + ", ".join(f"{n}: {t_ms[n]:.1f}" for n in SIZES))
print("\nDraft pass ms by n: " + ", ".join(f"{n}: {d_ms[n]:.1f}" for n in SIZES))
for cat, seqs in ranks_by_cat.items():
    report(cat, seqs)
report("all", [s for seqs in ranks_by_cat.values() for s in seqs])
if args.out:
    with open(args.out, "w") as f:
        json.dump({"ranks": ranks_by_cat, "target_ms": t_ms, "draft_ms": d_ms}, f)
