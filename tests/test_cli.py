"""The CLI as a user runs it: JSON output, plain vs speculative, and every bad input gets a one-line error."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from speculant import models

SMALL = "smollm2-135m-instruct"


def run(*args, stdin=None, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "speculant", *args], capture_output=True, text=True,
                          input=stdin, env={**os.environ, **(env or {})}, timeout=timeout)


def assert_clean_error(proc, *fragments):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("speculant: error")]
    assert len(lines) == 1, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def small():
    if not models.cached_path(SMALL).exists():
        pytest.skip("smollm2 not pulled")
    return SMALL


def test_generate_json_plain_and_speculative_agree(small):
    base = ["generate", "-m", small, "-p", "The three primary colors are", "-n", "24", "--json"]
    plain = run(*base)
    spec = run(*base, "-md", small, "--draft-max", "3", "--no-adapt")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    p, s = json.loads(plain.stdout), json.loads(spec.stdout)  # exactly one JSON object each
    assert set(p) >= {"text", "tokens", "stats"}
    for key in ("drafted", "accepted", "acceptance_rate", "acceptance_by_position", "mean_accepted_length",
                "target_calls", "prompt_tokens", "generated_tokens", "tokens_per_s"):
        assert key in s["stats"]
    assert s["tokens"] == p["tokens"] and s["stats"]["drafted"] > 0 and p["stats"]["drafted"] == 0


def test_generate_streams_text_from_stdin_and_file(small, tmp_path):
    a = run("generate", "-m", small, "-n", "8", "--chat", stdin="Say hello.")
    f = tmp_path / "prompt.txt"
    f.write_text("Say hello.")
    b = run("generate", "-m", small, "-n", "8", "--chat", "-f", str(f), "-md", "lookup")
    assert a.returncode == 0 and b.returncode == 0
    assert a.stdout == b.stdout and a.stdout.strip()
    assert "tokens/s" in a.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--draft-max", "-1", "-md", "lookup"], "--draft-max"),
    (["--draft-max", "1000", "-md", "lookup"], "--draft-max"),
    (["--temp", "-0.5"], "temperature"),
    (["--top-p", "0"], "top-p"),
    (["--top-p", "1.5"], "top-p"),
    (["--min-p", "1"], "min-p"),
    (["-n", "0"], "token limit"),
    (["--draft-min", "5", "--draft-max", "2", "-md", "lookup"], "--draft-min"),
    (["-c", "4"], "--ctx-size"),
])
def test_bad_settings_get_a_clear_error(small, args, fragment):
    assert_clean_error(run("generate", "-m", small, "-p", "hi", *args), fragment)


def test_empty_prompt_and_prompt_over_the_context(small):
    assert_clean_error(run("generate", "-m", small, "-p", "   "), "empty")
    assert_clean_error(run("generate", "-m", small, "-c", "32", "-p", "word " * 100), "context window")


def test_bad_models_get_a_clear_error(small, tmp_path):
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi"), "unknown model")
    assert_clean_error(run("generate", "-m", str(tmp_path / "missing.gguf"), "-p", "hi"), "not found")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    assert_clean_error(run("generate", "-m", str(junk), "-p", "hi"), "not a GGUF")
    truncated = tmp_path / "truncated.gguf"
    with open(models.cached_path(small), "rb") as src:
        truncated.write_bytes(src.read(20_000_000))
    assert_clean_error(run("generate", "-m", str(truncated), "-p", "hi"), "truncated")


def test_draft_with_another_vocabulary_is_refused(small):
    if not models.cached_path(models.DEFAULT_DRAFT).exists():
        pytest.skip("qwen draft not pulled")
    proc = run("generate", "-m", models.DEFAULT_DRAFT, "-md", small, "-p", "hi", "-n", "2")
    assert_clean_error(proc, "cannot draft for target", "vocabulary sizes differ", "151936", "49152")


def test_pull_unknown_name_and_models_listing():
    assert_clean_error(run("pull", "no-such-model"), "unknown model")
    listing = run("models")
    assert listing.returncode == 0 and models.DEFAULT_TARGET in listing.stdout
