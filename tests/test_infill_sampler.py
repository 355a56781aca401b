"""llama.cpp's infill sampler (llama-server's "samplers": [..., "infill"], which llama.vim and llama.vscode send on
every /infill request): what it keeps, against a transliteration of llama.cpp's loops and against llama.cpp's own
sampler on Qwen's vocabulary; chains with it, as the server reads them, against llama.cpp's chains; greedy
decoding with it before a temperature of 0. Speculative decoding with it keeps the target's distribution:
tests/test_engine_synthetic.py (SETTINGS) and, end to end, tests/test_infill.py."""

import ctypes

import numpy as np
import pytest

from speculant.errors import SettingsError
from speculant.verify import (InfillVocab, SamplingParams, adjust_logits, infill_keep, probs_from_logits,
                              reference_infill_keep, with_eog_banned)

# texts over two letters: many are prefixes of others; b"" is a control token's text (never merges)
SMALL_TEXTS = (b"a", b"ab", b"abb", b"b", b"ba", b"bab", b"", b"aa", b"abb", b"bb", b"<e>", b"",
               b"c", b"d", b"e", b"f", b"g", b"cd", b"h")
SMALL = InfillVocab(SMALL_TEXTS, frozenset({10, 11}), 11)


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_infill_keep_is_llama_cpps_loop():
    """The pairs found by sorting the texts, merged in llama.cpp's order, keep what its all-pairs loop keeps (each
    merge changes the masses later pairs compare); every branch of the sampler is reached."""
    rng = np.random.default_rng(0)
    reached = {"eog only": 0, "end": 0, "merged": 0, "kept several": 0}
    for case in range(6000):
        n = int(rng.integers(1, len(SMALL_TEXTS) + 1))
        ids = np.sort(rng.choice(len(SMALL_TEXTS), n, replace=False))
        if rng.random() < 0.7:  # most without the end-of-generation tokens, which would often take the row
            ids = ids[(ids != 10) & (ids != 11)] if n > 2 else ids
        n = len(ids)
        probs = _softmax(rng.standard_normal(n) * rng.uniform(0.1, 4.0))
        n_candidates = n + int(rng.choice([0, 0, 5]))  # tokens at -inf besides these count in the EOG test
        kept, end = infill_keep(ids, probs, SMALL, n_candidates)
        want_kept, want_end = reference_infill_keep(ids, probs, SMALL, n_candidates)
        assert end == want_end and (kept is None) == (want_kept is None), case
        if end is not None:
            assert end == 11
            reached["end"] += 1
            continue
        assert np.array_equal(kept, want_kept), (case, ids, probs)
        texts = [SMALL.piece(int(t)) for t in ids[kept]]
        if kept.any() and all(int(t) in SMALL.eog for t in ids[kept]) and len(ids) > kept.sum():
            reached["eog only"] += 1
        # a kept text token whose text starts another candidate's (or is started by one): merged from it
        if any(a and b != a and b.startswith(a) for a in texts for b in (SMALL.piece(int(t)) for t in ids)):
            reached["merged"] += 1
        reached["kept several"] += int(kept.sum() > 1)
    assert min(reached.values()) >= 50, reached


