"""The wrapper's lean path on an existing SQLite ledger: a run whose processes never open the ledger
never loads the full ledger (nor the report, the live view, the retention modules), and every case
the lean path cannot judge still ends as before.

No timing: real wrapper processes; ``sys.modules`` is read at the wrapper's exit by an ``atexit``
hook, and the ledger's rows are read back with ``sqlite3``.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from quotawrap.simulator import ArkSimulator
from tests.conftest import ledger_rows, run_cli, sigkill_mid_stream

_DRIVER = r"""
import atexit, sys
OUT, ARGS = sys.argv[1], sys.argv[2:]  # no json here: the wrapper must not need it
atexit.register(lambda: open(OUT, "w").write("\n".join(sorted(sys.modules))))
from quotawrap.cli import main
sys.argv = ["quotawrap", *ARGS]
main()  # as the console script calls it
"""

# What a run that made no guarded call never needs, start to end.
NEVER_LOADED = (
    "quotawrap.ledger.sqlite.ledger",
    "quotawrap.ledger.base",
    "quotawrap.core.quota",
    "quotawrap.wrapper.summary",
    "quotawrap.wrapper.live",
    "quotawrap.books.retention",
    "quotawrap.core.money",
    "dataclasses",
    "typing",
    "json",
    "re",  # the command line is redacted without it when no argument looks secret (redact.plain_argument)
    "shlex",
    "enum",
    "pathlib",
    "subprocess",
    "ctypes",
)


def _modules_at_exit(tmp_path: Path, args: list[str]) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    out = tmp_path / "modules.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("QUOTAWRAP_")}
    result = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert out.exists(), result.stderr
    return out.read_text().splitlines(), result


def _existing_ledger(store: str) -> None:
    first = run_cli("--quiet", "--store", store, "--", sys.executable, "-c", "pass")  # the full path makes it
    assert first.returncode == 0, first.stderr


@pytest.mark.parametrize("options", [["--quiet"], []], ids=["quiet", "summary"])
def test_a_run_without_a_guarded_call_never_loads_the_full_ledger(
    tmp_path: Path, store: str, options: list[str]
) -> None:
    _existing_ledger(store)
    modules, result = _modules_at_exit(tmp_path, [*options, "--store", store, "--", sys.executable, "-c", "exit(3)"])
    assert result.returncode == 3, result.stderr
    assert [name for name in NEVER_LOADED if name in modules] == []
    if not options:  # the same summary line the report module prints for a run of no calls
        assert result.stderr.strip().endswith("0 guarded call(s), 0 tokens settled (¥0.000000), 0 blocked")
    last = "SELECT exit_code, ended_at IS NOT NULL, command FROM runs ORDER BY started_at DESC"
    (row,) = ledger_rows(store, last)[:1]
    assert row[:2] == (3, 1) and "exit(3)" in str(row[2])


def test_the_lean_row_matches_the_full_paths(tmp_path: Path, store: str) -> None:
    """A new ledger's first run (full path) and the next (lean): the same columns, the same tags' JSON."""
    command = [sys.executable, "-c", "pass", "--api-key", "sk-secretsecret"]
    for run_id in ("full", "lean"):
        result = run_cli("--quiet", "--store", store, "--run-id", run_id, "--tag", "note=a,b é", "--", *command)
        assert result.returncode == 0, result.stderr
    rows = {
        row[0]: row[1:]
        for row in ledger_rows(store, "SELECT run_id, command, tags, exit_code, ended_at IS NOT NULL FROM runs")
    }
    full_tags, lean_tags = json.loads(str(rows["full"][1])), json.loads(str(rows["lean"][1]))
    assert full_tags.pop("wrapper_pid") != lean_tags.pop("wrapper_pid")
    assert full_tags == lean_tags and lean_tags["note"] == "a,b é"
    assert rows["full"][0] == rows["lean"][0] and "sk-secretsecret" not in str(rows["lean"][0])
    assert rows["full"][2:] == rows["lean"][2:] == (0, 1)


def test_a_sigkilled_child_that_reserved_has_its_hold_charged(sim: ArkSimulator, store: str) -> None:
    """The child marks the run directory before its first reserve: the wrapper's end finds the mark,
    loads the full ledger and charges the hold the SIGKILL left open (on an existing ledger)."""
    _existing_ledger(store)
    stderr, (state, charged, reserved) = sigkill_mid_stream(sim, store)
    assert state == "unresolved" and charged == reserved > 0
    assert "1 guarded call(s)" in stderr


def test_the_mark_is_left_before_the_ledger_opens(tmp_path: Path) -> None:
    """Every directory of QUOTAWRAP_RUN_DIR gets the process's mark, even when the ledger cannot open."""
    from quotawrap.support.files import ledger_used

    inner, outer = tmp_path / "inner", tmp_path / "outer"
    inner.mkdir()
    outer.mkdir()
    script = (
        "from quotawrap.ledger import open_ledger\n"
        "try:\n    open_ledger('sqlite:////nonexistent/dir/x')\nexcept Exception:\n    pass\n"
    )
    env = {**os.environ, "QUOTAWRAP_RUN_DIR": os.pathsep.join([str(inner), str(outer)])}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    assert ledger_used(str(inner)) and ledger_used(str(outer))
    assert not ledger_used(str(tmp_path))


@pytest.mark.parametrize("damage", ["newer schema", "garbage"])
def test_a_bad_existing_ledger_still_stops_the_run_before_the_child(tmp_path: Path, store: str, damage: str) -> None:
    _existing_ledger(store)
    path = store.removeprefix("sqlite:///")
    if damage == "newer schema":
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema'")
    else:
        with open(path, "r+b") as handle:
            handle.write(b"this is no database header")
    ran = tmp_path / "ran"
    result = run_cli("--store", store, "--", sys.executable, "-c", f"open({str(ran)!r}, 'w')")
    assert result.returncode == 4, result.stderr
    assert not ran.exists()
