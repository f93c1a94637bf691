"""Import structure: the core stays free of torch and of higher layers, the runtime's
modules import one another without a circle, and the runtime holds no model."""
from __future__ import annotations

import ast
from pathlib import Path

import pipeblocks

PACKAGE = Path(pipeblocks.__file__).parent


def _imports(path: Path) -> set[str]:
    """Dotted names of the pipeblocks modules (and top-level packages) `path` imports,
    at any depth (function-level imports count too)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def test_core_imports_no_torch_and_no_higher_layer():
    for path in sorted((PACKAGE / "core").glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            assert top != "torch", f"{path.name} imports torch"
            if top == "pipeblocks":
                assert name.startswith("pipeblocks.core"), f"{path.name} imports {name}"


def test_runtime_modules_import_without_a_circle():
    modules = {p.stem: p for p in (PACKAGE / "runtime").glob("*.py") if p.stem != "__init__"}
    edges = {
        name: {m.split(".")[2] for m in _imports(path) if m.startswith("pipeblocks.runtime.")} & set(modules)
        for name, path in modules.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            assert state.get(nxt) != 1, f"import circle: {' -> '.join([*trail, node, nxt])}"
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [])
    assert "memory" in edges and "compute" not in edges["memory"]


def test_the_toy_model_lives_with_the_models():
    assert not (PACKAGE / "runtime" / "toy.py").exists()
    assert not any(m.startswith("pipeblocks.schedules") for m in _imports(PACKAGE / "models" / "toy.py"))
