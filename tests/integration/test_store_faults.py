"""A store that is down or corrupt: fail closed by default, --fail-open is explicit and never silent."""

from __future__ import annotations

import json
from pathlib import Path

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, run_quotawrap
from tests.redis_server import free_port


class TestStoreDown:
    def test_unreachable_store_refuses_to_run(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """Redis down at start: exit 4 naming the store, the child never runs, nothing is sent."""
        marker = tmp_path / "ran"
        store = f"redis://127.0.0.1:{free_port()}/0"
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url],
            ["python", "-c", f"open({str(marker)!r}, 'w')"],
        )
        assert result.returncode == 4
        assert store in result.stderr and "--fail-open" in result.stderr
        assert not marker.exists()

    def test_fail_open_runs_and_records_every_unguarded_call(self, sim: ArkSimulator, tmp_path: Path) -> None:
        """--fail-open: the call goes out, and the summary, the report and a JSONL record say so."""
        log = tmp_path / "unguarded.jsonl"
        report = tmp_path / "report.json"
        result = run_quotawrap(
            [
                "--store",
                f"redis://127.0.0.1:{free_port()}/0",
                "--base-url",
                sim.url,
                "--fail-open",
                "--unguarded-log",
                str(log),
                "--report-json",
                str(report),
            ],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("TOTAL") and sim.billed_total() > 0
        assert "1 call(s) went out UNGUARDED" in result.stderr
        (record,) = [json.loads(line) for line in log.read_text().splitlines()]
        assert record["model"] == "deepseek-v4-flash" and "Connection refused" in record["error"]
        data = json.loads(report.read_text())
        assert data["totals"]["unguarded_calls"] == 1
        assert data["store_error"]


class TestStoreCorrupt:
    def test_corrupt_sqlite_is_refused_and_left_untouched(self, tmp_path: Path) -> None:
        """A damaged ledger file: exit 4 with a clear message; its bytes are exactly as they were."""
        path = tmp_path / "ledger.sqlite3"
        garbage = b"this is not a database, but it is somebody's file\n" * 100
        path.write_bytes(garbage)
        result = run_quotawrap(["--store", f"sqlite:///{path}"], ["python", "-c", "pass"])
        assert result.returncode == 4
        assert "damaged" in result.stderr and "Traceback" not in result.stderr
        assert path.read_bytes() == garbage
