"""A draft model with another tokenizer drafts through text (drafters/crossvocab.py): exact at T = 0 (the
target's own output) and at T > 0 (the target's distribution), on synthetic models with two tokenizers and on
the real SmolLM2 / Qwen2.5 pair, whose vocabularies differ."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import speculant.engine as engine_mod
from speculant import chat
from speculant.drafters.crossvocab import RETOKENIZE_BYTES, CrossVocabDrafter, TextTokens, _utf8_complete, \
    same_vocabulary
from speculant.engine import Engine
from speculant.verify import SamplingParams

from synthetic import TableBackend, pvalue, sequence_counts, sqrt_p_verifier
from test_engine_synthetic import PROMPT, V, exact_joint

TARGET_TEXTS = [b"a", b"b", b"c", b"ab", b"ca", b"bc", b"abc", b" "]  # [V]: the target's tokens
DRAFT_TEXTS = [b"a", b"b", b"c", b" "]  # the draft's: single characters


class TextTable(TableBackend):
    """A table model with a real tokenizer: longest match over its token texts (merges reach back like BPE's)."""

    def __init__(self, texts, seed, **kw):
        super().__init__(len(texts), seed=seed, texts=list(texts), **kw)
        self.by_text = {t: i for i, t in enumerate(texts)}
        self.longest = max(len(t) for t in texts)

    def tokenize(self, text, add_special=True):
        data, out, i = text.encode(), [], 0
        while i < len(data):
            n = next(n for n in range(min(self.longest, len(data) - i), 0, -1) if data[i:i + n] in self.by_text)
            out.append(self.by_text[data[i:i + n]])
            i += n
        return out


def make_pair(draft_seed=1, **kw):
    target = TextTable(TARGET_TEXTS, seed=0, **kw)
    draft = TextTable(DRAFT_TEXTS, seed=draft_seed, **kw)
    return target, draft


def test_utf8_complete():
    text = "añ€😀".encode()  # 1 + 2 + 3 + 4 bytes
    assert _utf8_complete(text) == len(text)
    for cut, whole in [(1, 1), (2, 1), (3, 3), (4, 3), (5, 3), (6, 6), (7, 6), (8, 6), (9, 6), (10, 10)]:
        assert _utf8_complete(text[:cut]) == whole, cut
    assert _utf8_complete(b"") == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.text(alphabet="abc ", max_size=30)), min_size=1, max_size=12))
def test_incremental_tokenization_equals_the_whole_texts(edits):
    """Cut the text back by some bytes and append some: the kept ids plus the re-tokenized tail are the
    tokenization of the whole text, as long as merges reach back less than RETOKENIZE_BYTES."""
    target, _ = make_pair()
    tokens, text = TextTokens(target), b""
    for cut, more in edits:
        text = text[:max(len(text) - cut, 0)] + more.encode()
        assert tokens.update(text) == target.tokenize(text.decode())
        assert tokens.ends == list(np.cumsum([len(TARGET_TEXTS[t]) for t in tokens.ids]))
    assert RETOKENIZE_BYTES > target.longest


def test_drafts_are_the_targets_ids_of_the_drafts_text():
    target, draft = make_pair()
    drafter = CrossVocabDrafter(draft, target)
    d = drafter.propose(PROMPT, 4, SamplingParams(0.0), np.random.default_rng(0))
    assert 0 < len(d) <= 4 and d.probs is None and d.steps <= 8
    context_text = b"".join(TARGET_TEXTS[t] for t in PROMPT)
    draft_ids = draft.tokenize(context_text.decode())
    greedy = list(draft_ids)
    texts = []  # the draft's greedy text after each of its steps
    for _ in range(8):
        greedy.append(int(np.argmax(draft.logits_after(greedy))))
        texts.append(b"".join(DRAFT_TEXTS[t] for t in greedy[len(draft_ids):]).decode())
    # the draft is whole target tokens of the text the draft wrote, all but the last of some step's text
    assert any(target.tokenize(t)[:-1][:len(d)] == d.tokens and len(target.tokenize(t)) > len(d) for t in texts)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_is_the_targets(k):
    target, draft = make_pair()
    plain = Engine(TextTable(TARGET_TEXTS, seed=0)).generate(PROMPT, max_tokens=60)
    spec = Engine(target, CrossVocabDrafter(draft, target), draft_max=k).generate(PROMPT, max_tokens=60)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0 and 0 < spec.stats.accepted < spec.stats.drafted


def sampled(params, n_runs, n=3):
    target, draft = make_pair()
    return sequence_counts(Engine(target, CrossVocabDrafter(draft, target), draft_max=3), PROMPT, params, n_runs, n)


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=90_000, coupled=False),
                                    SamplingParams(0.7, top_k=4, seed=91_000, coupled=False),
                                    SamplingParams(1.0, seed=92_000)],
                         ids=["T1", "T0.7-topk4", "coupled-T1"])
def test_sampled_sequences_follow_the_target(params):
    counts, drafted = sampled(params, 15_000)
    assert drafted >= 15_000
    probs = exact_joint(params)
    assert pvalue(counts, probs) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.04


def test_the_distribution_test_fails_a_wrong_verifier(monkeypatch):
    monkeypatch.setattr(engine_mod, "verify_sampled", sqrt_p_verifier)
    params = SamplingParams(1.0, seed=90_000, coupled=False)
    counts, _ = sampled(params, 15_000)
    assert pvalue(counts, exact_joint(params)) < 1e-6


