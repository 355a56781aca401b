"""StaticTorchBackend (static KV, fixed-shape passes, CUDA graphs on CUDA) on tiny random Qwen2 models.

On CPU the graphs are off and the same fixed-shape code runs eagerly; the CUDA tests run only where a GPU is
visible (scripts/gpu_bench.sh runs the same checks at real shapes); SPECULANT_TEST_DEVICE=cuda runs the
speculative runs there too."""

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
torch.set_num_threads(1)
DEVICE = os.environ.get("SPECULANT_TEST_DEVICE", "cpu")

from speculant.backends.torch_static import SHAPE_CLASSES, shape_class  # noqa: E402
from speculant.engine import Engine  # noqa: E402
from speculant.errors import SettingsError  # noqa: E402
from speculant.shapes import random_backend  # noqa: E402

IDS = [(37 * i + 11) % 500 for i in range(300)]  # 300 tokens: passes near the end cross the 256-position KV block
PROMPT = IDS[:20]


def one_at_a_time(backend, ids, base):
    """Logits after each of ids[base:], decoded alone after a prefill of ids[:base]."""
    backend.rewind(0)
    backend.eval(ids[:base], n_logits=0)
    return np.stack([backend.eval([x])[0] for x in ids[base:]])


def check_invariant(backend, ids, sizes, offsets=(0, 3)):
    base = len(ids) - max(sizes) - max(offsets)
    single = one_at_a_time(backend, ids, base)
    for n in sizes:
        for off in offsets:
            at = len(ids) - n - off
            backend.rewind(at)
            backend.eval(ids[len(backend.tokens):at], n_logits=0)  # a shorter earlier pass may have cut it
            batch = backend.eval(ids[at:at + n], n_logits=n)
            ref = single[at - base:at - base + n]
            assert np.array_equal(batch, ref), (n, off, np.abs(batch - ref).max())


def test_shape_classes():
    assert [shape_class(n) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]


@pytest.mark.parametrize("rows", [8, 16])
def test_fixed_rows_bit_identical_in_every_pass_size(rows):
    """A token's logits are the same bits whether decoded alone or in a verify pass of any size (every shape
    class up to 64 and past it, chunked), at offsets crossing a KV block."""
    b = random_backend("tiny", rows=rows, seed=1)
    check_invariant(b, IDS, sizes=sorted(set(SHAPE_CLASSES) | {3, 5, rows + 1, 2 * rows + 3}))


def test_shape_classes_match_fixed_rows_closely():
    """The draft's shape-class passes compute the same function (rounding aside) as fixed-width passes."""
    fixed, classes = random_backend("tiny", rows=16, seed=2), random_backend("tiny", seed=2)
    for n in (1, 3, 7, 20, 70):
        fixed.rewind(0), classes.rewind(0)
        a, b = fixed.eval(IDS[:n], n_logits=n), classes.eval(IDS[:n], n_logits=n)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_logits_equal_existing_torch_backend():
    """Same weights: the static backend's forward (own code, static KV) matches TorchBackend (transformers'
    modules, growing cache) at 32 rows, the existing backend's pass width."""
    static, dynamic = random_backend("tiny", rows=32, seed=3), random_backend("tiny", static=False, seed=3)
    a, b = static.eval(IDS[:70], n_logits=70), dynamic.eval(IDS[:70], n_logits=70)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert (a.argmax(-1) == b.argmax(-1)).all()


@pytest.mark.parametrize("draft_shape", ["tiny", "tiny-draft"])
def test_speculative_greedy_equals_plain(draft_shape):
    """Static target + static draft (shape classes): the speculative output is the target's plain output token
    for token (on CPU also the first backend's); the same-weights draft accepts, so rewinds are exercised."""
    from speculant.drafters.model import ModelDrafter

    target = random_backend("tiny", rows=16, seed=4, std=0.2, device=DEVICE)
    plain = Engine(target).generate(PROMPT, max_tokens=40)
    if DEVICE == "cpu":  # float32: the first backend decodes the same tokens (bf16 on a GPU rounds otherwise)
        first = random_backend("tiny", static=False, seed=4, std=0.2)
        assert Engine(first).generate(PROMPT, max_tokens=40).tokens == plain.tokens
    draft = random_backend(draft_shape, seed=4 if draft_shape == "tiny" else 5, std=0.2, device=DEVICE)
    r = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=5).generate(PROMPT, max_tokens=40)
    assert r.tokens == plain.tokens
    assert r.stats.drafted > 0
    if draft_shape == "tiny":
        assert r.stats.accepted > r.stats.drafted // 2


