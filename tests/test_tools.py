"""Tool calling (speculant/tools.py): request validation, the prompt the template renders, the grammar that
forces calls, and the answers parsed back into OpenAI tool_calls."""

import json

import numpy as np
import pytest

from speculant import chat
from speculant.tools import CLOSE, OPEN, ToolsError, held_back, message_for_template, parse_calls, parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}


def test_parse_tools_and_choice():
    assert parse_tools({}) is None and parse_tools({"tools": []}) is None
    t = parse_tools({"tools": [WEATHER, ADD]})
    assert t.choice == "auto" and t.forced is None and t.active and t.grammar() is None
    assert [f["function"]["name"] for f in t.functions] == ["get_weather", "add"]
    assert not parse_tools({"tools": [WEATHER], "tool_choice": "none"}).active
    t = parse_tools({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert t.choice == "required" and t.forced == "add"


@pytest.mark.parametrize("body, param, needle", [
    ({"tools": {"a": 1}}, "tools", "must be an array"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "type 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "appears twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", "JSON schema"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be none, auto, required"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    # a schema the grammar cannot read: refused under auto too (it was taken, its calls left unconstrained)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "wat"}}}}}]}, "tools", r"tools\[0\]\.function\.parameters: .*Unrecognized schema"),
])
def test_bad_tools_are_named(body, param, needle):
    with pytest.raises(ToolsError, match=needle) as e:
        parse_tools(body)
    assert e.value.param == param


def test_parse_calls():
    text = f'Let me check.\n{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}\n' \
           f'{OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n{CLOSE}'
    p = parse_calls(text)
    assert p.content == "Let me check."
    assert [c["function"]["name"] for c in p.calls] == ["get_weather", "add"]
    assert json.loads(p.calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in p.calls)
    assert len({c["id"] for c in p.calls}) == 2
    only = parse_calls(f'{OPEN}{{"name": "add", "arguments": {{}}}}{CLOSE}')
    assert only.content is None and len(only.calls) == 1
    # a second call cut off by the token limit is dropped, not shown as content (it was: '<tool_call>\n{"')
    cut = parse_calls(f'{OPEN}\n{{"name": "add", "arguments": {{}}}}\n{CLOSE}\n{OPEN}\n{{"')
    assert cut.content is None and len(cut.calls) == 1
    # not a call: kept as the text the model wrote
    for text in ["no tools here", f"{OPEN} not json {CLOSE}", f'{OPEN}{{"arguments": {{}}}}{CLOSE}',
                 f'{OPEN}{{"name": "add"']:
        p = parse_calls(text)
        assert p.calls == [] and p.content == text
    # a tagged call to a function the request does not have is not a tool call
    unknown = f'{OPEN}{{"name": "launch", "arguments": {{}}}}{CLOSE}'
    assert parse_calls(unknown, {"add"}).calls == [] and len(parse_calls(unknown, {"launch"}).calls) == 1


def test_a_call_the_token_limit_cut_is_a_call_as_far_as_written_never_text():
    """finish_reason "length" (cut=True): a call cut off is given with its arguments as far as they were written, as
    OpenAI gives one; a call cut before its name is whole, or a tag cut inside ("<tool"), is no text either (the
    raw markup came back as the message's content: '<tool_call>\n{"name": ...')."""
    names = {"get_time"}
    whole = f'{OPEN}\n{{"name": "get_time", "arguments": {{"city": "Paris"}}}}\n'  # only the closing tag cut
    for text, content, args in [
            (whole, None, '{"city": "Paris"}'),
            (f'{OPEN}\n{{"name": "get_time", "arguments": {{"city": "Pa', None, '{"city": "Pa'),
            (f'{OPEN}\n{{"name": "get_time"', None, ""),
            (f'Let me check. {OPEN}\n{{"name": "get_time", "argu', "Let me check.", ""),
            (f'{whole}{CLOSE}\n<tool', None, '{"city": "Paris"}'),  # a second call cut inside its tag
            (f'{whole}</tool', None, '{"city": "Paris"}'),  # cut inside its closing tag
            (f'{OPEN}\n{{"name": "get_time", "arguments": {{"q": "a <', None, '{"q": "a <'),
            (f'{OPEN}\n{{"', None, None), ("Hello <tool", "Hello ", None), (OPEN, None, None)]:
        p = parse_calls(text, names, cut=True)
        assert p.content == content, text
        assert [c["function"]["arguments"] for c in p.calls] == ([args] if args is not None else []), text
        assert all(c["function"]["name"] == "get_time" for c in p.calls)
    # a whole block that stays text (not JSON; another function) before the cut call stays, and the cut call counts
    for block in (f"{OPEN}\nnot json\n{CLOSE}\n", f'{OPEN}\n{{"name": "other", "arguments": {{}}}}\n{CLOSE}\n'):
        p = parse_calls(block + f'{OPEN}\n{{"name": "get_time", "arguments": {{"city": "Pa', names, cut=True)
        assert p.content == block.strip() and [c["function"]["arguments"] for c in p.calls] == ['{"city": "Pa']
    # the tag inside a cut call's arguments is part of them
    p = parse_calls(f'{OPEN}\n{{"name": "get_time", "arguments": {{"text": "the tag is {OPEN} and', names, cut=True)
    assert p.content is None and p.calls[0]["function"]["arguments"] == f'{{"text": "the tag is {OPEN} and'
    # text that only may start a tag stays; a call to a function the request lacks stays text, cut or whole
    assert parse_calls("a < b", names, cut=True).content == "a < b"
    other = f'{OPEN}\n{{"name": "launch", "arguments": {{"x": 1'
    assert parse_calls(other, names, cut=True).content == other and not parse_calls(other, names, cut=True).calls
    # not cut: as before, what the model wrote
    assert parse_calls(f'{OPEN}\n{{"name": "get_time"', names).content == f'{OPEN}\n{{"name": "get_time"'


def test_a_call_written_without_the_tags_counts_only_for_the_requests_functions():
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    names = {"get_weather", "add"}
    for text in [bare, f"```json\n{bare}\n```", f" {bare}\n"]:
        p = parse_calls(text, names)
        assert p.content is None and [c["function"]["name"] for c in p.calls] == ["get_weather"], text
    two = parse_calls(f'[{bare}, {{"name": "add", "arguments": {{"a": 1, "b": 2}}}}]', names)
    assert [c["function"]["name"] for c in two.calls] == ["get_weather", "add"]
    for text, known in [(bare, None), (bare, {"add"}), ('{"name": "get_weather", "city": "Paris"} and more', names),
                        ('{"answer": 42}', names)]:
        p = parse_calls(text, known)
        assert p.calls == [] and p.content == text


def test_streamed_text_holds_back_what_may_start_a_call():
    assert held_back('{"name": "add"') == len('{"name": "add"') and held_back("  ``") == 4
    assert held_back("`x`") == 0
    assert held_back("Hello") == 0
    assert held_back("Hello <") == 1 and held_back("Hello <tool_") == len("<tool_")
    assert held_back("Hello <b>") == 0
    assert held_back(f"Hi {OPEN}\n{{\"name\"") == len(f"{OPEN}\n{{\"name\"")
    # a code fence waits only while it may hold a call's JSON (a coder model's answers often open with one)
    for text in ["```", "```js", "```json", "```json\n", "```\n  {", "```json\n[{"]:
        assert held_back(text) == len(text), text
    for text in ["```python", "```py\nprint(1)", "```json\nx = 1", "```\nhello"]:
        assert held_back(text) == 0, text


def test_messages_with_calls_and_results_render_through_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [message_for_template(m) for m in [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # a template without tools (ChatML): tools described in a system message, the call written out
    text = chat.render(None, msgs, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}' in text
    assert "<|im_start|>tool\n{\"temp\": 21}" in text
    # the same conversation in a request without tools keeps the call (it vanished: the result answered nothing)
    assert f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}' in chat.render(None, msgs)
    with pytest.raises(ToolsError, match="not valid JSON"):
        message_for_template({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]})


def test_a_template_that_takes_tools_gets_them(qwen_target):
    template = qwen_target.chat_template()
    assert "tools" in template
    text = chat.render(template, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER])
    assert "# Tools" in text and json.dumps(WEATHER["function"]["parameters"]["properties"]["city"]) in text
    assert text.count("<|im_start|>system") == 1 and text.endswith("<|im_start|>assistant\n")


def _accepts(backend, gbnf, text):
    """Does the grammar accept this exact text, token by token (the model's tokenization of it)?"""
    c = backend.grammar(gbnf)
    for t in backend.tokenize(text, add_special=False):
        if not c.allowed([t])[0]:
            return False
        c.accept(t)
    return any(c.allowed(sorted(c.eog)))


def test_required_calls_follow_the_tools_schemas(qwen_target):
    t = parse_tools({"tools": [WEATHER, ADD], "tool_choice": "required"})
    g = t.grammar()
    good = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    two = good + f'\n{OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2.5}}}}\n{CLOSE}'
    assert _accepts(qwen_target, g, good) and _accepts(qwen_target, g, two)
    assert not _accepts(qwen_target, g, "Sure! " + good)  # text first: no
    assert not _accepts(qwen_target, g, good.replace("get_weather", "get_time"))  # an unknown function
    assert not _accepts(qwen_target, g, good.replace('{"city": "Paris"}', '{"town": "Paris"}'))  # its schema
    one = parse_tools({"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False}).grammar()
    assert _accepts(qwen_target, one, good) and not _accepts(qwen_target, one, two)
    named = parse_tools({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert not _accepts(qwen_target, named.grammar(), good)
    assert _accepts(qwen_target, named.grammar(), f'{OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n{CLOSE}')
    # a function without parameters takes none (OpenAI: an empty parameter list); it took any object
    now = parse_tools({"tools": [{"type": "function", "function": {"name": "now"}}], "tool_choice": "required"})
    assert _accepts(qwen_target, now.grammar(), f'{OPEN}\n{{"name": "now", "arguments": {{}}}}\n{CLOSE}')
    assert not _accepts(qwen_target, now.grammar(), f'{OPEN}\n{{"name": "now", "arguments": {{"type": "x"}}}}\n{CLOSE}')


def _triggered(backend, tools):
    from speculant.constraint import TriggeredGrammar

    return TriggeredGrammar(backend.token_text, OPEN.encode(), backend.grammar(tools.body_grammar()), CLOSE.encode())


def _follows(c, backend, text):
    """Feed the model's tokens of `text` to constraint c; False at the first one it forbids."""
    for t in backend.tokenize(text, add_special=False):
        if not c.allowed([t])[0]:
            return False
        c.accept(t)
    return True


def test_auto_calls_follow_the_schemas_once_the_model_opens_one(qwen_target):
    """tool_choice auto: text is free until the model writes <tool_call>; the call is then held to a request
    function and its schema until </tool_call>, and the text after it is free again (a second call too)."""
    t = parse_tools({"tools": [WEATHER, ADD]})
    assert t.grammar() is None and t.body_grammar() is not None
    call = f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}'
    c = _triggered(qwen_target, t)
    assert _follows(c, qwen_target, "Let me look that up. " + call) and c.inner is None
    assert _follows(c, qwen_target, " Anything {oops} goes here, " + call.replace("Paris", "Rome"))
    for bad in (call.replace("get_weather", "get_time"), call.replace('"city"', '"town"'),
                call.replace('{"city": "Paris"}', '{"city": 5}')):
        assert not _follows(_triggered(qwen_target, t), qwen_target, "Sure. " + bad)
    # inside a call the generation may not end; after it, it may
    c = _triggered(qwen_target, t)
    _follows(c, qwen_target, f'{OPEN}\n{{"name": "add", "arguments": {{"a": 1')
    assert not c.allowed(sorted(c.eog)).any()
    fork = c.fork()
    assert _follows(fork, qwen_target, ', "b": 2}}\n' + CLOSE) and fork.inner is None
    assert c.inner is not None and not c.allowed(sorted(c.eog)).any()  # the fork did not move it
    assert _follows(c, qwen_target, ', "b": 2}}\n' + CLOSE) and c.allowed(sorted(c.eog)).all()
    assert parse_tools({"tools": [WEATHER], "tool_choice": "required"}).body_grammar() is None


def test_without_parallel_calls_only_the_first_counts():
    two = (f'{OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{CLOSE}\n'
           f'{OPEN}\n{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}\n{CLOSE}')
    parsed, finish = parse_tools({"tools": [WEATHER, ADD]}).answer(two, "stop")
    assert [c["function"]["name"] for c in parsed.calls] == ["get_weather", "add"] and finish == "tool_calls"
    parsed, finish = parse_tools({"tools": [WEATHER, ADD], "parallel_tool_calls": False}).answer(two, "stop")
    assert [c["function"]["name"] for c in parsed.calls] == ["get_weather"] and finish == "tool_calls"


def test_held_back_searches_only_what_follows_the_sent_text():
    text = "Some text first, then " + OPEN
    assert held_back(text, sent=len("Some text first, t")) == len(OPEN)
    assert held_back("abc <tool", sent=3) == len("<tool") and held_back("abc def", sent=3) == 0
    assert held_back('x {"a": 1}', sent=1) == 0  # JSON later in the answer is text, not a call


def test_the_server_decodes_auto_calls_under_the_call_grammar_where_it_can(qwen_target):
    """A chat job with tools under auto gets the triggered call grammar, required gets its grammar, no tools
    none; a backend without grammars (torch) leaves auto calls parsed only, where required is refused."""
    from types import SimpleNamespace

    from speculant.constraint import GrammarConstraint, TriggeredGrammar
    from speculant.server import Job, _constraint

    from synthetic import TableBackend

    def job(**body):
        return Job("prompt", True, 8, None, [], False, False, tools=parse_tools({"tools": [WEATHER], **body}))

    llama = SimpleNamespace(target=qwen_target)
    assert isinstance(_constraint(job(), llama), TriggeredGrammar)
    required = job(tool_choice="required")
    required.grammar = required.tools.grammar()
    assert isinstance(_constraint(required, llama), GrammarConstraint)
    assert _constraint(job(tool_choice="none"), llama) is None
    assert _constraint(Job("prompt", True, 8, None, [], False, False), llama) is None
    assert _constraint(job(), SimpleNamespace(target=TableBackend(8))) is None


def test_a_continued_message_advances_a_response_format_not_tool_calls(qwen_target):
    """A final assistant message that the answer continues is read by a response format's grammar first (the
    message and the answer are one document), from the prompt's own tokens; tool-call grammars start afresh, as
    calls are read from the answer alone (a required call begun in the message came back as text)."""
    from types import SimpleNamespace

    from speculant.constraint import json_grammar
    from speculant.server import Job, _constraint

    llama = SimpleNamespace(target=qwen_target)
    started = '{"city": "'
    prompt = "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n" + started
    tokens = qwen_target.tokenize(prompt, add_special=False)
    ids = {text: qwen_target.tokenize(text, add_special=False) for text in ("Paris", "<tool_call>")}
    fmt = Job(prompt, True, 8, None, [], False, False, grammar=json_grammar(), grammar_param="response_format",
              tokens=tokens, continued=started)
    assert _constraint(fmt, llama).allowed(np.array(ids["Paris"][:1]))[0]  # inside the string the message opened
    fmt.continued = ""
    assert not _constraint(fmt, llama).allowed(np.array(ids["Paris"][:1]))[0]  # a new document starts with {
    call = Job(prompt, True, 8, None, [], False, False, tools=parse_tools({"tools": [WEATHER],
                                                                          "tool_choice": "required"}),
               tokens=tokens, continued='<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    call.grammar, call.grammar_param = call.tools.grammar(), "tools"
    assert _constraint(call, llama).allowed(np.array(ids["<tool_call>"][:1]))[0]  # from the start of a call


def test_a_continued_message_is_read_in_the_prompts_own_tokens():
    from types import SimpleNamespace

    from speculant.server import APIError, _message_tokens

    texts = {1: b"<s>", 2: b"\n", 3: b"{", 4: b'"a', 5: b" {", 6: b"\n{"}
    spm = SimpleNamespace(token_text=texts.get, tokenize=lambda text, **kw: [5, 4])  # a space before its own text
    bpe = SimpleNamespace(token_text=texts.get, tokenize=lambda text, **kw: [3, 4])
    assert _message_tokens([1, 2, 3, 4], b'{"a', spm) == [3, 4]  # where the prompt's tokens begin with it
    assert _message_tokens([1, 6, 4], b'{"a', bpe) == [3, 4]  # a token spans the template and the message
    with pytest.raises(APIError, match="cannot be lined up"):
        _message_tokens([1, 6, 4], b'{"a', spm)
