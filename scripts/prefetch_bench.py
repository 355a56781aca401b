"""Our build's software prefetch off (SPECULANT_PREFETCH=0), into L1 only (SPECULANT_PREFETCH_L2=0), and into L1
plus L2 4 KiB ahead for the repacked Q4_0 kernel (SPECULANT_PREFETCH_L2=4096; the AVX-512 builds' default, off in
the AVX2 ones), side by side: ms per target pass over n new tokens after 200 cached ones, a fresh process per setting
(the kernels read the settings once, at load), alternating setting by setting, round by round. Run it on every new
kind of CPU: the distances were chosen on Sapphire Rapids and checked there on the AVX2 variant too, not on AMD.

    .venv/bin/python scripts/prefetch_bench.py [rounds] [model names or GGUF paths, comma-separated]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

_ARGS = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
_ARGS.add_argument("rounds", nargs="?", type=int, default=2, help="rounds of every setting (default 2)")
_ARGS.add_argument("models", nargs="?", default="qwen2.5-coder-1.5b-instruct,qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0",
                   help="model names or GGUF paths, comma-separated (default: the Qwen pair)")
_OPTS = _ARGS.parse_args()
ROUNDS = _OPTS.rounds
MODELS = _OPTS.models.split(",")
SETTINGS = {"off": {"SPECULANT_PREFETCH": "0"}, "L1": {"SPECULANT_PREFETCH_L2": "0"},
            "L1+L2": {"SPECULANT_PREFETCH_L2": "4096"}}
NS = (1, 5, 8)

CHILD = r"""
import json, statistics, sys, time
from speculant import models, native
from speculant.api import load_backend
backend = load_backend(models.resolve(sys.argv[1]), n_ctx=512)
tokens = [1000 + (i * 7919) % 30000 for i in range(200)]
backend.prefill(tokens)
ms = {}
for n in json.loads(sys.argv[2]):
    times = []
    for r in range(9):
        backend.rewind(200)
        t = time.perf_counter()
        backend.eval([2000 + r + j for j in range(n)], n_logits=n)
        times.append(1000 * (time.perf_counter() - t))
    ms[n] = statistics.median(times)
print(json.dumps({"variant": native.loaded_variant(), "ms": ms}))
"""


def one_run(model: str, setting: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULANT_PREFETCH")}
    env.update(setting)
    out = subprocess.run([sys.executable, "-c", CHILD, model, json.dumps(NS)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


results = {m: {s: {n: [] for n in NS} for s in SETTINGS} for m in MODELS}
variant = "?"
for r in range(ROUNDS):
    for model in MODELS:
        for name, setting in SETTINGS.items():
            run = one_run(model, setting)
            variant = run["variant"]
            for n in NS:
                results[model][name][n].append(run["ms"][str(n)])

print(f"CPU variant {variant}, {ROUNDS} alternating rounds, median of 9 passes each; ms per pass, "
      f"prefetch off / L1 / L1+L2 (off / L1+L2)\n")
print("| model | " + " | ".join(f"n = {n}" for n in NS) + " |\n|---|" + "---:|" * len(NS))
for model in MODELS:
    cells = []
    for n in NS:
        off, l1, l2 = (statistics.median(results[model][s][n]) for s in SETTINGS)
        cells.append(f"{off:.1f} / {l1:.1f} / {l2:.1f} ({off / l2:.2f})")
    print(f"| {os.path.basename(model)} | " + " | ".join(cells) + " |")
