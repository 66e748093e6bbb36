"""One guarded request's life after its reservation: status, body tee, settle exactly once.

An adapter drives a :class:`GuardedCall` with what the network gives it: the response status, the
body bytes as they pass, and the end of the body (or an error, or an early close). Whichever comes
first settles the hold, once; the settle lands through the :class:`SettleSink` it was admitted with
(quotawrap.settling.sink.Landing), which is all it sees of the process. The settle policy itself is in
the guard module's docstring ("Failure policy").
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, NamedTuple, Protocol

from ..core import endpoints
from ..core.endpoint_prices import CostRule
from ..core.output_bound import ADDED, cut_short
from ..core.sse import SSEUsageReader, is_event_stream
from ..core.synthetic import SyntheticResponse
from ..core.usage import Usage, UsageBound, check_usage, model_of_body, usage_from_body
from ..ledger import HoldRequest
from ..ledger.base import CallRecord, CallState, Decision, Drawn, Settle
from ..support.log import warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..support.events import BoundEvent

__all__ = ["CallContext", "Followup", "GuardedCall", "Landed", "SettleSink"]


class CallContext(NamedTuple):
    """What a guarded call was when it was reserved: the audit record's fixed half.

    A NamedTuple, as the ledger's Settle, rather than a frozen record: every guarded call makes one, and a
    frozen record sets each of its 13 fields through object.__setattr__, a cost on every call's path.
    """

    hold_id: str
    run_id: str
    model: str
    day: str
    endpoint: str
    reserved: int
    reserved_cost: int
    key_fingerprint: str | None
    started_at: float
    pid: int
    would_block: bool
    blocked_by: str | None
    output_bound: int | None = None  # the whole-output bound the guard set on the request, if it set one
    drawn: Drawn | None = None  # admitted from an advance of its process (quotawrap.admission.advances)
    bound_how: str | None = None  # how the guard set it (admission.ADDED or REPLACED)

    @classmethod
    def of_hold(
        cls, hold: HoldRequest, decision: Decision, now: float, output_bound: int | None, bound_how: str | None = None
    ) -> CallContext:
        blocking = decision.verdict.blocking
        drawn = None if decision.advance_id is None else Drawn.of(decision.advance_id, hold, now)
        return cls(
            hold_id=hold.hold_id,
            run_id=hold.run_id,
            model=hold.model,
            day=hold.day,
            endpoint=hold.endpoint,
            reserved=hold.reserve,
            reserved_cost=hold.reserve_cost,
            key_fingerprint=hold.key_fingerprint,
            started_at=now,
            pid=hold.pid,
            would_block=blocking is not None,
            blocked_by=blocking.name if blocking else None,
            output_bound=output_bound,
            drawn=drawn,
            bound_how=bound_how,
        )

    def record(
        self,
        state: CallState,
        usage: Usage | None,
        cost: int,
        latency_s: float,
        *,
        tags: Mapping[str, str],
        ended_at: float,
        host: str,
    ) -> CallRecord:
        """The audit record of the call once it ended as ``state``."""
        return CallRecord(
            id=self.hold_id,
            run_id=self.run_id,
            model=self.model,
            day=self.day,
            endpoint=self.endpoint,
            state=state,
            reserved=self.reserved,
            charged=(usage.total_tokens if usage else self.reserved) if state in ("settled", "unresolved") else 0,
            reserved_cost=self.reserved_cost,
            charged_cost=cost,
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            reasoning_tokens=usage.reasoning_tokens if usage else None,
            cached_tokens=usage.cached_tokens if usage else None,
            overshoot=usage is not None and usage.total_tokens > self.reserved,
            would_block=self.would_block,
            blocked_by=self.blocked_by,
            key_fingerprint=self.key_fingerprint,
            tags=tags,
            started_at=self.started_at,
            ended_at=ended_at,
            latency_s=latency_s,
            pid=self.pid,
            host=host,
        )


class Landed(NamedTuple):
    """What a call's settle means once it has landed: its room is free, its usage is learned from, and its
    audit record is written (the sink does all three, so the call is not called back)."""

    context: CallContext
    state: CallState
    usage: Usage | None
    cost: int
    latency_s: float
    anomaly: str | None


class Followup(Protocol):
    """Settles a call whose answer means more than its usage (a video task created or polled, a context)."""

    def finish(self, hold_id: str | None, status: int, body: bytes, complete: bool) -> bool:
        """Handle the end of the answer to the call holding ``hold_id``; True when nothing else is to be settled."""
        ...


class SettleSink(Protocol):
    """All a guarded call sees of the process that admitted it (quotawrap.settling.sink.Landing), so this module
    imports nothing above it."""

    def land(self, settle: Settle, landed: Landed | None, bound: BoundEvent | None = None) -> None:
        """Queue or send ``settle``; once it has landed, free the room, learn and audit as ``landed`` says."""
        ...

    def flush(self, timeout: float = -1) -> bool:
        """Land this process's settles in transit; False when they did not land within ``timeout``."""
        ...

    def price(self, model: str, usage: Usage, rule: CostRule | None = None) -> int:
        """The micro-CNY ``usage`` cost (``rule``: per image, plugin fees, batch discount)."""
        ...

    def record_bound(self, bound: BoundEvent) -> None:
        """Record the bound event of a call no settle carries (a followup settled it)."""
        ...


