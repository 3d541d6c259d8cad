"""shardline's module graph: imports go down the layers of README's "Code layout", and no module imports itself
back through others (every import counts, also those inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

import shardline

SRC = Path(shardline.__file__).parent.parent
# Bottom to top, by the first name under shardline ("" is the package itself: `import shardline`).
# README: engine/ <- checkpoint/ <- train/, diagnostics/, report/, lightning/, hf/ <- cli/.
LAYERS = {
    "_torch_compat": 0,
    "_transformers_compat": 0,
    "_tree": 0,
    "_deprecation": 0,
    "_teardown": 0,
    "_version": 0,
    "errors": 0,
    "engine": 1,
    "models": 1,
    "checkpoint": 2,
    "distributed": 2,
    "": 3,
    "testing": 3,
    "diagnostics": 4,
    "hf": 4,
    "lightning": 4,
    "report": 4,
    "train": 4,
    "cli": 5,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "shardline").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _graph() -> dict[str, set[str]]:
    """Module -> the shardline modules it imports (``from a.b import c`` is ``a.b.c`` where that is a module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_top_level_module_has_a_layer() -> None:
    assert sorted({_layer(m) for m in _modules()} - set(LAYERS)) == []


def test_imports_never_go_up_a_layer() -> None:
    wrong = [
        f"{module} imports {target} ({_layer(target) or 'shardline'} is above {_layer(module) or 'shardline'})"
        for module, targets in sorted(_graph().items())
        for target in sorted(targets)
        if LAYERS[_layer(target)] > LAYERS[_layer(module)]
    ]
    assert wrong == []


def test_no_import_circles() -> None:
    graph = _graph()
    assert len(graph) > 100  # the walk saw the package
    state: dict[str, int] = {}
    circles: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == []
