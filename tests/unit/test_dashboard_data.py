"""``status_snapshot``, the one read behind ``status --json``, the dashboard and ``/metrics``, on real ledgers;
and the dashboard's answers (``Pages``): its assets, its data, a store that fails, reads shared across tabs."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from quotawrap.books.status import TOP_ROWS, model_status, status_snapshot
from quotawrap.config.settings import Settings
from quotawrap.core.errors import StoreError
from quotawrap.core.quota import Counters, Limit, QuotaSettings, Snapshot, beijing_day, effective_limit
from quotawrap.core.usage import Usage
from quotawrap.dashboard.pages import Pages, addressed_here
from quotawrap.ledger import Ledger, open_ledger
from quotawrap.ledger.base import HoldRequest, RunRecord, model_day_key
from tests.redis_server import session_url

MODEL = "deepseek-v4-flash"


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    if request.param == "sqlite":
        opened = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
        yield opened
        opened.close()
        return
    with session_url() as url:
        opened = open_ledger(url)
        yield opened
        opened.close()


def _hold(ledger: Ledger, reserve: int, *, cap: int, tags: dict[str, str], run: str = "run-a") -> str | None:
    """A call of today under a daily cap of ``cap``: its hold id, or None when the cap refused it."""
    request = HoldRequest(
        run_id=run,
        model=MODEL,
        day=beijing_day(time.time()),
        reserve=reserve,
        endpoint="/api/v3/chat/completions",
        pid=os.getpid(),
        host="h",
        expires_at=time.time() + 600,
        tags=tags,
    )
    decision = ledger.reserve(request, lambda _snapshot: [Limit("daily_cap", "model_day", cap)])
    return decision.hold_id if decision.held else None


def _settle(ledger: Ledger, hold_id: str | None, tokens: int) -> None:
    assert hold_id is not None
    ledger.settle(
        hold_id, Usage(prompt_tokens=tokens // 2, completion_tokens=tokens - tokens // 2, total_tokens=tokens)
    )


def test_the_snapshot_carries_the_ledgers_figures(ledger: Ledger) -> None:
    users = [f"user-{n:02d}" for n in range(TOP_ROWS + 3)]
    for n, user in enumerate(users):
        _settle(ledger, _hold(ledger, 500, cap=100_000, tags={"user": user, "team": "infra"}), 100 + n)
    _settle(ledger, _hold(ledger, 1_500, cap=100_000, tags={"user": "alice"}), 1_000)
    held = _hold(ledger, 700, cap=100_000, tags={"user": "alice"})
    assert held is not None
    refused = [_hold(ledger, 200_000, cap=100_000, tags={"user": "alice"}) for _ in range(2)]
    assert refused == [None, None]

    now = time.time()
    snapshot = status_snapshot(ledger, Settings(), now)
    json.dumps(snapshot)  # plain JSON values, as data.json and /metrics carry them
    counters = ledger.counters([model_day_key(MODEL, beijing_day(now))])[model_day_key(MODEL, beijing_day(now))]
    (row,) = snapshot["models"]
    assert (row["usage"], row["in_flight"], row["refused"]) == (counters.settled, counters.in_flight, 2)
    assert counters == Counters(1_000 + sum(100 + n for n in range(len(users))), 700)
    assert snapshot["refused"] == {MODEL: 2} and snapshot["waiting"] == {}
    # status --json's rows, and no figure of their own
    assert {k: v for k, v in row.items() if k not in ("refused", "limits")} == model_status(ledger, Settings(), now)[0]

    curve = snapshot["curves"][MODEL]["usage"]
    assert curve[-1][1] == counters.settled and [t for t, _ in curve] == sorted(t for t, _ in curve)

    by_user = snapshot["by_tag"]["user"]
    assert len(by_user) == TOP_ROWS + 1  # the largest ten (alice first), and the rest as one row
    others = by_user[-1]
    assert others["key"] == "(others)"
    assert sum(r["settled_tokens"] for r in by_user) == counters.settled
    smallest = len(users) - (TOP_ROWS - 1)  # alice and nine users are kept
    assert others["calls"] == smallest and others["settled_tokens"] == sum(100 + n for n in range(smallest))
    assert by_user[0]["key"] == "alice" and (by_user[0]["settled_tokens"], by_user[0]["blocked_calls"]) == (1_000, 2)
    assert snapshot["by_tag"]["team"][0] == {
        "key": "infra",
        "calls": len(users),
        "blocked_calls": 0,
        "settled_tokens": counters.settled - 1_000,
        "cost_micro_cny": 0,
    }
    assert snapshot["sessions"] == [] and snapshot["unguarded_processes"] == [] and snapshot["budgets"] == []


def test_only_this_stores_runs_count_among_the_hosts_events_logs(ledger: Ledger, tmp_path: Path) -> None:
    """The events directory is the host's, shared by the runs of every store: waits and processes outside the
    guard count only for the runs this store knows."""
    now = time.time()
    ledger.start_run(RunRecord("run-here", now - 60, command="python agent.py"))
    for run in ("run-here", "run-of-another-store"):
        events = [
            {"ev": "wait", "id": f"{run}-w", "model": MODEL, "pid": os.getpid()},
            {
                "ev": "unguarded",
                "wrapper_pid": os.getpid(),
                "pid": 4242,
                "command": "node agent.js",
                "reason": "no hook",
            },
        ]
        (tmp_path / f"{run}.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    snapshot = status_snapshot(ledger, Settings(), now, events_dir=str(tmp_path))
    assert snapshot["waiting"] == {MODEL: 1}
    assert [process["session"] for process in snapshot["unguarded_processes"]] == ["run-here"]


@pytest.mark.parametrize(
    ("balance", "usage_at_sync", "lagged", "daily_cap"),
    [
        (1_500_000, 40_000, 10_000, 2_000_000),  # both below the cap: the lag-aware limit is lower
        (900_000, 0, 0, 2_000_000),  # nothing used before the sync: the two agree
        (3_000_000, 40_000, 10_000, 2_000_000),  # a big balance: the daily cap binds both
        (20_000, 5_000, 5_000, 2_000_000),  # a pool under the small buffer: no room at all
    ],
)
def test_the_v6_and_lag_aware_limits_of_todays_balance(
    ledger: Ledger, balance: int, usage_at_sync: int, lagged: int, daily_cap: int
) -> None:
    now = time.time()
    snap = Snapshot(balance, usage_at_sync, lagged, now - 60, beijing_day(now), "billing-api", 1800.0)
    ledger.put_snapshot(MODEL, snap)
    settings = Settings(daily_cap=daily_cap)
    (row,) = status_snapshot(ledger, settings, now)["models"]
    buffer = settings.small_buffer
    assert row["limits"]["v6"] == min(daily_cap, max(0, balance + usage_at_sync - buffer))
    assert row["limits"]["lag_aware"] == min(daily_cap, max(0, balance + lagged - buffer)) == row["effective_limit"]
    assert row["limits"]["daily_cap"] == daily_cap
    assert next(wall["name"] for wall in row["limits"]["walls"]) in ("usage_wall", "daily_cap", "snapshot")
    quota = QuotaSettings(daily_cap=daily_cap)
    assert row["limits"]["v6"] == effective_limit(snap, dataclasses.replace(quota, balance_lag_s=0.0))[0]


# -- the dashboard's answers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "status", "kind"),
    [
        ("", 200, "text/html"),
        ("index.html", 200, "text/html"),
        ("dashboard.js", 200, "text/javascript"),
        ("dashboard.css", 200, "text/css"),
        ("icon.svg", 200, "image/svg+xml"),
        ("data.json", 200, "application/json"),
        ("../pages.py", 404, "text/plain"),
        ("nothing", 404, "text/plain"),
    ],
)
def test_each_path_is_answered_from_the_package(name: str, status: int, kind: str) -> None:
    answer = Pages(lambda: {"models": []}).answer(name)
    assert answer.status == status and answer.content_type.startswith(kind)
    assert ("Content-Security-Policy", answer.headers[0][1]) == answer.headers[0]
    assert "script-src 'self'" in answer.headers[0][1]  # no inline script, nothing from elsewhere


def test_the_page_loads_nothing_from_another_host() -> None:
    pages = Pages(dict)
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        text = pages.answer(name).body.decode()
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text


def test_a_store_that_fails_is_a_503_without_its_password() -> None:
    def down() -> dict[str, Any]:
        raise StoreError("the server did not answer", store="redis://:hunter2@10.0.0.5:6379/0")

    answer = Pages(down).answer("data.json")
    assert answer.status == 503 and b"hunter2" not in answer.body and b"did not answer" in answer.body


def test_tabs_polling_at_once_share_one_read_of_the_store() -> None:
    reads = []
    gate = threading.Barrier(8)

    def read() -> dict[str, Any]:
        reads.append(1)
        time.sleep(0.05)  # a slow store: the other tabs' polls arrive meanwhile
        return {"reads": len(reads)}

    pages = Pages(read, fresh_s=3600)
    answers: list[bytes] = []

    def tab() -> None:
        gate.wait()
        answers.append(pages.answer("data.json").body)

    threads = [threading.Thread(target=tab) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(reads) == 1 and set(answers) == {b'{"reads":1}'}
    assert Pages(read, fresh_s=0).answer("data.json").body == b'{"reads":2}'  # no sharing: read anew


@pytest.mark.parametrize(
    ("host_header", "bound", "answered"),
    [
        ("127.0.0.1:8791", "127.0.0.1", True),
        ("localhost:8791", "127.0.0.1", True),
        ("LOCALHOST", "127.0.0.1", True),
        ("[::1]:8791", "::1", True),
        (None, "127.0.0.1", True),  # no browser omits Host: not a page of another site
        ("attacker.example:8791", "127.0.0.1", False),  # a name pointed at 127.0.0.1 (DNS rebinding)
        ("127.0.0.1.attacker.example", "127.0.0.1", False),
        ("[::1].attacker.example", "::1", False),
        ("dash.team.internal:8791", "0.0.0.0", True),  # bound beyond loopback: reached by any name, on purpose
    ],
)
def test_a_loopback_page_answers_only_requests_addressed_to_this_machine(
    host_header: str | None, bound: str, answered: bool
) -> None:
    assert addressed_here(host_header, bound) is answered


def test_more_paths_are_answered_beside_the_page() -> None:
    pages = Pages(dict, extra={"metrics": lambda: ("text/plain; version=0.0.4", b"quotawrap_waiting_calls 0\n")})
    answer = pages.answer("metrics")
    assert (answer.status, answer.content_type, answer.body) == (
        200,
        "text/plain; version=0.0.4",
        b"quotawrap_waiting_calls 0\n",
    )
    assert pages.refused("attacker.example").status == 403


def test_a_failure_of_the_server_is_one_line_without_secrets(capfd: pytest.CaptureFixture[str]) -> None:
    import http.client
    import urllib.request

    from quotawrap.dashboard.server import DashboardServer

    def broken() -> dict[str, Any]:
        raise RuntimeError("read failed on redis://:hunter2@10.0.0.5:6379/0")

    server = DashboardServer(Pages(broken), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            urllib.request.urlopen(server.url + "data.json", timeout=30)
        with urllib.request.urlopen(server.url, timeout=30) as answer:  # and it goes on serving
            assert answer.status == 200
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "RuntimeError: read failed" in err and "hunter2" not in err
