"""Tool calls in generated text, in the format of the model's chat template: `ToolCallParser`.

Formats (`FORMATS`; docs/tools.md has examples):
- "hermes": Qwen2.5, Qwen3 and Hermes write `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, anywhere in the turn after its reasoning (up to the last `</think>`, whether the
  turn or the generation prompt opened it: a call only drafted there is not made); the rest of the
  text is the content. A closed pair is a call attempt whatever it holds; an unclosed `<tool_call>`
  not followed by JSON (`{`, `[` or a ``` fence) is the tag named in prose, content like the rest.
- "llama3": Llama 3.1-3.3 write the whole turn as `{"name": ..., "parameters": {...}}` (several
  separated by ";"), optionally after `<|python_tag|>`; a turn that starts otherwise holds no call,
  and text after the calls that is not JSON is the content.
- "template": transformers' own response parsing, `tokenizer.parse_response`, driven by the
  tokenizer's `response_template` (transformers >= 5.19; chosen first whenever the tokenizer has one).

`get_tool_parser(tokenizer, tools, name=None)` picks "template" when the tokenizer has a
response_template, else the format its chat template text shows, else fails asking for
`tool_parser:` (as for Qwen3-Coder's and Qwen3.5's XML calls in `<tool_call>`, which no format here
reads). A call that cannot be made (bad JSON, no name, arguments not an object, an unknown tool,
missing or unexpected arguments) becomes a `ParseError` in its place, with a message for the model;
the other calls of the turn stand.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .base import Tool, ToolCall, check_call

FORMATS = ("hermes", "llama3", "template")
_HINTS = {
    "hermes": 'Write each call as <tool_call>\n{"name": <tool name>, "arguments": {<argument>: <value>}}\n</tool_call>',
    "llama3": 'Write a call as the whole message: {"name": <tool name>, "parameters": {<argument>: <value>}}',
    "template": "",
}
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
# what follows a tag that opens a call: JSON (an object, a list a model may write, or either in a ``` fence)
_JSON_NEXT = re.compile(r"\s*(?:[{\[]|```)")
_BLANKS = re.compile(r"\s*")
_JSON_OPENS = re.compile(r"\s*(?:\{\s*[\"}]|\[)")  # how a call's JSON starts: an object's first key, or a list
_JSON = json.JSONDecoder()
_LLAMA3_START = re.compile(r"\{\s*\"name\"")
_PYTHON_TAG = "<|python_tag|>"
_THINK_END = "</think>"  # Qwen3's end of reasoning
_XML_CALL = "<function="  # Qwen3-Coder's and Qwen3.5's calls: <tool_call>\n<function=add>\n<parameter=a>\n1\n...
_LLAMA3_TURN_ENDS = ("<|eot_id|>", "<|eom_id|>")


@dataclass(frozen=True)
class ParseError:
    """A call the model tried to make and that cannot be made; `message` is what the model is told."""

    reason: str
    text: str  # the offending text, as generated
    hint: str = ""

    @property
    def message(self) -> str:
        hint = f" {self.hint}" if self.hint else ""
        return f"error: could not read this tool call: {self.reason.rstrip('.')}.{hint}"


@dataclass
class ParsedTurn:
    """One assistant turn: its text without the calls, and its calls in order (a ParseError in place of a bad one)."""

    content: str
    calls: list[ToolCall | ParseError] = field(default_factory=list)

    @property
    def num_parse_errors(self) -> int:
        return sum(isinstance(c, ParseError) for c in self.calls)

    def as_message(self) -> dict:
        """The turn as an assistant message, with the well-formed calls as `tool_calls`."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        made = [c.as_message_part() for c in self.calls if isinstance(c, ToolCall)]
        if made:
            message["tool_calls"] = made
        return message


