"""Benchmark statistics over raw rows (one row = one prompt x method x temperature x repeat).

Row fields used here: prompt_id, category, variant, k, temp, tokens_per_s, generated_tokens, drafted,
accepted, target_calls, drafted_by_position, accepted_by_position, draft_s, greedy_equal (None where not
applicable), cost ("draft_model" | "in_run").

Speedup follows Spec-Bench: mean over prompts of the method's tokens/s divided by the mean over the same
prompts of plain tokens/s (same temperature); the spread is the quartiles of the per-prompt ratios.
Rows may name a `baseline` variant (default plain): the plain decoding on the method's own target runtime
("plain-torch" for torch-target methods). Greedy identity is checked against it, and a second ratio,
speedup_vs_baseline, is taken against it; `backend` picks that runtime's measured costs.
The predicted speedup is Leviathan et al.'s: E / (k*c + V(k+1)) with E = (1 - a^(k+1)) / (1 - a).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional

import numpy as np

BASELINE = "plain"
OVERALL = "overall"


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target pass with k drafts, each accepted with probability alpha (i.i.d.)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def verify_cost(costs: dict, n: int) -> float:
    """V(n): a target pass over n tokens relative to a one-token pass, from the measured table (linear
    extrapolation past the largest n measured)."""
    table = {int(key): float(v) for key, v in costs["V"].items()}
    if n in table:
        return table[n]
    ns = sorted(table)
    if len(ns) == 1:
        return table[ns[0]] * n / ns[0]
    lo, hi = ns[-2], ns[-1]
    if n < ns[0]:
        return table[ns[0]]
    if n > hi:
        slope = (table[hi] - table[lo]) / (hi - lo)
        return table[hi] + slope * (n - hi)
    below = max(x for x in ns if x < n)
    above = min(x for x in ns if x > n)
    return table[below] + (table[above] - table[below]) * (n - below) / (above - below)


def predicted_speedup(alpha: float, k: int, c: float, v_k1: float) -> float:
    """Leviathan: E / (k*c + V(k+1)), all costs relative to one single-token target pass."""
    denom = k * c + v_k1
    return expected_tokens(alpha, k) / denom if denom > 0 else float("nan")


def _sum_lists(lists: Iterable[list]) -> list:
    out: list = []
    for xs in lists:
        if len(xs) > len(out):
            out += [0] * (len(xs) - len(out))
        for i, x in enumerate(xs):
            out[i] += x
    return out


def _per_prompt_tps(rows: list[dict]) -> dict[str, float]:
    by: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        by[r["prompt_id"]].append(r["tokens_per_s"])
    return {p: float(np.mean(v)) for p, v in by.items()}


def aggregate(rows: list[dict], base_rows: list[dict], *, k: int, costs: Optional[dict]) -> dict:
    """Statistics of one variant's rows against plain rows (same temperature), over the prompts both have."""
    tps, base = _per_prompt_tps(rows), _per_prompt_tps(base_rows)
    common = [p for p in tps if p in base]
    out: dict = {"n_prompts": len(common), "n_rows": len(rows)}
    m = float(np.mean([tps[p] for p in common])) if common else float("nan")
    b = float(np.mean([base[p] for p in common])) if common else float("nan")
    out["tokens_per_s"] = m
    out["plain_tokens_per_s"] = b
    out["speedup"] = m / b if common and b > 0 else float("nan")
    ratios = [tps[p] / base[p] for p in common if base[p] > 0]
    q1, med, q3 = np.percentile(ratios, [25, 50, 75]) if ratios else (float("nan"),) * 3
    out.update(ratio_q1=float(q1), ratio_median=float(med), ratio_q3=float(q3),
               ratio_min=float(min(ratios)) if ratios else float("nan"),
               ratio_max=float(max(ratios)) if ratios else float("nan"))
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    # the end-of-generation token is produced by a target call too, though it is not part of the text
    generated = sum(r["generated_tokens"] + int(bool(r.get("ended_by_eog"))) for r in rows)
    calls = sum(r["target_calls"] for r in rows)
    out["drafted"], out["accepted"] = drafted, accepted
    out["acceptance"] = accepted / drafted if drafted else None
    by_source: dict = defaultdict(int)  # which drafter supplied the accepted tokens
    for r in rows:
        for src, n in (r.get("accepted_by_source") or {}).items():
            by_source[src] += n
    out["accepted_by_source"] = dict(by_source)
    out["tau"] = generated / calls if calls else None  # counts the target's own token, as Spec-Bench does
    d_pos = _sum_lists(r["drafted_by_position"] for r in rows)
    a_pos = _sum_lists(r["accepted_by_position"] for r in rows)
    out["acceptance_by_position"] = [a / d if d else None for a, d in zip(a_pos, d_pos)]
    out["predicted_speedup"] = None
    out["c"] = None
    # Leviathan's formula is for k drafted at every step: a method that decoded steps plainly (an adaptive policy's
    # k = 0, lookup finding no match) drafts another mix, which it would misprice (2.73x predicted at tau 1.20)
    every_step = all(r.get("plain_steps", 0) == 0 for r in rows)
    if costs and k > 0 and out["acceptance"] is not None and every_step:
        c = draft_cost(rows, costs)
        out["c"] = c
        out["predicted_speedup"] = predicted_speedup(out["acceptance"], k, c, verify_cost(costs, k + 1))
    eq = [r["greedy_equal"] for r in rows if r.get("greedy_equal") is not None]
    out["greedy_equal"] = sum(eq) if eq else None
    out["greedy_checked"] = len(eq) if eq else None
    return out


