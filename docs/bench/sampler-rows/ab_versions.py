"""Before / after: two source trees of speculant decode the same built-in suite prompts, sampled, one fresh
process per (tree, prompt), the trees alternating prompt by prompt; plain decoding and the adaptive default
(draft model) in each. Prints tokens/s per run and the after / before ratios.

    .venv/bin/python docs/bench/sampler-rows/ab_versions.py OLD_TREE NEW_TREE [--suite default] [--limit 1]
        [--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05]
"""

import argparse
import json
import math
import subprocess
import sys

CHILD = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import speculant
from speculant.bench.suite import read_suite
from speculant.verify import SamplingParams
suite, pid, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
t, k, p, m = map(float, sys.argv[5:9])
prompt = [x for x in read_suite(suite) if str(x.id) == pid][0]
out = {}
for method, draft in (("plain", None), ("adaptive", "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0")):
    eng = speculant.load_engine("qwen2.5-coder-1.5b-instruct", draft, threads=2)
    text = eng.chat_prompt(prompt.messages())
    r = eng.generate(text, is_chat=True, max_tokens=128, params=SamplingParams(t, int(k), p, m, seed=seed))
    out[method] = {"tok_s": r.stats.tokens_per_s, "tokens": r.stats.generated_tokens,
                   "accepted": r.stats.accepted, "drafted": r.stats.drafted}
    eng.close()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--suite", default="default")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--min-p", type=float, default=0.05)
    args = ap.parse_args()
    sys.path.insert(0, args.new)
    from speculant.bench.suite import read_suite, select

    prompts = select(read_suite(args.suite), limit=args.limit)
    settings = [str(args.temp), str(args.top_k), str(args.top_p), str(args.min_p)]
    rows = []
    for i, p in enumerate(prompts):
        order = [("before", args.old), ("after", args.new)]
        if i % 2:
            order.reverse()
        got = {}
        for name, tree in order:
            res = subprocess.run([sys.executable, "-c", CHILD, tree, args.suite, str(p.id), str(100 + i), *settings],
                                 capture_output=True, text=True, check=True)
            got[name] = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append((p.id, got))
        print(p.id, json.dumps(got), flush=True)
    for method in ("plain", "adaptive"):
        ratios = [g["after"][method]["tok_s"] / g["before"][method]["tok_s"] for _, g in rows]
        before = sum(g["before"][method]["tok_s"] for _, g in rows) / len(rows)
        after = sum(g["after"][method]["tok_s"] for _, g in rows) / len(rows)
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{method}: before {before:.2f} tok/s, after {after:.2f} tok/s, after/before geomean {geo:.2f}x "
              f"(per prompt {min(ratios):.2f}-{max(ratios):.2f})")
    for name in ("before", "after"):
        speedups = [g[name]["adaptive"]["tok_s"] / g[name]["plain"]["tok_s"] for _, g in rows]
        geo = math.exp(sum(map(math.log, speedups)) / len(speedups))
        d = sum(g[name]["adaptive"]["drafted"] for _, g in rows)
        a = sum(g[name]["adaptive"]["accepted"] for _, g in rows)
        print(f"{name}: adaptive / plain geomean {geo:.3f}x, acceptance {a}/{d} = {a / max(d, 1):.1%}")


if __name__ == "__main__":
    main()