def test_a_fixed_width_target_prices_its_passes_by_construction_and_drafts_longer():
    """A static target's passes up to its width cost the same (ceil(n / rows) passes of one shape): its cost
    profile says so, so the adaptive policy's default bound on k is 8 (engine.default_draft_max) and long free
    drafts 32; a draft in shape classes has no such profile."""
    from speculant.drafters.model import ModelDrafter
    from speculant.engine import DRAFT_MAX_FLAT, LONG_MAX_CHEAP

    target = random_backend("tiny", rows=16, seed=4)
    profile = target.cost_profile()
    assert profile[1] == profile[16] == 1.0 and profile[17] == profile[32] == 2.0 and profile[64] == 4.0
    draft = random_backend("tiny", seed=4)
    assert draft.cost_profile() is None
    engine = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=None, adaptive=True)
    assert engine.draft_max == DRAFT_MAX_FLAT and engine.long_max == LONG_MAX_CHEAP
    assert Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=3, adaptive=True).draft_max == 3


@pytest.mark.parametrize("rows", [16, None])
def test_the_triton_kernels_compute_what_torch_does(rows):
    """kernels='triton' (here in Triton's interpreter) gives the torch kernels' logits, rounding aside, for a
    target's fixed rows and a draft's shape classes, across a KV block."""
    kernel = random_backend("tiny", rows=rows, seed=2, kernels="triton")
    plain = random_backend("tiny", rows=rows, seed=2, kernels="torch")
    for n in (1, 20):
        kernel.rewind(0), plain.rewind(0)
        np.testing.assert_allclose(kernel.eval(IDS[:n], n_logits=n), plain.eval(IDS[:n], n_logits=n),
                                   atol=1e-5, rtol=1e-5)
    # a pass across the 256-position KV block over the same cached context (the interpreter is slow: torch's
    # kernels fill the cache, then each pass runs both ways)
    plain.rewind(0)
    plain.eval(IDS[:250], n_logits=0)
    passes = {}
    for kernels in ("torch", "triton"):
        plain.rewind(250)
        plain.kernels = kernels
        passes[kernels] = plain.eval(IDS[250:270], n_logits=20)
    np.testing.assert_allclose(passes["triton"], passes["torch"], atol=1e-5, rtol=1e-5)


def test_bad_settings_are_clear_errors(monkeypatch):
    with pytest.raises(SettingsError, match="rows"):
        random_backend("tiny", rows=65)
    with pytest.raises(SettingsError, match="kernels must be"):
        random_backend("tiny", rows=16, kernels="flash")
    for rows in (16, None):
        assert random_backend("tiny", rows=rows, device=DEVICE).kernels == ("triton" if DEVICE == "cuda" else "torch")
    if DEVICE == "cpu":
        from speculant.backends import triton_kernels

        monkeypatch.setattr(triton_kernels, "interpreted", lambda: False)
        with pytest.raises(SettingsError, match="interpreter"):
            random_backend("tiny", rows=16, kernels="triton")
    if not torch.cuda.is_available():
        with pytest.raises(SettingsError, match="CUDA graphs need a CUDA device"):
            random_backend("tiny", graphs=True)
    with pytest.raises(SettingsError, match="unknown shape"):
        random_backend("qwen9-1t")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@cuda
@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_cuda_graphs_bit_identical_to_eager_and_invariant(kernels):
    eager = random_backend("tiny", rows=16, graphs=False, device="cuda", seed=6, kernels=kernels)
    graphs = random_backend("tiny", rows=16, graphs=True, device="cuda", seed=6, kernels=kernels)
    a, b = eager.eval(IDS[:100], n_logits=100), graphs.eval(IDS[:100], n_logits=100)
    assert np.array_equal(a, b)
    check_invariant(graphs, IDS, sizes=(1, 2, 5, 8, 16, 17, 40))
    if kernels == "triton":  # around the first SPLIT positions: rows before them are in passes of both kinds
        from speculant.backends.triton_kernels import SPLIT

        long_ids = [(37 * i + 11) % 500 for i in range(SPLIT + 20)]
        check_invariant(graphs, long_ids, sizes=(1, 2, 5, 16, 17, 33))


