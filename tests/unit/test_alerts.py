"""Webhook alerts (quotawrap.books.alerts): each threshold of a limit and period posted once, whoever polls."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap.books.alerts import (
    BUDGET,
    DAILY_LIMIT,
    AlertSender,
    AlertWatcher,
    Watched,
    alert_payload,
    budget_row,
    claim_name,
    day_limit_watched,
    shown_webhook,
    watched_limits,
)
from quotawrap.core.thresholds import THRESHOLDS, crossed
from quotawrap.ledger import Ledger, open_ledger
from quotawrap.ledger.base import ledger_clock
from tests.redis_server import session_url
from tests.webhook_receiver import webhook

LIMIT = 1_000


def _day_limit(used: int, *, day: str = "2026-12-07", in_flight: int = 0) -> Watched:
    return Watched(DAILY_LIMIT, "deepseek-v4", day, used, in_flight, LIMIT, time.time() + 3600)


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}"
        return
    with session_url() as url:
        yield url


def _watcher(ledger: Ledger, readings: list[Watched], url: str, **sender: object) -> AlertWatcher:
    """A watcher whose every poll reads the next of ``readings`` (the last one again at the end)."""
    left = list(readings)

    def read(_now: float) -> list[Watched]:
        return [left.pop(0) if len(left) > 1 else left[0]]

    return AlertWatcher(
        ledger,
        read,
        THRESHOLDS,
        AlertSender(url, **sender),
        clock=ledger_clock(ledger),
        session="s1",  # type: ignore[arg-type]
    )


class TestOncePerThreshold:
    def test_rising_use_posts_each_threshold_once(self, ledger_url: str) -> None:
        """30%, 55%, 85%, 85%, 100%: one alert each for 50, 80 and 100, nothing for the repeats."""
        ledger = open_ledger(ledger_url)
        readings = [_day_limit(used) for used in (300, 550, 850, 850, 1_000)]
        with webhook() as receiver:
            watcher = _watcher(ledger, readings, receiver.url)
            queued = [watcher.poll() for _ in readings]
            watcher.stop()
        ledger.close()
        assert queued == [0, 1, 1, 0, 1]
        assert receiver.thresholds() == [(DAILY_LIMIT, "deepseek-v4", p) for p in (50.0, 80.0, 100.0)]

    def test_a_jump_past_two_thresholds_is_one_message_naming_the_highest(self, ledger_url: str) -> None:
        """0 -> 90% in one poll: one message, at 80%, that also says 50% was passed."""
        ledger = open_ledger(ledger_url)
        with webhook() as receiver:
            watcher = _watcher(ledger, [_day_limit(900)], receiver.url)
            watcher.poll()
            watcher.stop()
        ledger.close()
        [body] = receiver.bodies
        assert body["quotawrap"]["threshold_percent"] == 80.0
        assert body["quotawrap"]["thresholds_percent"] == [50.0, 80.0]
        assert "reached 80% of its daily limit" in body["text"] and "also past 50%" in body["text"]

    def test_two_watchers_on_one_ledger_share_the_claims(self, ledger_url: str) -> None:
        """Two watchers (two connections, two threads) poll the same rising use at once: each threshold
        is posted by one of them only."""
        readings = [_day_limit(used) for used in (100, 520, 610, 810, 990, 1_000, 1_000)]
        ledgers = [open_ledger(ledger_url), open_ledger(ledger_url)]
        with webhook() as receiver:
            watchers = [_watcher(ledger, readings, receiver.url) for ledger in ledgers]
            start = threading.Barrier(2)

            def run(watcher: AlertWatcher) -> None:
                start.wait()
                for _ in readings:
                    watcher.poll()
                watcher.stop()

            threads = [threading.Thread(target=run, args=(watcher,)) for watcher in watchers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
        for ledger in ledgers:
            ledger.close()
        announced = sorted(receiver.thresholds())
        assert announced == [(DAILY_LIMIT, "deepseek-v4", p) for p in (50.0, 80.0, 100.0)]

    def test_a_new_period_fires_again(self, ledger_url: str) -> None:
        """The next Beijing day's 50% is a threshold of another period."""
        ledger = open_ledger(ledger_url)
        readings = [_day_limit(600, day="2026-12-07"), _day_limit(600, day="2026-12-08")]
        with webhook() as receiver:
            watcher = _watcher(ledger, readings, receiver.url)
            watcher.poll()
            watcher.poll()
            watcher.stop()
        ledger.close()
        assert [body["quotawrap"]["period"] for body in receiver.bodies] == ["2026-12-07", "2026-12-08"]


