"""llama.cpp RPC: `speculant worker` (ggml's rpc-server, in-process) and what a client needs to use workers.

A worker serves its CPU backend over ggml's RPC protocol (libggml-rpc from our pinned llama.cpp, the very
library libllama loaded: see native.py); a client adds each worker as a device and llama.cpp places some of
the target's layers there. The protocol has no authentication and a worker runs whatever graph it is sent,
so workers listen on loopback unless told otherwise. A worker serves one client at a time.

The client side aborts its process (GGML_ABORT) when a worker goes away mid-call, so the target runs in a
supervised child process (backends/supervised.py); this module only speaks to workers from the parent
through plain sockets (`probe`, `reachable`).
"""

from __future__ import annotations

import ctypes
import ipaddress
import math
import os
import socket
import struct
import sys
import threading
from typing import Optional, Sequence

from .errors import SettingsError, SpeculantError

RPC_PROTO_MAJOR = 7  # ggml-rpc.h of the pinned llama.cpp (RPC_PROTO_MAJOR_VERSION)
_CMD_HELLO = 14  # rpc_cmd RPC_CMD_HELLO ("must be always 14")
_CAPS_SIZE = 24  # RPC_CONN_CAPS_SIZE (transport.h)
INSECURE = ("the RPC protocol has no authentication or encryption: anyone who can reach this port can run "
            "code on this machine's memory and read the model; bind it only on a private network you trust, "
            "or keep the default 127.0.0.1 and reach it through an SSH tunnel (ssh -L PORT:127.0.0.1:PORT host)")


class WorkerError(SpeculantError):
    """An RPC worker is down, unreachable, or not a worker."""

    def __init__(self, message: str, endpoint: Optional[str] = None):
        super().__init__(message)
        self.endpoint = endpoint


def parse_endpoints(text: str) -> list[str]:
    """'HOST:PORT[,HOST:PORT...]' -> ['HOST:PORT', ...] (SettingsError for anything else)."""
    endpoints = []
    for part in (p.strip() for p in text.split(",")):
        host, sep, port = part.rpartition(":")
        if not sep or not host or any(c.isspace() for c in host) or not (port.isascii() and port.isdigit()) \
                or not (0 < int(port) < 65536):
            raise SettingsError(f"--rpc: {part!r} is not HOST:PORT (e.g. 127.0.0.1:50052; several: separated by commas)")
        if part in endpoints:
            raise SettingsError(f"--rpc: {part} is listed twice")
        twin = next((e for e in endpoints if _same_worker(e, part)), None)
        if twin is not None:  # a second connection to a worker waits for the first to end: it would hang
            raise SettingsError(f"--rpc: {twin} and {part} are the same worker")
        endpoints.append(part)
    if len(endpoints) > 15:  # GGML_SCHED_MAX_BACKENDS (16) counts this machine's CPU too; 16 workers aborted
        raise SettingsError(f"--rpc: at most 15 workers (llama.cpp's scheduler takes 16 devices, this machine's "
                            f"CPU one of them), got {len(endpoints)}")
    return endpoints


def _same_worker(a: str, b: str) -> bool:
    """Two HOST:PORTs that resolve to the same address and port (names that do not resolve are compared as
    written; probing the workers reports those)."""
    def address(endpoint: str):
        host, _, port = endpoint.rpartition(":")
        host = host.strip("[]")
        try:
            return socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)[0][4][:2]
        except (OSError, UnicodeError):
            return (host, int(port))
    return address(a) == address(b)


def parse_tensor_split(text: Optional[str], n_workers: int) -> list[float]:
    """--tensor-split: one weight per worker (in --rpc order) and optionally a last one for this machine
    -> [w_worker_1, ..., w_worker_n, w_local]; default equal shares for all of them."""
    if not text:
        return [1.0] * (n_workers + 1)
    try:
        weights = [float(w) for w in text.replace("/", ",").split(",")]
    except ValueError:
        raise SettingsError(f"--tensor-split must be comma-separated numbers, got {text!r}") from None
    if len(weights) == n_workers:
        weights.append(0.0)
    if len(weights) != n_workers + 1:
        raise SettingsError(f"--tensor-split takes one weight per --rpc worker ({n_workers}) and optionally one "
                            f"more for this machine, got {len(weights)}")
    if any(not (0 <= w < math.inf) for w in weights) or sum(weights) <= 0 or not math.isfinite(sum(weights)):
        raise SettingsError(f"--tensor-split weights must be finite, >= 0 and not all 0, got {text!r}")
    idle = [i + 1 for i, w in enumerate(weights[:-1]) if w == 0]
    if idle:  # connected (and held: a worker serves one client) for no layers
        raise SettingsError(f"--tensor-split gives --rpc worker {idle[0]} a weight of 0: it would hold no layers; "
                            f"leave it out of --rpc")
    return weights