def draft_cost(rows: list[dict], costs: dict) -> float:
    """c: one draft token's cost relative to a one-token target pass."""
    if rows and rows[0].get("cost") == "draft_model" and costs.get("c") is not None:
        return float(costs["c"])
    drafted = sum(r["drafted"] for r in rows)
    t1 = costs["target_ms"]["1"] if "1" in costs["target_ms"] else costs["target_ms"][1]
    return (sum(r["draft_s"] for r in rows) * 1000.0 / drafted) / t1 if drafted and t1 > 0 else 0.0


def summarize(rows: list[dict], costs: Optional[dict] = None,
              costs_by_backend: Optional[dict] = None) -> list[dict]:
    """One summary per (temperature, variant, category) plus an 'overall' per (temperature, variant).
    Variants keep their order of first appearance; categories too, with overall last. costs_by_backend:
    runtime -> measured costs, for rows whose `backend` was measured apart (else `costs`)."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    categories = list(dict.fromkeys(r["category"] for r in rows))
    temps = list(dict.fromkeys(r["temp"] for r in rows))
    out = []
    for temp in temps:
        at_t = [r for r in rows if r["temp"] == temp]
        base_all = [r for r in at_t if r["variant"] == BASELINE]
        for variant in variants:
            vrows = [r for r in at_t if r["variant"] == variant]
            if not vrows:
                continue
            k = int(vrows[0].get("k") or 0)
            baseline = vrows[0].get("baseline") or BASELINE
            vcosts = (costs_by_backend or {}).get(vrows[0].get("backend"), costs)
            for cat in categories + [OVERALL]:
                crows = vrows if cat == OVERALL else [r for r in vrows if r["category"] == cat]
                if not crows:
                    continue
                cbase = base_all if cat == OVERALL else [r for r in base_all if r["category"] == cat]
                s = {"temp": temp, "variant": variant, "method": vrows[0].get("method", variant), "k": k,
                     "category": cat}
                s.update(aggregate(crows, cbase, k=k, costs=vcosts))
                s["baseline"] = baseline
                s["speedup_vs_baseline"] = s["speedup"]
                if baseline != BASELINE:
                    own = [r for r in at_t if r["variant"] == baseline and (cat == OVERALL or r["category"] == cat)]
                    s["speedup_vs_baseline"] = aggregate(crows, own, k=0, costs=None)["speedup"]
                out.append(s)
    return out


def mark_greedy_equal(rows: list[dict], tokens: dict) -> None:
    """Set row['greedy_equal'] on rows other than their baseline: same tokens as the baseline (row['baseline'],
    default plain) for that prompt, temperature and repeat. Sampled rows too: the bench's requests are seeded, so
    they draw with coupled noise (verify.coupled_draw) and are then equal as greedy ones are. `tokens` maps
    (prompt_id, temp, repeat, variant) -> generated token ids."""
    for r in rows:
        r["greedy_equal"] = None
        baseline = r.get("baseline") or BASELINE
        if r["variant"] == baseline:
            continue
        ref = tokens.get((r["prompt_id"], r["temp"], r["repeat"], baseline))
        if ref is not None:
            r["greedy_equal"] = tokens[(r["prompt_id"], r["temp"], r["repeat"], r["variant"])] == ref
