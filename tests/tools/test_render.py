"""render_tool_messages: tool results as Qwen2.5's chat template renders them, as ids to append."""

import pytest

from grouprl.tools import ToolResult, get_tool_parser, render_tool_messages, resolve_tools

from .conftest import add, web_lookup

TOOLS = resolve_tools([add, web_lookup])
SCHEMAS = [t.schema for t in TOOLS.values()]


def test_ids_follow_the_end_of_turn_token(qwen_tokenizer):
    results = [ToolResult("add", "5", "ok"), ToolResult(None, "error: could not read this tool call.", "parse_error")]
    ids = render_tool_messages(qwen_tokenizer, results, TOOLS)
    assert qwen_tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nerror: could not read this tool "
        "call.\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ids[1] == qwen_tokenizer.convert_tokens_to_ids("<|im_start|>")  # special tokens are single ids


def test_prompt_turn_and_results_are_the_templates_rendering_of_the_conversation(qwen_tokenizer):
    """The rollout's context (prompt ids, the policy's turn, then these ids) equals the chat template's
    rendering of the whole conversation, token for token."""
    tok = qwen_tokenizer
    user = [{"role": "user", "content": "What is 2 + 3? Then look up GRPO."}]
    prompt = tok.apply_chat_template(user, tools=SCHEMAS, add_generation_prompt=True, tokenize=False)
    generated = ('Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n<tool_call>\n'
                 '{"name": "web_lookup", "arguments": {"query": "GRPO"}}\n</tool_call><|im_end|>')
    turn = get_tool_parser(tok, TOOLS).parse(generated.removesuffix("<|im_end|>"))
    results = [ToolResult("add", "5", "ok"), ToolResult("web_lookup", "results for GRPO", "ok")]
    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    context = ids(prompt) + ids(generated) + render_tool_messages(tok, results, TOOLS)
    conversation = user + [turn.as_message()] + [r.message for r in results]
    expected = tok.apply_chat_template(conversation, tools=SCHEMAS, add_generation_prompt=True, tokenize=False)
    assert context == ids(expected)


def test_templates_that_cannot_be_continued_fail_clearly(qwen_tokenizer):
    with pytest.raises(ValueError, match="no tool results to render"):
        render_tool_messages(qwen_tokenizer, [], TOOLS)
    qwen_tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}a: {% endif %}")
    with pytest.raises(ValueError, match="ends an assistant turn without a special token"):
        render_tool_messages(qwen_tokenizer, [ToolResult("add", "5", "ok")], TOOLS)
    qwen_tokenizer.chat_template = "{{ messages | length }}<|im_end|>"
    with pytest.raises(ValueError, match="renders earlier turns differently once tool messages follow"):
        render_tool_messages(qwen_tokenizer, [ToolResult("add", "5", "ok")], TOOLS)
