"""What work between two calls costs the SDK's own next call: the part of a guard's overhead that is not its code.

    python bench/bench_neighbour_cost.py [--rounds 6] [--calls 1500] [--work 1,3]

The same plain agent as bench_agent_overhead.py (the real ``openai`` SDK, sequential small chat calls to the
bundled simulator, no guard) runs with and without unrelated work between its calls: a SQLite write
transaction (WAL, ``synchronous=NORMAL``, as the ledger), ``json.loads`` of a ~1 KB object and a hundred dict
entries, ``--work`` times over, about what a guard's reserve, estimate and bookkeeping touch. The agent times
each ``create()`` call's own thread CPU apart from the work's. Without a guard in the way, what the call gains
from the work is what the work left in the caches and branch predictors for the SDK to load again.

Prints, per work size: the call's CPU with and without the work (median of the per-round medians), the
work's own CPU, and their ratio: how many µs each µs of work between calls adds to the SDK's call. A guard
whose own code costs X µs a call adds about X times (1 + that ratio) to the whole process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from _machine import load_average, machine_line  # bench/ is the script's directory
from bench_agent_overhead import MODEL, REPO_ROOT, simulator

AGENT = r"""
import json, os, sqlite3, sys, time
import openai

base_url, calls, warmup, work, db_path, model, kind = sys.argv[1:8]
calls, warmup, work = int(calls), int(warmup), int(work)
client = openai.OpenAI(base_url=base_url, api_key="sk-bench-not-a-key", max_retries=0)
messages = [{"role": "user", "content": "彩虹有几种颜色？Answer in one short sentence."}]
db = sqlite3.connect(db_path, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("PRAGMA synchronous=NORMAL")  # as the ledger: no sync per commit
db.execute("CREATE TABLE IF NOT EXISTS t (k TEXT PRIMARY KEY, v INTEGER)")
doc = json.dumps({"items": [{"n": i, "text": str(i) * 5} for i in range(40)]})


def neighbour():
    for _ in range(work):
        if kind in ("both", "sqlite"):
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT OR REPLACE INTO t VALUES (?, ?)", (os.urandom(4).hex(), 1))
            db.execute("SELECT k, v FROM t LIMIT 5").fetchall()
            db.execute("COMMIT")
        if kind in ("both", "python"):
            json.loads(doc)
            sorted({str(i): i for i in range(100)}.items())
        if kind == "syscalls":
            for _ in range(20):
                os.getppid()


def once():
    client.chat.completions.create(model=model, messages=messages, max_tokens=64).choices[0].message.content


for _ in range(warmup):
    once()
    neighbour()
call_ns, work_ns = [], []
for _ in range(calls):
    start = time.thread_time_ns()
    neighbour()
    middle = time.thread_time_ns()
    once()
    work_ns.append(middle - start)
    call_ns.append(time.thread_time_ns() - middle)
print(json.dumps({"call": call_ns, "work": work_ns}))
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--calls", type=int, default=1500, help="timed calls per agent run (default 1500)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls first in each agent run")
    parser.add_argument("--work", default="1,3", help="comma-separated work sizes to run beside none (default 1,3)")
    parser.add_argument(
        "--kind",
        choices=("both", "sqlite", "python", "syscalls"),
        default="both",
        help="the work: a SQLite transaction and Python (default), either alone, or 20 bare system calls",
    )
    args = parser.parse_args(argv)
    sizes = [0, *(int(size) for size in args.work.split(",") if size)]

    print(f"What work between calls costs the SDK's next call — {machine_line()}")
    print(f"work: {args.kind}; {args.rounds} rounds x {args.calls} calls per cell, interleaved; load {load_average()}")
    call_medians: dict[int, list[float]] = {size: [] for size in sizes}
    work_medians: dict[int, list[float]] = {size: [] for size in sizes}
    with tempfile.TemporaryDirectory(prefix="quotawrap-neighbour-bench-") as tmp, simulator() as sim_url:
        agent = Path(tmp) / "agent.py"
        agent.write_text(AGENT)
        for round_index in range(args.rounds):
            order = sizes[round_index % len(sizes) :] + sizes[: round_index % len(sizes)]
            for size in order:
                argv = [sys.executable, str(agent), sim_url, str(args.calls), str(args.warmup), str(size)]
                argv += [str(Path(tmp) / f"work{size}.sqlite3"), MODEL, args.kind]
                done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                call_medians[size].append(statistics.median(result["call"]) / 1e3)
                work_medians[size].append(statistics.median(result["work"]) / 1e3)
            print(f"  round {round_index + 1}/{args.rounds} done, load {load_average()}", flush=True)
    base = statistics.median(call_medians[0])
    print()
    print(f"{'work':>5} {'call CPU µs':>12} {'+call µs':>9} {'work CPU µs':>12} {'+call per µs of work':>21}")
    for size in sizes:
        call = statistics.median(call_medians[size])
        work = statistics.median(work_medians[size])
        added = call - base
        if not size:
            print(f"{size:>5} {call:>12.0f} {'':>9} {work:>12.0f}")
            continue
        per_round = [with_work - alone for with_work, alone in zip(call_medians[size], call_medians[0], strict=True)]
        spread = f"  (per round {min(per_round):+.0f} to {max(per_round):+.0f})"
        print(f"{size:>5} {call:>12.0f} {added:>+9.0f} {work:>12.0f} {added / work:>21.2f}{spread}")
    print(f"load after {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
