"""llama-server's /infill (code completion at a cursor, as llama.vim and llama.vscode ask for it): the prompt's
layout (repository-level with the model's tokens, snippets without) and how it is cut to fit the context, the
n_indent and t_max_predict_ms stopping rules against a reference, and the endpoint end to end on Qwen2.5-Coder
0.5B through a real server: the same answer as /v1/completions over the same prompt, streamed or not, and
speculative (prompt lookup copying from the other files) equal to plain decoding."""

import dataclasses
import itertools
import json
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculant.engine import Engine
from speculant.errors import ContextOverflowError, SettingsError
from speculant.server import InfillStop, ServerConfig, _fields, parse_native

from synthetic import TableBackend

PRE, SUF, MID, REPO, SEP = 1, 2, 3, 4, 5


class CharBackend(TableBackend):
    """One token per character (ids = code points): the prompt's layout can be read back exactly."""

    def __init__(self, repo: bool, n_ctx: int = 256):
        super().__init__(n_vocab=128, n_ctx=n_ctx)
        self.repo = repo

    def tokenize(self, text, add_special=True):
        return [ord(c) for c in text]

    def fim_tokens(self):
        return PRE, SUF, MID

    def fim_repo_tokens(self):
        return (REPO, SEP) if self.repo else None


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


# -- the prompt -----------------------------------------------------------------------------------------------
HEADER = [REPO] + chars("myproject\n") + [SEP] + chars("filename\n")  # llama-server's, chunks or not


def test_repository_level_layout():
    engine = Engine(CharBackend(repo=True))
    tokens, cut = engine.infill_prompt("def f():\n", "\nf()\n", extra=[("a.py", "A = 1\n"), ("b.py", "B")],
                                       middle="    ")
    assert not cut
    assert tokens == ([REPO] + chars("myproject\n") + [SEP] + chars("a.py\nA = 1\n") + [SEP] + chars("b.py\nB")
                      + [SEP] + chars("filename\n") + [PRE] + chars("def f():\n    ") + [SUF] + chars("\nf()\n")
                      + [MID])
    # without extra chunks: the repository header still comes first, as llama-server writes it, then the
    # fill-in-the-middle prompt of /v1/completions' suffix
    assert engine.infill_prompt("def f():\n", "\nf()\n")[0] == HEADER + engine.fim_prompt("def f():\n", "\nf()\n")


def test_suffix_prefix_middle_layout():
    """--spm-infill: the suffix before the prefix; typing on the cursor's line changes only the prompt's end."""
    engine = Engine(CharBackend(repo=True))
    tokens, _ = engine.infill_prompt("def f():\n", "\nf()\n", extra=[("a.py", "A")], middle="    ", spm=True)
    assert tokens == ([REPO] + chars("myproject\n") + [SEP] + chars("a.py\nA") + [SEP] + chars("filename\n")
                      + [SUF] + chars("\nf()\n") + [PRE] + chars("def f():\n    ") + [MID])
    typed, _ = engine.infill_prompt("def f():\n", "\nf()\n", extra=[("a.py", "A")], middle="    re", spm=True)
    assert typed[:len(tokens) - 1] == tokens[:-1]


def test_snippet_layout_without_repository_tokens():
    tokens, _ = Engine(CharBackend(repo=False)).infill_prompt("p", "s", extra=[("a.py", "A"), ("b.py", "B")])
    snippet = chars("\n\n--- snippet ---\n\n")
    assert tokens == snippet + chars("A") + snippet + chars("B") + [PRE] + chars("p") + [SUF] + chars("s") + [MID]


