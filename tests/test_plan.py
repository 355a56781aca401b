"""`speculant plan` against what llama.cpp reports and what a fresh process really holds (real models)."""

import json
import re
import subprocess
import sys

import pytest

from conftest import DRAFT, SHIPPED_DRAFT, SMALL, TARGET  # the texts below name the shipped file's type, Q4_K_M
from speculant import models, plan, quantize
from synthetic import embeddings_only_gguf

pytestmark = pytest.mark.models


def need(*names):
    for name in names:
        if not models.cached_path(name).exists():
            pytest.skip(f"{name} not pulled")


# the real pair at two context sizes, each in a fresh child process: the whole context filled at 1024, a
# 600-token prompt at 4096 (KV cache resident in full, attention buffers for the prompt only); and four
# request slots (serve -np 4), a KV cache each
@pytest.mark.parametrize("n_ctx, n_prompt, parallel", [(1024, None, 1), (4096, 600, 1), (2048, 600, 4)])
def test_plan_within_10_percent_of_measured_peak_rss(n_ctx, n_prompt, parallel):
    need(TARGET, DRAFT)
    p = plan.plan(TARGET, DRAFT, n_ctx=n_ctx, n_prompt=n_prompt, parallel=parallel)
    measured = plan.measure(TARGET, DRAFT, n_ctx, n_prompt=n_prompt, parallel=parallel)
    assert measured["prompt_tokens"] >= min(n_prompt or n_ctx, n_ctx - 12)
    planned_mb = p.total / 2 ** 20
    assert abs(planned_mb / measured["peak_rss_mb"] - 1) < 0.10, (planned_mb, measured)


def _llama_log(path, n_ctx, repack):
    """llama.cpp's whole log of loading path (the backend keeps only its last lines: widen it meanwhile)."""
    import collections

    from speculant.backends import llamacpp

    kept, llamacpp._LOG.lines = llamacpp._thread_lines(), collections.deque()  # this thread's, unbounded
    try:
        llamacpp.LlamaCppBackend(path, n_ctx=n_ctx, repack=repack).close()
        return "".join(line for _, line in llamacpp._LOG.lines)
    finally:
        llamacpp._LOG.lines = kept


def _mib(log, what):
    m = re.search(rf"{what} buffer size =\s+([\d.]+) MiB", log)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("n_ctx", [1024, 8192])
def test_compute_buffer_model_matches_llama_cpp(n_ctx):
    need(SMALL)
    log = _llama_log(models.cached_path(SMALL), n_ctx, False)
    m = plan.plan_model(SMALL, "target", n_ctx)
    assert abs(m.compute_reserved / 2 ** 20 / _mib(log, "CPU compute") - 1) < 0.03


@pytest.mark.parametrize("model", [SHIPPED_DRAFT, DRAFT, TARGET])
def test_repacked_weights_match_llama_cpp(model, monkeypatch):
    """Models load with repacking (Q4_K and Q6_K included: our build repacks Q6_K on x86 too): the plan's
    anonymous copy is llama.cpp's CPU_REPACK buffer; SPECULANT_REPACK=0 plans none."""
    need(model)
    log = _llama_log(models.cached_path(model), 512, True)
    m = plan.plan_model(model, "target", 512)
    assert _mib(log, "CPU_REPACK model") > 0
    assert abs(m.repacked / 2 ** 20 - _mib(log, "CPU_REPACK model")) < 1.0
    assert plan.plan_model(model, "draft", 512).repacked == m.repacked
    monkeypatch.setenv("SPECULANT_REPACK", "0")
    assert plan.plan_model(model, "target", 512).repacked == 0


