"""A run's write to a Delta table in two steps: Spark writes the rows as
parquet files, delta-rs commits them.

Not through Delta's own Spark writer: before each commit it computes the
table's snapshot in Spark jobs (for an overwrite, every file of it), collects
statistics in every task and runs post-commit jobs, for each of the up to
eight tables a run writes, mostly for the two small ones it overwrites (the
pending set, the queues). Here the files are what Delta's writer would write
(Spark's parquet writer, the session's settings), and the commit holds their
`add` actions (for an overwrite, the `remove` of the files they replace),
tagged with the run (`tagged_writes.write_for_run`), statistics taken from
the footers. Used only where that is exactly what Delta's writer would commit
(`committable`); anywhere else Delta's writer does the write, as it may.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from schemas import DISTINCT_COLUMNS
from txn_core.delta_log import file_stats, local_path, reader_duties, writer_duties

#: where Spark writes a commit's files before they move into the table; a
#: crash can leave one behind (hidden from Delta by its leading `_`), and
#: the next write to the table removes it (one writer at a time: the lease)
STAGING_PREFIX = "_txn_staging-"
#: Delta's defaults, for tables that do not set them
DEFAULT_INDEXED_COLUMNS = 32
DEFAULT_CHECKPOINT_INTERVAL = 10
#: Delta keeps string statistics to this many characters
STRING_PREFIX = 32


def committable(path: str, df: DataFrame):
    """The delta-rs table at `path` when this module can write `df` to it,
    else None: a table on a local disk whose protocol asks for nothing beyond
    the change data feed (whole files added or removed need no change files:
    the feed's readers take them as inserts and deletes), with no CHECK
    constraint, invariant or generated column to enforce, and `df`'s columns."""
    root = local_path(path)
    if root is None:
        return None
    from deltalake import DeltaTable as RsTable
    from deltalake.exceptions import TableNotFoundError

    try:
        table = RsTable(path)
    except TableNotFoundError:
        return None
    if reader_duties(table) is not None or writer_duties(table) is not None:
        return None
    schema = table_schema(table)
    same_columns = [(f.name, f.dataType.simpleString()) for f in schema.fields] == [
        (f.name, f.dataType.simpleString()) for f in df.schema.fields
    ]
    return table if same_columns else None


def table_schema(table) -> StructType:
    """The table's columns as Spark's types (Delta's schema JSON is Spark's)."""
    return StructType.fromJson(json.loads(table.schema().to_json()))


def write(df: DataFrame, table, mode: str, user_metadata: str) -> int:
    """Write `df` (its columns those of `table`: `committable`) to the table
    as one commit, appended or replacing every row (`mode`), with
    `user_metadata` in its commitInfo. Returns the version committed.

    A null in a NOT NULL column fails the Spark job, naming the column, and
    nothing is committed (as Delta's writer does).
    """
    _check_mode(mode)
    return commit(table, stage(df, table), mode, user_metadata)


def stage(df: DataFrame, table) -> list:
    """Write `df`'s rows as files into the table's directory, uncommitted
    (invisible to readers); their `add` actions, for `commit`."""
    root = local_path(table.table_uri)

    def write(staging: str) -> dict:
        _writer(df.select(*_not_null_checked(df, table_schema(table), root))).parquet(staging)
        return {0: staging}

    return _staged({0: table}, write)[0]


def stage_split(df: DataFrame, column: str, tables: dict) -> dict[str, list]:
    """`stage` for several tables in one Spark job: each row of `df` goes to
    the table `tables` names for its `column` value (each table `committable`
    for `df` without `column`; rows of other values are not written). The
    `add` actions by value.

    Why: one job reads `df` once, where one write per table reads all of it
    each time to keep its own rows.
    """
    values = sorted(tables)
    where = ", ".join(local_path(tables[v].table_uri) for v in values)

    def write(staging: str) -> dict:
        strictest = _strictest_schema([table_schema(tables[v]) for v in values])
        rows = df.where(F.col(column).isin(values))
        index = F.create_map(*[F.lit(x) for i, v in enumerate(values) for x in (v, i)])
        checked = _not_null_checked(rows.drop(column), strictest, where)
        (
            _writer(rows.select(*checked, index[F.col(column)].alias(_SPLIT_COLUMN)))
            .partitionBy(_SPLIT_COLUMN)
            .parquet(staging)
        )
        return {v: os.path.join(staging, f"{_SPLIT_COLUMN}={i}") for i, v in enumerate(values)}

    return _staged(tables, write)


def _staged(tables: dict, write) -> dict:
    """Clear what an earlier crash left staged in the tables, let `write(staging)`
    write the files in a new staging directory (inside the first table, so
    that the files move by a rename) and say where each table's files are,
    move them into their tables; the `add` actions by table."""
    roots = {key: local_path(table.table_uri) for key, table in tables.items()}
    for root in roots.values():
        _remove_staging(root)
    staging = _new_staging(roots[min(tables)])
    written = write(staging)
    staged = {}
    for key, table in tables.items():
        # no directory: no row for that table
        added = _moved_into_table(written[key], roots[key]) if os.path.isdir(written[key]) else []
        staged[key] = _add_actions(table, roots[key], added)
    shutil.rmtree(staging)
    return staged


#: the column `stage_split` partitions its one write by: the target's index
_SPLIT_COLUMN = "_txn_target"


def commit(table, adds: list, mode: str, user_metadata: str) -> int:
    """Commit staged `adds` to the table (`mode`: append, or overwrite: they
    replace every file), with `user_metadata` in its commitInfo; the version."""
    _check_mode(mode)
    from deltalake import CommitProperties
    from deltalake.transaction import PostCommitHookProperties

    table.create_write_transaction(
        adds,
        mode=mode,
        schema=table.schema(),
        commit_properties=CommitProperties(custom_metadata={"userMetadata": user_metadata}),
        post_commithook_properties=PostCommitHookProperties(
            create_checkpoint=False, cleanup_expired_logs=False
        ),
    )
    table.update_incremental()
    version = table.version()
    _checkpoint_as_delta_does(table, version, table.metadata().configuration)
    return version


def _check_mode(mode: str) -> None:
    if mode not in ("append", "overwrite"):
        raise ValueError(f"mode must be 'append' or 'overwrite'; got {mode!r}")


def _writer(df: DataFrame):
    """`df.write` with no _SUCCESS file, and no dictionary for the columns
    whose values are all distinct: parquet builds one for every column, and
    for these drops it, once built, for plain values."""
    writer = df.write.option("mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
    for name in DISTINCT_COLUMNS.intersection(df.columns):
        writer = writer.option(f"parquet.enable.dictionary#{name}", "false")
    return writer


def _new_staging(root: str) -> str:
    return os.path.join(root, STAGING_PREFIX + uuid.uuid4().hex)


def _strictest_schema(schemas: list[StructType]) -> StructType:
    """The first schema, each column NOT NULL where any of them says so."""
    first = schemas[0]
    for field in first.fields:
        field.nullable = all(s[field.name].nullable for s in schemas)
    return first


def _not_null_checked(df: DataFrame, schema: StructType, where: str) -> list:
    """`df`'s columns, failing on a null in a column the table declares NOT
    NULL (where Spark cannot tell from the plan that there is none)."""
    nullable = {f.name: f.nullable for f in df.schema.fields}
    columns = []
    for field in schema.fields:
        col = F.col(field.name)
        if not field.nullable and nullable[field.name]:
            message = f"NOT NULL constraint violated for column {field.name} of {where}"
            col = F.when(col.isNull(), F.raise_error(F.lit(message))).otherwise(col)
        columns.append(col.alias(field.name))
    return columns


def _remove_staging(root: str) -> None:
    for name in os.listdir(root):
        if name.startswith(STAGING_PREFIX):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _moved_into_table(written: str, root: str) -> list[str]:
    """Move the data files Spark wrote in `written` (and their checksum
    files, as Delta's writer leaves them) into the table's directory; their
    names."""
    names = sorted(n for n in os.listdir(written) if n.endswith(".parquet"))
    for name in names:
        os.rename(os.path.join(written, name), os.path.join(root, name))
        crc = f".{name}.crc"
        if os.path.exists(os.path.join(written, crc)):
            os.rename(os.path.join(written, crc), os.path.join(root, crc))
    return names


def _add_actions(table, root: str, names: list[str]) -> list:
    indexed = _indexed_columns(table_schema(table), table.metadata().configuration)
    return [add for add in (_add_action(root, name, indexed) for name in names) if add is not None]


def _indexed_columns(schema: StructType, config: dict) -> list[str]:
    """The columns Delta keeps statistics on: `delta.dataSkippingStatsColumns`,
    else the first `delta.dataSkippingNumIndexedCols` (-1: all)."""
    named = config.get("delta.dataSkippingStatsColumns")
    if named:
        return [c.strip() for c in named.split(",")]
    n = int(config.get("delta.dataSkippingNumIndexedCols", DEFAULT_INDEXED_COLUMNS))
    names = [f.name for f in schema.fields]
    return names if n < 0 else names[:n]


def _add_action(root: str, name: str, indexed: list[str]):
    """The `add` action of a data file; None for a file without rows (Spark
    writes one for an empty DataFrame), which is deleted instead."""
    import pyarrow.parquet as pq
    from deltalake.transaction import AddAction

    full = os.path.join(root, name)
    metadata = pq.read_metadata(full)
    if metadata.num_rows == 0:
        for leftover in (full, os.path.join(root, f".{name}.crc")):
            if os.path.exists(leftover):
                os.remove(leftover)
        return None
    info = os.stat(full)
    stats = file_stats(metadata, indexed, string_prefix=STRING_PREFIX)
    return AddAction(name, info.st_size, {}, int(info.st_mtime * 1000), True, json.dumps(stats))


def _checkpoint_as_delta_does(table, version: int, config: dict) -> None:
    """A checkpoint every `delta.checkpointInterval` commits (Delta's default,
    10), and the log entries past `delta.logRetentionDuration` dropped then,
    as Delta's writer does after its commits; Spark's readers then replay at
    most that many commits."""
    interval = int(config.get("delta.checkpointInterval", DEFAULT_CHECKPOINT_INTERVAL))
    if interval > 0 and version > 0 and version % interval == 0:
        table.create_checkpoint()
        table.cleanup_metadata()
