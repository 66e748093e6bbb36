"""Follow-ups: a guarded call whose answer means more than its usage, behind one interface (``followup_for``).

**Video tasks: a hold that outlives the request that took it.** ``POST /contents/generations/tasks`` only creates
a task; Seedance bills the video when the task succeeds, and the usage appears only on a later
``GET /contents/generations/tasks/{id}`` (or in the task list). So the create reserves as any guarded call does,
and when its answer names the task the hold is handed over to a hold named after the task, ``task-<id>``, valid
for ``--task-hold-ttl``. A poll that reads the task settles that hold exactly (succeeded) or frees it (failed,
cancelled, expired: nothing was billed). A task nobody polls stays held until the wrapper charges the run's open
holds at exit (or ``reclaim`` does, when its owner died or its validity ran out); a poll that comes later still
corrects the charge to the usage.

The hand-over uses only the Ledger protocol: the task's hold is reserved with no limits (the capacity was already
admitted by the create's hold, which is released right after, so for a moment the amount is counted twice, never
zero times). The create's row is released ``handed_to`` the task's hold, so reports and totals count the task as
one call: its own row.

**Context caches: a context chat reads tokens its request does not carry.** ``/context/chat/completions`` names a
``context_id``; the provider prepends the cached context (billed as cached input) to the messages sent. An
estimate from the request alone would miss those tokens, so the guard remembers, per process, how large each
context it saw created was (``usage.prompt_tokens`` of ``/context/create``) and adds that to a context chat's
reserve. A context created elsewhere (another process, an earlier run) is unknown here: its chats reserve their
own messages only, and the settle still charges what the provider reports.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..core.endpoint_prices import CostRule
from ..core.endpoints import Route
from ..core.errors import QuotawrapError
from ..core.identity import Identity
from ..core.usage import Usage, check_usage, usage_from_body, usage_from_mapping
from ..ledger import CallPath, HoldRequest, Reader
from ..ledger.base import CallRecord
from ..support.log import warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .call import Followup

__all__ = [
    "TASK_HOLD_PREFIX",
    "ContextCreated",
    "ContextSizes",
    "FollowupServices",
    "TaskCreated",
    "TaskPolled",
    "followup_for",
    "open_task_holds",
    "task_hold_id",
]

TASK_HOLD_PREFIX = "task-"
_UNBILLED = frozenset({"failed", "cancelled", "canceled", "expired"})
_MAX_CONTEXTS = 1024


class ContextSizes:
    """Tokens of each context created in this process, by id; thread-safe and bounded."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, context_id: str, tokens: int) -> None:
        with self._lock:
            self._sizes[context_id] = tokens
            self._sizes.move_to_end(context_id)
            while len(self._sizes) > _MAX_CONTEXTS:
                self._sizes.popitem(last=False)

    def size(self, context_id: object) -> int:
        if not isinstance(context_id, str):
            return 0
        with self._lock:
            return self._sizes.get(context_id, 0)


class FollowupServices(NamedTuple):
    """What the follow-ups need of their process, built once by the guard: the store (opened on first use), the
    price table, the clock, the run's host and tags, the task hold's validity, the endpoint ids, the contexts."""

    ledger: Callable[[], CallPath]
    price: Callable[[str, Usage, CostRule | None], int]
    clock: Callable[[], float]
    host: str
    tags: Mapping[str, str]
    task_hold_ttl: float
    resolve: Callable[[str], Identity]  # a model as the request names it, as the ledger keys it
    contexts: ContextSizes


def followup_for(route: Route, hold: HoldRequest | None, services: FollowupServices) -> Followup | None:
    """The follow-up of a call to ``route`` admitted as ``hold`` (None: not reserved, a poll), if it has one."""
    if route.action == "poll":
        return TaskPolled(services)
    if route.endpoint == "video_task" and hold is not None:
        return TaskCreated(services, hold)
    if route.endpoint == "context":
        return ContextCreated(services.contexts)
    return None


def task_hold_id(task_id: str) -> str:
    return TASK_HOLD_PREFIX + task_id


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


