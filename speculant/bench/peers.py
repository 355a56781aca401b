"""Peers on the same GGUF files and prompts: llama.cpp's own speculative decoding and Hugging Face
transformers' assisted generation. Each peer is compared with its own plain decoding and with ours.

llama.cpp: tools built by scripts/build_llama_tools.sh with llama.cpp's own defaults (native CPU build, llamafile,
  repacking and tiled kernels on: what a user gets), kept per CPU; our engine runs our exact build (native/).
  plain  = `llama-lookup --spec-draft-n-max 0` (the lookup loop drafting nothing: one target pass per token, and the
           same decode-only timing as the speculative tools), draft-kK = `llama-speculative-simple --spec-type draft-simple -md`,
  lookup-kK = `llama-lookup` (n-gram prompt lookup). tokens/s is the tools' "decoded N tokens in S seconds"
  (prefill excluded), acceptance from n_drafted / n_accept.
hf: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (dequantized, float32, CPU), plain `generate`,
  `generate(assistant_model=draft)` and `generate(prompt_lookup_num_tokens=k)`. Decode-only tokens/s is
  (n - 1) / (t_generate - t_first_token), with t_first_token timed by a 1-token generate of the same prompt.
  transformers does not report acceptance here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from .. import models
from ..errors import SettingsError

PEER_NAMES = ("llama.cpp", "hf")


def check_names(names: list[str]) -> None:
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise SettingsError(f"unknown peer {', '.join(unknown)}; known: {', '.join(PEER_NAMES)}")


def default_tools_dir(explicit: Optional[str] = None) -> Path:
    if explicit:
        return Path(explicit)
    if os.environ.get("LLAMA_TOOLS_DIR"):
        return Path(os.environ["LLAMA_TOOLS_DIR"]) / "bin"
    return models.home() / "llama-tools" / cpu_key() / "bin"


def cpu_key() -> str:
    """The per-CPU folder scripts/build_llama_tools.sh builds into (a native build runs only where it was built)."""
    import hashlib

    lines = Path("/proc/cpuinfo").read_text().splitlines()
    first = lambda prefix: next((line + "\n" for line in lines if line.startswith(prefix)), "")  # noqa: E731
    # built without AMX where the CPU has it (the script's NATIVE_FLAGS: llama.cpp's AMX path crashes)
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if "amx_int8" in first("flags").split() else ""
    return hashlib.sha256((first("model name") + first("flags") + no_amx + "\n").encode()).hexdigest()[:10]


_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+|nan|inf)\s+t/s")
_FIELD = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s+=\s*(-?\d+)")  # lines may carry a log prefix


def parse_llama_output(text: str) -> dict:
    """Parse llama-speculative-simple / llama-lookup output: tokens/s (decode only) and acceptance."""
    m = _DECODED.search(text)
    if not m:
        raise ValueError("no 'decoded N tokens in S seconds' line in the tool's output")
    n, secs = int(m.group(1)), float(m.group(2))
    out = {"generated_tokens": n, "decode_s": secs, "tokens_per_s": n / secs if secs > 0 else float("nan")}
    for key, val in _FIELD.findall(text):
        out[key] = int(val)
    out["drafted"] = out.get("n_drafted", 0)
    out["accepted"] = out.get("n_accept", 0)
    out["acceptance"] = out["accepted"] / out["drafted"] if out["drafted"] else None
    return out


def _llama_variants(cfg, bindir: Path, draft_path: Optional[str]) -> list[tuple[str, list[str]]]:
    ks = sorted({v.k for v in cfg.variants if v.k > 0}) or [4]
    out = [("plain", [str(bindir / "llama-lookup"), "--spec-draft-n-max", "0"])]
    if draft_path:
        out += [(f"draft-k{k}", [str(bindir / "llama-speculative-simple"), "--spec-type", "draft-simple", "-md", draft_path, "--spec-draft-n-max", str(k),
                                  "--spec-draft-n-min", "0", "--spec-draft-p-min", str(cfg.draft_p_min)]) for k in ks]
    out += [(f"lookup-k{k}", [str(bindir / "llama-lookup"), "--spec-draft-n-max", str(k)]) for k in ks]
    return out


def run_llamacpp(cfg, prompts, rendered: dict, model_path: str, draft_path: Optional[str], bindir: Path,
                 bar, threads: Optional[int] = None) -> list[dict]:
    variants = _llama_variants(cfg, bindir, draft_path)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pi, p in enumerate(prompts):
            pf = Path(tmp) / f"{pi}.txt"
            pf.write_text(rendered[p.id], encoding="utf-8")
            grammar = []
            if p.grammar is not None:  # llama.cpp decodes under the same grammar
                gf = Path(tmp) / f"{pi}.gbnf"
                gf.write_text(p.grammar, encoding="utf-8")
                grammar = ["--grammar-file", str(gf)]
            for temp in cfg.temps:
                shift = pi % len(variants)
                for label, cmd in variants[shift:] + variants[:shift]:
                    full = cmd + ["-m", model_path, "-f", str(pf), "-n", str(cfg.n_predict), "-c", str(cfg.n_ctx),
                                  "--temp", str(temp), "--seed", str(cfg.seed + pi), "-ngl", "0", *grammar]
                    if threads:
                        full += ["-t", str(threads), "-tb", str(threads)]
                    proc = subprocess.run(full, capture_output=True, text=True, errors="replace", timeout=3600)
                    text = proc.stdout + "\n" + proc.stderr
                    row = {"peer": "llama.cpp", "variant": label, "prompt_id": p.id, "category": p.category,
                           "temp": temp, "command": " ".join(full[:1] + full[1:])}
                    try:
                        if proc.returncode != 0:
                            raise ValueError(f"exit code {proc.returncode}: {text.strip().splitlines()[-1:]}")
                        row.update(parse_llama_output(text))
                    except ValueError as e:
                        row["error"] = str(e)
                    rows.append(row)
                    bar.update(1)
    return rows


def run_hf(cfg, prompts, rendered: dict, model_path: str, draft_path: Optional[str], bar,
           threads: Optional[int] = None) -> list[dict]:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise SettingsError(f"the hf peer needs torch and transformers: pip install torch==2.13.0 transformers "
                            f"({e})") from None
    if threads:
        torch.set_num_threads(threads)
    mp = Path(model_path)
    tok = AutoTokenizer.from_pretrained(mp.parent, gguf_file=mp.name)
    model = AutoModelForCausalLM.from_pretrained(mp.parent, gguf_file=mp.name, dtype=torch.float32).eval()
    assistant = None
    if draft_path:
        dp = Path(draft_path)
        assistant = AutoModelForCausalLM.from_pretrained(dp.parent, gguf_file=dp.name,
                                                         dtype=torch.float32).eval()
    ks = sorted({v.k for v in cfg.variants if v.k > 0}) or [4]
    variants: list[tuple[str, dict]] = [("plain", {})]
    if assistant is not None:
        variants += [(f"draft-k{k}", {"assistant_model": assistant, "num_assistant_tokens": k,
                                      "num_assistant_tokens_schedule": "constant"}) for k in ks]
    variants += [(f"lookup-k{k}", {"prompt_lookup_num_tokens": k}) for k in ks]
    rows = []
    for pi, p in enumerate(prompts):
        ids = tok(rendered[p.id], return_tensors="pt", add_special_tokens=False)
        for temp in cfg.temps:
            sampling = {"do_sample": temp > 0}
            if temp > 0:
                sampling.update(temperature=temp, top_k=cfg.top_k or None, top_p=cfg.top_p)
            shift = pi % len(variants)
            for label, extra in variants[shift:] + variants[:shift]:
                row = {"peer": "hf", "variant": label, "prompt_id": p.id, "category": p.category, "temp": temp}
                if p.grammar is not None:  # an unconstrained answer would not be the same task
                    row["error"] = "transformers' generate takes no grammar"
                    rows.append(row)
                    bar.update(1)
                    continue
                try:
                    with torch.inference_mode():
                        torch.manual_seed(cfg.seed + pi)
                        t = time.perf_counter()
                        model.generate(**ids, max_new_tokens=1, min_new_tokens=1, **sampling, **extra)
                        t_first = time.perf_counter() - t
                        torch.manual_seed(cfg.seed + pi)
                        t = time.perf_counter()
                        out = model.generate(**ids, max_new_tokens=cfg.n_predict, **sampling, **extra)
                        total = time.perf_counter() - t
                    n = int(out.shape[-1] - ids["input_ids"].shape[-1])
                    dec = max(total - t_first, 1e-9)
                    row.update(generated_tokens=n, decode_s=dec, tokens_per_s=(n - 1) / dec if n > 1 else float("nan"),
                               drafted=0, accepted=0, acceptance=None,
                               tokens=out[0, ids["input_ids"].shape[-1]:].tolist())
                except Exception as e:  # a peer failing must not lose our own results
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                bar.update(1)
    for r in rows:  # greedy identity against the peer's own plain output
        if r["temp"] == 0 and r["variant"] != "plain" and "tokens" in r:
            ref = next((x for x in rows if x["prompt_id"] == r["prompt_id"] and x["variant"] == "plain"
                        and x["temp"] == 0 and "tokens" in x), None)
            r["greedy_equal"] = ref is not None and ref["tokens"] == r["tokens"]
    for r in rows:
        r.pop("tokens", None)
    return rows


def summarize_peers(rows: list[dict], our_rows: list[dict]) -> list[dict]:
    """Per (peer, temperature, variant): mean tokens/s over prompts, speedup over the peer's own plain and
    over speculant's plain (same prompts), acceptance."""
    out = []
    ours = {}
    for r in our_rows:
        if r["variant"] == "plain":
            ours.setdefault((r["temp"], r["prompt_id"]), []).append(r["tokens_per_s"])
    keys = list(dict.fromkeys((r["peer"], r["temp"], r["variant"]) for r in rows))
    for peer, temp, variant in keys:
        sel = [r for r in rows if (r["peer"], r["temp"], r["variant"]) == (peer, temp, variant) and "error" not in r]
        base = {r["prompt_id"]: r["tokens_per_s"] for r in rows
                if (r["peer"], r["temp"], r["variant"]) == (peer, temp, "plain") and "error" not in r}
        errors = sum(1 for r in rows if (r["peer"], r["temp"], r["variant"]) == (peer, temp, variant) and "error" in r)
        tps = {r["prompt_id"]: r["tokens_per_s"] for r in sel}
        common = [p for p in tps if p in base]
        ours_common = [p for p in tps if (temp, p) in ours]
        s = {"peer": peer, "temp": temp, "variant": variant, "n_prompts": len(tps), "errors": errors,
             "tokens_per_s": float(np.mean(list(tps.values()))) if tps else None}
        s["speedup_own"] = (float(np.mean([tps[p] for p in common]) / np.mean([base[p] for p in common]))
                            if common else None)
        s["speedup_vs_ours"] = (float(np.mean([tps[p] for p in ours_common])
                                      / np.mean([np.mean(ours[(temp, p)]) for p in ours_common]))
                                if ours_common else None)
        drafted = sum(r.get("drafted", 0) for r in sel)
        s["acceptance"] = sum(r.get("accepted", 0) for r in sel) / drafted if drafted else None
        eq = [r["greedy_equal"] for r in sel if r.get("greedy_equal") is not None]
        s["greedy_equal"] = f"{sum(eq)}/{len(eq)}" if eq else None
        s["note"] = (f"{errors} failed" if errors else "") + (f" greedy equal {s['greedy_equal']}" if eq else "")
        out.append(s)
    return out


