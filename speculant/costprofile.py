"""What a target pass over n tokens costs on this machine, relative to a one-token pass: the adaptive policy's
starting point.

A profile is r(n) = T(n) / T(1) for n = 1..16 (T(n): one pass over n new tokens with all their logits, as a
verify pass runs). It depends on the model file, the llama.cpp build, the CPU and the thread count, and little
else, so it is measured once per such key and cached under $SPECULANT_HOME/costs/. `speculant bench --costs`
writes the careful one (several alternating rounds); a backend without one measures a quick one the first time
an adaptive policy needs it (the fastest of three rounds, a few seconds; more while one looks disturbed). The
policy scales the profile by the T(1) it measures itself, so a busy machine shifts absolute times without skewing
the shape much.

A round counts only where its threads had the CPU to themselves (cpu_share). Beside another busy process, every
pass waits at each of ggml's thread barriers for a descheduled thread, a fixed cost that flattens the profile
(measured here: a 2-token pass at 1.0 one-token passes and 4 tokens at 1.15, against 1.17 and 1.63 on a quiet
machine). The policy corrects its prices from the passes it times, but a cached profile should describe the machine.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

PROFILE_SIZES = list(range(1, 17))
QUICK_SIZES = [1, 2, 3, 4, 6, 8, 12, 16]
# A pass over n tokens costs at most about n one-token passes (it could be run as those); a profile that prices one
# higher was measured while something else ran, and would keep the policy from drafting for good
PLAUSIBLE = 1.25
MORE_ROUNDS = 3  # rounds added, at most, when the quick rounds' fastest times still look implausible
# The share of its threads' time a round got (cpu_share) for it to count: 0.87-1.0 on a quiet machine here, 0.33
# beside two other programs decoding
QUIET_SHARE = 0.8
DEPTH = 100  # context before the measured passes: a typical verify pass is not at the start of the cache

TEXT = ("def merge_intervals(intervals):\n    intervals.sort()\n    out = []\n    for lo, hi in intervals:\n"
        "        if out and lo <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], hi)\n        else:\n"
        "            out.append([lo, hi])\n    return out\n") * 64


def pass_times_ms(backend, ns: list[int], depth: int = DEPTH) -> dict[int, float]:
    """One round: ms of one pass over n new tokens after `depth` tokens, all n logits returned."""
    toks = backend.tokenize(TEXT)
    assert len(toks) >= depth + max(ns), "cost text too short"
    backend.rewind(0)
    backend.eval(toks[:depth], n_logits=0)
    out = {}
    for n in ns:
        backend.rewind(depth)
        t = time.perf_counter()
        backend.eval(toks[depth:depth + n], n_logits=n)
        out[n] = (time.perf_counter() - t) * 1e3
    backend.rewind(0)
    return out


def cpu_share(cpu_s: float, wall_s: float, backend) -> float:
    """The share of its threads' time a stretch of passes got: process CPU seconds over wall seconds times the
    threads that can run at once (ggml's threads spin at their barriers, so a quiet machine gives about 1). 1.0
    where it says nothing: a target with layers on RPC workers (its passes wait on the network, or run in a child
    process), one on a GPU, or no time."""
    if getattr(backend, "offloaded", False) or str(getattr(backend, "device", "cpu")) != "cpu" or wall_s <= 0:
        return 1.0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    threads = max(min(getattr(backend, "n_threads", 1) or 1, cores), 1)
    return cpu_s / (wall_s * threads)


def with_share(backend, fn, *args):
    """(fn(*args), the CPU share its passes on `backend` got: cpu_share over the call)."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, cpu_share(time.process_time() - cpu, time.perf_counter() - wall, backend)


def quick_round(backend) -> tuple[dict[int, float], float]:
    """One round of the quick profile: ms per pass size, and the CPU share its passes got (cpu_share)."""
    return with_share(backend, pass_times_ms, backend, QUICK_SIZES)


def profile_key(backend) -> str:
    """Model file (name, size, mtime), build, CPU, threads, weight layout and whether AMX tile products are taken
    (SPECULANT_AMX=0 turns them off): what T(n) depends on."""
    from . import native
    from .bench.peers import cpu_key

    path = Path(backend.path)
    st = path.stat()
    build = (native.build_info() or {}).get("key", "stock")
    layout = "repacked" if getattr(backend, "repack", False) else "plain"
    raw = f"{path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{build}|{cpu_key()}|{backend.n_threads}|{layout}"
    if native.amx():
        raw += "|amx"
    return f"{path.stem}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"


def profile_path(backend) -> Path:
    from . import models

    return models.home() / "costs" / f"{profile_key(backend)}.json"


def from_times(times_ms: dict[int, float]) -> dict[int, float]:
    """ms per pass size -> r(n) = T(n) / T(1), made non-decreasing (a pass over more tokens never costs less
    in the model the policy uses; a measured dip is noise or a kernel switch the policy cannot exploit)."""
    t1 = times_ms[1]
    out, best = {}, 1.0
    for n in sorted(times_ms):
        best = max(best, times_ms[n] / t1)
        out[n] = best
    return out


def fastest(rounds_ms: list[dict[int, float]]) -> dict[int, float]:
    """Per pass size, the fastest of the rounds: another process can only add time to a pass, so the minimum is
    the estimate a busy moment disturbs least (a median of three kept a 6x spike that two rounds shared)."""
    return {n: min(r[n] for r in rounds_ms) for n in rounds_ms[0]}


def implausible_size(times_ms: dict[int, float]) -> Optional[int]:
    """The first size that costs more than PLAUSIBLE x its token count one-token passes (times in ms, or ratios
    with r(1) = 1): the machine was busy while it measured. None: none does. (Dips are not judged: a kernel switch
    makes real ones, e.g. plain Q4_K rows over 3 tokens cost 1.4x those over 4.)"""
    return next((n for n in sorted(times_ms) if times_ms[n] > PLAUSIBLE * n * times_ms[1]), None)


def plausible(times_ms: dict[int, float]) -> bool:
    return implausible_size(times_ms) is None


def save(backend, times_ms: dict[int, float], source: str, share: Optional[float] = None) -> Path:
    """Store a profile (atomic write; a write that fails leaves no temporary file behind). share: the CPU share
    its rounds got (cpu_share), the lowest of those used."""
    path = profile_path(backend)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"model": str(backend.path), "threads": backend.n_threads, "source": source,
            "measured_ms": {str(n): round(v, 3) for n, v in sorted(times_ms.items())},
            "ratio": {str(n): round(v, 4) for n, v in from_times(times_ms).items()}}
    if share is not None:
        data["cpu_share"] = round(share, 3)
    write_atomic(path, json.dumps(data, indent=1))
    return path


