"""Long-context costs of the default target: a 1000-token prompt's processing, then passes over n new tokens ending
at 1000 and 2000 positions (median of 7 each). Run it alternately on two builds (fresh processes) to compare them:

    .venv/bin/python scripts/long_context_costs.py LABEL
"""
import statistics
import sys
import time
from pathlib import Path

from speculant import models
from speculant.api import load_backend

ROOT = Path(__file__).resolve().parents[1]
label = sys.argv[1] if len(sys.argv) > 1 else "this build"
backend = load_backend(models.resolve("qwen2.5-coder-1.5b-instruct"), n_ctx=2100)
try:
    tokens = backend.tokenize((ROOT / "README.md").read_text() + (ROOT / "BENCHMARKS.md").read_text())[:2000]
    t = time.perf_counter()
    backend.prefill(tokens[:1000])
    prompt_s = time.perf_counter() - t
    ms = {}
    for context in (1000, 2000):
        backend.prefill(tokens[:context])
        for n in (1, 8):
            times = []
            for _ in range(7):
                backend.rewind(context - 8)
                t = time.perf_counter()
                backend.eval(tokens[context - 8:context - 8 + n])
                times.append(1000 * (time.perf_counter() - t))
            ms[context, n] = statistics.median(times)
finally:
    backend.close()
print(f"{label}: prompt of 1000 {prompt_s:.2f} s; " +
      "; ".join(f"n = {n} after {c}: {v:.1f} ms" for (c, n), v in ms.items()))
