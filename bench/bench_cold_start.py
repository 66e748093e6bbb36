"""Output bounds: a cold start's cost, and what each --reasoning-reserve policy trades under a tight cap.

    python bench/bench_cold_start.py [--rounds 3] [--compare before=DIR] [--parts cold,policies]

The bundled simulator (``quotawrap simulate``) answers each call after 1 s, in its own process. An agent
on the real ``openai`` SDK sends ``--calls`` (20) chat calls at once from threads and prints their wall time
(the first call's start to the last one's end), plain (``python agent.py``) and guarded (``quotawrap run``).

* ``cold``: calls that may think and set no output bound (the guard adds its own), from a fresh SQLite
  ledger each run, under ``--cap-tokens`` 200,000, at least 100 times what the calls use (the run prints
  the ratio). Target: guarded at most 1.2 x plain. Before the fix, a model without history was bounded at
  50,000 a call and concurrent first calls did not wait for the history read: 3 fit at once, 17 waited.
* ``policies``: calls that set ``max_tokens`` 512 and reason 1,000 to 9,500 tokens (``x-sim-reasoning-tokens``),
  to a model whose documented reasoning ceiling is 32,768, under a cap (250,000) that holds their bill
  but not many of their worst cases at once: per ``--reasoning-reserve`` policy the wall time, the calls
  that waited, the calls the guard's bound cut short, and the tokens billed past a hold (sum over calls
  of charged - reserved where positive, from the ledger).

``--compare before=DIR`` runs another checkout's guard in the same rounds (``cold`` only: an older
checkout has no policies). Rounds are interleaved; medians are printed, with the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from _machine import load_average, machine_line  # bench/ is the script's directory
from bench_agent_overhead import simulator as agent_simulator

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.2
COLD_CAP = 200_000
POLICY_CAP = 250_000
COLD_MODEL = "deepseek-v4-flash"
POLICY_MODEL = "doubao-seed-1-6-251015"  # reasoning ceiling 32,768 (quotawrap/model_limits.py)

AGENT = r"""
import json, sys, threading, time
import openai

base_url, calls, model, max_tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
client = openai.OpenAI(base_url=base_url, api_key="sk-bench-not-a-key", max_retries=0, timeout=600)
done = {}


def one(i):
    kwargs = {"model": model, "messages": [{"role": "user", "content": f"问题 {i}: 彩虹有几种颜色？"}]}
    headers = {}
    if max_tokens:
        kwargs["max_tokens"] = max_tokens
        headers["x-sim-reasoning-tokens"] = str(1_000 + (i * 7919) % 8_501)
    try:
        client.chat.completions.create(**kwargs, extra_headers=headers)
        done[i] = 200
    except openai.APIStatusError as exc:
        done[i] = exc.status_code


threads = [threading.Thread(target=one, args=(i,)) for i in range(calls)]
start = time.perf_counter()
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(json.dumps({"wall_s": time.perf_counter() - start, "statuses": sorted(done.values())}))
"""


@contextlib.contextmanager
def simulator(reasoning: int) -> Iterator[str]:
    """One-second calls that think ``reasoning`` tokens."""
    with agent_simulator("--latency", "1", "--reply-tokens", "20", "--reasoning-tokens", str(reasoning)) as url:
        yield url


def run(
    code: Path, agent: Path, sim_url: str, calls: int, model: str, max_tokens: int, guard: list[str] | None
) -> tuple[dict, dict | None, list[tuple[int, int]]]:
    """The agent's result, the run's report (guarded) and the ledger's (reserved, charged) per call."""
    tmp = Path(tempfile.mkdtemp(prefix="quotawrap-cold-"))
    store = tmp / "ledger.sqlite3"
    report = tmp / "report.json"
    prefix: list[str] = []
    if guard is not None:
        prefix = [sys.executable, "-m", "quotawrap", "run", "--quiet", "--store", f"sqlite:///{store}"]
        prefix += ["--base-url", sim_url, "--report-json", str(report), *guard, "--"]
    argv = [*prefix, sys.executable, str(agent), sim_url, str(calls), model, str(max_tokens)]
    env = {**os.environ, "PYTHONPATH": str(code), "XDG_STATE_HOME": str(tmp / "state")}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, cwd=code, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])}...: exit {done.returncode}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if guard is None:
        return result, None, []
    with contextlib.closing(sqlite3.connect(store)) as conn:
        rows = conn.execute("SELECT reserved, charged FROM calls WHERE state != 'blocked'").fetchall()
    return result, json.loads(report.read_text()), rows


