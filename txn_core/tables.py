"""Opening and creating the broker core's Delta tables through delta-rs.

The producer tables (`_sys/half`, `_sys/op`, `_sys/check_answers`) are
created here with the change data feed on, so the job and the producers read
only what was added since a version (a run's cursors are table versions,
docs/protocol.md §4.1). No other table feature is enabled: delta-rs must stay
able to write them (docs/protocol.md §2).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import TableNotFoundError
from deltalake.schema import Field

from schemas import CHECK_ANSWERS, HALF, LEASE, OP, PRODUCERS, RUNS, TableSchema, table_path
from schemas.arrow import arrow_schema
from txn_core import kept_tables
from txn_core.errors import PersistError
from txn_core.storage import options_for

BROKER_TABLES = (HALF, OP, CHECK_ANSWERS, PRODUCERS)

# Group commit at thousands of messages a second writes many commits: keep the
# log short (checkpoint every 100 commits, drop JSON commits after 2 days) so
# opening a table stays cheap. The job must run at least once in that window,
# or its next run fails (jobs.inputs.HistoryGoneError, docs/protocol.md §4.1).
PRODUCER_TABLE_CONFIG = {
    "delta.enableChangeDataFeed": "true",
    "delta.checkpointInterval": "100",
    "delta.logRetentionDuration": "interval 2 days",
    "delta.deletedFileRetentionDuration": "interval 1 days",
    "delta.enableExpiredLogCleanup": "true",
}


log = logging.getLogger(__name__)

#: the job's own small tables (`_sys/runs`, `_sys/lease`) take a few commits
#: every run and are read several times a run, each read replaying the log
#: from the newest checkpoint (on an object store, a GET per entry): a
#: checkpoint every this many commits keeps every read short
SMALL_TABLE_CHECKPOINT_EVERY = 10

#: `_sys/lease` and `_sys/runs` take commits at every run, idle or not, and
#: nothing reads their history: what a later commit replaced (its file, its
#: tombstone in their checkpoints) is kept this long, not Delta's week, in
#: which their checkpoints grew by a few rows a run (`vacuum_every_run_table`)
EVERY_RUN_RETENTION_HOURS = 1
EVERY_RUN_TABLE_CONFIG = {
    "delta.deletedFileRetentionDuration": f"interval {EVERY_RUN_RETENTION_HOURS} hours"
}

_CREATE_ONCE = CommitProperties(max_commit_retries=0)
# A column addition is rebased over the producers' concurrent appends.
_ALTER = CommitProperties(max_commit_retries=1000)


class MissingTableError(RuntimeError):
    """A table the caller needs does not exist (and may not be created here)."""


class SharedTopicTableError(RuntimeError):
    """Two topics' names lead to one table: the warehouse's file system does
    not tell them apart (`ORDER` and `Order` where case is ignored)."""


def check_topic_table(table: DeltaTable, topic: str) -> None:
    """Refuse `table` as `topic`'s when it was made for another topic.

    The job names each topic table after its topic when it creates it; a
    table made by an earlier release has no name and passes. On a file
    system that ignores case (macOS's and Windows' default), `topics/Order`
    is `topics/ORDER`, and two topics' messages would share one table and
    one range of offsets.
    """
    name = table.metadata().name
    if name is not None and name != topic:
        raise SharedTopicTableError(
            f"topic {topic!r} would use the table of topic {name!r} ({table.table_uri}): "
            "the warehouse's file system does not tell the two names apart (macOS and "
            "Windows ignore case by default). Nothing of it was read or delivered; put "
            "the warehouse on a case-sensitive file system or an object store "
            "(docs/operating.md, \"The warehouse's path, and each topic's directory\")"
        )


def open_or_create(
    warehouse: str,
    table: TableSchema,
    configuration: dict[str, str] | None = None,
    storage_options: dict[str, str] | None = None,
) -> DeltaTable:
    """Open `table` under `warehouse`, creating it when missing.

    Several processes may race to create the same table; the loser of the
    version-0 commit simply opens what the winner made. (With retries, delta-rs
    would commit the loser's CREATE TABLE again as version 1: a second table
    id and schema that every concurrent writer then conflicts with.)
    """
    uri = table_path(warehouse, table)
    storage_options = options_for(uri, storage_options)
    for attempt in range(5):
        try:
            return DeltaTable(uri, storage_options=storage_options)
        except TableNotFoundError:
            pass
        try:
            return DeltaTable.create(
                uri,
                arrow_schema(table),
                mode="error",
                configuration=configuration or PRODUCER_TABLE_CONFIG,
                storage_options=storage_options,
                commit_properties=_CREATE_ONCE,
            )
        # Lost the race to create it (delta-rs names that differently per store);
        # a real failure recurs and is reported after the last attempt.
        except Exception as exc:  # noqa: BLE001
            last = exc
            time.sleep(0.01 * (attempt + 1))
    raise PersistError(
        f"could not create {uri}: {last} (writing to the warehouse needs write access "
        "there, and room)"
    ) from last


def open_existing(
    warehouse: str, table: TableSchema, storage_options: dict[str, str] | None = None
) -> DeltaTable | None:
    """Open `table` if it exists, else None (e.g. check requests before the job ran)."""
    uri = table_path(warehouse, table)
    try:
        return DeltaTable(uri, storage_options=options_for(uri, storage_options))
    except TableNotFoundError:
        return None


def is_warehouse(warehouse: str, storage_options: dict[str, str] | None = None) -> bool:
    """Whether producers (`_sys/half`) or the job (`_sys/runs`) ever used `warehouse`."""
    return any(open_existing(warehouse, t, storage_options) is not None for t in (HALF, RUNS))


def ensure_broker_tables(
    warehouse: str, storage_options: dict[str, str] | None = None
) -> dict[str, DeltaTable]:
    """Create the tables the broker core writes, and add the columns a table
    made by an earlier release lacks (`add_missing_columns`); return handles
    keyed by path."""
    tables = {}
    for t in BROKER_TABLES:
        table = open_existing(warehouse, t, storage_options)
        if table is None:
            if t == HALF:  # a typo in a path makes a warehouse nobody else reads
                log.warning(
                    "creating a new warehouse at %s (it has no %s): if producers and the "
                    "job should share an existing one, check the warehouse setting",
                    warehouse,
                    HALF.path,
                )
            table = open_or_create(warehouse, t, storage_options=storage_options)
        add_missing_columns(table, t)
        tables[t.path] = table
    return tables


#: how often a column addition that lost a race to another commit is tried again
_ALTER_ATTEMPTS = 10


def missing_columns(table: DeltaTable, schema: TableSchema) -> list[str]:
    """The columns of `schema` the table does not have (yet)."""
    have = set(table.schema().to_arrow().names)
    return [name for name in schema.names if name not in have]


def add_missing_columns(table: DeltaTable, schema: TableSchema) -> list[str]:
    """Bring a table an earlier release created up to `schema`: add the
    columns it lacks, at the end and nullable (a metadata-only commit; rows
    already written read them as null in both engines). Returns the columns
    added; `table` is left at the new version.

    Several processes may migrate at once: a loser reloads and finds the
    columns there. A missing NOT NULL column, or one the table has in
    another position, cannot be added so and raises MissingTableError.

    >>> add_missing_columns(DeltaTable(path), HALF)        # doctest: +SKIP
    ['message_type']
    """
    for attempt in range(_ALTER_ATTEMPTS):
        missing = missing_columns(table, schema)
        if not missing:
            return []
        order = table.schema().to_arrow().names + missing
        if order != schema.names or any(schema.column(n).nullable is False for n in missing):
            raise MissingTableError(
                f"{table.table_uri} has columns {table.schema().to_arrow().names}; "
                f"{schema.path} needs {schema.names}, and only nullable columns at the end "
                "can be added"
            )
        fields = [Field.from_arrow(arrow_schema(schema).field(name)) for name in missing]
        try:
            table.alter.add_columns(fields, commit_properties=_ALTER)
            return missing
        except Exception as exc:  # noqa: BLE001 - a race: reload and look again
            last = exc
            time.sleep(0.01 * (attempt + 1))
            table.update_incremental()
    raise MissingTableError(f"could not add {missing} to {table.table_uri}: {last}") from last


def checkpoint_if_due(table: DeltaTable, every: int = SMALL_TABLE_CHECKPOINT_EVERY) -> None:
    """Checkpoint `table`, a handle that has just committed, when its
    version is a multiple of `every`. Whatever the table's own
    `delta.checkpointInterval`, so tables made by an earlier release get
    it too. A failure is only logged: the commit is done, and the next
    due version checkpoints again."""
    version = table.version()
    if version % every:
        return
    try:
        table.create_checkpoint()
    except Exception as exc:  # noqa: BLE001 - a missing checkpoint only slows readers
        log.warning("checkpoint of %s at version %d failed (%s)", table.table_uri, version, exc)


def lease_table(warehouse: str, storage_options: dict[str, str] | None = None) -> DeltaTable:
    """The job's lease table, written through delta-rs (put-if-absent commits)."""
    return open_or_create(
        warehouse,
        LEASE,
        configuration={"delta.checkpointInterval": "50", **EVERY_RUN_TABLE_CONFIG},
        storage_options=storage_options,
    )


