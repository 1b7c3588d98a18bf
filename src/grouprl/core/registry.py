"""The one registry mechanism of grouprl: named variants of one kind (advantage estimators, policy
terms, loss aggregations, ratio levels, KL estimators, importance-sampling modes, token masks,
multi-objective aggregations; outside core, the built-in reward functions and tools), each a
function registered under the name the config uses.

    ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "grouprl.core.register_advantage_estimator")

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(...): ...

    ADVANTAGE_ESTIMATORS.get("my_estimator")   # the function; an unknown name raises ValueError
    ADVANTAGE_ESTIMATORS.names()               # ("grpo", ..., "my_estimator"), registration order

Config validation reads the allowed names from the registries, so a variant registered before the
config is validated is accepted, and an unknown name is answered with the registered ones.

A registry is a read-only ``Mapping`` (``sorted(r)``, ``r[name]``, ``name in r`` work), with two
departures from ``dict``: ``get(name)`` raises instead of returning a default (a missing variant is
always a mistake to report), and ``unregister`` / ``del r[name]`` / the ``registered`` context
manager remove a variant again (meant for tests, which must leave the registries as they found them).

An entry registered with ``factory=True`` is a factory: called with the parameters a config gives
next to the name (``{name: regex_match, pattern: ...}``), it returns the variant itself;
``is_factory(name)`` tells the two apart (grouprl.importpath.resolve_spec builds it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Mapping[str, F], Generic[F]):
    """Named functions of one ``kind`` (e.g. "advantage estimator"); ``decorator`` is the public
    path of the function that registers one, quoted in error messages."""

    def __init__(self, kind: str, decorator: str) -> None:
        self.kind = kind
        self.decorator = decorator
        self._entries: dict[str, F] = {}
        self._factories: set[str] = set()

    def register(self, name: str, *, factory: bool = False) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name`` (with ``factory=True``: a function of parameters
        that returns the variant); a name already taken raises ValueError."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name {name!r} must be a non-empty string")

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered; pick another name")
            self._entries[name] = fn
            if factory:
                self._factories.add(name)
            return fn

        return decorator

    def get(self, name: str, arg: str | None = None) -> F:  # type: ignore[override]
        """The function registered as ``name``; otherwise ValueError naming the kind, the bad name
        (as ``arg=name`` when ``arg`` names the caller's parameter), the registered names and how to
        register one."""
        if name in self._entries:
            return self._entries[name]
        what = f"{arg}={name!r}" if arg else f"{self.kind} {name!r}"
        raise ValueError(f"{what} is unknown; use one of {sorted(self._entries)} (the registered "
                         f"{self.kind}s), or register one with @{self.decorator}(name)")

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._entries)

    def is_factory(self, name: str) -> bool:
        """Whether ``name`` was registered with ``factory=True`` (False for a name not registered)."""
        return name in self._factories

    def unregister(self, name: str) -> F:
        """Remove and return ``name``'s function (KeyError if it is not registered). For tests."""
        if name not in self._entries:
            raise KeyError(f"{self.kind} {name!r} is not registered")
        self._factories.discard(name)
        return self._entries.pop(name)

    @contextmanager
    def registered(self, name: str, fn: F, *, factory: bool = False) -> Iterator[F]:
        """``with registry.registered(name, fn):`` registers ``fn`` for the block only (tests)."""
        self.register(name, factory=factory)(fn)
        try:
            yield fn
        finally:
            self.unregister(name)

    def __delitem__(self, name: str) -> None:
        self.unregister(name)

    def __getitem__(self, name: str) -> F:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
