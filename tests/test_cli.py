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
    # sampled with a seed: the same tokens with or without a drafter (coupled draws), the seed reported
    sampled = [*base, "--temp", "0.9", "--top-k", "0", "--top-p", "1", "--min-p", "0", "-s", "11"]
    plain, spec = run(*sampled), run(*sampled, "-md", small, "--draft-max", "3", "--no-adapt")
    p, s = json.loads(plain.stdout), json.loads(spec.stdout)
    assert s["tokens"] == p["tokens"] and s["stats"]["drafted"] > 0 and p["seed"] == s["seed"] == 11


def test_prompt_lookup_goes_in_front_of_a_draft_model_unless_turned_off(small):
    """With a draft model, prompt lookup drafts first by default (free drafts: 1.36x against 1.26x plain decoding
    on the suite, BENCHMARKS.md); --no-lookup leaves the model alone. The tokens are the same either way."""
    base = ["generate", "-m", small, "-md", small, "-n", "32", "--json", "-p",
            "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon.\napple, banana, cherry, date,"]
    on, off = run(*base, "--no-adapt"), run(*base, "--no-adapt", "--no-lookup")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    a, b = json.loads(on.stdout), json.loads(off.stdout)
    assert a["tokens"] == b["tokens"]
    assert a["stats"]["accepted_by_source"].get("lookup", 0) > 0
    assert set(b["stats"]["accepted_by_source"]) <= {"draft"} and b["stats"]["accepted"] > 0
    ngram = run(*base, "--no-lookup", "--lookup-ngram-max", "3")
    assert ngram.returncode == 0 and "warning: --lookup-ngram-max has no effect with --no-lookup" in ngram.stderr
    plain = run("generate", "-m", small, "-n", "2", "-p", "hi", "--no-lookup")
    assert plain.returncode == 0 and "warning: --no-lookup has no effect without a draft model" in plain.stderr
    both = run("generate", "-m", small, "-n", "2", "-p", "hi", "-md", "lookup", "--no-lookup")
    assert both.returncode != 0 and both.stderr.startswith("speculant: error: --no-lookup"), both.stderr


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
    (["-n", "-3"], "token limit"),
    (["--draft-min", "5", "--draft-max", "2", "-md", "lookup"], "--draft-min"),
    (["-c", "4"], "--ctx-size"),
    (["-t", "100000"], "--threads must be 1..512"),  # ggml's limit: more crashed in its thread pool
    (["-td", "600", "-md", "lookup"], "--threads-draft must be 1..512"),
    (["--presence-penalty", "3"], "presence penalty"),
    (["--repeat-penalty", "0"], "repetition penalty"),
    (["-l", "12*3"], "--logit-bias"),
    (["-l", "99999999-1"], "outside the vocabulary"),
    (["--logprobs", "3"], "--json"),
    (["--json", "--logprobs", "30"], "logprobs"),
    (["--grammar", 'root ::= "a'], "invalid grammar"),
    (["--grammar-file", "/no/such/file.gbnf"], "No such file"),
    (["-j", "{not json"], "not valid JSON"),
    (["-jf", "/no/such/schema.json"], "No such file"),
    (["--suffix", "/no/such/suffix.py"], "cannot read suffix file"),
    (["--suffix", __file__], "no fill-in-the-middle tokens"),  # SmolLM2 has none
    (["--suffix", __file__, "--chat"], "does not go with --chat"),
])
def test_bad_settings_get_a_clear_error(small, args, fragment):
    assert_clean_error(run("generate", "-m", small, "-p", "hi", *args), fragment)


def test_a_bad_grammar_is_one_line_naming_its_fault(small):
    """llama.cpp's parser printed its error and the whole grammar to stderr, then ours said only "failed to parse
    grammar"; now the one line names the fault."""
    proc = run("generate", "-m", small, "-p", "hi", "--grammar", "root ::= foo")
    assert_clean_error(proc, "invalid grammar (GBNF): Undefined rule identifier 'foo'")
    assert "error parsing grammar" not in proc.stderr and "root ::= foo" not in proc.stderr, proc.stderr


