"""The torch backend against the llama.cpp backend on the same GGUF (smollm2-135m-instruct Q4_1).

Tolerance: transformers dequantizes the Q4_1 weights and computes in bf16; llama.cpp computes with its
quantized dot-product kernels (activations quantized to Q8_1). The logits cannot be equal; measured on a
13-token prompt: top-1 agreement 100%, max |diff| 1.2 on logits of magnitude ~28 (4.3% of max |logit|).
Asserted: top-1 agreement >= 90% and max |diff| <= 10% of max |logit|; and the same greedy tokens for a
short generation. Also: tokenizer, token bytes and vocabulary agree exactly (check_compatible passes both
ways), batched logits are bit-identical to one-token passes (fixed-shape passes), and mixed runtimes
(torch target + llama.cpp draft, and the reverse) are token-for-token the target alone."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)  # shared CI cores: oversubscribed torch threads are far slower

from speculant import models  # noqa: E402
from speculant.engine import Engine  # noqa: E402
from speculant.vocab import check_compatible  # noqa: E402

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is Paris. The capital of Germany is"
N_GEN = 10

pytestmark = pytest.mark.skipif(not models.cached_path(MODEL).exists(), reason=f"{MODEL} is not pulled")


@pytest.fixture(scope="module")
def tb():
    from speculant.backends.torch import load_torch_backend

    b = load_torch_backend(MODEL)
    yield b
    b.close()


@pytest.fixture(scope="module")
def lb():
    from speculant.api import load_backend

    b = load_backend(MODEL, n_ctx=512, threads=1)
    yield b
    b.close()


@pytest.fixture(scope="module")
def lb_draft():
    from speculant.api import load_backend

    b = load_backend(MODEL, n_ctx=512, threads=1, role="draft")
    yield b
    b.close()


def test_vocab_and_text_match(tb, lb):
    ti, li = tb.vocab_info(), lb.vocab_info()
    check_compatible(ti, li, "torch", "llama.cpp")
    check_compatible(li, ti, "llama.cpp", "torch")
    assert ti.special_ids == li.special_ids
    assert all(tb.token_bytes(t) == lb.token_bytes(t) for t in range(lb.n_vocab))
    assert all(tb.is_eog(t) == lb.is_eog(t) for t in range(lb.n_vocab))
    for text in (PROMPT, "def f(x):\n    return x  # ünïcode 日本", "<|im_start|>user\nhi<|im_end|>\n"):
        for add_special in (True, False):
            assert tb.tokenize(text, add_special) == lb.tokenize(text, add_special)
    assert tb.chat_template() == lb.chat_template()
    assert (tb.bos_token, tb.eos_token) == (lb.bos_token, lb.eos_token)


def test_logits_match_llamacpp(tb, lb):
    ids = lb.tokenize(PROMPT)
    tb.rewind(0)
    lb.rewind(0)
    t = tb.eval(ids, n_logits=len(ids))
    ref = lb.eval(ids, n_logits=len(ids))
    assert t.shape == ref.shape == (len(ids), lb.n_vocab) and t.dtype == np.float32
    agree = (t.argmax(-1) == ref.argmax(-1)).mean()
    rel = np.abs(t - ref).max() / np.abs(ref).max()
    assert agree >= 0.9, agree
    assert rel <= 0.10, rel


def assert_pass_invariant(backend, ids, sizes=(2, 5, 8, 40), offsets=(0, 3)):
    """Logits of a token are bit-identical however the passes are cut: one-token passes vs a block of n tokens
    starting at several offsets (40 spans two 32-row chunks; long contexts cross a 256-position KV block)."""
    backend.rewind(0)
    backend.eval(ids[:-max(sizes) - max(offsets)], n_logits=0)
    base = len(backend.tokens)
    single = np.stack([backend.eval([x])[0] for x in ids[base:]])  # single[i]: logits after ids[base + i]
    for n in sizes:
        for off in offsets:
            at = len(ids) - n - off
            backend.rewind(at)
            batch = backend.eval(ids[at:at + n], n_logits=n)
            assert np.array_equal(batch, single[at - base:at - base + n]), (n, off, np.abs(batch - single[at - base:at - base + n]).max())


def test_pass_invariance(tb):
    """Bit-identical logits whatever the pass size or position (fixed-shape passes, any dtype)."""
    assert_pass_invariant(tb, [100 + (7 * i) % 300 for i in range(300)])


@pytest.fixture(scope="module")
def plain(tb, lb):
    return (Engine(tb).generate(PROMPT, max_tokens=N_GEN).tokens,
            Engine(lb).generate(PROMPT, max_tokens=N_GEN).tokens)


def test_same_greedy_tokens(plain):
    torch_tokens, llama_tokens = plain
    assert torch_tokens == llama_tokens


def test_mixed_runtimes_greedy_identity(tb, lb, lb_draft, plain):
    from speculant.drafters.model import ModelDrafter
    from speculant.drafters.selfspec import LayerSubsetBackend

    # torch target, llama.cpp draft
    check_compatible(tb.vocab_info(), lb_draft.vocab_info())
    r = Engine(tb, ModelDrafter(lb_draft, tb.n_vocab), draft_max=3).generate(PROMPT, max_tokens=N_GEN)
    assert r.tokens == plain[0] and r.stats.drafted > 0
    # llama.cpp target, torch draft (the torch model's first 15 layers: a cheaper, different model)
    draft = LayerSubsetBackend(tb, list(range(15)))
    r = Engine(lb, ModelDrafter(draft, lb.n_vocab), draft_max=3).generate(PROMPT, max_tokens=N_GEN)
    assert r.tokens == plain[1] and r.stats.drafted > 0


def test_fill_in_the_middle_tokens_agree_with_llama_cpp(tb, lb):
    """SmolLM2 has none by llama.cpp's reading of its GGUF; the torch backend, which looks them up by text,
    must not find some either (a suffix is then refused on both runtimes alike)."""
    assert tb.fim_tokens() == lb.fim_tokens()
    assert tb.fim_repo_tokens() == lb.fim_repo_tokens()


def test_training_context_cap_is_warned_about_as_on_llama_cpp(tb, capsys):
    """-c above the training context: the same warning as the llama.cpp backend's, then the training context."""
    from speculant.backends.torch import TorchBackend

    capped = TorchBackend(tb.model, tb.tokenizer, name=tb.name, n_ctx=100000, specials=tb.specials)
    assert capped.n_ctx == 8192
    assert (f"speculant: warning: --ctx-size 100000 is more than {tb.name}'s training context (8192 tokens); "
            f"using 8192") in capsys.readouterr().err
    TorchBackend(tb.model, tb.tokenizer, name=tb.name, n_ctx=0, specials=tb.specials)
    assert "warning" not in capsys.readouterr().err  # 0: the training context, nothing to say


