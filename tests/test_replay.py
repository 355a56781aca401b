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


def fixture_doc() -> dict:
    return json.loads(FIXTURE.read_text())


def write(tmp_path, doc) -> str:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    return str(path)


TINY = ["--shape", "tiny", "--draft-shape", "tiny-draft", "--device", "cpu", "--rows", "8", "-t", "1"]


def _runs_not_objects(doc):
    doc["runs"] = [1, 2]


def _no_prompt_tokens(doc):
    del doc["runs"][2]["prompt_tokens"]


def _no_categories(doc):
    for r in doc["runs"]:
        del r["category"]


def _short_step(doc):
    doc["runs"][1]["steps"][2] = ["draft", 4, 4, 5, 4]


def _too_few_steps(doc):
    doc["runs"][1]["steps"] = doc["runs"][1]["steps"][:2]


def _bad_agreement(doc):
    doc["runs"][1]["agree"] = [1, 0]


@pytest.mark.parametrize("spoil, message", [
    (_runs_not_objects, "run 1 is int, not an object"),
    (_no_prompt_tokens, "run 3 has no prompt_tokens"),
    (_no_categories, "run 1 has no category"),
    (_short_step, "run 2 step 3 is not [source, k, accepted, target_pass, draft_steps, draft_catchup]"),
    (_too_few_steps, "run 2 has steps that make 10 tokens, fewer than its generated_tokens (16)"),
    (_bad_agreement, "run 2 has an agree that is not one 0 or 1 per generated token"),
])
def test_a_malformed_trace_is_refused_when_read(spoil, message, tmp_path, capsys):
    doc = fixture_doc()
    spoil(doc)
    assert main(["replay", write(tmp_path, doc), *TINY, "--no-hf"]) == 1
    err = capsys.readouterr().err
    assert "is not a valid speculant trace: " + message in err and "Traceback" not in err


def test_a_trace_without_settings_replays(tmp_path, capsys):
    doc = fixture_doc()
    del doc["settings"]
    assert main(["replay", write(tmp_path, doc), *TINY, "--categories", "coding"]) == 0
    assert "hf_generate" in capsys.readouterr().out


def test_a_run_that_ended_at_once_replays():
    """The first token was the end token: no output, one target pass (a real engine's trace)."""
    doc = fixture_doc()
    doc["runs"].append({**doc["runs"][1], "prompt_id": "99", "generated_tokens": 0,
                        "steps": [["draft", 4, 0, 5, 4, 0]]})
    target, draft = random_backend("tiny", rows=8), random_backend("tiny-draft")
    res = replay(doc, target, draft, warmup=False)
    row = next(r for r in res["rows"] if r["category"] == "summarization")
    assert row["runs"] == 2 and row["tokens"] == 16 and row["speedup"] > 0


def _plain_only(tmp_path):
    doc = fixture_doc()
    doc["runs"] = [r for r in doc["runs"] if r["method"] == "plain"]
    return [write(tmp_path, doc)]


def _under_a_file(tmp_path):
    (tmp_path / "a-file").write_text("")
    return [str(FIXTURE), "--json", str(tmp_path / "a-file" / "r.json")]


@pytest.mark.parametrize("argv, message", [
    (lambda tmp: [str(FIXTURE), "--categories", "codng"], "it has categories coding, summarization"),
    (lambda tmp: [str(FIXTURE), "--variants", "nope"], "and variants draft-k4"),
    (_plain_only, "it has only plain runs"),
    (_under_a_file, "--json"),
    (lambda tmp: [str(FIXTURE), "-t", "513"], "--threads must be 1..512, got 513"),
], ids=["category-typo", "unknown-variant", "plain-only", "json-unwritable", "threads"])
def test_the_models_are_built_only_when_something_can_be_replayed(argv, message, tmp_path, capsys, monkeypatch):
    import speculant.replay as replay_module

    def built(*args, **kwargs):
        raise AssertionError("build_pair ran")

    monkeypatch.setattr(replay_module, "build_pair", built)
    assert main(["replay", *argv(tmp_path), *TINY[:-2], "--no-hf"]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_replay_refuses_models_bigger_than_memory_on_cpu(monkeypatch, capsys):
    import speculant.replay as replay_module

    monkeypatch.setattr(replay_module, "available_ram", lambda: 2**16, raising=False)  # 64 KiB
    assert main(["replay", str(FIXTURE), *TINY, "--no-hf"]) == 1
    err = capsys.readouterr().err
    assert "tiny + tiny-draft need" in err and "this machine has 0.0 GiB available" in err


def test_temperatures_are_rows_of_their_own():
    import copy

    from speculant.replay import format_rows

    doc = fixture_doc()
    hot = [copy.deepcopy(r) for r in doc["runs"]]
    for r in hot:
        r["temp"] = 0.8
        if r["method"] != "plain":
            r["steps"] = [["draft", 4, 1, 5, 4, 0]] * 8  # a poorer acceptance than at T = 0
    doc["runs"] += hot
    target, draft = random_backend("tiny", rows=8), random_backend("tiny-draft")
    res = replay(doc, target, draft, categories=["coding"], warmup=False)
    rows = {r["temp"]: r for r in res["rows"]}
    assert set(rows) == {0.0, 0.8} and rows[0.0]["tau"] == 4.0 and rows[0.8]["tau"] == 2.0
    table = format_rows(res["rows"], {}, "tiny", "tiny-draft")
    assert "| variant | category | T | runs |" in table and "| draft-k4 | coding | 0.8 | 1 | 16 |" in table
    assert "| T |" not in format_rows(res["rows"][:1], {}, "tiny", "tiny-draft")


def test_plain_decoding_pays_the_pass_that_produced_the_end_token():
    from speculant.replay import at_k, replay_plain

    target = random_backend("tiny", rows=8)
    doc = fixture_doc()
    spec = doc["runs"][1]  # 16 tokens at the -n limit
    assert replay_plain(spec, target)["target_passes"] == 16
    ended = {**spec, "generated_tokens": 14}  # the same steps, ended by the end token and a draft after it
    assert replay_plain(ended, target)["target_passes"] == 15
    plain = doc["runs"][0]
    assert replay_plain({**plain, "generated_tokens": 15}, target)["target_passes"] == 16
    for run, passes in ((spec, 16), (ended, 15)):  # a fixed k makes the end token too
        run = {**run, "agree": [1] * run["generated_tokens"]}
        assert sum(s[2] + 1 for s in at_k(run, 4)["steps"]) == passes
