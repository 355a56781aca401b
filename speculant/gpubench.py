"""The GPU benchmark of issue 15 as one command (scripts/gpu_bench.sh runs it): random weights of real Qwen2.5
shapes, so nothing but this repository has to reach the GPU machine.

Steps, each timed and reported on its own; a failing step is reported and the next one runs:
  env       torch / CUDA / transformers / triton versions, the device, whether the Triton kernels check out
  identity  bit-identity on the static backend: a token decoded alone vs in verify passes of every size
            (with the default kernels, and torch's), graphs vs eager, and speculative greedy == plain output
  costs     ms per pass over n = 1, 5, 8, 16 new tokens after a 256-token context, per shape: ours with CUDA
            graphs (fixed 16 rows, and shape classes; each with the Triton kernels and with torch's),
            ours eager, the existing TorchBackend, transformers eager (sdpa + DynamicCache)
  replay    the committed traces (docs/bench/traces/) replayed on the 32B shape with the 0.5B draft, beside
            transformers' generate and assisted generation on the same weights; a trace that recorded its
            draft's agreement is also replayed at fixed k = 4, 5, 6, 8
  draft     ms per draft step of the 0.5B shape as ModelDrafter runs it: tokens chosen on the device (one
            transfer per draft, or a small one per step) vs the host loop (each logits row to the host)
  engine    decode tokens/s of the whole engine (plain, and speculative with a same-weights draft) beside the
            bare passes of the steps it took: what the engine's host side adds to the replayed passes
--smoke runs the same steps with tiny shapes (on CPU without a GPU) in well under a minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 256  # context tokens before a timed pass (the table)
PASS_SIZES = (1, 5, 8, 16)


class StepFailed(Exception):
    """A step that ran to the end with a failing check: its numbers are still results."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _say(msg: str) -> None:
    print(msg, flush=True)


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        try:
            torch.cuda.empty_cache()
        except Exception:  # after a sticky CUDA error this raises again: the report must still be written
            pass


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, repeats: int, device) -> float:
    fn()  # warm-up (and graph capture)
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return round(1000 * statistics.median(times), 3)


# ---------------------------------------------------------------------------------------------------------
# steps


def step_env(opts) -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "device": opts.device}
    if opts.device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1))
        from .backends import triton_kernels

        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
        # ok: RoPE + K/V stores and attention run as Triton kernels (the default where this holds)
        info["triton_kernels"] = triton_kernels.check(opts.device, torch.bfloat16) or "ok"
    for k, v in info.items():
        _say(f"  {k}: {v}")
    return info


