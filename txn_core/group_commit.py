"""Group commit: many writers' rows in one Delta commit.

One thread per table drains a queue of pending appends, builds the Arrow
columns once for all of them, commits them with a reused `DeltaTable` handle
and wakes every waiting sender. A sender's latency is then about one commit
(plus the wait for the commit in flight), and a commit carries whatever
arrived meanwhile — so throughput grows with concurrency instead of being
bounded by one commit per row.

The senders of a commit are woken as a chain (`CommitTicket`): the writer
wakes the first, and each wakes the next as it returns. Waking a hundred
threads at once cost the writer ~1.5 ms of futex calls under the GIL, and the
woken herd then queued for the GIL ahead of the writer's next batch; chained,
the writer goes straight on, and only the next sender is woken while one runs.

After every commit delta-rs' expired-log cleanup hook lists the whole
`_delta_log` directory (on a local disk each entry is also stat'ed): one of
three listings per commit, whose cost grows with the log the job needs kept
(with 2,000 entries a commit took 27 ms with the hook, 16 ms without). The
writer turns the hook off and cleans the log itself every `LOG_CLEANUP_EVERY`
commits; entries can only be dropped up to the last checkpoint anyway, and
the producer tables checkpoint every 100 commits.

Every commit adds a file, and delta-rs' cost of a commit grows with the
table's active files (it re-materialises the file list after each commit:
~0.15 ms a file here, so 300 small files tripled it). The writer therefore
compacts its table every `compact_every` commits — the producer-side
compaction SPEC §2 asks for, done where the small files are made. The
rewrite is dataChange=false, invisible to the change data feed the job reads.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa
from deltalake import (CommitProperties, DeltaTable, PostCommitHookProperties, WriterProperties,
                       write_deltalake)
from deltalake.exceptions import CommitFailedError

from txn_core.errors import BrokerClosedError, PersistError
from txn_core.log_trim import trim_log, trimmed_past

log = logging.getLogger(__name__)

# Appends never conflict logically; with many processes on one table a commit
# may need several rebases, so allow far more retries than delta-rs' default.
_COMMIT = CommitProperties(max_commit_retries=1000)
# The per-commit log cleanup lists the whole log; the writer does it every
# LOG_CLEANUP_EVERY commits instead (checkpoints stay with delta-rs).
_HOOKS = PostCommitHookProperties(cleanup_expired_logs=False)
LOG_CLEANUP_EVERY = 100
_STOP = object()
#: how long a wake-up chain may stall (a sender that never asked for its
#: result) before the writer wakes the rest of it at once
CHAIN_STALL_S = 0.05
#: small files (commits under SMALL_FILE_BYTES of Arrow data) between two
#: compactions; the compaction packs files under COMPACT_TARGET_BYTES
COMPACT_EVERY = 64
SMALL_FILE_BYTES = 4 << 20
COMPACT_TARGET_BYTES = 64 << 20


@dataclass(frozen=True)
class WriterStats:
    """What a group-commit writer has done since it started, and where its
    thread spent the time: inside the Delta commit (parquet file and log
    entry), building the Arrow columns, compacting and cleaning the log, or
    idle, waiting for rows. `later - earlier` gives the figures of a window.

    >>> stats = broker.writer_stats["_sys/half"]               # doctest: +SKIP
    >>> stats.rows_per_commit, stats.ms_per_commit              # doctest: +SKIP
    (72.0, 24.1)
    """

    commits: int = 0
    rows: int = 0
    commit_s: float = 0.0
    build_s: float = 0.0
    maintenance_s: float = 0.0
    idle_s: float = 0.0

    @property
    def rows_per_commit(self) -> float:
        return self.rows / self.commits if self.commits else 0.0

    @property
    def ms_per_commit(self) -> float:
        """Mean time inside one Delta commit, in milliseconds."""
        return 1000 * self.commit_s / self.commits if self.commits else 0.0

    def __sub__(self, earlier: "WriterStats") -> "WriterStats":
        return WriterStats(*(getattr(self, f) - getattr(earlier, f)
                             for f in self.__dataclass_fields__))


class GroupCommitWriter:
    """Appends rows to one Delta table from one background thread.

    `submit(columns)` takes a dict of column name → list of values (all the
    table's columns except `stamp_column`, which the writer fills with the
    clock's time just before the commit: the row's durable-write time) and
    returns a `CommitTicket` whose `result()` is the committed table version.
    Every `compact_every` commits the writer compacts the table (None: never);
    every `log_cleanup_every` commits it drops expired log entries (None:
    never, e.g. when `maintain` does it) and, when `log_floor` (a callable:
    the first version anyone still reads, or None) is given, trims the log up
    to the newest checkpoint at or before that version (`txn_core.log_trim`).
    `writer_properties` go to every parquet file it writes, compactions included.
    `stats()` tells where the writer's time goes (`WriterStats`).
    """

    def __init__(self, table: DeltaTable, schema: pa.Schema, *, name: str,
                 clock: Callable[[], int], stamp_column: str | None = "store_ms",
                 max_rows: int = 50_000, compact_every: int | None = COMPACT_EVERY,
                 log_cleanup_every: int | None = LOG_CLEANUP_EVERY,
                 log_floor: Callable[[], int | None] | None = None,
                 writer_properties: WriterProperties | None = None):
        self._table = table
        self._schema = schema
        self._name = name
        self._clock = clock
        self._stamp = stamp_column
        self._max_rows = max_rows
        self._compact_every = compact_every
        self._log_cleanup_every = log_cleanup_every
        self._log_floor = log_floor
        self._writer_properties = writer_properties
        self.trimmed_entries = 0
        self.compactions = 0
        self.log_cleanups = 0
        self._commits_since_cleanup = 0
        self._waking: collections.deque = collections.deque()  # the last commit's chain
        self._small_files = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self.commits = 0
        # Written by the writer thread only; read whole by stats().
        self._rows = 0
        self._seconds = {"commit": 0.0, "build": 0.0, "maintenance": 0.0, "idle": 0.0}
        self._thread = threading.Thread(target=self._run, name=f"group-commit-{name}",
                                        daemon=True)
        self._thread.start()

    def submit(self, columns: dict[str, list]) -> "CommitTicket":
        ticket = CommitTicket()
        with self._lock:
            if self._closed:
                raise BrokerClosedError(f"the {self._name} writer is closed")
            self._queue.put((columns, ticket))
        return ticket

    def stats(self) -> WriterStats:
        s = dict(self._seconds)
        return WriterStats(commits=self.commits, rows=self._rows, commit_s=s["commit"],
                           build_s=s["build"], maintenance_s=s["maintenance"],
                           idle_s=s["idle"])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()

    # --- writer thread ----------------------------------------------------------

    def _run(self) -> None:
        stopping = False
        while not stopping:
            waited = time.perf_counter()
            item = self._next_item()
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
            started = time.perf_counter()
            if self._compact_every and self._small_files >= self._compact_every:
                self._compact()
            if (self._log_cleanup_every
                    and self._commits_since_cleanup >= self._log_cleanup_every):
                self._clean_log()
            self._seconds["maintenance"] += time.perf_counter() - started
        _wake_all(self._waking)

    def _next_item(self):
        """The next queued append; while the last commit's senders are still
        being woken, waits at most CHAIN_STALL_S before waking the rest itself."""
        while self._waking:
            try:
                return self._queue.get(timeout=CHAIN_STALL_S)
            except queue.Empty:
                _wake_all(self._waking)
        return self._queue.get()

    def _commit(self, batch: list[tuple[dict, "CommitTicket"]]) -> None:
        started, built = time.perf_counter(), None
        try:
            table = self._build(batch)
            built = time.perf_counter()
            self._seconds["build"] += built - started
            if trimmed_past(self._table):  # idle while others committed and trimmed
                self._table.update_incremental()
            write_deltalake(self._table, table, mode="append", commit_properties=_COMMIT,
                            post_commithook_properties=_HOOKS,
                            writer_properties=self._writer_properties)
            self._seconds["commit"] += time.perf_counter() - built
            self._small_files += table.nbytes < SMALL_FILE_BYTES
            version = self._table.version()
        except BaseException as exc:  # every waiting sender must hear of it
            if built is not None:
                self._seconds["commit"] += time.perf_counter() - built
            log.warning("group commit to %s failed: %s", self._name, exc)
            error = PersistError(f"could not append {sum(len(c[next(iter(c))]) for c, _ in batch)}"
                                 f" row(s) to {self._name}: {exc}")
            error.__cause__ = exc
            self._wake(batch, None, error)
            return
        self._rows += table.num_rows
        self.commits += 1
        self._commits_since_cleanup += 1
        self._wake(batch, version, None)

    def _wake(self, batch: list[tuple[dict, "CommitTicket"]], version: int | None,
              error: BaseException | None) -> None:
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

    def _compact(self) -> None:
        """Merge the table's small files. Losing a race (another process
        compacting or purging the same files) or failing is not the senders'
        problem: the next round, or `maintain`, does it."""
        self.compactions += 1
        self._small_files = 0
        try:
            self._table.optimize.compact(target_size=COMPACT_TARGET_BYTES,
                                         writer_properties=self._writer_properties,
                                         commit_properties=_COMMIT)
        except CommitFailedError as exc:
            log.info("compaction of %s lost a race (%s); next round", self._name, exc)
        except Exception:  # noqa: BLE001 - a failed compaction must not stop the writer
            log.warning("compaction of %s failed; next round", self._name, exc_info=True)

    def _clean_log(self) -> None:
        """Drop log entries past the table's logRetentionDuration (up to the
        last checkpoint), as delta-rs' post-commit hook would, and those behind
        `log_floor`, if the table asks for clean-up. Failing is harmless: the
        next round, or `maintain`, does it."""
        self._commits_since_cleanup = 0
        try:
            config = self._table.metadata().configuration
            if config.get("delta.enableExpiredLogCleanup", "true").lower() != "true":
                return
            self._table.cleanup_metadata()
            self.log_cleanups += 1
            floor = self._log_floor() if self._log_floor else None
            if floor is not None:
                self.trimmed_entries += trim_log(self._table, floor)
        except Exception:  # noqa: BLE001 - a failed cleanup must not stop the writer
            log.warning("log cleanup of %s failed; next round", self._name, exc_info=True)

    def _build(self, batch: list[tuple[dict, "CommitTicket"]]) -> pa.Table:
        if len(batch) == 1:
            return to_arrow(self._schema, batch[0][0], self._stamp, self._clock())
        names = [n for n in self._schema.names if n != self._stamp]
        merged: dict[str, list] = {n: [] for n in names}
        for columns, _ in batch:
            for n in names:
                merged[n].extend(columns[n])
        return to_arrow(self._schema, merged, self._stamp, self._clock())


class CommitTicket:
    """A sender's claim on the commit that carries its rows.

    `result(timeout=None)` waits for that commit and returns its table
    version, or raises its PersistError, like `Future.result`. The writer
    settles all tickets of a commit, then wakes the first; each ticket wakes
    the next of its commit as its `result()` returns (see the module doc).
    """

    __slots__ = ("_ready", "_chain", "_version", "_error")

    def __init__(self):
        self._ready = threading.Lock()
        self._ready.acquire()  # released once, when the chain reaches this ticket
        self._chain: collections.deque | None = None
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
        _wake_next(self._chain)
        if self._error is not None:
            raise self._error
        return self._version


def _wake_next(chain: collections.deque) -> None:
    # popleft is atomic, so a ticket is woken once even if the writer, waking
    # a stalled chain, races a sender passing it on.
    try:
        chain.popleft()._ready.release()
    except IndexError:
        pass


def _wake_all(chain: collections.deque) -> None:
    while chain:
        _wake_next(chain)


def to_arrow(schema: pa.Schema, columns: dict[str, list], stamp_column: str | None,
             stamp: int) -> pa.Table:
    """Arrow columns built directly from Python lists (no per-row dicts);
    `stamp_column` gets `stamp`, the durable-write time, in every row."""
    size = len(next(iter(columns.values())))
    arrays = [pa.array([stamp] * size, type=f.type) if f.name == stamp_column
              else pa.array(columns[f.name], type=f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


class DirectWriter:
    """The naive design, for comparison: every submit is its own Delta commit.

    Each calling thread commits through its own table handle, so concurrent
    callers race for versions and delta-rs rebases the losers.
    """

    def __init__(self, uri: str, schema: pa.Schema, *, name: str, clock: Callable[[], int],
                 stamp_column: str | None = "store_ms",
                 storage_options: dict[str, str] | None = None):
        self._uri = uri
        self._schema = schema
        self._name = name
        self._clock = clock
        self._stamp = stamp_column
        self._storage_options = storage_options
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.commits = 0

    def submit(self, columns: dict[str, list]) -> Future:
        fut: Future = Future()
        table = getattr(self._local, "table", None)
        if table is None:
            table = self._local.table = DeltaTable(self._uri,
                                                   storage_options=self._storage_options)
        size = len(next(iter(columns.values())))
        try:
            write_deltalake(table, to_arrow(self._schema, columns, self._stamp, self._clock()),
                            mode="append", commit_properties=_COMMIT)
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
