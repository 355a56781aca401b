"""Exactness of the torch backend on Qwen2.5-Coder-1.5B, where library kernels round differently by pass
shape (see speculant/backends/torch.py). Runs only when the model and its torch conversion are cached
(`speculant bench --methods plain-torch ...` or `speculant generate --backend torch -m
qwen2.5-coder-1.5b-instruct` makes it), since converting takes minutes and ~10 GB of memory.

Before fixed-shape passes, this prompt's mixed-runtime greedy output left plain torch decoding at a near tie
(docs/bench/runtimes/, 2 of 9 prompts)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from speculant import models  # noqa: E402
from speculant.engine import Engine  # noqa: E402

from test_torch_backend import assert_pass_invariant  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPT = ("<|im_start|>user\nWhat is the difference between weather and climate?<|im_end|>\n"
          "<|im_start|>assistant\n")
N_GEN = 32


def _converted() -> bool:
    from speculant.backends.torch import cache_dir_for, cache_problem

    gguf = models.cached_path(TARGET)
    return gguf.exists() and cache_problem(cache_dir_for(gguf), gguf.resolve()) is None


pytestmark = pytest.mark.skipif(not (_converted() and models.cached_path(DRAFT).exists()),
                                reason="Qwen 1.5B torch conversion or the 0.5B draft is not cached")


@pytest.fixture(scope="module")
def qwen():
    from speculant.backends.torch import load_torch_backend

    b = load_torch_backend(TARGET, threads=2)
    yield b
    b.close()


def test_pass_invariance_qwen(qwen):
    ids = qwen.tokenize(PROMPT * 20)  # ~340 tokens: the blocks below cross the 256-position KV block
    assert len(ids) > 256 + 40
    assert_pass_invariant(qwen, ids[:300], sizes=(5, 33), offsets=(0, 2))


def test_mixed_runtime_greedy_identity_qwen(qwen):
    from speculant.api import load_backend
    from speculant.drafters.model import ModelDrafter

    plain = Engine(qwen).generate(PROMPT, max_tokens=N_GEN)
    draft = load_backend(DRAFT, n_ctx=1024, threads=2, role="draft")
    try:
        spec = Engine(qwen, ModelDrafter(draft, qwen.n_vocab), draft_max=4).generate(PROMPT, max_tokens=N_GEN)
    finally:
        draft.close()
    assert spec.stats.drafted > 0 and spec.stats.accepted > 0
    assert spec.tokens == plain.tokens, (qwen.detokenize(plain.tokens), qwen.detokenize(spec.tokens))


def test_fill_in_the_middle_tokens_are_llama_cpps(qwen):
    """The torch backend finds the FIM tokens by their texts; llama.cpp reads them from the GGUF."""
    from speculant.api import load_backend

    ref = load_backend(TARGET, n_ctx=256, threads=2)
    try:
        assert qwen.fim_tokens() == ref.fim_tokens() is not None
        assert qwen.fim_repo_tokens() == ref.fim_repo_tokens() is not None
    finally:
        ref.close()
