"""Usable share of a cap against concurrency, for an agent that never retries a 429. Asserts nothing.

    python bench/bench_ceiling.py [--cap 100000] [--callers 1 8 32 128]

Each run is the real ``quotawrap`` CLI (defaults, ``--cap-tokens CAP``) over an agent of N threads
(openai SDK, ``max_retries=0``) against the bundled simulator (50 ms to the first byte). Every call
thinks 0-3,000 tokens (varied per call, no ``max_tokens``) and answers 200; a thread calls until
its first 429. Reported per N, with the default ``--wait`` and with ``--wait 0`` (refuse at once):

* used: the simulator's bill / the cap (the bill never exceeds it);
* waited, p50 / p99: calls that waited for room and how long (from the run's summary);
* in-flight 429s: calls refused although settled usage + their reserve fit the cap: they were
  refused only for holds in flight (the false blocks waiting removes; target 0);
* tail 429s: calls refused at the end whose *actual* size would have fit in what the cap had left
  (target 0: a cap's last room below the thinking floor is offered bounded, see admission.plan_output).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import load_average, machine_line

from quotawrap.simulator import serve

REPLY = 200

AGENT = textwrap.dedent(
    r"""
    import json, os, sys, threading
    import openai

    client = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk", max_retries=0)

    def reasoning(i):
        return (i * 7919) % 3001

    def worker(w):
        for n in range(1000):
            i = w * 1000 + n
            try:
                client.chat.completions.create(
                    model="deepseek-v4-flash",
                    messages=[{"role": "user", "content": f"question {i}"}],
                    extra_headers={"x-sim-reasoning-tokens": str(reasoning(i))},
                )
            except openai.RateLimitError as exc:
                message = exc.body.get("message", "") if isinstance(exc.body, dict) else str(exc)
                os.write(1, (json.dumps({"refused": reasoning(i), "message": message}) + "\n").encode())
                return

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(int(sys.argv[1]))]
    for t in threads: t.start()
    for t in threads: t.join()
    """
)


_NUMBERS = re.compile(r"settled ([\d,]+) \+ in flight ([\d,]+) \+ this call ([\d,]+) = [\d,]+ > ([\d,]+)")


def _only_in_flight(message: str) -> bool:
    """The 429 named a hold limit settled usage + this call would have met: only calls in flight were in the way."""
    found = _NUMBERS.search(message)
    if found is None:
        return False
    settled, _, this_call, cap = (int(group.replace(",", "")) for group in found.groups())
    return settled + this_call <= cap


def run(callers: int, cap: int, wait: str | None, workdir: Path) -> dict[str, object]:
    agent = workdir / "agent.py"
    agent.write_text(AGENT)
    store = f"sqlite:///{workdir / f'ledger-{callers}-{wait}.sqlite3'}"
    report = workdir / "report.json"
    with serve() as sim:
        sim.configure(latency_s=0.05, reply_tokens=REPLY, tokens_per_chunk=200)
        args = [sys.executable, "-m", "quotawrap", "--store", store, "--base-url", sim.url, "--cap-tokens", str(cap)]
        args += ["--report-json", str(report), "--quiet"]
        if wait is not None:
            args += ["--wait", wait]
        proc = subprocess.run(
            [*args, "--", sys.executable, str(agent), str(callers)],
            env={**os.environ, "SIM_URL": sim.url},
            capture_output=True,
            text=True,
            timeout=1800,
        )
        billed = sim.billed_total()
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    summary = json.loads(report.read_text())
    left = cap - billed
    # a refused call's whole size: its prompt (~12 tokens) + reasoning + the answer
    refused = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    tail_fits = sum(1 for r in refused if 12 + r["refused"] + REPLY <= left)
    in_flight = sum(1 for r in refused if _only_in_flight(r["message"]))
    waits = summary["waits"]
    return {
        "used": billed / cap,
        "waited": waits["waited_calls"],
        "p50": waits["wait_p50_s"],
        "p99": waits["wait_p99_s"],
        "in_flight": in_flight,
        "tail": tail_fits,
        "calls": summary["totals"]["calls"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", type=int, default=100_000)
    parser.add_argument("--callers", type=int, nargs="*", default=[1, 8, 32, 128])
    args = parser.parse_args()
    print(f"machine: {machine_line()}; load {load_average()}")
    print(f"cap {args.cap:,} tokens; calls think 0-3,000 and answer {REPLY}; 50 ms to first byte")
    head = f"{'callers':>7} {'wait':>8} {'calls':>6} {'used':>6} {'waited':>7} {'p50 s':>7} {'p99 s':>7}"
    print(head + f" {'in-flight 429':>13} {'tail 429':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for callers in args.callers:
            for wait in (None, "0"):
                row = run(callers, args.cap, wait, Path(tmp))
                p50 = "-" if row["p50"] is None else f"{row['p50']:.2f}"
                p99 = "-" if row["p99"] is None else f"{row['p99']:.2f}"
                print(
                    f"{callers:>7} {'default' if wait is None else wait:>8} {row['calls']:>6} {row['used']:>6.1%}"
                    f" {row['waited']:>7} {p50:>7} {p99:>7} {row['in_flight']:>13} {row['tail']:>8}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
