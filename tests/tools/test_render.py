"""render_tool_messages: tool results as Qwen2.5's chat template renders them, as ids to append; and
small templates of our own that behave as Qwen3's and Llama 3's do where those differ."""

import pytest

from grouprl.tasks.testing import build_char_tokenizer
from grouprl.tools import ToolResult, get_tool_parser, render_after_turn, render_tool_messages, resolve_tools

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


# Like Qwen3's template: the conversation's last message, when an assistant turn, opens with an empty
# think block and an earlier assistant turn does not, so a turn renders differently once messages follow it
THINKING_CHATML = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- m.content }}"
    "{%- for call in m.tool_calls or [] %}{{- '<tool_call>' + call.function.name + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_a_last_turn_that_renders_differently_once_messages_follow(qwen_tokenizer):
    """The policy's turn ends with <|im_end|>; the ids are what the template writes after it (tool results, or
    an observation), and prompt + turn + ids is the template's rendering of the whole conversation."""
    tok = qwen_tokenizer
    tok.chat_template = THINKING_CHATML
    results = [ToolResult("add", "5", "ok"), ToolResult("web_lookup", "results for GRPO", "ok")]
    ids = render_tool_messages(tok, results, TOOLS)
    assert tok.decode(ids) == ("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>tool\nresults for GRPO<|im_end|>\n"
                               "<|im_start|>assistant\n")
    user = [{"role": "user", "content": "Add, then look up."}]
    turn = {"role": "assistant", "content": "Adding.", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": {}}} for name in ("add", "web_lookup")]}
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    generated = "Adding.<tool_call>add</tool_call><tool_call>web_lookup</tool_call><|im_end|>"
    expected = tok.apply_chat_template(user + [turn] + [r.message for r in results], add_generation_prompt=True,
                                       tokenize=False)
    assert tok(prompt + generated, add_special_tokens=False)["input_ids"] + ids == tok(
        expected, add_special_tokens=False)["input_ids"]
    observation = render_after_turn(tok, [{"role": "user", "content": "higher"}])
    assert tok.decode(observation) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


# Qwen3's switch: with enable_thinking false the generation prompt carries an empty thinking block
THINKING_SWITCH = THINKING_CHATML.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def test_the_next_turn_is_opened_with_the_templates_arguments(qwen_tokenizer):
    """chat_template_kwargs reach the header of the turn after tool results or an observation, as they
    reached the prompt's: Qwen3 without thinking opens every assistant turn with an empty block."""
    tok = qwen_tokenizer
    tok.chat_template = THINKING_SWITCH
    assert THINKING_SWITCH != THINKING_CHATML
    results = [ToolResult("add", "5", "ok")]
    plain = tok.decode(render_tool_messages(tok, results, TOOLS))
    assert plain.endswith("<|im_start|>assistant\n")
    off = {"enable_thinking": False}
    assert tok.decode(render_tool_messages(tok, results, TOOLS, off)) == plain + "<think>\n\n</think>\n\n"
    observation = render_after_turn(tok, [{"role": "user", "content": "higher"}], template_kwargs=off)
    assert tok.decode(observation) == ("\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
                                       "<think>\n\n</think>\n\n")


# Like Llama 3.1-3.3's template: an assistant turn with tool calls is written as its call alone (the content
# is dropped), and a turn with more than one call raises
LLAMA3_LIKE = (
    "{%- for m in messages %}"
    "{%- if 'tool_calls' in m %}"
    "{%- if m.tool_calls | length != 1 %}"
    "{{- raise_exception('This model only supports single tool-calls at once!') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{\"name\": \"' + m.tool_calls[0].function.name }}"
    "{{- '\"}<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n' }}"
    "{{- m.content + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def llama3_like_tokenizer():
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.eos_token = "<|eot_id|>"
    tok.chat_template = LLAMA3_LIKE
    return tok


def test_a_template_that_takes_one_call_per_turn_renders_several_results():
    tok = llama3_like_tokenizer()
    ids = render_tool_messages(tok, [ToolResult("add", "5", "ok"), ToolResult("add", "7", "ok")], TOOLS)
    assert tok.decode(ids) == ("<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
                               "<|start_header_id|>ipython<|end_header_id|>\n\n7<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    observation = render_after_turn(tok, [{"role": "user", "content": "higher"}])
    assert tok.decode(observation) == ("<|start_header_id|>user<|end_header_id|>\n\nhigher<|eot_id|>"
                                       "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_template_that_raises_fails_with_the_problem_and_the_fix(qwen_tokenizer):
    # like Gemma's and Mistral's older templates, which accept only alternating user and assistant turns
    qwen_tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'tool' %}"
        "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}{{- m.content + '<|im_end|>' }}{%- endfor %}")
    with pytest.raises(ValueError, match=r"the chat template cannot render tool messages after an assistant turn "
                                         r"with a tool call \(TemplateError: Conversation roles must alternate .*\); "
                                         r"they are appended as the template renders them, so use a template that "
                                         r"accepts them"):
        render_tool_messages(qwen_tokenizer, [ToolResult("add", "5", "ok")], TOOLS)