def test_cut_to_fit_keeps_the_code_nearest_the_cursor():
    engine = Engine(CharBackend(repo=True, n_ctx=100))
    prefix, suffix = "".join(chr(48 + i % 40) for i in range(200)), "".join(chr(88 + i % 30) for i in range(200))
    tokens, cut = engine.infill_prompt(prefix, suffix, extra=[("x", "X" * 10)], room=20)
    assert cut and len(tokens) == 100 - 20  # everything the room leaves is used
    at_suf = tokens.index(SUF)
    kept_prefix, kept_suffix = tokens[tokens.index(PRE) + 1:at_suf], tokens[at_suf + 1:-1]
    assert kept_prefix == chars(prefix)[-len(kept_prefix):]  # the end of the prefix
    assert kept_suffix == chars(suffix)[:len(kept_suffix)]  # the start of the suffix
    assert len(kept_suffix) >= (len(kept_prefix) + len(kept_suffix)) // 4  # at least a quarter of the code
    assert tokens[0] == REPO and chars("x\n" + "X" * 10) == tokens[12:24]  # the chunk fits whole
    # a chunk that fits whole is kept, an earlier one that does not is left out; the code keeps at least half
    tokens, cut = engine.infill_prompt(prefix, "s", extra=[("x", "X" * 30), ("y", "Y" * 3)], room=20)
    assert cut and tokens[:tokens.index(PRE)] == [REPO] + chars("myproject\n") + [SEP] + chars("y\nYYY") + [SEP] \
        + chars("filename\n")
    assert len(tokens) - tokens.index(PRE) - 3 >= (100 - 20 - 3) // 2  # prefix and suffix
    assert len(tokens) == 100 - 20  # the room the left-out chunk would have had is the code's
    # one chunk too long for its share: the code takes all the room (it used to get half, the rest left empty)
    tokens, cut = engine.infill_prompt(prefix, suffix, extra=[("x", "X" * 60)], room=20)
    assert cut and len(tokens) == 100 - 20 and tokens[:tokens.index(PRE)] == HEADER
    # nothing to cut: all kept; a long prefix without chunks takes all the room the header leaves
    tokens, cut = engine.infill_prompt("p", suffix[:50], room=20)
    assert not cut and tokens == HEADER + [PRE] + chars("p") + [SUF] + chars(suffix[:50]) + [MID]
    tokens, cut = engine.infill_prompt(prefix, "", room=20)
    assert cut and tokens == HEADER + [PRE] + chars(prefix)[-(100 - 20 - 3 - len(HEADER)):] + [SUF, MID]
    with pytest.raises(ContextOverflowError, match="no room"):
        engine.infill_prompt("p", "s", room=97)


def test_a_model_without_fim_tokens_is_refused():
    backend = CharBackend(repo=False)
    backend.fim_tokens = lambda: None
    with pytest.raises(SettingsError, match="no fill-in-the-middle tokens"):
        Engine(backend).infill_prompt("p", "s")


# -- the stopping rules ---------------------------------------------------------------------------------------
def reference_indent_cut(text: str, n_indent: int):
    """What n_indent keeps of a whole text: up to the first non-indentation character of the first line after
    the first that begins with fewer than n_indent spaces or tabs (None: nothing is cut)."""
    lines = text.split("\n")
    at = len(lines[0]) + 1
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip(" \t"))
        complete_or_written = indent < len(line) or at + len(line) < len(text)  # a character after the indentation
        if complete_or_written and indent < n_indent:
            return text[:at + indent]
        at += len(line) + 1
    return None


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=" \tx\n", max_size=40), st.integers(0, 5), st.lists(st.integers(1, 6), max_size=40))
def test_n_indent_matches_the_reference(text, n_indent, sizes):
    rule, kept, at, ended = InfillStop(n_indent=n_indent), [], 0, False
    for size in sizes + [len(text)]:  # the text in pieces of the given sizes, then the rest
        if at >= len(text):
            break
        piece, ended = rule.add(text[at:at + size])
        kept.append(piece)
        at += size
        if ended:
            break
    expected = reference_indent_cut(text, n_indent) if n_indent else None
    if expected is None:
        assert not ended and "".join(kept) == text == rule.text
    else:
        assert ended and rule.ended == "n_indent" and "".join(kept) == expected == rule.text


def test_n_indent_stops_at_the_end_of_the_block():
    rule = InfillStop(n_indent=4)
    out = [rule.add(p) for p in ["return", " x\n", "    ", "\n", "    y = 1\n", "\n", "def g"]]
    assert out[:5] == [("return", False), (" x\n", False), ("    ", False), ("\n", False), ("    y = 1\n", False)]
    assert out[5] == ("", True)  # an empty line: its indentation (none) is less than 4
    assert rule.text == "return x\n    \n    y = 1\n"


def test_t_max_predict_ms_ends_at_the_next_new_line():
    now = [0.0]
    rule = InfillStop(t_max_ms=100, clock=lambda: now[0])
    assert rule.add("a = 1") == ("a = 1", False)
    now[0] = 0.5  # past the limit, but no new line yet
    assert rule.add(" + 2") == (" + 2", False)
    assert rule.add("\nb") == ("\nb", True) and rule.ended == "t_max_predict_ms"
    fast = InfillStop(t_max_ms=100, clock=lambda: 0.0)
    assert fast.add("x\n") == ("x\n", False) and fast.add("y\n") == ("y\n", False)


