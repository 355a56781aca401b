"""The adaptive policy starts from the pass costs measured on this machine (costprofile.py)."""

import json
import os

import pytest

from speculant import costprofile, models
from speculant.engine import Engine
from speculant.policy import AdaptivePolicy, best_draft_length

from conftest import SMALL


def test_profile_is_relative_and_never_decreasing():
    r = costprofile.from_times({1: 80.0, 2: 100.0, 3: 96.0, 4: 120.0})
    assert r == {1: 1.0, 2: 1.25, 3: 1.25, 4: 1.5}


def test_prior_ratio_interpolates_and_extends():
    pol = AdaptivePolicy(cost_prior={1: 1.0, 2: 1.2, 4: 1.4, 8: 2.2})
    assert pol.prior_ratio(2) == 1.2
    assert pol.prior_ratio(3) == pytest.approx(1.3)
    assert pol.prior_ratio(6) == pytest.approx(1.8)
    assert pol.prior_ratio(10) == pytest.approx(2.2 + 0.2 * 2)  # the last step (0.2 per token) continued
    assert AdaptivePolicy().prior_ratio(5) == 3.0  # no profile: 0.5 of a step per extra token


def test_policy_prices_unmeasured_sizes_from_the_profile():
    cheap = AdaptivePolicy(cost_prior={n: 1.0 + 0.1 * (n - 1) for n in range(1, 17)})
    default = AdaptivePolicy()
    for pol in (cheap, default):
        pol.observe("draft", 0, 0, 0.0, 0.080, 1)  # one plain step timed: T(1) = 80 ms
    assert cheap.target_time(5) == pytest.approx(0.080 * 1.4)
    assert default.target_time(5) == pytest.approx(0.080 * 3.0)
    assert cheap.verify_price(4) == pytest.approx(0.1)
    # acceptance 0.7, a draft step 0.25 of a target step: drafting pays only where verifying is cheap
    assert best_draft_length(0.7, 0.25 * 0.080, cheap.target_time, 1, 8) == 2
    assert best_draft_length(0.7, 0.25 * 0.080, default.target_time, 1, 8) == 0


def test_timed_sizes_scale_the_profile_near_them():
    pol = AdaptivePolicy(cost_prior={1: 1.0, 2: 1.2, 4: 1.4, 8: 2.2})
    pol.observe("draft", 0, 0, 0.0, 0.1, 1)  # T(1) = 0.1
    for _ in range(10):
        pol.observe("draft", 3, 3, 0.0, 0.1 * 1.4 * 0.8, 4)  # T(4) runs at 0.8x the profile now
    assert pol.target_time(4) == pytest.approx(0.112)
    assert pol.target_time(8) == pytest.approx(0.1 * 2.2 * 0.8)  # beyond: the nearest timed size's factor
    assert pol.target_time(2) == pytest.approx(0.1 * 1.2 * (1 - 0.2 / 3))  # between 1 (factor 1) and 4 (0.8)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    monkeypatch.delenv("SPECULANT_COST_PROFILE", raising=False)
    return tmp_path


def _small_backend(home, monkeypatch):
    """The small model on one thread, its cost profiles kept under `home`."""
    from speculant.backends.llamacpp import LlamaCppBackend

    path = models.cached_path(SMALL)
    if not path.exists():
        pytest.skip(f"{SMALL} not pulled")
    monkeypatch.setenv("SPECULANT_HOME", str(home))
    monkeypatch.delenv("SPECULANT_COST_PROFILE", raising=False)
    return LlamaCppBackend(path, n_ctx=512, n_threads=1)


