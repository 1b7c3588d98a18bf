"""The code_tests reward: extraction from fenced blocks, fraction of tests passed, parallel scoring."""

import json

import pytest

from grouprl.rewards import code_tests, extract_code


def test_extract_code_takes_the_last_python_block():
    text = "First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\n```bash\nls\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("no code here") is None


def test_code_tests_fraction_passed():
    f = code_tests(timeout_s=2.0, memory_mb=128)
    tests = [{"input": "2", "output": "4"}, {"input": "3", "output": "9"}, {"input": "-1", "output": "1"},
             {"input": "0", "output": "0"}]
    completions = [
        "```python\nn = int(input())\nprint(n * n)\n```",  # all 4
        "```python\nn = int(input())\nprint(n + n)\n```",  # 2 -> 4 and 0 -> 0 pass: 2/4
        "I think the answer is to square it.",  # no code block -> 0
        [{"role": "assistant", "content": "```python\ndef sq(n):\n    return n * n\n```"}],
        "```python\nprint(1)\n```",
    ]
    assert_tests = [{"assert": "assert sq(3) == 9"}, {"assert": "assert sq(-2) == 4"}]
    rows = [tests, tests, tests, json.dumps(assert_tests), []]
    assert f([""] * 5, completions, tests=rows) == [1.0, 0.5, 0.0, 1.0, None]


def test_code_tests_needs_the_tests_column():
    with pytest.raises(ValueError, match="'tests'"):
        code_tests()([""], ["```python\nprint(1)\n```"], answer=["1"])


def test_a_program_faking_a_sandbox_failure_scores_0_and_the_batch_goes_on():
    """sandbox_error (on which code_tests raises) comes only from a pipe the program never holds."""
    fake = "import os, sys\nsys.stderr.write('sandbox setup failed: fake\\n')\nsys.stderr.flush()\nos._exit(125)"
    completions = [f"```python\n{fake}\n```", "```python\nprint(int(input()) * 2)\n```"]
    tests = [[{"input": "2", "output": "4"}]] * 2
    assert code_tests(timeout_s=15.0, memory_mb=128)(["", ""], completions, tests=tests) == [0.0, 1.0]


def test_a_memory_limit_the_interpreter_cannot_start_in_is_refused_when_built():
    with pytest.raises(ValueError, match="memory_mb=4: the sandbox cannot run"):
        code_tests(memory_mb=4)


def test_assert_tests_are_named_as_gameable_once(caplog):
    """A policy can learn to pass an in-process assert test without solving the task (the program runs
    in the harness's interpreter): said once per reward, not for input/output tests."""
    f = code_tests(timeout_s=2.0, memory_mb=128)
    program = ["```python\ndef sq(n):\n    return n * n\n```"]
    with caplog.at_level("WARNING", logger="grouprl.rewards.code"):
        f([""], program, tests=[[{"input": "", "output": ""}]])
        assert not caplog.records
        for _ in range(2):
            assert f([""], program, tests=[[{"assert": "assert sq(3) == 9"}]]) == [1.0]
    assert len(caplog.records) == 1 and "a policy can learn to pass them" in caplog.records[0].getMessage()
