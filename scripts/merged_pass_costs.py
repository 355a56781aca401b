#!/usr/bin/env python
"""What a merged pass costs: ms of one target pass over k tokens of each of s request slots (serve -np),
against one slot alone, after a 300-token context in every slot. Median of 9, alone on the machine (run it
under `flock /tmp/speculant-bench.lock`).

    .venv/bin/python scripts/merged_pass_costs.py [-m MODEL] [-np 4] [-t 2]
"""

import argparse
import statistics
import time

from speculant import models
from speculant.backends.llamacpp import LlamaCppBackend
from speculant.batching import Job

TEXT = "def merge_intervals(intervals):\n    intervals.sort()\n    out = []\n" * 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default=models.DEFAULT_TARGET)
    p.add_argument("-np", "--parallel", type=int, default=4)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--sizes", default="1,2,4,5", help="tokens per slot (k)")
    args = p.parse_args()
    b = LlamaCppBackend(models.resolve(args.model), n_ctx=1024, n_threads=args.threads, n_seq=args.parallel)
    slots = [b.slot(i) for i in range(b.n_seq)]
    toks = b.tokenize(TEXT)[:300]
    for s in slots:
        s.prefill(toks[:-1])
    start = len(toks) - 1
    print(f"{args.model}, {args.threads} threads: ms per pass (k tokens in each of s slots)")
    print("k  " + "  ".join(f"s={s:<5d}" for s in range(1, b.n_seq + 1)))
    for k in (int(x) for x in args.sizes.split(",")):
        row = []
        for s in range(1, b.n_seq + 1):
            times = []
            for _ in range(9):
                jobs = [Job(b, i, start, toks[-1:] + toks[:k - 1], k) for i in range(s)]
                t = time.perf_counter()
                b.run_group(jobs)
                times.append((time.perf_counter() - t) * 1e3)
                for slot in slots:
                    slot._truncate(start)
            row.append(statistics.median(times))
        print(f"{k:<2d} " + "  ".join(f"{ms:7.1f}" for ms in row))
    b.close()


if __name__ == "__main__":
    main()
