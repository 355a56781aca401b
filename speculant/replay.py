"""Step traces of real runs, and their replay on random weights of bigger architectures.

`speculant bench --trace FILE` writes every decoding step of every run; `speculant replay FILE --shape
qwen2.5-32b --draft-shape qwen2.5-0.5b --device cuda` re-runs exactly those passes (same pass sizes, same
positions, same number of draft steps) with random weights of the named architectures, so a machine without
our model weights (a rented GPU) can measure what speculation would gain there. What is replayed is the
recorded pair's acceptance (which drafts were accepted), so a replay on other shapes predicts the speed of
those shapes at that acceptance, not the acceptance a bigger target would have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .errors import SettingsError

TRACE_FORMAT = "speculant-trace/1"
STEP_FIELDS = ["source", "k", "accepted", "target_pass", "draft_steps", "draft_catchup"]


def write_trace(result: dict, path: str | Path) -> Path:
    """A bench result (run with trace=True) -> a small JSON file of its runs' steps."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": TRACE_FORMAT, "models": result.get("models"), "machine": result.get("machine", {}).get("cpu"),
           "settings": {k: result["settings"].get(k) for k in ("n_predict", "temps", "top_k", "top_p", "min_p",
                                                               "seed", "suite")},
           "step_fields": STEP_FIELDS, "runs": result.get("trace", []),
           **({"partial": True} if result.get("partial") else {})}  # an interrupted bench: its finished prompts
    text = json.dumps(doc, separators=(",", ":")) + "\n"
    if path.exists() and not path.is_file():  # /dev/stdout and the like: written as they are
        path.write_text(text)
        return path
    from .costprofile import write_atomic

    write_atomic(path, text)  # whole or not at all (a full disk)
    return path


def read_trace(path: str | Path) -> dict:
    """A trace file -> its dict; a clear SettingsError for anything else."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"trace file {path} does not exist (write one with `speculant bench --trace FILE`)") from None
    except (OSError, ValueError) as e:
        raise SettingsError(f"trace file {path} is not readable JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT or not isinstance(doc.get("runs"), list):
        raise SettingsError(f"{path} is not a speculant trace (expected format {TRACE_FORMAT!r})")
    problem = trace_problem(doc)
    if problem:
        raise SettingsError(f"{path} is not a valid speculant trace: {problem}")
    return doc


RUN_FIELDS = {"category": (str, "a string"), "prompt_id": ((str, int), "an id"), "variant": (str, "a string"),
              "method": (str, "a string"), "temp": ((int, float), "a number"),
              "prompt_tokens": (int, "an integer"), "generated_tokens": (int, "an integer"), "steps": (list, "a list")}


def trace_problem(doc: dict) -> Optional[str]:
    """What in a trace's settings or runs the replay cannot use, or None."""
    if not isinstance(doc.get("settings", {}), dict):
        return "its settings are not an object"
    for i, run in enumerate(doc["runs"], 1):
        problem = _run_problem(run)
        if problem:
            return f"run {i} {problem}"
    return None


def _run_problem(run) -> Optional[str]:
    if not isinstance(run, dict):
        return f"is {type(run).__name__}, not an object"
    for key, (kind, what) in RUN_FIELDS.items():
        if key not in run:
            return f"has no {key}"
        if not isinstance(run[key], kind) or isinstance(run[key], bool):
            return f"has a {key} that is not {what}"
    if run["prompt_tokens"] < 1 or run["generated_tokens"] < 0:
        return "has prompt_tokens < 1 or generated_tokens < 0"
    for j, step in enumerate(run["steps"], 1):
        if not (isinstance(step, list) and len(step) == len(STEP_FIELDS) and isinstance(step[0], str)
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in step[1:])):
            return f"step {j} is not [{', '.join(STEP_FIELDS)}] (a string and 5 counts)"
        _, k, accepted, target_pass, _, _ = step
        if not accepted <= k < target_pass:
            return f"step {j} accepts more than it drafted, or its target pass is shorter than its draft"
    made = sum(s[2] + 1 for s in run["steps"])
    if run["steps"] and made < run["generated_tokens"]:
        return f"has steps that make {made} tokens, fewer than its generated_tokens ({run['generated_tokens']})"
    agree = run.get("agree")
    if agree is not None and (not isinstance(agree, list) or len(agree) != run["generated_tokens"]
                              or any(a not in (0, 1) for a in agree)):
        return "has an agree that is not one 0 or 1 per generated token"
    return None


