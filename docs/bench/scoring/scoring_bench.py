"""Scoring as evaluation harnesses do it (lm-eval's loglikelihood over /v1/completions: echo + logprobs,
max_tokens 0): each question's context with each of its 4 answers, one prompt per answer.

Three ways, interleaved question by question (the order rotates), in one process over one target:
  before  a fresh Engine per prompt and the old token_logprobs (one float64 [n, V] log_softmax, argpartition)
  rows    a fresh Engine per prompt, today's token_logprobs (row by row, alternatives above a cut)
  kept    one Engine for all prompts: the entries shared with the last prompt scored are kept
All three must give the same log-probabilities (checked). Prints seconds per question and the ratios.
Usage: python docs/bench/scoring/scoring_bench.py [questions (default 5)] [top (default 1)]
"""
import json
import sys
import time
from importlib.resources import files

import numpy as np

import speculant.engine as engine_mod
from speculant import models
from speculant.api import load_backend
from speculant.engine import Engine
from speculant.verify import TokenLogprob


def old_token_logprobs(logits, tokens, n_top):
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))  # [n, V]
    out = []
    for row, token in zip(logp, tokens):
        top: tuple = ()
        if n_top > 0:
            m = min(n_top, row.shape[0])
            head = np.argpartition(-row, m - 1)[:m]
            head = head[np.lexsort((head, -row[head]))]
            top = tuple((int(t), float(row[t])) for t in head)
        out.append(TokenLogprob(int(token), float(row[token]), top))
    return out


NEW = engine_mod.token_logprobs
ANSWERS = [" It parses the input.", " It stores records and reports totals.", " It draws a chart.", " Nothing."]


def main(n_questions=5, n_top=1):
    target = load_backend(models.DEFAULT_TARGET, n_ctx=4096, threads=2)
    code = sorted(p for p in files("speculant").joinpath("data/code").iterdir() if p.name.endswith(".py"))
    questions = [p.read_text()[:1800] + "\n\nQuestion: what does this module do?\nAnswer:" for p in code][:n_questions]
    kept = Engine(target)
    totals = {"before": 0.0, "rows": 0.0, "kept": 0.0}
    rows = []
    for qi, q in enumerate(questions):
        prompts = [target.tokenize(q + a) for a in ANSWERS]
        order = ["before", "rows", "kept"]
        order = order[qi % 3:] + order[:qi % 3]
        got, secs = {}, {}
        for way in order:
            engine_mod.token_logprobs = old_token_logprobs if way == "before" else NEW
            t = time.perf_counter()
            got[way] = [(kept if way == "kept" else Engine(target)).prompt_logprobs(p, n_top) for p in prompts]
            secs[way] = time.perf_counter() - t
        engine_mod.token_logprobs = NEW
        values = {w: [[e.logprob for e in entries] for entries in g] for w, g in got.items()}
        assert values["before"] == values["rows"] == values["kept"], "log-probabilities differ"
        for w in totals:
            totals[w] += secs[w]
        rows.append({"question": qi, "prompt_tokens": [len(p) for p in prompts], **{w: round(s, 2) for w, s in secs.items()}})
        print(f"question {qi} ({len(prompts[0])} tokens x 4): before {secs['before']:.2f} s, rows {secs['rows']:.2f} s, "
              f"kept {secs['kept']:.2f} s", flush=True)
    print(f"total: before {totals['before']:.1f} s, rows {totals['rows']:.1f} s ({totals['before'] / totals['rows']:.2f}x), "
          f"kept {totals['kept']:.1f} s ({totals['before'] / totals['kept']:.2f}x); same log-probabilities: yes")
    print(json.dumps({"top": n_top, "questions": rows, "totals": {w: round(s, 2) for w, s in totals.items()}}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