class TestRetries:
    def test_a_failing_receiver_still_gets_the_alert_once(self, ledger_url: str) -> None:
        """The first three posts answered 500: the fourth try lands, and only one alert arrives."""
        ledger = open_ledger(ledger_url)
        with webhook(fail_first=3) as receiver:
            watcher = _watcher(ledger, [_day_limit(500)], receiver.url, backoff_s=(0.01, 0.02, 0.04, 0.08))
            watcher.poll()
            watcher.stop()
        ledger.close()
        assert receiver.refused == 3
        assert receiver.thresholds() == [(DAILY_LIMIT, "deepseek-v4", 50.0)]

    def test_retries_are_bounded_and_never_raise(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A receiver that always fails: five tries, then one warning naming the host alone."""
        tries: list[bytes] = []

        def post(url: str, body: bytes) -> None:
            tries.append(body)
            raise OSError("connection refused")

        sender = AlertSender("https://hooks.example.com/services/T0/B0/XYZSECRET", backoff_s=(0, 0, 0, 0), post=post)
        sender.submit({"text": "x"})
        sender.close()
        err = capsys.readouterr().err
        assert len(tries) == 5 and sender.failed == 1 and sender.sent == 0
        assert "https://hooks.example.com" in err and "XYZSECRET" not in err

    def test_close_shrinks_the_pauses_to_its_bound(self) -> None:
        """A stopping sender still retries, but within its bound: a run's end waits no hour of backoff."""
        calls: list[bytes] = []

        def post(url: str, body: bytes) -> None:
            calls.append(body)
            if len(calls) < 3:
                raise OSError("refused")

        sender = AlertSender("http://127.0.0.1:9/x", backoff_s=(3600.0, 3600.0), post=post)
        sender.submit({"text": "x"})
        sender.close(timeout=4.0)
        assert len(calls) == 3 and sender.sent == 1  # delivered before close gave up: no pause of the hour waited


class TestPayload:
    def test_only_the_limit_its_numbers_period_host_and_session(self) -> None:
        """The message carries the limit's figures and where it was seen, and nothing else."""
        payload = alert_payload(_day_limit(850, in_flight=20), 0.8, [0.8], host="h1", session="run-1")
        assert payload["text"] == (
            "quotawrap: deepseek-v4 reached 80% of its daily limit (850 tokens of 1,000 tokens settled,"
            " +20 tokens in flight; Beijing day 2026-12-07) on host h1, session run-1"
        )
        assert set(payload) == {"text", "quotawrap"}
        assert set(payload["quotawrap"]) == {
            "limit", "name", "period", "threshold_percent", "thresholds_percent", "used", "in_flight",
            "limit_amount", "unit", "host", "session",
        }  # fmt: skip

    def test_a_money_budget_in_cny(self) -> None:
        """A CNY budget's micro-CNY read as CNY."""
        budget = Watched(BUDGET, "team-search", "1765123200", 2_500_000, 0, 3_000_000, 0.0, "cny")
        text = alert_payload(budget, 0.8, [0.8], host="h", session=None)["text"]
        assert "budget team-search reached 80% of its budget (2.50 CNY of 3.00 CNY settled)" in text

    def test_webhook_shown_without_its_path(self) -> None:
        """A Slack webhook's path is its secret: messages name the host."""
        assert shown_webhook("https://user:pw@hooks.slack.com/services/T/B/X") == "https://hooks.slack.com"


class TestWatchedLimits:
    def test_models_and_budgets_of_a_snapshot(self) -> None:
        """Each model's daily limit (its day, ending at the reset) and each budget (ending at its reset)."""
        data = {
            "models": [
                {"model": "m1", "day": "2026-12-07", "usage": 5, "in_flight": 1, "effective_limit": 10,
                 "seconds_to_reset": 100.0},
            ],
            "budgets": [{"name": "b", "used": 3, "in_flight": 0, "limit": 4, "unit": "tokens", "resets_at": 5000.0}],
        }  # fmt: skip
        assert watched_limits(data, 1000.0) == [
            Watched(DAILY_LIMIT, "m1", "2026-12-07", 5, 1, 10, 1100.0),
            Watched(BUDGET, "b", "5000", 3, 0, 4, 5000.0),
        ]

    def test_a_day_is_watched_up_to_its_usage_line(self) -> None:
        """The usage wall below the effective limit is where the day ends: 100% there, as the live view draws it."""
        row = {
            "model": "m1", "day": "2026-12-07", "usage": 1_950, "in_flight": 0, "effective_limit": 2_000,
            "seconds_to_reset": 10.0, "evicted": True,
            "limits": {"walls": [{"name": "usage_wall", "cap": 1_950}, {"name": "balance_wall", "cap": 1}]},
        }  # fmt: skip
        watched = day_limit_watched(row, 0.0)
        assert (watched.limit, watched.stopped) == (1_950, True)
        assert crossed(0.0, watched.fraction) == [0.5, 0.8, 1.0]

    def test_a_model_stopped_by_a_wall_has_reached_its_limit(self) -> None:
        """Evicted by the balance wall with a sliver used: 100% (the model takes no more calls), said so."""
        row = {
            "model": "m1", "day": "2026-12-07", "usage": 40, "in_flight": 0, "effective_limit": 2_000,
            "seconds_to_reset": 10.0, "evicted": True,
        }  # fmt: skip
        watched = day_limit_watched(row, 0.0)
        assert crossed(0.0, watched.fraction) == [0.5, 0.8, 1.0]
        text = alert_payload(watched, 1.0, [0.5, 0.8, 1.0], host="h", session=None)["text"]
        assert (
            "reached 100% of its daily limit (40 tokens of 2,000 tokens settled; no more calls to it this day;" in text
        )

    def test_budget_records_shape_too(self) -> None:
        """A budget as its own records write it (id, amount, period_key, left) reads as the snapshot's shape."""
        record = {
            "id": "team=search/day", "spec": "team=search:1k/day", "unit": "tokens", "amount": 1_000, "soft": False,
            "period": "day", "period_key": "2026-12-07", "used": 850, "in_flight": 100, "left": 50,
            "resets_at": 7200.0, "run_id": "",
        }  # fmt: skip
        assert budget_row(record) == {
            "name": "team=search/day", "used": 850, "in_flight": 100, "limit": 1_000, "left": 50, "unit": "tokens",
            "period": "2026-12-07", "resets_at": 7200.0,
        }  # fmt: skip
        assert watched_limits({"budgets": [record]}, 0.0) == [
            Watched(BUDGET, "team=search/day", "2026-12-07", 850, 100, 1_000, 7200.0)
        ]

    def test_claim_names_differ_by_limit_period_and_threshold(self) -> None:
        """One claim per (limit, period, threshold)."""
        days = ("2026-12-07", "2026-12-08")
        names = {claim_name(_day_limit(0, day=day), threshold) for day in days for threshold in THRESHOLDS}
        assert len(names) == 6
