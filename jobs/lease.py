"""One run at a time: a lease committed through delta-rs on `_sys/lease` (exit 75).

Each lease change overwrites the table with one row (holder, expiry) in a
commit made with `max_commit_retries=0`: a Delta commit is a put-if-absent of
the next log version, so of two runners that read the same version, exactly
one commits; the other gets `CommitFailedError` and backs off. A crashed run's
lease expires after `lease_ttl_s` of wall-clock time (never `now_ms`, which a
run may set to any instant), or at once when its holder ran on this host and
its process is gone. A background thread renews a working run's lease
(`renewed`), and the run checks it before each write (`keep_alive`): a run that
stalls or loses its storage long enough for another to take over stops writing.
Those are timed promises; what makes a stalled run's commits harmless whatever
the clocks say is `verify` and the fence built on it (`jobs.fence`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
from deltalake import CommitProperties, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from schemas import LEASE, table_path
from schemas.arrow import arrow_schema
from txn_core import kept_tables
from txn_core.log_trim import checkpoint_and_trim
from txn_core.storage import options_for
from txn_core.tables import EVERY_RUN_RETENTION_HOURS, lease_table, vacuum_every_run_table

EXIT_LEASE_HELD = 75

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another run holds the lease, or won the race for it: retry later."""


class LeaseLost(RuntimeError):
    """This run's lease expired and someone else took it: stop writing."""


@dataclass(frozen=True)
class LeaseRow:
    holder: str
    host: str
    pid: int
    action: str
    wall_ms: int
    expires_ms: int


