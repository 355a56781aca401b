"""The benchmark harness: statistics on hand-made rows, suite readers, the method registry, and one tiny
end-to-end run on SmolLM2 (its own draft) that writes every output file. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from speculant import models
from speculant.bench import METHODS, Method, read_suite, register, select
from speculant.bench import stats as bstats
from speculant.bench.methods import expand, parse_list
from speculant.bench.report import markdown
from speculant.bench.suite import BUILTIN_SUITE
from speculant.errors import SettingsError

FIXTURE = Path(__file__).parent / "fixtures" / "spec_bench_small.jsonl"
SMALL = "smollm2-135m-instruct"


def row(pid, cat, variant, tps, *, k=0, drafted=0, accepted=0, gen=10, calls=10, d_pos=(), a_pos=(),
        temp=0.0, rep=0, draft_s=0.0, cost="in_run", greedy_equal=None):
    return {"prompt_id": pid, "category": cat, "variant": variant, "method": variant.split("-")[0], "k": k,
            "temp": temp, "repeat": rep, "tokens_per_s": tps, "generated_tokens": gen, "drafted": drafted,
            "accepted": accepted, "target_calls": calls, "drafted_by_position": list(d_pos),
            "accepted_by_position": list(a_pos), "draft_s": draft_s, "cost": cost, "greedy_equal": greedy_equal}


COSTS = {"target_ms": {"1": 10.0, "2": 12.0, "3": 14.0, "4": 16.0, "5": 20.0},
         "V": {"1": 1.0, "2": 1.2, "3": 1.4, "4": 1.6, "5": 2.0}, "draft_step_ms": 1.0, "c": 0.1}


def hand_rows():
    return [
        row("a", "qa", "plain", 10.0), row("b", "qa", "plain", 20.0), row("c", "code", "plain", 5.0),
        # draft-k2: prompt a 2x, b 1x, c 4x
        row("a", "qa", "draft-k2", 20.0, k=2, drafted=8, accepted=6, gen=10, calls=4, d_pos=[4, 4], a_pos=[4, 2],
            cost="draft_model", greedy_equal=True),
        row("b", "qa", "draft-k2", 20.0, k=2, drafted=4, accepted=1, gen=10, calls=6, d_pos=[2, 2], a_pos=[1, 0],
            cost="draft_model", greedy_equal=False),
        row("c", "code", "draft-k2", 20.0, k=2, drafted=6, accepted=5, gen=12, calls=4, d_pos=[3, 3], a_pos=[3, 2],
            cost="draft_model", greedy_equal=True),
    ]


def by(summary, variant, category):
    (s,) = [r for r in summary if r["variant"] == variant and r["category"] == category]
    return s


def test_expected_tokens_and_predicted_speedup():
    assert bstats.expected_tokens(0.5, 3) == pytest.approx((1 - 0.5 ** 4) / 0.5)
    assert bstats.expected_tokens(1.0, 4) == 5.0
    assert bstats.expected_tokens(0.0, 4) == 1.0
    assert bstats.expected_tokens(0.7, 0) == 1.0
    # E / (k c + V(k+1)): alpha 0.5, k 3, c 0.1, V(4) 1.6
    assert bstats.predicted_speedup(0.5, 3, 0.1, 1.6) == pytest.approx(1.875 / (0.3 + 1.6))
    # costly drafts or a costly verify pass predict a slowdown
    assert bstats.predicted_speedup(0.5, 4, 1.0, 1.0) < 1.0


def test_verify_cost_interpolates_and_extrapolates():
    assert bstats.verify_cost(COSTS, 3) == pytest.approx(1.4)
    assert bstats.verify_cost(COSTS, 7) == pytest.approx(2.0 + 0.4 * 2)  # slope of the last two points
    gappy = {"V": {"1": 1.0, "3": 2.0}}
    assert bstats.verify_cost(gappy, 2) == pytest.approx(1.5)


def test_summary_speedup_is_ratio_of_means_with_quartiles():
    s = bstats.summarize(hand_rows(), COSTS)
    overall = by(s, "draft-k2", "overall")
    # Spec-Bench: mean method tokens/s over mean plain tokens/s, not the mean of the ratios
    assert overall["speedup"] == pytest.approx(20.0 / (35.0 / 3))
    assert overall["n_prompts"] == 3
    ratios = [2.0, 1.0, 4.0]
    assert overall["ratio_median"] == pytest.approx(2.0)
    assert overall["ratio_q1"] == pytest.approx(np.percentile(ratios, 25))
    assert overall["ratio_q3"] == pytest.approx(np.percentile(ratios, 75))
    assert (overall["ratio_min"], overall["ratio_max"]) == (1.0, 4.0)
    qa = by(s, "draft-k2", "qa")
    assert qa["speedup"] == pytest.approx(20.0 / 15.0)
    assert by(s, "draft-k2", "code")["speedup"] == pytest.approx(4.0)
    assert by(s, "plain", "overall")["speedup"] == pytest.approx(1.0)
    # categories first in order of appearance, overall last
    assert [r["category"] for r in s if r["variant"] == "draft-k2"] == ["qa", "code", "overall"]


def test_summary_acceptance_tau_positions_and_greedy():
    s = bstats.summarize(hand_rows(), COSTS)
    overall = by(s, "draft-k2", "overall")
    assert overall["acceptance"] == pytest.approx(12 / 18)
    assert overall["tau"] == pytest.approx(32 / 14)  # tokens per target call
    assert overall["acceptance_by_position"] == pytest.approx([8 / 9, 4 / 9])
    assert (overall["greedy_equal"], overall["greedy_checked"]) == (2, 3)
    qa = by(s, "draft-k2", "qa")
    assert qa["acceptance"] == pytest.approx(7 / 12)
    assert qa["acceptance_by_position"] == pytest.approx([5 / 6, 2 / 6])
    # predicted: the draft-model c from the measured costs, V(3)
    a = 12 / 18
    assert overall["predicted_speedup"] == pytest.approx(bstats.expected_tokens(a, 2) / (2 * 0.1 + 1.4))
    plain = by(s, "plain", "overall")
    assert plain["acceptance"] is None and plain["predicted_speedup"] is None and plain["tau"] == 1.0
    # a method that decoded steps plainly (lookup without a match, an adaptive k = 0) drafts another mix than k
    # every step, which the formula misprices (a probe saw 2.73x predicted at tau 1.20): none predicted
    mixed = hand_rows()
    mixed[3]["plain_steps"] = 1
    assert by(bstats.summarize(mixed, COSTS), "draft-k2", "overall")["predicted_speedup"] is None
    assert by(bstats.summarize(mixed, COSTS), "draft-k2", "code")["predicted_speedup"] is not None


def _result(rows) -> dict:
    """A bench result around rows, with what the report reads beside them."""
    return {"summary": bstats.summarize(rows, COSTS), "rows": rows, "n_prompts": len({r["prompt_id"] for r in rows}),
            "machine": {}, "versions": {}, "costs": COSTS, "models": {"target": "t"},
            "settings": {"suite": "builtin", "n_predict": 8, "repeats": 1, "temps": [0.0], "top_k": 0, "top_p": 1.0,
                         "min_p": 0.0, "seed": 0, "draft_p_min": 0.0, "n_ctx": 512}}


def test_a_speedup_of_a_method_that_drafted_nothing_is_marked_as_noise():
    from speculant.bench.report import markdown

    rows = [row("a", "qa", "plain", 10.0), row("a", "qa", "adaptive-lookup", 4.0),
            row("b", "qa", "plain", 10.0), row("b", "qa", "lookup-k2", 20.0, k=2, drafted=4, accepted=3, calls=6)]
    table = [line for line in markdown(_result(rows)).splitlines() if line.startswith("| 0 |")]
    assert any("| adaptive-lookup | qa |" in line and "0.40x† |" in line for line in table), table
    assert not any("†" in line for line in table if "| plain |" in line or "| lookup-k2 |" in line), table


def test_in_run_draft_cost_and_repeats_averaged_per_prompt():
    rows = [row("a", "x", "plain", 10.0, rep=0), row("a", "x", "plain", 30.0, rep=1),
            row("a", "x", "lookup-k2", 30.0, k=2, drafted=10, accepted=5, calls=5, d_pos=[5, 5], a_pos=[4, 1],
                draft_s=0.05, rep=0),
            row("a", "x", "lookup-k2", 50.0, k=2, drafted=10, accepted=5, calls=5, d_pos=[5, 5], a_pos=[4, 1],
                draft_s=0.05, rep=1)]
    o = by(bstats.summarize(rows, COSTS), "lookup-k2", "overall")
    assert o["speedup"] == pytest.approx(40.0 / 20.0)
    assert o["n_prompts"] == 1 and o["n_rows"] == 2
    # c from the run: 0.1 s / 20 drafted = 5 ms per token = 0.5 target steps
    assert o["c"] == pytest.approx(0.5)
    assert o["predicted_speedup"] == pytest.approx(bstats.expected_tokens(0.5, 2) / (2 * 0.5 + 1.4))


def test_temperatures_are_compared_separately():
    rows = [row("a", "x", "plain", 10.0, temp=0.0), row("a", "x", "plain", 5.0, temp=0.8),
            row("a", "x", "draft-k2", 20.0, k=2, drafted=2, accepted=1, calls=1, temp=0.0),
            row("a", "x", "draft-k2", 20.0, k=2, drafted=2, accepted=1, calls=1, temp=0.8)]
    s = bstats.summarize(rows)
    got = {r["temp"]: r["speedup"] for r in s if r["variant"] == "draft-k2" and r["category"] == "overall"}
    assert got == {0.0: pytest.approx(2.0), 0.8: pytest.approx(4.0)}


def test_mark_greedy_equal():
    rows = [row("a", "x", "plain", 1.0), row("a", "x", "draft-k2", 1.0, k=2), row("a", "x", "draft-k4", 1.0, k=4),
            row("a", "x", "plain", 1.0, temp=0.8), row("a", "x", "draft-k2", 1.0, k=2, temp=0.8)]
    tokens = {("a", 0.0, 0, "plain"): [1, 2, 3], ("a", 0.0, 0, "draft-k2"): [1, 2, 3],
              ("a", 0.0, 0, "draft-k4"): [1, 2, 4], ("a", 0.8, 0, "plain"): [5], ("a", 0.8, 0, "draft-k2"): [6]}
    bstats.mark_greedy_equal(rows, tokens)  # sampled rows too: the bench's seeded draws are coupled
    assert [r["greedy_equal"] for r in rows] == [None, True, False, None, False]


def test_spec_bench_reader_first_turn_categories_limit():
    prompts = read_suite(FIXTURE)
    assert [p.id for p in prompts] == ["2", "4", "8", "10", "12", "14"]
    assert prompts[0].text == "Write a two-line poem about autumn leaves."  # first turn only
    assert prompts[2].category == "coding"
    sel = select(prompts, ["math_reasoning", "writing"], limit=1)
    assert [(p.category, p.id) for p in sel] == [("writing", "2"), ("math_reasoning", "10")]
    assert len(select(prompts, None, limit=1)) == 4  # one per category
    with pytest.raises(SettingsError, match="unknown category nope"):
        select(prompts, ["nope"])
    with pytest.raises(SettingsError, match="--limit"):
        select(prompts, None, limit=0)


def test_suite_reader_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": ["ok"]}\n{"question_id": 2, "turns": []}\n')
    with pytest.raises(SettingsError, match=r"bad.jsonl:2"):
        read_suite(bad)
    bad.write_text("not json\n")
    with pytest.raises(SettingsError, match="not valid JSON"):
        read_suite(bad)
    with pytest.raises(SettingsError, match="cannot read"):
        read_suite(tmp_path / "missing.jsonl")


def test_builtin_suite_covers_every_task_type():
    prompts = read_suite()
    assert read_suite(BUILTIN_SUITE) == prompts
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p.category] = counts.get(p.category, 0) + 1
    for cat in ("translation", "summarization", "qa", "math_reasoning", "rag", "coding", "code_editing",
                "writing", "roleplay"):
        assert counts.get(cat, 0) >= 8, cat
    assert len({p.text for p in prompts}) == len(prompts)


def test_method_registry_variants_and_errors():
    vs = expand(["draft"], [4, 8, 4])
    assert [(v.label, v.k) for v in vs] == [("plain", 0), ("draft-k4", 4), ("draft-k8", 8)]
    with pytest.raises(SettingsError, match="unknown method lookahead.*known: plain, draft"):
        expand(["plain", "lookahead"], [4])
    with pytest.raises(SettingsError, match="--draft-max"):
        expand(["draft"], [0])
    # a method may name its own k: that one variant, whatever --draft-max says
    assert [v.label for v in expand(["draft", "adaptive-k4", "lookup-k1"], [2, 3])] == \
        ["plain", "draft-k2", "draft-k3", "adaptive-k4", "lookup-k1"]
    assert [v.k for v in expand(["adaptive-k4"], [2])] == [0, 4]
    with pytest.raises(SettingsError, match="unknown method plain-k2"):
        expand(["plain-k2"], [4])
    with pytest.raises(SettingsError, match="--draft-max"):
        expand(["draft-k0"], [4])
    with pytest.raises(SettingsError, match="--temp"):
        parse_list("0,hot", float, "--temp")
    assert parse_list("0, 0.8", float, "--temp") == [0.0, 0.8]
    # adding a method is one entry
    try:
        register(Method("echo", lambda ctx, k: None, uses_k=False, help="test"))
        assert [v.label for v in expand(["echo"], [4])] == ["plain", "echo"]
    finally:
        METHODS.pop("echo", None)


def test_cli_registers_bench_and_needs_draft_for_draft_methods():
    from speculant.cli import build_parser, main

    args = build_parser().parse_args(["bench", "-m", "x.gguf", "--draft-max", "4,8", "--temp", "0,0.8"])
    assert args.handler.__name__ == "cmd_bench" and args.draft_max == "4,8"
    assert main(["bench", "-m", SMALL, "--methods", "plain,nosuch", "--out", "/nonexistent"]) == 1
    # step interleaving by default; the torch-target methods (a target copy per method is too big) by prompt
    from speculant.bench import config_from_args

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["bench", "-m", "x.gguf", *argv]))

    assert cfg("--methods", "lookup").interleave == "step"
    assert cfg("--methods", "lookup,plain-torch").interleave == "prompt"
    assert cfg("--methods", "lookup", "--interleave", "prompt").interleave == "prompt"


def test_cli_missing_draft_is_a_clear_error(capsys):
    from speculant.cli import main

    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled")
    assert main(["bench", "-m", SMALL, "--methods", "draft", "--limit", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "method draft needs a draft model: pass -md, or --methods without it" in err
    assert "prompts x" not in err  # said before the bench's banner, as the error it is
    assert main(["bench", "-m", SMALL, "--methods", "draft,adaptive", "--limit", "1", "--no-progress"]) == 1
    assert "methods adaptive, draft need a draft model" in capsys.readouterr().err
    # an unknown -m is named first (it was "needs a draft model", then the model's error after adding -md)
    assert main(["bench", "-m", "no-such-model", "--limit", "1", "--no-progress"]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_bench_checks_its_output_paths_before_it_runs(tmp_path, capsys):
    """--out and --trace are checked before any model loads: a bench that runs for an hour must not fail at its
    end because its results cannot be written."""
    from speculant.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["bench", "-m", "no-such-model.gguf", "--out", str(blocker), "--no-progress"]) == 1
    assert f"--out {blocker} is not a directory" in capsys.readouterr().err  # it said "cannot write there (File exists)"
    assert main(["bench", "--costs", "-m", "no-such-model.gguf", "--out", str(blocker / "sub")]) == 1
    assert "cannot write there" in capsys.readouterr().err
    assert main(["bench", "-m", "no-such-model.gguf", "--out", str(tmp_path / "out"), "--trace", str(tmp_path),
                 "--no-progress"]) == 1
    assert "is a directory: name a file" in capsys.readouterr().err


@pytest.mark.models
def test_end_to_end_tiny_bench_writes_every_file(tmp_path, capsys):
    from speculant.cli import main

    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled (run `make models`)")
    out = tmp_path / "bench"
    rc = main(["bench", "-m", SMALL, "-md", SMALL, "--methods", "plain,draft", "--draft-max", "3",
               "--categories", "qa,coding", "--limit", "1", "-n", "8", "-c", "1024", "-t", "1", "--cost-repeats", "2", "--out", str(out),
               "--temp", "0,0.9", "--no-progress"])
    assert rc == 0
    for name in ("results.json", "summary.md", "speedup_by_category.png", "acceptance_by_position.png",
                 "predicted_vs_measured.png"):
        assert (out / name).stat().st_size > 0, name
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2  # 2 prompts x (plain, draft-k3) x 2 temperatures
    assert {r["category"] for r in rows} == {"qa", "coding"}
    for r in rows:
        assert r["generated_tokens"] > 0 and r["tokens_per_s"] > 0
        if r["variant"] == "plain":
            assert r["greedy_equal"] is None and r["drafted"] == 0
        else:
            assert r["greedy_equal"] is True  # exact speculative decoding: same tokens as plain (seeded at T > 0)
            assert r["drafted"] > 0 and len(r["acceptance_by_position"]) <= 3
    assert result["machine"]["threads_used"] >= 1 and result["machine"]["cpu"]
    assert result["settings"]["n_predict"] == 8 and result["versions"]["llama-cpp-python"]
    assert set(result["costs"]["target_ms"]) == {"1", "2", "3", "4"} and result["costs"]["c"] > 0
    overall = [s for s in result["summary"] if s["category"] == "overall" and s["variant"] == "draft-k3"]
    assert len(overall) == 2 and all(s["predicted_speedup"] > 0 and s["greedy_checked"] == 2 for s in overall)
    md = (out / "summary.md").read_text()
    assert "| **overall** |" in md and "draft-k3" in md
    assert md in capsys.readouterr().out  # the table is printed too
    # how much of its threads' time each prompt's runs got (one thread: the process's CPU time over the wall time)
    assert all(0 < r["cpu_share"] < 2 for r in rows) and result["cpu_share"]["min"] <= result["cpu_share"]["median"]
    assert "- CPU: our threads got" in md
    from speculant.bench.report import markdown

    result["cpu_share"] = {"median": 0.95, "min": 0.9}
    assert "our threads got 95% of their time" in markdown(result) and "another program" not in markdown(result)
    result["cpu_share"] = {"median": 0.6, "min": 0.4}  # a busy machine: said, beside the numbers it spoilt
    assert "lowest 40%). Below 80% another program took the CPU" in markdown(result)


@pytest.mark.parametrize("stop,code", [(KeyboardInterrupt, 130), (SystemExit(143), 143)])
def test_an_interrupted_bench_writes_the_prompts_it_finished(tmp_path, monkeypatch, capsys, stop, code):
    """Ctrl-C (or SIGTERM, which exit_on_sigterm turns into SystemExit(143)) during a long bench used to throw
    away every finished run; now the whole prompts done are written, marked partial, with the signal's code."""
    from speculant.bench import runner
    from speculant.cli import main

    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled (run `make models`)")
    real, calls = runner._generate_all, []

    def stopped_on_the_second_prompt(*a, **kw):  # 2 repeats a prompt: the 4th call is the second's 2nd repeat
        calls.append(1)
        if len(calls) == 4:
            raise stop
        return real(*a, **kw)

    monkeypatch.setattr(runner, "_generate_all", stopped_on_the_second_prompt)
    out = tmp_path / "bench"
    try:
        rc = main(["bench", "-m", SMALL, "-md", "lookup", "--methods", "plain,lookup", "--categories", "qa,coding",
                   "--limit", "1", "-n", "8", "-c", "1024", "-t", "1", "--cost-repeats", "1", "--repeats", "2",
                   "--out", str(out), "--no-progress", "--no-plots", "--trace", str(tmp_path / "trace.json")])
    except SystemExit as e:
        rc = e.code
    assert rc == code
    assert json.loads((tmp_path / "trace.json").read_text())["partial"] is True
    result = json.loads((out / "results.json").read_text())
    assert result["partial"] is True
    # the first prompt whole (plain and lookup, 2 repeats), nothing of the second, whose first repeat had finished
    assert len({r["prompt_id"] for r in result["rows"]}) == 1 and len(result["rows"]) == 4
    assert "interrupted after 1 of 2 prompts" in capsys.readouterr().err
    # the summary says so too (it said "2 prompts" as if whole)
    assert "**interrupted: 1 of 2 prompts finished**" in (out / "summary.md").read_text()


