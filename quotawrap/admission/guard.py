"""All reserve / settle / release policy, independent of any HTTP client.

An adapter (httpx, httpx2, requests, aiohttp, the stdlib) translates its request into ``Guard.begin(...)`` and then
drives the returned :class:`GuardedCall` with what the network gives it: the response status, the body bytes as
they pass, and the end of the body (or an error, or an early close). It settles once, whichever comes first.

Failure policy (documented in README "Failure modes"):

* ledger unreachable while reserving -> fail closed: a synthetic 503 naming the store, unless ``--fail-open``
  (then the call goes out unguarded and a warning says so); a hold that may have landed is given back;
* request body we cannot read or judge (not JSON, nested too deep, ``max_tokens`` 1e30) -> a synthetic 400;
* any other fault of quotawrap's own while reserving -> a synthetic 503, never an exception in the caller
  (``begin`` never raises; settling never raises into the caller's read either);
* a POST to a guarded host that is no endpoint we know -> a synthetic 403 naming ``--allow-path``;
* a redirect answer -> release the hop's hold and guard the client's re-sent request as the same call;
* an identical retry of a request refused moments ago -> the same answer, from memory (``refusals``);
* a video task -> the create's hold becomes the task's, settled by a later GET (``tasks``);
* no usage in the answer, stream cut, reader stopped early -> charge the whole hold
  (``unresolved``); an error answer before generation, or a connection never made -> release;
* usage the call could not have produced (``usage.check_usage``) -> an anomaly: warned, kept in the ledger's
  record (``usage_anomaly``) and the audit log, and the whole hold charged instead.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import replace
from typing import Any, cast

from ..config.settings import Settings
from ..core import endpoints, quota
from ..core.endpoint_prices import CostRule
from ..core.errors import PolicyRefused, QuotawrapError, StoreError
from ..core.estimate import Estimate, EstimateSettings, Kind, ReasoningReserve, estimate_request, unbounded_thinking
from ..core.identity import UNMAPPED, Identity, answered_model, canonical
from ..core.model_limits import reasoning_ceiling
from ..core.output_bound import bound_mark
from ..core.redact import key_fingerprint
from ..core.synthetic import SyntheticResponse, blocked_response
from ..core.tokens import TokenizerUnavailable, utf8_bound
from ..core.usage import Usage, UsageBound
from ..ledger import CallPath, HoldRequest, model_day_key, open_ledger
from ..ledger.base import Decision, Settle, ledger_clock, new_hold_id, run_cost_key, run_key
from ..ledger.endpoint_ids import EndpointIds
from ..settling import readahead
from ..settling.books import GuardBooks
from ..settling.call import CallContext, GuardedCall
from ..settling.contexts import ContextCreated, ContextSizes
from ..support.events import BoundEvent, EventLog, RoomSignal
from ..support.log import warn
from . import refusals
from .allowance import AllowanceBook
from .call import Call, reserve_steps
from .room import Plan, Room, Wait, plan_output

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..core.prices import PriceTable
    from ..settling.draw_notes import DrawNotes
    from ..settling.settler import Settler
    from .advances import Advances

__all__ = ["Guard"]

_SNAPSHOT_TTL_S = 1.0
_CHEAP_SHARE = 0.01  # of the smallest token cap: inputs bounded below it never load a tokenizer


class Guard(GuardBooks):
    """One per process: the settings, the ledger and the policy."""

    def __init__(
        self,
        settings: Settings,
        ledger: CallPath | None = None,
        *,
        clock: Callable[[], float] | None = None,
        soft_walls: bool = True,
        background_settle: bool = False,
    ) -> None:
        """``soft_walls=False`` (``quotawrap consume`` only): the §7.6 soft-evict walls do not apply,
        every hold limit (caps, the synced pool) still does. ``background_settle`` (the guard of a
        guarded child): calls settle through this process's :class:`~quotawrap.settling.settler.Settler`,
        off the caller's path; otherwise each settle lands before the caller gets its last byte. ``clock``: by
        default the ledger's (``ledger_clock``: on Redis the server's, so hosts with wrong clocks share its day)."""
        self.settings = settings
        self._soft_walls = soft_walls
        self._ledger = ledger
        self._ledger_lock = threading.Lock()
        self._clock = clock if clock is not None else self._ledger_now
        self._estimate_settings = EstimateSettings(
            thinking_floor=settings.thinking_floor,
            default_max_tokens=settings.default_max_tokens,
            image_tokens=settings.image_tokens,
        )
        self._quota = settings.quota
        self._reasoning_reserve = cast(ReasoningReserve, settings.reasoning_reserve)
        self._token_cap = self._smallest_token_cap()  # pure in the settings, which never change; every call asks
        self._run_id = settings.run_id or f"adhoc-{os.getpid()}"
        self._host = socket.gethostname()
        self._eviction_cache: dict[
            tuple[str, str], tuple[float, tuple[quota.Verdict, dict[str, quota.Counters]] | None]
        ] = {}
        self._limits_cache: dict[tuple[quota.Snapshot | None, str], list[quota.Limit]] = {}
        self._warned_tokenizer = False
        self.tags = dict(entry.partition("=")[::2] for entry in settings.tag if "=" in entry)
        self._cost_cap = None if settings.cap_cost is None else round(settings.cap_cost * 1_000_000)
        self._prices: PriceTable | None = None
        self.retries = refusals.RetryMemory()
        self.contexts = ContextSizes()
        self._redirects = refusals.RedirectMemory(self.clock)
        self._router = endpoints.Router(settings.base_url, settings.allow_path)
        # --model names the models to guard as the ledger keys them (quotawrap.core.identity)
        self._patterns = tuple(canonical(pattern) for pattern in settings.model)
        self.endpoint_ids = EndpointIds(lambda: self.ledger, wall=self.clock, host=self._host)
        self._outside: set[str] = set()  # models this process said --model leaves unguarded
        self.settler: Settler | None = None
        self.advances: Advances | None = None
        self._draw_notes: DrawNotes | None = None
        self._room_signal = RoomSignal()
        if background_settle and settings.background_settle:
            from ..settling.handoff import sender_from_env
            from ..settling.settler import Settler

            # Advances, their draw notes and the relay to the wrapper are one piece (Settings.draws_ahead): only
            # under a wrapper, which learns of every draw. Its settles go to the wrapper; while a call of this
            # process waits for room they land here, so that their landing wakes it.
            relay = sender_from_env() if settings.draws_ahead else None
            self.settler = Settler(lambda: self.ledger, relay=relay, relay_now=self._room_signal.unwatched)
            if relay is not None:
                from ..settling.draw_notes import DrawNotes
                from ..settling.handoff import encode
                from .advances import Advances

                notes = self._draw_notes = relay.notes = DrawNotes(os.path.dirname(relay.path), encode)
                self.advances = Advances(
                    lambda: self.ledger, lambda settle: self.land(settle, None), notes.write, relay.listening
                )
        self._events = EventLog(settings.events_log)
        self._allowances = AllowanceBook(lambda: self.ledger, clock=self.clock)
        self._known: dict[tuple[str, str], dict[str, quota.Counters]] = {}  # last counters seen per (model, day)
        self._snapshots: dict[str, tuple[float, quota.Snapshot | None]] = {}
        self._rooms: dict[tuple[str, str], Room] = {}

    @property
    def host(self) -> str:
        return self._host

    def clock(self) -> float:
        return self._clock()

    def _ledger_now(self) -> float:
        """The guard's clock until it has read its ledger's: the ledger's from then on. A store that cannot be
        opened is the reserve's to report: until it opens, this host's clock."""
        try:
            ledger = self.ledger
        except QuotawrapError:
            return time.time()
        self._clock = ledger_clock(ledger)
        return self._clock()

    @property
    def ledger(self) -> CallPath:
        if self._ledger is None:
            with self._ledger_lock:
                if self._ledger is None:
                    from ..config.paths import default_store_url

                    ledger = open_ledger(self.settings.store or default_store_url())
                    if self.settler is not None and self.settler.relay is not None:
                        # The wrapper lands this child's settles on the same ledger all along: its commits run
                        # the checkpoints, off the caller's path (SQLite's ledger only; Redis has none).
                        leave = getattr(ledger, "leave_checkpoints", None)
                        if leave is not None:
                            leave()
                    self._ledger = ledger
        return self._ledger

    def land(self, settle: Settle, landed: Callable[[], None] | None, bound: BoundEvent | None = None) -> None:
        """Settle or release one hold: queued for the settler, or at once. Never raises. ``bound``: the call's
        bound event (the guard bounded it), recorded here unless the wrapper takes it with the settle."""
        notes = self._draw_notes
        if notes is not None and settle.drawn is not None and settle.event != "close":
            landed = notes.clearing(settle.hold_id, landed)  # once the wrapper has the settle, or it landed
        relayed = self.settler is not None and self.settler.submit(settle, landed, bound)
        if bound is not None and not relayed:
            self._events.bounds((bound,))
        if self.settler is not None:
            return
        try:
            self.ledger.settle_many((settle,))
        except Exception as exc:
            # The hold stays open and the wrapper charges it at exit; the caller's answer is intact.
            warn(f"could not settle a call: {exc}; the wrapper will charge its hold")
            return
        if landed is not None:
            landed()

    def settles_in_transit(self) -> bool:
        """Whether settles of this process may not have landed yet (queued here, or handed to the wrapper)."""
        if self.settler is None:
            return False
        relay = self.settler.relay
        return self.settler.landing or (relay is not None and relay.unsynced > 0)

    def flush(self, timeout: float = -1) -> bool:
        """Land every settle queued so far, and wait until the wrapper has landed those this process handed
        to it (tests, a program that reads the ledger itself). False on timeout."""
        if self.settler is None:
            return True
        relay = self.settler.relay
        if relay is None:
            return self.settler.flush(timeout)
        deadline = time.monotonic() + (timeout if timeout >= 0 else 3600.0)
        landed_here = self.settler.flush(timeout)
        return relay.sync(max(deadline - time.monotonic(), 0)) and landed_here

    # -- limits -----------------------------------------------------------------------------

    def limits_for(self, snapshot: quota.Snapshot | None, day: str) -> list[quota.Limit]:
        """The limits of one call; pure in (snapshot, day), so computed once per sync and day."""
        key = (snapshot, day)
        limits = self._limits_cache.get(key)
        if limits is None:
            limits = [
                *quota.run_limits(self.settings.cap_tokens),
                *quota.cost_limits(self._cost_cap),
                *quota.model_day_limits(snapshot, self._quota, today=day),
            ]
            if not self._soft_walls:
                limits = [limit for limit in limits if limit.kind != "wall"]
            if len(self._limits_cache) > 64:
                self._limits_cache.clear()
            self._limits_cache[key] = limits
        return limits

    def snapshot(self, model: str) -> quota.Snapshot | None:
        """The model's stored balance snapshot, re-read at most once a second (for planning, not deciding)."""
        now = self._clock()  # the guard's clock: a simulated day stays deterministic
        cached = self._snapshots.get(model)
        if cached is not None and now - cached[0] < _SNAPSHOT_TTL_S:
            return cached[1]
        snapshot = self.ledger.snapshot(model)
        self._snapshots[model] = (now, snapshot)
        return snapshot

    def _evicted(self, model: str, day: str, now: float) -> tuple[quota.Verdict, dict[str, quota.Counters]] | None:
        """The seed's short-cut: an evicted model is answered before any token counting.

        Cached for a second: a model evicted within that second is still estimated, then
        refused by the reservation itself, which checks the same walls atomically.
        """
        cached = self._eviction_cache.get((model, day))
        if cached is not None and now - cached[0] < _SNAPSHOT_TTL_S:
            return cached[1]
        walls = [limit for limit in self.limits_for(self.ledger.snapshot(model), day) if limit.kind == "wall"]
        result: tuple[quota.Verdict, dict[str, quota.Counters]] | None = None
        if walls:
            key = model_day_key(model, day)
            counters = {"model_day": self.ledger.counters([key])[key]}
            verdict = quota.verdict(walls, counters, 0)
            result = None if verdict.allowed else (verdict, counters)
        self._eviction_cache[(model, day)] = (now, result)
        return result

    # -- the entry point --------------------------------------------------------------------

    def route(self, method: str, url: str) -> endpoints.Route | None:
        """How a request is treated (see :func:`endpoints.route`); a redirected call's next hop too."""
        found = self._router(method, url)
        return found if found is not None else self._redirects.route_for(method, url)

    def wants(self, method: str, url: str) -> bool:
        """Cheap test, before any body is read: could this request be guarded? Never raises."""
        try:
            return self.route(method, url) is not None
        except Exception:  # begin() answers the URL it cannot read with a 400
            return True

    def note_redirect(self, from_url: str, location: str, route: endpoints.Route) -> None:
        self._redirects.note(from_url, location, route)

    def begin(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None) -> GuardedCall | None:
        """Called before a request is sent. None: not ours, send it untouched. May wait for room (--wait)."""
        readahead.leave_mine()
        steps = self.admission(method, url, headers, body)
        try:
            delay = next(steps)
            while True:
                self._room_signal.nap(delay)
                delay = next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            steps.close()

    async def abegin(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None) -> GuardedCall | None:
        """``begin`` for an event loop: waiting for room awaits, so the loop's other tasks go on."""
        import asyncio

        readahead.leave_mine()
        steps = self.admission(method, url, headers, body)
        try:
            delay = next(steps)
            while True:
                await asyncio.sleep(delay)
                delay = next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        finally:
            steps.close()  # a cancelled wait leaves its place in line

    def admission(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None
    ) -> Generator[float, None, GuardedCall | None]:
        """The admission as steps, each yield a pause (seconds) while waiting for room: the gateway awaits them.

        Never raises: whatever goes wrong becomes an answer (400 for a body quotawrap cannot
        judge, 503 when the ledger fails), because an exception of quotawrap's own inside the
        caller's SDK call is a crash the program was never written to expect.
        """
        try:
            found = self.route(method, url)
        except Exception as exc:  # a URL the client accepted but urlsplit cannot read
            return _unreadable(f"quotawrap cannot read the URL of this request, so it cannot guard it: {exc}")
        if found is None:
            return None
        if found.action in ("refuse", "wrong_method"):
            if found.action == "refuse":
                message = refusals.unknown_path_message(method, found.path)
            else:
                message = refusals.wrong_method_message(method, found.path)
            if self.settings.watch:  # --watch blocks nothing, but says what it did not guard
                warn(f"--watch: {message.replace('quotawrap refused', 'sent UNGUARDED')}")
                return None
            if found.action == "refuse":
                refusal = SyntheticResponse.ark_error(403, "QuotawrapUnknownEndpoint", "Forbidden", message)
            else:
                refusal = SyntheticResponse.ark_error(405, "QuotawrapMethodNotAllowed", "MethodNotAllowed", message)
                refusal = SyntheticResponse(405, refusal.body, (*refusal.headers, ("allow", "POST")))
            return GuardedCall.refused(refusal)
        if found.action == "poll":
            from ..settling.tasks import TaskPolled

            poll = GuardedCall(None, None, "", sink=self)
            poll.followup = TaskPolled(self)
            return poll
        try:
            request = endpoints.parse_json_body(body)
        except (ValueError, RecursionError, MemoryError) as exc:
            return _unreadable(f"quotawrap cannot read this request to {url}, so it cannot guard it: {_reason(exc)}")
        asked = request.get("model")
        if not isinstance(asked, str) or not asked:
            return _unreadable("quotawrap cannot guard a request without a 'model' string.")
        probe = None  # the lease of the one unmapped call out to the endpoint, when this call is it
        try:
            identity = self.endpoint_ids.resolve(asked)
            # --watch changes nothing, the timing of calls included: its unmapped calls do not wait for an answer
            if identity.model == UNMAPPED and identity.endpoint is not None and not self.settings.watch:
                identity, probe = yield from self._first_answer(asked, identity.endpoint)
        except PolicyRefused as exc:  # a bad [endpoints] table: the wrapper said so at its start too
            return _refuse(400, "QuotawrapPolicyRefused", "BadRequest", f"quotawrap refuses a call to {asked}: {exc}.")
        except StoreError as exc:  # the ledger's endpoint pairs or lease: as any reserve, fail closed
            if self.settings.fail_open:
                warn(f"{exc}; --fail-open: this call to {asked.strip()} goes out UNGUARDED")
                self._record_unguarded(canonical(asked), found.endpoint, exc)
                return None
            message = f"quotawrap cannot reach its ledger, so it refuses to send unguarded: {exc}. Fix the store,"
            return _refuse(503, "QuotawrapStoreUnavailable", "ServiceUnavailable", message + _FAIL_OPEN_HINT)
        if not self._guards(identity):
            self._outside_filter(identity.model, found.endpoint)
            return None
        model = identity.model
        call: GuardedCall | None = None
        try:
            call = yield from self._admission(method, url, headers, body, found, request, model, identity.endpoint)
            if model == UNMAPPED and call is not None and call.hold_id is not None and not self.settings.watch:
                call = yield from self._room_everywhere(call)
        finally:
            if probe is not None and identity.endpoint is not None:
                if call is None or call.hold_id is None:  # refused, unguarded or gone: the next one may go
                    self.endpoint_ids.probed(identity.endpoint, probe)
                else:
                    call.probe = (identity.endpoint, probe)  # it lets the next one go when it ends
        return call

    def _admission(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str],
        body: bytes | None,
        found: endpoints.Route,
        request: dict[str, Any],
        model: str,
        endpoint_id: str | None,
    ) -> Generator[float, None, GuardedCall | None]:
        """The admission of a request to ``model`` (its identity), once it is known to be guarded."""
        key = None  # hashing the body costs more than the rest of the admission's bookkeeping: only with refusals
        if self.retries:
            key = refusals.fingerprint(method, url, body, refusals.caller())
            remembered = self._recall_refusal(key)
            if remembered is not None:
                return remembered
        try:
            call = yield from self._reserve(found, url, headers, body, request, model, endpoint_id)
        except PolicyRefused as exc:  # a rule, not an outage: asking again gets the same answer, so never fail-open
            return _refuse(400, "QuotawrapPolicyRefused", "BadRequest", f"quotawrap refuses a call to {model}: {exc}.")
        except StoreError as exc:  # its message names the store with the password hidden (the ledger's rule)
            if self.settings.fail_open:
                warn(f"{exc}; --fail-open: this call to {model} goes out UNGUARDED")
                self._record_unguarded(model, found.endpoint, exc)
                return None
            message = f"quotawrap cannot reach its ledger, so it refuses to send unguarded: {exc}. Fix the store,"
            return _refuse(503, "QuotawrapStoreUnavailable", "ServiceUnavailable", message + _FAIL_OPEN_HINT)
        except Exception as exc:  # any other fault of ours: refuse loudly, never raise, and never fail open
            warn(f"internal error while guarding a call to {model}: {type(exc).__name__}: {exc}")
            message = f"quotawrap failed to guard this call ({type(exc).__name__}: {exc}), so it refuses it."
            return _refuse(503, "QuotawrapCannotGuard", "ServiceUnavailable", message)
        if call.blocked is not None and call.blocked.status in (403, 429):
            key = key or refusals.fingerprint(method, url, body, refusals.caller())
            self.retries.remember(key, call.blocked, self._clock())
        call.url = url
        call.route = found
        return call

    def _first_answer(self, asked: str, endpoint: str) -> Generator[float, None, tuple[Identity, str | None]]:
        """The identity of a call to an endpoint not mapped yet, and its probe: mapped (no probe) once the answer
        to the call to it that is out (from any process of the ledger) named its model; else UNMAPPED, and this
        call is the one out, whose answer will tell (the lease's holder, EndpointIds.probe)."""
        backoff = _PROBE_POLL_MIN_S
        while (probe := self.endpoint_ids.probe(endpoint)) is None:
            yield backoff
            backoff = min(backoff * 2, _PROBE_POLL_MAX_S)
            identity = self.endpoint_ids.resolve(asked)
            if identity.model != UNMAPPED:
                return identity, None
        # the call out before it may have ended just now, its answer naming the model: read the pairs once more
        identity = self.endpoint_ids.resolve(asked, fresh=True)
        if identity.model != UNMAPPED:
            self.endpoint_ids.probed(endpoint, probe)
            return identity, None
        return Identity(UNMAPPED, endpoint), probe

    def _guards(self, identity: Identity) -> bool:
        """Whether --model guards calls of this identity: its model (or the endpoint id the request names)
        matches; a call whose model is not known yet is guarded whatever --model says."""
        patterns = self._patterns
        if not patterns or identity.model == UNMAPPED:
            return True
        if endpoints.model_matches(identity.model, patterns):
            return True
        return identity.endpoint is not None and endpoints.model_matches(identity.endpoint, patterns)

    def _outside_filter(self, model: str, kind: str) -> None:
        """A call --model leaves unguarded: never silent. Said once per model and process, and recorded for the
        run's summary (per model, beside --fail-open's)."""
        if model not in self._outside:
            self._outside.add(model)
            names = ", ".join(self.settings.model)
            warn(f"--model {names} does not name {model}: its calls go out UNGUARDED (counted in the summary)")
        self._record_unguarded(model, kind, None)

    def _recall_refusal(self, key: str) -> GuardedCall | None:
        """An identical retry of a request refused moments ago: the same answer, no new ledger row."""
        answer = self.retries.answer(key, self._clock())
        return GuardedCall.refused(answer) if isinstance(answer, SyntheticResponse) else None

    def _reserve(
        self,
        found: endpoints.Route,
        url: str,
        headers: Mapping[str, str],
        raw: bytes | None,
        request: dict[str, Any],
        model: str,
        endpoint_id: str | None = None,
    ) -> Generator[float, None, GuardedCall]:
        kind: Kind = found.kind or "chat"
        # Ark's batch client retries every 429 until its timeout (x-should-retry ignored), but never a 403,
        # the status Ark itself gives when spending must stop (AccountOverdueError).
        refusal_status = 403 if found.endpoint.startswith("batch_") else 429
        now = self._clock()
        day = quota.beijing_day(now)
        enforce = not self.settings.watch
        evicted = self._evicted(model, day, now) if enforce else None
        if evicted is not None:
            verdict, counters = evicted
            return GuardedCall.refused(blocked_response(model, verdict, counters, 0, status=refusal_status))
        try:
            if model == UNMAPPED:  # its tokenizer is not known: a token is at least one UTF-8 byte of any
                estimate = self.estimate(kind, request, enforce=enforce, count=_utf8_bytes)
            elif model != request.get("model"):  # counted by the tokenizer of the model it is, not of its name
                estimate = self.estimate(kind, {**request, "model": model}, enforce=enforce)
            else:
                estimate = self.estimate(kind, request, enforce=enforce)
            if found.endpoint == "context_chat":  # the cached context is read too (contexts.py)
                estimate = replace(
                    estimate, input_tokens=estimate.input_tokens + self.contexts.size(request.get("context_id"))
                )
            rule = CostRule.for_request(found.endpoint, request, estimate)
        except (ValueError, RecursionError) as exc:
            return _unreadable(f"quotawrap cannot estimate this request to {model}: {_reason(exc)}")
        room = self._rooms.get((model, day)) or self._room(model, day)
        call = Call(
            found,
            kind,
            url,
            headers,
            raw,
            request,
            model,
            day,
            now,
            enforce,
            estimate,
            rule,
            refusal_status,
            endpoint_id,
        )
        return (yield from reserve_steps(self, call, room))

    def _room(self, model: str, day: str) -> Room:
        """The room of a (model, day): pure in them (a Room keeps nothing of one call), so made once, not per
        call (building its keys, two closures and itself on every call was a measurable share of the guard)."""
        keys = {
            "run": run_key(self._run_id),
            "model_day": model_day_key(model, day),
            "run_cost": run_cost_key(self._run_id),
        }
        room = Room(
            self.ledger,
            lambda snapshot: self.limits_for(snapshot, day),
            lambda: self.snapshot(model),
            self._known,
            (model, day),
            keys,
        )
        if len(self._rooms) >= 64:  # days pass, and a program may name many models
            self._rooms.clear()
        self._rooms[(model, day)] = room
        return room

    @property
    def events(self) -> EventLog:
        return self._events

    def unreadable(self, model: str, exc: BaseException) -> GuardedCall:
        return _unreadable(f"quotawrap cannot estimate this request to {model}: {_reason(exc)}")

    def plan(self, kind: Kind, url: str, request: dict[str, Any], model: str, room: Room, estimate: Estimate) -> Plan:
        """What a call that may think without a whole-output bound is sent as and reserves (bots, batch and
        context chat too: their API takes the chat body); see ``admission.plan_output``."""
        if kind not in ("chat", "responses") or not unbounded_thinking(kind, request):
            return Plan(estimate, request, None)
        # --watch observes the program as it is: it changes no request
        boundable = self.settings.bound and not self.settings.watch
        policy = self._reasoning_reserve
        learns = boundable and (policy == "learned" or kind != "chat" or not request.get("max_tokens"))
        reasoning = self._allowances.reasoning(model) if learns else None
        space = room.token_space
        if model == UNMAPPED:  # it must fit every model's room, not its own alone
            space = lambda: self._unmapped_space(room.token_space())  # noqa: E731
            if learns and reasoning is None:
                # Not a whole day's bound for one call: the most any guarded model learned, else the thinking floor
                # alone (its first answer tells the model).
                learned = [self._allowances.reasoning(m) for m in self._guarded_models()]
                reasoning = max((r for r in learned if r is not None), default=0)
        return plan_output(
            kind,
            request,
            estimate,
            self._estimate_settings,
            boundable=boundable,
            policy=policy,
            ceiling=reasoning_ceiling(model),
            reasoning=reasoning,
            token_space=space,
            token_cap=room.token_cap,
        )

    def hold(
        self,
        call: Call,
        plan: Plan,
        *,
        pid: int,
        waiter: str | None,
        ticket: int | None,
        can_wait: bool,
        hold_id: str | None = None,
    ) -> HoldRequest:
        """The hold of one attempt of ``call``; ``hold_id``: the id to number it by (a retry's), a new one if None.
        A call sent with the guard's bound carries it in its id (``admission.bound_mark``)."""
        hold_id = hold_id or new_hold_id()
        if plan.bound is not None:
            hold_id += bound_mark(plan.how, plan.bound)
        return HoldRequest(
            run_id=self._run_id,
            model=call.model,
            day=call.day,
            reserve=plan.estimate.total,
            endpoint=call.found.endpoint or call.kind,
            pid=pid,
            host=self._host,
            # a video task's hold is handed over to the task once created (see tasks.py)
            expires_at=call.now + self.settings.hold_ttl,
            enforce=call.enforce,
            key_fingerprint=key_fingerprint(call.headers),
            tags=self.tags,
            reserve_cost=self.reserve_cost(self._priced_as(call), plan.estimate, call.rule),
            waiter=waiter,
            ticket=ticket,
            can_wait=can_wait,
            hold_id=hold_id,
        )

    def _priced_as(self, call: Call) -> str:
        """What a call's hold is priced as: its model; while an endpoint's model is not known, the endpoint's own
        entry of the price table ([prices."ep-..."]) if it has one, else the table's default."""
        if call.model == UNMAPPED and call.endpoint_id is not None and self.prices.price_for(call.endpoint_id):
            return call.endpoint_id
        return call.model

    def audit_refusal(self, plan: Plan, hold: HoldRequest, decision: Decision) -> None:
        self.audit(CallContext.of_hold(hold, decision, self._clock(), plan.bound), "blocked", None, 0, 0.0)

    def refused(
        self, call: Call, plan: Plan, hold: HoldRequest, decision: Decision, waited: Wait | None
    ) -> GuardedCall:
        self.audit_refusal(plan, hold, decision)
        response = blocked_response(
            call.model, decision.verdict, decision.counters, hold.reserve, hold.reserve_cost, status=call.refusal_status
        )
        if waited is not None and waited.seconds() >= 0.001:
            response = response.with_note(f" (refused after waiting {waited.seconds():.1f}s for room; --wait)")
        return GuardedCall.refused(response)

    def admitted(
        self, call: Call, plan: Plan, hold: HoldRequest, decision: Decision, answer_bound: UsageBound
    ) -> GuardedCall:
        found, kind, request, model, now, rule = call.found, call.kind, call.request, call.model, call.now, call.rule
        body = plan.body
        hide = False
        new_body: bytes | None = None
        if (
            self.settings.inject_usage
            and kind in ("chat", "completions")
            and endpoints.stream_requested(body)
            and not endpoints.wants_usage(body)
            # stream_options that is not an object is the provider's to refuse, not ours to rewrite
            and isinstance(body.get("stream_options"), (Mapping, type(None)))
        ):
            new_body = endpoints.with_usage_requested(body)
            hide = True
        elif body is not request:  # the request with its bound added (Plan.body)
            new_body = endpoints.encode_added(call.raw, request, body)
        context = CallContext.of_hold(hold, decision, now, plan.bound, plan.how)
        guarded = GuardedCall(
            self.ledger,
            decision.hold_id,
            model,
            new_body=new_body,
            hide_usage_chunk=hide,
            sink=self,
            context=context,
            bound=answer_bound,
        )
        guarded.cost_rule = rule
        guarded.endpoint_id = call.endpoint_id
        if found.endpoint == "video_task":
            from ..settling.tasks import TaskCreated

            guarded.followup = TaskCreated(self, context)
        elif found.endpoint == "context":
            guarded.followup = ContextCreated(self.contexts)
        return guarded

    # -- endpoints whose model is not known yet ------------------------------------------------------

    def _guarded_models(self) -> list[str]:
        """The ledger's models (every one it has a call or a balance of) that --model guards."""
        return [m for m in self.ledger.known_models() if m != UNMAPPED and self._guards(Identity(m))]

    def _every_model(self, day: str, models: list[str]) -> list[tuple[str | None, list[quota.Limit], quota.Counters]]:
        """Each of ``models`` and None (a model nobody used today), its day's hold limits, and its counters with
        every unmapped call's hold and charge added: what an unmapped call must fit, whichever model it is."""
        ledger = self.ledger
        keys = [model_day_key(m, day) for m in models]
        unmapped_key = model_day_key(UNMAPPED, day)
        counters = ledger.counters([*keys, unmapped_key])
        unmapped = counters[unmapped_key]
        found: list[tuple[str | None, list[quota.Limit], quota.Counters]] = []
        for model, key in [*zip(models, keys, strict=True), (None, None)]:
            own = counters[key] if key is not None else quota.Counters()
            seen = quota.Counters(own.settled + unmapped.settled, own.in_flight + unmapped.in_flight)
            limits = self.limits_for(ledger.snapshot(model) if model is not None else None, day)
            found.append(
                (model, [limit for limit in limits if limit.scope == "model_day" and limit.kind == "hold"], seen)
            )
        return found

    def _unmapped_space(self, own: int | None) -> int | None:
        """What an unmapped call may reserve at most (quota.token_room): its own limits' room (``own``), and
        every model's, whichever it turns out to be."""
        rooms = [] if own is None else [own]
        for _model, limits, seen in self._every_model(quota.beijing_day(self._clock()), self._guarded_models()):
            room = quota.token_room(limits, {"model_day": seen})
            if room is not None:
                rooms.append(room)
        return min(rooms) if rooms else None

    def _room_everywhere(self, call: GuardedCall) -> Generator[float, None, GuardedCall]:
        """An unmapped call whose hold is taken goes out once every model's day limits hold it with the rest,
        whichever model it turns out to be; it waits for room (--wait) while only calls in flight are in the way.

        From the moment it was taken, the hold counts in every model's checks (the ledger's rule), and the models
        and their counters are read after it: a call to a model either saw this hold when it reserved, or is in
        the counters read here. So once this passes, no model's cap can be passed by it."""
        context = call.context
        assert context is not None
        wait_s = self.settings.wait if 0 < self.settings.wait < float("inf") else 0.0
        deadline, backoff = time.monotonic() + wait_s, _PROBE_POLL_MIN_S
        # read once, after the hold: a model first used later reserved after it, and counted it
        models = self._guarded_models()
        while True:
            short = next(
                (
                    (model, limit, seen)
                    for model, limits, seen in self._every_model(context.day, models)
                    for limit in limits
                    if seen.settled + seen.in_flight > limit.cap
                ),
                None,
            )
            if short is None:
                return call
            _model, limit, seen = short
            if seen.settled + context.reserved > limit.cap or time.monotonic() >= deadline:  # never, or waited enough
                return self._unmapped_refused(call, context, short)
            yield backoff  # only calls in flight are in the way: its hold keeps its place meanwhile
            backoff = min(backoff * 2, _PROBE_POLL_MAX_S)

    def _unmapped_refused(
        self, call: GuardedCall, context: CallContext, short: tuple[str | None, quota.Limit, quota.Counters]
    ) -> GuardedCall:
        """Refuse the unmapped call ``short`` found no room for: its hold is given back (as no call of its own),
        and a refused call's row takes its place in the ledger."""
        model, limit, seen = short
        refusal = self._hold_in_place_of(context, UNMAPPED)
        always = quota.Limit(limit.name, "model_day", -1, "hold", limit.detail)  # refuses whatever it counts
        try:
            self.ledger.reserve(refusal, lambda _snapshot: [always])
            self.ledger.release(context.hold_id, handed_to=refusal.hold_id)
        except QuotawrapError as exc:  # the wrapper charges the hold at its end
            warn(f"could not give back the hold of a refused call to {call.endpoint_id}: {exc}")
        blocked = context._replace(hold_id=refusal.hold_id, would_block=True, blocked_by=limit.name)
        self.audit(blocked, "blocked", None, 0, 0.0)
        counters = {"model_day": quota.Counters(seen.settled, max(0, seen.in_flight - context.reserved))}
        status = 403 if context.endpoint.startswith("batch_") else 429
        name = model or "a model not used today"
        response = blocked_response(name, quota.Verdict(False, limit), counters, context.reserved, status=status)
        return GuardedCall.refused(response.with_note(_UNMAPPED_NOTE.format(endpoint=call.endpoint_id)))

    def _hold_in_place_of(self, context: CallContext, model: str, *, enforce: bool = True) -> HoldRequest:
        """A new hold of the call's size and owner, on ``model``, to take the place of the call's own."""
        return HoldRequest(
            run_id=context.run_id,
            model=model,
            day=context.day,
            reserve=context.reserved,
            endpoint=context.endpoint,
            pid=context.pid,
            host=self._host,
            expires_at=self._clock() + self.settings.hold_ttl,
            enforce=enforce,
            key_fingerprint=context.key_fingerprint,
            tags=self.tags,
            reserve_cost=context.reserved_cost,
        )

    def answered(self, call: GuardedCall, raw: object) -> None:
        """A call to an endpoint id was answered naming ``raw`` (its ``model``): learn which model the endpoint
        serves, and hand the call's hold over to that model when it was held as another (unmapped, or an
        endpoint since moved to another version), so that its settle lands where Ark billed it."""
        endpoint, model = call.endpoint_id, answered_model(raw)
        if endpoint is None or model is None:
            return
        self.endpoint_ids.learn(endpoint, model)
        context = call.context
        if model == call.model or context is None or context.drawn is not None:
            return  # a call drawn from an advance settles on the advance's model-day (README)
        # taken whatever the limits and lines say: its tokens were admitted as the hold it replaces, which
        # counted against this model's room too (an unmapped hold counts against every model's)
        hold = self._hold_in_place_of(context, model, enforce=False)
        try:
            self.ledger.reserve(hold, lambda _snapshot: ())
            self.ledger.release(context.hold_id, handed_to=hold.hold_id)
        except QuotawrapError as exc:
            warn(f"could not move a call to {endpoint} to {model}: {exc}; it settles as {call.model}")
            return
        call.moved_to(context._replace(hold_id=hold.hold_id, model=model))

    # -- learning and waking ---------------------------------------------------------------------

    def settled(self, context: CallContext, usage: Usage | None) -> None:
        """A call of this process settled or was released: wake this process's waiters, learn its reasoning."""
        self._room_signal.room_freed()
        if usage is not None and context.endpoint != "embeddings":
            self._allowances.observe(
                context.model, usage.reasoning_tokens, usage.completion_tokens, context.output_bound
            )

    def _smallest_token_cap(self) -> int:
        """The smallest cap on tokens held at once that the settings alone fix (run cap, daily cap).

        A synced pool can only lower the model-day cap, so a reserve above this is refused whatever
        the counters say.
        """
        caps = [self._quota.daily_cap]
        if self.settings.cap_tokens is not None:
            caps.append(self.settings.cap_tokens)
        return min(caps)

    def estimate(
        self,
        kind: str,
        request: Mapping[str, Any],
        *,
        enforce: bool = True,
        count: Callable[[str, str], int] | None = None,
    ) -> Estimate:
        """The estimate this guard reserves for ``request`` (whoever sizes calls to fit must use it).

        ``ValueError`` for a body it cannot judge. With ``enforce``, counting stops once the input
        passes the smallest cap (the call is refused anyway). ``count``: how to count text instead of the
        model's tokenizer.
        """
        if count is not None:
            return estimate_request(kind, request, self._estimate_settings, count=count)  # type: ignore[arg-type]
        cap = self._token_cap
        # Below this share of the cap the UTF-8 bound is used as is: its surplus over the exact count
        # (held only until the call settles) costs less than that share, and no tokenizer is loaded.
        exact_above = int(cap * _CHEAP_SHARE)
        stop_above = cap if enforce else None  # in --watch the call goes out: count it all
        try:
            return estimate_request(
                kind,  # type: ignore[arg-type]
                request,
                self._estimate_settings,
                exact_above=exact_above,
                stop_above=stop_above,
            )
        except TokenizerUnavailable as exc:
            # Still guarded, never less safe: a BPE token is at least one UTF-8 byte.
            if not self._warned_tokenizer:
                self._warned_tokenizer = True
                warn(f"{exc}; estimating inputs by their UTF-8 byte count instead (an upper bound)")
            return estimate_request(kind, request, self._estimate_settings, count=_utf8_bytes)  # type: ignore[arg-type]


_FAIL_OPEN_HINT = " or pass --fail-open to let calls through unguarded."
_UNMAPPED_NOTE = (
    " The call names {endpoint}, whose model is not known yet (its first answer tells), so it must fit every"
    ' model\'s room: map it in quotawrap.toml ([endpoints] "{endpoint}" = "<model>-<version>"), or set'
    " VolcEngine credentials so that the management API lists it, and it counts against its own model only."
)
# A call to an endpoint whose first call of this process is out polls for its answer this often (doubling).
_PROBE_POLL_MIN_S, _PROBE_POLL_MAX_S = 0.01, 0.25


def _refuse(status: int, code: str, error_type: str, message: str) -> GuardedCall:
    return GuardedCall.refused(SyntheticResponse.ark_error(status, code, error_type, message))


def _unreadable(message: str) -> GuardedCall:
    """Refuse a request quotawrap cannot read (the provider could not either): 400, never sent."""
    return _refuse(400, "QuotawrapUnreadableRequest", "BadRequest", message)


def _utf8_bytes(_model: str, text: str) -> int:
    return utf8_bound(text)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "it is nested too deeply"
    if isinstance(exc, MemoryError):
        return "it is too large to read"
    return str(exc)
