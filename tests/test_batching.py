"""Concurrent requests on one model (speculant/batching.py, LlamaCppBackend slots): merged passes give every
sequence the bits it gets alone, and the gatherer merges what it should and never hangs."""

import os
import random
import threading
import time

import numpy as np
import pytest

from speculant.batching import GATHERER, Gatherer, Job
from speculant.errors import SettingsError

from conftest import SMALL, TARGET, _backend


# -- the gatherer, on a stand-in model --------------------------------------------------------------------
class _Model:
    """Records the groups it runs; a job's result is its tokens' sum."""

    def __init__(self, fail=False):
        self.groups, self.fail = [], fail

    def run_group(self, jobs):
        self.groups.append(sorted(j.seq for j in jobs))
        if self.fail:
            raise RuntimeError("pass failed")
        for j in jobs:
            j.result = sum(j.tokens)


def _take_all(jobs):
    return list(jobs)


def _threads(n, body):
    out, errors = [None] * n, []

    def run(i):
        try:
            out[i] = body(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert not any(t.is_alive() for t in ts), "a thread hung"
    return out, errors


def test_busy_requests_in_step_run_as_one_pass():
    g, model = Gatherer(gather_s=5.0), _Model()
    ready = threading.Barrier(3)

    def body(i):
        g.busy(True)
        try:
            ready.wait()  # all three are busy before any submits: the pass must wait for the last one
            time.sleep(0.05 * i)
            return [g.submit(Job(model, i, 0, [i, step], 1), _take_all) for step in range(3)]
        finally:
            g.busy(False)

    t = time.perf_counter()
    out, errors = _threads(3, body)
    assert not errors
    assert out == [[i + s for s in range(3)] for i in range(3)]
    assert model.groups == [[0, 1, 2]] * 3
    assert time.perf_counter() - t < 4.0  # never waited out gather_s: everyone was there


def test_a_busy_request_that_does_not_submit_delays_others_by_gather_s_only():
    g, model = Gatherer(gather_s=0.2), _Model()
    g.busy(True, key=12345)  # a request whose client is slow to read: busy, but not submitting
    t = time.perf_counter()
    assert g.submit(Job(model, 0, 0, [7], 1), _take_all) == 7
    assert 0.15 <= time.perf_counter() - t < 3.0
    g.busy(False, key=12345)
    t = time.perf_counter()
    assert g.submit(Job(model, 0, 0, [8], 1), _take_all) == 8  # nobody else busy: at once
    assert time.perf_counter() - t < 0.15


def test_a_failed_pass_reaches_every_request_in_it_and_the_next_pass_runs():
    g, bad, good = Gatherer(gather_s=5.0), _Model(fail=True), _Model()
    ready = threading.Barrier(2)

    def body(i):
        g.busy(True)
        try:
            ready.wait()
            with pytest.raises(RuntimeError, match="pass failed"):
                g.submit(Job(bad, i, 0, [1], 1), _take_all)
            return g.submit(Job(good, i, 0, [i], 1), _take_all)
        finally:
            g.busy(False)

    out, errors = _threads(2, body)
    assert not errors and out == [0, 1]
    assert bad.groups == [[0, 1]] and good.groups == [[0, 1]]


def test_passes_of_two_models_never_run_at_once():
    g = Gatherer(gather_s=0.01)
    running, overlap = [0], []

    class Slow(_Model):
        def run_group(self, jobs):
            running[0] += 1
            overlap.append(running[0])
            time.sleep(0.01)
            super().run_group(jobs)
            running[0] -= 1

    a, b = Slow(), Slow()

    def body(i):
        g.busy(True)
        try:
            return [g.submit(Job(a if (i + s) % 2 else b, i, 0, [s], 1), _take_all) for s in range(5)]
        finally:
            g.busy(False)

    out, errors = _threads(4, body)
    assert not errors and out == [list(range(5))] * 4
    assert max(overlap) == 1


# -- llama.cpp slots: the bits of a sequence alone -----------------------------------------------------------
def _script(backend, prompt, seed, steps=10, cold=True):
    """Prefill (from an empty cache when cold), then verify-like passes of 1-8 tokens with random acceptances
    and rewinds: every logit row."""
    rng = random.Random(seed)
    if cold:
        backend.rewind(0)
    backend.prefill(prompt[:-1])
    ctx, out = list(prompt), []
    for _ in range(steps):
        n = rng.choice([1, 1, 2, 3, 5, 8])
        cand = ctx + [rng.randrange(100, 20000) for _ in range(n - 1)]
        logits = backend.sync(cand, n_logits=n)
        out.append(logits.copy())
        keep = rng.randrange(n)  # drafts accepted, then the target's token
        ctx = cand[:len(ctx) + keep] + [int(logits[keep].argmax())]
        backend.rewind(len(ctx) - 1)
    return out


TEXT = ("def merge_intervals(intervals):\n    intervals.sort()\n    out = []\n    for lo, hi in intervals:\n"
        "        if out and lo <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], hi)\n") * 12


@pytest.mark.models
@pytest.mark.parametrize("name", [SMALL, TARGET])
def test_slots_in_merged_passes_get_the_bits_they_get_alone(name, monkeypatch):
    from speculant import native

    # a loaded machine can stall a thread past the default 20 ms gather; merging is what is tested, not latency
    monkeypatch.setattr(GATHERER, "gather_s", 2.0)
    forced = os.environ.get("SPECULANT_CPU_VARIANT")
    solo = _backend(name, n_ctx=1024)
    assert not forced or native.loaded_variant() == forced
    shared = _backend(name, n_ctx=1024, n_seq=3)
    try:
        toks = solo.tokenize(TEXT)
        # one prompt crosses 256 positions (a KV stream longer than the others: more masked cells for them)
        prompts = [toks[:21], toks[:300], toks[40:130]]
        # 20 steps each: the slots' prompts take different numbers of prefill passes (which merge with nothing),
        # so their decode passes fall into step after a few steps
        want = [_script(solo, p, seed, steps=20) for seed, p in enumerate(prompts)]
        slots = [shared.slot(i) for i in range(3)]
        passes, jobs = GATHERER.passes, GATHERER.jobs

        def body(i):
            slots[i].busy(True)
            try:
                return _script(slots[i], prompts[i], i, steps=20)
            finally:
                slots[i].busy(False)

        got, errors = _threads(3, body)
        assert not errors, errors
        merged = (GATHERER.jobs - jobs) - (GATHERER.passes - passes)
        assert merged >= 10, f"only {merged} passes were saved by merging"
        for i in range(3):
            for step, (a, b) in enumerate(zip(want[i], got[i])):
                assert np.array_equal(a, b), f"slot {i} step {step}: max diff {np.abs(a - b).max()}"
    finally:
        shared.close()
        solo.close()


@pytest.mark.models
def test_a_slot_that_copies_another_slots_prompt_computes_its_bits():
    """Backend.copy_prefix: a slot takes another slot's cached prompt (llama.cpp copies the KV stream at the next
    pass), while that slot goes on decoding its own request, and a third slot copies the second before any pass
    ran. Everything they compute after is bit for bit what a cold cache computes."""
    solo = _backend(SMALL, n_ctx=1024)
    shared = _backend(SMALL, n_ctx=1024, n_seq=3)
    try:
        toks = solo.tokenize(TEXT)
        prompt, mine = toks[:200], toks[:230]  # mine extends the prompt slot 0 processed
        want = _script(solo, mine, 7, steps=8)
        first, second, third = (shared.slot(i) for i in range(3))
        first.prefill(prompt[:-1])
        ctx = list(prompt)
        first.sync(ctx + [11, 12], n_logits=3)  # slot 0 is mid-request: drafts in its cache, then rejected
        first.rewind(len(ctx))
        assert second.copy_prefix(first, mine) == len(ctx)
        assert third.copy_prefix(second, mine) == len(ctx)  # the chain: copied before any pass ran
        assert second.copy_prefix(first, mine) == len(ctx)  # nothing more to take: no copy
        first.sync(ctx + [13, 14, 15], n_logits=3)  # its next pass writes past the copied positions
        with pytest.raises(ValueError):
            second.copy_prefix(second, mine)
        for slot in (second, third):
            got = _script(slot, mine, 7, steps=8, cold=False)
            for step, (a, b) in enumerate(zip(want, got)):
                assert np.array_equal(a, b), f"step {step}: max diff {np.abs(a - b).max()}"
    finally:
        shared.close()
        solo.close()


@pytest.mark.models
def test_merged_passes_on_the_avx2_kernels():
    """The same check on the AVX2 (haswell) variant, as an AVX2-only machine runs it: 4 tokens per weight
    unpacking there, 8 on AVX-512."""
    from conftest import rerun_on_haswell

    rerun_on_haswell(__file__, f"test_slots_in_merged_passes_get_the_bits_they_get_alone and {TARGET}", 1)


@pytest.mark.models
def test_merge_keeps_passes_invariant_and_inside_each_stream():
    b = _backend(SMALL, n_ctx=256, n_seq=4)
    try:
        limit = min(b.invariant_rows, b.n_batch)
        ones = [Job(b, i, 10, [1], 1) for i in range(4)]
        assert sorted(j.seq for j in b.merge(ones)) == [0, 1, 2, 3]  # four 1-token passes: one pass
        big = Job(b, 0, 0, [1] * (limit + 1), 0)
        assert b.merge([big, *ones[1:]]) == [big]  # a prompt chunk runs alone (llama.cpp's fast kernels)
        long = Job(b, 0, 10, [1] * limit, limit)
        group = b.merge([ones[1], long, ones[2]])
        assert long not in group and ones[1] in group  # 2 x 64 padded tokens would leave the invariant kernels
        full = Job(b, 3, b._cells - 1, [1], 1)  # one cell left: padding it to 5 tokens would not fit
        five = Job(b, 1, 10, [1] * 5, 5)
        assert b.merge([full, five]) == [full]
        for g in (b.merge(ones), b.merge([five, *ones[:1]])):
            assert len(g) * max(len(j.tokens) for j in g) <= limit
    finally:
        b.close()


@pytest.mark.models
def test_slot_errors_are_clear():
    b = _backend(SMALL, n_ctx=256, n_seq=2)
    try:
        assert b.slot(0) is b
        with pytest.raises(SettingsError, match="slot 2 does not exist"):
            b.slot(2)
        s = b.slot(1)
        s.close()  # a slot's close leaves the shared model alone
        assert len(b.sync(b.tokenize("Hello"), 1)[0]) == b.n_vocab
    finally:
        b.close()
    with pytest.raises(SettingsError, match="--parallel"):
        _backend(SMALL, n_ctx=256, n_seq=0)


# -- engines on slots: the same output as alone ----------------------------------------------------------------
@pytest.mark.models
def test_concurrent_engines_give_the_output_of_each_request_alone():
    """Greedy and sampled (fixed seeds; a fixed draft length, so the random stream is used alike) requests,
    draft model and prompt lookup, on three slots at once: each output is the one a lone engine gives."""
    from speculant.api import load_engine
    from speculant.verify import SamplingParams

    prompts = ["def quicksort(xs):", "Write a haiku about the sea.", "The capital of France is"]
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, seed=5)]
    kw = dict(n_ctx=512, threads=2, lookup=True, adaptive=False, draft_max=3)
    solo = load_engine(SMALL, SMALL, **kw)
    try:
        want = [solo.generate(p, max_tokens=40, params=q).tokens for p, q in zip(prompts, params)]
    finally:
        solo.close()
    engine = load_engine(SMALL, SMALL, parallel=3, **kw)
    try:
        engines = [engine.for_slot(i) for i in range(3)]
        assert engines[0] is engine and engines[1].target is not engine.target
        with pytest.raises(SettingsError):
            engine.for_slot(3)
        got, errors = _threads(3, lambda i: engines[i].generate(prompts[i], max_tokens=40, params=params[i]))
        assert not errors, errors
        assert [r.tokens for r in got] == want
        assert all(r.stats.drafted > 0 for r in got)
    finally:
        engine.close()


