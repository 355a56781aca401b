"""For the built-in suite's plain greedy outputs (N prompts per category, default 2): per output token, whether the
draft model's greedy choice agreed with it, and the target's and the draft's max probabilities there
(draft-agreement.json, read by stop_rule_sim.py). Run from the repository root:
.venv/bin/python docs/bench/spr-2026-12-07/draft_agreement.py [N]"""
import json, sys, numpy as np
from speculant.api import load_engine
from speculant.bench.suite import read_suite, select
eng = load_engine(draft_model="qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0", threads=2, lookup=False)
tgt = eng.target; dbk = eng.draft_backend
prompts = select(read_suite(), limit=int(sys.argv[1]) if len(sys.argv) > 1 else 2)
def maxprob(x):
    x = x.astype(np.float64); x = x - x.max(-1, keepdims=True); e = np.exp(x); return 1.0 / e.sum(-1)
out_rows = []
for p in prompts:
    ids = eng.tokenize_prompt(eng.chat_prompt(p.messages(), p.tools), is_chat=True)
    res = eng.generate(ids, max_tokens=128)
    out = res.tokens
    ctx = list(ids) + list(out)
    tl = tgt.sync(ctx[:-1], n_logits=len(out))  # [len(out), V]: row i predicts out[i]
    dl = dbk.sync(ctx[:-1], n_logits=len(out))
    tl = tl[:, :dl.shape[1]] if tl.shape[1] > dl.shape[1] else tl
    V = min(tl.shape[1], dl.shape[1])
    t_p = maxprob(tl).tolist(); d_p = maxprob(dl).tolist()
    agree = [int(np.argmax(dl[i, :V]) == out[i]) for i in range(len(out))]
    out_rows.append({"cat": p.category, "id": p.id, "t_p": t_p, "d_p": d_p, "agree": agree})
    print(p.category, len(out), sum(agree) / len(out), file=sys.stderr)
json.dump(out_rows, open("docs/bench/spr-2026-12-07/draft-agreement.json", "w"))
