"""Code completion at a cursor as editor plugins ask llama-server's /infill for it, plain against speculative.

Each case takes one of the package's sample source files (speculant/data/code), cuts out 3 lines and puts the
cursor in the middle of the first of them, as if the user were typing it: the prompt is Engine.infill_prompt's
(the one /infill builds) with the text before the cursor as prefix and middle (the cursor's line), the text
after the cut as suffix, and the other sample files of the same language as input_extra chunks (the files an
editor has open; llama.vim sends chunks of them). Four engines over one target, interleaved case by case (the
order rotates): plain decoding, prompt lookup (which copies from the other files as well as from around the
cursor), the draft model, and lookup then the draft model (the draft ones adaptive). Greedy; every speculative
output must equal plain decoding's (checked). Prints tokens/s per case, the totals' speedups and a JSON line.
Usage: python docs/bench/infill/infill_bench.py [max tokens per case (default 64)] [cases per file (default 3)]
[vim: sample as llama.vim asks (top-k 40, top-p 0.9, then llama.cpp's infill sampler, temperature 1), seeded
per case (the seed couples the draws: outputs must still be plain decoding's)]
"""
import sys
from importlib.resources import files
from pathlib import Path

from speculant import models
from speculant.api import load_backend, load_drafter
from speculant.engine import Engine
from speculant.verify import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from interleave import run_interleaved  # noqa: E402


def cases(per_file: int):
    """(name, prefix, middle, suffix, extra): per file, 3-line gaps at evenly spaced places past the header, the
    cursor halfway into the gap's first line; extra: the other files with the same extension."""
    paths = sorted(files("speculant").joinpath("data/code").iterdir(), key=lambda p: p.name)
    out = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        extra = [(p.name, p.read_text(encoding="utf-8")) for p in paths
                 if p.name != path.name and p.suffix == path.suffix]
        for j in range(per_file):
            at = 8 + (len(lines) - 16) * (j + 1) // (per_file + 1)
            line = lines[at]
            indent = len(line) - len(line.lstrip())
            cursor = indent + (len(line) - indent) // 2
            out.append((f"{path.name}:{at}", "".join(lines[:at]), line[:cursor], "".join(lines[at + 3:]), extra))
    return out


def main(max_tokens=64, per_file=3, vim=False):
    target = load_backend(models.DEFAULT_TARGET, n_ctx=4096, threads=2)
    engines = {"plain": Engine(target),
               "lookup": Engine(target, load_drafter(target, "lookup"), draft_max=4, adaptive=True),
               "draft": Engine(target, load_drafter(target, models.DEFAULT_DRAFT, threads=2), draft_max=4,
                               adaptive=True),
               "lookup+draft": Engine(target, load_drafter(target, models.DEFAULT_DRAFT, lookup=True, threads=2),
                                      draft_max=4, adaptive=True)}
    todo = []
    for name, prefix, middle, suffix, extra in cases(per_file):
        prompt, cut = engines["plain"].infill_prompt(prefix, suffix, extra=extra, middle=middle,
                                                     room=max_tokens)
        assert not cut
        todo.append((name, prompt))
    params = None
    if vim:  # llama.vim's request: "samplers": ["top_k", "top_p", "infill"], top_k 40, top_p 0.90
        params = SamplingParams(1.0, top_k=40, top_p=0.9, seed=0, infill=target.infill_vocab(), infill_after="top_p")
    run_interleaved(engines, target, todo, max_tokens, params)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*(int(a) for a in args if a != "vim"), vim="vim" in args)
