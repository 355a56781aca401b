"""How close the adaptive policy's per-token rule (DraftBudget.more/take) comes to an oracle, for the draft model alone,
simulated over real draft agreement (draft_agreement.py: per output token of plain greedy decoding, the draft model's
greedy choice agreed or not, and its max probability). Costs in one-token target passes: c a draft step, v an extra
verified token. Usage: python stop_rule_sim.py [c v]   (Sapphire Rapids here: 0.30 0.10; Zen 4: 0.32 0.17)"""
import collections
import json
import sys
from pathlib import Path

rows = json.load(open(Path(__file__).with_name("draft-agreement.json")))
EDGES = (0, 0.5, 0.8, 0.9, 0.95, 0.98)  # the policy's confidence buckets (policy.CONFIDENCE_EDGES)
c, v = (float(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (0.30, 0.10)


def bucket(p):
    return max(i for i, e in enumerate(EDGES) if p >= e)


counts = collections.defaultdict(lambda: [0, 0])
for r in rows:
    for a, p in zip(r["agree"], r["d_p"]):
        counts[bucket(p)][0] += a
        counts[bucket(p)][1] += 1
A = {k: hit / n for k, (hit, n) in counts.items()}  # acceptance per bucket (what the policy learns)


def run(r, k_max, rule, scale=lambda recent: 1.0, recent=None):
    """Seconds (in T(1)) to emit r's tokens: each step drafts while `rule` says so, then one verify pass."""
    n, pos, time = len(r["agree"]), 0, 0.0
    recent = collections.deque(maxlen=512) if recent is None else recent
    while pos < n:
        drafted, p_all, last, step = 0, 1.0, None, 0.0
        s = scale(recent)
        while drafted < min(k_max, n - pos - 1):
            if drafted and rule == "policy" and p_all * A[last] < s * (c + v):
                break  # more(): the next token's odds (the last one's bucket) against a draft step and a verify
            if drafted and rule == "oracle" and not r["agree"][pos + drafted - 1]:
                break  # stop right after the first wrong draft (which was still paid for)
            step += c
            last = bucket(r["d_p"][pos + drafted])
            if rule == "policy" and p_all * A[last] < v:
                break  # take(): not worth verifying
            p_all *= A[last]
            drafted += 1
        accepted = 0
        while accepted < drafted and r["agree"][pos + accepted]:
            accepted += 1
        step += 1 + v * drafted
        time += step
        pos += accepted + 1
        recent.append((step, accepted + 1))
    return time


def value(recent):  # token_value: recent seconds per token over T(1), at most 1 (its price scale: 1 / that)
    return 1.0 / min(sum(t for t, _ in recent) / sum(k for _, k in recent), 1.0) if recent else 1.0


tokens = sum(len(r["agree"]) for r in rows)
print(f"c = {c}, v = {v}; {len(rows)} outputs, {tokens} tokens; speedup over plain decoding (draft model only)")
for name, k, rule, scale in (("fixed k = 1", 1, "fixed", None), ("fixed k = 4", 4, "fixed", None),
                             ("the policy's rule, k <= 4", 4, "policy", None),
                             ("the policy's rule, k <= 8", 8, "policy", None),
                             ("  prices x 1.5", 8, "policy", lambda _: 1.5),
                             ("  prices / token value (512 steps)", 8, "policy", value),
                             ("oracle stop, k <= 8", 8, "oracle", None)):
    shared = collections.deque(maxlen=512)  # the policy's memory runs across requests
    t = sum(run(r, k, rule, scale or (lambda _: 1.0), shared) for r in rows)
    print(f"{name:38s} {tokens / t:.3f}x")
