"""Ledger backends behind one interface; ``open_ledger(url)`` picks one from the store URL."""

from __future__ import annotations

import os
import sys

from ..core.errors import ConfigError

# The records (``base``: dataclasses) and the interface load on first use: a guarded command's
# start path only needs the store's URL and, on the usual SQLite store, the runs table.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from .base import Decision, HoldRequest, ModelTotals, RunTotals, model_day_key, run_key
    from .interface import Books, CallPath, Ledger, Reader

_FROM_BASE = frozenset({"Decision", "HoldRequest", "ModelTotals", "RunTotals", "model_day_key", "run_key"})
_FROM_INTERFACE = frozenset({"Books", "CallPath", "Ledger", "Reader"})


def __getattr__(name: str) -> object:
    if name in _FROM_BASE:
        from . import base

        return getattr(base, name)
    if name in _FROM_INTERFACE:
        from . import interface

        return getattr(interface, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Books",
    "CallPath",
    "Decision",
    "HoldRequest",
    "Ledger",
    "ModelTotals",
    "Reader",
    "RunTotals",
    "default_store_url",
    "model_day_key",
    "normalize_store_url",
    "open_ledger",
    "redact_store_url",
    "run_key",
    "user_state_dir",
]


def user_state_dir() -> str:
    """quotawrap's state directory: ``platformdirs.user_state_dir("quotawrap")``.

    On Linux by the XDG rule platformdirs applies (``$XDG_STATE_HOME`` when absolute, else
    ``$HOME/.local/state``), since importing platformdirs delays every guarded command's child;
    anything unusual (another system, no absolute home) asks platformdirs.
    """
    if sys.platform.startswith("linux"):
        xdg = os.environ.get("XDG_STATE_HOME", "")
        if xdg.startswith("/"):
            return os.path.join(xdg, "quotawrap")
        home = os.environ.get("HOME", "")
        if home.startswith("/"):
            return home.rstrip("/") + "/.local/state/quotawrap"
    import platformdirs

    return platformdirs.user_state_dir("quotawrap")


def default_store_url() -> str:
    return f"sqlite:///{os.path.join(user_state_dir(), 'ledger.sqlite3')}"


def normalize_store_url(url: str) -> str:
    """Make a store URL independent of the working directory (the child may chdir)."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return url
    # SQLAlchemy's convention: sqlite:///relative/path and sqlite:////absolute/path.
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
    elif url.startswith("sqlite:"):
        raise ConfigError(f"store URL {url!r}: use sqlite:///PATH")
    else:
        path = url
    return f"sqlite:///{os.path.realpath(os.path.expanduser(path))}"  # Path(path).expanduser().resolve()


def redact_store_url(url: str) -> str:
    """The store URL as output may show it: a Redis password (any form) replaced by ***."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis.options import redact

        return redact(url)
    return url


def open_ledger(url: str) -> Ledger:
    """The ledger at ``url``. A process of a guarded run marks its run directory first: its wrapper
    then knows this run may hold calls (:func:`quotawrap.support.files.mark_ledger_use`)."""
    from ..support.files import mark_ledger_use

    mark_ledger_use()
    if url.startswith(("redis://", "rediss://", "unix://")):
        try:
            from .redis import RedisLedger
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("the Redis store needs the redis package: pip install 'quotawrap[redis]'") from exc
        return RedisLedger(url)
    from .sqlite.ledger import SQLiteLedger

    normalized = normalize_store_url(url)
    return SQLiteLedger(normalized.removeprefix("sqlite:///"), url=normalized)
