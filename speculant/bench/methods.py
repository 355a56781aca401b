"""The method registry: a benchmark method name -> how to build its Engine around the shared target.

Adding a method is one entry in METHODS (or one `register(...)` call from another module), e.g.

    register(Method("lookup", lambda ctx, k: Engine(ctx.target, LookupDrafter(), draft_max=k),
                    uses_k=True, needs_draft=False, cost="in_run", help="prompt lookup (n-gram)"))

Every engine wraps the SAME loaded target backend (engines are cheap; models load once). A builder must
not close anything: the runner closes the backends at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from ..backends.base import Backend
from ..engine import Engine
from ..errors import SettingsError


@dataclass
class MethodContext:
    target: Backend
    draft: Optional[Backend]  # the draft model, loaded once when any method needs it
    draft_p_min: float = 0.0
    options: dict = field(default_factory=dict)  # free-form settings for future methods

    def model_drafter(self):
        from ..drafters.model import ModelDrafter

        if self.draft is None:
            raise SettingsError("this method needs a draft model: pass -md")
        return ModelDrafter(self.draft, self.target.n_vocab, p_min=self.draft_p_min)


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


def _composite(ctx):
    from ..drafters.composite import CompositeDrafter

    return CompositeDrafter(_lookup(ctx), ctx.model_drafter())


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


def expand(method_names: list[str], draft_max: list[int]) -> list[Variant]:
    """Method names x draft lengths -> variants; 'plain' is always included, first."""
    unknown = [m for m in method_names if m not in METHODS]
    if unknown:
        raise SettingsError(f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"known: {', '.join(METHODS)}")
    for k in draft_max:
        if k < 1:
            raise SettingsError(f"--draft-max values must be >= 1, got {k}")
    names = ["plain"] + [m for m in dict.fromkeys(method_names) if m != "plain"]
    out = []
    for name in names:
        m = METHODS[name]
        if m.uses_k:
            out += [Variant(f"{name}-k{k}", m, k) for k in dict.fromkeys(draft_max)]
        else:
            out.append(Variant(name, m, 0))
    return out
