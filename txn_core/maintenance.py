"""Keeping the producer tables healthy, from the producer side (docs/protocol.md §2, I5).

Group commit at thousands of messages a second leaves many small files and a
long log. `maintain` compacts small files (a rewrite with dataChange=false:
invisible to the change data feed the job reads), writes a checkpoint, drops
expired log entries and those behind the job's cursor (`txn_core.log_trim`),
vacuums unreferenced files, and — the only deletion of half or OP rows
anywhere (I5) — purges messages that the job has resolved
(COMMIT or ROLLBACK in `_sys/resolved`) and that are older than
`reserved_hours`. Run it from any one producer process, e.g. hourly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from schemas import CHECK_ANSWERS, HALF, OP, RESOLVED
from txn_core.broker import Broker
from txn_core.log_trim import job_cursor, trim_log
from txn_core.tables import open_existing

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

    def to_dict(self) -> dict[str, int | dict[str, int]]:
        return {
            "compacted_files": self.compacted_files,
            "purged_halves": self.purged_halves,
            "purged_ops": self.purged_ops,
            "vacuumed_files": self.vacuumed_files,
            "trimmed_log_entries": self.trimmed_log_entries,
        }


def maintain(
    broker: Broker, now_ms: int | None = None, *, purge: bool = True, vacuum: bool = True
) -> MaintenanceReport:
    """Compact, checkpoint, clean the log, vacuum and purge; returns what was done.

    A commit that loses a race with a concurrent producer commit is skipped
    and logged; the next maintenance pass does it.
    """
    now_ms = broker.clock() if now_ms is None else now_ms
    report = MaintenanceReport()
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
    """Delete half and OP rows of resolved messages stored before the retention window.

    Only messages the job has written to `_sys/resolved` qualify: a pending or
    discarded message keeps its rows. Returns (halves deleted, OPs deleted).
    """
    resolved_table = open_existing(broker.warehouse, RESOLVED, broker.storage_options)
    if resolved_table is None:
        return 0, 0
    cutoff = now_ms - broker.config.reserved_hours * 3_600_000
    resolved = resolved_table.to_pyarrow_dataset().to_table(columns=["half_offset"])
    halves = broker.table(HALF.path)
    halves.update_incremental()
    old = halves.to_pyarrow_dataset().to_table(
        columns=["half_offset"], filter=pc.field("store_ms") < cutoff
    )
    doomed = pc.filter(
        old["half_offset"], pc.is_in(old["half_offset"], resolved["half_offset"])
    ).to_pylist()
    if not doomed:
        return 0, 0
    purged_halves = _delete_offsets(halves, "half_offset", doomed)
    purged_ops = _delete_offsets(broker.table(OP.path), "half_offset", doomed)
    log.info(
        "purged %d resolved half rows and %d OP rows stored before %d",
        purged_halves,
        purged_ops,
        cutoff,
    )
    return purged_halves, purged_ops


def _delete_offsets(table: DeltaTable, column: str, offsets: list[int]) -> int:
    deleted = 0
    for start in range(0, len(offsets), _PURGE_CHUNK):
        chunk = offsets[start : start + _PURGE_CHUNK]
        predicate = f"{column} IN ({', '.join(str(int(o)) for o in chunk)})"
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


__all__ = ["MaintenanceReport", "maintain", "purge_resolved"]
