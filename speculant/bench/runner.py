"""Run a benchmark: load the models, build every method's engine, measure the costs the predicted speedup
needs, then run each prompt under every method in one sitting, interleaved; then, optionally, each method's
peak memory in a process of its own (speculant.bench.memory).

Two ways to interleave (`interleave`):
- "prompt": every engine wraps the same loaded target (models load once); each prompt runs under one method
  after another, the first method rotating between prompts. On a shared machine, speed drifts between two
  runs of the same prompt: plain against plain, one run each, spreads 0.85-1.11 per prompt here.
- "step": every method gets its own copy of the models, and all methods generate the same prompt at once,
  one decoding step each in turn (round robin); each is charged only the time its own steps took. A drift
  then hits every method alike: plain against plain spreads 0.99-1.01 per prompt. Costs a target (and draft)
  in memory per method, so the torch-target methods stay with "prompt".
"""

from __future__ import annotations

import hashlib
import importlib
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from ..costprofile import with_share
from ..errors import SettingsError, SpeculantError
from ..replay import draft_agreement
from ..verify import SamplingParams
from . import stats as bstats
from .methods import Method, MethodContext, Variant
from .suite import Prompt


def check_draft(cfg: "BenchConfig") -> None:
    """Methods that need a draft model have one (checked before anything is printed or loaded)."""
    from ..api import FREE_DRAFTERS

    names = sorted({v.method.name for v in cfg.variants if v.method.needs_draft})
    if names and (not cfg.draft_model or cfg.draft_model in FREE_DRAFTERS):
        free = (f" (-md {cfg.draft_model} is not a model: bench runs prompt lookup and history drafting as the "
                f"methods lookup, adaptive-lookup and history)" if cfg.draft_model else "")
        raise SettingsError(f"method{'s' if len(names) > 1 else ''} {', '.join(names)} "
                            f"need{'' if len(names) > 1 else 's'} a draft model: pass -md, or --methods without "
                            f"{'them' if len(names) > 1 else 'it'} (e.g. --methods plain,adaptive-lookup; the default, "
                            f"plain,adaptive+lookup, needs one){free}")


@dataclass
class BenchConfig:
    model: str
    draft_model: Optional[str]
    variants: list[Variant]
    temps: list[float]
    n_predict: int = 128
    repeats: int = 1
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    draft_p_min: float = 0.0
    n_ctx: int = 4096
    threads: Optional[int] = None
    cost_repeats: int = 5
    warmup: bool = True
    suite: str = "builtin"
    extra: dict = field(default_factory=dict)  # method options (MethodContext.options), e.g. self_spec_exit
    dtype: Optional[str] = None  # torch target: None = the backend's default (bf16 on CPUs with native bf16)
    device: Optional[str] = None
    memory: bool = False  # measure each method's peak RSS in a child process
    interleave: str = "prompt"  # "prompt" | "step" (see the module docstring)
    target_rpc: dict = field(default_factory=dict)  # llama.cpp target on RPC workers: {rpc, tensor_split}
    trace: bool = False  # record every decoding step (speculant/replay.py reads it back)

    def settings(self) -> dict:
        d = asdict(self)
        d["variants"] = [{"label": v.label, "method": v.method.name, "k": v.k} for v in self.variants]
        return d


