"""`speculant quantize`: llama.cpp's quantizer on the real SmolLM2-135M, in a scratch $SPECULANT_HOME.

The result must be a GGUF of the asked type that loads and generates, named in the local registry (with its
sha256), written atomically; bad input must give one clear line and leave nothing behind."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import as_from_a_terminal, small_imatrix_entries, write_imatrix
from speculant import models

pytestmark = pytest.mark.models

SMALL = "smollm2-135m-instruct"


def run(*args, env):
    return subprocess.run([sys.executable, "-m", "speculant", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env})


def assert_clean_error(proc, *needles):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [s for s in proc.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("speculant: error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture()
def home(tmp_path):
    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / models.cached_path(SMALL).name).symlink_to(models.cached_path(SMALL))
    return tmp_path


def _gguf_types(path):
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path, "r").tensors}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_requantized_model_loads_generates_and_is_registered(home, qtype):
    env = {"SPECULANT_HOME": str(home)}
    proc = run("quantize", SMALL, "--type", qtype, "--allow-requantize", "-q", env=env)
    assert proc.returncode == 0, proc.stderr
    name = f"{SMALL}-{qtype.lower()}"
    assert proc.stdout.startswith(f"{name}: ") and "requantized" in proc.stdout
    entry = json.loads((home / "models" / "local.json").read_text())[name]
    path = home / "models" / f"{name}.gguf"
    assert entry["path"] == str(path) and entry["size"] == path.stat().st_size
    assert entry["sha256"] == models.sha256_file(path)
    assert entry["type"] == qtype and entry["requantized"] and entry["tokenizer"] == "smollm2"
    types = _gguf_types(path)
    assert sum(t == qtype for t in types.values()) > 100  # the attention and FFN matrices (210 in SmolLM2)
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".quantize-")]  # nothing staged left
    listed = run("models", env=env)
    assert name in listed.stdout
    assert f"{name}" in run("doctor", env=env).stdout  # doctor lists what quantize made too
    gen = run("generate", "-m", name, "-md", name, "-p", "The capital of France is", "-n", "8", "--json",
              "-t", "1", env=env)
    assert gen.returncode == 0, gen.stderr
    out = json.loads(gen.stdout)
    assert out["stats"]["generated_tokens"] == 8 and out["text"].strip()


def test_output_tensor_type_and_own_path(home, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "small-q8-out-q4.gguf"
    env = {"SPECULANT_HOME": str(home)}
    proc = run("quantize", SMALL, "--type", "Q8_0", "--output-tensor-type", "Q4_0", "--allow-requantize", "-q",
               "-o", str(out), "--name", "small-test", env=env)
    assert proc.returncode == 0, proc.stderr
    # SmolLM2 ties its output layer to the token embeddings, so the embedding matrix is the one it quantizes
    types = _gguf_types(out)
    assert "output.weight" not in types and types["token_embd.weight"] == "Q4_0"
    assert json.loads((home / "models" / "local.json").read_text())["small-test"]["path"] == str(out)


def test_dry_run_names_every_tensor_type_and_size_the_real_run_writes(home):
    """`--dry-run` is llama.cpp's own dry run: for a mixed type (Q3_K_M: Q3_K, Q4_K, Q5_K, Q6_K by tensor, and
    SmolLM2's rows of 576 values falling back to other types) every tensor's type and byte count equal the real
    file's, and nothing is written."""
    from gguf import GGUFReader

    from speculant import quantize

    env = {"SPECULANT_HOME": str(home)}
    dry = run("quantize", SMALL, "--type", "Q3_K_M", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert sorted(p.name for p in (home / "models").iterdir()) == [models.cached_path(SMALL).name]
    planned = quantize.dry_run(SMALL, "Q3_K_M")
    assert planned.fallbacks > 0 and planned.source_quantized and not planned.needs_imatrix
    assert run("quantize", SMALL, "--type", "Q3_K_M", "--allow-requantize", "-q", env=env).returncode == 0
    written = {t.name: (t.tensor_type.name, [int(x) for x in t.shape], int(t.n_bytes))
               for t in GGUFReader(home / "models" / f"{SMALL}-q3_k_m.gguf", "r").tensors}
    assert {name: (ttype, shape, nbytes) for name, ttype, shape, nbytes, _ in planned.tensors} == written
    assert len({t for t, _, _ in written.values()}) >= 3
    mib = planned.data_bytes / 2 ** 20
    assert f"{SMALL} as Q3_K_M (llama.cpp's quantizer, dry run: nothing written)" in dry.stdout
    assert f"tensor data {mib:.0f} MiB" in dry.stdout and "verify passes on this CPU: at batch cost" in dry.stdout
    assert f"{planned.fallbacks} tensors get a fallback type" in dry.stdout and "--allow-requantize" in dry.stdout


def test_dry_run_says_what_a_type_would_cost_speculation_and_needs(home):
    """Q1_0 (no multi-token kernel) on the Qwen 0.5B, its tied output layer too: the share verified one token at a time; IQ2_XXS: the
    importance matrix the real run would need. Exit 0, nothing written; -o with --dry-run is refused."""
    qwen = "qwen2.5-coder-0.5b-instruct"
    if not models.cached_path(qwen).exists():
        pytest.skip(f"{qwen} not pulled")
    env = {"SPECULANT_HOME": str(home)}
    slow = run("quantize", str(models.cached_path(qwen)), "--type", "Q1_0", "--output-tensor-type", "Q1_0",
               "--dry-run", env=env)
    assert slow.returncode == 0, slow.stderr
    assert re.search(r"one token at a time over \d+% of the matmul weights \(Q1_0\): speculation would gain little",
                     slow.stdout), slow.stdout
    imatrix = run("quantize", SMALL, "--type", "IQ2_XXS", "--dry-run", env=env)
    assert imatrix.returncode == 0 and "needs an importance matrix: pass --imatrix FILE" in imatrix.stdout
    assert "IQ2_XXS" in imatrix.stdout and "at batch cost" in imatrix.stdout
    for ours in ("IQ3_XS", "IQ3_XXS"):  # llama.cpp makes them without; the real run refuses them without one
        said = run("quantize", SMALL, "--type", ours, "--dry-run", env=env)
        assert said.returncode == 0 and "needs an importance matrix: pass --imatrix FILE" in said.stdout, said.stdout
        assert_clean_error(run("quantize", SMALL, "--type", ours, "--allow-requantize", env=env),
                           f"{ours} needs an importance matrix")
    assert "needs an importance" not in run("quantize", SMALL, "--type", "IQ3_S", "--dry-run", env=env).stdout
    dense = run("quantize", SMALL, "--type", "MXFP4_MOE", "--dry-run", env=env)  # was silently all Q8_0
    assert dense.returncode == 0 and "has no expert matrices, so it comes out all Q8_0" in dense.stderr
    assert_clean_error(run("quantize", SMALL, "--type", "Q4_0", "--dry-run", "-o", str(home / "x.gguf"), env=env),
                       "--dry-run writes nothing")
    assert_clean_error(run("quantize", SMALL, "--type", "Q9_9", "--dry-run", env=env), "unknown quantization type")
    assert sorted(p.name for p in (home / "models").iterdir()) == [models.cached_path(SMALL).name]


def test_refuses_to_requantize_unless_asked(home):
    proc = run("quantize", SMALL, "--type", "Q8_0", env={"SPECULANT_HOME": str(home)})
    assert_clean_error(proc, "already holds quantized weights", "Q4_1", "--allow-requantize", "acceptance")
    assert not list((home / "models").glob("*q8_0*"))


@pytest.mark.parametrize("args, needles", [
    (["--type", "Q9_9"], ["unknown quantization type", "Q4_0", "Q4_K_M", "Q8_0"]),
    (["--type", "Q4_0", "--output-tensor-type", "Q7"], ["unknown tensor type", "--output-tensor-type"]),
    (["--type", "Q4_0", "-t", "100000"], ["--threads must be 1..512"]),
    # a name is a file in $SPECULANT_HOME/models and a word for -m/-md (they wrote outside it, made folders,
    # fell back to the default name, or named a model -md could never reach)
    (["--type", "Q4_0", "--name", "../escaped"], ["--name '../escaped'", "letters, digits"]),
    (["--type", "Q4_0", "--name", "bad/name"], ["--name 'bad/name'"]),
    (["--type", "Q4_0", "--name", ""], ["--name ''"]),
    (["--type", "Q4_0", "--name", "x.gguf"], ["without .gguf"]),
    (["--type", "Q4_0", "--name", "lookup"], ["the name of a drafter (-md lookup)"]),
    (["--type", "Q4_0", "--name", "History"], ["the name of a drafter (-md history)"]),
])
def test_bad_settings(home, args, needles):
    assert_clean_error(run("quantize", SMALL, *args, "--allow-requantize", env={"SPECULANT_HOME": str(home)}),
                       *needles)
    assert sorted(p.name for p in home.rglob("*")) == ["models", models.cached_path(SMALL).name]  # nothing made


def test_missing_and_corrupt_inputs(home, tmp_path_factory):
    env = {"SPECULANT_HOME": str(home)}
    scratch = tmp_path_factory.mktemp("bad")
    assert_clean_error(run("quantize", str(scratch / "none.gguf"), "--type", "Q4_0", env=env), "not found")
    assert_clean_error(run("quantize", "no-such-model", "--type", "Q4_0", env=env), "unknown model")
    cut = scratch / "cut.gguf"
    cut.write_bytes(models.cached_path(SMALL).read_bytes()[:5_000_000])  # header intact, tensor data cut off
    assert_clean_error(run("quantize", str(cut), "--type", "Q4_0", "--allow-requantize", env=env), "truncated")
    junk = scratch / "junk.gguf"
    junk.write_bytes(b"not a model at all" * 100)
    assert_clean_error(run("quantize", str(junk), "--type", "Q4_0", env=env), "not a GGUF file")
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".quantize-") or "q4_0" in p.name]


