"""n choices in one request against n requests in turn, on one `speculant serve -np N` server.

For each prompt: one request with n choices (seed s; choice i samples with s + i) and n lone requests with seeds
s .. s + n - 1, in alternating order; reports wall seconds and completion tokens/s of both, and whether every
choice's text equals its lone request's (it must: each choice is exactly what its seed answers alone).

    .venv/bin/python scripts/n_choices.py -m qwen2.5-coder-1.5b-instruct -np 4 -n 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from speculant.bench.suite import read_suite, select
from speculant.server import spawn_local


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("-md", "--model-draft", default=None)
    ap.add_argument("-np", "--parallel", type=int, default=4)
    ap.add_argument("-n", "--choices", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per category of the default suite")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    serve = ["-m", args.model, "-np", str(args.parallel), "-c", "2048", "-t", str(args.threads)]
    if args.model_draft:
        serve += ["-md", args.model_draft]
    proc, url = spawn_local(serve, timeout=300)
    rows = []
    try:
        def ask(prompt: str, seed: int, n: int) -> dict:
            r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
                "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                "temperature": args.temp, "seed": seed, "n": n})
            r.raise_for_status()
            return r.json()

        prompts = select(read_suite(None), None, args.prompts)
        ask(prompts[0].text, 0, 1)  # warm-up
        for pi, p in enumerate(prompts):
            seed = 1000 * pi
            timed = {}
            for mode in (["n", "turn"] if pi % 2 == 0 else ["turn", "n"]):
                t = time.perf_counter()
                if mode == "n":
                    out = ask(p.text, seed, args.choices)
                    texts = [c["message"]["content"] for c in out["choices"]]
                    tokens = out["usage"]["completion_tokens"]
                else:
                    outs = [ask(p.text, seed + i, 1) for i in range(args.choices)]
                    texts = [o["choices"][0]["message"]["content"] for o in outs]
                    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
                timed[mode] = (time.perf_counter() - t, tokens, texts)
            rows.append({"prompt": p.id, "category": p.category, "n_s": timed["n"][0], "turn_s": timed["turn"][0],
                         "n_tok_s": timed["n"][1] / timed["n"][0], "turn_tok_s": timed["turn"][1] / timed["turn"][0],
                         "same": timed["n"][2] == timed["turn"][2]})
            r = rows[-1]
            print(f"{p.category:16s} n={args.choices}: {r['n_s']:6.1f} s {r['n_tok_s']:6.2f} tok/s | in turn: "
                  f"{r['turn_s']:6.1f} s {r['turn_tok_s']:6.2f} tok/s | same texts: {r['same']}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    speedup = statistics.median(r["turn_s"] / r["n_s"] for r in rows)
    print(f"\n{len(rows)} prompts: n={args.choices} in one request {sum(r['n_s'] for r in rows):.1f} s, in turn "
          f"{sum(r['turn_s'] for r in rows):.1f} s; median time ratio {speedup:.2f}x; every choice = its lone "
          f"request: {all(r['same'] for r in rows)}")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
