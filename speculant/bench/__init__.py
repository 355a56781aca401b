"""`speculant bench`: every method on every prompt in one sitting, interleaved; speedups as ratios.

    speculant bench                                   # built-in suite, default Qwen pair, plain vs adaptive+lookup
    speculant bench -m smollm2-135m-instruct -md smollm2-135m-instruct --methods plain,draft \
        --draft-max 4,8 --temp 0,0.8 --suite question.jsonl --categories qa,rag --limit 5 --out bench-out
    speculant bench --methods draft,plain-torch,self-spec,mixed    # llama.cpp vs torch runtimes, peak memory

Writes OUT/results.json (raw rows, summary, machine, versions, settings, measured costs), OUT/summary.md
(also printed) and OUT/*.png. Methods live in speculant.bench.methods (one entry each). Methods on the torch
backend (plain-torch, self-spec, mixed) share a second copy of the target loaded with transformers; --memory
measures each method's peak RSS in a child process (speculant.bench.memory).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .. import models
from ..errors import SettingsError
from .methods import METHODS, Method, MethodContext, Variant, expand, parse_list, register
from .suite import BUILTIN_SUITE, Prompt, read_suite, select

__all__ = ["add_cli", "cmd_bench", "METHODS", "Method", "MethodContext", "Variant", "register", "read_suite",
           "select", "Prompt", "BUILTIN_SUITE"]


def add_cli(sub, add_model_args=None, add_sampling_args=None) -> None:
    from ..api import thread_count

    n_builtin = len(read_suite(None))
    p = sub.add_parser("bench", help="benchmark methods against plain decoding (speedup, acceptance, τ)",
                       description="Run every prompt under every method, interleaved, and report speedups over "
                                   f"plain decoding as ratios. The default is long: the built-in suite's "
                                   f"{n_builtin} prompts x 128 tokens x plain and adaptive+lookup (what `generate -md` runs) on the Qwen pair "
                                   "(tens of minutes on a CPU); `--limit 1` runs one prompt per category. Methods: " +
                                   "; ".join(f"{m.name}: {m.help}" for m in METHODS.values()))
    p.add_argument("-m", "--model", default=models.DEFAULT_TARGET,
                   help="target model: registered name or GGUF path (default %(default)s)")
    p.add_argument("-md", "--model-draft", "--draft-model", dest="model_draft", default=None,
                   help=f"draft model (default {models.DEFAULT_DRAFT} when -m is the default target)")
    p.add_argument("--methods", default="plain,adaptive+lookup",
                   help=f"comma list of methods (plain is always run, plain-torch too with a torch-target method; "
                        f"known: {', '.join(METHODS)})")
    p.add_argument("--draft-max", "--draft", default="4", help="comma list of draft lengths k (default 4)")
    p.add_argument("--draft-p-min", type=float, default=0.0, help="draft confidence cut-off (default 0: off)")
    p.add_argument("--draft-vocab", type=int, default=32768,
                   help="token ids the *-cut methods' draft keeps in its output layer (default %(default)s)")
    p.add_argument("--temp", default="0", help="comma list of temperatures (default 0 = greedy)")
    p.add_argument("--top-k", type=int, default=0, help="top-k when sampling (default 0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p when sampling (default 1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p when sampling (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="base seed for sampling (per prompt and repeat)")
    p.add_argument("--suite", default=None,
                   help="JSONL suite (Spec-Bench question.jsonl format) or a built-in suite's name: default, "
                        "code_edit_predicted, repeated, structured (JSON answers under their schemas), tools (agent "
                        "requests with OpenAI tools); a comma list runs several (default: default)")
    p.add_argument("--categories", default=None, help="comma list of categories to run (default all)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per category")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate per prompt (default 128)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each prompt x method (default 1)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context window (default 4096)")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="put part of the llama.cpp target's layers on these `speculant worker`s (the draft stays here)")
    p.add_argument("-ts", "--tensor-split", default=None, metavar="W1[,W2...]",
                   help="with --rpc: layer share per worker, and optionally one for this machine (default: equal)")
    p.add_argument("--out", default="bench-out", help="output directory (default %(default)s)")
    p.add_argument("--peers", default=None,
                   help="also run peers on the same GGUF files: comma list of llama.cpp, hf (see speculant.bench.peers)")
    p.add_argument("--llama-tools", default=None, help="directory of llama.cpp tools (default: the build cache)")
    p.add_argument("--cost-repeats", type=int, default=5,
                   help="timed repeats (median) of each cost measurement at the start (default 5)")
    p.add_argument("--dtype", default=None, help="torch-target methods: bf16 | fp32 | fp16 (default bf16 where native)")
    p.add_argument("--device", default=None, help="torch-target methods: cpu | cuda | cuda:N (default cuda if present)")
    p.add_argument("--self-spec-exit", type=int, default=None,
                   help="self-spec: exit after this many layers (default: the saved `speculant calibrate` "
                        "layers, else half the layers)")
    p.add_argument("--self-spec-config", metavar="FILE", default=None,
                   help="self-spec: the layers saved by `speculant calibrate -o FILE`")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="measure each method's peak RSS, its models loaded alone in a child process (default: on "
                        "when a torch-target method is selected)")
    p.add_argument("--interleave", choices=("auto", "step", "prompt"), default="auto",
                   help="step: all methods decode each prompt together, one step each in turn, each with its own "
                        "copy of the models (drift hits all alike); prompt: one method after another on shared "
                        "models; auto (default): step unless a method runs the target on torch")
    p.add_argument("--costs", action="store_true",
                   help="only measure what a target pass over n = 1..16 tokens and a 512-token prefill cost, ours "
                        "against llama.cpp's default build (llama-bench), side by side with the ratio")
    p.add_argument("--costs-depth", type=int, default=100, help="--costs: context tokens before the pass (default 100)")
    p.add_argument("--costs-rounds", type=int, default=5, help="--costs: alternating rounds, median (default 5)")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="also write every decoding step (drafter, k, accepted, pass sizes, draft steps) to FILE, "
                        "for `speculant replay`")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation per method")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_bench)


def writable_dir(path: str, flag: str) -> Path:
    """The directory `path` (made if missing), checked writable; a clear error otherwise."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise SettingsError(f"{flag} {path} is not a directory (it names where the results go: a directory)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise SettingsError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return out


