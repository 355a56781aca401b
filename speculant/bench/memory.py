"""Peak memory per method. ru_maxrss is process-wide (the bench process holds every method's models at
once), so each method is measured in a child Python process of its own that loads exactly that method's
models (what `speculant generate` with the same flags would load), generates a few tokens on a short prompt,
and reports its peak resident set size.

peak_rss_mb: the child's peak RSS over its whole life, model loading included: VmHWM of /proc/self/status
(the high-water mark of the child's own address space). ru_maxrss_mb: getrusage(RUSAGE_SELF).ru_maxrss,
kept for reference; on Linux it is not the child's own peak when the parent is large, because execve carries
over the high-water mark of the forked copy of the parent (every child of a 1.3 GB bench reads >= 1.3 GB).
rss_anon_mb / rss_file_mb: RssAnon / RssFile of /proc/self/status after generating. GGUF weights (llama.cpp)
load repacked and read, so anonymous (with SPECULANT_REPACK=0 they are mmapped: file-backed pages that the page
cache shares with every process mapping the same file); torch weights converted to bf16 (or fp32) are
anonymous memory of the process. startup_rss_mb: before any model
loads (the interpreter and speculant's imports). peak_gpu_mb: torch.cuda.max_memory_allocated, on CUDA.

    python -m speculant.bench.memory '{"method": "plain", "model": "smollm2-135m-instruct", ...}'
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

from ..memory import maxrss_mb, proc_status_mb

PROMPT = "Write a haiku about memory."
N_TOKENS = 8
MARK = "SPECULANT_MEMORY "


_mb_status = proc_status_mb  # the measurements live in speculant.memory (stats and /metrics use them)
_maxrss_mb = maxrss_mb


def child(spec: dict) -> dict:
    """In the child: load the method's models, generate N tokens greedily, measure."""
    from ..verify import SamplingParams
    from .methods import METHODS
    from .runner import BenchConfig, close_context, load_context

    method = METHODS[spec.pop("method")]
    k, n_tokens = spec.pop("k"), spec.pop("n_tokens", N_TOKENS)
    cfg = BenchConfig(**{key: val for key, val in spec.items() if key in BenchConfig.__dataclass_fields__})
    startup = _mb_status().get("rss_mb") or _maxrss_mb()
    ctx = load_context(cfg, [method])
    try:
        engine = method.build(ctx, k)
        res = engine.generate(engine.chat_prompt([{"role": "user", "content": PROMPT}]), max_tokens=n_tokens,
                              params=SamplingParams(0.0), is_chat=True)
        status = _mb_status()
        out = {"peak_rss_mb": status.pop("peak_rss_mb", None) or _maxrss_mb(), "ru_maxrss_mb": _maxrss_mb(),
               "startup_rss_mb": startup, **status, "generated_tokens": res.stats.generated_tokens}
        planned = res.stats.model_memory_mb  # the plan's worst case (a full context) for each llama.cpp model
        if planned:
            from ..plan import RUNTIME_BASE

            out["planned_mb"] = round(sum(m["planned_mb"] for m in planned.values()) + RUNTIME_BASE / 2 ** 20, 1)
            out["models"] = planned
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2 ** 20, 1)
        return out
    finally:
        close_context(ctx)


def probe(cfg, method: str, k: int, *, n_tokens: int = N_TOKENS, timeout: float = 900.0) -> dict:
    """Run one method in a child process; its measurements, or {"peak_rss_mb": None, "error": ...}."""
    spec = {key: getattr(cfg, key) for key in type(cfg).__dataclass_fields__ if key not in ("variants", "temps")}
    spec.update(method=method, k=k, n_tokens=n_tokens, variants=[], temps=[0.0], memory=False)
    try:
        proc = subprocess.run([sys.executable, "-m", "speculant.bench.memory", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"peak_rss_mb": None, "error": f"timed out after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return {"peak_rss_mb": None, "error": tail[-300:]}


def probe_all(cfg, *, progress: bool = True, log=None) -> dict:
    """method name -> probe(...) for each method of cfg.variants (its first k), one child at a time."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    first: dict = {}
    for v in cfg.variants:
        first.setdefault(v.method.name, v.k)
    out = {}
    for name, k in first.items():
        out[name] = probe(cfg, name, k)
        if progress:
            m = out[name]
            log(f"memory: {name}: " + (f"peak RSS {m['peak_rss_mb']:.0f} MB (anon {m.get('rss_anon_mb', 0):.0f} "
                                       f"MB, file-backed {m.get('rss_file_mb', 0):.0f} MB after generating)"
                                       if m.get("peak_rss_mb") else f"failed: {m.get('error')}"))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    spec = json.loads((argv or sys.argv[1:])[0])
    print(MARK + json.dumps(child(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
