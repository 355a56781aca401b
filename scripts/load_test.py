#!/usr/bin/env python
"""Load test for `speculant serve`: throughput and latency percentiles, with and without speculation, with
one or more requests decoded at once (--parallel).

For each mode and slot count it starts its own server on 127.0.0.1 (a free port), sends a bounded number of
streaming chat requests from a bounded number of concurrent clients, and reports requests/s, generated
tokens/s, latency and time-to-first-token percentiles, and the server's acceptance rate, τ and requests per
forward pass. Every server gets the same requests from the same clients (--concurrency), so `-np 1` (one at a
time, the others queue) and `-np 4` (four at once, passes merged) compare like with like; --rounds repeats
the whole list in turn (the machine is noisy) and the table gives medians and the ratio to the first server.
Greedy outputs are compared across servers: concurrency must not change a single token.

    .venv/bin/python scripts/load_test.py -m smollm2-135m-instruct -md smollm2-135m-instruct \
        --requests 16 --concurrency 4 -n 32 -t 1 --parallel 1,4

Or against a server you started yourself (loopback only): --url http://127.0.0.1:8080 (one mode).
Bounded: at most --requests requests per mode (<= 1000) and --max-seconds of wall time per mode; requests
not started by then are skipped and reported.
"""

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash map is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "Write a haiku about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Give a short recipe for pancakes.",
    "Write a SQL query that counts rows per customer.",
    "Summarise the water cycle.",
]


def _loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_server(args, draft: bool, parallel: int):
    from speculant.server import spawn_local

    cmd = ["-m", args.model, "-c", str(args.ctx_size), "--parallel", str(parallel)]
    if draft:
        cmd += ["-md", args.model_draft, "--draft-max", str(args.draft_max)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    cmd += args.server_arg + (args.spec_arg if draft else [])
    try:
        return spawn_local(cmd, timeout=180, exe=str(Path(sys.executable).with_name("speculant")),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except RuntimeError as e:
        sys.exit(f"server failed to start: {e}")


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client, url, model, prompt, args, headers):
    t0 = time.perf_counter()
    ttft = None
    usage = None
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.n_predict,
            "temperature": args.temp, "stream": True, "stream_options": {"include_usage": True}}
    if args.temp > 0:
        body["seed"] = 0
    text = ""
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"ok": False, "error": obj["error"]["message"]}
            if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                text += obj["choices"][0]["delta"]["content"]
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if obj.get("usage"):
                usage = obj["usage"]
    return {"ok": True, "latency": time.perf_counter() - t0, "ttft": ttft if ttft is not None else float("nan"),
            "tokens": usage["completion_tokens"] if usage else 0, "text": text}


