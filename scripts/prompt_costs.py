"""What prompt processing costs, with and without our AMX tile products (one process, the same weights in memory,
alternating), beside llama.cpp's own llama-bench (pp) where scripts/build_llama_tools.sh built it:

    .venv/bin/python scripts/prompt_costs.py [ROUNDS]

Prints seconds per prompt of 512, 1000 and 2000 tokens (median over ROUNDS, default 3) for the default target and
draft. The prompt runs as `speculant generate` runs it: 64-token batch-invariant passes from position 0.
"""
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from speculant import models, native
from speculant.api import load_backend

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
LENGTHS = (512, 1000, 2000)
MODELS = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0")


def llama_bench(path: Path, n: int):
    """llama-bench's prompt processing (tok/s) of n tokens on 2 threads, or None without the tool."""
    bins = sorted(models.home().glob("llama-tools/*/bin/llama-bench"))
    if not bins:
        return None
    out = subprocess.run([str(bins[-1]), "-m", str(path), "-p", str(n), "-n", "0", "-t", "2", "-r", "2", "-o", "json"],
                         capture_output=True, text=True, timeout=900)
    try:
        return json.loads(out.stdout)[0]["avg_ts"]
    except (ValueError, LookupError):
        return None


text = (ROOT / "README.md").read_text() + (ROOT / "BENCHMARKS.md").read_text()
for name in MODELS:
    path = models.resolve(name)
    backend = load_backend(path, n_ctx=max(LENGTHS) + 64)
    if name == MODELS[0]:
        print(f"AMX tile products here: {native.amx()} (variant {native.loaded_variant()})")
    tokens = backend.tokenize(text)[:max(LENGTHS)]
    times: dict = {}
    try:
        for _ in range(ROUNDS):
            for amx in (True, False):
                for n in LENGTHS:
                    with native.without_amx() if not amx else contextlib.nullcontext():
                        backend.rewind(0)
                        t = time.perf_counter()
                        backend.prefill(tokens[:n])
                        times.setdefault((amx, n), []).append(time.perf_counter() - t)
    finally:
        backend.close()
    for n in LENGTHS:
        on, off = statistics.median(times[True, n]), statistics.median(times[False, n])
        print(f"{name}: prompt of {n}: {on:.2f} s ({n / on:.0f} tok/s) with AMX, {off:.2f} s ({n / off:.0f} tok/s) "
              f"without: {off / on:.2f}x")
    peer = llama_bench(path, 512)
    if peer:
        print(f"{name}: llama-bench pp512 {peer:.0f} tok/s (llama.cpp's defaults, AMX off: scripts/build_llama_tools.sh)")
