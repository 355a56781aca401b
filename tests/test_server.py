"""`speculant serve` end to end: a real server process on 127.0.0.1, driven by the official openai client
(and raw httpx for what the client will not send). SmolLM2-135M is both target and draft, to stay fast."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from speculant import models
from speculant.server import LLAMA_SAMPLERS, spawn_local

pytestmark = pytest.mark.models

MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"
CTX = 512
MAX_BODY = 64 * 1024
SPECULANT = str(Path(sys.executable).with_name("speculant"))
COMMON = ["-m", MODEL, "-md", MODEL, "-c", str(CTX), "-t", "1"]
# always draft (when the CLI can adapt the draft length, it would rightly stop drafting with a draft as slow
# as the target), so that the speculative path is what these tests exercise
if "--no-adapt" in subprocess.run([SPECULANT, "serve", "--help"], capture_output=True, text=True).stdout:
    COMMON.append("--no-adapt")
PROMPT = "The capital of France is"


def _start(*extra, timeout=120):
    if not models.cached_path(MODEL).exists():
        pytest.skip(f"{MODEL} not pulled")
    return spawn_local([*COMMON, *extra], timeout=timeout, exe=SPECULANT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server():
    proc, url = _start("--api-key", KEY, "--max-body", str(MAX_BODY))
    yield url
    _stop(proc)
    assert proc.returncode == 0, proc.stdout.read()
    out = proc.stdout.read()
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _metrics(url) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _cli(*args) -> dict:
    out = subprocess.run([SPECULANT, "generate", *COMMON, "--json", *args], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)


def _post(url, path, body, *, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, headers=headers, timeout=60,
                      **({"content": body} if isinstance(body, (str, bytes)) else {"json": body}), **kw)


# -- the happy paths ------------------------------------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # without --served-model-name any name is served, so any name is there (404 with it: below)
    other = client.models.retrieve("gpt-4")
    assert other.id == "gpt-4" and other.root == MODEL
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["draft_model"] == MODEL
    assert httpx.head(server + "/health").status_code == 200


def test_draft_max_0_serves_plainly_and_names_no_draft():
    """-md MODEL --draft-max 0: the draft is not loaded, and /health, /v1/models do not name it as if it drafted."""
    proc, url = _start("--draft-max", "0")
    try:
        assert httpx.get(url + "/health").json()["draft_model"] is None
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["speculative"]["drafted"] == 0
    finally:
        _stop(proc)


def test_endpoints_it_has_not_say_so(server, client):
    """Embeddings, reranking and the Responses API: a 501 saying the server has not that (a bare 404 'Not Found'
    read as a wrong URL), as llama-server answers embeddings without --embeddings; the openai client raises."""
    import openai

    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(model=MODEL, input="hi")
    assert e.value.status_code == 501 and "does not support embeddings" in e.value.message
    for path, what in (("/embedding", "embeddings"), ("/v1/rerank", "reranking"), ("/v1/responses", "Responses")):
        r = _post(server, path, {"input": "hi"})
        assert r.status_code == 501 and what in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "not_supported"
    assert _post(server, "/v1/embeddings", {"input": "hi"}, key="wrong").status_code == 401  # the key first


def _preflight(url, origin):
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_web_pages_may_call_the_api_from_a_browser(server):
    """CORS (as vLLM and llama-server by default): a browser's preflight gets its yes without the API key, and
    answers carry Access-Control-Allow-Origin; the key is still needed for the request itself."""
    pre = _preflight(server, "http://chat.example:3000")
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = httpx.get(server + "/v1/models", headers={"Origin": "http://chat.example:3000",
                                                 "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert httpx.get(server + "/v1/models", headers={"Origin": "http://chat.example:3000"}).status_code == 401


def test_greedy_completion_equals_cli(client):
    cli = _cli("-p", PROMPT, "-n", "32")
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    assert r.choices[0].text == cli["text"]
    assert r.choices[0].finish_reason == cli["finish_reason"]
    assert r.usage.completion_tokens == len(cli["tokens"])
    spec = r.usage.model_extra["speculative"]
    assert spec["drafted"] > 0 and spec["accepted"] > 0  # the draft is the target: it is mostly accepted
    assert spec["generated_tokens"] == r.usage.completion_tokens


def test_greedy_chat_equals_cli(client):
    question = "What is 2 + 2? Answer briefly."
    cli = _cli("--chat", "-p", question, "-n", "24")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == cli["text"]
    assert r.usage.model_extra["speculative"]["target_calls"] > 0


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert all(c.usage is None for c in stream)  # usage only when asked for (stream_options.include_usage)
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert stream[-1].choices == [] and [c for c in stream if c.usage] == [stream[-1]]
    assert stream[-1].usage.model_extra["speculative"]["generated_tokens"] == chat.usage.completion_tokens


def _sse(url, body):
    with httpx.stream("POST", url, headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}]}),
])
def test_stream_usage_arrives_once_as_openai_sends_it(server, path, body):
    """With include_usage: every chunk carries "usage": null but the last, which has "choices": [] and the
    usage (a client summing the chunks' usage counts each token once); without it, no chunk has the field."""
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": True, **body}
    plain = _sse(server + path, body)
    assert all("usage" not in c for c in plain)
    chunks = _sse(server + path, {**body, "stream_options": {"include_usage": True}})
    assert all("usage" in c for c in chunks)
    with_usage = [c for c in chunks if c["usage"] is not None]
    assert with_usage == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["usage"]["completion_tokens"] == chunks[-1]["usage"]["speculative"]["generated_tokens"] > 0


def test_system_fingerprint_names_the_build_in_every_answer(server, client, monkeypatch):
    """OpenAI's system_fingerprint (it was null): the same in every answer of a server, streamed or not; it
    changes with what decides the bits (the llama.cpp build, its CPU kernels), so a seed reproduces an answer
    where the fingerprint is the same."""
    import re

    from speculant import native, server as srv

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    chunks = _sse(server + "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True})
    assert re.fullmatch(r"fp_[0-9a-f]{10}", chat.system_fingerprint), chat.system_fingerprint
    assert {text.system_fingerprint, *(c["system_fingerprint"] for c in chunks)} == {chat.system_fingerprint}

    class Target:  # the llama.cpp backend's part of it
        pass

    monkeypatch.setattr(native, "loaded_variant", lambda: "zen4")
    zen4 = srv._system_fingerprint(Target(), {"key": "84d9ba2c3578"})
    assert zen4 == srv._system_fingerprint(Target(), {"key": "84d9ba2c3578"})
    assert zen4 != srv._system_fingerprint(Target(), {"key": "0123456789ab"})
    monkeypatch.setattr(native, "loaded_variant", lambda: "haswell")
    assert zen4 != srv._system_fingerprint(Target(), {"key": "84d9ba2c3578"})


def test_stream_wire_format_ends_with_done(server):
    with httpx.stream("POST", server + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                            "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_stop_strings(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    assert "United" in full  # " Paris.\n\nThe United States ..." (checked against the CLI above)
    want = full[:full.index("United")]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=["United", "zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop="United",
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == want
    # more than OpenAI's 4, as llama-server takes them (its clients send them on every endpoint)
    many = [f"zz{i}" for i in range(9)] + ["United"]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                                     stop=many).choices[0].text == want
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          stop=many).choices[0].finish_reason in ("stop", "length")
    import openai

    with pytest.raises(openai.BadRequestError, match="at most 256"):  # a bound all the same
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stop=["x"] * 257)
    with pytest.raises(openai.BadRequestError, match="at most 16384 characters together"):  # each is matched per step
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stop=["x" * 4000] * 5)


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_a_stream_that_ends_inside_a_possible_stop_string_sends_its_tail(server, path):
    """The end of an answer that could still start a stop string is held back while streaming; when the answer
    ends there (by length), the held text is streamed before the end (llama-server's /completion lost it)."""
    native = path == "/completion"
    limit = "n_predict" if native else "max_tokens"

    def text(chunks):
        return "".join(c["content"] if native else c["choices"][0]["text"] for c in chunks)

    for n in (1, 4, 7):
        body = {"model": MODEL, "prompt": PROMPT, limit: n, "temperature": 0}
        r = _post(server, path, body).json()
        full = r["content"] if native else r["choices"][0]["text"]
        assert len(full) >= 3
        never = [full[-3:] + "\u2603never"]  # the answer's last characters start it
        held = _post(server, path, {**body, "stop": never}).json()
        assert (held["content"] if native else held["choices"][0]["text"]) == full
        with httpx.stream("POST", server + path, headers={"Authorization": f"Bearer {KEY}"},
                          json={**body, "stop": never, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert text(chunks) == full


def test_logprobs_chat_and_completions(server, client):
    """OpenAI's logprobs objects, from the target's verify passes: one entry per token, the token's bytes spell
    the text, alternatives most likely first; streamed chunks carry the same entries as the whole answer."""
    messages = [{"role": "user", "content": "Name three colors."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    # (the whole 20 unless the answer ends sooner: where it ends depends on this CPU's bits)
    assert len(content) == r.usage.completion_tokens > 0
    assert r.usage.completion_tokens == 20 or r.choices[0].finish_reason == "stop"
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy: the top one
    assert r.usage.model_extra["speculative"]["accepted"] > 0  # most of them came from verify passes
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content

    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    n = c.usage.completion_tokens
    assert n == 16 or c.choices[0].finish_reason == "stop"
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == n > 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert all(len(top) in (2, 3) and top[tok] == tl for top, tok, tl in zip(lp.top_logprobs, lp.tokens,
                                                                           lp.token_logprobs))
    # with a stop string the entries end with the text's tokens; streamed the same
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2,
                                    stop=c.choices[0].text[8:12])
    assert "".join(cut.choices[0].logprobs.tokens).startswith(cut.choices[0].text)
    assert cut.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(cut.choices[0].logprobs.tokens)]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2,
                                            stop=c.choices[0].text[8:12], stream=True))
    assert [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] == \
        cut.choices[0].logprobs.tokens