def machine_info(threads_used: Optional[int]) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads_used": threads_used, "platform": platform.platform(),
            "python": sys.version.split()[0]}
    try:
        info["cores_available"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        info["loadavg_at_start"] = list(os.getloadavg())
    except OSError:
        pass
    from ..doctor import ISA_FLAGS, llama_facts  # the same facts as `speculant doctor`
    from ..native import cpu_flags

    info["cpu_features"] = [f for f in ISA_FLAGS if f in cpu_flags()]
    info["llama.cpp"] = llama_facts()
    return info


def versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("speculant", "llama-cpp-python", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        here = Path(__file__).resolve().parent
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                                           timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    return out


def measure_costs(target, draft, context: list[int], max_n: int, repeats: int = 5) -> dict:
    """Time a target pass over n = 1..max_n new tokens (logits for all n, as verification needs) and one
    draft-model step, after `context`; medians in ms. V(n) = t(n) / t(1), c = draft step / t(1).
    The measurements go round-robin (n = 1, 2, ..., draft, then again), so a burst of load from elsewhere
    spreads over all of them instead of spoiling one."""
    context = list(context)[: max(1, min(len(context), target.n_ctx - max_n - 2))]
    probe = (context * (max_n // max(1, len(context)) + 2))[:max_n]  # any tokens will do for timing
    target.sync(context, n_logits=1)
    base = len(target.tokens)
    steps = {}
    for n in range(1, max_n + 1):
        def step(n=n):
            target.eval(probe[:n], n_logits=n)
            target.rewind(base)
        steps[str(n)] = step
    if draft is not None:
        if draft.n_vocab != target.n_vocab:  # another vocabulary: the same text in its own ids
            context = draft.tokenize(target.detokenize(context), add_special=False)[:len(context)] or [0]
        draft.sync(context, n_logits=1)
        dbase = len(draft.tokens)

        def dstep():
            draft.eval(context[:1], n_logits=1)
            draft.rewind(dbase)
        steps["draft"] = dstep
    times: dict[str, list[float]] = {key: [] for key in steps}
    for fn in steps.values():  # warm
        fn()
    for _ in range(repeats):
        for key, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - t) * 1000.0)
    target_ms = {key: statistics.median(v) for key, v in times.items() if key != "draft"}
    t1 = target_ms["1"]
    out = {"target_ms": target_ms, "V": {n: ms / t1 for n, ms in target_ms.items()},
           "draft_step_ms": None, "c": None, "repeats": repeats, "context_tokens": base}
    if draft is not None:
        out["draft_step_ms"] = statistics.median(times["draft"])
        out["c"] = out["draft_step_ms"] / t1
    return out


def _token_hash(tokens: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def check_config(cfg: BenchConfig, prompts: list[Prompt]) -> dict[float, SamplingParams]:
    """Settings the run cannot start with are a SettingsError (before anything is printed or loaded); returns the
    sampling parameters per temperature."""
    from ..api import check_ctx_size

    if not prompts:
        raise SettingsError("no prompts selected")
    if cfg.repeats < 1:
        raise SettingsError(f"--repeats must be >= 1, got {cfg.repeats}")
    if cfg.cost_repeats < 1:
        raise SettingsError(f"--cost-repeats must be >= 1, got {cfg.cost_repeats}")
    if cfg.n_predict < 1:
        raise SettingsError(f"-n must be >= 1, got {cfg.n_predict}")
    check_ctx_size(cfg.n_ctx)
    check_draft(cfg)
    params_by_temp = {t: SamplingParams(t, cfg.top_k, cfg.top_p, cfg.min_p, cfg.seed) for t in cfg.temps}  # validates
    methods = list({v.method.name: v.method for v in cfg.variants}.values())
    check_torch(methods)
    if cfg.interleave not in ("prompt", "step"):
        raise SettingsError(f"--interleave must be prompt or step, got {cfg.interleave!r}")
    if cfg.interleave == "step" and any(m.backend == "torch" for m in methods):
        raise SettingsError("--interleave step loads the target once per method, too much for torch-target "
                            "methods: use --interleave prompt")
    return params_by_temp


def run(cfg: BenchConfig, prompts: list[Prompt], *, progress: bool = True, log=print,
        keep_partial: bool = False) -> dict:
    """Run the benchmark; returns {machine, versions, settings, models, costs, rows, summary} (and costs_torch,
    notes, memory when they apply). keep_partial: a Ctrl-C or SIGTERM while decoding ends the runs there and
    returns what was finished (whole prompts), with "interrupted" holding the exception to raise once the
    results are written; nothing finished re-raises at once."""
    params_by_temp = check_config(cfg, prompts)
    methods = list({v.method.name: v.method for v in cfg.variants}.values())

    t_start = time.time()
    contexts: list[MethodContext] = []
    try:
        if cfg.interleave == "step":  # a copy of the models per method: their states advance together
            if any(m.backend == "llama.cpp" for m in methods):
                # The first repacked target a process loads runs ~6% slower than the next ones (its memory is
                # placed worse; measured: 65 against 60-61 ms a pass, and equal once a first copy is held):
                # that copy is held apart, so that every method's copy is placed alike.
                from ..api import load_backend

                contexts.append(MethodContext(load_backend(cfg.model, n_ctx=cfg.n_ctx, threads=cfg.threads,
                                                           **cfg.target_rpc), None))
            own = {}
            for v in cfg.variants:
                contexts.append(load_context(cfg, [v.method]))
                own[v.label] = contexts[-1]
            drafted = [c for c in own.values() if c.draft is not None]
            ctx = MethodContext(own[cfg.variants[0].label].target, drafted[0].draft if drafted else None)  # costs
        else:
            contexts.append(load_context(cfg, methods))
            ctx = contexts[0]
            own = {v.label: ctx for v in cfg.variants}
    except BaseException:
        for c in contexts:
            close_context(c)
        raise
    target, draft, torch_target = ctx.target, ctx.draft, ctx.torch_target
    try:
        engines = {v.label: v.method.build(own[v.label], v.k) for v in cfg.variants}
        any_engine = engines[cfg.variants[0].label]
        rendered = {p.id: any_engine.chat_prompt(p.messages(), p.tools) for p in prompts}

        if cfg.warmup:  # first calls pay for page faults and allocations; keep them out of the numbers
            for v in cfg.variants:
                engines[v.label].generate(rendered[prompts[0].id], max_tokens=min(32, cfg.n_predict),
                                          params=SamplingParams(0.0), is_chat=True)
        max_k = max([v.k for v in cfg.variants] + [1])
        ctx_tokens = any_engine.tokenize_prompt(rendered[prompts[0].id], is_chat=True)
        costs = measure_costs(target, draft, ctx_tokens, max_k + 1, cfg.cost_repeats)
        costs_torch = None
        if torch_target is not None:  # torch-target methods: V(n) and c relative to the torch target's pass
            tv = [v for v in cfg.variants if v.method.backend == "torch"]
            t_tokens = engines[tv[0].label].tokenize_prompt(rendered[prompts[0].id], is_chat=True)
            costs_torch = measure_costs(torch_target, draft if any(v.method.needs_draft for v in tv) else None,
                                        t_tokens, max([v.k for v in tv] + [1]) + 1, cfg.cost_repeats)

        rows: list[dict] = []
        tokens: dict = {}
        traces: list[dict] = []
        total = len(prompts) * cfg.repeats * len(cfg.temps) * len(cfg.variants)
        bar = _progress(total, progress)
        interrupted: Optional[BaseException] = None
        whole = (0, 0)  # rows and traces of the prompts finished
        try:
            for pi, p in enumerate(prompts):
                whole = (len(rows), len(traces))
                for rep in range(cfg.repeats):
                    for temp in cfg.temps:
                        shift = (pi + rep) % len(cfg.variants)  # rotate who goes first: A B, B A, ...
                        order = cfg.variants[shift:] + cfg.variants[:shift]
                        seed = cfg.seed + 1000 * pi + rep
                        base_params = params_by_temp[temp]
                        params = SamplingParams(temp, base_params.top_k, base_params.top_p, base_params.min_p, seed)
                        for v in order:
                            engines[v.label].trace = [] if cfg.trace else None
                        # share: below costprofile.QUIET_SHARE another program took the CPU from these runs
                        runs, share = with_share(target, _generate_all, engines, order, rendered[p.id],
                                                 cfg.n_predict, params, cfg.interleave, p.prediction, p.grammar,
                                                 p.call_grammar)
                        for v, res in zip(order, runs):
                            s = res.stats
                            row = {"prompt_id": p.id, "category": p.category, "method": v.method.name,
                                   "variant": v.label, "k": v.k, "temp": temp, "repeat": rep, "seed": seed,
                                   "cost": v.method.cost, "backend": v.method.backend,
                                   "baseline": v.method.baseline}
                            row.update(s.to_dict())
                            row["tokens_per_s"] = s.tokens_per_s  # unrounded
                            row["drafted_by_position"] = list(s.drafted_by_position)
                            row["accepted_by_position"] = list(s.accepted_by_position)
                            row["finish_reason"] = res.finish_reason
                            row["tokens_sha1"] = _token_hash(res.tokens)
                            row["text"] = res.text
                            row["cpu_share"] = round(share, 3)
                            rows.append(row)
                            tokens[(p.id, temp, rep, v.label)] = res.tokens
                            if cfg.trace:
                                traces.append({"category": p.category, "prompt_id": p.id, "variant": v.label,
                                               "method": v.method.name, "k": v.k, "temp": temp,
                                               "prompt_tokens": s.prompt_tokens,
                                               "generated_tokens": s.generated_tokens,
                                               "steps": engines[v.label].trace})
                                plain_prompt = not (p.prediction or p.grammar or p.call_grammar)
                                if temp == 0 and plain_prompt and v.method.name == "draft":
                                    eng = engines[v.label]
                                    traces[-1]["agree"] = draft_agreement(
                                        eng.drafter, eng.tokenize_prompt(rendered[p.id], is_chat=True),
                                        res.tokens)
                            bar.update(1)
                        bar.set_postfix_str(f"{p.category}/{p.id} T={temp:g}", refresh=False)
        except (KeyboardInterrupt, SystemExit) as stop:  # SystemExit: SIGTERM (signals.exit_on_sigterm)
            # the prompt under way is dropped, all its repeats and temperatures: its runs are compared together
            del rows[whole[0]:], traces[whole[1]:]
            if not (keep_partial and rows):
                raise
            interrupted = stop
        finally:
            bar.close()
        bstats.mark_greedy_equal(rows, tokens)
        threads_used = getattr(target, "n_threads", cfg.threads)
        result = {
            "machine": machine_info(threads_used),
            "versions": versions(),
            "settings": cfg.settings(),
            "models": {"target": str(getattr(target, "path", cfg.model)),
                       "draft": str(getattr(draft, "path", cfg.draft_model)) if draft else None},
            "n_prompts": len(prompts),
            "costs": costs,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t_start)),
            "rows": rows,
            "summary": bstats.summarize(rows, costs, {"torch": costs_torch} if costs_torch else None),
        }
        shares = sorted(r["cpu_share"] for r in rows)
        if shares:  # how much of its threads' time the runs got: the machine was quiet, or not
            result["cpu_share"] = {"median": shares[len(shares) // 2], "min": shares[0]}
        if torch_target is not None:
            dtype = str(getattr(torch_target, "dtype", "")).replace("torch.", "")
            result["models"]["torch_target"] = (f"{getattr(torch_target, 'source', cfg.model)} "
                                                f"({dtype}, {getattr(torch_target, 'device', '')})")
            result["costs_torch"] = costs_torch
        if ctx.notes:
            result["notes"] = dict(ctx.notes)
        if cfg.trace:
            result["trace"] = traces
        if interrupted is not None:
            result["interrupted"] = interrupted
    finally:
        for c in contexts:
            close_context(c)
    if cfg.memory and "interrupted" not in result:  # after the timed runs, so that the children do not disturb them
        from .memory import probe_all

        result["memory"] = probe_all(cfg, progress=progress)
        for s in result["summary"]:
            s["peak_rss_mb"] = result["memory"].get(s["method"], {}).get("peak_rss_mb")
    result["wall_s"] = round(time.time() - t_start, 2)
    return result


def _generate_all(engines: dict, order: list[Variant], prompt: str, n_predict: int, params: SamplingParams,
                  interleave: str, prediction: Optional[str] = None, grammar: Optional[str] = None,
                  call_grammar: Optional[str] = None) -> list:
    """One prompt under every variant in `order`; returns their Results in that order. "prompt": one
    generation after another. "step": round robin, one decoding step of each in turn; a variant's decode
    time is then the time spent inside its own steps (its stream's own clock would also count the others').
    prediction: the prompt's predicted output, given to the methods that use one; grammar: the GBNF every
    method decodes under (a constraint of its own each); call_grammar: tool_choice auto's, held to from
    <tool_call> to </tool_call> (constraint.TriggeredGrammar)."""
    from ..engine import Result
    from ..stats import SpecStats

    def pred(v: Variant) -> dict:
        out = {"prediction": prediction} if prediction is not None and v.method.uses_prediction else {}
        target = engines[v.label].target
        if grammar is not None:
            out["constraint"] = target.grammar(grammar)
        elif call_grammar is not None:
            from ..constraint import TriggeredGrammar
            from ..tools import CLOSE, OPEN

            out["constraint"] = TriggeredGrammar(target.token_text, OPEN.encode(), target.grammar(call_grammar),
                                                 CLOSE.encode())
        return out

    if interleave == "prompt":
        return [engines[v.label].generate(prompt, max_tokens=n_predict, params=params, is_chat=True, **pred(v))
                for v in order]
    results = [Result("", [], SpecStats()) for _ in order]
    streams = [engines[v.label].stream(prompt, max_tokens=n_predict, params=params, is_chat=True, result=res,
                                       **pred(v))
               for v, res in zip(order, results)]
    inside = [0.0] * len(order)  # seconds spent inside each stream: prefill + its steps
    live = list(range(len(order)))
    while live:
        for i in list(live):
            t = time.perf_counter()
            try:
                next(streams[i])  # one step: it yields its first new token (the others come free)
            except StopIteration:
                live.remove(i)
            inside[i] += time.perf_counter() - t
    for res, spent in zip(results, inside):
        res.stats.decode_time = max(spent - res.stats.prefill_time, 1e-9)
    return results


def check_torch(methods: list[Method]) -> None:
    """A clear error, before anything loads, when a torch-target method is selected without torch."""
    names = [m.name for m in methods if m.backend == "torch"]
    if not names:
        return
    try:
        importlib.import_module("transformers")
        importlib.import_module("speculant.backends.torch")
    except (ImportError, SpeculantError) as e:
        raise SettingsError(f"method{'s' if len(names) > 1 else ''} {', '.join(names)} run the target on the "
                            f"torch backend, which needs torch and transformers ({e}); install them with: "
                            "pip install -e '.[torch]'") from None


def load_context(cfg: BenchConfig, methods: list[Method]) -> MethodContext:
    """Load what `methods` need, once each: the target on llama.cpp, the target on torch, the draft model
    (on llama.cpp), noting whether the draft shares each target's vocabulary."""
    from ..api import load_backend
    from ..drafters.crossvocab import same_vocabulary

    ctx = MethodContext(None, None, draft_p_min=cfg.draft_p_min, options=dict(cfg.extra))
    try:
        if any(m.backend == "llama.cpp" for m in methods):
            ctx.target = load_backend(cfg.model, n_ctx=cfg.n_ctx, threads=cfg.threads, **cfg.target_rpc)
        if any(m.backend == "torch" for m in methods):
            ctx.torch_target = load_backend(cfg.model, n_ctx=cfg.n_ctx, threads=cfg.threads, backend="torch",
                                            dtype=cfg.dtype, device=cfg.device)
        need = {m.backend for m in methods if m.needs_draft}
        drafted_for = [t for b, t in (("llama.cpp", ctx.target), ("torch", ctx.torch_target)) if b in need]
        if drafted_for:
            ctx.draft = load_backend(cfg.draft_model, n_ctx=min(t.n_ctx for t in drafted_for), threads=cfg.threads,
                                     role="draft")
            for t in drafted_for:  # say now when the draft drafts through text
                ctx.same_vocab[id(t)] = same_vocabulary(t, ctx.draft)
        if any(m.cut for m in methods):
            from .. import models
            from ..vocabcut import load_cut_draft

            ctx.cut_draft, ctx.cut_keep = load_cut_draft(models.resolve(cfg.draft_model),
                                                         int(cfg.extra.get("draft_vocab", 32768)),
                                                         n_ctx=ctx.target.n_ctx, threads=cfg.threads)
    except BaseException:
        close_context(ctx)
        raise
    return ctx


def close_context(ctx: MethodContext) -> None:
    for b in (ctx.cut_draft, ctx.draft, ctx.torch_target, ctx.target):
        if b is not None:
            b.close()


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="run", disable=not enabled, dynamic_ncols=True, file=sys.stderr)
