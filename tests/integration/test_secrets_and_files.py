"""No secret in what quotawrap stores or prints; every file it writes is 0600 and never written through a link."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from quotawrap.simulator import ArkSimulator
from tests.conftest import child, ledger_rows, run_cli, run_quotawrap

SECRETS = ["sk-live-abcdef123456", "tok-zzz-987", "hunter2-pass", "opaque-bearer-value-42"]
SECRET_ARGS = [
    "--api-key",
    SECRETS[0],
    "token=tok-zzz-987",
    "--password=hunter2-pass",
    "Authorization: Bearer opaque-bearer-value-42",
    "--model",
    "kept-visible",
]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class TestCommandLinesAreRedacted:
    def test_runs_command_and_sessions_hide_secret_arguments(self, store: str) -> None:
        """The ledger's runs.command and `sessions` (text and JSON) show the command without its secrets."""
        result = run_quotawrap(["--store", store], [sys.executable, "-c", "pass", *SECRET_ARGS])
        assert result.returncode == 0, result.stderr
        ((stored,),) = ledger_rows(store, "SELECT command FROM runs")
        shown = [run_cli("sessions", "--store", store, *flag).stdout for flag in ([], ["--json"])]
        for text in [str(stored), *shown]:
            assert not [secret for secret in SECRETS if secret in text], text
            assert "***" in text
        assert "kept-visible" in str(stored) and "kept-visible" in shown[1]  # the text view cuts at 60 chars

    def test_sessions_redacts_a_command_stored_in_clear_by_an_older_version(self, store: str) -> None:
        """A ledger row written before redaction is still shown redacted."""
        assert run_quotawrap(["--store", store], ["true"]).returncode == 0
        path = store.removeprefix("sqlite:///")
        import sqlite3

        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE runs SET command = ?", (f"python agent.py --api-key {SECRETS[0]}",))
        out = run_cli("sessions", "--store", store, "--json").stdout
        assert SECRETS[0] not in out and json.loads(out)[0]["command"] == "python agent.py --api-key '***'"


class TestFilesWeWrite:
    def test_report_and_audit_log_are_0600_in_new_0700_directories(
        self, sim: ArkSimulator, store: str, tmp_path: Path
    ) -> None:
        """Missing directories are created 0700 at start; the audit log and report JSON are 0600."""
        audit = tmp_path / "new" / "audit" / "calls.jsonl"
        report = tmp_path / "other" / "report.json"
        os.umask(0o022)
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--audit-log", str(audit), "--report-json", str(report)],
            child("one_call.py"),
            env={"SIM_URL": sim.url},
        )
        assert result.returncode == 0, result.stderr
        assert len(audit.read_text().splitlines()) == 1 and "cannot write" not in result.stderr
        assert (mode(audit), mode(report)) == (0o600, 0o600)
        assert {mode(tmp_path / "new"), mode(audit.parent), mode(report.parent)} == {0o700}

    def test_a_symlinked_audit_log_is_refused_at_start(self, store: str, tmp_path: Path) -> None:
        """--audit-log pointing at a symlink: exit 2 before the child runs; the link's target is untouched."""
        target = tmp_path / "victim.txt"
        target.write_text("precious\n")
        link = tmp_path / "audit.jsonl"
        link.symlink_to(target)
        marker = tmp_path / "ran"
        result = run_quotawrap(
            ["--store", store, "--audit-log", str(link)], [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
        )
        assert result.returncode == 2 and "--audit-log" in result.stderr and "symbolic link" in result.stderr
        assert target.read_text() == "precious\n" and not marker.exists()

    def test_a_symlinked_report_is_refused_at_start(self, store: str, tmp_path: Path) -> None:
        """--report-json pointing at a symlink: exit 2, nothing written through it."""
        target = tmp_path / "victim.json"
        target.write_text("{}")
        link = tmp_path / "report.json"
        link.symlink_to(target)
        result = run_quotawrap(["--store", store, "--report-json", str(link)], ["true"])
        assert result.returncode == 2 and "--report-json" in result.stderr
        assert target.read_text() == "{}" and link.is_symlink()

    def test_an_unwritable_output_directory_is_refused_at_start(self, store: str, tmp_path: Path) -> None:
        """A path under a regular file cannot be made a directory: exit 2 naming the option, once."""
        (tmp_path / "file").write_text("")
        result = run_quotawrap(["--store", store, "--audit-log", str(tmp_path / "file" / "a.jsonl")], ["true"])
        assert result.returncode == 2 and result.stderr.count("--audit-log") == 1
