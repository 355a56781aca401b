"""A target split over llama.cpp RPC workers: real `speculant worker` processes on loopback, a real server.

Identity with local decoding, a worker killed with SIGKILL mid-request (error within 5 s, the server stays up
and serves again once the worker is back), a worker never started, a port that is not a worker, and the
binding warning."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import pytest

from speculant import models
from speculant.errors import SettingsError
from speculant.rpc import WorkerError, layer_plan, parse_endpoints, parse_tensor_split, probe
from speculant.server import spawn_local

pytestmark = pytest.mark.models

MODEL = "smollm2-135m-instruct"
CLI = [sys.executable, "-m", "speculant"]
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
REPEATING = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket is held until all are chosen (one at a time, the kernel may hand the
    same port out twice, and the fixture then started one worker where two were meant)."""
    held = [socket.socket() for _ in range(n)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def _start_worker(port: int, host: str = "127.0.0.1", env=None) -> subprocess.Popen:
    proc = subprocess.Popen([*CLI, "worker", "--host", host, "--port", str(port), "-t", "1"], env=env or ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited: {proc.stdout.read()}")
        try:
            probe(f"127.0.0.1:{port}", timeout=2)
            return proc
        except WorkerError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("worker did not start")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def workers():
    if not models.cached_path(MODEL).exists():
        pytest.skip(f"{MODEL} not pulled")
    ports = _free_ports(2)
    procs = {port: _start_worker(port) for port in ports}
    yield procs
    for proc in procs.values():
        _stop(proc)


def _endpoints(workers) -> list[str]:
    return [f"127.0.0.1:{port}" for port in workers]


# -- flags ----------------------------------------------------------------------------------------------------

def test_endpoint_and_split_parsing():
    assert parse_endpoints("127.0.0.1:50052, 10.0.0.2:50053") == ["127.0.0.1:50052", "10.0.0.2:50053"]
    # the same worker twice, under two names, would hang (its second connection waits for the first to end)
    for bad in ("127.0.0.1", "host:port", ":50052", "a:70000", "a:1,a:1", "localhost:50052,127.0.0.1:50052",
                "127.0.0.1:\u0665\u0660\u0666\u0660\u0661"):
        with pytest.raises(SettingsError):
            parse_endpoints(bad)
    with pytest.raises(SettingsError, match="at most 15 workers"):  # 16 passed, then llama.cpp's scheduler aborted
        parse_endpoints(",".join(f"127.0.0.1:{50000 + i}" for i in range(16)))
    assert len(parse_endpoints(",".join(f"127.0.0.1:{50000 + i}" for i in range(15)))) == 15
    with pytest.raises(SettingsError, match="is not HOST:PORT .*separated by commas"):  # (was: a name not resolving)
        parse_endpoints("127.0.0.1:8810 127.0.0.1:8811")
    assert parse_tensor_split(None, 2) == [1.0, 1.0, 1.0]  # two workers and this machine, equal shares
    assert parse_tensor_split("3,1", 2) == [3.0, 1.0, 0.0]  # no share given for this machine: none
    for bad in ("1", "1,2,3,4", "a,b", "0,0", "-1,2", "inf,1", "1e400,1", "nan,1", "0,1", "1,0,0"):
        with pytest.raises(SettingsError):
            parse_tensor_split(bad, 2)
    assert layer_plan(30, [1.0, 1.0, 1.0]) == [10, 10]  # the last 20 layers on the workers
    assert layer_plan(30, [1.0, 0.0]) == [30]
    assert layer_plan(28, [1.0, 1.0, 1.0, 0.0]) == [10, 9, 9]  # the largest remainders get the odd layers
    assert layer_plan(28, [1.0, 2.0, 4.0]) == [4, 8]
    for starved in ([1e-9, 1.0], [1.0, 1e-9, 1.0], [0.01, 1.0, 0.0]):  # a worker held for no layer
        with pytest.raises(SettingsError, match="leaves --rpc worker .* no layer"):
            layer_plan(28, starved)


# -- exactness ------------------------------------------------------------------------------------------------

def test_greedy_output_equals_local_decoding(workers):
    """Plain and speculative (prompt lookup: verify passes of several tokens) decoding with the layers on two
    workers and this machine give the local model's tokens."""
    from speculant.api import load_engine
    from speculant.verify import SamplingParams

    greedy = SamplingParams(0.0, 0, 1.0, 0.0, 0)
    prompts = ["The capital of France is", REPEATING]
    local = load_engine(MODEL, n_ctx=512, threads=1)
    try:
        expected = [local.generate(p, max_tokens=40, params=greedy).tokens for p in prompts]
    finally:
        local.close()
    for draft in (None, "lookup"):
        split = load_engine(MODEL, draft, n_ctx=512, threads=1, rpc=_endpoints(workers), adaptive=False)
        try:
            assert split.target.device_layers == [10, 10]  # 30 layers: a third here, a third per worker
            results = [split.generate(p, max_tokens=40, params=greedy) for p in prompts]
        finally:
            split.close()
        assert [r.tokens for r in results] == expected
        if draft:
            assert results[1].stats.accepted > 0  # verify passes over several tokens ran on the workers


def test_the_output_layer_stays_here_so_a_token_crosses_the_network_as_one_hidden_state(workers):
    """Per generated token the last worker sends back the last layer's hidden state (n_embd floats: 2.3 KB for
    SmolLM2), not a row of logits (n_vocab floats: 197 KB, 600 KB for Qwen; llama.cpp's own split puts the output
    layer on the last device). The split is said once, at the start."""
    port = list(workers)[1]
    received = {}
    for n in (4, 24):
        listen = _free_port()
        route = f"{listen}:127.0.0.1:{port}"
        proxy = subprocess.Popen([sys.executable, "-m", "speculant.bench.netdelay", "--delay-ms", "0", route],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert proxy.stdout.readline().strip() == "ready"
            r = _cli("generate", "-m", MODEL, "-t", "1", "-n", str(n), "--ignore-eos", "-p", "Once upon a time",
                     "--rpc", f"127.0.0.1:{listen}", timeout=180)
        finally:
            proxy.terminate()
            carried = proxy.communicate(timeout=30)[0]
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("the target's 30 layers") == 1 and (
            f"speculant: the target's 30 layers: 15 here (with the embeddings and the output layer), 15 on "
            f"127.0.0.1:{listen}\n") in r.stderr, r.stderr
        received[n] = json.loads(carried.splitlines()[-1])[route]["from_upstream"]
    per_token = (received[24] - received[4]) / 20
    assert per_token < 2 * 576 * 4, per_token  # 576: SmolLM2's n_embd


def test_repacked_weight_types_give_the_same_tokens_whatever_the_split(workers):
    """Q4_0 rows (the default draft's file as a target) are repacked when loaded locally, but RPC workers hold them
    plain. Workers and the process driving them give plain rows of a type llama.cpp repacks the repacked kernels'
    bits (native.set_plain_as_repacked), so every split (the layers kept here load repacked) gives the tokens and
    log-probabilities of a default local run. (Before, the two layouts' sums rounded differently and the output
    changed with --tensor-split; then the layers kept here were plain too, which made verify passes cost more.)"""
    from speculant.api import load_engine
    from speculant.backends.llamacpp import LlamaCppBackend
    from speculant.engine import Engine
    from speculant.verify import SamplingParams

    name = models.DEFAULT_DRAFT
    if not models.cached_path(name).exists():
        pytest.skip(f"{name} not pulled")
    greedy = SamplingParams(0.0, 0, 1.0, 0.0, 0)
    prompt = "def fibonacci(n):"
    local = Engine(LlamaCppBackend(models.cached_path(name), n_ctx=512, n_threads=1, repack=True))
    try:
        expected = local.generate(prompt, max_tokens=24, params=greedy, logprobs=0)
    finally:
        local.close()
    for split in ("2,1,1", "1,3,0", "1,1,6"):
        engine = load_engine(name, n_ctx=512, threads=1, rpc=_endpoints(workers), tensor_split=split)
        try:
            got = engine.generate(prompt, max_tokens=24, params=greedy, logprobs=0)
        finally:
            engine.close()
        assert got.tokens == expected.tokens, split
        assert [e.logprob for e in got.logprobs] == [e.logprob for e in expected.logprobs], split  # the same bits


def test_a_cancelled_request_stops_the_prompt_on_the_workers(workers):
    """A server's request whose client leaves during a long prompt: the target's process (which drives the
    workers) stops it between two passes, as a local target does; what it evaluated stays cached, and the next
    request decodes the local model's tokens."""
    from speculant.api import load_engine
    from speculant.errors import Cancelled
    from speculant.verify import SamplingParams

    greedy = SamplingParams(0.0, 0, 1.0, 0.0, 0)
    prompt = "Numbers: " + " ".join(str(i) for i in range(300))
    local = load_engine(MODEL, n_ctx=4096, threads=1)
    try:
        expected = local.generate(prompt, max_tokens=8, params=greedy)
    finally:
        local.close()
    split = load_engine(MODEL, n_ctx=4096, threads=1, rpc=_endpoints(workers))
    try:
        asked = []
        split.target.should_stop = lambda: asked.append(1) or len(asked) > 2  # the client leaves ~0.4 s in
        with pytest.raises(Cancelled):
            split.generate(prompt, max_tokens=8, params=greedy)
        split.target.should_stop = None
        again = split.generate(prompt, max_tokens=8, params=greedy)
    finally:
        split.close()
    assert again.tokens == expected.tokens
    n_prompt = expected.stats.prompt_tokens
    assert 0 < again.stats.cached_prompt_tokens < n_prompt - 64, (again.stats.cached_prompt_tokens, n_prompt)


# -- faults ---------------------------------------------------------------------------------------------------

def test_worker_killed_mid_request_server_answers_503_and_recovers(workers):
    port = list(workers)[1]
    endpoint = f"127.0.0.1:{port}"
    proc, url = spawn_local(["-m", MODEL, "-c", "4096", "-t", "1", "--rpc", ",".join(_endpoints(workers))],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert httpx.get(url + "/health").json()["workers"] == {ep: "up" for ep in _endpoints(workers)}
        body = {"prompt": "Count from 1 to 1000: 1, 2, 3,", "max_tokens": 3000, "stream": True, "temperature": 0}
        events, killed_at = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 5:  # generating: kill the second worker
                    workers[port].send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
        failed_after = time.monotonic() - killed_at
        error = json.loads(events[-1])["error"]
        assert error["code"] == "worker_down" and endpoint in error["message"], error
        assert failed_after <= 5.0, failed_after
        assert proc.poll() is None  # the server is still up

        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "worker_down" and endpoint in r.json()["error"]["message"]
        health = httpx.get(url + "/health")
        assert health.status_code == 503
        assert health.json()["workers"][endpoint].startswith("down")
        assert endpoint in health.json()["message"]

        workers[port].wait()
        workers[port] = _start_worker(port)  # back on the same port: serving resumes by itself
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                      "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8

        first = list(workers)[0]  # a worker restarted between two requests: the next one just works
        workers[first].send_signal(signal.SIGKILL)
        workers[first].wait()
        workers[first] = _start_worker(first)
        r2 = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                       "temperature": 0}, timeout=120)
        assert r2.status_code == 200, r2.text
        assert r2.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    out = proc.stdout.read()
    assert "Traceback" not in out, out


def test_cli_exits_with_one_line_naming_the_killed_worker(workers):
    port = list(workers)[0]
    endpoint = f"127.0.0.1:{port}"
    gen = subprocess.Popen([*CLI, "generate", "-m", MODEL, "-t", "1", "-n", "3000", "-p", "Count from 1 to 1000: 1, 2, 3,",
                            "--rpc", ",".join(_endpoints(workers))],
                           env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert gen.stdout.read(20)  # it is generating
        workers[port].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = gen.communicate(timeout=30)
        failed_after = time.monotonic() - killed_at
    finally:
        _stop(gen)
        workers[port].wait()
        workers[port] = _start_worker(port)
    assert gen.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith(f"speculant: error: RPC worker {endpoint} went down"), err
    assert "Traceback" not in err and "ggml" not in err, err
    assert failed_after <= 5.0, failed_after


def _cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=ENV, capture_output=True, text=True, timeout=timeout)


def test_an_empty_rpc_is_refused_not_run_locally():
    r = _cli("generate", "-m", MODEL, "--rpc", "", "-p", "hi", "-n", "1")
    assert r.returncode == 1 and r.stderr.strip() == ("speculant: error: --rpc is empty: name the workers "
                                                      "(HOST:PORT[,HOST:PORT...]), or leave --rpc out"), r.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_worker_never_started(command):
    if not models.cached_path(MODEL).exists():
        pytest.skip(f"{MODEL} not pulled")
    port, server_port = _free_ports(2)
    args = ["-p", "Hi"] if command == "generate" else ["--port", str(server_port)]
    r = _cli(command, "-m", MODEL, "--rpc", f"127.0.0.1:{port}", *args)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (f"speculant: error: no RPC worker at 127.0.0.1:{port}: connection "
                                                 f"refused (start one there with `speculant worker --port {port}`)")
    assert "Traceback" not in r.stderr


def _listener(reply: bytes, on_accept=None):
    """A TCP server on loopback that answers every connection with `reply` (b"": says nothing) and keeps it;
    on_accept(conn): what to do with each connection instead."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if on_accept is not None:
                on_accept(conn)
            elif reply:
                conn.sendall(reply)
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def test_a_port_that_is_not_a_worker():
    silent, silent_ep = _listener(b"")
    http, http_ep = _listener(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    try:
        with pytest.raises(WorkerError, match="did not answer the RPC handshake within 1 s: not a speculant worker"):
            probe(silent_ep, timeout=1)
        with pytest.raises(WorkerError, match=f"{http_ep} is not a speculant worker"):
            probe(http_ep)
        if models.cached_path(MODEL).exists():  # the CLI says so in one line
            r = _cli("generate", "-m", MODEL, "-p", "Hi", "--rpc", http_ep)
            assert r.returncode == 1 and "Traceback" not in r.stderr
            assert r.stderr.strip().splitlines()[-1].startswith(f"speculant: error: {http_ep} is not a speculant worker")
    finally:
        silent.close()
        http.close()


def _hello_then(identity, cut: int = 0):
    """on_accept for _listener: ggml's rpc-server of protocol 7 as far as the handshake goes (its HELLO reply), then
    on the next command either what our patched server answers to the identity command (identity: bytes), or, as
    a stock server does with a command it does not know, closing the connection (identity None)."""
    def serve(conn):
        conn.recv(1 + 8 + 24)
        conn.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24))
        command = conn.recv(1 + 8)
        if identity is not None and command[:1] == b"\xc5":
            conn.sendall(struct.pack("<Q", len(identity) + cut) + identity)  # cut: announces more than it sends
        conn.close()
    return serve


def test_a_worker_of_another_build_is_refused():
    """A worker whose layers would not compute a pass as this build does (llama.cpp's own rpc-server, another
    speculant build, other batch-invariant pass sizes) is refused before anything loads: over it, speculative output
    could differ from plain decoding. SPECULANT_RPC_ANY_BUILD=1 turns that into a warning."""
    from speculant.native import load_backends, system_features
    from speculant.rpc import check_identity

    load_backends()
    own = system_features()
    if "SPECULANT" not in own:
        pytest.skip("llama-cpp-python not built by speculant: it promises nothing to check")
    stock, stock_ep = _listener(b"", on_accept=_hello_then(None))
    other, other_ep = _listener(b"", on_accept=_hello_then(b"BACKEND=CPU\nSPECULANT=000000000000\nCPU_VARIANT=x64\n"))
    cut, cut_ep = _listener(b"", on_accept=_hello_then(f"SPECULANT={own['SPECULANT']}\n".encode(), cut=5))
    try:
        assert probe(cut_ep) is None  # a reply cut short says nothing
        assert probe(stock_ep) is None
        with pytest.raises(WorkerError, match=f"the worker at {stock_ep} is not a speculant worker of this build"):
            check_identity(stock_ep, probe(stock_ep))
        assert probe(other_ep)["SPECULANT"] == "000000000000"
        with pytest.raises(WorkerError, match=f"runs speculant build 000000000000, this process {own['SPECULANT']}"):
            check_identity(other_ep, probe(other_ep))
        os.environ["SPECULANT_RPC_ANY_BUILD"] = "1"
        try:
            assert "using it anyway" in check_identity(stock_ep, probe(stock_ep))[0]
        finally:
            del os.environ["SPECULANT_RPC_ANY_BUILD"]
        if models.cached_path(MODEL).exists():  # the CLI says so in one line
            r = _cli("generate", "-m", MODEL, "-p", "Hi", "--rpc", stock_ep)
            assert r.returncode == 1 and "Traceback" not in r.stderr
            assert r.stderr.strip().splitlines()[-1].startswith(
                f"speculant: error: the worker at {stock_ep} is not a speculant worker of this build")
    finally:
        stock.close()
        other.close()
        cut.close()


def test_invariant_rows_are_read_as_the_kernels_read_them():
    """SPECULANT_INVARIANT_ROWS as native/src/speculant-mm.c reads it (unset: 64; else C's atoll), on this side and
    for a worker's, so that the two are compared as their kernels use them (int() raised on junk, and an empty value
    was 64 here but 0 in C)."""
    from speculant.native import rows_setting

    cases = {None: 64, "": 0, "64": 64, " 64": 64, "32abc": 32, "abc": 0, "+7": 7, "\u00b2": 0, "  -12x": -12}
    assert {v: rows_setting(v) for v in cases} == cases


def test_real_workers_say_their_build_and_settings():
    """A real worker names its build, kernels and batch-invariant pass size; one started with other pass sizes is
    refused by the CLI in one line, and runs with SPECULANT_RPC_ANY_BUILD=1 (with a warning); one on other kernels
    (the AVX2 variant) is let in with a note."""
    from speculant.native import load_backends, loaded_variant, system_features
    from speculant.rpc import check_identity

    if not models.cached_path(MODEL).exists():
        pytest.skip(f"{MODEL} not pulled")
    load_backends()
    own = system_features()
    if "SPECULANT" not in own:
        pytest.skip("llama-cpp-python not built by speculant")
    port = _free_port()
    proc = _start_worker(port, env={**ENV, "SPECULANT_INVARIANT_ROWS": "8"})
    endpoint = f"127.0.0.1:{port}"
    try:
        identity = probe(endpoint)
        assert identity["SPECULANT"] == own["SPECULANT"] and identity["CPU_VARIANT"] == own["CPU_VARIANT"]
        assert identity["SPECULANT_INVARIANT_ROWS"] == "8"
        with pytest.raises(WorkerError, match="batch-invariant passes of up to 8 tokens, this process up to 64"):
            check_identity(endpoint, identity)
        r = _cli("generate", "-m", MODEL, "-p", "Hi", "-n", "4", "--rpc", endpoint)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert "SPECULANT_INVARIANT_ROWS alike on both" in r.stderr.strip().splitlines()[-1]
        r = subprocess.run([*CLI, "generate", "-m", MODEL, "-p", "Hi", "-n", "4", "--rpc", endpoint, "--json"],
                           env={**ENV, "SPECULANT_RPC_ANY_BUILD": "1"}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("using it anyway, output is not promised exact") == 1
        stats = json.loads(r.stdout)["stats"]
        assert stats["exact_numerics"] is False  # (it said true beside the warning)
        # the target's local layers are in its own process: counted (this process alone was ~76 MiB)
        assert stats["peak_rss_mb"] > 150, stats
    finally:
        _stop(proc)
    info = native_build_variants()
    if loaded_variant() == "haswell" or "haswell" not in info:
        return
    proc = _start_worker(port, env={**ENV, "SPECULANT_CPU_VARIANT": "haswell"})
    try:
        notes = check_identity(endpoint, probe(endpoint))
        assert len(notes) == 1 and f"runs llama.cpp's haswell kernels, this machine {loaded_variant()}" in notes[0]
    finally:
        _stop(proc)


def native_build_variants() -> list[str]:
    from speculant.native import build_info

    info = build_info()
    return info["variants"].split(",") if info else []


def test_binding_beyond_loopback_warns():
    def first_lines(host):
        port = _free_port()
        proc = subprocess.Popen([*CLI, "worker", "--host", host, "--port", str(port), "-t", "1"], env=ENV,
                                stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            return [proc.stderr.readline() for _ in range(1 if host.startswith("127.") else 2)]
        finally:
            _stop(proc)

    warned = first_lines("0.0.0.0")
    assert warned[0].startswith("speculant: warning: binding the worker to 0.0.0.0")
    assert "no authentication" in warned[0] and "SSH tunnel" in warned[0] and "private network" in warned[0]
    assert warned[1].startswith("speculant: worker on 0.0.0.0:")
    assert first_lines("127.0.0.1")[0].startswith("speculant: worker on 127.0.0.1:")  # no warning on loopback
    assert first_lines("127.0.0.2")[0].startswith("speculant: worker on 127.0.0.2:")  # 127/8 is loopback too
    r = _cli("worker", "--host", "nosuch.invalid", "--port", "1")  # the error alone, no warning before it
    assert r.returncode == 1 and r.stderr.startswith("speculant: error: --host nosuch.invalid: not an IPv4"), r.stderr
    r = _cli("worker", "--host", "::1", "--port", "1")
    assert r.returncode == 1 and r.stderr.startswith("speculant: error: --host ::1: not an IPv4 address")


def test_delay_proxy_forwards_both_directions_in_order():
    """The benchmark's latency proxy (speculant.bench.netdelay) passes every byte through, in order."""
    echo = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = echo.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    listen = _free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "speculant.bench.netdelay", "--delay-ms", "1",
                              f"{listen}:127.0.0.1:{echo.getsockname()[1]}"], stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout.readline().strip() == "ready"
        payload = os.urandom(1 << 20)
        with socket.create_connection(("127.0.0.1", listen)) as c:
            received = bytearray()
            for i in range(0, len(payload), 1 << 16):
                c.sendall(payload[i:i + (1 << 16)])
            c.shutdown(socket.SHUT_WR)
            while data := c.recv(1 << 20):
                received += data
        assert bytes(received) == payload
    finally:
        proxy.kill()
        proxy.wait()
        echo.close()


def test_a_worker_that_stops_answering_after_the_check_fails_the_load_in_time(workers, monkeypatch):
    """A second client of a worker passes the check while the first client's process is still connecting, then
    waits unanswered: the load hung for its whole 10-minute limit. Now the workers' first answers have their own
    limit. Here a proxy passes the check's connection through to a real worker and holds the next one."""
    from speculant.api import load_engine
    from speculant.backends import supervised

    monkeypatch.setattr(supervised, "CONNECT_S", 3.0)
    worker = _endpoints(workers)[0].rsplit(":", 1)
    upstreams = []

    def pipe(src, dst):
        while data := src.recv(65536):
            dst.sendall(data)

    def through_once(conn):  # the check's connection goes through to the worker; later ones are held, unanswered
        if not upstreams:
            upstreams.append(socket.create_connection((worker[0], int(worker[1]))))
            for a, b in ((conn, upstreams[0]), (upstreams[0], conn)):
                threading.Thread(target=lambda a=a, b=b: _quietly(pipe, a, b), daemon=True).start()

    server, endpoint = _listener(b"", on_accept=through_once)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="did not answer this client within 3 s"):
            load_engine(MODEL, n_ctx=512, threads=1, rpc=[endpoint])
        assert time.monotonic() - t0 < 30
    finally:
        server.close()
        for s in upstreams:
            s.close()


