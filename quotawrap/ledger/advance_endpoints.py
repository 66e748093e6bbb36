"""The endpoint an advance's row carries (admission/advances.py: room a process reserved for its next calls), which
tells it from a call's: while open, and once its process gave back what it did not draw. No imports: the run's
lean books read it too (ledger/runs.py)."""

__all__ = ["ADVANCE", "ADVANCE_CLOSED"]

ADVANCE = "advance"
ADVANCE_CLOSED = "advance closed"
