"""The method registry: a benchmark method name -> how to build its Engine around the shared target.

Adding a method is one entry in METHODS (or one `register(...)` call from another module), e.g.

    register(Method("lookup", lambda ctx, k: Engine(ctx.target, LookupDrafter(), draft_max=k),
                    uses_k=True, needs_draft=False, cost="in_run", help="prompt lookup (n-gram)"))

Every engine wraps the SAME loaded target backend (engines are cheap; models load once). A method whose
`backend` is "torch" wraps the second target, the same model on the torch backend (loaded once, only when
such a method is selected); its speed is also compared with, and its greedy output checked against,
plain decoding on that runtime ("plain-torch", added automatically). A builder must not close anything:
the runner closes the backends at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..backends.base import Backend
from ..engine import Engine
from ..errors import SettingsError


@dataclass
class MethodContext:
    target: Optional[Backend]  # the target on llama.cpp
    draft: Optional[Backend]  # the draft model, loaded once when any method needs it
    draft_p_min: float = 0.0
    options: dict = field(default_factory=dict)  # free-form settings for future methods
    torch_target: Optional[Backend] = None  # the target on the torch backend, when a method needs it
    notes: dict = field(default_factory=dict)  # method name -> what it chose (reported)
    cut_draft: Optional[Backend] = None  # the draft model with its vocabulary cut (--draft-vocab), when needed
    cut_keep: Optional[object] = None  # its kept target ids (np.ndarray)
    same_vocab: dict = field(default_factory=dict)  # id(target) -> does the draft share its vocabulary

    def model_drafter(self, target: Optional[Backend] = None, cut: bool = False):
        """The draft model's drafter for `target` (default: the llama.cpp one): its own ids when it shares the
        target's vocabulary, else through text (drafters/crossvocab.py)."""
        from ..drafters.crossvocab import CrossVocabDrafter, same_vocabulary
        from ..drafters.model import ModelDrafter

        draft = self.cut_draft if cut else self.draft
        if draft is None:
            raise SettingsError("this method needs a draft model: pass -md")
        target = target or self.target
        if id(target) not in self.same_vocab:
            self.same_vocab[id(target)] = same_vocabulary(target, self.draft)
        if not self.same_vocab[id(target)]:
            if cut:
                raise SettingsError("a cut draft vocabulary needs a draft that shares the target's vocabulary")
            return CrossVocabDrafter(draft, target, p_min=self.draft_p_min)
        return ModelDrafter(draft, target.n_vocab, p_min=self.draft_p_min,
                            keep=self.cut_keep if cut else None, map_inputs=False)

    def torch(self) -> Backend:
        if self.torch_target is None:
            raise SettingsError("this method needs the target on the torch backend")
        return self.torch_target


@dataclass(frozen=True)
class Method:
    name: str
    build: Callable[[MethodContext, int], Engine]  # (context, k) -> Engine
    uses_k: bool = True  # one variant per --draft-max value ("draft-k4", ...); False: one variant
    needs_draft: bool = False  # loads -md
    # how the predicted speedup gets the draft cost c: "draft_model" = the measured draft-model step
    # (timed at the start of the run); "in_run" = the method's own draft time per drafted token
    cost: str = "in_run"
    help: str = ""
    backend: str = "llama.cpp"  # the target's runtime: "llama.cpp" (ctx.target) or "torch" (ctx.torch_target)
    cut: bool = False  # uses the draft model with its vocabulary cut to --draft-vocab ids
    uses_prediction: bool = False  # gets the prompt's predicted output (suites that have one)

    @property
    def baseline(self) -> str:
        """The plain variant on this method's runtime: its greedy output is the reference."""
        return BASELINES[self.backend]


BASELINES = {"llama.cpp": "plain", "torch": "plain-torch"}


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


register(Method("plain", lambda ctx, k: Engine(ctx.target), uses_k=False, cost="in_run",
                help="target alone, one pass per token (the baseline)"))
register(Method("draft", lambda ctx, k: Engine(ctx.target, ctx.model_drafter(), draft_max=k),
                needs_draft=True, cost="draft_model", help="draft model (-md) proposes k tokens"))


def _lookup(ctx):
    from ..drafters.lookup import LookupDrafter

    return LookupDrafter(**{k: v for k, v in ctx.options.items() if k in ("ngram_max", "ngram_min")})


def _composite(ctx, cut: bool = False):
    from ..drafters.composite import CompositeDrafter

    return CompositeDrafter(_lookup(ctx), ctx.model_drafter(cut=cut))


register(Method("lookup", lambda ctx, k: Engine(ctx.target, _lookup(ctx), draft_max=k),
                help="prompt lookup (n-gram copy from prompt and output), k tokens"))
register(Method("draft+lookup", lambda ctx, k: Engine(ctx.target, _composite(ctx), draft_max=k),
                needs_draft=True, help="prompt lookup first, the draft model when it finds nothing"))
register(Method("adaptive", lambda ctx, k: Engine(ctx.target, ctx.model_drafter(), draft_max=k, adaptive=True),
                needs_draft=True, help="draft model, k chosen per step (<= --draft-max), plain when it does not pay"))
register(Method("adaptive-lookup", lambda ctx, k: Engine(ctx.target, _lookup(ctx), draft_max=k, adaptive=True),
                help="prompt lookup with the adaptive policy"))
register(Method("adaptive+lookup",
                lambda ctx, k: Engine(ctx.target, _composite(ctx), draft_max=k, adaptive=True),
                needs_draft=True, help="lookup then draft model, adaptive k and plain fallback"))

register(Method("draft-cut", lambda ctx, k: Engine(ctx.target, ctx.model_drafter(cut=True), draft_max=k),
                needs_draft=True, cut=True, cost="in_run",
                help="draft model with its output layer cut to --draft-vocab ids (cheaper steps), k tokens"))
