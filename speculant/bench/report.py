"""Benchmark outputs: results.json (raw rows + summary + settings), summary.md (printed too), PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from ..costprofile import QUIET_SHARE, write_atomic
from .stats import BASELINE, OVERALL


def _f(x, fmt="{:.2f}", none="–") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return fmt.format(x)


def markdown(result: dict) -> str:
    s = result["summary"]
    m, v, st, costs = result["machine"], result["versions"], result["settings"], result["costs"]
    lines = [
        "# speculant bench",
        "",
        f"- target: `{result['models']['target']}`" + (f", draft: `{result['models']['draft']}`"
                                                        if result["models"].get("draft") else ""),
        f"- machine: {m.get('cpu')} — {m.get('cores')} cores, {m.get('threads_used')} threads used; "
        f"{m.get('platform')}, Python {m.get('python')}",
        f"- llama.cpp: ours = build {m.get('llama.cpp', {}).get('build', '?')}, CPU variant "
        f"{m.get('llama.cpp', {}).get('variant', '?')} (invariant kernels for passes of <= 64 tokens); peers = "
        f"llama.cpp's own defaults, native build (scripts/build_llama_tools.sh)",
        f"- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- settings: suite {st['suite']}, " + (
            f"**interrupted: {len({r['prompt_id'] for r in result['rows']})} of {result['n_prompts']} prompts "
            f"finished** (\"partial\": true)" if result.get("partial") else f"{result['n_prompts']} prompts")
        + f", -n {st['n_predict']}, repeats "
        f"{st['repeats']}, temps {', '.join(f'{t:g}' for t in st['temps'])}, top-k {st['top_k']}, top-p "
        f"{st['top_p']}, min-p {st['min_p']}, seed {st['seed']}, draft-p-min {st['draft_p_min']}, ctx {st['n_ctx']}",
        f"- measured costs: target pass over n tokens (ms) "
        + ", ".join(f"n={n}: {ms:.2f}" for n, ms in costs["target_ms"].items())
        + (f"; draft step {costs['draft_step_ms']:.2f} ms (c = {costs['c']:.3f})" if costs.get("c") is not None else ""),
    ]
    if result["models"].get("torch_target"):
        ct = result.get("costs_torch") or {}
        lines.append(f"- torch target: `{result['models']['torch_target']}`; measured costs (ms) "
                     + ", ".join(f"n={n}: {ms:.2f}" for n, ms in ct.get("target_ms", {}).items())
                     + (f"; draft step {ct['draft_step_ms']:.2f} ms (c = {ct['c']:.3f})" if ct.get("c") else ""))
    share = result.get("cpu_share")
    if share:
        busy = share["min"] < QUIET_SHARE
        lines.append(f"- CPU: our threads got {share['median']:.0%} of their time over a prompt's runs (median; lowest "
                     f"{share['min']:.0%})" + (f". Below {QUIET_SHARE:.0%} another program took the CPU from the runs: "
                                               f"measure again on a quiet machine" if busy else ""))
    lines += [f"- {name}: {note}" for name, note in result.get("notes", {}).items()]
    own = any(r.get("baseline", BASELINE) != BASELINE for r in s)
    mem = result.get("memory")
    sources = any(len(r.get("accepted_by_source") or {}) > 1 or set(r.get("accepted_by_source") or {}) - {"draft", "lookup"}
                  for r in s)
    lines += [
        "",
        "Speedup = mean tokens/s of the method / mean tokens/s of plain over the same prompts (Spec-Bench); "
        "q1/median/q3 are quartiles of the per-prompt ratios; τ = tokens per target pass; predicted = "
        "Leviathan E/(k·c+V(k+1)) from the measured acceptance and costs, for methods that drafted k at every "
        "step (– where steps were decoded plainly: the formula does not price that mix); a speedup marked † is of "
        "a method that drafted nothing, the same passes as plain, so its distance from 1.00x is the machine's noise "
        "(and the adaptive policy's bookkeeping); equal = runs whose tokens are plain "
        "decoding's (at T > 0 too: seeded requests draw with coupled noise, the same tokens whatever is drafted).",
    ]
    if own:
        lines.append("Rows on the torch target (baseline plain-torch): speedup is against plain on llama.cpp, "
                     "'vs baseline' against plain on the torch backend, and equal compares their tokens with "
                     "plain-torch's (bf16 numerics differ from llama.cpp's); the other rows' baseline is plain.")
    if mem:
        lines.append("Peak RSS: each method's models loaded alone in a child process that generates a few tokens "
                     "(see the memory table below).")
    lines += [
        "",
        "| T | method | category | prompts | tok/s | speedup |" + (" baseline | vs baseline |" if own else "")
        + " ratio q1 / med / q3 | acceptance | τ | predicted | equal |" + (" peak RSS MB |" if mem else "")
        + (" accepted by source |" if sources else ""),
        "|---|---|---|---:|---:|---:|" + ("---|---:|" if own else "") + "---|---:|---:|---:|---|"
        + ("---:|" if mem else "") + ("---|" if sources else ""),
    ]
    for r in s:
        eq = f"{r['greedy_equal']}/{r['greedy_checked']}" if r.get("greedy_checked") else "–"
        spread = (f"{_f(r['ratio_q1'])} / {_f(r['ratio_median'])} / {_f(r['ratio_q3'])}"
                  if r["variant"] != BASELINE else "–")
        name = f"**{r['category']}**" if r["category"] == OVERALL else r["category"]
        base = r.get("baseline", BASELINE)
        vs_base = r.get("speedup_vs_baseline") if base != BASELINE else None
        lines.append(
            f"| {r['temp']:g} | {r['variant']} | {name} | {r['n_prompts']} | {_f(r['tokens_per_s'])} | "
            f"{_f(r['speedup'], '{:.2f}x')}{'†' if r['variant'] not in (BASELINE, r.get('baseline')) and not r.get('drafted') else ''} | "
            + (f"{base} | {_f(vs_base, '{:.2f}x')} | " if own else "")
            + f"{spread} | {_f(r['acceptance'], '{:.1%}')} | {_f(r['tau'])} | "
            f"{_f(r['predicted_speedup'], '{:.2f}x')} | {eq} |"
            + (f" {_f(r.get('peak_rss_mb'), '{:.0f}')} |" if mem else "")
            + (f" {_sources(r)} |" if sources else ""))
    if mem:
        lines += ["", "Memory per method (its models alone in a child process, a few tokens generated): peak RSS = "
                  "the child's high-water RSS (VmHWM), loading included; RSS after (anon / file-backed) = VmRSS "
                  "(RssAnon / RssFile) after generating. GGUF weights (llama.cpp) are mmapped, file-backed and "
                  "shared with the page cache; torch weights converted to bf16/fp32 are anonymous memory. startup = "
                  "before any model loaded. planned = `speculant plan`'s estimate for the method's models with a full "
                  "context (the worst case; a short prompt touches less of the compute buffers).", "",
                  "| method | peak RSS MB | planned MB | RSS after MB | anon MB | file-backed MB | startup MB | note |",
                  "|---|---:|---:|---:|---:|---:|---:|---|"]
        for name, m in mem.items():
            note = (m.get("error") or (f"peak GPU {m['peak_gpu_mb']:.0f} MB" if m.get("peak_gpu_mb") else ""))
            note = note.replace("|", "/")
            lines.append(f"| {name} | " + " | ".join(_f(m.get(key), "{:.0f}") for key in (
                "peak_rss_mb", "planned_mb", "rss_mb", "rss_anon_mb", "rss_file_mb", "startup_rss_mb")) + f" | {note} |")
    pos = [r for r in s if r["category"] == OVERALL and r["variant"] != BASELINE and r["acceptance_by_position"]]
    if pos:
        width = max(len(r["acceptance_by_position"]) for r in pos)
        lines += ["", "Acceptance by draft position (overall):", "",
                  "| T | method | " + " | ".join(str(i + 1) for i in range(width)) + " |",
                  "|---|---|" + "---:|" * width]
        for r in pos:
            cells = [_f(x, "{:.0%}") for x in r["acceptance_by_position"]]
            cells += ["–"] * (width - len(cells))
            lines.append(f"| {r['temp']:g} | {r['variant']} | " + " | ".join(cells) + " |")
    peers = result.get("peers")
    if peers:
        lines += ["", "Peers (same GGUF files, same prompts; speedup against the peer's own plain decoding, and "
                  "against speculant plain):", "",
                  "| peer | T | method | prompts | tok/s | speedup vs own plain | vs speculant plain | acceptance | note |",
                  "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in peers.get("summary", []):
            lines.append(f"| {r['peer']} | {r['temp']:g} | {r['variant']} | {r['n_prompts']} | {_f(r['tokens_per_s'])} | "
                         f"{_f(r.get('speedup_own'), '{:.2f}x')} | {_f(r.get('speedup_vs_ours'), '{:.2f}x')} | "
                         f"{_f(r.get('acceptance'), '{:.1%}')} | {r.get('note', '')} |")
        for note in peers.get("skipped", []):
            lines.append(f"\n- skipped: {note}")
    return "\n".join(lines) + "\n"


def _sources(r: dict) -> str:
    """'prediction 812, history 40': accepted tokens by the drafter that proposed them."""
    by = r.get("accepted_by_source") or {}
    return ", ".join(f"{k} {v}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])) or "–"


def _jsonable(x):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(result: dict, path: Path) -> None:
    write_atomic(path, json.dumps(_jsonable(result), indent=1, ensure_ascii=False))


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    summary = [r for r in result["summary"] if r["variant"] != BASELINE]
    temps = list(dict.fromkeys(r["temp"] for r in result["summary"]))
    variants = list(dict.fromkeys(r["variant"] for r in summary))
    cats = list(dict.fromkeys(r["category"] for r in summary if r["category"] != OVERALL)) + [OVERALL]
    files = []

    # 1. speedup by category, one panel per temperature
    fig, axes = plt.subplots(len(temps), 1, figsize=(max(6, 1.1 * len(cats) * max(1, len(variants)) / 2 + 3),
                                                     3.6 * len(temps)), squeeze=False)
    for ax, temp in zip(axes[:, 0], temps):
        width = 0.8 / max(1, len(variants))
        x = np.arange(len(cats))
        for i, var in enumerate(variants):
            vals = [next((r["speedup"] for r in summary if r["temp"] == temp and r["variant"] == var
                          and r["category"] == c), np.nan) for c in cats]
            ax.bar(x + (i - (len(variants) - 1) / 2) * width, [np.nan if v is None else v for v in vals], width,
                   label=var)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(x, cats, rotation=30, ha="right")
        ax.set_ylabel("speedup over plain")
        ax.set_title(f"speedup by category (T={temp:g})")
        if variants:
            ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, out / "speedup_by_category.png", plt))

    # 2. acceptance by draft position (overall)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in summary:
        if r["category"] == OVERALL and r["acceptance_by_position"]:
            ys = [np.nan if y is None else y for y in r["acceptance_by_position"]]
            ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{r['variant']} T={r['temp']:g}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted at that position)")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft position")
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(_save(fig, out / "acceptance_by_position.png", plt))

    # 3. predicted vs measured speedup (each point a variant x category; stars = overall)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    pts = [r for r in summary if r["predicted_speedup"] is not None and r["speedup"] is not None
           and not math.isnan(r["speedup"])]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for vi, var in enumerate(variants):
        for overall in (False, True):
            sel = [r for r in pts if r["variant"] == var and (r["category"] == OVERALL) == overall]
            if sel:
                ax.scatter([r["predicted_speedup"] for r in sel], [r["speedup"] for r in sel],
                           marker="*" if overall else "o", s=120 if overall else 25,
                           color=colors[vi % len(colors)],
                           label=f"{var}{' (overall)' if overall else ''}")
    vals = [r["predicted_speedup"] for r in pts] + [r["speedup"] for r in pts] + [1.0]
    lo, hi = min(vals) * 0.9, max(vals) * 1.1
    ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls="--")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted speedup (Leviathan, measured α, c, V)")
    ax.set_ylabel("measured speedup")
    ax.set_title("predicted vs measured speedup")
    if pts:
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(_save(fig, out / "predicted_vs_measured.png", plt))
    return files


def _save(fig, path: Path, plt) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
    return path


def write_all(result: dict, out: Path, *, make_plots: bool = True) -> tuple[dict[str, Path], list[str]]:
    """results.json, summary.md and the plots into out, each whole or not at all: (what was written, "PATH: why"
    for each file that could not be, e.g. on a full disk). results.json first: it holds everything."""
    written, failed = {}, []
    for key, path, write in (("json", out / "results.json", lambda p: write_json(result, p)),
                             ("markdown", out / "summary.md", lambda p: write_atomic(p, markdown(result)))):
        try:
            out.mkdir(parents=True, exist_ok=True)
            write(path)
            written[key] = path
        except OSError as e:
            failed.append(f"{path}: {e.strerror or e}")
    if make_plots and not failed:
        try:
            for p in plots(result, out):
                written[p.stem] = p
        except OSError as e:  # a plot cut short is removed: whole or not at all
            for png in out.glob("*.png.tmp"):
                png.unlink(missing_ok=True)
            failed.append(f"the plots in {out}: {e.strerror or e}")
    return written, failed
