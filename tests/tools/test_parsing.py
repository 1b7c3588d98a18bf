"""Tool calls parsed per chat-template family, malformed calls included, and the choice of parser."""

import json

import pytest

from grouprl.tools import ParseError, ToolCall, ToolCallParser, get_tool_parser, resolve_tools

from .conftest import add, build_qwen_tokenizer, web_lookup

TOOLS = resolve_tools([add, web_lookup])
HERMES_HINT = 'Write each call as <tool_call>\n{"name": <tool name>, "arguments": {<argument>: <value>}}\n</tool_call>'
UNKNOWN = "error: could not read this tool call: unknown tool '{}'; the tools are: add, web_lookup."
LLAMA3_HINT = 'Write a call as the whole message: {"name": <tool name>, "parameters": {<argument>: <value>}}'
# transformers' own parsing, declared for Qwen2.5 (the tokenizer_config.json key `response_template`)
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


def hermes(text):
    return ToolCallParser("hermes", TOOLS).parse(text)


def llama3(text):
    return ToolCallParser("llama3", TOOLS).parse(text)


# ---------------------------------------------------------------- hermes: Qwen2.5, Qwen3, Hermes


def test_hermes_calls_and_content():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>{"name": "web_lookup", "arguments": {"query": "GRPO"}}</tool_call>')
    turn = hermes(text)
    assert turn.content == "Let me add."
    assert turn.calls == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("web_lookup", {"query": "GRPO"})]
    assert turn.num_parse_errors == 0
    assert turn.as_message() == {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
        {"type": "function", "function": {"name": "web_lookup", "arguments": {"query": "GRPO"}}}]}