def layer_plan(n_layer: int, weights: Sequence[float]) -> list[int]:
    """Repeating layers per worker, in --rpc order (llama.cpp's n_gpu_layers: the workers hold the last ones,
    the first worker the first of those); this machine keeps the first layers, the embeddings and the output
    layer. A worker the weights would leave with no layer is a SettingsError: it would be held for nothing."""
    on_workers = min(n_layer, round(n_layer * sum(weights[:-1]) / sum(weights)))
    ideal = [on_workers * w / sum(weights[:-1]) for w in weights[:-1]]
    layers = [math.floor(x) for x in ideal]
    by_remainder = sorted(range(len(layers)), key=lambda i: layers[i] - ideal[i])  # largest remainder first
    for i in by_remainder[:on_workers - sum(layers)]:
        layers[i] += 1
    if 0 in layers:
        i = layers.index(0)
        share = n_layer * weights[i] / sum(weights)
        raise SettingsError(f"the layer split leaves --rpc worker {i + 1} no layer (its share: {share:.2g} of "
                            f"{n_layer} layers): give it a larger --tensor-split share or leave it out of --rpc")
    return layers


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def reachable(endpoint: str, timeout: float = 1.0) -> bool:
    """False when the endpoint refuses connections (or cannot be reached); a busy worker counts as reachable
    (it serves one client at a time with a listen backlog of 1, so a connect may wait: a timeout is busy)."""
    try:
        with socket.create_connection(_split(endpoint), timeout=timeout):
            return True
    except (socket.timeout, TimeoutError):
        return True
    except OSError:
        return False


_TCP_STATES = {"01": "established", "08": "close_wait"}  # /proc/net/tcp st column


def connections(pid: int, endpoints: Sequence[str]) -> dict[str, str]:
    """endpoint -> the state of process pid's TCP connection to it: "established", "close_wait" (the worker
    closed it: it is gone), "other" or "none". Read from /proc, so it never disturbs a busy worker."""
    wanted = {}
    for endpoint in endpoints:
        host, port = _split(endpoint)
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            continue
        wanted[f"{socket.htonl(int.from_bytes(socket.inet_aton(ip), 'big')):08X}:{port:04X}"] = endpoint
    states = {ep: "none" for ep in endpoints}
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        with open(f"/proc/{pid}/net/tcp") as f:
            next(f)
            for line in f:
                cols = line.split()
                endpoint = wanted.get(cols[2])
                if endpoint and cols[9] in inodes and states[endpoint] != "established":
                    states[endpoint] = _TCP_STATES.get(cols[3], "other")
    except OSError:
        pass
    return states


_CMD_SPECULANT_IDENTITY = 0xC5  # our patch's command (native/*.patch, ggml-rpc.cpp); stock servers close on it
ANY_BUILD_ENV = "SPECULANT_RPC_ANY_BUILD"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Up to n bytes: fewer only when the peer closed the connection."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def probe(endpoint: str, timeout: float = 3.0) -> Optional[dict[str, str]]:
    """Check that a ggml RPC worker of our protocol answers at endpoint (its HELLO handshake), or raise a
    one-line WorkerError saying what is there instead; return what the worker says of its build (its backends'
    features: SPECULANT, the build key, CPU_VARIANT, ...; and SPECULANT_INVARIANT_ROWS as set there), or None
    for a worker that does not say (llama.cpp's own rpc-server, an older speculant). Only while no client holds
    the worker: it serves one connection at a time."""
    try:
        sock = socket.create_connection(_split(endpoint), timeout=timeout)
    except ConnectionRefusedError:
        raise WorkerError(f"no RPC worker at {endpoint}: connection refused (start one there with "
                          f"`speculant worker --port {_split(endpoint)[1]}`)", endpoint) from None
    except OSError as e:
        raise WorkerError(f"cannot reach the RPC worker at {endpoint}: {e.strerror or e}", endpoint) from None
    with sock:
        try:
            sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CAPS_SIZE) + bytes(_CAPS_SIZE))
            reply = _recv_exact(sock, 8 + 4 + _CAPS_SIZE)
        except socket.timeout:
            raise WorkerError(f"{endpoint} accepted a connection but did not answer the RPC handshake within "
                              f"{timeout:g} s: not a speculant worker (ggml rpc-server), or one busy serving "
                              f"another client", endpoint) from None
        except OSError as e:
            raise WorkerError(f"{endpoint} closed the RPC handshake ({e.strerror or e}): not a speculant worker",
                              endpoint) from None
        if len(reply) < 12 or struct.unpack("<Q", reply[:8])[0] != 4 + _CAPS_SIZE:
            raise WorkerError(f"{endpoint} is not a speculant worker (ggml rpc-server): it answered "
                              f"{reply[:16]!r} to the RPC handshake", endpoint)
        major, minor = reply[8], reply[9]
        if major != RPC_PROTO_MAJOR:
            raise WorkerError(f"the worker at {endpoint} speaks RPC protocol {major}.{minor}, this client "
                              f"{RPC_PROTO_MAJOR}.x: run the same speculant (llama.cpp) version on both", endpoint)
        try:
            sock.sendall(struct.pack("<BQ", _CMD_SPECULANT_IDENTITY, 0))
            size = _recv_exact(sock, 8)
            if len(size) < 8 or struct.unpack("<Q", size)[0] > 1 << 20:
                return None  # a server without our patch closes on the command
            n = struct.unpack("<Q", size)[0]
            text = _recv_exact(sock, n)
            if len(text) < n:  # cut short: no identity either
                return None
        except OSError:  # a reset or a timeout: no identity either
            return None
        text = text.decode("utf-8", "replace")
    return dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)


