"""The simulator's settings: one frozen `SimConfig`, patched from Python, JSON or `x-sim-*` headers.

A config is immutable so a request can take one reference at its start and keep a consistent
view while another thread (or `POST /_sim/config`) swaps in a new one.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..core.records import Record

__all__ = [
    "FAULTS",
    "THINKING_AUTO_MODELS",
    "PackageSpec",
    "SimConfig",
    "SimConfigError",
    "apply_headers",
    "apply_patch",
    "format_utc",
    "parse_utc",
]

# implausible_usage: a non-streamed answer reports total_tokens 2**63 (a broken provider or proxy count)
FAULTS = frozenset({"error_500", "error_429", "error_400", "cut", "no_usage", "implausible_usage", "hang"})
HEADER_PREFIX = "x-sim-"
_UTC_FORMAT = "%Y-%m-%dT%H:%M:%SZ"

# Ark's 深度思考 doc (volcengine 82379/1449737, Dec 2025) lists thinking "auto" for these two; a 2026 probe of
# twelve models (anomalyco/models.dev#5518) saw only doubao-seed-1-6-flash-250828 accept it.
THINKING_AUTO_MODELS = ("doubao-seed-1-6-250615", "doubao-1-5-thinking-pro-m-250428", "doubao-seed-1-6-flash-250828")


class SimConfigError(ValueError):
    """A config field or value was rejected; `param` names the field (or header) at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


def parse_utc(value: str) -> float:
    """Parse Volcengine's `yyyy-MM-ddTHH:mm:ssZ` into epoch seconds."""
    parsed = dt.datetime.strptime(value, _UTC_FORMAT).replace(tzinfo=dt.timezone.utc)
    return parsed.timestamp()


def format_utc(epoch_s: float) -> str:
    """Format epoch seconds as Volcengine's `yyyy-MM-ddTHH:mm:ssZ` (UTC)."""
    return dt.datetime.fromtimestamp(epoch_s, tz=dt.timezone.utc).strftime(_UTC_FORMAT)


def _epoch(param: str, value: Any) -> float:
    if isinstance(value, bool):
        raise SimConfigError(param, "expected epoch seconds or yyyy-MM-ddTHH:mm:ssZ")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return parse_utc(value)
        except ValueError:
            pass
    raise SimConfigError(param, f"expected epoch seconds or yyyy-MM-ddTHH:mm:ssZ, got {value!r}")


class PackageSpec(Record, frozen=True):
    """One prepaid token package of one model, as the billing API will report it."""

    model: str
    total: int
    effective_time: float
    expiry_time: float
    name: str | None = None  # ConfigurationName; defaults to "<model> 免费资源包"
    code: str | None = None  # ConfigurationCode; defaults to "ark_free_<model>"

    @classmethod
    def from_json(cls, obj: Mapping[str, Any] | PackageSpec) -> PackageSpec:
        """Build from a JSON object; times may be epoch seconds or `yyyy-MM-ddTHH:mm:ssZ`."""
        if isinstance(obj, PackageSpec):
            return obj
        if not isinstance(obj, Mapping):
            raise SimConfigError("packages", f"each package must be an object, got {obj!r}")
        unknown = set(obj) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise SimConfigError("packages", f"unknown package fields {sorted(unknown)}")
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            raise SimConfigError("packages", "each package needs a non-empty 'model'")
        total = _int("packages.total", obj.get("total"))
        if total < 0:
            raise SimConfigError("packages.total", "must be >= 0")
        for key in ("effective_time", "expiry_time"):
            if key not in obj:
                raise SimConfigError("packages", f"each package needs '{key}'")
        return cls(
            model=model,
            total=total,
            effective_time=_epoch("packages.effective_time", obj["effective_time"]),
            expiry_time=_epoch("packages.expiry_time", obj["expiry_time"]),
            name=_opt_str("packages.name", obj.get("name")),
            code=_opt_str("packages.code", obj.get("code")),
        )

    def to_json(self) -> dict[str, Any]:
        """JSON form with epoch-second times, exact enough to round-trip through `from_json`."""
        return dataclasses.asdict(self)