def writable_file(path: str, flag: str) -> None:
    """`path` can be written (its directory exists and takes files; it is not a directory)."""
    p = Path(path)
    if p.is_dir():
        raise SettingsError(f"{flag} {path} is a directory: name a file")
    writable_dir(str(p.parent), flag)


def config_from_args(args):
    from .runner import BenchConfig

    method_names = parse_list(args.methods, str, "--methods")
    draft_max = parse_list(args.draft_max, int, "--draft-max")
    temps = parse_list(args.temp, float, "--temp")
    variants = expand(method_names, draft_max)
    draft_model = args.model_draft
    if draft_model is None and args.model == models.DEFAULT_TARGET:
        draft_model = models.DEFAULT_DRAFT
    if not any(v.method.needs_draft for v in variants):
        draft_model = None
    torch_names = [v.method.name for v in variants if v.method.backend == "torch"]
    if (args.dtype or args.device) and not torch_names:
        raise SettingsError("--dtype and --device apply to the torch-target methods (plain-torch, self-spec, mixed)")
    for flag, value in (("--self-spec-exit", args.self_spec_exit), ("--self-spec-config", args.self_spec_config)):
        if value is not None and "self-spec" not in torch_names:
            raise SettingsError(f"{flag} applies to the self-spec method: add it to --methods")
    if args.self_spec_exit is not None and args.self_spec_config is not None:
        raise SettingsError("choose --self-spec-config or --self-spec-exit, not both")
    if args.rpc and args.interleave == "step":
        raise SettingsError("--interleave step loads the target once per method, and an RPC worker serves one "
                            "client at a time: use --interleave prompt with --rpc")
    return BenchConfig(model=args.model, draft_model=draft_model, variants=variants, temps=temps,
                       n_predict=args.n_predict, repeats=args.repeats, top_k=args.top_k, top_p=args.top_p,
                       min_p=args.min_p, seed=args.seed, draft_p_min=args.draft_p_min, n_ctx=args.ctx_size,
                       threads=args.threads, cost_repeats=args.cost_repeats, warmup=not args.no_warmup,
                       suite=str(args.suite) if args.suite else "builtin", dtype=args.dtype, device=args.device,
                       extra={**({"self_spec_exit": args.self_spec_exit} if args.self_spec_exit is not None else {}),
                              **({"self_spec_config": args.self_spec_config} if args.self_spec_config else {}),
                              **({"draft_vocab": args.draft_vocab} if any(v.method.cut for v in variants) else {})},
                       memory=bool(torch_names) if args.memory is None else args.memory,
                       target_rpc=_rpc_kwargs(args),
                       interleave=(("prompt" if torch_names or args.rpc else "step") if args.interleave == "auto"
                                   else args.interleave),
                       trace=bool(args.trace))


