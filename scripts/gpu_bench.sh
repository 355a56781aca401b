#!/usr/bin/env bash
# Plain vs draft model vs self-speculative decoding on a CUDA GPU, torch backend, bf16:
# target qwen2.5-coder-1.5b-instruct, draft qwen2.5-coder-0.5b-instruct, both loaded from the GGUFs
# (dequantized by transformers; the conversion is cached under $SPECULANT_HOME/torch/).
# Budget: well under 10 minutes (conversion ~1-2 min, calibration ~1 min, 3 runs x 3 prompts x N tokens).
# Usage: scripts/gpu_bench.sh [N_TOKENS] [DRAFT_MAX]    -> JSON lines on stdout, a summary table at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
N=${1:-128}
K=${2:-4}
TARGET=${TARGET:-qwen2.5-coder-1.5b-instruct}   # overridable for a CPU smoke run, e.g. TARGET=DRAFT=smollm2-135m-instruct
DRAFT=${DRAFT:-qwen2.5-coder-0.5b-instruct}
export N K TARGET DRAFT
timeout ${BENCH_TIMEOUT:-540} "$PY" - <<'PYEOF'
import json, os, sys, time
import torch
from speculant.backends.torch import load_torch_backend
from speculant.calibrate import calibrate, load_config, save_config
from speculant.drafters.model import ModelDrafter
from speculant.drafters.selfspec import SelfSpecDrafter
from speculant.engine import Engine
from speculant.verify import SamplingParams
from speculant.vocab import check_compatible

N, K = int(os.environ["N"]), int(os.environ["K"])
dev = "cuda" if torch.cuda.is_available() else "cpu"
print(f"device {dev} {torch.cuda.get_device_name(0) if dev == 'cuda' else ''}", file=sys.stderr)
t0 = time.time()
if os.environ.get("THREADS"):
    torch.set_num_threads(int(os.environ["THREADS"]))
target = load_torch_backend(os.environ["TARGET"], dtype="bf16", device=dev)
draft = load_torch_backend(os.environ["DRAFT"], dtype="bf16", device=dev)
check_compatible(target.vocab_info(), draft.vocab_info(), target.name, draft.name)
print(f"loaded in {time.time() - t0:.1f}s", file=sys.stderr)
prompts = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals and returns them sorted.",
    "Write a C function that reverses a singly linked list, with a short explanation.",
    "Explain the difference between a process and a thread, with an example in Python.",
]
prompts = [Engine(target).chat_prompt([{"role": "user", "content": p}]) for p in prompts]
cfg = load_config(target)
if cfg is None:
    t = time.time()
    cfg = calibrate(target, prompts[:2], max_tokens=48, draft_max=K, log=lambda s: print(s, file=sys.stderr))
    print(f"calibrated in {time.time() - t:.1f}s: {cfg['description']}, saved to {save_config(target, cfg)}",
          file=sys.stderr)
Engine(target).generate(prompts[0], max_tokens=8, is_chat=True)  # warm-up (CUDA kernels, allocator)

setups = {
    "plain": lambda: Engine(target),
    "draft-model": lambda: Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=K),
    "self-spec": lambda: Engine(target, SelfSpecDrafter(target, cfg["layers"]), draft_max=K),
}
summary, ref = {}, {}
for name, make in setups.items():
    toks, secs, drafted, accepted = 0, 0.0, 0, 0
    for i, p in enumerate(prompts):
        if dev == "cuda":
            torch.cuda.synchronize()
        r = make().generate(p, max_tokens=N, params=SamplingParams(0.0), is_chat=True)
        s = r.stats
        toks += s.generated_tokens; secs += s.decode_time; drafted += s.drafted; accepted += s.accepted
        same = None
        if name == "plain":
            ref[i] = r.tokens
        else:
            n = min(len(ref[i]), len(r.tokens))
            same = r.tokens[:n] == ref[i][:n]
        print(json.dumps({"setup": name, "prompt": i, "tokens": s.generated_tokens,
                          "tokens_per_s": round(s.tokens_per_s, 2), "acceptance": round(s.acceptance_rate, 3),
                          "same_as_plain": same, "peak_rss_mb": round(s.peak_rss_mb)}), flush=True)
    summary[name] = (toks / secs if secs else 0.0, accepted / drafted if drafted else 0.0)
base = summary["plain"][0]
print(f"\n{'setup':12s} {'tok/s':>8s} {'speedup':>8s} {'accept':>7s}")
for name, (tps, acc) in summary.items():
    print(f"{name:12s} {tps:8.2f} {tps / base if base else 0:7.2f}x {acc:7.1%}")
print(f"self-spec layers: {cfg['description']} ({len(cfg['layers'])}/{cfg['n_layers']})")
if dev == "cuda":
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
PYEOF