def check_identity(endpoint: str, identity: Optional[dict[str, str]]) -> list[str]:
    """Refuse (WorkerError) a worker whose layers would not compute a pass as this build does, so that speculative
    output could differ from plain decoding: another build, llama.cpp's own rpc-server, other batch-invariant pass
    sizes. With SPECULANT_RPC_ANY_BUILD=1 those become warnings. Return the warnings for the caller to print."""
    from .native import invariant_rows, load_backends, rows_setting, system_features

    load_backends()
    own = system_features()
    if "SPECULANT" not in own:  # this build promises nothing to keep (native.exactness_problems says so)
        return []
    problems, notes = [], []
    if identity is None or "SPECULANT" not in identity:
        problems.append(f"the worker at {endpoint} is not a speculant worker of this build (llama.cpp's own "
                        f"rpc-server, or an older speculant): its kernels need not compute a verify pass as they "
                        f"compute single tokens, so speculative output could differ from plain decoding; run "
                        f"`speculant worker` of this version (build {own['SPECULANT']}) there")
    elif identity["SPECULANT"] != own["SPECULANT"]:
        problems.append(f"the worker at {endpoint} runs speculant build {identity['SPECULANT']}, this process "
                        f"{own['SPECULANT']}: their kernels can round differently, so run the same speculant "
                        f"version (llama.cpp build) on both")
    else:
        theirs = rows_setting(identity.get("SPECULANT_INVARIANT_ROWS"))  # as the worker's kernels read it
        if theirs != invariant_rows():
            problems.append(f"the worker at {endpoint} computes batch-invariant passes of up to {theirs} tokens, "
                            f"this process up to {invariant_rows()}: set SPECULANT_INVARIANT_ROWS alike on both "
                            f"(or on neither)")
        if identity.get("CPU_VARIANT") and identity["CPU_VARIANT"] != own.get("CPU_VARIANT"):
            notes.append(f"the worker at {endpoint} runs llama.cpp's {identity['CPU_VARIANT']} kernels, this "
                         f"machine {own.get('CPU_VARIANT')}: speculative output equals plain decoding over these "
                         f"workers, but can differ in the last bits from a run on one machine")
    if problems and os.environ.get(ANY_BUILD_ENV) != "1":
        raise WorkerError(f"{problems[0]} ({ANY_BUILD_ENV}=1 uses it anyway, without exact output)", endpoint)
    return [f"{p}; {ANY_BUILD_ENV}=1: using it anyway, output is not promised exact" for p in problems] + notes


# -- the ggml side (worker process and the supervised target's child process) -----------------------------

def _rpc_fn(name: str, restype, argtypes) -> ctypes._CFuncPtr:
    """A function of the RPC backend that ggml registered (native.load_backends), by address: the same
    library instance as the one llama.cpp uses."""
    from .native import _ggml, load_backends

    load_backends()
    g = _ggml()
    g.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    g.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    g.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    g.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    reg = g.ggml_backend_reg_by_name(b"RPC")
    addr = g.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not addr:
        raise SpeculantError("this llama.cpp build has no RPC backend (GGML_RPC=ON): rebuild with `make setup`")
    return ctypes.CFUNCTYPE(restype, *argtypes)(addr)