def test_return_tokens_gives_the_generated_ids(server):
    """llama-server's return_tokens: the generated token ids in "tokens" (else []), each stream chunk with its own,
    every token in a chunk even while its text is held back; they spell the answer."""
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0}
    assert _post(server, "/completion", body).json()["tokens"] == []
    res = _post(server, "/completion", {**body, "return_tokens": True}).json()
    assert len(res["tokens"]) == res["tokens_predicted"] == 12
    assert _post(server, "/detokenize", {"tokens": res["tokens"]}).json()["content"] == res["content"]
    with httpx.stream("POST", server + "/completion", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={**body, "return_tokens": True, "stream": True, "stop": [res["content"][-4:] + "~~"]}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [t for c in chunks for t in c["tokens"]] == res["tokens"]
    assert "".join(c["content"] for c in chunks) == res["content"]
    # a stop string ends the text; the ids are still every token decoded, as llama-server's, streamed or not
    stop = _post(server, "/detokenize", {"tokens": res["tokens"][6:8]}).json()["content"]
    cut = _post(server, "/completion", {**body, "return_tokens": True, "stop": [stop]}).json()
    assert cut["stop_type"] == "word" and len(cut["tokens"]) == cut["tokens_predicted"] >= 7
    assert cut["tokens"] == res["tokens"][:len(cut["tokens"])]
    with httpx.stream("POST", server + "/completion", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={**body, "return_tokens": True, "stream": True, "stop": [stop]}) as r:
        assert [t for line in r.iter_lines() if line.startswith("data: ")
                for t in json.loads(line[6:])["tokens"]] == cut["tokens"]
    assert _post(server, "/completion", {**body, "return_tokens": "yes"}).status_code == 400


def test_a_whitespace_prompt_is_text(server):
    """A prompt of spaces has tokens and is decoded (OpenAI's API takes it); an empty one is a 400."""
    for path in ("/v1/completions", "/completion"):
        assert _post(server, path, {"model": MODEL, "prompt": " ", "max_tokens": 2}).status_code == 200
        assert _post(server, path, {"model": MODEL, "prompt": "", "max_tokens": 2}).status_code == 400


def test_llama_server_completion_endpoint(server, client):
    """llama-server's own /completion (and /completions): the answer /v1/completions gives, in llama-server's
    objects (content, stop_type, timings, completion_probabilities with n_probs), streamed as llama-server
    streams it (no [DONE]); a prompt of token ids too."""
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=2)
    r = _post(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "n_probs": 2})
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["content"] == ref.choices[0].text and res["stop"] is True and res["stop_type"] == "limit"
    assert res["tokens_predicted"] == 16 and res["tokens_evaluated"] == ref.usage.prompt_tokens
    assert res["timings"]["predicted_n"] == 16 and res["truncated"] is False
    probs = res["completion_probabilities"]
    assert [p["logprob"] for p in probs] == ref.choices[0].logprobs.token_logprobs
    assert b"".join(bytes(p["bytes"]) for p in probs).decode() == res["content"]
    assert all(len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)  # greedy
    events = []
    with httpx.stream("POST", server + "/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"prompt": PROMPT, "n_predict": 16, "temperature": 0, "n_probs": 2, "stream": True}) as s:
        for line in s.iter_lines():
            if line:
                events.append(json.loads(line.removeprefix("data: ")))
    assert [e["stop"] for e in events][-1] is True and not any(e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == res["content"]
    assert [p for e in events for p in e["completion_probabilities"]] == probs
    ids = _post(server, "/tokenize", {"content": PROMPT, "add_special": True}).json()["tokens"]
    by_ids = _post(server, "/completion", {"prompt": ids, "n_predict": 16, "temperature": 0,
                                           "stop": [res["content"][4:8]]}).json()
    assert by_ids["content"] == res["content"][:4 + res["content"][4:].index(res["content"][4:8])]
    assert by_ids["stop_type"] == "word" and by_ids["stopping_word"] == res["content"][4:8]


def test_a_prompt_may_mix_token_ids_and_text(server):
    """llama-server's mixed prompt: [ids, "text", ids] is those ids with the text's tokens between them, on
    /completion and /v1/completions (also as one prompt of a batch); echo gives its text."""
    head = _post(server, "/tokenize", {"content": "The capital", "add_special": True}).json()["tokens"]
    mid = _post(server, "/tokenize", {"content": " of France"}).json()["tokens"]
    tail = _post(server, "/tokenize", {"content": " is"}).json()["tokens"]
    body = {"n_predict": 8, "temperature": 0}
    want = _post(server, "/completion", {**body, "prompt": head + mid + tail}).json()
    got = _post(server, "/completion", {**body, "prompt": [*head, " of France", *tail]}).json()
    assert got["content"] == want["content"] and got["tokens_evaluated"] == want["tokens_evaluated"]
    assert _post(server, "/completion", {**body, "prompt": ["The capital", *mid, " is"]}).json()["content"] \
        == want["content"]  # starting with text: tokenized as a text prompt starts (BOS where the model has one)
    v1 = _post(server, "/v1/completions", {"model": MODEL, "max_tokens": 8, "temperature": 0, "echo": True,
                                           "prompt": [[*head, " of France", *tail], head + mid + tail]}).json()
    assert [c["text"] for c in v1["choices"]] == ["The capital of France is" + want["content"]] * 2
    for bad in ([*head, None], [*head, 1.5], [*head, ["x"]]):
        r = _post(server, "/completion", {**body, "prompt": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_logit_bias_and_penalties_as_the_cli(client):
    """The request fields do what the CLI flags do (the CLI decodes with the same drafts), and they change the
    answer."""
    base = _cli("-p", PROMPT, "-n", "24")
    first = base["tokens"][0]
    for fields, flags in (({"logit_bias": {str(first): -100}}, ["-l", f"{first}-100"]),
                          ({"frequency_penalty": 1.5, "presence_penalty": 0.5},
                           ["--frequency-penalty", "1.5", "--presence-penalty", "0.5"]),
                          ({"extra_body": {"repetition_penalty": 1.8}}, ["--repeat-penalty", "1.8"])):
        extra = fields.pop("extra_body", {})
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra,
                                      **fields)
        cli = _cli("-p", PROMPT, "-n", "24", *flags)
        assert r.choices[0].text == cli["text"] != base["text"], flags
    assert first not in _cli("-p", PROMPT, "-n", "24", "-l", f"{first}-inf")["tokens"]


def test_json_mode_schema_and_grammar(server, client):
    """response_format json_object / json_schema and llama-server's `grammar`: the output follows them, greedy
    as the CLI's -j / --grammar gives it (both speculative here, the draft being the target), streamed alike."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"]}
    messages = [{"role": "user", "content": "Give the capital of France and its population as JSON."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "city", "schema": schema}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)
    assert r.usage.model_extra["speculative"]["accepted"] > 0
    cli = _cli("--chat", "-p", messages[0]["content"], "-n", "60", "-j", json.dumps(schema))
    assert cli["text"] == r.choices[0].message.content
    stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                 response_format={"type": "json_schema",
                                                                  "json_schema": {"name": "city", "schema": schema}},
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    j = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    text = j.choices[0].message.content  # SmolLM2 rambles: the object may not end within 40 tokens
    assert text.startswith("{") and (j.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    assert text != client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                                  temperature=0).choices[0].message.content
    g = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Is Paris in France? Answer:", "max_tokens": 8,
                                          "grammar": 'root ::= " yes" | " no"'}).json()
    assert g["choices"][0]["text"] in (" yes", " no") and g["choices"][0]["finish_reason"] == "stop"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}


def test_tool_calls(server, client):
    """tools + tool_choice: a required (or named) call is constrained by the tools' schemas and comes back as
    OpenAI tool_calls, streamed alike; the call and the tool's result render into the next prompt."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # one call (SmolLM2 would go on calling while parallel calls are allowed)
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", max_tokens=60, temperature=0, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert isinstance(args["city"], str)
    else:
        assert call.function.name == "get_time" and isinstance(args["zone"], str)
    named = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_tokens=60, temperature=0, parallel_tool_calls=False)
    assert [t.function.name for t in named.choices[0].message.tool_calls] == ["get_time"]
    assert named.usage.model_extra["speculative"]["drafted"] > 0
    for stop in (["\n"], ["Paris", "{"]):  # stop strings do not cut required calls (they left '<tool_call>' text)
        cut = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], stop=stop,
                                             tool_choice="required", max_tokens=60, temperature=0,
                                             parallel_tool_calls=False)
        assert cut.choices[0].message.tool_calls and cut.choices[0].message.content is None, cut
    # cut by max_tokens: the call as far as it was written, finish_reason length, never the tags as content
    # (the message's content was '<tool_call>\n{"name": ...': the usual `if tool_calls ... else show(content)`
    # showed it to the user)
    whole, n_whole = c.message.tool_calls[0].function, r.usage.completion_tokens
    for max_tokens in (3, n_whole // 2, n_whole - 3):
        for stream in (False, True):
            cut = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                                 tool_choice="required", max_tokens=max_tokens, temperature=0,
                                                 parallel_tool_calls=False, stream=stream)
            if stream:
                got = [ch for ch in cut if ch.choices]
                content = "".join(ch.choices[0].delta.content or "" for ch in got)
                calls = [t.function for ch in got for t in ch.choices[0].delta.tool_calls or ()]
                finish = got[-1].choices[0].finish_reason
            else:
                content, finish = cut.choices[0].message.content, cut.choices[0].finish_reason
                calls = [t.function for t in cut.choices[0].message.tool_calls or ()]
            assert not content and "<tool" not in (content or "") and finish == "length", (max_tokens, cut)
            for f in calls:  # (3 tokens: cut before the name is whole, no call)
                assert f.name == whole.name and whole.arguments.replace(" ", "").startswith(
                    f.arguments.replace(" ", "").rstrip()), (f, whole)  # (the whole one's spacing is json's)
            if max_tokens == n_whole - 3:  # inside its arguments or closing tag
                assert calls, (max_tokens, n_whole, stream)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL],
                                                 tool_choice="required", max_tokens=60, temperature=0, stream=True,
                                                 parallel_tool_calls=False))
    deltas = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(i, t.function.name, t.function.arguments) for i, t in enumerate(c.message.tool_calls)]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the conversation goes on with the call and its result
    follow = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, tools=[WEATHER_TOOL], messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # tool_choice none: the model is not told of the tools; an answer in plain text
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    none = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice="none",
                                          max_tokens=12, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_tools_beside_a_response_format(server, client):
    """OpenAI's Agents SDK sends tools and an output schema together: under auto the model may call (the schema
    alone left it no way to), or answer under the schema; required calls, the schema being for a later answer."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}}, "required": ["answer"]}}}
    angle = _post(server, "/tokenize", {"content": "<"}).json()["tokens"][0]
    brace = _post(server, "/tokenize", {"content": "{"}).json()["tokens"][0]
    for bias, called in (({str(angle): 6}, True), ({str(brace): 6}, False), ({}, None)):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], response_format=fmt,
                                           max_tokens=60, temperature=0, parallel_tool_calls=False, logit_bias=bias)
        c = r.choices[0]
        if c.message.tool_calls:
            assert called in (True, None) and c.finish_reason == "tool_calls"
            assert isinstance(json.loads(c.message.tool_calls[0].function.arguments)["city"], str)
        else:
            assert called in (False, None) and c.finish_reason == "stop", c
            assert isinstance(json.loads(c.message.content)["answer"], str)
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], response_format=fmt,
                                       tool_choice="required", max_tokens=60, temperature=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "grammar": 'root ::= "a"'}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_are_400s(server, body, param):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(server, "/v1/completions", {"prompt": "hi", "tools": [WEATHER_TOOL]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = _post(server, "/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": "{x"}}]}]})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_n_choices_are_the_answers_of_their_seeds(server, client):
    """n > 1: choice i samples with the request's seed + i, on a slot of its own (they decode at once, their
    passes merged), and is exactly what a lone request with that seed answers; streamed alike, by index."""
    def ask(**kw):
        return client.completions.create(model=MODEL, prompt="Once upon a time", temperature=1.0, top_p=0.95,
                                         **{"max_tokens": 16, **kw})

    r = ask(seed=40, n=3, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [ask(seed=40 + i).choices[0].text for i in range(3)]
    assert len({c.text for c in r.choices}) > 1  # different samples
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert r.usage.prompt_tokens == ask(seed=1, max_tokens=1).usage.prompt_tokens  # counted once
    spec = r.usage.model_extra["speculative"]
    assert isinstance(spec, list) and len(spec) == 3 and sum(s["generated_tokens"] for s in spec) == \
        r.usage.completion_tokens
    texts = {}
    finish = {}
    for c in ask(seed=40, n=3, stream=True):
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.text or "")
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    assert all(finish[i] for i in range(3))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                          max_tokens=8, temperature=0, n=2)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content


def test_echo_scores_the_prompt_and_batches_and_token_ids(server, client):
    """/v1/completions as evaluation harnesses call it: echo with logprobs (and max_tokens 0: scoring only)
    returns each prompt token's log-probability given the ones before it (the first has none), the value a
    one-token pass gives; a prompt may be token ids, and a batch of prompts gets n choices each,
    prompt p's i-th at index p * n + i, each the answer of its lone request."""
    import numpy as np

    from speculant.backends.llamacpp import LlamaCppBackend

    ref = LlamaCppBackend(str(models.cached_path(MODEL)), n_ctx=CTX, n_threads=1)
    ids = ref.tokenize(PROMPT)
    expected = []
    for i in range(1, len(ids)):
        row = ref.sync(ids[:i])[-1].astype(np.float64)
        expected.append(row[ids[i]] - row.max() - np.log(np.exp(row - row.max()).sum()))
    ref.close()

    scored = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    c = scored.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and scored.usage.completion_tokens == 0
    lp = c.logprobs
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0 and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, rtol=0, atol=1e-9)  # batch-invariant passes
    assert all(len(top) in (2, 3) and top[tok] == tl for top, tok, tl in zip(lp.top_logprobs[1:], lp.tokens[1:],
                                                                           lp.token_logprobs[1:]))

    # an evaluation harness scores each answer to a question: the question's entries are kept (the slot whose
    # cache holds the longest prefix, of 32 tokens or more, takes the request), not evaluated again
    question = "Read the passage and answer. " * 6 + "Which city is the capital of France?"
    first, second = (client.completions.create(model=MODEL, prompt=question + answer, max_tokens=0, echo=True,
                                               logprobs=2) for answer in (" Paris", " Lyon"))
    shared = len(_post(server, "/tokenize", {"content": question}).json()["tokens"])
    assert shared >= 32 and first.usage.prompt_tokens_details.cached_tokens < shared
    assert second.usage.prompt_tokens_details.cached_tokens >= shared - 1
    assert second.choices[0].logprobs.token_logprobs[:shared] == first.choices[0].logprobs.token_logprobs[:shared]
    assert second.choices[0].logprobs.top_logprobs[:shared] == first.choices[0].logprobs.top_logprobs[:shared]
    # the answers in one batch (two slots): the later ones wait for the first, then copy its cache and entries
    other = "Read the text and reply. " * 6 + "Which river runs through Paris?"
    answers = (" The Seine", " The Rhine", " The Loire")
    batch = client.completions.create(model=MODEL, prompt=[other + a for a in answers], max_tokens=0, echo=True,
                                      logprobs=2)
    shared = len(_post(server, "/tokenize", {"content": other}).json()["tokens"])
    alone = [client.completions.create(model=MODEL, prompt=other + a, max_tokens=0, echo=True, logprobs=2)
             for a in answers]
    assert [c.logprobs.token_logprobs for c in batch.choices] == [a.choices[0].logprobs.token_logprobs for a in alone]
    assert [c.logprobs.top_logprobs for c in batch.choices] == [a.choices[0].logprobs.top_logprobs for a in alone]
    assert batch.usage.prompt_tokens_details.cached_tokens >= 2 * (shared - 1)

    gen = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1)
    both = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=1, echo=True)
    assert both.choices[0].text == PROMPT + gen.choices[0].text  # ids prompt: the same answer, echoed
    assert both.choices[0].logprobs.tokens == lp.tokens + gen.choices[0].logprobs.tokens
    assert both.choices[0].logprobs.token_logprobs[len(ids):] == gen.choices[0].logprobs.token_logprobs
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == both.choices[0].text
    assert [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens] \
        == both.choices[0].logprobs.tokens

    other = "Once upon a time"
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=6, temperature=1.0,
                                      seed=7)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=1.0, seed=7 + i)
             for p in (PROMPT, other) for i in range(2)]
    assert [ch.text for ch in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    ids_batch = client.completions.create(model=MODEL, prompt=[ids, ids[:-1]], max_tokens=4, temperature=0)
    assert ids_batch.choices[0].text == gen.choices[0].text[:len(ids_batch.choices[0].text)]
    assert len(ids_batch.choices) == 2


def test_a_conversation_goes_back_to_the_slot_that_holds_it(server, client):
    """Two conversations in turn on a 2-slot server: each next turn lands on the slot whose cache holds its
    prompt so far (usage.prompt_tokens_details.cached_tokens counts what it did not evaluate again), and the
    other goes to the slot used least recently instead of evicting it. Answers stay those of a cold cache."""
    a = "Here is a story about a lighthouse keeper. " * 12  # ~110 tokens: past one 64-token prefill pass
    b = "A recipe for bread: flour, water, salt and yeast. " * 10

    def ask(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)

    first_a, first_b = ask(a), ask(b)
    next_a, next_b = ask(a + "And then"), ask(b + "Then")
    assert first_a.usage.prompt_tokens >= 100
    assert next_a.usage.prompt_tokens_details.cached_tokens >= first_a.usage.prompt_tokens - 1
    assert next_b.usage.prompt_tokens_details.cached_tokens >= first_b.usage.prompt_tokens - 1
    assert next_a.usage.model_extra["speculative"]["cached_prompt_tokens"] == \
        next_a.usage.prompt_tokens_details.cached_tokens
    cold = _cli("-p", a + "And then", "-n", "4")
    assert next_a.choices[0].text == cold["text"]


def test_choices_and_requests_take_the_prompt_another_slot_processed(server, client):
    """n > 1: the first choice processes the prompt and the others copy its slot's cache (its KV stream) instead
    of processing it again; a request whose prompt a busy slot holds copies it from there. The answers stay
    those of their lone requests and of a cold cache."""
    p = "The history of the printing press, in brief. " * 14  # new to the server: no slot holds it
    copies = _metrics(server).get("speculant_prompt_cache_copies_total", 0.0)
    r = client.completions.create(model=MODEL, prompt=p, n=2, max_tokens=6, temperature=1.0, seed=11)
    assert _metrics(server)["speculant_prompt_cache_copies_total"] == copies + 1
    first, second = r.usage.model_extra["speculative"]
    assert first["cached_prompt_tokens"] < 32 and r.usage.prompt_tokens > 120
    assert second["cached_prompt_tokens"] >= r.usage.prompt_tokens - 1
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=1.0, seed=11 + i)
             for i in range(2)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]

    q = "Notes on the migration of arctic terns. " * 14
    busy = client.completions.create(model=MODEL, prompt=q, max_tokens=150, temperature=0, stream=True)
    started = next(iter(busy))  # its slot has processed q and is decoding
    b = client.completions.create(model=MODEL, prompt=q + "In summary", max_tokens=5, temperature=0)
    rest = [started] + list(busy)
    assert any(ch.choices and ch.choices[0].finish_reason for ch in rest)
    assert b.usage.prompt_tokens_details.cached_tokens >= b.usage.prompt_tokens - 8
    assert b.choices[0].text == _cli("-p", q + "In summary", "-n", "5")["text"]