def test_response_fields_and_request_fields():
    res = {"content": "x", "timings": {"prompt_n": 3, "predicted_n": 4}, "stop": True}
    assert _fields(res, ["content", "timings/prompt_n", "timings/nope", "nope/x"]) == \
        {"content": "x", "timings/prompt_n": 3}
    assert _fields(res, None) is res and _fields(res, []) is res
    cfg = ServerConfig("m", max_tokens=128, infill_vocab=lambda: "the target's")
    job, fields = parse_native({"input_prefix": "a", "input_suffix": "b", "prompt": "c", "n_predict": -1,
                                "seed": -1, "repeat_penalty": 1.1, "samplers": ["penalties", "top_k", "infill"],
                                "cache_prompt": True, "t_max_prompt_ms": 500, "n_indent": 2,
                                "input_extra": [{"text": "t"}], "response_fields": ["content"]}, cfg, 1000,
                                infill=True)
    assert job.max_tokens == 1000 and job.params.seed is None and job.params.repetition_penalty == 1.1
    assert job.params.temperature == 1.0  # left out of "samplers": llama-server's chain then samples at 1
    assert job.params.infill == "the target's" and job.params.infill_after == ""  # top_k is off: first
    assert job.infill == {"prefix": "a", "suffix": "b", "middle": "c", "extra": [("tmp", "t")], "room": 250,
                          "spm": False}
    assert job.stop_rule.n_indent == 2 and fields == ["content"]
    job, _ = parse_native({"input_prefix": "", "input_suffix": "", "seed": 7}, cfg, 1000, infill=True)
    assert job.max_tokens == 128 and job.params.seed == 7 and job.stop_rule is None
    assert job.infill["room"] == 128
    job, _ = parse_native({"input_prefix": "", "input_suffix": ""}, ServerConfig("m", spm_infill=True), 1000,
                          infill=True)
    assert job.infill["spm"] is True


# -- real models -------------------------------------------------------------------------------------------------
SHAPES = ("class Circle:\n    def __init__(self, r):\n        self.r = r\n\n    def area(self):\n"
          "        return 3.14159 * self.r ** 2\n\n    def perimeter(self):\n        return 2 * 3.14159 * self.r\n\n"
          "    def scaled(self, factor):\n        return Circle(self.r * factor)\n")
PREFIX = ("from geometry.shapes import Circle\n\n\nclass Square:\n    def __init__(self, side):\n"
          "        self.side = side\n\n    def area(self):\n")
MIDDLE = "        "
SUFFIX = "\n\n\ndef total_area(shapes):\n    return sum(s.area() for s in shapes)\n"
EXTRA = [("geometry/shapes.py", SHAPES)]


@pytest.mark.models
def test_speculative_infill_is_plain_decoding_qwen(qwen_target, qwen_draft):
    """Greedy completion at the cursor with the other file in the prompt: prompt lookup (copying from it) and the
    draft model give plain decoding's tokens."""
    from speculant.drafters import CompositeDrafter, LookupDrafter, ModelDrafter

    plain = Engine(qwen_target)
    tokens, cut = plain.infill_prompt(PREFIX, SUFFIX, extra=EXTRA, middle=MIDDLE, room=64)
    assert not cut
    rep, sep = qwen_target.fim_repo_tokens()
    assert [qwen_target.token_text(t) for t in (rep, sep)] == [b"<|repo_name|>", b"<|file_sep|>"]
    assert tokens[0] == rep and tokens.count(sep) == 2
    reference = plain.generate(tokens, max_tokens=64)
    assert reference.text.strip()
    for drafter in (LookupDrafter(), CompositeDrafter(LookupDrafter(), ModelDrafter(qwen_draft, qwen_target.n_vocab))):
        out = Engine(qwen_target, drafter, draft_max=4).generate(tokens, max_tokens=64)
        assert out.tokens == reference.tokens and out.stats.drafted > 0


# -- through the server ----------------------------------------------------------------------------------------
SERVER_MODEL = "qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0"
CTX = 1024


