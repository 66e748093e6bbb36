"""The shared ledger: Redis (single node, TLS, unix socket or Cluster), one Lua script per change.

Same seam and same semantics as :mod:`quotawrap.ledger.sqlite.ledger`; ``docs/redis.md`` documents
the key schema. The shape of the design:

* limits are computed in Python by ``limits_for(snapshot)`` and sent in ``quota.ordered``'s
  order; a Lua script evaluates ``quota.verdict``'s rule on the server and takes the hold in the
  same step, and every later transition applies ``holds.step`` (lua/lib.lua mirrors both);
* a hold lives as a small hash in its model-day's slot (``{qw:md:<day>:<model>}``), and is
  deleted once settled or released, so the per-call state is bounded by the open holds;
  per-call history goes to a capped stream, totals to per-run hashes;
* on single-node Redis one script touches the run and the model-day slots at once: fully atomic.
  On Cluster those are two slots, so a reserve takes the run hold first, then the model-day hold,
  and gives the run hold back if the model-day refused (never over, at worst briefly over-held);
* usage recorded by the LiteLLM limiter under ``daily_usage:{date}:{model}:{hash}`` counts towards
  the model-day's settled usage, and ours is written there under our own hash;
* every time kept or compared is on the server's clock (:mod:`.clock`): hosts whose clocks disagree
  share one Beijing day, and the reserve scripts refuse to open another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, ClassVar

from ...core import quota
from ...core.budgets import BUDGET_PREFIX, Budget, BudgetUse
from ...core.errors import ConfigError, QuotawrapError, StoreError
from ...core.identity import UNMAPPED
from ...core.quota import BEIJING, Counters, Limit, Package, Snapshot, Verdict
from ...core.usage import Usage
from ...support.processes import pid_alive
from ..base import (
    CallRecord,
    DayAggregate,
    Decision,
    Drawn,
    HoldRequest,
    LimitsFor,
    PruneResult,
    RunRecord,
    RunTotals,
    Settle,
)
from ..budgets import BudgetBook, budget_uses
from ..holds import Event
from ..scopes import ModelDay, Run, parse_counter_key
from . import books, records
from .budgets import RedisBudgets, budget_counters_of
from .client import Arg, Client, as_int, as_text
from .clock import ServerClock
from .keys import Keys, expire_at
from .lines import NO_LINE, LineReply, count_waiting, leave, leave_lines, with_ticket
from .litellm import THEIR_SNAPSHOT_TTL_S, ForeignUsage, pick_snapshot, with_our_lag
from .options import DAY_S, RedisOptions, redact, split_url
from .records import Location
from .reserve_args import ReserveArgs, budget_fields, limit_args
from .transitions import OWN_DAILY_USAGE_TTL_S, Step, anomaly_note, step_arg, step_keys

if TYPE_CHECKING:
    from ...core.member_keys import MemberKey

__all__ = ["RedisLedger"]

OUR_SNAPSHOT_TTL_S = 48 * 3600
SNAPSHOT_REUSE_S = 1.0  # a process re-reads the balance snapshot at least this often (the script checks it anyway)
SYNC_HISTORY_MAX = 1000
ACTIVE_KEEP_S = 3 * DAY_S
LOCATIONS_KEPT = 4096  # holds' locations a process keeps (one it forgot is read from the store: one MGET a batch)


def _lease_ttl(ttl_s: float) -> int:
    return int(max(ttl_s, 0)) + 3600


def _of_day(snapshot: Snapshot | None, day: str) -> Snapshot | None:
    """The snapshot if it is of ``day``: a call moved to the server's day is never limited by another day's sync."""
    return snapshot if snapshot is not None and snapshot.day == day else None


class RedisLedger:
    """Ledger in Redis; safe across threads, processes and hosts. Connects on first use."""

    takes_advances: ClassVar[bool] = True  # on a single node (lua/advance.lua); Cluster refuses every advance

    def __init__(self, url: str, *, clock: Callable[[], float] | None = None, **options: object) -> None:
        """``clock``: a simulated clock (a day that runs fast, in tests) for every time the ledger keeps, whose
        days the scripts then take as given; by default the server's (:meth:`now`)."""
        self.url = url
        self._given_clock = clock
        self._store = redact(url)
        client_url, from_url = split_url(url)
        unknown = set(options) - set(RedisOptions.names())
        if unknown:
            raise ConfigError(f"unknown Redis ledger option(s): {', '.join(sorted(unknown))}")
        self.options = RedisOptions(**{**from_url, **options})  # type: ignore[arg-type]
        self._host = socket.gethostname()
        self._client = Client(client_url, self._store, self.options)
        self._keys = Keys(self.options)
        self._args = ReserveArgs(self.options, checks_day=clock is None)
        self._server = ServerClock(self._store)
        self._measuring = threading.Lock()
        self._measure_after = 0.0  # time.monotonic() before which now() does not try to connect again
        self._read_with = 0.0  # the offset now() last read the server's time with (what callers' times are on)
        self._foreign = ForeignUsage(self._client, self._keys)
        self._epoch: str | None = None
        self._lost_at: float | None = None  # when this ledger saw the store come back empty
        self._locations: dict[str, Location] = {}  # holds this process took, until settled
        self._snapshots: dict[str, tuple[float, str, Snapshot | None]] = {}
        self._active_seen: dict[str, float] = {}
        self._budgets = RedisBudgets(self._client, self._keys)

    @property
    def cluster(self) -> bool:
        return self._client.cluster

    # -- the ledger's clock --------------------------------------------------------------------

    def now(self) -> float:
        """The ledger's clock, which every process sharing it agrees on: the server's ``TIME`` as this host
        reads it (connecting first to measure it; if the store cannot be reached, this host's clock until it
        can). Never raises. A ledger given a clock: that clock."""
        given = self._given_clock
        if given is not None:
            return given()
        if not self._server.measured:
            self._measure_once()
        offset = self._read_with = self._server.offset
        return time.time() + offset

    def _measure_once(self) -> None:
        """Connect (which measures the offset), once for all the threads that ask meanwhile; a store that is
        away is asked again at most every few seconds, not on every reading."""
        with self._measuring:
            if self._server.measured or time.monotonic() < self._measure_after:
                return
            try:
                self._redis()
            except QuotawrapError:
                self._measure_after = time.monotonic() + 5.0

    def _now(self) -> float:
        given = self._given_clock
        return given() if given is not None else time.time() + self._server.offset

    def _expire_at(self, day: str, expires_at: float = 0.0) -> int:
        """keys.expire_at on the server's clock, which EXPIREAT is read on, whatever clock the ledger keeps."""
        return expire_at(day, self._server.now(), expires_at)

    def _measure(self) -> None:
        client, sent = self._client, time.time()
        server = client.time()
        self._server.observe(server, sent, time.time())

    # -- connection, meta and lost data --------------------------------------------------------

    def _redis(self) -> Client:
        """The client, connected and checked (meta epoch, our hash) on first use."""
        client = self._client
        if client.connected and self._epoch is not None:
            return client
        client.connect()
        if self._epoch is None:
            client.retrying("open", self._load_meta)
        return client

    def _load_meta(self) -> None:
        meta, client = self._keys.meta(), self._client
        self._measure()
        client.hsetnx(meta, "epoch", uuid.uuid4().hex)
        client.hsetnx(meta, "hash", self.options.hash)
        client.hsetnx(meta, "created_at", repr(self._now()))
        stored = client.hgetall(meta)
        if stored.get("hash") != self.options.hash:
            raise ConfigError(
                f"store {self._store} is used by quotawrap with daily_usage hash {stored.get('hash')!r}, not"
                f" {self.options.hash!r}: two hashes under one prefix would count each other's usage twice"
            )
        self._epoch = stored["epoch"]

    def _lost(self, day: str) -> StoreError:
        """The store came back empty (restart without persistence): mark the day, refuse to guess."""
        meta, client = self._keys.meta(), self._client
        now = self._now()

        def mark() -> None:
            client.hsetnx(meta, "epoch", uuid.uuid4().hex)
            client.hsetnx(meta, "hash", self.options.hash)
            client.hsetnx(meta, f"lost:{day}", repr(now))
            self._epoch = client.hget(meta, "epoch")

        client.retrying("mark lost", mark)
        self._lost_at = now
        return self._lost_error(day, now)

    def _lost_error(self, day: str, at: float) -> StoreError:
        when = datetime.fromtimestamp(at, BEIJING).strftime("%H:%M:%S")
        return StoreError(
            f"Redis lost quotawrap's counters (restarted without persistence?); detected at {when} Beijing."
            f" Today's ({day}) usage is unknown, so guarded calls are refused until Beijing midnight."
            f" Restore the counts, then clear the mark: HDEL {self._keys.meta()} lost:{day}",
            store=self._store,
        )

    def _check_meta(self, day: str) -> None:
        epoch, lost = self._redis().hmget(self._keys.meta(), ["epoch", f"lost:{day}"])
        if epoch != self._epoch:
            raise self._lost(day)
        if lost is not None:
            raise self._lost_error(day, float(lost or 0))

    def run_totals(self, run_id: str) -> RunTotals:
        """A store that lost its data since we opened it would report the run as empty: say so instead."""
        client = self._redis()
        if client.retrying("read", lambda: client.hget(self._keys.meta(), "epoch")) != self._epoch:
            raise self._lost(quota.beijing_day(self._now()))
        if self._lost_at is not None:  # seen by another of our calls (the live view, a reserve) meanwhile
            raise self._lost_error(quota.beijing_day(self._lost_at), self._lost_at)
        return books.run_totals(client, self._keys, run_id)

    # -- books and the read side (books.py) ----------------------------------------------------

    def usage_series(self, model: str, day: str) -> list[tuple[float, int]]:
        return books.usage_series(self._redis(), self._keys, model, day)

    def sync_history(self, model: str, day: str) -> list[tuple[float, int]]:
        return books.sync_history(self._redis(), self._keys, model, day)

    def reasoning_history(self, model: str, *, since: float, limit: int) -> list[int]:
        return books.reasoning_history(self._redis(), self._keys, model, since=since, limit=limit)

    def call_records(
        self, *, since: float | None = None, until: float | None = None, run_id: str | None = None
    ) -> list[CallRecord]:
        return books.call_records(self._redis(), self._keys, since=since, until=until, run_id=run_id)

    def start_run(self, run: RunRecord) -> None:
        books.start_run(self._redis(), self._keys, self.options, run, self._now())

    def end_run(self, run_id: str, exit_code: int, ended_at: float) -> None:
        books.end_run(self._redis(), self._keys, self.options, run_id, exit_code, ended_at)

    def runs(self, *, since: float | None = None, until: float | None = None) -> list[RunRecord]:
        return books.runs(self._redis(), self._keys, since=since, until=until)

    def put_packages(self, model: str, packages: Sequence[Package], synced_at: float) -> None:
        books.put_packages(self._redis(), self._keys, model, packages, synced_at)

    def packages(self, model: str) -> list[Package]:
        return books.packages(self._redis(), self._keys, model)

    def prune(self, before_day: str, *, dry_run: bool = False) -> PruneResult:
        return books.prune(before_day, dry_run=dry_run)

    def aggregates(self, *, since_day: str | None = None, until_day: str | None = None) -> list[DayAggregate]:
        return books.aggregates()

    # -- snapshots -----------------------------------------------------------------------------

    def _read_snapshot(self, model: str) -> tuple[str, Snapshot | None]:
        """(fingerprint of the snapshot keys, the snapshot they give)."""
        balance_key, usage_key = self._keys.their_snapshot(model)
        client = self._redis()
        fields, balance, usage, ttl = client.read_snapshot(self._keys.snapshot(model), balance_key, usage_key)
        fingerprint = f"{fields.get('synced_at') or ''}|{balance or ''}|{usage or ''}"
        ours = records.snapshot_from_fields(fields)
        picked = pick_snapshot(ours, balance, usage, ttl, self._server.now())
        if picked is not None and picked is not ours and ours is not None and ours.lag_s > 0:
            picked = with_our_lag(client, self._keys, model, picked, ours.lag_s)
        return fingerprint, picked

    def _snapshot_for_reserve(self, model: str, *, fresh: bool) -> tuple[str, Snapshot | None]:
        """(fingerprint, snapshot), read at most every SNAPSHOT_REUSE_S unless ``fresh``.

        Reusing it is safe: the reserve script compares the fingerprint with the stored keys and
        answers -1 when they changed, and the reserve then reads again with ``fresh``.
        """
        now = time.monotonic()
        cached = self._snapshots.get(model)
        if cached is None or fresh or now - cached[0] >= SNAPSHOT_REUSE_S:
            fingerprint, snapshot = self._client.retrying("read", lambda: self._read_snapshot(model))
            cached = (now, fingerprint, snapshot)
            self._snapshots[model] = cached
        return cached[1], cached[2]

    # -- reserve -------------------------------------------------------------------------------

    def reserve(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        if self._redis().cluster:
            return self._reserve_cluster(request, limits_for)
        return self._reserve_one(request, limits_for)

    def _decision(
        self,
        request: HoldRequest,
        ordered: Sequence[Limit],
        blocking: int,
        md: Counters,
        run: Sequence[int],
        held: bool,
        line: LineReply = NO_LINE,
        budgets: Mapping[str, Counters] | None = None,
    ) -> Decision:
        if held:
            locations = self._locations
            if len(locations) >= LOCATIONS_KEPT:  # settles relayed to a wrapper never end them here: the oldest go
                del locations[next(iter(locations))]
            locations[request.hold_id] = Location(request.day, request.model, request.run_id)
        tokens, cost = Counters(run[0], run[1]), Counters(run[2], run[3])
        counters = {"run": tokens, "model_day": md, "run_cost": cost, **(budgets or {})}
        return line.decision(request, ordered, blocking, counters, held)

    def _reserve_one(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        """Single node: one script checks every limit and takes the hold in both slots."""
        client, model = self._client, request.model
        index_at = self._index_due(request.day, model)  # the script indexes them: no round trip of their own
        fresh = other_day = False
        for _ in range(5):
            day, now = request.day, self._now()
            fingerprint, snapshot = self._snapshot_for_reserve(model, fresh=fresh)
            version, budget_limits, scopes = self._budgets_for(request, now, fresh=fresh)
            if scopes is None:  # no room ahead past a budget (ledger/budgets.py): its calls reserve one by one
                return Decision(request.hold_id, Verdict(True), False, {})
            of_day = limits_for(_of_day(snapshot, day) if other_day else snapshot)
            ordered, limits = self._args.ordered([*of_day, *budget_limits] if budget_limits else of_day)
            keys = self._keys.reserve_one(day, model, request.run_id, request.hold_id, self._foreign.names(model, day))
            expires = self._expire_at(day, request.expires_at)
            args = (
                self._epoch or "",
                fingerprint,
                self._args.encode(request, limits, expires, now, index_at, budget_fields(scopes)),
                version,
            )
            sent = time.time()
            result = client.retrying("reserve", partial(client.script, "reserve_one", keys, args))
            received = time.time()
            code = int(result[0])  # a decision has 14 fields (blocking -1: the waiting line), the errors 1 or 2
            if code == -1 and len(result) == 1:  # the snapshot changed since it was read: read it again
                fresh = True
                continue
            if code == -2 and len(result) == 1:
                raise self._lost(day)
            if code == -3 and len(result) == 2:
                raise self._lost_error(day, float(as_text(result[1]) or 0))
            if code == -4 and len(result) == 2:
                request, other_day = self._on_the_servers_day(request, result[1], sent, received), True
                index_at = self._index_due(request.day, model)
                continue
            self._server.observe(float(as_text(result[13]) or 0), sent, received)
            if index_at is not None:
                self._active_seen[records.model_day_member(day, model)] = index_at
            self._foreign.seen(model, day, int(result[6]))  # the usage series adds it to our own settled
            md = Counters(int(result[1]), int(result[2]))
            run = [int(result[4]), int(result[5]), int(result[7]), int(result[8])]
            line = LineReply(int(result[9]), int(result[10]), as_text(result[11]) or "", int(result[12]))
            seen = budget_counters_of(result[14])
            return self._decision(request, ordered, code, md, run, bool(int(result[3])), line, seen)
        raise StoreError(
            "the balance snapshot, the budgets or the server's Beijing day kept changing while reserving; try again",
            store=self._store,
        )

    def _budgets_for(
        self, request: HoldRequest, now: float, *, fresh: bool
    ) -> tuple[str, list[Limit], list[str] | None]:
        """(the budgets' version, the hard budgets' limits, every matching budget's scope) of ``request``; scopes
        None: an advance a budget bars."""
        version, budgets = self._budgets.for_reserve(fresh=fresh)
        if BudgetBook.bars_advance(budgets, request):
            return version, [], None
        limits, scopes = BudgetBook.for_hold(budgets, request, now)
        return version, limits, scopes

    def _on_the_servers_day(self, request: HoldRequest, server: object, sent: float, received: float) -> HoldRequest:
        """The call again on the server's day, once a script refused the day it named: the caller read the ledger's
        clock before the offset was known, or with one gone stale (the host's clock was stepped), or midnight came
        in between. Its expiry moves by what the offset it was read with lacked."""
        at = float(as_text(server) or 0)
        self._server.observe(at, sent, received)
        moved = self._server.offset - self._read_with
        return dataclasses.replace(request, day=quota.beijing_day(at), expires_at=request.expires_at + moved)

    def _reserve_cluster(self, request: HoldRequest, limits_for: LimitsFor) -> Decision:
        """Cluster: run slot first (check the run limits, take the run hold), then the model-day slot.

        The model-day script re-evaluates the whole verdict on the run counters the gate saw, so
        the answer is quota.verdict's; if it refuses, the run hold is given back. Between the two
        steps the run hold is held but not yet used: other calls of the same run may be refused
        for it, never let through beyond the cap.
        """
        if request.advance:  # a call's split would span its run's and model-day's slots: each call reserves alone
            return Decision(request.hold_id, Verdict(True), False, {})
        client, model, run_id, hold_id = self._client, request.model, request.run_id, request.hold_id
        request = with_ticket(client, self._keys, request)
        other_day = False
        for _ in range(3):
            day, now = request.day, self._now()
            expires = self._expire_at(day, request.expires_at)
            client.retrying("read", partial(self._check_meta, day))
            _, snapshot = self._snapshot_for_reserve(model, fresh=True)
            version, budget_limits, scopes = self._budgets_for(request, now, fresh=True)
            of_day = limits_for(_of_day(snapshot, day) if other_day else snapshot)
            ordered, limits = self._args.ordered([*of_day, *budget_limits] if budget_limits else of_day)
            foreign = client.retrying("read", partial(self._foreign.total, model, day))
            # The unmapped endpoints' counters live in another slot: read here, before the model-day script.
            also = (0, 0) if model == UNMAPPED else self._unmapped_counters(day)
            args = self._args.encode(request, limits, expires, now)
            location = Location(day, model, run_id).encode()
            client.retrying("reserve", partial(client.set, self._keys.location(hold_id), location, exat=expires))
            self._touch_active(day, model)
            sent = time.time()
            gate = client.retrying("reserve", partial(client.script, "run_gate", self._keys.run_gate(run_id), [args]))
            if int(gate[0]) == -4 and len(gate) == 2:  # another day than the server's: the gate took nothing
                request, other_day = self._on_the_servers_day(request, gate[1], sent, time.time()), True
                continue
            run, taken, ahead_run, in_run_line = [int(v) for v in gate[:4]], int(gate[4]), int(gate[5]), int(gate[6])
            seen: dict[str, Counters] = {}
            budget_taken = False
            if scopes:  # the budgets' slot next: check them and take their share, as the run gate did the run's
                own = limit_args(quota.ordered(budget_limits))
                gate_args = self._args.encode(request, json.dumps(own), expires, now, None, budget_fields(scopes))
                gated = self._budgets.gate(gate_args, version)
                if gated is None:  # the budgets changed since they were read: give the run's back, read again
                    if taken:
                        self._run_apply(run_id, hold_id, "gone", 0, 0)
                    continue
                budget_taken, seen = gated
                args = self._args.encode(request, limits, expires, now, None, budget_fields(scopes, seen))
            md_keys = self._keys.md_reserve(day, model, run_id, hold_id)
            md_args: list[Arg] = [*run, foreign + also[0], args, ahead_run, also[1]]
            sent = time.time()
            try:
                result = client.retrying("reserve", partial(client.script, "md_reserve", md_keys, md_args))
            except StoreError:
                with contextlib.suppress(StoreError):
                    self._give_back(run_id, hold_id, taken=bool(taken), budget_taken=budget_taken)
                raise
            received = time.time()
            if int(result[0]) == -4 and len(result) == 2:  # midnight came between the two slots: give the run's back
                self._give_back(run_id, hold_id, taken=bool(taken), budget_taken=budget_taken)
                request, other_day = self._on_the_servers_day(request, result[1], sent, received), True
                continue
            self._server.observe(float(as_text(result[6]) or 0), sent, received)
            held = bool(int(result[3]))
            if not held:
                self._give_back(run_id, hold_id, taken=bool(taken), budget_taken=budget_taken)
                client.retrying("reserve", lambda: client.delete(self._keys.location(hold_id)))
            elif request.waiter is not None and in_run_line:  # admitted: out of the run's line too
                leave(client, self._keys.run_line(run_id), request.waiter)
            md = Counters(int(result[1]), int(result[2]))
            line = LineReply(ahead_run, int(result[4]), as_text(result[5]) or "", request.ticket or 0)
            return self._decision(request, ordered, int(result[0]), md, run, held, line, seen)
        raise StoreError("the server's Beijing day kept changing while reserving; try again", store=self._store)

    def _give_back(self, run_id: str, hold_id: str, *, taken: bool, budget_taken: bool) -> None:
        """Cluster: the shares a reserve cut short took in the run's and the budgets' slots, given back."""
        if taken:
            self._run_apply(run_id, hold_id, "gone", 0, 0)
        if budget_taken:
            self._budgets.apply(hold_id, "gone", 0, 0)

    def _unmapped_counters(self, day: str) -> tuple[int, int]:
        """(settled, in flight) of the calls to endpoints whose model is not known yet, on ``day``."""
        client = self._redis()
        key = self._keys.md_counters(day, UNMAPPED)
        settled, in_flight = client.retrying("read", lambda: client.hmget(key, ["settled", "in_flight"]))
        return as_int(settled), as_int(in_flight)

    def leave_line(self, request: HoldRequest) -> None:
        leave_lines(self._redis(), self._keys, request)

    def waiting(self, now: float) -> dict[str, int]:
        """``now`` is not used: the lines' leases are on the server's clock, which decides."""
        client = self._redis()
        return count_waiting(client, self._keys, self._server.now())

    def _run_apply(self, run_id: str, hold_id: str, target: str, charged: int, charged_cost: int) -> None:
        args: list[Arg] = [hold_id, target, charged, charged_cost, self.options.run_ttl_s]
        self._client.retrying("settle", lambda: self._client.script("run_apply", self._keys.run_apply(run_id), args))

    def _index_due(self, day: str, model: str) -> float | None:
        """Now, when the model-day (for reclaim_orphans) and the model (known_models) are due to be indexed:
        once a minute per process."""
        now = self._now()
        if now - self._active_seen.get(records.model_day_member(day, model), 0.0) < 60:
            return None
        return now

    def _touch_active(self, day: str, model: str) -> None:
        """Cluster: index the model-day and the model in their own commands (reserve_one does it on a single node)."""
        now = self._index_due(day, model)
        if now is None:
            return
        client, member = self._client, records.model_day_member(day, model)

        def index() -> None:
            client.zadd(self._keys.active(), member, now)
            client.sadd(self._keys.models(), model)

        client.retrying("index", index)
        self._active_seen[member] = now

    # -- transitions ---------------------------------------------------------------------------

    def _locate(self, hold_id: str) -> Location | None:
        return self._locate_many((hold_id,)).get(hold_id)

    def _locate_many(self, hold_ids: Sequence[str], *, keep: Collection[str] = ()) -> dict[str, Location]:
        """``_locate`` for a batch: the holds this process did not reserve (a wrapper landing its child's settles
        reserved none) are looked up in one MGET, not one GET round trip each. ``keep``: holds that stay
        (advances whose calls are split from them), the others are forgotten as they end."""
        found: dict[str, Location] = {}
        unknown: list[str] = []
        for hold_id in hold_ids:
            location = self._locations.get(hold_id) if hold_id in keep else self._locations.pop(hold_id, None)
            if location is not None:
                found[hold_id] = location
            elif hold_id not in found:
                unknown.append(hold_id)
        if unknown:
            client = self._redis()
            names = [self._keys.location(hold_id) for hold_id in unknown]
            raws = client.retrying("read", lambda: client.mget(names))
            found.update((hold_id, Location.decode(raw)) for hold_id, raw in zip(unknown, raws, strict=True) if raw)
        return found

    def _transition(
        self,
        at: Location,
        hold_id: str,
        event: Event,
        usage: Usage | None = None,
        latency_s: float | None = None,
        cost: int | None = None,
        note: tuple[str, str] | None = None,
    ) -> tuple[bool, str]:
        """Apply holds.step's ``event`` to one hold. (changed, new state)."""
        client = self._redis()  # connected again if close() came between the reserve and this
        args = (self._step_arg(at, hold_id, event, Step(usage, latency_s, cost, note)),)
        if not client.cluster:
            keys = self._keys.transition_one(at.day, at.model, at.run_id, hold_id)
            result = client.retrying(event, lambda: client.script("transition_one", keys, args))
            if not int(result[0]):
                return False, ""
            return True, as_text(result[1]) or ""
        md_keys = self._keys.md_transition(at.day, at.model, at.run_id, hold_id)
        result = client.retrying(event, lambda: client.script("md_transition", md_keys, args))
        if not int(result[0]):
            return False, ""
        target, charged, delta, charged_cost = as_text(result[1]) or "", int(result[3]), int(result[4]), int(result[6])
        # Not atomic with the model-day step on Cluster: each is idempotent, and a lost step only
        # leaves the run's or the LiteLLM limiter's view short (docs/redis.md).
        self._run_apply(at.run_id, hold_id, target, charged, charged_cost)
        self._budgets.apply(hold_id, target, charged, charged_cost)
        if delta:
            own = self._keys.own_daily_usage(at.model, at.day)
            with client.errors(event):
                client.write([("INCRBY", own, delta), ("EXPIRE", own, OWN_DAILY_USAGE_TTL_S)])
        if target != "unresolved":
            with contextlib.suppress(StoreError), client.errors(event):
                client.delete(self._keys.location(hold_id))
        return True, target

    def _step_arg(self, at: Location, hold_id: str, event: str, step: Step) -> str:
        foreign = self._foreign.last(at.model, at.day)
        now, server_now = self._now(), self._server.now()
        return step_arg(at, hold_id, event, step, now=now, server_now=server_now, foreign=foreign, options=self.options)

    def settle(
        self,
        hold_id: str,
        usage: Usage | None,
        *,
        latency_s: float | None = None,
        cost: int | None = None,
        anomaly: str | None = None,
    ) -> None:
        """Charge actual usage and cost (micro-CNY; without usage or cost the reserved cost). Idempotent."""
        at = self._locate(hold_id)
        if at is not None:
            self._transition(at, hold_id, "settle", usage, latency_s, cost, anomaly_note(anomaly))

    def release(self, hold_id: str, *, handed_to: str | None = None) -> None:
        at = self._locate(hold_id)
        if at is not None:
            self._transition(at, hold_id, "release", note=None if handed_to is None else ("handed_to", handed_to))

    def settle_many(self, settles: Sequence[Settle]) -> None:
        """Every settle and release, and an advance's steps; on a single node in one script call
        (lua/transition_many.lua)."""
        client = self._redis()
        if client.cluster:
            for hold_id, event, usage, latency_s, cost, anomaly, _ in settles:
                if event in ("draw", "close"):  # Cluster takes no advance (_reserve_cluster)
                    continue
                if event == "release":
                    self.release(hold_id)
                else:
                    self.settle(hold_id, usage, latency_s=latency_s, cost=cost, anomaly=anomaly)
            return
        keys: list[str] = []
        args: list[Arg] = []
        advances = {settle.drawn.advance_id for settle in settles if settle.drawn is not None}
        located = self._locate_many([s.hold_id for s in settles] + list(advances), keep=advances)
        for hold_id, event, usage, latency_s, cost, anomaly, drawn in settles:
            # a drawn call not split yet lives where its advance does
            at = located.get(hold_id) or (located.get(drawn.advance_id) if drawn is not None else None)
            if at is None:
                continue
            named: Drawn | None = drawn
            if event == "close":  # the hold is the advance, named twice in its keys
                if drawn is None:
                    continue
                named = drawn._replace(advance_id=hold_id)
                step = Step(drawn=named)
            elif event == "settle":
                step = Step(usage, latency_s, cost, anomaly_note(anomaly), drawn)
            else:
                step = Step(drawn=drawn)
            keys += step_keys(self._keys, at, hold_id, named)
            args.append(self._step_arg(at, hold_id, event, step))
        if args:
            # one script, one round trip; each step is idempotent, so a retried batch never counts one twice
            client.retrying("settle", partial(client.script, "transition_many", keys, args))

    def resolve_run(self, run_id: str, *, release_advances: bool = False) -> int:
        """``release_advances``: what is left of the advances of the run's dead processes on this host is
        released first (every call drawn from them has a hold of its own); the rest is charged whole."""
        client = self._redis()
        copies = client.retrying("read", lambda: client.hgetall(self._keys.run_holds(run_id)))
        held = {hold_id: records.parse_run_hold(copy) for hold_id, copy in copies.items()}
        held = {hold_id: parsed for hold_id, parsed in held.items() if parsed[0] == "held"}
        if release_advances:
            for hold_id, (_, day, model) in list(held.items()):
                advance, host, pid = self._hold_fields(day, model, [hold_id], "advance", "host", "pid")[0]
                if advance == "1" and host == self._host and pid.isdigit() and not pid_alive(int(pid)):
                    self._transition(Location(day, model, run_id), hold_id, "release")
                    del held[hold_id]
        resolved = 0
        for hold_id, (_, day, model) in held.items():
            self._locations.pop(hold_id, None)
            changed, _ = self._transition(Location(day, model, run_id), hold_id, "resolve")
            if changed:
                resolved += 1
            elif not client.retrying("read", partial(client.exists, self._keys.hold(day, model, hold_id))):
                # the model-day never took it (a Cluster reserve cut short): nothing was sent
                self._give_back(run_id, hold_id, taken=True, budget_taken=True)
        return resolved

    def reclaim_orphans(self, now: float) -> int:
        client = self._redis()
        active = self._keys.active()
        client.retrying("scan", lambda: client.zremrangebyscore(active, "-inf", now - ACTIVE_KEEP_S))
        members = client.retrying("scan", lambda: client.zrange(active))
        return sum(self._reclaim_model_day(*records.parse_model_day_member(m), now) for m in members)

    def _reclaim_model_day(self, day: str, model: str, now: float) -> int:
        client = self._client
        open_key = self._keys.md_open(day, model)
        expired = client.retrying("scan", lambda: client.zrangebyscore(open_key, "-inf", f"({now!r}"))
        reclaimed = self._resolve_holds(day, model, expired)
        owners = client.retrying("scan", lambda: client.hgetall(self._keys.md_pids(day, model)))
        dead = set()
        for owner in owners:
            host, pid = records.parse_owner(owner)
            if host == self._host and pid.isdigit() and not pid_alive(int(pid)):
                dead.add(pid)
        if dead:
            open_ids = client.retrying("scan", lambda: client.zrange(open_key))
            holders = self._hold_fields(day, model, open_ids, "host", "pid")
            mine = [h for h, (host, pid) in zip(open_ids, holders, strict=True) if host == self._host and pid in dead]
            reclaimed += self._resolve_holds(day, model, mine)
        return reclaimed

    def _hold_fields(self, day: str, model: str, hold_ids: Sequence[str], *names: str) -> list[tuple[str, ...]]:
        keys = [self._keys.hold(day, model, hold_id) for hold_id in hold_ids]
        rows = self._client.retrying("scan", lambda: self._client.hmget_many(keys, names))
        return [tuple(v or "" for v in row) for row in rows]

    def _resolve_holds(self, day: str, model: str, hold_ids: Sequence[str]) -> int:
        count = 0
        for hold_id, (run_id,) in zip(hold_ids, self._hold_fields(day, model, hold_ids, "run"), strict=True):
            if run_id:
                changed, _ = self._transition(Location(day, model, run_id), hold_id, "resolve")
                count += changed
        return count

    # -- counters and snapshots ----------------------------------------------------------------

    def counters(self, keys: Sequence[str]) -> dict[str, Counters]:
        """Counters by scopes.counter_key; a model-day's settled includes the LiteLLM limiter's
        daily_usage of that model-day (what the verdict sees)."""
        client = self._redis()
        found: dict[str, Counters] = self._budgets.counters([key for key in keys if key.startswith(BUDGET_PREFIX)])
        for key in keys:
            if key in found:
                continue
            scope = parse_counter_key(key)
            if isinstance(scope, ModelDay):
                day, model = scope.day, scope.model
                md_counters = self._keys.md_counters(day, model)
                values = client.retrying("read", partial(client.hmget, md_counters, ("settled", "in_flight")))
                foreign = client.retrying("read", partial(self._foreign.total, model, day))
                found[key] = Counters(as_int(values[0]) + foreign, as_int(values[1]))
            elif scope is not None:
                run_counters = self._keys.run_counters(scope.run_id)
                fields = ("settled", "in_flight") if isinstance(scope, Run) else ("cost_settled", "cost_in_flight")
                values = client.retrying("read", partial(client.hmget, run_counters, fields))
                found[key] = Counters(as_int(values[0]), as_int(values[1]))
            else:
                found[key] = Counters()
        return found

    def snapshot(self, model: str) -> Snapshot | None:
        _, snapshot = self._redis().retrying("read", lambda: self._read_snapshot(model))
        return snapshot

    def put_snapshot(self, model: str, snapshot: Snapshot) -> None:
        """Our record, the sync history, and the LiteLLM limiter's two snapshot keys (TTL 24h)."""
        client = self._redis()
        ours = self._keys.snapshot(model)
        balance_key, usage_key = self._keys.their_snapshot(model)
        sync_key = self._keys.md_sync(snapshot.day, model)
        fields = [item for pair in records.snapshot_fields(snapshot).items() for item in pair]

        def write() -> None:
            # their keys first: if we stop half-way the next read sees theirs newer, never a mix
            client.set(balance_key, snapshot.balance, ex=THEIR_SNAPSHOT_TTL_S)
            client.set(usage_key, snapshot.usage_at_sync, ex=THEIR_SNAPSHOT_TTL_S)
            client.write([("DEL", ours), ("HSET", ours, *fields), ("EXPIRE", ours, OUR_SNAPSHOT_TTL_S)])
            client.write(
                [
                    ("RPUSH", sync_key, records.encode_sync_entry(snapshot)),
                    ("LTRIM", sync_key, -SYNC_HISTORY_MAX, -1),
                    ("EXPIREAT", sync_key, self._expire_at(snapshot.day)),
                ]
            )
            client.sadd(self._keys.models(), model)

        client.retrying("sync", write)
        self._snapshots.pop(model, None)

    # -- budgets (ledger/budgets.py) -----------------------------------------------------------

    def set_budget(self, budget: Budget) -> bool:
        self._redis()
        return self._budgets.put(budget.id, budget)

    def remove_budget(self, budget_id: str) -> bool:
        self._redis()
        return self._budgets.put(budget_id, None)

    def budgets(self, run_id: str | None = None) -> list[Budget]:
        self._redis()
        return self._budgets.listed(run_id)

    def budget_uses(self, now: float, run_id: str | None = None) -> list[BudgetUse]:
        return budget_uses(self, now, run_id)

    # -- models and leases --------------------------------------------------------------------

    def known_models(self) -> list[str]:
        """Every model the ledger has seen a call or a balance for."""
        client = self._redis()
        return client.retrying("read", lambda: client.smembers(self._keys.models()))

    def endpoint_models(self) -> dict[str, str]:
        """Every endpoint id -> model id pair kept (learned from answers, or listed by the management API)."""
        client = self._redis()
        return client.retrying("read", lambda: client.hgetall(self._keys.endpoints()))

    def put_endpoint_models(self, models: Mapping[str, str]) -> None:
        """Keep these endpoint id -> model id pairs; an endpoint's pair replaces the one it had."""
        if not models:
            return
        client = self._redis()
        pairs = [item for pair in models.items() for item in pair]
        client.retrying("endpoints", lambda: client.write([("HSET", self._keys.endpoints(), *pairs)]))

    # -- member keys (member_keys.py): imported on use, off every guarded command's start

    def add_member_key(self, key: MemberKey) -> bool:
        from .member_keys import add_member_key

        return add_member_key(self._redis(), self._keys, key)

    def member_key(self, key_hash: str) -> MemberKey | None:
        from .member_keys import member_key

        return member_key(self._redis(), self._keys, key_hash)

    def member_keys(self) -> list[MemberKey]:
        from .member_keys import member_keys

        return member_keys(self._redis(), self._keys)

    def revoke_member_key(self, name: str, at: float) -> MemberKey | None:
        from .member_keys import revoke_member_key

        return revoke_member_key(self._redis(), self._keys, name, at)

    def try_lease(self, name: str, holder: str, ttl_s: float, now: float) -> bool:
        """Take (or renew) a named lease unless another holder has it: one billing caller per ledger."""
        client = self._redis()
        args: list[Arg] = [holder, repr(float(now)), repr(float(now + ttl_s)), _lease_ttl(ttl_s)]
        return bool(int(client.retrying("lease", lambda: client.script("lease", [self._keys.lease(name)], args))))

    def release_lease(self, name: str, holder: str) -> None:
        client = self._redis()
        client.retrying("lease", lambda: client.script("unlease", [self._keys.lease(name)], [holder]))

    def close(self) -> None:
        self._epoch = None
        self._client.close()