def test_threads_of_a_torch_target_stay_when_the_draft_is_on_torch_too(capsys):
    """torch's thread count is one per process: the draft (loaded last) must not replace the target's -t."""
    from speculant.api import load_engine
    from speculant.backends.torch import TorchBackend

    try:
        engine = load_engine(MODEL, MODEL, backend="torch", draft_backend="torch", device="cpu", threads=1,
                             draft_threads=2, lookup=False, n_ctx=512)
        try:
            assert isinstance(engine.target, TorchBackend) and isinstance(engine.drafter.backend, TorchBackend)
            assert torch.get_num_threads() == 1
        finally:
            engine.close()
        assert ("speculant: warning: --threads-draft 2 has no effect when the target and the draft both run on "
                "torch") in capsys.readouterr().err
    finally:
        torch.set_num_threads(1)


def test_python_generate_reaches_the_torch_backend(plain):
    """speculant.generate takes the CLI's --backend, --device, --dtype, --backend-draft and --self-spec-exit."""
    import speculant
    from speculant.errors import SettingsError

    r = speculant.generate(PROMPT, model=MODEL, backend="torch", device="cpu", threads=1, max_tokens=N_GEN)
    assert r.tokens == plain[0]
    r = speculant.generate(PROMPT, model=MODEL, backend="torch", device="cpu", threads=1, max_tokens=N_GEN,
                           self_spec_exit=15, lookup=False, adaptive=False)
    assert r.tokens == plain[0] and r.stats.drafted > 0
    # a torch draft under the llama.cpp target: the draft takes the device
    r = speculant.generate(PROMPT, model=MODEL, draft_model=MODEL, draft_backend="torch", device="cpu",
                           threads=1, max_tokens=N_GEN, lookup=False, adaptive=False)
    assert r.tokens == plain[1] and r.stats.drafted > 0
    with pytest.raises(SettingsError, match="--dtype and --device apply to the torch backend only"):
        speculant.generate(PROMPT, model=MODEL, dtype="fp32", threads=1, max_tokens=2)


def test_a_sliding_window_past_the_training_context_is_not_refused(tmp_path):
    """check_gguf_supported refuses sliding-window models (the torch backend's attention is full) from the GGUF's
    metadata, but a window at least as long as the training context limits nothing (Phi-3 128k files carry one of
    262144): such a model runs."""
    from gguf import GGUFWriter

    from speculant.backends.torch import check_gguf_supported
    from speculant.errors import ModelError

    def gguf(name, window):
        path = tmp_path / f"{name}.gguf"
        writer = GGUFWriter(str(path), "llama")
        writer.add_context_length(4096)
        if window is not None:
            writer.add_uint32("llama.attention.sliding_window", window)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    check_gguf_supported(gguf("full", None))
    check_gguf_supported(gguf("long-window", 262144))
    check_gguf_supported(gguf("window-equal", 4096))
    with pytest.raises(ModelError, match="sliding-window attention layers \\(window 512\\)"):
        check_gguf_supported(gguf("short-window", 512))
