"""The wrapper's start-up waits for a balance sync only when today has none."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.conftest import run_quotawrap

# Prints a balance once the child has started (or gives up waiting), and says which came first.
BALANCE = textwrap.dedent(
    """
    import os, sys, time
    marker, verdict, patience = sys.argv[1], sys.argv[2], float(sys.argv[3])
    deadline = time.monotonic() + patience
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    open(verdict, "w").write("child-first" if os.path.exists(marker) else "sync-first")
    print("house-model=400000")
    """
)


def _balance_script(tmp_path: Path, patience_s: float) -> str:
    script = tmp_path / "balance.py"
    script.write_text(BALANCE)
    return f"{sys.executable} {script} {tmp_path / 'child-started'} {tmp_path / 'verdict'} {patience_s}"


class TestFirstSync:
    def test_with_todays_snapshot_the_child_starts_before_the_sync_ends(self, store: str, tmp_path: Path) -> None:
        """Today already has a balance: the due sync runs beside the child, not before it."""
        subprocess.run(
            [sys.executable, "-m", "quotawrap", "sync", "--store", store, "--balance", "house-model=500000"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        marker = tmp_path / "child-started"
        balance = _balance_script(tmp_path, 20)  # the old order would make it wait all of it
        result = run_quotawrap(
            ["--store", store, "--model", "house-model", "--sync-interval", "0.001", "--balance-cmd", balance],
            [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        )
        assert result.returncode == 0, result.stderr
        verdict = tmp_path / "verdict"
        deadline = time.monotonic() + 60
        while not verdict.exists():  # the balance command may outlive the run by a moment
            assert time.monotonic() < deadline, "the balance command never ran"
            time.sleep(0.05)
        assert verdict.read_text() == "child-first"

    def test_without_todays_snapshot_the_sync_comes_first(self, store: str, tmp_path: Path) -> None:
        """No balance yet today: the wrapper reads one before the child's first call can be made."""
        marker = tmp_path / "child-started"
        result = run_quotawrap(
            ["--store", store, "--model", "house-model", "--balance-cmd", _balance_script(tmp_path, 1)],
            [sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        )
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "verdict").read_text() == "sync-first"