def test_sampled_generation_verifies_on_the_device():
    """T > 0 with a static target goes through verify_step (verify_torch); a seed reproduces the output, and a
    same-weights draft is mostly accepted (p == q accepts always, up to rounding)."""
    from speculant.drafters.model import ModelDrafter
    from speculant.verify import SamplingParams

    target = random_backend("tiny", rows=16, seed=4, std=0.2, device=DEVICE)
    draft = random_backend("tiny", seed=4, std=0.2, device=DEVICE)
    engine = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=4)
    runs = [engine.generate(PROMPT, max_tokens=30, params=SamplingParams(0.8, seed=s)) for s in (1, 1, 2)]
    assert runs[0].tokens == runs[1].tokens != runs[2].tokens
    assert runs[0].stats.accepted >= 0.9 * runs[0].stats.drafted > 0


def test_a_seeded_output_on_the_device_is_plain_decodings():
    """Coupled draws on the device (verify_torch.verify_coupled, and a static draft's draft_steps with the same
    noise): a seeded sampled output is plain decoding's, drafting or not, and a same-weights draft is accepted."""
    from speculant.drafters.model import ModelDrafter
    from speculant.verify import SamplingParams

    from synthetic import near_copy

    target = random_backend("tiny", rows=16, seed=4, std=0.5, device=DEVICE)
    for seed in (1, 2, 3):
        params = SamplingParams(1.0, seed=seed)
        plain = Engine(target).generate(PROMPT, max_tokens=24, params=params)
        for draft, least in ((random_backend("tiny", seed=4, std=0.5, device=DEVICE), 0.9),
                             (near_copy(std=0.5, noise=0.05, device=DEVICE), 0.0)):
            draft_rows = _host_logit_rows(draft)
            out = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=4).generate(
                PROMPT, max_tokens=24, params=params)
            assert out.tokens == plain.tokens and out.stats.accepted > least * out.stats.drafted
            assert not any(draft_rows)  # it drafted on its device: no logits came to the host


def _host_logit_rows(backend):
    """Count the draft's passes that bring logits to the host (what draft_steps is there to avoid)."""
    calls = []
    decode = backend._decode

    def counted(tokens, start, n_logits):
        calls.append(n_logits)
        return decode(tokens, start, n_logits)
    backend._decode = counted
    return calls


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_static_draft_chooses_its_tokens_on_the_device(adaptive):
    """ModelDrafter on a static draft runs draft_steps: each step's token is chosen where the logits are and fed
    to the next pass there; no draft logits reach the host. Greedy output is the plain output, and with a fixed
    k (all passes back to back, one transfer) each proposal is the host loop's: same tokens, same passes."""
    from speculant.drafters.model import ModelDrafter
    from speculant.verify import SamplingParams

    target = random_backend("tiny", rows=16, seed=4, std=0.2, device=DEVICE)
    plain = Engine(target).generate(PROMPT, max_tokens=40)
    draft = random_backend("tiny-draft", seed=5, std=0.2, device=DEVICE)
    host_rows = _host_logit_rows(draft)
    engine = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=4, adaptive=adaptive)
    r = engine.generate(PROMPT, max_tokens=40)
    assert r.tokens == plain.tokens and r.stats.drafted > 0
    assert not any(host_rows)  # only prompt prefills (no logits) went through the host path
    if adaptive:
        return
    draft, same = (random_backend("tiny-draft", seed=5, std=0.2, device=DEVICE) for _ in range(2))
    same.draft_steps = None  # the host loop
    on_device, on_host = ModelDrafter(draft, target.n_vocab), ModelDrafter(same, target.n_vocab)
    rng = np.random.default_rng(0)
    for n in (20, 23, 31, 32, 26):  # catch-ups of one and more tokens, a rewind
        a = on_device.propose(IDS[:n], 4, SamplingParams(), rng)
        b = on_host.propose(IDS[:n], 4, SamplingParams(), rng)
        assert draft.tokens == same.tokens
        assert (a.tokens, a.steps, a.keys, a.catchup_tokens) == (b.tokens, b.steps, b.keys, b.catchup_tokens)
        assert len(a.tokens) == 4


def _top4_joint(target, params):
    """P(first two tokens) [V, V] when the static target alone samples with top_k=4 params."""
    from speculant.verify import probs_from_logits

    V = target.n_vocab
    joint = np.zeros((V, V))
    first = probs_from_logits(target.sync(PROMPT)[0], params)
    for t in np.flatnonzero(first):
        joint[t] = first[t] * probs_from_logits(target.sync(PROMPT + [int(t)])[0], params)
    return joint.ravel()


