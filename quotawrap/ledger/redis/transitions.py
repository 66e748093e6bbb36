"""The transition scripts' arguments: one JSON object per step, as lib.lua's ``transition_args()`` decodes it.

A step is an event of holds.step's (settle, release, resolve) on one hold, or an advance's (admission/advances.py,
lua/advance.lua): ``draw`` splits a call from its advance, ``close`` gives back what an advance's process did not
draw; a settle of a drawn call splits it first. transition_many.lua takes a batch of them in one call.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from ...core.usage import Usage
from ..advance_endpoints import ADVANCE_CLOSED
from ..base import Drawn
from ..holds import clamp
from .keys import Keys, expire_at
from .options import RedisOptions
from .records import Location

__all__ = ["OWN_DAILY_USAGE_TTL_S", "Step", "anomaly_note", "step_arg", "step_keys"]

OWN_DAILY_USAGE_TTL_S = 48 * 3600  # the LiteLLM limiter's TTL for daily_usage keys (seed §6.1)


class Step(NamedTuple):
    """What a step is about beyond its hold: the usage and cost a settle charges, and an advance's part."""

    usage: Usage | None = None
    latency_s: float | None = None
    cost: int | None = None
    note: tuple[str, str] | None = None  # ("anomaly", why the usage was not believed) or ("handed_to", task)
    drawn: Drawn | None = None  # the call was drawn from this advance; for a close, what is given back


def anomaly_note(anomaly: str | None) -> tuple[str, str] | None:
    """The hold's field that keeps why a settle's usage was not believed (none when it was)."""
    return None if anomaly is None else ("anomaly", anomaly)


def _drawn_fields(event: str, drawn: Drawn, day: str, server_now: float) -> dict[str, object]:
    """lua/advance.lua's ``d``; a close names the endpoint an advance reads once closed."""
    return {
        "advance_id": drawn.advance_id,
        "reserved": clamp(int(drawn.reserved)),
        "reserved_cost": clamp(int(drawn.reserved_cost)),
        "endpoint": ADVANCE_CLOSED if event == "close" else drawn.endpoint,
        "kf": drawn.key_fingerprint or "",
        "started": repr(float(drawn.started_at)),
        "expires": repr(float(drawn.expires_at)),
        "expire_at": expire_at(day, server_now, drawn.expires_at),
    }


def step_arg(
    at: Location,
    hold_id: str,
    event: str,
    step: Step,
    *,
    now: float,
    server_now: float,
    foreign: int,
    options: RedisOptions,
) -> str:
    """The step's one argument; ``now``: the ledger's clock (the usage series' minute, the record's end),
    ``server_now``: the server's (the keys' expiry); ``foreign``: the LiteLLM limiter's usage of the model-day,
    as last read."""
    usage = step.usage
    fields: dict[str, object] = {
        "hold_id": hold_id,
        "mode": event,
        "has_usage": "1" if usage is not None else "0",
        "total": usage.total_tokens if usage else 0,  # clamped by hold_step, as holds.step does
        "prompt": clamp(usage.prompt_tokens) if usage else 0,
        "completion": clamp(usage.completion_tokens) if usage else 0,
        "reasoning": clamp(usage.reasoning_tokens) if usage else 0,
        "cached": clamp(usage.cached_tokens) if usage else 0,
        "latency": "" if step.latency_s is None else repr(float(step.latency_s)),
        "now": repr(now),
        "minute": int(now // 60),
        "expire_at": expire_at(at.day, server_now),
        "audit_max": options.audit_max,
        "foreign": foreign,
        "run_ttl": options.run_ttl_s,
        "own_ttl": OWN_DAILY_USAGE_TTL_S,
        "cost": "" if step.cost is None else int(step.cost),
    }
    if step.note is not None:
        fields[step.note[0]] = step.note[1]
    if step.drawn is not None:
        fields["drawn"] = _drawn_fields(event, step.drawn, at.day, server_now)
    return json.dumps(fields, separators=(",", ":"))


def step_keys(keys: Keys, at: Location, hold_id: str, drawn: Drawn | None) -> list[str]:
    """transition_one's keys, then, for a step that names an advance, the advance's hold and its location."""
    names = keys.transition_one(at.day, at.model, at.run_id, hold_id)
    if drawn is not None:
        names += [keys.hold(at.day, at.model, drawn.advance_id), keys.location(drawn.advance_id)]
    return names