class Lease:
    def __init__(
        self,
        warehouse: str,
        ttl_s: int,
        *,
        clock: Callable[[], float] = time.time,
        storage_options: dict[str, str] | None = None,
    ):
        self.warehouse = warehouse
        self.ttl_ms = ttl_s * 1000
        self.clock = clock
        self.storage_options = storage_options
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.held = False
        #: why the lease was lost while held (every later keep_alive raises it)
        self.lost: str | None = None
        self._renewed_ms = 0
        self._renewing = threading.Lock()  # the run's output writes renew from several threads
        #: when (time.monotonic_ns) the last read that found this holder's row the newest began
        self._verified_from_ns = -1
        self._verifying = threading.Lock()
        #: (a version of the lease table whose newest row is this holder's, what
        #: tells its log entry from another file: `kept_tables.log_entry`): while
        #: that entry is the newest, nothing was committed since (no row to read)
        self._own: tuple[int, object] | None = None
        #: the lease table's version this holder's acquire committed: a later
        #: holder's is higher (versions only grow), so the job's writes can
        #: tell a newer run's staged files from leftovers (`jobs.commits`)
        self.generation: int | None = None

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    @contextmanager
    def _taken(self):
        """The lease table for the block: the table kept open between runs
        (`txn_core.kept_tables`), up to date, or opened (made if missing)."""
        uri = table_path(self.warehouse, LEASE)
        try:
            table = kept_tables.take(uri, options_for(uri, self.storage_options))
        except TableNotFoundError:
            table = lease_table(self.warehouse, self.storage_options)
        try:
            yield table
        finally:
            kept_tables.give_back(table)

    @contextmanager
    def _read(self):
        """(the lease table, its row) for the block (`_taken`)."""
        with self._taken() as table:
            rows = table.to_pyarrow_table().to_pylist()
            yield table, (LeaseRow(**rows[-1]) if rows else None)

    def _blocking(self, row: LeaseRow | None) -> bool:
        """Does `row` keep us out?"""
        if row is None or row.action == "RELEASE" or row.holder == self.holder:
            return False
        if row.expires_ms <= self._now_ms():
            return False
        return not _dead_local_process(row)

    def _write(self, table, action: str, expires_ms: int) -> None:
        now = self._now_ms()
        data = pa.Table.from_pylist(
            [
                {
                    "holder": self.holder,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "action": action,
                    "wall_ms": now,
                    "expires_ms": expires_ms,
                }
            ],
            schema=arrow_schema(LEASE),
        )
        write_deltalake(
            table, data, mode="overwrite", commit_properties=CommitProperties(max_commit_retries=0)
        )
        checkpoint_and_trim(table)
        self._own = self._entry_of(table.version()) if action != "RELEASE" else None

    def acquire(self) -> Lease:
        with self._read() as (table, row):
            if self._blocking(row):
                raise LeaseHeld(
                    f"another run holds the job's lease: {row.holder} (host {row.host}, "
                    f"pid {row.pid}) until {row.expires_ms} ms; retry later"
                )
            try:
                self._write(table, "ACQUIRE", self._now_ms() + self.ttl_ms)
                self.generation = table.version()
            except (CommitFailedError, DeltaError) as exc:
                raise LeaseHeld(
                    f"another run took the job's lease first ({exc}); retry later"
                ) from exc
        self.held = True
        self._renewed_ms = self._now_ms()
        return self

    def keep_alive(self) -> None:
        """Renew once a third of the ttl has passed; raise LeaseLost if the
        lease was taken over or could not be renewed (now or earlier).

        Right after it returns, the lease is this holder's for at least two
        thirds of the ttl: the moment to start a write.
        """
        with self._renewing:
            if self.lost is not None:
                raise LeaseLost(self.lost)
            try:
                self._keep_alive()
            except LeaseLost as exc:
                self.lost = str(exc)
                raise

    def verify(self, read_after_ns: int | None = None) -> None:
        """Raise LeaseLost unless this holder's row is still the lease table's
        newest, as the store says, whatever any clock says: no other runner has
        taken the lease since this holder last wrote it. While the entry of
        this holder's last known version is the log's newest, one look at the
        log says so (`_still_own`); otherwise the row is read.

        `read_after_ns` (`time.monotonic_ns`): what the caller needs is a read
        begun after that moment, so a read that began after it and found the
        row this holder's serves (commits made at once share one read); None:
        a read now. A commit made from a table version read before such a read,
        with no retry, cannot land on top of another run's commit
        (`jobs.fence`).
        """
        if self.lost is not None:
            raise LeaseLost(self.lost)
        with self._verifying:
            if read_after_ns is not None and self._verified_from_ns > read_after_ns:
                return
            began = time.monotonic_ns()
            if not self._still_own():
                with self._read() as (table, row):
                    self._check_row(row)
                    self._own = self._entry_of(table.version())
            self._verified_from_ns = began

    def _still_own(self) -> bool:
        """Whether the entry of this holder's last known version is still the
        lease table's newest (one look at its log), so its row still is."""
        own = self._own
        if own is None:
            return False
        uri = table_path(self.warehouse, LEASE)
        seen = kept_tables.log_entry(uri, own[0], options_for(uri, self.storage_options))
        return seen is not None and seen[0] is not None and seen == (own[1], False)

    def _entry_of(self, version: int) -> tuple[int, object] | None:
        """`_own` for `version`, whose newest row is this holder's; None when
        its entry cannot be told apart or is no longer the newest."""
        uri = table_path(self.warehouse, LEASE)
        seen = kept_tables.log_entry(uri, version, options_for(uri, self.storage_options))
        if seen is None or seen[0] is None or seen[1]:
            return None
        return version, seen[0]

    def _check_row(self, row: LeaseRow | None) -> None:
        """LeaseLost (remembered: every later check raises it) unless `row`,
        the lease table's newest, is this holder's and not a release."""
        if row is not None and row.holder == self.holder and row.action != "RELEASE":
            return
        self.held, self._own = False, None
        self.lost = (
            f"the job's lease was taken over by {row.holder if row else 'nobody'}"
            " while this run was working; its intent will be redone"
        )
        raise LeaseLost(self.lost)

    def _keep_alive(self) -> None:
        if not self.held or self._now_ms() - self._renewed_ms < self.ttl_ms // 3:
            return
        began = time.monotonic_ns()
        with self._read() as (table, row):
            self._check_row(row)
            try:
                self._write(table, "RENEW", self._now_ms() + self.ttl_ms)
            except (CommitFailedError, DeltaError) as exc:
                self.held, self._own = False, None
                raise LeaseLost(f"lost the job's lease while renewing it: {exc}") from exc
        self._renewed_ms = self._now_ms()
        with self._verifying:
            self._verified_from_ns = max(self._verified_from_ns, began)

    @contextmanager
    def renewed(self, every_s: float | None = None):
        """Renew the lease in the background while the block runs (every
        sixth of the ttl by default; `keep_alive` renews once a third has
        passed), so a long computation between writes keeps it. A failed
        renewal is kept in `lost`: the run's next `keep_alive` raises it.
        """
        stop = threading.Event()
        interval = every_s if every_s is not None else max(self.ttl_ms / 6000, 0.5)

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self.keep_alive()
                except LeaseLost as exc:
                    log.warning("%s", exc)
                    return
                # reading the lease failed: retry (BaseException: a delta-rs panic
                # ended this thread, and a long run then lost its lease)
                except BaseException as exc:  # noqa: BLE001
                    log.warning("renewing the job's lease failed (%s); retrying", exc)

        thread = threading.Thread(target=beat, name="lease-renewal", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    def release(self) -> None:
        if not self.held:
            return
        self.held, self._own = False, None
        with self._read() as (table, row):
            if row is None or row.holder != self.holder:
                return
            try:
                self._write(table, "RELEASE", self._now_ms())
            except (CommitFailedError, DeltaError):
                pass  # someone else moved on; an unreleased lease only expires later

    def vacuum(self, retention_hours: int = EVERY_RUN_RETENTION_HOURS) -> int:
        """`vacuum_every_run_table` of the lease table, under the renewal
        lock: a renewal committed at the same moment as the vacuum's commits
        would fail, as a lost lease. Returns how many files were deleted."""
        with self._renewing, self._read() as (table, _):
            return vacuum_every_run_table(table, retention_hours)

    def current(self) -> LeaseRow | None:
        with self._read() as (_, row):
            return row


def _dead_local_process(row: LeaseRow) -> bool:
    if row.host != socket.gethostname() or row.pid == os.getpid():
        return False
    try:
        os.kill(row.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
