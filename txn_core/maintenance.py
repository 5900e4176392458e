"""Keeping the producer tables healthy, from the producer side (docs/protocol.md §2, I5).

Group commit at thousands of messages a second leaves many small files and a
long log. `maintain` compacts small files (a rewrite with dataChange=false:
invisible to the change data feed the job reads), writes a checkpoint, drops
expired log entries and those behind the job's cursor (`txn_core.log_trim`),
vacuums unreferenced files, and — the only deletion of half or OP rows
anywhere (I5) — purges messages that the job has resolved
(COMMIT or ROLLBACK in `_sys/resolved`), and plain delayed messages whose
delivery it cancelled (`_sys/cancelled`: never delivered, so never
resolved), older than `reserved_hours`. Run it from any one producer
process, e.g. hourly.

`maintain_consumer_tables` (which `maintain` runs too) keeps the consumer
groups' two append-only tables small: it expires `_sys/consumer_members`
rows older than a day (`MEMBER_TIMEOUT_MAX_S`, the longest member timeout)
and deletes the `_sys/consumer_offsets` rows that a newer row of the same
group, topic and queue supersedes, then compacts, checkpoints and vacuums
both. A corrupt row (a null where a value must be) is never deleted.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from schemas import CHECK_ANSWERS, CONSUMER_MEMBERS, CONSUMER_OFFSETS, HALF, OP, RESOLVED
from schemas.tables import CANCELLED
from txn_core.broker import Broker
from txn_core.config import Config
from txn_core.consumer_group import CONSUMER_LOG_RETENTION, MEMBER_TIMEOUT_MAX_S
from txn_core.log_trim import job_cursor, trim_log
from txn_core.storage import resolve_warehouse
from txn_core.tables import open_existing
from txn_core.vocabulary import MessageType

log = logging.getLogger(__name__)

# Deleting by an IN list: keep each predicate a reasonable size.
_PURGE_CHUNK = 5_000


@dataclass
class MaintenanceReport:
    compacted_files: dict[str, int] = field(default_factory=dict)
    purged_halves: int = 0
    purged_ops: int = 0
    vacuumed_files: int = 0
    trimmed_log_entries: int = 0
    expired_member_rows: int = 0
    superseded_offset_rows: int = 0

    def to_dict(self) -> dict[str, int | dict[str, int]]:
        return {
            "compacted_files": self.compacted_files,
            "purged_halves": self.purged_halves,
            "purged_ops": self.purged_ops,
            "vacuumed_files": self.vacuumed_files,
            "trimmed_log_entries": self.trimmed_log_entries,
            "expired_member_rows": self.expired_member_rows,
            "superseded_offset_rows": self.superseded_offset_rows,
        }


def maintain(
    broker: Broker,
    now_ms: int | None = None,
    *,
    purge: bool = True,
    vacuum: bool = True,
    consumers: bool = True,
) -> MaintenanceReport:
    """Compact, checkpoint, clean the log, vacuum and purge; returns what was done.

    With `consumers`, the consumer groups' tables too (`maintain_consumer_tables`).
    A commit that loses a race with a concurrent producer commit is skipped
    and logged; the next maintenance pass does it.
    """
    now_ms = broker.clock() if now_ms is None else now_ms
    report = MaintenanceReport()
    if consumers:
        maintain_consumer_tables(
            broker.warehouse,
            now_ms,
            storage_options=broker.storage_options,
            vacuum=vacuum,
            report=report,
        )
    if purge:
        report.purged_halves, report.purged_ops = purge_resolved(broker, now_ms)
    for table in (HALF, OP, CHECK_ANSWERS):
        dt = broker.table(table.path)
        dt.update_incremental()
        try:
            metrics = dt.optimize.compact()
            report.compacted_files[table.path] = int(metrics.get("numFilesRemoved", 0))
        except CommitFailedError as exc:
            log.info("compaction of %s lost a race (%s); next pass", table.path, exc)
        dt.update_incremental()
        dt.create_checkpoint()
        dt.cleanup_metadata()
        if table in (HALF, OP):
            floor = job_cursor(broker.warehouse, table, broker.storage_options)
            if floor is not None:
                report.trimmed_log_entries += trim_log(dt, floor)
        if vacuum:
            report.vacuumed_files += len(dt.vacuum(dry_run=False))
    return report


def purge_resolved(broker: Broker, now_ms: int) -> tuple[int, int]:
    """Delete half and OP rows of finished messages stored, and due when
    delayed, before the retention window.

    Finished: written to `_sys/resolved` by the job, or a plain message whose
    delivery the job cancelled (`_sys/cancelled`). A pending or discarded message keeps its rows,
    and so does a cancelled transactional one, whose decision still resolves
    it. Returns (halves deleted, OPs deleted).
    """
    cutoff = now_ms - broker.config.reserved_hours * 3_600_000
    halves = broker.table(HALF.path)
    halves.update_incremental()
    finished = _finished_offsets(broker, halves, cutoff)
    if finished is None:
        return 0, 0
    # A delayed message committed early is resolved, then waits in the job's
    # scheduled set, where a cancel must still find its half row: it is old
    # only once its due time too is before the window.
    due = pc.field("deliver_at_ms")
    old = halves.to_pyarrow_dataset().to_table(
        columns=["half_offset"],
        filter=(pc.field("store_ms") < cutoff) & (due.is_null() | (due < cutoff)),
    )
    doomed = pc.filter(old["half_offset"], pc.is_in(old["half_offset"], finished)).to_pylist()
    if not doomed:
        return 0, 0
    purged_halves = _delete_offsets(halves, "half_offset", doomed)
    purged_ops = _delete_offsets(broker.table(OP.path), "half_offset", doomed)
    log.info(
        "purged %d finished half rows and %d OP rows stored before %d",
        purged_halves,
        purged_ops,
        cutoff,
    )
    return purged_halves, purged_ops


def _finished_offsets(broker: Broker, halves: DeltaTable, cutoff: int) -> pa.Array | None:
    """The half offsets `purge_resolved` may delete (before its store-time
    filter); None when the job has written neither table yet."""
    resolved = open_existing(broker.warehouse, RESOLVED, broker.storage_options)
    cancelled = open_existing(broker.warehouse, CANCELLED, broker.storage_options)
    if resolved is None and cancelled is None:
        return None
    parts: list[pa.ChunkedArray] = []
    if resolved is not None:
        parts.append(resolved.to_pyarrow_dataset().to_table(columns=["half_offset"])[0])
    if cancelled is not None:
        due_before = cancelled.to_pyarrow_dataset().to_table(
            columns=["half_offset"], filter=pc.field("due_ms") < cutoff
        )[0]
        parts.append(_plain_only(halves, due_before))
    return pa.chunked_array(
        [chunk for part in parts for chunk in part.cast(pa.int64()).chunks], pa.int64()
    ).combine_chunks()


def _plain_only(halves: DeltaTable, cancelled: pa.ChunkedArray) -> pa.ChunkedArray:
    """The offsets in `cancelled` naming plain messages (a transactional one
    is resolved by its decision, or kept when discarded)."""
    if len(cancelled) == 0:
        return cancelled
    return halves.to_pyarrow_dataset().to_table(
        columns=["half_offset"],
        filter=(pc.field("message_type") == MessageType.NORMAL.value)
        & pc.field("half_offset").isin(cancelled),
    )[0]


def _delete_offsets(table: DeltaTable, column: str, offsets: list[int]) -> int:
    predicates = []
    for start in range(0, len(offsets), _PURGE_CHUNK):
        chunk = offsets[start : start + _PURGE_CHUNK]
        predicates.append(f"{column} IN ({', '.join(str(int(o)) for o in chunk)})")
    return _delete_where(table, predicates)


def _delete_where(table: DeltaTable, predicates: list[str]) -> int:
    """Delete the rows matching each predicate in turn; returns how many."""
    deleted = 0
    for predicate in predicates:
        for _attempt in range(20):
            table.update_incremental()
            try:
                deleted += int(table.delete(predicate).get("num_deleted_rows", 0))
                break
            except CommitFailedError:
                continue  # a concurrent append touched the same files: redo on the new state
        else:
            raise RuntimeError(f"could not delete from {table.table_uri} after 20 attempts")
    return deleted


# --- the consumer groups' tables ----------------------------------------------------

# Keys (group, topic, queue) per DELETE predicate of superseded offsets.
_OFFSET_KEYS_PER_DELETE = 200


def maintain_consumer_tables(
    warehouse: str | os.PathLike[str] | Config | Broker,
    now_ms: int,
    *,
    storage_options: dict[str, str] | None = None,
    vacuum: bool = True,
    report: MaintenanceReport | None = None,
) -> MaintenanceReport:
    """Expire `_sys/consumer_members` rows with a heartbeat more than a day
    before `now_ms`, delete superseded `_sys/consumer_offsets` rows, then
    compact, checkpoint, clean the log of and vacuum both tables (a missing
    table is skipped). Safe beside running consumers: neither kind of row is
    read again by anyone (a live member heartbeats well within a day; the
    newest offsets row of each queue stays), and a consumer's append moves
    past them (`consumer_group._AppendedTable`).
    Adds to `report` if given.
    """
    report = MaintenanceReport() if report is None else report
    warehouse, storage_options = resolve_warehouse(warehouse, storage_options, check=False)
    members = open_existing(warehouse, CONSUMER_MEMBERS, storage_options)
    if members is not None:
        cutoff = now_ms - int(MEMBER_TIMEOUT_MAX_S * 1000)
        report.expired_member_rows += _delete_where(members, [f'"heartbeat_ms" < {cutoff}'])
        _tidy(members, CONSUMER_MEMBERS.path, report, vacuum)
    offsets = open_existing(warehouse, CONSUMER_OFFSETS, storage_options)
    if offsets is not None:
        report.superseded_offset_rows += _delete_where(offsets, _superseded_offsets(offsets))
        _tidy(offsets, CONSUMER_OFFSETS.path, report, vacuum)
    return report


def _superseded_offsets(table: DeltaTable) -> list[str]:
    """DELETE predicates of the offsets rows older than the newest of their
    (group, topic, queue_id): the committed_ms order decides (the reader's
    rule, `txn_core.consumer_group.read_committed_offsets`), so a row
    committed meanwhile is newer still and stays."""
    rows = table.to_pyarrow_dataset().to_table(
        columns=["group", "topic", "queue_id", "committed_ms"]
    )
    newest: dict[tuple[str, str, int], int] = {}
    older: set[tuple[str, str, int]] = set()
    for row in rows.to_pylist():
        key = (row["group"], row["topic"], row["queue_id"])
        committed_ms = row["committed_ms"]
        if None in key or committed_ms is None:
            continue  # corrupt: left for an operator (the reader names it)
        if key in newest and newest[key] != committed_ms:
            older.add(key)
        newest[key] = max(committed_ms, newest.get(key, committed_ms))
    clauses = [
        f'("group" = {_sql_string(key[0])} AND "topic" = {_sql_string(key[1])} '
        f'AND "queue_id" = {int(key[2])} AND "committed_ms" < {int(newest[key])})'
        for key in sorted(older)
    ]
    return [
        " OR ".join(clauses[start : start + _OFFSET_KEYS_PER_DELETE])
        for start in range(0, len(clauses), _OFFSET_KEYS_PER_DELETE)
    ]


def _sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _tidy(table: DeltaTable, path: str, report: MaintenanceReport, vacuum: bool) -> None:
    """Give a consumer table `CONSUMER_LOG_RETENTION` if it lacks it (made
    before that was set at creation), then compact, checkpoint, clean the
    log and vacuum it."""
    table.update_incremental()
    _keep_a_day_of_log(table, path)
    try:
        metrics = table.optimize.compact()
        report.compacted_files[path] = int(metrics.get("numFilesRemoved", 0))
    except CommitFailedError as exc:
        log.info("compaction of %s lost a race (%s); next pass", path, exc)
    table.update_incremental()
    table.create_checkpoint()
    table.cleanup_metadata()
    if vacuum:
        report.vacuumed_files += len(table.vacuum(dry_run=False))


def _keep_a_day_of_log(table: DeltaTable, path: str) -> None:
    configuration = table.metadata().configuration
    if all(configuration.get(k) == v for k, v in CONSUMER_LOG_RETENTION.items()):
        return
    try:
        table.alter.set_table_properties(CONSUMER_LOG_RETENTION)
    except CommitFailedError as exc:  # a consumer's append came first
        log.info("setting the log retention of %s lost a race (%s); next pass", path, exc)
    table.update_incremental()


__all__ = ["MaintenanceReport", "maintain", "maintain_consumer_tables", "purge_resolved"]
