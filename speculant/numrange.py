"""GBNF for the JSON numbers between two bounds, digit by digit: what `minimum`/`maximum`/`exclusive*` of a JSON
schema allow, as a grammar (no value lists, any size of range, either side open).

Integers are written canonically (`-?(0|[1-9][0-9]*)`). Bounded non-integers are written without an exponent
(`-?(0|[1-9][0-9]*)(.[0-9]+)?`): a narrower form of JSON's number, so every answer is valid JSON inside the
bounds, and every value inside them can be written (an exponent only spells the same values otherwise). `-0` is
not written (`0` is). A bound is read as the decimal its JSON text spells (0.1 is 1/10, not the float nearest it).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Optional

ANY_FRACTION = '("." [0-9]+)?'


def _alternatives(alts: list[str]) -> Optional[str]:
    alts = [a for a in alts if a is not None]
    if not alts:
        return None
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


def _same_length(lo: str, hi: str) -> str:
    """Digit strings of lo's length from lo to hi (lo <= hi, equally long)."""
    if not lo:
        return '""'
    rest = len(lo) - 1
    any_rest = f" [0-9]{{{rest}}}" if rest else ""
    if lo[0] == hi[0]:
        return f'"{lo[0]}"' + (" " + _same_length(lo[1:], hi[1:]) if rest else "")
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        return f"[{lo[0]}-{hi[0]}]" + any_rest
    alts = [f'"{lo[0]}" ' + _same_length(lo[1:], "9" * rest)]
    if int(hi[0]) - int(lo[0]) >= 2:
        alts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]" + any_rest)
    alts.append(f'"{hi[0]}" ' + _same_length("0" * rest, hi[1:]))
    return _alternatives(alts)


def naturals(lo: int, hi: Optional[int]) -> str:
    """The integers lo..hi (hi None: no end), 0 <= lo <= hi, canonically written."""
    alts = []
    last = len(str(hi)) if hi is not None else len(str(lo))
    for digits in range(len(str(lo)), last + 1):
        first = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        end = 10 ** digits - 1 if hi is None else min(hi, 10 ** digits - 1)
        if first <= end:
            alts.append(_same_length(str(first), str(end)))
    if hi is None:  # every number with more digits than lo is above it
        alts.append(f"[1-9] [0-9]{{{len(str(lo))},}}")
    return _alternatives(alts)


