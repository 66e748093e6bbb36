"""Post-import hooks that cost nothing at start-up.

``wrapt.when_imported`` would do, but importing wrapt pulls in asyncio and
importlib.metadata, and even ``importlib.abc`` is slow to import: every child would
pay that at start-up although it may never import an HTTP client. This module imports only
``sys``; finder and loader are duck-typed as the import system allows.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

__all__ = ["when_imported"]

_hooks: dict[str, list[Callable[[ModuleType], None]]] = {}


class _Loader:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        result: ModuleType | None = self._inner.create_module(spec)
        return result

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for hook in _hooks.get(module.__name__, ()):
            _run(hook, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._inner, name)


class _Finder:
    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)  # type: ignore[assignment]  # duck-typed Loader
                return spec
        return None


_finder = _Finder()


def _run(hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as exc:  # a hook must never break the user's import, nor the hooks after it
        sys.stderr.write(f"quotawrap: could not instrument {module.__name__}: {exc!r}\n")


def when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once ``name`` is imported (at once if it already is)."""
    _hooks.setdefault(name, []).append(hook)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    module = sys.modules.get(name)
    if module is not None:
        _run(hook, module)