def test_parallel_settings_are_checked():
    from speculant.api import load_engine

    with pytest.raises(SettingsError, match="--parallel"):
        load_engine(SMALL, parallel=0)
    with pytest.raises(SettingsError, match="--parallel"):
        load_engine(SMALL, parallel=1000)
    with pytest.raises(SettingsError, match="one request at a time"):
        load_engine(SMALL, backend="torch", parallel=2)


def test_beside_other_requests_the_draft_model_rests_and_free_drafters_draft():
    from speculant.policy import AdaptivePolicy

    policy = AdaptivePolicy(k_max=4, cost_prior={1: 1.0, 2: 1.05, 5: 1.1})
    policy.observe("draft", 0, 0, 0.0, 0.06, 1)  # a plain step timed: 60 ms
    alone, shared = policy.budget(8), policy.budget(8, sharing=2)
    assert shared.start("draft", free=False) == 0
    assert shared.start("lookup", free=True) == 4 and alone.start("lookup", free=True) == 4
    # a token verified beside 3 other requests pads all 4 sequences: it must be likelier to pay
    assert policy.verify_price(1, 4) > policy.verify_price(1, 2) > policy.verify_price(1)
    assert not policy.wants_draft_prefill("draft", 2)
    before, n3 = policy.target_cost[1].value, policy.key_acceptance("lookup", "n3")
    policy.observe("lookup", 0, 0, 0.0, 0.5, 1, timed=False)  # a merged pass: its time is not ours
    policy.observe("lookup", 2, 1, 0.0, 0.5, 2, keys=["n3", "n3+"], timed=False)
    assert policy.target_cost[1].value == before and 3 not in policy.target_cost
    assert policy.key_acceptance("lookup", "n3") > n3  # the accepted token still counts