def test_repacked_q2_K_weights_match_llama_cpp(tmp_path, monkeypatch):
    """llama.cpp repacks Q2_K where the CPU has AVX-512 and leaves it plain elsewhere: the plan of the target
    requantized to Q2_K (mostly Q2_K, then Q3_K, Q4_K repacked) counts what its CPU_REPACK buffer holds."""
    need(TARGET)
    path = tmp_path / "qwen-q2_k.gguf"
    q8_0 = quantize.tensor_type("Q8_0", "test")  # embedding and output layer: quick to make
    quantize.make(models.cached_path(TARGET), path, quantize.file_type("Q2_K"), allow_requantize=True,
                  output_tensor_type=q8_0, token_embedding_type=q8_0, progress=False)
    log = _llama_log(path, 512, True)
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path / "home"))  # the temporary file's facts: not in the user's cache
    assert abs(plan.plan_model(str(path), "target", 512).repacked / 2 ** 20 - _mib(log, "CPU_REPACK model")) < 1.0
    assert len(list((tmp_path / "home" / "plan-cache").glob("*.json"))) == 1


def test_kv_per_token_from_metadata(monkeypatch):
    need(TARGET, SHIPPED_DRAFT)
    t, d = plan.plan_model(TARGET, "target", 4096), plan.plan_model(SHIPPED_DRAFT, "draft", 4096)
    # Qwen2.5-1.5B: 28 layers x 2 KV heads x (128 + 128) x 2 bytes; 0.5B: 24 layers x 2 x (64 + 64) x 2
    assert t.kv_per_token == 28 * 2 * 256 * 2 and d.kv_per_token == 24 * 2 * 128 * 2
    assert t.kv == t.kv_per_token * 4096
    assert plan.plan_model(TARGET, "target", 4096, parallel=3).kv == 3 * t.kv  # a KV cache per request slot
    monkeypatch.setenv("SPECULANT_REPACK", "0")
    assert plan.plan_model(TARGET, "target", 4096).mapped == models.cached_path(TARGET).stat().st_size
    size = models.cached_path(TARGET).stat().st_size
    assert t.mapped == 0 and t.repacked > 0 and size - 16 * 2 ** 20 < t.loaded + t.repacked < size  # read, no mmap