def cold(args: argparse.Namespace, checkouts: dict[str, Path], agent: Path) -> None:
    print(
        f"\ncold start: {args.calls} calls at once, 1 s each, no output bound, --cap-tokens {COLD_CAP:,}, fresh ledger"
    )
    walls: dict[str, list[float]] = {"plain": [], **{name: [] for name in checkouts}}
    waited: dict[str, list[int]] = {name: [] for name in checkouts}
    used: list[int] = []
    with simulator(reasoning=50) as sim_url:
        for index in range(args.rounds):
            names = ["plain", *checkouts]
            for name in names[index % len(names) :] + names[: index % len(names)]:
                code = REPO_ROOT if name == "plain" else checkouts[name]
                guard = None if name == "plain" else ["--cap-tokens", str(COLD_CAP)]
                result, report, _ = run(code, agent, sim_url, args.calls, COLD_MODEL, 0, guard)
                assert result["statuses"] == [200] * args.calls, result
                walls[name].append(result["wall_s"])
                if report is not None:
                    waited[name].append(report["waits"]["waited_calls"])
                    used.append(report["totals"]["settled_tokens"])
            print(f"  round {index + 1}/{args.rounds} done, load {load_average()}", flush=True)
    plain = statistics.median(walls["plain"])
    use = max(used)
    print(f"  the calls used {use:,} tokens: the cap is {COLD_CAP / use:,.0f} x their use")
    print(f"  {'':<22} {'wall s (median)':>16} {'x plain':>8} {'waited calls':>13}")
    print(f"  {'plain':<22} {plain:>16.2f} {1.0:>8.2f} {'':>13}")
    for name in checkouts:
        wall = statistics.median(walls[name])
        verdict = "" if name != "guarded" else ("  met" if wall / plain <= TARGET else f"  MISSED (target {TARGET})")
        print(f"  {name:<22} {wall:>16.2f} {wall / plain:>8.2f} {statistics.median(waited[name]):>13}{verdict}")


def policies(args: argparse.Namespace, agent: Path) -> None:
    print(
        f"\nthe reasoning reserve: {args.calls} calls at once, 1 s each, max_tokens 512, reasoning 1,000-9,500,"
        f" {POLICY_MODEL} (ceiling 32,768), --cap-tokens {POLICY_CAP:,}"
    )
    cells: dict[str, dict[str, list[float]]] = {}
    with simulator(reasoning=0) as sim_url:
        plain: list[float] = []
        for index in range(args.rounds):
            result, _, _ = run(REPO_ROOT, agent, sim_url, args.calls, POLICY_MODEL, 512, None)
            plain.append(result["wall_s"])
            for policy in ("ceiling", "learned", "cut"):
                guard = ["--cap-tokens", str(POLICY_CAP), "--reasoning-reserve", policy]
                result, report, rows = run(REPO_ROOT, agent, sim_url, args.calls, POLICY_MODEL, 512, guard)
                assert report is not None
                cell = cells.setdefault(policy, {})
                for key, value in (
                    ("wall", result["wall_s"]),
                    ("answered", result["statuses"].count(200)),
                    ("waited", report["waits"]["waited_calls"]),
                    ("cut", report["totals"]["cut_by_bound_calls"]),
                    ("past", sum(max(0, charged - reserved) for reserved, charged in rows)),
                    ("overshoot", sum(1 for reserved, charged in rows if charged > reserved)),
                    ("billed", report["totals"]["settled_tokens"]),
                ):
                    cell.setdefault(key, []).append(value)
            print(f"  round {index + 1}/{args.rounds} done, load {load_average()}", flush=True)
    print(f"  plain: {statistics.median(plain):.2f} s (median)")
    header = ("policy", "wall s", "answered", "waited", "cut", "overshoot", "billed past holds", "billed")
    print("  " + f"{header[0]:<9}" + "".join(f"{title:>19}" for title in header[1:]))
    for policy, cell in cells.items():
        values = [statistics.median(cell[key]) for key in ("wall", "answered", "waited", "cut", "overshoot")]
        values += [statistics.median(cell["past"]), statistics.median(cell["billed"])]
        print(f"  {policy:<9}{values[0]:>19.2f}" + "".join(f"{int(value):>19,}" for value in values[1:]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--calls", type=int, default=20, help="calls sent at once (default 20)")
    parser.add_argument("--parts", default="cold,policies", help="comma-separated: cold, policies")
    parser.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also run the cold start with the quotawrap checkout in DIR (e.g. before=/tmp/base)",
    )
    args = parser.parse_args(argv)
    checkouts = {"guarded": REPO_ROOT} | {
        f"guarded@{name}": Path(path).resolve() for name, path in (entry.split("=", 1) for entry in args.compare)
    }
    print(f"Output bounds: cold start and the reasoning reserve — {machine_line()}")
    print(f"load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="quotawrap-cold-bench-") as tmp:
        agent = Path(tmp) / "agent.py"
        agent.write_text(AGENT)
        parts = [part for part in args.parts.split(",") if part]
        if "cold" in parts:
            cold(args, checkouts, agent)
        if "policies" in parts:
            policies(args, agent)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
