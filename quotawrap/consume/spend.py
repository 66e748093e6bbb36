"""``quotawrap consume``: spend what is left of today's free collection, through the same ledger.

Usage is returned as a package the next day (notes §1.3), so what a day leaves unused is not
lost; what expires is. The seed's 23:20 task spends the rest of the day's 2M collection so old
packages are used before they expire. This is that task, made by quotawrap itself:

* the plan per model is :func:`consume_plan.plan_model`: the gate's own limit, less today's usage
  and what is in flight;
* every call reserves and settles through a real :class:`Guard` on the configured ledger, so it
  counts in today's usage (and on Redis in the same ``daily_usage`` keys the LiteLLM limiter
  reads), and every hold limit still applies; only the §7.6 soft-evict walls do not (they exist
  to leave headroom for users, which is what this task spends on purpose);
* calls are streamed chat completions with thinking disabled and ``max_tokens`` sized so that the
  whole hold fits what is left: without thinking ``max_tokens`` bounds every output token, so a
  call can never cost more than its hold (the seed's 176k surprise came from thinking, §7.6);
* a per-day lease ``consume:last_run:{date}`` (48 h) in the ledger makes a second run on the same
  Beijing day, from any host sharing the ledger, spend nothing and say why.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import field
from typing import Any

from ..admission.guard import Guard
from ..config.settings import Settings
from ..core import quota
from ..core.errors import QuotawrapError
from ..core.records import Record
from ..ledger import CallPath, Ledger, model_day_key
from ..ledger.base import ledger_clock
from ..settling.call import GuardedCall
from .plan import LEASE_TTL_S, ConsumePlan, lease_name, next_call_tokens, plan_model, stop_reason

__all__ = [
    "DEFAULT_BASE_URL",
    "PROMPT",
    "ConsumeOptions",
    "ConsumeResult",
    "ModelOutcome",
    "consume_models",
    "execute",
    "make_plans",
    "run_consume",
]

DEFAULT_BASE_URL = "https://ark.cn-beijing.volces.com/api/v3"
# Long answers are the cheapest way to spend many tokens per call: output is bounded exactly by
# max_tokens (thinking off), while a long prompt would be counted by a tokenizer that may differ
# from Ark's and could be served partly from a context cache.
PROMPT = (
    "请写一篇尽可能长的原创中文长篇小说章节，细节丰富，不要总结，不要提前结束，一直写下去直到被截断。"
    " Write the longest original text you can; never summarise and never stop early."
)


class ConsumeOptions(Record, frozen=True):
    api_key: str
    base_url: str = DEFAULT_BASE_URL
    max_tokens_per_call: int = 16_384
    concurrency: int = 4
    stop_before_s: float = 600.0
    max_errors: int = 5
    force: bool = False
    timeout_s: float = 900.0


class ModelOutcome(Record):
    plan: ConsumePlan
    spent: int = 0
    calls: int = 0
    errors: int = 0
    stop: str = ""
    last_error: str | None = None
    failed: bool = False  # stopped by errors, not by the plan, a limit or the clock


class ConsumeResult(Record):
    day: str
    run_id: str
    skipped: str | None = None  # why nothing was spent (the day's lease was taken)
    outcomes: list[ModelOutcome] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(outcome.failed for outcome in self.outcomes)

    def as_json(self) -> dict[str, Any]:
        return {
            "day": self.day,
            "skipped": self.skipped,
            "models": {
                o.plan.model: {
                    "plan": o.plan.budget,
                    "binding": o.plan.binding,
                    "usage_at_start": o.plan.usage,
                    "pool": o.plan.pool,
                    "spent": o.spent,
                    "calls": o.calls,
                    "errors": o.errors,
                    "stop": o.stop,
                    "last_error": o.last_error,
                    "failed": o.failed,
                }
                for o in self.outcomes
            },
        }


def consume_models(ledger: CallPath, settings: Settings, today: str) -> list[str]:
    """The exact ids given with --model; else the models with a balance synced today (matching any pattern)."""
    from ..core.endpoints import model_matches
    from ..core.identity import canonical

    patterns = [canonical(m) for m in settings.model]  # as the ledger keys models
    exact = [m for m in patterns if not any(ch in m for ch in "*?[")]
    if exact:
        return exact
    return [
        m
        for m in ledger.known_models()
        if (s := ledger.snapshot(m)) is not None and s.day == today and model_matches(m, patterns)
    ]


def make_plans(ledger: CallPath, settings: Settings, models: Sequence[str], now: float) -> list[ConsumePlan]:
    day = quota.beijing_day(now)
    keys = [model_day_key(model, day) for model in models]
    counters = ledger.counters(keys)
    return [
        plan_model(model, ledger.snapshot(model), counters.get(key, quota.Counters()), settings.quota, day)
        for model, key in zip(models, keys, strict=True)
    ]


def _body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "thinking": {"type": "disabled"},
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class _ModelRun:
    """One model's spending: workers size each call under one lock, so their holds never collide."""

    def __init__(
        self,
        plan: ConsumePlan,
        guard: Guard,
        ledger: Ledger,
        options: ConsumeOptions,
        clock: Callable[[], float],
        progress: Callable[[str], None],
    ) -> None:
        self.plan = plan
        self.guard = guard
        self.ledger = ledger  # the guard's, whole: the guard types it as its call path, this reads run totals
        self.options = options
        self.clock = clock
        self.progress = progress
        self.outcome = ModelOutcome(plan)
        self._cond = threading.Condition()
        self._in_flight = 0  # our holds not yet settled
        self._streak = 0
        self._blocked_by: str | None = None
        self._stop: str | None = None
        # the guard's own estimate (a short prompt is reserved at its UTF-8 bound), so a hold fits exactly
        self.prompt_tokens = guard.estimate("chat", _body(plan.model, 1)).input_tokens
        self.url = options.base_url.rstrip("/") + "/chat/completions"

    # -- accounting -------------------------------------------------------------------------

    def _spent(self) -> int:
        totals = self.ledger.run_totals(self.guard.settings.run_id or "").models.get(self.plan.model)
        return totals.settled_tokens if totals is not None else 0

    def _headroom(self, now: float) -> int:
        """What the gate's hold limits still admit on this model today, whoever spends it."""
        ledger = self.guard.ledger
        day = quota.beijing_day(now)
        key = model_day_key(self.plan.model, day)
        counters = ledger.counters([key])[key]
        limits = self.guard.limits_for(ledger.snapshot(self.plan.model), day)
        cap = min(limit.cap for limit in limits if limit.kind == "hold" and limit.scope == "model_day")
        return cap - counters.settled - counters.in_flight

    def _next(self) -> tuple[GuardedCall, bytes, int] | None:
        """Size and reserve the next call, or record why to stop (None).

        "Plan spent" while our own calls are in flight is only provisional: a model may answer
        shorter than ``max_tokens``, and what it leaves is spent by the next call.
        """
        with self._cond:
            while self._stop is None:
                now = self.clock()
                spent = self._spent()
                self.outcome.spent = spent
                unassigned = min(self.plan.budget - spent - self._in_flight, self._headroom(now))
                reason = stop_reason(
                    unassigned=unassigned,
                    prompt_tokens=self.prompt_tokens,
                    seconds_to_midnight=quota.seconds_to_beijing_midnight(now),
                    stop_before_s=self.options.stop_before_s,
                    error_streak=self._streak,
                    max_errors=self.options.max_errors,
                    blocked_by=self._blocked_by,
                )
                if reason == "plan spent" and self._in_flight > 0:
                    self._cond.wait()
                    continue
                if reason is not None:
                    self._stop = reason
                    self._cond.notify_all()
                    break
                return self._reserve(unassigned)
            return None

    def _reserve(self, unassigned: int) -> tuple[GuardedCall, bytes, int] | None:
        max_tokens = next_call_tokens(unassigned, self.prompt_tokens, self.options.max_tokens_per_call)
        body = json.dumps(_body(self.plan.model, max_tokens)).encode()
        headers = {"authorization": f"Bearer {self.options.api_key}", "content-type": "application/json"}
        call = self.guard.begin("POST", self.url, headers, body)
        if call is None:  # cannot happen: the guard is built for this model and URL
            self._stop = f"quotawrap does not guard {self.url}; refusing to spend unguarded"
            return None
        if call.blocked is not None:
            self.outcome.last_error = json.loads(call.blocked.body)["error"]["message"]
            blocked_by = dict(call.blocked.headers).get("x-quotawrap-blocked")
            if call.blocked.status == 429 and blocked_by:
                self._blocked_by = blocked_by
                self._stop = f"stopped at the {blocked_by} limit"
            else:  # the ledger is unreachable (503): never spend unguarded
                self._stop = f"stopped: quotawrap refused the call ({call.blocked.status})"
                self.outcome.failed = True
            return None
        hold = self.prompt_tokens + max_tokens
        self._in_flight += hold
        return call, call.new_body or body, hold

    def _done(self, hold: int, error: str | None) -> None:
        with self._cond:
            self._in_flight -= hold
            self._cond.notify_all()
            self.outcome.calls += 1
            if error is None:
                self._streak = 0
            else:
                self._streak += 1
                self.outcome.errors += 1
                self.outcome.last_error = error
                self.outcome.failed = self.outcome.failed or self._streak >= self.options.max_errors
            spent = self._spent()
            self.outcome.spent = spent
        budget = self.plan.budget
        share = f" ({spent / budget:.0%})" if budget else ""
        state = f"error: {error}" if error else "ok"
        self.progress(f"{self.plan.model}: call {self.outcome.calls} {state}; spent {spent:,} of {budget:,}{share}")

    # -- the calls --------------------------------------------------------------------------

    def _send(self, client: Any, call: GuardedCall, body: bytes) -> str | None:
        """One streamed call, settled by the guard; returns an error text or None."""
        import httpx

        headers = {
            "authorization": f"Bearer {self.options.api_key}",
            "content-type": "application/json",
            **call.HEADER_OVERRIDES,
        }
        try:
            with client.stream("POST", self.url, content=body, headers=headers) as response:
                call.response_started(response.status_code, response.headers)
                failed_body = b""
                for chunk in response.iter_raw():
                    call.feed(chunk)
                    if response.status_code >= 400 and len(failed_body) < 2000:
                        failed_body += chunk
                call.finish()
                if response.status_code >= 400:
                    return f"HTTP {response.status_code} {failed_body[:300].decode('utf-8', 'replace')}"
                return None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            call.failed(exc, sent=False)
            return f"cannot connect to {self.options.base_url}: {exc}"
        except Exception as exc:  # whatever broke the stream, the hold is charged, never lost
            call.failed(exc, sent=True)
            return f"{type(exc).__name__}: {exc}"

    def worker(self, client: Any) -> None:
        try:
            while True:
                taken = self._next()
                if taken is None:
                    return
                call, body, hold = taken
                error = self._send(client, call, body)
                self._done(hold, error)
                if error is not None:
                    time.sleep(min(1.0 * self._streak, 10.0))  # a failing provider gets a breath
        except QuotawrapError as exc:  # the ledger failed mid-run: stop every worker, say why
            with self._cond:
                self._stop = self._stop or f"stopped: {exc}"
                self.outcome.failed = True
                self._cond.notify_all()

    def run(self, client: Any) -> ModelOutcome:
        workers = [
            threading.Thread(target=self.worker, args=(client,), name=f"consume-{i}", daemon=True)
            for i in range(max(1, self.options.concurrency))
        ]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        self.outcome.stop = self._stop or "plan spent"
        self.outcome.spent = self._spent()
        return self.outcome


