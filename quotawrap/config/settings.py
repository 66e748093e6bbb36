"""Every setting, declared once.

The table ``OPTIONS`` drives the CLI flags, their ``QUOTAWRAP_*`` environment variables,
``quotawrap.toml`` keys and the environment handed to the child: the child rebuilds the very
same :class:`Settings` from the variables the wrapper wrote, so there is one list, not two.

Precedence: command-line flag > environment variable > ``quotawrap.toml`` > built-in default.
"""

from __future__ import annotations

import math
import os

from ..core.errors import ConfigError

# Every guarded command imports this table before its child starts, so it imports nothing heavy:
# no dataclasses (Option and Settings are plain classes), typing, json, re, pathlib, nor the limit
# math (its rules are asked only for a value that is not the default).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

    from ..core.quota import QuotaSettings

    Check = Callable[[Any], "str | None"]  # a value's problem, or None when it is fine

__all__ = [
    "ACCESS_KEY_VARIABLES",
    "CONFIG_FILE",
    "OPTIONS",
    "OPTION_BY_NAME",
    "RETIRED",
    "Option",
    "Settings",
    "env_name",
    "retired_notice",
    "say_retired",
    "sync_source",
]

CONFIG_FILE = "quotawrap.toml"

# QuotaSettings' defaults (tests/unit/test_settings_lean.py holds them equal): the limit math's
# module would slow every guarded command's start, and a default needs no check.
_DAILY_CAP = 2_000_000
_SMALL_BUFFER = 50_000
_USAGE_WALL = 1_950_000
_BALANCE_WALL = 100_000
_BALANCE_LAG_S = 1800.0


class Option:
    """One setting: its flag, ``QUOTAWRAP_*`` variable and toml key, its type, default and rule."""

    __slots__ = ("check", "child", "default", "flag", "help", "multiple", "name", "secret", "type")

    def __init__(
        self,
        name: str,
        type: type,  # int, float, str or bool
        default: Any,
        help: str,
        *,
        multiple: bool = False,
        child: bool = True,  # travels to the child through the environment
        flag: str = "",
        check: Check | None = None,  # the option's rule, applied to flags, environment and toml alike
        secret: bool = False,  # its value is a credential (a webhook's URL): no message shows it
    ) -> None:
        self.name, self.type, self.default, self.help = name, type, default, help
        self.multiple, self.child, self.flag, self.check, self.secret = multiple, child, flag, check, secret

    def __repr__(self) -> str:
        return f"Option({self.name!r}, {self.type.__name__}, {self.default!r})"

    def is_default(self, value: Any) -> bool:
        """``value`` is the built-in default, which every rule accepts (the tests hold it so)."""
        return type(value) is type(self.default) and value == self.default

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def validate(self, value: Any) -> None:
        """Raise a ConfigError naming the flag and its variable when ``value`` breaks the rule."""
        if self.check is None or value is None or self.is_default(value):
            return
        for item in value if self.multiple else (value,):
            problem = self.check(item)
            if problem is not None:
                from ..core.redact import HIDDEN, redact_text

                shown = HIDDEN if self.secret else redact_text(repr(item))
                raise ConfigError(f"{self.cli_flag} ({env_name(self.name)}): {problem}, got {shown}")


def _count(value: Any) -> str | None:
    return None if value >= 0 else "must be a whole number >= 0"


def _quota(field_name: str) -> Check:
    """The limit math owns the rules of its own settings; the table asks it rather than copy them."""

    def check(value: Any) -> str | None:
        from ..core.quota import QuotaSettings

        try:
            QuotaSettings(**{field_name: value})
        except ConfigError as exc:
            return str(exc).rpartition(", got ")[0] or str(exc)
        return None

    return check


def _positive(value: Any) -> str | None:
    return None if value >= 1 else "must be a whole number >= 1"


def _seconds(value: Any) -> str | None:
    return None if math.isfinite(value) and value >= 0 else "must be a finite number of seconds >= 0"


def _days(value: Any) -> str | None:
    return None if math.isfinite(value) and value >= 0 else "must be a finite number of days >= 0"


def _period(value: Any) -> str | None:
    return None if math.isfinite(value) and value > 0 else "must be a finite number of seconds > 0"


def _cny(value: Any) -> str | None:
    return None if math.isfinite(value) and value >= 0 else "must be a finite amount of CNY >= 0"


