"""Prompt processing in passes of 512, 64 and 32 tokens on our llama.cpp build: Qwen2.5-Coder-1.5B Q4_K_M,
2 threads, 512 and 1024 random tokens from an empty cache, alternating chunk sizes, two rounds.
Passes of at most 64 tokens run our batch-invariant kernels, longer ones llama.cpp's fast batched kernels.

    .venv/bin/python docs/bench/prefill-chunks/prefill_chunks.py
    SPECULANT_CPU_VARIANT=haswell .venv/bin/python docs/bench/prefill-chunks/prefill_chunks.py   # AVX2 kernels
"""

import time

import numpy as np

from speculant import models, native
from speculant.backends.llamacpp import LlamaCppBackend

b = LlamaCppBackend(str(models.cached_path("qwen2.5-coder-1.5b-instruct")), n_ctx=2048, n_threads=2)
print(f"CPU variant {native.loaded_variant()}, invariant passes up to {b.invariant_rows} tokens")
tokens = [int(t) for t in np.random.default_rng(0).integers(100, 50000, 1024)]


def seconds(chunk: int, n: int) -> float:
    b.rewind(0)
    t = time.perf_counter()
    for a in range(0, n, chunk):
        b.eval(tokens[a:min(a + chunk, n)], n_logits=0)
    return time.perf_counter() - t


for rnd in range(2):
    for n in (512, 1024):
        row = {chunk: seconds(chunk, n) for chunk in (512, 64, 32)}
        print(f"round {rnd}, {n} tokens: " + ", ".join(f"{c}-token passes {s:.2f} s" for c, s in row.items())
              + f" (64 / 512: {row[64] / row[512]:.2f})", flush=True)
b.close()
