"""Calls whose model is not known yet: an endpoint id no table, answer or management API has mapped.

Such a call is held as the unmapped model and must fit every guarded model's room, whichever it turns out to
be (:meth:`EveryModel.room_everywhere`); once an answer names its model, the endpoint is learned and the call's
hold is moved to that model (:meth:`EveryModel.answered`), so that its settle lands where Ark billed it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator

from ..config.settings import Settings
from ..core import endpoints, quota
from ..core.errors import QuotawrapError
from ..core.identity import UNMAPPED, Identity, answered_model
from ..core.synthetic import blocked_response
from ..ledger import CallPath, HoldRequest, model_day_key
from ..ledger.endpoint_ids import EndpointIds
from ..settling.books import Books
from ..settling.call import CallContext, GuardedCall
from ..support.log import warn
from .room import Limits

__all__ = ["PROBE_POLL_MAX_S", "PROBE_POLL_MIN_S", "EveryModel", "guards"]

_UNMAPPED_NOTE = (
    " The call names {endpoint}, whose model is not known yet (its first answer tells), so it must fit every"
    ' model\'s room: map it in quotawrap.toml ([endpoints] "{endpoint}" = "<model>-<version>"), or set'
    " VolcEngine credentials so that the management API lists it, and it counts against its own model only."
)
# A call to an endpoint whose first call of this process is out polls for its answer this often (doubling).
PROBE_POLL_MIN_S, PROBE_POLL_MAX_S = 0.01, 0.25


def guards(patterns: tuple[str, ...], identity: Identity) -> bool:
    """Whether --model guards calls of this identity: its model (or the endpoint id the request names)
    matches; a call whose model is not known yet is guarded whatever --model says."""
    if not patterns or identity.model == UNMAPPED:
        return True
    if endpoints.model_matches(identity.model, patterns):
        return True
    return identity.endpoint is not None and endpoints.model_matches(identity.endpoint, patterns)


class EveryModel:
    """What an unmapped call must fit, and its move to its model once answered; one per guard, made with its
    ledger open."""

    __slots__ = ("_books", "_clock", "_endpoint_ids", "_ledger", "_limits", "_patterns", "_settings")

    def __init__(
        self,
        ledger: CallPath,
        limits: Limits,
        *,
        settings: Settings,
        books: Books,
        endpoint_ids: EndpointIds,
        clock: Callable[[], float],
        patterns: tuple[str, ...],
    ) -> None:
        """``patterns``: the models --model guards, as the ledger keys them."""
        self._ledger = ledger
        self._limits = limits
        self._settings = settings
        self._books = books
        self._endpoint_ids = endpoint_ids
        self._clock = clock
        self._patterns = patterns

    def models(self) -> list[str]:
        """The ledger's models (every one it has a call or a balance of) that --model guards."""
        return [m for m in self._ledger.known_models() if m != UNMAPPED and guards(self._patterns, Identity(m))]

    def _every_model(self, day: str, models: list[str]) -> list[tuple[str | None, list[quota.Limit], quota.Counters]]:
        """Each of ``models`` and None (a model nobody used today), its day's hold limits, and its counters with
        every unmapped call's hold and charge added: what an unmapped call must fit, whichever model it is."""
        ledger = self._ledger
        keys = [model_day_key(m, day) for m in models]
        unmapped_key = model_day_key(UNMAPPED, day)
        counters = ledger.counters([*keys, unmapped_key])
        unmapped = counters[unmapped_key]
        found: list[tuple[str | None, list[quota.Limit], quota.Counters]] = []
        for model, key in [*zip(models, keys, strict=True), (None, None)]:
            own = counters[key] if key is not None else quota.Counters()
            seen = quota.Counters(own.settled + unmapped.settled, own.in_flight + unmapped.in_flight)
            limits = self._limits(ledger.snapshot(model) if model is not None else None, day)
            found.append(
                (model, [limit for limit in limits if limit.scope == "model_day" and limit.kind == "hold"], seen)
            )
        return found

    def space(self, own: int | None) -> int | None:
        """What an unmapped call may reserve at most (quota.token_room): its own limits' room (``own``), and
        every model's, whichever it turns out to be."""
        rooms = [] if own is None else [own]
        for _model, limits, seen in self._every_model(quota.beijing_day(self._clock()), self.models()):
            room = quota.token_room(limits, {"model_day": seen})
            if room is not None:
                rooms.append(room)
        return min(rooms) if rooms else None

    def room_everywhere(self, call: GuardedCall) -> Generator[float, None, GuardedCall]:
        """An unmapped call whose hold is taken goes out once every model's day limits hold it with the rest,
        whichever model it turns out to be; it waits for room (--wait) while only calls in flight are in the way.

        From the moment it was taken, the hold counts in every model's checks (the ledger's rule), and the models
        and their counters are read after it: a call to a model either saw this hold when it reserved, or is in
        the counters read here. So once this passes, no model's cap can be passed by it."""
        context = call.context
        assert context is not None
        wait_s = self._settings.wait if 0 < self._settings.wait < float("inf") else 0.0
        deadline, backoff = time.monotonic() + wait_s, PROBE_POLL_MIN_S
        # read once, after the hold: a model first used later reserved after it, and counted it
        models = self.models()
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
                return self._refused(call, context, short)
            yield backoff  # only calls in flight are in the way: its hold keeps its place meanwhile
            backoff = min(backoff * 2, PROBE_POLL_MAX_S)

    def _refused(
        self, call: GuardedCall, context: CallContext, short: tuple[str | None, quota.Limit, quota.Counters]
    ) -> GuardedCall:
        """Refuse the unmapped call ``short`` found no room for: its hold is given back (as no call of its own),
        and a refused call's row takes its place in the ledger."""
        model, limit, seen = short
        refusal = self._hold_in_place_of(context, UNMAPPED)
        always = quota.Limit(limit.name, "model_day", -1, "hold", limit.detail)  # refuses whatever it counts
        try:
            self._ledger.reserve(refusal, lambda _snapshot: [always])
            self._ledger.release(context.hold_id, handed_to=refusal.hold_id)
        except QuotawrapError as exc:  # the wrapper charges the hold at its end
            warn(f"could not give back the hold of a refused call to {call.endpoint_id}: {exc}")
        blocked = context._replace(hold_id=refusal.hold_id, would_block=True, blocked_by=limit.name)
        self._books.audit(blocked, "blocked", None, 0, 0.0)
        counters = {"model_day": quota.Counters(seen.settled, max(0, seen.in_flight - context.reserved))}
        status = 403 if context.endpoint.startswith("batch_") else 429
        name = model or "a model not used today"
        response = blocked_response(name, quota.Verdict(False, limit), counters, context.reserved, status=status)
        return GuardedCall.refused(response.with_note(_UNMAPPED_NOTE.format(endpoint=call.endpoint_id)))

    def _hold_in_place_of(
        self, context: CallContext, model: str, *, enforce: bool = True, taken_over: bool = False
    ) -> HoldRequest:
        """A new hold of the call's size and owner, on ``model``, to take the place of the call's own."""
        return HoldRequest(
            run_id=context.run_id,
            model=model,
            day=context.day,
            reserve=context.reserved,
            endpoint=context.endpoint,
            pid=context.pid,
            host=self._books.host,
            expires_at=self._clock() + self._settings.hold_ttl,
            enforce=enforce,
            key_fingerprint=context.key_fingerprint,
            tags=self._books.tags,
            reserve_cost=context.reserved_cost,
            taken_over=taken_over,
        )

    def answered(self, call: GuardedCall, raw: object) -> None:
        """A call to an endpoint id was answered naming ``raw`` (its ``model``): learn which model the endpoint
        serves, and hand the call's hold over to that model when it was held as another (unmapped, or an
        endpoint since moved to another version), so that its settle lands where Ark billed it."""
        endpoint, model = call.endpoint_id, answered_model(raw)
        if endpoint is None or model is None:
            return
        self._endpoint_ids.learn(endpoint, model)
        context = call.context
        if model == call.model or context is None or context.drawn is not None:
            return  # a call drawn from an advance settles on the advance's model-day (README)
        # taken whatever the limits and lines say: its tokens were admitted as the hold it replaces, which
        # counted against this model's room too (an unmapped hold counts against every model's)
        hold = self._hold_in_place_of(context, model, enforce=False, taken_over=True)
        try:
            self._ledger.reserve(hold, lambda _snapshot: ())
            self._ledger.release(context.hold_id, handed_to=hold.hold_id)
        except QuotawrapError as exc:
            warn(f"could not move a call to {endpoint} to {model}: {exc}; it settles as {call.model}")
            return
        call.moved_to(context._replace(hold_id=hold.hold_id, model=model))
