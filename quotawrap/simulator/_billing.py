"""What the simulated provider charged, and the billing API's view of prepaid token packages.

`BillBook` is the thread-safe bill: one `BillRecord` per generation, timestamped by the
simulator's clock. `report_packages` replays that log against the configured packages:

* each bill draws FIFO from its model's packages that were effective when it was billed
  (earliest effective_time first); what no package covers is post-paid and draws nothing;
* the billing view lags: at time `now` only bills made at or before `now - balance_lag_s` count;
  with batch settlement (`settle_every_s`), only those up to the last batch boundary before that
  (`settled_until`): the lag then saws between the delay and the delay + one period (§4.2's
  "periodic convergence");
* a package whose expiry_time has passed reports Status "Expired" and AvailableAmount "0";
  one not yet effective reports "NotEffective"; an emptied one "UsedUp"; otherwise "Effective".

`list_resource_packages` applies ListResourcePackages' request rules (MaxResults a string of at most
"20", NextToken paging, Status/Product filters) to those items.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.records import Record
from ._config import PackageSpec, format_utc

__all__ = [
    "MAX_RESULTS_LIMIT",
    "RESOURCE_TYPES",
    "STATUSES",
    "BillBook",
    "BillRecord",
    "BillingRequestError",
    "list_endpoints",
    "list_resource_packages",
    "report_packages",
    "settled_until",
]

MAX_RESULTS_LIMIT = 20
RESOURCE_TYPES = frozenset({"Package", "RI", "RSC"})
STATUSES = frozenset({"NotEffective", "Effective", "FailedToCreate", "UsedUp", "Expired", "Refunded"})


class BillRecord(Record, frozen=True):
    """One billed generation."""

    t: float
    model: str
    path: str
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class BillBook:
    """Thread-safe record of requests seen and generations billed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bills: list[BillRecord] = []
        self._requests: collections.Counter[str] = collections.Counter()

    def count_request(self, path: str) -> None:
        with self._lock:
            self._requests[path] += 1

    def bill(self, record: BillRecord) -> None:
        with self._lock:
            self._bills.append(record)

    def records(self) -> list[BillRecord]:
        with self._lock:
            return list(self._bills)

    def requests_by_path(self) -> dict[str, int]:
        with self._lock:
            return dict(self._requests)

    def reset(self) -> None:
        with self._lock:
            self._bills.clear()
            self._requests.clear()

    def stats(self) -> dict[str, Any]:
        """The `GET /_sim/stats` body, from one consistent snapshot."""
        with self._lock:
            bills = list(self._bills)
            requests = dict(self._requests)
        by_model: dict[str, int] = {}
        for bill in bills:
            by_model[bill.model] = by_model.get(bill.model, 0) + bill.total_tokens
        return {
            "billed_total": sum(by_model.values()),
            "billed_by_model": by_model,
            "calls": len(bills),
            "requests_by_path": requests,
        }


class _Balance(Record, frozen=True):
    spec: PackageSpec
    index: int  # position in the config: a stable InstanceNo
    remaining: int


def _replay(specs: Sequence[PackageSpec], bills: Sequence[BillRecord], visible_until: float) -> list[_Balance]:
    remaining = [spec.total for spec in specs]
    order = sorted(range(len(specs)), key=lambda i: (specs[i].effective_time, i))
    for bill in sorted(bills, key=lambda b: b.t):
        if bill.t > visible_until:
            break
        owed = bill.total_tokens
        for i in order:
            spec = specs[i]
            if owed == 0:
                break
            if spec.model != bill.model or not spec.effective_time <= bill.t < spec.expiry_time:
                continue
            take = min(owed, remaining[i])
            remaining[i] -= take
            owed -= take
    return [_Balance(spec, i, remaining[i]) for i, spec in enumerate(specs)]


def _status(balance: _Balance, now: float) -> str:
    if balance.spec.expiry_time <= now:
        return "Expired"
    if balance.spec.effective_time > now:
        return "NotEffective"
    return "UsedUp" if balance.remaining == 0 else "Effective"


def _item(balance: _Balance, now: float) -> dict[str, str]:
    spec = balance.spec
    status = _status(balance, now)
    name = spec.name or f"{spec.model} 免费资源包"
    effective = format_utc(spec.effective_time)
    return {
        "AvailableAmount": "0" if status == "Expired" else str(balance.remaining),
        "TotalAmount": str(spec.total),
        "Unit": "token",
        "EffectiveTime": effective,
        "ExpiryTime": format_utc(spec.expiry_time),
        "BillTime": effective,
        "Status": status,
        "ConfigurationCode": spec.code or f"ark_free_{spec.model}",
        "ConfigurationName": name,
        "Specification": spec.model,
        "SpecificationUnit": "token",
        "SpecCalculateFactor": "1",
        "InstanceNo": f"RP-sim-{balance.index:06d}",
        "InstanceName": name,
        "Product": "ark",
        "ProductName": "火山方舟",
        "PackageType": "Normal",  # GUESS: Ark's real value is unknown; only "Periodic" is documented
        "ResetPeriod": "",
        "ResetByNaturalMonth": "false",
        "RegionCode": "cn-beijing",
        "ZoneCode": "",
        "OwnerID": "2100000000",
        "UserName": "simulator",
        "SubjectNo": "SIM-SUBJECT",
    }


