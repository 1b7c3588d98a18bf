"""The dependency arrows of docs/architecture.md, read from the source: `cli -> trainer ->
{rollout, rewards, data, checkpoint, runlog} -> core`, one way, no cycles. Every import of a grouprl
module counts, at module level or inside a function (under `if TYPE_CHECKING:` too). The graph is
read with `ast` at two granularities: modules (grouprl.core.policy_loss) and units, a top-level
module or package (core, trainer)."""

import ast
import collections
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "grouprl"

# rollout/factory.py reads the config and picks the engine: it wires rollout/ from above, at the
# trainer's level, so it is a unit of its own, and the rest of rollout/ stays below the config.
OWN_UNITS = {"grouprl.rollout.factory": "rollout.factory"}


def _unit(module: str) -> str:
    """grouprl.core.advantages -> core; grouprl.trainer -> trainer; grouprl -> grouprl."""
    if module in OWN_UNITS:
        return OWN_UNITS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "grouprl"


def _modules() -> dict[str, Path]:
    """grouprl.core.advantages -> its file; a package's name -> its __init__.py."""
    out = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module an import names: itself, or the nearest enclosing package (`grouprl.rollout.HFEngine`
    -> grouprl.rollout)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _module_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from grouprl import distributed` imports grouprl.distributed
                targets = [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.split(".")[0] == "grouprl" and _resolve(target) != module:
                    edges[module].add(_resolve(target))
    return edges


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for module, targets in MODULE_GRAPH.items():
        for target in targets:
            if _unit(target) != _unit(module):
                edges[_unit(module)].add(_unit(target))
    return edges


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (depth-first), or None."""
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> list[str] | None:
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:  # back to a module on the current path: the cycle from v to v
                walk = path + [u, v]
                return walk[walk.index(v):]
            if v not in state and (found := visit(v, path + [u])):
                return found
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u, [])):
            return found
    return None


MODULE_GRAPH = _module_graph()
GRAPH = _graph()


def test_the_graph_was_read():
    assert {"batch", "rollout", "rewards", "config"} <= GRAPH["trainer"]


def test_the_module_graph_was_read():
    assert {"grouprl.core.policy_terms", "grouprl.core.loss_params"} <= MODULE_GRAPH["grouprl.core.policy_loss"]
    assert "grouprl.distributed" in MODULE_GRAPH["grouprl.trainer"]  # `from grouprl import distributed as D`
    assert "grouprl.rollout" in MODULE_GRAPH["grouprl.rollout.factory"]  # `from grouprl.rollout import HFEngine`


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"x": {"a"}, "a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_cycles_between_modules_and_packages():
    cycle = _cycle(GRAPH)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_no_cycles_between_modules():
    """Module by module, as `python -c 'import grouprl.x'` would meet them: a type-checking-only
    import counts too (it still reads one module from the other)."""
    cycle = _cycle(MODULE_GRAPH)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.parametrize("unit, allowed", [
    ("core", set()),                      # pure math: nothing of ours
    ("lora", set()),
    ("packing", set()),                   # padding-free passes: transformers and torch only
    ("config", {"core", "tools"}),        # core's registries and presets, tools' call formats; nothing else
    ("sandbox", set()),
    ("tools", {"core", "sandbox", "importpath"}),  # core: the Registry of built-in tools
    ("rewards", {"core", "sandbox", "importpath"}),
    ("rollout", {"tools", "lora", "importpath"}),  # engines and turns know no config and no trainer
    # the factory: the config's engine and driver; the trainer's level, below it
    ("rollout.factory", {"rollout", "config", "policy", "checkpoint", "distributed", "tools", "envs", "importpath"}),
])
def test_lower_layers_import_only_what_is_below_them(unit, allowed):
    assert GRAPH.get(unit, set()) <= allowed, f"{unit} imports {sorted(GRAPH[unit] - allowed)}"


def test_only_the_trainer_imports_the_rollout_factory():
    """The trainer, and rollout_source.py, which builds the async producer's own rollout driver for
    the trainer (split out of trainer.py: the same layer)."""
    assert {u for u, deps in GRAPH.items() if "rollout.factory" in deps} == {"trainer", "rollout_source"}


def test_only_the_cli_imports_the_trainer_and_nothing_imports_the_cli():
    for unit, deps in GRAPH.items():
        if unit not in ("cli", "__main__"):
            assert not deps & {"trainer", "cli", "cli_args"}, f"{unit} imports {sorted(deps)}"


def _private_imports(path: Path) -> list[str]:
    """`from grouprl.x import _name` (or a relative one) in `path`: a private name taken from another module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "grouprl"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} imports {a.name}")
    return found


def test_no_private_names_imported_across_modules():
    found = [hit for path in MODULES.values() for hit in _private_imports(path)]
    assert not found, "make these public where they live: " + "; ".join(found)


def test_benchmarks_and_scripts_import_grouprl_not_the_tests():
    root = SRC.parents[1]
    found = []
    for path in sorted([*(root / "benchmarks").glob("*.py"), *(root / "scripts").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "tests"]
    found += [hit for path in sorted((root / "benchmarks").glob("*.py")) for hit in _private_imports(path)]
    assert not found, "; ".join(found)