@pytest.mark.models
def test_infill_keeps_what_llama_cpps_sampler_keeps_on_qwens_vocabulary(qwen_target):
    """llama_sampler_init_infill itself over candidate sets built to reach its branches: families of tokens whose
    texts start one another ("self", "self.", "self._"...), end-of-generation tokens, others."""
    import llama_cpp as ll

    vocab = qwen_target.infill_vocab()
    assert vocab.end == qwen_target.vocab_info().special_ids["eot"]
    by_text = {}
    for t, text in enumerate(vocab.pieces):
        by_text.setdefault(text, []).append(t)
    long = [t for t, text in enumerate(vocab.pieces) if len(text) >= 5]
    eog = sorted(vocab.eog)
    rng = np.random.default_rng(1)
    sampler = ll.llama_sampler_init_infill(ll.llama_model_get_vocab(qwen_target._model))
    reached = {"eog only": 0, "end": 0, "merged": 0, "kept": 0}
    try:
        for case in range(400):
            text = vocab.pieces[int(rng.choice(long))]
            family = {t for i in range(1, len(text) + 1) for t in by_text.get(text[:i], [])}  # its prefixes
            family |= {t for t, p in enumerate(vocab.pieces[:20000]) if p.startswith(text[:3])}
            family |= set(rng.choice(len(vocab.pieces), int(rng.integers(0, 8))).tolist())
            if rng.random() < 0.4:
                family |= set(rng.choice(eog, int(rng.integers(1, len(eog) + 1)), replace=False).tolist())
            scale = rng.uniform(0.1, 5.0)
            if case % 4 == 0:  # many unrelated tokens, none likely: no text token reaches 0.2
                family, scale = set(rng.choice(len(vocab.pieces), int(rng.integers(6, 40))).tolist()), 0.3
            ids = np.array(sorted(family))[:60]
            logits = (rng.standard_normal(len(ids)) * scale).astype(np.float32)

            data = (ll.llama_token_data * len(ids))()
            for i, (t, x) in enumerate(zip(ids, logits)):
                data[i].id, data[i].logit, data[i].p = int(t), float(x), 0.0
            arr = ll.llama_token_data_array(data=data, size=len(ids), selected=-1, sorted=False)
            ll.llama_sampler_apply(sampler, ctypes.byref(arr))
            theirs = {data[i].id for i in range(arr.size) if data[i].logit > -np.inf}

            kept, end = infill_keep(ids, _softmax(logits.astype(np.float64)), vocab)
            if end is not None:
                assert arr.size == 1 and data[0].id == end and data[0].logit == 1.0, case
                reached["end"] += 1
                continue
            ours = set(ids[kept].tolist())
            assert ours == theirs, (case, [vocab.pieces[t] for t in ids])
            reached["kept"] += 1
            reached["eog only"] += int(bool(ours) and ours <= vocab.eog)
            reached["merged"] += int(any(a != b and vocab.pieces[b].startswith(vocab.pieces[a]) and vocab.pieces[a]
                                         for a in ours for b in ids))
    finally:
        ll.llama_sampler_free(sampler)
    assert min(reached.values()) >= 20, reached


