"""A simulated Beijing day against the simulator's lagging billing: v6 (lag 0) vs the lag-aware limit.

    python bench/day_simulation.py [--seed N] [--jobs N]
    python bench/day_simulation.py --sweep 20      # the headline scenario on 20 seeds

Every component is the real one: the Ark simulator answers chat calls over loopback HTTP, an
httpx client patched by quotawrap's adapter sends them through a real ``Guard`` and a real SQLite
ledger, and ``SyncLoop.tick()`` reads the simulator's ListResourcePackages through the official
billing SDK on the wrapper's cadence (30 min, 5 min when low, at once after 100k). Only the clock
is simulated: one object, advanced in 10-second steps (the wrapper's sync check) and to each call's
time, is handed to the simulator, the ledger, the guard and the sync loop. Nothing sleeps, so a day
takes seconds and the numbers depend on the seed only, not on the machine or on ``--jobs``.

Billing shows a token Δ after it is billed (``SimConfig.balance_lag_s``; §4.2 measured 14 min).
Each scenario runs twice on identical traffic, each time with a fresh simulator and a fresh ledger:
``balance_lag=0`` (v6 exactly) and the shipped lag-aware default (1800 s).

Measured per run (docs/day-simulation.md explains each column): real consumption (the simulator's
bill); overspend, the tokens no free package covered (the bill replayed FIFO as the simulator
draws it; with no package expiring that day it is ``max(0, consumption - B0)``); the usable pool
``min(2M, B0 + granted - expired - SMALL_BUFFER)`` and the share of it used for free; the most the limit in
force ever stood above the one the true pool allows; blocked calls, and how many of them the same
limits would have admitted had billing shown the truth at once ("early").
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import random
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing

from quotawrap.core import quota  # noqa: E402

__all__ = [
    "DEFAULT_SEED",
    "HEADLINE",
    "SCENARIOS",
    "Call",
    "PackagePlan",
    "RunResult",
    "Scenario",
    "SimClock",
    "format_table",
    "free_and_paid",
    "free_left",
    "ideal_admits",
    "main",
    "make_traffic",
    "run_day",
    "run_variant",
    "sweep",
    "true_pool",
]

MODEL = "deepseek-v4-flash-ga-260731"  # the seed's model (§5)
DAY_START = datetime(2026, 8, 14, tzinfo=quota.BEIJING).timestamp()  # a Beijing midnight
HOUR_S = 3600.0
TICK_S = 10.0  # the wrapper's sync_check: how often the background loop asks whether a sync is due
DEFAULT_SEED = 20260814
V6_LAG_S = 0.0
LAG_AWARE_S = quota.QuotaSettings().balance_lag_s  # the shipped default
VARIANTS: tuple[tuple[str, float], ...] = (("v6 (lag 0)", V6_LAG_S), ("lag-aware", LAG_AWARE_S))
_VOCABULARY = (
    "quota",
    "balance",
    "token",
    "model",
    "usage",
    "burst",
    "guard",
    "ledger",
    "agent",
    "tool",
    "answer",
    "review",
)


class SimClock:
    """The one clock of a simulated day: monotone, moved only by the driver."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"the simulated clock only moves forward ({t} < {self.now})")
        self.now = t


@dataclass(frozen=True)
class PackagePlan:
    """A free package, its times in hours from the simulated day's Beijing midnight."""

    total: int
    effective_h: float
    expiry_h: float


@dataclass(frozen=True)
class Scenario:
    name: str
    packages: tuple[PackagePlan, ...]
    delay_s: float  # Δ: how long billing takes to show a token (SimConfig.balance_lag_s)
    note: str = ""

    @property
    def b0(self) -> int:
        """The true free pool at midnight: packages in force then."""
        return sum(p.total for p in self.packages if p.effective_h <= 0 < p.expiry_h)

    @property
    def granted(self) -> int:
        """Packages that take effect during the day (the grant of yesterday's usage, §1.1)."""
        return sum(p.total for p in self.packages if 0 < p.effective_h < 24)