def test_text_that_is_not_utf8_is_refused_before_loading(small, tmp_path):
    latin1 = "café au lait".encode("latin-1")

    def run_bytes(*args, stdin=None):  # argv and stdin as raw bytes
        proc = subprocess.run([sys.executable, "-m", "speculant", *args], capture_output=True, input=stdin,
                              env={**os.environ, "SPECULANT_VERBOSE": "1"}, timeout=300)
        proc.stderr = proc.stderr.decode("utf-8", "replace")
        return proc

    suite = tmp_path / "latin1.jsonl"
    suite.write_bytes(b'{"turns": ["' + latin1 + b'"]}\n')
    for proc, fragment in [
        (run_bytes("generate", "-m", small, stdin=latin1), "the prompt on stdin is not UTF-8"),
        (run_bytes("generate", "-m", small, "-p", latin1), "-p is not UTF-8"),
        (run_bytes("generate", "-m", small, "-p", "hi", "--stop", latin1), "--stop is not UTF-8"),
        (run_bytes("generate", "-m", small, "-p", "hi", "--grammar", b'root ::= "' + latin1 + b'"'),
         "--grammar is not UTF-8"),
        (run_bytes("generate", "-m", small, "-p", "hi", "--prediction", "-", stdin=latin1),
         "the prediction on stdin is not UTF-8"),
        (run_bytes("bench", "-m", small, "--suite", str(suite), "--methods", "plain"), "is not UTF-8"),
    ]:
        assert_clean_error(proc, fragment)
        assert "llama_model_loader" not in proc.stdout.decode(), fragment  # refused before loading


def test_two_readers_of_stdin_are_refused(small):
    for args in (["-f", "-", "--prediction", "-"], ["--prediction", "-"], ["-p", "hi", "--prediction", "-",
                                                                        "--suffix", "-"]):
        assert_clean_error(run("generate", "-m", small, *args, stdin="hi"), "would both read stdin")


def test_grammar_json_schema_and_logprobs(small, tmp_path):
    schema = '{"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}'
    base = ["generate", "-m", small, "--chat", "-p", "Name a primary color as JSON.", "-n", "20", "--json"]
    plain = run(*base, "-j", schema, "--logprobs", "2")
    spec = run(*base, "-j", schema, "--logprobs", "2", "-md", small, "--no-adapt")
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    p, s = json.loads(plain.stdout), json.loads(spec.stdout)
    assert json.loads(p["text"])["color"] in ("red", "green", "blue") and p["finish_reason"] == "stop"
    assert s["tokens"] == p["tokens"] and s["logprobs"] == p["logprobs"] and s["stats"]["accepted"] > 0
    assert [e["token"] for e in p["logprobs"]] == p["tokens"] and all(len(e["top"]) == 2 for e in p["logprobs"])
    g = tmp_path / "yn.gbnf"
    g.write_text('root ::= " yes" | " no"\n')
    yn = run("generate", "-m", small, "-p", "Is the sky blue? Answer:", "-n", "5", "--grammar-file", str(g), "--json")
    assert json.loads(yn.stdout)["text"] in (" yes", " no")
    f = tmp_path / "color.json"
    f.write_text(schema)
    from_file = run(*base, "-jf", str(f))
    assert from_file.returncode == 0, from_file.stderr
    assert json.loads(from_file.stdout)["tokens"] == p["tokens"]  # the same schema, so the same greedy output


def test_a_model_whose_weights_give_nan_is_an_error_not_an_empty_answer(small, tmp_path):
    """Damaged weight data (a block's scales overwritten: NaN) made every logit NaN, which decoded as EOS: an empty
    answer, exit 0. Now the load's warm-up pass says so in one line."""
    from gguf import GGUFReader

    path = tmp_path / "damaged.gguf"
    shutil.copyfile(models.cached_path(SMALL), path)
    tensor = next(t for t in GGUFReader(path, "r").tensors if t.name == "blk.0.attn_q.weight")
    with open(path, "r+b") as f:
        f.seek(int(tensor.data_offset))
        f.write(b"\xff" * 4096)  # Q4_1 blocks whose fp16 scales are NaN
    r = run("generate", "-m", str(path), "-p", "Hello", "-n", "3", "-t", "1")
    assert_clean_error(r, "computes NaN or infinite logits", "damaged")