def _quietly(fn, *args):
    try:
        fn(*args)
    except OSError:
        pass


def test_a_hung_worker_ends_a_decode_pass_after_the_stall_limit(workers, monkeypatch):
    """A worker that stops answering (SIGSTOP: its connection stays open, so it is not seen as down) held a decode
    pass forever. Past STALL_S (120 s; 3 here) the pass raises a WorkerError naming the stall, and the next
    call, the worker back, starts afresh with the same output."""
    from speculant.api import load_engine
    from speculant.backends import supervised

    monkeypatch.setattr(supervised, "STALL_S", 3.0)
    port = _free_port()
    worker = _start_worker(port)  # its own: the module's may still serve an earlier test's client
    try:
        engine = load_engine(MODEL, n_ctx=512, threads=1, rpc=[f"127.0.0.1:{port}"])
        try:
            expected = engine.generate("The capital of France is", max_tokens=6).tokens
            stream = engine.stream("Once upon a time", max_tokens=200)
            next(stream)
            worker.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(WorkerError, match="gave no answer to a decode pass for 3 s"):
                    for _ in stream:
                        pass
            finally:
                worker.send_signal(signal.SIGCONT)
            assert engine.generate("The capital of France is", max_tokens=6).tokens == expected
        finally:
            engine.close()
    finally:
        _stop(worker)


