"""speculant.Llama: llama-cpp-python's high-level API (create_completion, create_chat_completion, tokenize,
detokenize), checked against llama-cpp-python's own Llama on the same GGUF (SmolLM2-135M), and speculative
(prompt lookup, llama-cpp-python's LlamaPromptLookupDecoding) against plain."""

import json

import pytest

from speculant import Llama, models
from speculant.errors import SettingsError

pytestmark = pytest.mark.models

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def path():
    p = models.cached_path(MODEL)
    if not p.exists():
        pytest.skip(f"{MODEL} not pulled")
    return str(p)


@pytest.fixture(scope="module")
def plain(path):
    with Llama(path, n_ctx=1024, n_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def spec(path):
    with Llama(path, draft_model="lookup", n_ctx=1024, n_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(path, plain):
    """llama-cpp-python's own Llama over the same llama.cpp build (speculant loaded its CPU backends)."""
    from llama_cpp import Llama as LlamaCpp

    llm = LlamaCpp(path, n_ctx=1024, n_threads=1, verbose=False)
    yield llm
    llm.close()


def test_code_written_for_llama_cpp_python_gets_its_answers(plain, spec, reference):
    """The same calls, the same greedy text (and token counts) as llama-cpp-python's Llama; speculative the same."""
    want = reference(PROMPT, max_tokens=24, temperature=0)
    for llm in (plain, spec):
        got = llm(PROMPT, max_tokens=24, temperature=0)
        assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
        assert got["usage"] == want["usage"]
    want = reference.create_chat_completion(CHAT, max_tokens=20, temperature=0)
    for llm in (plain, spec):
        got = llm.create_chat_completion(CHAT, max_tokens=20, temperature=0)
        assert got["object"] == "chat.completion"
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["usage"] == want["usage"]
    assert plain.tokenize(b"Hello world") == reference.tokenize(b"Hello world")
    assert plain.detokenize(plain.tokenize(b"Hello world", add_bos=False)) == b"Hello world"
    assert plain.n_ctx() == 1024 and plain.n_vocab() == reference.n_vocab()


def test_streams_join_to_the_answer_and_sampling_is_plain_decodings(plain, spec, path):
    whole = plain(PROMPT, max_tokens=30, temperature=0, stop=["\n\n"])
    chunks = list(spec(PROMPT, max_tokens=30, temperature=0, stop=["\n\n"], stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"] == "stop"
    answer = plain.create_chat_completion(CHAT, max_tokens=20, temperature=0)["choices"][0]["message"]["content"]
    chunks = list(spec.create_chat_completion(CHAT, max_tokens=20, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == answer
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 20
    # seeded sampling (llama-cpp-python's defaults: T 0.8, top-k 40, top-p 0.95, min-p 0.05): the same text
    # every time, speculative or not; llama-cpp-python's prompt lookup object drafts the same way
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    with Llama(path, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4), n_ctx=1024, n_threads=1) as lookup:
        texts = {llm(PROMPT, max_tokens=24, seed=7)["choices"][0]["text"] for llm in (plain, spec, lookup, plain)}
        assert lookup.engine.draft_max == 4
    assert len(texts) == 1
    assert plain(PROMPT, max_tokens=24, seed=8)["choices"][0]["text"] != texts.pop()  # the seed matters


def test_response_formats_grammars_logprobs_and_echo(plain, spec):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    for llm in (plain, spec):
        got = llm.create_chat_completion(CHAT, response_format=fmt, max_tokens=40, temperature=0)["choices"][0]
        assert got["finish_reason"] == "stop" and json.loads(got["message"]["content"])["color"] in schema[
            "properties"]["color"]["enum"]
    # llama-cpp-python's own spelling of a schema, and a GBNF grammar
    got = plain.create_chat_completion(CHAT, response_format={"type": "json_object", "schema": schema},
                                       max_tokens=40, temperature=0)["choices"][0]["message"]["content"]
    assert json.loads(got)["color"] in ("red", "green", "blue")
    yes = plain("Is the sky blue? Answer:", grammar='root ::= " yes" | " no"', max_tokens=8, temperature=0)
    assert yes["choices"][0]["text"] in (" yes", " no")
    echoed = plain("Once", max_tokens=4, temperature=0, logprobs=2, echo=True)["choices"][0]
    lp = echoed["logprobs"]
    assert echoed["text"].startswith("Once") and echoed["text"] == "Once" + "".join(lp["tokens"])
    assert lp["text_offset"][0] == len("Once") and len(lp["token_logprobs"]) == 4
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    chat = spec.create_chat_completion(CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == chat["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in content)


def test_what_it_has_not_is_refused_not_ignored(plain, path):
    for call in (lambda: plain(PROMPT, mirostat_mode=2), lambda: plain(PROMPT, typical_p=0.5),
                 lambda: plain(PROMPT, logits_processor=[lambda ids, logits: logits]),
                 lambda: plain.create_chat_completion(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]),
                 lambda: plain.create_chat_completion(CHAT, response_format={"type": "xml"}),
                 lambda: plain(PROMPT, seed=-5), lambda: plain.detokenize([plain.n_vocab()]),
                 lambda: Llama(path, n_gpu_layers=99), lambda: Llama(path, draft_model=3)):
        with pytest.raises(SettingsError):
            call()
    with pytest.raises(TypeError, match="unexpected keyword argument 'n_gpu_layer'"):
        Llama(path, n_gpu_layer=0)
    assert plain(PROMPT, max_tokens=2, mirostat_mode=0, typical_p=1.0, temperature=0)["usage"]["completion_tokens"] == 2
