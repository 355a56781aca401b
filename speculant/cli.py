"""`speculant` command line: generate | pull | models | demo (flags read like llama.cpp's)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import signal
import sys
from typing import Optional, Sequence

from . import models, samplers
from .api import FREE_DRAFTERS, LOOKUP, lookup_by_default, thread_count
from .errors import SettingsError, SpeculantError
from .signals import exit_on_sigterm

DEMO_FILE = "data/code/inventory.py"  # the demo's task: a code edit, with the file as the predicted output
DEMO_PROMPT = ("Rename the class `Inventory` to `StockBook` everywhere in this file. Reply with the complete "
               "updated file in one code block and nothing else.\n\n```python\n{file}```")


class _Formatter(argparse.HelpFormatter):
    def _format_usage(self, usage, actions, groups, prefix):  # refused flags: in the help, not the usage line
        return super()._format_usage(usage, [a for a in actions if not isinstance(a, _Refused)], groups, prefix)


class _Parser(argparse.ArgumentParser):
    """Reads flags as llama.cpp does: a flag matches whole, never as an abbreviation (--predict is not
    --prediction), and a single-dash flag of several letters is never a short flag with its value or more short
    flags attached (-ngld is not -n gld, -hf not -h -f, -sys not -s ys); a number may still follow a short flag
    (-n16)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line and exit 2, like every other error
        self.exit(2, f"speculant: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        """A flag that takes a value takes the next argument, whatever it starts with, as llama.cpp's parser does
        (`--stop ---`, `-p -x`: argparse read those as flags and wanted a value)."""
        args = list(sys.argv[1:] if args is None else args)
        out = []
        i = 0
        while i < len(args):
            action = self._option_string_actions.get(args[i])
            if args[i] == "--":
                out += args[i:]
                break
            if action is not None and action.nargs is None and i + 1 < len(args) and args[i + 1].startswith("-") \
                    and args[i + 1] != "--":  # argparse drops a "--" value (a list came out): it stays a missing value
                out.append(f"{args[i]}={args[i + 1]}")
                i += 2
                continue
            out.append(args[i])
            i += 1
        return super().parse_known_args(out, namespace)

    def _get_option_tuples(self, option_string):
        if len(option_string) > 2 and option_string[0] in self.prefix_chars \
                and option_string[1] not in self.prefix_chars and option_string[2].isalpha():
            return []  # an unknown word: "unrecognized arguments", not a short flag's value
        return super()._get_option_tuples(option_string)


class _Refused(argparse.Action):
    """A llama.cpp flag that cannot mean anything here: refused while parsing, in one line (exit 2), saying what
    to do instead; `accepted` values are what speculant does anyway (-fa off), taken and ignored."""

    def __init__(self, option_strings, dest, what="", instead="", accepted=(), **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)
        self.what, self.instead, self.accepted = what, instead, accepted

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None or values not in self.accepted:
            parser.error(f"{option_string} ({self.what}) is not supported: {self.instead}")


# llama.cpp flags refused here: (flags, metavar (None: a switch), what they set in llama.cpp, what to do instead,
# values that are speculant's own setting anyway). Those of every model command (generate, serve, demo):
REFUSED_MODEL_FLAGS = (
    (("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token"), "REPO", "a Hugging Face download",
     "no model hub is reachable here: `speculant pull NAME` fetches a registered model (`speculant models` lists "
     "them), -m PATH runs any GGUF file", ()),
    (("-hfd", "-hfrd", "--hf-repo-draft"), "REPO", "a Hugging Face download of the draft",
     "no model hub is reachable here: `speculant pull NAME` fetches a registered model (`speculant models` lists "
     "them), -md PATH drafts with any GGUF file", ()),
    (("-fa", "--flash-attn"), "on|off|auto", "flash attention",
     "the llama.cpp backend keeps it off (flash_attn_type disabled): its tiled kernel, taken from 64 queries on, "
     "would round a verify pass differently from one-token passes; leave -fa out", ("off", "disabled", "false", "0")),
    (("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"), "TYPE", "KV cache type",
     "the KV cache holds K and V in f16, llama.cpp's default, and is not configurable here; leave it out",
     ("f16",)),
    (("-b", "--batch-size", "-ub", "--ubatch-size"), "N", "batch size",
     "the engine chunks prompts itself, in batch-invariant passes of 64 tokens (which keep a cached prefix "
     "reusable bit for bit); leave it out", ()),
    (("--mlock",), None, "locking the weights in memory",
     "the weights are read into memory (on huge pages where the kernel grants them), not locked; leave it out", ()),
    (("--chat-template", "--chat-template-file"), "TEMPLATE", "another chat template",
     "the chat template is the model file's own (a model without one gets ChatML); leave it out", ()),
    (("-v", "--verbose", "--log-verbose"), None, "verbose logging",
     "SPECULANT_VERBOSE=1 shows llama.cpp's own log; `speculant doctor` the machine, build and kernels", ()),
)
_NO_SAMPLER = ("speculant samples with the penalties, top-k, top-p, min-p, the temperature and logit biases (each "
               "verified exactly under speculation); this sampler is not implemented: leave it out")
REFUSED_SAMPLING_FLAGS = (
    (("--mirostat",), "N", "Mirostat sampling", _NO_SAMPLER, ("0",)),
    (("--mirostat-lr", "--mirostat-ent"), "N", "Mirostat's settings", _NO_SAMPLER, ()),
    (("--typical", "--typical-p"), "N", "locally typical sampling", _NO_SAMPLER, ("1", "1.0", "1.00")),
    (("--dry-multiplier",), "N", "the DRY repetition penalty", _NO_SAMPLER, ("0", "0.0", "0.00")),
    (("--dry-base", "--dry-allowed-length", "--dry-penalty-last-n", "--dry-sequence-breaker"), "N",
     "the DRY penalty's settings", _NO_SAMPLER, ()),
    (("--xtc-probability",), "N", "XTC sampling", _NO_SAMPLER, ("0", "0.0", "0.00")),
    (("--xtc-threshold",), "N", "XTC's threshold", _NO_SAMPLER, ()),
    (("--top-nsigma", "--top-n-sigma"), "N", "top-n-sigma sampling", _NO_SAMPLER, ("-1", "-1.0")),
    (("--dynatemp-range",), "N", "dynamic temperature", _NO_SAMPLER, ("0", "0.0")),
    (("--dynatemp-exp",), "N", "dynamic temperature's exponent", _NO_SAMPLER, ("1", "1.0")),
)
_NOT_INTERACTIVE = ("generate answers one prompt; use --chat for one chat turn (-sys adds a system message), or "
                    "`speculant serve` with an OpenAI chat client for a conversation")
REFUSED_GENERATE_FLAGS = (
    (("-np", "--parallel"), "N", "parallel sequences",
     "generate answers one prompt; requests decoded at once: `speculant serve -np N`", ()),
    (("-cnv", "--conversation"), None, "interactive conversation", _NOT_INTERACTIVE, ()),
    (("-i", "--interactive", "-if", "--interactive-first"), None, "interactive mode", _NOT_INTERACTIVE, ()),
    (("-mli", "--multiline-input"), None, "interactive multi-line input", _NOT_INTERACTIVE, ()),
)


REFUSED_TITLE = "llama.cpp flags refused here (each error says what to use instead)"


def _add_refused(p: argparse.ArgumentParser, rows) -> None:
    """The rows' flags on p, in one group of its help (and not its usage line: _Formatter)."""
    group = next((g for g in p._action_groups if g.title == REFUSED_TITLE), None) or p.add_argument_group(
        REFUSED_TITLE)
    for flags, metavar, what, instead, accepted in rows:
        group.add_argument(*flags, action=_Refused, nargs=0 if metavar is None else "?", metavar=metavar,
                           what=what, instead=instead, accepted=accepted,
                           help=f"{what}: not supported{' (' + ', '.join(accepted) + ' accepted)' if accepted else ''}")


# flags that only act with a drafter: None means "not given" (warned about when they would do nothing)
DRAFT_DEFAULTS = {"draft_max": None, "draft_min": 1, "draft_p_min": 0.0, "adapt": True, "draft_vocab": 0,
                  "lookup_ngram_max": 4, "lookup_ngram_min": 2, "threads_draft": None, "ctx_size_draft": None,
                  "backend_draft": "auto"}
NO_GPU_OFFLOAD = ("no GPU offload in the llama.cpp backend: speculant builds it for the CPU, where batched "
                  "and one-token logits are bit-identical; pass -ngl 0 or leave it out (a GPU: --backend torch "
                  "--device cuda)")
NO_NGL_ON_TORCH = ("the torch backend places the whole model with --device (cpu, cuda or cuda:N) and does not use "
                   "-ngl; leave -ngl out")


def _add_model_args(p: argparse.ArgumentParser, default_target: bool = True) -> None:
    p.add_argument("-m", "--model", default=models.DEFAULT_TARGET if default_target else None,
                   help="target model: registered name or GGUF path (default %(default)s)")
    p.add_argument("-md", "--model-draft", "--draft-model", dest="model_draft", default=None,
                   help="draft model of the same family (name or GGUF path), 'lookup' for prompt lookup, or "
                        "'history' for history drafting; omit for plain decoding")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="with a draft model: try prompt lookup first, the draft model when it finds nothing "
                        "(default on with a draft model or --self-spec; --no-lookup: the model alone)")
    p.add_argument("--history", action="store_true",
                   help="draft from a suffix trie over the prompt and this process's earlier outputs (before "
                        "lookup and the draft model); lossless, proposals only")
    p.add_argument("--draft-max", "--draft", type=int, default=None,
                   help="tokens drafted per step; an upper bound when adapting (default 4, or 8 where the "
                        "target's passes cost the same up to 8 tokens: a GPU)")
    p.add_argument("--draft-min", type=int, default=None,
                   help="lower bound of the planned draft length when adapting (the per-token confidence rule "
                        "may still stop earlier; default 1)")
    p.add_argument("--adapt", action=argparse.BooleanOptionalAction, default=None,
                   help="choose the draft length per step from measured costs and acceptance, and decode "
                        "plainly when speculation does not pay (default on; --no-adapt drafts --draft-max always)")
    p.add_argument("--draft-p-min", type=float, default=None,
                   help="stop drafting when the draft model's confidence falls below this (default 0: off)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="run a llama.cpp draft from a copy whose output layer keeps only its first N token ids "
                        "(a cheaper draft step that cannot propose the other ids; lossless; made once under "
                        "$SPECULANT_HOME/cut; default 0: the full vocabulary)")
    p.add_argument("--lookup-ngram-max", type=int, default=None,
                   help="prompt lookup: longest n-gram matched (default 4)")
    p.add_argument("--lookup-ngram-min", type=int, default=None,
                   help="prompt lookup: shortest n-gram matched (default 2: single-token matches rarely pay)")
    p.add_argument("--backend", choices=("auto", "llama.cpp", "torch"), default="auto",
                   help="runtime of the target (auto: torch for a transformers directory, else llama.cpp)")
    p.add_argument("--backend-draft", choices=("auto", "llama.cpp", "torch"), default=None,
                   help="runtime of the draft model (may differ from the target's; default auto: torch for a "
                        "transformers directory, else llama.cpp)")
    p.add_argument("--dtype", default=None, help="torch backend: bf16 | fp32 | fp16 (default bf16 where native)")
    p.add_argument("--device", default=None, help="torch backend: cpu | cuda | cuda:N (default cuda if present)")
    p.add_argument("--self-spec", action="store_true",
                   help="draft with the target's own first layers (torch target; `speculant calibrate` picks them)")
    p.add_argument("--self-spec-exit", type=int, default=None, help="self-spec: exit after this many layers")
    p.add_argument("--self-spec-config", metavar="FILE", default=None,
                   help="self-spec: the layers saved by `speculant calibrate -o FILE` (default: those it saved "
                        "for the model in its default place)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context window in tokens; 0: the model's training context (default 4096)")
    p.add_argument("-cd", "--ctx-size-draft", type=int, default=None,
                   help="accepted for llama.cpp compatibility: the draft's context is always the target's (-c), "
                        "as it holds the same tokens; only 0 or the -c value are allowed")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-tb", "--threads-batch", type=int, default=None,
                   help="accepted for llama.cpp compatibility: prompts are processed with the -t threads, so only "
                        "the -t value is allowed (<= 0: all cores, as in llama.cpp)")
    p.add_argument("-td", "--threads-draft", type=thread_count, default=None,
                   help="CPU threads of the draft model (default: --threads)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="put part of the target's layers on these `speculant worker`s (llama.cpp RPC); the draft "
                        "stays on this machine")
    p.add_argument("-ts", "--tensor-split", default=None, metavar="W1[,W2...]",
                   help="with --rpc: share of the target's layers per worker, in --rpc order, and optionally a "
                        "last one for this machine (default: equal shares for every worker and this machine)")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="gpu_layers", type=int, default=0,
                   help="accepted for llama.cpp compatibility: only 0 (no GPU offload in the llama.cpp backend; "
                        "a GPU is --backend torch --device cuda)")
    p.add_argument("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft", dest="gpu_layers_draft", type=int,
                   default=0, help="the draft model's -ngl: accepted for llama.cpp compatibility, only 0")
    p.add_argument("--jinja", action="store_true", help="accepted for llama.cpp compatibility: chat templates are "
                   "always rendered with Jinja (the model file's own)")
    p.add_argument("--no-mmap", action="store_true", help="accepted for llama.cpp compatibility: the weights are "
                   "always read into memory, not mapped")
    _add_refused(p, REFUSED_MODEL_FLAGS)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=0.0,
                   help="temperature; 0 = greedy (default 0, unlike llama-cli's 0.8: output is reproducible and "
                        "can be checked token for token against plain decoding; pass --temp 0.8 for llama-cli's)")
    p.add_argument("--top-k", type=int, default=40, help="top-k when sampling (0 = off; default 40, as llama-cli)")
    p.add_argument("--top-p", type=float, default=0.95,
                   help="top-p in (0, 1] when sampling (1 = off; default 0.95, as llama-cli)")
    p.add_argument("--min-p", type=float, default=0.05,
                   help="min-p in [0, 1) when sampling (0 = off; default 0.05, as llama-cli)")
    p.add_argument("-s", "--seed", type=int, default=-1,
                   help="random seed for sampling (default -1: a random one, reported with the result)")
    p.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=128,
                   help="tokens to generate (default 128; -1 or -2: until the end of generation or a full context; "
                        "generate -n 0: none, the prompt only checked)")
    p.add_argument("--stop", "-r", "--reverse-prompt", action="append", default=[],
                   help="stop string (repeatable; also llama.cpp's -r/--reverse-prompt, which ends a generation "
                        "there as this does, but prints it; escapes processed, see -e)")
    _add_escape_arg(p)
    p.add_argument("--samplers", default=None, metavar="SAMPLERS",
                   help="the samplers that run, in order, separated by ';', as llama.cpp's flag: one left out does "
                        "nothing (the temperature left out samples at 1). speculant has penalties, top_k, top_p, "
                        "min_p, temperature (in that order) and infill (default: llama.cpp's chain)")
    p.add_argument("--sampling-seq", "--sampler-seq", dest="sampling_seq", default=None, metavar="SEQUENCE",
                   help="--samplers as one character each, as llama.cpp's flag (e k p m t i; its default edskypmxt)")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens among the last --repeat-last-n by "
                        "this (1 = off, the default)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="the penalties (repeat, presence, frequency) count the last N tokens, prompt included, as "
                        "llama.cpp's (default 64; 0: no penalties; -1: the whole context)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token among the last --repeat-last-n, in [-2, 2] "
                        "(default 0)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count among the last --repeat-last-n from its logit, in "
                        "[-2, 2] (default 0)")
    p.add_argument("-l", "--logit-bias", action="append", default=[], metavar="TOKEN_ID(+/-)BIAS",
                   help="add BIAS to the logit of TOKEN_ID, as llama.cpp: 15043+1, 15043-1, 15043-inf bans it "
                        "(repeatable; |BIAS| <= 100)")
    _add_refused(p, REFUSED_SAMPLING_FLAGS)


