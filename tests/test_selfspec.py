"""Self-speculative drafting on the torch backend: greedy identity, everything accepted when the draft runs
all layers, the first-token distribution through the engine, calibration. A tiny randomly initialised
Llama (vocab 16, 4 layers) keeps it fast; one short greedy check runs on smollm2 when it is cached."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torch.set_num_threads(1)  # shared CI cores: oversubscribed torch threads are 100x slower on tiny models
pytest.importorskip("transformers")

from scipy import stats as sps  # noqa: E402

from speculant.engine import Engine  # noqa: E402
from speculant.errors import SettingsError  # noqa: E402
from speculant.verify import SamplingParams, probs_from_logits  # noqa: E402

V = 16
PROMPT = [1, 5, 3, 7]


def tiny_backend(seed=0, n_layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculant.backends.torch import TorchBackend, default_dtype

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper logits than the default init, so greedy paths are not all one token
        model.lm_head.weight.mul_(40.0)
    model = model.to(default_dtype("cpu"))
    return TorchBackend(model, None, name=f"tiny-{seed}", n_ctx=512)


@pytest.fixture(scope="module")
def tiny():
    return tiny_backend()


def test_layer_sets():
    from speculant.drafters.selfspec import normalize_layers

    assert normalize_layers(6, exit_layer=2) == [0, 1]
    assert normalize_layers(6, skip=[2, 4]) == [0, 1, 3, 5]
    for bad in (dict(exit_layer=0), dict(exit_layer=7), dict(skip=[0]), dict(skip=[6]), dict(exit_layer=2, skip=[3])):
        with pytest.raises(SettingsError):
            normalize_layers(6, **bad)


@pytest.mark.parametrize("draft, message", [
    (dict(exit_layer=6), "--self-spec-exit must be in [1, 5] for a model of 6 layers"),
    (dict(skip=[]), "skips no layer"),
    (dict(), "skips no layer"),
])
def test_a_draft_of_every_layer_is_refused(draft, message):
    """Every layer drafting is the target itself: a target pass per drafted token, nothing saved."""
    from speculant.drafters.selfspec import normalize_layers

    with pytest.raises(SettingsError) as e:
        normalize_layers(6, **draft)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("draft", [dict(exit_layer=1), dict(exit_layer=2), dict(skip=[1, 2])])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_identity(tiny, draft, k):
    from speculant.drafters.selfspec import SelfSpecDrafter

    plain = Engine(tiny).generate(PROMPT, max_tokens=40)
    spec = Engine(tiny, SelfSpecDrafter(tiny, **draft), draft_max=k).generate(PROMPT, max_tokens=40)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0
    assert len(set(plain.tokens)) > 1  # a meaningful sequence, not one repeated token


@pytest.mark.parametrize("k", [2, 5])
def test_all_layers_accepts_everything(tiny, k):
    from speculant.drafters.selfspec import SelfSpecDrafter

    d = SelfSpecDrafter(tiny, list(range(tiny.n_layers)))  # a layer list is taken as it is (--self-spec-exit refuses this)
    r = Engine(tiny, d, draft_max=k).generate(PROMPT, max_tokens=24)
    assert r.stats.acceptance_rate == 1.0
    assert r.stats.target_calls == -(-24 // (k + 1))


def test_weights_are_shared(tiny):
    from speculant.drafters.selfspec import SelfSpecDrafter

    d = SelfSpecDrafter(tiny, exit_layer=2)
    base = tiny.model.model
    assert d.backend.target is tiny and len(base.layers) == tiny.n_layers  # layers restored after a pass
    d.propose(PROMPT, 3, SamplingParams(), np.random.default_rng(0))
    assert len(base.layers) == tiny.n_layers and base.config.num_hidden_layers == tiny.n_layers
    # the draft's cache only holds the draft's layers
    assert sorted(d.backend.cache.keys) == [0, 1]


def test_kv_shared_with_target(tiny):
    """Layers before the first skipped one use the target's KV entries: an early-exit draft never prefills or
    catches up (every draft pass is one token), and a draft evaluating another context invalidates just the
    part of the target's cache it overwrote (the target's logits stay those of a fresh model)."""
    from speculant.drafters.selfspec import SelfSpecDrafter

    d = SelfSpecDrafter(tiny, exit_layer=2)
    assert d.backend.n_shared == 2 and d.backend.early_exit
    calls = []
    forward = tiny.forward

    def spy(tokens, start, n_logits, cache, layers=None):
        calls.append((cache is d.backend.cache, len(tokens)))
        return forward(tokens, start, n_logits, cache, layers)

    tiny.forward = spy
    try:
        plain = Engine(tiny).generate(PROMPT, max_tokens=24).tokens
        r = Engine(tiny, d, draft_max=3).generate(PROMPT, max_tokens=24)
    finally:
        del tiny.forward
    assert r.tokens == plain and r.stats.drafted > 0
    assert not d.backend.cache.own.keys  # no layers of its own
    assert {n for is_draft, n in calls if is_draft and n} == {1}  # (an empty call is the no-op prefill)
    skip = SelfSpecDrafter(tiny, skip=[2])
    assert skip.backend.n_shared == 2 and not skip.backend.early_exit

    tiny.rewind(0)
    ref = tiny.sync(PROMPT + [2, 4, 6], n_logits=3).copy()
    for draft in (d, skip):
        tiny.rewind(0)
        tiny.sync(PROMPT + [2, 4, 6], n_logits=3)
        draft.backend.sync(PROMPT[:2] + [9, 9, 9])  # diverges at position 2: overwrites shared entries there
        assert len(tiny.tokens) == 2
        assert np.array_equal(tiny.sync(PROMPT + [2, 4, 6], n_logits=3), ref)


def test_first_token_distribution(tiny):
    """Sampled first tokens through the engine (self-spec drafts, rejection sampling) follow softmax(target)."""
    from speculant.drafters.selfspec import SelfSpecDrafter

    params = SamplingParams(temperature=1.0, seed=123)
    tiny.rewind(0)
    expected = probs_from_logits(tiny.sync(PROMPT)[0], params)
    engine = Engine(tiny, SelfSpecDrafter(tiny, exit_layer=1), draft_max=2)
    n = 4000
    counts = np.zeros(V)
    rng_seeds = np.random.default_rng(7).integers(0, 2**31, n)
    for s in rng_seeds:
        r = engine.generate(PROMPT, max_tokens=1, params=SamplingParams(temperature=1.0, seed=int(s)))
        counts[r.tokens[0]] += 1
    mask = expected * n >= 5
    obs = np.append(counts[mask], counts[~mask].sum())
    exp = np.append(expected[mask] * n, expected[~mask].sum() * n)
    keep = exp > 0
    chi2, p = sps.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum())
    assert p > 1e-3, (chi2, p, counts, expected)


def test_calibrate_tiny(tiny, tmp_path, monkeypatch):
    from speculant import calibrate
    from speculant.drafters.selfspec import SelfSpecDrafter

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    cfg = calibrate.calibrate(tiny, prompts=[PROMPT, [2, 9, 4]], max_tokens=8, draft_max=3)
    layers = cfg["layers"]
    assert layers and layers[0] == 0 and layers == sorted(set(layers)) and layers[-1] < tiny.n_layers
    assert len(layers) < tiny.n_layers and cfg["n_layers"] == tiny.n_layers
    path = calibrate.save_config(tiny, cfg)
    assert path.parent == tmp_path / "selfspec" and path.exists()
    d = SelfSpecDrafter.from_config(tiny)
    assert d.layers == layers
    r = Engine(tiny, d, draft_max=3).generate(PROMPT, max_tokens=12)
    assert r.tokens == Engine(tiny).generate(PROMPT, max_tokens=12).tokens



def test_calibrate_refuses_to_choose_when_nothing_was_drafted(tiny):
    """One token per prompt leaves nothing to draft: no subset may be saved as beating plain decoding."""
    from speculant import calibrate
    from speculant.errors import SpeculantError

    with pytest.raises(SpeculantError, match="no layer subset had a drafted token accepted"):
        calibrate.calibrate(tiny, prompts=[PROMPT], max_tokens=1, draft_max=3)


@pytest.mark.parametrize("flags, message", [
    (["-n", "1"], "-n must be >= 2"),
    (["--draft-max", "100"], "--draft-max must be in [1, 63], got 100"),
    (["-t", "513"], "--threads must be 1..512, got 513"),
    (["-c", "-5"], "--ctx-size must be 0 (the model's training context) or an integer >= 16, got -5"),
    (["-c", "8"], "--ctx-size must be 0 (the model's training context) or an integer >= 16, got 8"),
])
def test_calibrate_flags_are_checked_before_the_model_loads(flags, message, capsys, monkeypatch):
    import speculant.backends.torch as torch_backends

    def load(*a, **kw):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(torch_backends, "load_torch_backend", load)
    from speculant.cli import main

    assert main(["calibrate", "-m", "no-such-model", *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_torch_backend_refuses_a_bad_thread_count():
    from speculant.backends.torch import load_torch_backend

    with pytest.raises(SettingsError, match="--threads must be 1..512, got -1"):
        load_torch_backend("no-such-model", threads=-1)


@pytest.mark.parametrize("text", ['{"n_layers": 4, "layers": [0,1,2', '[0, 1]', '{"n_layers": 4, "layers": ["a"]}',
                                  '{"n_layers": 4, "layers": [1, 2]}'])
def test_a_corrupt_calibration_names_its_file(tiny, tmp_path, monkeypatch, text):
    from speculant import calibrate
    from speculant.api import load_drafter
    from speculant.drafters.selfspec import SelfSpecDrafter

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    path = calibrate.config_paths(tiny)[-1]
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(SettingsError, match="rerun `speculant calibrate` or delete it") as e:
        SelfSpecDrafter.from_config(tiny)
    assert str(path) in str(e.value)
    with pytest.raises(SettingsError, match="self-spec calibration"):
        load_drafter(tiny, None, self_spec=True)


def test_self_spec_reads_a_named_calibration(tiny, tmp_path):
    """`calibrate -o FILE` writes a calibration that load_drafter / load_engine read with self_spec_config."""
    import json

    from speculant.api import load_drafter
    from speculant.drafters.selfspec import SelfSpecDrafter

    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"n_layers": tiny.n_layers, "layers": [0, 1, 3]}))
    d = load_drafter(tiny, None, self_spec_config=mine, lookup=False)
    assert isinstance(d, SelfSpecDrafter) and d.layers == [0, 1, 3]
    d.close()
    with pytest.raises(SettingsError, match="does not exist"):
        load_drafter(tiny, None, self_spec_config=tmp_path / "missing.json")
    with pytest.raises(SettingsError, match="not both"):
        load_drafter(tiny, None, self_spec_config=mine, self_spec_exit=2)
    mine.write_text(json.dumps({"n_layers": 6, "layers": [0, 1]}))
    with pytest.raises(SettingsError, match="is for a model of 6 layers"):
        load_drafter(tiny, None, self_spec_config=mine)


def test_a_calibration_of_every_layer_is_refused(tiny, tmp_path):
    import json

    from speculant.api import load_drafter

    every = tmp_path / "every.json"
    every.write_text(json.dumps({"n_layers": tiny.n_layers, "layers": list(range(tiny.n_layers))}))
    with pytest.raises(SettingsError, match="lists all 4 layers, so the draft would be the whole target") as e:
        load_drafter(tiny, None, self_spec_config=every)
    assert "\n" not in str(e.value)


def test_a_calibration_of_another_model_is_warned_about(tiny, tmp_path, capsys):
    """Same layer count, another model: used, with a warning naming both; none for this model's own file
    (recorded by name or by path) or for a file without `model`."""
    import json

    from speculant.drafters.selfspec import SelfSpecDrafter

    path = tmp_path / "cal.json"
    for model, warned in (("other-model.gguf", True), (tiny.name, False), (f"/somewhere/{tiny.name}", False),
                          (None, False)):
        cfg = {"n_layers": tiny.n_layers, "layers": [0, 1]}
        if model is not None:
            cfg["model"] = model
        path.write_text(json.dumps(cfg))
        d = SelfSpecDrafter.from_config(tiny, path)
        assert d.layers == [0, 1]
        d.close()
        err = capsys.readouterr().err
        if warned:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("speculant: warning: "), err
            assert "other-model.gguf" in err and tiny.name in err and str(path) in err
        else:
            assert err == "", err


def test_smollm2_greedy_identity():
    from speculant import models

    if not models.cached_path("smollm2-135m-instruct").exists():
        pytest.skip("smollm2-135m-instruct is not pulled")
    from speculant.backends.torch import load_torch_backend
    from speculant.drafters.selfspec import SelfSpecDrafter

    t = load_torch_backend("smollm2-135m-instruct")
    prompt = "def add(a, b):\n"
    plain = Engine(t).generate(prompt, max_tokens=12)
    spec = Engine(t, SelfSpecDrafter(t, exit_layer=20), draft_max=3).generate(prompt, max_tokens=12)
    assert spec.tokens == plain.tokens and spec.stats.drafted > 0


def test_generate_reads_the_calibration_named_by_self_spec_config(tmp_path):
    """`calibrate -o FILE` then `generate --self-spec-config FILE`: those layers draft, and the output is plain
    decoding's."""
    import json
    import subprocess
    import sys

    from speculant import models

    if not models.cached_path("smollm2-135m-instruct").exists():
        pytest.skip("smollm2-135m-instruct is not pulled")
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"n_layers": 30, "layers": list(range(24))}))
    base = [sys.executable, "-m", "speculant", "generate", "-m", "smollm2-135m-instruct", "--backend", "torch",
            "--device", "cpu", "-t", "1", "-p", "def add(a, b):", "-n", "12", "--json"]
    runs = [subprocess.run(base + extra, capture_output=True, text=True, timeout=240)
            for extra in ([], ["--self-spec-config", str(mine), "--no-lookup"])]
    for r in runs:
        assert r.returncode == 0, r.stderr
    plain, spec = (json.loads(r.stdout) for r in runs)
    assert spec["tokens"] == plain["tokens"] and spec["stats"]["drafted"] > 0
    mine.write_text(json.dumps({"n_layers": 12, "layers": [0, 1]}))  # read, and refused: not this model's
    r = subprocess.run(base + ["--self-spec-config", str(mine)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 1 and "is for a model of 12 layers" in r.stderr and "Traceback" not in r.stderr