def settled_until(now: float, delay_s: float, settle_every_s: float = 0.0) -> float:
    """The latest bill time the billing view shows at `now`: `now - delay`, rounded down to a batch."""
    visible = now - delay_s
    if settle_every_s <= 0:
        return visible
    return (visible // settle_every_s) * settle_every_s


def report_packages(
    specs: Sequence[PackageSpec],
    bills: Sequence[BillRecord],
    now: float,
    balance_lag_s: float,
    settle_every_s: float = 0.0,
) -> list[dict[str, str]]:
    """The billing API's items at `now`, newest effective first (the API sorts newest-created first)."""
    balances = _replay(specs, bills, settled_until(now, balance_lag_s, settle_every_s))
    balances.sort(key=lambda b: (b.spec.effective_time, b.index), reverse=True)
    return [_item(balance, now) for balance in balances]


class BillingRequestError(ValueError):
    """A ListResourcePackages request the real API would reject; `code` is the Volcengine error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _max_results(value: Any) -> int:
    if value is None or value == "":
        raise BillingRequestError("MissingParameter", "MaxResults is required")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).isdigit():
        raise BillingRequestError("InvalidParameter", f"MaxResults must be a numeric string, got {value!r}")
    number = int(value)
    if not 1 <= number <= MAX_RESULTS_LIMIT:
        raise BillingRequestError("InvalidParameter", f"MaxResults must be between 1 and {MAX_RESULTS_LIMIT}")
    return number


def _offset(token: Any) -> int:
    if token is None or token == "":
        return 0
    if not isinstance(token, str) or not token.isdigit():
        raise BillingRequestError("InvalidParameter", f"NextToken {token!r} is not valid")
    return int(token)


def list_resource_packages(items: Sequence[dict[str, str]], request: Mapping[str, Any]) -> dict[str, Any]:
    """The `Result` of ListResourcePackages for `request` over `items`; raises BillingRequestError."""
    resource_type = request.get("ResourceType")
    if not resource_type:
        raise BillingRequestError("MissingParameter", "ResourceType is required")
    if resource_type not in RESOURCE_TYPES:
        raise BillingRequestError("InvalidParameter", f"ResourceType must be one of {sorted(RESOURCE_TYPES)}")
    limit = _max_results(request.get("MaxResults"))
    offset = _offset(request.get("NextToken"))
    status = request.get("Status") or None
    if status is not None and status not in STATUSES:
        raise BillingRequestError("InvalidParameter", f"Status must be one of {sorted(STATUSES)}")
    product = request.get("Product") or None
    selected = [
        item
        for item in (items if resource_type == "Package" else [])
        if (status is None or item["Status"] == status) and (product is None or item["Product"] == product)
    ]
    page = selected[offset : offset + limit]
    next_token = str(offset + limit) if offset + limit < len(selected) else ""
    return {"List": page, "NextToken": next_token}


def list_endpoints(endpoints: Sequence[tuple[str, str]], request: Mapping[str, Any]) -> dict[str, Any]:
    """The `Result` of the ark management API's ListEndpoints over the simulator's (endpoint, model) pairs,
    a page (PageNumber from 1, PageSize) at a time; a model id "<name>-<version>" is its FoundationModel."""
    try:
        number, size = int(request.get("PageNumber") or 1), int(request.get("PageSize") or 10)
    except (TypeError, ValueError):
        raise BillingRequestError("InvalidParameter", "PageNumber and PageSize must be integers") from None
    if number < 1 or not 1 <= size <= 100:
        raise BillingRequestError("InvalidParameter", "PageNumber must be >= 1 and PageSize in [1, 100]")
    items = []
    for endpoint, model in endpoints[(number - 1) * size : number * size]:
        name, _, version = model.rpartition("-")
        foundation = {"Name": name, "ModelVersion": version} if name else {"Name": model, "ModelVersion": ""}
        items.append(
            {"Id": endpoint, "Name": endpoint, "Status": "Running", "ModelReference": {"FoundationModel": foundation}}
        )
    return {"Items": items, "PageNumber": number, "PageSize": size, "TotalCount": len(endpoints)}
