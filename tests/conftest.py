import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/synthetic.py

from speculant import models  # noqa: E402

TARGET, DRAFT, SMALL = models.DEFAULT_TARGET, models.DEFAULT_DRAFT, "smollm2-135m-instruct"


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
