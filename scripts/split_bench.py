"""How the threads split a pass's matmuls: ms of passes over n new tokens with the default split (a few chunks of
weight rows a thread) against fixed 64-row chunks (the split before 2026-12-02), alternating round by round in one
process over the same weights, for the target and the draft model.

    .venv/bin/python scripts/split_bench.py [rounds] [threads]
"""
import statistics
import sys

from speculant import costprofile, models, native
from speculant.api import load_backend

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
THREADS = int(sys.argv[2]) if len(sys.argv) > 2 else None
NS = [1, 2, 4, 8]
SPLITS = {"default": 0, "64-row chunks": 64}

for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0"):
    backend = load_backend(models.resolve(name), n_ctx=1024, threads=THREADS)
    try:
        costprofile.pass_times_ms(backend, NS)  # warm-up
        times = {split: [] for split in SPLITS}
        for _ in range(ROUNDS):
            for split, rows in SPLITS.items():
                with native.chunk_rows(rows) as switched:
                    if not switched:
                        sys.exit("this build has no switch for the split (not our build)")
                    times[split].append(costprofile.pass_times_ms(backend, NS))
        print(f"\n{name}: {backend.n_threads} threads, CPU variant {native.loaded_variant()}, "
              f"median of {ROUNDS} alternating rounds, ms per pass")
        print("| n | default | 64-row chunks | default / 64-row |\n|---:|---:|---:|---:|")
        for n in NS:
            new, old = (statistics.median(r[n] for r in times[s]) for s in SPLITS)
            print(f"| {n} | {new:.1f} | {old:.1f} | {new / old:.2f} |")
    finally:
        backend.close()