def _budget(value: Any) -> str | None:
    from ..core.budgets import parse_budget

    try:
        parse_budget(value)
    except ConfigError as exc:
        return str(exc).removeprefix(f"budget {value!r}: ")
    return None


def _price_policy(value: Any) -> str | None:
    from ..core.money import UNKNOWN_PRICE_POLICIES

    return None if value in UNKNOWN_PRICE_POLICIES else f"must be one of {', '.join(UNKNOWN_PRICE_POLICIES)}"


def _reasoning_reserve(value: Any) -> str | None:
    from ..core.estimate import REASONING_RESERVES

    return None if value in REASONING_RESERVES else f"must be one of {', '.join(REASONING_RESERVES)}"


def _pair(value: Any) -> str | None:
    left, sep, right = str(value).partition("=")
    return None if sep and left.strip() and right.strip() else "must be MODEL=TEXT"


def _store(value: Any) -> str | None:
    url = str(value)
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme in ("redis", "rediss", "unix"):
        from urllib.parse import urlsplit  # only for these: a SQLite store's check is on every run's start path

        if scheme == "unix":
            return None if urlsplit(url).path else "a unix:// store needs a socket path (unix:///PATH?db=N)"
        try:
            urlsplit(url).port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            return "the Redis port must be a number (redis://HOST:PORT/DB)"
        return None
    if (scheme and scheme != "sqlite") or (url.startswith("sqlite:") and not url.startswith("sqlite:///")):
        return "must be sqlite:///PATH, redis://HOST:PORT/DB, rediss://..., unix:///PATH or a file path"
    return None


def _base_url(value: Any) -> str | None:
    """An http(s) URL naming a host and, if any, a port from 1 to 65535: the hook, the gateway and
    ``--proxy`` all take the same. Read without urllib.parse, whose import a run's start would pay for."""
    text = str(value)
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return "must be an http:// or https:// URL, e.g. https://ark.cn-beijing.volces.com/api/v3"
    if any(char <= " " or char == "\x7f" for char in text):
        return "must not hold spaces or control characters"
    authority = rest
    for end in "/?#":
        authority = authority.partition(end)[0]
    host = authority.rpartition("@")[2]  # user:password@ is the upstream's business
    if host.startswith("["):  # an IPv6 literal: [::1]:8080
        name, bracket, port = host[1:].partition("]")
        if not bracket or (port and not port.startswith(":")):
            return "has a malformed [IPv6] host"
        port = port[1:]
    else:
        name, _, port = host.partition(":")
    if not name:
        return "names no host"
    if port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return "has a port that is not a number from 1 to 65535"
    return None


def _thresholds(value: Any) -> str | None:
    from ..core.thresholds import parse_thresholds

    try:
        parse_thresholds(str(value))
    except ValueError as exc:
        return str(exc)
    return None


def _retention(value: Any) -> str | None:
    from ..core.durations import parse_retention

    try:
        parse_retention(str(value))
    except ValueError as exc:
        return str(exc).partition(": ")[2]  # the flag's name and the value are the ConfigError's own words
    return None


_RUN_ID_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
_RUN_ID_REST = _RUN_ID_FIRST | frozenset(".:-")


def _run_id(value: Any) -> str | None:
    # it names a file (the unguarded log) and a key: no path separators, no leading dot
    # ([A-Za-z0-9_][A-Za-z0-9_.:-]{0,127}, without importing re: every run checks its new id)
    text = str(value)
    ok = 0 < len(text) <= 128 and text[0] in _RUN_ID_FIRST and all(char in _RUN_ID_REST for char in text)
    return None if ok else "must be 1-128 letters, digits, '_', '.', ':' or '-', not starting with '.', ':' or '-'"


def env_name(name: str) -> str:
    return "QUOTAWRAP_" + name.upper()