def test_tokenize_and_detokenize(server):
    """llama-server's /tokenize and /detokenize: the ids are the ones completions take (echo gives the text
    back), pieces come with with_pieces, bad input is a 400 naming the field, and the key is required."""
    ids = _post(server, "/tokenize", {"content": PROMPT}).json()["tokens"]
    assert ids and all(isinstance(t, int) for t in ids)
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"content": PROMPT}
    echoed = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True}).json()
    assert echoed["choices"][0]["text"] == PROMPT and echoed["usage"]["prompt_tokens"] >= len(ids)
    pieces = _post(server, "/tokenize", {"content": "naïve café", "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == _post(server, "/tokenize", {"content": "naïve café"}).json()["tokens"]
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces) \
        == "naïve café".encode()
    # parse_special (llama-server's, default true): a control token's text is that token, or its plain pieces
    assert _post(server, "/tokenize", {"content": "<|im_end|>"}).json()["tokens"] == [2]  # SmolLM2's end of turn
    plain = _post(server, "/tokenize", {"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert len(plain) > 1 and 2 not in plain
    for path, body, param in (("/tokenize", {"content": 5}, "content"), ("/tokenize", [1], "content"),
                              ("/tokenize", {"content": "a", "add_special": "no"}, "add_special"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens"), ("/detokenize", {"tokens": [10 ** 9]}, "tokens")):
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body, r.text)
    assert _post(server, "/tokenize", {"content": "a"}, key=None).status_code == 401


def test_seed_reproducibility(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                         top_p=0.95, seed=seed).choices[0].text

    a = sample(7)
    assert sample(7) == a
    assert len({a, sample(8), sample(9)}) > 1  # sampling really happens
    assert len({sample(-1) for _ in range(3)}) > 1  # -1 asks for a random seed, as on llama-server (was seed -1)


def test_concurrent_clients_get_their_own_answers(server, client):
    prompts = ["The capital of France is", "def fibonacci(n):", "My favourite animal is", "1, 2, 3, 4,"]
    expected = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in prompts}
    before = _metrics(server)

    def one(i):
        p = prompts[i % len(prompts)]
        if i % 2:
            chunks = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True)
            return p, "".join(c.choices[0].text for c in chunks)
        return p, client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    assert len(answers) == 16
    for p, text in answers:
        assert text == expected[p], p
    after = _metrics(server)
    ok = 'speculant_requests_total{endpoint="/v1/completions",status="200"}'
    assert after[ok] - before[ok] == 16
    assert after["speculant_queue_depth"] == 0 and after["speculant_requests_in_progress"] == 0
    # two slots (the default --parallel): requests decoded together, in passes that computed both. How many of
    # ~150 passes merge depends on how the two slots' phases (prompt, decode) happen to line up: 7 to 30 in runs of
    # the same code here (a bound of 10 failed 1 run in 5); without merging, sequences == passes
    passes = after["speculant_batched_passes_total"] - before["speculant_batched_passes_total"]
    sequences = after["speculant_batched_pass_sequences_total"] - before["speculant_batched_pass_sequences_total"]
    assert passes > 0 and sequences >= passes + 2, (passes, sequences)
    assert httpx.get(server + "/health").json()["slots"] == 2


def test_concurrent_sampled_requests_get_their_seeds_output(server, client):
    """A seeded sampled request gives the same text alone and beside others (a fixed draft length here: the
    adaptive policy's choices, which depend on timing, decide how much of the random stream drafting uses)."""
    asks = [("Once upon a time", s) for s in range(3)] + [("def fibonacci(n):", s) for s in range(3)]

    def ask(a):
        p, seed = a
        return client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0.9, seed=seed,
                                         top_p=0.95).choices[0].text

    alone = [ask(a) for a in asks]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, asks))
    assert together == alone
    assert len(set(alone)) > 2  # the seeds matter: this is sampling


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    m = _metrics(server)
    for name in ("speculant_completion_tokens_total", "speculant_prompt_tokens_total",
                 "speculant_drafted_tokens_total", "speculant_accepted_tokens_total",
                 "speculant_tokens_per_second_count", "speculant_request_duration_seconds_count",
                 "speculant_time_to_first_token_seconds_count"):
        assert m[name] > 0, name
    assert 0 < m["speculant_acceptance_rate"] <= 1
    assert m["speculant_mean_accepted_length"] >= 1
    assert "speculant_queue_depth" in m
    # llama-server's own endpoints count too (time to first token: streamed and not)
    for stream in (False, True):
        before = _metrics(server)["speculant_time_to_first_token_seconds_count"]
        r = _post(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "stream": stream})
        assert r.status_code == 200 and r.content
        assert _metrics(server)["speculant_time_to_first_token_seconds_count"] == before + 1
    # n choices share their prompt's processing: the counters add what usage says, once
    before = _metrics(server)
    shared = "A long preamble that both prompts of the batch begin with, word for word. " * 4  # > REUSE_MIN
    for prompts in ([PROMPT, "Once upon a time"], [shared + "One", shared + "Two"]):  # the second waits for the
        r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4,  # first's cache
                                      temperature=1.0, seed=3)
        after = _metrics(server)
        assert after["speculant_prompt_tokens_total"] - before["speculant_prompt_tokens_total"] == \
            r.usage.prompt_tokens
        assert after["speculant_completion_tokens_total"] - before["speculant_completion_tokens_total"] == \
            r.usage.completion_tokens
        before = after