register(Method("adaptive-cut",
                lambda ctx, k: Engine(ctx.target, ctx.model_drafter(cut=True), draft_max=k, adaptive=True),
                needs_draft=True, cut=True, help="adaptive with the cut draft model"))
register(Method("adaptive+lookup-cut",
                lambda ctx, k: Engine(ctx.target, _composite(ctx, cut=True), draft_max=k, adaptive=True),
                needs_draft=True, cut=True, help="adaptive+lookup with the cut draft model"))


# -- predicted outputs and history drafting (the code_edit_predicted and repeated suites) -------------------------
def _history():
    from ..drafters.history import HistoryDrafter

    return HistoryDrafter()


def _free_chain(ctx):
    from ..drafters.composite import CompositeDrafter

    return CompositeDrafter(_history(), _lookup(ctx))


register(Method("history", lambda ctx, k: Engine(ctx.target, _history(), draft_max=4, adaptive=True), uses_k=False,
                help="history drafting (suffix trie over the prompt and earlier outputs), adaptive"))
register(Method("prediction", lambda ctx, k: Engine(ctx.target, adaptive=True), uses_prediction=True, uses_k=False,
                help="the prompt's predicted output drafted (aligned, re-anchored), adaptive; plain without one"))
register(Method("prediction+history",
                lambda ctx, k: Engine(ctx.target, _free_chain(ctx), draft_max=4, adaptive=True),
                uses_prediction=True, uses_k=False, help="prediction, then history, then lookup (all free), adaptive"))
register(Method("composed", lambda ctx, k: Engine(ctx.target, _composed(ctx), draft_max=k, adaptive=True),
                uses_prediction=True, needs_draft=True,
                help="prediction, then history, then lookup, then the draft model, adaptive"))


def _composed(ctx):
    from ..drafters.composite import CompositeDrafter

    return CompositeDrafter(_history(), _lookup(ctx), ctx.model_drafter())


def _self_spec(ctx):
    """The target's own first layers: --self-spec-exit when given, else --self-spec-config's calibration, else
    the saved one, else the SelfSpecDrafter default (half the layers)."""
    from ..calibrate import _describe, load_config
    from ..drafters.selfspec import SelfSpecDrafter

    target, exit_layer = ctx.torch(), ctx.options.get("self_spec_exit")
    config = ctx.options.get("self_spec_config")
    if exit_layer is not None:
        d, source = SelfSpecDrafter(target, exit_layer=exit_layer, p_min=ctx.draft_p_min), "--self-spec-exit"
    else:
        source = (config if config else "calibration" if load_config(target)
                  else "default (no calibration: run `speculant calibrate`)")
        d = SelfSpecDrafter.from_config(target, config, p_min=ctx.draft_p_min)
    n = target.n_layers
    ctx.notes["self-spec"] = f"{len(d.layers)}/{n} layers ({_describe(d.layers, n)}), from {source}"
    return d


register(Method("plain-torch", lambda ctx, k: Engine(ctx.torch()), uses_k=False, backend="torch",
                help="target alone on the torch backend (the baseline of torch-target methods)"))
register(Method("self-spec", lambda ctx, k: Engine(ctx.torch(), _self_spec(ctx), draft_max=k), backend="torch",
                help="torch target drafts with its own first layers (calibrated, or --self-spec-exit)"))
register(Method("mixed", lambda ctx, k: Engine(ctx.torch(), ctx.model_drafter(ctx.torch()), draft_max=k),
                needs_draft=True, cost="draft_model", backend="torch",
                help="torch target, draft model (-md) on llama.cpp"))


@dataclass(frozen=True)
class Variant:
    label: str  # "plain", "draft-k4", ...
    method: Method
    k: int  # draft length (0 for plain)


def parse_list(text: str, kind: type, flag: str) -> list:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise SettingsError(f"{flag} needs at least one value")
    try:
        return [kind(s) for s in items]
    except ValueError:
        raise SettingsError(f"{flag}: expected comma-separated {kind.__name__} values, got {text!r}") from None


def _split_k(name: str) -> tuple[str, Optional[int]]:
    """'adaptive-k4' -> ('adaptive', 4): one variant with its own k; a plain method name -> (name, None)."""
    base, sep, k = name.rpartition("-k")
    if sep and base in METHODS and METHODS[base].uses_k and k.isdigit() and name not in METHODS:
        return base, int(k)
    return name, None


def expand(method_names: list[str], draft_max: list[int]) -> list[Variant]:
    """Method names x draft lengths -> variants; 'plain' is always included, first, and 'plain-torch' after
    it when any method runs the target on the torch backend. A name with its k ("adaptive-k4") is that one
    variant, whatever --draft-max says."""
    split = [_split_k(m) for m in method_names]
    unknown = [m for m, _ in split if m not in METHODS]
    if unknown:
        raise SettingsError(f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"known: {', '.join(METHODS)} (a method taking k may name it: draft-k4)")
    for k in list(draft_max) + [k for _, k in split if k is not None]:
        if k < 1:
            raise SettingsError(f"--draft-max values must be >= 1, got {k}")
    baselines = ["plain"] + (["plain-torch"] if any(METHODS[m].backend == "torch" for m, _ in split) else [])
    out = [Variant(name, METHODS[name], 0) for name in baselines]
    for name, k in split:
        m = METHODS[name]
        if name in baselines:
            continue
        for kk in ([k] if k is not None else dict.fromkeys(draft_max)) if m.uses_k else [0]:
            label = f"{name}-k{kk}" if m.uses_k else name
            if label not in [v.label for v in out]:
                out.append(Variant(label, m, kk))
    return out