@pytest.mark.models
def test_llamacpp_backend_measures_once_and_caches(tmp_path, monkeypatch, capsys, quiet_cpu):
    b = _small_backend(tmp_path, monkeypatch)  # a machine that has no profile yet (nor other programs running)
    try:
        prof = b.cost_profile()
        assert "measuring" in capsys.readouterr().err
        assert sorted(prof) == costprofile.QUICK_SIZES and prof[1] == 1.0
        assert all(prof[a] <= prof[b] for a, b in zip(costprofile.QUICK_SIZES, costprofile.QUICK_SIZES[1:]))
        stored = json.loads(costprofile.profile_path(b).read_text())
        assert stored["threads"] == 1 and set(stored["measured_ms"]) == {str(n) for n in costprofile.QUICK_SIZES}
        assert b.cost_profile() == prof and "measuring" not in capsys.readouterr().err  # cached now
        policy = Engine(b, _NullDrafter(), draft_max=4, adaptive=True).policy
        assert policy.cost_prior == prof
        assert b.one_pass_seconds() == pytest.approx(stored["measured_ms"]["1"] / 1000) == policy.t1_prior
        # another thread count is another profile (the shape depends on it)
        b.n_threads = 2
        assert costprofile.load(b) is None and b.one_pass_seconds() is None
    finally:
        b.close()


@pytest.mark.models
def test_a_cache_that_cannot_be_written_keeps_the_measured_profile(tmp_path, monkeypatch, capsys, quiet_cpu):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    b = _small_backend(blocker / "home", monkeypatch)  # no directory can be made there
    try:
        prof = b.cost_profile()
        assert "cannot cache the pass costs" in capsys.readouterr().err
        assert sorted(prof) == costprofile.QUICK_SIZES and prof[1] == 1.0
    finally:
        b.close()


def test_profile_can_be_switched_off(home, monkeypatch):
    monkeypatch.setenv("SPECULANT_COST_PROFILE", "0")

    class Fake:
        path = "/nonexistent.gguf"

    assert costprofile.get(Fake()) is None and costprofile.one_pass_seconds(Fake()) is None


class _Model:
    """What keys a cost file: a model file, a thread count."""

    def __init__(self, path, n_threads=2):
        self.path, self.n_threads = str(path), n_threads


def test_prompt_ratio_is_kept_per_pair_and_folded(home):
    draft_file, target_file = home / "draft.gguf", home / "target.gguf"
    draft_file.write_bytes(b"d" * 10)
    target_file.write_bytes(b"t" * 30)
    draft, target = _Model(draft_file), _Model(target_file)
    assert costprofile.prompt_ratio(draft, target) is None
    costprofile.observe_prompt_ratio(draft, target, (1.0, 500), (2.0, 500))  # 2 ms against 4 ms a token
    assert costprofile.prompt_ratio(draft, target) == pytest.approx(0.5)
    costprofile.observe_prompt_ratio(draft, target, (0.6, 500), (2.0, 500))  # 0.3: folded in, not replacing
    assert costprofile.prompt_ratio(draft, target) == pytest.approx(0.5 + costprofile.PROMPT_RATIO_RATE * -0.2)
    folded = costprofile.prompt_ratio(draft, target)
    costprofile.observe_prompt_ratio(draft, target, (0.1, 20), (2.0, 20))  # too short to say
    costprofile.observe_prompt_ratio(draft, target, (1.0, 500), (2.0, 100))  # the target had most of it cached
    assert costprofile.prompt_ratio(draft, target) == pytest.approx(folded)
    assert costprofile.prompt_ratio(target, draft) is None  # the pair, in order
    assert costprofile.prompt_ratio(_Model(draft_file, n_threads=1), target) is None  # another thread count
    assert costprofile.prompt_ratio(_Model(home / "gone.gguf"), target) is None  # no file: no key
    assert costprofile.prompt_ratio(object(), target) is None  # no file at all (a torch checkpoint)
    costprofile.observe_prompt_ratio(object(), target, (1.0, 500), (2.0, 500))  # nothing to keep it by: ignored


def test_prompt_ratio_can_be_switched_off(home, monkeypatch):
    (home / "a.gguf").write_bytes(b"a")
    costprofile.observe_prompt_ratio(_Model(home / "a.gguf"), _Model(home / "a.gguf"), (1.0, 500), (2.0, 500))
    monkeypatch.setenv("SPECULANT_COST_PROFILE", "0")
    assert costprofile.prompt_ratio(_Model(home / "a.gguf"), _Model(home / "a.gguf")) is None