# -- bad input ------------------------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", "[1, 2]", 400, None),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -2}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
    # a lone UTF-16 surrogate is not text (it was a 500 from the tokenizer)
    ("/completion", '{"prompt": "\\ud800 alone", "n_predict": 4}', 400, None),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a\\udfff"}]}' % MODEL,
     400, None),
    # schemas: llama-server's json_schema field, with another constraint; keywords no grammar can enforce
    ("/completion", {"prompt": "hi", "json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, 400,
     "json_schema"),
    ("/completion", {"prompt": "hi", "json_schema": "{}"}, 400, "json_schema"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     400, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),  # OpenAI's 400: stream options without a stream
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 2000}, 400, "prompt"),  # over the 512 context
    ("/v1/completions", {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)}, 413, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "usr", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": None},
                                                           {"role": "user", "content": "hi"}]}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2 ** 64 + 3}, 400, "seed"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
                              "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 3},
     400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, "a", None]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi", []]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 17}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "def f():", "suffix": "\nf()\n"}, 400, "suffix"),  # no FIM tokens
    ("/v1/completions", {"model": MODEL, "prompt": "def f():", "suffix": 3}, 400, "suffix"),
    ("/v1/completions", {"model": MODEL, "prompt": "def f():", "suffix": "x", "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "suffix": "x"},
     400, "suffix"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True},
     400, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": [1, 2]}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # was a 500
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"\u0663": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": "x"}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": "json"}, 400, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "response_format": {"type": "json_schema",
                                                                            "json_schema": {"schema": 5}}},
     400, "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "grammar": 'root ::= "yes'}, 400, "grammar"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "grammar": 5}, 400, "grammar"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "grammar": 'root ::= "a"',
                         "response_format": {"type": "json_object"}}, 400, "grammar"),
    # llama-server's /infill (SmolLM2 has no fill-in-the-middle tokens: the first; the others fail before that)
    # (501 not_supported, as llama-server answers a model without those tokens; it was a 400)
    ("/infill", {"input_prefix": "def f():\n", "input_suffix": "\nf()\n"}, 501, None),
    ("/infill", "not json", 400, None),
    ("/infill", [], 400, None),
    ("/infill", {"input_suffix": ""}, 400, "input_prefix"),
    ("/infill", {"input_prefix": "", "input_suffix": None}, 400, "input_suffix"),
    ("/infill", {"input_prefix": 1, "input_suffix": ""}, 400, "input_prefix"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "prompt": ["x"]}, 400, "prompt"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": {"text": "x"}}, 400, "input_extra"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a.py"}]}, 400, "input_extra"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x", "filename": 3}]}, 400,
     "input_extra"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "n_predict": -2}, 400, "n_predict"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "n_probs": -1}, 400, "n_probs"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "n_indent": -1}, 400, "n_indent"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "t_max_predict_ms": "x"}, 400, "t_max_predict_ms"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "response_fields": "content"}, 400, "response_fields"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "repeat_penalty": 0}, 400, "repeat_penalty"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "temperature": 3}, 400, "temperature"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "stop": [1]}, 400, "stop"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "grammar": 5}, 400, "grammar"),
    ("/completion", {"n_predict": 4}, 400, "prompt"),
    ("/completion", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/completion", {"prompt": "hi", "n_probs": 21}, 400, "n_probs"),
    ("/completion", {"prompt": "hi", "input_extra": 5, "n_predict": "x"}, 400, "n_predict"),
    ("/completions", {"prompt": "word " * 2000}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "x"]}, 400, "prompt"),  # OpenAI's batches are of one kind
    # llama-server's per-request adapters: none is loaded here (it was answered by the base model)
    ("/completion", {"prompt": "hi", "lora": [{"id": 0, "scale": 1.0}]}, 400, "lora"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "lora": [{"id": 0, "scale": 0.5}]}, 400, "lora"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "lora": [{"id": 0}]}, 400, "lora"),
    # llama-server's n_cmpl completions of one prompt: one came back for the several asked for
    ("/completion", {"prompt": "hi", "n_cmpl": 2}, 400, "n_cmpl"),
    ("/completion", {"prompt": "hi", "n_cmpl": "2"}, 400, "n_cmpl"),
    ("/infill", {"input_prefix": "", "input_suffix": "", "n_cmpl": 3}, 400, "n_cmpl"),
]


