"""What prompt processing costs, with and without our AMX tile products (one process, the same weights in memory,
alternating), beside llama.cpp's own llama-bench (pp512) where scripts/build_llama_tools.sh built it:

    .venv/bin/python scripts/prompt_costs.py [ROUNDS] [--passes]

Prints seconds per prompt of 512, 1000 and 2000 tokens (median over ROUNDS, default 3) for the default target and
draft. The prompt runs as `speculant generate` runs it: 64-token batch-invariant passes from position 0. With
--passes, also each model's ms per verify pass (every token's logits) over n = 1..64 new tokens after 200
positions, both ways. --models=NAME,... measures those models instead (registered names or .gguf paths).
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
ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ROUNDS = int(ARGS[0]) if ARGS else 3
PASSES = "--passes" in sys.argv
LENGTHS = (512, 1000, 2000)
PASS_SIZES = (1, 4, 8, 9, 10, 12, 14, 16, 20, 32, 64)
MODELS = tuple(next((a.split("=", 1)[1].split(",") for a in sys.argv[1:] if a.startswith("--models=")),
                    ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0"]))


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


def switch(amx: bool):
    return contextlib.nullcontext(True) if amx else native.without_amx()


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
                with switch(amx):
                    for n in LENGTHS:
                        backend.rewind(0)
                        t = time.perf_counter()
                        backend.prefill(tokens[:n])
                        times.setdefault((amx, n), []).append(time.perf_counter() - t)
                    if PASSES:
                        backend.prefill(tokens[:200])
                        for n in PASS_SIZES:
                            for _ in range(3):
                                backend.rewind(200)
                                t = time.perf_counter()
                                backend.eval(tokens[200:200 + n], n_logits=n)  # as a verify pass: every token's logits
                                times.setdefault((amx, "pass", n), []).append(1000 * (time.perf_counter() - t))
    finally:
        backend.close()
    for n in LENGTHS:
        on, off = statistics.median(times[True, n]), statistics.median(times[False, n])
        print(f"{name}: prompt of {n}: {on:.2f} s ({n / on:.0f} tok/s) with AMX, {off:.2f} s ({n / off:.0f} tok/s) "
              f"without: {off / on:.2f}x")
    if PASSES:
        for n in PASS_SIZES:
            on, off = statistics.median(times[True, "pass", n]), statistics.median(times[False, "pass", n])
            print(f"{name}: verify pass of {n} after 200: {on:.1f} ms with AMX, {off:.1f} ms without: {off / on:.2f}x")
    peer = llama_bench(path, 512)
    if peer:
        print(f"{name}: llama-bench pp512 {peer:.0f} tok/s (llama.cpp's defaults, AMX off: scripts/build_llama_tools.sh)")
