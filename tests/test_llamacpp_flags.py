"""llama.cpp's flags as a llama.cpp user types them: escapes in the prompt and stop strings (-e, on by default),
-f's trailing newline, -sys, --ignore-eos, multi-letter single-dash flags read whole, and the flags that cannot
mean anything here refused in one line."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from speculant import cli, models

SMALL = "smollm2-135m-instruct"


def run(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "speculant", *args], capture_output=True, text=True, input=stdin,
                          timeout=timeout)


@pytest.fixture(scope="module")
def small():
    if not models.cached_path(SMALL).exists():
        pytest.skip("smollm2 not pulled")
    return SMALL


@pytest.fixture()
def seen(monkeypatch):
    """Runs `speculant generate` in this process and records what reaches Engine.stream: the prompt text, the
    stop strings, the token limit, whether it is a chat."""
    from speculant.engine import Engine

    calls = []
    stream = Engine.stream

    def recording(self, prompt, **kw):
        calls.append({"prompt": prompt, "stop": list(kw["stop"]), "max_tokens": kw["max_tokens"],
                      "is_chat": kw["is_chat"], "params": kw["params"], "prediction": kw.get("prediction")})
        return stream(self, prompt, **kw)

    monkeypatch.setattr(Engine, "stream", recording)
    monkeypatch.setenv("SPECULANT_THP", "0")  # generate sets it; restored after the test

    def generate(*args):
        assert cli.main(["generate", "-m", SMALL, "-t", "1", "-n", "1", *args]) == 0
        return calls.pop()

    return generate


def test_repeat_last_n_is_llama_cpps_penalty_window(small, seen):
    """--repeat-last-n (llama-cli's, default 64): the penalties count the last N tokens, prompt included; 0 turns
    them off, -1 is the whole context (they counted the whole prompt and output, vLLM's way, with no flag)."""
    assert seen("-p", "hi", "--repeat-penalty", "1.3")["params"].penalty_last_n == 64
    assert seen("-p", "hi", "--repeat-penalty", "1.3", "--repeat-last-n", "8")["params"].penalty_last_n == 8
    assert seen("-p", "hi", "--repeat-penalty", "1.3", "--repeat-last-n", "-1")["params"].penalty_last_n >= 1 << 30
    off = seen("-p", "hi", "--repeat-penalty", "1.3", "--presence-penalty", "1", "--repeat-last-n", "0")["params"]
    assert not off.penalizes
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", "--repeat-last-n", "-2"), "--repeat-last-n")


# what llama.cpp's string_process_escapes (common/common.cpp) makes of each, checked against that C++ function
# compiled as it is (3,000 random strings of backslashes, x, hex digits, signs, spaces and the escape letters agreed)
ESCAPES = [
    (r"code:\n\n#include", "code:\n\n#include"),
    (r"\r\t\'\"\\", "\r\t'\"\\"),
    (r"\\n", "\\n"),  # an escaped backslash, then a plain n
    (r"\q \a \0 \é", r"\q \a \0 \é"),  # unknown escapes stay, backslash and all
    ("ends in \\", "ends in \\"),  # a lone trailing backslash too
    (r"\x41\x62", "Ab"),
    (r"\xc3\xa9", "é"),  # \x writes one byte: é is two
    (r"\x4", r"\x4"), (r"\x4g", r"\x4g"), (r"\xg4", r"\xg4"), (r"\x0x", r"\x0x"),  # not two hex digits: kept
    (r"\x 9", "\t"), (r"\x+a", "\n"),  # strtol skips a space and takes a sign: one digit then counts
    (r"\x\n", "\\x\n"),  # a failed \x keeps "\x" and reads on from there
]


@pytest.mark.parametrize("typed, meant", ESCAPES)
def test_escapes_are_processed_as_llama_cpp_does(typed, meant):
    assert cli.process_escapes(typed, "-p") == meant


def test_escapes_that_make_bytes_other_than_utf8_are_refused():
    with pytest.raises(cli.SettingsError, match=r"--stop: its \\x escapes make bytes that are not UTF-8"):
        cli.process_escapes(r"\xff", "--stop")
    with pytest.raises(cli.SettingsError):
        cli.process_escapes(r"\x-1", "-p")  # strtol's -1: byte 0xff
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", r"caf\xe9"), "-p: its \\x escapes")


def test_prompt_stop_and_file_escapes_reach_the_engine(small, seen, tmp_path, monkeypatch):
    """-p and each --stop are processed by default (llama.cpp's -e); --no-escape takes them as typed. A prompt
    read from -f or stdin drops one trailing newline (llama.cpp's -f does) and is otherwise taken as written: a
    code file's own \\n must reach the model as they stay in a --prediction file (llama.cpp escapes -f text)."""
    r = seen("-p", r"code:\n\n#include", "--stop", r"\n", "--stop", r"\x41;")
    assert r["prompt"] == "code:\n\n#include" and r["stop"] == ["\n", "A;"]
    r = seen("-p", r"code:\n\n#include", "--stop", r"\n", "--no-escape")
    assert r["prompt"] == r"code:\n\n#include" and r["stop"] == [r"\n"]
    f = tmp_path / "prompt.txt"
    f.write_text('printf("a\\tb\\n");\n\n')
    for flags in ([], ["-e"], ["--no-escape"]):
        assert seen("-f", str(f), *flags)["prompt"] == 'printf("a\\tb\\n");\n'  # one newline dropped, no escapes
    f.write_text("Say hello.\n")
    assert seen("-f", str(f))["prompt"] == "Say hello."
    for args in ([], ["-f", "-"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x\\ty\n")))
        assert seen(*args)["prompt"] == "x\\ty"


def test_files_are_read_as_written_as_stdin_is(small, seen, tmp_path, monkeypatch):
    """A file's \\r\\n line ends reach the model as they do from stdin, and as llama.cpp reads a file (Python's
    newline translation made -f and `< file` two prompts); one trailing \\n is dropped from a prompt, as there."""
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"Hello\r\nWorld\r\n")
    from_file = seen("-f", str(crlf), "--prediction", str(crlf))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello\r\nWorld\r\n")))
    from_stdin = seen("-f", "-")
    assert from_file["prompt"] == from_stdin["prompt"] == "Hello\r\nWorld\r"
    assert from_file["prediction"] == "Hello\r\nWorld\r\n"
    system = tmp_path / "system.txt"
    system.write_bytes(b"Be\r\nbrief.\r\n")
    assert "system\nBe\r\nbrief.\r<|im_end|>" in seen("-sysf", str(system), "-p", "Hi")["prompt"]


def test_system_prompt_is_a_chat_message_before_the_users(small, seen):
    """-sys (parsed as -s 'ys' before) puts a system message first and implies --chat, as llama-cli applies the
    chat template for it; llama.cpp processes no escapes in it, nor does speculant."""
    r = seen("-sys", r"Be\nbrief.", "-p", "Hi")
    assert r["is_chat"]
    assert r["prompt"] == "<|im_start|>system\nBe\\nbrief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n" \
                          "<|im_start|>assistant\n"
    assert seen("--system-prompt", "Be brief.", "-p", "Hi", "--chat")["prompt"] == r["prompt"].replace("\\n", " ")
    # an empty one is no system message, in a chat still (llama-cli's; it was a plain completion of "Hi")
    assert seen("-sys", "", "-p", "Hi")["prompt"] == seen("--chat", "-p", "Hi")["prompt"] != "Hi"
    assert seen("--predict", "3", "-p", "Hi")["max_tokens"] == 3  # not --prediction, as an abbreviation
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", "-sys", "x", "--suffix", __file__),
                       "does not go with -sys")


def test_a_value_may_start_with_a_dash_and_llama_cpp_spellings_are_read(small, seen):
    """A flag's value is the next argument whatever it starts with, as llama.cpp reads it (`--stop ---` was
    "expected one argument"); -r/--reverse-prompt are --stop; -t -1 (llama.cpp's default) and 0 are all cores."""
    r = seen("-p", "-x", "--stop", "---", "-r", "-", "--reverse-prompt", "-n")
    assert r["prompt"] == "-x" and r["stop"] == ["---", "-", "-n"]
    parser = cli.build_parser()
    for value, threads in (("-1", None), ("0", None), ("3", 3)):
        assert parser.parse_args(["generate", "-m", SMALL, "-t", value, "-td", value]).threads == threads
    assert parser.parse_args(["generate", "-m", SMALL, "--temp", "-1", "-n", "-1"]).n_predict == -1
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", "--stop"), "expected one argument")
    # "--" stays argparse's separator: a flag before it still misses its value (merged, it was an empty list)
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", "--stop", "--"), "expected one argument")
    assert_clean_error(run("serve", "-m", "no-such-model", "--api-key", "--"), "expected one argument")
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", "-t", "x"), "invalid int value")


def test_system_prompt_file(small, seen, tmp_path, monkeypatch):
    """-sysf FILE is -sys read from a file (or stdin), less one trailing newline and with no escapes, as
    llama-cli's; it implies --chat too."""
    f = tmp_path / "system.txt"
    f.write_text("Be\\nbrief.\nAlways.\n\n")
    r = seen("-sysf", str(f), "-p", "Hi")
    assert r["is_chat"]
    assert r["prompt"].startswith("<|im_start|>system\nBe\\nbrief.\nAlways.\n<|im_end|>\n<|im_start|>user\nHi")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Be brief.\n")))
    assert seen("--system-prompt-file", "-", "-p", "Hi")["prompt"] == seen("-sys", "Be brief.", "-p", "Hi")["prompt"]
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", "-sysf", str(tmp_path / "none.txt")),
                       "cannot read system prompt file")
    assert_clean_error(run("generate", "-m", "no-such-model", "-sysf", "-"), "the prompt and -sysf would both read stdin")
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", "-sys", "x", "-sysf", str(f)),
                       "not allowed with argument -sys")


