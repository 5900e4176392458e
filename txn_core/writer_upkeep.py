"""Keeping a group-commit writer's table healthy, beside the writer, not in its way.

A producer table committed to tens of times a second needs, from the producer
side (docs/protocol.md §2): checkpoints, compaction of the small file every commit makes,
and log clean-up. In the writer's thread they would stall every sender waiting
on that table, so `WriterUpkeep` runs them on threads and table handles of
its own (delta-rs handles are not shared between threads here). Appends never conflict
with them: delta-rs rebases a compaction (dataChange=false, invisible to the
job's change feed) over them. Clean-up drops what delta-rs' post-commit hook
would (the writer turns it off: it lists the whole log every commit) and what
lies behind `log_floor` (`txn_core.log_trim`); checkpoints are written when the
writer reports one due (its commits bypass delta-rs' hook).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from deltalake import CommitProperties, DeltaTable, WriterProperties
from deltalake.exceptions import CommitFailedError

from txn_core.delta_log import TRANSIENT_LOG_ERROR
from txn_core.log_trim import trim_log

log = logging.getLogger(__name__)

#: small files (commits under SMALL_FILE_BYTES of Arrow data) between two
#: compactions; the compaction packs files under COMPACT_TARGET_BYTES. Rare
#: rounds: a compaction's commit races the writer's appends, and delta-rs'
#: rebase over them takes seconds under load
COMPACT_EVERY = 256
SMALL_FILE_BYTES = 4 << 20
COMPACT_TARGET_BYTES = 16 << 20
#: the least time from one compaction's end to the next one's start: under a
#: steady load small files come faster than every few seconds, and each
#: round rewrites the partly filled files of the last one, so frequent rounds
#: rewrite the same rows over and over (docs/performance.md has the figures)
COMPACT_MIN_INTERVAL_S = 30.0
#: commits between two log clean-ups
LOG_CLEANUP_EVERY = 100
_COMMIT = CommitProperties(max_commit_retries=1000)


class WriterUpkeep:
    """Checkpoints, compaction and log clean-up of one table, from two background threads.

    The writer reports each commit with `committed(version, small_file,
    checkpoint_due)`; a checkpoint is written at the newest due version
    (one a round: under load, versions fall due faster than one can be
    written, and only the newest helps a reader); every `compact_every`
    small files the table is compacted (None: never), every
    `log_cleanup_every` commits its log is cleaned (None: never) and trimmed
    up to `log_floor()` when given; a compaction starts at least
    `compact_min_interval_s` (by `monotonic`) after the last one ended, or
    at `close()`. Compaction has a thread and a table
    handle of its own: under load it takes seconds (delta-rs rebases its
    commit over the appends made meanwhile), and the checkpoints must not
    wait for it. `close()` finishes what is due, then stops. Failures are
    logged and retried at the next occasion: none is the senders' problem.
    """

    def __init__(
        self,
        table_uri: str,
        *,
        name: str,
        storage_options: dict[str, str] | None = None,
        compact_every: int | None = COMPACT_EVERY,
        compact_min_interval_s: float = COMPACT_MIN_INTERVAL_S,
        log_cleanup_every: int | None = LOG_CLEANUP_EVERY,
        log_floor: Callable[[], int | None] | None = None,
        writer_properties: WriterProperties | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self._uri = table_uri
        self._monotonic = monotonic
        self._name = name
        self._storage_options = storage_options
        self.compact_every = compact_every
        self.compact_min_interval_s = compact_min_interval_s
        self._compacted_at = float("-inf")  # when the last compaction ended (monotonic)
        self.log_cleanup_every = log_cleanup_every
        self._log_floor = log_floor
        self._writer_properties = writer_properties
        # one handle per thread (delta-rs handles are not shared), each opened there
        self._table: DeltaTable | None = None
        self._compacted: DeltaTable | None = None
        self.compactions = self.log_cleanups = self.checkpoints = self.trimmed_entries = 0
        #: reads of the table that met a log changing under them, retried next round
        self.transient_retries = 0
        self._busy = {"log": 0.0, "compaction": 0.0}
        self._counting = threading.Lock()
        # Written under _due: what the writer reported since the last round.
        self._due = threading.Condition()
        self._small_files = 0
        self._commits = 0
        self._checkpoint: int | None = None  # the newest version to checkpoint
        self._compacting = False
        self._closing = False
        self._threads = [
            threading.Thread(target=self._run, name=f"upkeep-{name}", daemon=True),
            threading.Thread(
                target=self._run_compactions, name=f"upkeep-compact-{name}", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def busy_s(self) -> float:
        """Seconds the upkeep threads spent working (both added up)."""
        return sum(self._busy.values())

    def committed(self, version: int, small_file: bool, checkpoint_due: bool = False) -> None:
        with self._due:
            self._small_files += small_file
            self._commits += 1
            if checkpoint_due:
                self._checkpoint = version
            if self._log_work_due() or self._compaction_due():
                self._due.notify_all()

    def close(self) -> None:
        with self._due:
            self._closing = True
            self._due.notify_all()
        for thread in self._threads:
            thread.join()

    # --- upkeep threads -------------------------------------------------------------

    def _log_work_due(self) -> bool:
        return self._checkpoint is not None or self._clean_up_due()

    def _clean_up_due(self) -> bool:
        """Whether the log is due for a clean-up: not while this process
        compacts, whose commit reads the entries written since it started."""
        due = bool(self.log_cleanup_every and self._commits >= self.log_cleanup_every)
        return due and not self._compacting

    def _compaction_due(self) -> bool:
        return bool(self.compact_every and self._small_files >= self.compact_every)

    def _compaction_wait_s(self) -> float:
        """How long a due compaction still waits for `compact_min_interval_s`."""
        return self._compacted_at + self.compact_min_interval_s - self._monotonic()

    def _run(self) -> None:
        """Checkpoints and log clean-up; closing, after this process's last compaction."""
        while True:
            with self._due:
                while not (self._log_work_due() or (self._closing and not self._compacting)):
                    self._due.wait()
                if not self._log_work_due():
                    return  # closing, nothing left to do
                checkpoint, self._checkpoint = self._checkpoint, None
                clean = self._clean_up_due()
                if clean:
                    self._commits = 0
            started = time.perf_counter()
            if checkpoint is not None and self._loaded(checkpoint):
                self._write_checkpoint()
            if clean and self._loaded():
                self._clean_log()
            self._busy["log"] += time.perf_counter() - started

    def _run_compactions(self) -> None:
        while True:
            with self._due:
                while not self._closing and (
                    not self._compaction_due() or self._compaction_wait_s() > 0
                ):
                    self._due.wait(max(self._compaction_wait_s(), 0) or None)
                if not self._compaction_due():
                    return
                self._small_files = 0
                self._compacting = True
            started = time.perf_counter()
            try:
                self._compacted = self._refreshed(self._compacted)
                if self._compacted is not None:
                    self._compact(self._compacted)
            finally:
                with self._due:
                    self._compacting = False
                    self._compacted_at = self._monotonic()
                    self._due.notify_all()  # a clean-up held back meanwhile
            self._busy["compaction"] += time.perf_counter() - started

    def _loaded(self, version: int | None = None) -> bool:
        """Load `version` (None: the latest) into the checkpoints' handle."""
        self._table = self._refreshed(self._table, version)
        return self._table is not None

    def _refreshed(self, table: DeltaTable | None, version: int | None = None) -> DeltaTable | None:
        """`table` (opened the first time) at `version` (None: the latest), or
        None when the log could not be read: the next round tries again."""
        try:
            if table is None:
                table = DeltaTable(self._uri, storage_options=self._storage_options)
            if version is None:
                table.update_incremental()
            else:
                table.load_as_version(version)
            return table
        # BaseException: delta-rs' panics are one, and would end the upkeep's thread
        except BaseException as exc:  # noqa: BLE001 - retried at the next round
            if is_transient(exc):
                self._retried()
                log.debug("upkeep of %s met a changing log (%s); next round", self._name, exc)
            else:
                log.warning(
                    "upkeep of %s could not read the table; next round", self._name, exc_info=True
                )
            return None

    def _retried(self) -> None:
        with self._counting:
            self.transient_retries += 1

    def _write_checkpoint(self) -> None:
        """What delta-rs' post-commit hook does for its own commits, at the
        version it would pick. Failing is harmless: readers replay more JSON
        until the next one."""
        try:
            assert self._table is not None  # opened by _loaded(), which the caller checked
            self._table.create_checkpoint()
            self.checkpoints += 1
        except BaseException as exc:  # noqa: BLE001 - a panic too (`_refreshed`)
            self._failed("checkpoint", exc, "next interval")

    def _compact(self, table: DeltaTable) -> None:
        """Merge the table's small files. Losing a race (another process
        compacting or purging the same files) or failing: the next round, or
        `maintain`, does it."""
        self.compactions += 1
        try:
            table.optimize.compact(
                target_size=COMPACT_TARGET_BYTES,
                writer_properties=self._writer_properties,
                commit_properties=_COMMIT,
            )
        except CommitFailedError as exc:
            log.info("compaction of %s lost a race (%s); next round", self._name, exc)
        except BaseException as exc:  # noqa: BLE001 - a panic too (`_refreshed`)
            self._failed("compaction", exc, "next round")

    def _clean_log(self) -> None:
        """Drop log entries past the table's logRetentionDuration (up to the
        last checkpoint), if the table asks for clean-up, and those behind
        `log_floor`. Failing: the next round, or `maintain`, does it."""
        try:
            assert self._table is not None  # opened by _loaded(), which the caller checked
            config = self._table.metadata().configuration
            if config.get("delta.enableExpiredLogCleanup", "true").lower() != "true":
                return
            self._table.cleanup_metadata()
            self.log_cleanups += 1
            floor = self._log_floor() if self._log_floor else None
            if floor is not None:
                self.trimmed_entries += trim_log(self._table, floor)
        except BaseException as exc:  # noqa: BLE001 - a panic too (`_refreshed`)
            self._failed("log cleanup", exc, "next round")

    def _failed(self, step: str, exc: BaseException, retry: str) -> None:
        """Log a failed upkeep `step`: a log others were changing meanwhile
        (`is_transient`, expected under load) is a retry counted in the
        writer's stats, anything else a warning with its traceback."""
        if is_transient(exc):
            self._retried()
            log.debug("%s of %s met a changing log (%s); %s", step, self._name, exc, retry)
        else:
            log.warning("%s of %s failed; %s", step, self._name, retry, exc_info=True)


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` is delta-rs meeting a log that others were changing: a
    gap in its listing, or an entry cleaned up between listing and reading."""
    text = str(exc)
    vanished = "Invalid table version" in text or (
        "_delta_log" in text and ("not found" in text.lower() or "no such file" in text.lower())
    )
    return TRANSIENT_LOG_ERROR in text or vanished
