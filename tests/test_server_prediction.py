"""Predicted outputs and history drafting through `speculant serve`, driven by the official openai client:
OpenAI's `prediction` field, usage.completion_tokens_details, the refusals that go with a prediction, and a
server-wide history that never changes another request's answer. SmolLM2-135M as target and draft."""

import httpx
import pytest

from test_server import KEY, MODEL, _post, _start, _stop

pytestmark = pytest.mark.models

QUESTION = "List the first five prime numbers, one per line, and nothing else."


@pytest.fixture(scope="module")
def server():
    proc, url = _start("--api-key", KEY, "--history")
    yield url
    _stop(proc)
    assert proc.returncode == 0, proc.stdout.read()
    assert "Traceback" not in proc.stdout.read()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, prediction=None, **kw):
    extra = {"prediction": prediction} if prediction is not None else {}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=40, temperature=0, **extra, **kw)


def test_prediction_gives_the_same_answer_and_reports_its_tokens(client):
    plain = _chat(client)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    right = _chat(client, {"type": "content", "content": text})
    assert right.choices[0].message.content == text
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens >= 0
    assert right.usage.speculative["accepted_by_source"].get("prediction") == details.accepted_prediction_tokens
    # partly wrong (a middle line changed), as text parts; and entirely wrong
    lines = text.split("\n")
    lines[len(lines) // 2] = "forty-two"
    parts = [{"type": "text", "text": "\n".join(lines[:2])}, {"type": "text", "text": "\n" + "\n".join(lines[2:])}]
    assert _chat(client, {"type": "content", "content": parts}).choices[0].message.content == text
    wrong = _chat(client, {"type": "content", "content": "Il était une fois un petit chat gris. " * 5})
    assert wrong.choices[0].message.content == text


def test_prediction_on_completions_and_streaming(client):
    prompt = "def add(a, b):\n"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    text = plain.choices[0].text
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"prediction": {"type": "content", "content": text}})
    assert r.choices[0].text == text and r.usage.completion_tokens_details.accepted_prediction_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": _chat(client).choices[0].message.content})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == _chat(client).choices[0].message.content


REFUSED = [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2, "logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"modalities": ["text", "audio"]}, "modalities"),
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[p for _, p in REFUSED])
def test_what_openai_refuses_with_a_prediction_is_a_400(client, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, {"type": "content", "content": "1\n2\n3"}, **extra)
    err = e.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert "prediction" in err["message"]


@pytest.mark.parametrize("prediction", ["just a string", {"type": "text", "content": "x"}, {"type": "content"},
                                        {"type": "content", "content": 5},
                                        {"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}])
def test_malformed_predictions_are_a_400(server, prediction):
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                               "prediction": prediction})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prediction"
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_shared_history_never_changes_another_requests_answer(client):
    """Two users: one asks something that fills the server-wide history; the other's answer (greedy) is the
    same as a fresh server without history gives (the CLI's), and sampled answers stay seeded."""
    from test_server import _cli

    secret = "Repeat exactly: the vault code is 7-3-1-9-4-4 and the vault code is 7-3-1-9-4-4."
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": secret}], max_tokens=40,
                                       temperature=0)
    other = "Write one sentence about the vault."
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": other}],
                                            max_tokens=32, temperature=0)
    ref = _cli("-p", other, "--chat", "-n", "32")
    assert answer.choices[0].message.content == ref["text"]
