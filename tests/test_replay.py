"""Traces (`speculant bench --trace`) and their replay on random weights (`speculant replay`), tiny shapes."""

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)

from speculant import models  # noqa: E402
from speculant.cli import main  # noqa: E402
from speculant.errors import SettingsError  # noqa: E402
from speculant.replay import (draft_agreement, draft_passes, read_trace, replay, replay_run,  # noqa: E402
                              steps_at_k)
from speculant.shapes import random_backend  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "trace-small.json"


def test_draft_pass_sizes():
    steps = [["draft", 4, 4, 5, 4, 0], ["draft", 4, 1, 5, 4, 0], ["none", 0, 0, 1, 0, 0],
             ["draft", 3, 0, 4, 3, 3], ["lookup", 5, 5, 6, 0, 0]]
    assert draft_passes(steps, 0) == [1, 1, 1, 1]  # after the prompt's prefill: the last token only
    assert draft_passes(steps, 1) == [2, 1, 1, 1]  # all 4 accepted: its own last draft and the bonus token
    assert draft_passes(steps, 2) == []  # a plain step
    assert draft_passes(steps, 3) == [3, 1, 1]  # a recorded catch-up
    assert draft_passes(steps, 4) == []  # a free drafter runs no model


def test_replay_runs_exactly_the_traced_passes():
    doc = read_trace(FIXTURE)
    target, draft = random_backend("tiny", rows=8), random_backend("tiny-draft")
    for run in doc["runs"]:
        if run["method"] == "plain":
            continue
        got = replay_run(run, target, draft)
        assert got["target_passes"] == len(run["steps"])
        assert got["draft_passes"] == sum(len(draft_passes(run["steps"], i)) for i in range(len(run["steps"])))
        assert got["tokens"] == run["generated_tokens"] and got["seconds"] > 0
    res = replay(doc, target, draft, warmup=False)
    assert {r["category"] for r in res["rows"]} == {"coding", "summarization"}
    for r in res["rows"]:
        assert r["tau"] >= 1 and r["speedup"] > 0


def test_steps_at_a_fixed_k_from_an_agreement():
    agree = [1, 1, 0, 1, 1, 1, 1, 0, 0, 1]
    assert steps_at_k(agree, 2) == [["draft", 2, 2, 3, 2, 0], ["draft", 2, 2, 3, 2, 0], ["draft", 2, 1, 3, 2, 0],
                                    ["draft", 1, 0, 2, 1, 0], ["none", 0, 0, 1, 0, 0]]
    for k in (1, 3, 5, 9, 20):
        steps = steps_at_k(agree, k)
        assert sum(s[2] + 1 for s in steps) == len(agree)  # every token once: accepted drafts + the target's
        assert all(s[1] <= k for s in steps)
    assert [s[2] for s in steps_at_k([1] * 9, 4)] == [4, 3]  # the last step drafts only what is left


def test_an_agreement_reproduces_a_fixed_k_run():
    """A draft model's recorded agreement gives, for any k, the steps a real greedy run with that fixed k takes:
    the same drafted and accepted counts, step by step (tiny random models, a draft near its target)."""
    from speculant.drafters.model import ModelDrafter
    from speculant.engine import Engine
    from synthetic import near_copy

    target = random_backend("tiny", rows=16, seed=4, std=0.5)
    prompt = [(37 * i + 11) % 500 for i in range(20)]
    plain = Engine(target).generate(prompt, max_tokens=48).tokens
    drafter = ModelDrafter(near_copy(seed=4, std=0.5, noise=0.05), target.n_vocab)
    agree = draft_agreement(drafter, prompt, plain)
    assert len(agree) == 48 and 0 < sum(agree) < 48
    for k in (1, 3, 4, 7):
        engine = Engine(target, drafter, draft_max=k, adaptive=False)
        engine.trace = []
        assert engine.generate(prompt, max_tokens=48).tokens == plain
        assert [s[1:3] for s in engine.trace] == [s[1:3] for s in steps_at_k(agree, k)], k
        assert [s[4] for s in engine.trace] == [s[4] for s in steps_at_k(agree, k)]  # draft passes
    assert draft_agreement(None, prompt, plain) is None


