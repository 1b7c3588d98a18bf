"""ConfigError, and the hint that names the field a misspelt name was meant to be."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field and the fix."""


def did_you_mean(name: str, known: set[str]) -> str:
    """` (did you mean 'x'?)` for the known name closest to a misspelt one, else ''."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
