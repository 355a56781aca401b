#!/usr/bin/env bash
# Single-token target pass, ours against llama.cpp's default build, in alternating rounds of many passes each
# (bench --costs takes a median of single passes, which is noisier at n = 1 on a shared machine).
#   scripts/ab_single_pass.sh [ROUNDS] [PASSES]      # prints ms per pass and the ratio per round
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-6}" PASSES="${2:-60}"
PY=.venv/bin/python
BIN="$($PY -c 'from speculant.bench.peers import default_tools_dir; print(default_tools_dir())')"
MODEL="$($PY -c 'from speculant import models; print(models.resolve(models.DEFAULT_TARGET))')"
[ -x "$BIN/llama-bench" ] || { echo "ab_single_pass: no llama-bench in $BIN (run scripts/build_llama_tools.sh)" >&2; exit 1; }
for _ in $(seq "$ROUNDS"); do
  ours=$($PY - "$MODEL" "$PASSES" <<'PY'
import sys, time
from speculant import costprofile
from speculant.backends.llamacpp import LlamaCppBackend
b = LlamaCppBackend(sys.argv[1], n_ctx=1024, n_threads=2)
toks = b.tokenize(costprofile.TEXT)
b.eval(toks[:100], n_logits=0)
n = int(sys.argv[2]); t = time.perf_counter()
for _ in range(n):
    b.rewind(100); b.eval(toks[100:101], n_logits=1)
print((time.perf_counter() - t) / n * 1e3)
PY
)
  peer=$("$BIN/llama-bench" -m "$MODEL" -p 1 -n 0 -d 100 -r 20 -t 2 -o json 2>/dev/null \
         | $PY -c "import json,sys; print(1e3 / json.load(sys.stdin)[0]['avg_ts'])")
  $PY -c "print(f'ours {$ours:.1f} ms  llama.cpp {$peer:.1f} ms  ratio {$ours / $peer:.3f}')"
done