def integers(lo: Optional[int], hi: Optional[int]) -> str:
    """The integers lo..hi, either side open (None), lo <= hi."""
    alts = []
    if hi is None or hi >= 0:
        alts.append(naturals(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:  # "-" and the magnitudes max(-hi, 1)..-lo
        alts.append('"-" ' + naturals(max(-hi, 1) if hi is not None else 1, -lo if lo is not None else None))
    return _alternatives(alts)


# Fractions: digit strings D after the point compared as the values 0.D; a bound's fraction f is a digit string
# without trailing zeros ("" for 0). "Tails" may be empty (no more digits: the value so far).

def _digits_at_least(f: str, strict: bool) -> str:
    """Non-empty D with 0.D >= 0.f (strict: >); never empty, since 0.999... passes any f < 1."""
    if not f:
        return '"0"* [1-9] [0-9]*' if strict else "[0-9]+"
    d = int(f[0])
    alts = [f"[{d + 1}-9] [0-9]*"] if d < 9 else []
    alts.append(f'"{d}" ' + (_digits_at_least(f[1:], strict) if f[1:] else
                             ('"0"* [1-9] [0-9]*' if strict else "[0-9]*")))
    return _alternatives(alts)


def _digits_at_most(f: str, strict: bool) -> Optional[str]:
    """Non-empty D with 0.D <= 0.f (strict: <); None when there is none (f = 0, strict)."""
    if not f:
        return None if strict else '"0"+'
    d = int(f[0])
    alts = [f"[0-{d - 1}] [0-9]*"] if d > 0 else []
    if f[1:]:
        alts.append(f'"{d}" ({_digits_at_most(f[1:], strict)})?')  # f[1:] > 0: the digit alone is below
    elif not strict:
        alts.append(f'"{d}" "0"*')
    return _alternatives(alts)


def _digits_between(lo: str, lo_strict: bool, hi: str, hi_strict: bool) -> Optional[str]:
    """Non-empty D with 0.lo <= 0.D <= 0.hi (each side strict or not), 0.lo <= 0.hi."""
    if not hi:  # both 0
        return None if lo_strict or hi_strict else '"0"+'
    l0, h0 = (int(lo[0]) if lo else 0), int(hi[0])
    if l0 == h0:
        tail = _between_tail(lo[1:], lo_strict, hi[1:], hi_strict)
        return None if tail is None else f'"{l0}" ' + tail
    alts = [f'"{l0}" ' + (_digits_at_least(lo[1:], lo_strict) if lo[1:] else
                          ('"0"* [1-9] [0-9]*' if lo_strict else "[0-9]*"))]
    if h0 - l0 >= 2:
        alts.append(f"[{l0 + 1}-{h0 - 1}] [0-9]*")
    if hi[1:]:
        alts.append(f'"{h0}" ({_digits_at_most(hi[1:], hi_strict)})?')
    elif not hi_strict:
        alts.append(f'"{h0}" "0"*')
    return _alternatives(alts)


def _between_tail(lo: str, lo_strict: bool, hi: str, hi_strict: bool) -> Optional[str]:
    """Possibly empty D with 0.lo <= 0.D <= 0.hi."""
    empty_ok = not lo and not lo_strict and (bool(hi) or not hi_strict)
    more = _digits_between(lo, lo_strict, hi, hi_strict)
    if more is None:
        return '""' if empty_ok else None
    return f"({more})?" if empty_ok else more


def _fraction(digits: Optional[str], none_ok: bool) -> Optional[str]:
    """The part after an integer: '.' and digits, or nothing where none_ok; None when neither."""
    if digits is None:
        return '""' if none_ok else None
    return f'("." {digits})?' if none_ok else f'"." {digits}'


def _split(d: Decimal) -> tuple[int, str]:
    whole, _, frac = format(d, "f").partition(".")
    return int(whole), frac.rstrip("0")


def _at_least_zero(lo: Decimal, lo_strict: bool, hi: Optional[Decimal], hi_strict: bool) -> Optional[str]:
    """Numbers x >= 0 with lo <= x <= hi (each side strict or not; hi None: no end), lo >= 0."""
    li, lf = _split(lo)
    ge = _fraction(_digits_at_least(lf, lo_strict), not lf and not lo_strict)
    if hi is None:
        return _alternatives([f'"{li}" ' + ge, naturals(li + 1, None) + " " + ANY_FRACTION])
    hi_i, hf = _split(hi)
    if li == hi_i:
        between = _fraction(_digits_between(lf, lo_strict, hf, hi_strict),
                            not lf and not lo_strict and (bool(hf) or not hi_strict))
        return None if between is None else f'"{li}" ' + between
    le = _fraction(_digits_at_most(hf, hi_strict), bool(hf) or not hi_strict)
    alts = [f'"{li}" ' + ge]
    if hi_i - li >= 2:
        alts.append(naturals(li + 1, hi_i - 1) + " " + ANY_FRACTION)
    if le is not None:
        alts.append(f'"{hi_i}" ' + le)
    return _alternatives(alts)


def decimals(lo: Optional[Decimal], lo_strict: bool, hi: Optional[Decimal], hi_strict: bool) -> Optional[str]:
    """Numbers between lo and hi (None: open; strict: the bound itself excluded), without an exponent; None when
    nothing lies between."""
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_strict or hi_strict))):
        return None
    alts = []
    if hi is None or hi > 0 or (hi == 0 and not hi_strict):
        alts.append(_at_least_zero(lo, lo_strict, hi, hi_strict) if lo is not None and lo >= 0 else
                    _at_least_zero(Decimal(0), False, hi, hi_strict))
    if lo is None or lo < 0:  # "-" and the magnitudes, above -hi (or 0) up to -lo
        low, low_strict = (-hi, hi_strict) if hi is not None and hi < 0 else (Decimal(0), True)
        magnitudes = _at_least_zero(low, low_strict, -lo if lo is not None else None, lo_strict)
        alts.append(None if magnitudes is None else '"-" ' + magnitudes)
    return _alternatives(alts)
