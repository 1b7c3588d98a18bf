"""The dependency arrows of docs/architecture.md, read from the source: `cli -> trainer ->
{rollout, rewards, data, checkpoint, runlog} -> core`, one way, no cycles. Every import of a grouprl
module counts, at module level or inside a function."""

import ast
import collections
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "grouprl"


def _unit(module: str) -> str:
    """grouprl.core.advantages -> core; grouprl.trainer -> trainer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "grouprl"


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC.parent).with_suffix("").parts
        module = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from grouprl import distributed` imports grouprl.distributed
                targets = [f"{base}.{a.name}" if base == "grouprl" else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target.split(".")[0] == "grouprl" and _unit(target) != _unit(module):
                    edges[_unit(module)].add(_unit(target))
    return edges


GRAPH = _graph()


def test_the_graph_was_read():
    assert {"core", "rollout", "rewards", "config"} <= GRAPH["trainer"]


def test_no_cycles_between_modules_and_packages():
    state: dict[str, int] = {}

    def visit(u: str, path: list[str]) -> None:
        state[u] = 1
        for v in sorted(GRAPH.get(u, ())):
            if state.get(v) == 1:
                pytest.fail(f"import cycle: {' -> '.join(path + [u, v])}")
            if v not in state:
                visit(v, path + [u])
        state[u] = 2

    for u in sorted(GRAPH):
        if u not in state:
            visit(u, [])


@pytest.mark.parametrize("unit, allowed", [
    ("core", set()),                      # pure math: nothing of ours
    ("lora", set()),
    ("packing", set()),                   # padding-free passes: transformers and torch only
    ("config", {"core", "tools"}),        # core's registries and presets, tools' call formats; nothing else
    ("sandbox", set()),
    ("tools", {"core", "sandbox", "importpath"}),  # core: the Registry of built-in tools
    ("rewards", {"core", "sandbox", "importpath"}),
    ("rollout", {"tools", "lora", "importpath"}),  # engines and turns know no config and no trainer
])
def test_lower_layers_import_only_what_is_below_them(unit, allowed):
    assert GRAPH.get(unit, set()) <= allowed, f"{unit} imports {sorted(GRAPH[unit] - allowed)}"


def test_only_the_cli_imports_the_trainer_and_nothing_imports_the_cli():
    for unit, deps in GRAPH.items():
        if unit not in ("cli", "__main__"):
            assert not deps & {"trainer", "cli", "cli_args"}, f"{unit} imports {sorted(deps)}"
