"""Facts about this host's processes and programs that every parent process asks, with no policy of their own."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "which"]


def pid_alive(pid: int) -> bool:
    """Whether a process of this host still runs (a hold's owner); unknown counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def which(name: str, path: str | None = None) -> str | None:
    """``shutil.which`` on POSIX, without shutil's imports (the compressors) on every run's start path."""
    if os.name != "posix":  # pragma: no cover - PATHEXT and the like
        import shutil

        return shutil.which(name, path=path)

    def runnable(candidate: str) -> bool:
        return os.path.exists(candidate) and os.access(candidate, os.F_OK | os.X_OK) and not os.path.isdir(candidate)

    if os.path.dirname(name):
        return name if runnable(name) else None
    search = os.environ.get("PATH") if path is None else path
    if search is None:
        search = os.confstr("CS_PATH") or os.defpath
    if not search:
        return None
    seen: set[str] = set()
    for directory in search.split(os.pathsep):
        normalized = os.path.normcase(directory)
        if normalized in seen:
            continue
        seen.add(normalized)
        candidate = os.path.join(directory, name)
        if runnable(candidate):
            return candidate
    return None