def test_a_disk_that_fills_up_is_named_and_nothing_is_kept(home, small_disk):
    out = small_disk / "big.gguf"  # F16 of the 135M model: about 260 MiB on a 40 MiB disk
    assert_clean_error(run("quantize", SMALL, "--type", "F16", "--allow-requantize", "-q", "-o", str(out),
                           env={"SPECULANT_HOME": str(home)}),
                       f"the disk holding {small_disk} is full", "nothing was kept")
    assert list(small_disk.iterdir()) == []


def test_a_failed_dry_run_gives_llama_cpps_reason(home):
    """It gave the child's closing 'llama_model_quantize returned 1' instead (the real run's reason was right)."""
    assert_clean_error(run("quantize", SMALL, "--type", "Q1_0", "--dry-run", "--allow-requantize",
                           env={"SPECULANT_HOME": str(home)}), "not divisible by 128", "no tensor type fallback")


def test_output_onto_its_input_is_refused(home):
    src = str(models.cached_path(SMALL))
    assert_clean_error(run("quantize", SMALL, "--type", "Q4_0", "--allow-requantize", "-o", src,
                           env={"SPECULANT_HOME": str(home)}), "is the input file")


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct-q4_0", "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0"])
def test_pull_makes_a_derived_draft_once_with_its_recorded_sha256(tmp_path, name):
    spec = models.REGISTRY[name]
    if not models.cached_path(spec.derived_from).exists():
        pytest.skip(f"{spec.derived_from} not pulled")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / models.cached_path(spec.derived_from).name).symlink_to(models.cached_path(spec.derived_from))
    env = {"SPECULANT_HOME": str(tmp_path)}
    first = run("pull", name, env=env)
    assert first.returncode == 0, first.stderr
    assert "preparing" in first.stderr and "never the output" in first.stderr and "warning" not in first.stderr
    made = tmp_path / "models" / spec.filename
    assert made.stat().st_size == spec.size and models.sha256_file(made) == spec.sha256  # deterministic here
    types = _gguf_types(made)
    assert types["blk.0.ffn_up.weight"] == "Q4_0" and types["output.weight"] == (spec.output_type or "Q8_0")
    again = run("pull", name, env=env)
    assert again.returncode == 0 and "preparing" not in again.stderr  # made once, then cached
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".quantize-")]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_quantize_leaves_nothing(home, sig, code):
    """The quantizer runs in a child: a signal to the command stops it at once and removes the staged file."""
    proc = subprocess.Popen([sys.executable, "-m", "speculant", "quantize", SMALL, "--type", "Q4_K_M",
                             "--allow-requantize", "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "SPECULANT_HOME": str(home)}, preexec_fn=as_from_a_terminal)
    folder = home / "models"
    deadline = time.monotonic() + 60
    while not list(folder.glob(".quantize-*/*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    if proc.poll() is not None:
        pytest.skip("quantizing finished before it could be interrupted")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert sorted(p.name for p in folder.iterdir()) == [models.cached_path(SMALL).name]  # nothing else


def test_a_target_verified_one_token_at_a_time_is_named_when_speculating(home):
    """Q1_0 (the Qwen 0.5B requantized to it, its tied embedding and output layer too), a type our build has
    no multi-token kernel for: asking for speculation on it warns that it will seldom pay, and says what does; the
    shipped Q4_1 SmolLM2, SmolLM2 requantized to IQ4_NL and plain decoding get no such warning. (SmolLM2 itself would not do: its rows of 576
    values hold no Q1_0 or K-quant blocks, and what llama.cpp falls back to, Q4_0, Q5_0 or IQ4_NL, verifies at
    batch cost.)"""
    qwen = "qwen2.5-coder-0.5b-instruct"
    if not models.cached_path(qwen).exists():
        pytest.skip(f"{qwen} not pulled")
    (home / "models" / models.cached_path(qwen).name).symlink_to(models.cached_path(qwen))
    env = {"SPECULANT_HOME": str(home), "SPECULANT_COST_PROFILE": "0"}  # no pass costs to measure: quicker
    proc = run("quantize", qwen, "--type", "Q1_0", "--output-tensor-type", "Q1_0", "--allow-requantize", "-q", env=env)
    assert proc.returncode == 0, proc.stderr
    name = f"{qwen}-q1_0-out-q1_0"
    args = ("-p", "The capital of France is", "-n", "4", "-t", "1")
    spec = run("generate", "-m", name, "-md", "lookup", *args, env=env)
    assert spec.returncode == 0, spec.stderr
    assert "verify passes compute one token at a time" in spec.stderr and "Q1_0" in spec.stderr, spec.stderr
    assert "Q4_K_M, Q5_K_M" in spec.stderr and "IQ4_NL" in spec.stderr
    assert run("quantize", SMALL, "--type", "IQ4_NL", "--allow-requantize", "-q", env=env).returncode == 0
    for quiet in (("generate", "-m", name, *args), ("generate", "-m", SMALL, "-md", "lookup", *args),
                  ("generate", "-m", f"{SMALL}-iq4_nl", "-md", "lookup", *args)):  # IQ4_NL: batched since 2026-12-03
        proc = run(*quiet, env=env)
        assert proc.returncode == 0 and "one token at a time" not in proc.stderr, proc.stderr


# -- importance matrices ----------------------------------------------------------------------------------------

def test_both_imatrix_formats_read_as_llama_cpp_reads_them(home, tmp_path):
    import numpy as np

    from speculant import quantize

    entries = small_imatrix_entries()
    for legacy in (False, True):
        path = tmp_path / ("m.dat" if legacy else "m.gguf")
        write_imatrix(path, entries, legacy=legacy)
        read = quantize.read_imatrix(path)
        assert read.keys() == entries.keys()
        for name, values in entries.items():
            np.testing.assert_allclose(read[name], values, rtol=1e-6)


def test_low_bit_types_need_an_importance_matrix_and_a_readable_one(home, tmp_path):
    env = {"SPECULANT_HOME": str(home)}
    assert_clean_error(run("quantize", SMALL, "--type", "IQ2_XXS", "--allow-requantize", env=env),
                       "IQ2_XXS needs an importance matrix", "--imatrix")
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x03\x00\x00\x00not an imatrix")
    assert_clean_error(run("quantize", SMALL, "--type", "IQ2_M", "--imatrix", str(junk), "--allow-requantize",
                           env=env), "is not an importance matrix")
    assert_clean_error(run("quantize", SMALL, "--type", "IQ2_M", "--imatrix", str(tmp_path / "none.gguf"),
                           "--allow-requantize", env=env), "no such file")
    other = tmp_path / "other-model.gguf"  # an importance matrix of another model: columns that do not match
    write_imatrix(other, {name: values[:64] for name, values in small_imatrix_entries().items()})
    assert_clean_error(run("quantize", SMALL, "--type", "IQ2_XXS", "--imatrix", str(other), "--allow-requantize",
                           "-q", env=env), "quantizer failed", "imatrix size 64 is different from tensor size 576")
    assert not [p for p in (home / "models").iterdir() if p.name.startswith(".quantize-") or "iq2" in p.name]


def test_quantize_to_a_registered_derived_model_makes_it_as_pull_does(home, monkeypatch, capsys):
    """A type whose default name is a registered derived model's is made by pull, with the threads asked for."""
    import dataclasses

    from speculant import cli, quantize

    name = f"{SMALL}-q8_0"
    spec = dataclasses.replace(models.REGISTRY[SMALL], name=name, filename=f"{name}.gguf", parts=(),
                               derived_from=SMALL, quant_type="Q8_0")
    monkeypatch.setitem(models.REGISTRY, name, spec)
    monkeypatch.setenv("SPECULANT_HOME", str(home))
    threads = []
    real_make = quantize.make
    monkeypatch.setattr(quantize, "make", lambda *a, **kw: threads.append(kw.get("threads")) or real_make(*a, **kw))
    assert cli.main(["quantize", SMALL, "--type", "Q8_0", "--allow-requantize", "-q", "-t", "1"]) == 0
    out = capsys.readouterr().out
    path = home / "models" / f"{name}.gguf"
    assert out.startswith(f"{name}: {path} (") and models.sha256_file(path)[:16] in out
    assert threads == [1] and name not in models.local_entries()  # registered: no local entry
    # the digest it was made with is recorded beside it: what a later `pull` checks it against
    assert (home / "models" / f"{name}.gguf.sha256").read_text().strip() == models.sha256_file(path)


def test_an_imatrix_directory_is_named_a_directory(tmp_path):
    from speculant import quantize
    from speculant.errors import SettingsError

    with pytest.raises(SettingsError, match="is a directory"):
        quantize.read_imatrix(tmp_path)