def step_identity(opts) -> dict:
    """Max |diff| between one-at-a-time logits and verify-pass logits (must be 0.0), per pass size."""
    from .drafters.model import ModelDrafter
    from .engine import Engine
    from .shapes import random_backend

    dev, shape = opts.device, opts.identity_shape
    on_cuda = dev.startswith("cuda")
    out: dict = {"shape": shape}
    # the default kernels (on CUDA: Triton's where they check out), and torch's on CUDA beside them
    modes = [("graphs", True, None), ("eager", False, None), ("graphs_torch_kernels", True, "torch")] \
        if on_cuda else [("eager", False, None)]
    from .shapes import SHAPES

    from .backends.triton_kernels import SPLIT

    # passes around the 256-position KV block, and (on CUDA) around the first SPLIT positions, where Triton's
    # attention starts splitting the keys: rows before it are in passes of both kinds
    bases = (CONTEXT - 8, SPLIT - 8) if on_cuda else (CONTEXT - 8,)
    ids = [(37 * i + 11) % SHAPES[shape][5] for i in range(max(bases) + 64)]
    singles = {}
    for mode, graphs, kernels in modes:
        b = random_backend(shape, rows=16, graphs=graphs, device=dev, n_ctx=max(bases) + 128, seed=7,
                           kernels=kernels)
        out[f"{mode}_kernels"] = b.kernels
        diffs = {}
        for base in bases:
            b.rewind(0)
            b.eval(ids[:base], n_logits=0)
            single = np.stack([b.eval([x])[0] for x in ids[base:base + 48]])  # [48, V]
            if base == bases[0]:
                singles[mode] = single
            for n in (1, 2, 5, 8, 16, 17, 33):
                for off in (0, 3):
                    at = base + off
                    b.rewind(at)
                    b.eval(ids[len(b.tokens):at], n_logits=0)  # a shorter earlier pass may have cut it
                    batch = b.eval(ids[at:at + n], n_logits=n)
                    diffs[f"at={base},n={n},off={off}"] = float(np.abs(batch - single[off:off + n]).max())
        worst = max(diffs.values())
        out[f"{mode}_max_diff"] = worst
        _say(f"  {mode} ({b.kernels} kernels): alone vs verify passes n=1..33 at offsets 0,3 after "
             f"{', '.join(map(str, bases))} tokens (crossing a KV block{', the first split' if on_cuda else ''}): "
             f"max |diff| {worst} {'IDENTICAL' if worst == 0.0 else 'DIFFERENT'}")
        b.close()
        del b
        _free()
    if "graphs" in singles:
        d = float(np.abs(singles["graphs"] - singles["eager"]).max())
        out["graphs_vs_eager_max_diff"] = d
        _say(f"  graphs vs eager, one-token passes: max |diff| {d} {'IDENTICAL' if d == 0.0 else 'DIFFERENT'}")
    # speculative greedy == plain, same-weights draft in shape-class mode (graphs where CUDA is)
    target = random_backend(shape, rows=16, device=dev, n_ctx=1024, seed=7, std=0.05)
    draft = random_backend(shape, device=dev, n_ctx=1024, seed=7, std=0.05)
    prompt = ids[:40]
    plain = Engine(target).generate(prompt, max_tokens=32)
    spec = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=4).generate(prompt, max_tokens=32)
    out["greedy_identity"] = spec.tokens == plain.tokens
    out["greedy_acceptance"] = spec.stats.acceptance_rate
    _say(f"  speculative greedy == plain: {out['greedy_identity']} (acceptance {spec.stats.acceptance_rate}, "
         f"{spec.stats.target_calls} vs {plain.stats.target_calls} target calls)")
    for b in (target, draft):
        b.close()
    del target, draft
    _free()
    ok = all(v == 0.0 for k, v in out.items() if k.endswith("max_diff")) and out["greedy_identity"]
    out["ok"] = ok
    if not ok:
        raise StepFailed(f"identity check failed: {out}", out)
    return out


def _hf_pass_ms(model, n: int, repeats: int, device) -> float:
    """transformers eager (sdpa, DynamicCache): a pass over n new tokens after CONTEXT tokens."""
    import torch
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    ctx = torch.tensor([[(13 * i) % vocab for i in range(CONTEXT)]], device=device)
    new = torch.tensor([[(17 * i + 5) % vocab for i in range(n)]], device=device)
    import inspect

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # renamed in 5.2x
    saved = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            try:
                cache = DynamicCache(config=model.config)
            except TypeError:  # older transformers
                cache = DynamicCache()
            model(input_ids=ctx, use_cache=True, **{kw: cache})

            def run():
                extra = cache.get_seq_length() - CONTEXT
                if extra > 0:
                    cache.crop(-extra)  # the number of tokens to drop, negated
                model(input_ids=new, use_cache=True, **{kw: cache})
            return _median_ms(run, repeats, device)
    finally:
        model.config._attn_implementation = saved


def _ours_pass_ms(backend, n: int, repeats: int, device) -> float:
    ids = [(19 * i + 3) % backend.n_vocab for i in range(CONTEXT + n)]
    backend.rewind(0)
    backend.eval(ids[:CONTEXT], n_logits=0)

    def run():
        backend.rewind(CONTEXT)
        backend.sync_device(ids, n) if hasattr(backend, "sync_device") else backend.eval(ids[CONTEXT:], n_logits=n)
    return _median_ms(run, repeats, device)


