"""Fill in the middle (code completion at a cursor, as editor plugins ask for it), plain against speculative.

Each case cuts a span of lines out of one of the package's sample source files (speculant/data/code) and asks
the target to write it back between the text before and after (Engine.fim_prompt, Qwen2.5-Coder's FIM tokens).
Three engines over one target, interleaved case by case (the order rotates): plain decoding, the draft model
(adaptive), and prompt lookup then the draft model (adaptive; lookup copies from the prefix and suffix).
Greedy; every speculative output must equal plain decoding's (checked). Prints tokens/s per case, the
speedup of the totals, and a JSON line.
Usage: python docs/bench/fim/fim_bench.py [max tokens per case (default 64)] [cases per file (default 3)]
"""
import json
import sys
import time
from importlib.resources import files

from speculant import models
from speculant.api import load_backend, load_drafter
from speculant.engine import Engine


def cases(per_file: int):
    """(name, prefix, suffix): per file, spans of 3 lines cut at evenly spaced places past the header."""
    out = []
    for path in sorted(files("speculant").joinpath("data/code").iterdir()):
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for j in range(per_file):
            at = 8 + (len(lines) - 16) * (j + 1) // (per_file + 1)
            out.append((f"{path.name}:{at}", "".join(lines[:at]), "".join(lines[at + 3:])))
    return out


def main(max_tokens=64, per_file=3):
    target = load_backend(models.DEFAULT_TARGET, n_ctx=4096, threads=2)
    engines = {"plain": Engine(target),
               "draft": Engine(target, load_drafter(target, models.DEFAULT_DRAFT, threads=2), draft_max=4,
                               adaptive=True)}
    engines["lookup+draft"] = Engine(target, load_drafter(target, models.DEFAULT_DRAFT, lookup=True, threads=2),
                                     draft_max=4, adaptive=True)
    totals = {name: [0, 0.0] for name in engines}
    rows = []
    for i, (name, prefix, suffix) in enumerate(cases(per_file)):
        prompt = engines["plain"].fim_prompt(prefix, suffix)
        order = list(engines)[i % 3:] + list(engines)[:i % 3]
        got = {}
        for way in order:
            target.rewind(0)  # each engine processes the prompt itself (prefill is not timed below)
            r = engines[way].generate(prompt, max_tokens=max_tokens)
            got[way] = r
            totals[way][0] += r.stats.generated_tokens
            totals[way][1] += r.stats.decode_time
        assert all(got[w].tokens == got["plain"].tokens for w in got), f"{name}: speculative output differs"
        rows.append({"case": name, "prompt_tokens": len(prompt), "tokens": len(got["plain"].tokens),
                     **{w: round(got[w].stats.tokens_per_s, 2) for w in got},
                     "accepted": {w: [got[w].stats.accepted, got[w].stats.drafted] for w in got if w != "plain"}})
        print(f"{name:22s} {len(prompt):5d} prompt tokens, {len(got['plain'].tokens):3d} written: "
              + ", ".join(f"{w} {got[w].stats.tokens_per_s:6.2f} tok/s" for w in engines)
              + f"  (lookup+draft accepted {got['lookup+draft'].stats.accepted}/{got['lookup+draft'].stats.drafted})",
              flush=True)
    speed = {w: t[0] / t[1] for w, t in totals.items()}
    print("totals: " + ", ".join(f"{w} {s:.2f} tok/s ({s / speed['plain']:.2f}x)" for w, s in speed.items())
          + "; outputs identical to plain: yes")
    print(json.dumps({"max_tokens": max_tokens, "cases": rows,
                      "tokens_per_s": {w: round(s, 2) for w, s in speed.items()}}))


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
