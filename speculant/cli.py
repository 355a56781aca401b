"""`speculant` command line: generate | pull | models | demo (flags read like llama.cpp's)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from . import models
from .errors import SpeculantError

DEMO_PROMPT = (
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals and returns "
    "them sorted. Include a docstring and a short example."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other error
        self.exit(2, f"speculant: error: {message}\n")


def _add_model_args(p: argparse.ArgumentParser, default_target: bool = True) -> None:
    p.add_argument("-m", "--model", default=models.DEFAULT_TARGET if default_target else None,
                   help="target model: registered name or GGUF path (default %(default)s)")
    p.add_argument("-md", "--model-draft", "--draft-model", dest="model_draft", default=None,
                   help="draft model of the same family (name or GGUF path), 'lookup' for prompt lookup, or "
                        "'history' for history drafting; omit for plain decoding")
    p.add_argument("--lookup", action="store_true",
                   help="with a draft model: try prompt lookup first, the draft model when it finds nothing")
    p.add_argument("--history", action="store_true",
                   help="draft from a suffix trie over the prompt and this process's earlier outputs (before "
                        "lookup and the draft model); lossless, proposals only")
    p.add_argument("--draft-max", "--draft", type=int, default=4,
                   help="tokens drafted per step; an upper bound when adapting (default 4)")
    p.add_argument("--draft-min", type=int, default=1, help="lower bound of the planned draft length when adapting (the per-token confidence rule may still stop earlier)")
    p.add_argument("--adapt", action=argparse.BooleanOptionalAction, default=True,
                   help="choose the draft length per step from measured costs and acceptance, and decode "
                        "plainly when speculation does not pay (default on; --no-adapt drafts --draft-max always)")
    p.add_argument("--draft-p-min", type=float, default=0.0,
                   help="stop drafting when the draft's confidence falls below this (default 0: off)")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="run a llama.cpp draft from a copy whose output layer keeps only its first N token ids "
                        "(a cheaper draft step that cannot propose the other ids; lossless; made once under "
                        "$SPECULANT_HOME/cut; default 0: the full vocabulary)")
    p.add_argument("--lookup-ngram-max", type=int, default=4, help="longest n-gram prompt lookup matches")
    p.add_argument("--lookup-ngram-min", type=int, default=2,
                   help="shortest n-gram prompt lookup matches (default 2: single-token matches rarely pay)")
    p.add_argument("--backend", choices=("auto", "llama.cpp", "torch"), default="auto",
                   help="runtime of the target (auto: torch for a transformers directory, else llama.cpp)")
    p.add_argument("--backend-draft", choices=("auto", "llama.cpp", "torch"), default="auto",
                   help="runtime of the draft model (may differ from the target's)")
    p.add_argument("--dtype", default=None, help="torch backend: bf16 | fp32 | fp16 (default bf16 where native)")
    p.add_argument("--device", default=None, help="torch backend: cpu | cuda | cuda:N (default cuda if present)")
    p.add_argument("--self-spec", action="store_true",
                   help="draft with the target's own first layers (torch target; `speculant calibrate` picks them)")
    p.add_argument("--self-spec-exit", type=int, default=None, help="self-spec: exit after this many layers")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context window (default 4096)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p in (0, 1] (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p in [0, 1) (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speculant", description="Exact speculative decoding for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text (speculatively with -md)")
    _add_model_args(g)
    _add_sampling_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object {text, tokens, stats}")
    g.add_argument("--prediction", metavar="FILE", default=None,
                   help="predicted output (e.g. the file being edited): drafted first wherever the output follows "
                        "it; lossless ('-' for stdin)")

    pl = sub.add_parser("pull", help="download registered models into $SPECULANT_HOME")
    pl.add_argument("names", nargs="*", help="model names (default: the default target and draft)")
    pl.add_argument("-q", "--quiet", action="store_true")

    sub.add_parser("models", help="list registered models")

    d = sub.add_parser("demo", help="plain vs speculative on a built-in coding prompt")
    _add_model_args(d)
    d.set_defaults(model_draft=models.DEFAULT_DRAFT)
    d.add_argument("-n", "--n-predict", type=int, default=128)
    d.add_argument("--temp", type=float, default=0.0)
    d.add_argument("-p", "--prompt", default=DEMO_PROMPT)
    for module in _PLUGINS:  # subcommands that live in their own modules: add_cli(sub) registers them
        try:
            mod = __import__(f"speculant.{module}", fromlist=["add_cli"])
        except ImportError:
            continue
        mod.add_cli(sub, _add_model_args, _add_sampling_args)
    return parser


_PLUGINS = ("server", "bench", "calibrate")


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file and args.file != "-":
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise SpeculantError(f"cannot read prompt file {args.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise SpeculantError(f"prompt file {args.file} is not UTF-8 text") from None
    if args.file == "-" or not sys.stdin.isatty():
        return sys.stdin.read()
    raise SpeculantError("no prompt: pass -p TEXT, -f FILE, or pipe text on stdin")


def engine_from_args(args):
    """The Engine that the common model flags describe (also used by `serve`)."""
    from .api import load_engine

    return load_engine(args.model, args.model_draft, draft_max=args.draft_max, draft_min=args.draft_min,
                       draft_p_min=args.draft_p_min, adaptive=args.adapt, lookup=args.lookup,
                       ngram_max=args.lookup_ngram_max, ngram_min=args.lookup_ngram_min, n_ctx=args.ctx_size,
                       threads=args.threads, backend=args.backend, draft_backend=args.backend_draft,
                       dtype=args.dtype, device=args.device, self_spec=args.self_spec,
                       self_spec_exit=args.self_spec_exit, draft_vocab=args.draft_vocab,
                       history=getattr(args, "history", False))


def _read_prediction(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise SpeculantError(f"cannot read prediction file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpeculantError(f"prediction file {path} is not UTF-8 text") from None


def cmd_generate(args) -> int:
    from .engine import Result
    from .stats import SpecStats
    from .verify import SamplingParams

    params = SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, args.seed)
    prediction = _read_prediction(args.prediction)
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise SpeculantError("the prompt is empty")
    engine = engine_from_args(args)
    try:
        text = engine.chat_prompt([{"role": "user", "content": prompt}]) if args.chat else prompt
        result = Result("", [], SpecStats())
        printed = 0
        for event in engine.stream(text, max_tokens=args.n_predict, params=params, stop=args.stop,
                                   is_chat=args.chat, result=result, prediction=prediction):
            if not args.json and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
                printed += len(event.text)
    finally:
        engine.close()
    if args.json:
        json.dump(result.to_dict(), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(result.text[printed:] + "\n")
        s = result.stats
        print(f"[{s.generated_tokens} tokens, {s.tokens_per_s:.2f} tokens/s, acceptance "
              f"{s.acceptance_rate:.1%}, τ {s.mean_accepted_length:.2f}, {s.target_calls} target calls"
              + (f", accepted by source {dict(s.accepted_by_source)}" if len(s.accepted_by_source) > 1 or prediction
                 else "") + "]", file=sys.stderr)
    if result.message:
        print(f"speculant: {result.message}", file=sys.stderr)
    return 0


def cmd_pull(args) -> int:
    for name in args.names or [models.DEFAULT_TARGET, models.DEFAULT_DRAFT]:
        path = models.pull(name, quiet=args.quiet)
        if not args.quiet:
            print(f"{name}: {path}")
    return 0


def cmd_models(args) -> int:
    for name, desc, present in models.list_models():
        print(f"{name:32s} {'pulled' if present else '-':7s} {desc}")
    return 0


def cmd_demo(args) -> int:
    from .api import load_backend, load_drafter
    from .engine import Engine
    from .verify import SamplingParams

    target = load_backend(args.model, n_ctx=args.ctx_size, threads=args.threads, backend=args.backend,
                          dtype=args.dtype, device=args.device)
    drafter = load_drafter(target, args.model_draft, lookup=args.lookup, draft_p_min=args.draft_p_min,
                           ngram_max=args.lookup_ngram_max, ngram_min=args.lookup_ngram_min, threads=args.threads,
                           draft_backend=args.backend_draft, dtype=args.dtype, device=args.device,
                           self_spec=args.self_spec, self_spec_exit=args.self_spec_exit,
                           draft_vocab=args.draft_vocab)
    plain = Engine(target)
    spec = Engine(target, drafter, draft_max=args.draft_max, adaptive=args.adapt, draft_min=args.draft_min)
    params = SamplingParams(args.temp, seed=0)
    prompt = plain.chat_prompt([{"role": "user", "content": args.prompt}])
    print(f"prompt: {args.prompt}\n")
    runs = {}
    for label, engine in (("plain", plain), ("speculative", spec)):
        print(f"--- {label} ({target.name}{' + ' + args.model_draft if engine.drafter else ''}) ---")
        runs[label] = r = engine.generate(prompt, max_tokens=args.n_predict, params=params, is_chat=True)
        print(r.text)
        print(f"[{label}: {r.stats.generated_tokens} tokens at {r.stats.tokens_per_s:.2f} tokens/s]\n")
    p, s = runs["plain"].stats, runs["speculative"].stats
    same = runs["plain"].tokens == runs["speculative"].tokens
    print(f"plain:       {p.tokens_per_s:6.2f} tokens/s")
    print(f"speculative: {s.tokens_per_s:6.2f} tokens/s  (draft-max {args.draft_max}"
          f"{', adaptive' if args.adapt else ''}, acceptance {s.acceptance_rate:.1%}, "
          f"τ {s.mean_accepted_length:.2f}, mean draft length {s.to_dict()['mean_draft_length']})")
    print(f"speedup:     {s.tokens_per_s / p.tokens_per_s:.2f}x   identical output: {'yes' if same else 'NO'}")
    spec.close()
    return 0 if same or args.temp > 0 else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        handlers = {"generate": cmd_generate, "pull": cmd_pull, "models": cmd_models, "demo": cmd_demo}
        return (handlers.get(args.command) or args.handler)(args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("speculant: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
