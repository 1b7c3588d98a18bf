"""Objects named in a config by import path: "package.module:attribute" (rewards, tools)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def import_callable(spec: str, kind: str) -> Callable:
    """The callable that `spec` ("package.module:function", or "package.module:Class.method") names.

    `kind` ("reward", "tool") opens every error message, which names the part that failed.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r}: {e}") from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{kind} {spec!r}: {attr!r} is a {type(target).__name__}, not a function")
    return target