def test_stop_newline_ends_the_answer_at_its_first_line(small):
    """`--stop '\\n'` was the two characters backslash and n, which never matched."""
    base = ["generate", "-m", small, "-t", "1", "-n", "24", "--json", "--chat", "-p",
            "Name three colors, one per line, nothing else."]
    plain = json.loads(run(*base).stdout)
    assert "\n" in plain["text"].strip(), plain["text"]
    cut = json.loads(run(*base, "--stop", r"\n").stdout)
    assert cut["finish_reason"] == "stop" and "\n" not in cut["text"] and cut["text"]
    assert plain["text"].startswith(cut["text"] + "\n")
    typed = json.loads(run(*base, "--stop", r"\n", "--no-escape").stdout)
    assert typed["tokens"] == plain["tokens"]


def test_ignore_eos_goes_on_to_the_token_limit_exactly_under_speculation(small):
    base = ["generate", "-m", small, "-t", "1", "-td", "1", "-n", "40", "--json", "--chat", "-p", "Say OK."]
    ended = json.loads(run(*base).stdout)
    assert ended["finish_reason"] == "stop" and len(ended["tokens"]) < 40  # the model ends by itself
    on = run(*base, "--ignore-eos")
    assert on.returncode == 0, on.stderr
    on = json.loads(on.stdout)
    assert on["finish_reason"] == "length" and len(on["tokens"]) == 40 and not on["stats"]["ended_by_eog"]
    assert on["tokens"][:len(ended["tokens"])] == ended["tokens"]  # the same until where it would have ended
    spec = json.loads(run(*base, "--ignore-eos", "-md", small, "--no-adapt", "--draft-max", "3").stdout)
    assert spec["tokens"] == on["tokens"] and spec["stats"]["drafted"] > 0