def test_empty_prompt_and_prompt_over_the_context(small):
    """As llama.cpp: an empty prompt is BOS alone where the model starts with one (gemma), refused where it has
    none (SmolLM2); spaces are text."""
    assert_clean_error(run("generate", "-m", small, "-p", ""), "the prompt is empty", "adds no BOS token")
    assert run("generate", "-m", small, "-p", "   ", "-n", "2", "--json").returncode == 0
    assert_clean_error(run("generate", "-m", small, "-c", "32", "-p", "word " * 100), "context window")
    if models.cached_path("gemma-3-270m").exists():
        out = run("generate", "-m", "gemma-3-270m", "-p", "", "-n", "4", "--json")
        assert out.returncode == 0 and json.loads(out.stdout)["stats"]["prompt_tokens"] == 1, out.stderr


def test_token_limits_as_llama_cpp_reads_them(small):
    """-n -1 and -2 (llama.cpp's: until the context is full; it never shifts here) run to the context's end; -n 0
    checks the prompt and generates nothing; below -2 is an error."""
    base = ["generate", "-m", small, "-p", "The capital of France is", "-c", "48", "--ignore-eos", "--json"]
    full = [json.loads(run(*base, "-n", n).stdout) for n in ("-1", "-2")]
    assert full[0]["tokens"] == full[1]["tokens"] and full[0]["stats"]["prompt_tokens"] + len(full[0]["tokens"]) == 48
    none = json.loads(run(*base, "-n", "0").stdout)
    assert none["text"] == "" and none["stats"]["prompt_tokens"] == full[0]["stats"]["prompt_tokens"]
    assert_clean_error(run(*base[:-1], "-n", "0", "-c", "16", "-p", "word " * 40), "context window")
    assert_clean_error(run(*base, "-n", "-3"), "-n must be >= 0, or -1 / -2")
    # the settings are checked as a generation checks them, and the output has the fields it would have
    assert_clean_error(run(*base, "-n", "0", "-l", "999999+1"), "outside the vocabulary")
    assert json.loads(run(*base, "-n", "0", "--logprobs", "1").stdout)["logprobs"] == []


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
    cut = tmp_path / "cut-metadata.gguf"  # ends inside the metadata: ggml's reason in the line, nothing raw
    with open(models.cached_path(small), "rb") as src:
        cut.write_bytes(src.read(100_000))
    proc = run("generate", "-m", str(cut), "-p", "hi")
    assert_clean_error(proc, "corrupt or truncated", "failed to read")
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "fooarch.gguf"), "fooarch")  # well formed, unknown architecture
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    assert_clean_error(run("generate", "-m", str(tmp_path / "fooarch.gguf"), "-p", "hi"),
                       "unknown model architecture: 'fooarch'")
    pytest.importorskip("transformers")
    foreign = tmp_path / "foreign"  # a directory goes to transformers: a config it cannot read is one line too
    foreign.mkdir()
    for config in ("{}", "{"):
        (foreign / "config.json").write_text(config)
        assert_clean_error(run("generate", "-m", str(foreign), "-p", "hi"), "transformers cannot load")


def test_draft_with_another_vocabulary_drafts_through_text(small):
    if not models.cached_path(models.DEFAULT_DRAFT).exists():
        pytest.skip("qwen draft not pulled")
    args = ["generate", "-m", models.DEFAULT_DRAFT, "-p", "The capital of France is", "-n", "12", "--json"]
    plain = run(*args)
    # a fixed draft length: whether drafting pays is the adaptive policy's call (where the 0.5B target's step is
    # cheap, as on Zen 4 since the kernel fixes, it decodes this prompt plainly)
    spec = run(*args, "-md", small, "--draft-max", "3", "--no-adapt")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert "vocabulary sizes differ" in spec.stderr and "drafts through text" in spec.stderr
    assert "Traceback" not in spec.stderr
    a, b = json.loads(plain.stdout), json.loads(spec.stdout)
    assert a["tokens"] == b["tokens"] and b["stats"]["drafted"] > 0


def test_pull_unknown_name_and_models_listing():
    assert_clean_error(run("pull", "no-such-model"), "unknown model")
    listing = run("models")
    assert listing.returncode == 0 and models.DEFAULT_TARGET in listing.stdout


# -- the first hour as a user (issue 18) ------------------------------------------------------------------------

