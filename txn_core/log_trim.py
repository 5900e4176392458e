"""Trimming a producer table's Delta log to what the job still needs.

On a local filesystem delta-rs lists a table's whole `_delta_log` directory
several times a commit, so a commit's cost grows with the log, and time-based
clean-up alone (`delta.logRetentionDuration`, 2 days) lets a busy table's log
reach millions of entries. The only reader of old entries is the job, reading
the change data feed from its cursor: the input versions its latest run
started from (`_sys/runs`; an unfinished run is redone from there). So the
producers trim up to the newest checkpoint at or before that cursor (the job
can always read on, any reader can rebuild the table from that checkpoint),
and nothing until the job has run once: its first run reads from version 0.

The job's own tables under `_sys/` have no reader of their history beyond
the versions the latest run pinned, a commit or two back: their logs are
trimmed to their last hundred or so entries (`trim_behind_newest`), those
written at every run, idle or not (`_sys/lease`, `_sys/runs`), through
`checkpoint_and_trim`.
"""

from __future__ import annotations

import logging
import os

from deltalake import DeltaTable

from schemas import HALF, OP, TableSchema
from txn_core.delta_log import LOG_DIR, checkpoint_versions, entry_name, is_log_file, local_dir
from txn_core.tables import SMALL_TABLE_CHECKPOINT_EVERY, checkpoint_if_due, latest_run_rows

log = logging.getLogger(__name__)

#: log entries `checkpoint_and_trim` keeps behind a table's newest commit: a
#: reader that listed the log loses the checkpoint it reads from only if that
#: many commits are made before it reads it
KEPT_ENTRIES = 100

#: the `_sys/runs` column with the version after which a run reads each table
_CURSOR = {HALF.path: "prev_half_version", OP.path: "prev_op_version"}


def job_cursor(
    warehouse: str, table: TableSchema, storage_options: dict[str, str] | None = None
) -> int | None:
    """The first version of `table` (half or OP) the job may still read, or
    None when the job has not run yet."""
    column = _CURSOR[table.path]
    rows = latest_run_rows(warehouse, [column], storage_options)
    return min(r[column] for r in rows) + 1 if rows else None


def trim_log(table: DeltaTable, keep_from: int) -> int:
    """Delete the log entries (commits, their checksums, checkpoints) of
    versions before the newest checkpoint at or before `keep_from`; returns
    how many. Only on a local filesystem (elsewhere listing from a version
    does not read the whole log, and time-based clean-up does)."""
    root = local_dir(table)
    if root is None:
        return 0
    log_dir = os.path.join(root, LOG_DIR)
    names = sorted(os.listdir(log_dir))
    checkpoints = checkpoint_versions(names)
    floor = max((v for v in checkpoints if v <= keep_from), default=None)
    if floor is None:
        return 0
    removed = 0
    for name in names:  # oldest first: what is left is always contiguous
        version = is_log_file(name)
        if version is None or version >= floor:
            continue
        try:
            os.remove(os.path.join(log_dir, name))
            removed += 1
        except FileNotFoundError:  # another producer process trimmed it first
            pass
    return removed


def trimmed_past(table: DeltaTable) -> bool:
    """Whether the log no longer holds this handle's own version (local tables
    only; elsewhere False): a handle left behind while other processes
    committed and trimmed. delta-rs cannot commit from it (it reads the commits
    since its version to rebase); `update_incremental` rebuilds it from the
    newest checkpoint."""
    root = local_dir(table)
    if root is None:
        return False
    return not os.path.exists(os.path.join(root, LOG_DIR, entry_name(table.version())))


def checkpoint_and_trim(table: DeltaTable) -> int:
    """After a commit through `table` to a table the job writes at every run
    (`_sys/lease`, `_sys/runs`): `checkpoint_if_due`, and once a checkpoint
    is made, the log trimmed to the newest checkpoint at least
    `KEPT_ENTRIES` versions back (`trim_log`: a local disk only). Nothing
    reads those tables' history, and a few entries a run made every commit,
    and so every idle run of a continuous job, slower by the hour
    (docs/performance.md). A handle whose own version was trimmed cannot
    commit (delta-rs refuses it), so no commit can reuse a trimmed version.

    Returns the entries removed; a failed trim is only logged, the next
    checkpoint trims again.

    >>> checkpoint_and_trim(table)   # doctest: +SKIP
    0
    """
    version = table.version()
    if version % SMALL_TABLE_CHECKPOINT_EVERY:
        return 0
    checkpoint_if_due(table)
    return trim_behind_newest(table)


def trim_behind_newest(table: DeltaTable) -> int:
    """`trim_log` to the newest checkpoint at least `KEPT_ENTRIES` versions
    behind the handle's version, for a table whose history nobody reads;
    returns the entries removed. A failed trim is only logged: the next
    one trims again."""
    try:
        return trim_log(table, table.version() - KEPT_ENTRIES)
    except OSError as exc:
        log.warning("trimming the log of %s failed (%s)", table.table_uri, exc)
        return 0
