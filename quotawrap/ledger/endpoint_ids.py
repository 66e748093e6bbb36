"""The endpoint ids a process's calls name, and the model each serves (quotawrap.core.identity is the rule).

Three sources, the first that knows an endpoint wins: what this process's answers told it (Ark answers an
endpoint call with the model it used), quotawrap.toml's ``[endpoints]``, and the ledger's pairs, which every
process and host shares: learned from answers by any of them, or listed by the management API
(:mod:`quotawrap.books.ark_endpoints`). An endpoint none of them knows is guarded as ``identity.UNMAPPED`` until
an answer names its model (README, "One identity per model").

Only one unmapped call to an endpoint id is out at a time, in the whole ledger (a lease of the ledger's,
``endpoint:<id>``): the others wait for its answer (:meth:`EndpointIds.probe`), since each unmapped call in
flight narrows every model's room, and on Redis Cluster one may pass unseen (README, "One identity per model").
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping

from ..core.errors import ConfigError
from ..core.identity import UNMAPPED, Identity, endpoint_table, resolve
from ..support.log import warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from . import CallPath

__all__ = ["PROBE_WAIT_S", "EndpointIds", "configured_endpoints"]

PROBE_WAIT_S = 30.0  # how long a call waits for the answer of the unmapped call to its endpoint sent before it
PROBE_LEASE = "endpoint:"  # + the endpoint id: the ledger's lease of the one unmapped call out to it
_REREAD_S = 0.25  # the ledger's pairs are read again at most this often while an endpoint is unmapped here
_KEPT = 1024  # resolved model strings a process remembers


def configured_endpoints() -> dict[str, str]:
    """quotawrap.toml's ``[endpoints]`` table; ConfigError naming the entry when it is not one."""
    from ..config.file import config_path, config_section

    try:
        return endpoint_table(config_section("endpoints"), f"{config_path()}: [endpoints]")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class EndpointIds:
    """One process's table of endpoint ids, and which of its unmapped calls is out. Thread-safe."""

    def __init__(
        self,
        ledger: Callable[[], CallPath],
        configured: Callable[[], Mapping[str, str]] = configured_endpoints,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        host: str = "",
    ) -> None:
        """``configured``: quotawrap.toml's table, read on the first endpoint id seen. ``wall``: the clock the
        ledger's leases run on; ``host``: this host's name, in the leases' holder."""
        self._ledger = ledger
        self._configured = configured
        self._clock = clock
        self._wall = wall
        self._holder = f"{host}:{os.getpid()}:{os.urandom(4).hex()}"  # each call's holder is this and a number
        self._numbers = itertools.count()
        self._lock = threading.Lock()
        self._answered: dict[str, str] = {}  # what this process's answers said
        self._config: dict[str, str] | None = None
        self._stored: dict[str, str] = {}  # the ledger's pairs, last read
        self._read_at = -float("inf")
        self._resolved: dict[str, Identity] = {}  # by the request's own string: most calls name one or two
        self._probes: dict[str, tuple[str, float]] = {}  # endpoint -> (lease holder, since) of this process's call

    def resolve(self, model: str, *, fresh: bool = False) -> Identity:
        """The identity of a request's model string; ``fresh``: read the ledger's pairs now if it is not known
        here (else at most every _REREAD_S). Raises ConfigError for a bad table, StoreError."""
        found = self._resolved.get(model)
        if found is not None:
            return found
        identity = resolve(model, {})
        if identity.endpoint is not None:
            identity = self._endpoint(identity.endpoint, fresh)
        if identity.model != UNMAPPED:  # an unmapped endpoint is asked again: another process may learn it
            with self._lock:
                if len(self._resolved) >= _KEPT:
                    self._resolved.clear()
                self._resolved[model] = identity
        return identity

    def _endpoint(self, endpoint: str, fresh: bool) -> Identity:
        if self._config is None:
            self._config = dict(self._configured())
        known = self._answered.get(endpoint) or self._config.get(endpoint) or self._stored.get(endpoint)
        if known is None and (fresh or self._clock() - self._read_at >= _REREAD_S):
            self._read_at = self._clock()
            self._stored = self._ledger().endpoint_models()
            known = self._stored.get(endpoint)
        return Identity(known or UNMAPPED, endpoint)

    def learn(self, endpoint: str, model: str) -> None:
        """An answer named ``endpoint``'s model: this process uses it from now on, and the ledger keeps it for
        every other (written once per pair and process). Never raises: the call's answer is intact anyway."""
        with self._lock:
            if self._answered.get(endpoint) == model:
                return
            self._answered[endpoint] = model
            self._resolved.clear()
            configured = (self._config or {}).get(endpoint)
        if configured is not None and configured != model:
            warn(
                f"quotawrap.toml [endpoints] maps {endpoint} to {configured}, but Ark answered with {model}:"
                f" its calls count as {model} from now on; correct the table"
            )
        if self._stored.get(endpoint) == model:
            return
        try:
            self._ledger().put_endpoint_models({endpoint: model})
        except Exception as exc:  # the next answer tells it again
            warn(f"could not keep in the ledger that {endpoint} serves {model}: {exc}")

    # -- the first unmapped call to an endpoint ---------------------------------------------------------

    def probe(self, endpoint: str) -> str | None:
        """Whether the caller's unmapped call to ``endpoint`` goes out now: no other call to it is out, in any
        process or host of the ledger, or one has been out for PROBE_WAIT_S (its answer may never be read). It
        then is the one out: the lease's holder is returned, for :meth:`probed`. StoreError when the ledger
        cannot say."""
        now = self._clock()
        with self._lock:
            out = self._probes.get(endpoint)
            if out is not None and now - out[1] < PROBE_WAIT_S:
                return None  # one of this process's is out: no need to ask the ledger
            holder = f"{self._holder}:{next(self._numbers)}"
        if not self._ledger().try_lease(PROBE_LEASE + endpoint, holder, PROBE_WAIT_S, self._wall()):
            return None
        with self._lock:
            self._probes[endpoint] = (holder, now)
        return holder

    def probed(self, endpoint: str, holder: str) -> None:
        """The unmapped call to ``endpoint`` that ``holder`` names ended (answered, failed or refused): the next
        one may go."""
        with self._lock:
            if self._probes.get(endpoint, ("", 0.0))[0] == holder:
                del self._probes[endpoint]
        try:
            self._ledger().release_lease(PROBE_LEASE + endpoint, holder)
        except Exception as exc:  # it runs out by itself
            warn(f"could not end the lease of {endpoint}'s first call: {exc}; it ends within {PROBE_WAIT_S:.0f}s")