def step_costs(opts) -> dict:
    import torch

    from .backends.torch import TorchBackend
    from .backends.torch_static import StaticTorchBackend
    from .shapes import random_model

    dev = opts.device
    on_cuda = dev.startswith("cuda")
    table: dict = {}
    for shape in opts.cost_shapes:
        if opts.over_budget():
            _say(f"  {shape}: skipped (time budget)")
            continue
        t0 = time.perf_counter()
        try:
            model = random_model(shape, device=dev, seed=0)
        except Exception as e:  # e.g. out of memory at 32B: the smaller shapes' rows stay
            table[shape] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
            _say(f"  {shape}: FAILED to build: {table[shape]['failed']}")
            _free()
            continue
        setups = []
        if on_cuda:  # the defaults (Triton's kernels where they check out), and torch's
            setups += [("ours graphs, 16 rows", dict(rows=16, graphs=True)),
                       ("ours graphs, 16 rows, torch kernels", dict(rows=16, graphs=True, kernels="torch")),
                       ("ours graphs, 8 rows", dict(rows=8, graphs=True)),  # a target's width for k <= 7
                       ("ours graphs, shape classes", dict(rows=None, graphs=True)),
                       ("ours graphs, classes, torch kernels", dict(rows=None, graphs=True, kernels="torch"))]
        setups += [("ours eager, 16 rows", dict(rows=16, graphs=False))]
        rows: dict = {}

        def measure(label, make):
            try:
                b = make()
                rows[label] = {n: _ours_pass_ms(b, n, opts.repeats, dev) for n in PASS_SIZES}
                b.close()
            except Exception as e:  # one setup failing (an old transformers, memory) leaves the others' rows
                rows[label] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
            _free()

        for label, kw in setups:
            measure(label, lambda kw=kw: StaticTorchBackend(model, name=shape, n_ctx=1024, **kw))
        if opts.existing_backend:
            measure("TorchBackend (existing)", lambda: TorchBackend(model, name=shape, n_ctx=1024))
        try:
            rows["transformers eager sdpa"] = {n: _hf_pass_ms(model, n, opts.repeats, dev) for n in PASS_SIZES}
        except Exception as e:
            rows["transformers eager sdpa"] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        table[shape] = rows
        for label, r in rows.items():
            _say(f"  {shape:14s} {label:34s} " + "  ".join(f"n={n}: {ms:8.2f} ms" if isinstance(ms, float)
                                                          else f"{n}: {ms}" for n, ms in r.items()))
        _say(f"  ({shape}: {time.perf_counter() - t0:.1f} s)")
        if on_cuda:
            _say(f"  GPU memory held after {shape}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        del model
        _free()
    if on_cuda:
        _say(f"  peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    failed = [shape if "failed" in rows else f"{shape}/{label}" for shape, rows in table.items()
              for label, r in ({"": rows} if "failed" in rows else rows).items() if "failed" in r]
    if failed:  # the numbers that were measured stay results; the summary says what was not
        raise StepFailed(f"{len(failed)} setups failed: {', '.join(failed)}"[:300], table)
    return table


def step_replay(opts) -> dict:
    from .replay import build_pair, format_rows, hf_generate_speed, hf_lengths, read_trace, replay

    traces = opts.traces or sorted(str(p) for p in (ROOT / "docs" / "bench" / "traces").glob("*.json"))
    if not traces:
        raise FileNotFoundError("no traces under docs/bench/traces/ (record one with `speculant bench --trace`)")
    docs = [read_trace(t) for t in traces]
    longest = max((r["prompt_tokens"] + r["generated_tokens"] for d in docs for r in d["runs"]), default=0)
    target, draft = build_pair(opts.replay_shape, opts.replay_draft_shape, opts.device, n_ctx=longest + 128)
    out = {"kernels": target.kernels}
    _say(f"  kernels: {target.kernels}")
    try:
        for path, doc in zip(traces, docs):
            if opts.over_budget():
                _say(f"  {path}: skipped (time budget)")
                continue
            ks = opts.replay_ks if any(r.get("agree") for r in doc["runs"]) else ()
            res = replay(doc, target, draft, ks=ks)
            res["hf"] = hf_generate_speed(target.model, draft.model, *hf_lengths(doc), target.device)
            out[Path(path).name] = res
            _say(f"  trace {Path(path).name}:")
            for line in format_rows(res["rows"], res["hf"], opts.replay_shape, opts.replay_draft_shape).splitlines():
                _say("    " + line)
    finally:
        target.close(), draft.close()
        del target, draft
        _free()
    return out


def step_draft(opts) -> dict:
    """ms per draft step of the draft shape as the engine runs it: ModelDrafter.propose of k = 4 after a 256-token
    context (a one-token catch-up, then 3 fed-back steps: 4 passes), with the tokens chosen on the device (all
    passes back to back and one transfer, as a fixed k; or a small transfer a step, as the adaptive policy
    reads) and with the host loop (each step's logits row to the host), beside one bare pass. The replay
    charges a draft step as a bare pass and a device argmax."""
    from .drafters.model import ModelDrafter
    from .shapes import random_backend
    from .verify import SamplingParams

    dev, k = opts.device, 4
    b = random_backend(opts.replay_draft_shape, device=dev, n_ctx=1024, seed=3)
    ids = [(19 * i + 3) % b.n_vocab for i in range(CONTEXT)]
    rng = np.random.default_rng(0)
    out = {"shape": opts.replay_draft_shape, "bare pass": _ours_pass_ms(b, 1, opts.repeats, dev)}
    try:
        for label, p_min, host, params in (("device, k at once", 0.0, False, SamplingParams()),
                                           ("device, read each step", 1e-9, False, SamplingParams()),
                                           ("host loop", 0.0, True, SamplingParams()),
                                           ("device, sampled T=1", 0.0, False, SamplingParams(1.0)),
                                           ("host loop, sampled T=1", 0.0, True, SamplingParams(1.0))):
            drafter = ModelDrafter(b, b.n_vocab, p_min=p_min)  # p_min > 0: a decision every step
            if host:
                b.draft_steps = None  # the host loop: ModelDrafter looks the method up on the instance
            try:
                b.rewind(0)
                b.eval(ids[:-1], n_logits=0)
                ms = _median_ms(lambda: drafter.propose(ids, k, params, rng), opts.repeats, dev) / k
            finally:
                if host:
                    del b.draft_steps
            out[label] = round(ms, 3)
    finally:
        b.close()
        del b
        _free()
    _say("  " + "  ".join(f"{label}: {v} ms" for label, v in out.items() if label != "shape")
         + f"  (per draft step, {out['shape']})")
    return out


def step_engine(opts) -> dict:
    """The whole engine on the device, against the bare passes it runs: plain decoding and greedy speculation
    (k = 4, fixed) of the identity shape with a same-weights draft (it accepts nearly everything), 64 tokens,
    decode tokens/s through Engine.generate beside replay_run of exactly the steps it took. Their ratio is what
    the engine's host side (policy, stats, detokenization, transfers) costs on top of the passes, which the
    replay does not charge."""
    from .drafters.model import ModelDrafter
    from .engine import Engine
    from .replay import replay_run
    from .shapes import SHAPES, random_backend

    dev, shape, n = opts.device, opts.identity_shape, 64
    target = random_backend(shape, rows=16, device=dev, n_ctx=1024, seed=7, std=0.05)
    draft = random_backend(shape, device=dev, n_ctx=1024, seed=7, std=0.05)
    prompt = [(37 * i + 11) % SHAPES[shape][5] for i in range(200)]
    out: dict = {"shape": shape}
    try:
        for label, engine in (("plain", Engine(target)),
                              ("speculative k=4", Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=4,
                                                         adaptive=False))):
            engine.generate(prompt, max_tokens=8)  # warm-up: graphs for these shapes
            best, steps = None, None
            for _ in range(3):  # greedy: every run takes the same steps; the fastest is kept
                engine.trace = []
                r = engine.generate(prompt, max_tokens=n)
                if best is None or r.stats.decode_time < best.stats.decode_time:
                    best, steps = r, engine.trace
            run = {"prompt_tokens": len(prompt), "generated_tokens": best.stats.generated_tokens, "steps": steps}
            bare = min(replay_run(run, target, draft if label != "plain" else None)["seconds"] for _ in range(3))
            out[label] = {"engine_tok_s": round(best.stats.tokens_per_s, 2),
                          "bare_passes_tok_s": round(run["generated_tokens"] / bare, 2),
                          "engine_over_bare": round(best.stats.decode_time / bare, 3),
                          "tau": round(best.stats.generated_tokens / len(steps), 2)}
            _say(f"  {label}: engine {out[label]['engine_tok_s']} tok/s, its passes alone "
                 f"{out[label]['bare_passes_tok_s']} tok/s (engine / passes time {out[label]['engine_over_bare']}x, "
                 f"τ {out[label]['tau']})")
    finally:
        for b in (target, draft):
            b.close()
        del target, draft
        _free()
    return out