class ToolCallParser:
    """Parses one format (`FORMATS`) and checks each call against `tools`."""

    def __init__(self, format: str, tools: dict[str, Tool], tokenizer: Any = None):
        if format not in FORMATS:
            raise ValueError(f"tool_parser={format!r}: use one of {', '.join(FORMATS)} "
                             "(hermes: Qwen2.5, Qwen3, Hermes; llama3: Llama 3.1-3.3; template: the tokenizer's "
                             "response_template, with transformers >= 5.19)")
        if format == "template" and getattr(tokenizer, "response_template", None) is None:
            raise ValueError("tool_parser='template' needs a tokenizer with a response_template (transformers >= "
                             "5.19 reads it from tokenizer_config.json); this one has none: set tool_parser to "
                             "hermes or llama3")
        self.format, self.tools, self.tokenizer = format, tools, tokenizer
        self.hint = _HINTS[format]

    def parse(self, text: str, prefix: str = "") -> ParsedTurn:
        """Parse one generated assistant turn. `prefix` (the prompt text before it) matters only to
        "template", whose response_template may need what the chat template pre-wrote."""
        split = _SPLITTERS.get(self.format)
        content, raw = split(text) if split is not None else self._template(text, prefix)
        return ParsedTurn(content, [r if isinstance(r, ParseError) else self._call(*r) for r in raw])

    def _template(self, text: str, prefix: str) -> tuple[str, list]:
        schemas = [t.schema for t in self.tools.values()]
        try:
            message = self.tokenizer.parse_response(text, prefix=prefix, tools=schemas)
        except ValueError as e:  # transformers parses a turn as a whole: one bad call fails it all
            return text.strip(), [ParseError(str(e).splitlines()[0], text)]
        except RecursionError as e:  # brackets nested past the recursion limit: json raises, transformers lets it out
            return text.strip(), [ParseError(f"invalid JSON ({_unreadable(e)})", text)]
        calls = message.get("tool_calls", [])
        raw = [(c.get("function", c) if isinstance(c, dict) else c, json.dumps(c)) for c in calls]
        return message.get("content") or "", raw

    def _call(self, obj: Any, text: str) -> ToolCall | ParseError:
        """A ToolCall from a decoded {"name": ..., "arguments" | "parameters": {...}}, or why not."""
        if not isinstance(obj, dict):
            return ParseError(f"expected a JSON object, got {type(obj).__name__}", text, self.hint)
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return ParseError('the call has no "name"', text, self.hint)
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):  # invalid, a number past Python's digit limit, nesting too deep
                pass
        if not isinstance(arguments, dict):
            return ParseError(f'the arguments of {name} are not a JSON object', text, self.hint)
        call = ToolCall(name, arguments)
        problem = check_call(call, self.tools)
        return call if problem is None else ParseError(problem, text)


def _decode(body: str) -> tuple[Any, str | None]:
    """(object, None) or (None, why the JSON is invalid)."""
    try:
        return json.loads(body), None
    except json.JSONDecodeError as e:
        return None, f"invalid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except (ValueError, RecursionError) as e:  # a degenerate model's 5,000-digit number or 1,000 open brackets
        return None, f"invalid JSON ({_unreadable(e)})"


