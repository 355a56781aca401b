import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/synthetic.py

from speculant import models  # noqa: E402

TARGET, DRAFT, SMALL = models.DEFAULT_TARGET, models.DEFAULT_DRAFT, "smollm2-135m-instruct"
SHIPPED_DRAFT = models.REGISTRY[DRAFT].derived_from or DRAFT  # the file the default draft is made from


def as_from_a_terminal():
    """preexec_fn for a CLI child that a test signals: Ctrl-C reaches a command started from a terminal, but a CI
    job run in the background of a shell has SIGINT ignored and a child inherits that (rightly: `nohup cmd &`
    must not die of it), so the child gets the default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _backend(name, **kw):
    path = models.cached_path(name)
    if not path.exists():
        pytest.skip(f"{name} not pulled (run `make models`)")
    from speculant.backends.llamacpp import LlamaCppBackend

    return LlamaCppBackend(path, **kw)


@pytest.fixture(scope="session")
def qwen_target():
    b = _backend(TARGET, n_ctx=2048)
    yield b
    b.close()


@pytest.fixture(scope="session")
def qwen_draft():
    b = _backend(DRAFT, n_ctx=2048, repack=True)
    yield b
    b.close()


@pytest.fixture(scope="session")
def qwen_draft_shipped():
    b = _backend(SHIPPED_DRAFT, n_ctx=2048, repack=True)
    yield b
    b.close()


@pytest.fixture(scope="session")
def small_target():
    b = _backend(SMALL, n_ctx=2048)
    yield b
    b.close()


@pytest.fixture(scope="session")
def small_draft_same_numerics():
    """SmolLM2 again, loaded exactly like the target (no repack): its logits equal the target's."""
    b = _backend(SMALL, n_ctx=2048)
    yield b
    b.close()


def write_imatrix(path, entries: dict, *, legacy: bool = False, ncall: int = 10):
    """An importance matrix file as llama-imatrix writes it, for entries {tensor name: mean squared activations
    per input column}: GGUF (NAME.in_sum2 sums over `ncall` tokens, NAME.counts) or the older .dat."""
    import numpy as np

    if legacy:  # n_entries; per entry: name length, name, ncall, nval, values; then chunk count, dataset name
        parts = [np.int32(len(entries)).tobytes()]
        for name, values in entries.items():
            raw = name.encode()
            parts += [np.int32(len(raw)).tobytes(), raw, np.int32(ncall).tobytes(), np.int32(values.size).tobytes(),
                      (values * ncall).astype(np.float32).tobytes()]
        parts += [np.int32(ncall).tobytes(), np.int32(4).tobytes(), b"test"]
        path.write_bytes(b"".join(parts))
        return
    from gguf import GGUFWriter

    w = GGUFWriter(path, arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["test"])
    w.add_uint32("imatrix.chunk_count", ncall)
    w.add_uint32("imatrix.chunk_size", 1)
    for name, values in entries.items():
        w.add_tensor(f"{name}.in_sum2", (values * ncall).astype(np.float32).reshape(1, -1))
        w.add_tensor(f"{name}.counts", np.array([[ncall]], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_imatrix_entries(seed=0):
    """Made-up mean squared activations for every matrix of SmolLM2 (the quantizer only weighs columns by them)."""
    import numpy as np
    from gguf import GGUFReader

    rng = np.random.default_rng(seed)
    return {t.name: rng.uniform(0.1, 2.0, int(t.shape[0])).astype(np.float32)
            for t in GGUFReader(models.cached_path(SMALL), "r").tensors
            if t.name.startswith("blk.") and len(t.shape) >= 2}