class _NullDrafter:
    paid = True


@pytest.mark.models
def test_a_context_too_short_to_measure_in_leaves_the_policy_unprimed(tmp_path, monkeypatch, capsys):
    """A first run with a small -c on a machine without a profile: nothing measured, nothing cached, and the
    run decodes (the measurement would need DEPTH + 16 positions)."""
    from speculant.backends.llamacpp import LlamaCppBackend
    from speculant.drafters.lookup import LookupDrafter

    path = models.cached_path(SMALL)
    _small_backend(tmp_path, monkeypatch).close()
    b = LlamaCppBackend(path, n_ctx=costprofile.DEPTH + 15, n_threads=1)
    try:
        prompt = b.tokenize("one two three one two three one two")
        spec = Engine(b, LookupDrafter(), adaptive=True).generate(prompt, max_tokens=16)
        plain = Engine(b).generate(prompt, max_tokens=16)
        assert spec.tokens == plain.tokens and "measuring" not in capsys.readouterr().err
        assert not (tmp_path / "costs").exists()
    finally:
        b.close()


# -- cached files that parse but hold values no measurement makes ----------------------------------------------
UNSOUND_PROFILES = [
    {"ratio": {"5": 1.0}, "measured_ms": {"1": 10}},  # no size 1: prior_ratio divided by zero
    {"ratio": {"1": 0, "2": 0}},  # zero ratios: best_draft_length divided by zero
    {"ratio": {"1": 1.0, "2": False}},  # a bool is no number
    {"ratio": {"1": True, "2": True}},
    {"ratio": {"1": 1.0, "2": float("nan")}},  # NaN and negative ratios passed silently and changed the drafting
    {"ratio": {"1": 1.0, "2": -1.0}},
    {"ratio": {"1": 1.0, "2": float("inf")}},
    {"ratio": {"1": 1.0, "2": "1.2"}},  # a string is no number
    {"ratio": {"1": 2.0, "2": 2.5}},  # r(1) is T(1) / T(1)
    {"ratio": {"1": 1.0, "2": 1.5, "3": 1.2}},  # from_times never writes a decreasing profile
    {"ratio": {"0": 1.0, "1": 1.0}},
    {"ratio": {"1": 1.0, "x": 1.5}},
    {"ratio": {"1": 1.0, "2": 1.5}, "measured_ms": {"1": 0}},  # T(1) is what the policy scales by
    {"ratio": {"1": 1.0, "2": 1.5}, "measured_ms": {"1": -5}},
    {"ratio": {"1": 1.0, "2": 1.5}, "measured_ms": {"1": float("nan")}},
    {"ratio": {"1": 1.0, "2": 1.5}, "measured_ms": {"1": True}},
    {"ratio": {"1": 1.0, "2": 1.5}, "measured_ms": [10]},
    {"ratio": {}},
    {"ratio": [1.0, 1.5]},
    # measured on a busy machine (a 2-token pass priced at 5.9 one-token passes): the policy never drafted again
    {"ratio": {"1": 1.0, "2": 5.9, "3": 5.9, "4": 5.9}, "measured_ms": {"1": 33.5, "2": 198.0, "3": 47.0, "4": 51.0}},
    # a quick profile from before the CPU share was checked: perhaps flattened by another program (the one this
    # machine cached while the CI ran: 2 tokens at 1.0 one-token passes, 4 at 1.15, against 1.17 and 1.61)
    {"source": "quick: fastest of 3 rounds at load", "ratio": {"1": 1.0, "2": 1.0, "4": 1.1461},
     "measured_ms": {"1": 38.368, "2": 37.578, "4": 43.975}},
    [],
    None,
]


