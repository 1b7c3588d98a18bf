"""Tool results as the chat template renders them: `render_tool_messages` -> token ids.

The ids continue a conversation right after an assistant turn that the policy ended with its
end-of-turn token (Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`): whatever the template writes after
that token (Qwen: a newline), the tool messages, and the header of the next assistant turn.

How: render a stand-in conversation (a user turn, an assistant turn whose content, and whose one tool
call's name, is a marker) alone, and followed by the tool messages (role "tool") and the generation
prompt, via `apply_chat_template(..., tools=schemas)`. The policy's end-of-turn token is the last
special token after the marker in the assistant turn's rendering; what follows it in the full
rendering is template glue, messages and the next header, and is returned. Anchoring on the marker
rather than comparing the two renderings whole lets a template write the turn's opening differently
once messages follow (Qwen3 gives only the last assistant turn an empty `<think>` block); one call
suffices to make a template accept tool messages (Llama 3's refuses a turn with more than one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import Tool, ToolCall
from .execute import ToolResult


_MARK = "grouprl_turn_marker"  # stands in for the policy's turn: the content and the one call's name
_NOT_INCREMENTAL = ("this chat template renders earlier turns differently once tool messages follow, so tool results "
                    "cannot be appended as tokens; use a template that renders a conversation incrementally "
                    "(Qwen2.5, Qwen3, Llama 3.x do)")


def render_tool_messages(tokenizer: Any, results: Sequence[ToolResult], tools: dict[str, Tool] | None = None,
                         template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids to append after the policy's end-of-turn token: the results as tool messages, then
    the next assistant header. ValueError when the template cannot be continued this way."""
    if not results:
        raise ValueError("no tool results to render: a turn without calls is not followed by tool messages")
    return render_after_turn(tokenizer, [r.message for r in results], tools, after_call=True,
                             template_kwargs=template_kwargs)


def render_after_turn(tokenizer: Any, messages: Sequence[dict], tools: dict[str, Tool] | None = None,
                      after_call: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids to append after the policy's end-of-turn token: `messages` (tool results, or an
    environment's observations as user messages), then the next assistant header. `after_call`: the
    stand-in assistant turn makes a tool call (a template may check that tool messages follow one).
    `template_kwargs`: more arguments for the template (chat_template_kwargs, e.g. enable_thinking)."""
    if not messages:
        raise ValueError("no messages to render after the assistant turn")
    schemas = [t.schema for t in tools.values()] if tools else None
    user = [{"role": "user", "content": "."}]
    turn = user + [{"role": "assistant", "content": _MARK}
                   | ({"tool_calls": [ToolCall(_MARK, {}).as_message_part()]} if after_call else {})]

    def render(conversation: list[dict], generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False,
                                                 add_generation_prompt=generation_prompt, **(template_kwargs or {}))
        except Exception as e:  # jinja's raise_exception, or a template tripping over these roles
            roles = ", ".join(dict.fromkeys(str(m.get("role")) for m in messages))
            raise ValueError(f"the chat template cannot render {roles} messages after an assistant turn"
                             f"{' with a tool call' if after_call else ''} ({type(e).__name__}: {e}); they are "
                             "appended as the template renders them, so use a template that accepts them "
                             "(Qwen2.5, Qwen3, Llama 3.x do)") from e

    before, base = render(user), render(turn)
    full = render(turn + list(messages), generation_prompt=True)
    if not base.startswith(before) or not full.startswith(before):
        raise ValueError(_NOT_INCREMENTAL)
    mark = base.rfind(_MARK, len(before))
    if mark < 0:
        raise ValueError("this chat template shows neither an assistant turn's content nor its tool calls, so "
                         "where the policy's turn ends cannot be found; use a template that renders them")
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    turn_end = max((base.rfind(s) + len(s) for s in special if base.rfind(s) > mark), default=-1)
    if turn_end < 0:
        raise ValueError("this chat template ends an assistant turn without a special token, so the policy's end "
                         "of turn cannot be told from the template's glue; add one to the template")
    ending = base[mark:turn_end]  # the stand-in turn from its (last) marker through its end-of-turn token
    at = full.find(ending, len(before))
    if at < 0:
        raise ValueError(_NOT_INCREMENTAL)
    return tokenizer(full[at + len(ending):], add_special_tokens=False)["input_ids"]