def test_native_answers_name_the_slot_that_generated_them(server):
    """id_slot: the slot used, as llama-server answers (it was always -1), in a stream's events too."""
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/completion", headers=headers, json={"prompt": PROMPT, "n_predict": 2}, timeout=60)
    slots = httpx.get(server + "/slots", headers=headers).json()
    assert r.status_code == 200 and r.json()["id_slot"] in {s["id"] for s in slots}, (r.json(), slots)
    with httpx.stream("POST", server + "/completion", headers=headers, timeout=60,
                      json={"prompt": PROMPT, "n_predict": 3, "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert events and len({e["id_slot"] for e in events}) == 1 and events[0]["id_slot"] in {s["id"] for s in slots}


def test_a_bad_grammar_is_a_400_naming_its_fault_and_stays_out_of_the_log():
    """llama.cpp prints an unparsable grammar, whole, to stderr: the server's answer said only "failed to parse
    grammar" and its log got the dump (the fault was caught on a command's main thread alone). (--history: the
    banner names it, before lookup; it did not.)"""
    proc, url = _start("--history")
    try:
        r = httpx.post(url + "/completion", json={"prompt": "hi", "grammar": "root ::= foo", "n_predict": 2},
                       timeout=60)
        assert r.status_code == 400 and "Undefined rule identifier 'foo'" in r.json()["error"]["message"], r.text
        ok = httpx.post(url + "/completion", json={"prompt": "hi", "grammar": 'root ::= " yes"', "n_predict": 8},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["content"] == " yes"
    finally:
        _stop(proc)
    out = proc.stdout.read()
    assert "error parsing grammar" not in out and "root ::= foo" not in out, out
    assert "POST /completion 200" in out, out  # the rest of the log is there
    assert f"with draft {MODEL} (history drafting, then prompt lookup first) on {url}/v1" in out, out


@pytest.mark.parametrize("path,body,status,param", BAD, ids=range(len(BAD)))
def test_bad_input_is_a_clear_4xx(server, path, body, status, param):
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    assert err["param"] == param
    # ... and the server keeps serving
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_bad_input_through_the_client(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt="word " * 2000, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="'n' must be <= 16"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=30)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_final_assistant_message_is_continued(server, client):
    """A conversation that ends with an assistant message is continued from its text (llama-server's default,
    vLLM's continue_final_message), not closed and answered anew; continue_final_message: false closes it."""
    user = {"role": "user", "content": "Name a color."}
    started = {"role": "assistant", "content": "The color is"}
    opened = _post(server, "/apply-template", {"messages": [user]}).json()["prompt"]
    prompt = _post(server, "/apply-template", {"messages": [user, started]}).json()["prompt"]
    assert prompt == opened + "The color is"
    expected = _post(server, "/completion", {"prompt": prompt, "n_predict": 8, "temperature": 0,
                                             "n_cmpl": 1}).json()["content"]
    chat = client.chat.completions.create(model=MODEL, messages=[user, started], max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == expected
    streamed = client.chat.completions.create(model=MODEL, messages=[user, started], max_tokens=8, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    closed = _post(server, "/apply-template", {"messages": [user, started], "continue_final_message": False})
    assert closed.json()["prompt"].startswith(prompt) and len(closed.json()["prompt"]) > len(prompt)
    for body, param in (({"messages": [user, started], "continue_final_message": "yes"}, "continue_final_message"),
                        ({"messages": [user], "continue_final_message": True}, "continue_final_message")):
        r = _post(server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_continued_message_follows_the_response_format_as_a_whole(server):
    """With a response format, the final assistant message's text and the answer that continues it make one
    valid JSON document (the grammar reads the message first); the answer used to start a new object after it."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    user = {"role": "user", "content": "Describe Paris as JSON with its city name and population."}
    for started in ('{"city": "', '{"city": "Paris", "population": 2'):
        body = {"model": MODEL, "messages": [user, {"role": "assistant", "content": started}], "max_tokens": 48,
                "temperature": 0, "response_format": fmt}
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]
        assert answer["finish_reason"] == "stop", answer
        whole = json.loads(started + answer["message"]["content"])
        assert set(whole) == {"city", "population"} and isinstance(whole["population"], int)
    r = _post(server, "/v1/chat/completions", {**body, "messages": [user, {"role": "assistant",
                                                                          "content": "Sure! {"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "'S" in r.json()["error"]["message"]


def test_any_model_name_is_served_unless_a_served_name_is_given(server):
    """Without --served-model-name any "model" is served, as llama-server does (clients hard-code names); with it,
    another name is a 404 naming the field, as vLLM's."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    ours = _post(server, "/v1/completions", {**body, "model": MODEL}).json()["choices"][0]["text"]
    assert _post(server, "/v1/completions", {**body, "model": "gpt-4o"}).json()["choices"][0]["text"] == ours
    assert _post(server, "/completion", {"prompt": PROMPT, "n_predict": 6, "model": "gpt-4o"}).json()["content"] \
        == ours
    proc, url = _start("--served-model-name", "coder")
    try:
        for path, request in (("/v1/completions", {**body, "model": "gpt-4"}),
                              ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}]}),
                              ("/completion", {"prompt": "hi", "model": "gpt-4"}),
                              ("/infill", {"input_prefix": "", "input_suffix": "", "model": "gpt-4"})):
            r = httpx.post(url + path, json=request, timeout=60)
            assert r.status_code == 404 and r.json()["error"]["param"] == "model", (path, r.text)
            assert "this server serves 'coder'" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={**body, "model": "coder"}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ours
        assert httpx.get(url + "/v1/models/coder").json()["id"] == "coder"
        r = httpx.get(url + "/v1/models/gpt-4")
        assert r.status_code == 404 and "this server serves 'coder'" in r.json()["error"]["message"]
    finally:
        _stop(proc)


def test_unknown_route_and_method(server):
    assert _post(server, "/v1/nothing", {}).json()["error"]["code"] == "not_found"
    r = httpx.get(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "error" in r.json()


def test_auth(server):
    import openai
    from openai import OpenAI

    bad = OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
              key=None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = _post(server, "/infill", {"input_prefix": "", "input_suffix": ""}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server + "/health").status_code == 200  # health and metrics stay open


# -- disconnects and shutdown ---------------------------------------------------------------------------------

def _wait_idle(url, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _metrics(url)
        if m["speculant_requests_in_progress"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError("the engine stayed busy")


def _assert_counted_once(url, before, endpoint, status, *, not_as, timeout=30):
    """One more request of `endpoint` counted with `status` since the metrics `before` (it is counted a moment
    after the request ends), none more with `not_as`."""
    label = 'speculant_requests_total{endpoint="%s",status="%%s"}' % endpoint
    deadline = time.monotonic() + timeout
    while _metrics(url).get(label % status, 0) == before.get(label % status, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = _metrics(url)
    assert after.get(label % status, 0) == before.get(label % status, 0) + 1
    assert after.get(label % not_as, 0) == before.get(label % not_as, 0)


def test_disconnect_mid_stream_frees_the_slot(server, client):
    before = _metrics(server)
    with httpx.stream("POST", server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True},
                      timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 3:
                break  # leaving the block closes the connection mid-stream
    after = _wait_idle(server)
    assert after["speculant_requests_cancelled_total"] == before["speculant_requests_cancelled_total"] + 1
    generated = after["speculant_completion_tokens_total"] - before["speculant_completion_tokens_total"]
    assert 3 <= generated < 400  # it stopped early, not after 400 tokens
    # the next request is served, with the right answer (no leftover KV state)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text.startswith(" Paris")


def test_disconnect_while_waiting_non_streaming(server, client):
    """A non-streaming client that gives up is dropped too, and others behind it are still answered."""
    before = _metrics(server)
    slow = threading.Thread(target=lambda: _swallow(lambda: httpx.post(
        server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400}, timeout=1.5)))
    slow.start()
    slow.join()
    after = _wait_idle(server)
    assert after["speculant_requests_cancelled_total"] == before["speculant_requests_cancelled_total"] + 1
    assert after["speculant_completion_tokens_total"] - before["speculant_completion_tokens_total"] < 400
    # counted as the client closing its request (499), not as answered (200)
    _assert_counted_once(server, before, "/v1/completions", "499", not_as="200")
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_a_client_that_leaves_while_sending_its_body_is_a_499(server, client):
    """A client (or a proxy that timed out) that closes its connection halfway through the request body: counted
    and logged as 499 (client closed request), no 500, no traceback in the log (the fixture checks it)."""
    host, port = server.rsplit("//", 1)[1].split(":")
    before = _metrics(server)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"messages\":")
    _assert_counted_once(server, before, "/v1/chat/completions", "499", not_as="500")
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4


def test_a_client_that_stops_sending_or_reading_is_given_up_after_the_timeout():
    """--timeout (llama-server's read/write timeout): a body that stops coming is a 408 on a closed connection; a
    stream whose client stops reading (uvicorn's send waits on it, and the slot with it) is cut after the
    timeout, and the slot (-np 1) serves the next request. A timeout below 0 is refused before loading."""
    bad = subprocess.run([SPECULANT, "serve", *COMMON, "--timeout", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--timeout must be a number of seconds >= 0" in bad.stderr, bad.stderr
    proc, url = _start("-np", "1", "--timeout", "2", "-c", "2048")
    try:
        host, port = url.rsplit("//", 1)[1].split(":")
        before = _metrics(url)
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"prompt\":")
            answer = b""
            while chunk := s.recv(4096):  # to the end: the server closes the connection
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), answer
        assert json.loads(body)["error"]["code"] == "request_timeout"
        _assert_counted_once(url, before, "/v1/completions", "408", not_as="499")
        # a body that keeps coming, if slowly, is read to its end: the timeout is on its parts, not its whole
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode()
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
            for i in range(0, len(body), len(body) // 4 + 1):  # 5 s in all, more than the timeout
                s.sendall(body[i:i + len(body) // 4 + 1])
                time.sleep(1.2)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]

        # ~2 KB a token (20 alternatives each): the socket buffers fill after some hundreds of tokens
        ask = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 1900,
               "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}
        raw = json.dumps(ask).encode()
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(raw) + raw)  # and never reads
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and _metrics(url)["speculant_requests_cancelled_total"] == \
                    before["speculant_requests_cancelled_total"]:
                time.sleep(0.5)
            after = _wait_idle(url)
            assert after["speculant_requests_cancelled_total"] == before["speculant_requests_cancelled_total"] + 1
            assert after["speculant_completion_tokens_total"] - before["speculant_completion_tokens_total"] < 1900
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                           timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        _stop(proc)
    out = proc.stdout.read()
    assert "the client took no data for 2 s (--timeout): its stream is cut" in out, out
    assert "Traceback" not in out and "ERROR" not in out, out


def test_a_client_that_leaves_during_its_prompt_stops_the_prompt():
    """A long prompt is processed in passes of 64 tokens; a client that gives up meanwhile stops it between two
    passes (the slot is not held until the whole prompt is done). What it processed stays cached: the same
    prompt asked again finds only that part there, not all of it."""
    proc, url = _start("-c", "4096", "-np", "1")
    try:
        prompt = "word " * 2500
        _swallow(lambda: httpx.post(url + "/v1/completions", timeout=1.0,
                                    json={"model": MODEL, "prompt": prompt, "max_tokens": 4}))
        _wait_idle(url)
        assert _metrics(url)["speculant_requests_cancelled_total"] == 1
        again = httpx.post(url + "/v1/completions", timeout=300,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 1}).json()["usage"]
        assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"] - 64
    finally:
        _stop(proc)


def _swallow(fn):
    try:
        fn()
    except httpx.TimeoutException:
        pass


def test_a_full_queue_is_a_503_that_says_when_to_retry():
    """-np 1 --max-queue 0: while one request generates, the next is refused at once (503 server_overloaded),
    with Retry-After as HTTP clients and proxies read it."""
    proc, url = _start("-np", "1", "--max-queue", "0", "--allowed-origins", "http://chat.example:3000")
    try:
        # (and --allowed-origins: only the page named may call the API from a browser)
        assert _preflight(url, "http://chat.example:3000").headers["access-control-allow-origin"] == \
            "http://chat.example:3000"
        other = _preflight(url, "http://elsewhere.example")
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480,
                                "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # until it generates
            busy = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                              timeout=60)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_overloaded"
        assert busy.headers["retry-after"] == "1" and "(0 requests queued)" in busy.json()["error"]["message"]
        # an idle server admits a request whatever its n or prompts, streamed or not (a streamed n = 2 was
        # refused: each choice counted as a queued request)
        for stream in (False, True):
            for extra in ({"prompt": "Hi", "n": 2}, {"prompt": ["Hi", "Bye"]}):
                r = httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 2, "stream": stream,
                                                                **extra}, timeout=60)
                assert r.status_code == 200, (stream, extra, r.text)
    finally:
        _stop(proc)


def test_a_queued_client_that_leaves_gives_its_place_up_at_once():
    """-np 1 --max-queue 1: a request that is not streamed, queued behind a long one, whose client gives up, leaves
    the queue then (it held its place until the slot freed: every other client got a 503 meanwhile)."""
    proc, url = _start("-np", "1", "--max-queue", "1", "-c", "2048")  # the long one runs for seconds
    try:
        long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # until it generates
            with pytest.raises(httpx.TimeoutException):  # queued behind it; the client gives up
                httpx.post(url + "/v1/completions", json={**long, "max_tokens": 2}, timeout=1.0)
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health").json()["queue_depth"] and time.monotonic() < deadline:
                time.sleep(0.05)
            health = httpx.get(url + "/health").json()
            assert health["queue_depth"] == 0 and health["in_progress"] == 1, health  # the long one goes on
            queued = {}
            waiting = threading.Thread(target=lambda: queued.update(r=httpx.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=120)))
            waiting.start()  # admitted to the queue (it was a 503), answered once the long one ends
            time.sleep(1.0)
            assert "r" not in queued and httpx.get(url + "/health").json()["queue_depth"] == 1
        waiting.join(120)
        assert queued["r"].status_code == 200, queued["r"].text
        assert _metrics(url)["speculant_requests_cancelled_total"] >= 2  # the one that left, the long one
    finally:
        _stop(proc)