def run(*args, home=None):
    """The CLI; home: a SPECULANT_HOME of its own (where it plans files that are not the real models: their
    plan-cache entries must not pile up in the user's cache)."""
    env = {**__import__("os").environ, "SPECULANT_HOME": str(home)} if home else None
    return subprocess.run([sys.executable, "-m", "speculant", *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_cli_json_and_mem():
    need(TARGET, SHIPPED_DRAFT)
    out = json.loads(run("plan", "-md", SHIPPED_DRAFT, "-c", "2048", "--mem", "2G", "--json").stdout)
    assert out["n_ctx"] == 2048 and [m["role"] for m in out["models"]] == ["target", "draft"]
    assert out["total_mb"] == pytest.approx(out["runtime_mb"] + sum(m["total_mb"] for m in out["models"]), abs=0.5)
    fits = {(r["target_type"], r["draft_type"]): r for r in out["fits"]}
    assert fits[("Q4_K_M", "Q4_K_M")]["fits"] and fits[("Q4_K_M", "Q4_K_M")]["n_ctx"] == 2048  # --ctx given
    assert not fits[("Q8_0 (quantized)", "Q4_K_M")]["fits"]
    assert "weights alone" in fits[("Q8_0 (quantized)", "Q4_K_M")]["why"]
    # smaller targets that still verify at batch cost: IQ4_XS, Q3_K_M, IQ3_M and Q2_K, each smaller than the last
    smaller = ("Q4_K_M", "IQ4_XS (quantized)", "Q3_K_M (quantized)", "IQ3_M (quantized)", "Q2_K (quantized)")
    totals = [fits[(t, "Q4_K_M")]["total_mb"] for t in smaller]
    assert totals == sorted(totals, reverse=True) and totals[0] - totals[-1] > 300
    assert all(fits[(t, "Q4_K_M")]["unbatched"] == 0 for t in smaller[:-1])
    # a planned type's weights are what llama.cpp's quantizer would write, tensor by tensor (its dry run)
    planned = plan.plan(TARGET, n_ctx=2048, target_type="IQ3_M").models[0]
    dry = quantize.dry_run(TARGET, "IQ3_M")
    assert planned.types == dry.bytes_by_type() and set(planned.types) == {"IQ3_S", "Q6_K", "Q4_K", "F32"}
    text = run("plan", "-md", SHIPPED_DRAFT, "--mem", "1700M").stdout
    assert "KV per token: 28.0 KiB" in text and "KV per token: 12.0 KiB" in text
    assert "does not fit: target Q8_0 (quantized) alone (plain decoding, -md lookup or -md history): the weights " \
           "alone take 1801 MiB" in text
    assert re.search(r"does not fit: target Q4_K_M \+ draft Q4_K_M: at n_ctx 512 it needs \d+ MiB "
                     r"\(weights 1523,", text)
    # (8192: a prompt is read in 64-token chunks, whose attention buffers are an eighth of 512-token ones')
    assert re.search(r"fits: target Q4_K_M alone \(plain decoding.*\), n_ctx up to 8192 ", text)
    # the smaller target types that still verify at batch cost are offered for the target, not for the draft
    assert re.search(r"fits: target Q3_K_M \(quantized\) \+ draft Q4_0 \(quantized\), n_ctx up to", text)
    assert re.search(r"fits: target IQ3_M \(quantized\) \+ draft Q4_0 \(quantized\), n_ctx up to", text)
    assert "draft IQ4_XS" not in text and "draft Q3_K_M" not in text and "draft IQ3_M" not in text
    assert "speculant quantize MODEL --type TYPE" in text and "dry run" in text
    # every offered type verifies at batch cost (Q2_K too where llama.cpp repacks it, on AVX-512 CPUs)
    assert not [line for line in text.splitlines() if "one token at a time" in line]


@pytest.mark.parametrize("args, needle", [
    (["--mem", "lots"], "is not a size"),
    (["-m", "no-such-model"], "unknown model"),
    (["-c", "8"], "--ctx-size must be"),
    (["--prompt-tokens", "9000", "-c", "4096"], "--prompt-tokens must be"),
    (["--backend", "torch"], "plan covers the llama.cpp backend"),
    (["-np", "0"], "--parallel must be"),
])
def test_cli_bad_input(args, needle):
    proc = run("plan", *args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [s for s in proc.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr


def test_ctx_zero_is_the_training_context_as_for_generate():
    need(SMALL)
    out = json.loads(run("plan", "-m", SMALL, "-c", "0", "--json").stdout)
    assert out["n_ctx"] == plan.gguf_facts(models.cached_path(SMALL))["n_ctx_train"] == 8192


def test_a_context_beyond_training_is_lowered_and_said_as_for_generate():
    need(SMALL)
    proc = run("plan", "-m", SMALL, "-c", "1000000", "--json")
    assert proc.returncode == 0 and "training context (8192 tokens); using 8192" in proc.stderr
    assert json.loads(proc.stdout)["n_ctx"] == 8192
    assert run("plan", "-m", SMALL, "-c", "1000000", "--prompt-tokens", "9000").returncode != 0  # against 8192


def test_a_truncated_file_is_refused_as_by_every_command(tmp_path):
    need(SMALL)
    src = models.cached_path(SMALL)
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f, open(cut, "wb") as out:
        out.write(f.read(src.stat().st_size // 2))
    proc = run("plan", "-m", str(cut))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "is truncated" in proc.stderr, proc.stderr


def test_parse_size():
    assert plan.parse_size("8G") == 8 * 2 ** 30
    assert plan.parse_size("1.5GiB") == int(1.5 * 2 ** 30)
    assert plan.parse_size("900M") == 900 * 2 ** 20
    assert plan.parse_size("4096") == 4096


# -- the prompt chunk, sizes, failures, free drafters (audit findings) -------------------------------------------

def test_the_plan_counts_the_prompt_chunk_the_backend_reads(monkeypatch):
    """The backend reads a prompt in 64-token chunks with our build (SPECULANT_INVARIANT_ROWS=0: 512): the
    plan's attention buffers are a chunk's, read as the backend reads it."""
    need(SMALL)
    from speculant import native

    if native.build_info() is None:
        pytest.skip("not our llama.cpp build: no invariant chunks")
    f = plan.gguf_facts(models.cached_path(SMALL))
    assert plan.prefill_chunk() == 64
    assert plan.plan_model(SMALL, "target", 4096).compute == plan.compute_resident(f, 4096, 5, chunk=64)
    monkeypatch.setenv("SPECULANT_INVARIANT_ROWS", "0")
    assert plan.prefill_chunk() == 512
    assert plan.plan_model(SMALL, "target", 4096).compute == plan.compute_resident(f, 4096, 5, chunk=512)


# SmolLM2 alone: a short prompt in a long context (-10.5% before), the whole context (+8% before), within 5%;
# as its own draft (+15.5% at 2048 before; +4.4 to +5% now: two copies of one vocabulary share some tables)
@pytest.mark.parametrize("n_ctx, n_prompt, draft, within", [(4096, 200, None, 0.05), (2048, None, None, 0.05),
                                                             (2048, None, SMALL, 0.07)])
def test_small_model_plan_close_to_measured_peak_rss(n_ctx, n_prompt, draft, within):
    need(SMALL)
    p = plan.plan(SMALL, draft, n_ctx=n_ctx, n_prompt=n_prompt)
    measured = plan.measure(SMALL, draft, n_ctx, n_prompt=n_prompt)
    assert abs(p.total / 2 ** 20 / measured["peak_rss_mb"] - 1) < within, (p.total / 2 ** 20, measured)


@pytest.mark.parametrize("text", [".", "1.2.3G", "1" + "0" * 400, "0", "12 X", "5iB"])
def test_sizes_that_are_not_sizes_are_one_line_errors(text):
    from speculant.errors import SettingsError

    with pytest.raises(SettingsError, match="--mem"):
        plan.parse_size(text)
    proc = run("plan", "--mem", text)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert [s for s in proc.stderr.splitlines() if s.strip()][0].startswith("speculant: error: --mem")


def test_si_and_binary_units():
    assert plan.parse_size("500MB") == 500 * 10 ** 6 and plan.parse_size("2 GB") == 2 * 10 ** 9
    assert plan.parse_size("500MiB") == plan.parse_size("500M") == 500 * 2 ** 20
    assert plan.parse_size(".5G") == 2 ** 29 and plan.parse_size("100B") == 100


def test_a_failed_measurement_is_one_line(tmp_path, monkeypatch):
    bad = embeddings_only_gguf(tmp_path / "bad.gguf")
    proc = run("plan", "-m", str(bad), "-c", "256", "--measure", home=tmp_path / "home")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = [s for s in proc.stderr.splitlines() if s.strip()]
    assert len(lines) == 1 and lines[0].startswith("speculant: error: memory measurement failed: "), proc.stderr
    assert len(list((tmp_path / "home" / "plan-cache").glob("*.json"))) == 1  # the temporary file's facts: here
    from speculant.errors import ModelError

    def too_slow(*args, timeout=None, **kwargs):
        raise subprocess.TimeoutExpired(args[0], timeout)

    monkeypatch.setattr(plan.subprocess, "run", too_slow)
    with pytest.raises(ModelError, match="took more than 900 s"):
        plan.measure(SMALL, None, 512)


def test_a_context_walk_warns_only_for_the_context_asked_for():
    need(SMALL)
    proc = run("plan", "-m", SMALL, "--mem", "4G")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert "n_ctx up to 8192 " in proc.stdout  # the training context, not past it
    proc = run("plan", "-m", SMALL, "--mem", "4G", "-c", "20000")
    assert proc.returncode == 0 and proc.stderr.count("training context") == 1, proc.stderr


@pytest.mark.parametrize("drafter", ["lookup", "history"])
def test_free_drafters_plan_the_target_alone(drafter):
    need(SMALL)
    proc = run("plan", "-m", SMALL, "-md", drafter, "-c", "1024", "--json")
    assert proc.returncode == 0, proc.stderr
    assert [m["role"] for m in json.loads(proc.stdout)["models"]] == ["target"]


def test_a_truncated_registered_model_is_refused_by_name(tmp_path, monkeypatch):
    need(SMALL)
    (tmp_path / "models").mkdir()
    src = models.cached_path(SMALL)
    with open(src, "rb") as f:
        (tmp_path / "models" / src.name).write_bytes(f.read(50 << 20))
    proc = subprocess.run([sys.executable, "-m", "speculant", "plan", "-m", SMALL], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "SPECULANT_HOME": str(tmp_path)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "damaged or incomplete" in proc.stderr and f"speculant pull {SMALL}" in proc.stderr, proc.stderr


def test_a_split_target_plans_each_machine_and_its_layers():
    """--rpc/-ts: this machine's part (embeddings, output layer, first layers) and each worker's (the last layers,
    in --rpc order), split as generate splits them; together they hold the whole model's weights and KV cache."""
    need(TARGET)
    whole = json.loads(run("plan", "-c", "2048", "--json").stdout)["models"][0]
    r = run("plan", "-c", "2048", "--rpc", "10.0.0.2:50052,10.0.0.3:50052", "-ts", "2,1,1", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    here, workers = out["models"][0], out["workers"]
    # 28 layers, three quarters on the workers (21), split 2:1 among them
    assert [(w["endpoint"], w["first_layer"], w["layers"]) for w in workers] == [
        ("10.0.0.2:50052", 7, 14), ("10.0.0.3:50052", 21, 7)]
    assert here["kv_mb"] + sum(w["kv_mb"] for w in workers) == pytest.approx(whole["kv_mb"], abs=0.5)
    weights = here["loaded_mb"] + here["repacked_mb"] + sum(w["weights_mb"] for w in workers)
    assert weights == pytest.approx(whole["loaded_mb"] + whole["repacked_mb"], abs=1.0)
    assert 0.4 < workers[1]["weights_mb"] / workers[0]["weights_mb"] < 0.6  # half the layers, half the bytes
    assert here["output_mb"] == whole["output_mb"] and here["compute_mb"] == whole["compute_mb"]  # logits made here
    assert all(w["compute_mb"] < whole["compute_mb"] + 1 for w in workers)
    text = run("plan", "-c", "2048", "--rpc", "10.0.0.2:50052,10.0.0.3:50052", "-ts", "2,1,1").stdout
    assert "The target's 28 layers: 7 here (with the embeddings and the output layer" in text
    assert re.search(r"\| 10\.0\.0\.2:50052 \| 7-20 \(14\) \| \d+ \| \d+ \| \d+ \| \d+ \| \*\*\d+\*\* \|", text), text
    assert "**total on this machine**" in text


@pytest.mark.parametrize("args, needle", [
    (["-ts", "1,1"], "--tensor-split splits the target over --rpc workers: pass --rpc too"),
    (["--rpc", "a:1", "--mem", "2G"], "--mem plans one machine"),
    (["--rpc", "a:1", "--measure"], "--measure plans one machine"),
    (["--rpc", "a:1", "-ts", "1e-9,1"], "leaves --rpc worker 1 no layer"),
    (["--rpc", "a:1", "-np", "2"], "serves one request at a time"),
    (["--rpc", "a:1 b:2"], "separated by commas"),
    (["--rpc", ""], "--rpc is empty"),  # generate ran locally without a word
])
def test_split_plans_refuse_what_cannot_be_planned(args, needle):
    need(TARGET)
    proc = run("plan", *args)
    lines = [s for s in proc.stderr.splitlines() if s.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_a_split_target_plan_within_10_percent_of_measured_peaks():
    """SmolLM2 split over two real workers, a prompt filling most of the context: this machine's peak (the
    process and the target's own) and each worker's, against the plan."""
    from test_rpc import _free_ports, _start_worker, _stop

    from speculant.memory import proc_status_mb

    need(SMALL)
    ports = _free_ports(2)
    workers = [_start_worker(port) for port in ports]
    try:
        rpc = [f"127.0.0.1:{port}" for port in ports]
        p = plan.plan(SMALL, None, n_ctx=4096, rpc=rpc)
        measured = plan.measure(SMALL, None, 4096, rpc=rpc)
        assert measured["prompt_tokens"] > 4000
        assert abs(p.total / 2 ** 20 / measured["peak_rss_mb"] - 1) < 0.10, (p.total / 2 ** 20, measured)
        for w, proc in zip(p.workers, workers):
            peak = proc_status_mb(proc.pid)["peak_rss_mb"]
            assert abs(w.total / 2 ** 20 / peak - 1) < 0.10, (w, peak)
    finally:
        for proc in workers:
            _stop(proc)
