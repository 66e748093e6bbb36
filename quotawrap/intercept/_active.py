"""The process's one guard, kept apart from the package so the adapters can import it without a cycle."""

from __future__ import annotations

import _thread

TYPE_CHECKING = False  # typing itself costs ~8 ms of every child's start-up
if TYPE_CHECKING:
    from ..guard import Guard

__all__ = ["get_guard", "set_guard"]

_guard: Guard | None = None
_guard_lock = _thread.allocate_lock()


def get_guard() -> Guard | None:
    """The process's guard, built from ``QUOTAWRAP_*`` variables on first use."""
    global _guard
    if _guard is None:
        with _guard_lock:
            if _guard is None:
                # Imported here, not at the top: a child that never imports an HTTP client
                # must not pay for the guard's imports at start-up.
                from ..guard import Guard
                from ..settings import Settings

                # the child's one guard: settles off the caller's path, flushed at exit and before fork
                _guard = Guard(Settings.from_env(), background_settle=True)
    return _guard


def set_guard(guard: Guard | None) -> None:
    """Use this guard (tests; embedding); None rebuilds one from the environment on next use."""
    global _guard
    _guard = guard