def test_ignore_eos_under_a_grammar_ends_where_the_grammar_does(small):
    """A grammar complete under --ignore-eos allows only the banned end tokens: the answer ends there, with a
    message (an arbitrary token was picked: Qwen's grammar aborted the process on it, SmolLM2 emitted its banned
    end token silently; sampled, a KeyError), plain and speculative alike."""
    from speculant.engine import GRAMMAR_ENDED

    base = ["generate", "-m", small, "-t", "1", "-n", "10", "--json", "-p", "Is the sky blue? Answer:",
            "--grammar", 'root ::= " yes" | " no"', "--ignore-eos"]
    for sampled in ([], ["--temp", "0.8", "-s", "1"]):
        outs = []
        for drafter in ([], ["-md", "lookup"], ["-md", small, "--no-adapt", "--draft-max", "3"]):
            proc = run(*base, *sampled, *drafter)
            assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
            out = json.loads(proc.stdout)
            assert out["text"] in (" yes", " no") and out["finish_reason"] == "stop", out
            assert out["message"] == GRAMMAR_ENDED and GRAMMAR_ENDED in proc.stderr
            outs.append(out["tokens"])
        assert outs[1:] == outs[:-1]


def test_serve_and_demo_process_escapes_too(small, monkeypatch):
    from speculant import server

    got = []
    monkeypatch.setattr(server, "cmd_serve", lambda args: got.append(args.stop) or 0)
    assert cli.main(["serve", "--stop", r"\n", "--stop", r"</s>\t"]) == 0
    assert cli.main(["serve", "--stop", r"\n", "--no-escape"]) == 0
    assert got == [["\n", "</s>\t"], [r"\n"]]
    demo = run("demo", "-m", small, "-n", "2", "-t", "1", "-p", r"Say\thi.")
    assert demo.returncode == 0 and "prompt: Say\thi.\n" in demo.stdout, demo.stdout + demo.stderr


