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
* a video task -> the create's hold becomes the task's, settled by a later GET (``settling/followups``);
* no usage in the answer, stream cut, reader stopped early -> charge the whole hold
  (``unresolved``); an error answer before generation, or a connection never made -> release;
* usage the call could not have produced (``usage.check_usage``) -> an anomaly: warned, kept in the ledger's
  record (``usage_anomaly``) and the audit log, and the whole hold charged instead.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Generator, Mapping
from typing import Any, cast

from ..config.settings import Settings
from ..core import endpoints, quota
from ..core.errors import PolicyRefused, StoreError
from ..core.estimate import Estimate, EstimateSettings, ReasoningReserve
from ..core.identity import UNMAPPED, Identity, canonical
from ..core.synthetic import SyntheticResponse
from ..ledger import CallPath, model_day_key, open_ledger
from ..ledger.base import run_cost_key, run_key
from ..ledger.endpoint_ids import EndpointIds
from ..settling import readahead
from ..settling.books import Books
from ..settling.call import GuardedCall
from ..settling.followups import ContextSizes, FollowupServices, followup_for
from ..settling.sink import Landing, Store
from ..support.events import EventLog, RoomSignal
from ..support.log import warn
from . import refusals
from .allowance import AllowanceBook
from .call import Admission, AdmissionServices, Estimator, reason, unreadable
from .room import Limits, Room, Snapshots
from .unmapped import PROBE_POLL_MAX_S, PROBE_POLL_MIN_S, EveryModel, guards

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..settling.settler import Settler
    from .advances import Advances

__all__ = ["Guard"]


