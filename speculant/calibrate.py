"""`speculant calibrate -m MODEL`: choose the self-speculative layer subset that maximizes measured tokens/s.

Search (Draft&Verify / SWIFT style, kept cheap): greedy decoding on a few prompts with every candidate
(early exit after L layers for a grid of depths, then skip sets that drop every other layer of the upper
part), measuring tokens/s directly (it folds acceptance and per-step cost together); then a greedy local
refinement of the best early-exit depth by +-1 layer steps while tokens/s improves. The winner is saved to
`<model>.selfspec.json` next to the model (or under $SPECULANT_HOME/selfspec/ when that is read-only), where
SelfSpecDrafter.from_config finds it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .errors import SettingsError, SpeculantError

DEFAULT_PROMPTS = (
    "Write a Python function `is_prime(n)` that checks whether n is prime.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain in two sentences what a hash map is.",
)


def config_paths(target) -> list[Path]:
    """Where a calibration is stored: next to the model first, then under $SPECULANT_HOME."""
    from . import models

    src = Path(getattr(target, "source", None) or target.name)
    name = src.name
    paths = []
    if src.exists():
        paths.append(src.parent / f"{name}.selfspec.json" if src.is_file() else src / "selfspec.json")
    paths.append(models.home() / "selfspec" / f"{name}.selfspec.json")
    return paths


def load_config(target, path: Optional[str | os.PathLike] = None) -> Optional[dict]:
    """The calibration for the target: from `path` (which must exist and fit the target), else from the first
    default location holding one for its number of layers; None when there is none. A clear SettingsError
    naming the file for one that is not a calibration."""
    for p in ([Path(path)] if path else config_paths(target)):
        if not p.exists():
            if path:
                raise SettingsError(f"self-spec calibration {p} does not exist (write one with `speculant "
                                    "calibrate -o FILE`)")
            continue
        cfg = _read_config(p)
        if cfg["n_layers"] == target.n_layers:
            _warn_if_other_model(p, cfg, target)
            return cfg
        if path:
            raise SettingsError(f"self-spec calibration {p} is for a model of {cfg['n_layers']} layers; "
                                f"{target.name} has {target.n_layers}")
    return None


_warned: set = set()  # (file, target) pairs already warned about: a bench reads a calibration more than once


def _warn_if_other_model(p: Path, cfg: dict, target) -> None:
    """A calibration records the model it was measured on (`model`: the target's name, the GGUF's file name
    or the transformers directory's); another model of as many layers can read it, but its subset was not
    chosen for this one. Files without `model` (written by hand) are taken as they are."""
    recorded = cfg.get("model")
    if not isinstance(recorded, str) or not recorded:
        return
    mine = Path(str(getattr(target, "name", "") or "")).name
    theirs = Path(recorded).name
    if not mine or theirs == mine or (p, mine) in _warned:
        return
    _warned.add((p, mine))
    print(f"speculant: warning: self-spec calibration {p} was measured on {theirs}, not {mine}: its layers "
          f"may not pay off here (calibrate this model: `speculant calibrate -m MODEL`)", file=sys.stderr)


def _read_config(p: Path) -> dict:
    """A calibration file -> its dict (n_layers, and layers: a valid subset of them, one layer at least
    left out)."""
    fix = "rerun `speculant calibrate` or delete it"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise SettingsError(f"self-spec calibration {p} is not readable JSON ({e}): {fix}") from None
    n = cfg.get("n_layers") if isinstance(cfg, dict) else None
    layers = cfg.get("layers") if isinstance(cfg, dict) else None
    if (not isinstance(n, int) or not isinstance(layers, list) or 0 not in layers
            or any(not isinstance(i, int) or not 0 <= i < n for i in layers)):
        raise SettingsError(f"self-spec calibration {p} is not a calibration (n_layers and a list of layers "
                            f"among them, 0 included): {fix}")
    if len(set(layers)) >= n:
        raise SettingsError(f"self-spec calibration {p} lists all {n} layers, so the draft would be the whole "
                            f"target: leave at least one layer out (or rerun `speculant calibrate`)")
    return cfg


def save_config(target, cfg: dict, path: Optional[str | os.PathLike] = None) -> Path:
    errors = []
    for p in ([Path(path)] if path else config_paths(target)):
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(p.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cfg, indent=1))
            os.replace(tmp, p)
            return p
        except OSError as e:
            errors.append(f"{p}: {e.strerror}")
    raise SpeculantError("cannot save the calibration: " + "; ".join(errors))


def candidates(n_layers: int) -> list[list[int]]:
    """Early-exit depths over a grid, then 'skip every other upper layer' sets."""
    out: list[list[int]] = []
    depths = sorted({max(1, round(n_layers * f)) for f in (0.25, 0.375, 0.5, 0.625, 0.75)})
    for d in depths:
        if d < n_layers:
            out.append(list(range(d)))
    for frac in (0.25, 0.5):
        lo = max(1, round(n_layers * frac))
        layers = [i for i in range(n_layers) if i < lo or (i - lo) % 2 == 0 or i == n_layers - 1]
        if len(layers) < n_layers and layers not in out:
            out.append(layers)
    return out


def measure(target, layers: Optional[Sequence[int]], prompts: Sequence, max_tokens: int, draft_max: int) -> dict:
    """Greedy generation on the prompts; tokens/s over all of them, acceptance and accepted tokens."""
    from .drafters.selfspec import SelfSpecDrafter
    from .engine import Engine
    from .verify import SamplingParams

    drafter = SelfSpecDrafter(target, layers) if layers is not None else None
    engine = Engine(target, drafter, draft_max=draft_max if drafter else 0)
    n_tok, t_total, drafted, accepted = 0, 0.0, 0, 0
    for p in prompts:
        r = engine.generate(p, max_tokens=max_tokens, params=SamplingParams(0.0))
        n_tok += r.stats.generated_tokens
        t_total += r.stats.decode_time
        drafted += r.stats.drafted
        accepted += r.stats.accepted
    if drafter:
        drafter.close()
    return {"tokens_per_s": n_tok / t_total if t_total > 0 else 0.0,
            "acceptance": accepted / drafted if drafted else 0.0, "accepted": accepted, "tokens": n_tok}


def calibrate(target, prompts: Sequence = DEFAULT_PROMPTS, *, max_tokens: int = 32, draft_max: int = 4,
              log=None) -> dict:
    """Search the layer subset; return the config dict (not saved)."""
    n = target.n_layers
    log = log or (lambda *a: None)
    measure(target, None, prompts[:1], 2, 0)  # warm-up: a cold first measurement would flatter every later one
    base = measure(target, None, prompts, max_tokens, 0)
    log(f"plain: {base['tokens_per_s']:.2f} tokens/s")
    results: dict[tuple, dict] = {}

    def run(layers: list[int]) -> dict:
        key = tuple(layers)
        if key not in results:
            results[key] = measure(target, layers, prompts, max_tokens, draft_max)
            r = results[key]
            log(f"{len(layers)}/{n} layers {_describe(layers, n)}: {r['tokens_per_s']:.2f} tokens/s, "
                f"acceptance {r['acceptance']:.1%}")
        return results[key]

    for layers in candidates(n):
        run(layers)
    # greedy refinement of the best early exit depth
    exits = [k for k in results if list(k) == list(range(len(k)))]
    if exits:
        best = max(exits, key=lambda k: results[k]["tokens_per_s"])
        depth = len(best)
        for step in (1, -1):
            d = depth
            while 1 <= d + step < n:
                cur, nxt = results[tuple(range(d))], run(list(range(d + step)))
                if nxt["tokens_per_s"] <= cur["tokens_per_s"]:
                    break
                d += step
    paid = [k for k in results if results[k]["accepted"]]  # one that accepted nothing only decoded plainly
    if not paid:
        raise SpeculantError(f"no layer subset had a drafted token accepted in {max_tokens} tokens per prompt: "
                             "nothing to choose from (try a larger -n)")
    best_key = max(paid, key=lambda k: results[k]["tokens_per_s"])
    best = results[best_key]
    return {"n_layers": n, "layers": list(best_key), "description": _describe(list(best_key), n),
            "tokens_per_s": best["tokens_per_s"], "acceptance": best["acceptance"],
            "plain_tokens_per_s": base["tokens_per_s"], "draft_max": draft_max,
            "speedup": best["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None,
            "beats_plain": best["tokens_per_s"] > base["tokens_per_s"],
            "candidates": [{"layers": list(k), **v} for k, v in results.items()],
            "model": target.name, "dtype": str(getattr(target, "dtype", "")), "time": time.time()}


def _describe(layers: Sequence[int], n: int) -> str:
    if list(layers) == list(range(len(layers))):
        return f"early exit after {len(layers)}"
    return "skip " + ",".join(str(i) for i in range(n) if i not in set(layers))


def cmd_calibrate(args) -> int:
    from .api import check_ctx_size, check_threads
    from .backends.torch import load_torch_backend
    from .engine import MAX_DRAFT

    if not 1 <= args.prompts <= len(DEFAULT_PROMPTS):
        raise SettingsError(f"--prompts must be 1..{len(DEFAULT_PROMPTS)} (the built-in prompts), got {args.prompts}")
    if not 1 <= args.draft_max <= MAX_DRAFT:
        raise SettingsError(f"--draft-max must be in [1, {MAX_DRAFT}], got {args.draft_max}")
    if args.n_predict < 2:
        raise SettingsError(f"-n must be >= 2 (after one token nothing is left to draft), got {args.n_predict}")
    check_ctx_size(args.ctx_size)  # load_backend's check, before the model is converted
    check_threads(args.threads, "--threads")
    target = load_torch_backend(args.model, dtype=args.dtype, device=args.device, n_ctx=args.ctx_size,
                                threads=args.threads)
    prompts = DEFAULT_PROMPTS[: args.prompts]
    cfg = calibrate(target, prompts, max_tokens=args.n_predict, draft_max=args.draft_max,
                    log=lambda s: print(s, file=sys.stderr, flush=True))
    path = save_config(target, cfg, args.output)
    print(f"{cfg['description']} ({len(cfg['layers'])}/{cfg['n_layers']} layers): {cfg['tokens_per_s']:.2f} "
          f"tokens/s vs plain {cfg['plain_tokens_per_s']:.2f}; saved to {path}")
    if not cfg["beats_plain"]:
        print("speculant: no layer subset beat plain decoding on this model; prefer plain or a draft model",
              file=sys.stderr)
    return 0


def add_cli(sub, add_model_args=None, add_sampling_args=None) -> None:
    from . import models
    from .api import thread_count

    p = sub.add_parser("calibrate", help="choose the self-speculative layer subset of a model (torch backend)",
                       description="Greedy generation on a few built-in prompts with candidate layer subsets; "
                                   "saves the fastest for --self-spec.")
    p.add_argument("-m", "--model", default=models.DEFAULT_TARGET,
                   help="model: registered name, GGUF path (converted once) or transformers directory "
                        "(default %(default)s)")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 | fp16 (default bf16 where native)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default cuda if present)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context window (default 4096)")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--draft-max", "--draft", type=int, default=4, help="tokens drafted per step (default 4)")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--prompts", type=int, default=len(DEFAULT_PROMPTS),
                   help=f"how many built-in prompts (default {len(DEFAULT_PROMPTS)})")
    p.add_argument("-o", "--output", default=None,
                   help="where to save (default <model>.selfspec.json next to the model, else under "
                        "$SPECULANT_HOME/selfspec/: where --self-spec looks; another file is read with "
                        "--self-spec-config FILE)")
    p.set_defaults(handler=cmd_calibrate)
