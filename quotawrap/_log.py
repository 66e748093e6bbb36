"""quotawrap's one voice on stderr, importable without pulling in anything else."""

from __future__ import annotations

import sys

__all__ = ["NO_COST", "summary_head", "warn"]

NO_COST = "¥0.0000"  # money.format_cny(0), without decimal: a run that made no guarded call says it


def warn(message: str) -> None:
    """One line on stderr; never raises (stderr may be closed in a daemonised child)."""
    try:
        sys.stderr.write(f"quotawrap: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def summary_head(
    session: str,
    calls: int,
    settled_tokens: int,
    cost: str,
    blocked: int,
    *,
    would_block: int | None,
    went_around: bool,
) -> str:
    """The first line of a run's summary (``report.format_summary``'s); ``would_block`` in watch mode only.

    Here, not in :mod:`quotawrap.report`: a run whose processes never opened the ledger prints it alone,
    without loading the report's modules and the full ledger."""
    return (
        f"quotawrap: session {session}: {calls} guarded call(s),"
        f" {settled_tokens:,} tokens settled ({cost}),"
        f" {blocked} blocked"
        + (f", {would_block} WOULD have been blocked (watch mode)" if would_block is not None else "")
        + (" — and NOT everything went through the guard (below)" if went_around else "")
    )
