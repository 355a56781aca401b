"""scripts/gpu_bench.sh --smoke: the GPU benchmark's steps with tiny shapes, on whatever device is here
(CPU: graphs off), end to end through the real script; and a failing step does not stop the others."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "fixtures" / "trace-small.json"


def run_script(tmp_path, *args):
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1", "BENCH_TIMEOUT": "120"}
    r = subprocess.run([str(ROOT / "scripts" / "gpu_bench.sh"), "--smoke", "-t", "1", "--out", str(tmp_path), *args],
                       capture_output=True, text=True, env=env, timeout=180)
    return r, json.loads((tmp_path / "results.json").read_text())


def test_smoke_runs_every_step(tmp_path):
    r, res = run_script(tmp_path, "--trace", str(TRACE))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert all(s.startswith("ok") for s in res["status"].values()) and len(res["status"]) == 6
    assert "IDENTICAL" in r.stdout and "DIFFERENT" not in r.stdout
    ident = res["results"]["identity"]
    assert ident["eager_max_diff"] == 0.0 and ident["greedy_identity"] is True
    costs = res["results"]["costs"]["tiny"]
    assert set(costs["ours eager, 16 rows"]) == {"1", "5", "8", "16"}  # ms per pass over n tokens
    replay = res["results"]["replay"]["trace-small.json"]
    assert {row["category"] for row in replay["rows"]} == {"coding", "summarization"}
    assert all(row["speedup"] > 0 and row["tokens"] > 0 for row in replay["rows"])
    assert "| variant | category |" in r.stdout
    draft = res["results"]["draft"]
    assert {"bare pass", "device, k at once", "host loop", "device, sampled T=1"} <= set(draft)
    assert all(v > 0 for k, v in draft.items() if k != "shape")
    engine = res["results"]["engine"]
    assert engine["plain"]["tau"] == 1.0 and engine["speculative k=4"]["tau"] > 4  # a same-weights draft
    assert all(row["engine_tok_s"] > 0 and row["engine_over_bare"] > 0 for k, row in engine.items() if k != "shape")


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    r, res = run_script(tmp_path, "--steps", "env,replay,identity", "--trace", str(tmp_path / "missing.json"))
    assert r.returncode == 1
    assert res["status"]["replay"].startswith("FAILED") and "does not exist" in res["status"]["replay"]
    assert res["status"]["env"].startswith("ok") and res["status"]["identity"].startswith("ok")
    assert "summary:" in r.stdout


def test_the_costs_step_fails_when_a_setup_failed(monkeypatch):
    """One setup failing (a CUDA error in graph capture, say) keeps the other rows but fails the step, so the
    summary of the one GPU run cannot read 'ok' over missing numbers."""
    import argparse

    import speculant.backends.torch_static as torch_static
    from speculant import gpubench

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch_static, "StaticTorchBackend", broken)
    opts = argparse.Namespace(device="cpu", cost_shapes=["tiny-draft"], repeats=1, existing_backend=False,
                              over_budget=lambda: False)
    with pytest.raises(gpubench.StepFailed, match="tiny-draft/ours eager, 16 rows") as failed:
        gpubench.step_costs(opts)
    rows = failed.value.result["tiny-draft"]
    assert "stream is capturing" in rows["ours eager, 16 rows"]["failed"]
    assert set(rows["transformers eager sdpa"]) == set(gpubench.PASS_SIZES)  # the other rows stay


def test_a_bad_thread_count_is_refused(tmp_path, capsys):
    from speculant import gpubench

    with pytest.raises(SystemExit) as e:
        gpubench.main(["--smoke", "-t", "-1", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--threads must be 1..512, got -1" in err and "Traceback" not in err