def write_atomic(path: Path, text: str) -> None:
    """text into path through a temporary file beside it, which is removed whatever fails (OSError raised)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        try:
            tmp.unlink()  # gone already where the replace succeeded
        except OSError:
            pass


def _number(value) -> Optional[float]:
    """A JSON value as a finite float; None where it is no number (a bool, a string, null), NaN or infinite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return value if math.isfinite(value) else None


def _check(data) -> tuple[Optional[dict[int, float]], Optional[str]]:
    """(r(n), None) where the stored data is a profile as from_times makes one: positive integer pass sizes with
    r(1) = 1.0, finite positive ratios (numbers, not bools) that never decrease with the size, and a positive finite
    T(1) in ms where measured_ms has one; else (None, what is wrong): the policy would divide by a zero or missing
    r(1), or draft by a shape no machine has."""
    if not isinstance(data, dict):
        return None, "not a JSON object"
    table = data.get("ratio")
    if not isinstance(table, dict) or not table:
        return None, "no \"ratio\" table"
    ratio: dict[int, float] = {}
    for key, value in table.items():
        n = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and key == str(int(key)) else 0
        r = _number(value)
        if n < 1:
            return None, f"pass size {json.dumps(key)[:20]} is not a positive integer"
        if r is None or r <= 0:
            return None, f"ratio[{json.dumps(key)[:20]}] = {json.dumps(value)[:20]} is not a positive finite number"
        ratio[n] = r
    if ratio.get(1) != 1.0:
        return None, "ratio[\"1\"] is not 1.0"
    sizes = sorted(ratio)
    if any(ratio[b] < ratio[a] for a, b in zip(sizes, sizes[1:])):
        return None, "the ratios decrease with the pass size"
    slow = implausible_size(ratio)
    if slow is not None:  # n passes of one token each would have done: the machine was busy while it measured
        return None, f"a pass over {slow} tokens is priced at {ratio[slow]:g} one-token passes"
    measured = data.get("measured_ms", {})
    if not isinstance(measured, dict):
        return None, "\"measured_ms\" is not a table"
    if "1" in measured and not (_number(measured["1"]) or 0) > 0:
        return None, f"measured_ms[\"1\"] = {json.dumps(measured['1'])[:20]} is not a positive finite number"
    if str(data.get("source", "")).startswith("quick") and "cpu_share" not in data:
        return None, "measured before speculant checked that nothing else ran"  # perhaps flattened (cpu_share)
    return ratio, None