def _llama_cpp_chain(model, logits, params, chain):
    """llama.cpp's samplers named in `chain`, in its order, over one row [V] -> what its `dist` draws from."""
    import llama_cpp as ll

    n = len(logits)
    rows = np.zeros(n, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    rows["id"], rows["logit"] = np.arange(n), logits
    arr = ll.llama_token_data_array(data=rows.ctypes.data_as(ctypes.POINTER(ll.llama_token_data)), size=n,
                                    selected=-1, sorted=False)
    init = {"top_k": lambda: ll.llama_sampler_init_top_k(params.top_k),
            "top_p": lambda: ll.llama_sampler_init_top_p(params.top_p, 1),
            "min_p": lambda: ll.llama_sampler_init_min_p(params.min_p, 1),
            "temperature": lambda: ll.llama_sampler_init_temp(params.temperature),
            "infill": lambda: ll.llama_sampler_init_infill(ll.llama_model_get_vocab(model))}
    for name in chain:
        s = init[name]()
        ll.llama_sampler_apply(s, ctypes.byref(arr))
        ll.llama_sampler_free(s)
    kept = rows[:arr.size]
    z = np.full(n, -np.inf)
    z[kept["id"]] = kept["logit"]
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.mark.models
def test_chains_with_the_infill_sampler_sample_as_llama_cpps(qwen_target):
    """llama-server's "samplers" with "infill" anywhere after top-k (llama.vim's: top_k, top_p, infill), read by the
    server: the distribution llama.cpp's chain draws from, row over the whole vocabulary; at temperature 0 the
    greedy token is the argmax of what it keeps (then the temperature's argmax), not the row's."""
    from speculant.server import _llama_samplers

    vocab = qwen_target.infill_vocab()
    v = len(vocab.pieces)
    family = [t for t, p in enumerate(vocab.pieces) if p.startswith(b" re")][:40]  # " re", " return", " read", ...
    rng = np.random.default_rng(2)
    greedy_differs = greedy_cases = 0
    for case in range(120):
        logits = (rng.standard_normal(v) * 2.0).astype(np.float32)
        spread = rng.choice([1.0, 6.0])  # 1: a dozen tokens alike, none at 0.2 alone (the merges decide)
        logits[rng.choice(family, 12, replace=False)] += rng.uniform(8.0, 8.0 + spread, 12).astype(np.float32)
        if rng.random() < 0.3:
            logits[sorted(vocab.eog)] += np.float32(rng.uniform(6.0, 12.0))
        rest = [s for s in ("top_p", "min_p", "temperature") if rng.random() < 0.6]
        chain = ["top_k"] + rest
        chain.insert(int(rng.integers(1, len(chain) + 1)), "infill")
        body = {"samplers": chain, "top_k": int(rng.choice([5, 40])), "top_p": float(rng.choice([0.99, 0.9, 0.6])),
                "min_p": float(rng.choice([0.0, 0.05])), "temperature": float(rng.choice([0.0, 0.0, 0.6, 1.0, 1.7]))}
        params = SamplingParams(body["temperature"], body["top_k"], body["top_p"], body["min_p"])
        got = _llama_samplers(body, params, 4096, infill_vocab=qwen_target.infill_vocab)
        assert got.infill is vocab
        want = _llama_cpp_chain(qwen_target._model, logits, got, chain)
        if got.greedy:
            greedy = int(np.argmax(adjust_logits(logits, got, [1], 1)))
            assert want[greedy] == 1.0, (case, chain)
            greedy_differs += greedy != int(np.argmax(logits))
            greedy_cases += got.infill_after != "temperature"
            continue
        ours = probs_from_logits(logits, got)
        assert np.array_equal(ours > 0, want > 0), (case, chain)
        np.testing.assert_allclose(ours, want, rtol=2e-5, atol=1e-7)
    assert greedy_differs >= 2, (greedy_differs, greedy_cases)


def test_the_server_reads_where_the_infill_sampler_comes():
    from speculant.server import APIError, _llama_samplers

    def read(chain, **fields):
        body = {"samplers": chain, "top_k": 40, "top_p": 0.9, "temperature": 0.8, **fields}
        params = SamplingParams(body["temperature"], 40, 0.9, repetition_penalty=body.get("repeat_penalty", 1.0))
        return _llama_samplers(body, params, 4096, infill_vocab=lambda: SMALL)

    assert read(["top_k", "top_p", "infill"]).infill_after == "top_p"
    assert read(["top_k", "top_p", "infill"]).temperature == 1.0  # llama.vim's: no temperature in its chain
    assert read("kipt").infill_after == "top_k" and read(["infill", "top_k"]).infill_after == ""
    assert read(["top_k", "min_p", "infill", "top_p"], top_p=1.0).infill_after == "top_k"  # top_p 1 does nothing
    assert read(["top_k", "temperature", "infill"]).infill_after == "temperature"
    assert read(["top_k", "top_p", "temperature"]).infill is None
    assert read(["penalties", "infill"], repeat_penalty=1.1).repetition_penalty == 1.1
    assert read(["infill", "penalties"]).infill_after == ""  # no penalty asked for: the order changes nothing
    for chain, fields in ((["top_k", "infill", "top_p", "infill"], {}), (["infill", "top_p", "top_k"], {}),
                          (["infill", "penalties"], {"repeat_penalty": 1.1})):
        with pytest.raises(APIError) as e:
            read(chain, **fields)
        assert e.value.status == 400 and e.value.param == "samplers", chain
    with pytest.raises(APIError):  # no vocabulary to read: refused, not ignored
        _llama_samplers({"samplers": ["infill"]}, SamplingParams(), 4096)
    with pytest.raises(SettingsError):
        SamplingParams(1.0, infill=SMALL, infill_after="typ_p")


def test_greedy_with_infill_before_temperature_0_takes_the_argmax_of_what_it_keeps():
    """The infill sampler never drops the likeliest token by a merge (it absorbs), but by its thresholds: "b" 0.19
    is the row's argmax, and falls under 0.2, while "ab", "aa" and "abb" merge into "a" (0.665), the greedy token.
    With the end-of-generation mass high: that token alone; no text token at 0.2 or more: EOT, however unlikely."""
    params = SamplingParams(0.0, infill=SMALL, infill_after="")
    row = np.full(len(SMALL_TEXTS), -np.inf, dtype=np.float32)
    row[[3, 0, 1, 7, 2, 6]] = np.log([0.19, 0.18, 0.17, 0.16, 0.155, 0.145])  # b, a, ab, aa, abb, "" (control)
    assert int(np.argmax(row)) == 3 and int(np.argmax(adjust_logits(row, params, [1], 1))) == 0
    sampled = probs_from_logits(row, SamplingParams(1.0, infill=SMALL, infill_after=""))
    assert np.flatnonzero(sampled).tolist() == [0]
    row[10] = np.log(0.1)  # EOG: 3 x ~0.09 x 7 candidates > ~0.91
    assert int(np.argmax(adjust_logits(row, params, [1], 1))) == 10
    assert int(np.argmax(adjust_logits(row, SamplingParams(0.0), [1], 1))) == 3  # without it: the row's argmax
    flat_texts = InfillVocab((b"x", b"y", b"z", b"w", b"v", b"u", b""), frozenset({6}), 6)
    flat = np.zeros(7, dtype=np.float32)
    flat[6] = -30.0  # 3 x p_eog x 7 is ~1e-12: no EOG branch; six texts of 1/6, none at 0.2: EOT alone
    assert int(np.argmax(adjust_logits(flat, SamplingParams(0.0, infill=flat_texts, infill_after=""), [1], 1))) == 6
    assert probs_from_logits(flat, SamplingParams(1.0, infill=flat_texts, infill_after="")).tolist() == [0.0] * 6 + [1.0]
    # EOT banned (ignore_eos: a logit of -inf): llama.cpp still ends with it there, greedy or not
    banned = with_eog_banned(SamplingParams(0.0, infill=flat_texts, infill_after=""), [6])
    assert int(np.argmax(adjust_logits(flat, banned, [1], 1))) == 6
    assert probs_from_logits(flat, dataclasses_replace(banned, temperature=0.8))[6] == 1.0
    # a temperature so small that x / T overflows: the argmax alone (of what the infill sampler kept, when first)
    row[10] = -np.inf
    for after, token in (("temperature", 3), ("", 0)):
        tiny = probs_from_logits(row, SamplingParams(1e-310, infill=SMALL, infill_after=after))
        assert np.flatnonzero(tiny).tolist() == [token] and tiny[token] == 1.0


def dataclasses_replace(params, **kw):
    import dataclasses

    return dataclasses.replace(params, **kw)


@pytest.mark.models
def test_the_infill_sampler_with_a_grammar_is_refused(small_target):
    """llama.cpp samples a grammar and the infill sampler in an order speculant does not reproduce (a greedy row
    whose kept tokens the grammar all forbids): a clear error, not a row of -inf (the server: tests/test_server.py)."""
    from speculant.engine import Engine

    params = SamplingParams(0.0, top_k=40, infill=small_target.infill_vocab(), infill_after="top_k")
    with pytest.raises(SettingsError, match="infill sampler with a grammar"):
        Engine(small_target).generate("1 + 1 =", max_tokens=4, params=params,
                                      constraint=small_target.grammar("root ::= [0-9]+"))
    assert Engine(small_target).generate("1 + 1 =", max_tokens=4, params=params).tokens