class TaskCreated:
    """Follows a guarded create: hands its hold over to the task it created."""

    def __init__(self, services: FollowupServices, hold: HoldRequest) -> None:
        self._services = services
        self._hold = hold

    def finish(self, hold_id: str | None, status: int, body: bytes, complete: bool) -> bool:
        """True when the hold was handed over (the caller must not settle it as well)."""
        data = _json(body) if complete and 200 <= status < 300 else None
        task_id = data.get("id") if isinstance(data, dict) else None
        if not isinstance(task_id, str) or not task_id or hold_id is None:
            return False  # ordinary settling: an error is released, an unreadable answer charged
        services, created = self._services, self._hold
        hold = HoldRequest(
            run_id=created.run_id,
            model=created.model,
            day=created.day,
            reserve=created.reserve,
            endpoint="video_task",
            pid=created.pid,
            host=services.host,
            expires_at=services.clock() + services.task_hold_ttl,
            key_fingerprint=created.key_fingerprint,
            tags=services.tags,
            reserve_cost=created.reserve_cost,
            hold_id=task_hold_id(task_id),
            taken_over=True,
        )
        try:
            ledger = services.ledger()
            ledger.reserve(hold, lambda _snapshot: ())
            ledger.release(hold_id, handed_to=hold.hold_id)
        except QuotawrapError as exc:
            warn(f"could not hand the hold of video task {task_id} over to the task: {exc}; the wrapper charges it")
        return True


class TaskPolled:
    """Follows a GET of a task (or of the task list): settles what the answer says has ended."""

    def __init__(self, services: FollowupServices) -> None:
        self._services = services

    def finish(self, hold_id: str | None, status: int, body: bytes, complete: bool) -> bool:
        data = _json(body) if complete and status == 200 else None
        if isinstance(data, dict):
            listed = data.get("items")
            for item in listed if isinstance(listed, list) else [data]:
                if isinstance(item, dict):
                    self._settle(item)
        return True

    def _settle(self, task: dict[str, Any]) -> None:
        task_id, state = task.get("id"), task.get("status")
        if not isinstance(task_id, str) or not task_id:
            return
        services = self._services
        try:
            ledger = services.ledger()
            if state == "succeeded":
                raw = task.get("usage")
                checked = check_usage(usage_from_mapping(raw) if isinstance(raw, dict) else None)
                usage = checked.usage
                if checked.anomaly is not None:  # charged its hold now, and the ledger says why
                    warn(f"usage anomaly in video task {task_id}: {checked.anomaly}; charged its whole hold")
                    ledger.settle(task_hold_id(task_id), None, anomaly=checked.anomaly)
                    return
                if usage is None:
                    return  # no usage yet: charged its hold at run end, rather than guessed now
                named = task.get("model")  # the model as the ledger keys it (an endpoint id resolved)
                model = services.resolve(named).model if isinstance(named, str) and named else ""
                cost = services.price(model, usage, CostRule("video_task")) if model else None
                ledger.settle(task_hold_id(task_id), usage, cost=cost)
            elif state in _UNBILLED:
                ledger.release(task_hold_id(task_id))
        except QuotawrapError as exc:
            warn(f"could not settle video task {task_id}: {exc}; the wrapper charges its hold")


class ContextCreated:
    """Follows a guarded context create: remembers the context's size, then settles as usual."""

    def __init__(self, sizes: ContextSizes) -> None:
        self._sizes = sizes

    def finish(self, hold_id: str | None, status: int, body: bytes, complete: bool) -> bool:
        if complete and 200 <= status < 300:
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                data = None
            usage = usage_from_body(body)
            if isinstance(data, dict) and isinstance(data.get("id"), str) and usage is not None:
                self._sizes.note(data["id"], usage.prompt_tokens)
        return False  # the create itself settles from its usage like any call


def open_task_holds(ledger: Reader, now: float, *, within_s: float = 7 * 86400) -> list[CallRecord]:
    """Video tasks still held: created, not yet seen to end by any poll."""
    return [
        record
        for record in ledger.call_records(since=now - within_s)
        if record.state == "held" and record.id.startswith(TASK_HOLD_PREFIX)
    ]
