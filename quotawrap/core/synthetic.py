"""The answers quotawrap makes itself, in Ark's error shape: a request it refuses never reaches the network.

``blocked_response`` is the refusal of a call that does not fit; ``block_message`` words it: which limit, its
numbers, how to raise it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from . import quota
from .money import format_cny
from .records import Record

__all__ = ["SyntheticResponse", "block_message", "blocked_response"]


class SyntheticResponse(Record, frozen=True):
    """An answer made locally; the request never reaches the network."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...]

    @classmethod
    def ark_error(cls, status: int, code: str, error_type: str, message: str, **extra: str) -> SyntheticResponse:
        body = json.dumps(
            {"error": {"code": code, "message": message, "param": "", "type": error_type}}, ensure_ascii=False
        ).encode()
        headers = (
            ("content-type", "application/json; charset=utf-8"),
            ("content-length", str(len(body))),
            # Ark's and openai's SDKs honour this and do not retry into the same wall.
            ("x-should-retry", "false"),
            # Clients that retry a 429 anyway (llama-index) wait Retry-After instead of their own 4 s and
            # up: the guard answers their identical retries at once from memory, so they end at once.
            *((("retry-after", "0"),) if status == 429 else ()),
            *((f"x-quotawrap-{key.replace('_', '-')}", value) for key, value in extra.items()),
        )
        return cls(status, body, headers)

    def with_note(self, note: str) -> SyntheticResponse:
        """The same error with ``note`` appended to its message."""
        data = json.loads(self.body)
        data["error"]["message"] += note
        body = json.dumps(data, ensure_ascii=False).encode()
        headers = tuple((k, str(len(body)) if k == "content-length" else v) for k, v in self.headers)
        return SyntheticResponse(self.status, body, headers)


def _fmt(n: int) -> str:
    return f"{n:,}"


_RAISE_HINTS = {
    "run_cap": "raise it with --cap-tokens / QUOTAWRAP_CAP_TOKENS",
    "cost_cap": "raise it with --cap-cost / QUOTAWRAP_CAP_COST",
    "daily_cap": "raise it with --daily-cap / QUOTAWRAP_DAILY_CAP (it resets at Beijing midnight)",
    "snapshot": "sync a fresher balance with `quotawrap sync`, or lower --small-buffer",
    "usage_wall": "raise --usage-wall / QUOTAWRAP_USAGE_WALL (it resets at Beijing midnight)",
    "balance_wall": "top up the free balance and `quotawrap sync`, or lower --balance-wall",
}


def block_message(model: str, verdict: quota.Verdict, counters: Mapping[str, quota.Counters], reserve: int) -> str:
    """The 429's message: which limit, its numbers (tokens, or CNY for the cost cap), how to raise it."""
    limit = verdict.blocking
    assert limit is not None
    used = counters.get(limit.scope, quota.Counters())
    hint = _RAISE_HINTS.get(limit.name, "see `quotawrap status`")
    fmt = format_cny if quota.counts_cost(limit.scope) else _fmt
    if limit.name == "waiting_line":  # ledger/lines.py: refused by the line, not by a cap
        what = f"call to {model} cannot wait (--wait) and other calls wait for room before it"
    elif limit.kind == "wall":
        numbers = f"settled {fmt(used.settled)} >= {fmt(limit.cap)}"
        what = f"model {model} is evicted for today ({limit.name}: {numbers})"
    else:
        numbers = (
            f"settled {fmt(used.settled)} + in flight {fmt(used.in_flight)} + this call {fmt(reserve)}"
            f" = {fmt(used.settled + used.in_flight + reserve)} > {fmt(limit.cap)}"
        )
        what = f"call to {model} would exceed the {limit.name} ({numbers})"
    detail = f" [{limit.detail}]" if limit.detail else ""
    return f"quotawrap blocked this request: {what}{detail}; {hint}."


def blocked_response(
    model: str,
    verdict: quota.Verdict,
    counters: Mapping[str, quota.Counters],
    reserve: int,
    reserve_cost: int = 0,
    *,
    status: int = 429,
) -> SyntheticResponse:
    """The refusal of a call that does not fit: a 429 (a 403 where the client would retry a 429 forever)."""
    limit = verdict.blocking
    assert limit is not None
    return SyntheticResponse.ark_error(
        status,
        "QuotawrapLimitExceeded",
        "TooManyRequests" if status == 429 else "Forbidden",
        block_message(model, verdict, counters, quota.charge(limit.scope, reserve, reserve_cost)),
        blocked=limit.name,
    )
