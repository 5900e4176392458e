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

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    @contextmanager
    def _read(self):
        """(the lease table, its row) for the block: the table kept open
        between runs (`txn_core.kept_tables`), up to date, or opened (made
        if missing)."""
        uri = table_path(self.warehouse, LEASE)
        try:
            table = kept_tables.take(uri, options_for(uri, self.storage_options))
        except TableNotFoundError:
            table = lease_table(self.warehouse, self.storage_options)
        try:
            rows = table.to_pyarrow_table().to_pylist()
            yield table, (LeaseRow(**rows[-1]) if rows else None)
        finally:
            kept_tables.give_back(table)

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

    def acquire(self) -> Lease:
        with self._read() as (table, row):
            if self._blocking(row):
                raise LeaseHeld(
                    f"another run holds the job's lease: {row.holder} (host {row.host}, "
                    f"pid {row.pid}) until {row.expires_ms} ms; retry later"
                )
            try:
                self._write(table, "ACQUIRE", self._now_ms() + self.ttl_ms)
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

    def _keep_alive(self) -> None:
        if not self.held or self._now_ms() - self._renewed_ms < self.ttl_ms // 3:
            return
        with self._read() as (table, row):
            if row is None or row.holder != self.holder:
                self.held = False
                raise LeaseLost(
                    f"the job's lease was taken over by {row.holder if row else 'nobody'}"
                    " while this run was working; its intent will be redone"
                )
            try:
                self._write(table, "RENEW", self._now_ms() + self.ttl_ms)
            except (CommitFailedError, DeltaError) as exc:
                self.held = False
                raise LeaseLost(f"lost the job's lease while renewing it: {exc}") from exc
        self._renewed_ms = self._now_ms()

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
        self.held = False
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