@pytest.fixture
def quiet_cpu(monkeypatch):
    """Made-up measurements take no time: every round counts as one that had the CPU to itself."""
    monkeypatch.setattr(costprofile, "cpu_share", lambda cpu_s, wall_s, backend: 1.0)


def _fake_target(home):
    """A backend whose profile key is real (a file, a thread count) and whose measurement is made up."""
    model = home / "m.gguf"
    model.write_bytes(b"m" * 100)
    b = _Model(model, n_threads=1)
    b.name = "m.gguf"
    return b


@pytest.mark.parametrize("stored", UNSOUND_PROFILES, ids=lambda v: json.dumps(v)[:60])
def test_an_unsound_cached_profile_is_a_warning_and_measured_again(home, monkeypatch, capsys, quiet_cpu, stored):
    b = _fake_target(home)
    times = {n: 10.0 + 2.0 * (n - 1) for n in costprofile.QUICK_SIZES}
    measured = []
    monkeypatch.setattr(costprofile, "pass_times_ms", lambda backend, ns, depth=0: measured.append(ns) or times)
    path = costprofile.profile_path(b)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(stored))
    assert costprofile.load(b) is None and costprofile.one_pass_seconds(b) is None
    assert costprofile.get(b, measure=False) is None and not capsys.readouterr().err  # no measuring: no word
    prof = costprofile.get(b)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("speculant: warning: ignoring the cached pass costs in ") \
        and str(path) in err[0] and "measuring m.gguf's again" in err[0], err
    assert measured and prof == costprofile.from_times(times)
    assert costprofile.load(b) == prof and costprofile.one_pass_seconds(b) == pytest.approx(0.010)  # replaced
    # the policy runs on what was measured
    pol = AdaptivePolicy(cost_prior=prof, t1_prior=costprofile.one_pass_seconds(b))
    assert pol.prior_ratio(20) > pol.prior_ratio(16) > 1.0
    assert best_draft_length(0.8, 0.001, pol.target_time, 1, 8) >= 1


def test_a_busy_moment_while_measuring_is_not_kept(home, monkeypatch, capsys, quiet_cpu):
    """Each size's fastest round is kept (a spike that two of three rounds shared was the median); rounds are added
    while a size still costs more than PLAUSIBLE x its tokens one-token passes, and a profile that stays so is
    neither used (the policy starts unprimed, timing passes itself) nor cached (it would keep every later process
    from drafting)."""
    b = _fake_target(home)
    quiet = {n: 10.0 + 2.0 * (n - 1) for n in costprofile.QUICK_SIZES}
    spiked = {**quiet, 2: 60.0}
    rounds = [spiked, spiked, quiet]
    monkeypatch.setattr(costprofile, "pass_times_ms", lambda backend, ns, depth=0: rounds.pop(0) if len(ns) > 2
                        else quiet)
    assert costprofile.get(b) == costprofile.from_times(quiet) == costprofile.load(b)
    assert json.loads(costprofile.profile_path(b).read_text())["source"] == "quick: fastest of 3 rounds at load"
    costprofile.profile_path(b).unlink()
    rounds = [spiked] * 4 + [quiet]  # the fifth round is quiet: measured again until it was
    assert costprofile.get(b) == costprofile.from_times(quiet) == costprofile.load(b) and rounds == []
    costprofile.profile_path(b).unlink()
    capsys.readouterr()
    rounds = [spiked] * 6  # busy all along: neither used nor cached
    assert costprofile.get(b) is None and rounds == []
    assert costprofile.load(b) is None and "measured unevenly" in capsys.readouterr().err


