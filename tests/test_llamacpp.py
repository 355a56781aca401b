"""Real models through llama.cpp: batch invariance, greedy identity, cache consistency, structure."""

import numpy as np
import pytest

from speculant.drafters.model import ModelDrafter
from speculant.engine import Engine
from speculant.verify import SamplingParams
from speculant.vocab import check_compatible

PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "translation": "Translate into German: The library opens at nine and closes at six on weekdays.",
    "math": "A train travels 180 km in 2.5 hours. What is its average speed? Explain step by step.",
    "story": "Write the opening paragraph of a story about a lighthouse keeper who finds a strange map.",
}


def _batch_vs_single(backend, text, sizes=(2, 3, 5, 9, 17, 64, 100)):
    toks = backend.tokenize(text)
    backend.rewind(0)
    backend.eval(toks[:4], n_logits=0)
    single = np.stack([backend.eval([t])[0] for t in toks[4:]])  # [n, V]
    worst = 0.0
    for size in sizes:
        backend.rewind(4)
        batched = np.concatenate([backend.eval(toks[i:i + size], n_logits=len(toks[i:i + size]))
                                  for i in range(4, len(toks), size)])
        worst = max(worst, float(np.abs(batched - single).max()))
    return worst


@pytest.mark.parametrize("which", ["qwen_target", "small_target"])
def test_batched_pass_is_bit_identical_to_single_token_passes(which, request):
    backend = request.getfixturevalue(which)
    text = ("def add(a, b):\n    return a + b\n\n# Translate: Der Hund schläft im Garten, weil es warm ist.\n"
            "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper. " * 4)
    assert len(backend.tokenize(text)) > 104
    # batches of up to 100 tokens (verification and prefill sizes): flash attention's tiled kernel at >= 64
    # queries and the tiled K-quant matmul at >= 8 rows would each break this
    assert _batch_vs_single(backend, text) == 0.0


def _chat(engine, prompt):
    return engine.chat_prompt([{"role": "user", "content": prompt}])


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_identity_qwen_pair(kind, qwen_target, qwen_draft):
    """Speculative output equals target-only output token for token, for k in {1, 4, 8}."""
    plain = Engine(qwen_target)
    prompt = _chat(plain, PROMPTS[kind])
    reference = plain.generate(prompt, max_tokens=40, is_chat=True)
    for k in (1, 4, 8):
        spec = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=k)
        out = spec.generate(prompt, max_tokens=40, is_chat=True)
        assert out.tokens == reference.tokens, f"k={k} diverged on {kind}"
        assert out.stats.drafted > 0


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identity_smollm2_drafting_for_itself(k, small_target, small_draft_same_numerics):
    plain = Engine(small_target)
    spec = Engine(small_target, ModelDrafter(small_draft_same_numerics, small_target.n_vocab), draft_max=k)
    for prompt in PROMPTS.values():
        text = _chat(plain, prompt)
        ref = plain.generate(text, max_tokens=48, is_chat=True)
        out = spec.generate(text, max_tokens=48, is_chat=True)
        assert out.tokens == ref.tokens
        # same weights, same numerics: every draft is accepted
        assert out.stats.accepted == out.stats.drafted


def test_caches_stay_consistent_after_rejections(qwen_target, qwen_draft):
    """Continuing a speculative run (caches full of rejected drafts) equals a fresh run on the same text."""
    spec = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=6)
    prompt = qwen_target.tokenize(_chat(spec, PROMPTS["story"]))
    first = spec.generate(prompt, max_tokens=24, params=SamplingParams(0.9, seed=1))
    assert first.stats.accepted < first.stats.drafted  # there were rejections to clean up
    continued = spec.generate(prompt + first.tokens, max_tokens=24)
    qwen_target.rewind(0)
    qwen_draft.rewind(0)
    fresh = Engine(qwen_target).generate(prompt + first.tokens, max_tokens=24)
    assert continued.tokens == fresh.tokens


def test_sampled_run_is_reproducible_with_a_seed(qwen_target, qwen_draft):
    spec = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=4)
    prompt = _chat(spec, PROMPTS["story"])
    params = SamplingParams(0.8, top_p=0.95, seed=123)
    a = spec.generate(prompt, max_tokens=24, params=params, is_chat=True)
    b = spec.generate(prompt, max_tokens=24, params=params, is_chat=True)
    assert a.tokens == b.tokens and a.stats.drafted > 0


def test_qwen_pair_vocabularies_are_compatible_and_smollm2_is_refused(qwen_target, qwen_draft, small_target):
    check_compatible(qwen_target.vocab_info(), qwen_draft.vocab_info())
    from speculant.errors import VocabMismatchError

    with pytest.raises(VocabMismatchError, match="sizes differ"):
        check_compatible(qwen_target.vocab_info(), small_target.vocab_info())


def test_chat_template_comes_from_the_gguf(qwen_target):
    plain = Engine(qwen_target)
    text = _chat(plain, "hi")
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
