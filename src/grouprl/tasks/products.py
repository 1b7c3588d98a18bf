"""The built-in tool-use task: products of a 3-digit and a 2-digit number, with a calculator tool.

    prompt       "347*86="                                          (user message "347*86")
    tool use     <tool_call>{"name": "mul", "arguments": {"a": 347, "b": 86}}</tool_call><|im_end|>
                 [29842]                                            (the tool message, context)
                 29842<|im_end|>
    no tool      ~24000<|im_end|>                                   (an estimate: wrong, almost always)

A 0.5 M-parameter policy cannot multiply, but it can copy: the operands into the call and the
tool's result into its answer. The shipped policy (`TOOL_POLICY_DIR`, built by
scripts/build_tool_policy.py) was warmed up to use the tool on a minority of draws and to give a
leading-digit estimate otherwise, so greedy decoding starts out estimating (accuracy near 0)
while sampling finds the tool; GRPO moves the mode to the tool.

The chat template is a terse one (every character is a token): a user turn is its content and
"=", an assistant turn its content, its calls in Hermes' `<tool_call>` format and `<|im_end|>`, a
tool message its content in brackets. It does not print the tools' schemas (one tool, learned in
the warm-up; a Qwen-style template would spend ~400 prompt tokens on them).

Rows carry `prompt` (chat messages), `answer`, `a` and `b`. Reward functions: `product_accuracy`
(the last assistant message is exactly the product) and `correct_tool_use` (the trajectory called
`mul` with the prompt's operands), both reading the trajectory's messages.
"""

from __future__ import annotations

import random
from typing import Any

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{ m.content }}="
    "{%- elif m.role == 'assistant' -%}{{ m.content }}"
    "{%- for tc in (m.tool_calls or []) -%}{%- set f = tc.function if tc.function is defined else tc -%}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>'
    "{%- endfor -%}<|im_end|>"
    "{%- elif m.role == 'tool' -%}[{{ m.content }}]"
    "{%- endif -%}"
    "{%- endfor -%}"
)
TURN_END, CALL_TOKENS = "<|im_end|>", ("<tool_call>", "</tool_call>")
EVAL_SIZE = 200
_SPLIT_SEED = 4321


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def estimate(a: int, b: int) -> str:
    """What the policy says without the tool: "~" and the product of the leading digits, e.g. 347*86 -> "~24000"."""
    lead = lambda x: int(str(x)[0]) * 10 ** (len(str(x)) - 1)  # noqa: E731
    return f"~{lead(a) * lead(b)}"


def make_row(a: int, b: int) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b), "a": a, "b": b}


def _split() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    return pairs[EVAL_SIZE:], pairs[:EVAL_SIZE]


def train_rows() -> list[dict[str, Any]]:
    """80,800 training problems (every pair not held out), in a fixed shuffled order."""
    return [make_row(a, b) for a, b in _split()[0]]


def eval_rows() -> list[dict[str, Any]]:
    """The 200 held-out problems, disjoint from `train_rows()`."""
    return [make_row(a, b) for a, b in _split()[1]]


def _final_answer(trajectory: Any) -> str:
    if isinstance(trajectory, str):
        return trajectory.strip()
    assistant = [m for m in trajectory if m.get("role") == "assistant"]
    return str(assistant[-1].get("content") or "").strip() if assistant else ""


def product_accuracy(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the trajectory's last assistant message is exactly the product, else 0.0."""
    return [float(_final_answer(c) == str(a)) for c, a in zip(completions, answer)]


product_accuracy.rowwise = True  # scored row by row: the reward workers may cut a group


def correct_tool_use(prompts: list[Any], completions: list[Any], a: list[int], b: list[int],
                     **kwargs: Any) -> list[float]:
    """1.0 when the trajectory called `mul` with the prompt's operands (and nothing else), else 0.0."""
    out = []
    for c, x, y in zip(completions, a, b):
        calls = [tc["function"] for m in c if isinstance(m, dict) for tc in m.get("tool_calls", [])]
        out.append(float(bool(calls) and all(f["name"] == "mul" and f["arguments"] == {"a": x, "b": y}
                                             for f in calls)))
    return out


correct_tool_use.rowwise = True  # scored row by row: the reward workers may cut a group


def add_chat_tokens(tokenizer) -> None:
    """The character tokenizer's additions for this task: <|im_end|> (special: the end of an
    assistant turn, the EOS), the call tokens (plain added tokens, as in Qwen's), the template."""
    tokenizer.add_special_tokens({"additional_special_tokens": [TURN_END]})
    tokenizer.add_tokens(list(CALL_TOKENS))
    tokenizer.eos_token = TURN_END
    tokenizer.chat_template = CHAT_TEMPLATE
