"""The day simulation made harder: reasoning tokens, batch settlement, grants, calls in flight together.

    python bench/day_simulation_stress.py [--seed N]

``bench/day_simulation.py`` settles each call the instant it is sent, against a billing view that
lags by a fixed Δ, with the whole pool there at midnight. Production is rougher, and this variant
adds each roughness on the same seeded traffic:

* **reasoning tokens**: most calls leave thinking on and the simulator thinks 100-6,000 tokens
  (2 % of calls: 15,000-30,000). ``max_tokens`` does not bound reasoning, so a call might bill more
  than its hold (overshoot, §7.6); the guard now bounds it with ``max_completion_tokens`` (issue 9),
  so none does; a third of the calls turn thinking off;
* **calls in flight together**: a call is reserved when it starts and billed and settled when it
  ends, ``(reasoning + answer) / 40`` seconds later; other calls start in between, so bursts hold
  many reservations at once;
* **batch settlement**: billing settles in batches every 15 minutes, 5 minutes after the fact, so
  the lag saws between 5 and 20 minutes (``_billing.settled_until``; §4.2 "periodic convergence");
* **grants during the day**: 150k left at midnight; yesterday's return (1.2M) arrives at 09:30 and
  a 300k package at 15:00.

The guard, ledger, sync loop, simulator and billing SDK are the real ones, on one simulated clock.
What is measured: the day's bill, the tokens billed beyond the free packages (FIFO replay), calls
that overshot their hold, the most calls in flight at once, blocked calls.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import json
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _load_day() -> Any:
    spec = importlib.util.spec_from_file_location("day_simulation", HERE / "day_simulation.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return sys.modules[spec.name]


day = _load_day()

__all__ = ["STRESS", "StressResult", "main", "run_stress"]

TOKENS_PER_S = 40.0  # generation speed: how long a call stays in flight
SETTLE_DELAY_S = 5 * 60.0
SETTLE_EVERY_S = 15 * 60.0
STRESS = day.Scenario(
    "150k at 0:00, grants 09:30 + 15:00, batch billing",
    (
        day.PackagePlan(150_000, -29 * 24, 24),
        day.PackagePlan(1_200_000, 9.5, 9.5 + 30 * 24),
        day.PackagePlan(300_000, 15.0, 15.0 + 30 * 24),
    ),
    SETTLE_DELAY_S,
    "reasoning, concurrency, batch settlement and grants together",
)


@dataclass
class StressResult:
    variant: str
    consumption: int = 0
    overspend: int = 0
    calls: int = 0
    blocked: int = 0
    overshoot_calls: int = 0
    overshoot_tokens: int = 0
    max_in_flight: int = 0
    reasoning_tokens: int = 0
    usable_pool: int = 0  # min(daily cap, every package of the day - small buffer): nothing expires today

    @property
    def pool_used(self) -> float:
        return (self.consumption - self.overspend) / self.usable_pool if self.usable_pool else 0.0


@dataclass(frozen=True)
class _Shape:
    """One call's thinking and its time in flight, seeded by the call."""

    thinking: bool
    reasoning: int

    @classmethod
    def of(cls, call: Any, index: int) -> _Shape:
        rng = random.Random(index * 7_919 + call.max_tokens)
        if rng.random() < 1 / 3:
            return cls(False, 0)
        big = rng.random() < 0.02
        return cls(True, rng.randint(15_000, 30_000) if big else rng.randint(100, 6_000))


def _body(call: Any, index: int, shape: _Shape) -> dict[str, Any]:
    body: dict[str, Any] = day._request_body(call, index)
    if not shape.thinking:
        body["thinking"] = {"type": "disabled"}
    return body


def _finish(client: Any, url: str, pending: Any, call: Any, shape: _Shape) -> dict[str, Any] | None:
    """Send the call now (the provider bills at completion) and drive its guarded call to settlement."""
    guarded, body = pending
    headers = {
        "authorization": "Bearer day-simulation",
        "content-type": "application/json",
        "x-sim-reply-tokens": str(call.reply_tokens),
        "x-sim-reasoning-tokens": str(shape.reasoning),
        **guarded.HEADER_OVERRIDES,
    }
    with client.stream("POST", url, content=body, headers=headers) as response:
        guarded.response_started(response.status_code, response.headers)
        raw = b""
        for chunk in response.iter_raw():
            guarded.feed(chunk)
            raw += chunk
        guarded.finish()
    if response.status_code != 200:
        day._raise(f"the simulator answered {response.status_code}")
    from quotawrap.core.sse import SSEUsageReader
    from quotawrap.core.usage import usage_from_body

    if call.stream:
        reader = SSEUsageReader()
        reader.feed(raw)
        reader.finish()
        usage = reader.usage
    else:
        usage = usage_from_body(raw)
    return None if usage is None else {"total": usage.total_tokens, "reasoning": usage.reasoning_tokens}


