"""`speculant bench --costs`: what one target pass over n tokens costs, ours against llama.cpp's default build.

Ours: the target through our backend (invariant kernels up to 64 tokens, all logits returned, as a verify
pass needs), n new tokens after a `--costs-depth`-token context. llama.cpp: `llama-bench -p N -d DEPTH`
from the tools built with llama.cpp's own defaults (scripts/build_llama_tools.sh): prompt-processing
speed of an N-token pass after DEPTH tokens, i.e. the same pass with its fastest batched kernels. Rounds
alternate between the two so machine drift hits both; each figure is the median over rounds.

Also, where our build has the switch: the same passes in our process with ggml's own kernels (what llama.cpp's
build runs, not exact) over the very same weights in memory. Two processes can place their weights so that
one streams them measurably faster than the other (seen: 10-30% between runs of one binary), which this column
is immune to: it is the kernel comparison, llama-bench's the one a user sees.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from .. import costprofile, native
from ..errors import SettingsError


def ours_ms(backend, ns: list[int], depth: int, prefill: int) -> dict:
    """One round: ms per pass over n tokens after `depth` tokens, prompt processing of `prefill` tokens, and the
    CPU share the passes got (costprofile.cpu_share: below QUIET_SHARE, something else ran)."""
    times, share = costprofile.with_share(backend, costprofile.pass_times_ms, backend, ns, depth)
    out: dict = {**times, "cpu_share": share}
    toks = backend.tokenize(costprofile.TEXT)
    assert len(toks) >= prefill, "cost text too short"
    t = time.perf_counter()
    backend.prefill(toks[:prefill])
    out["prefill_tps"] = prefill / (time.perf_counter() - t)
    backend.rewind(0)
    return out


def _llama_bench(cmd: list[str]) -> list[dict]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SettingsError(f"llama-bench failed ({why}): {last} -- rebuild the peer with scripts/build_llama_tools.sh")
    return json.loads(proc.stdout)


def llama_bench_ms(bindir: Path, model: str, ns: list[int], depth: int, prefill: int, threads: int) -> dict:
    """One round of llama-bench (its own defaults build): the same quantities."""
    runs = _llama_bench([str(bindir / "llama-bench"), "-m", model, "-p", ",".join(str(n) for n in ns), "-n", "0",
                         "-d", str(depth), "-r", "1", "-t", str(threads), "-o", "json"])
    out = {r["n_prompt"]: r["n_prompt"] / r["avg_ts"] * 1e3 for r in runs}
    out["prefill_tps"] = _llama_bench([str(bindir / "llama-bench"), "-m", model, "-p", str(prefill), "-n", "0",
                                       "-r", "1", "-t", str(threads), "-o", "json"])[0]["avg_ts"]
    return out


def measure(model_path: str, *, ns: Optional[list[int]] = None, depth: int = 100, prefill: int = 512,
            rounds: int = 5, threads: Optional[int] = None, tools_dir: Optional[str] = None) -> dict:
    from ..api import load_backend
    from .peers import default_tools_dir

    ns = ns or list(range(1, 17))
    threads = threads or os.cpu_count() or 1
    bindir = default_tools_dir(tools_dir)
    have_peer = (bindir / "llama-bench").exists()
    backend = load_backend(model_path, n_ctx=2048, threads=threads)
    ours_rounds, peer_rounds, same_rounds = [], [], []
    try:
        ours_ms(backend, ns[:2], depth, 64)  # warm-up
        for _ in range(rounds):
            ours_rounds.append(ours_ms(backend, ns, depth, prefill))
            with native.ggml_kernels() as switched:
                if switched:
                    same_rounds.append(dict(costprofile.pass_times_ms(backend, ns, depth)))
            if have_peer:
                peer_rounds.append(llama_bench_ms(bindir, model_path, ns, depth, prefill, threads))
        med = lambda rows, key: statistics.median(r[key] for r in rows) if rows else None  # noqa: E731
        keys = ns + ["prefill_tps"]
        share = med(ours_rounds, "cpu_share")
        if 1 in ns:  # the adaptive policy's starting point on this machine (costprofile.py)
            times = {n: med(ours_rounds, n) for n in ns}
            if share < costprofile.QUIET_SHARE:  # flattened by waits for descheduled threads (costprofile.py)
                print(f"speculant: warning: other programs ran while the pass costs were measured (our passes got "
                      f"{share:.0%} of their threads' time): not saved as the adaptive policy's cost profile",
                      file=sys.stderr)
            elif costprofile.plausible(times):
                profile = costprofile.save(backend, times, source=f"speculant bench --costs: median of {rounds} rounds",
                                           share=share)
                print(f"cost profile for the adaptive policy: {profile}", file=sys.stderr)
            else:  # the loader would throw it away (costprofile._check)
                print("speculant: warning: the pass costs measured unevenly (the machine is busy?): not saved as "
                      "the adaptive policy's cost profile", file=sys.stderr)
    finally:
        backend.close()
    return {"model": model_path, "depth": depth, "prefill": prefill, "rounds": rounds, "threads": threads,
            "ours": {k: med(ours_rounds, k) for k in keys}, "ours_cpu_share": share,
            "llama.cpp": {k: med(peer_rounds, k) for k in keys} if have_peer else None,
            "ggml_same_process": {n: med(same_rounds, n) for n in ns} if same_rounds else None,
            "llama_tools": str(bindir) if have_peer else f"not built ({bindir}): run scripts/build_llama_tools.sh"}


def markdown(costs: dict) -> str:
    ours, peer, same = costs["ours"], costs["llama.cpp"], costs.get("ggml_same_process")
    fmt = lambda v: f"{v:.1f}" if v else "–"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "–"  # noqa: E731
    lines = [f"target pass over n new tokens after {costs['depth']} tokens, ms (median of {costs['rounds']} "
             f"alternating rounds, {costs['threads']} threads); llama.cpp = {costs['llama_tools']}; ggml kernels = "
             "llama.cpp's own kernels in our process over the same weights in memory"
             + (f"; our passes got {costs['ours_cpu_share']:.0%} of their threads' time"
                + (" (other programs ran: measure again on a quiet machine)"
                   if costs["ours_cpu_share"] < costprofile.QUIET_SHARE else "")
                if costs.get("ours_cpu_share") else ""), "",
             "| n | ours (invariant) | llama.cpp defaults | ratio | ggml kernels, same process | ratio |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n, ms in ours.items():
        if n == "prefill_tps":
            continue
        p, g = peer[n] if peer else None, same.get(n) if same else None
        lines.append(f"| {n} | {ms:.1f} | {fmt(p)} | {ratio(ms, p)} | {fmt(g)} | {ratio(ms, g)} |")
    mine, p = ours["prefill_tps"], peer["prefill_tps"] if peer else None
    lines.append(f"| prefill {costs['prefill']} tokens, tokens/s | {mine:.1f} | {fmt(p)} | {ratio(mine, p)} | – | – |")
    return "\n".join(lines) + "\n"


def run_cli(args) -> int:
    from .. import models

    if args.costs_rounds < 1:
        raise SettingsError("--costs-rounds must be at least 1")
    from . import writable_dir

    out = writable_dir(args.out, "--out")
    costs = measure(str(models.resolve(args.model)), depth=args.costs_depth, rounds=args.costs_rounds,
                    threads=args.threads, tools_dir=args.llama_tools)
    (out / "costs.json").write_text(json.dumps(costs, indent=2, default=str))
    print(markdown(costs), end="")
    return 0