def test_replay_at_fixed_k_from_the_agreement():
    doc = read_trace(FIXTURE)
    target, draft = random_backend("tiny", rows=8), random_backend("tiny-draft")
    with pytest.raises(SettingsError, match="no draft agreement"):
        replay(doc, target, draft, ks=[4], warmup=False)
    for run in doc["runs"]:
        if run["method"] == "draft":
            run["agree"] = [1, 1, 1, 0] * (run["generated_tokens"] // 4)
    res = replay(doc, target, draft, ks=[2, 4], warmup=False)
    rows = {(r["variant"], r["category"]): r for r in res["rows"]}
    assert set(rows) == {(v, c) for v in ("draft-k4", "fixed k=2", "fixed k=4") for c in ("coding", "summarization")}
    assert rows["fixed k=4", "coding"]["tau"] == 4.0  # 3 agreeing tokens and the target's, each step
    assert rows["fixed k=2", "coding"]["tau"] == round(16 / len(steps_at_k([1, 1, 1, 0] * 4, 2)), 3)


def test_replay_cli(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", str(FIXTURE), "--shape", "tiny", "--draft-shape", "tiny-draft", "--device", "cpu",
                 "--rows", "8", "--categories", "coding", "--json", str(out), "-t", "1"]) == 0
    printed = capsys.readouterr().out
    assert "| draft-k4 | coding |" in printed and "hf_generate" in printed
    res = json.loads(out.read_text())
    assert res["shape"] == "tiny" and res["graphs"] is False and [r["category"] for r in res["rows"]] == ["coding"]


@pytest.mark.parametrize("argv, message", [
    (["replay", "/nonexistent/trace.json"], "does not exist"),
    (["replay", str(FIXTURE), "--shape", "qwen9-1t", "--device", "cpu"], "unknown shape"),
    (["replay", str(FIXTURE), "--shape", "tiny", "--draft-shape", "tiny-draft", "--device", "cpu",
      "--categories", "poetry"], "no speculative runs"),
    (["replay", str(FIXTURE), "--shape", "tiny", "--draft-shape", "tiny-draft", "--device", "cpu", "--k", "4,x"],
     "comma list of draft lengths"),
    (["replay", str(FIXTURE), "--shape", "tiny", "--draft-shape", "tiny-draft", "--device", "cpu", "--k", "0"],
     "must be in [1, 32]"),
    (["replay", str(FIXTURE), "--shape", "tiny", "--draft-shape", "tiny-draft", "--device", "cpu", "--no-hf",
      "--k", "4"], "no draft agreement"),
])
def test_replay_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text('{"rows": []}')
    assert main(["replay", str(bad)]) == 1
    assert "is not a speculant trace" in capsys.readouterr().err


MODEL = "smollm2-135m-instruct"


@pytest.mark.skipif(not models.cached_path(MODEL).exists(), reason=f"{MODEL} is not pulled")
def test_bench_trace_records_every_step(tmp_path):
    trace = tmp_path / "t.json"
    assert main(["bench", "-m", MODEL, "-md", MODEL, "--methods", "plain,draft", "--categories", "coding",
                 "--limit", "1", "-n", "12", "--cost-repeats", "1", "--no-plots", "--no-progress", "--no-memory",
                 "--out", str(tmp_path / "out"), "--trace", str(trace), "-t", "1"]) == 0
    doc = read_trace(trace)
    results = json.loads((tmp_path / "out" / "results.json").read_text())["rows"]
    assert len(doc["runs"]) == 2
    for run, row in zip(doc["runs"], results):
        assert (run["variant"], run["category"]) == (row["variant"], row["category"])
        steps = run["steps"]
        assert len(steps) == row["target_calls"]
        assert sum(s[1] for s in steps) == row["drafted"] and sum(s[2] for s in steps) == row["accepted"]
        assert all(s[3] >= s[1] + 1 for s in steps)  # a target pass covers the last token and every draft
        if run["method"] == "draft":
            assert all(s[0] == "draft" and s[4] >= 1 for s in steps if s[1])
            # greedy: each step accepted the run of agreeing tokens from where it drafted, up to its k
            agree, pos = run["agree"], 0
            assert len(agree) == run["generated_tokens"]
            for _, k, accepted, *_ in steps:
                run_of_ones = next((i for i in range(k) if not agree[pos + i]), k) if pos + k <= len(agree) \
                    else accepted
                assert accepted == run_of_ones
                pos += accepted + 1
        else:
            assert "agree" not in run
