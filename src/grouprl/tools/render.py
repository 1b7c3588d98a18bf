"""Tool results as the chat template renders them: `render_tool_messages` -> token ids.

The ids continue a conversation right after an assistant turn that the policy ended with its
end-of-turn token (Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`): whatever the template writes after
that token (Qwen: a newline), the tool messages, and the header of the next assistant turn.

How: render a stand-in conversation (a user turn, an assistant turn with the calls) with and without
the tool messages (role "tool") and the generation prompt, via `apply_chat_template(..., tools=schemas)`,
and keep the difference. The policy's end-of-turn token is the last special token of the assistant
turn's rendering; what follows it in that rendering is template glue, and starts the returned text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import Tool, ToolCall
from .execute import ToolResult


def render_tool_messages(tokenizer: Any, results: Sequence[ToolResult],
                         tools: dict[str, Tool] | None = None) -> list[int]:
    """Token ids to append after the policy's end-of-turn token: the results as tool messages, then
    the next assistant header. ValueError when the template cannot be continued this way."""
    if not results:
        raise ValueError("no tool results to render: a turn without calls is not followed by tool messages")
    calls = [ToolCall(r.name or "unknown", {}).as_message_part() for r in results]
    return render_after_turn(tokenizer, [r.message for r in results], tools, calls)


def render_after_turn(tokenizer: Any, messages: Sequence[dict], tools: dict[str, Tool] | None = None,
                      calls: Sequence[dict] | None = None) -> list[int]:
    """Token ids to append after the policy's end-of-turn token: `messages` (tool results, or an
    environment's observations as user messages), then the next assistant header. `calls`: the
    `tool_calls` of the stand-in assistant turn (a template may check that tool messages follow calls)."""
    if not messages:
        raise ValueError("no messages to render after the assistant turn")
    schemas = [t.schema for t in tools.values()] if tools else None
    user = [{"role": "user", "content": "."}]
    turn = user + [{"role": "assistant", "content": ""} | ({"tool_calls": list(calls)} if calls else {})]

    def render(messages: list[dict], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    before, base = render(user), render(turn)
    full = render(turn + list(messages), generation_prompt=True)
    if not base.startswith(before) or not full.startswith(base):
        raise ValueError("this chat template renders earlier turns differently once tool messages follow, so tool "
                         "results cannot be appended as tokens; use a template that renders a conversation "
                         "incrementally (Qwen2.5, Qwen3, Llama 3.x do)")
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    turn_end = max((base.rfind(s) + len(s) for s in special if s in base), default=-1)
    if turn_end <= len(before):
        raise ValueError("this chat template ends an assistant turn without a special token, so the policy's end "
                         "of turn cannot be told from the template's glue; add one to the template")
    return tokenizer(base[turn_end:] + full[len(base):], add_special_tokens=False)["input_ids"]