@pytest.mark.models
def test_sharing_counts_the_requests_in_progress():
    b = _backend(SMALL, n_ctx=256, n_seq=2)
    try:
        s = b.slot(1)
        assert b.sharing() == 1
        b.busy(True)
        started = threading.Event()
        release = threading.Event()

        def other():
            s.busy(True)
            started.set()
            release.wait(10)
            s.busy(False)

        t = threading.Thread(target=other)
        t.start()
        started.wait(10)
        assert b.sharing() == 2 and s.sharing() == 2
        release.set()
        t.join(10)
        assert b.sharing() == 1
        b.busy(False)
    finally:
        b.close()


def test_an_interrupted_pass_ends_before_the_next_one_may_start():
    """Ctrl-C while a merged pass ran marked it done at once, while the pass thread still wrote the caches: a
    rewind of that sequence (or another pass) could run beside it. The interrupted caller now waits for it."""
    import signal

    g = Gatherer(gather_s=0.01)
    events = []

    class Slow(_Model):
        def run_group(self, jobs):
            events.append("start")
            time.sleep(0.5)
            super().run_group(jobs)
            events.append("end")

    model = Slow()
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT))  # Ctrl-C in the middle of the pass
    timer.start()
    cpu = time.process_time()
    with pytest.raises(KeyboardInterrupt):
        g.submit(Job(model, 0, 0, [1, 2], 1), _take_all)
    events.append("interrupted caller goes on")
    cpu = time.process_time() - cpu
    timer.join()
    assert events == ["start", "end", "interrupted caller goes on"]
    assert cpu < 0.2, cpu  # it waited (0.4 s of a core when it spun: the pass's own threads need that core)
    assert g.submit(Job(model, 0, 0, [3], 1), _take_all) == 3  # and the gatherer still works