def assert_clean_error(proc, *fragments, code=None):
    assert proc.returncode != 0 and (code is None or proc.returncode == code), (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout[:300] + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculant: error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


REFUSED = [  # (command, flags, what the one line must say)
    ("generate", ["-hf", "ggml-org/X"], "no model hub is reachable here: `speculant pull NAME`"),  # was -h -f
    ("generate", ["-hfr", "ggml-org/X"], "-m PATH"),
    ("generate", ["--hf-repo", "ggml-org/X"], "-m PATH"),
    ("generate", ["-hff", "x.gguf"], "-m PATH"),
    ("generate", ["-hft", "token"], "-m PATH"),
    ("generate", ["-hfd", "ggml-org/X"], "-md PATH"),
    ("generate", ["-fa"], "flash attention"),  # was -f a
    ("generate", ["-fa", "on"], "flash_attn_type disabled"),
    ("serve", ["--flash-attn", "auto"], "flash_attn_type disabled"),
    ("generate", ["-ctk", "q8_0"], "f16"),  # was -c tk
    ("generate", ["-ctv", "q4_0"], "f16"),
    ("generate", ["--cache-type-k", "q8_0"], "f16"),
    ("generate", ["-b", "2048"], "batch-invariant passes of 64 tokens"),
    ("serve", ["-ub", "512"], "batch-invariant passes of 64 tokens"),
    ("demo", ["--batch-size", "512"], "batch-invariant passes of 64 tokens"),
    ("generate", ["-np", "2"], "`speculant serve -np N`"),  # was -n p
    ("generate", ["-mli"], "--chat for one chat turn"),  # was -m li
    ("generate", ["-i"], "--chat for one chat turn"),
    ("generate", ["-if"], "--chat for one chat turn"),
    ("generate", ["-cnv"], "-cnv (interactive conversation) is not supported"),
    # samplers speculant has not: a llama-cli command with them got a bare "unrecognized arguments"
    ("generate", ["--mirostat", "2"], "--mirostat (Mirostat sampling) is not supported: speculant samples with"),
    ("serve", ["--mirostat-lr", "0.2"], "this sampler is not implemented"),
    ("generate", ["--typical", "0.9"], "locally typical sampling"),
    ("generate", ["--dry-multiplier", "0.8"], "DRY"),
    ("serve", ["--dry-base", "1.75"], "DRY"),
    ("generate", ["--xtc-probability", "0.5"], "XTC"),
    ("generate", ["--top-nsigma", "1.5"], "top-n-sigma"),
    ("generate", ["--dynatemp-range", "0.5"], "dynamic temperature"),
    ("generate", ["--dynatemp-range", "1"], "dynamic temperature"),  # on in llama.cpp (temp +- 1): not taken
    ("generate", ["--dynatemp-exp", "2"], "dynamic temperature's exponent"),
    ("generate", ["--mlock"], "not locked"),
    ("serve", ["--chat-template", "chatml"], "the model file's own"),
    ("generate", ["-v"], "SPECULANT_VERBOSE=1"),
]


def test_samplers_run_the_chain_they_list(small, seen):
    """llama-cli's --samplers (names separated by ';') and --sampling-seq (one character each): only the samplers
    listed run, the temperature left out samples at 1; the infill sampler reads the model's vocabulary after the
    sampler before it; an order that would change the distribution, adaptive-p, or both flags: one line each."""
    from speculant.verify import SamplingParams

    def want(*args):
        return SamplingParams(*args, 4, penalty_last_n=64)  # --repeat-last-n's default window

    base = ["-p", "hi", "--temp", "0.7", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.1", "-s", "4"]
    assert seen(*base, "--samplers", "top_k;top_p")["params"] == want(1.0, 20, 0.9, 0.0)
    assert seen(*base, "--sampling-seq", "kpt")["params"] == want(0.7, 20, 0.9, 0.0)
    assert seen(*base, "--samplers", "Top-K;nucleus;temp")["params"] == want(0.7, 20, 0.9, 0.0)
    assert seen(*base, "--samplers", "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature")[
        "params"] == seen(*base)["params"]
    assert seen(*base, "--sampling-seq", "")["params"] == want(1.0, 0, 1.0, 0.0)  # none: llama.cpp's dist alone
    infill = seen(*base, "--samplers", "top_k;top_p;infill")["params"]
    assert infill.infill is not None and infill.infill_after == "top_p" and len(infill.infill.pieces) == 49152
    for flags, fragment in ((["--samplers", "top_p;top_k"], "--samplers: samplers top_p, top_k in this order"),
                            (["--sampling-seq", "tk"], "--sampling-seq: samplers temperature, top_k in this order"),
                            (["--samplers", "top_k;adaptive_p"], "--samplers: the adaptive-p sampler"),
                            (["--samplers", "top_k", "--sampling-seq", "k"], "--samplers and --sampling-seq both")):
        assert_clean_error(run("generate", "-m", "no-such-model", *base, *flags), fragment)  # before the model
    assert_clean_error(run("serve", "-m", "no-such-model", *base[2:], "--samplers", "temperature;min_p"),
                       "--samplers: samplers temperature, min_p in this order")


def test_samplers_names_are_read_as_llama_cpp_reads_them(small, seen, capsys):
    """Names are whole between the ';' (a space is part of one, as in llama.cpp, so " temperature" is no sampler):
    one that is none is skipped, with one warning, as llama.cpp skips and warns."""
    got = seen("-p", "hi", "--temp", "0.7", "--samplers", "top_k; temperature")["params"]
    assert got.temperature == 1.0 and got.top_k == 40
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["speculant: warning: --samplers: no sampler is named ' temperature'; it is skipped, as "
                        "llama.cpp skips it"]


def test_serve_samplers_set_the_default_chain_not_the_defaults(small):
    """serve --samplers is the chain of requests that leave "samplers" out; the flags' values stay the server's
    defaults (a request listing the penalties gets --repeat-penalty, though the default chain leaves them out)."""
    import signal

    import httpx

    from speculant.server import spawn_local

    proc, url = spawn_local(["-m", SMALL, "-t", "1", "-c", "256", "--samplers", "top_k;temperature",
                             "--repeat-penalty", "1.3", "--presence-penalty", "0.5", "--temp", "0.7"], timeout=120,
                            exe=str(Path(sys.executable).with_name("speculant")))
    try:
        params = httpx.get(url + "/props", timeout=30).json()["default_generation_settings"]["params"]
        assert params["samplers"] == ["top_k", "temperature"] and params["repeat_penalty"] == 1.3
        assert params["presence_penalty"] == 0.5 and params["temperature"] == 0.7
        body = {"prompt": "Once upon a time", "n_predict": 32, "seed": 1, "top_k": 1}  # top-k 1: greedy
        base = httpx.post(url + "/completion", json=body, timeout=60).json()["content"]
        penalized = httpx.post(url + "/completion", json={**body, "samplers": ["penalties", "top_k"]},
                               timeout=60).json()["content"]
        assert base and penalized != base  # the server's 1.3 and 0.5
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


@pytest.mark.parametrize("command, flags, fragment", REFUSED, ids=[" ".join(r[1]) for r in REFUSED])
def test_llama_cpp_flags_that_mean_nothing_here_are_refused_in_one_line(command, flags, fragment):
    prompt = ["-p", "hi"] if command != "serve" else []
    assert_clean_error(run(command, "-m", "no-such-model", *prompt, *flags), fragment, code=2)


@pytest.mark.parametrize("flags", [["-tb", "2", "-t", "2"], ["-tb", "0"], ["--threads-batch", "3", "-t", "3"],
                                   ["-ngld", "0"], ["--gpu-layers-draft", "0"], ["-fa", "off"], ["-ctk", "f16"],
                                   ["--predict", "16"], ["--n-predict", "16"], ["-n16"], ["-e"], ["--no-escape"],
                                   # samplers at their off values, and what speculant does anyway
                                   ["--mirostat", "0"], ["--typical", "1.0"], ["--dry-multiplier", "0"],
                                   ["--xtc-probability", "0"], ["--top-nsigma", "-1"], ["--jinja"], ["--no-mmap"],
                                   ["--dynatemp-range", "0"], ["--dynatemp-exp", "1"],
                                   ["-st"], ["--single-turn"], ["--no-display-prompt"]])
def test_llama_cpp_flags_that_mean_what_speculant_does_are_accepted(flags):
    """Parsed and checked: the run then stops at the model name, which only comes after the flags are read."""
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", *flags), "unknown model 'no-such-model'")


@pytest.mark.parametrize("flags, fragment", [
    (["-tb", "1", "-t", "2"], "-tb 1: speculant processes prompts with the threads it generates with (-t, here 2)"),
    (["-ngld", "99"], "-ngld 99: no GPU offload in the llama.cpp backend"),  # was -n gld
    (["-ngld", "99", "--backend-draft", "torch", "-md", "x"], "the torch backend places the whole model"),
    (["-sys"], "argument -sys/--system-prompt: expected one argument"),  # was -s ys
    (["-nkvo"], "unrecognized arguments: -nkvo"),  # an unknown word, not -n kvo
    (["--predic", "16"], "unrecognized arguments: --predic"),  # no abbreviations (--predict was --prediction)
    (["--pred", "x"], "unrecognized arguments: --pred"),
])
def test_llama_cpp_flags_are_read_whole_and_checked(flags, fragment):
    assert_clean_error(run("generate", "-m", "no-such-model", "-p", "hi", *flags), fragment)


def test_unknown_hf_flag_no_longer_prints_the_help():
    """`generate -hf REPO -p hi` was -h -f: the full help on stdout and exit 0."""
    proc = run("generate", "-hf", "ggml-org/gemma-3-1b-it-GGUF", "-p", "hi")
    assert proc.returncode == 2 and proc.stdout == "" and "usage" not in proc.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "demo"])