def test_the_choices_of_a_request_count_against_the_queue():
    """-np 2 --max-queue 0: a streamed n = 2 request takes both slots, so the next request is refused (it was
    admitted and waited: only a request's first choice was counted), and /health counts it as nothing queued."""
    import asyncio

    proc, url = _start("-np", "2", "--max-queue", "0")
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "n": 2,
                                "temperature": 1.0, "stream": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: {"):
                pass  # until it generates
            deadline = time.monotonic() + 60
            while httpx.get(url + "/health").json()["in_progress"] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            health = httpx.get(url + "/health").json()
            busy = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                              timeout=60)
        assert health["in_progress"] == 2 and health["queue_depth"] == 0
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_overloaded"

        async def burst():  # arriving together, the second is refused before the first's choices run
            async with httpx.AsyncClient(timeout=120) as client:
                async def one():
                    r = await client.post(url + "/v1/completions", json={
                        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "n": 2, "temperature": 1.0})
                    return r.status_code
                return sorted(await asyncio.gather(one(), one()))

        for _ in range(3):
            assert asyncio.run(burst()) == [200, 503]
        assert httpx.get(url + "/health").json()["queue_depth"] == 0  # every place given back
    finally:
        _stop(proc)


LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 150  # ~1500 tokens: seconds of prompt processing


def test_a_burst_is_admitted_up_to_the_queue_and_tokenizing_does_not_wait_for_a_prompt():
    """-np 1 --max-queue 1: of four requests sent at once, two are admitted and two refused (503 before a 200,
    streamed or not); the admission counted against the slots' semaphore let bursts through and refused others
    at random. /tokenize answers while a long prompt is processed (it waited behind it on the slot's thread)."""
    import asyncio

    proc, url = _start("-np", "1", "--max-queue", "1", "-c", "2048")
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                async def one(stream):
                    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "stream": stream}
                    async with client.stream("POST", url + "/v1/completions", json=body) as r:
                        text = (await r.aread()).decode()
                        return r.status_code, text
                return await asyncio.gather(*(one(i % 2 == 0) for i in range(4)))

        for _ in range(3):
            answers = asyncio.run(burst())
            statuses = sorted(status for status, _ in answers)
            assert statuses == [200, 200, 503, 503], answers
            assert all("server_overloaded" in text for status, text in answers if status == 503)
            assert not any('"error"' in text for status, text in answers if status == 200), answers
        done = threading.Event()
        long = threading.Thread(target=lambda: (httpx.post(url + "/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1}), done.set()))
        long.start()
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").json()["in_progress"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.post(url + "/tokenize", json={"content": "Hello"}, timeout=120).status_code == 200
        assert not done.is_set()  # answered during the long prompt's processing
        long.join(300)
    finally:
        _stop(proc)


def test_a_shutdown_during_a_long_prompt_cuts_it_with_an_error():
    """SIGTERM while prompts are processed: past the grace period they are cut with the 'shutting_down' error
    (uvicorn cancelled the handlers: a bare 500, a stream cut without an error event)."""
    proc, url = _start("-np", "2", "-c", "2048", "--shutdown-timeout", "1")
    got = {}

    def request(stream):
        body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8, "stream": stream}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            got[stream] = (r.status_code, [line for line in r.iter_lines() if line])

    threads = [threading.Thread(target=request, args=(stream,)) for stream in (False, True)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").json()["in_progress"] < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    for th in threads:
        th.join(120)
    assert proc.wait(60) == 0
    status, lines = got[False]
    assert status == 503 and json.loads(lines[0])["error"]["code"] == "shutting_down", (status, lines)
    status, lines = got[True]
    assert status == 200 and json.loads(lines[-1][6:])["error"]["code"] == "shutting_down", lines[-3:]


def test_graceful_shutdown_cuts_in_flight_and_exits():
    proc, url = _start("--shutdown-timeout", "2")
    lines = []

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480,
                                "stream": True}) as r:
            lines.extend(line for line in r.iter_lines() if line)

    th = threading.Thread(target=stream)
    th.start()
    deadline = time.monotonic() + 60
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the server hung on shutdown")
    th.join(30)
    assert rc == 0
    assert "Traceback" not in proc.stdout.read()
    last = json.loads(lines[-1][6:]) if lines[-1] != "data: [DONE]" else None
    # either it finished in the grace period or it was cut with an error event; never a silent truncation
    assert last is None or last["error"]["code"] == "shutting_down"


def test_shutdown_answers_queued_requests_at_once():
    """-np 1: one request streams, another waits for the slot; on SIGTERM the waiting one gets its 503 at once,
    while the one in flight still streams (its grace period), not when that one ends or the server exits."""
    proc, url = _start("--shutdown-timeout", "8", "-np", "1")
    tokens, answered = [], []

    def stream():
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480,
                                "stream": True}) as r:
            tokens.extend(1 for line in r.iter_lines() if line)

    def queued():
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        answered.append((r.status_code, r.json()["error"]["code"], len(tokens)))  # events streamed by then

    first = threading.Thread(target=stream)
    first.start()
    deadline = time.monotonic() + 60
    while not tokens and time.monotonic() < deadline:
        time.sleep(0.05)
    second = threading.Thread(target=queued)
    second.start()
    while _metrics(url)["speculant_queue_depth"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    second.join(60)
    first.join(60)
    assert proc.wait(60) == 0
    (status, code, streamed_by_then), = answered
    assert (status, code) == (503, "shutting_down")
    assert streamed_by_then < len(tokens) - 5, (streamed_by_then, len(tokens))  # the stream went on after it


# -- fail fast, log, say what -n means ----------------------------------------------------------------------

def test_busy_port_fails_before_loading_in_one_line():
    import socket

    if not models.cached_path(MODEL).exists():
        pytest.skip(f"{MODEL} not pulled")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([SPECULANT, "serve", *COMMON, "--port", str(port)], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "SPECULANT_VERBOSE": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("speculant: error")] == [
        f"speculant: error: cannot listen on 127.0.0.1:{port}: Address already in use (another server is using "
        f"it; pick one with --port)"]
    assert "serving" not in proc.stderr and "ERROR" not in proc.stderr
    assert "llama_model_loader" not in proc.stdout  # no model was loaded


def test_one_log_line_per_request_and_the_context_full_message():
    proc, url = _start("-c", "64")
    try:
        from openai import OpenAI

        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        _post(url, "/v1/completions", {"model": MODEL, "prompt": 42}, key=None)
        both = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, n=2, temperature=1.0, seed=1)
        httpx.get(url + "/health")
        r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
                                                  "max_tokens": 64}, key=None)
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length" and "context window full" in body["message"]
    finally:
        _stop(proc)
    out = proc.stdout.read()
    lines = [line for line in out.splitlines() if " /v1/" in line]
    assert len(lines) == 4, out
    assert lines[0].startswith("speculant: POST /v1/completions 200 ") and "completion=3/3" in lines[0]
    assert "tau=" in lines[0] and "400 invalid_type" in lines[1]
    # n = 2: both choices (it showed the first one's only)
    assert f"completion={both.usage.completion_tokens}/2x3 " in lines[2], lines[2]
    assert f"prompt={both.usage.prompt_tokens} " in lines[2]
    assert out.count("serving") == 1 and "Uvicorn running" not in out
    assert f"serving {MODEL} with draft {MODEL} (prompt lookup first) on {url}/v1" in out  # the default chain


