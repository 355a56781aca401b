"""Attention of small passes, ours (each K / V row dotted with every query column that reads it; the softmax's
maximum 16 lanes at once) against ggml's loops (one dot product per element; one compare per score; the same
bits): ms per target pass over n new tokens after C cached positions, alternating round by round in one process
over the same weights and cache.

    .venv/bin/python scripts/attention_bench.py [rounds] [contexts, e.g. 200,1000,2000,3500] [model]
"""
import statistics
import sys
import time
from contextlib import nullcontext

from speculant import models, native
from speculant.api import load_backend

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 15
CONTEXTS = [int(c) for c in (sys.argv[2] if len(sys.argv) > 2 else "200,1000,2000,3500").split(",")]
NAME = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-1.5b-instruct"
NS = [1, 2, 4, 8]

backend = load_backend(models.resolve(NAME), n_ctx=max(CONTEXTS) + 64)
print(f"{NAME}: {backend.n_threads} threads, CPU variant {native.loaded_variant()}, median of {ROUNDS} "
      f"alternating rounds, ms per pass (ours / ggml's loop)\n")
print("| cached positions | " + " | ".join(f"n = {n}" for n in NS) + " |\n|---:|" + "---:|" * len(NS))
try:
    for context in CONTEXTS:
        backend.prefill([1000 + (i * 7919) % 30000 for i in range(context)])
        times = {"ours": {n: [] for n in NS}, "ggml": {n: [] for n in NS}}
        for r in range(ROUNDS):
            for kind in ("ours", "ggml"):
                with native.ggml_attention() if kind == "ggml" else nullcontext(True) as switched:
                    if not switched:
                        sys.exit("this build has no switch for the attention products (not our build)")
                    for n in NS:
                        t = time.perf_counter()
                        backend.eval([2000 + r + j for j in range(n)], n_logits=n)
                        times[kind][n].append(1000 * (time.perf_counter() - t))
                        backend.rewind(context)
        cells = []
        for n in NS:
            ours, ggml = (statistics.median(times[k][n]) for k in ("ours", "ggml"))
            cells.append(f"{ours:.1f} / {ggml:.1f} ({ours / ggml:.2f})")
        print(f"| {context} | " + " | ".join(cells) + " |", flush=True)
finally:
    backend.close()
