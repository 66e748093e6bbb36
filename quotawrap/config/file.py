"""quotawrap.toml: where it is, its option values, and the tables other features own (``[prices]``).

Apart from :mod:`quotawrap.config.settings`, which owns the option table these values are checked against:
a guarded command reads the file before its child starts, and the table's module stays small.
"""

from __future__ import annotations

import os

from ..core.errors import ConfigError
from .settings import CONFIG_FILE, OPTION_BY_NAME, RETIRED, Settings, parse_value, say_retired

TYPE_CHECKING = False  # importing typing itself would slow a guarded command's start
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

    from ..core.prices import PriceTable

__all__ = ["config_path", "config_section", "load_config_file", "load_price_table"]


def config_path(path: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file in force: ``path``, ``$QUOTAWRAP_CONFIG`` or ``./quotawrap.toml``, if it exists."""
    candidate = os.fspath(path or os.environ.get("QUOTAWRAP_CONFIG") or CONFIG_FILE)
    if not os.path.isfile(candidate):
        return None  # the usual run: pathlib stays unloaded
    from pathlib import Path

    return Path(candidate).resolve()


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def config_section(name: str) -> dict[str, Any]:
    """A table of the config file (``[prices]``, ...) for the feature that owns it; {} if absent."""
    candidate = config_path()
    section = _read_toml(candidate).get(name, {}) if candidate is not None else {}
    if not isinstance(section, dict):
        raise ConfigError(f"{candidate}: [{name}] must be a table")
    return section


def load_config_file(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Read ``quotawrap.toml`` (top-level keys are option names, dashes or underscores).

    Looks at ``$QUOTAWRAP_CONFIG``, else ``./quotawrap.toml``; a missing file is no error.
    """
    candidate = config_path(path)
    if candidate is None:
        return {}
    data = _read_toml(candidate)
    values: dict[str, Any] = {}
    for key, raw in data.items():
        name = key.replace("-", "_")
        option = OPTION_BY_NAME.get(name)
        if option is None:
            if isinstance(raw, dict):
                continue  # sections (prices, models) belong to other features
            if name in RETIRED:
                say_retired(name)
                continue
            raise ConfigError(f"{candidate}: unknown setting {key!r}")
        try:
            values[name] = parse_value(option, raw)
        except ConfigError as exc:
            raise ConfigError(f"{candidate}: {exc}") from exc
    return values


def load_price_table(settings: Settings) -> PriceTable:
    """The table in force for a run: bundled prices plus ``[prices]`` of quotawrap.toml, with the policy."""
    from ..core.prices import load_overrides  # the table is built only when a call needs it

    # Settings checked the policy when it was built
    return load_overrides(config_section("prices"), unknown_price=settings.unknown_price)  # type: ignore[arg-type]