def set_properties(table: DeltaTable, properties: dict[str, str]) -> bool:
    """Give `table` these `properties` where it has others or none (a
    metadata-only commit, none when it has them all); whether it committed."""
    configured = table.metadata().configuration
    if all(configured.get(key) == value for key, value in properties.items()):
        return False
    table.alter.set_table_properties(properties)
    return True


def vacuum_every_run_table(
    table: DeltaTable, retention_hours: int = EVERY_RUN_RETENTION_HOURS
) -> int:
    """Delete the files of `_sys/lease` or `_sys/runs` (`table`, up to date)
    that its log no longer references and that are older than
    `retention_hours`: each lease change leaves one, and so does each run
    record once compacted. A table made by an earlier release gets
    `EVERY_RUN_TABLE_CONFIG` first. Both are commits to the table (a vacuum
    logs its start and its end). Returns how many files were deleted.

    >>> vacuum_every_run_table(DeltaTable("/wh/_sys/runs"))   # doctest: +SKIP
    96
    """
    set_properties(table, EVERY_RUN_TABLE_CONFIG)
    deleted = table.vacuum(
        retention_hours=retention_hours,
        enforce_retention_duration=False,
        full=True,  # files whose tombstones have left the checkpoints too
        dry_run=False,
    )
    return len(deleted)