def _device_drafted_counts(target, draft, params, n_runs):
    from speculant.drafters.model import ModelDrafter

    engine = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=2, adaptive=False)
    V = target.n_vocab
    counts = np.zeros(V * V, dtype=np.int64)
    drafted = accepted = 0
    for i in range(n_runs):
        r = engine.generate(PROMPT, max_tokens=3, params=dataclasses.replace(params, seed=params.seed + i))
        counts[r.tokens[0] * V + r.tokens[1]] += 1
        drafted, accepted = drafted + r.stats.drafted, accepted + r.stats.accepted
    return counts, drafted, accepted


N_RUNS = 800


def test_sampled_tokens_drafted_on_the_device_keep_the_target_law():
    """T > 0: the draft samples on its device from q (top-k 4 of another model's logits) and q stays there for
    verify_step; the first two output tokens follow the target's own law (chi-square and TV against the exact
    joint), and the same test fails a draft that proposes its argmax while reporting q."""
    from synthetic import near_copy, pvalue

    from speculant.verify import SamplingParams

    params = SamplingParams(1.0, top_k=4, seed=50_000, coupled=False)  # seeded coupled draws draft on the host
    target = random_backend("tiny", rows=16, seed=4, std=0.5, device=DEVICE)
    draft = near_copy(std=0.5, noise=0.05, device=DEVICE)
    exact = _top4_joint(target, params)
    counts, drafted, accepted = _device_drafted_counts(target, draft, params, N_RUNS)
    assert drafted > N_RUNS and 0.2 * drafted < accepted < 0.9 * drafted  # proposals of both outcomes
    assert pvalue(counts, exact) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - exact).sum() < 0.1
    real_steps = draft.draft_steps

    def argmax_steps(*args, **kwargs):  # a wrong draft: proposes q's argmax, reports q
        for _, confidence, q in real_steps(*args, **kwargs):
            yield int(q.argmax()), confidence, q
    draft.draft_steps = argmax_steps
    wrong, _, _ = _device_drafted_counts(target, draft, params, 300)  # fails at p ~ 1e-73 with 800
    assert pvalue(wrong, exact) < 1e-6


def test_real_weights_same_greedy_as_torch_backend():
    """SmolLM2 (Llama architecture, real weights and tokenizer): the static backend's greedy output is the
    existing backend's, and a speculative run with a llama.cpp draft is token for token the same."""
    from speculant import models
    from speculant.api import load_backend
    from speculant.backends.torch import load_torch_backend
    from speculant.backends.torch_static import load_static_backend
    from speculant.drafters.model import ModelDrafter

    name = "smollm2-135m-instruct"
    if not models.cached_path(name).exists():
        pytest.skip(f"{name} is not pulled")
    prompt = "The capital of France is Paris. The capital of Germany is"
    plain = Engine(load_torch_backend(name, n_ctx=512)).generate(prompt, max_tokens=12)
    static = load_static_backend(name, n_ctx=512, rows=16)
    assert Engine(static).generate(prompt, max_tokens=12).tokens == plain.tokens
    draft = load_backend(name, n_ctx=512, threads=1, role="draft")
    try:
        r = Engine(static, ModelDrafter(draft, static.n_vocab), draft_max=3).generate(prompt, max_tokens=12)
    finally:
        draft.close()
    assert r.tokens == plain.tokens and r.stats.drafted > 0



def test_fused_weights_leave_the_model_unchanged():
    """The static backend fuses q/k/v and gate/up into single matmuls over views: the transformers model it
    wraps still computes what it did (TorchBackend over the same object), with no weight held twice."""
    from speculant.backends.torch import TorchBackend
    from speculant.shapes import random_model

    model = random_model("tiny", seed=7)
    before = TorchBackend(model, name="tiny", n_ctx=512).eval(IDS[:40], n_logits=40)
    n_params = sum(p.numel() for p in model.parameters())
    static = random_backend("tiny", rows=16, seed=7)  # separate weights, same values
    from speculant.backends.torch_static import StaticTorchBackend
    wrapped = StaticTorchBackend(model, name="tiny", n_ctx=512, rows=16)
    after = TorchBackend(model, name="tiny", n_ctx=512).eval(IDS[:40], n_logits=40)
    assert np.array_equal(before, after)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == wrapped._qkv[0][0][attn.q_proj.weight.shape[0]:].data_ptr()
    assert sum(p.numel() for p in model.parameters()) == n_params
    again = StaticTorchBackend(model, name="tiny", n_ctx=512, rows=16)  # a second backend over the same model
    for fused in ("_qkv", "_gate_up"):
        for (w1, b1), (w2, b2) in zip(getattr(wrapped, fused), getattr(again, fused)):
            assert w1.data_ptr() == w2.data_ptr() and w1.shape == w2.shape  # a view, not a copy
            assert (b1 is None) == (b2 is None) and (b1 is None or b1.data_ptr() == b2.data_ptr())
    assert attn.k_proj.weight.data_ptr() == again._qkv[0][0][attn.q_proj.weight.shape[0]:].data_ptr()
    assert np.array_equal(again.eval(IDS[:40], n_logits=40), wrapped.eval(IDS[:40], n_logits=40))
    wrapped.rewind(0)
    np.testing.assert_allclose(wrapped.eval(IDS[:40], n_logits=40), static.eval(IDS[:40], n_logits=40))


