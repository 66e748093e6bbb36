"""Video tasks: a hold that outlives the request that took it.

``POST /contents/generations/tasks`` only creates a task; Seedance bills the video when the
task succeeds, and the usage appears only on a later ``GET /contents/generations/tasks/{id}``
(or in the task list). So the create reserves as any guarded call does, and when its answer
names the task the hold is handed over to a hold named after the task, ``task-<id>``, valid
for ``--task-hold-ttl``. A poll that reads the task settles that hold exactly (succeeded) or
frees it (failed, cancelled, expired: nothing was billed). A task nobody polls stays held
until the wrapper charges the run's open holds at exit (or ``reclaim`` does, when its owner
died or its validity ran out); a poll that comes later still corrects the charge to the usage.

The hand-over uses only the Ledger protocol: the task's hold is reserved with no limits (the
capacity was already admitted by the create's hold, which is released right after, so for
a moment the amount is counted twice, never zero times). The create's row is released
``handed_to`` the task's hold, so reports and totals count the task as one call: its own row.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from ..core.endpoint_prices import CostRule
from ..core.errors import QuotawrapError
from ..core.usage import Usage, check_usage, usage_from_mapping
from ..ledger import CallPath, HoldRequest, Reader
from ..ledger.base import CallRecord
from ..support.log import warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..config.settings import Settings
    from ..ledger.endpoint_ids import EndpointIds
    from .call import CallContext, GuardedCall

__all__ = ["TASK_HOLD_PREFIX", "TaskCreated", "TaskPolled", "TaskServices", "open_task_holds", "task_hold_id"]

TASK_HOLD_PREFIX = "task-"
_UNBILLED = frozenset({"failed", "cancelled", "canceled", "expired"})


class TaskServices(Protocol):
    """What a video task's follow-up needs of its process (the guard satisfies it): the store, the clock, the
    run's host and tags, the task hold's validity, the endpoint ids and the price table. This module never
    imports the guard."""

    @property
    def settings(self) -> Settings: ...

    @property
    def ledger(self) -> CallPath: ...

    @property
    def host(self) -> str: ...

    @property
    def tags(self) -> dict[str, str]: ...

    @property
    def endpoint_ids(self) -> EndpointIds: ...

    def clock(self) -> float: ...

    def actual_cost(self, model: str, usage: Usage, rule: CostRule | None = None) -> int: ...


def task_hold_id(task_id: str) -> str:
    return TASK_HOLD_PREFIX + task_id


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


class TaskCreated:
    """Follows a guarded create: hands its hold over to the task it created."""

    def __init__(self, guard: TaskServices, context: CallContext) -> None:
        self._guard = guard
        self._context = context

    def finish(self, call: GuardedCall, status: int, body: bytes, complete: bool) -> bool:
        """True when the hold was handed over (the caller must not settle it as well)."""
        data = _json(body) if complete and 200 <= status < 300 else None
        task_id = data.get("id") if isinstance(data, dict) else None
        if not isinstance(task_id, str) or not task_id or call.hold_id is None:
            return False  # ordinary settling: an error is released, an unreadable answer charged
        context = self._context
        hold = HoldRequest(
            run_id=context.run_id,
            model=context.model,
            day=context.day,
            reserve=context.reserved,
            endpoint="video_task",
            pid=context.pid,
            host=self._guard.host,
            expires_at=self._guard.clock() + self._guard.settings.task_hold_ttl,
            key_fingerprint=context.key_fingerprint,
            tags=self._guard.tags,
            reserve_cost=context.reserved_cost,
            hold_id=task_hold_id(task_id),
        )
        ledger = self._guard.ledger
        try:
            ledger.reserve(hold, lambda _snapshot: ())
            ledger.release(call.hold_id, handed_to=hold.hold_id)
        except QuotawrapError as exc:
            warn(f"could not hand the hold of video task {task_id} over to the task: {exc}; the wrapper charges it")
        return True


class TaskPolled:
    """Follows a GET of a task (or of the task list): settles what the answer says has ended."""

    def __init__(self, guard: TaskServices) -> None:
        self._guard = guard

    def finish(self, call: GuardedCall, status: int, body: bytes, complete: bool) -> bool:
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
        ledger = self._guard.ledger
        try:
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
                model = self._guard.endpoint_ids.resolve(named).model if isinstance(named, str) and named else ""
                cost = self._guard.actual_cost(model, usage, CostRule("video_task")) if model else None
                ledger.settle(task_hold_id(task_id), usage, cost=cost)
            elif state in _UNBILLED:
                ledger.release(task_hold_id(task_id))
        except QuotawrapError as exc:
            warn(f"could not settle video task {task_id}: {exc}; the wrapper charges its hold")


def open_task_holds(ledger: Reader, now: float, *, within_s: float = 7 * 86400) -> list[CallRecord]:
    """Video tasks still held: created, not yet seen to end by any poll."""
    return [
        record
        for record in ledger.call_records(since=now - within_s)
        if record.state == "held" and record.id.startswith(TASK_HOLD_PREFIX)
    ]