def test_a_file_it_cannot_write_loses_nothing_else(tmp_path, capsys):
    """A file that cannot be written (here summary.md, a directory; a full disk alike) is one line naming it,
    after the table is printed and results.json and the trace are written; no temporary is left. A full disk used
    to lose the whole run, results.json too when the trace came first."""
    from speculant.cli import main

    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled (run `make models`)")
    out = tmp_path / "bench"
    (out / "summary.md").mkdir(parents=True)
    rc = main(["bench", "-m", SMALL, "-md", "lookup", "--methods", "plain,lookup", "--categories", "qa",
               "--limit", "1", "-n", "4", "-c", "1024", "-t", "1", "--cost-repeats", "1", "--out", str(out),
               "--trace", str(tmp_path / "trace.json"), "--no-progress", "--no-plots"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "| T | method | category |" in captured.out  # the table
    assert json.loads((out / "results.json").read_text())["rows"]
    assert json.loads((tmp_path / "trace.json").read_text())["runs"]
    errors = [line for line in captured.err.splitlines() if line.startswith("speculant: error:")]
    assert len(errors) == 1 and f"could not write {out / 'summary.md'}: Is a directory" in errors[0], captured.err
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "summary.md"]  # no summary.md.tmp


def test_settings_it_cannot_run_with_are_refused_before_the_banner(capsys):
    from speculant.cli import main

    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled (run `make models`)")
    for bad in (["-n", "0"], ["--repeats", "0"], ["--temp", "-1"], ["-c", "10"], ["--seed", "-5"]):
        assert main(["bench", "-m", SMALL, "-md", "lookup", "--methods", "plain,lookup", "--limit", "1",
                     "--no-progress", *bad]) == 1, bad
        err = capsys.readouterr().err
        assert "speculant bench:" not in err and err.startswith("speculant: error:"), (bad, err)


LLAMA_SPEC_OUTPUT = """
 Paris is the capital of France.

encoded   42 tokens in    0.120 seconds, speed:  350.000 t/s
decoded   64 tokens in    1.600 seconds, speed:   40.000 t/s

n_draft   = 4
n_predict = 64
n_drafted = 60
n_accept  = 45
accept    = 75.000%

draft:
"""


def test_costs_table_on_a_small_model(tmp_path):
    """`bench --costs`: one round on SmolLM2 without llama.cpp's tools writes costs.json with our pass times and,
    on our build, the same passes on ggml's own kernels in our process; the table says what is missing."""
    import os
    import subprocess
    import sys

    path = models.cached_path(SMALL)
    if not path.exists():
        pytest.skip(f"{SMALL} not pulled")
    proc = subprocess.run([sys.executable, "-m", "speculant", "bench", "--costs", "--costs-rounds", "1", "-m", str(path),
                           "-t", "2", "--llama-tools", str(tmp_path / "no-tools"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SPECULANT_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    costs = json.loads((tmp_path / "out" / "costs.json").read_text())
    assert [int(n) for n in costs["ours"] if n != "prefill_tps"] == list(range(1, 17))
    assert costs["ours"]["prefill_tps"] > 0 and costs["llama.cpp"] is None and "not built" in costs["llama_tools"]
    same = costs["ggml_same_process"]
    if same is not None:
        assert [int(n) for n in same] == list(range(1, 17)) and all(v > 0 for v in same.values())
    assert "| 16 |" in proc.stdout and "ggml kernels, same process" in proc.stdout
    assert 0 < costs["ours_cpu_share"] < 1.5 and "of their threads' time" in proc.stdout


def test_parse_llama_tool_output():
    from speculant.bench.peers import parse_llama_output

    r = parse_llama_output(LLAMA_SPEC_OUTPUT)
    assert r["generated_tokens"] == 64 and r["tokens_per_s"] == pytest.approx(40.0)
    assert (r["drafted"], r["accepted"], r["n_draft"]) == (60, 45, 4)
    assert r["acceptance"] == pytest.approx(0.75)
    plain = parse_llama_output("decoded   10 tokens in    0.500 seconds, speed:   20.000 t/s\n"
                               "0.41.441.178 I n_draft      = 0\n0.41.441.179 I n_drafted    = 0\n"
                               "0.41.441.181 I n_accept     = 0\n0.41.441.182 I accept       = -nan%\n")
    assert plain["tokens_per_s"] == pytest.approx(20.0) and plain["acceptance"] is None
    with pytest.raises(ValueError):
        parse_llama_output("error: failed to load model")


def test_peer_summary_against_own_plain_and_ours():
    from speculant.bench.peers import check_names, summarize_peers

    peer_rows = [{"peer": "llama.cpp", "variant": "plain", "prompt_id": "a", "temp": 0.0, "tokens_per_s": 10.0},
                 {"peer": "llama.cpp", "variant": "plain", "prompt_id": "b", "temp": 0.0, "tokens_per_s": 30.0},
                 {"peer": "llama.cpp", "variant": "draft-k4", "prompt_id": "a", "temp": 0.0, "tokens_per_s": 30.0,
                  "drafted": 8, "accepted": 6},
                 {"peer": "llama.cpp", "variant": "draft-k4", "prompt_id": "b", "temp": 0.0, "tokens_per_s": 50.0,
                  "drafted": 2, "accepted": 0},
                 {"peer": "llama.cpp", "variant": "lookup-k4", "prompt_id": "a", "temp": 0.0, "error": "boom"}]
    ours = [row("a", "x", "plain", 20.0), row("b", "x", "plain", 20.0), row("a", "x", "draft-k4", 99.0, k=4)]
    s = {r["variant"]: r for r in summarize_peers(peer_rows, ours)}
    assert s["draft-k4"]["speedup_own"] == pytest.approx(40.0 / 20.0)
    assert s["draft-k4"]["speedup_vs_ours"] == pytest.approx(40.0 / 20.0)
    assert s["plain"]["speedup_vs_ours"] == pytest.approx(1.0)
    assert s["draft-k4"]["acceptance"] == pytest.approx(0.6)
    assert s["lookup-k4"]["errors"] == 1 and s["lookup-k4"]["tokens_per_s"] is None
    with pytest.raises(SettingsError, match="unknown peer vllm"):
        check_names(["llama.cpp", "vllm"])


def test_runner_interleaves_methods_on_synthetic_models(monkeypatch):
    """The whole run loop on tiny synthetic models (no llama.cpp): every prompt under every method, the
    first method rotating between prompts, greedy identity marked, costs measured, summary built."""
    from synthetic import TableBackend

    import speculant.api
    from speculant.bench.runner import BenchConfig, run
    from speculant.bench.suite import Prompt

    class ContentOnly(TableBackend):
        def chat_template(self):
            return "{% for m in messages %}{{ m.content }}{% endfor %}"

    loaded = []

    def fake_load(name, *, n_ctx=4096, threads=None, role="target"):
        b = ContentOnly(n_vocab=12, seed=0 if role == "target" else 1, n_ctx=256)
        loaded.append(role)
        return b

    monkeypatch.setattr(speculant.api, "load_backend", fake_load)
    prompts = [Prompt("p1", "a", "1 2 3"), Prompt("p2", "b", "4 5 6 7"), Prompt("p3", "a", "8 9")]
    cfg = BenchConfig(model="t", draft_model="d", variants=expand(["draft"], [2, 3]), temps=[0.0, 1.0],
                      n_predict=12, repeats=2, cost_repeats=1)
    result = run(cfg, prompts, progress=False)
    assert loaded == ["target", "draft"]  # each model loaded once, shared by every method
    rows = result["rows"]
    assert len(rows) == 3 * 2 * 2 * 3
    first = [rows[i]["variant"] for i in range(0, len(rows), 3)]
    assert first[:4] == ["plain", "plain", "draft-k2", "draft-k2"]  # prompt 1 rep 0 (T=0, T=1), then rep 1
    for r in rows:
        assert r["generated_tokens"] == 12
        # equal to plain at T = 1 too: the bench's requests are seeded, so their draws are coupled
        assert r["greedy_equal"] is (None if r["variant"] == "plain" else True)
    s = result["summary"]
    assert {(r["temp"], r["variant"]) for r in s if r["category"] == "overall"} == \
        {(t, v) for t in (0.0, 1.0) for v in ("plain", "draft-k2", "draft-k3")}
    assert set(result["costs"]["target_ms"]) == {"1", "2", "3", "4"} and result["costs"]["c"] is not None
    k3 = [r for r in s if r["variant"] == "draft-k3" and r["category"] == "overall" and r["temp"] == 0][0]
    assert len(k3["acceptance_by_position"]) == 3 and k3["greedy_equal"] == k3["greedy_checked"] == 6


def test_step_interleave_gives_each_method_its_own_models_and_only_its_own_time(monkeypatch):
    """--interleave step on synthetic models: every method loads its own target (and draft), all methods
    decode a prompt together, and each is charged only the time of its own steps: the decode times of all
    methods add up to no more than the run's wall time (each stream's own clock would count every method's
    steps, about three times the wall time here)."""
    import time as _time

    from synthetic import TableBackend

    import speculant.api
    from speculant.bench.runner import BenchConfig, run
    from speculant.bench.suite import Prompt

    class SlowContentOnly(TableBackend):
        def chat_template(self):
            return "{% for m in messages %}{{ m.content }}{% endfor %}"

        def _decode(self, tokens, start, n_logits):
            _time.sleep(0.002)  # a pass takes time, as a real one does
            return super()._decode(tokens, start, n_logits)

    loaded = []

    def fake_load(name, *, n_ctx=4096, threads=None, role="target"):
        loaded.append(role)
        return SlowContentOnly(n_vocab=12, seed=0 if role == "target" else 1, n_ctx=256)

    monkeypatch.setattr(speculant.api, "load_backend", fake_load)
    prompts = [Prompt("p1", "a", "1 2 3"), Prompt("p2", "b", "4 5 6 7")]
    cfg = BenchConfig(model="t", draft_model="d", variants=expand(["draft", "lookup"], [2]), temps=[0.0, 1.0],
                      n_predict=20, cost_repeats=1, warmup=False, interleave="step")
    t0 = _time.perf_counter()
    result = run(cfg, prompts, progress=False)
    wall = _time.perf_counter() - t0
    # a first copy held apart (placement: runner.py), then plain, draft-k2 (+ its draft), lookup-k2
    assert loaded == ["target", "target", "target", "draft", "target"]
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 3 and all(r["generated_tokens"] == 20 for r in rows)
    assert all(r["greedy_equal"] for r in rows if r["temp"] == 0 and r["variant"] != "plain")
    assert sum(r["decode_s"] for r in rows) <= wall
    assert all(r["decode_s"] > 0.002 for r in rows)
    assert result["settings"]["interleave"] == "step"
    with pytest.raises(SettingsError, match="--interleave must be"):
        run(BenchConfig(model="t", draft_model=None, variants=expand(["lookup"], [2]), temps=[0.0],
                        interleave="sideways"), prompts, progress=False)


# -- torch-target methods (plain-torch, self-spec, mixed) and peak memory per method --------------------------

def test_torch_methods_registered_expand_and_flags():
    from speculant.bench import config_from_args
    from speculant.cli import build_parser

    for name in ("plain-torch", "self-spec", "mixed"):
        assert METHODS[name].backend == "torch" and METHODS[name].baseline == "plain-torch"
    assert METHODS["mixed"].needs_draft and not METHODS["self-spec"].needs_draft
    assert METHODS["draft"].backend == "llama.cpp" and METHODS["draft"].baseline == "plain"
    # plain-torch joins plain as soon as a torch-target method is selected
    assert [v.label for v in expand(["self-spec", "draft", "mixed"], [4])] == \
        ["plain", "plain-torch", "self-spec-k4", "draft-k4", "mixed-k4"]
    assert [v.label for v in expand(["plain-torch"], [4, 8])] == ["plain", "plain-torch"]
    assert [v.label for v in expand(["draft"], [4])] == ["plain", "draft-k4"]

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["bench", "-m", SMALL, "-md", SMALL, *argv]))

    assert cfg("--methods", "draft").memory is False  # quick llama.cpp benches stay quick
    c = cfg("--methods", "self-spec", "--self-spec-exit", "3", "--dtype", "bf16")
    assert c.memory is True and c.extra == {"self_spec_exit": 3} and c.dtype == "bf16" and c.draft_model is None
    assert cfg("--methods", "mixed", "--no-memory").memory is False
    assert cfg("--methods", "draft", "--memory").memory is True
    with pytest.raises(SettingsError, match="--self-spec-exit applies to the self-spec method"):
        cfg("--methods", "mixed", "--self-spec-exit", "3")
    assert cfg("--methods", "self-spec", "--self-spec-config", "c.json").extra == {"self_spec_config": "c.json"}
    with pytest.raises(SettingsError, match="--self-spec-config applies to the self-spec method"):
        cfg("--methods", "mixed", "--self-spec-config", "c.json")
    with pytest.raises(SettingsError, match="not both"):
        cfg("--methods", "self-spec", "--self-spec-config", "c.json", "--self-spec-exit", "3")
    with pytest.raises(SettingsError, match="--dtype and --device apply to the torch-target methods"):
        cfg("--methods", "draft", "--dtype", "bf16")


def test_torch_rows_compare_with_plain_torch():
    rows = [row("a", "x", "plain", 10.0), row("a", "x", "plain-torch", 5.0), row("a", "x", "mixed-k2", 10.0, k=2)]
    rows[1].update(baseline="plain-torch", backend="torch")
    rows[2].update(baseline="plain-torch", backend="torch")
    tokens = {("a", 0.0, 0, "plain"): [1, 2], ("a", 0.0, 0, "plain-torch"): [1, 3], ("a", 0.0, 0, "mixed-k2"): [1, 3]}
    bstats.mark_greedy_equal(rows, tokens)
    assert [r["greedy_equal"] for r in rows] == [None, None, True]  # against plain-torch, not llama.cpp plain
    s = bstats.summarize(rows)
    mixed = by(s, "mixed-k2", "overall")
    assert mixed["baseline"] == "plain-torch"
    assert (mixed["speedup"], mixed["speedup_vs_baseline"]) == (pytest.approx(1.0), pytest.approx(2.0))
    assert by(s, "plain", "overall")["baseline"] == "plain"


def test_runner_loads_torch_target_once_for_torch_methods(monkeypatch):
    """Synthetic models: the llama.cpp target, the torch target and the draft each load once; torch-target
    methods share the torch target and are checked against plain-torch's output (here a different model)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from synthetic import TableBackend

    import speculant.api
    from speculant.bench.runner import BenchConfig, run
    from speculant.bench.suite import Prompt

    class ContentOnly(TableBackend):
        def chat_template(self):
            return "{% for m in messages %}{{ m.content }}{% endfor %}"

    loaded = []

    def fake_load(name, *, n_ctx=4096, threads=None, role="target", backend="auto", dtype=None, device=None):
        loaded.append((role, backend))
        return ContentOnly(n_vocab=12, seed={"draft": 1, "torch": 2}.get(role if role == "draft" else backend, 0),
                           n_ctx=256)

    monkeypatch.setattr(speculant.api, "load_backend", fake_load)
    cfg = BenchConfig(model="t", draft_model="d", variants=expand(["mixed", "draft"], [2]), temps=[0.0],
                      n_predict=10, cost_repeats=1)
    result = run(cfg, [Prompt("p1", "a", "1 2 3"), Prompt("p2", "b", "4 5")], progress=False)
    assert loaded == [("target", "auto"), ("target", "torch"), ("draft", "auto")]
    by_variant = {}
    for r in result["rows"]:
        by_variant.setdefault(r["variant"], []).append(r)
    assert all(r["greedy_equal"] for r in by_variant["mixed-k2"] + by_variant["draft-k2"])
    assert by_variant["plain-torch"][0]["tokens_sha1"] != by_variant["plain"][0]["tokens_sha1"]
    assert {r["baseline"] for r in by_variant["mixed-k2"]} == {"plain-torch"}
    assert result["costs_torch"]["c"] is not None and "memory" not in result


def test_self_spec_without_torch_is_a_clear_error(monkeypatch, capsys):
    import sys

    from speculant.cli import main

    monkeypatch.setitem(sys.modules, "speculant.backends.torch", None)  # as if torch were not installed
    assert main(["bench", "-m", SMALL, "--methods", "self-spec", "--limit", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "self-spec run the target on the torch backend" in err and "pip install -e '.[torch]'" in err


@pytest.mark.models
def test_memory_probe_reports_peak_rss_of_a_child(tmp_path):
    from speculant.bench.memory import probe
    from speculant.bench.runner import BenchConfig

    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled (run `make models`)")
    cfg = BenchConfig(model=SMALL, draft_model=None, variants=[], temps=[0.0], n_ctx=512, threads=1)
    m = probe(cfg, "plain", 0, n_tokens=4)
    assert m["peak_rss_mb"] > 0 and m["generated_tokens"] == 4, m
    assert m["rss_anon_mb"] > 50 and m["rss_file_mb"] < 50  # the GGUF (94 MB) is read, not mmapped (repacking)
    assert m["peak_rss_mb"] < 1000  # its own peak, not the (pytest) parent's carried over by fork + exec
    cfg.model = str(tmp_path / "missing.gguf")
    failed = probe(cfg, "plain", 0)  # the child's error comes back, no exception
    assert failed["peak_rss_mb"] is None and "missing.gguf" in failed["error"], failed


@pytest.mark.models
def test_end_to_end_bench_with_torch_methods_and_memory(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from speculant.cli import main

    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled (run `make models`)")
    out = tmp_path / "bench"
    rc = main(["bench", "-m", SMALL, "-md", SMALL, "--methods", "self-spec,mixed", "--self-spec-exit", "20",
               "--draft-max", "3", "--categories", "coding", "--limit", "1", "-n", "6", "-c", "512", "-t", "1",
               "--cost-repeats", "1", "--no-warmup", "--no-plots", "--no-progress", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["plain", "plain-torch", "self-spec-k3", "mixed-k3"]
    for r in result["rows"]:
        assert r["generated_tokens"] > 0
        assert r["baseline"] == ("plain" if r["variant"] == "plain" else "plain-torch")
        assert r["greedy_equal"] is (None if r["variant"].startswith("plain") else True)
    assert set(result["memory"]) == {"plain", "plain-torch", "self-spec", "mixed"}
    for name, m in result["memory"].items():
        assert m["peak_rss_mb"] > 0, (name, m)
    # bf16 weights are anonymous memory; the GGUF is mmapped
    assert result["memory"]["plain-torch"]["rss_anon_mb"] > result["memory"]["plain"]["rss_anon_mb"]
    overall = {s["variant"]: s for s in result["summary"] if s["category"] == "overall"}
    assert overall["mixed-k3"]["peak_rss_mb"] == result["memory"]["mixed"]["peak_rss_mb"]
    assert overall["self-spec-k3"]["speedup_vs_baseline"] > 0
    note = result["notes"]["self-spec"]
    assert note.startswith("20/30 layers (early exit after 20)") and "--self-spec-exit" in note
    md = (out / "summary.md").read_text()
    assert "peak RSS MB" in md and "| plain-torch |" in md and "mixed-k3" in md


# -- predicted outputs and history (code_edit_predicted, repeated) --------------------------------------------

def test_predicted_and_repeated_suites():
    edits = read_suite("code_edit_predicted")
    assert len(edits) >= 20 and {p.category for p in edits} == {"code_edit_predicted"}
    kinds = {p.id.split("-", 2)[2] for p in edits}
    assert {"rename", "parameter", "bug", "docstrings", "translate"} <= kinds
    files = {p.prediction for p in edits}
    assert len(files) >= 5
    for p in edits:  # the original file is the prediction and is quoted in the prompt
        assert p.prediction and p.prediction in p.text and "{prediction}" not in p.text
        assert 30 <= len(p.prediction.splitlines()) <= 80
    repeated = read_suite("repeated")
    assert len(repeated) >= 12 and all(p.prediction is None for p in repeated)
    assert len({p.id.split("-", 2)[2] for p in repeated}) == 2  # two kinds of request, each asked repeatedly


def test_suite_prediction_fields(tmp_path):
    (tmp_path / "f.txt").write_text("a b c")
    s = tmp_path / "s.jsonl"
    s.write_text('{"question_id": 1, "category": "x", "turns": ["edit: {prediction}"], "prediction_file": "f.txt"}\n'
                 '{"question_id": 2, "category": "x", "turns": ["t"], "prediction": "p q"}\n'
                 '{"question_id": 3, "category": "x", "turns": ["t"]}\n')
    assert [(p.text, p.prediction) for p in read_suite(s)] == [("edit: a b c", "a b c"), ("t", "p q"), ("t", None)]
    s.write_text('{"question_id": 1, "category": "x", "turns": ["t"], "prediction_file": "nope.txt"}\n')
    with pytest.raises(SettingsError, match="prediction_file"):
        read_suite(s)


def test_runner_gives_the_prediction_only_to_prediction_methods(monkeypatch):
    """Synthetic models, step interleave: the prediction methods get the prompt's prediction (and copy from
    it), the others do not; greedy output is plain's everywhere; the summary says which
    source supplied the accepted tokens."""
    from synthetic import TableBackend

    import speculant.api
    from speculant.bench.runner import BenchConfig, run
    from speculant.bench.suite import Prompt
    from speculant.engine import Engine

    class ContentOnly(TableBackend):
        def chat_template(self):
            return "{% for m in messages %}{{ m.content }}{% endfor %}"

    def fake_load(name, *, n_ctx=4096, threads=None, role="target"):
        return ContentOnly(n_vocab=12, seed=0 if role == "target" else 1, n_ctx=256)

    monkeypatch.setattr(speculant.api, "load_backend", fake_load)
    texts = ["1 2 3", "4 5 6 7"]
    plain = [Engine(ContentOnly(n_vocab=12, seed=0)).generate(t, max_tokens=40).tokens for t in texts]
    prompts = [Prompt(f"p{i}", "edit", t, " ".join(map(str, out))) for i, (t, out) in enumerate(zip(texts, plain))]
    cfg = BenchConfig(model="t", draft_model=None, variants=expand(["history", "prediction", "prediction+history"], [4]),
                      temps=[0.0], n_predict=40, cost_repeats=1, interleave="step")
    rows = run(cfg, prompts, progress=False)["rows"]
    assert all(r["greedy_equal"] for r in rows if r["variant"] != "plain")
    for variant in ("prediction", "prediction+history"):  # how many, and on which prompt: timings decide (the
        # adaptive policy prices microsecond passes of the synthetic models, so one prompt may decode plainly)
        assert sum(r["accepted_by_source"].get("prediction", 0) for r in rows if r["variant"] == variant) > 0
    for r in rows:
        if r["variant"] not in ("prediction", "prediction+history"):
            assert "prediction" not in r["accepted_by_source"]


def test_structured_suite_and_grammar_fields(tmp_path):
    prompts = read_suite("structured")
    assert len(prompts) == 12 and {p.category for p in prompts} == {"json_extract", "tool_call", "json_order"}
    assert all(p.grammar and "root" in p.grammar for p in prompts)
    s = tmp_path / "s.jsonl"
    s.write_text('{"question_id": 1, "category": "x", "turns": ["t"], "grammar": "root ::= \\"a\\""}\n'
                 '{"question_id": 2, "category": "x", "turns": ["t"], "response_format": "json_object"}\n'
                 '{"question_id": 3, "category": "x", "turns": ["t"], "json_schema": {"type": "integer"}}\n'
                 '{"question_id": 4, "category": "x", "turns": ["t"]}\n')
    got = read_suite(s)
    assert got[0].grammar == 'root ::= "a"' and "object" in got[1].grammar and got[2].grammar and \
        got[3].grammar is None
    for bad, fragment in (('"grammar": 5', "GBNF"), ('"response_format": "xml"', "json_object"),
                          ('"json_schema": 5', "must be an object"),
                          ('"grammar": "x", "json_schema": {}', "one of")):
        s.write_text('{"question_id": 1, "category": "x", "turns": ["t"], ' + bad + '}\n')
        with pytest.raises(SettingsError, match=fragment):
            read_suite(s)


def test_tools_suite(tmp_path):
    """Prompts with OpenAI tools: rendered into the chat prompt; a required call decodes under its grammar."""
    prompts = read_suite("tools")
    assert len(prompts) == 12 and {p.category for p in prompts} == {"tool_auto", "tool_required"}
    assert all(p.tools for p in prompts)
    assert all((p.grammar is not None) == (p.category == "tool_required") for p in prompts)
    assert all("<tool_call>" in p.grammar for p in prompts if p.grammar)
    s = tmp_path / "s.jsonl"
    tool = '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}'
    s.write_text('{"question_id": 1, "turns": ["t"], "tools": [' + tool + '], "tool_choice": "none"}\n')
    assert read_suite(s)[0].tools is None and read_suite(s)[0].grammar is None  # none: not offered
    for bad, fragment in (('"tools": 5', "must be an array"), ('"tool_choice": "required"', "needs 'tools'"),
                          ('"tools": [' + tool + '], "tool_choice": "required", "grammar": "root ::= \\"a\\""',
                           "cannot also follow")):
        s.write_text('{"question_id": 1, "category": "x", "turns": ["t"], ' + bad + '}\n')
        with pytest.raises(SettingsError, match=fragment):
            read_suite(s)


def test_costs_refuses_a_trace_it_would_not_write(tmp_path, capsys):
    from speculant import cli

    assert cli.main(["bench", "--costs", "-m", SMALL, "--trace", str(tmp_path / "t.json")]) == 1
    assert "--costs times passes only" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
