"""Turning what the trainer passes (strings or chat messages) into plain text."""

from __future__ import annotations

from typing import Any


def message_content(message: Any) -> str:
    """Content of one chat message; multi-part content ([{"type": "text", "text": ...}]) is joined."""
    content = message.get("content", "") if isinstance(message, dict) else message
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return "" if content is None else str(content)


def completion_text(completion: Any) -> str:
    """A completion as text: a string as is; a message list (TRL's conversational form) -> the
    content of its assistant messages, joined (usually exactly one)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return message_content(completion)
    if isinstance(completion, (list, tuple)):
        assistant = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        return "\n".join(message_content(m) for m in (assistant or completion))
    raise TypeError(f"completion of type {type(completion).__name__}: expected a string or a list of chat messages")


def prompt_text(prompt: Any) -> str:
    """A prompt as text, for reward functions that only need to read it (message contents joined)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return "\n".join(message_content(m) for m in prompt)
    return str(prompt)


def prompt_messages(prompt: Any) -> list[dict]:
    """A prompt as chat messages, for a reward model's chat template: a string becomes one user
    message; a message list is copied."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def column(kwargs: dict, names: tuple[str, ...], n: int, func: str) -> list:
    """The first present dataset column among `names`, checked to hold one value per completion."""
    for name in names:
        if kwargs.get(name) is not None:
            values = list(kwargs[name])
            if len(values) != n:
                raise ValueError(f"{func}: column {name!r} has {len(values)} values for {n} completions")
            return values
    raise ValueError(
        f"{func} needs the dataset column {' or '.join(map(repr, names))}; "
        f"the columns given were {sorted(k for k in kwargs)}"
    )
