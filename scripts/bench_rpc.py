"""Plain vs speculative decoding with the target split over 0, 1 and 2 RPC workers at 0, 1 and 5 ms of added
one-way latency, in one run (BENCHMARKS.md, "A target split over RPC workers").

Workers run on this machine (`speculant worker -t 1`); latency comes from speculant.bench.netdelay between
the client and each worker (this kernel has no netem qdisc). Per configuration the target is loaded once with
its layers split equally over this machine and the workers, the draft stays local, and each prompt runs plain
then speculative (order alternating per prompt). Greedy, so every speculative output is checked against the
local plain output token for token.

    flock /tmp/speculant-bench.lock python scripts/bench_rpc.py --out docs/bench/rpc.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Explain in three sentences what a hash table is and why lookups are fast on average.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("-md", "--model-draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("-n", "--n-predict", type=int, default=40)
    p.add_argument("--draft-max", type=int, default=4)
    p.add_argument("--adapt", action="store_true", help="adaptive draft length (default: always --draft-max)")
    p.add_argument("--workers", default="0,1,2")
    p.add_argument("--delays", default="0,1,5", help="added one-way latency per direction, ms")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from speculant.api import load_drafter, load_engine
    from speculant.engine import Engine
    from speculant.rpc import probe
    from speculant.verify import SamplingParams

    greedy = SamplingParams(0.0, 0, 1.0, 0.0, 0)
    counts = [int(x) for x in args.workers.split(",")]
    delays = [float(x) for x in args.delays.split(",")]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    procs = []
    try:
        ports = [free_port() for _ in range(max(counts))]
        procs += [subprocess.Popen([sys.executable, "-m", "speculant", "worker", "--port", str(port), "-t", "1"],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in ports]
        proxied: dict[float, list[str]] = {}
        for delay in delays:
            listen = [free_port() for _ in ports]
            routes = [f"{lp}:127.0.0.1:{wp}" for lp, wp in zip(listen, ports)]
            proxy = subprocess.Popen([sys.executable, "-m", "speculant.bench.netdelay", "--delay-ms", str(delay),
                                      *routes], env=env, stdout=subprocess.PIPE, text=True)
            procs.append(proxy)
            assert proxy.stdout.readline().strip() == "ready"
            proxied[delay] = [f"127.0.0.1:{lp}" for lp in listen]
        for port in ports:
            for _ in range(100):
                try:
                    probe(f"127.0.0.1:{port}")
                    break
                except Exception:
                    time.sleep(0.3)
        rows, reference = [], {}
        configs = [(0, None)] + [(n, d) for n in counts if n for d in delays]
        for n_workers, delay in configs:
            rpc = proxied[delay][:n_workers] if n_workers else ()
            t0 = time.perf_counter()
            spec = load_engine(args.model, args.model_draft, n_ctx=2048, threads=1, draft_threads=1,
                               draft_max=args.draft_max, adaptive=args.adapt, rpc=rpc)
            plain = Engine(spec.target, None)
            load_s = time.perf_counter() - t0
            for engine in (plain, spec):  # warm-up
                engine.generate(engine.chat_prompt([{"role": "user", "content": "Hi"}]), max_tokens=4,
                                params=greedy, is_chat=True)
            speeds = {"plain": [], "speculative": []}
            same, tau = True, []
            for i, text in enumerate(PROMPTS):
                prompt = plain.chat_prompt([{"role": "user", "content": text}])
                order = [("plain", plain), ("speculative", spec)]
                for label, engine in (order if i % 2 == 0 else order[::-1]):
                    r = engine.generate(prompt, max_tokens=args.n_predict, params=greedy, is_chat=True)
                    speeds[label].append(r.stats.tokens_per_s)
                    ref = reference.setdefault(i, r.tokens)
                    same &= r.tokens == ref
                    if label == "speculative":
                        tau.append(r.stats.mean_accepted_length)
            spec.close()
            row = {"workers": n_workers, "delay_ms": delay, "load_s": round(load_s, 1),
                   "plain_tps": round(sum(speeds["plain"]) / len(PROMPTS), 2),
                   "spec_tps": round(sum(speeds["speculative"]) / len(PROMPTS), 2),
                   "tau": round(sum(tau) / len(tau), 2), "identical": same}
            row["speedup"] = round(row["spec_tps"] / row["plain_tps"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    print("\n| workers | added latency (one way) | plain tok/s | speculative tok/s | speedup | tau | identical | load s |")
    print("|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        lat = "-" if r["delay_ms"] is None else f"{r['delay_ms']:g} ms"
        print(f"| {r['workers']} | {lat} | {r['plain_tps']} | {r['spec_tps']} | {r['speedup']}x | {r['tau']} | "
              f"{'yes' if r['identical'] else 'NO'} | {r['load_s']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "prompts": PROMPTS, "rows": rows}, f, indent=1)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
