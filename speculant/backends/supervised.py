"""A llama.cpp target whose layers are partly on RPC workers, run in a supervised child process.

ggml's RPC client aborts its whole process (GGML_ABORT) when a worker dies mid-call; that cannot be caught
in-process. So the model lives in a child process, and this backend (in the parent) forwards the decode
calls to it over a pipe and watches it: when the child dies or a worker stops accepting connections, the
child is killed and the call raises a one-line WorkerError naming the worker, within about a second. The
next call starts a new child once every worker answers again (serving resumes by itself).

The parent keeps what text handling needs (vocabulary, token pieces, chat template), sent once by the
child, so only tokenize and the passes cross the pipe. Numerics: the worker runs the same CPU backend
variant with our invariant kernels on its layers, so the logits are those of the model run locally
(tests/test_rpc.py checks greedy output token for token).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..errors import Cancelled, ModelError, SpeculantError
from ..native import gguf_block_count
from ..rpc import WorkerError, check_identity, connections, layer_plan, probe, reachable
from .base import Backend, VocabInfo

WATCH_S = 0.2  # how often a waiting call checks the child process
REACH_S = 1.0  # how often it checks that the workers still accept connections
STALL_S = 120.0  # a decode pass without an answer this long: a worker is hung (stopped, or its host unreachable
# without closing its connections); even a 72B target's pass over a slow network takes seconds
STALLED_S = 10.0  # /health calls a worker stalled while a decode pass has waited this long
CONNECT_S = 20.0  # the workers' first answers while loading: a worker serves one client at a time, and another
# client's connection waits unanswered until the first leaves


def _child_main(conn, path: str, endpoints: list[str], device_layers: list[int], kwargs: dict, log_path: str,
                stop) -> None:
    """The child: load the target with its layers on the workers, then answer the parent's calls. stop: an
    event the parent sets to stop the prompt in progress between two passes (its request was cancelled)."""
    import resource

    os.environ["GGML_NO_BACKTRACE"] = "1"  # an abort must end the child at once, not attach a debugger
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 2)  # ggml's abort message: the parent reads it, the user's terminal does not
    os.dup2(log, 1)
    try:
        from .. import rpc
        from ..api import repack_weights
        from ..native import gguf_tensors, set_plain_as_repacked
        from .llamacpp import LlamaCppBackend

        # The workers hold their layers in the plain layout (RPC offers no repacked buffers), and compute plain rows
        # of the types llama.cpp repacks with the repacked kernels' arithmetic (`speculant worker`), as this process
        # does from here on: the layers kept here load repacked as a local run's do, and every split gives a default
        # local run's output. Not so a mixture of experts' expert matrices (a plain expert with one token of a pass
        # runs ggml's own dot product): such a target keeps its layers here plain, as the workers do, and gives the
        # same output whatever the split, though not a local run's.
        switched = set_plain_as_repacked()  # False: a build without the switch, whose workers would round as plain
        experts = any(len(t.shape) == 3 for t in gguf_tensors(path))
        devices = rpc.rpc_devices(endpoints)  # every worker has answered (a busy one would not)
        conn.send(("connected", None))
        backend = LlamaCppBackend(path, devices=devices, device_layers=device_layers,
                                  repack=repack_weights() and not experts and switched,
                                  **kwargs)
        backend.should_stop = stop.is_set
        eog = [t for t in range(backend.n_vocab) if backend.is_eog(t)]
        info = {"name": backend.name, "n_ctx": backend.n_ctx, "n_vocab": backend.n_vocab,
                "n_batch": backend.n_batch, "n_threads": backend.n_threads, "n_ctx_train": backend.n_ctx_train,
                "invariant_rows": backend.invariant_rows, "exact_numerics": backend.exact_numerics,
                "device_layers": device_layers, "chat_template": backend.chat_template(),
                "bos_token": backend.bos_token, "eos_token": backend.eos_token, "add_bos": backend.add_bos(),
                "fim_tokens": backend.fim_tokens(), "fim_repo_tokens": backend.fim_repo_tokens(),
                "eog": eog, "vocab_info": backend.vocab_info(),
                "pieces": [backend.token_bytes(t) for t in range(backend.n_vocab)]}
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises it)
        conn.send(("error", e if isinstance(e, SpeculantError) else ModelError(f"{type(e).__name__}: {e}")))
        return
    conn.send(("ok", info))
    while True:
        try:
            op, *args = conn.recv()
        except EOFError:
            break
        try:
            if op == "decode":
                tokens, start, n_logits = args
                backend.rewind(start)
                value = backend.eval(tokens, n_logits)
            elif op == "prefill":
                value = backend.prefill(args[0])
            elif op == "tokenize":
                value = backend.tokenize(*args)
            elif op == "metadata":
                value = backend.metadata(*args)
            elif op == "close":
                break
            else:
                raise ValueError(f"unknown call {op!r}")
            conn.send(("ok", value))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", e if isinstance(e, SpeculantError) else RuntimeError(str(e))))
    backend.close()


class SupervisedBackend(Backend):
    """A llama.cpp target split over this CPU and RPC workers, in a watched child process."""

    def __init__(self, path: str | Path, endpoints: Sequence[str], weights: Sequence[float], *,
                 n_ctx: int = 4096, n_threads: Optional[int] = None, load_timeout: float = 600.0):
        super().__init__()
        self.path = Path(path)
        self.offloaded = True  # its passes run in a child process and on RPC workers (costprofile.cpu_share)
        self.endpoints = list(endpoints)
        self._kwargs = {"n_ctx": n_ctx, "n_threads": n_threads}
        self._abort_at: Optional[float] = None  # a shutdown's deadline (abort_at): past it, a waiting call ends
        self._decoding_since: Optional[float] = None  # when the decode pass in flight was sent
        self._what = "decoding"  # what the passes are doing (scoring: "scoring the prompt")
        self._load_timeout = load_timeout
        self._proc: Optional[mp.Process] = None
        self._conn = None
        fd, self._log_path = tempfile.mkstemp(prefix="speculant-target-", suffix=".log")
        os.close(fd)
        self.down: dict[str, str] = {}  # endpoint -> why, for the workers found down by the last failure
        self._warned: set[tuple[str, str]] = set()
        self._inexact: set[str] = set()  # workers of another build or settings, used anyway
        n_layer = gguf_block_count(self.path)
        self.device_layers = layer_plan(n_layer, weights)  # checked before any worker is held
        self._split = (f"the target's {n_layer} layers: {n_layer - sum(self.device_layers)} here (with the "
                       f"embeddings and the output layer), " + ", ".join(
                           f"{n} on {endpoint}" for n, endpoint in zip(self.device_layers, self.endpoints)))
        self._start()

    @property
    def n_device_layers(self) -> int:
        """Repeating layers on the workers."""
        return sum(self.device_layers)

    # -- the child ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Check every worker answers, then start a child and wait until its model is loaded."""
        self._inexact = set()  # as the workers are now (one of another build may have been replaced)
        for endpoint in self.endpoints:
            try:
                warnings = check_identity(endpoint, probe(endpoint))
            except WorkerError as e:
                self.down = {endpoint: str(e)}
                raise
            if any("output is not promised exact" in line for line in warnings):
                self._inexact.add(endpoint)  # a worker used anyway (SPECULANT_RPC_ANY_BUILD=1): not exact
            for line in warnings:
                if (endpoint, line) not in self._warned:  # once, not at every restart
                    self._warned.add((endpoint, line))
                    print(f"speculant: warning: {line}", file=sys.stderr, flush=True)
        self.down = {}
        if self._split:  # once, when every worker has answered (not at a restart)
            print(f"speculant: {self._split}", file=sys.stderr, flush=True)
            self._split = ""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._stop_prompt = ctx.Event()
        self._proc = ctx.Process(target=_child_main, name="speculant-target", daemon=True,
                                 args=(child, str(self.path), self.endpoints, self.device_layers, self._kwargs,
                                       self._log_path, self._stop_prompt))
        self._proc.start()
        child.close()
        self._conn = parent
        info = self._wait(timeout=self._load_timeout, what="loading the target")
        for key in ("name", "n_ctx", "n_vocab", "n_batch", "n_threads", "n_ctx_train", "invariant_rows",
                    "exact_numerics", "device_layers"):
            setattr(self, key, info[key])
        self.exact_numerics = self.exact_numerics and not self._inexact  # the child cannot see the workers' builds
        self._info = info
        self._eog = frozenset(info["eog"])
        self.tokens = []

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            self._proc = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.tokens = []

    def _failed(self, what: str) -> WorkerError:
        """Kill the child and describe why it stopped: a worker that is down, else the child's last words."""
        code = self._proc.exitcode if self._proc is not None else None
        self._stop()
        self.down = {ep: "not accepting connections" for ep in self.endpoints if not reachable(ep)}
        if self.down:
            names = ", ".join(self.down)
            return WorkerError(f"RPC worker {names} went down while {what} (it no longer accepts connections)",
                               next(iter(self.down)))
        last = [line for line in Path(self._log_path).read_text(errors="replace").splitlines() if line.strip()]
        why = last[-1].strip() if last else f"exit code {code}"
        return WorkerError(f"the target's process ended while {what} ({why}); workers "
                           f"{', '.join(self.endpoints)} answer: the next request retries")

    def _wait(self, timeout: float = float("inf"), what: str = "decoding", should_stop=None):
        """The child's answer to the call in flight, watching the child and the workers while waiting (and
        should_stop: when it says True, the child is asked to stop the prompt in progress)."""
        t0 = checked = time.monotonic()
        connected = what != "loading the target"
        try:
            while True:
                if self._conn.poll(WATCH_S):
                    status, value = self._conn.recv()
                    if status != "connected":
                        break
                    connected = True
                    continue
                if not connected and time.monotonic() - t0 > CONNECT_S:
                    self._stop()
                    raise WorkerError(f"the RPC workers {', '.join(self.endpoints)} did not answer this client within "
                                      f"{CONNECT_S:.0f} s: a worker serves one client at a time; is another process "
                                      f"using one of them?", self.endpoints[0])
                if should_stop is not None and should_stop():
                    self._stop_prompt.set()
                now = time.monotonic()
                if not self._proc.is_alive():
                    raise self._failed(what)
                if now - checked >= REACH_S and what != "loading the target":
                    checked = now
                    if "close_wait" in connections(self._proc.pid, self.endpoints).values():
                        raise self._failed(what)  # a worker closed its connection: it is gone
                if now - t0 > timeout:
                    self._stop()
                    raise WorkerError(f"{what} took longer than {timeout:.0f} s; stopped")
                if what == "decoding" and now - t0 > STALL_S:
                    self._stop()
                    raise WorkerError(f"the RPC workers {', '.join(self.endpoints)} gave no answer to a decode pass "
                                      f"for {STALL_S:.0f} s: one is hung (stopped, or its host unreachable without "
                                      "closing the connection); the target's process is stopped, the next request "
                                      "retries", self.endpoints[0])
                if self._abort_at is not None and now >= self._abort_at:
                    self._stop()  # a hung worker would otherwise hold a shutting-down server for good
                    raise WorkerError(f"the server shut down while {what} waited on the RPC workers",
                                      self.endpoints[0])
        except (EOFError, OSError):
            raise self._failed(what) from None
        except (KeyboardInterrupt, SystemExit):
            if what == "loading the target":  # the loading child reads no "close": end it now, not in 5 s
                self._stop()
            raise
        if status == "error":
            if what == "loading the target":
                self._stop()
            raise value
        return value

    def _call(self, op: str, *args, what: str = "decoding", should_stop=None):
        if self._proc is None:
            self._start()  # after a failure: the workers are checked first (WorkerError while one is down)
        self._stop_prompt.clear()
        try:
            self._conn.send((op, *args))
        except OSError:
            raise self._failed(what) from None
        if what == "decoding":
            self._decoding_since = time.monotonic()
        try:
            return self._wait(what=what, should_stop=should_stop)
        finally:
            self._decoding_since = None

    @property
    def child_pid(self) -> Optional[int]:
        """The process the target runs in (its local layers' memory is there: memory.engine_peak_rss_mb)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.is_alive() else None

    def abort_at(self, deadline: float) -> None:
        """A shutdown: a call still waiting on the workers at `deadline` (time.monotonic()) stops the target's
        process and raises WorkerError (a hung worker held the server from exiting)."""
        self._abort_at = deadline

    def health(self) -> dict[str, str]:
        """endpoint -> "up" | why it is down. While the target runs, from the state of its connections (a
        worker serves one client, so connecting to it would wait); after a failure, by connecting."""
        proc, since = self._proc, self._decoding_since
        states = connections(proc.pid, self.endpoints) if proc is not None and proc.is_alive() else {}
        if since is not None and time.monotonic() - since > STALLED_S:  # connected, but not answering
            return {ep: f"stalled: no answer to a decode pass for {time.monotonic() - since:.0f} s"
                    for ep in self.endpoints}
        return {ep: "up" if states.get(ep) not in (None, "close_wait") or reachable(ep)
                else "down: not accepting connections" for ep in self.endpoints}

    # -- Backend ------------------------------------------------------------------------------------------
    def _decode(self, tokens: Sequence[int], start: int, n_logits: int) -> np.ndarray:
        # after a failure self.tokens is empty, so `start` is 0 and the new child's empty cache agrees; the passes
        # of a prompt being scored (echo with logprobs: `scoring`) may take long: they are not held to STALL_S
        return self._call("decode", list(map(int, tokens)), start, n_logits, what=self._what)

    @contextlib.contextmanager
    def scoring(self):
        """Passes over a prompt being scored (Engine.prompt_logprobs), not decode steps: no stall limit."""
        self._what = "scoring the prompt"
        try:
            yield
        finally:
            self._what = "decoding"

    def _truncate(self, n_kept: int) -> None:
        pass  # the child cuts its cache to `start` at each decode, and prefill keeps what it can

    def prefill(self, context: Sequence[int]) -> int:
        proc = self._proc
        if proc is not None and "close_wait" in connections(proc.pid, self.endpoints).values():
            self._stop()  # a worker went away since the last request (and may be back): start afresh
        try:
            kept = self._call("prefill", list(map(int, context)), what="processing the prompt",
                              should_stop=self.should_stop)
        except Cancelled:
            self.tokens = []  # the child holds part of the prompt; its own prefill reconciles the next one
            raise
        self.tokens = list(map(int, context))
        return kept

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self._call("tokenize", text, add_special, parse_special, what="tokenizing")

    def token_bytes(self, token: int) -> bytes:
        pieces = self._info["pieces"]
        return pieces[token] if 0 <= token < len(pieces) else b""

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def chat_template(self) -> Optional[str]:
        return self._info["chat_template"]

    def vocab_info(self) -> VocabInfo:
        return self._info["vocab_info"]

    @property
    def bos_token(self) -> str:
        return self._info["bos_token"]

    @property
    def eos_token(self) -> str:
        return self._info["eos_token"]

    def add_bos(self) -> bool:
        return self._info["add_bos"]

    def fim_tokens(self) -> Optional[tuple[int, int, int]]:
        return self._info["fim_tokens"]

    def fim_repo_tokens(self) -> Optional[tuple[int, int]]:
        return self._info["fim_repo_tokens"]

    def metadata(self, key: str) -> Optional[str]:
        return self._call("metadata", key, what="reading metadata")

    def close(self) -> None:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(("close",))
                self._proc.join(5)
            except OSError:
                pass
        self._stop()
        try:
            os.unlink(self._log_path)
        except OSError:
            pass

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