_FLUSH_S = 10.0  # a store that does not answer by then: the waiter polls the ledger anyway
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class GuardedCall:
    """One guarded request's life after the reservation. Thread-safe; settles exactly once."""

    # Headers every guarded request gets: a tee cannot read a compressed body it cannot decode.
    HEADER_OVERRIDES: Mapping[str, str] = {"accept-encoding": "identity"}

    # What every call starts with, as class attributes that an instance shadows once it changes them:
    # set in __init__, they cost a store each on every guarded call. Only immutable values here.
    anomaly: str | None = None  # why the answer's usage was not believed, if it was not
    _status = 0
    _sse: SSEUsageReader | None = None
    _decompress: Any = None
    _undecodable = False
    _redirected = False
    url = ""
    route: endpoints.Route | None = None
    cost_rule: CostRule | None = None
    followup: Followup | None = None
    endpoint_id: str | None = None  # the endpoint id the request named: its answer says which model it serves
    # (that endpoint, its lease's holder) when no model was known for it: its end lets the next such call go
    probe: Callable[[], None] | None = None
    # the guard's, handed over at admission where needed: a redirect's next hop, a named endpoint's answer
    on_redirect: Callable[[str, str, endpoints.Route], None] | None = None
    on_answer: Callable[[GuardedCall, object], None] | None = None
    _answer_model: object = None  # the model a JSON answer names (model_of_body), read for endpoint calls only

    def __init__(
        self,
        hold_id: str | None,
        model: str,
        *,
        new_body: bytes | None = None,
        hide_usage_chunk: bool = False,
        blocked: SyntheticResponse | None = None,
        sink: SettleSink | None = None,
        context: CallContext | None = None,
        bound: UsageBound | None = None,
    ) -> None:
        self._bound = bound
        self._sink = sink
        self._context = context
        self.hold_id = hold_id
        self.model = model
        self.new_body = new_body
        self.blocked = blocked
        self._hide = hide_usage_chunk
        self._lock = threading.Lock()
        self._done = blocked is not None
        self._started = time.monotonic()
        self._chunks: list[bytes] = []

    @classmethod
    def refused(cls, response: SyntheticResponse) -> GuardedCall:
        return cls(None, "", blocked=response)

    # -- driven by the adapter --------------------------------------------------------------

    def response_started(self, status: int, headers: Mapping[str, str], *, decoded: bool = False) -> None:
        """``decoded``: the adapter hands the tee already-decompressed bytes (requests does)."""
        self._status = status
        # only a redirect's Location is read: each header lookup costs a case-insensitive search
        location = (headers.get("location") or headers.get("Location")) if status in _REDIRECTS else None
        if location and self.on_redirect is not None and self.route is not None:
            # The hop bills nothing; the client may re-send the call there, which must be guarded too.
            self._redirected = True
            self.on_redirect(self.url, location, self.route)
        encoding = "identity" if decoded else (headers.get("content-encoding") or "identity").lower().strip()
        if encoding in ("gzip", "x-gzip"):
            self._decompress = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._decompress = zlib.decompressobj()
        elif encoding != "identity":
            self._undecodable = True  # the provider ignored accept-encoding: identity
        if is_event_stream(headers.get("content-type")):
            # Hiding rewrites bytes, which is only possible on the identity encoding.
            self._sse = SSEUsageReader(hide_usage_only_chunk=self._hide and encoding == "identity")

    def feed(self, chunk: bytes) -> bytes:
        """Observe body bytes as they pass; returns the bytes to hand on to the caller."""
        if self._done or not chunk:
            return chunk
        try:
            data = self._decompress.decompress(chunk) if self._decompress is not None else chunk
            if self._sse is not None:
                out = self._sse.feed(data)
                return out if self._decompress is None else chunk
            self._chunks.append(data)
        except Exception as exc:  # a tee must never break the caller's read
            self._undecodable = True
            warn(f"cannot decode the answer of a call to {self.model} ({exc}); charging its whole hold")
        return chunk

    def tee(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """Hand a body's chunks on while observing them; settle at the end, on close or on error."""
        try:
            for chunk in chunks:
                out = self.feed(chunk)
                if out:
                    yield out
        except GeneratorExit:  # the caller stopped reading
            self.close()
            raise
        except BaseException as exc:
            self.failed(exc, sent=True)
            raise
        tail = self.finish()
        if tail:
            yield tail

    async def atee(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """:meth:`tee` for an async body."""
        try:
            async for chunk in chunks:
                out = self.feed(chunk)
                if out:
                    yield out
        except GeneratorExit:
            self.close()
            raise
        except BaseException as exc:
            self.failed(exc, sent=True)
            raise
        tail = self.finish()
        if tail:
            yield tail

    @property
    def streaming(self) -> bool:
        """The answer is an event stream (its usage comes at its end): one a program may leave unread."""
        return self._sse is not None and not self._done

    def flush(self) -> None:
        """Wait until this process's queued settles have landed (a read-ahead's, before it says it is done)."""
        if self._sink is not None:
            self._sink.flush(timeout=_FLUSH_S)

    def finish(self) -> bytes:
        """End of the body: settle. Returns bytes the SSE reader was still holding back."""
        tail = b""
        if self._sse is not None and not self._done and self._decompress is None:
            tail = self._sse.finish()
        self._settle(complete=True)
        return tail

    def close(self) -> None:
        """The caller closed the body (maybe before the end)."""
        self._settle(complete=False)

    def failed(self, exc: BaseException, *, sent: bool) -> None:
        """The request raised: never sent -> release; sent, outcome unknown -> charge the hold."""
        with self._lock:
            if self._done:
                return
            self._done = True
        self._apply("charge" if sent else "release", None)

    # -- settlement -------------------------------------------------------------------------

    def _outcome(self, complete: bool) -> tuple[str, Usage | None]:
        if self._redirected:
            return "release", None
        if self._undecodable:
            return "charge", None
        if self._sse is not None:
            usage = self._believed(self._sse.usage if self._sse.done else None)
            if usage is not None:
                return "settle", usage
            if self.anomaly is not None:
                return "charge", None
            return ("release", None) if self._status >= 400 else ("charge", None)
        if not complete:
            return ("release", None) if self._status >= 400 else ("charge", None)
        body = b"".join(self._chunks)
        if self.endpoint_id is not None:
            self._answer_model = model_of_body(body)
        usage = self._believed(usage_from_body(body))
        if usage is not None:
            return "settle", usage
        if self.anomaly is None and self._status >= 400 and (self._status < 500 or _is_error_body(body)):
            return "release", None
        return "charge", None

    def _believed(self, usage: Usage | None) -> Usage | None:
        checked = check_usage(usage, self._bound)
        self.anomaly = checked.anomaly
        return checked.usage

    def _settle(self, *, complete: bool) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            followup = self.followup if self._sse is None and not self._undecodable else None
        # outside the lock, which _done already made ours (a followup does ledger I/O)
        try:
            if followup is not None:
                body, self._chunks = b"".join(self._chunks), []
                if followup.finish(self.hold_id, self._status, body, complete):
                    self._record_bound()  # the followup settled it, or will
                    return
                self._chunks = [body]
            action, usage = self._outcome(complete)
        except Exception as exc:  # never the caller's problem: charge the hold
            warn(f"cannot read the usage of a call to {self.model} ({type(exc).__name__}: {exc})")
            action, usage = "charge", None
        if self.hold_id is None:
            return
        if self.on_answer is not None and action != "release":
            answered = self._sse.model if self._sse is not None else self._answer_model
            try:  # learned and moved to the model it is, before the settle is priced and lands
                self.on_answer(self, answered)
            except Exception as exc:  # never the caller's problem: it settles where it was held
                warn(f"could not learn the model of {self.endpoint_id} ({type(exc).__name__}: {exc})")
        if self.anomaly is not None:
            warn(
                f"usage anomaly in the answer of a call to {self.model}: {self.anomaly};"
                " not believed, charged its whole hold (unresolved)"
            )
        elif action == "charge" and self._status < 400:
            warn(f"no usage in the answer of a call to {self.model}: charged its whole hold (unresolved)")
        self._apply(action, usage)

    def _apply(self, action: str, usage: Usage | None) -> None:
        self._chunks = []
        if self.probe is not None:
            self.probe()
        if self.hold_id is None or self._sink is None:
            return
        latency = time.monotonic() - self._started
        cost = 0
        try:
            if action != "release":
                if usage is not None:
                    cost = self._sink.price(self.model, usage, self.cost_rule)
                elif self._context is not None:
                    cost = self._context.reserved_cost
        except Exception as exc:
            # The hold stays open and the wrapper charges it at exit; the caller's answer is intact.
            warn(f"could not settle a call to {self.model}: {exc}; the wrapper will charge its hold")
            self._record_bound(usage)
            return
        event: Literal["settle", "release"] = "release" if action == "release" else "settle"
        landed = None
        if self._context is not None:
            state: CallState = "released" if action == "release" else ("settled" if usage else "unresolved")
            landed = Landed(self._context, state, usage, cost, latency, self.anomaly)
        drawn = None if self._context is None else self._context.drawn
        settle = Settle(self.hold_id, event, usage, latency, cost, self.anomaly, drawn)
        self._sink.land(settle, landed, self._bound_event(usage))

    @property
    def context(self) -> CallContext | None:
        return self._context

    def moved_to(self, context: CallContext) -> None:
        """The call's hold was handed over to another (its answer named another model): it settles that one."""
        self._context = context
        self.hold_id = context.hold_id
        self.model = context.model

    def _bound_event(self, usage: Usage | None = None) -> BoundEvent | None:
        """The call's ``bound`` event, None unless the guard bounded it; cut short when its ``usage`` says so."""
        context = self._context
        if context is None or context.output_bound is None:
            return None
        cut = usage is not None and cut_short(usage.completion_tokens, context.output_bound)
        return (context.model, context.output_bound, context.pid, context.bound_how or ADDED, cut)

    def _record_bound(self, usage: Usage | None = None) -> None:
        """The call's bound event where no settle carries it (the sink's land records it with the others)."""
        bound = self._bound_event(usage)
        if self._sink is not None and bound is not None:
            self._sink.record_bound(bound)


def _is_error_body(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)
