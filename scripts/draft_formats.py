"""Draft formats: what one draft step costs and how much of it the target accepts, per quantization of a draft.

One shared target; the drafts in every format stay loaded. Acceptance (--phase accept): for each prompt of
the built-in suite (--limit per category) every format decodes greedily with a fixed draft length
(--draft-max, no adapting, so acceptance is comparable), in an order rotated per prompt. Greedy acceptance
does not depend on timing, so this phase may run beside other work. Step costs (--phase costs, alone on the
machine): one draft pass over 1 token after a 256-token context, per format, alternating formats round by
round (median), and the target's own 1-token pass for the ratio c = draft step / target step; it then
writes the table with the acceptance phase's figures.

    python scripts/draft_formats.py --phase accept --formats shipped=qwen2.5-coder-0.5b-instruct,q4_0=...-q4_0
    flock /tmp/speculant-bench.lock python scripts/draft_formats.py --phase costs --formats ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from speculant import models
from speculant.api import load_backend, load_drafter
from speculant.bench.suite import read_suite, select
from speculant.engine import Engine
from speculant.verify import SamplingParams


def step_ms(backend, context: list[int], rounds: int, n: int = 1) -> list[float]:
    """ms of one n-token pass (all n logits) after `context`, `rounds` times (rewound to the context each time)."""
    backend.rewind(0)
    backend.eval(context, n_logits=1)
    out = []
    for i in range(rounds):
        backend.rewind(len(context))
        t = time.perf_counter()
        backend.eval(context[i:i + n], n_logits=n)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=models.DEFAULT_TARGET)
    ap.add_argument("--formats", required=True, help="comma list of label=model (registered/local name or GGUF)")
    ap.add_argument("--limit", type=int, default=1, help="prompts per category")
    ap.add_argument("--categories", default=None)
    ap.add_argument("-n", "--n-predict", type=int, default=48)
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("--cost-rounds", type=int, default=7, help="alternating rounds of step costs")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", default="bench-out/draft-formats")
    ap.add_argument("--phase", choices=("accept", "costs", "all"), default="all")
    args = ap.parse_args()

    formats = dict(item.split("=", 1) for item in args.formats.split(","))
    cats = args.categories.split(",") if args.categories else None
    prompts = select(read_suite(None), cats, args.limit)
    target = load_backend(args.model, n_ctx=2048, threads=args.threads)
    engines = {}
    for label, name in formats.items():
        drafter = load_drafter(target, name, threads=args.threads)
        engines[label] = Engine(target, drafter, draft_max=args.draft_max, adaptive=False)
    params = SamplingParams(0.0)
    rows = []
    labels = list(formats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.phase == "costs":
        rows = json.loads((out / "accept.json").read_text())["rows"]
        prompts = sorted({r["prompt"] for r in rows})
    for i, p in enumerate(prompts if args.phase != "costs" else []):
        order = labels[i % len(labels):] + labels[:i % len(labels)]
        text = next(iter(engines.values())).chat_prompt([{"role": "user", "content": p.text}])
        outs = {}
        for label in order:
            r = engines[label].generate(text, max_tokens=args.n_predict, params=params, is_chat=True)
            s = r.stats
            outs[label] = r.tokens
            rows.append({"prompt": p.id, "category": p.category, "format": label, "drafted": s.drafted,
                         "accepted": s.accepted, "target_calls": s.target_calls, "generated": s.generated_tokens,
                         "draft_s": s.draft_time, "verify_s": s.verify_time, "decode_s": s.decode_time})
            print(f"{p.category:16s} {label:14s} acc {s.accepted}/{s.drafted} tok/s {s.tokens_per_s:.2f}",
                  file=sys.stderr, flush=True)
        same = len({tuple(t) for t in outs.values()}) == 1
        for row in rows[-len(order):]:
            row["same_output"] = same
    if args.phase == "accept":
        (out / "accept.json").write_text(json.dumps({"rows": rows, "settings": vars(args)}, indent=1))
        print(f"wrote {out / 'accept.json'}")
        return 0
    # step costs, alternating
    ctx = target.tokenize(("def merge_intervals(intervals):\n    intervals.sort()\n    out = []\n" * 40))[:256]
    costs = {label: [] for label in labels}
    costs["target"], costs["verify"] = [], []  # the target over 1 token, and over k+1 (a verify pass)
    for _ in range(args.cost_rounds):
        for label in labels:
            costs[label] += step_ms(engines[label].drafter.backend, ctx, 5)
        costs["target"] += step_ms(target, ctx, 5)
        costs["verify"] += step_ms(target, ctx, 3, args.draft_max + 1)
    med = {k: statistics.median(v) for k, v in costs.items()}
    verify = med["verify"] / med["target"]
    summary = []
    base = labels[0]
    for label in labels:
        rs = [r for r in rows if r["format"] == label]
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        gen, dec = sum(r["generated"] for r in rs), sum(r["decode_s"] for r in rs)
        path = models.resolve(formats[label])
        summary.append({"format": label, "model": formats[label], "file_mib": round(path.stat().st_size / 2**20),
                        "draft_step_ms": round(med[label], 2), "c": round(med[label] / med["target"], 3),
                        "step_vs_first": round(med[label] / med[base], 3),
                        "draft_ms_per_drafted": round(1e3 * sum(r["draft_s"] for r in rs) / max(drafted, 1), 2),
                        "acceptance": round(accepted / max(drafted, 1), 4),
                        "tau": round((gen + 0.0) / max(sum(r["target_calls"] for r in rs), 1), 3),
                        "tokens_per_s": round(gen / dec, 3) if dec and args.phase == "all" else None,
                        "all_same_output": all(r["same_output"] for r in rs)})
        s = summary[-1]  # Leviathan's speedup with measured costs: tau over (k draft steps + one verify pass)
        s["predicted_speedup"] = round(s["tau"] / (args.draft_max * s["c"] + verify), 3)
    first = summary[0]
    lines = [f"target {args.model}: 1-token pass {med['target']:.1f} ms, {args.draft_max + 1}-token verify pass "
             f"{med['verify']:.1f} ms ({verify:.2f}x); greedy, draft-max {args.draft_max} fixed, {len(prompts)} prompts"
             f" x {args.n_predict} tokens; draft steps after 256 tokens, median of {args.cost_rounds} alternating "
             "rounds x 5", "",
             "| draft format | file MiB | draft step ms | vs shipped | c | acceptance | Δ acc (points) | τ | "
             "predicted speedup | same output |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for s in summary:
        lines.append(f"| {s['format']} | {s['file_mib']} | {s['draft_step_ms']:.1f} | {s['step_vs_first']:.2f} | "
                     f"{s['c']:.3f} | {s['acceptance']:.1%} | {100 * (s['acceptance'] - first['acceptance']):+.1f} | "
                     f"{s['tau']:.2f} | {s['predicted_speedup']:.2f}x | {'yes' if s['all_same_output'] else 'NO'} |")
    (out / "results.json").write_text(json.dumps({"summary": summary, "rows": rows, "costs_ms": costs,
                                                  "settings": vars(args)}, indent=1))
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    for e in engines.values():
        e.drafter.close() if hasattr(e.drafter, "close") else None
    target.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