# ---------------------------------------------------------------------------------------------------------
# replay


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokens(n: int, n_vocab: int, salt: int) -> list[int]:
    """n token ids (their values do not change a pass's cost)."""
    return [(salt * 7919 + 104729 * i) % n_vocab for i in range(n)]


def _pass(backend, n: int, start: int) -> int:
    """One pass over n tokens at positions start.. and a device argmax: what a step pays for a model pass
    (the argmax's transfer is the step's only sync, as in verify_step). Returns the last argmax."""
    logits = backend.decode_device(_tokens(n, backend.n_vocab, start), start, n)  # [n, V]
    return int(logits.argmax(-1)[-1].item())


def draft_agreement(drafter, prompt: Sequence[int], output: Sequence[int]) -> Optional[list[int]]:
    """Per output token, 1 where the draft model's greedy choice after the prompt and the output before it is
    that token, else 0 (None for a drafter that is not one draft model). Greedy drafting proposes exactly these
    choices as long as the tokens before are right, so a draft of k from output position i is accepted as far
    as the run of 1s from i: a replay can draft any fixed k from it (steps_at_k). One draft pass over the
    output (its logits are those of one-token passes: our kernels' bit-identity)."""
    from .drafters.model import ModelDrafter

    if type(drafter) is not ModelDrafter or not output:
        return None
    context = list(prompt) + list(output)
    logits = drafter.backend.sync(drafter._ids(context[:-1]), n_logits=len(output))  # [len(output), V]
    return [int(int(np.argmax(drafter._fit(row))) == t) for row, t in zip(logits, output)]


def steps_at_k(agree: Sequence[int], k: int) -> list[list]:
    """The steps (STEP_FIELDS) of greedy drafting with a fixed k over a run whose agreement is `agree`: each
    drafts min(k, tokens left - 1) in as many draft passes, and keeps its run of agreeing tokens and the
    target's own."""
    steps, pos, n = [], 0, len(agree)
    while pos < n:
        k_now = min(k, n - pos - 1)
        accepted = 0
        while accepted < k_now and agree[pos + accepted]:
            accepted += 1
        steps.append(["draft", k_now, accepted, k_now + 1, k_now, 0] if k_now > 0 else ["none", 0, 0, 1, 0, 0])
        pos += accepted + 1
    return steps


def ended_by_eog(run: dict) -> bool:
    """Whether a run stopped at the end of generation (its steps made more tokens than it kept: the end
    token, and drafts after it) rather than at its -n limit."""
    return sum(s[2] + 1 for s in run["steps"]) > run["generated_tokens"]


def at_k(run: dict, k: int) -> dict:
    """A traced run with a recorded agreement, drafted with a fixed k instead (its variant says so). A run
    that ended by the end token makes it too, as the target's own (the agreement does not say whether the
    draft would have proposed it)."""
    return {**run, "variant": f"fixed k={k}", "k": k, "generated_tokens": len(run["agree"]),
            "steps": steps_at_k(list(run["agree"]) + [0] * ended_by_eog(run), k)}


def draft_passes(steps: list, i: int) -> list[int]:
    """The draft model's pass sizes at step i: the first pass catches up (the recorded catch-up, else 2 after a
    fully accepted draft and 1 otherwise: the draft's cache lacks its own last token and the target's), then
    one token per further draft step."""
    source, k, accepted, _, n_steps, catchup = steps[i]
    if n_steps <= 0:  # steps count paid draft-model passes, whichever drafter's proposal was verified
        return []
    prev = steps[i - 1] if i > 0 else None
    first = catchup or (2 if prev and prev[1] > 0 and prev[2] == prev[1] else 1)
    return [first] + [1] * (n_steps - 1)


