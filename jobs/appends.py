"""Delta tables read as plain parquet where their log allows: the rows a producer
table gained between two versions, and a state table read whole.

Why not Delta's change data feed: its batch reader (`DeltaCDFRelation`)
hands Spark its rows as an `RDD[Row]`, so every row is converted to a JVM
object and back. For the half table, whose rows carry the message bodies,
that made reading 1,000,000 new rows cost ~12 s of CPU on 2 cores, where
reading the same files as parquet (vectorized, no conversion) costs 2-3 s:
the largest single cost of a run.

What is read instead: the producer tables only grow by blind appends
(group commits, batches) and by compactions that rewrite files without
changing data (dataChange=false). For such commits the change feed's
inserts are exactly the rows of the files their `add` actions mark
dataChange=true, which `appended_files` lists from the commits' log entries
and `read_appended` reads, each row with the version that added it. Anything
else in the range — a DELETE's change files, a deletion vector, partitions,
column mapping, a file added twice (a RESTORE) — and any table not on a
local disk, where the log entries are not plain files to read, fall back to
the change data feed, which is always right.

A table read whole (the pending set, the queues) is read the same way, as
the files of its snapshot (`snapshot_files`), under the same conditions.
"""
from __future__ import annotations

import json
import os
from urllib.parse import unquote

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from jobs.local import local_frame
from schemas import TableSchema
from schemas.spark import spark_schema
from txn_core.log_trim import local_path

_FILE_VERSIONS = StructType([StructField("_file", StringType(), False),
                             StructField("commit_version", LongType(), False)])
#: table properties under which a data file's rows are not the table's rows as written
_READER_PROPERTIES = ("delta.columnMapping.mode",)


def log_entry(root: str, version: int) -> str:
    return os.path.join(root, "_delta_log", f"{version:020d}.json")


def appended_files(path: str, after: int, upto: int) -> list[tuple[int, str]] | None:
    """(version, file path) of every data file the commits (after, upto]
    added with dataChange=true, when each of those commits is one the
    module's docstring can read as parquet; otherwise None.

    The caller checked that the log still holds version after + 1; a later
    entry missing (removed meanwhile) also gives None, and the change data
    feed then says what is wrong.
    """
    root = local_path(path)
    if root is None or not plain_table(_rs_table(path, upto)):
        return None
    files: list[tuple[int, str]] = []
    for version in range(after + 1, upto + 1):
        try:
            with open(log_entry(root, version), "rb") as entry:
                actions = [json.loads(line) for line in entry if line.strip()]
        except FileNotFoundError:
            return None
        for action in actions:
            if not _plain(action):
                return None
            add = action.get("add")
            if add is not None and add.get("dataChange", True):
                files.append((version, os.path.join(root, unquote(add["path"]))))
    names = [os.path.basename(f) for _, f in files]
    if len(set(names)) != len(names):
        return None  # a file added twice, or two directories: leave it to the change feed
    return files


def _plain(action: dict) -> bool:
    """Whether the action leaves each added file's rows as the rows it adds."""
    if "cdc" in action:
        return False
    if "add" in action:
        add = action["add"]
        return not add.get("deletionVector") and not add.get("partitionValues")
    if "metaData" in action:
        meta = action["metaData"]
        config = meta.get("configuration") or {}
        return not meta.get("partitionColumns") and all(
            config.get(k, "none") == "none" for k in _READER_PROPERTIES)
    if "protocol" in action:
        protocol = action["protocol"]
        return _plain_reader(protocol.get("minReaderVersion", 1),
                             protocol.get("readerFeatures"))
    return True


def _plain_reader(min_reader_version: int, reader_features) -> bool:
    """Whether a reader of this protocol reads data files as they are."""
    return min_reader_version == 1 or (
        min_reader_version == 3 and set(reader_features or ()) <= {"timestampNtz"})


def snapshot_files(path: str, version: int) -> list[str] | None:
    """The data files of the table as of `version`, when its rows are those
    files' rows as written (no deletion vectors, column mapping or
    partitions) and they are on a local disk; otherwise None.

    Listed from the log by delta-rs in milliseconds, where Delta's own
    reader first computes the table's snapshot in a Spark job (~0.4 s on 2
    cores; for the pending set, before the run can start its first pass).
    """
    if local_path(path) is None:
        return None
    table = _rs_table(path, version)
    return table.file_uris() if plain_table(table) else None


def _rs_table(path: str, version: int):
    from deltalake import DeltaTable as RsTable
    return RsTable(path, version=version)


def plain_table(table) -> bool:
    """Whether the delta-rs `table` (at its loaded version) has its rows in
    its data files as written (what commits before the range set up, e.g.
    column mapping)."""
    protocol, metadata = table.protocol(), table.metadata()
    return (_plain_reader(protocol.min_reader_version, protocol.reader_features)
            and not metadata.partition_columns
            and all(metadata.configuration.get(k, "none") == "none"
                    for k in _READER_PROPERTIES))


def read_appended(spark: SparkSession, files: list[tuple[int, str]],
                  table: TableSchema) -> DataFrame:
    """The rows of `files` (`appended_files`, not empty) in `table`'s
    columns, plus `commit_version`: the version that added each file."""
    versions = local_frame(spark, [(os.path.basename(f), v) for v, f in files], _FILE_VERSIONS)
    rows = (spark.read.schema(spark_schema(table)).parquet(*[f for _, f in files])
            .withColumn("_file", F.col("_metadata.file_name")))
    return (rows.join(F.broadcast(versions), "_file").drop("_file")
            .select(*table.names, "commit_version"))
