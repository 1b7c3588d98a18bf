"""Tools from plain functions: `Tool`, `ToolCall`, `check_call`.

A tool is a Python function (or `async def`) with a type hint on every parameter and a Google-style
docstring. Its JSON schema, which the chat template shows the model, is transformers' own
`get_json_schema(func)`, never written by hand here.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from transformers.utils import get_json_schema

HOW = ("A tool is a function with a type hint on every parameter and a Google-style docstring: a summary "
       "line, then `Args:` with one `name: description` line per parameter (transformers.utils."
       "get_json_schema builds the schema the model sees from them).")


@dataclass(frozen=True)
class Tool:
    """A callable the model may call by `name`, with the JSON schema that describes it."""

    name: str
    func: Callable[..., Any]
    schema: dict = field(repr=False)  # {"type": "function", "function": {"name", "description", "parameters"}}

    @classmethod
    def from_function(cls, func: Callable[..., Any]) -> Tool:
        """Build a tool from `func`; ValueError naming the function and the fix when it cannot describe itself."""
        name = getattr(func, "__name__", repr(func))
        try:
            schema = get_json_schema(func)
        except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
            raise ValueError(f"tool {name}: {e}. {HOW}") from None
        return cls(name, func, schema)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.func)

    @functools.cached_property
    def argument_check(self) -> tuple[Any, frozenset[str]]:
        """(a jsonschema validator of the parameters, nullable read as null; the parameters whose default
        is None), made once per tool for `check_call`."""
        from jsonschema import Draft202012Validator

        return Draft202012Validator(_with_null(self.parameters)), frozenset(_none_defaults(self.func))

    @property
    def parameters(self) -> dict:
        """The schema's parameters: {"type": "object", "properties": {...}, "required": [...]}."""
        return self.schema["function"].get("parameters", {})


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]

    def as_message_part(self) -> dict:
        """The call as an assistant message's `tool_calls` entry, the form chat templates render."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_call(call: ToolCall, tools: dict[str, Tool]) -> str | None:
    """Why `call` cannot be made (unknown tool, missing or unexpected arguments, a value the schema
    refuses: a type, an enum), or None when it can."""
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return f"unknown tool {call.name!r}; the tools are: {known}"
    properties, required = tool.parameters.get("properties", {}), tool.parameters.get("required", [])
    missing = [p for p in required if p not in call.arguments]
    unexpected = [a for a in call.arguments if a not in properties]
    problems = ([f"missing {', '.join(map(repr, missing))}"] if missing else []) + (
        [f"unexpected {', '.join(map(repr, unexpected))}"] if unexpected else [])
    problems = problems or _refused_values(call.arguments, tool)
    if not problems:
        return None
    signature = ", ".join(f"{p}: {spec.get('type', 'any')}" + ("" if p in required else " (optional)")
                          for p, spec in properties.items())
    return f"bad arguments for {call.name}: {'; '.join(problems)}. It takes ({signature})"


def _refused_values(arguments: dict[str, Any], tool: Tool) -> list[str]:
    """What the JSON schema of the tool's parameters refuses in the arguments' values, one line per
    argument (jsonschema: `"2"` for an integer, a word outside an enum, a string for a list), with the
    value in JSON's spelling and shortened. null passes where the function's default is None. A schema
    jsonschema cannot use (a tool's hand-written one: a bad pattern, a type that is no name) checks
    nothing here: the call is made as before."""
    validator, none_defaults = tool.argument_check
    values = {k: v for k, v in arguments.items() if not (v is None and k in none_defaults)}
    try:
        errors = list(validator.iter_errors(values))
    except Exception:  # noqa: BLE001 - anything the schema makes jsonschema raise: no check, not a failed rollout
        return []
    first: dict[str, str] = {}
    for e in errors:
        name = str(e.absolute_path[0]) if e.absolute_path else ""
        first.setdefault(name, (f"{name!r}: " if name else "") + _refusal(e))
    return list(first.values())


def _refusal(e: Any) -> str:
    """A jsonschema error as the model is told it: the value in JSON's spelling, shortened (a 50,000-
    character string passed for an integer is not repeated back), and what the schema wanted."""
    got = _short(e.instance)
    if e.validator == "type":
        wanted = e.validator_value if isinstance(e.validator_value, list) else [e.validator_value]
        return f"{got} is not {' or '.join(map(str, wanted))}"
    if e.validator == "enum":
        return f"{got} is not one of {_short([v for v in e.validator_value if v is not None], 200)}"
    if e.validator in ("anyOf", "oneOf"):
        return f"{got} matches none of the accepted forms"
    return f"{got}: {e.message[:200]}"


def _short(value: Any, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _none_defaults(func: Callable[..., Any]) -> set[str]:
    """The parameters of `func` whose default is None (`x: int = None`: transformers writes no nullable)."""
    try:
        return {p.name for p in inspect.signature(func).parameters.values() if p.default is None}
    except (TypeError, ValueError):  # no signature to read
        return set()


def _with_null(schema: Any) -> Any:
    """`schema` with OpenAPI's `"nullable": true` (what transformers' get_json_schema writes for
    `Optional[...]`) said in JSON Schema's own terms, which have no such keyword: null among the types
    (and the enum)."""
    if isinstance(schema, list):
        return [_with_null(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict):
            out[key] = {name: _with_null(spec) for name, spec in value.items()}
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "additionalProperties"):
            out[key] = _with_null(value)
        else:
            out[key] = value
    if out.pop("nullable", False) is True:
        if "type" in out:
            types = out["type"] if isinstance(out["type"], list) else [out["type"]]
            out["type"] = [*types, "null"] if "null" not in types else types
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        for key in ("anyOf", "oneOf"):  # Optional[Union[...]]: null is one more accepted form
            if isinstance(out.get(key), list):
                out[key] = [*out[key], {"type": "null"}]
    return out


def truncate(text: str, max_chars: int) -> str:
    """`text` if it fits, else at most `max_chars` characters: its head and tail around a line saying how many
    characters were cut (the line is paid from the same budget), or only its head when the budget cannot hold
    that line (the limit is the model's context, which a marker must not outgrow)."""
    if len(text) <= max_chars:
        return text
    kept = max_chars
    while kept >= 0 and kept + len(_cut_marker(len(text) - kept)) > max_chars:
        kept = max_chars - len(_cut_marker(len(text) - kept))  # fewer kept, more cut: a marker a digit longer
    if kept < 0:
        return text[:max_chars]
    head = kept // 2
    return f"{text[:head]}{_cut_marker(len(text) - kept)}{text[len(text) - (kept - head):]}"


def _cut_marker(cut: int) -> str:
    return f"\n[... {cut} characters cut ...]\n"
