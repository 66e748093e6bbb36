"""A call's row as the SQLite ledger writes it: the columns a reserve fills, the columns and values a step
writes (SQLiteLedger._step, and advances' landing of a drawn call straight into calls), and what a step owes
the counters."""

from __future__ import annotations

from typing import Any

from ...core.usage import Usage
from ..holds import Deltas, Step, clamp

__all__ = ["RESERVE_COLUMNS", "STEP_COLUMNS", "Owed", "step_values"]

Owed = tuple[tuple[str, str, str], Deltas]  # what one step owes the counters of its (run, model, day)

# What a reserve writes of a call's row (reserve.RESERVE_INTO_HOLDS / RESERVE_INTO_CALLS, advances' split).
RESERVE_COLUMNS = (
    "id, run_id, model, day, endpoint, state, reserved, reserved_cost, would_block, blocked_by, pid, host,"
    " key_fingerprint, tags, started_at, expires_at"
)
# What a step writes of a call's row, in order.
STEP_COLUMNS = (
    *("state", "charged", "charged_cost", "prompt_tokens", "completion_tokens", "reasoning_tokens"),
    *("cached_tokens", "overshoot", "ended_at", "latency_s", "usage_anomaly", "handed_to"),
)


def step_values(
    moved: Step,
    usage: Usage | None,
    latency_s: float | None,
    anomaly: str | None,
    handed_to: str | None,
    ended_at: float,
) -> tuple[Any, ...]:
    """What a step writes of a call's row, in STEP_COLUMNS' order."""
    return (
        moved.state,
        moved.charged,
        moved.charged_cost,
        clamp(usage.prompt_tokens) if usage else None,
        clamp(usage.completion_tokens) if usage else None,
        clamp(usage.reasoning_tokens) if usage else None,
        clamp(usage.cached_tokens) if usage else None,
        int(moved.overshoot),
        ended_at,
        latency_s,
        anomaly,
        handed_to,
    )