def _until_free(endpoint: str, timeout: float = 60) -> None:
    """Wait until the worker answers a new client (one a test before held may still be serving it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            probe(endpoint)
            return
        except WorkerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_server_whose_worker_hangs_says_so_and_still_shuts_down(workers):
    """serve --rpc with a worker stopped mid-request: /health says the worker is stalled (503) instead of "ok",
    and SIGTERM ends the server (exit 0) after its grace period: the pass in flight was waited on for good, and
    the process could only be killed with -9."""
    port = list(workers)[1]
    endpoint = f"127.0.0.1:{port}"
    _until_free(endpoint)
    proc, url = spawn_local(["-m", MODEL, "-c", "2048", "-t", "1", "--rpc", endpoint, "--shutdown-timeout", "1"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stopped = False
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # generating
            workers[port].send_signal(signal.SIGSTOP)
            stopped = True
            deadline = time.monotonic() + 60
            while (health := httpx.get(url + "/health", timeout=10)).status_code == 200 and \
                    time.monotonic() < deadline:
                time.sleep(1)
            assert health.status_code == 503 and health.json()["workers"][endpoint].startswith("stalled"), \
                health.text
            assert "stalled" in health.json()["message"]
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest and "error" in json.loads(rest[-1][6:]), rest[-3:]  # the stream ends with an error
        assert proc.wait(60) == 0
    finally:
        if stopped:
            workers[port].send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "Traceback" not in out, out
