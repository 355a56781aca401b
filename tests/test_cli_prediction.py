"""`speculant generate --prediction FILE` and `-md history` / `--history` as a user runs them."""

import json

import pytest

from test_cli import SMALL, assert_clean_error, run, small  # noqa: F401  (fixture)

pytestmark = pytest.mark.models

BASE = ["generate", "-m", SMALL, "-p", "def fibonacci(n):\n", "-n", "32", "--json"]


def test_prediction_file_gives_the_same_output_and_supplies_tokens(small, tmp_path):
    plain = json.loads(run(*BASE).stdout)
    pred = tmp_path / "pred.txt"
    pred.write_text(plain["text"])
    r = json.loads(run(*BASE, "--prediction", str(pred)).stdout)
    assert r["tokens"] == plain["tokens"]  # adaptive: drafting may not pay on this CPU (smollm2 on 2 AVX2 cores:
    # a pass over 2 tokens costs 2 over 1), so whether the prediction supplies tokens is the policy's call
    r = json.loads(run(*BASE, "--prediction", str(pred), "--no-adapt", "--draft-max", "8").stdout)
    assert r["tokens"] == plain["tokens"]
    assert r["stats"]["accepted_by_source"].get("prediction", 0) > 0  # --no-adapt: it drafts every step
    pred.write_text("completely unrelated text " * 10)
    assert json.loads(run(*BASE, "--prediction", str(pred)).stdout)["tokens"] == plain["tokens"]
    assert_clean_error(run(*BASE, "--prediction", str(tmp_path / "missing.txt")), "prediction file")


@pytest.mark.parametrize("flags", [["-md", "history"], ["-md", SMALL, "--history", "--lookup"]])
def test_history_drafting_from_the_cli(small, flags):
    plain = json.loads(run(*BASE).stdout)
    r = json.loads(run(*BASE, *flags).stdout)
    assert r["tokens"] == plain["tokens"]
