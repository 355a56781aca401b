"""A JSON schema's string `pattern` as GBNF for the JSON string literal whose value matches it.

The regular expression is parsed with Python's own parser (`re._parser`), then written character set by
character set in the form a JSON string needs: `"` and `\\` as their escapes, control characters as theirs (in
sets given one by one) or left out (in `.` and negated sets: a narrower answer, never an invalid one). As in
JSON Schema (ECMA-262), `\\d` and `\\w` are ASCII sets, `\\s` holds Unicode's white space too, and a pattern not
anchored with `^`/`$` may match anywhere in the string. What a grammar cannot hold (back-references, look-arounds, inline flags) is refused.
"""

from __future__ import annotations

from re import _constants as C
from re import _parser
from re import error as RegexError

from .errors import SettingsError

DIGIT = [(0x30, 0x39)]
WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
# ECMA-262's \s: white space and line terminators, Unicode's among them (\S must not take a no-break space)
SPACE = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
         (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
CATEGORIES = {C.CATEGORY_DIGIT: (DIGIT, False), C.CATEGORY_NOT_DIGIT: (DIGIT, True),
              C.CATEGORY_WORD: (WORD, False), C.CATEGORY_NOT_WORD: (WORD, True),
              C.CATEGORY_SPACE: (SPACE, False), C.CATEGORY_NOT_SPACE: (SPACE, True)}
SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
# one character of a JSON string's content: anything but '"', '\' and control characters, or an escape
JSON_CHAR = '([^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4}))'
MAX_REPEAT = 2000  # llama.cpp's grammar parser: a larger count is unbounded (upper) or fails (lower)
PLAIN_NEGATED = '"\\\\\\x7F\\x00-\\x1F'  # what a negated set leaves out besides its own members


def _needs_escape(cp: int) -> bool:
    return cp in (0x22, 0x5C) or cp < 0x20 or cp == 0x7F


def _escaped(cp: int) -> str:
    """GBNF literal for how a JSON string writes code point cp when it must be escaped."""
    text = SHORT_ESCAPES.get(cp, f"\\u{cp:04x}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _class_char(cp: int) -> str:
    ch = chr(cp)
    return ch if ch.isalnum() and cp < 0x80 else (f"\\x{cp:02X}" if cp < 0x100 else f"\\u{cp:04X}" if cp < 0x10000
                                                  else f"\\U{cp:08X}")


def _literal(cp: int) -> str:
    if _needs_escape(cp):
        return _escaped(cp)
    ch = chr(cp)
    return f'"{ch}"'


def _set(ranges: list[tuple[int, int]], negated: bool) -> str:
    """GBNF for one character of the set (its JSON spelling)."""
    if negated:
        members = "".join(_class_char(lo) + ("" if lo == hi else "-" + _class_char(hi)) for lo, hi in ranges)
        alts = [f"[^{members}{PLAIN_NEGATED}]"]
        alts += [_escaped(cp) for cp in (0x22, 0x5C) if not any(lo <= cp <= hi for lo, hi in ranges)]
        return "(" + " | ".join(alts) + ")" if len(alts) > 1 else alts[0]
    plain, special = [], []
    for lo, hi in ranges:
        cp = lo
        while cp <= hi:  # cut the range around the characters JSON escapes
            if _needs_escape(cp):
                special.append(cp)
                cp += 1
                continue
            end = cp
            while end + 1 <= hi and not _needs_escape(end + 1):
                end += 1
            plain.append((cp, end))
            cp = end + 1
    alts = []
    if plain:
        alts.append("[" + "".join(_class_char(lo) + ("" if lo == hi else "-" + _class_char(hi))
                                  for lo, hi in plain) + "]")
    alts += [_escaped(cp) for cp in dict.fromkeys(special)]
    if not alts:
        raise SettingsError("the pattern has an empty character set")
    return "(" + " | ".join(alts) + ")" if len(alts) > 1 else alts[0]


def _in(items) -> str:
    ranges, negated = [], False
    for op, arg in items:
        if op is C.NEGATE:
            negated = True
        elif op is C.LITERAL:
            ranges.append((arg, arg))
        elif op is C.RANGE:
            ranges.append(arg)
        elif op is C.CATEGORY:
            cat, neg = CATEGORIES[arg]
            if neg:
                if len(items) != 1:
                    raise SettingsError("a negated class (\\D, \\W, \\S) inside [...] cannot be enforced")
                return _set(cat, True)
            ranges += cat
        else:
            raise SettingsError(f"the pattern's character set holds {op}, which cannot be enforced")
    return _set(ranges, negated)


def _sequence(items, outer: bool = False) -> str:
    """GBNF for a parsed sequence (a list of (op, arg)); anchors are taken off by the caller."""
    out = []
    for op, arg in items:
        if op is C.LITERAL:
            out.append(_literal(arg))
        elif op is C.NOT_LITERAL:
            out.append(_set([(arg, arg)], True))
        elif op is C.ANY:
            out.append(_set([(0x0A, 0x0A)], True))
        elif op is C.IN:
            out.append(_in(arg))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
            lo, hi, sub = arg
            if max(lo, 0 if hi is C.MAXREPEAT else hi) > MAX_REPEAT:
                raise SettingsError(f"a count above {MAX_REPEAT} in the pattern cannot be enforced (llama.cpp's "
                                    f"grammars take at most {MAX_REPEAT})")
            body = _sequence(sub)
            body = body if len(sub) == 1 and sub[0][0] in (C.LITERAL, C.IN, C.ANY, C.SUBPATTERN) else f"({body})"
            if hi is C.MAXREPEAT:
                out.append(body + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}"))
            else:
                out.append(body + ("?" if (lo, hi) == (0, 1) else f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"))
        elif op in (C.SUBPATTERN, C.ATOMIC_GROUP):
            sub = arg[-1] if op is C.SUBPATTERN else arg
            if op is C.SUBPATTERN and (arg[1] or arg[2]):
                raise SettingsError("inline flags in the pattern cannot be enforced")
            out.append("(" + (_sequence(sub) or '""') + ")")
        elif op is C.BRANCH:
            out.append("(" + " | ".join(_sequence(alt) or '""' for alt in arg[1]) + ")")
        elif op is C.AT:
            raise SettingsError("an anchor (^, $, \\b) inside the pattern cannot be enforced; only ^ at its start "
                                "and $ at its end")
        else:  # GROUPREF, ASSERT, ASSERT_NOT, GROUPREF_EXISTS
            raise SettingsError(f"the pattern uses {str(op).lower()} (a back-reference or look-around), which a "
                                f"grammar cannot enforce")
    return " ".join(out)


def _alternative(items) -> str:
    """One top-level alternative: anchored where it says so, else open to any text on that side."""
    items = list(items)
    start = bool(items) and items[0] == (C.AT, C.AT_BEGINNING) or items[:1] == [(C.AT, C.AT_BEGINNING_STRING)]
    end = bool(items) and items[-1][0] is C.AT and items[-1][1] in (C.AT_END, C.AT_END_STRING)
    core = _sequence(items[int(start):len(items) - int(end)])
    parts = ([] if start else [JSON_CHAR + "*"]) + ([core] if core else []) + ([] if end else [JSON_CHAR + "*"])
    return " ".join(parts) or '""'


def pattern_body(pattern: str) -> str:
    """GBNF for the content (between the quotes) of a JSON string whose value matches pattern."""
    try:
        parsed = _parser.parse(pattern)
    except (RegexError, RecursionError) as e:
        raise SettingsError(f"'pattern' {pattern!r} is not a regular expression: {e}") from None
    if parsed.state.flags & ~C.SRE_FLAG_UNICODE:
        raise SettingsError("inline flags in the pattern ((?i), (?s), ...) cannot be enforced")
    items = list(parsed)
    if len(items) == 1 and items[0][0] is C.BRANCH:
        return "(" + " | ".join(_alternative(alt) for alt in items[0][1][1]) + ")"
    if len(items) == 2 and items[0] == (C.AT, C.AT_BEGINNING) and items[1][0] is C.BRANCH:
        # "^a$|^b$": the parser takes the shared ^ out in front of the alternatives
        return "(" + " | ".join(_alternative([items[0], *alt]) for alt in items[1][1][1]) + ")"
    return _alternative(items)
