"""quotawrap's one voice on stderr, importable without pulling in anything else."""

from __future__ import annotations

import sys

__all__ = ["warn"]


def warn(message: str) -> None:
    """One line on stderr; never raises (stderr may be closed in a daemonised child)."""
    try:
        sys.stderr.write(f"quotawrap: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