def test_refused_flags_are_in_the_help_not_the_usage_line(command):
    text = run(command, "--help").stdout
    usage, _, rest = text.partition("options:")
    assert "-hf" not in usage and "-fa" not in usage and "llama.cpp flags refused here" in rest and "-fa" in rest
    assert "-e, --escape, --no-escape" in rest


def test_a_prompt_file_before_a_suffix_file_is_read_as_it_is(small, tmp_path, monkeypatch):
    """With --suffix the prompt is the text before a cursor, the suffix file the text after it: both are read
    exactly (a newline before the cursor is kept, a backslash in the code stays), whereas -p is still escaped."""
    from speculant.engine import Engine
    from speculant.errors import SettingsError

    got = []

    def recording(self, prompt, suffix):
        got.append((prompt, suffix))
        raise SettingsError("recorded")

    monkeypatch.setattr(Engine, "fim_prompt", recording)
    monkeypatch.setenv("SPECULANT_THP", "0")
    before, after = tmp_path / "before.py", tmp_path / "after.py"
    before.write_text('print("a\\n")\n')
    after.write_text('print("b\\n")\n')
    assert cli.main(["generate", "-m", SMALL, "-t", "1", "-f", str(before), "--suffix", str(after)]) == 1
    assert cli.main(["generate", "-m", SMALL, "-t", "1", "-p", r"x = 1\n", "--suffix", str(after)]) == 1
    assert got == [('print("a\\n")\n', 'print("b\\n")\n'), ("x = 1\n", 'print("b\\n")\n')]
