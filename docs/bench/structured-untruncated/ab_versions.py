"""Before / after: two source trees of speculant decode the same structured-suite prompts, sampled with no
truncation (T = 1, top-k 0, top-p 1, min-p 0: OpenAI's defaults), one fresh process per (tree, prompt), the
trees alternating prompt by prompt. Prints tokens/s per run and the after / before ratios.

    .venv/bin/python docs/bench/structured-untruncated/ab_versions.py OLD_TREE NEW_TREE [--limit 2]
"""

import argparse
import json
import subprocess
import sys

CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import speculant
from speculant.bench.suite import read_suite, select
from speculant.verify import SamplingParams
prompt = [p for p in read_suite("structured") if p.id == sys.argv[2]][0]
seed = int(sys.argv[3])
out = {}
for method, draft in (("plain", None), ("adaptive", "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0")):
    eng = speculant.load_engine("qwen2.5-coder-1.5b-instruct", draft, threads=2)
    text = eng.chat_prompt(prompt.messages())
    r = eng.generate(text, is_chat=True, max_tokens=128, params=SamplingParams(1.0, seed=seed),
                     constraint=eng.target.grammar(prompt.grammar))
    out[method] = {"tok_s": r.stats.tokens_per_s, "tokens": r.stats.generated_tokens,
                   "accepted": r.stats.accepted, "drafted": r.stats.drafted}
    eng.close()
print(json.dumps(out))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--limit", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, args.new)
    from speculant.bench.suite import read_suite, select

    prompts = select(read_suite("structured"), limit=args.limit)
    rows = []
    for i, p in enumerate(prompts):
        order = [("before", args.old), ("after", args.new)]
        if i % 2:
            order.reverse()
        got = {}
        for name, tree in order:
            res = subprocess.run([sys.executable, "-c", CHILD, tree, p.id, str(100 + i)], capture_output=True,
                                 text=True, check=True)
            got[name] = json.loads(res.stdout.strip().splitlines()[-1])
        rows.append((p.id, got))
        print(p.id, json.dumps(got), flush=True)
    import math

    for method in ("plain", "adaptive"):
        ratios = [g["after"][method]["tok_s"] / g["before"][method]["tok_s"] for _, g in rows]
        before = sum(g["before"][method]["tok_s"] for _, g in rows) / len(rows)
        after = sum(g["after"][method]["tok_s"] for _, g in rows) / len(rows)
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{method}: before {before:.2f} tok/s, after {after:.2f} tok/s, after/before geomean {geo:.2f}x "
              f"(per prompt {min(ratios):.2f}-{max(ratios):.2f})")
    for name in ("before", "after"):
        d = sum(g[name]["adaptive"]["drafted"] for _, g in rows)
        a = sum(g[name]["adaptive"]["accepted"] for _, g in rows)
        print(f"adaptive acceptance {name}: {a}/{d} = {a / max(d, 1):.1%}")


if __name__ == "__main__":
    main()