def test_the_torch_backend_on_cuda_is_the_static_one(monkeypatch):
    """`--backend torch` on a CUDA device loads StaticTorchBackend: the target at one fixed width, a draft in
    shape classes; CPUs and a self-speculating target keep TorchBackend (it runs layer subsets)."""
    from speculant import api, models
    from speculant.backends.torch import TorchBackend
    from speculant.backends.torch_static import StaticTorchBackend

    assert not api.uses_static_torch("cpu")
    assert api.uses_static_torch("cuda") and api.uses_static_torch("cuda:1")
    assert not api.uses_static_torch("cuda", self_spec=True)
    assert api.uses_static_torch(None) == torch.cuda.is_available()
    name = "smollm2-135m-instruct"
    if not models.cached_path(name).exists():
        pytest.skip(f"{name} is not pulled")
    monkeypatch.setattr(api, "uses_static_torch", lambda device, self_spec=False: not self_spec)  # as on a GPU
    engine = api.load_engine(name, name, backend="torch", draft_backend="torch", device="cpu", n_ctx=256,
                             lookup=False)
    assert type(engine.target) is StaticTorchBackend and engine.target.rows == api.STATIC_TARGET_ROWS
    assert type(engine.drafter.backend) is StaticTorchBackend and engine.drafter.backend.rows is None
    engine = api.load_engine(name, backend="torch", device="cpu", n_ctx=256, self_spec=True)
    assert type(engine.target) is TorchBackend


def test_other_model_types_stay_on_the_eager_backend(monkeypatch, capsys):
    """A model whose layers _run does not compute (Qwen3: q/k norms) is refused by the static backend, and
    load_static_backend (the CUDA path of --backend torch) keeps it on TorchBackend, which runs transformers'
    own layers, with a warning, instead of computing it wrongly."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from speculant.backends import torch as torch_backends
    from speculant.backends.torch import TorchBackend
    from speculant.backends.torch_static import StaticTorchBackend, load_static_backend
    from speculant.errors import ModelError

    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512))
    with pytest.raises(ModelError, match="not 'qwen3'"):
        StaticTorchBackend(model, name="tiny-qwen3")
    monkeypatch.setattr(torch_backends, "load_torch_backend",
                        lambda *a, **k: TorchBackend(model, name="tiny-qwen3", n_ctx=k["n_ctx"]))
    b = load_static_backend("tiny-qwen3", rows=16)
    assert type(b) is TorchBackend
    assert "tiny-qwen3 (qwen3) runs on the eager torch backend" in capsys.readouterr().err
    assert b.eval(IDS[:5], n_logits=1).shape == (1, 512)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_logits_on_the_device_are_an_error_naming_the_model(temperature):
    """A damaged weight makes every logit NaN; verified on the device, a NaN row picked some token silently (the
    host path checks each verify pass's first row): the device verification checks it too."""
    from speculant.backends.torch_static import StaticTorchBackend
    from speculant.drafters.model import ModelDrafter
    from speculant.errors import ModelError
    from speculant.shapes import random_model
    from speculant.verify import SamplingParams

    model = random_model("tiny", seed=4, std=0.2, device=DEVICE)
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")  # the final norm: every position's logits
    target = StaticTorchBackend(model, name="damaged-tiny", rows=16)
    draft = random_backend("tiny", seed=4, std=0.2, device=DEVICE)
    engine = Engine(target, ModelDrafter(draft, target.n_vocab), draft_max=4)
    with pytest.raises(ModelError, match="damaged-tiny computes NaN or infinite logits"):
        engine.generate(PROMPT, max_tokens=8, params=SamplingParams(temperature, seed=1))
