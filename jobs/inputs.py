"""A run's inputs, read by version: the rows the producer tables gained since
the last run (their change data feed, or its files read as parquet), and the
job's state tables as of the versions pinned in the run's intent, so that a
redo of the run reads exactly what the first attempt read.
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType

from jobs import appends, scheduled
from jobs.job_tables import NO_VERSION, WHOLE_STATE_TABLES
from jobs.local import local_frame
from schemas import CHECK_ANSWERS, HALF, OP, TableSchema, table_path
from schemas.spark import spark_schema
from schemas.tables import SCHEDULED
from txn_core.delta_log import LOG_DIR, entry_name


class HistoryGoneError(RuntimeError):
    """The Delta log no longer holds the versions the job still has to read."""


def empty(spark: SparkSession, table: TableSchema, with_commit_version: bool = False) -> DataFrame:
    schema = spark_schema(table)
    if with_commit_version:
        schema = schema.add("commit_version", LongType(), False)
    return local_frame(spark, [], schema)


def snapshot(spark: SparkSession, path: str, table: TableSchema, version: int) -> DataFrame:
    """The table as of `version` (empty when it did not exist then)."""
    if version == NO_VERSION:
        return empty(spark, table)
    return with_missing_columns(
        spark.read.format("delta").option("versionAsOf", version).load(path), table
    )


def log_holds(spark: SparkSession, path: str, version: int) -> bool:
    """Whether the table's log still has the commit of `version` (Hadoop FS: any storage)."""
    jvm = spark.sparkContext._jvm
    log_file = jvm.org.apache.hadoop.fs.Path(f"{path.rstrip('/')}/{LOG_DIR}/{entry_name(version)}")
    fs = log_file.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return fs.exists(log_file)


def added_rows(
    spark: SparkSession,
    path: str,
    table: TableSchema,
    after: int,
    upto: int,
    *,
    keep_slow: Callable[[DataFrame], DataFrame] | None = None,
) -> DataFrame:
    """Rows inserted in versions (after, upto], with their `commit_version`:
    the change data feed's inserts, read as parquet when the commits allow
    (`jobs.appends`). `keep_slow`: applied to the rows when they come from
    the change feed's reader, which costs several times a parquet read (for
    a caller reading them more than once, to cache them).

    Fails with HistoryGoneError when the log no longer holds version after+1:
    the job then cannot know what was added, and guessing could deliver a
    message twice or never. This happens only when the job has not run for
    longer than the producer tables' log retention (2 days by default).
    """
    if upto <= after:
        return empty(spark, table, with_commit_version=True)
    if not log_holds(spark, path, after + 1):
        raise HistoryGoneError(
            f"the Delta log of {path} no longer holds version {after + 1}, where the job's "
            f"cursor stands (cleaned up after the table's logRetentionDuration); the job "
            f"must run at least once within that window. Rows added since cannot be "
            f"read incrementally; restore the log or raise the retention and rerun"
        )
    files = appends.appended_files(path, after, upto)
    if files is not None:
        return (
            appends.read_appended(spark, files, table)
            if files
            else empty(spark, table, with_commit_version=True)
        )
    rows = with_missing_columns(change_feed_inserts(spark, path, after, upto), table)
    return keep_slow(rows) if keep_slow is not None else rows


def with_missing_columns(df: DataFrame, table: TableSchema) -> DataFrame:
    """`df` with the columns of `table` it lacks added as nulls: a table an
    earlier release created, not migrated yet (`txn_core.tables.add_missing_columns`),
    reads as one that was. (Read as parquet with `table`'s schema, its files
    give the nulls themselves.)"""
    missing = [c for c in table.columns if c.name not in df.columns]
    if not missing:
        return df
    return df.selectExpr("*", *[f"CAST(NULL AS {c.type}) AS `{c.name}`" for c in missing])


def change_feed_inserts(spark: SparkSession, path: str, after: int, upto: int) -> DataFrame:
    """The change data feed's inserts in versions (after, upto], with `commit_version`."""
    return (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", after + 1)
        .option("endingVersion", upto)
        .load(path)
        .where(F.col("_change_type") == "insert")
        .withColumnRenamed("_commit_version", "commit_version")
        .drop("_change_type", "_commit_timestamp")
    )