class SimConfig(Record, frozen=True):
    """How the simulated provider behaves; every field can also be set per request as `x-sim-<field>`."""

    latency_s: float = 0.0  # before the first byte of a successful or faulted answer
    chunk_delay_s: float = 0.0  # between stream frames
    reply_tokens: int = 20  # answer tokens the model wants to say (capped by max_tokens & co)
    reasoning_tokens: int = 0  # >0: the model thinks first (unless thinking is disabled)
    fault: str | None = None  # one of FAULTS
    error_rate: float = 0.0  # probability that a request fails with 500 (when no fault is set)
    error_code: str | None = None  # overrides the Ark error code of error_* faults (e.g. QuotaExceeded)
    tokens_per_chunk: int = 4  # tokens per streamed delta
    hang_s: float = 600.0  # how long "hang" holds the connection (stop() ends it early)
    seed: int | None = None  # seeds error_rate's random draws
    balance_lag_s: float = 0.0  # billing API shows usage only this long after it was billed
    packages: tuple[PackageSpec, ...] = ()
    task_s: float = 0.5  # a video task succeeds (and is billed) this long after its create
    bot_searches: int = 0  # web_search plugin calls each bots answer reports in bot_usage.action_usage
    redirect_to: str | None = None  # answer inference POSTs with a 307 to this base URL + the same path
    require_auth: bool = True  # False: serve requests without a bearer key (clients drop it on cross-origin redirects)
    api_keys: tuple[str, ...] = ()  # the bearer keys accepted (any other is answered 401, as Ark answers one); (): any
    strict: bool = True  # validate requests as Ark does (docs/ark-contract.md); False: accept any model and value
    models: tuple[str, ...] = ()  # model ids served besides the bundled price table's (each also as a family prefix)
    endpoints: tuple[tuple[str, str], ...] = ()  # (endpoint id, foundation model id "<name>-<version>") pairs
    thinking_auto_models: tuple[str, ...] = THINKING_AUTO_MODELS  # models that accept thinking {"type": "auto"}

    def __post_init__(self) -> None:
        for name in ("latency_s", "chunk_delay_s", "hang_s", "balance_lag_s", "task_s"):
            if getattr(self, name) < 0:
                raise SimConfigError(name, "must be >= 0")
        for name in ("reply_tokens", "reasoning_tokens", "bot_searches"):
            if getattr(self, name) < 0:
                raise SimConfigError(name, "must be >= 0")
        if self.tokens_per_chunk < 1:
            raise SimConfigError("tokens_per_chunk", "must be >= 1")
        if not 0.0 <= self.error_rate <= 1.0:
            raise SimConfigError("error_rate", "must be between 0 and 1")
        if self.fault is not None and self.fault not in FAULTS:
            raise SimConfigError("fault", f"must be one of {sorted(FAULTS)} or null, got {self.fault!r}")
        # Accept plain dicts/lists for convenience; store an immutable tuple of specs.
        object.__setattr__(self, "packages", tuple(PackageSpec.from_json(p) for p in self.packages))
        object.__setattr__(self, "models", _names("models", self.models))
        object.__setattr__(self, "thinking_auto_models", _names("thinking_auto_models", self.thinking_auto_models))
        object.__setattr__(self, "endpoints", _endpoints("endpoints", self.endpoints))

    def to_json(self) -> dict[str, Any]:
        """The config as a JSON object (what `GET /_sim/config` returns)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["packages"] = [p.to_json() for p in self.packages]
        data["models"] = list(self.models)
        data["thinking_auto_models"] = list(self.thinking_auto_models)
        data["endpoints"] = dict(self.endpoints)
        return data

    def endpoint_model(self, model: str) -> str | None:
        """The foundation model an endpoint id serves, or None when `model` is no endpoint configured here."""
        for endpoint, served in self.endpoints:
            if endpoint == model:
                return served
        return None


def _float(param: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SimConfigError(param, f"expected a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise SimConfigError(param, f"expected a number, got {value!r}") from None


def _int(param: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SimConfigError(param, f"expected an integer, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise SimConfigError(param, f"expected an integer, got {value!r}") from None
    if not number.is_integer():
        raise SimConfigError(param, f"expected an integer, got {value!r}")
    return int(number)


def _bool(param: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SimConfigError(param, f"expected a boolean, got {value!r}")


_NULL_WORDS = frozenset({"", "none", "null"})


def _opt_str(param: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.lower() in _NULL_WORDS):
        return None
    if not isinstance(value, str):
        raise SimConfigError(param, f"expected a string or null, got {value!r}")
    return value


def _opt_int(param: str, value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.lower() in _NULL_WORDS):
        return None
    return _int(param, value)


def _names(param: str, value: Any) -> tuple[str, ...]:
    """Model ids from a list, or from one comma-separated string (a header or a command line)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise SimConfigError(param, f"expected a list of model ids, got {value!r}")
    return tuple(item.strip() for item in items if item.strip())


