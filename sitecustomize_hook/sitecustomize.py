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

from _quotawrap_hook import run

loaded = run("sitecustomize", __file__)
