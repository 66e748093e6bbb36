"""Ledger backends behind one interface; ``open_ledger(url)`` picks one from the store URL."""

from __future__ import annotations

import os

from ..core.errors import ConfigError

# The records (``base``: dataclasses) and the interface load on first use: a guarded command's
# start path only needs the store's URL and, on the usual SQLite store, the runs table.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..config.settings import Settings
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
    "model_day_key",
    "normalize_store_url",
    "open_ledger",
    "open_store",
    "redact_store_url",
    "run_key",
]


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def normalize_store_url(url: str) -> str:
    """Make a store URL independent of the working directory (the child may chdir)."""
    if url.startswith(REDIS_SCHEMES):
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
    if url.startswith(REDIS_SCHEMES):
        from .redis.options import redact

        return redact(url)
    return url


def open_ledger(url: str) -> Ledger:
    """The ledger at ``url``. A process of a guarded run marks its run directory first: its wrapper
    then knows this run may hold calls (:func:`quotawrap.support.files.mark_ledger_use`)."""
    from ..support.files import mark_ledger_use

    mark_ledger_use()
    if url.startswith(REDIS_SCHEMES):
        try:
            from .redis import RedisLedger
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("the Redis store needs the redis package: pip install 'quotawrap[redis]'") from exc
        return RedisLedger(url)
    from .sqlite.ledger import SQLiteLedger

    normalized = normalize_store_url(url)
    return SQLiteLedger(normalized.removeprefix("sqlite:///"), url=normalized)


def open_store(settings: Settings) -> Ledger:
    """The ledger ``settings`` name (or the default one), opened for a command; a problem is one line naming
    the cure, and the process exits."""
    from ..config.paths import default_store_url
    from ..core.errors import EXIT_STORE, QuotawrapError, exit_code, with_cure
    from ..support.log import fail
    from ..support.packages import import_problem

    url = settings.store or default_store_url()
    if url.startswith(REDIS_SCHEMES) and (problem := import_problem("redis", "the Redis store", "redis")):
        fail(problem, EXIT_STORE)
    try:
        return open_ledger(normalize_store_url(url))
    except QuotawrapError as exc:
        fail(f"{with_cure(exc)}; the ledger was left untouched", exit_code(exc))