def replay_run(run: dict, target, draft) -> dict:
    """Re-run one traced run's passes (untimed prompt prefill, then every step timed) -> counts and seconds."""
    import time

    device = target.device
    n_prompt = int(run["prompt_tokens"])
    steps = run["steps"]
    for b in (target, draft) if draft is not None else (target,):
        b.decode_device(_tokens(n_prompt - 1, b.n_vocab, 1), 0, 0)  # the prompt, but its last token
    _sync(device)
    pos = n_prompt - 1  # the target's cache holds the context but its last token
    n_target = n_draft = 0
    t0 = time.perf_counter()
    for i, (source, k, accepted, target_pass, n_steps, catchup) in enumerate(steps):
        passes = draft_passes(steps, i) if draft is not None else []
        dpos = pos + 1 - passes[0] if passes else 0  # the first draft pass ends with the context's last token
        for n in passes:
            _pass(draft, n, dpos)
            dpos += n
            n_draft += 1
        _pass(target, target_pass, pos + k + 1 - target_pass)
        n_target += 1
        pos += accepted + 1
    _sync(device)
    return {"seconds": time.perf_counter() - t0, "target_passes": n_target, "draft_passes": n_draft,
            "tokens": int(run["generated_tokens"])}


def replay_plain(run: dict, target) -> dict:
    """Plain decoding of the same prompt and output: one 1-token pass per token, and one more for the end
    token where the run ended by it (the pass that produced it)."""
    n_passes = run["generated_tokens"] + ended_by_eog(run)
    return replay_run({"prompt_tokens": run["prompt_tokens"], "generated_tokens": run["generated_tokens"],
                       "steps": [["none", 0, 0, 1, 0, 0]] * n_passes}, target, None)


class _Rows:
    """Run a StaticTorchBackend at another pass width for a while (plain decoding needs no invariance)."""

    def __init__(self, backend, rows):
        self.backend, self.rows = backend, rows

    def __enter__(self):
        self.saved, self.backend.rows = self.backend.rows, self.rows

    def __exit__(self, *exc):
        self.backend.rows = self.saved


def select_runs(doc: dict, categories=None, variants=None, ks: Sequence[int] = ()) -> tuple[list, dict]:
    """The speculative runs to replay, and per (category, prompt, temperature) the first with a draft
    agreement; a clear SettingsError when there is nothing to replay."""
    spec = [r for r in doc["runs"] if r.get("method") != "plain" and r.get("steps")]
    runs = [r for r in spec if (not categories or r["category"] in categories)
            and (not variants or r["variant"] in variants)]
    if not runs:
        has = (f"it has categories {', '.join(sorted({r['category'] for r in spec}))} and variants "
               f"{', '.join(sorted({r['variant'] for r in spec}))}" if spec else "it has only plain runs")
        raise SettingsError(f"the trace has no speculative runs to replay (after --categories / --variants): {has}")
    agreed = {}
    for r in runs:
        if r.get("agree"):
            agreed.setdefault((r["category"], r["prompt_id"], r["temp"]), r)
    if ks and not agreed:
        raise SettingsError("the trace records no draft agreement to replay a fixed k from (record it again "
                            "with `speculant bench --trace`, greedy, the draft method)")
    return runs, agreed


