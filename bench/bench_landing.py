"""What the wrapper's relay pays to land a guarded child's drawn calls in SQLite, and the WAL it writes.

    python bench/bench_landing.py [--calls 100000] [--ids time,random]

The relay lands a child's settles in batches, each call drawn from an advance of ADVANCE_CALLS (admission/advances.py):
here each batch is an advance reserved, then its 16 calls' settles landed in one ``settle_many``, into one
ledger that grows to ``--calls`` calls. It prints the median µs per settle landed in each quarter of the run
(does it slow as the ledger grows?) and the WAL bytes written per call once the ledger holds 32k calls
(checkpoints off while counted). ``--ids``: hold ids as ``new_hold_id`` makes them (time: led by the time, since
session 27) or 128 random bits (random: before), each in a ledger of its own. Not pass/fail.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _machine import load_average, machine_line  # bench/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quotawrap.admission.advances import ADVANCE_CALLS as BATCH  # calls per advance
from quotawrap.core.quota import Limit, beijing_day
from quotawrap.core.usage import Usage
from quotawrap.ledger.base import ADVANCE, Drawn, HoldRequest, Settle, new_hold_id
from quotawrap.ledger.sqlite.ledger import SQLiteLedger

LIMITS = [Limit("daily_cap", "model_day", 10**15)]
WAL_AFTER = 32_000  # calls in the ledger before the WAL is counted
WAL_CALLS = 8_000
IDS: dict[str, Callable[[], str]] = {"time": new_hold_id, "random": lambda: os.urandom(16).hex()}


def land_batch(ledger: SQLiteLedger, new_id: Callable[[], str], day: str) -> float:
    """An advance reserved, its BATCH calls' settles landed at once; seconds per settle landed."""
    now = time.time()
    advance = HoldRequest(
        run_id="bench", model="bench-model", day=day, reserve=BATCH * 1000, endpoint=ADVANCE,
        pid=os.getpid(), host="bench", expires_at=now + 600, advance=True, hold_id=new_id(),
    )  # fmt: skip
    assert ledger.reserve(advance, lambda _snapshot: LIMITS).held
    drawn = Drawn(advance.hold_id, 1000, 0, "/api/v3/chat/completions", None, now, now + 600)
    settles = [Settle(new_id(), "settle", Usage(100, 200, 300), 0.1, None, None, drawn) for _ in range(BATCH)]
    start = time.perf_counter()
    ledger.settle_many(settles)
    return (time.perf_counter() - start) / BATCH


def run(kind: str, calls: int) -> None:
    new_id = IDS[kind]
    day = beijing_day(time.time())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.sqlite3"
        ledger = SQLiteLedger(path)
        times = [land_batch(ledger, new_id, day) for _ in range(calls // BATCH)]
        quarters = [times[q * len(times) // 4 : (q + 1) * len(times) // 4] for q in range(4)]
        shown = " / ".join(f"{statistics.median(q) * 1e6:.1f}" for q in quarters)
        print(f"  {kind:7} ids: landing µs per settle, by quarter of {calls:,} calls: {shown}")
        ledger.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.sqlite3"
        ledger = SQLiteLedger(path)
        for _ in range(WAL_AFTER // BATCH):
            land_batch(ledger, new_id, day)
        conn = ledger._conn()  # this thread's: the one that lands
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        for _ in range(WAL_CALLS // BATCH):
            land_batch(ledger, new_id, day)
        wal = os.path.getsize(f"{path}-wal") / WAL_CALLS
        print(f"  {kind:7} ids: WAL written per call (the advance's reserve included): {wal / 1024:.1f} KiB")
        ledger.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000, help="calls landed per kind of id (default 100,000)")
    parser.add_argument("--ids", default="time,random", help="comma-separated: time (new_hold_id), random (before)")
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.ids.split(",") if kind.strip()]
    unknown = set(kinds) - set(IDS)
    if unknown:
        parser.error(f"unknown --ids: {', '.join(sorted(unknown))}")
    print(f"Landing drawn calls in SQLite — {machine_line()}; load {load_average()}")
    for kind in kinds:
        run(kind, args.calls)
    print(f"load at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
