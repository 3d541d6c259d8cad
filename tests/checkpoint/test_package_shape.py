"""The checkpoint package's shape: sub-packages by concept that import only downwards, and no import circles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import shardline.checkpoint

ROOT = Path(shardline.checkpoint.__file__).parent
# Bottom to top: a module may import from its own package and from packages of a lower layer only.
LAYERS = {
    "coordination": 0,
    "faults": 0,
    "storage": 1,
    "format": 1,
    "state": 2,
    "integrity": 3,
    "provenance": 4,
    "lifecycle": 5,
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
    return out


def test_every_module_is_in_a_concept_package() -> None:
    flat = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert flat == []
    assert sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()) == sorted(LAYERS)


def test_imports_go_downwards_only() -> None:
    wrong = []
    for path in sorted(ROOT.glob("*/*.py")):
        package = path.parent.name
        for module in _imports(path):
            if module == "shardline.checkpoint":
                wrong.append(f"{path.relative_to(ROOT)} imports the package's public face ({module})")
            elif module.startswith("shardline.checkpoint."):
                target = module.split(".")[2]
                if target != package and LAYERS[target] >= LAYERS[package]:
                    wrong.append(
                        f"{path.relative_to(ROOT)} imports {module} (layer {LAYERS[target]} >= {LAYERS[package]})"
                    )
    assert wrong == []


def test_sub_package_inits_hold_no_code() -> None:
    for init in sorted(ROOT.glob("*/__init__.py")):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1, init
        assert isinstance(body[0], ast.Expr), init  # the docstring alone


def test_no_import_circles() -> None:
    """The module graph (every import of a shardline.checkpoint module, at any depth of a file) has no cycle."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.glob("*/*.py"):
        if path.name == "__init__.py":
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        graph[name] = set()
        for module in _imports(path):
            parts = module.split(".")
            if module.startswith("shardline.checkpoint.") and len(parts) >= 4:
                graph[name].add(".".join(parts[2:4]))
    # The `from shardline.checkpoint.coordination import coord` form names the module in the imported names.
    for path in ROOT.glob("*/*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.count(".") == 2:
                package = node.module.split(".")[2]
                graph.setdefault(name, set()).update(
                    f"{package}.{alias.name}" for alias in node.names if f"{package}.{alias.name}" in graph
                )
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1 and not cycle:
                cycle.extend([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycle == []
    assert len(graph) > 30  # the walk saw the package


def test_the_public_package_imports_in_a_fresh_interpreter() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import shardline.checkpoint as c; print(len(c.__all__))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) == len(shardline.checkpoint.__all__)