STEPS = {"env": step_env, "identity": step_identity, "replay": step_replay, "costs": step_costs, "draft": step_draft,
         "engine": step_engine}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m speculant.gpubench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU (a test runs this)")
    ap.add_argument("--device", default=None, help="default cuda if present, else cpu")
    ap.add_argument("--steps", default=",".join(STEPS), help="comma list of steps (default all)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BENCH_BUDGET", 420)),
                    help="seconds after which remaining shapes/traces are skipped (default 420)")
    ap.add_argument("--trace", action="append", default=None, help="trace file(s) to replay (default: committed)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench-out/gpu", help="directory for results.json")
    ap.add_argument("-t", "--threads", type=int, default=None, help="CPU threads")
    args = ap.parse_args(argv)

    import torch

    from .api import check_threads
    from .backends.torch import resolve_device
    from .errors import SettingsError

    try:
        check_threads(args.threads, "--threads")
    except SettingsError as e:
        ap.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    opts = argparse.Namespace(
        device=resolve_device(args.device),
        identity_shape="tiny" if args.smoke else "qwen2.5-1.5b",
        cost_shapes=["tiny-draft", "tiny"] if args.smoke else ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b",
                                                               "qwen2.5-32b"],
        replay_shape="tiny" if args.smoke else "qwen2.5-32b",
        replay_draft_shape="tiny-draft" if args.smoke else "qwen2.5-0.5b",
        repeats=3 if args.smoke else 7, existing_backend=True, traces=args.trace, replay_ks=(4, 5, 6, 8),
        over_budget=lambda: time.perf_counter() - t_start > args.budget)
    _say(f"speculant GPU bench ({'smoke, tiny shapes' if args.smoke else 'Qwen2.5 shapes, random weights'}) "
         f"on {opts.device}")
    results, status = {}, {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every step: a run stopped by its time limit keeps what it measured
        (out / "results.json").write_text(json.dumps({"status": status, "results": results}, indent=1, default=str))

    for name in [s for s in args.steps.split(",") if s]:
        if name not in STEPS:
            _say(f"[{name}] unknown step (known: {', '.join(STEPS)})")
            status[name] = "unknown"
            continue
        _say(f"[{name}]")
        t = time.perf_counter()
        try:
            results[name] = STEPS[name](opts)
            status[name] = f"ok ({time.perf_counter() - t:.1f} s)"
        except KeyboardInterrupt:  # gpu_bench.sh's hard stop (timeout --signal=INT)
            status[name] = f"INTERRUPTED ({time.perf_counter() - t:.1f} s)"
            _say(f"[{name}] {status[name]}")
            break
        except Exception as e:  # report and go on: one broken step must not cost the others
            if isinstance(e, StepFailed):
                results[name] = e.result
            traceback.print_exc(file=sys.stderr)
            status[name] = f"FAILED ({time.perf_counter() - t:.1f} s): {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            _free()
        _say(f"[{name}] {status[name]}")
        write()
    _say("\nsummary:")
    for name, s in status.items():
        _say(f"  {name:9s} {s}")
    _say(f"  total {time.perf_counter() - t_start:.1f} s")
    write()
    _say(f"wrote {out / 'results.json'}")
    return 0 if all(s.startswith("ok") for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