def test_each_slot_keeps_its_own_text(monkeypatch):
    target, draft = make_pair()
    monkeypatch.setattr(draft, "slot", lambda i: TextTable(DRAFT_TEXTS, seed=1), raising=False)
    drafter = CrossVocabDrafter(draft, target)
    assert drafter.for_slot(0) is drafter
    other = drafter.for_slot(1)
    assert other.backend is not draft and other.target is target
    a = drafter.propose(PROMPT, 3, SamplingParams(0.0), np.random.default_rng(0))
    b = other.propose([2, 2, 0, 1], 3, SamplingParams(0.0), np.random.default_rng(0))
    assert drafter._context == PROMPT and other._context == [2, 2, 0, 1]
    assert drafter.propose(PROMPT, 3, SamplingParams(0.0), np.random.default_rng(0)).tokens == a.tokens
    assert b.tokens == CrossVocabDrafter(TextTable(DRAFT_TEXTS, seed=1), target).propose(
        [2, 2, 0, 1], 3, SamplingParams(0.0), np.random.default_rng(0)).tokens


# -- the real models --------------------------------------------------------------------------------------------
QUESTIONS = ["Summarize in two sentences: the city council voted to expand the bike lane network after a year of "
             "public hearings, citing safety data and rising commuter numbers.",
             "Write a Python function that returns the n-th Fibonacci number iteratively."]


def test_smollm2_drafts_for_qwen_through_text(qwen_target, small_draft_same_numerics):
    target, draft = qwen_target, small_draft_same_numerics
    assert not same_vocabulary(target, draft, quiet=True)
    drafter = CrossVocabDrafter(draft, target)
    for q in QUESTIONS:
        prompt = chat.render(target.chat_template(), [{"role": "user", "content": q}])
        plain = Engine(target).generate(prompt, max_tokens=48, is_chat=True)
        spec = Engine(target, drafter, draft_max=4).generate(prompt, max_tokens=48, is_chat=True)
        assert spec.tokens == plain.tokens and spec.text == plain.text
        assert spec.stats.accepted > 0.2 * spec.stats.drafted > 0, spec.stats


def test_a_context_ending_inside_a_character_drafts_nothing(qwen_target, small_draft_same_numerics):
    target, draft = qwen_target, small_draft_same_numerics
    euro = "€".encode()
    byte_ids = [next(t for t in range(target.n_vocab) if target.token_bytes(t) == euro[i:i + 1]) for i in range(3)]
    context = target.tokenize("The price is 5", add_special=False) + byte_ids[:1]
    drafter = CrossVocabDrafter(draft, target)
    assert len(drafter.propose(context, 4, SamplingParams(0.0), np.random.default_rng(0))) == 0
    context += byte_ids[1:]  # the character is whole again: the draft reads it
    drafter.propose(context, 4, SamplingParams(0.0), np.random.default_rng(0))
    assert drafter._draft_context(context) == draft.tokenize("The price is 5€", add_special=True)


def test_the_chat_markup_reaches_the_draft_as_its_own_control_tokens(qwen_target, small_draft_same_numerics):
    """Both speak ChatML: Qwen's <|im_start|> is written out and read back as SmolLM2's <|im_start|>."""
    target, draft = qwen_target, small_draft_same_numerics
    prompt = chat.render(target.chat_template(), [{"role": "user", "content": "hi"}])
    drafter = CrossVocabDrafter(draft, target)
    ids = drafter._draft_context(target.tokenize(prompt, add_special=False))
    assert ids == draft.tokenize(prompt, add_special=True)
    im_start = draft.tokenize("<|im_start|>", add_special=False)
    assert len(im_start) == 1 and ids.count(im_start[0]) == prompt.count("<|im_start|>")


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_draft_whose_text_runs_longer_than_its_context_drafts_less_and_never_past_it(adaptive):
    """The draft's own tokens of the same text are more (here, one per character), so near the context's end
    its prompt, or a draft of k target tokens, can need more positions than it has: it drafts less instead."""
    for n_ctx in range(len(PROMPT) + 1, 48):
        target, draft = make_pair(n_ctx=n_ctx)
        plain = Engine(TextTable(TARGET_TEXTS, seed=0, n_ctx=n_ctx)).generate(PROMPT, max_tokens=n_ctx)
        spec = Engine(target, CrossVocabDrafter(draft, target), draft_max=8, adaptive=adaptive).generate(
            PROMPT, max_tokens=n_ctx)
        assert spec.tokens == plain.tokens, n_ctx


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_prompt_longer_in_the_drafts_tokens_than_its_context_is_not_fed_to_it(adaptive):
    prompt = [6] * 10  # "abc" ten times: 10 target tokens, 30 of the draft's
    target, draft = make_pair(n_ctx=20)
    plain = Engine(TextTable(TARGET_TEXTS, seed=0, n_ctx=20)).generate(prompt, max_tokens=8)
    spec = Engine(target, CrossVocabDrafter(draft, target), draft_max=4, adaptive=adaptive).generate(
        prompt, max_tokens=8)
    assert spec.tokens == plain.tokens
    assert len(draft.tokens) == 0


def test_a_draft_writing_bytes_that_are_not_utf8_stops_its_draft_there():
    """A byte-level draft model can write a lone continuation byte; the target reads text, so the draft ends
    before it (it was a traceback)."""
    target = TextTable(TARGET_TEXTS, seed=0)
    draft = TextTable(DRAFT_TEXTS + [b"\x80"], seed=1)
    plain = Engine(TextTable(TARGET_TEXTS, seed=0)).generate(PROMPT, max_tokens=60)
    spec = Engine(target, CrossVocabDrafter(draft, target), draft_max=6, adaptive=False).generate(PROMPT, max_tokens=60)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0