def _add_escape_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-e", "--escape", action=argparse.BooleanOptionalAction, default=True,
                   help="process escape sequences (\\n \\r \\t \\' \\\" \\\\ \\xHH) in -p and "
                        "--stop strings, as llama.cpp does (default on; --no-escape takes them as typed; a prompt "
                        "file or stdin is always taken as written)")


def process_escapes(text: str, flag: str) -> str:
    """llama.cpp's string_process_escapes (common/common.cpp), on the UTF-8 bytes: \\n \\r \\t \\' \\" \\\\ become
    their characters; \\x followed by two characters that C's strtol(_, _, 16) reads whole (two hex digits, or one
    after a space or a sign) becomes that byte; any other backslash, a lone trailing one included, stays as it is,
    with the character after it. Bytes that end up not UTF-8 (\\xff) are refused: the tokenizer takes text."""
    data = text.encode("utf-8")
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        c = data[i]
        if c == 0x5C and i + 1 < n:  # a backslash with something after it
            i += 1
            e = data[i]
            if e in _SIMPLE_ESCAPES:
                out += _SIMPLE_ESCAPES[e]
            elif e == 0x78 and i + 2 < n and (byte := _strtol_hex_pair(data[i + 1 : i + 3])) is not None:  # \x
                out.append(byte)
                i += 2
            else:  # unknown: kept, backslash and all
                out += bytes((0x5C, e))
        else:
            out.append(c)
        i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise SettingsError(f"{flag}: its \\x escapes make bytes that are not UTF-8 text (a character beyond "
                            "ASCII is its UTF-8 bytes, e.g. \\xc3\\xa9 for é; --no-escape takes the text as typed)"
                            ) from None


