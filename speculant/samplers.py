"""llama.cpp's sampler chain (common/sampling.cpp): the names and characters its `--samplers`, `--sampling-seq` and
llama-server's "samplers" field take, and the SamplingParams a chain means here.

speculant applies the penalties, top-k, top-p, min-p and the temperature in that order (verify.adjust_logits, then
probs_from_logits), and llama.cpp's infill sampler anywhere after the penalties (verify.infill_keep). A chain
runs only what it lists: a sampler left out does nothing (the temperature left out samples at 1, as llama.cpp's
chain then does). An order that would give another distribution is refused, never silently changed."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

from .errors import SettingsError
from .verify import INFILL_STAGES, InfillVocab, SamplingParams

# llama.cpp's default chain, its samplers' one-character names, and the names and aliases it reads
LLAMA_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                 "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill", "a": "adaptive_p"}
SAMPLER_NAMES = {**{name: name for name in SAMPLER_CHARS.values()},
                 **{name.replace("_", sep): name for name in SAMPLER_CHARS.values() if "_" in name
                    for sep in ("-", "")},
                 "nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
OUR_ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")  # the order speculant applies them in


def from_names(names: Iterable[str], unknown: Optional[Callable[[str], None]] = None) -> tuple[str, ...]:
    """A chain of names (any case, llama.cpp's aliases; spaces are part of a name, as there); ones it does not
    know are skipped, as it skips them (unknown(name) is told, as it warns)."""
    names = list(names)
    for name in names:
        if name.lower() not in SAMPLER_NAMES and unknown is not None:
            unknown(name)
    return _supported(tuple(SAMPLER_NAMES[n.lower()] for n in names if n.lower() in SAMPLER_NAMES))


def from_chars(chars: str) -> tuple[str, ...]:
    """A chain of one character each ("kpt"); unknown characters are skipped, as llama.cpp skips them."""
    return _supported(tuple(SAMPLER_CHARS[c] for c in chars if c in SAMPLER_CHARS))


def _supported(chain: tuple[str, ...]) -> tuple[str, ...]:
    if "adaptive_p" in chain:  # it picks the token itself, in place of the distribution's draw
        raise SettingsError("the adaptive-p sampler is not supported; leave it out of the samplers")
    return chain


def in_chain(params: SamplingParams, chain: tuple[str, ...],
             infill_vocab: Optional[Callable[[], InfillVocab]] = None) -> SamplingParams:
    """params as llama.cpp's chain applies them (see the module's docstring); samplers speculant lacks are the
    caller's to check (they pass when left out of the chain or at their neutral values). The infill sampler may
    come anywhere after the penalties, once: SamplingParams.infill, read after the active sampler before it;
    infill_vocab() gives the target's vocabulary."""
    if chain == LLAMA_SAMPLERS:
        return params
    off = {"penalties": dict(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0),
           "top_k": dict(top_k=0), "top_p": dict(top_p=1.0), "min_p": dict(min_p=0.0),
           "temperature": dict(temperature=1.0)}
    params = dataclasses.replace(params, **{k: v for name, kw in off.items() if name not in chain
                                            for k, v in kw.items()})
    active = {"penalties": (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                            or params.frequency_penalty != 0.0),
              "top_k": params.top_k > 0, "top_p": params.top_p < 1.0, "min_p": params.min_p > 0.0,
              "temperature": params.temperature != 1.0}  # greedy too: after the penalties it would skip them
    order = [name for name in chain if active.get(name)]
    if len(order) != len(set(order)) or order != sorted(order, key=OUR_ORDER.index):
        raise SettingsError(f"samplers {', '.join(order)} in this order are not supported; speculant applies "
                            f"{', '.join(OUR_ORDER)} in that order (llama.cpp's default)")
    if "infill" in chain:
        if chain.count("infill") > 1:
            raise SettingsError("the infill sampler is listed more than once; speculant applies it once")
        if infill_vocab is None:
            raise SettingsError("the infill sampler is not available here")
        before = [name for name in chain[:chain.index("infill")] if active.get(name)]
        if active["penalties"] and "penalties" not in before:  # speculant applies them to the logits first
            raise SettingsError("the infill sampler before the penalties is not supported; list it after them")
        before = [name for name in before if name in INFILL_STAGES]
        params = dataclasses.replace(params, infill=infill_vocab(), infill_after=before[-1] if before else "")
    return params
