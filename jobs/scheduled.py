"""The scheduled set (`_sys/scheduled`): committed messages not due yet
(docs/protocol.md §4, "Delayed messages"), looked at with delta-rs.

A run reads the rows due in (its previous watermark, its watermark] with
Spark (`jobs.transforms.due_scheduled`), from the files `files_due` picks
by their statistics, schedules the messages it reads
that are due later, and needs the earliest due time still waiting for its
`next_due_ms`: `next_due_after` finds it from the files' statistics,
opening only the files that may hold it. Rows due at or before a committed
run's watermark are never read again (delivered, or dropped as cancelled):
`upkeep` deletes them, with the job's other upkeep, and rewrites the set
sorted once the small files of runs that scheduled a few messages each are
many (their due ranges may be wide).
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.compute as pc

from jobs.appends import snapshot_files_by_stats
from jobs.job_tables import NO_VERSION
from schemas import table_path
from schemas.tables import SCHEDULED
from txn_core.delta_log import refresh
from txn_core.storage import options_for

log = logging.getLogger(__name__)

#: rows per file of a run's scheduled rows, sorted by due_ms: a run reading
#: what falls due opens the few files whose due_ms range meets its window
ROWS_PER_FILE = 25_000
#: files of fewer rows than this are small (a run that scheduled a few)...
SMALL_FILE_ROWS = ROWS_PER_FILE // 2
#: ...and this many of them make the upkeep rewrite the set sorted by due_ms
SMALL_FILES_TO_MERGE = 32


def next_due_after(warehouse: str, version: int, after_ms: int) -> int | None:
    """The earliest due_ms above `after_ms` in `_sys/scheduled` as of
    `version` (None: none). The files whose statistics end above `after_ms`
    bound it by the least of their maxima; only the files that may hold a
    due time in (after_ms, that bound] are read, and only their due_ms."""
    if version == NO_VERSION:
        return None
    from deltalake import DeltaTable

    path = table_path(warehouse, SCHEDULED)
    table = DeltaTable(path, version=version, storage_options=options_for(path))
    files = pa.table(table.get_add_actions(flatten=True))
    if files.num_rows == 0:
        return None
    if "max.due_ms" not in files.column_names or files["max.due_ms"].null_count:
        bound = None  # files without statistics: read the column
    else:
        later = files.filter(pc.greater(files["max.due_ms"], after_ms))
        if later.num_rows == 0:
            return None
        bound = pc.min(later["max.due_ms"]).as_py()
    due = pc.field("due_ms") > after_ms
    if bound is not None:
        due = due & (pc.field("due_ms") <= bound)
    found = table.to_pyarrow_dataset().to_table(columns=["due_ms"], filter=due)["due_ms"]
    earliest: int | None = pc.min(found).as_py()
    return earliest


def files_due(path: str, version: int, after_ms: int, upto_ms: int) -> list[str] | None:
    """The data files of the scheduled set at `path` as of `version` whose
    statistics may hold a row due in (after_ms, upto_ms] (a file without
    them is kept), when the set can be read as parquet
    (`appends.snapshot_files_by_stats`); otherwise None."""
    return snapshot_files_by_stats(
        path,
        version,
        "due_ms",
        lambda low, high: pc.and_kleene(pc.greater(high, after_ms), pc.less_equal(low, upto_ms)),
    )


def upkeep(warehouse: str, watermark_ms: int) -> tuple[int, int]:
    """The scheduled set's share of the job's upkeep (every
    `job_tables.COMPACT_EVERY_RUNS` runs, after a committed run whose
    watermark is `watermark_ms`): `_drop_past`, then `_merge_small_files`.
    Returns (rows dropped, files merged). Neither commit is tagged with a
    run, so a redo steps over them as over a compaction. A failure is
    logged, never raised: the run it follows is committed, and the next
    round retries."""
    from deltalake import DeltaTable

    path = table_path(warehouse, SCHEDULED)
    try:
        table = DeltaTable(path, storage_options=options_for(path))
        dropped = _drop_past(table, watermark_ms)
        merged = _merge_small_files(table)
    except Exception as exc:  # noqa: BLE001 - upkeep must not fail a finished run
        log.warning("the upkeep of %s failed (%s); the next round retries", path, exc)
        return 0, 0
    return dropped, merged


def _drop_past(table, watermark_ms: int) -> int:
    """Delete the rows due at or before `watermark_ms`: every later run reads
    only what falls due after its previous watermark, and `status` and the
    cancels only what is due after the current one. Only files whose
    statistics start there are read (of a big run's sorted files, the one
    straddling the watermark); what they still hold is written back
    together, due after the watermark."""
    files = pa.table(table.get_add_actions(flatten=True))
    if files.num_rows == 0:
        return 0
    if "min.due_ms" in files.column_names and not files["min.due_ms"].null_count:
        if pc.min(files["min.due_ms"]).as_py() > watermark_ms:
            return 0
    return int(table.delete(f"due_ms <= {int(watermark_ms)}").get("num_deleted_rows", 0))


def _merge_small_files(table) -> int:
    """When `SMALL_FILES_TO_MERGE` files hold fewer than `SMALL_FILE_ROWS`
    rows each, rewrite the whole set sorted by due_ms into files of about
    `ROWS_PER_FILE` rows (delta-rs' z-order on the one column: a sort), so
    that a window's read opens a few files again; no row changes
    (dataChange false), and the cost follows what waits."""
    refresh(table)
    files = pa.table(table.get_add_actions(flatten=True))
    small = pc.sum(pc.less(files["num_records"], SMALL_FILE_ROWS)).as_py() or 0
    if small < SMALL_FILES_TO_MERGE:
        return 0
    rows = pc.sum(files["num_records"]).as_py() or 1
    row_bytes = max(1, (pc.sum(files["size_bytes"]).as_py() or 0) // rows)
    metrics = table.optimize.z_order(["due_ms"], target_size=row_bytes * ROWS_PER_FILE)
    return int(metrics.get("numFilesRemoved", 0))
