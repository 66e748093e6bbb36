"""One clock per ledger (ledger/redis/clock.py): the Redis ledger keeps the server's time, whatever the host's.

The offset rule and the warning are table-tested; the ledger is driven on a real redis-server with the calls a
process with a wrong clock makes (a day that is not the server's, an offset gone stale), on a single node and on
Cluster. tests/integration/test_redis_clock_skew.py runs whole processes 30 h ahead under libfaketime.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap.core.quota import DAY_S, Counters, beijing_day
from quotawrap.ledger.base import ledger_clock
from quotawrap.ledger.redis import RedisLedger
from quotawrap.ledger.redis import clock as clock_module
from quotawrap.ledger.redis.clock import SKEW_VARIABLE, ServerClock, consistent, skew_text
from quotawrap.ledger.scopes import model_day_key
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from tests.redis_server import RedisCluster3, cluster_unavailable_reason, flushed, redis_binary, session_url
from tests.unit.test_ledger_contract import MODEL, limits, request, usage

H = 3600.0


@pytest.mark.parametrize(
    ("offset", "server", "sent", "received", "agrees"),
    [
        (0.0, 100.0, 99.9, 100.1, True),  # within the round trip
        (0.2, 100.0, 99.9, 100.1, False),  # the server answered after we sent: at most 0.1 + slack
        (-0.1, 100.0, 99.9, 100.1, True),
        (-0.1011, 100.0, 99.9, 100.1, False),
        (-30 * H, 100.0, 100.0 + 30 * H, 100.0 + 30 * H, True),  # a host 30 h ahead, once known
        (0.0, 100.0, 100.0 + 30 * H, 100.0 + 30 * H, False),  # ... and before
    ],
)
def test_an_offset_agrees_with_a_reading_within_its_round_trip(
    offset: float, server: float, sent: float, received: float, agrees: bool
) -> None:
    assert consistent(offset, server, sent, received) is agrees


@pytest.mark.parametrize(
    ("offset", "text"),
    [(-30 * H, "30.0 h ahead"), (20 * H, "20.0 h behind"), (720.0, "12 min behind"), (-7.2, "7 s ahead")],
)
def test_skew_in_words(offset: float, text: str) -> None:
    assert skew_text(offset) == text


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that has not warned, with no parent that did."""
    monkeypatch.setattr(clock_module, "_warned", False)
    monkeypatch.delenv(SKEW_VARIABLE, raising=False)


@pytest.mark.usefixtures("fresh_process")
def test_the_offset_moves_only_for_a_reading_it_disagrees_with(capsys: pytest.CaptureFixture[str]) -> None:
    server = ServerClock("redis://h:1/0")
    server.observe(1000.0, 999.0, 999.2)  # the first reading sets it: the middle of the round trip
    assert server.measured and server.offset == pytest.approx(0.9)
    server.observe(2000.0, 1999.05, 1999.5)  # agrees (0.9 is in [0.5, 0.95]): kept
    assert server.offset == pytest.approx(0.9)
    server.observe(3000.0, 2999.5, 2999.6)  # disagrees (a stepped clock): moved
    assert server.offset == pytest.approx(0.45)
    assert capsys.readouterr().err == ""  # under a second off: nothing to say


@pytest.mark.usefixtures("fresh_process")
def test_a_host_clock_far_off_warns_once_per_process_and_tells_its_children(
    capsys: pytest.CaptureFixture[str],
) -> None:
    first, second = ServerClock("redis://h:1/0"), ServerClock("redis://h:1/1")
    first.observe(1000.0, 1000.0 + 30 * H, 1000.0 + 30 * H)
    first.observe(5000.0, 5000.0 + 20 * H, 5000.0 + 20 * H)  # stepped again
    second.observe(1000.0, 1000.0 + 30 * H, 1000.0 + 30 * H)  # another ledger of the same process
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("quotawrap: this host's clock is 30.0 h ahead of the Redis ledger's (redis://h:1/0)")
    assert "NTP" in lines[0]
    assert float(os.environ[SKEW_VARIABLE]) == pytest.approx(-30 * H)