def test_no_command_lists_the_commands_and_version():
    proc = run()
    assert proc.returncode == 2
    for command in ("generate", "serve", "pull", "models", "bench", "demo", "calibrate"):
        assert command in proc.stderr
    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("speculant ")


def test_every_flag_has_help_and_calibrate_lists_only_its_own():
    import argparse

    from speculant.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in sub.choices.items() for a in p._actions
               if not a.help]
    assert missing == []
    calibrate = {s for a in sub.choices["calibrate"]._actions for s in a.option_strings}
    assert not calibrate & {"-md", "--lookup", "--self-spec", "--backend", "--draft-vocab", "--adapt"}
    assert "72 prompts" in sub.choices["bench"].format_help()  # the default run is long: it says so


@pytest.mark.parametrize("args,fragment", [
    (["-ngl", "99"], "no GPU offload in the llama.cpp backend"),
    (["-ngl", "99", "--backend", "torch"], "the torch backend places the whole model with --device"),
    (["-cd", "100", "-c", "200", "-md", "lookup"], "the draft's context is always the target's"),
    (["-cnv"], "-cnv (interactive conversation) is not supported"),
    (["--lookup"], "for prompt lookup alone pass -md lookup"),
    (["--draft-vocab", "-5", "-md", "lookup"], "--draft-vocab must be >= 0"),
    (["-n", "-5"], "token limit"),
    (["--seed", "-2"], "--seed must be >= 0, or -1"),
    (["--self-spec"], "add --backend torch"),
    (["--self-spec-config", "x.json"], "add --backend torch"),
    (["--self-spec-config", "x.json", "--self-spec-exit", "3", "--backend", "torch"], "not both"),
])
def test_impossible_llama_cpp_flags_are_refused_before_loading(args, fragment):
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", *args), fragment)


def test_llama_cpp_spellings_and_conventions(small):
    base = ["generate", "-m", small, "-p", "Once upon a time", "-n", "8", "--temp", "0.8", "--json"]
    spec = ["-md", small, "--no-adapt"]  # a fixed draft length: the same seed gives the same sample
    a = run(*base, *spec, "-ngl", "0", "-s", "7", "-td", "1", "-cd", "0", "-no-cnv")
    b = run(*base, *spec, "--seed", "7")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    ra, rb = json.loads(a.stdout), json.loads(b.stdout)
    assert ra["seed"] == rb["seed"] == 7 and ra["tokens"] == rb["tokens"]
    r = run(*base)  # --seed -1 (the default): random, and reported
    assert r.returncode == 0 and isinstance(json.loads(r.stdout)["seed"], int)
    r = run(*base[:-1])
    assert r.returncode == 0 and ", seed " in r.stderr


def test_n_minus_one_runs_until_the_context_is_full_and_says_so(small):
    proc = run("generate", "-m", small, "-c", "48", "-n", "-1", "--json", "-p", "1, 2, 3, 4, 5,")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["finish_reason"] == "length" and "context window full" in r["message"]
    assert r["stats"]["prompt_tokens"] + r["stats"]["generated_tokens"] == 48
    assert "context window full" in proc.stderr


