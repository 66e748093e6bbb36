"""What quotawrap's ``sitecustomize`` and ``usercustomize`` share: chain the user's module of the
same name, then load the hook. Tiny and stdlib-only; never raises.

``usercustomize`` is the fallback for an interpreter outside quotawrap's environment (no
``quotawrap-hook.pth``) whose ``PYTHONPATH`` starts with another tool's ``sitecustomize`` that
does not chain (opentelemetry-instrument's): ``site`` imports ``usercustomize`` right after,
from the same path, wherever the user site is enabled (not in a venv, not under ``-s``).
"""

import os
import sys


def _chain(name: str, here: str) -> None:
    """Import the user's own ``name`` module (ddtrace's pattern: our dir out, module popped, import)."""
    saved_path = list(sys.path)
    ours = sys.modules.pop(name, None)
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    try:
        __import__(name)
    except ImportError as exc:
        if exc.name != name:
            sys.stderr.write(f"Error in the user's {name} (chained by quotawrap): {exc!r}\n")
        if ours is not None:
            sys.modules[name] = ours
    except Exception as exc:
        sys.stderr.write(f"Error in the user's {name} (chained by quotawrap): {exc!r}\n")
    finally:
        sys.path[:] = saved_path


def _install() -> None:
    home = os.environ.get("QUOTAWRAP_HOME")
    if home and home not in sys.path:
        sys.path.append(home)  # last: the program's own packages win
    from quotawrap.bootstrap import initialize

    initialize()  # a no-op when the .pth or the other of the two files loaded it already


def run(name: str, file: str) -> bool:
    """Chain the user's ``name``, then install quotawrap if this is a guarded run. True if all went well."""
    try:
        _chain(name, os.path.dirname(os.path.abspath(file)))
        if os.environ.get("QUOTAWRAP_RUN_ID"):
            _install()
        return True
    except Exception as exc:  # pragma: no cover - defensive
        sys.stderr.write(f"quotawrap: {name} failed, this process is NOT guarded: {exc!r}\n")
        return False
