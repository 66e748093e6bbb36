"""Ledger backends behind one interface; ``open_ledger(url)`` picks one from the store URL."""

from __future__ import annotations

from pathlib import Path

from .._errors import ConfigError
from .base import Decision, HoldRequest, Ledger, ModelTotals, RunTotals, model_day_key, run_key

__all__ = [
    "Decision",
    "HoldRequest",
    "Ledger",
    "ModelTotals",
    "RunTotals",
    "default_store_url",
    "model_day_key",
    "normalize_store_url",
    "open_ledger",
    "redact_store_url",
    "run_key",
]


def default_store_url() -> str:
    import platformdirs

    return f"sqlite:///{Path(platformdirs.user_state_dir('quotawrap')) / 'ledger.sqlite3'}"


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
    return f"sqlite:///{Path(path).expanduser().resolve()}"


def redact_store_url(url: str) -> str:
    """The store URL as output may show it: a Redis password (any form) replaced by ***."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis.options import redact

        return redact(url)
    return url


def open_ledger(url: str) -> Ledger:
    if url.startswith(("redis://", "rediss://", "unix://")):
        try:
            from .redis import RedisLedger
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError("the Redis store needs the redis package: pip install 'quotawrap[redis]'") from exc
        return RedisLedger(url)
    from .sqlite import SQLiteLedger

    normalized = normalize_store_url(url)
    return SQLiteLedger(normalized.removeprefix("sqlite:///"), url=normalized)
