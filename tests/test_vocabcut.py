"""A draft with its vocabulary cut (speculant/vocabcut.py): the cut GGUF computes the same logits for the ids
it keeps, drafting with it stays lossless (greedy identity on the real Qwen pair, the sampled distribution
on synthetic models with a draft that cannot propose some tokens), and the CLI/API path builds it once."""

import numpy as np
import pytest

from speculant import models
from speculant.drafters.model import ModelDrafter
from speculant.engine import Engine
from speculant.errors import SettingsError
from speculant.verify import SamplingParams

from synthetic import TableBackend
from test_engine_synthetic import PROMPT as SYN_PROMPT, V, exact_joint, pvalue

SMALL = "smollm2-135m-instruct"


def test_kept_ids_are_the_first_n_and_every_special_token():
    from speculant.vocabcut import kept_ids

    types = [1] * 10 + [3] + [1] * 5 + [4]  # 3: control, 4: user-defined
    assert kept_ids(types, 4).tolist() == [0, 1, 2, 3, 10, 16]
    assert kept_ids(types, 100).tolist() == list(range(17))


def cut_drafter_engine(k=3):
    """A target over 8 ids and a draft that only knows 5 of them (it can never propose 1, 4 or 6)."""
    keep = np.array([0, 2, 3, 5, 7])
    draft = TableBackend(len(keep), seed=1)
    return Engine(TableBackend(V, seed=0), ModelDrafter(draft, V, keep=keep), draft_max=k), keep


def test_cut_draft_greedy_identity_and_proposals_stay_in_the_cut():
    engine, keep = cut_drafter_engine(4)
    plain = Engine(TableBackend(V, seed=0)).generate(SYN_PROMPT, max_tokens=60)
    r = engine.generate(SYN_PROMPT, max_tokens=60)
    assert r.tokens == plain.tokens and r.stats.drafted > 0
    drafted = [t for t, d in zip(r.tokens, r.from_draft) if d]
    assert set(drafted) <= set(keep.tolist())


def test_cut_draft_sampled_sequences_follow_the_target():
    engine, _ = cut_drafter_engine(3)
    params = SamplingParams(1.0, seed=50_000)
    counts = np.zeros(V ** 3, dtype=np.int64)
    for i in range(20_000):
        toks = engine.generate(SYN_PROMPT, max_tokens=3, params=SamplingParams(1.0, seed=50_000 + i)).tokens
        counts[np.ravel_multi_index(toks, (V,) * 3)] += 1
    probs = exact_joint(params)
    assert pvalue(counts, probs) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.06


def test_keep_table_must_fit():
    with pytest.raises(SettingsError):
        ModelDrafter(TableBackend(5), V, keep=np.array([0, 1, 2]))  # 3 ids for a 5-token draft
    with pytest.raises(SettingsError):
        ModelDrafter(TableBackend(2), V, keep=np.array([0, 9]))  # 9 is not a target id


@pytest.fixture(scope="module")
def small_cut(tmp_path_factory):
    path = models.cached_path(SMALL)
    if not path.exists():
        pytest.skip(f"{SMALL} not pulled")
    from speculant.backends.llamacpp import LlamaCppBackend
    from speculant.vocabcut import read_keep, write_cut

    out = write_cut(path, tmp_path_factory.mktemp("cut") / "small.top8192.gguf", 8192)
    b = LlamaCppBackend(out, n_ctx=512)
    yield b, read_keep(out)
    b.close()


def test_cut_gguf_gives_the_same_logits_for_kept_ids(small_cut, small_target):
    cut, keep = small_cut
    assert cut.n_vocab == len(keep) < small_target.n_vocab and keep[:8192].tolist() == list(range(8192))
    ids = small_target.tokenize("The capital of France is Paris. The capital of Germany is")
    full = small_target.sync(ids, n_logits=len(ids))
    mine = cut.sync(ids, n_logits=len(ids))
    assert np.array_equal(mine, full[:, keep])


def test_qwen_pair_greedy_identity_with_a_cut_draft(qwen_target):
    """The CLI/API path (--draft-vocab 32768): load_drafter cuts the 0.5B draft (made once, then cached) and
    feeds it the full vocabulary's embeddings."""
    from speculant.api import load_drafter

    if not models.cached_path(models.DEFAULT_DRAFT).exists():
        pytest.skip("draft not pulled")
    drafter = load_drafter(qwen_target, models.DEFAULT_DRAFT, threads=2, draft_vocab=32768, lookup=False)
    try:
        assert drafter.keep is not None and drafter.backend.n_vocab == len(drafter.keep) < qwen_target.n_vocab
        assert drafter.to_draft is None and drafter.backend.embed is not None  # reads every id exactly
        prompt = ("<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome."
                  "<|im_end|>\n<|im_start|>assistant\n")
        plain = Engine(qwen_target).generate(prompt, max_tokens=40)
        r = Engine(qwen_target, drafter, draft_max=4, adaptive=False).generate(prompt, max_tokens=40)
        assert r.tokens == plain.tokens and r.stats.accepted > 0
    finally:
        drafter.close()
    full = load_drafter(qwen_target, models.DEFAULT_DRAFT, threads=2, lookup=False)  # the default keeps every id
    try:
        assert full.keep is None and full.backend.n_vocab >= qwen_target.n_vocab - 128
    finally:
        full.close()


def test_embedding_input_reads_tokens_like_ids(small_target):
    """A backend fed embeddings from the GGUF's own table computes what it computes from the ids."""
    from speculant.backends.llamacpp import LlamaCppBackend
    from speculant.vocabcut import TokenEmbeddings

    path = models.cached_path(SMALL)
    b = LlamaCppBackend(path, n_ctx=512, embed=TokenEmbeddings(path))
    try:
        ids = small_target.tokenize("def add(a, b):\n    return a + b  # Der Hund schläft")
        by_embd, by_ids = b.sync(ids, n_logits=len(ids)), small_target.sync(ids, n_logits=len(ids))
        assert (by_embd.argmax(-1) == by_ids.argmax(-1)).all()
        np.testing.assert_allclose(by_embd, by_ids, atol=1e-3 * np.abs(by_ids).max())
    finally:
        b.close()


def test_cut_model_is_made_once(tmp_path, monkeypatch, small_target):
    from speculant.vocabcut import cut_model

    src = models.cached_path(SMALL)
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    first = cut_model(src, 4096)
    stamp = first.stat().st_mtime_ns
    assert cut_model(src, 4096) == first and first.stat().st_mtime_ns == stamp
    assert not list(first.parent.glob("*.tmp*"))
    with pytest.raises(SettingsError):
        cut_model(src, 100)


@pytest.mark.parametrize("stamp_text", ["", "{not json"])
def test_a_bad_stamp_is_made_again(tmp_path, monkeypatch, stamp_text):
    """An empty or corrupt stamp (a crash while writing it) counts as none: the cut is made again."""
    import json

    from speculant.vocabcut import cut_model

    src = models.cached_path(SMALL)
    if not src.exists():
        pytest.skip(f"{SMALL} not pulled")
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    first = cut_model(src, 4096)
    stamp = first.with_suffix(".json")
    stamp.write_text(stamp_text)
    assert cut_model(src, 4096) == first
    assert json.loads(stamp.read_text())["n"] == 4096 and not list(first.parent.glob("*.tmp*"))
