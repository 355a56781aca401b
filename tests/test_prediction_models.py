"""Predicted outputs and history drafting on the real Qwen pair: greedy output with a prediction (correct,
partly wrong, entirely wrong), and with every drafter composed, is token for token the target's own."""

from pathlib import Path

import pytest

from speculant.drafters import CompositeDrafter, HistoryDrafter, LookupDrafter, ModelDrafter
from speculant.engine import Engine
from speculant.verify import SamplingParams

pytestmark = pytest.mark.models

CODE = (Path(__file__).resolve().parent.parent / "speculant" / "data" / "code" / "inventory.py").read_text()
N = 48


def _prompt(engine, task):
    return engine.chat_prompt([{"role": "user", "content": f"{task} Reply with the complete updated file in one "
                                                            f"code block and nothing else.\n\n```python\n{CODE}```"}])


@pytest.fixture(scope="module")
def plain_answer(qwen_target):
    eng = Engine(qwen_target)
    prompt = _prompt(eng, "Rename the class `Inventory` to `StockBook` everywhere in this file.")
    return prompt, eng.generate(prompt, max_tokens=N, is_chat=True)


def test_greedy_identity_with_correct_partly_wrong_and_wrong_predictions(qwen_target, plain_answer):
    prompt, plain = plain_answer
    eng = Engine(qwen_target)
    correct = plain.text
    partly = CODE  # the original file: the output differs from it where the class is renamed
    wrong = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 20
    results = {}
    for name, prediction in (("correct", correct), ("partly", partly), ("wrong", wrong), ("partly2", partly)):
        r = eng.generate(prompt, max_tokens=N, is_chat=True, prediction=prediction)
        assert r.tokens == plain.tokens, name
        results[name] = r.stats
    assert results["correct"].accepted_by_source["prediction"] >= N // 2
    assert results["correct"].target_calls < N // 2
    assert results["partly2"].accepted_by_source["prediction"] > 0  # copying resumed after the renamed lines
    assert results["wrong"].accepted_by_source.get("prediction", 0) <= 2


def test_every_drafter_composed_keeps_greedy_output(qwen_target, qwen_draft, plain_answer):
    prompt, plain = plain_answer
    drafter = CompositeDrafter(HistoryDrafter(), LookupDrafter(), ModelDrafter(qwen_draft, qwen_target.n_vocab))
    eng = Engine(qwen_target, drafter, draft_max=4, adaptive=True)
    try:
        for prediction in (None, CODE, None):
            r = eng.generate(prompt, max_tokens=N, is_chat=True, prediction=prediction)
            assert r.tokens == plain.tokens
        assert sum(r.stats.accepted_by_source.values()) == r.stats.accepted
        assert r.stats.accepted_by_source.get("history", 0) > 0  # the third time, history knows the answer
    finally:
        qwen_draft.rewind(0)


def test_sampled_generation_with_a_prediction_copies_from_it(qwen_target, plain_answer):
    """At T = 0.8 the output still follows the file most of the way (its distribution is the target's: see the
    synthetic distribution tests), so the prediction supplies tokens."""
    prompt, plain = plain_answer
    eng = Engine(qwen_target)
    for seed in (3, 4):
        r = eng.generate(prompt, max_tokens=N, is_chat=True, prediction=CODE, params=SamplingParams(0.8, seed=seed))
    assert r.stats.generated_tokens == N and r.stats.accepted_by_source.get("prediction", 0) > 0
