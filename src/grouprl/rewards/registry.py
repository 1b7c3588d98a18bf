"""Reward functions by name: `BUILTIN_REWARDS` and `resolve_reward_func`.

An entry is either a reward function (no parameters) or a factory (parameters -> reward function),
marked by membership in `FACTORIES`. A config names a built-in ("math_accuracy", "regex_match" with
pattern=...) or any function by import path ("package.module:function"); with parameters, an
imported target is called with them to build the reward function.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ..importpath import import_callable
from .code import code_tests
from .format import regex_match, think_format, think_format_soft
from .math import math_accuracy
from .model import reward_model
from .prm import process_reward_model
from .shaping import cosine_length, length_target, overlong_penalty, repetition_penalty

BUILTIN_REWARDS: dict[str, Callable] = {
    "math_accuracy": math_accuracy,
    "think_format": think_format,
    "think_format_soft": think_format_soft,
    "regex_match": regex_match,
    "length_target": length_target,
    "cosine_length": cosine_length,
    "repetition_penalty": repetition_penalty,
    "overlong_penalty": overlong_penalty,
    "code_tests": code_tests,
    "reward_model": reward_model,
    "process_reward_model": process_reward_model,
}
FACTORIES = frozenset(
    {"regex_match", "length_target", "cosine_length", "repetition_penalty", "overlong_penalty", "code_tests",
     "reward_model", "process_reward_model"}
)


def _build(name: str, factory: Callable, params: dict[str, Any]) -> Callable:
    sig = inspect.signature(factory)
    try:
        sig.bind(**params)
    except TypeError as e:
        accepted = ", ".join(
            p.name + ("" if p.default is inspect.Parameter.empty else f"={p.default!r}")
            for p in sig.parameters.values()
        )
        raise ValueError(f"reward {name!r}: {e}; its parameters are ({accepted})") from None
    func = factory(**params)
    func.__name__ = name
    return func


def resolve_reward_func(spec: str, **params: Any) -> Callable:
    """A reward function from a built-in name or an import path "package.module:function"."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec {spec!r}: give a built-in name or 'package.module:function'")
    if spec in BUILTIN_REWARDS:
        entry = BUILTIN_REWARDS[spec]
        if spec in FACTORIES:
            return _build(spec, entry, params)
        if params:
            raise ValueError(f"reward {spec!r} takes no parameters (got {sorted(params)})")
        return entry
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}. Built-in rewards: {', '.join(sorted(BUILTIN_REWARDS))}. "
            "Any other function can be named by import path as 'package.module:function' "
            "(it is called as f(prompts, completions, **columns) and returns one float or None per completion)."
        )
    target = import_callable(spec, "reward")
    if params:
        func = target(**params)
        if not getattr(func, "__name__", None):
            func.__name__ = spec.partition(":")[2].rsplit(".", 1)[-1]
        return func
    return target


def resolve_reward_spec(spec: Any) -> Callable:
    """A reward function from a `reward_funcs` config entry: a name, a module:function path, or a
    mapping with `name` and the function's parameters."""
    if isinstance(spec, dict):
        params = dict(spec)
        name = params.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"reward_funcs entry {spec!r} needs a `name` key")
        return resolve_reward_func(name, **params)
    if not isinstance(spec, str):
        raise ValueError(f"reward_funcs entry {spec!r} must be a name, a module:function path or a mapping")
    return resolve_reward_func(spec)
