"""Tools from functions (schema by transformers' get_json_schema) and tools by name (resolve_tool)."""

from typing import Literal, Optional, Union

import pytest
from transformers.utils import get_json_schema

from grouprl.tools import BUILTIN_TOOLS, Tool, ToolCall, check_call, resolve_tool, resolve_tools

from .conftest import add, web_lookup


def untyped(a):
    """Untyped.

    Args:
        a: A value.
    """


def undocumented(a: int) -> int:
    return a


def test_schema_is_transformers_get_json_schema():
    tool = Tool.from_function(add)
    assert (tool.name, tool.func, tool.is_async) == ("add", add, False)
    assert tool.schema == get_json_schema(add)
    assert tool.schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"a": {"type": "integer", "description": "The first integer."},
                       "b": {"type": "integer", "description": "The second integer."}},
        "required": ["a"],
    }


def test_async_function():
    async def fetch(url: str) -> str:
        """Fetch a page.

        Args:
            url: Where.
        """
        return url

    assert Tool.from_function(fetch).is_async


@pytest.mark.parametrize("func, why", [
    (untyped, "Argument a is missing a type hint in function untyped"),
    (undocumented, "Cannot generate JSON schema for undocumented because it has no docstring!"),
])
def test_a_function_that_cannot_describe_itself_fails_naming_it_and_the_fix(func, why):
    with pytest.raises(ValueError) as err:
        Tool.from_function(func)
    msg = str(err.value)
    assert msg.startswith(f"tool {func.__name__}: {why}. A tool is a function with a type hint on every parameter")
    assert "`Args:` with one `name: description` line per parameter" in msg


def test_check_call():
    tools = resolve_tools([add])
    assert check_call(ToolCall("add", {"a": 1}), tools) is None
    assert check_call(ToolCall("mul", {}), tools) == "unknown tool 'mul'; the tools are: add"
    assert check_call(ToolCall("add", {"b": 1, "c": 2}), tools) == (
        "bad arguments for add: missing 'a'; unexpected 'c'. It takes (a: integer, b: integer (optional))")


def pick(mode: Literal["fast", "slow"], ids: list[int], limit: Optional[float] = None,
         key: Optional[Union[int, list[str]]] = None, tag: str = None) -> str:
    """Pick.

    Args:
        mode: How.
        ids: Which.
        limit: At most.
        key: By what.
        tag: A tag.
    """
    return mode


def test_check_call_refuses_values_the_schema_refuses():
    """Values were passed as the model wrote them: `"2"` to an int, a word outside a Literal, a string for
    a list all ran. The schema the model is shown now decides, null included for an Optional (which
    transformers writes as OpenAPI's `nullable`, for a Union too) and for a default of None. The model
    is told in JSON's spelling, a long value shortened."""
    tools = resolve_tools([add, pick])
    assert check_call(ToolCall("pick", {"mode": "fast", "ids": [1, 2], "limit": None}), tools) is None
    assert check_call(ToolCall("pick", {"mode": "slow", "ids": [], "limit": 2, "key": None}), tools) is None
    assert check_call(ToolCall("pick", {"mode": "slow", "ids": [], "key": ["a", "b"], "tag": None}), tools) is None
    assert check_call(ToolCall("add", {"a": "2"}), tools) == (
        'bad arguments for add: \'a\': "2" is not integer. It takes (a: integer, b: integer (optional))')
    assert check_call(ToolCall("pick", {"mode": "now", "ids": "1,2", "limit": "x", "key": {}}), tools) == (
        'bad arguments for pick: \'mode\': "now" is not one of ["fast", "slow"]; \'ids\': "1,2" is not array; '
        '\'limit\': "x" is not number or null; \'key\': {} matches none of the accepted forms. It takes '
        "(mode: string, ids: array, limit: number (optional), key: any (optional), tag: string (optional))")
    assert "'ids': true is not integer" in check_call(ToolCall("pick", {"mode": "fast", "ids": [True]}), tools)
    long = check_call(ToolCall("add", {"a": "9" * 50_000}), tools)
    assert len(long) < 200 and '"999' in long and '999... is not integer' in long


def test_a_hand_written_schema_jsonschema_cannot_use_checks_no_value():
    """A Tool's own schema with a pattern Python cannot compile, or a type that is no name: the check
    raised out of the parser and execute_calls (the rollout failed); such a call is now made as before."""
    for spec in ({"type": "string", "pattern": "("}, {"type": 5}, "string"):
        tool = Tool("t", lambda q: q, {"type": "function", "function": {"name": "t", "parameters": {
            "type": "object", "properties": {"q": spec}, "required": ["q"]}}})
        assert check_call(ToolCall("t", {"q": "x"}), {"t": tool}) is None


def test_resolve_by_function_by_import_path_and_builtin():
    assert resolve_tool(add).name == "add"
    tool = resolve_tool("tests.tools.conftest:web_lookup")
    assert (tool.name, tool.func) == ("web_lookup", web_lookup)
    assert resolve_tool(tool) is tool
    python = resolve_tool("python", timeout_s=3.0)
    assert python.name == "python" and python.schema["function"]["parameters"]["required"] == ["code"]
    assert list(resolve_tools(["python", add, "tests.tools.conftest:web_lookup"])) == ["python", "add", "web_lookup"]
    assert set(BUILTIN_TOOLS) == {"python"} and BUILTIN_TOOLS.is_factory("python")


def test_an_import_path_with_parameters_is_a_factory():
    tool = resolve_tool("tests.tools.conftest:make_lookup", prefix=">")
    assert (tool.name, tool.func("x")) == ("lookup", ">x")


def test_resolve_errors_name_the_problem_and_the_fix():
    with pytest.raises(ValueError, match=r"unknown tool 'calculator'\. Built-in tools: python\. Any other "
                                         r"function can be named by import path as 'package\.module:function'"):
        resolve_tool("calculator")
    with pytest.raises(ValueError, match="tool 'no_such.mod:f': cannot import module 'no_such.mod'"):
        resolve_tool("no_such.mod:f")
    with pytest.raises(ValueError, match="module 'tests.tools.conftest' has no attribute 'nope'"):
        resolve_tool("tests.tools.conftest:nope")
    with pytest.raises(ValueError, match=r"tool 'python': got an unexpected keyword argument 'timeout'; its "
                                         r"parameters are \(timeout_s=10.0, memory_mb=512, max_output_chars=2000, "
                                         r"isolation='strict'\)"):
        resolve_tool("python", timeout=3)
    with pytest.raises(ValueError, match=r"tool 'add' is a function already; it takes no parameters \(got \['b'\]\)"):
        resolve_tool(add, b=1)
    with pytest.raises(ValueError, match="two tools are named 'add': the model calls tools by name, so rename one"):
        resolve_tools([add, add])
    with pytest.raises(ValueError, match=r"tools entry \{'timeout_s': 3\}: a mapping needs a `name` key"):
        resolve_tools([{"timeout_s": 3}])