def replay(doc: dict, target, draft, *, categories=None, variants=None, ks: Sequence[int] = (),
           warmup: bool = True, log=None) -> dict:
    """Replay every non-plain run of a trace on (target, draft) and plain decoding of the same outputs.
    ks: also draft each prompt with these fixed k, from the agreement its greedy draft run recorded (at_k).
    Returns {"rows": [per variant x category x temperature], "runs": n}. Plain runs at 1 row per pass (no
    invariance needed), the speculative target at its fixed width."""
    runs, agreed = select_runs(doc, categories, variants, ks)
    jobs = [(r, r) for r in runs] + [(r, at_k(r, k)) for k in ks for r in agreed.values()]
    if warmup:  # graph capture and allocator growth stay out of the timings: every run once, for the (rows,
        # KV blocks) classes of its passes (a later, longer run would capture while timed); of the fixed-k
        # jobs the longest k (the same positions, the widest draft catch-up)
        for r, job in jobs:
            if job is r or job["k"] == max(ks):
                replay_run(job, target, draft)
        for r in runs:
            with _Rows(target, None):
                replay_plain(r, target)
    groups: dict = {}
    plain_s: dict = {}  # id(run) -> seconds of its plain decoding (timed once, beside its first job)
    for r, job in jobs:
        spec = replay_run(job, target, draft)
        if id(r) not in plain_s:
            with _Rows(target, None):
                plain_s[id(r)] = replay_plain(r, target)["seconds"]
        plain = plain_s[id(r)]  # a fixed-k job makes the same output (its agreement: one entry per token)
        g = groups.setdefault((job["variant"], job["category"], job["temp"]),
                              {"spec_s": 0.0, "plain_s": 0.0, "tokens": 0, "target_passes": 0, "draft_passes": 0,
                               "runs": 0, "drafted": 0, "accepted": 0})
        g["spec_s"] += spec["seconds"]
        g["plain_s"] += plain
        g["tokens"] += spec["tokens"]
        g["target_passes"] += spec["target_passes"]
        g["draft_passes"] += spec["draft_passes"]
        g["drafted"] += sum(s[1] for s in job["steps"])
        g["accepted"] += sum(s[2] for s in job["steps"])
        g["runs"] += 1
        if log:
            log(f"  {job['variant']} {r['category']}/{r['prompt_id']} T={r['temp']:g}: "
                f"{spec['tokens'] / spec['seconds']:.1f} tok/s vs plain {job['generated_tokens'] / plain:.1f}")
    rows = []
    for (variant, category, temp), g in groups.items():
        rows.append({"variant": variant, "category": category, "temp": temp, "runs": g["runs"],
                     "tokens": g["tokens"],
                     "tau": round(g["tokens"] / g["target_passes"], 3) if g["target_passes"] else None,
                     "acceptance": round(g["accepted"] / g["drafted"], 3) if g["drafted"] else None,
                     "tokens_per_s": round(g["tokens"] / g["spec_s"], 2),
                     "plain_tokens_per_s": round(g["tokens"] / g["plain_s"], 2),
                     "speedup": round(g["plain_s"] / g["spec_s"], 3)})
    return {"rows": rows, "runs": len(runs)}