def run_consume(
    ledger: Ledger,
    settings: Settings,
    options: ConsumeOptions,
    models: Sequence[str],
    *,
    run_id: str,
    clock: Callable[[], float] | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> ConsumeResult:
    """Take the day's lease (unless ``force``), then spend each model's plan in turn. ``clock``: by default the
    ledger's (``ledger_clock``), whose Beijing day every host shares."""
    import httpx

    clock = clock or ledger_clock(ledger)
    now = clock()
    day = quota.beijing_day(now)
    result = ConsumeResult(day, run_id)
    holder = f"{socket.gethostname()}:{os.getpid()}:{run_id}"
    if not options.force and not ledger.try_lease(lease_name(day), holder, LEASE_TTL_S, now):
        result.skipped = (
            f"consume already ran for Beijing day {day} (lease {lease_name(day)}, kept 48 h); nothing spent."
            " Pass --force to run again"
        )
        return result
    guarded = settings.replace(
        model=tuple(models),
        base_url=(options.base_url,),
        run_id=run_id,
        watch=False,
        cap_tokens=None,
        cap_cost=None,
        fail_open=False,
    )
    guard = Guard(guarded, ledger, clock=clock, soft_walls=False)
    plans = make_plans(ledger, settings, models, now)
    if not options.force and all(plan.binding == "no_balance" for plan in plans):
        # nothing was planned for want of a balance: a run after `quotawrap sync` must not be refused
        ledger.release_lease(lease_name(day), holder)
    timeout = httpx.Timeout(options.timeout_s, connect=30.0, read=300.0)
    with httpx.Client(timeout=timeout) as client:
        for plan in plans:
            if plan.budget <= 0:
                result.outcomes.append(ModelOutcome(plan, stop=f"nothing to spend: {plan.detail}"))
                continue
            progress(f"{plan.model}: spending a plan of {plan.budget:,} tokens (bound by {plan.binding})")
            result.outcomes.append(_ModelRun(plan, guard, ledger, options, clock, progress).run(client))
    return result


def execute(
    ledger: Ledger,
    settings: Settings,
    options: ConsumeOptions,
    models: Sequence[str],
    *,
    say: Callable[[str], None],
    shout: Callable[[str], None],
) -> int:
    """``quotawrap consume`` after its checks: a recorded run, the live view, the summary; the exit code.

    ``say`` is progress (silenced by --quiet), ``shout`` what must be seen anyway. Store errors
    raise; Ctrl-C charges the calls in flight at their hold and returns 130.
    """
    import contextlib

    from ..config.paths import new_run_id
    from ..ledger.base import RunRecord
    from ..wrapper.live import LiveView
    from ..wrapper.summary import run_report, write_json

    run_id = f"consume-{new_run_id()}"
    tags = {"task": "consume"}
    ledger.start_run(RunRecord(run_id, time.time(), command="quotawrap consume", tags=tags))
    # on a terminal the guarded run's live bars sit below the progress lines; in logs the lines suffice
    view = None if settings.quiet else LiveView(ledger, settings.replace(run_id=run_id), run_id)
    try:
        with view if view is not None and view.is_terminal else contextlib.nullcontext():
            result = run_consume(ledger, settings, options, models, run_id=run_id, progress=say)
    except KeyboardInterrupt:
        charged = 0
        with contextlib.suppress(QuotawrapError):  # the holds are charged whole: the safe side
            charged = ledger.resolve_run(run_id)
            ledger.end_run(run_id, 130, time.time())
        shout(
            f"quotawrap: consume interrupted: {charged} call(s) in flight charged at their hold;"
            " the day's lease stays taken (--force to run again)"
        )
        return 130
    code = 1 if result.failed else 0
    ledger.end_run(run_id, code, time.time())
    if result.skipped:
        shout(f"quotawrap consume: {result.skipped}")
    for outcome in result.outcomes:
        say(f"{outcome.plan.model}: spent {outcome.spent:,} of a plan of {outcome.plan.budget:,}; {outcome.stop}")
        if outcome.last_error:
            say(f"{outcome.plan.model}: last error: {outcome.last_error}")
    if settings.report_json:
        totals = ledger.run_totals(run_id)
        report = run_report(totals, settings=settings.replace(run_id=run_id), exit_code=code, tags=tags)
        report["consume"] = result.as_json()
        write_json(report, settings.report_json)
    return code