def run_stress(seed: int, variant: str, balance_lag_s: float, workdir: Path) -> StressResult:
    """One stressed day of ``seed``'s traffic under one limit setting."""
    import httpx

    from quotawrap.admission.guard import Guard
    from quotawrap.books.sync import SyncLoop
    from quotawrap.config.settings import Settings
    from quotawrap.core import quota
    from quotawrap.ledger.sqlite.ledger import SQLiteLedger
    from quotawrap.simulator import PackageSpec, SimConfig, serve
    from quotawrap.simulator._billing import settled_until

    traffic = day.make_traffic(seed)
    clock = day.SimClock(day.DAY_START)
    sim = serve(config=SimConfig(tokens_per_chunk=512))
    sim.set_clock(clock)
    packages = [
        PackageSpec(
            day.MODEL, p.total, day.DAY_START + p.effective_h * day.HOUR_S, day.DAY_START + p.expiry_h * day.HOUR_S
        )
        for p in STRESS.packages
    ]
    sim.set_packages(packages)
    ledger = SQLiteLedger(Path(tempfile.mkdtemp(dir=workdir)) / "ledger.sqlite3", clock=clock)
    settings = Settings(
        model=(day.MODEL,),
        base_url=(sim.url,),
        billing_endpoint=sim.base_url,
        balance_lag=balance_lag_s,
        run_id="day-stress",
        quiet=True,
        wait=0.0,  # one driver thread plays every call: a call waiting for room would wait for itself
    )
    guard = Guard(settings, ledger, clock=clock)
    loop = SyncLoop(ledger, settings, clock=clock, on_error=day._raise)
    result = StressResult(variant)
    url = sim.url + "/chat/completions"
    events: list[tuple[float, int, int]] = []  # (time, 0 = start / 1 = end, call index)
    for index, call in enumerate(traffic):
        heapq.heappush(events, (day.DAY_START + call.at_s, 0, index))
    shapes = [_Shape.of(call, index) for index, call in enumerate(traffic)]
    pending: dict[int, tuple[Any, bytes]] = {}
    reserved: dict[int, int] = {}
    day_end = day.DAY_START + quota.DAY_S
    try:
        with day._billing_credentials(), httpx.Client() as client:
            tick_at = day.DAY_START
            while tick_at < day_end or pending:
                clock.advance_to(max(clock.now, tick_at))
                # batch settlement: the billing view shows bills up to the last batch boundary
                lag = clock.now - settled_until(clock.now, SETTLE_DELAY_S, SETTLE_EVERY_S)
                sim.configure(balance_lag_s=lag)
                loop.tick()
                while events and events[0][0] < tick_at + day.TICK_S:
                    at, kind, index = heapq.heappop(events)
                    clock.advance_to(max(clock.now, at))
                    call, shape = traffic[index], shapes[index]
                    if kind == 0:
                        body = json.dumps(_body(call, index, shape)).encode()
                        guarded = guard.begin("POST", url, {"authorization": "Bearer x"}, body)
                        result.calls += 1
                        if guarded is None or guarded.blocked is not None:
                            result.blocked += 1
                            continue
                        pending[index] = (guarded, guarded.new_body or body)
                        reserved[index] = guarded._context.reserved if guarded._context else 0
                        result.max_in_flight = max(result.max_in_flight, len(pending))
                        duration = (shape.reasoning + min(call.reply_tokens, call.max_tokens)) / TOKENS_PER_S
                        heapq.heappush(events, (clock.now + max(1.0, duration), 1, index))
                    else:
                        usage = _finish(client, url, pending.pop(index), call, shape)
                        if usage is not None:
                            result.reasoning_tokens += usage["reasoning"]
                            if usage["total"] > reserved[index]:
                                result.overshoot_calls += 1
                                result.overshoot_tokens += usage["total"] - reserved[index]
                tick_at += day.TICK_S
        bills = sim.bills()
    finally:
        ledger.close()
        sim.stop()
    result.consumption = sum(b.total_tokens for b in bills)
    result.overspend, _, _ = day.free_and_paid(packages, bills)
    qs = settings.quota
    result.usable_pool = min(qs.daily_cap, STRESS.b0 + STRESS.granted - qs.small_buffer)
    return result


def format_results(results: Sequence[StressResult]) -> str:
    lines = [
        "| guard | consumed | overspend | pool used | calls | blocked | overshoot calls | overshoot tokens | reasoning"
        " | max in flight |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.variant} | {r.consumption:,} | {r.overspend:,} | {r.pool_used:.1%} | {r.calls} | {r.blocked}"
            f" | {r.overshoot_calls}"
            f" | {r.overshoot_tokens:,} | {r.reasoning_tokens:,} | {r.max_in_flight} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=day.DEFAULT_SEED)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="quotawrap-stress-") as tmp:
        results = [run_stress(args.seed, name, lag, Path(tmp)) for name, lag in day.VARIANTS]
    print(f"seed {args.seed}, {STRESS.name}")
    print(format_results(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