def latest_run_rows(
    warehouse: str,
    columns: list[str] | None = None,
    storage_options: dict[str, str] | None = None,
    *,
    run_number: int | None = None,
) -> list[dict[str, Any]]:
    """The `_sys/runs` rows (STARTED and/or COMMITTED) of the highest run
    number, or of `run_number`, read with delta-rs; [] before the job's
    first run (or when that run has no row).

    The files' statistics give the highest run_number and prune the scan to
    the files that may hold it: the cost stays flat while `_sys/runs` grows
    by a row or two every run.
    """
    try:
        uri = table_path(warehouse, RUNS)
        table = kept_tables.take(uri, options_for(uri, storage_options))
    except TableNotFoundError:
        return []
    try:
        return _latest_run_rows(table, columns, run_number)
    finally:
        kept_tables.give_back(table)


def _latest_run_rows(
    table: DeltaTable, columns: list[str] | None, top: int | None
) -> list[dict[str, Any]]:
    files = pa.table(table.get_add_actions(flatten=True))
    if files.num_rows == 0:
        return []
    stats = "max.run_number" in files.column_names and files["max.run_number"].null_count == 0
    if top is None and stats:
        top = pc.max(files["max.run_number"]).as_py()
    if stats:
        runs = table.to_pyarrow_dataset(file_pruning_predicate=[("run_number", "=", top)])
    else:  # files without statistics: read the column
        runs = table.to_pyarrow_dataset()
        if top is None:
            top = pc.max(runs.to_table(columns=["run_number"])["run_number"]).as_py()
    if top is None:
        return []
    rows: list[dict[str, Any]] = runs.to_table(
        columns=columns, filter=pc.field("run_number") == top
    ).to_pylist()
    return rows


def empty(table: TableSchema) -> pa.Table:
    return arrow_schema(table).empty_table()