def _stored(backend) -> Optional[dict]:
    """The cached profile file of this backend's key, parsed; None where there is none (or it is unreadable)."""
    try:
        return json.loads(profile_path(backend).read_text())
    except (OSError, ValueError):
        return None


def _cached(backend) -> tuple[Optional[dict[int, float]], Optional[str]]:
    """(r(n), None) from this backend's cached profile; (None, None) where there is none; (None, why) where the
    file is there but damaged or holds values no measurement makes."""
    path = profile_path(backend)
    try:
        text = path.read_text()
    except OSError:
        return None, None
    try:
        data = json.loads(text)
    except ValueError:
        return None, "not JSON"
    return _check(data)


def load(backend) -> Optional[dict[int, float]]:
    """The cached r(n) for this backend's key; None where there is none, or none that is whole and sound."""
    return _cached(backend)[0]


def one_pass_seconds(backend) -> Optional[float]:
    """T(1) in seconds as this backend's cached profile measured it, or None (no sound profile, or switched off)."""
    if os.environ.get("SPECULANT_COST_PROFILE", "1") == "0" or not hasattr(backend, "path"):
        return None
    data = _stored(backend)
    if _check(data)[0] is None:
        return None
    ms = _number(data.get("measured_ms", {}).get("1"))
    return ms / 1000 if ms else None


# -- the draft model's prompt processing against the target's -------------------------------------------------
# A draft's prompt costs more per token, relative to the target's, than its decode step does (prompt passes are
# compute-bound and a narrow model uses its tiles less well: Qwen 0.5B/1.5B here, 0.45-0.54 against a step ratio
# of 0.30), so a process's first request would under-price it. Each request that prefills both models measures
# the ratio; it is kept per (draft, target) pair and machine for the next process.
PROMPT_RATIO_MIN_TOKENS = 64  # shorter prompts are dominated by a pass's fixed costs
PROMPT_RATIO_RATE = 0.3  # weight of a new measurement against the stored value


def prompt_ratio_path(draft, target) -> Optional[Path]:
    """Where the pair's prompt-cost ratio is kept; None where either model has no file (no key to keep it by)."""
    from . import models

    if os.environ.get("SPECULANT_COST_PROFILE", "1") == "0":
        return None
    try:
        return models.home() / "costs" / f"prompt-{profile_key(draft)}-over-{profile_key(target)}.json"
    except (AttributeError, TypeError, OSError):
        return None


def _read_ratio(path: Optional[Path]) -> Optional[float]:
    """The stored ratio: a positive finite number, else None (no file, a damaged one, or a value no measurement
    makes: zero, negative, NaN, infinite, a bool or a string)."""
    try:
        data = json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None
    value = _number(data.get("ratio")) if isinstance(data, dict) else None
    return value if value is not None and value > 0 else None