_SIMPLE_ESCAPES = {ord("n"): b"\n", ord("r"): b"\r", ord("t"): b"\t", ord("'"): b"'", ord('"'): b'"',
                   ord("\\"): b"\\"}
_HEX_DIGITS = b"0123456789abcdefABCDEF"


def _strtol_hex_pair(pair: bytes) -> Optional[int]:
    """The byte char(strtol(pair, &end, 16)) where strtol reads both characters, else None: two hex digits, or
    one after C whitespace (skipped) or a sign (a minus wraps: -1 is 0xff)."""
    a, b = pair
    if b not in _HEX_DIGITS:
        return None
    if a in _HEX_DIGITS:
        return int(pair, 16)
    if a in b" \t\n\v\f\r" or a == ord("+"):
        return int(chr(b), 16)
    if a == ord("-"):
        return -int(chr(b), 16) & 0xFF
    return None


def apply_escapes(args) -> None:
    """-e/--escape (on by default): escapes in -p and each --stop, as llama.cpp processes them in its prompt and
    reverse prompts (not a prompt file's text, which llama.cpp escapes too: see _read_prompt). llama.cpp leaves
    its system prompt (-sys) as typed, and so does speculant."""
    if not getattr(args, "escape", False):
        return
    if isinstance(getattr(args, "prompt", None), str):
        args.prompt = process_escapes(args.prompt, "-p")
    if getattr(args, "stop", None):
        args.stop = [process_escapes(s, "--stop") for s in args.stop]