OPTIONS: tuple[Option, ...] = (
    Option(
        "store",
        str,
        None,
        "Where spending is recorded: sqlite:///PATH (default: a file in your state directory), or"
        " redis://HOST:PORT/DB to share one set of limits between machines.",
        check=_store,
    ),
    Option(
        "model",
        str,
        (),
        "Guard only models matching this id, prefix or glob (repeatable; none = all).",
        multiple=True,
    ),
    Option(
        "base_url",
        str,
        (),
        "Also guard calls to this OpenAI-compatible API, e.g. http://127.0.0.1:8080/v1 (repeatable; Ark's own"
        " hosts are always guarded).",
        multiple=True,
        check=_base_url,
    ),
    Option(
        "cap_tokens",
        int,
        None,
        "Most tokens this whole run may spend: a call that could go past it is refused (calls done, calls in"
        " flight and this call's largest possible size all count).",
        check=_count,
    ),
    Option(
        "daily_cap",
        int,
        _DAILY_CAP,
        "Most tokens each model may use per day (Beijing time), as Ark's free daily allowance counts them.",
        check=_quota("daily_cap"),
    ),
    Option(
        "small_buffer",
        int,
        _SMALL_BUFFER,
        "Tokens of the free balance (as last read from your account) left unspent, as a safety margin.",
        check=_quota("small_buffer"),
    ),
    Option(
        "usage_wall",
        int,
        _USAGE_WALL,
        "Stop calling a model for the rest of the day once it has used this many tokens today.",
        check=_quota("usage_wall"),
    ),
    Option(
        "balance_wall",
        int,
        _BALANCE_WALL,
        "Stop calling a model already used today once its free balance (as last read) is below this.",
        check=_quota("balance_wall"),
    ),
    Option(
        "balance_lag",
        float,
        _BALANCE_LAG_S,
        "Seconds your account's balance runs behind real usage: tokens used in that time are counted as not"
        " yet billed (0: take the balance as read).",
        check=_quota("balance_lag_s"),
    ),
    Option(
        "thinking_floor",
        int,
        4096,
        "Fewest output tokens reserved for a call to a model that may reason ('think') before answering.",
        check=_count,
    ),
    Option("default_max_tokens", int, 4096, "Output tokens reserved for a call that sets no max_tokens.", check=_count),
    Option("image_tokens", int, 2000, "Tokens reserved for each image in a request.", check=_count),
    Option(
        "wait",
        float,
        600.0,
        "Seconds a call that does not fit only because of calls in flight waits for room (0: refuse at once).",
        check=_seconds,
    ),
    Option(
        "bound",
        bool,
        True,
        "Bound the whole output (reasoning too) of calls that leave it open at the learned allowance.",
    ),
    Option(
        "reasoning_reserve",
        str,
        "ceiling",
        "A call that may think and sets max_tokens: 'ceiling' reserves max_tokens + the model's documented"
        " reasoning ceiling (exact; waits under tight caps), 'learned' + the learned p99 (may overshoot),"
        " 'cut' sends max_tokens as max_completion_tokens (exact; the answer may be cut).",
        check=_reasoning_reserve,
    ),
    Option(
        "events_log",
        str,
        None,
        "File where the command's processes record waits and bounded calls for the summary (default: the state"
        " directory).",
    ),
    Option(
        "hold_ttl",
        float,
        3600.0,
        "Seconds a call's reservation waits for its answer before the call is charged in full as unresolved.",
        check=_period,
    ),
    Option(
        "task_hold_ttl",
        float,
        172800.0,
        "Seconds a video task's reservation waits for a status check to report its usage (then it is charged in full).",
        check=_period,
    ),
    Option(
        "allow_path",
        str,
        (),
        "Let POSTs to this unknown path (suffix or glob) on a guarded host through unguarded (repeatable).",
        multiple=True,
    ),
    Option("watch", bool, False, "Record everything, block nothing (the summary says what would have been)."),
    # Each speed piece of a guarded child, turned off for measuring it against its removal; none changes a sum.
    Option(
        "background_settle",
        bool,
        True,
        "Settle guarded calls on a background thread (off: each settle lands before the caller gets its answer;"
        " advances go with it).",
    ),
    Option(
        "advances",
        bool,
        True,
        "Let a guarded child draw calls from a block reserved ahead, its wrapper landing their settles"
        " (off: every call reserves in the ledger and its process lands the settle).",
    ),
    Option(
        "fail_open", bool, False, "If the store (--store) is unreachable, let calls through unguarded (and say so)."
    ),
    Option(
        "unguarded_log",
        str,
        None,
        "Where --fail-open records the calls it let through unguarded (default: the state directory).",
    ),
    Option(
        "inject_usage",
        bool,
        True,
        "Ask a streamed answer for its token usage when the program did not (the program does not see it), so it"
        " is charged exactly.",
    ),
    Option(
        "run_id",
        str,
        None,
        "This run's name in `quotawrap sessions` and reports; generated when not given.",
        check=_run_id,
    ),
    Option(
        "tag",
        str,
        (),
        "KEY=VALUE attribution tag (repeatable); user, host, git and CI tags are added automatically.",
        multiple=True,
    ),
    Option(
        "budget",
        str,
        (),
        "A budget for this run alone, SELECTOR:AMOUNT/PERIOD[,soft] as `quotawrap budget set` takes it (repeatable):"
        " it limits this run's calls and counts them only.",
        multiple=True,
        child=False,
        check=_budget,
    ),
    Option(
        "cap_cost",
        float,
        None,
        "Most this whole run may cost, in CNY, priced from the price table (calls done, in flight and this call"
        " count).",
        check=_cny,
    ),
    Option("audit_log", str, None, "Also append every guarded call as a JSON line to this file."),
    Option(
        "unknown_price",
        str,
        "conservative",
        "Model without a price: 'conservative' (the table's highest prices, flagged estimated) or 'error'.",
        check=_price_policy,
    ),
    Option(
        "balance_cmd",
        str,
        None,
        "Command printing the free balance as JSON {model: tokens} or model=N lines.",
    ),
    Option(
        "billing_endpoint",
        str,
        None,
        "Where to read the free balance: Volcengine's billing API (default open.volcengineapi.com), or the"
        " simulator's URL for offline runs.",
    ),
    Option(
        "package_match",
        str,
        (),
        "MODEL=TEXT: resource packages whose name contains TEXT belong to MODEL (repeatable).",
        multiple=True,
        check=_pair,
    ),
    Option("sync_interval", float, 1800.0, "Seconds between reads of the free balance.", check=_period),
    Option(
        "sync_interval_low", float, 300.0, "Seconds between reads of the free balance once it is low.", check=_period
    ),
    Option("low_balance", int, 300_000, "Free balance below which it is read more often.", check=_count),
    Option(
        "sync_burst",
        int,
        100_000,
        "Read the free balance at once after this many tokens were used since the last read.",
        check=_count,
    ),
    Option(
        "sync_check", float, 10.0, "Seconds between checks whether the free balance is due to be read.", check=_period
    ),
    Option(
        "linger",
        float,
        60.0,
        "Seconds the run waits for processes the command left running before it totals its calls.",
        child=False,
        check=_seconds,
    ),
    Option(
        "expiry_warning_days",
        float,
        3.0,
        "Warn at the start of a run when a model's free packages expire within this many days.",
        child=False,
        check=_days,
    ),
    Option(
        "proxy",
        bool,
        False,
        "Also start a local guarded gateway for the run and point the child's SDKs at it"
        " (OPENAI_BASE_URL, ARK_BASE_URL, ...): guards programs in any language.",
        child=False,
    ),
    Option(
        "drain_timeout",
        float,
        30.0,
        "Seconds a stopping gateway lets calls in flight finish (longer ones are charged in full).",
        child=False,
        check=_seconds,
    ),
    Option(
        "max_body_mib",
        int,
        64,
        "Largest request body the gateway reads, in MiB (a bigger one gets 413, never sent).",
        child=False,
        check=_positive,
    ),
    Option(
        "header_timeout",
        float,
        10.0,
        "Seconds a gateway connection may take to send a request's headers, from its opening or its previous"
        " answer (then it is closed).",
        child=False,
        check=_period,
    ),
    Option(
        "max_connections",
        int,
        512,
        "Client connections the gateway holds open at once; one more is answered 503 and closed.",
        child=False,
        check=_positive,
    ),
    Option(
        "upstream_key_env",
        str,
        None,
        "quotawrap serve only: the name of the environment variable that holds the provider's API key (e.g."
        " ARK_API_KEY). The gateway then sends that key upstream itself and takes only member keys from its"
        " callers (quotawrap keys add).",
        child=False,
    ),
    Option(
        "allow_unguarded",
        bool,
        False,
        "Let through connections to a guarded API made outside every HTTP client quotawrap guards (they are"
        " counted, not refused).",
    ),
    Option(
        "strict",
        bool,
        False,
        "Stop any Python process of the run that starts without quotawrap's hook (it is reported either way).",
        child=False,
    ),
    Option(
        "retention",
        str,
        "90d",
        "Keep calls this long (90d, 12h, 30m; 'off': never prune); older days are folded into daily aggregates"
        " at a run's end, at most once a day.",
        child=False,
        check=_retention,
    ),
    Option("report_json", str, None, "Write the run's summary as JSON to this path.", child=False),
    Option("fail_on_block", bool, False, "Exit with code 3 when any call was blocked.", child=False),
    Option("quiet", bool, False, "No summary and no live line on stderr.", child=False),
    Option(
        "alert_at",
        str,
        "50,80,100",
        "Percents of a limit (a model's day, the run's cap, a budget) at which the run warns on stderr and"
        " --alert-webhook posts, e.g. 50,80,100.",
        child=False,
        check=_thresholds,
    ),
    Option(
        "alert_webhook",
        str,
        None,
        "Post a Slack-compatible message to this URL when a limit crosses an --alert-at percent: once per limit,"
        " day and percent, whichever run or host sees it first.",
        child=False,
        check=_base_url,
        secret=True,
    ),
    Option(
        "otel",
        bool,
        False,
        "Record each guarded call's input and output tokens as OpenTelemetry metrics (gen_ai.client.token.usage)"
        " on the program's meter provider; needs the OpenTelemetry SDK.",
    ),
)