async def run_load(url, args, headers):
    model = (await asyncio.to_thread(lambda: httpx.get(url + "/v1/models", headers=headers).json()))["data"][0]["id"]
    results, skipped = [], 0
    sem = asyncio.Semaphore(args.concurrency)
    deadline = time.monotonic() + args.max_seconds
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.max_seconds + 10), limits=limits) as client:
        async def worker(i):
            nonlocal skipped
            async with sem:
                if time.monotonic() >= deadline:
                    skipped += 1
                    return
                try:
                    r = await asyncio.wait_for(one_request(client, url, model, args.prompts[i % len(args.prompts)],
                                                           args, headers),
                                               timeout=max(0.1, deadline - time.monotonic()))
                except (asyncio.TimeoutError, httpx.HTTPError) as e:
                    r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                r["index"] = i
                results.append(r)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(args.requests)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] == r["ttft"]]
    tokens = sum(r["tokens"] for r in ok)
    metrics = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(("speculant_acceptance_rate ", "speculant_mean_accepted_length ",
                            "speculant_batched_pass")):
            name, value = line.split()
            metrics[name] = float(value)
    passes = metrics.get("speculant_batched_passes")
    return {
        "requests": args.requests, "ok": len(ok), "failed": len(results) - len(ok), "skipped": skipped,
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "wall_s": round(wall, 2), "requests_per_s": round(len(ok) / wall, 3),
        "tokens_per_s": round(tokens / wall, 2), "completion_tokens": tokens,
        "latency_s": {f"p{p}": round(_pct(lat, p), 3) for p in (50, 90, 99)},
        "ttft_s": {f"p{p}": round(_pct(ttft, p), 3) for p in (50, 90, 99)},
        "acceptance_rate": metrics.get("speculant_acceptance_rate"),
        "tau": metrics.get("speculant_mean_accepted_length"),
        "requests_per_pass": round(metrics["speculant_batched_pass_sequences"] / passes, 2) if passes else None,
        "texts": {r["index"]: r["text"] for r in ok},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="smollm2-135m-instruct")
    p.add_argument("-md", "--model-draft", default="smollm2-135m-instruct")
    p.add_argument("--draft-max", type=int, default=4)
    p.add_argument("-c", "--ctx-size", type=int, default=1024)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra flag for the servers this script starts (repeatable, e.g. --server-arg=--seed=1)")
    p.add_argument("--spec-arg", action="append", default=[],
                   help="extra flag for the speculative server only (e.g. --spec-arg=--no-adapt)")
    p.add_argument("--url", default=None, help="use this running server (loopback only) instead of starting one")
    p.add_argument("--api-key", default=os.environ.get("SPECULANT_API_KEY"))
    p.add_argument("--modes", default="plain,speculative", help="comma list of plain,speculative")
    p.add_argument("--parallel", default="1", help="comma list of --parallel values: a server each (default 1)")
    p.add_argument("--rounds", type=int, default=1, help="times the whole list of servers runs, in turn (default 1)")
    p.add_argument("--out", default=None, help="also write the report (JSON) here")
    p.add_argument("--suite", default=None, help="prompts from a bench suite (a built-in name such as default, or a "
                                                 "file), in an order that mixes its categories; default: 8 short ones")
    p.add_argument("--requests", type=int, default=16, help="requests per mode (1..1000, default 16)")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent clients (1..64, default 4)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("--max-seconds", type=float, default=300, help="wall-time cap per mode (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    if not 1 <= args.requests <= 1000 or not 1 <= args.concurrency <= 64 or args.max_seconds <= 0:
        p.error("--requests must be in 1..1000, --concurrency in 1..64, --max-seconds > 0")
    if args.url and not _loopback(args.url):
        p.error("--url must be a loopback address (127.0.0.1, ::1 or localhost)")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    args.prompts = PROMPTS
    if args.suite:
        from speculant.bench.suite import read_suite

        by_cat: dict[str, list] = {}
        for q in read_suite(args.suite):
            by_cat.setdefault(q.category, []).append(q.text)
        args.prompts = [t for row in zip(*by_cat.values()) for t in row]  # category by category, in turn

    report = {}
    if args.url:
        report["server"] = asyncio.run(run_load(args.url.rstrip("/"), args, headers))
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if any(m not in ("plain", "speculative") for m in modes):
            p.error(f"--modes: choose from plain, speculative (got {args.modes!r})")
        try:
            slots = [int(x) for x in args.parallel.split(",") if x.strip()]
        except ValueError:
            p.error(f"--parallel must be a comma list of integers, got {args.parallel!r}")
        runs: dict[str, list] = {}
        for _ in range(max(1, args.rounds)):
            for mode in modes:
                for n in slots:
                    proc, url = start_server(args, draft=(mode == "speculative"), parallel=n)
                    try:
                        runs.setdefault(f"{mode} -np {n}", []).append(asyncio.run(run_load(url, args, {})))
                    finally:
                        stop_server(proc)
        for name, rs in runs.items():  # the round with the median throughput stands for the server
            r = dict(sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2])
            r["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in rs]
            report[name] = r
    first = next(iter(report.values()))
    for r in report.values():
        r["vs_first"] = round(r["tokens_per_s"] / first["tokens_per_s"], 3) if first["tokens_per_s"] else None
        shared = set(r["texts"]) & set(first["texts"])
        r["same_text_as_first"] = f"{sum(r['texts'][i] == first['texts'][i] for i in shared)}/{len(shared)}"
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.requests} requests/server, concurrency {args.concurrency}, max_tokens {args.n_predict}, "
          f"temperature {args.temp}, {max(1, args.rounds)} round(s)")
    print(f"{'server':20s} {'ok':>4s} {'fail':>4s} {'req/s':>7s} {'tok/s':>7s} {'ratio':>6s} {'p50 s':>7s} "
          f"{'p90 s':>7s} {'ttft50':>7s} {'ttft90':>7s} {'accept':>7s} {'tau':>5s} {'req/pass':>8s} same text")
    for name, r in report.items():
        acc = f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] else "-"
        tau = f"{r['tau']:.2f}" if r["tau"] else "-"
        rpp = f"{r['requests_per_pass']:.2f}" if r["requests_per_pass"] else "-"
        print(f"{name:20s} {r['ok']:4d} {r['failed'] + r['skipped']:4d} {r['requests_per_s']:7.3f} "
              f"{r['tokens_per_s']:7.2f} {r['vs_first']:6.2f} {r['latency_s']['p50']:7.2f} "
              f"{r['latency_s']['p90']:7.2f} {r['ttft_s']['p50']:7.2f} {r['ttft_s']['p90']:7.2f} {acc:>7s} {tau:>5s} "
              f"{rpp:>8s} {r['same_text_as_first']}")
        for e in r["errors"]:
            print(f"  error: {e}")
    return 0 if all(r["failed"] == 0 for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
