"""Per model, how much its recent calls reasoned: the rule, and the SQLite query that mirrors it.

The guard bounds a call that leaves reasoning open by the p99 of its model's recent reasoning
(``allowance``), read from the ledger by every process on its first call of a model and every 30 s
after. Read as whole call records, a busy day held up that first call for every row; the query reads
one column of that model's latest rows only. ``tests/unit/test_reasoning_history.py`` proves the
query equal to the rule on generated ledgers.
"""

from __future__ import annotations

from collections.abc import Iterable

from .base import CallRecord

__all__ = ["REASONING_HISTORY", "reasoning_samples"]


def reasoning_samples(records: Iterable[CallRecord], per_model: int) -> dict[str, list[int]]:
    """Per model, the reasoning tokens of its settled generating calls, oldest first, the latest ``per_model``."""
    samples: dict[str, list[int]] = {}
    for record in sorted(records, key=lambda r: r.started_at):
        if record.state != "settled" or record.completion_tokens is None or record.endpoint == "embeddings":
            continue
        samples.setdefault(record.model, []).append(record.reasoning_tokens or 0)
    return {model: values[-per_model:] for model, values in samples.items()}


# Parameters: model, since (started_at >=), limit. Rows: (reasoning,), latest first. Read backwards
# along the started_at index, it stops at the limit: ~1,000 rows, whatever the day holds.
REASONING_HISTORY = """
SELECT COALESCE(reasoning_tokens, 0) FROM calls
WHERE model = ? AND started_at >= ? AND state = 'settled' AND completion_tokens IS NOT NULL
      AND endpoint != 'embeddings'
ORDER BY started_at DESC, rowid DESC
LIMIT ?
"""
