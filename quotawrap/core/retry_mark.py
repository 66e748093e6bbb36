"""The hold id a refitted call asks again under, after the refused attempt the report must not count."""

from __future__ import annotations

__all__ = ["RETRY_MARK", "retry_id"]

# The refused attempt stays a record of the ledger, so the mark lets every view leave it out of the blocked calls.
RETRY_MARK = "~"


def retry_id(hold_id: str) -> str:
    """The hold id of a call's next attempt after a refused one it refitted."""
    return hold_id + RETRY_MARK
