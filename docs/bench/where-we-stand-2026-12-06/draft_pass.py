"""A model's bare one-token pass (backend.eval only), after 200-250 cached tokens: median ms of N passes.

    .venv/bin/python docs/bench/where-we-stand-2026-12-06/draft_pass.py qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0 2 300
    SPECULANT_CHUNK_ROWS=64 .venv/bin/python ...   # rows per chunk of each matmul (0: the default split)
"""
import statistics
import sys
import time

from speculant import api, costprofile

model, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
b = api.load_backend(model, n_ctx=2048, threads=threads)
toks = b.tokenize(costprofile.TEXT)
b.eval(toks[:200], n_logits=0)
times = []
for i in range(n):
    b.rewind(200 + i % 50)
    t = time.perf_counter()
    b.eval([toks[200 + i % 50]], n_logits=1)
    times.append(time.perf_counter() - t)
print(f"{model} threads {threads}: median {1e3 * statistics.median(times):.2f} ms over {n} passes")
b.close()