_KEPT = PackagePlan(1_500_000, -7 * 24, 23 * 24)  # a 1.5M pool that outlives the day

SCENARIOS: tuple[Scenario, ...] = (
    Scenario("B0 1.5M, Δ 14 min", (_KEPT,), 14 * 60, "the headline: B0 < 2M, §4.2's delay"),
    Scenario("B0 1.5M, Δ 25 min", (_KEPT,), 25 * 60, "slower billing, still within the 30 min lag"),
    Scenario(
        "B0 2,242,178, Δ 14 min",
        (PackagePlan(2_242_178, -7 * 24, 23 * 24),),
        14 * 60,
        "§4.2's day: the 2M cap binds",
    ),
    Scenario(
        "B0 1.8M, 900k expire 12:00, Δ 14 min",
        (PackagePlan(900_000, -30 * 24 + 12, 12), PackagePlan(900_000, -24, 29 * 24)),
        14 * 60,
        "a package expires mid-day; another stays",
    ),
    Scenario("B0 1.5M, Δ 40 min", (_KEPT,), 40 * 60, "billing slower than the lag: outside assumption 1"),
    Scenario(
        "B0 1.5M, all expire 15:00, Δ 14 min",
        (PackagePlan(1_500_000, -30 * 24 + 15, 15),),
        14 * 60,
        "the model's only package expires: the sync finds no package and records nothing",
    ),
    Scenario(
        "150k at 0:00, 1.2M grant 09:30, Δ 14 min",
        (PackagePlan(150_000, -29 * 24, 24), PackagePlan(1_200_000, 9.5, 9.5 + 30 * 24)),
        14 * 60,
        "the 0:00-to-grant window: yesterday's return arrives late in the morning",
    ),
)
HEADLINE = SCENARIOS[0]


# -- traffic ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One chat call: the simulator answers ``min(reply_tokens, max_tokens)`` after the prompt."""

    at_s: float  # seconds after midnight
    prompt_words: int
    max_tokens: int
    reply_tokens: int
    stream: bool
    burst: bool


@dataclass(frozen=True)
class TrafficShape:
    night_gap_s: float = 40 * 60.0  # mean gap between calls, 00:00-07:00
    day_gap_s: float = 6 * 60.0  # mean gap between calls, 07:00-24:00
    bursts: int = 6
    burst_window_h: tuple[float, float] = (9.0, 22.0)  # bursts start in this window
    burst_tokens: tuple[int, int] = (150_000, 400_000)  # §4.2: 149,616 in 14 minutes
    burst_minutes: tuple[float, float] = (10.0, 15.0)
    stream_share: float = 0.3


