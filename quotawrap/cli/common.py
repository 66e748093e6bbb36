"""What every ``quotawrap`` subcommand shares: its flags from the one option table, its settings,
the one-line failure, and the ledger it opens.

Lives apart from :mod:`quotawrap.cli.commands` so the subcommands defined in other modules
(:mod:`quotawrap.cli.ledger_commands`) use it without importing the command group back. click is
imported only by the helpers that build or read click's commands: a plain guarded run never loads it.
"""

from __future__ import annotations

import os

from ..config.settings import OPTIONS, RETIRED, Option, Settings, env_name, parse_value, say_retired
from ..core.errors import EXIT_USAGE, ConfigError
from ..support.log import fail

__all__ = [
    "command_settings",
    "echo",
    "settings_from_values",
    "settings_options",
]

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    F = Callable[..., Any]


def _click_option(option: Option) -> Callable[[F], F]:
    import click

    flag = option.cli_flag
    common: dict[str, Any] = {"envvar": env_name(option.name), "help": option.help, "show_envvar": True}
    if option.type is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", option.name, default=None, **common)
    if option.multiple:
        # Its variable is read in command_settings, not by click (which would split it on whitespace).
        help_text = f"{option.help} [env var: {env_name(option.name)}, comma-separated or a JSON list]"
        return click.option(flag, option.name, multiple=True, type=str, help=help_text)
    return click.option(flag, option.name, type=option.type, default=None, **common)


def _retired_flag(name: str) -> Callable[[F], F]:
    """A retired option's on/off flag, hidden from --help: taken, said to be ignored, its value dropped."""
    import click

    def said(_ctx: click.Context, _param: click.Parameter, value: bool | None) -> None:
        if value is not None:
            say_retired(name)

    flag = name.replace("_", "-")
    return click.option(f"--{flag}/--no-{flag}", default=None, hidden=True, expose_value=False, callback=said)


def settings_options(names: Sequence[str] | None = None) -> Callable[[F], F]:
    """Decorate a command with the flags of these options (all when None), from the one table; a retired
    option's flag goes wherever its successor's does."""
    chosen = [option for option in OPTIONS if names is None or option.name in names]
    retired = [name for name, (successor, _) in RETIRED.items() if names is None or successor in names]

    def decorate(func: F) -> F:
        for option in reversed(chosen):
            func = _click_option(option)(func)
        for name in retired:
            func = _retired_flag(name)(func)
        return func

    return decorate


def command_settings(values: dict[str, Any]) -> Settings:
    """Settings from click's values; a repeatable option not given as a flag comes from its variable."""
    import click

    ctx = click.get_current_context(silent=True)
    for option in OPTIONS:
        if not option.multiple or option.name not in values:
            continue
        given = ctx is not None and ctx.get_parameter_source(option.name) == click.core.ParameterSource.COMMANDLINE
        if not given:
            raw = os.environ.get(env_name(option.name))
            if raw is not None:
                try:
                    values[option.name] = parse_value(option, raw)
                except ConfigError as exc:
                    fail(str(exc), EXIT_USAGE)
    return settings_from_values(values)


def settings_from_values(values: dict[str, Any]) -> Settings:
    """Settings from typed option values; a broken rule is the one-line usage error (exit 2)."""
    try:
        return Settings.from_values(values)
    except ConfigError as exc:  # every option's rule, checked before anything starts
        fail(str(exc), EXIT_USAGE)


def echo(text: str, *, err: bool = False) -> None:
    """A subcommand's output lines on the terminal, each escaped (``_log.printable``): model names, commands
    and provider messages come from the network and programs."""
    import click

    from ..support.log import printable

    click.echo(printable(text, lines=True), err=err)
