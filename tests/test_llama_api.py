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

    llm = LlamaCpp(path, n_ctx=1024, n_threads=1, verbose=False, logits_all=True)
    yield llm
    llm.close()


def test_penalties_echo_logprobs_and_turns_as_llama_cpp_python(path, plain, spec, reference):
    """What differed from llama-cpp-python: its penalties count only the output's last last_n_tokens_size tokens
    (ours counted the prompt: greedy text changed under LangChain's repeat_penalty 1.1); echo with logprobs scores
    the prompt too and text_offset counts from the prompt's start; a final assistant message is a closed turn."""
    for kw in ({"repeat_penalty": 1.3}, {"repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.3}):
        want = reference(PROMPT, max_tokens=30, temperature=0, **kw)["choices"][0]["text"]
        assert [llm(PROMPT, max_tokens=30, temperature=0, **kw)["choices"][0]["text"] for llm in (plain, spec)] == \
            [want, want], kw
    want = reference.create_chat_completion(CHAT, max_tokens=20, temperature=0, repeat_penalty=1.1)
    assert spec.create_chat_completion(CHAT, max_tokens=20, temperature=0, repeat_penalty=1.1)["choices"][0][
        "message"] == want["choices"][0]["message"]
    from llama_cpp import Llama as LlamaCpp

    short = LlamaCpp(path, n_ctx=1024, n_threads=1, verbose=False, last_n_tokens_size=4)
    with Llama(path, n_ctx=1024, n_threads=1, last_n_tokens_size=4) as ours:
        kw = {"max_tokens": 30, "temperature": 0, "repeat_penalty": 1.5}
        assert ours(PROMPT, **kw)["choices"][0]["text"] == short(PROMPT, **kw)["choices"][0]["text"] != \
            plain(PROMPT, **kw)["choices"][0]["text"]  # the window matters here
    short.close()
    question = "Q: Is the sky blue? A:"
    want = reference(question, max_tokens=3, temperature=0, logprobs=0)["choices"][0]["logprobs"]
    generated = plain(question, max_tokens=3, temperature=0, logprobs=0)["choices"][0]["logprobs"]
    assert generated["tokens"] == want["tokens"] and generated["text_offset"] == want["text_offset"]  # from 22
    assert generated["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-3)
    assert [list(t) for t in generated["top_logprobs"]] == [list(t) for t in want["top_logprobs"]]  # the chosen one
    # echo: the prompt's tokens scored too, the first without a logprob (llama-cpp-python's own echo drops the last
    # generated token and misplaces the prompt's values: not compared)
    echoed = plain(question, max_tokens=3, temperature=0, logprobs=0, echo=True)["choices"][0]
    lp, n = echoed["logprobs"], len(plain.tokenize(question.encode()))
    assert echoed["text"] == question + "".join(want["tokens"]) == "".join(lp["tokens"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == n + 3
    assert lp["text_offset"][n:] == want["text_offset"] and lp["token_logprobs"][n:] == generated["token_logprobs"]
    turns = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"},
             {"role": "user", "content": "Again"}][:2]
    assert plain.create_chat_completion(turns, max_tokens=8, temperature=0)["choices"][0]["message"] == \
        reference.create_chat_completion(turns, max_tokens=8, temperature=0)["choices"][0]["message"]


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
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and spec.last_stats.generated_tokens == 20
    # an answer cut by max_tokens after the start of a stop string ("\n" of "\n\n"): that text was never streamed
    from speculant.engine import Result
    from speculant.stats import SpecStats

    for llm in (plain, spec):
        whole = llm(PROMPT, max_tokens=3, temperature=0, stop=["\n\n"])["choices"][0]["text"]
        chunks = list(llm(PROMPT, max_tokens=3, temperature=0, stop=["\n\n"], stream=True))
        assert whole.endswith("\n") and "".join(c["choices"][0]["text"] for c in chunks) == whole, chunks
        result = Result("", [], SpecStats())
        events = list(llm.engine.stream(PROMPT, max_tokens=3, stop=["\n\n"], result=result))
        assert "".join(e.text for e in events) == result.text == whole
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
    n = len(plain.tokenize(b"Once"))
    assert echoed["text"].startswith("Once") and echoed["text"] == "".join(lp["tokens"])
    assert lp["text_offset"][n] == len("Once") and len(lp["token_logprobs"]) == n + 4
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])  # 2 and the chosen one
    chat = spec.create_chat_completion(CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == chat["choices"][0]["message"]["content"]
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in content)


def test_what_integrations_construct_and_call_is_taken(path, plain):
    """LangChain's LlamaCpp passes f16_kv, n_parts, lora_path/lora_base None and tutorials n_gpu_layers -1 (llama-cpp-
    python swallows what it does not know); llama-index reads context_params.n_ctx; a random seed is llama.cpp's
    0xFFFFFFFF; streamed logprobs come with their chunk; a context overflow is a ValueError, as llama-cpp-python's."""
    import llama_cpp

    langchain = dict(f16_kv=True, n_parts=-1, lora_path=None, lora_base=None, n_gpu_layers=-1, n_batch=8,
                     use_mlock=False, verbose=False, rope_freq_scale=1.0)
    with pytest.raises(SettingsError, match="rope_freq_base=10000.0: this model's own is 100000"):
        Llama(model_path=path, n_ctx=256, n_threads=1, rope_freq_base=10000.0, **langchain)  # LangChain's default
    with Llama(model_path=path, n_ctx=256, n_threads=1, rope_freq_base=100000.0, **langchain) as llm:
        assert llm.context_params.n_ctx == 256
        texts = [llm(PROMPT, max_tokens=12, temperature=1.5)["choices"][0]["text"] for _ in range(4)]
        assert len(set(texts)) > 1  # each call draws its seed from the last one, as llama-cpp-python's
        llm.set_seed(llama_cpp.LLAMA_DEFAULT_SEED)
        assert [llm(PROMPT, max_tokens=12, temperature=1.5)["choices"][0]["text"] for _ in range(4)] == texts
        sticky = [llm(PROMPT, max_tokens=12, temperature=1.5, seed=7)["choices"][0]["text"] for _ in range(2)]
        assert sticky[0] == sticky[1] and llm._seed == 7  # a call's seed sticks (set_seed), as there
        llm.reset()
        with pytest.raises(ValueError, match="context"):
            llm("word " * 400, max_tokens=4)
        with pytest.raises(AttributeError, match="token-level interface"):
            llm.eval([1, 2])
        assert not hasattr(llm, "no_such_thing")
    chunks = list(plain(PROMPT, max_tokens=6, temperature=0, logprobs=1, stream=True))
    per_chunk = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["text"]]
    assert per_chunk and all(lp and len(lp["tokens"]) >= 1 for lp in per_chunk)
    assert "usage" not in chunks[-1]  # llama-cpp-python's chunks have none
    assert plain(PROMPT, max_tokens=8, top_p=0.0)["choices"][0]["text"] == \
        plain(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]  # top_p 0 keeps the likeliest token
    assert plain(PROMPT, max_tokens=4, temperature=-1, seed=1)["usage"]["completion_tokens"] == 4
    assert plain(PROMPT, max_tokens=4.0, temperature=0)["usage"]["completion_tokens"] == 4
    with Llama(path, n_ctx=256, n_threads=1, last_n_tokens_size=0) as off:  # llama.cpp's window 0: no penalties
        assert off(PROMPT, max_tokens=20, temperature=0, repeat_penalty=1.8)["choices"][0]["text"] == \
            plain(PROMPT, max_tokens=20, temperature=0)["choices"][0]["text"]


def test_what_it_has_not_is_refused_not_ignored(plain, path):
    for call in (lambda: plain(PROMPT, mirostat_mode=2), lambda: plain(PROMPT, typical_p=0.5),
                 lambda: plain(PROMPT, logits_processor=[lambda ids, logits: logits]),
                 lambda: plain.create_chat_completion(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]),
                 lambda: plain.create_chat_completion(CHAT, response_format={"type": "xml"}),
                 lambda: plain(PROMPT, seed=-5), lambda: plain.detokenize([plain.n_vocab()]),
                 lambda: Llama(path, chat_format="llama-2"), lambda: Llama(path, lora_path="x.gguf"),
                 lambda: Llama(path, rope_freq_scale=0.5), lambda: Llama(path, draft_model=3)):
        with pytest.raises(SettingsError):
            call()
    assert plain(PROMPT, max_tokens=2, mirostat_mode=0, typical_p=1.0, temperature=0)["usage"]["completion_tokens"] == 2
