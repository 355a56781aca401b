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
