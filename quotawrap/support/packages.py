"""Whether an optional package can be used, said as the extra that installs it."""

from __future__ import annotations

__all__ = ["import_problem"]


def import_problem(package: str, needed_by: str, extra: str) -> str | None:
    """Why ``package`` cannot be used, naming the extra that installs it, or None. Imported here, before it
    is needed: a package that raises on import (a broken or partial install raises anything, not only
    ImportError) is then one line, not a traceback."""
    import importlib.util

    if importlib.util.find_spec(package) is None:
        return f"{needed_by} needs the {package} package: pip install 'quotawrap[{extra}]'"
    try:
        importlib.import_module(package)
    except Exception as exc:
        return (
            f"the {package} package is installed but cannot be imported ({type(exc).__name__}: {exc});"
            f" reinstall it: pip install --force-reinstall 'quotawrap[{extra}]'"
        )
    return None
