"""The arguments of a plain guarded run, read without click: ``quotawrap [OPTIONS] [--] COMMAND...``.

Loading click costs a guarded command more than its whole child start-up, so the run reads its
own arguments from the one option table, exactly as click's ``run`` would, or declines: anything
it does not read the way click does (a subcommand, ``--help``, an unknown or misspelt flag, a value
click would reject with its own message) returns None and click parses the whole line as before.
``tests/unit/test_run_args.py`` holds it to click's result over generated command lines.

Where a value comes from, first found: the flag, its ``QUOTAWRAP_*`` variable, ``quotawrap.toml``,
the built-in default (a repeatable option's variable is read as :func:`cli.common.command_settings`
reads it: JSON list or comma-separated, and also when it is set but empty).
"""

from __future__ import annotations

from ..config.settings import OPTIONS, Option, env_name, parse_value

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from typing import Any

__all__ = ["SUBCOMMANDS", "RunArgs", "parse_run_args"]

# The command group's subcommands (the test checks this list against click's group).
SUBCOMMANDS = frozenset(
    {
        "run",
        "serve",
        "status",
        "dashboard",
        "report",
        "sessions",
        "sync",
        "prune",
        "simulate",
        "demo",
        "consume",
        "keys",
        "budget",
    }
)
_GROUP_FLAGS = frozenset({"-h", "--help", "--version"})
# click's BoolParamType states; anything else is click's to refuse
_BOOL_STATES = {
    "1": True,
    "0": False,
    "yes": True,
    "no": False,
    "true": True,
    "false": False,
    "on": True,
    "off": False,
    "t": True,
    "f": False,
    "y": True,
    "n": False,
}


def _flags() -> dict[str, tuple[Option, bool | None]]:
    """Each flag spelling: its option and, for an on/off flag, the value it sets."""
    flags: dict[str, tuple[Option, bool | None]] = {}
    for option in OPTIONS:
        if option.type is bool:
            flags[option.cli_flag] = (option, True)
            flags["--no-" + option.cli_flag[2:]] = (option, False)
        else:
            flags[option.cli_flag] = (option, None)
    return flags


_FLAGS = _flags()
_DECLINE = object()


class RunArgs:
    """The option values (click's types, None for unset) and the command to run."""

    def __init__(self, values: dict[str, Any], command: tuple[str, ...]) -> None:
        self.values = values
        self.command = command


def _convert(option: Option, raw: str) -> Any:
    """A value as click's type turns it, or _DECLINE where click would refuse it with its own words."""
    if option.type is bool:
        state = _BOOL_STATES.get(raw.strip().lower())
        return _DECLINE if state is None else state
    if option.type in (int, float):
        try:
            return option.type(raw)
        except ValueError:
            return _DECLINE
    return raw


def _names_no_program(word: str) -> bool:
    from ..support.processes import which

    return which(word) is None


def parse_run_args(args: Sequence[str], environ: Mapping[str, str], config: Mapping[str, Any]) -> RunArgs | None:
    """A plain run's values and command, or None: click is to parse ``args``.

    Raises the :class:`ConfigError` of a repeatable option's malformed variable, as
    ``command_settings`` does once click has parsed the same line.
    """
    if not args or args[0] in _GROUP_FLAGS:
        return None
    if args[0] in SUBCOMMANDS:
        if args[0] != "run":
            return None
        args = args[1:]
    elif not args[0].startswith("-") and _names_no_program(args[0]):
        return None  # where a subcommand goes: click judges whether it is a misspelt one
    given: dict[str, Any] = {}
    command: tuple[str, ...] = ()
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            command = tuple(args[index + 1 :])
            break
        if not arg.startswith("-") or arg == "-":
            command = tuple(args[index:])  # no options after the command's first word
            break
        name, equals, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        known = _FLAGS.get(name)
        if known is None:
            return None  # -h, a typo, a short flag: click's message
        option, flag_value = known
        if flag_value is not None:
            if equals:
                return None
            given[option.name] = flag_value
        else:
            if equals:
                raw = inline
            elif index + 1 < len(args) and not args[index + 1].startswith("-"):
                index += 1
                raw = args[index]
            else:
                return None  # no value, or one that looks like a flag
            value = _convert(option, raw)
            if value is _DECLINE:
                return None
            if option.multiple:
                given.setdefault(option.name, []).append(value)
            else:
                given[option.name] = value
        index += 1
    if not command:
        return None  # click names the missing command
    values: dict[str, Any] = {}
    for option in OPTIONS:
        if option.name in given:
            value = given[option.name]
            values[option.name] = tuple(value) if option.multiple else value
        elif option.multiple and env_name(option.name) in environ:
            values[option.name] = parse_value(option, environ[env_name(option.name)])
        elif not option.multiple and environ.get(env_name(option.name)):
            value = _convert(option, environ[env_name(option.name)])
            if value is _DECLINE:
                return None
            values[option.name] = value
        elif option.name in config:
            values[option.name] = config[option.name]
        else:
            values[option.name] = () if option.multiple else None
    return RunArgs(values, command)