def check_model_flags(args) -> None:
    """Refuse flags that cannot work, warn about flags that do nothing in this combination, then fill in the
    defaults of the drafter flags (None = not given). Runs before anything is loaded."""
    if args.gpu_layers != 0:
        from .api import on_torch

        torch_target = args.backend == "torch" or on_torch(args.model, args.backend)
        raise SettingsError(f"-ngl {args.gpu_layers}: {NO_NGL_ON_TORCH if torch_target else NO_GPU_OFFLOAD}")
    if args.gpu_layers_draft != 0:
        from .api import on_torch

        torch_draft = args.backend_draft == "torch" or on_torch(args.model_draft, args.backend_draft)
        why = NO_NGL_ON_TORCH.replace("-ngl", "-ngld") if torch_draft else NO_GPU_OFFLOAD.replace("-ngl 0", "-ngld 0")
        raise SettingsError(f"-ngld {args.gpu_layers_draft}: {why}")
    if args.threads_batch is not None:
        threads = args.threads or os.cpu_count()
        if (args.threads_batch if args.threads_batch > 0 else os.cpu_count()) != threads:
            raise SettingsError(f"-tb {args.threads_batch}: speculant processes prompts with the threads it "
                                f"generates with (-t, here {threads}); set -t, and leave -tb out")
    if args.ctx_size_draft not in (None, 0, args.ctx_size):
        raise SettingsError(f"-cd {args.ctx_size_draft}: the draft's context is always the target's (-c "
                            f"{args.ctx_size}), as it holds the same tokens; leave -cd out")
    from .api import check_threads

    check_threads(args.threads, "--threads")
    check_threads(args.threads_draft, "--threads-draft")
    if args.draft_vocab is not None and args.draft_vocab < 0:
        raise SettingsError(f"--draft-vocab must be >= 0, got {args.draft_vocab}")
    if args.draft_vocab:
        from .vocabcut import check_draft_vocab

        check_draft_vocab(args.draft_vocab)
    draft = args.model_draft
    if args.self_spec_config is not None and args.self_spec_exit is not None:
        raise SettingsError("choose --self-spec-config or --self-spec-exit, not both")
    if args.self_spec_config is not None or args.self_spec_exit is not None:
        args.self_spec = True  # either one means self-speculation
    self_spec = args.self_spec
    if self_spec and args.backend != "torch" and not os.path.isdir(os.path.expanduser(args.model)):
        raise SettingsError("--self-spec drafts with the target's own layers, which needs the torch backend for "
                            "the target: add --backend torch")
    if args.lookup and (not draft or draft == LOOKUP) and not self_spec:
        raise SettingsError("--lookup adds prompt lookup in front of a draft model (-md MODEL); for prompt "
                            "lookup alone pass -md lookup")
    if args.lookup is False and draft == LOOKUP:
        raise SettingsError("--no-lookup turns off prompt lookup in front of a draft model, but -md lookup makes "
                            "prompt lookup the drafter; leave -md out to decode plainly")
    given = {name for name in DRAFT_DEFAULTS if getattr(args, name) is not None}
    idle: dict[str, str] = {}  # flag -> why it does nothing here
    if args.lookup is False and not self_spec and (not draft or draft in FREE_DRAFTERS):
        idle["no_lookup"] = "without a draft model (-md MODEL or --self-spec): prompt lookup goes in front of one"
    if not draft and not self_spec and not getattr(args, "prediction", None) and not getattr(args, "history", False):
        idle.update((n, "without a drafter (-md MODEL, -md lookup, -md history or --self-spec): this run decodes plainly")
                    for n in given)
    else:
        if draft in FREE_DRAFTERS or not draft:
            alone = {LOOKUP: "prompt lookup alone (-md lookup)", None: "a prediction alone"}.get(
                draft, "history drafting alone (-md history)")
            idle.update((n, f"with {alone}: it applies to a draft model")
                        for n in given & {"draft_p_min", "draft_vocab", "threads_draft", "backend_draft"})
        elif args.lookup is False:
            idle.update((n, "with --no-lookup") for n in given & {"lookup_ngram_max", "lookup_ngram_min"})
        if self_spec:
            idle.update((n, "with --self-spec (the target drafts for itself)")
                        for n in given & {"draft_vocab", "threads_draft", "backend_draft"})
        if args.adapt is False and "draft_min" in given:
            idle["draft_min"] = "with --no-adapt (every step drafts --draft-max)"
    for name, why in sorted(idle.items()):
        flag = "--" + ("no-adapt" if name == "adapt" and args.adapt is False else name.replace("_", "-"))
        print(f"speculant: warning: {flag} has no effect {why}", file=sys.stderr)
    if args.draft_max == 0 and (draft or self_spec):
        print(f"speculant: warning: --draft-max 0: {'--self-spec' if self_spec else '-md ' + draft} drafts nothing, "
              f"this run decodes plainly (the drafter is not loaded)", file=sys.stderr)
    for name, default in DRAFT_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.lookup is None:
        args.lookup = lookup_by_default(draft, self_spec)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="speculant", description="Exact speculative decoding for LLMs: a cheap drafter "
                     "guesses tokens, the target checks them in one pass, and the output is what the target "
                     "alone would produce. Flags follow llama.cpp's where they mean the same.",
                     epilog="`speculant COMMAND --help` describes a command's flags.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text (speculatively with -md)")
    _add_model_args(g)
    _add_sampling_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file ('-' for stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    system = g.add_mutually_exclusive_group()
    system.add_argument("-sys", "--system-prompt", default=None, metavar="TEXT",
                        help="a system message before the prompt; implies --chat, as llama-cli applies the chat "
                             "template for it (taken as typed: llama.cpp processes no escapes in it)")
    system.add_argument("-sysf", "--system-prompt-file", default=None, metavar="FILE",
                        help="-sys read from a file ('-' for stdin), less one trailing newline, as llama-cli")
    g.add_argument("-no-cnv", "--no-conversation", action="store_true",
                   help="accepted for llama.cpp compatibility (generate is never interactive)")
    g.add_argument("-st", "--single-turn", "--no-display-prompt", action="store_true", dest="single_turn",
                   help="accepted for llama.cpp compatibility (generate answers one turn and prints only the answer)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="never end at an end-of-generation token (a logit bias of -inf on each, as llama.cpp): "
                        "generate until -n, a stop string or a full context")
    _add_refused(g, REFUSED_GENERATE_FLAGS)
    g.add_argument("--json", action="store_true",
                   help="print one JSON object {text, tokens, finish_reason, message, seed, stats}")
    gram = g.add_mutually_exclusive_group()
    gram.add_argument("--grammar", default=None, metavar="GBNF",
                      help="the output follows this GBNF grammar (llama.cpp's format), exactly under speculation")
    gram.add_argument("--grammar-file", default=None, metavar="FILE", help="read the GBNF grammar from FILE")
    gram.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                      help="the output is JSON following this JSON schema ('{}': any JSON value)")
    gram.add_argument("-jf", "--json-schema-file", default=None, metavar="FILE",
                      help="read the JSON schema from FILE")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="with --json: also each token's log-probability under the target and its N most likely "
                        "alternatives (0..20), as \"logprobs\": [{token, logprob, top: [[token, logprob], ...]}]")
    g.add_argument("--suffix", metavar="FILE", default=None,
                   help="fill in the middle: the text after the cursor (the prompt is the text before it); the "
                        "model writes what goes between (code models with FIM tokens, e.g. Qwen2.5-Coder)")
    g.add_argument("--prediction", metavar="FILE", default=None,
                   help="predicted output (e.g. the file being edited): drafted first wherever the output follows "
                        "it; lossless ('-' for stdin)")

    pl = sub.add_parser("pull", help="download registered models into $SPECULANT_HOME")
    pl.add_argument("names", nargs="*", help="model names (default: the default target and draft)")
    pl.add_argument("-q", "--quiet", action="store_true", help="no progress output")

    sub.add_parser("models", help="list registered models")

    d = sub.add_parser("demo", help="plain vs speculative on a built-in code edit (the file as predicted output, "
                                    "then the draft model)")
    _add_model_args(d)
    d.set_defaults(model_draft=None)  # the default draft where it shares the target's tokenizer: demo_draft()
    d.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=128,
                   help="tokens to generate (default 128)")
    d.add_argument("--temp", type=float, default=0.0,
                   help="temperature (default 0: greedy, so both outputs must be identical)")
    d.add_argument("-p", "--prompt", default=None,
                   help="your own prompt instead (then no prediction: the draft model alone)")
    _add_escape_arg(d)
    for module in _PLUGINS:  # subcommands that live in their own modules: add_cli(sub) registers them
        try:
            mod = __import__(f"speculant.{module}", fromlist=["add_cli"])
        except ImportError:
            continue
        mod.add_cli(sub, _add_model_args, _add_sampling_args)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    try:
        llama = version("llama-cpp-python")
    except PackageNotFoundError:
        llama = "not installed"
    return f"speculant {__version__} (llama-cpp-python {llama})"


