#!/usr/bin/env python
"""ms per target pass over n = 1, 4, 8 tokens after a 200-token context, on SmolLM2 rebuilt as a mixture of
experts with MXFP4 experts (or --type's; tests/test_llamacpp.py's _smollm2_as_moe; made once, kept in --dir).
Median of 15. For A/B runs between two builds, alternate the builds' runs (the machine is shared and noisy).

    .venv/bin/python scripts/bench_mxfp4_moe.py [--repack 1|0] [--type MXFP4] [--dir /tmp/speculant-mxfp4]
"""

import argparse
import pathlib
import statistics
import sys
import time

from speculant import models
from speculant.backends.llamacpp import LlamaCppBackend

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repack", type=int, default=1, choices=(0, 1), help="load the weights repacked (default 1)")
    ap.add_argument("--type", default="MXFP4", help="the experts' ggml type (default MXFP4)")
    ap.add_argument("--dir", default="/tmp/speculant-mxfp4", help="where the MoE file is made and kept")
    args = ap.parse_args()
    path = pathlib.Path(args.dir) / f"smollm2-moe-{args.type}.gguf"
    if not path.exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from test_llamacpp import _smollm2_as_moe

        path.parent.mkdir(parents=True, exist_ok=True)
        _smollm2_as_moe(models.cached_path("smollm2-135m-instruct"), path, args.type)
    b = LlamaCppBackend(path, n_ctx=1024, repack=bool(args.repack))
    try:
        tokens = b.tokenize((ROOT / "README.md").read_text())[:300]
        b.eval(tokens[:200])
        ms = {}
        for n in (1, 4, 8):
            times = []
            for _ in range(15):
                b.rewind(200)
                t0 = time.perf_counter()
                b.eval(tokens[200:200 + n])
                times.append(time.perf_counter() - t0)
            ms[n] = 1000 * statistics.median(times)
    finally:
        b.close()
    print(f"{args.type} repack {bool(args.repack)}: " + "  ".join(f"n={n} {v:.2f} ms" for n, v in ms.items())
          + f"  8/1 {ms[8] / ms[1]:.2f}")


if __name__ == "__main__":
    main()