def test_rounds_that_shared_the_cpu_are_not_kept(home, monkeypatch, capsys):
    """A round whose threads got less than QUIET_SHARE of their time ran beside another program: its times are
    flattened (each pass waits at every barrier for a descheduled thread), so it is not used; rounds are added
    until one is quiet, and a profile with none is neither used nor cached."""
    b = _fake_target(home)
    quiet = {n: 10.0 + 2.0 * (n - 1) for n in costprofile.QUICK_SIZES}
    flat = {n: 40.0 + 0.5 * (n - 1) for n in costprofile.QUICK_SIZES}  # plausible, and wrong
    rounds = [(flat, 0.35), (flat, 0.4), (flat, 0.3), (quiet, 0.95)]
    monkeypatch.setattr(costprofile, "pass_times_ms", lambda backend, ns, depth=0: quiet)  # the warm-up
    monkeypatch.setattr(costprofile, "quick_round", lambda backend: rounds.pop(0))
    assert costprofile.get(b) == costprofile.from_times(quiet) == costprofile.load(b) and rounds == []
    stored = json.loads(costprofile.profile_path(b).read_text())
    assert stored["cpu_share"] == 0.95 and stored["source"] == "quick: fastest of 1 rounds at load"
    costprofile.profile_path(b).unlink()
    capsys.readouterr()
    rounds = [(flat, 0.4)] * 6  # busy all along
    assert costprofile.get(b) is None and rounds == [] and costprofile.load(b) is None
    err = capsys.readouterr().err
    assert "measured while other programs ran (its passes got 40% of their threads' time at best)" in err, err


def test_cpu_share_is_the_threads_time_they_got(monkeypatch):
    class B:
        n_threads = 2

    monkeypatch.setattr(costprofile.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert costprofile.cpu_share(1.9, 1.0, B()) == pytest.approx(0.95)
    monkeypatch.setattr(costprofile.os, "sched_getaffinity", lambda pid: {0})  # 2 threads on 1 core at best
    assert costprofile.cpu_share(0.9, 1.0, B()) == pytest.approx(0.9)
    B.device = "cuda:0"  # nor one on a GPU
    assert costprofile.cpu_share(0.1, 1.0, B()) == 1.0
    B.device, B.offloaded = "cpu", True  # nor one that waits on RPC workers (or runs in a child process)
    assert costprofile.cpu_share(0.1, 1.0, B()) == 1.0
    from speculant.backends.supervised import SupervisedBackend

    assert SupervisedBackend.__init__.__code__.co_names.count("offloaded")  # set where it starts its child


@pytest.mark.models
def test_a_machine_busy_with_another_program_measures_no_profile(tmp_path, monkeypatch, capsys):
    """Real passes on every core, quiet, then beside a process spinning on each core: the rounds get about half
    their threads' time and nothing is cached (so the next process measures again)."""
    import subprocess
    import sys

    from speculant.backends.llamacpp import LlamaCppBackend

    path = models.cached_path(SMALL)
    _small_backend(tmp_path, monkeypatch).close()  # the model pulled; the cost files under tmp_path from here
    b = LlamaCppBackend(path, n_ctx=512, n_threads=len(os.sched_getaffinity(0)))
    costprofile.pass_times_ms(b, [1, 2])  # warm-up
    if costprofile.quick_round(b)[1] < costprofile.QUIET_SHARE:
        b.close()
        pytest.skip("the machine is busy already: nothing to compare with")
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(b.n_threads)]
    try:
        _, share = costprofile.quick_round(b)
        assert share < costprofile.QUIET_SHARE
        assert costprofile.get(b) is None and not costprofile.profile_path(b).exists()
        assert "while other programs ran" in capsys.readouterr().err
    finally:
        for p in spin:
            p.kill()
            p.wait()
        b.close()


def test_a_sound_profile_is_read_as_written(home):
    b = _fake_target(home)
    path = costprofile.save(b, {1: 10.0, 2: 12.0, 4: 15.0}, source="test")
    assert costprofile.load(b) == {1: 1.0, 2: 1.2, 4: 1.5} and costprofile.one_pass_seconds(b) == 0.010
    data = json.loads(path.read_text())
    del data["measured_ms"]  # T(1) is optional: the policy times it itself
    data["ratio"] = {"1": 1, "2": 1.2, "4": 1.2}  # an integer 1 is 1.0; equal neighbours do not decrease
    path.write_text(json.dumps(data))
    assert costprofile.load(b) == {1: 1.0, 2: 1.2, 4: 1.2} and costprofile.one_pass_seconds(b) is None