_PLUGINS = ("server", "bench", "calibrate", "doctor", "replay", "rpc", "quantize", "plan")


def _read_prompt(args, exact: bool = False) -> str:
    """-p (its escapes processed in main), else the prompt read from -f FILE or stdin with one trailing newline
    dropped, as llama.cpp's -f reads one. Unlike llama.cpp, no escapes are processed in a file's text: it holds
    real newlines, and code's own \\n (in string literals) must reach the model as written, as it stays in a
    --prediction file. exact: as it is (the text before a cursor, beside a --suffix file read as it is)."""
    if args.prompt is not None:
        return args.prompt
    if args.file and args.file != "-":
        try:
            with open(args.file, encoding="utf-8", newline="") as f:  # as written, as llama.cpp and stdin read it
                text = f.read()
        except OSError as e:
            raise SpeculantError(f"cannot read prompt file {args.file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise SpeculantError(f"prompt file {args.file} is not UTF-8 text") from None
    elif args.file == "-" or not sys.stdin.isatty():
        text = _read_stdin("the prompt")
    else:
        raise SpeculantError("no prompt: pass -p TEXT, -f FILE, or pipe text on stdin")
    return text if exact else _less_one_newline(text)


def _less_one_newline(text: str) -> str:
    """A file's text less one trailing newline, as llama.cpp's -f and -sysf read one."""
    return text[:-1] if text.endswith("\n") else text


def _read_stdin(what: str) -> str:
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        raise SpeculantError(f"{what} on stdin is not UTF-8 text") from None


# flags that carry text (not paths): text that is not UTF-8 reaches Python as surrogate escapes, which the
# tokenizer cannot encode; such a flag is refused before anything loads
TEXT_FLAGS = {"prompt": "-p", "stop": "--stop", "grammar": "--grammar", "json_schema": "-j", "api_key": "--api-key",
              "served_model_name": "--served-model-name", "system_prompt": "-sys"}


def check_text_flags(args) -> None:
    for dest, flag in TEXT_FLAGS.items():
        value = getattr(args, dest, None)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise SettingsError(f"{flag} is not UTF-8 text") from None


def engine_from_args(args):
    """The Engine that the common model flags describe (also used by `serve`)."""
    from .api import load_engine

    return load_engine(args.model, args.model_draft, draft_max=args.draft_max, draft_min=args.draft_min,
                       draft_p_min=args.draft_p_min, adaptive=args.adapt, lookup=args.lookup,
                       ngram_max=args.lookup_ngram_max, ngram_min=args.lookup_ngram_min, n_ctx=args.ctx_size,
                       threads=args.threads, backend=args.backend, draft_backend=args.backend_draft,
                       dtype=args.dtype, device=args.device, self_spec=args.self_spec,
                       self_spec_exit=args.self_spec_exit, self_spec_config=args.self_spec_config,
                       draft_vocab=args.draft_vocab, draft_threads=args.threads_draft,
                       history=getattr(args, "history", False), parallel=getattr(args, "parallel", 1),
                       **rpc_kwargs(args))


def rpc_kwargs(args) -> dict:
    """--rpc / --tensor-split -> load_engine's rpc and tensor_split (checked before anything loads)."""
    from .rpc import parse_endpoints, parse_tensor_split

    if getattr(args, "rpc", None) is not None and not args.rpc.strip():  # an unset variable in a script
        raise SettingsError("--rpc is empty: name the workers (HOST:PORT[,HOST:PORT...]), or leave --rpc out")
    if not getattr(args, "rpc", None):
        if getattr(args, "tensor_split", None):
            raise SettingsError("--tensor-split splits the target over --rpc workers: pass --rpc too")
        return {}
    endpoints = parse_endpoints(args.rpc)
    parse_tensor_split(args.tensor_split, len(endpoints))
    return {"rpc": endpoints, "tensor_split": args.tensor_split}


def parse_logit_bias(items: Sequence[str]) -> tuple[tuple[int, float], ...]:
    """-l TOKEN_ID(+/-)BIAS values -> SamplingParams.logit_bias (a later value for a token replaces an earlier)."""
    out: dict[int, float] = {}
    for item in items:
        m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(inf|[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*", item)
        if not m:
            raise SettingsError(f"--logit-bias {item!r}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf")
        bias = float(m.group(3)) * (1 if m.group(2) == "+" else -1)
        if bias == math.inf:
            raise SettingsError(f"--logit-bias {item!r}: +inf would force one token forever; use a finite bias")
        out[int(m.group(1))] = bias
    return tuple(out.items())


def sampling_params(args, seed: Optional[int], backend=None, chained: bool = True):
    """SamplingParams from the sampling flags (validated there), as --samplers chains them (chained False: as
    given). The infill sampler reads the model's vocabulary: without `backend` (flags checked before the model
    loads) it is left out."""
    from .verify import SamplingParams, with_repeat_last_n

    if args.repeat_last_n < -1:
        raise SettingsError(f"--repeat-last-n must be >= -1 (0: no penalties, -1: the whole context), got "
                            f"{args.repeat_last_n}")
    params = with_repeat_last_n(SamplingParams(args.temp, args.top_k, args.top_p, args.min_p, seed,
                                               logit_bias=parse_logit_bias(args.logit_bias),
                                               presence_penalty=args.presence_penalty,
                                               frequency_penalty=args.frequency_penalty,
                                               repetition_penalty=args.repeat_penalty), args.repeat_last_n)
    chain = sampler_chain(args)
    if chain is None or not chained:
        return params
    try:
        params = samplers.in_chain(params, chain, lambda: backend.infill_vocab() if backend is not None else None)
    except SettingsError as e:
        raise SettingsError(f"{_chain_flag(args)}: {e}") from None
    return params


def _chain_flag(args) -> str:
    return "--samplers" if args.samplers is not None else "--sampling-seq"


def sampler_chain(args) -> Optional[tuple[str, ...]]:
    """--samplers or --sampling-seq as llama.cpp reads them (samplers.py); None: neither given."""
    if args.samplers is not None and args.sampling_seq is not None:
        raise SettingsError("--samplers and --sampling-seq both give the samplers: give one")
    try:
        if args.samplers is not None:
            def unknown(name):
                if name not in warned:  # once, however often the flags are read
                    warned.add(name)
                    print(f"speculant: warning: --samplers: no sampler is named {name!r}; it is skipped, as "
                          f"llama.cpp skips it", file=sys.stderr)
            warned = vars(args).setdefault("_unknown_samplers", set())
            return samplers.from_names(args.samplers.split(";"), unknown)
        if args.sampling_seq is not None:
            return samplers.from_chars(args.sampling_seq)
    except SettingsError as e:
        raise SettingsError(f"{_chain_flag(args)}: {e}") from None
    return None


def sampling_seed(seed: int) -> int:
    """-s/--seed: -1 (the default) draws a random seed, which is then reported."""
    if seed == -1:
        return secrets.randbits(32)
    if seed < 0:
        raise SettingsError(f"--seed must be >= 0, or -1 for a random one, got {seed}")
    return seed


def _read_grammar(args) -> Optional[str]:
    """--grammar, --grammar-file, -j/--json-schema or -jf/--json-schema-file -> GBNF text, or None."""
    from .constraint import json_grammar

    if args.json_schema is not None:
        return json_grammar(args.json_schema)
    if args.json_schema_file is not None:
        return json_grammar(_read_text(args.json_schema_file, "--json-schema-file"))
    if args.grammar_file is not None:
        return _read_text(args.grammar_file, "--grammar-file")
    return args.grammar


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(f"{flag} {path}: {e.strerror if isinstance(e, OSError) else e}") from None


def _read_prediction(path: Optional[str], what: str = "prediction") -> Optional[str]:
    if path is None:
        return None
    if path == "-":
        return _read_stdin(f"the {what}")
    try:
        with open(path, encoding="utf-8", newline="") as f:  # as written: "\r\n" stays, as on stdin
            return f.read()
    except OSError as e:
        raise SpeculantError(f"cannot read {what} file {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SpeculantError(f"{what} file {path} is not UTF-8 text") from None


def cmd_generate(args) -> int:
    from .engine import Result
    from .native import one_request_pages
    from .stats import SpecStats

    one_request_pages()
    # llama-cli applies the chat template for one, an empty one too (which adds no system message)
    if args.system_prompt is not None or args.system_prompt_file is not None:
        args.chat = True
    if args.n_predict < -2:
        raise SettingsError(f"the token limit -n must be >= 0, or -1 / -2 (until the context is full), got "
                            f"{args.n_predict}")
    if args.logprobs is not None and not args.json:
        raise SettingsError("--logprobs prints with --json: add --json")
    seed = sampling_seed(args.seed)
    params = sampling_params(args, seed)
    prompt_on_stdin = args.prompt is None and args.file in (None, "-")
    readers = [flag for flag, on_stdin in (("the prompt", prompt_on_stdin), ("--prediction", args.prediction == "-"),
                                           ("--suffix", args.suffix == "-"),
                                           ("-sysf", args.system_prompt_file == "-")) if on_stdin]
    if len(readers) > 1:
        raise SettingsError(f"{' and '.join(readers)} would both read stdin: give all but one a file (-p TEXT or "
                            f"-f FILE for the prompt)")
    if args.system_prompt_file is not None:
        args.system_prompt = _less_one_newline(_read_prediction(args.system_prompt_file, "system prompt"))
    prediction = _read_prediction(args.prediction)
    suffix = _read_prediction(args.suffix, "suffix")
    if suffix is not None and args.chat:
        raise SettingsError(f"--suffix fills in the middle of a text: it does not go with "
                            f"{'-sys (a chat message)' if args.system_prompt is not None else '--chat'}")
    prompt = _read_prompt(args, exact=suffix is not None)  # "" or spaces: as the engine takes them (tokenize_prompt)
    gbnf = _read_grammar(args)
    engine = engine_from_args(args)
    try:
        if args.chat:
            from .chat import missing_template_warning

            no_template = missing_template_warning(engine.target.chat_template(), args.model)
            if no_template:
                print(f"speculant: warning: {no_template}; without --chat the prompt goes in as it is",
                      file=sys.stderr)
        constraint = engine.target.grammar(gbnf) if gbnf is not None else None
        if "infill" in (sampler_chain(args) or ()):  # checked above; now with the model's vocabulary
            params = sampling_params(args, seed, engine.target)
        if args.ignore_eos:
            from .verify import with_eog_banned

            params = with_eog_banned(params, engine.target.eog_ids())
        if suffix is not None:
            text = engine.fim_prompt(prompt, suffix)
        else:
            system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
            text = engine.chat_prompt([*system, {"role": "user", "content": prompt}]) if args.chat else prompt
        result = Result("", [], SpecStats())
        printed = 0
        # llama.cpp's -1 (no limit) and -2 (until the context is full) are one here: the context never shifts
        limit = engine.target.n_ctx if args.n_predict < 0 else args.n_predict
        if limit == 0:  # -n 0: the prompt and settings checked (as a generation would), nothing generated
            engine.check_settings(params, args.logprobs, constraint)
            result.stats.prompt_tokens = len(engine.tokenize_prompt(text, is_chat=args.chat))
            result.finish_reason = "length"
            if args.logprobs is not None:
                result.logprobs = []
        for event in engine.stream(text, max_tokens=limit, params=params, stop=args.stop, is_chat=args.chat,
                                   result=result, prediction=prediction, logprobs=args.logprobs,
                                   constraint=constraint) if limit else ():
            if not args.json and event.text:
                _write(event.text)
                printed += len(event.text)
        speculative = engine.drafter is not None or prediction is not None
    finally:
        engine.close()
    if args.json:
        _write(json.dumps({**result.to_dict(), "seed": seed}, ensure_ascii=False) + "\n")
    else:
        _write(result.text[printed:] + "\n")
        sampled = f", seed {seed}" if not params.greedy else ""
        sources = (f", accepted by source {dict(result.stats.accepted_by_source)}"
                   if len(result.stats.accepted_by_source) > 1 or prediction else "")
        print(f"[{result.stats.summary(speculative)}{sampled}{sources}]", file=sys.stderr)
    if result.message:
        print(f"speculant: {result.message}", file=sys.stderr)
    return 0


def cmd_pull(args) -> int:
    names = args.names or [models.DEFAULT_TARGET, models.DEFAULT_DRAFT]
    for name in names:  # every name checked before anything is downloaded
        models.registered(name)
    for name in names:  # a present file is checked against its sha256 (seconds), fetched again if damaged
        path = models.pull(name, quiet=args.quiet, verify=True)
        if not args.quiet:
            print(f"{name}: {path}")
    return 0


def cmd_models(args) -> int:
    rows = models.list_models()
    width = max([32] + [len(name) for name, _, _ in rows])
    for name, desc, present in rows:
        print(f"{name:{width}s} {'pulled' if present else '-':7s} {desc}")
    return 0


def demo_draft(model: str, predicted: bool = True) -> Optional[str]:
    """The demo's draft model when -md is not given: the default draft, unless the target is a registered or local
    model of another tokenizer family (SmolLM2: the 0.5B Qwen would out-cost the 135M target it drafts for, through
    text); then none, and the prediction drafts alone."""
    target, draft = models.spec_of(model), models.spec_of(models.DEFAULT_DRAFT)
    if target is not None and target.tokenizer and target.tokenizer != draft.tokenizer:
        alone = "the predicted output drafts alone" if predicted else "the speculative run has no drafter"
        print(f"speculant: no registered draft model shares {model}'s tokenizer ({target.tokenizer}): {alone} "
              f"(-md NAME chooses one)", file=sys.stderr)
        return None
    return models.DEFAULT_DRAFT


def cmd_demo(args) -> int:
    from .api import check_torch_settings, load_backend, load_drafter, on_torch
    from .engine import Engine
    from .native import one_request_pages
    from .verify import SamplingParams

    one_request_pages()
    if args.model_draft is None and not args.self_spec:
        args.model_draft = demo_draft(args.model, predicted=args.prompt is None)
    self_spec = args.self_spec or args.self_spec_exit is not None
    check_torch_settings(args.model, args.backend, args.model_draft, args.backend_draft, args.dtype, args.device,
                         self_spec)
    target_on_torch = on_torch(args.model, args.backend)  # else --dtype / --device are the draft's only
    target = load_backend(args.model, n_ctx=args.ctx_size, threads=args.threads, backend=args.backend,
                          dtype=args.dtype if target_on_torch else None,
                          device=args.device if target_on_torch else None,
                          self_spec=args.self_spec or args.self_spec_exit is not None, **rpc_kwargs(args))
    drafter = load_drafter(target, args.model_draft, lookup=args.lookup, draft_p_min=args.draft_p_min,
                           ngram_max=args.lookup_ngram_max, ngram_min=args.lookup_ngram_min,
                           threads=args.threads_draft or args.threads, draft_backend=args.backend_draft, dtype=args.dtype, device=args.device,
                           self_spec=args.self_spec, self_spec_exit=args.self_spec_exit,
                           self_spec_config=args.self_spec_config, draft_vocab=args.draft_vocab,
                           history=args.history)
    plain = Engine(target)
    spec = Engine(target, drafter, draft_max=args.draft_max, adaptive=args.adapt, draft_min=args.draft_min)
    params = SamplingParams(args.temp, seed=0)
    prediction = None
    if args.prompt is None:  # the built-in code edit: free drafts from the file, where speculation pays most
        from importlib.resources import files

        prediction = files("speculant").joinpath(DEMO_FILE).read_text(encoding="utf-8")
        args.prompt = DEMO_PROMPT.format(file=prediction)
    prompt = plain.chat_prompt([{"role": "user", "content": args.prompt}])
    print(f"prompt: {args.prompt}\n")
    runs = {}
    for label, engine in (("plain", plain), ("speculative", spec)):
        drafters = ([f"the file as predicted output ({DEMO_FILE.split('/')[-1]})"] if prediction else []) + \
                   (["history drafting"] if engine.drafter and args.history else []) + \
                   ([args.model_draft] if engine.drafter and args.model_draft else []) + \
                   (["its own first layers"] if engine.drafter and args.self_spec else [])
        print(f"--- {label} ({target.name}{' + ' + ', then '.join(drafters) if label == 'speculative' and drafters else ''}) ---")
        runs[label] = r = engine.generate(prompt, max_tokens=args.n_predict, params=params, is_chat=True,
                                          prediction=prediction if label == "speculative" else None)
        print(r.text)
        print(f"[{label}: {r.stats.generated_tokens} tokens at {r.stats.tokens_per_s:.2f} tokens/s]\n")
    p, s = runs["plain"].stats, runs["speculative"].stats
    same = runs["plain"].tokens == runs["speculative"].tokens
    print(f"plain:       {p.tokens_per_s:6.2f} tokens/s")
    print(f"speculative: {s.tokens_per_s:6.2f} tokens/s  (draft-max {spec.draft_max}"
          f"{', adaptive' if args.adapt else ''}: {s.summary(True, speed=False)})")
    print(f"speedup:     {s.tokens_per_s / p.tokens_per_s:.2f}x   identical output: {'yes' if same else 'NO'}")
    if not s.drafted:  # both runs decoded plainly: the ratio is the machine's noise
        print("(nothing was drafted: the adaptive policy judged drafts would not pay here, so the speedup is timing "
              "noise)")
    spec.close()
    return 0 if same or args.temp > 0 else 1


MODEL_COMMANDS = ("generate", "serve", "demo")  # the commands with the common model flags


def _write(text: str) -> None:
    """Generated text to stdout, flushed. A reader that went away (`| head`) ends the command quietly (main); any
    other write error (a full disk) is one line, not a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise SpeculantError(f"cannot write the output: {e.strerror or e}") from None


def main(argv: Optional[list[str]] = None) -> int:
    previous = exit_on_sigterm()  # SIGTERM cleans up like Ctrl-C (a pull's staging directory, loaded models)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        check_text_flags(args)
        apply_escapes(args)
        if args.command in MODEL_COMMANDS:
            check_model_flags(args)
        handlers = {"generate": cmd_generate, "pull": cmd_pull, "models": cmd_models, "demo": cmd_demo}
        return (handlers.get(args.command) or args.handler)(args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("speculant: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of our output went away (`speculant generate ... | head`): stop quietly, as a Unix tool
        # killed by SIGPIPE does; stdout now points at /dev/null so that Python's flush at exit stays quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:  # a file or stream the command could not read or write: one line, not a traceback
        where = f": {e.filename}" if e.filename else ""
        print(f"speculant: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