def hf_generate_speed(target_model, draft_model, prompt_len: int, n_new: int, device, repeats: int = 1) -> dict:
    """transformers' own generate (sdpa, DynamicCache) and assisted generation (assistant_model) on the same
    random weights, greedy, n_new tokens forced (no EOS). Random weights make the assistant's acceptance
    meaningless (near 0), so assisted generation shows its cost, not a speedup a real draft would give."""
    import time

    import torch

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its deprecation chatter is not a result
    out = {}
    ids = torch.tensor([_tokens(prompt_len, target_model.config.vocab_size, 3)], device=device)
    saved = {m: m.config._attn_implementation for m in (target_model, draft_model) if m is not None}
    # transformers' assistant defaults (20 tokens, stop below confidence 0.4) would stop random weights after
    # one token: draft k = 4 every round, as the replayed traces do
    gen = getattr(draft_model, "generation_config", None)
    saved_gen = {a: getattr(gen, a, None) for a in ("num_assistant_tokens", "assistant_confidence_threshold",
                                                    "num_assistant_tokens_schedule")} if gen is not None else {}
    try:
        if gen is not None:
            gen.num_assistant_tokens, gen.assistant_confidence_threshold = 4, 0.0
            gen.num_assistant_tokens_schedule = "constant"
        for m in saved:
            m.config._attn_implementation = "sdpa"
        kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, eos_token_id=None,
                  pad_token_id=0)
        for name, extra in (("hf_generate", {}), ("hf_assisted", {"assistant_model": draft_model})):
            if name == "hf_assisted" and draft_model is None:
                continue
            try:
                with torch.no_grad():
                    target_model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4}, **extra)
                    _sync(device)
                    t = time.perf_counter()
                    for _ in range(repeats):
                        target_model.generate(ids, **kw, **extra)
                    _sync(device)
                out[name] = round(n_new * repeats / (time.perf_counter() - t), 2)
            except Exception as e:  # a peer's failure is a result to report, not a crash
                out[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        for m, impl in saved.items():
            m.config._attn_implementation = impl
        for a, v in saved_gen.items():
            setattr(gen, a, v)
    return out


# ---------------------------------------------------------------------------------------------------------
# CLI


def add_cli(sub, *_ignored) -> None:
    from .api import thread_count
    from .shapes import SHAPES

    p = sub.add_parser("replay", help="replay a bench trace's passes on random weights of bigger models (GPU "
                                      "what-if)",
                       description="Re-run exactly the passes of a recorded trace (`speculant bench --trace FILE`) "
                                   "with random weights of the named architectures, on the static-KV backend "
                                   "(CUDA graphs on CUDA), and print per category the predicted tokens/s and "
                                   "speedup over plain decoding of the same outputs, beside transformers' generate "
                                   "and assisted generation on the same weights. Shapes: " + ", ".join(SHAPES))
    p.add_argument("trace", help="trace JSON written by `speculant bench --trace FILE`")
    p.add_argument("--shape", default="qwen2.5-32b", help="target architecture (default %(default)s)")
    p.add_argument("--draft-shape", default="qwen2.5-0.5b", help="draft architecture (default %(default)s)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default cuda if present)")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 | fp16 (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--rows", type=int, default=16,
                   help="the target's fixed pass width (bit-identical batched logits; default %(default)s)")
    p.add_argument("--no-graphs", action="store_true", help="eager passes on CUDA (no CUDA graphs)")
    p.add_argument("--categories", default=None, help="comma list of categories to replay (default all)")
    p.add_argument("--variants", default=None, help="comma list of traced variants, e.g. draft-k4 (default all)")
    p.add_argument("--k", default=None, metavar="K,K...",
                   help="also draft every prompt with these fixed draft lengths, from the draft agreement its "
                        "greedy run recorded (e.g. 2,4,6,8)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate / assisted generation")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="CPU threads (default: all cores)")
    p.set_defaults(handler=cmd_replay)