def test_ctx_size_zero_is_the_models_context(small):
    from speculant.backends.llamacpp import LlamaCppBackend

    backend = LlamaCppBackend(models.cached_path(small), n_ctx=0)
    try:
        assert backend.n_ctx == backend.n_ctx_train == 8192
    finally:
        backend.close()
    proc = run("generate", "-m", small, "-c", "0", "-n", "2", "-p", "hi")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr
    # more than the training context: said, and the training context used
    proc = run("generate", "-m", small, "-c", "20000", "-n", "2", "-p", "hi", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "--ctx-size 20000 is more than smollm2-135m-instruct-q4_1.gguf's training context (8192 tokens); " \
           "using 8192" in proc.stderr


def test_flags_without_effect_are_warned_about(small):
    proc = run("generate", "-m", small, "-p", "hi", "-n", "2", "--draft-max", "3")
    assert proc.returncode == 0 and "warning: --draft-max has no effect without a drafter" in proc.stderr
    proc = run("generate", "-m", small, "-p", "hi", "-n", "2", "-md", "lookup", "--draft-p-min", "0.5")
    assert proc.returncode == 0 and "warning: --draft-p-min has no effect with prompt lookup" in proc.stderr
    proc = run("generate", "-m", small, "-p", "hi", "-n", "2", "-md", small, "--draft-vocab", "100000")
    assert proc.returncode == 0 and "warning: --draft-vocab 100000 has no effect: the draft has only" in proc.stderr
    proc = run("generate", "-m", small, "-p", "hi", "-n", "2", "-md", "lookup", "--draft-max", "0")
    assert proc.returncode == 0 and "warning: --draft-max 0: -md lookup drafts nothing" in proc.stderr
    # ... and a draft model that could draft nothing is not loaded (its memory and load time were spent for nothing)
    proc = run("generate", "-m", small, "-p", "hi", "-n", "2", "-md", small, "--draft-max", "0", "--json")
    assert proc.returncode == 0 and "(the drafter is not loaded)" in proc.stderr
    assert list(json.loads(proc.stdout)["stats"]["model_memory_mb"]) == ["target"], proc.stdout


def test_stats_line_tells_plain_from_speculative(small):
    plain = run("generate", "-m", small, "-p", "hi", "-n", "4")
    assert plain.returncode == 0 and "plain decoding" in plain.stderr and "acceptance" not in plain.stderr
    spec = run("generate", "-m", small, "-md", small, "--no-adapt", "-p", "The capital of France is", "-n", "8")
    assert spec.returncode == 0 and "drafted " in spec.stderr and "accepted " in spec.stderr
    assert "τ " in spec.stderr
    # a predicted output drafts without a drafter (here: the plain answer itself)
    answer = run("generate", "-m", small, "-p", "The capital of France is", "-n", "12")
    predicted = run("generate", "-m", small, "-p", "The capital of France is", "-n", "12", "--prediction", "-",
                    stdin=answer.stdout.rstrip("\n"))
    assert predicted.returncode == 0 and "plain decoding" not in predicted.stderr, predicted.stderr
    assert "drafted " in predicted.stderr and "'prediction'" in predicted.stderr


def test_stop_string_is_in_neither_text_nor_tokens(small, small_target):
    proc = run("generate", "-m", small, "-p", "The capital of France is", "-n", "24", "--stop", ".", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["finish_reason"] == "stop" and "." not in r["text"]
    assert b"".join(small_target.token_bytes(t) for t in r["tokens"]).decode() == r["text"]


def _home_with(tmp_path, *names):
    """A $SPECULANT_HOME where only `names` are pulled (links to the real files)."""
    (tmp_path / "models").mkdir()
    for name in names:
        (tmp_path / "models" / models.cached_path(name).name).symlink_to(models.cached_path(name))
    return {"SPECULANT_HOME": str(tmp_path)}


def test_torch_device_without_cuda_fails_before_loading(small, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = _home_with(tmp_path, small)
    proc = run("generate", "--backend", "torch", "--device", "cuda", "-m", small, "-p", "hi", env=env)
    assert_clean_error(proc, "--device cuda", "CUDA")
    assert not (tmp_path / "torch").exists()  # nothing was converted or loaded
    assert_clean_error(run("generate", "--backend", "torch", "--device", "tpu:0", "-m", small, "-p", "hi", env=env),
                       "--device")


@pytest.mark.parametrize("given, expected", [(None, "0"), ("1", "1")])
def test_generate_keeps_small_pages_unless_told(given, expected, small, monkeypatch):
    """generate loads for one request: huge pages would cost more to fault in than its decode saves
    (speculant/native.py), so it asks for 4 KiB pages unless SPECULANT_THP is set (test_llamacpp.py checks
    that SPECULANT_THP=0 really keeps the weights off huge pages)."""
    from speculant import cli

    monkeypatch.setenv("SPECULANT_THP", "x")  # recorded, so the variable is restored after the test
    monkeypatch.delenv("SPECULANT_THP")
    if given is not None:
        monkeypatch.setenv("SPECULANT_THP", given)
    assert cli.main(["generate", "-m", small, "-p", "hi", "-n", "2"]) == 0
    assert os.environ["SPECULANT_THP"] == expected


def test_demo_drafts_with_the_default_draft_only_for_its_tokenizer(small, capsys):
    """`demo -m smollm2` used to pair the 135M target with the 0.5B Qwen draft (through text, costing more than the
    target's own steps); now a target of another tokenizer family gets the predicted output alone. A GGUF path
    (no registry entry to tell) keeps the default draft, which the vocabulary check then handles."""
    from speculant.cli import build_parser, demo_draft

    assert build_parser().parse_args(["demo"]).model_draft is None  # chosen after parsing (also: --self-spec)
    assert demo_draft(models.DEFAULT_TARGET) == models.DEFAULT_DRAFT
    assert demo_draft("/some/model.gguf") == models.DEFAULT_DRAFT
    assert demo_draft(SMALL) is None
    assert "no registered draft model shares" in capsys.readouterr().err
    proc = run("demo", "-m", SMALL, "-n", "16", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    assert "identical output: yes" in proc.stdout and "then qwen" not in proc.stdout
    assert "the file as predicted output" in proc.stdout
    assert demo_draft(SMALL, predicted=False) is None  # `demo -p TEXT` has no prediction to draft alone
    assert "the speculative run has no drafter" in capsys.readouterr().err
    # --history reaches the demo's drafter (it was accepted and dropped)
    proc = run("demo", "-m", SMALL, "-n", "8", "-t", "1", "--history", "-p", "Say hi.")
    assert proc.returncode == 0 and "history" in proc.stdout, proc.stdout + proc.stderr


def test_output_cut_short_or_unwritable_is_not_a_traceback(small):
    """`speculant generate ... | head` ends quietly when head leaves (status 141, as a tool killed by SIGPIPE);
    a full disk is one error line."""
    proc = subprocess.run(f"{sys.executable} -m speculant generate -m {small} -p 'Once upon a time' -n 48 | head -c 3",
                          shell=True, capture_output=True, text=True, timeout=300,
                          executable="/bin/bash", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert len(proc.stdout) == 3
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([sys.executable, "-m", "speculant", "generate", "-m", small, "-p", "Hi", "-n", "4"],
                                  stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        assert_clean_error(proc, "cannot write the output")


def test_places_that_cannot_be_written_are_one_line_errors(small, tmp_path):
    blocker = tmp_path / "a-file"  # nothing can be made below a file, whoever runs the test (root included)
    blocker.write_text("")
    assert_clean_error(run("pull", "gemma-3-270m", env={"SPECULANT_HOME": str(blocker / "home")}),
                       "cannot write models into", "SPECULANT_HOME")
    assert_clean_error(run("quantize", small, "--type", "Q8_0", "--allow-requantize", "-o", str(blocker / "q.gguf")),
                       "cannot write", "q.gguf")
    if os.path.exists("/dev/full"):
        for command in ("models", "doctor"):
            with open("/dev/full", "w") as full:
                proc = subprocess.run([sys.executable, "-m", "speculant", command], stdout=full,
                                      stderr=subprocess.PIPE, text=True, timeout=300)
            assert_clean_error(proc, "No space left")


def test_a_corrupt_local_index_is_reported_and_never_overwritten(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    index = home / "models" / "local.json"
    index.write_text("{not json")
    proc = run("models", env={"SPECULANT_HOME": str(home)})
    assert proc.returncode == 0 and "local.json" in proc.stderr and "cannot be read" in proc.stderr
    assert SMALL in proc.stdout  # the registered models are still listed
    from speculant.errors import ModelError

    monkeypatch.setenv("SPECULANT_HOME", str(home))
    with pytest.raises(ModelError, match="fix or remove it"):
        models.register_local("mine", {"path": "x"})
    assert index.read_text() == "{not json"


def test_chat_without_a_template_is_warned_about():
    from speculant.chat import missing_template_warning

    assert "has no chat template" in missing_template_warning(None, "/m/base.gguf")
    assert "base.gguf" in missing_template_warning("", "/m/base.gguf")
    assert missing_template_warning("{% for m in messages %}{% endfor %}", "x") is None


class _Vocab:
    """A backend's template and vocabulary, as chat.fallback_stop_strings sees them."""

    def __init__(self, template, im_end_ids, eog=()):
        self.template, self.ids, self.eog = template, im_end_ids, set(eog)

    def chat_template(self):
        return self.template

    def tokenize(self, text, add_special=True):
        assert text == "<|im_end|>" and not add_special
        return list(self.ids)

    def is_eog(self, token):
        return token in self.eog


def test_the_chatml_fallback_stops_at_im_end_written_as_text():
    """No template and no <|im_end|> token (gemma-3-270m): the model writes it as text, which ends nothing, so
    it is a stop string; not with a template, nor where <|im_end|> is the model's own end-of-generation token."""
    from speculant.chat import fallback_stop_strings

    assert fallback_stop_strings(_Vocab(None, [236820, 236909, 548])) == ["<|im_end|>"]
    assert fallback_stop_strings(_Vocab("", [7], eog=())) == ["<|im_end|>"]  # one token, but it ends nothing
    assert fallback_stop_strings(_Vocab(None, [2], eog=[2])) == []  # SmolLM2, Qwen: their EOG
    assert fallback_stop_strings(_Vocab("{{ messages }}", [236820, 236909])) == []  # its own template


def test_gemma_chat_without_a_template_ends_at_the_chatml_turn_end():
    """gemma-3-270m ships no template and has no <|im_end|> token: a chat answer (is_chat, as the CLI's --chat and
    the server's chat endpoint ask) ends where it writes one, instead of running to max_tokens; the caller passes no
    stop string (the engine adds fallback_stop_strings)."""
    if not models.cached_path("gemma-3-270m").exists():
        pytest.skip("gemma-3-270m not pulled")
    from speculant.api import load_engine
    from speculant.chat import fallback_stop_strings
    from speculant.verify import SamplingParams

    engine = load_engine("gemma-3-270m", threads=1, n_ctx=256, lookup=False)
    try:
        prompt = engine.chat_prompt([{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
        stop = fallback_stop_strings(engine.target)
        r = engine.generate(prompt, max_tokens=48, params=SamplingParams(0.0), is_chat=True)
    finally:
        engine.close()
    assert stop == ["<|im_end|>"]
    assert r.finish_reason == "stop" and r.stop_string == "<|im_end|>" and r.stats.generated_tokens < 48
    assert "<|im_end|>" not in r.text


# -- audit findings: pull checks every name first and verifies; --draft-vocab's range up front ---------------------

def test_pull_checks_every_name_before_downloading_and_verifies_present_files(monkeypatch, capsys):
    from speculant import cli

    pulled = []
    monkeypatch.setattr(models, "pull", lambda name, **kw: pulled.append((name, kw)) or models.home() / name)
    for bad in ("", "no-such-model"):
        assert cli.main(["pull", SMALL, bad]) == 1
        assert f"unknown model {bad!r}" in capsys.readouterr().err and pulled == []
    assert cli.main(["pull", "-q", SMALL]) == 0
    assert pulled == [(SMALL, {"quiet": True, "verify": True})]  # an explicit pull checks the sha256


@pytest.mark.parametrize("n", ["1", "255"])
def test_a_draft_vocabulary_too_small_is_refused_before_loading(n):
    assert_clean_error(run("generate", "-m", "no-such-model", "-md", "no-such-draft", "-p", "hi", "--draft-vocab", n),
                       "--draft-vocab must be 0 (the full vocabulary) or at least 256")


@pytest.mark.parametrize("flag", [["--self-spec-exit", "3"], ["--self-spec-config", "c.json"], ["--self-spec"]])
def test_every_self_spec_flag_means_self_speculation(flag):
    """So `demo --self-spec-exit 3` does not pick the default draft model as well (it was refused: 'do not also
    pass a draft model', which the user had not)."""
    from speculant.cli import build_parser, check_model_flags

    args = build_parser().parse_args(["demo", "--backend", "torch", *flag])
    check_model_flags(args)
    assert args.self_spec is True


def test_device_and_dtype_go_to_whichever_model_runs_on_torch(small):
    """A torch draft under a llama.cpp target takes --device / --dtype; with no model on torch they are refused."""
    pytest.importorskip("torch")
    proc = run("generate", "-m", small, "-md", small, "--backend-draft", "torch", "--device", "cpu", "--dtype", "fp32",
               "-t", "1", "--no-adapt", "-n", "8", "-p", "The capital of France is", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["drafted"] > 0
    assert_clean_error(run("generate", "-m", small, "-md", small, "--device", "cpu", "-t", "1", "-p", "hi"),
                       "--dtype and --device apply to the torch backend only", "--backend-draft torch")


def test_a_model_the_torch_backend_cannot_run_is_refused_before_converting(tmp_path):
    """Gemma 3 (sliding-window layers): refused from the GGUF's metadata, not after a GB of dequantized cache."""
    pytest.importorskip("torch")
    if not models.cached_path("gemma-3-270m").exists():
        pytest.skip("gemma-3-270m not pulled")
    env = _home_with(tmp_path, "gemma-3-270m")
    proc = run("generate", "--backend", "torch", "--device", "cpu", "-t", "1", "-m", "gemma-3-270m", "-n", "2",
               "-p", "hi", env=env)
    assert_clean_error(proc, "sliding-window", "llama.cpp backend")
    assert not (tmp_path / "torch").exists() or not any((tmp_path / "torch").iterdir())  # nothing converted


@pytest.mark.parametrize("flags, why", [
    (["-md", "lookup", "--backend-draft", "torch"], "with prompt lookup alone (-md lookup)"),
    (["-md", "history", "--backend-draft", "torch"], "with history drafting alone (-md history)"),
    (["--backend", "torch", "--self-spec", "--backend-draft", "llama.cpp"], "with --self-spec"),
    (["--backend-draft", "torch"], "without a drafter"),
])
def test_backend_draft_without_a_draft_model_is_warned_about(flags, why, capsys):
    from speculant.cli import build_parser, check_model_flags

    args = build_parser().parse_args(["generate", "-p", "hi", *flags])
    check_model_flags(args)
    assert f"speculant: warning: --backend-draft has no effect {why}" in capsys.readouterr().err
    assert args.backend_draft in ("torch", "llama.cpp")  # still passed on as given
    args = build_parser().parse_args(["generate", "-p", "hi", "-md", "some-draft", "--backend-draft", "torch"])
    check_model_flags(args)
    assert "warning" not in capsys.readouterr().err
    args = build_parser().parse_args(["generate", "-p", "hi", "-md", "some-draft"])
    check_model_flags(args)
    assert args.backend_draft == "auto"


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(threads=1.5), "--threads must be an integer"),
    (dict(draft_threads=True), "--threads-draft must be an integer"),
    (dict(model=None), "model must be a registered name or a path"),
    (dict(draft_model=5), "draft_model must be"),
    (dict(lookup="yes"), "lookup must be True, False or None"),
    (dict(max_tokens=0), "or -1"),
    (dict(max_tokens=-2), "or -1"),
    (dict(max_tokens=2.0), "positive integer"),
    (dict(chat=True, prompt=[1, 2]), "chat=True takes the user's message as text"),
])
def test_python_api_arguments_are_checked_before_loading(kwargs, fragment):
    """Wrong types in speculant.generate were TypeErrors from ctypes or os.path (or taken silently: lookup="yes"),
    some after the models had loaded."""
    import speculant
    from speculant.errors import SettingsError

    prompt = kwargs.pop("prompt", "hi")
    with pytest.raises(SettingsError, match=fragment):
        speculant.generate(prompt, **{"model": "no-such-model", **kwargs})


def test_python_api_takes_paths_and_numpy_integers(small):
    """A pathlib.Path model and numpy thread counts are what callers pass (they loaded before the type checks)."""
    import numpy as np

    import speculant

    path = models.cached_path(small)
    r = speculant.generate("The capital of France is", model=path, draft_model=path, threads=np.int64(1),
                           draft_threads=np.int32(1), max_tokens=np.int64(4))
    assert r.tokens == speculant.generate("The capital of France is", model=small, threads=1, max_tokens=4).tokens
    # -1 (or None), as llama.cpp's -n -1 and llama-cpp-python's max_tokens: until the end or a full context
    for until_the_end in (-1, None):
        full = speculant.generate("1, 2, 3, 4, 5, 6,", model=small, threads=1, max_tokens=until_the_end, n_ctx=64)
        assert full.finish_reason == "length" and "context window full" in full.message, full
        assert full.stats.prompt_tokens + full.stats.generated_tokens == 64
