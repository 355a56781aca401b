"""Ctrl-C and SIGTERM stop any command at any moment: exit 130 (143 for SIGTERM), no traceback, nothing
left behind. The CLI runs in a subprocess and gets the signal at a chosen moment."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import as_from_a_terminal
from speculant import models

SMALL = "smollm2-135m-instruct"


def start(*args, env=None):
    return subprocess.Popen([sys.executable, "-m", "speculant", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                            preexec_fn=as_from_a_terminal)


def wait_for_line(stream, fragment, timeout=120):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        if fragment in line:
            return
    raise AssertionError(f"{fragment!r} never appeared in:\n{''.join(seen)[-2000:]}")


def finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the command did not stop")
    assert "Traceback" not in err and "Exception ignored" not in err, err
    return out, err


@pytest.fixture(scope="module")
def target():
    path = models.cached_path(models.DEFAULT_TARGET)
    if not path.exists():
        pytest.skip("the Qwen target is not pulled")
    pytest.importorskip("llama_cpp")
    return models.DEFAULT_TARGET


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_while_loading_stops_at_once(target, sig, code):
    # SPECULANT_VERBOSE echoes llama.cpp's log on stdout: its first line says the loader is running
    proc = start("generate", "-m", target, "-p", "Write a long story.", "-n", "400",
                 env={"SPECULANT_VERBOSE": "1"})
    wait_for_line(proc.stdout, "llama_model_loader")
    proc.send_signal(sig)
    out, err = finish(proc)
    assert proc.returncode == code, err
    assert "tokens/s" not in err  # no generation ran after the signal


def test_an_ignored_sigint_stays_ignored_while_loading(target):
    # a command started with SIGINT ignored (`cmd &` in a script, nohup) must not take a Ctrl-C meant for the
    # shell's foreground job as a cancel of its model load
    proc = subprocess.Popen([sys.executable, "-m", "speculant", "generate", "-m", target, "-p", "Hi", "-n", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SPECULANT_VERBOSE": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    wait_for_line(proc.stdout, "llama_model_loader")
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert "tokens/s" in err


def test_ctrl_c_while_generating(target):
    proc = start("generate", "-m", target, "-p", "Write a long story about a dragon.", "-n", "2000", "--chat")
    wait_for_line_chars(proc.stdout, 10)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 130 and "interrupted" in err


def wait_for_line_chars(stream, n, timeout=120):
    got = ""
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        c = stream.read(1)
        if not c:
            break
        got += c
    assert len(got) >= n, f"no output: {got!r}"


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_pull_leaves_nothing(tmp_path, sig, code):
    """The signal goes to speculant alone (not to pip, as a terminal's Ctrl-C would): pip's temporary files of
    the wheel it was fetching (in TMPDIR, ~50 MB each) were left behind."""
    (tmp_path / "tmp").mkdir()
    proc = start("pull", SMALL, env={"SPECULANT_HOME": str(tmp_path), "TMPDIR": str(tmp_path / "tmp")})
    folder = tmp_path / "models"
    deadline = time.monotonic() + 60
    while not list(folder.glob(".pull-*")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    if proc.poll() is not None:
        pytest.skip("the pull finished before it could be interrupted")
    time.sleep(0.3)  # pip is downloading or the parts are being assembled
    proc.send_signal(sig)
    out, err = finish(proc)
    if proc.returncode == 0:
        pytest.skip("the pull finished before the signal arrived")
    assert proc.returncode == code, err
    assert list(folder.iterdir()) == []  # no staging directory, no half-written model
    assert list((tmp_path / "tmp").iterdir()) == []  # nor pip's files