def available_ram() -> Optional[int]:
    """Bytes of memory a new allocation can take (MemAvailable in /proc/meminfo; None where it is not)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def build_pair(shape: str, draft_shape: Optional[str], device: str, dtype=None, rows: Optional[int] = 16,
               graphs: Optional[bool] = None, n_ctx: int = 1024):
    """Random-weight target (fixed width `rows`) and draft (shape classes) StaticTorchBackends, with a clear
    error when they cannot fit in the device's memory."""
    import torch

    from .backends.torch import _parse_dtype, check_device
    from .shapes import SHAPES, n_params, random_backend

    check_device(device)
    for s in (shape, draft_shape):
        if s is not None and s not in SHAPES:
            raise SettingsError(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    dtype = _parse_dtype(dtype) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    need = sum(n_params(s) for s in (shape, draft_shape) if s) * torch.finfo(dtype).bits // 8
    if device.startswith("cuda"):
        free, where = torch.cuda.mem_get_info(torch.device(device))[0], f"{device} has"
    else:
        free, where = available_ram(), "this machine has"
    if free is not None and need > 0.95 * free:
        raise SettingsError(f"{' + '.join(s for s in (shape, draft_shape) if s)} need {need / 2**30:.1f} GiB of "
                            f"weights ({str(dtype).replace('torch.', '')}); {where} {free / 2**30:.1f} GiB available")
    target = random_backend(shape, rows=rows, graphs=graphs, device=device, dtype=dtype, n_ctx=n_ctx, seed=0)
    vocab = SHAPES[shape][5]  # the draft's output layer padded to the target's vocabulary (Qwen2.5 0.5B/1.5B
    # have 151936 rows, 7B+ 152064): transformers' assisted generation needs equal sizes; the cost is ~0.1%
    draft = random_backend(draft_shape, graphs=graphs, device=device, dtype=dtype, n_ctx=n_ctx, seed=1,
                           vocab=vocab) if draft_shape else None
    return target, draft


def format_rows(rows: list[dict], hf: dict, shape: str, draft_shape: str) -> str:
    """A markdown table, with a temperature column where the rows have more than one."""
    temps = len({r["temp"] for r in rows}) > 1
    lines = [f"| variant | category |{' T |' if temps else ''} runs | tokens | τ | acceptance | tok/s | "
             f"plain tok/s | speedup |", "|---|---|" + "---:|" * (8 if temps else 7)]
    for r in rows:
        temp = f" {r['temp']:g} |" if temps else ""
        lines.append(f"| {r['variant']} | {r['category']} |{temp} {r['runs']} | {r['tokens']} | {r['tau']} | "
                     f"{r['acceptance']} | {r['tokens_per_s']} | {r['plain_tokens_per_s']} | {r['speedup']}x |")
    head = f"replayed on random weights: target {shape}, draft {draft_shape}"
    tail = [f"transformers on the same weights: {k} {v}" + (" tok/s" if isinstance(v, (int, float)) else "")
            for k, v in hf.items()]
    return "\n".join([head] + lines + tail) + "\n"


def hf_lengths(doc: dict) -> tuple[int, int]:
    """The prompt length (the runs' mean) and output length (the trace's -n, else 64) transformers' generate
    is timed at."""
    runs = doc["runs"]
    n_prompt = int(sum(r["prompt_tokens"] for r in runs) / len(runs)) if runs else 1
    return n_prompt, int((doc.get("settings") or {}).get("n_predict") or 64)


def cmd_replay(args) -> int:
    import sys

    import torch

    from .api import check_threads
    from .backends.torch import resolve_device
    from .bench import writable_file

    doc = read_trace(args.trace)
    check_threads(args.threads, "--threads")
    device = resolve_device(args.device)
    cats = [c for c in args.categories.split(",") if c] if args.categories else None
    variants = [v for v in args.variants.split(",") if v] if args.variants else None
    try:
        ks = [int(k) for k in args.k.split(",") if k] if args.k else []
    except ValueError:
        raise SettingsError(f"--k takes a comma list of draft lengths, e.g. 2,4,6; got {args.k!r}") from None
    if any(not 1 <= k <= 32 for k in ks):
        raise SettingsError(f"--k: draft lengths must be in [1, 32], got {args.k!r}")
    select_runs(doc, cats, variants, ks)  # before the models are built
    if args.json:
        writable_file(args.json, "--json")
    if args.threads:
        torch.set_num_threads(args.threads)
    longest = max((int(r["prompt_tokens"]) + int(r["generated_tokens"]) for r in doc["runs"]), default=0)
    target, draft = build_pair(args.shape, args.draft_shape, device, args.dtype, args.rows,
                               False if args.no_graphs else None, n_ctx=longest + 128)
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    result = replay(doc, target, draft, categories=cats, variants=variants, ks=ks, log=log)
    hf = {}
    if not args.no_hf:
        hf = hf_generate_speed(target.model, draft.model if draft else None, *hf_lengths(doc), target.device)
    result.update({"shape": args.shape, "draft_shape": args.draft_shape, "device": str(target.device),
                   "dtype": str(target.dtype).replace("torch.", ""), "target_rows": args.rows,
                   "graphs": target.graphs, "hf": hf, "trace": str(args.trace)})
    sys.stdout.write(format_rows(result["rows"], hf, args.shape, args.draft_shape))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0
