"""Target pass costs (ms over n new tokens after 100) with the weights plain (SPECULANT_REPACK=0) and repacked,
for two builds side by side, and plain rows with the repacked kernels' arithmetic (native.set_plain_as_repacked,
as RPC workers compute): rounds alternate between the configurations, each a fresh process (the layout is chosen at
load). OLD_PKG: a directory holding the previous build's llama_cpp package (put first on PYTHONPATH).

    python docs/bench/plain-as-repacked/layouts.py OLD_PKG [rounds] [model] [NEW_PKG]

NEW_PKG (optional): the same for this build (default: the installed one).
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, statistics, sys
from speculant import costprofile, models, native
from speculant.api import load_backend
b = load_backend(str(models.resolve(sys.argv[1])), n_ctx=2048, threads=2)
if sys.argv[2] == "as-repacked":
    assert native.set_plain_as_repacked()
costprofile.pass_times_ms(b, [1, 2])
rounds = [costprofile.pass_times_ms(b, [1, 2, 4, 5, 8]) for _ in range(3)]
print(json.dumps({"build": (native.build_info() or {}).get("key"), "repack": b.repack,
                  "ms": {n: statistics.median(r[n] for r in rounds) for n in (1, 2, 4, 5, 8)}}))
'''


def main() -> int:
    old_pkg = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    model = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-1.5b-instruct"
    new_pkg = sys.argv[4] if len(sys.argv) > 4 else None
    configs = {"previous build, plain": (old_pkg, "0", ""), "this build, plain": (new_pkg, "0", ""),
               "this build, plain, repacked arithmetic (RPC workers)": (new_pkg, "0", "as-repacked"),
               "this build, repacked": (new_pkg, "1", "")}
    got = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (pkg, repack, mode) in configs.items():
            env = {**os.environ, "SPECULANT_REPACK": repack, "SPECULANT_THP": "0", "SPECULANT_COST_PROFILE": "0"}
            if pkg:
                env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
            out = subprocess.run([sys.executable, "-c", CHILD, model, mode], env=env, capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            got[name].append(json.loads(out))
    print(f"{model}: ms per target pass over n tokens after 100 (median over {rounds} alternating processes x 3 rounds)")
    print("| weights | build | n=1 | n=2 | n=4 | n=5 | n=8 | r(5) | r(8) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    table = {}
    for name, runs in got.items():
        ms = {n: statistics.median(r["ms"][str(n)] for r in runs) for n in (1, 2, 4, 5, 8)}
        table[name] = {"build": runs[0]["build"], "ms": ms}
        cells = " | ".join(f"{ms[n]:.1f}" for n in (1, 2, 4, 5, 8))
        print(f"| {name} | {runs[0]['build']} | {cells} | {ms[5] / ms[1]:.2f} | {ms[8] / ms[1]:.2f} |")
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