@pytest.mark.models
def test_generate_measures_again_over_an_unsound_profile(tmp_path, monkeypatch):
    """The auditor's file: `generate` died of a ZeroDivisionError (and serve answered 500) before."""
    import os
    import subprocess
    import sys

    from speculant.backends.llamacpp import LlamaCppBackend

    src = models.cached_path(SMALL)
    if not src.exists():
        pytest.skip(f"{SMALL} not pulled")
    (tmp_path / "models").symlink_to(src.parent)  # the real models, read only; everything else under tmp_path
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    monkeypatch.delenv("SPECULANT_COST_PROFILE", raising=False)
    b = LlamaCppBackend(src, n_ctx=256, n_threads=1)  # loaded as generate loads the target: the same key
    path = costprofile.profile_path(b)
    b.close()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"ratio": {"5": 1.0}, "measured_ms": {"1": 10}}))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n")
    proc = subprocess.run([sys.executable, "-m", "speculant", "generate", "-m", SMALL, "-md", "lookup", "-t", "1",
                           "-n", "16", "-f", str(prompt)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "warning: ignoring the cached pass costs" in proc.stderr and str(path) in proc.stderr, proc.stderr
    # measured again, and kept (unless other programs took the CPU meanwhile: then not kept, and said)
    assert costprofile.load(b) is not None or "while other programs ran" in proc.stderr, proc.stderr


@pytest.mark.parametrize("stored", [{"ratio": 0}, {"ratio": -0.5}, {"ratio": float("nan")}, {"ratio": float("inf")},
                                    {"ratio": True}, {"ratio": "0.5"}, {"ratio": None}, {"ratio": [0.5]}, [0.5],
                                    "0.5", None], ids=lambda v: json.dumps(v))
def test_an_unsound_prompt_ratio_is_not_used_nor_folded_into(home, stored):
    draft_file, target_file = home / "draft.gguf", home / "target.gguf"
    draft_file.write_bytes(b"d" * 10)
    target_file.write_bytes(b"t" * 30)
    draft, target = _Model(draft_file), _Model(target_file)
    path = costprofile.prompt_ratio_path(draft, target)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(stored))
    assert costprofile.prompt_ratio(draft, target) is None
    costprofile.observe_prompt_ratio(draft, target, (1.0, 500), (2.0, 500))  # measured afresh: 0.5
    assert costprofile.prompt_ratio(draft, target) == pytest.approx(0.5)
    costprofile.observe_prompt_ratio(draft, target, (float("nan"), 500), (2.0, 500))  # a timing no clock gives
    assert costprofile.prompt_ratio(draft, target) == pytest.approx(0.5)


# -- a write that fails leaves nothing behind ------------------------------------------------------------------
def test_a_failed_profile_write_leaves_no_temporary_file(home):
    b = _fake_target(home)
    costprofile.profile_path(b).mkdir(parents=True)  # the target path is a directory: os.replace fails
    with pytest.raises(OSError):
        costprofile.save(b, {1: 10.0, 2: 12.0}, source="test")
    assert sorted(p.name for p in (home / "costs").iterdir()) == [costprofile.profile_path(b).name]


def test_a_failed_prompt_ratio_write_leaves_no_temporary_file(home):
    draft_file, target_file = home / "draft.gguf", home / "target.gguf"
    draft_file.write_bytes(b"d" * 10)
    target_file.write_bytes(b"t" * 30)
    draft, target = _Model(draft_file), _Model(target_file)
    path = costprofile.prompt_ratio_path(draft, target)
    path.mkdir(parents=True)
    costprofile.observe_prompt_ratio(draft, target, (1.0, 500), (2.0, 500))  # a cache it cannot write: ignored
    assert sorted(p.name for p in (home / "costs").iterdir()) == [path.name]
