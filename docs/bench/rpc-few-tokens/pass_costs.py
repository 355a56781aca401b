"""Target pass costs (ms over n new tokens after 100, 2 threads) of an RPC worker's plain rows with the repacked
kernels' arithmetic (native.set_plain_as_repacked), this build against the previous one, beside plain rows with
ggml's arithmetic and repacked rows: rounds alternate between the configurations, each a fresh process.
OLD_PKG: a directory holding the previous build's llama_cpp package (put first on PYTHONPATH).

    python docs/bench/rpc-few-tokens/pass_costs.py OLD_PKG [rounds] [model] [filter]
"""

import json
import os
import statistics
import subprocess
import sys

NS = [1, 2, 3, 4, 5, 8]
CHILD = r'''
import json, statistics, sys
from speculant import costprofile, models, native
from speculant.api import load_backend
NS = json.loads(sys.argv[3])
b = load_backend(str(models.resolve(sys.argv[1])), n_ctx=2048, threads=2)
if sys.argv[2] == "as-repacked":
    assert native.set_plain_as_repacked()
costprofile.pass_times_ms(b, [1, 2])
rounds = [costprofile.pass_times_ms(b, NS) for _ in range(3)]
print(json.dumps({"build": (native.build_info() or {}).get("key"), "ms": {n: statistics.median(r[n] for r in rounds) for n in NS}}))
'''


def main() -> int:
    old_pkg = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    model = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-coder-1.5b-instruct"
    only = sys.argv[4] if len(sys.argv) > 4 else ""
    configs = {"plain, previous build": (old_pkg, "0", ""), "plain, this build": (None, "0", ""),
               "plain with the repacked arithmetic (RPC worker), previous build": (old_pkg, "0", "as-repacked"),
               "plain with the repacked arithmetic (RPC worker), this build": (None, "0", "as-repacked"),
               "repacked, this build": (None, "1", "")}
    configs = {k: v for k, v in configs.items() if only in k}
    got = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (pkg, repack, mode) in configs.items():
            env = {**os.environ, "SPECULANT_REPACK": repack, "SPECULANT_THP": "0", "SPECULANT_COST_PROFILE": "0"}
            if pkg:
                env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
            out = subprocess.run([sys.executable, "-c", CHILD, model, mode, json.dumps(NS)], env=env,
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            got[name].append(json.loads(out))
    print(f"{model}: ms per target pass over n new tokens after 100 (2 threads; median of {rounds} alternating "
          f"processes x 3 rounds)")
    print("| weights | build | " + " | ".join(f"n={n}" for n in NS) + " |")
    print("|---|---|" + "---:|" * len(NS))
    table = {}
    for name, runs in got.items():
        ms = {n: statistics.median(r["ms"][str(n)] for r in runs) for n in NS}
        table[name] = {"build": runs[0]["build"], "ms": ms}
        print(f"| {name} | {runs[0]['build']} | " + " | ".join(f"{ms[n]:.1f}" for n in NS) + " |")
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
