"""The reserve scripts' one argument: the call as the JSON object lib.lua's ``reserve_args()`` decodes.

Every guarded call sends one, on the caller's path. Most of its fields are the same for every call
of a run on a model-day from one process (the run, the model, the host, the TTLs...), so that part is
encoded once and cached; only the call's own fields are encoded per call. The object decodes to the
same fields as ``json.dumps`` of them all would (tests/unit/test_redis_reserve_args.py checks it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _text  # json.dumps' own string encoder (C)

from ...core.quota import Counters, Limit, ordered
from ..base import HoldRequest
from ..holds import clamp
from ..lines import LEASE_S
from .keys import day_start
from .lines import LINE_TTL_S
from .options import RedisOptions

__all__ = ["BLOCKED_MARK_TTL_S", "ReserveArgs", "budget_fields", "limit_args"]

BLOCKED_MARK_TTL_S = 60  # long enough for a retried reserve to find its first answer
_CACHE_MAX = 256  # (run, model-day, endpoint, key...) combinations a process keeps before starting afresh


def budget_fields(scopes: Sequence[str], seen: Mapping[str, Counters] | None = None) -> str:
    """The call's budget scopes (and, on Cluster, the counters the budget gate saw) as fields of reserve_args."""
    if not scopes:
        return ""
    fields = f'"budgets":{json.dumps(list(scopes))},'
    if seen is not None:
        flat = [item for scope in scopes for item in (scope, str(seen[scope].settled), str(seen[scope].in_flight))]
        fields += f'"budget_seen":{json.dumps(flat)},'
    return fields


def limit_args(ordered: Sequence[Limit]) -> list[list[str | int]]:
    """The limits as lib.lua's blocking() reads them, in quota.ordered's order."""
    return [[limit.scope, limit.kind, int(limit.cap), limit.name] for limit in ordered]


class ReserveArgs:
    """Encodes reserve_args for one ledger; keeps the encodings that do not change from call to call."""

    def __init__(self, options: RedisOptions, *, checks_day: bool = True) -> None:
        """``checks_day``: the scripts refuse a call whose day is not the server's (False: the ledger runs on a
        simulated clock, whose days the server's clock knows nothing of)."""
        self._options = options
        self._checks_day = checks_day
        self._static: dict[tuple[str, str, str, int, str, str, str, bool, bool], str] = {}
        self._limits: tuple[list[Limit], list[Limit], str] | None = None
        self._tags: tuple[list[tuple[str, str]], str] = ([], '""')

    def ordered(self, limits: Sequence[Limit]) -> tuple[list[Limit], str]:
        """(quota.ordered(limits), their encoding), kept while the limits stay equal.

        A guard hands the same list back until its snapshot or day changes, so the comparison is the
        list's identity check of each element; a list that changed in any way is ordered again.
        """
        cached = self._limits
        if cached is not None and cached[0] == limits:
            return cached[1], cached[2]
        walls_first = ordered(limits)
        encoded = json.dumps(limit_args(walls_first), separators=(",", ":"))
        self._limits = (list(limits), walls_first, encoded)
        return walls_first, encoded

    def _static_part(self, request: HoldRequest) -> str:
        """The fields shared by a run's calls to one endpoint of a model-day, as `"name":value,...`."""
        key = (
            request.run_id,
            request.day,
            request.model,
            request.pid,
            request.host,
            request.endpoint,
            request.key_fingerprint or "",
            request.enforce,
            request.advance,
        )
        static = self._static.get(key)
        if static is None:
            options = self._options
            fields = {
                "run": request.run_id,
                "enforce": "1" if request.enforce else "0",
                "advance": "1" if request.advance else "0",
                "day": request.day,
                "day_start": day_start(request.day) if self._checks_day else False,
                "model": request.model,
                "pid": str(int(request.pid)),
                "host": request.host,
                "endpoint": request.endpoint,
                "key_fingerprint": request.key_fingerprint or "",
                "run_ttl": options.run_ttl_s,
                "audit_max": options.audit_max,
                "blocked_ttl": BLOCKED_MARK_TTL_S,
                "line_ttl": LINE_TTL_S,
            }
            static = json.dumps(fields, separators=(",", ":"))[1:-1]
            if len(self._static) >= _CACHE_MAX:
                self._static.clear()
            self._static[key] = static
        return static

    def _tags_part(self, tags: Mapping[str, str]) -> str:
        """The tags as a JSON text inside a JSON string ("" for none); a guard's tags are the same every call."""
        if not tags:
            return '""'
        items = list(tags.items())
        cached = self._tags
        if cached[0] == items:
            return cached[1]
        encoded = _text(json.dumps(dict(items)))
        self._tags = (items, encoded)
        return encoded

    def encode(
        self,
        request: HoldRequest,
        limits: str,
        expires: int,
        now: float,
        index_at: float | None = None,
        budgets: str = "",
    ) -> str:
        """The JSON argument; ``limits``: ``ordered``'s encoding, ``expires``: keys.expire_at of the call,
        ``index_at``: when reserve_one should index the model-day and the model (None: not now), ``budgets``:
        :func:`budget_fields`' of the call's budget scopes."""
        waiter = request.waiter
        return (
            f"{{{budgets}"
            f'"hold_id":{_text(request.hold_id)},"reserve":{clamp(int(request.reserve))},'
            f'"index_at":"{"" if index_at is None else repr(float(index_at))}",'
            f'"reserve_cost":{clamp(int(request.reserve_cost))},"expires":"{float(request.expires_at)!r}",'
            f'"now":{_text(repr(now))},"expire_at":{int(expires)},"tags":{self._tags_part(request.tags)},'
            f'"limits":{limits},"waiter":{_text(waiter or "")},"ticket":{int(request.ticket or 0)},'
            f'"can_wait":"{"1" if request.can_wait and waiter else "0"}","lease":{LEASE_S!r},'
            f"{self._static_part(request)}}}"
        )
