"""Shared by the tool tests: small typed tools and a Qwen2.5-style tokenizer built offline."""

from pathlib import Path

import pytest

from grouprl.tasks.testing import build_char_tokenizer

QWEN_TEMPLATE = (Path(__file__).parent / "qwen2_5_chat_template.jinja").read_text()


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def web_lookup(query: str) -> str:
    """Look a query up.

    Args:
        query: What to look up.
    """
    return f"results for {query}"


def make_lookup(prefix: str):
    """A factory, named with parameters in a config: `resolve_tool("...:make_lookup", prefix=">")`."""

    def lookup(query: str) -> str:
        """Look a query up.

        Args:
            query: What to look up.
        """
        return prefix + query

    return lookup


def build_qwen_tokenizer():
    """The character tokenizer with Qwen2.5's chat template and its turn tokens (special, as in Qwen's
    tokenizer) and <tool_call> / </tool_call> (added, not special, as in Qwen's)."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN_TEMPLATE
    return tok


@pytest.fixture
def qwen_tokenizer():
    return build_qwen_tokenizer()

