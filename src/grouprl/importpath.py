"""Objects a config names (rewards, tools, environments): a name in a registry, an import path
"package.module:attribute", or either one in a mapping with its parameters, `{name: ..., **params}`.

- `import_callable(spec, kind)`: the callable an import path names.
- `split_spec(entry)`: a config entry as (spec, params).
- `resolve_spec(spec, registry, params, ...)`: what a name or an import path stands for, built with
  `params` where it is a factory. Rewards (rewards/registry.py) and tools (tools/registry.py) both
  resolve their config entries here, each with its own `grouprl.core.Registry` of built-ins.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from typing import Any, Callable

from grouprl.core.registry import Registry


def import_callable(spec: str, kind: str) -> Callable:
    """The callable that `spec` ("package.module:function", or "package.module:Class.method") names.

    `kind` ("reward", "tool") opens every error message, which names the part that failed.
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r}: {e} (looked in the installed "
                         f"packages, PYTHONPATH and the current folder {os.getcwd()})") from e
    except SyntaxError as e:  # the module's own code, found but not valid Python
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} is not valid Python: {e.msg} "
                         f"({e.filename}, line {e.lineno}); fix that line") from e
    except Exception as e:  # raised by the module's own code as it was imported
        where = traceback.extract_tb(e.__traceback__)[-1]
        raise ValueError(f"{kind} {spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e} "
                         f"({where.filename}, line {where.lineno}: its top-level code runs on import)") from e
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{kind} {spec!r}: {attr!r} is a {type(target).__name__}, not a function")
    return target


def _import(module_name: str) -> Any:
    """The module, found as `python script.py` would find it: also in the current folder (after the
    installed packages: a module there never shadows one), which the `grouprl` command's own path
    lacks, so that `reward_funcs: [my_rewards:brevity]` beside the config works without PYTHONPATH."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top, cwd = module_name.partition(".")[0], os.getcwd()
        if e.name != top or cwd in sys.path or "" in sys.path:
            raise
    sys.path.append(cwd)  # outside the handler: an error of the module found here is not chained to the first
    return importlib.import_module(module_name)


def split_spec(entry: Any) -> tuple[Any, dict[str, Any]]:
    """A config entry as (spec, params): a mapping's `name` and its other keys, or the entry itself
    with no parameters. ValueError for a mapping without a string `name`."""
    if not isinstance(entry, dict):
        return entry, {}
    params = dict(entry)
    name = params.pop("name", None)
    if not isinstance(name, str):
        raise ValueError("a mapping needs a `name` key")
    return name, params


def resolve_spec(spec: str, registry: Registry, params: dict[str, Any], *, kind: str, forms: str,
                 how: str) -> tuple[Any, bool]:
    """(what `spec` names, whether a factory built it with `params`).

    `spec` is a name in `registry` (a factory entry is called with `params`, which must fit its
    signature; any other entry takes none) or "package.module:attribute" (the target is called with
    `params` as a factory when there are any). ValueError otherwise, opened by `kind` ("reward",
    "tool"): for a spec that is not a non-empty string it says the `forms` a spec may take; for an
    unknown name it lists the registry and the import form, followed by `how` (what such a function
    looks like); for parameters that do not fit it lists the accepted ones.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{kind} spec {spec!r}: give {forms}")
    if spec in registry:
        target, factory = registry[spec], registry.is_factory(spec)
        if not factory and params:
            raise ValueError(f"{kind} {spec!r} takes no parameters (got {sorted(params)})")
        if factory:
            _check_parameters(kind, spec, target, params)
    elif ":" in spec:
        target, factory = import_callable(spec, kind), bool(params)
    else:
        raise ValueError(f"unknown {kind} {spec!r}. Built-in {kind}s: {', '.join(sorted(registry))}. Any other "
                         f"function can be named by import path as 'package.module:function'{how}")
    return (target(**params), True) if factory else (target, False)


def _check_parameters(kind: str, name: str, factory: Callable, params: dict[str, Any]) -> None:
    """ValueError naming the accepted parameters (`name=default` where there is one) unless `params`
    fit `factory`'s signature."""
    sig = inspect.signature(factory)
    try:
        sig.bind(**params)
    except TypeError as e:
        accepted = ", ".join(p.name + ("" if p.default is inspect.Parameter.empty else f"={p.default!r}")
                             for p in sig.parameters.values())
        raise ValueError(f"{kind} {name!r}: {e}; its parameters are ({accepted})") from None