def run_peers(names: list[str], cfg, prompts, result: dict, *, tools_dir: Optional[str] = None,
              progress: bool = True) -> dict:
    from tqdm import tqdm

    from ..api import load_backend
    from .. import chat

    check_names(names)
    model_path, draft_path = result["models"]["target"], result["models"].get("draft")
    # the same rendered chat prompts as our run
    target = load_backend(model_path, n_ctx=cfg.n_ctx, threads=cfg.threads)
    try:
        rendered = {p.id: chat.render(target.chat_template(), p.messages(), bos_token=target.bos_token,
                                      eos_token=target.eos_token, tools=p.tools) for p in prompts}
        bos = target.bos_token
    finally:
        target.close()
    # llama.cpp tools and HF tokenizers add BOS themselves: strip a template-written one
    plain_text = {k: (v[len(bos):] if bos and v.startswith(bos) else v) for k, v in rendered.items()}
    rows: list[dict] = []
    skipped: list[str] = []
    for name in names:
        if name == "llama.cpp":
            bindir = default_tools_dir(tools_dir)
            missing = [t for t in ("llama-lookup", "llama-speculative-simple") if not (bindir / t).exists()]
            if missing:
                skipped.append(f"llama.cpp: {', '.join(missing)} not in {bindir} (run scripts/build_llama_tools.sh)")
                continue
            n = len(prompts) * len(cfg.temps) * len(_llama_variants(cfg, bindir, draft_path))
            with tqdm(total=n, desc="peer llama.cpp", disable=not progress, file=sys.stderr) as bar:
                rows += run_llamacpp(cfg, prompts, plain_text, model_path, draft_path, bindir, bar,
                                     threads=cfg.threads or result["machine"].get("threads_used"))
        elif name == "hf":
            ks = len({v.k for v in cfg.variants if v.k > 0}) or 1
            n = len(prompts) * len(cfg.temps) * (1 + ks * (2 if draft_path else 1))
            try:
                with tqdm(total=n, desc="peer hf", disable=not progress, file=sys.stderr) as bar:
                    rows += run_hf(cfg, prompts, rendered, model_path, draft_path, bar,
                                   threads=cfg.threads or result["machine"].get("threads_used"))
            except SettingsError as e:
                skipped.append(f"hf: {e}")
    return {"rows": rows, "summary": summarize_peers(rows, result["rows"]), "skipped": skipped}
