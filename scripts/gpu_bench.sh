#!/usr/bin/env bash
# The GPU benchmark of issue 15, one command: random weights of real Qwen2.5 shapes (no model files travel).
#   env       versions and the device; whether our Triton kernels build and match torch there
#   identity  bit-identical logits: a token alone vs in verify passes of every size (around the 256-position KV
#             block and the 1,024-position attention split), with the Triton kernels and with torch's, CUDA
#             graphs vs eager, speculative greedy output == plain output (Qwen2.5-1.5B shape)
#   replay    the committed traces (docs/bench/traces/*.json, real runs recorded on CPU) replayed with the
#             Qwen2.5-32B shape as target and the 0.5B shape as draft: tokens/s and speedup per category,
#             beside transformers' generate and assisted generation on the same weights
#   costs     ms per pass over n = 1, 5, 8, 16 tokens after 256 context tokens (0.5B, 1.5B, 7B, 32B shapes):
#             ours with CUDA graphs (16 fixed rows; shape classes; each with Triton's kernels and torch's),
#             ours eager, the existing TorchBackend, transformers eager (sdpa + DynamicCache)
#   draft     ms per draft step (0.5B shape) as ModelDrafter runs it: tokens chosen on the device vs the host
#   engine    decode tokens/s through Engine.generate beside the bare passes of the same steps
# Each step reports on its own and a failing step does not stop the next; a summary closes the output and
# $OUT/results.json (or bench-out/gpu/results.json) holds every number. Budget: under 8 minutes on an H200
# (shapes and traces past BENCH_BUDGET seconds, default 420, are skipped; a hard stop at BENCH_TIMEOUT).
# Usage: scripts/gpu_bench.sh            # on a CUDA machine
#        scripts/gpu_bench.sh --smoke    # tiny shapes, runs on a CPU in well under a minute (tests do)
#        scripts/gpu_bench.sh --steps identity,costs
# The GPU machine has no network and may hold an older transformers than the range we test (5.17 broke
# TorchBackend.eval); a wheel carried in .whl/ is used then. Prepare it here and carry it with the run:
#   pip download --no-deps --only-binary=:all: 'transformers==5.24.0' -d .whl   # .whl/ is git-ignored
#   run: command "scripts/gpu_bench.sh 2>&1 | tee $OUT/log", carry [".whl"], timeout_s 540
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # random weights from configs: nothing to fetch
if ls .whl/transformers-*.whl >/dev/null 2>&1 && ! "$PY" -c 'import sys, transformers as t
sys.exit(tuple(int(x) for x in t.__version__.split(".")[:2]) < (5, 24))' 2>/dev/null; then
    site="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --target "$site" .whl/transformers-*.whl \
        && export PYTHONPATH="$site:$PYTHONPATH" && echo "gpu_bench: transformers from $(ls .whl/transformers-*.whl)" >&2
fi
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # cuBLAS: the same bits on every stream
timeout --signal=INT --kill-after=10 "${BENCH_TIMEOUT:-470}" "$PY" -m speculant.gpubench "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu_bench: stopped after ${BENCH_TIMEOUT:-470} s (BENCH_TIMEOUT)" >&2
exit $rc
