"""quotawrap's exceptions.

QuotawrapError
├── ConfigError        bad flag, env var or quotawrap.toml value (exit code 2)
└── StoreError         the ledger cannot be opened, read or written (names the store)
    └── StoreCorrupt   the ledger exists but is not a quotawrap ledger / is damaged
"""

from __future__ import annotations

__all__ = ["ConfigError", "QuotawrapError", "StoreCorrupt", "StoreError"]


class QuotawrapError(Exception):
    """Root of every error quotawrap raises on purpose."""


class ConfigError(QuotawrapError):
    """A setting could not be understood."""


class StoreError(QuotawrapError):
    """The ledger could not be used; the message names the store."""

    def __init__(self, message: str, *, store: str) -> None:
        super().__init__(f"{message} (store: {store})")
        self.store = store


class StoreCorrupt(StoreError):
    """The ledger is damaged or is not a quotawrap ledger; it is never silently reset."""