def _rpc_kwargs(args) -> dict:
    from ..cli import rpc_kwargs

    return rpc_kwargs(args)


def cmd_bench(args) -> int:
    from . import report
    from .runner import check_config, run

    if args.costs:
        from . import costs

        if args.trace:
            raise SettingsError("--trace records the steps of decoding runs; --costs times passes only, it "
                                "decodes nothing")

        return costs.run_cli(args)

    cfg = config_from_args(args)
    categories = parse_list(args.categories, str, "--categories") if args.categories else None
    suites = parse_list(args.suite, str, "--suite") if args.suite else [None]
    prompts = select([p for name in suites for p in read_suite(name)], categories, args.limit)
    peers = parse_list(args.peers, str, "--peers") if args.peers else []
    if peers:
        from . import peers as peers_mod

        peers_mod.check_names(peers)
    out = writable_dir(args.out, "--out")  # before hours of benchmarking, not after
    if args.trace:
        writable_file(args.trace, "--trace")
    models.check_name(args.model)  # an unknown -m before the methods' need of a draft model
    check_config(cfg, prompts)  # before the banner: an error is all that is printed

    def count(n: int, what: str) -> str:
        return f"{n} {what}{'' if n == 1 else 's'}"

    print(f"speculant bench: {count(len(prompts), 'prompt')} x {count(len(cfg.variants), 'method')} "
          f"({', '.join(v.label for v in cfg.variants)}) x {count(len(cfg.temps), 'temperature')} x "
          f"{count(cfg.repeats, 'repeat')}, -n {cfg.n_predict}", file=sys.stderr)
    result = run(cfg, prompts, progress=not args.no_progress, keep_partial=True)
    interrupted = result.pop("interrupted", None)
    if interrupted is not None:  # Ctrl-C / SIGTERM: what was finished is written, then the exit code is the signal's
        result["partial"] = True
        print(f"speculant bench: interrupted after {len({r['prompt_id'] for r in result['rows']})} of {len(prompts)} "
              f"prompts: writing what was finished (\"partial\": true)", file=sys.stderr)
    if peers and interrupted is None:
        from . import peers as peers_mod

        result["peers"] = peers_mod.run_peers(peers, cfg, prompts, result, tools_dir=args.llama_tools,
                                              progress=not args.no_progress)
    # every file whole or not at all, results.json first, then the table (it needs no disk): a file that cannot be
    # written (a full disk) is said at the end and loses nothing else
    files, failed = report.write_all(result, out, make_plots=not args.no_plots)
    sys.stdout.write(report.markdown(result))
    sys.stdout.flush()
    if args.trace:
        from ..replay import write_trace

        try:
            files["trace"] = write_trace(result, args.trace)
        except OSError as e:
            failed.append(f"{args.trace}: {e.strerror or e}")
    if files:
        print("wrote " + ", ".join(str(p) for p in files.values()), file=sys.stderr)
    bad = [r for r in result["rows"] if r.get("greedy_equal") is False]
    if bad:
        print(f"speculant bench: {len(bad)} run(s) differ from plain output (see greedy_equal in "
              f"{files.get('json', 'the table above')})", file=sys.stderr)
    if failed:
        error = "could not write " + "; ".join(failed) + " (the table above is the run's summary)"
        if interrupted is None:
            raise SettingsError(error)
        print(f"speculant: error: {error}", file=sys.stderr)
    if interrupted is not None:
        raise interrupted
    return 0
