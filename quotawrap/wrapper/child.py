"""What the child is given: its environment with the hook first on PYTHONPATH, and what keeps the hook out."""

from __future__ import annotations

import os

from ..config.file import config_path
from ..config.settings import OPTIONS, RETIRED, Settings, env_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["HOOK_DIR", "NESTED_VARIABLE", "PACKAGE_HOME", "child_environment", "injection_blockers", "nested_in"]

# The directory that holds the quotawrap package (a checkout or site-packages): this file is quotawrap/wrapper/child.py.
PACKAGE_HOME = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
HOOK_DIR = os.path.join(PACKAGE_HOME, "sitecustomize_hook")
# Set by a wrapper for its child: a quotawrap started below with the same run id joins that run
# instead of opening (and later overwriting and closing) it a second time.
NESTED_VARIABLE = "QUOTAWRAP_WRAPPED_RUN"


def child_environment(settings: Settings, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The child's environment: our hook first on PYTHONPATH (once), settings as QUOTAWRAP_*."""
    env = dict(os.environ if base is None else base)
    hook = HOOK_DIR
    # Empty entries stay: Python reads them as the working directory, which the program may rely on.
    existing = [
        entry
        for entry in (env["PYTHONPATH"].split(os.pathsep) if env.get("PYTHONPATH") else [])
        if not entry or os.path.normpath(entry) != hook
    ]
    env["PYTHONPATH"] = os.pathsep.join([hook, *existing])
    env["QUOTAWRAP_HOME"] = PACKAGE_HOME
    found = config_path()
    if found is not None:
        env["QUOTAWRAP_CONFIG"] = str(found)  # the children read the wrapper's file, whatever their cwd
    # A leftover QUOTAWRAP_CAP_TOKENS="" from the caller's shell must not outlive an unset option, and a
    # credential the wrapper uses (the alert webhook's URL) is not the child's.
    for option in OPTIONS:
        if option.child or option.secret:
            env.pop(env_name(option.name), None)
    for name in RETIRED:  # said once, by this wrapper
        env.pop(env_name(name), None)
    env.update(settings.child_env())
    env[NESTED_VARIABLE] = settings.run_id or ""
    return env


def nested_in(settings: Settings, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this wrapper runs inside another's child with that run's id (``quotawrap -- ... quotawrap``)."""
    env = os.environ if environ is None else environ
    return bool(settings.run_id) and env.get(NESTED_VARIABLE) == settings.run_id


def injection_blockers(command: Sequence[str]) -> list[str]:
    """Interpreter flags that stop PYTHONPATH's sitecustomize from running (-I, -E, -S)."""
    import re

    if not command or not re.match(r"^python(\d+(\.\d+)?)?$", os.path.basename(command[0])):
        return []
    found: list[str] = []
    args = iter(command[1:])
    for arg in args:
        if arg == "-" or not arg.startswith("-"):
            break  # the script: what follows is its own
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                next(args, None)
            continue
        letters = arg[1:]
        for index, letter in enumerate(letters):
            if letter in "cm":
                return found  # -c CODE / -m MODULE: what follows is the program's
            if letter in "WX":  # -W ARG, -X ARG: the argument is the rest, or the next word
                if index == len(letters) - 1:
                    next(args, None)
                break
            if letter in "IES" and f"-{letter}" not in found:
                found.append(f"-{letter}")
    return found