def input_paths(warehouse: str) -> dict[str, str]:
    return {
        "half": table_path(warehouse, HALF),
        "op": table_path(warehouse, OP),
        "answers": table_path(warehouse, CHECK_ANSWERS),
    }


def state_version_key(table: TableSchema) -> str:
    return table.path


def read_scheduled(
    spark: SparkSession, warehouse: str, versions: dict[str, int], after_ms: int, upto_ms: int
) -> DataFrame:
    """The scheduled set as of the version pinned in `versions`, read from
    the files that may hold a row due in (after_ms, upto_ms]
    (`scheduled.files_due`); the caller filters the rows
    (`T.due_scheduled`). Through Delta's reader when the log does not allow it."""
    path = table_path(warehouse, SCHEDULED)
    version = versions.get(state_version_key(SCHEDULED), NO_VERSION)
    if version != NO_VERSION:
        files = scheduled.files_due(path, version, after_ms, upto_ms)
        if files is not None:
            return _read_files(spark, SCHEDULED, files)
    return snapshot(spark, path, SCHEDULED, version)


def read_state(
    spark: SparkSession, warehouse: str, versions: dict[str, int], table: TableSchema
) -> DataFrame:
    """The state table as of the version pinned in `versions` (a run's intent).

    The tables a run reads whole (WHOLE_STATE_TABLES) are read as the parquet
    files of that snapshot when the log allows (`appends.snapshot_files`);
    the others are looked up by key, where Delta's reader skips files by
    their statistics.
    """
    path = table_path(warehouse, table)
    version = versions.get(state_version_key(table), NO_VERSION)
    if table in WHOLE_STATE_TABLES:
        return read_snapshot(spark, path, table, version)
    return snapshot(spark, path, table, version)


def read_state_holding(
    spark: SparkSession,
    warehouse: str,
    versions: dict[str, int],
    table: TableSchema,
    offsets: list[int],
) -> DataFrame:
    """The state table as of the version pinned in `versions`, or at least
    its rows whose half_offset is one of `offsets` (the caller keeps those):
    read as parquet from the files whose statistics may hold one
    (`appends.snapshot_files_holding`) when the log allows, else through
    Delta's reader, which skips files the same way but first computes the
    table's snapshot in Spark jobs, every run that looks one up."""
    path = table_path(warehouse, table)
    version = versions.get(state_version_key(table), NO_VERSION)
    if version != NO_VERSION:
        files = appends.snapshot_files_holding(path, version, "half_offset", offsets)
        if files is not None:
            return _read_files(spark, table, files)
    return snapshot(spark, path, table, version)


def read_state_in_range(
    spark: SparkSession,
    warehouse: str,
    versions: dict[str, int],
    table: TableSchema,
    low: int,
    high: int,
) -> tuple[DataFrame, int] | None:
    """(The rows of the state table as of the version pinned in `versions`
    whose half_offset lies in [low, high], how many rows the files read for
    them hold): read as parquet from the files whose statistics overlap the
    range (`appends.snapshot_files_overlapping`); None when the log does
    not allow it."""
    path = table_path(warehouse, table)
    version = versions.get(state_version_key(table), NO_VERSION)
    # created and never written (`_sys/discard` in most warehouses): one
    # log entry read, where opening the table lists and reads its log
    if version == NO_VERSION or (version == 0 and appends.appended_rows(path, -1, 0) == 0):
        return empty(spark, table), 0
    picked = appends.snapshot_files_overlapping(path, version, "half_offset", low, high)
    if picked is None:
        return None
    files, rows = picked
    return _read_files(spark, table, files).where(
        f"half_offset BETWEEN {int(low)} AND {int(high)}"
    ), rows


def read_snapshot(spark: SparkSession, path: str, table: TableSchema, version: int) -> DataFrame:
    """The table as of `version` (`snapshot`), read as the parquet files of
    that snapshot when the log allows (`appends.snapshot_files`)."""
    if version != NO_VERSION:
        files = appends.snapshot_files(path, version)
        if files is not None:
            return _read_files(spark, table, files)
    return snapshot(spark, path, table, version)


def _read_files(spark: SparkSession, table: TableSchema, files: list[str]) -> DataFrame:
    """Data files of a snapshot (all of them, or those a caller picked) as
    parquet in `table`'s columns."""
    return appends.read_parquet(spark, table, files) if files else empty(spark, table)
