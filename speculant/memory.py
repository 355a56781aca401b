"""Memory of this process and of the models an engine holds: what stats, /metrics and bench tables report.

Measured: the process's peak resident set (VmHWM of /proc/self/status; ru_maxrss where there is no /proc).
Planned: `speculant plan`'s estimate for each loaded llama.cpp model at its context size (weights mmapped
and shared, repacked copies, KV cache, compute buffers; speculant/plan.py), computed once per model file.
"""

from __future__ import annotations

import functools
import os
import resource
import sys
from typing import Optional

STATUS_KEYS = {"VmHWM": "peak_rss_mb", "VmRSS": "rss_mb", "RssAnon": "rss_anon_mb", "RssFile": "rss_file_mb"}


def proc_status_mb(pid: str | int = "self") -> dict:
    """peak_rss_mb / rss_mb / rss_anon_mb / rss_file_mb of this process (or of process `pid`) from
    /proc/PID/status ({} without /proc)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                key, _, val = line.partition(":")
                name = STATUS_KEYS.get(key)
                if name and val.strip().endswith("kB"):
                    out[name] = round(int(val.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


def maxrss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (2 ** 20 if sys.platform == "darwin" else 1024), 1)


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB, model loading included."""
    return proc_status_mb().get("peak_rss_mb") or maxrss_mb()


def engine_peak_rss_mb(engine) -> float:
    """peak_rss_mb, plus that of the process a target on RPC workers runs in (backends/supervised.py: its model's
    local layers are there, not here; the sum of the two peaks, an upper bound of their peak together)."""
    child = getattr(engine.target, "child_pid", None)
    return round(peak_rss_mb() + (proc_status_mb(child).get("peak_rss_mb", 0.0) if child else 0.0), 1)


@functools.lru_cache(maxsize=64)
def _planned(path: str, role: str, n_ctx: int, verify_positions: int, parallel: int = 1) -> Optional[dict]:
    from .plan import plan_model

    try:
        m = plan_model(path, role, n_ctx, verify_positions=verify_positions, parallel=parallel)
    except Exception:  # a file the planner cannot read (e.g. a torch directory) is simply not planned
        return None
    return {"model": m.name.rsplit("/", 1)[-1], "planned_mb": round(m.total / 2 ** 20, 1),
            "weights_mmapped_mb": round(m.mapped / 2 ** 20, 1), "weights_read_mb": round(m.loaded / 2 ** 20, 1),
            "repacked_mb": round(m.repacked / 2 ** 20, 1),
            "kv_mb": round(m.kv / 2 ** 20, 1), "compute_mb": round(m.compute / 2 ** 20, 1)}


def draft_backends(drafter) -> list:
    """The backends of the draft models in a drafter (a composite's, recursively); [] for free drafters."""
    if drafter is None:
        return []
    inner = getattr(drafter, "drafters", None)
    if inner:
        return [b for d in inner for b in draft_backends(d)]
    backend = getattr(drafter, "backend", None)
    return [backend] if backend is not None else []


def draft_share(engine) -> Optional[float]:
    """The draft models' weights over the target's (file sizes): about what their prompt processing costs
    beside the target's, before it was timed. None where a model has no file (torch from a checkpoint)."""
    sizes = []
    for backend in [engine.target] + draft_backends(engine.drafter):
        path = getattr(backend, "path", None)
        try:
            sizes.append(os.path.getsize(path))
        except (TypeError, OSError):
            return None
    return sum(sizes[1:]) / sizes[0] if len(sizes) > 1 and sizes[0] > 0 else None


def engine_models(engine, draft_max: Optional[int] = None) -> dict:
    """role -> the plan's estimate for each llama.cpp model the engine holds (worst case: a full context)."""
    try:
        from .backends.llamacpp import LlamaCppBackend
    except Exception:  # no llama.cpp here (a torch-only install): nothing to plan
        return {}

    out = {}
    k = (engine.draft_max if engine.drafter is not None else 0) if draft_max is None else draft_max
    roles = [("target", engine.target)] + [("draft", b) for b in draft_backends(engine.drafter)]
    for role, backend in roles:
        if isinstance(backend, LlamaCppBackend) and role not in out:
            # every slot's KV cache (serve -np N), as `speculant plan -np N` counts them
            planned = _planned(str(backend.path), role, backend.n_ctx, k + 1 if role == "target" else 1,
                               getattr(backend, "n_seq", 1))
            if planned:
                out[role] = planned
    return out
