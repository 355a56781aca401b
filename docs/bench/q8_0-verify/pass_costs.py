"""Target pass costs over n new tokens after 200 cached (all n logits returned, as a verify pass), median of 5
rounds, for each model named: what `costprofile` measures, printed as ms and as one-token passes.

    .venv/bin/python docs/bench/q8_0-verify/pass_costs.py qwen2.5-coder-1.5b-instruct /tmp/q15-Q8_0.gguf

The Q8_0 file came from `speculant quantize qwen2.5-coder-1.5b-instruct --type Q8_0 --allow-requantize -o ...`.
For an A/B of two builds, copy each build's libggml-cpu-<variant>.so into the venv's llama_cpp/lib in turn.
"""
import statistics
import sys

from speculant import api, costprofile

NS = [1, 2, 3, 4, 5, 8, 16]
for path in sys.argv[1:]:
    b = api.load_backend(path, n_ctx=1024, threads=2)
    costprofile.pass_times_ms(b, [1, 2])  # warm-up
    rounds = [costprofile.pass_times_ms(b, NS, depth=200) for _ in range(5)]
    med = {n: statistics.median(r[n] for r in rounds) for n in NS}
    print(path.split("/")[-1], " ".join(f"n={n}:{med[n]:.1f}({med[n] / med[1]:.2f})" for n in NS), flush=True)
    b.close()
