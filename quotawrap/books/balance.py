"""Where the free balance comes from: the billing OpenAPI, a console reading, or a command.

Each source answers ``{model: [Package, ...]}`` or ``{model: balance}``; :mod:`quotawrap.books.sync`
turns a reading into a snapshot. Packages are matched to models by name: a package belongs
to the longest known model id found in its ConfigurationName / ConfigurationCode /
InstanceName / Specification (or to the text a ``[models.<id>] package_match`` entry of
``quotawrap.toml`` names).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from ..config.settings import ACCESS_KEY_VARIABLES, sync_source  # every run asks: it lives with the options
from ..core.errors import BalanceUnavailable, ConfigError
from ..core.identity import canonical
from ..core.quota import Package

TYPE_CHECKING = False
if TYPE_CHECKING:
    pass

__all__ = [
    "BalanceUnavailable",
    "match_model",
    "openapi_client",
    "packages_from_items",
    "parse_balance_args",
    "read_balance_command",
    "read_billing_api",
    "sync_source",
]

SECRET_KEY_VARIABLES = ("VOLC_SECRETKEY", "VOLCENGINE_SECRET_KEY", "VOLC_SECRET_ACCESS_KEY")
_PAGE_SIZE = "20"  # the API's maximum


def match_model(fields: Iterable[str], models: Sequence[str], package_match: Mapping[str, str]) -> str | None:
    """The model a package belongs to: an explicit match text first, else the longest model id it names."""
    text = " ".join(fields).lower()
    for model, needle in package_match.items():
        if needle.lower() in text:
            return model
    named = [model for model in models if model.lower() in text]
    return max(named, key=len) if named else None


def _utc(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def packages_from_items(
    items: Iterable[Mapping[str, Any]], models: Sequence[str], package_match: Mapping[str, str]
) -> dict[str, list[Package]]:
    """Effective token packages (ListResourcePackages items, all-string fields) per model."""
    found: dict[str, list[Package]] = {}
    for item in items:
        if str(item.get("Status", "Effective")) != "Effective":
            continue
        names = [
            str(item.get(key, ""))
            for key in ("ConfigurationName", "ConfigurationCode", "InstanceName", "Specification")
        ]
        model = match_model(names, models, package_match)
        if model is None:
            continue
        try:
            available = int(float(str(item.get("AvailableAmount", "0"))))
            expires = _utc(str(item["ExpiryTime"])) if item.get("ExpiryTime") else float("inf")
        except (ValueError, KeyError) as exc:
            raise BalanceUnavailable(f"unreadable package {item.get('InstanceNo', '?')}: {exc}") from exc
        found.setdefault(model, []).append(Package(model, available, expires))
    return found


def _credential(names: Sequence[str]) -> str | None:
    return next((os.environ[name] for name in names if os.environ.get(name)), None)


def read_billing_api(
    models: Sequence[str],
    *,
    endpoint: str | None = None,
    package_match: Mapping[str, str] | None = None,
    region: str = "cn-beijing",
) -> dict[str, list[Package]]:
    """``ListResourcePackages`` through the official SDK (``pip install 'quotawrap[volc]'``), all pages.

    ``endpoint`` (``http://127.0.0.1:PORT``) points the SDK at another host, e.g. the simulator.
    """
    try:
        import volcenginesdkbilling
        from volcenginesdkbilling.models import ListResourcePackagesRequest
    except ImportError as exc:
        raise BalanceUnavailable("the billing API needs the VolcEngine SDK: pip install 'quotawrap[volc]'") from exc
    api = volcenginesdkbilling.BILLINGApi(openapi_client(endpoint, region))
    items: list[dict[str, Any]] = []
    token = ""
    try:
        while True:
            page = api.list_resource_packages(
                ListResourcePackagesRequest(
                    resource_type="Package", max_results=_PAGE_SIZE, next_token=token, status="Effective"
                )
            )
            listed = page.list or []
            items.extend(_item_dict(entry) for entry in listed)
            token = page.next_token or ""
            if not token or not listed:
                break
    except Exception as exc:  # the SDK raises its own ApiException and urllib3 errors
        raise BalanceUnavailable(f"billing API ListResourcePackages failed: {exc}") from exc
    return packages_from_items(items, models, package_match or {})


def openapi_client(endpoint: str | None = None, region: str = "cn-beijing") -> Any:
    """The VolcEngine OpenAPI client (``volcenginesdkcore.ApiClient``) every management call signs with: the
    billing API's, the ark management API's. ``endpoint`` (``http://127.0.0.1:PORT``) points it at another
    host, e.g. the simulator. BalanceUnavailable without the SDK or credentials."""
    try:
        import volcenginesdkcore
    except ImportError as exc:
        raise BalanceUnavailable("the VolcEngine OpenAPI needs its SDK: pip install 'quotawrap[volc]'") from exc
    ak, sk = _credential(ACCESS_KEY_VARIABLES), _credential(SECRET_KEY_VARIABLES)
    if not ak or not sk:
        raise BalanceUnavailable(
            f"no VolcEngine credentials: set {ACCESS_KEY_VARIABLES[0]} and {SECRET_KEY_VARIABLES[0]}"
        )
    config = volcenginesdkcore.Configuration()
    config.ak, config.sk, config.region = ak, sk, region
    config.auto_retry = False
    if endpoint:
        scheme, _, host = endpoint.partition("://")
        config.scheme, config.host = (scheme, host.rstrip("/")) if host else ("https", scheme.rstrip("/"))
    return volcenginesdkcore.ApiClient(config)


def _item_dict(entry: Any) -> dict[str, Any]:
    """SDK model object -> the wire's field names (the SDK's attribute_map maps snake to Pascal)."""
    data = entry.to_dict()
    return {entry.attribute_map.get(key, key): value for key, value in data.items()}


def parse_balance_args(values: Sequence[str], flag: str = "--balance") -> dict[str, int]:
    """``MODEL=N`` pairs from ``quotawrap sync --balance`` (or ``--b0``)."""
    balances: dict[str, int] = {}
    for value in values:
        model, sep, number = value.rpartition("=")
        try:
            if not sep or not model:
                raise ValueError
            model = canonical(model)  # the ledger keys models so (quotawrap.core.identity)
            balances[model] = int(number.replace(",", "").replace("_", ""))
        except ValueError:
            raise ConfigError(f"{flag} expects MODEL=TOKENS, got {value!r}") from None
        if balances[model] < 0:
            raise ConfigError(f"{flag} {value!r}: a balance cannot be negative")
    return balances


def read_balance_command(command: str, timeout_s: float = 60.0) -> dict[str, int]:
    """Run ``--balance-cmd``; it prints ``{"model": tokens, ...}`` JSON or ``model=tokens`` lines."""
    try:
        done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BalanceUnavailable(f"balance command {command!r} failed: {exc}") from exc
    if done.returncode != 0:
        raise BalanceUnavailable(f"balance command {command!r} exited {done.returncode}: {done.stderr.strip()[:200]}")
    text = done.stdout.strip()
    try:
        if text.startswith("{"):
            data = json.loads(text)
            return {canonical(str(model)): int(tokens) for model, tokens in data.items()}
        return parse_balance_args([line.strip() for line in text.splitlines() if line.strip()])
    except (ValueError, TypeError, ConfigError) as exc:
        raise BalanceUnavailable(f"balance command {command!r} printed something unreadable: {exc}") from exc