@pytest.mark.usefixtures("fresh_process")
def test_threads_measuring_at_once_warn_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The threads of a process that connect together (each ledger, each first call) say it once between them."""
    start = threading.Barrier(16)

    def measure() -> None:
        clock = ServerClock("redis://h:1/0")
        start.wait()
        clock.observe(1000.0, 1000.0 + 30 * H, 1000.0 + 30 * H)

    threads = [threading.Thread(target=measure) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(capsys.readouterr().err.splitlines()) == 1


@pytest.mark.usefixtures("fresh_process")
@pytest.mark.parametrize(("told", "warns"), [(-30 * H, False), (-30 * H + 3, False), (-10 * H, True), ("junk", True)])
def test_a_child_whose_parent_warned_of_its_skew_stays_quiet(
    told: float | str, warns: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(SKEW_VARIABLE, repr(told) if isinstance(told, float) else told)
    ServerClock("redis://h:1/0").observe(1000.0, 1000.0 + 30 * H, 1000.0 + 30 * H)
    assert bool(capsys.readouterr().err) is warns


@pytest.mark.usefixtures("fresh_process")
def test_five_seconds_off_is_no_skew(capsys: pytest.CaptureFixture[str]) -> None:
    ServerClock("redis://h:1/0").observe(1000.0, 1005.0, 1005.0)
    assert capsys.readouterr().err == "" and SKEW_VARIABLE not in os.environ


def test_the_ledger_clock_of_each_store(tmp_path: Path) -> None:
    """SQLite's is this host's (one machine, one clock); Redis's is its server's, through the ledger."""
    sqlite = SQLiteLedger(tmp_path / "ledger.sqlite3")
    try:
        assert ledger_clock(sqlite) is time.time
    finally:
        sqlite.close()
    redis_ledger = RedisLedger("redis://127.0.0.1:1/0")
    assert ledger_clock(redis_ledger) == redis_ledger.now


# -- on a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def module_redis() -> Iterator[str]:
    with session_url() as url:
        yield url


@pytest.fixture
def ledger(module_redis: str) -> Iterator[RedisLedger]:
    opened = RedisLedger(flushed(module_redis))
    try:
        yield opened
    finally:
        opened.close()


def _md(ledger: RedisLedger, day: str) -> Counters:
    key = model_day_key(MODEL, day)
    return ledger.counters([key])[key]


def _days(ledger: RedisLedger) -> set[str]:
    """The days of every model-day key in the store."""
    import redis

    client = redis.Redis.from_url(ledger.url, decode_responses=True)
    try:
        return {name.split(":")[2] for name in client.scan_iter("{qw:md:*")}
    finally:
        client.close()


def _server_time(ledger: RedisLedger) -> float:
    import redis

    client = redis.Redis.from_url(ledger.url)
    try:
        seconds, micros = client.time()
    finally:
        client.close()
    return seconds + micros / 1_000_000


def _open_holds(ledger: RedisLedger, day: str) -> list[tuple[bytes, float]]:
    """(hold id, expiry) of the model-day's open holds, as the reclaim reads them."""
    import redis

    client = redis.Redis.from_url(ledger.url)
    try:
        return list(client.zrange(f"{{qw:md:{day}:{MODEL}}}:open", 0, -1, withscores=True))
    finally:
        client.close()


@pytest.mark.redis
def test_the_ledgers_clock_reads_the_servers(ledger: RedisLedger) -> None:
    assert abs(ledger.now() - _server_time(ledger)) < 1.0


@pytest.mark.redis
@pytest.mark.parametrize("days_off", [1, -1, 365])
def test_a_call_naming_another_day_is_held_on_the_servers(ledger: RedisLedger, days_off: int) -> None:
    """What a process whose clock is a day off (ahead, behind) names: the server's day is taken instead, every
    counter is that day's, and its settle lands there."""
    today = beijing_day(_server_time(ledger))
    other = beijing_day(_server_time(ledger) + days_off * DAY_S)
    held = ledger.reserve(request(100, day=other), limits(daily=150))
    assert held.held
    refused = ledger.reserve(request(100, day=other), limits(daily=150))  # the same day's cap, not another's
    assert not refused.held and refused.verdict.blocking is not None
    ledger.settle(held.hold_id, usage(80))
    assert _md(ledger, today) == Counters(80, 0)
    assert _days(ledger) == {today}
    assert ledger.run_totals("run-a").models[MODEL].settled_tokens == 80


@pytest.mark.redis
def test_a_stale_offset_is_corrected_by_the_next_reserve(ledger: RedisLedger) -> None:
    """As when this host's clock is stepped 30 h after the offset was measured: the process names tomorrow and
    an expiry 30 h late; the script refuses the day, the ledger learns the offset from its answer, and the hold
    is taken on the server's day with its expiry on the server's clock."""
    ledger.now()  # connected, the offset measured
    ledger._server.offset += 30 * H  # what the stepped clock leaves: the ledger now reads 30 h ahead
    now = ledger.now()
    assert now - _server_time(ledger) > 29 * H
    stale = dataclasses.replace(request(100, day=beijing_day(now)), expires_at=now + 600)
    assert ledger.reserve(stale, limits(daily=1000)).held
    assert abs(ledger.now() - _server_time(ledger)) < 1.0
    today = beijing_day(_server_time(ledger))
    assert _days(ledger) == {today} and _md(ledger, today) == Counters(0, 100)
    (expires,) = [score for _, score in _open_holds(ledger, today)]
    assert abs(expires - (_server_time(ledger) + 600)) < 5


@pytest.mark.redis
def test_a_call_naming_another_day_on_cluster() -> None:
    """Cluster's two slots: the run gate refuses the other day before it takes anything, then the call is held on
    the server's day in both."""
    reason = cluster_unavailable_reason()
    if reason is not None:
        pytest.fail(reason)
    binary = redis_binary()
    assert binary is not None
    cluster = RedisCluster3(binary).start()
    try:
        ledger = RedisLedger(cluster.url)
        today = beijing_day(ledger.now())
        held = ledger.reserve(request(100, day=beijing_day(ledger.now() + DAY_S)), limits(run_cap=150, daily=1000))
        assert ledger.cluster and held.held
        assert not ledger.reserve(request(100, day=today), limits(run_cap=150, daily=1000)).held
        ledger.settle(held.hold_id, usage(70))
        assert _md(ledger, today) == Counters(70, 0)
        assert ledger.run_totals("run-a").models[MODEL].settled_tokens == 70
        ledger.close()
    finally:
        cluster.cleanup()
