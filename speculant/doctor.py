"""`speculant doctor`: what a user needs to know before filing a bug, on one screen.

The same facts (`collect()`) go into every benchmark's machine record.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

from . import models, native

ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512vbmi", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def _version(pkg: str) -> Optional[str]:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _gpu() -> str:
    """Whether a GPU is visible, without importing torch when no driver is there."""
    if not (Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia").exists()):
        return "none visible (no NVIDIA driver)"
    try:
        import torch
        if torch.cuda.is_available():
            return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        return "NVIDIA driver present, but torch sees no CUDA device"
    except ImportError:
        return "NVIDIA driver present (torch not installed)"


def llama_facts() -> dict:
    """The llama.cpp build and the CPU kernels this process loaded."""
    out: dict = {"llama_cpp_python": _version("llama-cpp-python")}
    try:
        from .backends import llamacpp  # noqa: F401  (loads the CPU backend)
    except Exception as e:  # doctor reports what is broken instead of failing
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    build = native.build_info() or {}
    features = native.system_features()
    out.update({
        "build": build.get("key") or "not speculant's build (plain pip install: exactness not guaranteed)",
        "llama_cpp_commit": build.get("llama_cpp_commit", "unknown"),
        "variant": native.loaded_variant() or "linked in (no run-time variants)",
        "variants_built": sorted(p.name[len("libggml-cpu-"):-3] for p in native.lib_dir().glob("libggml-cpu-*.so")),
        "kernel_features": sorted(k for k, v in features.items() if v == "1"),
        "backends": native.backend_names(),
        "exactness": "; ".join(native.exactness_problems()) or "ok (bit-identical batched logits)",
        "huge_pages": native.huge_pages(),
        "amx": native.amx(),
    })
    return out


def collect(threads: Optional[int] = None) -> dict:
    flags = native.cpu_flags()
    try:
        cores_available = len(os.sched_getaffinity(0))
    except AttributeError:
        cores_available = os.cpu_count()
    cached = [(name, models.cached_path(name)) for name in models.REGISTRY]
    return {
        "speculant": _version("speculant"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": native.cpu_model(),
        "cpu_features": [f for f in ISA_FLAGS if f in flags],
        "cores": os.cpu_count(),
        "cores_available": cores_available,
        "threads": threads or os.cpu_count(),
        "llama.cpp": llama_facts(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "gpu": _gpu(),
        "home": str(models.home()),
        "models": {name: (path.stat().st_size if path.exists() else None) for name, path in cached},
        "local_models": {name: (Path(e["path"]).stat().st_size if Path(e["path"]).exists() else None)
                         for name, e in models.local_entries().items()},  # made by `speculant quantize`
        "damaged_models": {name: models.damaged_message(name, why) for name in [*models.REGISTRY,
                                                                                *models.local_entries()]
                           if (why := models.damage(name))},
    }


def render(facts: dict) -> str:
    ll = facts["llama.cpp"]
    lines = [
        f"speculant    {facts['speculant']}  (Python {facts['python']}, {facts['platform']})",
        f"cpu          {facts['cpu']}: {facts['cores']} cores ({facts['cores_available']} available), "
        f"threads {facts['threads']}",
        f"cpu features {' '.join(facts['cpu_features']) or 'none of ' + ', '.join(ISA_FLAGS)}",
        f"llama.cpp    llama-cpp-python {ll.get('llama_cpp_python')}, llama.cpp {ll.get('llama_cpp_commit', '?')[:12]}, "
        f"build {ll.get('build', '?')}",
    ]
    if "error" in ll:
        lines.append(f"  ERROR      {ll['error']}")
    else:
        lines += [
            f"  variant    {ll['variant']} (built: {', '.join(ll['variants_built']) or 'none'})",
            f"  kernels    {' '.join(ll['kernel_features'])}",
            f"  backends   {', '.join(ll['backends'])}",
            f"  exactness  {ll['exactness']}",
            f"  amx        " + ("tile products for repacked Q4_K and Q6_K rows in passes of 8+ tokens, Q4_0, IQ4_NL "
                                "and MXFP4 rows in passes of 6+ (prompts, long verify passes)" if ll["amx"]
                                else "not used (no AMX-INT8 on this CPU, or SPECULANT_AMX=0)"),
            f"  pages      transparent huge pages {ll['huge_pages']['kernel'] or 'not in this kernel'}; buffers of "
            f"2 MiB+ {'advised onto them' if ll['huge_pages']['requested'] else 'on 4 KiB pages (SPECULANT_THP=0)'}"
            f" (generate and demo: 4 KiB unless SPECULANT_THP=1)",
        ]
    lines += [
        f"torch        {facts['torch'] or 'not installed'}, transformers {facts['transformers'] or 'not installed'}",
        f"gpu          {facts['gpu']}",
        f"models       in {facts['home']}/models",
    ]
    for name, size in facts["models"].items():
        lines.append(f"  {name:<30} {f'{size / 2**20:,.0f} MiB' if size else 'not pulled (speculant pull ' + name + ')'}")
    for name, size in facts.get("local_models", {}).items():
        lines.append(f"  {name:<30} {f'{size / 2**20:,.0f} MiB' if size else 'file gone'} (local: speculant quantize)")
    lines += [f"  WARNING    {why}" for why in facts.get("damaged_models", {}).values()]
    return "\n".join(lines)


def add_cli(sub, add_model_args, add_sampling_args) -> None:
    from .api import thread_count

    p = sub.add_parser("doctor", help="machine, build, loaded CPU kernels, versions and models, on one screen")
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="threads to report (default: all cores)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from .api import check_threads

    check_threads(args.threads, "--threads")
    facts = collect(args.threads)
    print(json.dumps(facts, indent=2) if args.json else render(facts))
    return 0 if "error" not in facts["llama.cpp"] else 1