class Guard:
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
        self._store = Store(self._open_ledger, ledger, clock)
        self._estimate_settings = EstimateSettings(
            thinking_floor=settings.thinking_floor,
            default_max_tokens=settings.default_max_tokens,
            image_tokens=settings.image_tokens,
        )
        self._quota = settings.quota
        # pure in the settings, which never change; every call asks
        self._estimator = Estimator(self._estimate_settings, self._smallest_token_cap())
        self._run_id = settings.run_id or f"adhoc-{os.getpid()}"
        self._host = socket.gethostname()
        cost_cap = None if settings.cap_cost is None else round(settings.cap_cost * 1_000_000)
        self._limits = Limits(settings.cap_tokens, cost_cap, self._quota, soft_walls=soft_walls)
        tags = dict(entry.partition("=")[::2] for entry in settings.tag if "=" in entry)
        self.books = Books(settings, run_id=self._run_id, host=self._host, tags=tags, clock=self._store.now)
        self.retries = refusals.RetryMemory()
        self.contexts = ContextSizes()
        self._redirects = refusals.RedirectMemory(self._store.now)
        self._note_redirect = self._redirects.note  # bound once: every admitted call is handed it
        self._router = endpoints.Router(settings.base_url, settings.allow_path)
        # --model names the models to guard as the ledger keys them (quotawrap.core.identity)
        self._patterns = tuple(canonical(pattern) for pattern in settings.model)
        self.endpoint_ids = EndpointIds(self._store, wall=self._store.now, host=self._host)
        self._outside: set[str] = set()  # models this process said --model leaves unguarded
        self.advances: Advances | None = None
        self._room_signal = RoomSignal()
        self._events = EventLog(settings.events_log)
        self._allowances = AllowanceBook(self._store, clock=self._store.now)
        self.landing = Landing(self._store, books=self.books, events=self._events, room_signal=self._room_signal)
        self.landing.learn = self._allowances.observe
        if background_settle and settings.background_settle:
            from ..settling.handoff import sender_from_env
            from ..settling.settler import Settler

            # Advances, their draw notes and the relay to the wrapper are one piece (Settings.draws_ahead): only
            # under a wrapper, which learns of every draw. Its settles go to the wrapper; while a call of this
            # process waits for room they land here, so that their landing wakes it.
            relay = sender_from_env() if settings.draws_ahead else None
            self.landing.settler = Settler(self._store, relay=relay, relay_now=self._room_signal.unwatched)
            if relay is not None:
                from ..settling.draw_notes import DrawNotes
                from ..settling.handoff import encode
                from .advances import Advances

                notes = self.landing.notes = relay.notes = DrawNotes(os.path.dirname(relay.path), encode)
                land = self.landing.land
                self.advances = Advances(self._store, lambda settle: land(settle, None), notes.write, relay.listening)
        self._followups = FollowupServices(
            ledger=self._store,
            price=self.books.actual_cost,
            clock=self._store.now,
            host=self._host,
            tags=self.books.tags,
            task_hold_ttl=settings.task_hold_ttl,
            resolve=self.endpoint_ids.resolve,
            contexts=self.contexts,
        )
        self._services: AdmissionServices | None = None  # made once the ledger is open (admission_services)
        self._snapshots: Snapshots | None = None
        self._every: EveryModel | None = None
        self._known: dict[tuple[str, str], dict[str, quota.Counters]] = {}  # last counters seen per (model, day)
        self._rooms: dict[tuple[str, str], Room] = {}

    @property
    def host(self) -> str:
        return self._host

    def clock(self) -> float:
        return self._store.now()

    @property
    def ledger(self) -> CallPath:
        return self._store()

    def _open_ledger(self) -> CallPath:
        from ..config.paths import default_store_url

        ledger = open_ledger(self.settings.store or default_store_url())
        settler = self.landing.settler
        if settler is not None and settler.relay is not None:
            # The wrapper lands this child's settles on the same ledger all along: its commits run
            # the checkpoints, off the caller's path (SQLite's ledger only; Redis has none).
            leave = getattr(ledger, "leave_checkpoints", None)
            if leave is not None:
                leave()
        return ledger

    @property
    def settler(self) -> Settler | None:
        """The settle thread of a guard that settles in the background (None: each settle lands at once)."""
        return self.landing.settler

    def admission_services(self) -> AdmissionServices:
        """What every admission of this process needs: made once, on the first call (it opens the ledger)."""
        services = self._services
        if services is None:
            ledger = self.ledger
            clock = self._store.clock()  # the ledger's clock from now on, read without the store in between
            self._snapshots = Snapshots(ledger, clock)
            every = self._every = EveryModel(
                ledger,
                self._limits,
                settings=self.settings,
                books=self.books,
                endpoint_ids=self.endpoint_ids,
                clock=clock,
                patterns=self._patterns,
            )
            services = self._services = AdmissionServices(
                ledger=ledger,
                settings=self.settings,
                clock=clock,
                events=self._events,
                advances=self.advances,
                allowances=self._allowances,
                estimate=self._estimator,
                estimate_settings=self._estimate_settings,
                reasoning_reserve=cast(ReasoningReserve, self.settings.reasoning_reserve),
                books=self.books,
                sink=self.landing,
                followups=self._followups,
                every_model=every,
            )
        return services

    def flush(self, timeout: float = -1) -> bool:
        """Land every settle queued so far, and wait until the wrapper has landed those this process handed
        to it (tests, a program that reads the ledger itself). False on timeout."""
        return self.landing.flush(timeout)

    # -- limits -----------------------------------------------------------------------------

    def limits_for(self, snapshot: quota.Snapshot | None, day: str) -> list[quota.Limit]:
        """The limits of one call; pure in (snapshot, day), so computed once per sync and day."""
        return self._limits(snapshot, day)

    def snapshot(self, model: str) -> quota.Snapshot | None:
        """The model's stored balance snapshot, re-read at most once a second (for planning, not deciding)."""
        self.admission_services()
        assert self._snapshots is not None
        return self._snapshots(model)

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
            return unreadable(f"quotawrap cannot read the URL of this request, so it cannot guard it: {exc}")
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
            poll = GuardedCall(None, "", sink=self.landing)
            poll.followup = followup_for(found, None, self._followups)
            return poll
        try:
            request = endpoints.parse_json_body(body)
        except (ValueError, RecursionError, MemoryError) as exc:
            return unreadable(f"quotawrap cannot read this request to {url}, so it cannot guard it: {reason(exc)}")
        asked = request.get("model")
        if not isinstance(asked, str) or not asked:
            return unreadable("quotawrap cannot guard a request without a 'model' string.")
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
                self.books.record_unguarded(canonical(asked), found.endpoint, exc)
                return None
            message = f"quotawrap cannot reach its ledger, so it refuses to send unguarded: {exc}. Fix the store,"
            return _refuse(503, "QuotawrapStoreUnavailable", "ServiceUnavailable", message + _FAIL_OPEN_HINT)
        if not guards(self._patterns, identity):
            self._outside_filter(identity.model, found.endpoint)
            return None
        model = identity.model
        call: GuardedCall | None = None
        try:
            call = yield from self._admission(method, url, headers, body, found, request, model, identity.endpoint)
            if model == UNMAPPED and call is not None and call.hold_id is not None and not self.settings.watch:
                assert self._every is not None  # made with the services, before any hold
                call = yield from self._every.room_everywhere(call)
        finally:
            if probe is not None and identity.endpoint is not None:
                if call is None or call.hold_id is None:  # refused, unguarded or gone: the next one may go
                    self.endpoint_ids.probed(identity.endpoint, probe)
                else:  # it lets the next one go when it ends
                    call.probe = functools.partial(self.endpoint_ids.probed, identity.endpoint, probe)
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
            services = self.admission_services()
            now = services.clock()
            day = quota.beijing_day(now)
            room = self._rooms.get((model, day)) or self._room(model, day)
            admission = Admission(services, found, url, headers, body, request, room, now, endpoint_id)
            call = yield from admission.steps()
        except PolicyRefused as exc:  # a rule, not an outage: asking again gets the same answer, so never fail-open
            return _refuse(400, "QuotawrapPolicyRefused", "BadRequest", f"quotawrap refuses a call to {model}: {exc}.")
        except StoreError as exc:  # its message names the store with the password hidden (the ledger's rule)
            if self.settings.fail_open:
                warn(f"{exc}; --fail-open: this call to {model} goes out UNGUARDED")
                self.books.record_unguarded(model, found.endpoint, exc)
                return None
            message = f"quotawrap cannot reach its ledger, so it refuses to send unguarded: {exc}. Fix the store,"
            return _refuse(503, "QuotawrapStoreUnavailable", "ServiceUnavailable", message + _FAIL_OPEN_HINT)
        except Exception as exc:  # any other fault of ours: refuse loudly, never raise, and never fail open
            warn(f"internal error while guarding a call to {model}: {type(exc).__name__}: {exc}")
            message = f"quotawrap failed to guard this call ({type(exc).__name__}: {exc}), so it refuses it."
            return _refuse(503, "QuotawrapCannotGuard", "ServiceUnavailable", message)
        if call.blocked is not None and call.blocked.status in (403, 429):
            key = key or refusals.fingerprint(method, url, body, refusals.caller())
            self.retries.remember(key, call.blocked, self._store.now())
        call.url = url
        call.route = found
        call.on_redirect = self._note_redirect
        if endpoint_id is not None:
            call.on_answer = services.every_model.answered
        return call

    def _first_answer(self, asked: str, endpoint: str) -> Generator[float, None, tuple[Identity, str | None]]:
        """The identity of a call to an endpoint not mapped yet, and its probe: mapped (no probe) once the answer
        to the call to it that is out (from any process of the ledger) named its model; else UNMAPPED, and this
        call is the one out, whose answer will tell (the lease's holder, EndpointIds.probe)."""
        backoff = PROBE_POLL_MIN_S
        while (probe := self.endpoint_ids.probe(endpoint)) is None:
            yield backoff
            backoff = min(backoff * 2, PROBE_POLL_MAX_S)
            identity = self.endpoint_ids.resolve(asked)
            if identity.model != UNMAPPED:
                return identity, None
        # the call out before it may have ended just now, its answer naming the model: read the pairs once more
        identity = self.endpoint_ids.resolve(asked, fresh=True)
        if identity.model != UNMAPPED:
            self.endpoint_ids.probed(endpoint, probe)
            return identity, None
        return Identity(UNMAPPED, endpoint), probe

    def _outside_filter(self, model: str, kind: str) -> None:
        """A call --model leaves unguarded: never silent. Said once per model and process, and recorded for the
        run's summary (per model, beside --fail-open's)."""
        if model not in self._outside:
            self._outside.add(model)
            names = ", ".join(self.settings.model)
            warn(f"--model {names} does not name {model}: its calls go out UNGUARDED (counted in the summary)")
        self.books.record_unguarded(model, kind, None)

    def _recall_refusal(self, key: str) -> GuardedCall | None:
        """An identical retry of a request refused moments ago: the same answer, no new ledger row."""
        answer = self.retries.answer(key, self._store.now())
        return GuardedCall.refused(answer) if isinstance(answer, SyntheticResponse) else None

    def _room(self, model: str, day: str) -> Room:
        """The room of a (model, day): pure in them (a Room keeps nothing of one call), so made once, not per
        call (building its keys, two closures and itself on every call was a measurable share of the guard)."""
        keys = {
            "run": run_key(self._run_id),
            "model_day": model_day_key(model, day),
            "run_cost": run_cost_key(self._run_id),
        }
        services = self.admission_services()
        assert self._snapshots is not None
        room = Room(services.ledger, self._limits, self._snapshots, self._known, (model, day), keys)
        if len(self._rooms) >= 64:  # days pass, and a program may name many models
            self._rooms.clear()
        self._rooms[(model, day)] = room
        return room

    @property
    def events(self) -> EventLog:
        return self._events

    # -- estimates ---------------------------------------------------------------------------

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
        return self._estimator(kind, request, enforce=enforce, count=count)


_FAIL_OPEN_HINT = " or pass --fail-open to let calls through unguarded."


def _refuse(status: int, code: str, error_type: str, message: str) -> GuardedCall:
    return GuardedCall.refused(SyntheticResponse.ark_error(status, code, error_type, message))
