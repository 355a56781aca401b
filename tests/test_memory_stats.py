"""Memory in stats, /metrics and bench tables: the process's measured peak RSS and the plan per model
(real SmolLM2-135M as target and draft, a real server and client, a real bench run)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from speculant import models, plan
from speculant.server import spawn_local

pytestmark = pytest.mark.models

SMALL = "smollm2-135m-instruct"
SPECULANT = str(Path(sys.executable).with_name("speculant"))
PAIR = ["-m", SMALL, "-md", SMALL, "-c", "512", "-t", "1"]


@pytest.fixture(autouse=True)
def pulled():
    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled")


def test_generate_json_carries_peak_rss_and_plan_per_model():
    proc = subprocess.run([sys.executable, "-m", "speculant", "generate", *PAIR, "-p", "The capital of France is",
                           "-n", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    per_model = stats["model_memory_mb"]
    assert set(per_model) == {"target", "draft"}
    expected = {role: plan.plan_model(SMALL, role, 512).total / 2 ** 20 for role in per_model}
    for role, m in per_model.items():
        assert m["model"] == models.cached_path(SMALL).name
        assert m["planned_mb"] == pytest.approx(expected[role], abs=0.1)
        # repacking loads read the file (not mmapped): all of its tensors, as they are or repacked
        weights = m["weights_mmapped_mb"] + m["weights_read_mb"] + m["repacked_mb"]
        assert m["weights_mmapped_mb"] == 0
        assert weights == pytest.approx(models.cached_path(SMALL).stat().st_size / 2 ** 20, abs=2)
    # the process held both models and their buffers: more than one model's weights
    weights = sum(per_model["target"][k] for k in ("weights_mmapped_mb", "weights_read_mb", "repacked_mb"))
    assert stats["peak_rss_mb"] > weights + 30


def test_metrics_carry_process_and_model_memory():
    proc, url = spawn_local([*PAIR, "--no-adapt", "-np", "3"], timeout=120, exe=SPECULANT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        httpx.post(url + "/v1/completions", json={"model": SMALL, "prompt": "Hello", "max_tokens": 4},
                   timeout=120).raise_for_status()
        metrics = {}
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                metrics[name] = float(value)
        for role in ("target", "draft"):  # every slot's KV cache counted, as `speculant plan -np 3` counts them
            key = f'speculant_model_memory_planned_bytes{{model="{models.cached_path(SMALL).name}",role="{role}"}}'
            assert metrics[key] == pytest.approx(plan.plan_model(SMALL, role, 512, parallel=3).total, rel=1e-3), key
        peak = metrics["speculant_process_peak_rss_bytes"]
        assert metrics["process_resident_memory_bytes"] <= peak * 1.01
        assert peak > models.cached_path(SMALL).stat().st_size
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_bench_memory_table_has_measured_and_planned(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "speculant", "bench", "-m", SMALL, "-md", SMALL, "--methods",
                           "plain,draft", "--memory", "--categories", "qa", "--limit", "1", "-n", "4", "-c", "512",
                           "--cost-repeats", "1", "--no-plots", "--no-progress", "--no-warmup", "-t", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr
    memory = json.loads((tmp_path / "results.json").read_text())["memory"]
    one = plan.plan(SMALL, n_ctx=512, draft_max=0).total / 2 ** 20  # plain decoding: one logits row per pass
    two = plan.plan(SMALL, SMALL, n_ctx=512).total / 2 ** 20
    assert memory["plain"]["planned_mb"] == pytest.approx(one, abs=0.2)
    assert memory["draft"]["planned_mb"] == pytest.approx(two, abs=0.2)
    assert memory["draft"]["peak_rss_mb"] > memory["plain"]["peak_rss_mb"] > 0
    table = (tmp_path / "summary.md").read_text()
    assert "| method | peak RSS MB | planned MB |" in table
    assert f"| draft | {memory['draft']['peak_rss_mb']:.0f} | {memory['draft']['planned_mb']:.0f} |" in table