def _api_keys(param: str, value: Any) -> tuple[str, ...]:
    """Keys from a list, or from one comma-separated string (a command line); never quoted back."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        raise SimConfigError(param, "expected a list of API keys")
    return tuple(item.strip() for item in items if item.strip())


def _endpoints(param: str, value: Any) -> tuple[tuple[str, str], ...]:
    """Endpoint ids and the foundation model each serves: {"ep-...": "model-version"}, ["ep-...=model-version"],
    a comma-separated string of those, or (endpoint, model) pairs."""
    if isinstance(value, str):
        value = [item for item in value.split(",") if item.strip()]
    if isinstance(value, Mapping):
        items: list[Any] = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise SimConfigError(param, f"expected {{endpoint id: model}} or ['ep-...=model-version'], got {value!r}")
    found: dict[str, str] = {}
    for item in items:
        pair = item.split("=", 1) if isinstance(item, str) else item
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise SimConfigError(param, f"expected ep-...=MODEL-VERSION, got {item!r}")
        endpoint, model = pair[0].strip(), pair[1].strip()
        if not endpoint.startswith("ep-") or not model:
            shown = f"{endpoint}={model}"
            raise SimConfigError(
                param, f"expected ep-...=MODEL-VERSION (Ark endpoint ids start with ep-), got {shown!r}"
            )
        found[endpoint] = model
    return tuple(sorted(found.items()))


def _packages(param: str, value: Any) -> tuple[PackageSpec, ...]:
    if not isinstance(value, (list, tuple)):
        raise SimConfigError(param, "expected a list of packages")
    return tuple(PackageSpec.from_json(p) for p in value)


_COERCE: dict[str, Callable[[str, Any], Any]] = {
    "latency_s": _float,
    "chunk_delay_s": _float,
    "reply_tokens": _int,
    "reasoning_tokens": _int,
    "fault": _opt_str,
    "error_rate": _float,
    "error_code": _opt_str,
    "tokens_per_chunk": _int,
    "hang_s": _float,
    "seed": _opt_int,
    "balance_lag_s": _float,
    "packages": _packages,
    "task_s": _float,
    "bot_searches": _int,
    "redirect_to": _opt_str,
    "require_auth": _bool,
    "api_keys": _api_keys,
    "strict": _bool,
    "models": _names,
    "endpoints": _endpoints,
    "thinking_auto_models": _names,
}
assert set(_COERCE) == {f.name for f in dataclasses.fields(SimConfig)}, "every field needs a coercer"


def apply_patch(config: SimConfig, patch: Mapping[str, Any]) -> SimConfig:
    """Return `config` with the fields in `patch` replaced; values may be JSON or header strings."""
    changes: dict[str, Any] = {}
    for name, value in patch.items():
        coerce = _COERCE.get(name)
        if coerce is None:
            raise SimConfigError(name, f"unknown field; known: {sorted(_COERCE)}")
        changes[name] = coerce(name, value)
    return dataclasses.replace(config, **changes)


# A request may not choose the keys it is checked against.
_NOT_PER_REQUEST = frozenset({"packages", "api_keys"})


def apply_headers(config: SimConfig, headers: Iterable[tuple[str, str]]) -> SimConfig:
    """Apply per-request `x-sim-<field>` headers (dashes stand for underscores)."""
    patch: dict[str, str] = {}
    for raw_name, value in headers:
        name = raw_name.lower()
        if not name.startswith(HEADER_PREFIX):
            continue
        field = name[len(HEADER_PREFIX) :].replace("-", "_")
        if field not in _COERCE or field in _NOT_PER_REQUEST:
            raise SimConfigError(raw_name, "unknown x-sim-* header")
        patch[field] = value.strip()
    if not patch:
        return config
    try:
        return apply_patch(config, patch)
    except SimConfigError as exc:
        header = HEADER_PREFIX + exc.param.replace("_", "-")
        raise SimConfigError(header, exc.message) from None