def test_self_spec_is_named_as_the_drafter():
    """--self-spec: /health, /v1/models and the banner name it (they said no drafter: draft_model null)."""
    pytest.importorskip("torch")
    if not models.cached_path(MODEL).exists():
        pytest.skip(f"{MODEL} not pulled")
    proc, url = spawn_local(["-m", MODEL, "--backend", "torch", "--device", "cpu", "--self-spec-exit", "15", "-c",
                             str(CTX), "-t", "1"], timeout=240, exe=SPECULANT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        assert httpx.get(url + "/health").json()["draft_model"] == "self-spec"
        assert httpx.get(url + "/v1/models").json()["data"][0]["draft_model"] == "self-spec"
    finally:
        _stop(proc)
    out = proc.stdout.read()
    assert f"serving {MODEL} with self-spec (prompt lookup first) on {url}/v1" in out, out


def test_serve_help_says_what_n_means():
    out = subprocess.run([SPECULANT, "serve", "--help"], capture_output=True, text=True).stdout
    assert "max_tokens of requests that do not set it" in " ".join(out.split())
    assert "8080" in out


def test_completions_logprobs_name_partial_characters_by_their_bytes():
    """Tokens that hold part of a UTF-8 character: OpenAI's "bytes:\\x.." names (distinct, so top_logprobs keys do
    not collide and the chosen token's entry is its own), and text_offset counts the characters completed before
    each token, never past the text."""
    from speculant.server import LogprobsFormat
    from speculant.verify import TokenLogprob

    vocab = {0: " \xe3".encode("latin-1"), 1: b"\x81", 2: b"\x8a", 3: b"\x8f", 4: b"!"}  # " お" split, then "!"

    class Vocab:
        def token_bytes(self, token):
            return vocab[token]

    fmt = LogprobsFormat(Vocab(), chat=False)
    entries = [TokenLogprob(0, -0.5, ((0, -0.5), (4, -1.0))), TokenLogprob(1, -0.1, ((2, -0.05), (1, -0.1))),
               TokenLogprob(2, -0.2, ((3, -0.3), (1, -2.0)))]
    first = fmt(entries)
    later = fmt([TokenLogprob(4, -0.7, ((4, -0.7),))])  # the next stream chunk keeps counting
    text = " " + "\u304a" + "!"
    assert first["tokens"] == ["bytes:\\x20\\xe3", "bytes:\\x81", "bytes:\\x8a"] and later["tokens"] == ["!"]
    assert first["top_logprobs"][1] == {"bytes:\\x8a": -0.05, "bytes:\\x81": -0.1}
    assert all(top[name] == lp for top, name, lp in zip(first["top_logprobs"], first["tokens"],
                                                        first["token_logprobs"]))
    offsets = first["text_offset"] + later["text_offset"]
    assert offsets == [0, 1, 1, 2] and all(o <= len(text) for o in offsets)
    assert text[offsets[3]:] == "!"


def test_schemas_in_every_field_llama_server_and_openai_read(server):
    """llama-server's `json_schema` field (/completion, /v1) and a schema under response_format json_object were
    ignored: the answer was free text. A surrogate pair is text and stays accepted; top_k -1 (vLLM's off) is off."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for path, body, read in [
        ("/completion", {"prompt": "A number as JSON:", "n_predict": 24, "json_schema": schema},
         lambda r: r["content"]),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "A number as JSON"}],
                                  "max_tokens": 24, "json_schema": schema},
         lambda r: r["choices"][0]["message"]["content"]),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "A number as JSON"}],
                                  "max_tokens": 24, "response_format": {"type": "json_object", "schema": schema}},
         lambda r: r["choices"][0]["message"]["content"]),
    ]:
        r = _post(server, path, {**body, "temperature": 0})
        assert r.status_code == 200, r.text
        answer = json.loads(read(r.json()))
        assert set(answer) == {"n"} and 0 <= answer["n"] <= 9, (path, answer)
    pair = _post(server, "/completion", '{"prompt": "smile \\ud83d\\ude00", "n_predict": 2}')
    assert pair.status_code == 200, pair.text
    off = [_post(server, "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 6, "seed": 3,
                                            "temperature": 0.9, "top_k": k}).json()["choices"][0]["text"]
           for k in (-1, 0)]
    assert off[0] == off[1]


# -- llama-server's own fields, endpoints and keys ------------------------------------------------------------

QUESTION_2 = [{"role": "user", "content": "What is 2 + 2? Answer briefly."}]  # SmolLM2 ends it in 6 tokens


def _chat(server, **fields):
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION_2, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_predict_and_max_completion_tokens_on_every_endpoint(server):
    """As llama-server reads its aliases on every endpoint: n_predict, else max_completion_tokens, else max_tokens
    (n_predict ran 128 tokens on /v1, and /completion ignored max_completion_tokens)."""
    def used(path, **fields):
        body = {"model": MODEL, "temperature": 0, **fields}
        body.update({"messages": QUESTION_2} if "chat" in path else {"prompt": PROMPT})
        r = _post(server, path, body)
        assert r.status_code == 200, r.text
        res = r.json()
        return res["tokens_predicted"] if path == "/completion" else res["usage"]["completion_tokens"]

    for path in ("/v1/completions", "/v1/chat/completions", "/completion"):
        assert used(path, n_predict=3, max_tokens=20) == 3, path
        assert used(path, n_predict=3, max_completion_tokens=20, max_tokens=20) == 3, path
        assert used(path, max_completion_tokens=2, max_tokens=20) == 2, path
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n_predict": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "" and r.json()["usage"]["completion_tokens"] == 0
    # -1 under any name is no limit, as llama-server reads them all as n_predict (a stop string ends this one)
    assert used("/v1/completions", max_tokens=-1, stop=["."]) == used("/v1/completions", max_tokens=40, stop=["."])
    for name in ("max_tokens", "max_completion_tokens"):
        r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": QUESTION_2, name: -2})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text


def test_repeat_penalty_is_read_under_both_names_everywhere(server):
    """llama-server's repeat_penalty and vLLM's repetition_penalty, one setting on every endpoint (chat ignored
    repeat_penalty); both, with different values, is a 400."""
    base = _chat(server, max_tokens=24)["choices"][0]["message"]["content"]
    llama = _chat(server, max_tokens=24, repeat_penalty=1.8)["choices"][0]["message"]["content"]
    vllm = _chat(server, max_tokens=24, repetition_penalty=1.8)["choices"][0]["message"]["content"]
    assert llama == vllm != base
    assert _chat(server, max_tokens=24, repeat_penalty=1.8, repetition_penalty=1.8)["choices"][0]["message"][
        "content"] == llama
    for path in ("/v1/chat/completions", "/v1/completions", "/completion"):
        r = _post(server, path, {"model": MODEL, "prompt": PROMPT, "messages": QUESTION_2, "repeat_penalty": 1.8,
                                 "repetition_penalty": 1.2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "repeat_penalty", (path, r.text)
    native = [_post(server, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, name: 1.8}).json()
              ["content"] for name in ("repeat_penalty", "repetition_penalty")]
    assert native[0] == native[1]


def test_ignore_eos_generates_past_the_end_of_generation(server):
    """ignore_eos bans every end-of-generation token (a logit bias of -inf, the draft's too), on every endpoint: the
    answer goes on to the token limit, and what comes before the end is the answer without it (greedy)."""
    plain = _chat(server, max_tokens=24)
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 24
    answer = plain["choices"][0]["message"]["content"]
    chat = _chat(server, max_tokens=24, ignore_eos=True)
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 24
    assert chat["choices"][0]["message"]["content"].startswith(answer)
    assert len(chat["choices"][0]["message"]["content"]) > len(answer)
    assert chat["usage"]["speculative"]["drafted"] > 0
    prompt = _post(server, "/apply-template", {"messages": QUESTION_2}).json()["prompt"]
    res = _post(server, "/completion", {"prompt": prompt, "n_predict": 24, "temperature": 0,
                                        "ignore_eos": True}).json()
    assert res["stop_type"] == "limit" and res["tokens_predicted"] == 24
    assert res["content"] == chat["choices"][0]["message"]["content"]
    biased = _post(server, "/completion", {"prompt": prompt, "n_predict": 24, "temperature": 0, "ignore_eos": True,
                                           "logit_bias": {"28": -1}}).json()  # beside a request's own bias
    assert biased["stop_type"] == "limit" and biased["content"].startswith(answer)
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                          "ignore_eos": True}).json()
    assert r["choices"][0]["text"] == res["content"] and r["usage"]["completion_tokens"] == 24
    settings = httpx.get(server + "/slots", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert any(s.get("params", {}).get("ignore_eos") for s in settings)


def test_serve_ignore_eos_flag_is_every_requests_default():
    """`serve --ignore-eos` (llama-server's flag) was an unrecognized argument: now requests that leave the field
    out generate to their limit, and one may still ask for its end (ignore_eos false)."""
    proc, url = _start("--ignore-eos", "-np", "1")
    try:
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION_2, "temperature": 0,
                                                             "max_tokens": 24}, timeout=120).json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 24
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION_2, "temperature": 0,
                                                             "max_tokens": 24, "ignore_eos": False}, timeout=120).json()
        assert r["choices"][0]["finish_reason"] == "stop"
    finally:
        _stop(proc)


NEUTRAL = {"mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0,
           "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"],
           "xtc_probability": 0.0, "xtc_threshold": 0.1, "top_n_sigma": -1.0, "repeat_last_n": 64, "n_keep": 0,
           "dynatemp_range": 0.0, "min_keep": 0,
           "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]}
REFUSED = [("mirostat", {"mirostat": 2}), ("typical_p", {"typical_p": 0.5}),
           ("dry_multiplier", {"dry_multiplier": 0.8}), ("xtc_probability", {"xtc_probability": 0.5}),
           ("top_n_sigma", {"top_n_sigma": 1.0}),
           ("dynatemp_range", {"dynatemp_range": 0.5}), ("repeat_last_n", {"repeat_last_n": -2, "repeat_penalty": 1.3}),
           ("mirostat", {"mirostat": "x"}), ("samplers", {"samplers": ["top_p", "top_k"], "top_k": 5, "top_p": 0.5}),
           ("samplers", {"samplers": {"top_k": 1}})]


@pytest.mark.parametrize("path", ["/completion", "/v1/completions", "/v1/chat/completions"])
def test_llama_server_samplers_are_refused_or_neutral(server, path):
    """llama-server's other samplers, on every endpoint: a value that would change the output is a 400 naming the
    field (they were dropped without a word); the neutral values (llama-server's defaults) pass and change
    nothing; repeat_last_n 0 turns the penalties off, as in llama.cpp."""
    def ask(**fields):
        body = {"model": MODEL, "temperature": 0, "max_tokens": 12, **fields}
        body.update({"messages": QUESTION_2} if "chat" in path else {"prompt": PROMPT})
        return _post(server, path, body)

    def text(r):
        assert r.status_code == 200, r.text
        res = r.json()
        return res["content"] if path == "/completion" else \
            (res["choices"][0].get("message") or {}).get("content") or res["choices"][0].get("text")

    for param, fields in REFUSED:
        r = ask(**fields)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (fields, r.text)
    base = text(ask())
    assert text(ask(**NEUTRAL)) == base
    assert text(ask(xtc_probability=0.5, xtc_threshold=0.6)) == base  # a threshold above 0.5 turns XTC off
    assert text(ask(samplers="kt", typical_p=0.5)) == base  # typical sampling left out of the chain does nothing
    assert text(ask(repeat_last_n=0, repeat_penalty=1.8)) == base != text(ask(repeat_penalty=1.8))
    # the penalties' window, as llama.cpp's: llama-server's endpoints default to its 64, /v1 to OpenAI's and vLLM's
    # (repetition over the prompt and output: the whole context's window); a window of 1 token penalizes less
    default_window = 64 if path == "/completion" else -1
    assert text(ask(repeat_last_n=default_window, repeat_penalty=1.8)) == text(ask(repeat_penalty=1.8))
    assert text(ask(repeat_last_n=1, repeat_penalty=3.0)) != text(ask(repeat_last_n=-1, repeat_penalty=3.0))


def test_completion_reads_logprobs_as_n_probs(server):
    """/completion: llama-server's alias logprobs (when n_probs is not given) asks for completion_probabilities."""
    by_n_probs = _post(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "n_probs": 2})
    by_logprobs = _post(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "logprobs": 2})
    assert by_logprobs.status_code == 200, by_logprobs.text
    probs = by_logprobs.json()["completion_probabilities"]
    assert probs == by_n_probs.json()["completion_probabilities"] and all(len(p["top_logprobs"]) == 2 for p in probs)


def test_completion_post_sampling_probs(server):
    """llama-server's post_sampling_probs with n_probs: probabilities ("prob", "top_probs") of the distribution each
    token was drawn from (top-k 3: at most 3 alternatives, summing to 1, the token among them; temperature 0: the
    token alone, at 1), and the same tokens as without it. On /v1 (whose logprobs are the model's) and with a
    grammar it is a 400 naming it, not ignored."""
    body = {"prompt": PROMPT, "n_predict": 6, "n_probs": 5, "temperature": 0.9, "top_k": 3, "seed": 5}
    r = _post(server, "/completion", {**body, "post_sampling_probs": True})
    assert r.status_code == 200, r.text
    for p in r.json()["completion_probabilities"]:
        top = p["top_probs"]
        assert "logprob" not in p and "top_logprobs" not in p and 1 <= len(top) <= 3
        assert sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-6)
        assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
        assert {t["id"]: t["prob"] for t in top}[p["id"]] == p["prob"]
    assert r.json()["content"] == _post(server, "/completion", body).json()["content"]
    greedy = _post(server, "/completion", {**body, "temperature": 0, "post_sampling_probs": True}).json()
    assert all(p["prob"] == 1.0 and [t["id"] for t in p["top_probs"]] == [p["id"]]
               for p in greedy["completion_probabilities"])
    for path, extra in (("/v1/completions", {"logprobs": 2}), ("/completion", {"grammar": 'root ::= "a"+'})):
        bad = _post(server, path, {**body, **extra, "post_sampling_probs": True})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "post_sampling_probs", bad.text
    assert _post(server, "/v1/completions", {**body, "post_sampling_probs": True}).status_code == 200  # no logprobs


def test_the_infill_sampler_with_a_grammar_is_refused(server):
    """llama.cpp samples a grammar and the infill sampler in an order speculant does not reproduce (a greedy row
    could keep no allowed token): a 400 naming "samplers", on every way a grammar comes."""
    base = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "samplers": ["top_k", "infill", "temperature"]}
    for path, extra in (("/completion", {"grammar": 'root ::= [0-9]+'}),
                        ("/completion", {"json_schema": {"type": "integer"}}),
                        ("/v1/completions", {"response_format": {"type": "json_object"}})):
        r = _post(server, path, {**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "samplers", (path, r.text)
    assert _post(server, "/completion", base).status_code == 200


def test_logit_bias_in_llama_servers_array_form(server):
    """logit_bias as llama-server documents it first: [[id, bias]], [[id, false]] (a ban), [["text", bias]] (each
    token of the text); the object form still works, and both forms go on every endpoint."""
    def complete(path="/completion", **fields):
        body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, **fields}
        r = _post(server, path, body)
        assert r.status_code == 200, r.text
        return r.json()["content"] if path == "/completion" else r.json()["choices"][0]["text"]

    base = _post(server, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 1}).json()
    first = base["completion_probabilities"][0]["id"]
    banned = complete(logit_bias={str(first): -100})
    assert banned != base["content"]
    assert complete(logit_bias=[[first, False]]) == complete(logit_bias=[[first, -100]]) == banned
    assert complete("/v1/completions", logit_bias=[[first, False]]) == banned
    word = base["content"][:base["content"].index(" ", 1)] if " " in base["content"][1:] else base["content"]
    ids = _post(server, "/tokenize", {"content": word}).json()["tokens"]
    by_text = complete(logit_bias=[[word, -100]])
    assert by_text == complete(logit_bias={str(t): -100 for t in ids}) != base["content"]
    for bad in ([[first]], [[first, True]], [[-1, 1]], [[None, 1]], {"text": 1}):
        r = _post(server, "/completion", {"prompt": PROMPT, "logit_bias": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bad, r.text)
    # a control token's text is its pieces, as llama-server tokenizes these texts (parse_special off): banning
    # "<|im_end|>" does not ban the end of the turn (it did: the answer ran to max_tokens)
    chat = {"messages": QUESTION_2, "max_tokens": 64, "temperature": 0}
    plain = _post(server, "/v1/chat/completions", chat).json()["choices"][0]
    assert plain["finish_reason"] == "stop"
    biased = _post(server, "/v1/chat/completions", {**chat, "logit_bias": [["<|im_end|>", False]]}).json()["choices"][0]
    assert biased["finish_reason"] == "stop"


def test_props_slots_models_and_apply_template(server, client):
    """llama-server's GET /props, GET /slots, GET /models, GET /v1/health and POST /apply-template (were 404s)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server + "/props").status_code == 401  # as llama-server: only /health is open
    props = httpx.get(server + "/props", headers=auth).json()
    health = httpx.get(server + "/health").json()
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["total_slots"] == health["slots"]
    assert props["default_generation_settings"]["params"]["n_predict"] == 128
    assert props["default_generation_settings"]["params"]["samplers"] == list(LLAMA_SAMPLERS)  # llama-server's
    assert Path(props["model_path"]).is_file() and props["model_alias"] == MODEL
    assert "<|im_start|>" in props["chat_template"] and props["build_info"].startswith("speculant")
    prompt = _post(server, "/apply-template", {"messages": QUESTION_2}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and QUESTION_2[0]["content"] in prompt
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION_2, max_tokens=12, temperature=0)
    native = _post(server, "/completion", {"prompt": prompt, "n_predict": 12, "temperature": 0}).json()
    assert native["content"] == chat.choices[0].message.content
    assert native["tokens_evaluated"] == chat.usage.prompt_tokens  # the same prompt, token for token
    assert _post(server, "/apply-template", {"messages": []}).status_code == 400
    slots = httpx.get(server + "/slots", headers=auth).json()
    assert [s["id"] for s in slots] == list(range(health["slots"])) and all(s["n_ctx"] == CTX for s in slots)
    assert all(s["speculative"] is True and s["is_processing"] is False for s in slots)
    assert any(s.get("n_prompt_tokens") == chat.usage.prompt_tokens and
               s["next_token"][0]["n_decoded"] == native["tokens_predicted"] for s in slots)
    assert httpx.get(server + "/slots").status_code == 401
    assert httpx.get(server + "/models", headers=auth).json()["data"] == \
        httpx.get(server + "/v1/models", headers=auth).json()["data"]
    assert httpx.get(server + "/models").status_code == 401
    assert httpx.get(server + "/v1/health").json()["status"] == "ok"  # open, as /health


def test_api_keys_as_llama_server_takes_them(server):
    """--api-key takes a comma-separated list (each key works), $LLAMA_API_KEY stands in for the flag, and the key
    may come in X-Api-Key; --no-slots answers /slots with llama-server's 501."""
    r = httpx.get(server + "/v1/models", headers={"X-Api-Key": KEY})
    assert r.status_code == 200, r.text
    assert httpx.get(server + "/v1/models", headers={"X-Api-Key": "wrong"}).status_code == 401
    env = {k: v for k, v in os.environ.items() if k != "SPECULANT_API_KEY"}
    env["LLAMA_API_KEY"] = "key-a,key-b"
    proc, url = spawn_local([*COMMON, "--no-slots"], timeout=120, exe=SPECULANT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    try:
        for key in ("key-a", "key-b"):
            assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert httpx.get(url + "/props", headers={"X-Api-Key": key}).status_code == 200
            assert httpx.get(url + "/v1/models", headers={"Authorization": key}).status_code == 200  # no "Bearer"
        for headers in ({"Authorization": "Bearer key-a,key-b"}, {}, {"X-Api-Key": "key-c"},
                        {"Authorization": "Bearer wrong", "X-Api-Key": "key-a"}, {"Authorization": "Basic key-a"}):
            assert httpx.get(url + "/v1/models", headers=headers).status_code == 401, headers
        assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/v1/health").status_code == 200
        r = httpx.get(url + "/slots", headers={"X-Api-Key": "key-a"})
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    finally:
        _stop(proc)
