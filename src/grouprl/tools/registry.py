"""Tools by name: `BUILTIN_TOOLS`, `resolve_tool`, `resolve_tools`.

A config names a tool as a built-in ("python", with parameters) or any function by import path
("package.module:function"), as rewards are named (both through grouprl.importpath.resolve_spec):
`tools: [python, my_pkg.tools:web_lookup]`.
"""

from __future__ import annotations

from typing import Any, Callable

from grouprl.core.registry import Registry

from ..importpath import resolve_spec, split_spec
from .base import HOW, Tool
from .python import python_tool

BUILTIN_TOOLS: Registry[Callable[..., Tool]] = Registry("tool", "grouprl.tools.BUILTIN_TOOLS.register")
"""name -> factory (parameters -> Tool); every built-in tool is registered with factory=True."""
BUILTIN_TOOLS.register("python", factory=True)(python_tool)


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
    built, _ = resolve_spec(spec, BUILTIN_TOOLS, params, kind="tool", how=". " + HOW,
                            forms="a function, a built-in name or 'package.module:function'")
    return built if isinstance(built, Tool) else Tool.from_function(built)


def resolve_tools(specs: list[str | Callable | Tool | dict]) -> dict[str, Tool]:
    """name -> tool, in order, from `tools` entries: a `Tool`, a function, a built-in name, an import
    path, or a mapping with `name` and the tool's parameters. ValueError naming the entry otherwise;
    two tools with one name fail."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        try:
            name, params = split_spec(spec)
            tool = resolve_tool(name, **params)
        except (ValueError, TypeError, ImportError) as e:
            raise ValueError(f"tools entry {spec!r}: {e}") from None
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}: the model calls tools by name, so rename one")
        tools[tool.name] = tool
    return tools
