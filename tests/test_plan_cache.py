"""$SPECULANT_HOME/plan-cache (plan.py _cached): a stored value is used only where it is of the current format and
has the keys and types the producer writes; anything else is a miss, computed again and replaced."""

import json
import os
import subprocess
import sys

import pytest

from speculant import memory, plan
from synthetic import embeddings_only_gguf


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _entry(home, suffix=".json"):
    files = [p for p in (home / "plan-cache").iterdir() if p.name.endswith(suffix)
             and (suffix != ".json" or not p.name.endswith(".quantized.json"))]
    assert len(files) == 1, files
    return files[0]


def _facts_variants(good):
    """Cached facts that parse as JSON but are not what _read_facts writes (or not of this format)."""
    fmt = getattr(plan, "PLAN_CACHE_FORMAT", 1)
    wrap = lambda value: {"format": fmt, "value": value}  # noqa: E731
    bad_tensor = [["token_embd.weight", "F32", [64, "256"], 65536, 16384]]
    return [
        {"arch": "llama", "n_layer": 30},  # the auditor's: KeyError 'n_ctx_train' in `plan`
        [], None, {}, "llama", 3,
        good,  # the format before this one (a bare dict): an older layout is a miss
        {"format": fmt - 1, "value": good},
        wrap({"arch": "llama", "n_layer": 30}), wrap([]), wrap(None), wrap({}), wrap("x"),
        wrap({**good, "n_layer": "1"}), wrap({**good, "n_layer": True}), wrap({**good, "n_vocab": -256}),
        wrap({**good, "n_ctx_train": 512.0}), wrap({**good, "arch": None}), wrap({**good, "extra": 1}),
        wrap({k: v for k, v in good.items() if k != "data_bytes"}), wrap({**good, "tensors": {}}),
        wrap({**good, "tensors": bad_tensor}), wrap({**good, "tensors": [["token_embd.weight", "F32"]]}),
        {**wrap(good), "more": 1},
    ]


def test_cached_facts_of_another_shape_are_a_miss_and_replaced(home, tmp_path, monkeypatch):
    gguf = embeddings_only_gguf(tmp_path / "tiny.gguf")
    fresh = json.loads(json.dumps(plan._read_facts(gguf)))
    reads = []
    read_facts = plan._read_facts
    monkeypatch.setattr(plan, "_read_facts", lambda path: reads.append(path) or read_facts(path))
    assert json.loads(json.dumps(plan.gguf_facts(gguf))) == fresh and len(reads) == 1
    assert plan.gguf_facts(gguf) == fresh and len(reads) == 1  # a hit
    entry = _entry(home)
    for stored in _facts_variants(fresh):
        entry.write_text(json.dumps(stored))
        reads.clear()
        assert json.loads(json.dumps(plan.gguf_facts(gguf))) == fresh and len(reads) == 1, stored
        assert json.loads(entry.read_text()) == {"format": plan.PLAN_CACHE_FORMAT, "value": fresh}  # replaced
        m = plan.plan_model(str(gguf), "target", 256)  # as generate / serve plan it (memory._planned)
        assert m.n_layer == 1 and m.n_vocab == 256
    assert sorted(p.name for p in (home / "plan-cache").iterdir()) == [entry.name]  # no temporary files left


def test_cached_quantized_tensors_of_another_shape_are_a_miss_and_replaced(home, tmp_path, monkeypatch):
    gguf = embeddings_only_gguf(tmp_path / "tiny.gguf")
    tensors = [("token_embd.weight", "Q8_0", [64, 256], 17408, 16384)]
    runs = []

    class DryRun:
        def __init__(self):
            self.tensors = tensors

    monkeypatch.setattr(plan.quantize, "dry_run", lambda path, type_name: runs.append(type_name) or DryRun())
    want = json.loads(json.dumps(tensors))
    assert plan.quantized_facts(gguf, "Q8_0") == tensors and plan.quantized_facts(gguf, "Q8_0") == want
    assert runs == ["Q8_0"]
    entry = _entry(home, ".quantized.json")
    fmt = getattr(plan, "PLAN_CACHE_FORMAT", 1)
    wrap = lambda value: {"format": fmt, "value": value}  # noqa: E731
    for stored in [want, {"arch": "llama"}, None, {}, "x", wrap({}), wrap(None), wrap([]), wrap([["a", "Q8_0"]]),
                   wrap([["a", "Q8_0", [64, 256], 17408, True]]), wrap([["a", 8, [64, 256], 17408, 16384]]),
                   {"format": fmt - 1, "value": want}]:
        entry.write_text(json.dumps(stored))
        runs.clear()
        assert json.loads(json.dumps(plan.quantized_facts(gguf, "Q8_0"))) == want and runs == ["Q8_0"], stored
        assert json.loads(entry.read_text()) == wrap(want)


def test_plan_and_the_planned_memory_survive_a_bad_cache_entry(home, tmp_path):
    gguf = embeddings_only_gguf(tmp_path / "tiny.gguf")
    plan.gguf_facts(gguf)
    entry = _entry(home)
    for stored in ({"arch": "llama", "n_layer": 30}, [], None, {}, "llama"):
        entry.write_text(json.dumps(stored))
        assert memory._planned(str(gguf), "target", 256, 5) is not None, stored  # was silently None
        entry.write_text(json.dumps(stored))
        proc = subprocess.run([sys.executable, "-m", "speculant", "plan", "-m", str(gguf), "-c", "256", "--json"],
                              capture_output=True, text=True, timeout=300, env=dict(os.environ))
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["models"][0]["n_layer"] == 1


def test_a_failed_cache_write_leaves_no_temporary_file(home, tmp_path):
    gguf = embeddings_only_gguf(tmp_path / "tiny.gguf")
    plan.gguf_facts(gguf)
    entry = _entry(home)
    entry.unlink()
    entry.mkdir()  # the entry's path is a directory: the replace fails, the plan goes on uncached
    assert plan.gguf_facts(gguf)["n_layer"] == 1
    assert sorted(p.name for p in (home / "plan-cache").iterdir()) == [entry.name]
