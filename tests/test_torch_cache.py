"""The torch backend's cache of converted GGUFs ($SPECULANT_HOME/torch/): keyed by the file (two files of one name
and size never share a conversion; a file changed in place is converted again), safe to interrupt, to run in two
processes at once, and to damage (a damaged cache is converted again, with a warning). On a tiny llama GGUF made
from SmolLM2's tokenizer (600 tokens, one layer of width 64: a conversion takes seconds), in a scratch
$SPECULANT_HOME."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf_py = pytest.importorskip("gguf")

from speculant import models  # noqa: E402

SOURCE = models.cached_path("smollm2-135m-instruct")  # read only, from the real cache, before any home moves
pytestmark = pytest.mark.skipif(not SOURCE.exists(), reason="smollm2-135m-instruct is not pulled")
PROMPT = "The capital of France is"
REPO = Path(__file__).resolve().parent.parent


def write_tiny_gguf(path: Path, n_vocab: int = 600, seed: int = 0) -> None:
    """A llama GGUF with SmolLM2's metadata and first n_vocab tokens (and the merges among them), one layer of
    width 64, random F32 weights: transformers and llama.cpp both load it."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    src = GGUFReader(str(SOURCE))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:n_vocab]
    known = set(tokens)
    merges = [m for m in src.fields["tokenizer.ggml.merges"].contents()[:n_vocab]
              if all(p in known for p in m.split(" ")) and m.replace(" ", "") in known]
    override = {"llama.block_count": 1, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
                "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
                "llama.rope.dimension_count": 32, "llama.context_length": 512, "llama.vocab_size": n_vocab,
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
                "tokenizer.ggml.token_type": src.fields["tokenizer.ggml.token_type"].contents()[:n_vocab]}
    w = GGUFWriter(str(path), "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        array = field.types[0] == GGUFValueType.ARRAY
        w.add_key_value(key, override.get(key, field.contents()), field.types[0],
                        sub_type=field.types[-1] if array else None)
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.2 + (1 if len(shape) == 1 else 0)).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(n_vocab, 64))
    w.add_tensor("output_norm.weight", weight(64))
    for name, shape in (("attn_norm", (64,)), ("ffn_norm", (64,)), ("attn_q", (64, 64)), ("attn_k", (32, 64)),
                        ("attn_v", (32, 64)), ("attn_output", (64, 64)), ("ffn_gate", (128, 64)),
                        ("ffn_up", (128, 64)), ("ffn_down", (64, 128))):
        w.add_tensor(f"blk.0.{name}.weight", weight(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def negate_in_place(path: Path, tensor: str = "output_norm.weight") -> None:
    """Change a GGUF's weights without changing its size (as a re-export of another fine-tune would)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path), "r+")
    t = next(t for t in reader.tensors if t.name == tensor)
    t.data[...] = -t.data
    reader.data.flush()
    del reader


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture()
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("SPECULANT_HOME", str(h))
    return h


def copy_to(tiny: Path, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tiny, folder / "model.gguf")
    return folder / "model.gguf"


def leftovers(home: Path) -> list:
    return sorted(p.name for p in (home / "torch").glob("*.tmp*"))


def torch_logits(path: Path) -> np.ndarray:
    from speculant.backends.torch import load_torch_backend

    b = load_torch_backend(path, dtype="fp32", device="cpu", threads=1, n_ctx=256)
    try:
        return b.eval(b.tokenize(PROMPT), n_logits=1)[0]
    finally:
        b.close()


def llama_logits(path: Path) -> np.ndarray:
    from speculant.backends.llamacpp import LlamaCppBackend

    b = LlamaCppBackend(path, n_ctx=256, n_threads=1)
    try:
        return b.eval(b.tokenize(PROMPT), n_logits=1)[0]
    finally:
        b.close()


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return float(np.abs(a - b).max()) <= 0.02 * float(np.abs(b).max())


def test_files_of_one_name_and_size_and_a_file_changed_in_place_are_converted_apart(tiny, home, tmp_path, capsys):
    """a/model.gguf and b/model.gguf, b with other weights of the same size: each runs its own weights (as on
    llama.cpp), and b changed in place (a re-export) is converted again."""
    from speculant.backends.torch import resolve_model_dir

    a, b = copy_to(tiny, tmp_path / "a"), copy_to(tiny, tmp_path / "b")
    negate_in_place(b)
    assert a.stat().st_size == b.stat().st_size
    ref_a, ref_b = llama_logits(a), llama_logits(b)
    assert not close(ref_b, ref_a)  # the change shows in the logits
    got_a = torch_logits(a)
    got_b = torch_logits(b)
    assert close(got_a, ref_a) and close(got_b, ref_b), (np.abs(got_b - ref_b).max(), np.abs(got_b - ref_a).max())
    assert resolve_model_dir(a) != resolve_model_dir(b)
    # b re-exported in place: the same size, another mtime; its conversion is out of date
    mtime = b.stat().st_mtime_ns
    negate_in_place(b)
    os.utime(b, ns=(mtime + 10**9, mtime + 10**9))  # a coarse clock must not hide the change
    capsys.readouterr()
    assert close(torch_logits(b), ref_a)
    err = capsys.readouterr().err
    assert "is out of date (the GGUF's modification time changed since it was converted); converting it again" in err, err
    assert leftovers(home) == []


DAMAGE = {
    "source-empty": ("source.json", lambda p: p.write_text("")),
    "source-truncated": ("source.json", lambda p: p.write_text(p.read_text()[:30])),
    "source-a-list": ("source.json", lambda p: p.write_text("[]")),
    "specials-garbage": ("gguf_specials.json", lambda p: p.write_bytes(b"\x00\xffgarbage{")),
    "safetensors-truncated": ("model.safetensors",
                              lambda p: os.truncate(p, p.stat().st_size - 1000)),
    "tokenizer-missing": ("tokenizer.json", lambda p: p.unlink()),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_cache_is_converted_again_with_a_warning(tiny, home, capsys, case):
    from speculant.backends.torch import resolve_model_dir

    expected = torch_logits(tiny)
    name, damage = DAMAGE[case]
    damage(resolve_model_dir(tiny) / name)
    capsys.readouterr()
    got = torch_logits(tiny)  # no traceback: converted again
    err = capsys.readouterr().err
    assert np.array_equal(got, expected)
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "is damaged" in warnings[0] and "converting it again" in warnings[0], err
    assert leftovers(home) == []


def run_python(code: str, home: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, text=True,
                            env={**os.environ, "SPECULANT_HOME": str(home), "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    end = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the child ended first: {proc.communicate()}")
        assert time.time() < end, "the child never got there"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_conversion_stopped_midway_leaves_no_work_folder(tiny, home, tmp_path, sig):
    """SIGTERM (the CLI makes it SystemExit) stops a conversion after its weights are written: the work folder goes
    with it. SIGKILL leaves it; the next conversion of that entry deletes it, and others' of dead processes."""
    from speculant.backends.torch import resolve_model_dir

    ready = tmp_path / "ready"
    child = run_python(f"""
        import time
        import torch
        torch.set_num_threads(1)
        from speculant.signals import exit_on_sigterm
        from speculant.backends import torch as tb
        exit_on_sigterm()
        def stuck(path):
            open({str(ready)!r}, "w").close()
            time.sleep(600)
        tb._gguf_specials = stuck
        tb.resolve_model_dir({str(tiny)!r})
        """, home)
    try:
        wait_for(ready, child)
        assert len(leftovers(home)) == 1  # the weights are written in the work folder
        child.send_signal(sig)
        child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    if sig == signal.SIGTERM:
        assert child.returncode == 143
        assert leftovers(home) == []
        return
    stale = leftovers(home)[0]
    # another entry's work folder of a process that is gone, and one of a live process (this one)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (home / "torch" / f"other.gguf-0123456789ab.tmp{gone.pid}").mkdir()
    (home / "torch" / f"other.gguf-0123456789ab.tmp{gone.pid}.old").mkdir()
    (home / "torch" / f"other.gguf-0123456789ab.tmp{os.getpid()}").mkdir()
    (home / "torch" / "x.tmp1.gguf-0123456789ab").mkdir()  # an entry, of a GGUF named x.tmp1.gguf
    legacy = home / "torch" / "model.gguf"  # the layout before (named after the file alone): nothing reads it now
    legacy.mkdir()
    (legacy / "source.json").write_text('{"gguf": "model.gguf", "size": 1, "mtime": 1.0}')
    cache = resolve_model_dir(tiny)
    assert stale.startswith(cache.name + ".tmp")  # the same entry's
    assert leftovers(home) == [f"other.gguf-0123456789ab.tmp{os.getpid()}", "x.tmp1.gguf-0123456789ab"]
    assert not legacy.exists()


def test_an_exception_in_a_conversion_leaves_no_work_folder(tiny, home, monkeypatch):
    from speculant.backends import torch as tb

    def broken(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(tb, "_gguf_specials", broken)
    with pytest.raises(KeyboardInterrupt):
        tb.resolve_model_dir(tiny)
    assert leftovers(home) == [] and not [p for p in (home / "torch").iterdir() if p.is_dir()]


def test_two_processes_converting_at_once_convert_once(tiny, home, tmp_path):
    """Released together, two processes ask for the same conversion: one converts, the other waits for it and
    uses it; nothing is left behind."""
    go = tmp_path / "go"
    children = []
    for i in range(2):
        children.append(run_python(f"""
            import os, time
            import torch
            torch.set_num_threads(1)
            from speculant.backends import torch as tb
            convert = tb._convert_gguf
            def counted(*a):
                print("converted", flush=True)
                return convert(*a)
            tb._convert_gguf = counted
            open({str(tmp_path / f"ready{i}")!r}, "w").close()
            while not os.path.exists({str(go)!r}):
                time.sleep(0.01)
            print(tb.resolve_model_dir({str(tiny)!r}))
            """, home))
    try:
        for i, child in enumerate(children):
            wait_for(tmp_path / f"ready{i}", child)
        go.touch()
        outs = [child.communicate(timeout=240) for child in children]
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert [child.returncode for child in children] == [0, 0], outs
    stdout = [out.split() for out, _ in outs]
    assert sum(out.count("converted") for out in stdout) == 1, outs
    assert stdout[0][-1] == stdout[1][-1], outs
    assert leftovers(home) == []
    from speculant.backends.torch import cache_problem

    assert cache_problem(Path(stdout[0][-1]), tiny.resolve()) is None