OPTION_BY_NAME = {option.name: option for option in OPTIONS}

# Options taken out: each name, the option that took its place, and what to say. Still accepted where it was
# (flag, variable, toml key) with one line naming the successor, so an old script or shell keeps running.
RETIRED: dict[str, tuple[str, str]] = {
    "settle_relay": (
        "advances",
        "the wrapper lands a child's settles for its advances only, and --no-advances (QUOTAWRAP_ADVANCES=0)"
        " turns both off",
    ),
}


def retired_notice(name: str) -> str:
    """The one line said when the retired option ``name`` is given: it is ignored, and what replaced it."""
    flag = "--" + name.replace("_", "-")
    return (
        f"{flag} ({env_name(name)}, {name} in {CONFIG_FILE}) is no longer an option and is ignored: {RETIRED[name][1]}"
    )


_retired_said: set[str] = set()


def say_retired(name: str) -> None:
    """Say :func:`retired_notice` on stderr once per process, however many ways the option was given."""
    if name not in _retired_said:
        _retired_said.add(name)
        from ..support.log import warn

        warn(retired_notice(name))


class Settings:
    """Every option's value (its default unless given), checked by its rule when built; immutable.

    A plain class rather than a frozen dataclass: building the dataclass (and importing
    dataclasses, inspect, ast) delayed every guarded command's child.
    """

    __slots__ = (*(option.name for option in OPTIONS), "extra")

    store: str | None
    model: tuple[str, ...]
    base_url: tuple[str, ...]
    cap_tokens: int | None
    daily_cap: int
    small_buffer: int
    usage_wall: int
    balance_wall: int
    balance_lag: float
    thinking_floor: int
    default_max_tokens: int
    image_tokens: int
    wait: float
    bound: bool
    reasoning_reserve: str
    events_log: str | None
    hold_ttl: float
    task_hold_ttl: float
    allow_path: tuple[str, ...]
    background_settle: bool
    advances: bool
    watch: bool
    fail_open: bool
    unguarded_log: str | None
    inject_usage: bool
    run_id: str | None
    tag: tuple[str, ...]
    budget: tuple[str, ...]
    cap_cost: float | None
    audit_log: str | None
    unknown_price: str
    balance_cmd: str | None
    billing_endpoint: str | None
    package_match: tuple[str, ...]
    sync_interval: float
    sync_interval_low: float
    low_balance: int
    sync_burst: int
    sync_check: float
    linger: float
    expiry_warning_days: float
    proxy: bool
    drain_timeout: float
    max_body_mib: int
    header_timeout: float
    max_connections: int
    upstream_key_env: str | None
    allow_unguarded: bool
    strict: bool
    retention: str
    report_json: str | None
    fail_on_block: bool
    quiet: bool
    alert_at: str
    alert_webhook: str | None
    otel: bool
    extra: Mapping[str, Any]  # unknown toml sections, for later features

    def __init__(self, **values: Any) -> None:
        # Every way in (flag, variable, toml, the child's environment, code) ends here.
        unknown = values.keys() - OPTION_BY_NAME.keys() - {"extra"}
        if unknown:
            raise TypeError(f"Settings() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        for option in OPTIONS:
            value = values.get(option.name, option.default)
            option.validate(value)
            object.__setattr__(self, option.name, value)
        object.__setattr__(self, "extra", values.get("extra", {}))

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r}: Settings are immutable (use .replace)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}: Settings are immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and other.__class__ is self.__class__ and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(tuple(self._values().values()))  # a TypeError, as the frozen dataclass's was: extra is a dict

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{name}={value!r}' for name, value in self._values().items())})"

    def __reduce__(self) -> tuple[Any, ...]:  # pickled for a spawned worker as the dataclass was
        return (_settings_from, (self._values(),))

    @property
    def quota(self) -> QuotaSettings:
        from ..core.quota import QuotaSettings

        return QuotaSettings(
            daily_cap=self.daily_cap,
            small_buffer=self.small_buffer,
            usage_wall=self.usage_wall,
            balance_wall=self.balance_wall,
            balance_lag_s=self.balance_lag,
        )

    @property
    def draws_ahead(self) -> bool:
        """Whether a guarded child draws calls from advances, with the draw notes and the relay to its wrapper
        that they need (one piece: the wrapper must learn of every draw). The relay is the settler's way out,
        and --watch changes nothing in the ledger."""
        return self.advances and self.background_settle and not self.watch

    @property
    def package_matches(self) -> dict[str, str]:
        pairs = (entry.partition("=") for entry in self.package_match)
        return {model: text for model, sep, text in pairs if sep and model and text}

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` (each checked by its option's rule, as when built)."""
        return Settings(**{**self._values(), **changes})

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> Settings:
        """Build from already-typed values (click's), ignoring ``None`` for options that have defaults."""
        kwargs: dict[str, Any] = {}
        for name, value in values.items():
            option = OPTION_BY_NAME.get(name)
            if option is None or value is None:
                continue
            kwargs[name] = tuple(value) if option.multiple else value
        return cls(**kwargs)

    # -- environment ------------------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        """The ``QUOTAWRAP_*`` variables that let the child rebuild these settings."""
        env: dict[str, str] = {}
        for option in OPTIONS:
            if not option.child:
                continue
            value = getattr(self, option.name)
            if value is None:
                continue
            if option.multiple:
                # JSON, so a value may hold commas (a tag "note=a,b"); users may write "a,b" by hand
                env[env_name(option.name)] = _json_list(value)
            elif option.type is bool:
                env[env_name(option.name)] = "1" if value else "0"
            else:
                env[env_name(option.name)] = str(value)
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for option in OPTIONS:
            raw = environ.get(env_name(option.name))
            if raw is not None:
                values[option.name] = parse_value(option, raw)
        return cls.from_values(values)


ACCESS_KEY_VARIABLES = ("VOLC_ACCESSKEY", "VOLCENGINE_ACCESS_KEY", "VOLC_ACCESS_KEY_ID")


def sync_source(settings: Settings) -> str | None:
    """Which automatic balance source is configured: "command", "billing-api" or None (manual only).

    Here, not in :mod:`quotawrap.books.balance` or :mod:`quotawrap.books.sync`: every guarded run asks, and
    most have no source, so those modules stay off their start path.
    """
    if settings.balance_cmd:
        return "command"
    if settings.billing_endpoint or any(os.environ.get(name) for name in ACCESS_KEY_VARIABLES):
        return "billing-api"
    return None


def _json_list(values: Any) -> str:
    """``json.dumps(list(values), ensure_ascii=False)`` for strings, without importing json (and re)."""
    try:
        from _json import encode_basestring
    except ImportError:  # pragma: no cover - an interpreter without the C accelerator
        import json

        return json.dumps(list(values), ensure_ascii=False)
    return "[" + ", ".join(encode_basestring(str(value)) for value in values) + "]"


def _settings_from(values: dict[str, Any]) -> Settings:
    return Settings(**values)


def parse_value(option: Option, raw: Any) -> Any:
    """Turn an environment or toml value into the option's type, with a clear error."""
    try:
        if option.multiple:
            if isinstance(raw, list):
                items = raw
            elif str(raw).lstrip().startswith("["):
                import json

                items = json.loads(raw)
                if not isinstance(items, list):
                    raise ValueError(f"not a list: {raw!r}")
            else:
                items = [part for part in str(raw).split(",") if part.strip()]
            return tuple(str(item).strip() for item in items)
        if option.type is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in {"1", "true", "yes", "on"}:
                return True
            if text in {"0", "false", "no", "off", ""}:
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if option.type is int:
            return int(str(raw).replace("_", "").replace(",", ""))
        if option.type is float and isinstance(raw, bool):  # float(True) would quietly be 1.0
            raise ValueError(f"not a number: {raw!r}")
        return option.type(raw)
    except (ValueError, TypeError) as exc:  # TypeError: a toml list or table where a number belongs
        raise ConfigError(f"{option.name} ({env_name(option.name)}): {exc}") from exc