def rpc_devices(endpoints: Sequence[str]) -> list[int]:
    """ggml devices (pointers) for the workers, in order: what llama_model_params.devices lists."""
    from .native import _ggml

    add_server = _rpc_fn("ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    g = _ggml()
    g.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    g.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    g.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    g.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    devices = []
    for endpoint in endpoints:
        reg = add_server(endpoint.encode())
        if not reg:
            raise WorkerError(f"the RPC worker at {endpoint} has no devices", endpoint)
        devices += [g.ggml_backend_reg_dev_get(reg, i) for i in range(g.ggml_backend_reg_dev_count(reg))]
    return devices


def cpu_device() -> int:
    from .native import _ggml, load_backends

    load_backends()
    g = _ggml()
    g.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    g.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        raise SpeculantError("no llama.cpp CPU device to serve")
    return dev


def serve_worker(host: str, port: int, threads: int) -> None:
    """Run ggml's RPC server on host:port with this machine's CPU backend until the process ends."""
    import llama_cpp as ll

    from .backends import llamacpp  # noqa: F401  (llama.cpp's log callback, backend init, the CPU variant)
    from .native import exactness_problems, loaded_variant, set_plain_as_repacked

    start = _rpc_fn("ggml_backend_rpc_start_server", None,
                    [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                     ctypes.POINTER(ctypes.c_void_p)])
    try:  # ggml's server binds IPv4 addresses only (inet_addr)
        address = socket.gethostbyname(host)
    except OSError:
        raise SettingsError(f"--host {host}: not an IPv4 address or a name that resolves to one (the llama.cpp "
                            f"RPC server listens on IPv4 only)") from None
    listen_check(address, port)
    devices = (ctypes.c_void_p * 1)(cpu_device())
    endpoint = f"{address}:{port}"
    print(f"speculant: worker on {endpoint}: llama.cpp CPU backend {loaded_variant() or ''}, {threads} "
          f"thread{'s' if threads != 1 else ''} (llama.cpp {ll.__version__})", file=sys.stderr, flush=True)
    # the layers arrive plain (RPC offers no repacked buffers): they compute with the repacked layout's arithmetic,
    # as the client's own layers, loaded repacked, do
    problems = exactness_problems()
    if not set_plain_as_repacked():
        problems.append("this build cannot give plain rows the repacked layout's arithmetic, which the client's "
                        "layers use (run the client's speculant build here)")
    if problems:  # the layers computed here would not give a local run's bits
        print(f"speculant: warning: this worker's llama.cpp cannot promise exact greedy output: "
              f"{'; '.join(problems)}", file=sys.stderr, flush=True)
    # the C call never returns; in a thread, Ctrl-C / SIGTERM still reach Python in the main thread
    thread = threading.Thread(target=start, args=(endpoint.encode(), None, threads, 1, devices), daemon=True)
    thread.start()
    while thread.is_alive():  # timed waits: a signal delivered to ggml's thread still gets handled here
        thread.join(0.5)
    raise SpeculantError(f"the RPC server on {endpoint} stopped (see the messages above)")


def listen_check(host: str, port: int) -> None:
    """Fail with one line before ggml does (it prints and returns) when host:port cannot be bound."""
    try:
        with socket.socket(socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise SpeculantError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


# -- CLI --------------------------------------------------------------------------------------------------

def add_cli(sub, add_model_args, add_sampling_args) -> None:
    from .api import thread_count

    p = sub.add_parser("worker", help="serve this machine's CPU to a remote target over llama.cpp RPC "
                                      "(unauthenticated: loopback by default)")
    p.add_argument("--host", "-H", default="127.0.0.1",
                   help="address to bind (default %(default)s: this machine only; anything else is reachable "
                        "without authentication)")
    p.add_argument("--port", "-p", type=int, default=50052, help="port (default %(default)s, as rpc-server)")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="CPU threads (default: all cores)")
    p.set_defaults(handler=cmd_worker)


def cmd_worker(args) -> int:
    import os

    if not (0 < args.port < 65536):
        raise SettingsError(f"--port must be in 1..65535, got {args.port}")
    from .api import check_threads

    check_threads(args.threads, "--threads")
    try:  # ggml's server binds IPv4 addresses only (inet_addr)
        address = socket.gethostbyname(args.host)
    except OSError:
        raise SettingsError(f"--host {args.host}: not an IPv4 address or a name that resolves to one (the llama.cpp "
                            f"RPC server listens on IPv4 only)") from None
    if not ipaddress.ip_address(address).is_loopback:  # 127.0.0.0/8 is this machine's alone
        print(f"speculant: warning: binding the worker to {args.host}: {INSECURE}", file=sys.stderr, flush=True)
    serve_worker(args.host, args.port, args.threads or os.cpu_count() or 1)
    return 0
