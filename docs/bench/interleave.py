"""The loop the case-by-case benchmarks here share: engines over one target, interleaved, outputs checked.

Used by fim/fim_bench.py and infill/infill_bench.py (they put this folder on sys.path).
"""
import dataclasses
import json


def run_interleaved(engines: dict, target, cases: list[tuple[str, list[int]]], max_tokens: int,
                    params=None) -> dict:
    """Every (name, prompt tokens) case through every engine, the order rotating case by case (the machine's
    load drifts). Each engine processes the prompt itself; only decoding is timed (stats.decode_time). Every
    output must equal the first engine's (plain decoding), token for token. Prints a line per case, the totals'
    speedups over the first engine and a JSON line; returns that JSON's dict. params: the sampling settings
    (default greedy); a seeded one is seeded anew per case (its seed + the case's index), so that the outputs
    are still one function of the rows, whatever is drafted."""
    names = list(engines)
    first = names[0]
    totals = {name: [0, 0.0] for name in names}
    rows = []
    for i, (case, prompt) in enumerate(cases):
        got = {}
        for way in names[i % len(names):] + names[:i % len(names)]:
            target.rewind(0)
            kw = {} if params is None else {"params": params if params.seed is None else
                                            dataclasses.replace(params, seed=params.seed + i)}
            r = engines[way].generate(prompt, max_tokens=max_tokens, **kw)
            got[way] = r
            totals[way][0] += r.stats.generated_tokens
            totals[way][1] += r.stats.decode_time
        assert all(got[w].tokens == got[first].tokens for w in got), f"{case}: speculative output differs"
        rows.append({"case": case, "prompt_tokens": len(prompt), "tokens": len(got[first].tokens),
                     **{w: round(got[w].stats.tokens_per_s, 2) for w in names},
                     "accepted": {w: [got[w].stats.accepted, got[w].stats.drafted] for w in names if w != first}})
        print(f"{case:22s} {len(prompt):5d} prompt tokens, {len(got[first].tokens):3d} written: "
              + ", ".join(f"{w} {got[w].stats.tokens_per_s:6.2f}" for w in names) + " tok/s"
              + "  (accepted/drafted: " + ", ".join(f"{w} {got[w].stats.accepted}/{got[w].stats.drafted}"
                                                    for w in names if w != first) + ")", flush=True)
    speed = {w: t[0] / t[1] for w, t in totals.items()}
    print("totals: " + ", ".join(f"{w} {s:.2f} tok/s ({s / speed[first]:.2f}x)" for w, s in speed.items())
          + f"; outputs identical to {first}: yes")
    out = {"max_tokens": max_tokens, "cases": rows, "tokens_per_s": {w: round(s, 2) for w, s in speed.items()}}
    print(json.dumps(out))
    return out