def prompt_ratio(draft, target) -> Optional[float]:
    """The draft's prompt seconds per token over the target's, as earlier requests on this machine measured
    it; None where none did."""
    return _read_ratio(prompt_ratio_path(draft, target))


def observe_prompt_ratio(draft, target, draft_pass: tuple[float, int], target_pass: tuple[float, int]) -> None:
    """Fold one request's (seconds, tokens) of both models' prompt processing into the stored ratio (atomic
    write). Ignored for short prompts, or spans too different to compare (a cached prefix on one side)."""
    (draft_s, draft_n), (target_s, target_n) = draft_pass, target_pass
    if min(draft_n, target_n) < PROMPT_RATIO_MIN_TOKENS or draft_s <= 0 or target_s <= 0:
        return
    if abs(draft_n - target_n) > 0.25 * target_n:
        return
    path = prompt_ratio_path(draft, target)
    if path is None:
        return
    ratio = (draft_s / draft_n) / (target_s / target_n)
    if not (math.isfinite(ratio) and ratio > 0):
        return
    old = _read_ratio(path)
    if old is not None:
        ratio = old + PROMPT_RATIO_RATE * (ratio - old)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"draft": str(draft.path), "target": str(target.path),
                                        "ratio": round(ratio, 4)}))
    except OSError:
        pass  # a read-only cache only loses the prior


def get(backend, measure: bool = True, rounds: int = 3) -> Optional[dict[int, float]]:
    """r(n) for a llama.cpp backend: cached, else measured now (quick) and cached; None where it cannot be
    measured (another runtime) or SPECULANT_COST_PROFILE=0. Measuring empties the backend's cache."""
    if os.environ.get("SPECULANT_COST_PROFILE", "1") == "0" or not hasattr(backend, "path"):
        return None
    cached, unsound = _cached(backend)
    if cached is not None or not measure:
        return cached
    if getattr(backend, "n_ctx", DEPTH + QUICK_SIZES[-1]) < DEPTH + QUICK_SIZES[-1]:
        if unsound:
            print(f"speculant: warning: ignoring the cached pass costs in {profile_path(backend)} ({unsound})",
                  file=sys.stderr)
        return None  # no room to measure at a verify pass's depth: the policy starts unprimed and times passes itself
    if unsound:  # as where there is none: measured again (and the file replaced)
        print(f"speculant: warning: ignoring the cached pass costs in {profile_path(backend)} ({unsound}); "
              f"measuring {backend.name}'s again", file=sys.stderr)
    else:
        print(f"speculant: measuring {backend.name}'s pass costs once on this machine (cached in "
              f"{profile_path(backend).parent})", file=sys.stderr)
    pass_times_ms(backend, QUICK_SIZES[:2])  # warm-up
    measured = [quick_round(backend) for _ in range(rounds)]  # (times, CPU share) per round

    def quiet() -> list[tuple[dict[int, float], float]]:
        return [r for r in measured if r[1] >= QUIET_SHARE]

    while (not quiet() or not plausible(fastest([t for t, _ in quiet()]))) and len(measured) < rounds + MORE_ROUNDS:
        measured.append(quick_round(backend))
    used = quiet()
    if not used or not plausible(times := fastest([t for t, _ in used])):
        # still busy: the policy starts unprimed (it times passes itself); the next process measures again
        why = (f"while other programs ran (its passes got {max(s for _, s in measured):.0%} of their threads' time "
               f"at best)" if not used else "unevenly")
        print(f"speculant: warning: {backend.name}'s pass costs measured {why} (the machine is busy?); not using "
              f"or caching them", file=sys.stderr)
        return None
    try:
        save(backend, times, source=f"quick: fastest of {len(used)} rounds at load",
             share=min(s for _, s in used))
    except OSError as e:  # a read-only cache: this process uses what it measured, the next measures again
        print(f"speculant: warning: cannot cache the pass costs in {profile_path(backend).parent}: "
              f"{e.strerror or e}", file=sys.stderr)
        return from_times(times)
    return load(backend)
