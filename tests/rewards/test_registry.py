"""resolve_reward_func: built-in names, factories with parameters, import paths, readable errors."""

import pytest

from grouprl.core import Registry
from grouprl.rewards import BUILTIN_REWARDS, math_accuracy, resolve_reward_func, resolve_reward_spec

FACTORIES = {"regex_match", "length_target", "cosine_length", "repetition_penalty", "overlong_penalty", "code_tests",
             "reward_model", "process_reward_model"}
EXPECTED = {"math_accuracy", "think_format", "think_format_soft"} | FACTORIES


def test_builtin_names():
    assert isinstance(BUILTIN_REWARDS, Registry) and set(BUILTIN_REWARDS) == EXPECTED
    assert {name for name in BUILTIN_REWARDS if BUILTIN_REWARDS.is_factory(name)} == FACTORIES


def test_plain_builtin_and_factory_names():
    assert resolve_reward_func("math_accuracy") is math_accuracy
    f = resolve_reward_func("regex_match", pattern=r"\d")
    assert f.__name__ == "regex_match" and f([""], ["a1"]) == [1.0]
    g = resolve_reward_func("overlong_penalty", max_len=10, cache_len=4)
    assert g.__name__ == "overlong_penalty" and g([""], ["x"], completion_lengths=[8]) == [-0.5]
    assert resolve_reward_func("repetition_penalty").__name__ == "repetition_penalty"  # defaults


def test_missing_or_unknown_parameters_list_the_accepted_ones():
    with pytest.raises(ValueError, match=r"regex_match.*pattern"):
        resolve_reward_func("regex_match")
    with pytest.raises(ValueError, match=r"overlong_penalty.*max_len, cache_len"):
        resolve_reward_func("overlong_penalty", max_len=10, cache=2)
    with pytest.raises(ValueError, match="takes no parameters"):
        resolve_reward_func("math_accuracy", strict=True)


def test_unknown_name_lists_builtins_and_the_import_form():
    with pytest.raises(ValueError) as info:
        resolve_reward_func("accuracy")
    msg = str(info.value)
    assert "math_accuracy" in msg and "code_tests" in msg and "package.module:function" in msg


def test_import_paths():
    f = resolve_reward_func("grouprl.rewards.format:think_format")
    assert f.__name__ == "think_format"
    g = resolve_reward_func("grouprl.rewards.shaping:length_target", target=5)
    assert g([""], ["xxxxx"]) == [1.0] and g.__name__ == "length_target"
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        resolve_reward_func("no_such_pkg.mod:f")
    with pytest.raises(ValueError, match="module 'grouprl.rewards.format' has no attribute 'nope'"):
        resolve_reward_func("grouprl.rewards.format:nope")


def test_a_module_in_the_current_folder_is_found_as_python_script_py_finds_it(tmp_path, monkeypatch):
    """`grouprl train --reward_funcs my_rewards_here:brevity` run from the folder holding my_rewards_here.py:
    the `grouprl` command's own sys.path lacks the current folder, which `python train.py` would have;
    it is looked in after everything else, and an error says where it looked."""
    import sys

    (tmp_path / "my_rewards_here.py").write_text("def brevity(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    f = resolve_reward_func("my_rewards_here:brevity")
    assert f([""], ["x"]) == [1.0] and sys.path[-1] == str(tmp_path)
    with pytest.raises(ValueError, match=f"cannot import module 'not_here_either'.*the current folder {tmp_path}"):
        resolve_reward_func("not_here_either:f")


def test_a_module_that_fails_as_it_is_imported_says_so(tmp_path, monkeypatch):
    """A syntax error names the file and the line; an error of the module's top-level code names it; neither
    reads as "No module named" (the retry in the current folder is not chained to the first lookup)."""
    import sys

    (tmp_path / "syntax_slip.py").write_text("def broken(:\n    pass\n")
    (tmp_path / "raises_on_import.py").write_text("RATE = 1 / 0\n\ndef f(prompts, completions):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(ValueError, match=r"reward 'syntax_slip:broken': module 'syntax_slip' is not valid Python: "
                                         rf".*\({tmp_path}/syntax_slip.py, line 1\); fix that line") as e:
        resolve_reward_func("syntax_slip:broken")
    assert e.value.__cause__.__context__ is None  # no ModuleNotFoundError in the traceback
    with pytest.raises(ValueError, match="reward 'raises_on_import:f': importing module 'raises_on_import' "
                                         rf"raised ZeroDivisionError: division by zero \({tmp_path}/raises_on_import"
                                         r"\.py, line 1:"):
        resolve_reward_func("raises_on_import:f")


class Constant:
    """A reward factory whose rewards are callable objects, without a __name__ of their own."""

    def __init__(self, value: float):
        self.value = value

    def __call__(self, prompts, completions, **columns):
        return [self.value] * len(completions)


def test_an_unnamed_reward_from_an_imported_factory_is_named_after_the_attribute():
    f = resolve_reward_func(f"{__name__}:Constant", value=0.5)
    assert f.__name__ == "Constant" and f([""], ["a", "b"]) == [0.5, 0.5]


def test_a_config_entry_is_a_name_an_import_path_or_a_mapping_with_the_parameters():
    assert resolve_reward_spec("math_accuracy") is math_accuracy
    assert resolve_reward_spec("grouprl.rewards.math:math_accuracy") is math_accuracy
    f = resolve_reward_spec({"name": "regex_match", "pattern": r"\d"})
    assert f.__name__ == "regex_match" and f([""], ["a1", "b"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"reward_funcs entry \{'pattern': 'x'\}: a mapping needs a `name` key"):
        resolve_reward_spec({"pattern": "x"})
    with pytest.raises(ValueError, match="reward_funcs entry 5 must be a name, a module:function path or a mapping"):
        resolve_reward_spec(5)
    with pytest.raises(ValueError, match=r"reward spec '': give a built-in name or 'package.module:function'"):
        resolve_reward_func("")
