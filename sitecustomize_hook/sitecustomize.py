"""quotawrap's injected sitecustomize: keep it tiny, it runs in every child interpreter.

It chains the user's own sitecustomize (if any), then lets quotawrap register its lazy
post-import hooks. It never raises: an exception here would only print "Error in
sitecustomize" and repeat in every child process.

Its twin, ``quotawrap-hook.pth`` (installed into site-packages with quotawrap), loads the hook
earlier in interpreters of quotawrap's own environment, so another tool's sitecustomize placed
before this one (opentelemetry-instrument's does not chain) cannot shadow it; this file covers
every other interpreter that gets the wrapper's PYTHONPATH. Loading twice is a no-op. The .pth
keys on ``QUOTAWRAP_RUN_DIR``, which only the wrapper sets for its children: a user who exports
``QUOTAWRAP_RUN_ID`` to name runs does not get the hook in every Python of the environment.
"""

import os
import sys

loaded = False


def _chain_user_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    saved_path = list(sys.path)
    ours = sys.modules.pop("sitecustomize", None)
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    try:
        import sitecustomize  # noqa: F401  (the user's own, now that ours is out of the way)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            sys.stderr.write(f"Error in the user's sitecustomize (chained by quotawrap): {exc!r}\n")
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    except Exception as exc:
        sys.stderr.write(f"Error in the user's sitecustomize (chained by quotawrap): {exc!r}\n")
    finally:
        sys.path[:] = saved_path


def _install_quotawrap() -> None:
    home = os.environ.get("QUOTAWRAP_HOME")
    if home and home not in sys.path:
        sys.path.append(home)  # last: the program's own packages win
    from quotawrap.bootstrap import initialize

    initialize()


try:
    _chain_user_sitecustomize()
    if os.environ.get("QUOTAWRAP_RUN_ID"):
        _install_quotawrap()
    loaded = True
except Exception as _exc:  # pragma: no cover - defensive
    sys.stderr.write(f"quotawrap: sitecustomize failed, this process is NOT guarded: {_exc!r}\n")
