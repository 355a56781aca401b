"""Fill in the middle (code completion at a cursor, as editor plugins ask for it), plain against speculative.

Each case cuts a span of lines out of one of the package's sample source files (speculant/data/code) and asks
the target to write it back between the text before and after (Engine.fim_prompt, Qwen2.5-Coder's FIM tokens).
Three engines over one target, interleaved case by case (the order rotates): plain decoding, the draft model
(adaptive), and prompt lookup then the draft model (adaptive; lookup copies from the prefix and suffix).
Greedy; every speculative output must equal plain decoding's (checked). Prints tokens/s per case, the
speedup of the totals, and a JSON line.
Usage: python docs/bench/fim/fim_bench.py [max tokens per case (default 64)] [cases per file (default 3)]
"""
import sys
from importlib.resources import files
from pathlib import Path

from speculant import models
from speculant.api import load_backend, load_drafter
from speculant.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from interleave import run_interleaved  # noqa: E402


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
    todo = [(name, engines["plain"].fim_prompt(prefix, suffix)) for name, prefix, suffix in cases(per_file)]
    run_interleaved(engines, target, todo, max_tokens)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
