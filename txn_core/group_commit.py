"""Group commit: many writers' rows in one Delta commit.

One thread per table drains a queue of pending appends, builds the Arrow
columns once for all of them and commits them with a reused `DeltaTable`
handle: a sender waits about one commit (plus the one in flight), and a commit
carries whatever arrived meanwhile, so throughput grows with concurrency
instead of being bounded by one commit per row. A commit's senders are woken
as a chain (`CommitTicket`): waking them all at once would make the writer pay
for every wake-up, and the woken herd would queue for the GIL ahead of the
writer's next batch. On a local disk and on S3 the writer commits with
`BlindAppender` (no delta-rs per-commit cost), elsewhere or for a table it may
not write with delta-rs; checkpoints, compaction and log clean-up run beside
it (`WriterUpkeep`), so that no sender waits for them.
"""

from __future__ import annotations

import collections
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Final, TypeAlias

import pyarrow as pa
from deltalake import (
    ColumnProperties,
    CommitProperties,
    DeltaTable,
    PostCommitHookProperties,
    WriterProperties,
    write_deltalake,
)

from txn_core.blind_append import BlindAppender, TableChanged, unsupported_reason
from txn_core.errors import BrokerClosedError, PersistError
from txn_core.log_trim import trimmed_past
from txn_core.writer_upkeep import COMPACT_EVERY, LOG_CLEANUP_EVERY, SMALL_FILE_BYTES, WriterUpkeep

log = logging.getLogger(__name__)

# Appends never conflict logically; with many processes on one table a commit
# may need several rebases, so allow far more retries than delta-rs' default.
_COMMIT = CommitProperties(max_commit_retries=1000)
# The per-commit log cleanup lists the whole log; the upkeep thread cleans
# every LOG_CLEANUP_EVERY commits instead (checkpoints of delta-rs' own
# commits stay with its hook).
_HOOKS = PostCommitHookProperties(cleanup_expired_logs=False)


class _Stop(enum.Enum):
    """The queue's end mark: an enum member, so that `item is _STOP` narrows its type."""

    STOP = "stop"


_STOP: Final = _Stop.STOP
#: one append's rows: column name → its values, one per row
Columns: TypeAlias = Mapping[str, Sequence[object]]
#: a queued append and the ticket its sender waits on
_Pending: TypeAlias = "tuple[Columns, CommitTicket]"
#: the least time from one commit's start to the next one's: under a steady
#: load a commit then carries the rows of that long, instead of the few that
#: came during the last commit, and the table gets fewer files and log
#: entries for its readers, checkpoints and compactions (RocketMQ's
#: group-commit service also flushes at most every 10 ms); a send after a
#: quiet spell is committed at once
MIN_COMMIT_INTERVAL_S = 0.010
#: how long a wake-up chain may stall (a sender that never asked for its
#: result) before the writer wakes the rest of it at once
CHAIN_STALL_S = 0.05


@dataclass(frozen=True)
class WriterStats:
    """What a group-commit writer has done since it started, and where its
    thread spent the time: inside the Delta commit (parquet file and log
    entry), building the Arrow columns, or idle, waiting for rows; and the
    time its upkeep thread worked beside it (checkpoints, compaction, log
    clean-up). `later - earlier` gives the figures of a window.

    >>> stats = broker.writer_stats["_sys/half"]               # doctest: +SKIP
    >>> stats.rows_per_commit, stats.ms_per_commit              # doctest: +SKIP
    (72.0, 24.1)
    """

    commits: int = 0
    rows: int = 0
    commit_s: float = 0.0
    build_s: float = 0.0
    idle_s: float = 0.0
    upkeep_s: float = 0.0
    #: upkeep reads that met a log changing under them (retried, not errors)
    upkeep_retries: int = 0

    @property
    def rows_per_commit(self) -> float:
        return self.rows / self.commits if self.commits else 0.0

    @property
    def ms_per_commit(self) -> float:
        """Mean time inside one Delta commit, in milliseconds."""
        return 1000 * self.commit_s / self.commits if self.commits else 0.0

    def __sub__(self, earlier: WriterStats) -> WriterStats:
        return WriterStats(
            *(getattr(self, f) - getattr(earlier, f) for f in self.__dataclass_fields__)
        )


