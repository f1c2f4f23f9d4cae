"""The import drawing of the product package: no circle, and no arrow to kvpush's lab."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "kvpush"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def is_module(name: str, known: dict[str, Path]) -> bool:
    return name in known or name == "kvpush._native"


def type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module ``name`` imports when it runs (function-level imports too; what only a
    type checker reads, under ``if TYPE_CHECKING:``, not)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and type_checking_only(node)
        for inner in ast.walk(node)
        if inner is not node
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if is_module(submodule, known) else base)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_the_product_never_imports_the_lab() -> None:
    for name, imported in graph().items():
        lab = sorted(i for i in imported if i == "kvpush_lab" or i.startswith("kvpush_lab."))
        assert not lab, f"{name} imports {lab}: the lab is never imported by the product"


def test_the_product_has_no_import_circle() -> None:
    edges = {
        name: {i for i in imported if i.startswith("kvpush") and i != name}
        for name, imported in graph().items()
    }
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circle = [*path[path.index(name) :], name]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if name in done:
            return
        for imported in sorted(edges.get(name, ())):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(edges):
        visit(name, [])
    assert "kvpush.vllm.connector" in edges, "the drawing found the package's modules"