def _quiet_call(rng: random.Random, at_s: float, stream_share: float) -> Call:
    max_tokens = rng.choice((1024, 2048, 4096, 8192))
    return Call(
        at_s,
        rng.randint(50, 800),
        max_tokens,
        rng.randint(max_tokens // 5, max_tokens),
        rng.random() < stream_share,
        burst=False,
    )


def _burst_calls(rng: random.Random, shape: TrafficShape) -> list[Call]:
    start = rng.uniform(*shape.burst_window_h) * HOUR_S
    length = rng.uniform(*shape.burst_minutes) * 60.0
    target = rng.randint(*shape.burst_tokens)
    calls: list[Call] = []
    planned = 0
    while planned < target:
        max_tokens = rng.randint(8_000, 32_000)
        prompt_words = rng.randint(100, 1_500)
        reply = rng.randint(max_tokens * 3 // 5, max_tokens)
        planned += prompt_words + reply  # close enough to size the burst; the bill is exact
        calls.append(
            Call(
                start + rng.uniform(0.0, length),
                prompt_words,
                max_tokens,
                reply,
                rng.random() < shape.stream_share,
                burst=True,
            )
        )
    return calls


def make_traffic(seed: int, shape: TrafficShape = TrafficShape()) -> list[Call]:
    """A day of calls, the same for every scenario and variant of one seed."""
    rng = random.Random(seed)
    calls: list[Call] = []
    t = rng.expovariate(1.0 / shape.night_gap_s)
    while t < 24 * HOUR_S:
        calls.append(_quiet_call(rng, t, shape.stream_share))
        gap = shape.night_gap_s if t < 7 * HOUR_S else shape.day_gap_s
        t += rng.expovariate(1.0 / gap)
    for _ in range(shape.bursts):
        calls.extend(_burst_calls(rng, shape))
    calls.sort(key=lambda call: call.at_s)
    return calls


def _prompt(call: Call, index: int) -> str:
    # Seeded by the call, so both variants send identical bytes.
    rng = random.Random(index * 1_000_003 + call.prompt_words)
    return " ".join(rng.choices(_VOCABULARY, k=call.prompt_words))


# -- what the day cost ------------------------------------------------------------------------------


def _draw(packages: Sequence[Any], bills: Sequence[Any]) -> tuple[list[int], int]:
    """(what is left in each package, tokens no package covered): bills drawn FIFO, as the simulator does."""
    remaining = [p.total for p in packages]
    order = sorted(range(len(packages)), key=lambda i: (packages[i].effective_time, i))
    paid = 0
    for bill in sorted(bills, key=lambda b: b.t):
        owed = bill.total_tokens
        for i in order:
            spec = packages[i]
            if owed and spec.model == bill.model and spec.effective_time <= bill.t < spec.expiry_time:
                take = min(owed, remaining[i])
                remaining[i] -= take
                owed -= take
        paid += owed
    return remaining, paid


def free_and_paid(packages: Sequence[Any], bills: Sequence[Any]) -> tuple[int, int, int]:
    """(paid, expired, free) tokens of the simulated day, with billing settled (no reporting lag).

    Each bill draws FIFO from the packages in force at its time, the simulator's own rule; what
    none covers is billed at the real price (§2). ``expired`` is what was left in packages that
    expired during the day. ``packages`` are ``PackageSpec``s, ``bills`` ``BillRecord``s.
    """
    remaining, paid = _draw(packages, bills)
    day_end = DAY_START + quota.DAY_S
    expired = sum(remaining[i] for i, p in enumerate(packages) if DAY_START < p.expiry_time <= day_end)
    return paid, expired, sum(b.total_tokens for b in bills) - paid


def true_pool(packages: Sequence[Any], bills: Sequence[Any], now: float) -> int:
    """P(now): the packages that have taken effect, less what was left in those that have expired."""
    remaining, _ = _draw(packages, bills)
    return sum(
        p.total - (left if p.expiry_time <= now else 0)
        for left, p in zip(remaining, packages, strict=True)
        if p.effective_time <= now
    )


def free_left(packages: Sequence[Any], bills: Sequence[Any], now: float) -> int:
    """The true free balance at ``now``: what billing would show if it did not lag."""
    remaining, _ = _draw(packages, bills)
    return sum(left for left, p in zip(remaining, packages, strict=True) if p.effective_time <= now < p.expiry_time)


@dataclass
class RunResult:
    scenario: str
    variant: str
    balance_lag_s: float
    delay_s: float
    b0: int
    consumption: int = 0
    overspend: int = 0
    expired: int = 0
    usable_pool: int = 0  # min(daily cap, B0 + granted - expired - small buffer)
    calls: int = 0
    blocked: int = 0
    blocked_early: int = 0  # blocked, but the same limits on a balance without lag would have admitted it
    first_block_s: float = math.inf  # seconds after midnight
    max_excess: int = 0  # the most the limit in force ever stood above min(2M, true pool - S)
    blocked_by: Counter[str] = field(default_factory=Counter)
    syncs: int = 0
    bills: tuple[tuple[float, int], ...] = ()  # (seconds after midnight, tokens) of each billed call

    @property
    def free_used(self) -> int:
        return self.consumption - self.overspend

    @property
    def pool_used(self) -> float:
        """Free tokens used / the usable pool; above 1 means the small buffer was eaten too."""
        return self.free_used / self.usable_pool if self.usable_pool else 0.0


# -- one run ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _billing_credentials() -> Iterator[None]:
    """The billing SDK signs requests; the simulator only checks that a signature is there."""
    added = {
        name: value
        for name, value in (("VOLC_ACCESSKEY", "AKday-simulation"), ("VOLC_SECRETKEY", "SKday-simulation"))
        if not os.environ.get(name)
    }
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _guarded_httpx(guard: Any) -> Iterator[Any]:
    """httpx patched by quotawrap's adapter and routed to ``guard``; both undone afterwards."""
    import httpx

    from quotawrap import intercept
    from quotawrap.intercept import httpx_adapter

    was_patched = bool(getattr(httpx, "_quotawrap_patched", False))
    httpx_adapter.patch(httpx)
    intercept.set_guard(guard)
    try:
        yield httpx
    finally:
        intercept.set_guard(None)
        if not was_patched:
            httpx_adapter.unpatch(httpx)


def _raise(message: str) -> NoReturn:
    raise RuntimeError(f"day simulation: {message}")


def _request_body(call: Call, index: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": _prompt(call, index)}],
        "max_tokens": call.max_tokens,
        "stream": call.stream,
    }


def _send(client: Any, body: dict[str, Any], reply_tokens: int) -> tuple[int, str | None]:
    """(status, the limit that blocked it): the call through the patched client, body read to the end."""
    headers = {"x-sim-reply-tokens": str(reply_tokens)}
    with client.stream("POST", "/chat/completions", json=body, headers=headers) as response:
        response.read()
        return response.status_code, response.headers.get("x-quotawrap-blocked")


def ideal_admits(consumed: int, free: int, reserve: int, now: float, qs: quota.QuotaSettings) -> bool:
    """Whether the same limits and walls would admit the call if billing showed the truth at once.

    The guard's own math fed a snapshot of the true free balance with nothing unsettled: the
    yardstick for "blocked early", i.e. blocked only because the balance reading lags.
    """
    day = quota.beijing_day(now)
    truth = quota.Snapshot(max(0, free), consumed, consumed, now, day, "truth")
    limits = quota.model_day_limits(truth, qs, today=day)  # lagged == usage at sync: exact at any lag
    return quota.verdict(limits, {"model_day": quota.Counters(consumed)}, reserve).allowed


def _limit_excess(
    ledger: Any, packages: Sequence[Any], bills: Sequence[Any], now: float, qs: quota.QuotaSettings
) -> int:
    """How far the limit the guard applies now stands above the one the true pool allows."""
    day = quota.beijing_day(now)
    in_force, _ = quota.effective_limit(ledger.snapshot(MODEL), qs, today=day)
    allowed = max(0, min(qs.daily_cap, true_pool(packages, bills, now) - qs.small_buffer))
    return in_force - allowed


def run_variant(
    scenario: Scenario,
    traffic: Sequence[Call],
    variant: str,
    balance_lag_s: float,
    workdir: Path,
) -> RunResult:
    """One simulated day of ``traffic`` under one setting, with its own simulator and ledger."""
    import httpx

    from quotawrap.admission.guard import Guard
    from quotawrap.books.sync import SyncLoop
    from quotawrap.config.settings import Settings
    from quotawrap.core.estimate import estimate_request
    from quotawrap.ledger.sqlite.ledger import SQLiteLedger
    from quotawrap.simulator import PackageSpec, SimConfig, serve

    clock = SimClock(DAY_START)
    # big stream chunks: on loopback the number of frames, not of tokens, is what costs time
    sim = serve(config=SimConfig(balance_lag_s=scenario.delay_s, tokens_per_chunk=512))
    sim.set_clock(clock)
    packages = [
        PackageSpec(MODEL, p.total, DAY_START + p.effective_h * HOUR_S, DAY_START + p.expiry_h * HOUR_S)
        for p in scenario.packages
    ]
    sim.set_packages(packages)
    ledger = SQLiteLedger(Path(tempfile.mkdtemp(dir=workdir)) / "ledger.sqlite3", clock=clock)
    settings = Settings(
        model=(MODEL,),
        base_url=(sim.url,),
        billing_endpoint=sim.base_url,
        balance_lag=balance_lag_s,
        run_id="day-simulation",
        quiet=True,
    )
    result = RunResult(scenario.name, variant, balance_lag_s, scenario.delay_s, scenario.b0)
    loop = SyncLoop(ledger, settings, clock=clock, on_error=_raise)
    day_end = DAY_START + quota.DAY_S
    try:
        with (
            _billing_credentials(),
            _guarded_httpx(Guard(settings, ledger, clock=clock)),
            httpx.Client(base_url=sim.url, headers={"authorization": "Bearer day-simulation"}) as client,
        ):
            queue = iter(enumerate(traffic))
            upcoming = next(queue, None)
            tick_at = DAY_START
            while tick_at < day_end:
                clock.advance_to(tick_at)
                loop.tick()  # the wrapper's background check: is a sync due (cadence, low balance, burst)?
                while upcoming is not None and DAY_START + upcoming[1].at_s < tick_at + TICK_S:
                    index, call = upcoming
                    upcoming = next(queue, None)
                    clock.advance_to(max(clock.now, DAY_START + call.at_s))
                    body = _request_body(call, index)
                    result.max_excess = max(
                        result.max_excess, _limit_excess(ledger, packages, sim.bills(), clock.now, settings.quota)
                    )
                    status, blocked_by = _send(client, body, call.reply_tokens)
                    result.calls += 1
                    if status == 200:
                        continue
                    if status != 429 or not blocked_by:
                        _raise(f"call {index} at {call.at_s:.0f} s answered {status}")
                    result.blocked += 1
                    result.blocked_by[blocked_by] += 1
                    result.first_block_s = min(result.first_block_s, call.at_s)
                    bills = sim.bills()
                    consumed = sum(b.total_tokens for b in bills)
                    reserve = estimate_request("chat", body).total
                    if ideal_admits(
                        consumed, free_left(packages, bills, clock.now), reserve, clock.now, settings.quota
                    ):
                        result.blocked_early += 1
                tick_at += TICK_S
        result.syncs = len(ledger.sync_history(MODEL, quota.beijing_day(DAY_START)))
        bills = sim.bills()
    finally:
        ledger.close()
        sim.stop()
    result.bills = tuple((b.t - DAY_START, b.total_tokens) for b in bills)
    result.consumption = sum(b.total_tokens for b in bills)
    result.overspend, result.expired, _ = free_and_paid(packages, bills)
    qs = settings.quota
    result.usable_pool = max(0, min(qs.daily_cap, scenario.b0 + scenario.granted - result.expired - qs.small_buffer))
    return result


def run_day(
    seed: int,
    scenarios: Sequence[Scenario] = SCENARIOS,
    variants: Sequence[tuple[str, float]] = VARIANTS,
    *,
    shape: TrafficShape = TrafficShape(),
    jobs: int = 1,
) -> list[RunResult]:
    """Every scenario under every variant, on one seed's traffic, in that order.

    ``jobs`` > 1 runs them in that many processes (each run is independent: its own simulator,
    ledger and clock); the numbers are the same either way.
    """
    traffic = make_traffic(seed, shape)
    runs = [(scenario, variant, lag) for scenario in scenarios for variant, lag in variants]
    with tempfile.TemporaryDirectory(prefix="quotawrap-day-") as tmp:
        if jobs <= 1:
            return [run_variant(scenario, traffic, variant, lag, Path(tmp)) for scenario, variant, lag in runs]
        # spawn, not fork: the parent may hold simulator threads and open ledgers
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = [
                pool.submit(run_variant, scenario, traffic, variant, lag, Path(tmp)) for scenario, variant, lag in runs
            ]
            return [future.result() for future in futures]


# -- output -----------------------------------------------------------------------------------------

_COLUMNS = (
    ("scenario", "<"),
    ("guard", "<"),
    ("consumed", ">"),
    ("overspend", ">"),
    ("usable pool", ">"),
    ("max excess", ">"),
    ("pool used", ">"),
    ("blocked", ">"),
    ("early", ">"),
    ("first block", ">"),
    ("blocked by", "<"),
    ("syncs", ">"),
)


def _clock_time(seconds: float) -> str:
    if math.isinf(seconds):
        return "-"
    minutes = int(seconds // 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _row(result: RunResult) -> tuple[str, ...]:
    return (
        result.scenario,
        result.variant,
        f"{result.consumption:,}",
        f"{result.overspend:,}",
        f"{result.usable_pool:,}",
        f"{result.max_excess:,}",
        f"{result.pool_used:.1%}",
        f"{result.blocked}",
        f"{result.blocked_early}",
        _clock_time(result.first_block_s),
        ", ".join(f"{name} {count}" for name, count in sorted(result.blocked_by.items())) or "-",
        f"{result.syncs}",
    )


def format_table(results: Sequence[RunResult]) -> str:
    """A Markdown table, one row per scenario and variant."""
    rows = [tuple(name for name, _ in _COLUMNS), *(_row(r) for r in results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    aligns = [align for _, align in _COLUMNS]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.ljust(width) if align == "<" else cell.rjust(width)
            for cell, width, align in zip(cells, widths, aligns, strict=True)
        )
        return "| " + " | ".join(padded) + " |"

    rule = "|".join(
        "-" * (width + 1) + ":" if align == ">" else "-" * (width + 2)
        for width, align in zip(widths, aligns, strict=True)
    )
    return "\n".join([line(rows[0]), f"|{rule}|", *(line(row) for row in rows[1:])])


def _traffic_summary(seed: int) -> str:
    traffic = make_traffic(seed)
    bursts = sum(1 for call in traffic if call.burst)
    return f"{len(traffic)} calls ({bursts} in bursts)"


def sweep(first_seed: int, count: int, *, jobs: int = 1) -> str:
    """The headline scenario on ``count`` seeds: one line per seed, then the worst of each column."""
    lines = [
        "| seed | v6 overspend | lag-aware overspend | v6 pool used | lag-aware pool used | lag-aware early blocks |"
    ]
    lines.append("|---:|---:|---:|---:|---:|---:|")
    worst_lag_aware_use = math.inf
    overspent = Counter[str]()
    for seed in range(first_seed, first_seed + count):
        v6, aware = run_day(seed, (HEADLINE,), jobs=jobs)
        overspent.update(r.variant for r in (v6, aware) if r.overspend > 0)
        worst_lag_aware_use = min(worst_lag_aware_use, aware.pool_used)
        lines.append(
            f"| {seed} | {v6.overspend:,} | {aware.overspend:,} | {v6.pool_used:.1%} | {aware.pool_used:.1%}"
            f" | {aware.blocked_early} |"
        )
    lines.append("")
    lines.append(
        f"{count} seeds, {HEADLINE.name}: v6 overspent on {overspent[VARIANTS[0][0]]},"
        f" lag-aware on {overspent[VARIANTS[1][0]]}; lag-aware used at least {worst_lag_aware_use:.1%} of the pool"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="traffic seed: same seed, same table")
    parser.add_argument(
        "--sweep",
        type=int,
        default=0,
        metavar="N",
        help="instead of the table: the headline scenario on seeds SEED .. SEED+N-1",
    )
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes (results do not depend on it)"
    )
    args = parser.parse_args(argv)
    if args.sweep:
        print(sweep(args.seed, args.sweep, jobs=args.jobs))
        return 0
    print(f"seed {args.seed}: {_traffic_summary(args.seed)}; simulated clock, sync check every {TICK_S:g} s")
    print(format_table(run_day(args.seed, jobs=args.jobs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