class GroupCommitWriter:
    """Appends rows to one Delta table from one background thread.

    `submit(columns)` takes a dict of column name → list of values (all the
    table's columns except `stamp_column`, which the writer fills with the
    clock's time just before the commit: the row's durable-write time) and
    returns a `CommitTicket` whose `result()` is the committed table version.
    `plain_columns` are written without dictionary encoding (values unique by
    construction, such as offsets and ids), compactions included.
    `compact_every`, `log_cleanup_every` and `log_floor` go to the table's
    `WriterUpkeep` (`upkeep`), `storage_options` to its handle.
    `stats()` tells where the writer's time goes (`WriterStats`).

    On a local disk or S3 the writer commits with `BlindAppender` and reports the
    checkpoints the table's interval calls for to the upkeep; elsewhere, or for
    a table the appender may not write, it commits with delta-rs, whose hook
    checkpoints.
    """

    def __init__(
        self,
        table: DeltaTable,
        schema: pa.Schema,
        *,
        name: str,
        clock: Callable[[], int],
        stamp_column: str | None = "store_ms",
        max_rows: int = 50_000,
        compact_every: int | None = COMPACT_EVERY,
        log_cleanup_every: int | None = LOG_CLEANUP_EVERY,
        log_floor: Callable[[], int | None] | None = None,
        plain_columns: tuple[str, ...] = (),
        storage_options: dict[str, str] | None = None,
        min_commit_interval_s: float = MIN_COMMIT_INTERVAL_S,
    ):
        self._table = table
        self._min_interval_s = min_commit_interval_s
        self._last_commit_at = float("-inf")
        self._schema = schema
        self._name = name
        self._clock = clock
        self._stamp = stamp_column
        self._max_rows = max_rows
        self._writer_properties = plain_encoding(plain_columns)
        self._appender = None
        reason = unsupported_reason(table, schema, storage_options)
        if reason is None:
            self._appender = BlindAppender(
                table,
                schema,
                dictionary_columns=[n for n in schema.names if n not in plain_columns],
                storage_options=storage_options,
            )
        else:
            log.info("%s: committing with delta-rs (%s)", name, reason)
        self.upkeep = WriterUpkeep(
            table.table_uri,
            name=name,
            storage_options=storage_options,
            compact_every=compact_every,
            log_cleanup_every=log_cleanup_every,
            log_floor=log_floor,
            writer_properties=self._writer_properties,
        )
        # the last commit's chain
        self._waking: collections.deque[CommitTicket] = collections.deque()
        self._queue: queue.SimpleQueue[_Pending | _Stop] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self.commits = 0
        # Written by the writer thread only; read whole by stats().
        self._rows = 0
        self._seconds = {"commit": 0.0, "build": 0.0, "idle": 0.0}
        self._thread = threading.Thread(target=self._run, name=f"group-commit-{name}", daemon=True)
        self._thread.start()

    def submit(self, columns: Columns) -> CommitTicket:
        ticket = CommitTicket()
        with self._lock:
            if self._closed:
                raise BrokerClosedError(f"the {self._name} writer is closed")
            self._queue.put((columns, ticket))
        return ticket

    @property
    def committer(self) -> str:
        """How commits are made now: "blind append" (the fast path, on a
        local disk or S3) or "delta-rs" (everywhere else)."""
        return "blind append" if self._appender is not None else "delta-rs"

    def stats(self) -> WriterStats:
        s = dict(self._seconds)
        return WriterStats(
            commits=self.commits,
            rows=self._rows,
            commit_s=s["commit"],
            build_s=s["build"],
            idle_s=s["idle"],
            upkeep_s=self.upkeep.busy_s,
            upkeep_retries=self.upkeep.transient_retries,
        )

    def close(self) -> None:
        """Commit what was submitted, finish the upkeep that is due, stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()
        self.upkeep.close()

    # --- writer thread ----------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            waited = time.perf_counter()
            item = self._next_item()
            if item is not _STOP:
                self._linger()  # waiting for rows too
            self._seconds["idle"] += time.perf_counter() - waited
            if item is _STOP:
                break
            batch = [item]
            rows = len(next(iter(item[0].values())))
            while rows < self._max_rows:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stopping = True
                    break
                batch.append(nxt)
                rows += len(next(iter(nxt[0].values())))
            self._commit(batch)
        _wake_all(self._waking)

    def _linger(self) -> None:
        """Wait out the rest of `min_commit_interval_s` since the last
        commit started, gathering the rows that come meanwhile."""
        now = time.perf_counter()
        wait = self._last_commit_at + self._min_interval_s - now
        if wait > 0:
            time.sleep(wait)
            now += wait
        self._last_commit_at = now

    def _next_item(self) -> _Pending | _Stop:
        """The next queued append; while the last commit's senders are still
        being woken, waits at most CHAIN_STALL_S before waking the rest itself."""
        while self._waking:
            try:
                return self._queue.get(timeout=CHAIN_STALL_S)
            except queue.Empty:
                _wake_all(self._waking)
        return self._queue.get()

    def _commit(self, batch: list[_Pending]) -> None:
        started, built = time.perf_counter(), None
        try:
            table = self._build(batch)
            built = time.perf_counter()
            self._seconds["build"] += built - started
            version = self._append_rows(table)
            self._seconds["commit"] += time.perf_counter() - built
        except BaseException as exc:  # noqa: BLE001 - every waiting sender must hear of it
            if built is not None:
                self._seconds["commit"] += time.perf_counter() - built
            log.warning("group commit to %s failed: %s", self._name, exc)
            self._refresh_after_failure()
            error = PersistError(
                f"could not append {sum(len(c[next(iter(c))]) for c, _ in batch)}"
                f" row(s) to {self._name}: {exc}"
            )
            error.__cause__ = exc
            self._wake(batch, None, error)
            return
        self._rows += table.num_rows
        self.commits += 1
        self._wake(batch, version, None)
        self.upkeep.committed(
            version,
            small_file=table.nbytes < SMALL_FILE_BYTES,
            checkpoint_due=self._appender is not None and self._appender.checkpoint_due(version),
        )

    def _refresh_after_failure(self) -> None:
        """Load the table's newest version, so that the next commit does not
        start from the state that failed (a conflict delta-rs could not rebase)."""
        try:
            self._table.update_incremental()
        except Exception as exc:  # noqa: BLE001 - the next commit reports the store's state
            log.warning("%s: could not reload the table after a failed commit: %s", self._name, exc)

    def _append_rows(self, rows: pa.Table) -> int:
        """Commit `rows`; returns the table version that holds them."""
        if self._appender is not None:
            try:
                return self._appender.append(rows)
            except TableChanged as exc:
                log.warning("%s: committing with delta-rs from now on (%s)", self._name, exc)
                self._appender = None
        if trimmed_past(self._table):  # idle while others committed and trimmed
            self._table.update_incremental()
        # delta-rs' overloads say `writer_properties: WriterProperties`; the
        # function itself takes None (its default) as well.
        write_deltalake(
            self._table,
            rows,
            mode="append",  # type: ignore[call-overload]
            commit_properties=_COMMIT,
            post_commithook_properties=_HOOKS,
            writer_properties=self._writer_properties,
        )
        return self._table.version()

    def _wake(
        self, batch: list[_Pending], version: int | None, error: BaseException | None
    ) -> None:
        """Settle every ticket of the batch, then start its wake-up chain (a
        stalled previous chain is woken in full first: it had a whole commit)."""
        _wake_all(self._waking)
        tickets = [ticket for _, ticket in batch]
        for ticket in tickets:
            ticket._settle(version, error)
        self._waking = collections.deque(tickets)
        for ticket in tickets:
            ticket._chain = self._waking
        _wake_next(self._waking)

    def _build(self, batch: list[_Pending]) -> pa.Table:
        if len(batch) == 1:
            return to_arrow(self._schema, batch[0][0], self._stamp, self._clock())
        names = [n for n in self._schema.names if n != self._stamp]
        after = [n + AFTER_STAMP for n in names if any(n + AFTER_STAMP in c for c, _ in batch)]
        merged: dict[str, list[object]] = {n: [] for n in names + after}
        for columns, _ in batch:
            size = len(columns[names[0]])
            for n in names:
                merged[n].extend(columns[n])
            for n in after:
                merged[n].extend(columns.get(n) or [None] * size)
        return to_arrow(self._schema, merged, self._stamp, self._clock())


class CommitTicket:
    """A sender's claim on the commit that carries its rows.

    `result(timeout=None)` waits for that commit and returns its table
    version, or raises its PersistError, like `Future.result`. The writer
    settles all tickets of a commit, then wakes the first; each ticket wakes
    the next of its commit as its `result()` returns (see the module doc).
    """

    __slots__ = ("_ready", "_chain", "_version", "_error")

    def __init__(self) -> None:
        self._ready = threading.Lock()
        self._ready.acquire()  # released once, when the chain reaches this ticket
        self._chain: collections.deque[CommitTicket] | None = None
        self._version: int | None = None
        self._error: BaseException | None = None

    def _settle(self, version: int | None, error: BaseException | None) -> None:
        self._version, self._error = version, error

    def result(self, timeout: float | None = None) -> int:
        if not self._ready.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"the commit was not done within {timeout} s")
        self._ready.release()  # later calls return at once
        # Pass the wake-up on before our own work: the next thread gets
        # scheduled while we run, and takes the GIL when we block.
        assert self._chain is not None  # set before the writer releases any ticket
        _wake_next(self._chain)
        if self._error is not None:
            raise self._error
        assert self._version is not None  # settled with a version or an error
        return self._version


def _wake_next(chain: collections.deque[CommitTicket]) -> None:
    # popleft is atomic, so a ticket is woken once even if the writer, waking
    # a stalled chain, races a sender passing it on.
    try:
        chain.popleft()._ready.release()
    except IndexError:
        pass


def _wake_all(chain: collections.deque[CommitTicket]) -> None:
    while chain:
        _wake_next(chain)


def plain_encoding(columns: tuple[str, ...]) -> WriterProperties | None:
    """delta-rs parquet settings without dictionary encoding for `columns`,
    whose values are unique by construction (offsets, ids): the writer would
    build a dictionary per column chunk only to drop it. Bodies keep parquet's
    default: repeated bodies pack into a dictionary."""
    if not columns:
        return None
    return WriterProperties(
        column_properties={c: ColumnProperties(dictionary_enabled=False) for c in columns}
    )


#: a key of `Columns` named `<column>` + AFTER_STAMP holds durations: where
#: one is not None, `<column>` is the stamp plus it (a time relative to the
#: durable-write time, e.g. a timer's `deliver_at_ms` = store_ms + delay_ms)
AFTER_STAMP = "+after_stamp"


def to_arrow(schema: pa.Schema, columns: Columns, stamp_column: str | None, stamp: int) -> pa.Table:
    """Arrow columns built directly from Python lists (no per-row dicts);
    `stamp_column` gets `stamp`, the durable-write time, in every row, and a
    column with durations under `AFTER_STAMP` the stamp plus them."""
    size = len(next(iter(columns.values())))

    def values(name: str) -> Sequence[object]:
        after = columns.get(name + AFTER_STAMP)
        if after is None:
            return columns[name]
        return [
            v if d is None else stamp + int(d)  # type: ignore[call-overload]
            for v, d in zip(columns[name], after, strict=True)
        ]

    arrays = [
        pa.array([stamp] * size, type=f.type)
        if f.name == stamp_column
        else pa.array(values(f.name), type=f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)


class DirectWriter:
    """The naive design, for comparison: every submit is its own Delta commit.

    Each calling thread commits through its own table handle, so concurrent
    callers race for versions and delta-rs rebases the losers.
    """

    def __init__(
        self,
        uri: str,
        schema: pa.Schema,
        *,
        name: str,
        clock: Callable[[], int],
        stamp_column: str | None = "store_ms",
        storage_options: dict[str, str] | None = None,
    ):
        self._uri = uri
        self._schema = schema
        self._name = name
        self._clock = clock
        self._stamp = stamp_column
        self._storage_options = storage_options
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.commits = 0

    def submit(self, columns: Columns) -> Future[int]:
        fut: Future[int] = Future()
        table = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = DeltaTable(self._uri, storage_options=self._storage_options)
        size = len(next(iter(columns.values())))
        try:
            write_deltalake(
                table,
                to_arrow(self._schema, columns, self._stamp, self._clock()),
                mode="append",
                commit_properties=_COMMIT,
            )
        except Exception as exc:  # noqa: BLE001 - reported like the group writer does
            error = PersistError(f"could not append {size} row(s) to {self._name}: {exc}")
            error.__cause__ = exc
            fut.set_exception(error)
            return fut
        with self._count_lock:
            self.commits += 1
        fut.set_result(table.version())
        return fut

    def close(self) -> None:
        pass
