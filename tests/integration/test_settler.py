"""The background settler through the real `quotawrap` CLI: queued settles land at a normal exit,
and a SIGKILL with settles still queued leaves their holds charged whole (never under)."""

from __future__ import annotations

import os
import signal
import subprocess

from quotawrap.ledger.sqlite.file import EVERY_CALL
from quotawrap.simulator import ArkSimulator
from tests.conftest import child, ledger_rows, run_quotawrap, start_cli

CALLS = 6
# Each call holds the seed's 50,000 tokens for an open thinking budget (no usage has landed to learn from): under
# the default 2M cap an advance would be 1/64 of the room, less than one more call, and none is taken.
_ROOM_FOR_ADVANCES = ("--daily-cap", "1000000000", "--usage-wall", "1000000000")


def test_normal_exit_lands_every_queued_settle(sim: ArkSimulator, store: str) -> None:
    """Six settles still queued when the program ends: the exit flush lands each at its billed usage."""
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url],
        child("queued_settles.py", "exit"),
        env={"SIM_URL": sim.url, "CALLS": str(CALLS)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2] == str(CALLS)  # every settle was still queued at the end
    states = ledger_rows(store, "SELECT state, COUNT(*), SUM(charged) FROM calls GROUP BY state")
    assert states == [("settled", CALLS, sim.billed_total())]


def _wrapper_with_queued_settles(sim: ArkSimulator, store: str) -> tuple[subprocess.Popen[str], int]:
    """A running wrapper whose child has made its calls and holds every settle queued: (wrapper, child pid)."""
    proc = start_cli(
        "--store",
        store,
        "--base-url",
        sim.url,
        *_ROOM_FOR_ADVANCES,
        "--",
        *child("queued_settles.py", "wait"),
        env={"SIM_URL": sim.url, "CALLS": str(CALLS)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("QUEUED"), proc.stderr.read() if proc.stderr else line
    _, pid, pending, drawn = line.split()
    assert int(pending) == CALLS
    # calls drawn from an advance (quotawrap.admission.advances): all but the first, which may have come before the
    # wrapper's socket was there (it reserved alone then)
    assert int(drawn) >= CALLS - 1
    return proc, int(pid)


def test_sigkill_with_queued_settles_charges_their_holds(sim: ArkSimulator, store: str) -> None:
    """SIGKILL while six settles are queued: the wrapper charges each hold whole, as unresolved (sound)."""
    proc, pid = _wrapper_with_queued_settles(sim, store)
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, stderr
    rows = ledger_rows(store, "SELECT state, COUNT(*), SUM(charged), SUM(reserved) FROM calls GROUP BY state")
    assert len(rows) == 1
    state, count, charged, reserved = rows[0]
    assert (state, count) == ("unresolved", CALLS)
    assert charged == reserved
    assert isinstance(charged, int) and charged >= sim.billed_total() > 0


def test_ctrl_c_lands_every_queued_settle(sim: ArkSimulator, store: str) -> None:
    """SIGINT (KeyboardInterrupt) while six settles are queued: the exit flush still lands them exactly."""
    proc, pid = _wrapper_with_queued_settles(sim, store)
    os.kill(pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in stderr
    states = ledger_rows(store, "SELECT state, COUNT(*), SUM(charged) FROM calls GROUP BY state")
    assert states == [("settled", CALLS, sim.billed_total())]


def test_a_stream_left_open_at_exit_settles_and_the_child_ends(sim: ArkSimulator, store: str) -> None:
    """The interpreter's last collection closes the stream: its settle lands then, and the child exits
    (a settler thread started that late never runs, which hung the child forever)."""
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url], child("stream_left_open.py"), env={"SIM_URL": sim.url}, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "LEFT OPEN" in result.stdout
    (held,) = ledger_rows(store, f"SELECT COUNT(*) FROM {EVERY_CALL} WHERE state = 'held'")[0]
    assert held == 0


def test_a_child_killed_after_its_calls_has_them_landed_by_the_wrapper(sim: ArkSimulator, store: str) -> None:
    """The child hands each settle to its wrapper: SIGKILLed with its own settler held back, none of
    its settles is queued in it, and the wrapper lands all six exactly (not charged whole)."""
    result = run_quotawrap(
        ["--store", store, "--base-url", sim.url, *_ROOM_FOR_ADVANCES],
        child("queued_settles.py", "relayed"),
        env={"SIM_URL": sim.url, "CALLS": str(CALLS)},
    )
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    _, _, pending, drawn = result.stdout.split()
    assert pending == "0"  # nothing queued in the child: the wrapper has them
    # its calls were drawn from an advance it never gave back: each is exact all the same, the rest released
    assert int(drawn) >= CALLS - 1
    states = ledger_rows(store, "SELECT state, COUNT(*), SUM(charged) FROM calls GROUP BY state")
    assert states == [("settled", CALLS, sim.billed_total())]
    assert ledger_rows(store, "SELECT COUNT(*) FROM holds") == [(0,)]
