"""The package's import graph: no cycles, and imports point downward only (the layers of
dsv41_convert/__init__.py). A planted upward import or cycle fails these tests."""

import ast
import collections
from pathlib import Path

import dsv41_convert

PACKAGE = Path(dsv41_convert.__file__).resolve().parent
# bottom to top; a module may import its own layer and the layers below it
LAYERS = [
    "errors",
    "numbers",
    "file_kinds",
    "strict_json",
    "expert_names",
    "engram_buckets",
    "config",
    "engram_tokens",
    "progress",
    "interrupts",
    "torchrun",
    "quant",
    "kernels",
    "store",
    "model",
    "convert",
    "published",
    "hub",
    "verify",
    "synth",
    "app",
    "cli",
    "console",
]


def module_name(path: Path, root: Path = PACKAGE) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (a `from pkg import sub` counts as pkg.sub)."""
    mods = {module_name(p, root) for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsv41_convert"):
                base = node.module.removeprefix("dsv41_convert").removeprefix(".")
                for alias in node.names:
                    sub = f"{base}.{alias.name}".lstrip(".")
                    graph[module_name(path, root)].add(sub if sub in mods else base)
    return graph


def layer(module: str) -> int:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else -1


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(a, b) for a, targets in graph.items() for b in targets if b and layer(b) > layer(a)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_every_top_level_module_has_a_layer():
    tops = {module_name(p).split(".")[0] for p in PACKAGE.rglob("*.py")} - {"__init__", ""}
    assert tops <= set(LAYERS), tops - set(LAYERS)


def test_imports_point_downward():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_checks_catch_planted_faults(tmp_path):
    for sub in ("model", "convert"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "model" / "a.py").write_text("from dsv41_convert.convert import b\n")
    (tmp_path / "convert" / "b.py").write_text("from dsv41_convert.model import a\n")
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == [("model.a", "convert.b")]
    assert cycles(graph) == [["model.a", "convert.b", "model.a"]] or cycles(graph) == [
        ["convert.b", "model.a", "convert.b"]
    ]
