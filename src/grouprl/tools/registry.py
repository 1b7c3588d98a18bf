"""Tools by name: `BUILTIN_TOOLS`, `resolve_tool`, `resolve_tools`.

A config names a tool as a built-in ("python", with parameters) or any function by import path
("package.module:function"), as rewards are named (rewards/registry.py):
`tools: [python, my_pkg.tools:web_lookup]`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ..importpath import import_callable
from .base import HOW, Tool
from .python import python_tool

BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"python": python_tool}  # name -> factory (parameters -> Tool)


def resolve_tool(spec: str | Callable | Tool, **params: Any) -> Tool:
    """A tool from a `Tool`, a function, a built-in name ("python"), or "package.module:function".

    With `params`, a built-in is built with them (`python`: timeout_s, memory_mb, ...), and an
    imported target is called with them as a factory that returns the tool function (or a `Tool`).
    """
    if isinstance(spec, Tool) or callable(spec):
        if params:
            raise ValueError(f"tool {getattr(spec, 'name', None) or spec.__name__!r} is a function already; it "
                             f"takes no parameters (got {sorted(params)}): give them to its factory instead")
        return spec if isinstance(spec, Tool) else Tool.from_function(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"tool spec {spec!r}: give a function, a built-in name or 'package.module:function'")
    if spec in BUILTIN_TOOLS:
        factory = BUILTIN_TOOLS[spec]
        try:
            inspect.signature(factory).bind(**params)
        except TypeError as e:
            accepted = ", ".join(f"{p.name}={p.default!r}" for p in inspect.signature(factory).parameters.values())
            raise ValueError(f"tool {spec!r}: {e}; its parameters are ({accepted})") from None
        return factory(**params)
    if ":" not in spec:
        raise ValueError(f"unknown tool {spec!r}. Built-in tools: {', '.join(sorted(BUILTIN_TOOLS))}. Any other "
                         "function can be named by import path as 'package.module:function'. " + HOW)
    target = import_callable(spec, "tool")
    built = target(**params) if params else target
    return built if isinstance(built, Tool) else Tool.from_function(built)


def resolve_tools(specs: list[str | Callable | Tool | dict]) -> dict[str, Tool]:
    """name -> tool, in order, from `tools` entries: a `Tool`, a function, a built-in name, an import
    path, or a mapping with `name` and the tool's parameters. ValueError naming the entry otherwise;
    two tools with one name fail."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        try:
            if isinstance(spec, dict):
                params = dict(spec)
                if not isinstance(params.get("name"), str):
                    raise ValueError("a mapping needs a `name` key")
                tool = resolve_tool(params.pop("name"), **params)
            else:
                tool = resolve_tool(spec)
        except (ValueError, TypeError, ImportError) as e:
            raise ValueError(f"tools entry {spec!r}: {e}") from None
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}: the model calls tools by name, so rename one")
        tools[tool.name] = tool
    return tools
