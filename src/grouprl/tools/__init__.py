"""Tools the policy calls during a rollout: schemas, call parsing, execution, rendering (docs/tools.md).

- `Tool`, `resolve_tool(s)`: a tool from a typed, documented function (schema from transformers'
  `get_json_schema`), a built-in name ("python") or "package.module:function".
- `get_tool_parser(tokenizer, tools)`: parses an assistant turn into `ToolCall`s (and `ParseError`s)
  in the format of the model's chat template.
- `execute_calls(calls, tools, timeout_s=...)`: runs a batch of calls concurrently across rows; never raises.
- `render_tool_messages(tokenizer, results, tools)`: the results as the chat template's token ids.
"""

from .base import Tool, ToolCall, check_call
from .execute import STATUSES, ToolBatch, ToolResult, execute_calls
from .parsing import FORMATS, ParsedTurn, ParseError, ToolCallParser, detect_format, get_tool_parser
from .python import python_tool
from .registry import BUILTIN_TOOLS, resolve_tool, resolve_tools
from .render import render_after_turn, render_tool_messages

__all__ = [
    "BUILTIN_TOOLS",
    "FORMATS",
    "STATUSES",
    "ParseError",
    "ParsedTurn",
    "Tool",
    "ToolBatch",
    "ToolCall",
    "ToolCallParser",
    "ToolResult",
    "check_call",
    "detect_format",
    "execute_calls",
    "get_tool_parser",
    "python_tool",
    "render_after_turn",
    "render_tool_messages",
    "resolve_tool",
    "resolve_tools",
]