def _serve(*flags):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from speculant import models
    from speculant.server import spawn_local

    if not models.cached_path(SERVER_MODEL).exists():
        pytest.skip(f"{SERVER_MODEL} not pulled")
    exe = str(Path(sys.executable).with_name("speculant"))
    proc, url = spawn_local(["-m", SERVER_MODEL, "-md", "lookup", "-c", str(CTX), "-t", "1", "-np", "1", *flags],
                            timeout=180, exe=exe, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    out = proc.stdout.read()
    assert proc.returncode == 0 and "Traceback" not in out, out


@pytest.fixture(scope="module")
def server():
    yield from _serve()


@pytest.fixture(scope="module")
def tokenizer():
    """The server's model in this process, for the prompts it should build."""
    from conftest import _backend

    backend = _backend(SERVER_MODEL, n_ctx=CTX)
    yield Engine(backend)
    backend.close()


BODY = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": MIDDLE, "input_extra":
        [{"filename": "geometry/shapes.py", "text": SHAPES}], "n_predict": 48, "temperature": 0}


def _infill(url, **kw):
    r = httpx.post(url + "/infill", json={**BODY, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.models
def test_infill_answers_as_completions_over_the_same_prompt(server, tokenizer):
    res = _infill(server)
    tokens, _ = tokenizer.infill_prompt(PREFIX, SUFFIX, extra=EXTRA, middle=MIDDLE, room=48)
    assert res["tokens_evaluated"] == len(tokens) and res["truncated"] is False and res["stop"] is True
    same = httpx.post(server + "/v1/completions", json={"prompt": tokens, "max_tokens": 48, "temperature": 0},
                      timeout=120).json()
    assert res["content"] == same["choices"][0]["text"] and res["content"].strip()
    assert res["stop_type"] == ("eos" if same["choices"][0]["finish_reason"] == "stop" else "limit")
    t = res["timings"]
    assert t["predicted_n"] == res["tokens_predicted"] > 0 and t["prompt_n"] <= len(tokens)
    assert set(t) >= {"prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms",
                      "predicted_per_token_ms", "predicted_per_second"}  # what llama.vim shows
    assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / t["predicted_n"])
    assert res["speculative"]["generated_tokens"] == res["tokens_predicted"]
    probs = _infill(server, n_probs=1)["completion_probabilities"]  # llama-server's logprobs
    assert len(probs) == res["tokens_predicted"] and b"".join(bytes(p["bytes"]) for p in probs).decode() == \
        res["content"] and all(p["top_logprobs"][0]["id"] == p["id"] for p in probs)  # greedy: each the top one
    # streamed as llama-server streams it: content pieces, then a last event with stop and the timings
    events = []
    with httpx.stream("POST", server + "/infill", json={**BODY, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(json.loads(line[6:]))
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == res["content"] and events[-1]["content"] == ""
    assert events[-1]["timings"]["predicted_n"] == res["tokens_predicted"]


@pytest.mark.models
def test_llama_vims_sampler_chain_samples_with_the_infill_sampler(server, tokenizer):
    """llama.vim's request (top_k 40, top_p 0.99, samplers top_k, top_p, infill; no temperature in the chain: 1),
    seeded: the very tokens plain decoding draws with llama.cpp's infill sampler after top-p (a seed fixes them
    whatever is drafted), which are not those drawn without it."""
    from speculant.verify import SamplingParams

    tokens, _ = tokenizer.infill_prompt(PREFIX, SUFFIX, extra=EXTRA, middle=MIDDLE, room=48)
    vim = {"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99}
    differs = 0
    for seed in (3, 11):
        params = SamplingParams(1.0, top_k=40, top_p=0.99, seed=seed, infill=tokenizer.target.infill_vocab(),
                                infill_after="top_p")
        want = tokenizer.generate(tokens, max_tokens=48, params=params)
        res = _infill(server, **vim, seed=seed)
        assert res["content"] == want.text and res["tokens_predicted"] == len(want.tokens), seed
        without = tokenizer.generate(tokens, max_tokens=48, params=dataclasses.replace(params, infill=None))
        differs += without.tokens != want.tokens
    assert differs
    bad = httpx.post(server + "/infill", json={**BODY, "samplers": ["infill", "top_k", "infill"]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "samplers"


@pytest.mark.models
def test_n_predict_0_caches_the_prompt_as_editors_send_it_ahead(server):
    """llama.vim sends its context ahead with n_predict 0 (llama-server processes and caches the prompt): it was a
    400, so the editor's next request processed everything again."""
    fresh = {**BODY, "input_prefix": f"# warm-up {time.time_ns()}\n" + PREFIX}
    warm = httpx.post(server + "/infill", json={**fresh, "n_predict": 0}, timeout=120)
    assert warm.status_code == 200, warm.text
    assert warm.json()["content"] == "" and warm.json()["tokens_predicted"] == 0
    res = _infill(server, input_prefix=fresh["input_prefix"])
    assert res["timings"]["prompt_n"] == 1 and res["content"].strip()  # all but the last token was cached


@pytest.mark.models
def test_infill_stopping_rules_and_fields(server, tokenizer):
    # end-of-generation tokens banned, so that the answer runs to 160 tokens, over several lines, on any CPU
    target = tokenizer.target
    no_end = {str(t): -100 for t in range(target.n_vocab) if target.is_eog(t)}
    long = _infill(server, n_predict=160, logit_bias=no_end)["content"]
    lines = long.split("\n")
    assert len(lines) > 2, long
    for n_indent in (4, 8):
        res = _infill(server, n_predict=160, n_indent=n_indent, logit_bias=no_end)
        expected = reference_indent_cut(long, n_indent)
        assert res["content"] == (expected if expected is not None else long)
        if expected is not None:
            assert res["stop_type"] == "limit"
    # a generation that ends on text held back as the start of a stop string: the rule reads that tail too (it
    # came after the last event, and the answer kept the dedented line)
    cut = reference_indent_cut(long, 4)
    assert cut is not None, long
    probs = _infill(server, n_predict=160, n_probs=1, logit_bias=no_end)["completion_probabilities"]
    ends = list(itertools.accumulate(len(bytes(p["bytes"])) for p in probs))  # bytes of text after each token
    last = next(j for j, end in enumerate(ends) if end > len(cut.encode()))  # the token with the dedented char
    text = long.encode()[:ends[last]].decode()
    held = text[long.rfind("\n", 0, len(cut)):]  # from the new line before the dedented line
    res = _infill(server, n_predict=last + 1, n_indent=4, stop=[held + "\u2603never"], logit_bias=no_end)
    assert res["content"] == cut != text and res["stop_type"] == "limit"
    res = _infill(server, n_predict=160, t_max_predict_ms=1, logit_bias=no_end)  # past 1 ms: the first new line
    assert res["content"] == long[:len(res["content"])] and "\n" in res["content"]
    assert len(res["content"]) < len(long) and res["stop_type"] == "limit"
    # the engine's own end ran before the answer was made (the rule ends it from outside): its stats are whole
    assert res["speculative"]["peak_rss_mb"] > 0 and res["speculative"]["model_memory_mb"], res["speculative"]
    short = httpx.post(server + "/infill", json={**BODY, "response_fields": ["content", "timings/predicted_n"]},
                       timeout=120).json()
    assert set(short) == {"content", "timings/predicted_n"} and short["content"] == _infill(server)["content"]


@pytest.mark.models
def test_infill_cuts_what_does_not_fit(server):
    prefix = "".join(f"value_{i} = {i}\n" for i in range(400))  # ~3000 tokens: over the 1024 context
    res = _infill(server, input_prefix=prefix, n_predict=16)
    assert res["truncated"] is True and res["tokens_evaluated"] <= CTX - 16 and res["stop"] is True
    assert _infill(server, n_predict=16)["truncated"] is False


@pytest.fixture(scope="module")
def spm_server():
    yield from _serve("--spm-infill")


@pytest.mark.models
def test_spm_infill_evaluates_only_what_was_typed(server, spm_server, tokenizer):
    """--spm-infill: the prompt is suffix, prefix, middle (the same answer as /v1/completions over it), so the
    next keystroke's request evaluates only the end of the cursor's line; in the default order the suffix after
    it is evaluated again."""
    tokens, _ = tokenizer.infill_prompt(PREFIX, SUFFIX, extra=EXTRA, middle=MIDDLE, room=48, spm=True)
    res = _infill(spm_server)
    assert res["tokens_evaluated"] == len(tokens)
    same = httpx.post(spm_server + "/v1/completions", json={"prompt": tokens, "max_tokens": 48, "temperature": 0},
                      timeout=120).json()
    assert res["content"] == same["choices"][0]["text"]
    suffix_tokens = len(tokenizer.target.tokenize(SUFFIX, add_special=False))
    for url, at_most in ((spm_server, 6), (server, None)):
        _infill(url)  # the cursor's line so far, then the user types on
        typed = _infill(url, prompt=MIDDLE + "return")["timings"]["prompt_n"]
        if at_most is not None:
            assert typed <= at_most
        else:
            assert typed > suffix_tokens