def _unreadable(e: BaseException) -> str:
    """Why json could not read a call that is not a syntax error: a number past Python's integer
    digit limit (ValueError), or brackets nested past the recursion limit (RecursionError)."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]


def _hermes_spans(text: str) -> list[tuple[int, int, bool]]:
    """(start, end, closed) of each call attempt in `text`. A `<tool_call>...</tool_call>` pair is one,
    whatever it holds (a bad body is the model's malformed call, to be told about), unless a
    `<tool_call>` inside it opens a call of its own and the body is no JSON (a tag inside a JSON string
    is text): then the first tag was left unclosed. A `</tool_call>` inside the call's JSON (a string
    holding it) does not close it. An unclosed tag is an attempt only when JSON follows
    it, and runs to the next tag or the end; otherwise it is the tag named in prose ("I call tools with
    <tool_call> tags"), and stays content."""
    spans, pos, close = [], 0, None
    while (start := text.find(_OPEN, pos)) >= 0:
        body = start + len(_OPEN)
        if close is None or 0 <= close < body:  # none found after an earlier tag is none after this one either
            close = text.find(_CLOSE, body)
        if close >= 0 and (end := _json_end(text, body)) is not None and end > close:
            after = _BLANKS.match(text, end).end()  # the call's JSON holds "</tool_call>" in a string:
            if text.startswith(_CLOSE, after):  # its own close comes after it
                close = after
        inner = text.find(_OPEN, body, close if close >= 0 else len(text))
        if close >= 0 and not (inner >= 0 and _JSON_NEXT.match(text, inner + len(_OPEN))
                               and not _json_between(text, body, close)):
            spans.append((start, close + len(_CLOSE), True))
            pos = close + len(_CLOSE)
        elif _JSON_NEXT.match(text, body):  # unclosed: up to the next tag, or the end
            end = inner if inner >= 0 else len(text)
            spans.append((start, end, False))
            pos = end
        else:
            pos = body
    return spans


def _json_end(text: str, start: int) -> int | None:
    """Where the JSON value that starts at `start` (after blanks) ends, or None: read in place, with no
    copy of a long turn."""
    if not _JSON_OPENS.match(text, start):  # `{<tool_call>...`: no decode (a failed one counts the lines before it)
        return None
    try:
        return _JSON.raw_decode(text, _BLANKS.match(text, start).end())[1]
    except (ValueError, RecursionError):
        return None


def _json_between(text: str, start: int, stop: int) -> bool:
    """Whether text[start:stop] is one JSON value and blanks."""
    end = _json_end(text, start)
    return end is not None and end <= stop and not text[end:stop].strip()


def _hermes(text: str) -> tuple[str, list]:
    end = text.rfind(_THINK_END)
    reasoning, text = (text[:end + len(_THINK_END)], text[end + len(_THINK_END):]) if end >= 0 else ("", text)
    raw: list = []
    content, last = [], 0
    for start, stop, closed in _hermes_spans(text):
        whole = text[start:stop]
        content.append(text[last:start])
        last = stop
        if not closed:
            raw.append(ParseError("<tool_call> is not closed by </tool_call>", whole, _HINTS["hermes"]))
            continue
        obj, why = _decode(text[start + len(_OPEN):stop - len(_CLOSE)].strip())
        raw.append((obj, whole) if why is None else ParseError(why, whole, _HINTS["hermes"]))
    content.append(text[last:])
    return (reasoning + "".join(content)).strip(), raw


def _llama3(text: str) -> tuple[str, list]:
    body = text.strip()
    for end in _LLAMA3_TURN_ENDS:
        body = body.removesuffix(end).rstrip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).lstrip()
    if not tagged and not _LLAMA3_START.match(body):
        return text.strip(), []
    raw: list = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        if raw and body[pos] not in "{[":  # after a call, text that is not JSON is what the model said, not a call
            return body[pos:], raw
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            why = f"invalid JSON ({e.msg} at character {e.pos - pos})"
            raw.append(ParseError(why, body[pos:], _HINTS["llama3"]))
            break
        except (ValueError, RecursionError) as e:
            raw.append(ParseError(f"invalid JSON ({_unreadable(e)})", body[pos:], _HINTS["llama3"]))
            break
        raw.append((obj, body[pos:end]))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return "", raw


_SPLITTERS = {"hermes": _hermes, "llama3": _llama3}  # format -> text -> (content, [(object, text) | ParseError])


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def detect_format(tokenizer: Any) -> str | None:
    """The fallback format the tokenizer's chat template shows, or None."""
    text = _template_text(tokenizer)
    if _XML_CALL in text:  # Qwen3-Coder, Qwen3.5: <tool_call> around XML, not hermes' JSON: no parser here reads it
        return None
    if "<tool_call>" in text:
        return "hermes"
    if _PYTHON_TAG in text or ("<|start_header_id|>" in text and '"parameters"' in text):
        return "llama3"
    return None


def get_tool_parser(tokenizer: Any, tools: dict[str, Tool], name: str | None = None) -> ToolCallParser:
    """The parser named (`tool_parser:`), else "template" when the tokenizer has a response_template,
    else the format its chat template shows. Fails, asking for `tool_parser:`, when none is found."""
    if name is None:
        if getattr(tokenizer, "response_template", None) is not None:
            name = "template"
        else:
            name = detect_format(tokenizer)
        if name is None and _XML_CALL in _template_text(tokenizer):
            raise ValueError("cannot read this tokenizer's model's tool calls: it has no response_template and its "
                             "chat template writes calls as XML (<tool_call><function=name><parameter=...>, as "
                             "Qwen3-Coder and Qwen3.5 do), a format no parser here reads (hermes reads JSON in "
                             "<tool_call>). Give the tokenizer a response_template (transformers >= 5.19) or name "
                             f"the format with tool_parser: one of {', '.join(FORMATS)}")
        if name is None:
            raise ValueError("cannot tell how this tokenizer's model writes tool calls: it has no response_template "
                             "and its chat template shows neither <tool_call> nor Llama 3's format. Name the format "
                             f"with tool_parser: one of {', '.join(FORMATS)}")
    return ToolCallParser(name, tools, tokenizer)