@pytest.mark.parametrize("opened", ["<think>\n", ""])  # by the turn, or by the generation prompt (Qwen3)
def test_hermes_a_call_drafted_in_the_reasoning_is_not_made(opened):
    draft = '<tool_call>{"name": "add", "arguments": {"a": 9, "b": 9}}</tool_call>'
    text = (f'{opened}Maybe {draft}? No.\n</think>\n\nAdding.\n'
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    turn = hermes(text)
    assert turn.calls == [ToolCall("add", {"a": 2, "b": 3})] and turn.num_parse_errors == 0
    assert turn.content == f"{opened}Maybe {draft}? No.\n</think>\n\nAdding.".strip()


def test_hermes_no_call():
    turn = hermes("The answer is 5.")
    assert (turn.content, turn.calls, turn.as_message()) == (
        "The answer is 5.", [], {"role": "assistant", "content": "The answer is 5."})


def test_hermes_arguments_as_a_json_string_are_decoded():
    turn = hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert turn.calls == [ToolCall("add", {"a": 1})]

# Open brackets past any Python's recursion limit, where json raises RecursionError. 5,000 did on 3.11
# and 3.12.1, but 3.12.3 and 3.13 parse that deep and then stop at the missing value (a ValueError,
# "Expecting value": the same ParseError with another reason; seen on a lent GPU machine's 3.12.3).
DEEP = "[" * 100_000


@pytest.mark.parametrize("body, reason", [
    ('{"name": "add", "arguments": {"a": 1,}}', "invalid JSON (Expecting property name enclosed in double quotes at "
                                                "line 1 column 38)"),
    ('["add", 1]', "expected a JSON object, got list"),
    ('{"arguments": {"a": 1}}', 'the call has no "name"'),
    ('{"name": "add", "arguments": [1, 2]}', "the arguments of add are not a JSON object"),
    # a degenerate model's output, which json reads as no syntax error: ValueError and RecursionError
    ('{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}",
     "invalid JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
    ('{"name": "add", "arguments": {"a": ' + DEEP + "}}", "invalid JSON (nested too deeply)"),
    ('{"name": "add", "arguments": "' + DEEP + '"}', "the arguments of add are not a JSON object"),
], ids=["trailing-comma", "a-list", "no-name", "list-arguments", "too-many-digits", "too-deep", "deep-string"])
def test_hermes_malformed_call_is_a_parse_error_in_its_place(body, reason):
    text = f'<tool_call>{body}</tool_call><tool_call>{{"name": "add", "arguments": {{"a": 7}}}}</tool_call>'
    turn = hermes(text)
    assert turn.calls == [ParseError(reason, f"<tool_call>{body}</tool_call>", HERMES_HINT), ToolCall("add", {"a": 7})]
    assert turn.num_parse_errors == 1
    assert turn.calls[0].message == f"error: could not read this tool call: {reason}. {HERMES_HINT}"


def test_hermes_unknown_tool_and_missing_arguments_are_parse_errors():
    turn = hermes('<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>'
                  '<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    assert [c.message for c in turn.calls] == [
        UNKNOWN.format("mul"),
        "error: could not read this tool call: bad arguments for add: missing 'a'. It takes (a: integer, b: integer "
        "(optional)).",
    ]


def test_hermes_unclosed_call():
    turn = hermes('Sure.\n<tool_call>{"name": "add", "arguments": {"a": 1}')
    assert turn.content == "Sure."
    assert turn.calls == [ParseError("<tool_call> is not closed by </tool_call>",
                                     '<tool_call>{"name": "add", "arguments": {"a": 1}', HERMES_HINT)]


@pytest.mark.parametrize("text", [
    "Models call tools with <tool_call> tags; I need none. The answer is 42.",
    "Write <tool_call>, then the call. The answer is 42.",
])
def test_hermes_tag_named_in_prose_is_content_not_a_call(text):
    """An unclosed tag not followed by JSON is the tag named in prose: the answer keeps it, and no parse
    failure forces another turn."""
    turn = hermes(text)
    assert (turn.content, turn.calls) == (text, [])


@pytest.mark.parametrize("body", ["add(a=1)", '<function=add>\n<parameter=a>\n1\n</parameter>\n</function>',
                                  '"name": "add", "arguments": {"a": 1}'])
def test_hermes_closed_pair_around_no_json_is_a_malformed_call_the_model_is_told_of(body):
    """A `<tool_call>...</tool_call>` pair is a call attempt whatever it holds (a Qwen3 model writing
    Qwen3-Coder's XML calls, a Python call): silently taken as content, the turn ended as an answer."""
    turn = hermes(f"Sure.\n<tool_call>{body}</tool_call>")
    assert turn.content == "Sure." and len(turn.calls) == 1 and isinstance(turn.calls[0], ParseError)
    assert turn.calls[0].reason.startswith("invalid JSON")


def test_hermes_tag_inside_a_json_string_is_text_of_the_call():
    """`print('<tool_call>')` in a python call's code, or a query holding `<tool_call>{` or `</tool_call>`:
    the call's JSON holds them as text; neither starts a second call nor ends this one."""
    for value in ["s = '<tool_call>'\nprint(s)", "what is <tool_call>{ for?", "what does </tool_call> close?",
                  "<tool_call>{}</tool_call> in a string"]:
        call = json.dumps({"name": "web_lookup", "arguments": {"query": value}})
        turn = hermes(f"<tool_call>{call}</tool_call>")
        assert turn.calls == [ToolCall("web_lookup", {"query": value})] and turn.content == ""


def test_hermes_call_after_a_tag_named_in_prose_or_an_unclosed_call_is_read():
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    turn = hermes(f"I write <tool_call> tags like this:\n{call}")
    assert (turn.content, turn.calls) == ("I write <tool_call> tags like this:", [ToolCall("add", {"a": 2})])
    unclosed = '<tool_call>{"name": "add", "arguments": {"a": 1}}\n'
    turn = hermes(unclosed + call)
    assert turn.calls == [ParseError("<tool_call> is not closed by </tool_call>", unclosed, HERMES_HINT),
                          ToolCall("add", {"a": 2})]


def test_hermes_call_in_a_code_fence_is_a_parse_error():
    text = '<tool_call>\n```json\n{"name": "add", "arguments": {"a": 1}}\n```\n</tool_call>'
    turn = hermes(text)
    assert turn.content == ""
    assert [c.reason for c in turn.calls] == ["invalid JSON (Expecting value at line 1 column 1)"]


# ---------------------------------------------------------------- llama3: Llama 3.1-3.3 JSON


def test_llama3_json_call_with_parameters():
    turn = llama3('{"name": "add", "parameters": {"a": 2, "b": 3}}')
    assert (turn.content, turn.calls) == ("", [ToolCall("add", {"a": 2, "b": 3})])


def test_llama3_python_tag_form_several_calls_and_turn_end():
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; '
            '{"name": "web_lookup", "arguments": {"query": "x"}}<|eom_id|>')
    assert llama3(text).calls == [ToolCall("add", {"a": 1}), ToolCall("web_lookup", {"query": "x"})]


def test_llama3_text_after_the_calls_is_content_not_a_call():
    turn = llama3('{"name": "add", "parameters": {"a": 1}};\nLet me compute that for you.<|eot_id|>')
    assert (turn.content, turn.calls) == ("Let me compute that for you.", [ToolCall("add", {"a": 1})])
    turn = llama3('{"name": "add", "parameters": {"a": 1}}\n{"name": ')  # JSON after a call: a call, malformed
    assert turn.calls[0] == ToolCall("add", {"a": 1}) and isinstance(turn.calls[1], ParseError)


def test_llama3_plain_answers_hold_no_call():
    for text in ("The sum is 5.", '{"answer": 5}', 'I would call {"name": "add"} here'):
        turn = llama3(text)
        assert (turn.content, turn.calls) == (text, [])


def test_llama3_calls_json_cannot_read_are_parse_errors():
    for body, why in [("9" * 5000, "Exceeds the limit (4300 digits) for integer string conversion"),
                      (DEEP, "nested too deeply")]:
        turn = llama3('{"name": "add", "parameters": {"a": ' + body + "}}")
        assert [c.reason for c in turn.calls] == [f"invalid JSON ({why})"]


def test_llama3_malformed_calls():
    turn = llama3('{"name": "add", "parameters": {"a": 1}; {"name": ')
    assert turn.calls == [ParseError("invalid JSON (Expecting ',' delimiter at character 38)",
                                     '{"name": "add", "parameters": {"a": 1}; {"name":', LLAMA3_HINT)]
    turn = llama3("<|python_tag|>brave_search.call(query='x')")
    assert turn.calls == [ParseError("invalid JSON (Expecting value at character 0)",
                                     "brave_search.call(query='x')", LLAMA3_HINT)]
    turn = llama3('{"name": "add", "parameters": {"a": 1}} {"name": "nope", "parameters": {}}')
    assert turn.calls[0] == ToolCall("add", {"a": 1})
    assert turn.calls[1].message == UNKNOWN.format("nope")


# ---------------------------------------------------------------- transformers' response parsing


def test_template_parser_uses_the_tokenizers_response_template():
    tok = build_qwen_tokenizer()
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    parser = get_tool_parser(tok, TOOLS)
    assert parser.format == "template"
    prefix = "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n"
    generated = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": "2", "b": 3}}\n</tool_call><|im_end|>'
    turn = parser.parse(generated, prefix=prefix)
    # the tool's schema casts "2" to 2 (transformers' parse_response with tools=)
    assert (turn.content, turn.calls) == ("Adding.", [ToolCall("add", {"a": 2, "b": 3})])
    turn = parser.parse('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', prefix=prefix)
    assert turn.calls[0].message == UNKNOWN.format("mul")


def test_template_parser_malformed_json_fails_the_whole_turn():
    tok = build_qwen_tokenizer()
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": </tool_call>'
    turn = get_tool_parser(tok, TOOLS).parse(text)
    assert turn.calls == [ParseError("json parser could not parse region as JSON.", text)]
    assert turn.calls[0].message == "error: could not read this tool call: json parser could not parse region as JSON."


def test_template_parser_json_nested_too_deeply_is_a_parse_error():
    # a degenerate model's open brackets past the recursion limit: json raises RecursionError, which
    # transformers lets out;
    # like hermes and llama3, it is the model's parse error, not the rollout's crash
    tok = build_qwen_tokenizer()
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    text = "<tool_call>\n" + DEEP + "\n</tool_call>"
    turn = get_tool_parser(tok, TOOLS).parse(text)
    assert turn.calls == [ParseError("invalid JSON (nested too deeply)", text)]


# ---------------------------------------------------------------- which parser


def test_parser_from_the_chat_template_text_or_by_name():
    tok = build_qwen_tokenizer()
    assert get_tool_parser(tok, TOOLS).format == "hermes"
    tok.chat_template = '{{ "<|start_header_id|>" }}{%- if tools %}{{ "<|python_tag|>" }}{% endif %}'
    assert get_tool_parser(tok, TOOLS).format == "llama3"
    tok.chat_template = {"default": "{{ messages }}", "tool_use": "{{ '<tool_call>' }}"}
    assert get_tool_parser(tok, TOOLS).format == "hermes"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert get_tool_parser(tok, TOOLS, "llama3").format == "llama3"
    with pytest.raises(ValueError, match="cannot tell how this tokenizer's model writes tool calls.*Name the format "
                                         "with tool_parser: one of hermes, llama3, template"):
        get_tool_parser(tok, TOOLS)


def test_xml_calls_in_tool_call_tags_are_not_taken_for_hermes():
    # Qwen3-Coder, Qwen3.5: hermes would answer every call with a hint teaching JSON the model never saw
    tok = build_qwen_tokenizer()
    tok.chat_template = ("{%- if tools %}Reply in the format:\n<tool_call>\n<function=example_function_name>\n"
                         "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
                         "{%- endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match=r"writes calls as XML \(<tool_call><function=name><parameter=...>, as "
                                         r"Qwen3-Coder and Qwen3.5 do\), a format no parser here reads.*"
                                         "tool_parser: one of hermes, llama3, template"):
        get_tool_parser(tok, TOOLS)
    tok.response_template = QWEN_RESPONSE_TEMPLATE  # transformers' own parsing, when the tokenizer declares it
    assert get_tool_parser(tok, TOOLS).format == "template"


def test_bad_parser_names():
    tok = build_qwen_tokenizer()
    with pytest.raises(ValueError, match="tool_parser='qwen': use one of hermes, llama3, template "
                                         r"\(hermes: Qwen2.5, Qwen3, Hermes"):
        get_tool_parser(tok, TOOLS, "qwen")
    with pytest.raises(ValueError, match="tool_parser='template' needs a tokenizer with a response_template.*set "
                                         "tool_parser to hermes or llama3"):
        get_tool_parser(tok, TOOLS, "template")
