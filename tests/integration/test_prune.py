"""`quotawrap prune` and the automatic retention bound, through the real CLI on a ledger that holds both
old calls (written by the real SQLite ledger on a past clock) and fresh calls of a real guarded run."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from quotawrap.core.quota import beijing_day
from quotawrap.core.usage import Usage
from quotawrap.ledger import HoldRequest
from quotawrap.ledger.sqlite.ledger import SQLiteLedger
from quotawrap.simulator import ArkSimulator
from tests.conftest import child, ledger_rows, run_cli, run_quotawrap

DAY_S = 86_400


def _seed_old(store: str, days_ago: tuple[int, ...]) -> None:
    """Settled, released and unresolved calls of two models on past days, written by the real ledger."""
    clock = [0.0]
    ledger = SQLiteLedger(store.removeprefix("sqlite:///"), clock=lambda: clock[0])
    for ago in days_ago:
        clock[0] = time.time() - ago * DAY_S
        for n, model in enumerate(("deepseek-v4-flash", "doubao-seed-1-6-250615", "deepseek-v4-flash")):
            request = HoldRequest(
                run_id=f"old-{ago}",
                model=model,
                day=beijing_day(clock[0]),
                reserve=2000,
                endpoint="chat",
                pid=os.getpid(),
                host="old-host",
                expires_at=clock[0] + 3600,
                tags={"user": f"user{n % 2}"},
            )
            hold = ledger.reserve(request, lambda _snapshot: []).hold_id
            if n == 0:
                ledger.settle(hold, Usage(100 + ago, 40, 140 + ago), cost=500)
            elif n == 1:
                ledger.release(hold)
            else:
                ledger.settle(hold, None)
    ledger.close()


def _report(store: str, by: str) -> Any:
    result = run_cli("report", "--store", store, "--by", by, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["rows"]


def _reports(store: str) -> dict[str, Any]:
    return {by: _report(store, by) for by in ("day", "model", "tag:user")}


def _old_calls(store: str) -> int:
    cutoff = beijing_day(time.time() - 90 * DAY_S)
    return int(ledger_rows(store, "SELECT COUNT(*) FROM calls WHERE day < ?", (cutoff,))[0][0])


def test_prune_keeps_report_totals_by_day_and_model(sim: ArkSimulator, store: str) -> None:
    """`report --by day`, `--by model` and `--by tag:user` print the same rows before and after
    `prune --older-than 90d`; `--dry-run` changes nothing; only calls older than 90 days go."""
    _seed_old(store, (200, 120, 91))
    guarded = run_quotawrap(
        ["--store", store, "--base-url", sim.url, "--retention", "off"], child("one_call.py"), env={"SIM_URL": sim.url}
    )
    assert guarded.returncode == 0, guarded.stderr
    before = _reports(store)
    assert len(before["day"]) == 4  # three old days and today
    assert _old_calls(store) == 9

    dry = run_cli("prune", "--store", store, "--older-than", "90d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith("would prune 9 call(s) on 3 day(s)"), dry.stdout
    assert _old_calls(store) == 9

    pruned = run_cli("prune", "--store", store, "--older-than", "90d")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned 9 call(s) on 3 day(s)"), pruned.stdout
    assert _old_calls(store) == 0
    assert ledger_rows(store, "SELECT COUNT(*) FROM calls")[0][0] == 1  # today's guarded call stays
    assert _reports(store) == before
    again = run_cli("prune", "--store", store, "--older-than", "90d")
    assert again.stdout.startswith("nothing to prune"), again.stdout
    assert _reports(store) == before


def test_run_end_prunes_by_retention_once_a_day(sim: ArkSimulator, store: str) -> None:
    """A guarded run's end prunes by the default 90-day retention and says so; a later run the same day
    does not prune again (the day's lease), so a day seeded after the first run is still there."""
    _seed_old(store, (150,))
    before = _reports(store)
    first = run_quotawrap(["--store", store, "--base-url", sim.url], child("one_call.py"), env={"SIM_URL": sim.url})
    assert first.returncode == 0, first.stderr
    assert "retention 90d: pruned 3 call(s) on 1 day(s)" in first.stderr
    assert _old_calls(store) == 0
    after = _reports(store)
    assert [row for row in after["day"] if row["key"] != beijing_day(time.time())] == before["day"]
    _seed_old(store, (100,))
    second = run_quotawrap(["--store", store, "--base-url", sim.url], child("one_call.py"), env={"SIM_URL": sim.url})
    assert second.returncode == 0, second.stderr
    assert "pruned" not in second.stderr
    assert _old_calls(store) == 3


def test_bad_duration_is_one_line_and_changes_nothing(store: str, tmp_path: Path) -> None:
    """`--older-than 3w` exits 2 with one line naming the accepted forms, no traceback, nothing pruned."""
    _seed_old(store, (200,))
    result = run_cli("prune", "--store", store, "--older-than", "3w")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "90d, 12h, 30m" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert _old_calls(store) == 3


def test_every_flag_takes_the_same_durations(store: str, tmp_path: Path) -> None:
    """30m is a duration for prune --older-than, --retention and report/sessions --since alike (one parser);
    a bad --retention is refused before the command runs, not reported after it."""
    _seed_old(store, (200,))
    pruned = run_cli("prune", "--store", store, "--older-than", "30m", "--dry-run")
    assert pruned.returncode == 0 and "would prune 3 call(s)" in pruned.stdout, pruned.stderr
    for command in ("report", "sessions"):
        assert run_cli(command, "--store", store, "--since", "-30m").returncode == 0
    assert run_quotawrap(["--store", store, "--retention", "30m", "--quiet"], ["true"]).returncode == 0
    marker = tmp_path / "ran"
    refused = run_quotawrap(["--store", store, "--retention", "30x"], ["touch", str(marker)])
    assert refused.returncode == 2 and "--retention" in refused.stderr and "Traceback" not in refused.stderr
    assert not marker.exists()
