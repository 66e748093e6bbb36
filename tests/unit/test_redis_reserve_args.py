"""The reserve scripts' JSON argument, encoded in parts with caches (redis/reserve_args.py), decodes to the
fields the plain encoding of every field gives, on generated calls that share and change runs, model-days,
tags and limits in any order (so every cache is hit, missed and replaced)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from quotawrap.core.quota import Limit, ordered
from quotawrap.ledger.base import HoldRequest
from quotawrap.ledger.holds import clamp
from quotawrap.ledger.lines import LEASE_S
from quotawrap.ledger.redis.lines import LINE_TTL_S
from quotawrap.ledger.redis.options import RedisOptions
from quotawrap.ledger.redis.reserve_args import BLOCKED_MARK_TTL_S, ReserveArgs

TEXTS = ("r", "run-2", 'quo"te', "back\\slash", "tab\there", "ünï \u2603", "nl\nx", "")
LIMITS = (
    Limit("run_cap", "run", 5_000),
    Limit("daily_cap", "model_day", 2_000_000),
    Limit("usage_wall", "model_day", 1_950_000, "wall"),
    Limit("cost_cap", "run_cost", 9_000_000),
    Limit('odd "name"', "model_day", 7),
)


def _day_start(day: str) -> int:
    """The Unix time of the Beijing midnight that starts ``day``, by the calendar (not keys.day_start)."""
    return int(datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=timezone(timedelta(hours=8))).timestamp())


def _reference(
    request: HoldRequest,
    walls_first: Sequence[Limit],
    expires: int,
    now: float,
    index_at: float | None,
    *,
    checks_day: bool = True,
) -> dict[str, Any]:
    """Every field encoded at once, as the ledger did before the parts were cached."""
    options = RedisOptions()
    return {
        "hold_id": request.hold_id,
        "index_at": "" if index_at is None else repr(index_at),
        "run": request.run_id,
        "reserve": clamp(int(request.reserve)),
        "enforce": "1" if request.enforce else "0",
        "day": request.day,
        "day_start": _day_start(request.day) if checks_day else False,
        "model": request.model,
        "expires": repr(float(request.expires_at)),
        "pid": str(int(request.pid)),
        "host": request.host,
        "now": repr(now),
        "endpoint": request.endpoint,
        "key_fingerprint": request.key_fingerprint or "",
        "tags": json.dumps(dict(request.tags)) if request.tags else "",
        "expire_at": expires,
        "run_ttl": options.run_ttl_s,
        "audit_max": options.audit_max,
        "blocked_ttl": BLOCKED_MARK_TTL_S,
        "reserve_cost": clamp(int(request.reserve_cost)),
        "limits": [[limit.scope, limit.kind, int(limit.cap), limit.name] for limit in walls_first],
        "waiter": request.waiter or "",
        "ticket": request.ticket or 0,
        "can_wait": "1" if request.can_wait and request.waiter else "0",
        "lease": LEASE_S,
        "line_ttl": LINE_TTL_S,
        "advance": "1" if request.advance else "0",
    }


def _request(rng: random.Random) -> HoldRequest:
    tags = rng.choice([{}, {"team": "a"}, {"team": "a", "job": 'x"y'}, {"job": 'x"y', "team": "a"}, {"ü": "\\"}])
    return HoldRequest(
        run_id=rng.choice(TEXTS[:3]),
        model=rng.choice(("glm-4", "m:x", TEXTS[5])),
        day=rng.choice(("2026-12-01", "2026-12-02")),
        reserve=rng.choice((0, 1, 500, -3, 2**60)),
        endpoint=rng.choice(TEXTS),
        pid=rng.choice((1, 4242)),
        host=rng.choice(("h", TEXTS[3])),
        expires_at=rng.choice((1_764_600_000.25, 1e20, 3.0)),
        enforce=rng.random() < 0.8,
        reserve_cost=rng.choice((0, 300, -1, 2**60)),
        key_fingerprint=rng.choice((None, "abcd1234", TEXTS[2])),
        tags=tags,
        waiter=rng.choice((None, "w1", TEXTS[6])),
        ticket=rng.choice((None, 0, 7)),
        can_wait=rng.random() < 0.5,
        advance=rng.random() < 0.3,
    )


def test_the_cached_encoding_decodes_to_every_field() -> None:
    rng = random.Random(12)
    encoder = ReserveArgs(RedisOptions())
    for _ in range(3000):
        request = _request(rng)
        limits = rng.sample(LIMITS, rng.randint(0, len(LIMITS)))
        walls_first, encoded_limits = encoder.ordered(limits)
        assert walls_first == ordered(limits)
        now = rng.choice((1_764_600_000.125, 5.0, 0.1))
        expires = rng.choice((1_764_800_000, 0))
        index_at = rng.choice((None, 1_764_600_000.5))
        got = json.loads(encoder.encode(request, encoded_limits, expires, now, index_at))
        assert got == _reference(request, walls_first, expires, now, index_at)


def test_a_ledger_on_a_simulated_clock_sends_no_day_to_check() -> None:
    """Its days are its clock's, which the server's knows nothing of: the scripts take them as given."""
    rng = random.Random(13)
    encoder = ReserveArgs(RedisOptions(), checks_day=False)
    for _ in range(200):
        request = _request(rng)
        walls_first, encoded_limits = encoder.ordered(list(LIMITS))
        got = json.loads(encoder.encode(request, encoded_limits, 0, 5.0))
        assert got == _reference(request, walls_first, 0, 5.0, None, checks_day=False)


def test_limits_are_ordered_again_once_the_list_changes() -> None:
    encoder = ReserveArgs(RedisOptions())
    limits = [LIMITS[1], LIMITS[2]]
    first, _ = encoder.ordered(limits)
    assert first == [LIMITS[2], LIMITS[1]]
    limits[0] = LIMITS[0]  # the same list object, another limit in it
    again, encoded = encoder.ordered(limits)
    assert again == [LIMITS[2], LIMITS[0]]
    assert json.loads(encoded) == [["model_day", "wall", 1_950_000, "usage_wall"], ["run", "hold", 5_000, "run_cap"]]


def test_scripts_are_packed_as_redis_py_packs_them() -> None:
    """Client._send packs with hiredis directly when redis-py would: the bytes a connection's own packer gives."""
    import redis

    from quotawrap.ledger.redis.client import _packer

    pack = _packer()
    command = ("EVALSHA", "a" * 40, 2, "{qw:md:2026-12-01:ünï}:c", "qw:loc:x", "e", 'j"s\\on', 7, 0.5, -3)
    connection = redis.Connection()
    expected = b"".join(connection.pack_command(*command))
    assert pack is not None  # hiredis is installed for the tests, as for the benchmarks
    assert pack(command) == expected
