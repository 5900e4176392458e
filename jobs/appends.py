"""Delta tables read as plain parquet where their log allows: the rows a producer
table gained between two versions, and a state table read whole.

Not through Delta's change data feed: its batch reader (`DeltaCDFRelation`)
converts every row to a JVM object and back, for the half table's bodies the
largest single cost of a run, where parquet is read vectorized. The producer
tables only grow by blind appends, by MERGEs that only insert (the check
answers) and by compactions that change no data (dataChange=false), and for
such commits the feed's inserts are exactly the rows of the files their
`add` actions mark dataChange=true: `appended_files`
lists them from the log entries, `read_appended` reads them. Any other commit
in the range, or a table neither on a local disk nor on S3, falls back to the
change data feed, which is always right. A table read whole (the pending set,
the queues) is read the same way (`snapshot_files`).
"""

from __future__ import annotations

import json
import os
import threading
from bisect import bisect_left
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from urllib.parse import unquote

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from jobs import transforms as T
from jobs.local import local_frame
from schemas import TableSchema
from schemas.arrow import arrow_schema
from schemas.spark import spark_schema
from txn_core import kept_tables
from txn_core.delta_log import (
    LOG_DIR,
    entry_name,
    local_path,
    open_table,
    plain_reader,
    reader_duties,
)
from txn_core.storage import is_s3, object_key, options_for, storage_for

_FILE_VERSIONS = StructType(
    [StructField("_file", StringType(), False), StructField("commit_version", LongType(), False)]
)
#: log entries fetched at once from an object store
_PARALLEL_GETS = 16


def log_entry(root: str, version: int) -> str:
    return os.path.join(root, LOG_DIR, entry_name(version))


def appended_files(path: str, after: int, upto: int) -> list[tuple[int, str, int]] | None:
    """(version, file path, size in bytes) of every data file the commits
    (after, upto] added with dataChange=true, when each of those commits can be read as
    parquet (no rewritten rows as by an UPDATE, DELETE or updating MERGE,
    no deletion vector, partitions, column mapping or file added twice, as
    by a RESTORE) and the table is on a local
    disk or on S3 (its entries fetched with the warehouse's client, several
    at a time); otherwise None.

    The caller checked that the log still holds version after + 1; a later
    entry missing (removed meanwhile) also gives None, and the change data
    feed then says what is wrong.
    """
    if local_path(path) is None and not is_s3(path):
        return None
    plain_before = _plain_from.get(path)
    checked = plain_before is not None and after <= plain_before <= upto
    if not checked and not plain_table(_rs_table(path, upto)):
        return None
    entries = _log_entries(path, range(after + 1, upto + 1))
    if entries is None:
        return None
    files: list[tuple[int, str, int]] = []
    for version, actions in entries:
        if _rewrites_rows(actions):
            return None
        for action in actions:
            if not _plain(action):
                return None
            add = action.get("add")
            if add is not None and add.get("dataChange", True):
                if "://" in add["path"]:
                    return None  # an absolute path (a shallow clone): the change feed
                files.append((version, _join(path, unquote(add["path"])), int(add["size"])))
    names = [f.rsplit("/", 1)[-1] for _, f, _ in files]
    if len(set(names)) != len(names):
        return None  # a file added twice, or two directories: leave it to the change feed
    _plain_from[path] = upto
    return files


#: by table path, a version at which the table was plain (`plain_table`):
#: a later read of the commits after it (`appended_files`) needs no opening
#: of the table, which replays its log from its last checkpoint, since each
#: of those commits' protocol and metadata is checked on the way (`_plain`).
#: Like the job's cursors, it assumes a table is not replaced by another at
#: the same path.
_plain_from: dict[str, int] = {}


#: the most log entries `appended_rows` reads to count a run's new rows
COUNT_MAX_VERSIONS = 10_000


def appended_rows(path: str, after: int, upto: int) -> int | None:
    """How many rows the commits (after, upto] added, from the statistics
    (numRecords) of their `add` actions with dataChange=true; None when the
    table is neither local nor on S3, an entry or a file's statistics are
    missing, or there are more than `COUNT_MAX_VERSIONS` entries to read.
    A prediction's input (the JVM a run gets), not the rows a run reads."""
    if upto <= after:
        return 0
    stats = _added_stats(path, after, upto)
    if stats is None:
        return None
    try:
        return sum(int(s["numRecords"]) for s in stats)
    except (KeyError, ValueError, TypeError):
        return None


def appended_range(path: str, after: int, upto: int, column: str) -> tuple[int, int] | None:
    """The least and the greatest `column` (an integer column no row leaves
    null) among the rows the commits (after, upto] added, from the
    statistics (minValues, maxValues) of their `add` actions with
    dataChange=true; None when nothing was added, or when `appended_rows`
    would give None or a file's statistics of `column` are missing."""
    stats = _added_stats(path, after, upto) if upto > after else None
    if not stats:
        return None
    try:
        lows = [int(s["minValues"][column]) for s in stats]
        highs = [int(s["maxValues"][column]) for s in stats]
    except (KeyError, ValueError, TypeError):
        return None
    return min(lows), max(highs)


def _added_stats(path: str, after: int, upto: int) -> list | None:
    """The statistics of each `add` action with dataChange=true in the
    commits (after, upto], parsed (an action without them: an empty dict);
    None when the table is neither local nor on S3, there are more than
    `COUNT_MAX_VERSIONS` entries to read, or an entry is missing."""
    if upto - after > COUNT_MAX_VERSIONS or (local_path(path) is None and not is_s3(path)):
        return None
    entries = _log_entries(path, range(after + 1, upto + 1))
    if entries is None:
        return None
    stats = []
    for _, actions in entries:
        for action in actions:
            add = action.get("add")
            if add is not None and add.get("dataChange", True):
                try:
                    stats.append(json.loads(add.get("stats") or "{}"))
                except ValueError:
                    stats.append({})  # unreadable: as good as missing
    return stats


#: within `log_entries_kept`: the log entries read, by (table path, version)
_kept: dict[tuple[str, int], list[dict]] | None = None
_kept_lock = threading.Lock()


@contextmanager
def log_entries_kept() -> Iterator[None]:
    """Within: each log entry `_log_entries` reads is read once, then kept
    (a run reads its new entries twice: its size, then its files). Only for
    the length of a run: an entry never changes, but a table deleted and
    made again at the same path starts its versions over."""
    global _kept
    with _kept_lock:
        _kept = {}
    try:
        yield
    finally:
        with _kept_lock:
            _kept = None


def _log_entries(path: str, versions: range) -> list[tuple[int, list[dict]]] | None:
    """The actions of each version's log entry, from a local disk or an S3
    store (or `log_entries_kept`); None if one is missing."""
    with _kept_lock:
        kept = _kept
        unread = [v for v in versions if kept is None or (path, v) not in kept]
    if kept is None:
        return _read_log_entries(path, versions)
    if unread:
        read = _read_log_entries(path, range(unread[0], versions.stop))
        if read is None:
            return None
        with _kept_lock:
            kept.update(((path, v), actions) for v, actions in read)
    with _kept_lock:
        return [(v, kept[(path, v)]) for v in versions]


def _read_log_entries(path: str, versions: range) -> list[tuple[int, list[dict]]] | None:
    """`_log_entries`, read."""
    root = local_path(path)
    if root is not None:
        entries = []
        for version in versions:
            try:
                with open(log_entry(root, version), "rb") as entry:
                    entries.append((version, _actions(entry.read())))
            except FileNotFoundError:
                return None
        return entries
    storage = storage_for(path)
    client = storage.s3_client()
    prefix = object_key(path)

    def get(version: int) -> bytes | None:
        try:
            return client.get_object(
                Bucket=storage.bucket, Key=f"{prefix}/{LOG_DIR}/{entry_name(version)}"
            )["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    # Entries are small: their requests' latency, not their bytes, is the cost.
    with ThreadPoolExecutor(_PARALLEL_GETS) as pool:
        bodies = list(pool.map(get, versions))
    if any(body is None for body in bodies):
        return None
    return [(v, _actions(body)) for v, body in zip(versions, bodies)]


def _actions(entry: bytes) -> list[dict]:
    return [json.loads(line) for line in entry.splitlines() if line.strip()]


def _join(table_path: str, relative: str) -> str:
    root = local_path(table_path)
    return (
        os.path.join(root, relative)
        if root is not None
        else table_path.rstrip("/") + "/" + relative
    )


def _rewrites_rows(actions: list[dict]) -> bool:
    """Whether a commit both removes and adds rows (an UPDATE, a DELETE
    that rewrites files, a MERGE that updates): its added files then hold
    rows that were there before. A commit that only adds (an append, a
    MERGE that only inserts, whose change file repeats the added rows) or
    only removes does not; nor does a compaction (dataChange=false)."""

    def changes(kind: str) -> bool:
        return any(kind in a and a[kind].get("dataChange", True) for a in actions)

    return changes("add") and changes("remove")


def _plain(action: dict) -> bool:
    """Whether the action leaves each added file's rows as the rows it adds
    (given a commit that does not rewrite rows, `_rewrites_rows`)."""
    if "add" in action:
        add = action["add"]
        return not add.get("deletionVector") and not add.get("partitionValues")
    if "metaData" in action:
        meta = action["metaData"]
        config = meta.get("configuration") or {}
        return (
            not meta.get("partitionColumns")
            and config.get("delta.columnMapping.mode", "none") == "none"
        )
    if "protocol" in action:
        protocol = action["protocol"]
        return plain_reader(protocol.get("minReaderVersion", 1), protocol.get("readerFeatures"))
    return True


def snapshot_files(path: str, version: int) -> list[str] | None:
    """The data files of the table as of `version`, when its rows are those
    files' rows as written (no deletion vectors, column mapping or
    partitions) and they are on a local disk or S3; otherwise None.

    Listed from the log by delta-rs, where Delta's own reader first computes
    the table's snapshot in a Spark job (for the pending set, before the run
    can start its first pass).
    """
    table = open_snapshot(path, version)
    if table is None:
        return None
    paths = _data_files(table)
    kept_tables.give_back(table)
    return paths


def _data_files(table) -> list[str]:
    """The paths of the data files of delta-rs' `table`, as Spark and pyarrow
    open them: delta-rs lists them as URIs, whose escapes (`%20` for a space)
    both would read as part of the name."""
    return [unquote(uri) for uri in table.file_uris()]


def snapshot_files_by_stats(path: str, version: int, column: str, may_hold) -> list[str] | None:
    """The data files of the table at `path` as of `version` whose
    statistics of `column` may hold a wanted row, when the table can be read
    as parquet (`open_snapshot`); otherwise None. `may_hold(low, high)`
    (pyarrow arrays of each file's min and max) says which; a file without
    them is kept. Chosen in the driver from the log: Delta's own reader
    first rebuilds the table's state and filters its files in Spark jobs of
    their own, at every read."""
    picked = _files_by_stats(path, version, column, may_hold)
    return None if picked is None else picked[0]


def snapshot_files_overlapping(
    path: str, version: int, column: str, low: int, high: int
) -> tuple[list[str], int] | None:
    """`snapshot_files_by_stats` for the rows whose integer `column` lies in
    [low, high], and how many rows those files hold in all (their
    numRecords); None as there, or when a picked file's count is missing."""
    import pyarrow.compute as pc

    def overlaps(least, greatest):
        return pc.and_(pc.less_equal(least, high), pc.greater_equal(greatest, low))

    picked = _files_by_stats(path, version, column, overlaps)
    if picked is None:
        return None
    uris, files = picked
    if files.num_rows == 0:
        return [], 0
    if "num_records" not in files.column_names or files["num_records"].null_count:
        return None
    return uris, int(pc.sum(files["num_records"]).as_py() or 0)


def _files_by_stats(path: str, version: int, column: str, may_hold):
    """(`snapshot_files_by_stats`' files, their add actions as a pyarrow
    table), or None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = open_snapshot(path, version)
    if table is None:
        return None
    files = pa.table(table.get_add_actions(flatten=True))
    paths = _data_files(table)
    kept_tables.give_back(table)
    if files.num_rows == 0:
        return [], files
    low, high = f"min.{column}", f"max.{column}"
    if low in files.column_names and high in files.column_names:
        unknown = pc.or_kleene(pc.is_null(files[low]), pc.is_null(files[high]))
        files = files.filter(pc.or_kleene(unknown, may_hold(files[low], files[high])))
    wanted = {unquote(p).rsplit("/", 1)[-1] for p in files["path"].to_pylist()}
    return [p for p in paths if p.rsplit("/", 1)[-1] in wanted], files


def snapshot_files_holding(
    path: str, version: int, column: str, values: list[int]
) -> list[str] | None:
    """`snapshot_files_by_stats` for the rows whose integer `column` is one
    of `values`: what a lookup by key must read."""
    import pyarrow as pa

    ordered = sorted(values)

    def may_hold(low, high):
        return pa.array(
            [
                lo is None or hi is None or _any_within(ordered, lo, hi)
                for lo, hi in zip(low.to_pylist(), high.to_pylist())
            ]
        )

    return snapshot_files_by_stats(path, version, column, may_hold)


def _any_within(ordered: list[int], low: int, high: int) -> bool:
    """Whether a value of the sorted `ordered` lies in [low, high]."""
    i = bisect_left(ordered, low)
    return i < len(ordered) and ordered[i] <= high


def open_snapshot(path: str, version: int):
    """The delta-rs table at `version` when its files can be read as
    parquet by Spark (`snapshot_files`' conditions), taken from
    `txn_core.kept_tables` (give it back); otherwise None."""
    if local_path(path) is None and not is_s3(path):
        return None
    table = kept_tables.take(path, options_for(path), version=version)
    if plain_table(table):
        return table
    kept_tables.give_back(table)
    return None


def _rs_table(path: str, version: int):
    return open_table(path, version=version, storage_options=options_for(path))


def plain_table(table) -> bool:
    """Whether the delta-rs `table` (at its loaded version) has its rows in
    its data files as written (`txn_core.delta_log.reader_duties`)."""
    return reader_duties(table) is None


#: appended files read by the driver (pyarrow) rather than by Spark's tasks,
#: when there are more than this many and their rows are small in all
#: (`DRIVER_READ_MAX_BYTES`): producers sending one message at a time commit
#: a file per message, and Spark lists them and opens each in turn, where
#: one pyarrow scan reads them all (docs/performance.md). Spark's own
#: threshold: past 32 paths it lists them in a Spark job of its own
#: (`spark.sql.sources.parallelPartitionDiscovery.threshold`), a task a file
DRIVER_READ_MIN_FILES = 32
#: what the driver may hold of them, as read (Arrow, uncompressed: bodies
#: that compress tenfold on disk take ten times their files' size here, and
#: the JVM keeps a copy): past it, a run's cost per file jumps several-fold,
#: so this is set to a backlog of minutes under a steady load (2 KB messages
#: at 1,000/s), not seconds, within the driver's 2 GB. Files bigger in all
#: are not read; a read that grows past it is dropped and Spark reads them
DRIVER_READ_MAX_BYTES = 256 * 1024 * 1024


def read_appended(
    spark: SparkSession, files: list[tuple[int, str, int]], table: TableSchema
) -> DataFrame:
    """The rows of `files` (`appended_files`, not empty) in `table`'s
    columns, plus `commit_version`: the version that added each file. Many
    small files are read by the driver (`DRIVER_READ_MIN_FILES`), any others
    by Spark."""
    if len(files) > DRIVER_READ_MIN_FILES and sum(size for *_, size in files) <= (
        DRIVER_READ_MAX_BYTES
    ):
        rows = _rows_in_driver(files, table)
        if rows is not None:
            return spark.createDataFrame(rows, schema=_with_commit_version(table))
    rows = read_parquet(spark, table, [f for _, f, _ in files])
    if len(files) <= VERSION_MAP_MAX_FILES:
        return T.select(rows, *table.names, f"{_commit_version(files)} AS commit_version")
    versions = local_frame(spark, [(os.path.basename(f), v) for v, f, _ in files], _FILE_VERSIONS)
    return (
        rows.withColumn("_file", F.col("_metadata.file_name"))
        .join(F.broadcast(versions), "_file")
        .drop("_file")
        .select(*table.names, "commit_version")
    )


def read_parquet(spark: SparkSession, table: TableSchema, files: list[str]) -> DataFrame:
    """`files` (not empty) read as parquet in `table`'s columns. Local files
    are listed by the driver: past `DRIVER_READ_MIN_FILES` paths Spark
    lists them in a Spark job, a task a file (`_LISTED_BY_SPARK_FROM`),
    where a look at each from the driver takes microseconds. Files on an
    object store are listed as Spark chooses."""
    reader = spark.read.schema(spark_schema(table))
    if len(files) <= DRIVER_READ_MIN_FILES or any(local_path(f) is None for f in files):
        return reader.parquet(*files)
    with _listing_lock:
        before = spark.conf.get(_LISTED_BY_SPARK_FROM, None)
        spark.conf.set(_LISTED_BY_SPARK_FROM, str(len(files) + 1))
        try:
            return reader.parquet(*files)
        finally:
            if before is None:
                spark.conf.unset(_LISTED_BY_SPARK_FROM)
            else:
                spark.conf.set(_LISTED_BY_SPARK_FROM, before)


#: the session setting past which Spark lists a read's paths in a Spark job
_LISTED_BY_SPARK_FROM = "spark.sql.sources.parallelPartitionDiscovery.threshold"
#: one read at a time changes that setting, so that each puts back what it found
_listing_lock = threading.Lock()

#: up to this many files read by Spark, each row's commit version comes
#: from an expression on its file's name; more are joined with a table of
#: them, a broadcast of its own (32 MB of hash table even for one file)
VERSION_MAP_MAX_FILES = 256


def _commit_version(files: list[tuple[int, str, int]]) -> str:
    """SQL: the version that added each row's file: that version when every
    file came in one commit (`T.sql_run_value`), else a lookup of its name."""
    versions = {v for v, _, _ in files}
    if len(versions) == 1:
        return T.sql_run_value(versions.pop())
    by_name = ", ".join(f"{T.sql_string(os.path.basename(f))}, {v}" for v, f, _ in files)
    return f"CAST(element_at(map({by_name}), _metadata.file_name) AS BIGINT)"


def _rows_in_driver(files: list[tuple[int, str, int]], table: TableSchema):
    """`read_appended`'s rows read by the driver, as one Arrow table for
    Spark (pyarrow, several files at a time; from S3 with the warehouse's
    client), or None once they pass `DRIVER_READ_MAX_BYTES`.

    One chunk: past the size it keeps in the plan
    (`spark.sql.execution.arrow.localRelationThreshold`), Spark makes a
    partition of each chunk, and a chunk per file made every stage of a run
    a task per producer commit, and its writes a file per task."""
    import pyarrow as pa

    schema = arrow_schema(table)
    if local_path(files[0][1]) is not None:
        batches = _local_batches(files, schema)
    else:
        batches = _s3_batches(files, schema)
    kept, size = [], 0
    with closing(batches):  # stopped early: the reads under way end now
        for batch in batches:
            size += batch.nbytes
            if size > DRIVER_READ_MAX_BYTES:
                return None
            kept.append(batch)
    return pa.Table.from_batches(kept, _arrow_with_commit_version(schema)).combine_chunks()


def _arrow_with_commit_version(schema):
    import pyarrow as pa

    return schema.append(pa.field("commit_version", pa.int64(), False))


def _local_batches(files: list[tuple[int, str, int]], schema) -> Generator:
    """The local `files`' rows in `schema` plus `commit_version`, batch by
    batch: one dataset scan (its threads in C++, a file's missing trailing
    columns null), cheaper per file than a read of each."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    paths = [local_path(path) for _, path, _ in files]
    names, versions = pa.array(paths), pa.array([v for v, _, _ in files], pa.int64())
    out = _arrow_with_commit_version(schema)
    scan = ds.dataset(paths, schema=schema, format="parquet").to_batches(
        columns=[*schema.names, "__filename"]
    )
    for batch in scan:
        which = pc.index_in(batch["__filename"], value_set=names)
        yield pa.RecordBatch.from_arrays(
            [*batch.columns[:-1], pc.take(versions, which)], schema=out
        )


def _s3_batches(files: list[tuple[int, str, int]], schema) -> Generator:
    """The S3 `files`' rows in `schema` plus `commit_version`, a batch per
    file, fetched `_PARALLEL_GETS` at a time: no more fetched than a few
    past where the reader stops."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    read = _s3_reader(files[0][1])
    version_field = _arrow_with_commit_version(schema).field("commit_version")

    def rows(entry: tuple[int, str, int]) -> pa.Table:
        version, path, _ = entry
        got = pq.read_table(read(path), schema=schema).select(schema.names).cast(schema)
        return got.append_column(version_field, pa.array([version] * got.num_rows, pa.int64()))

    with ThreadPoolExecutor(_PARALLEL_GETS) as pool:
        for start in range(0, len(files), _PARALLEL_GETS):
            for got in pool.map(rows, files[start : start + _PARALLEL_GETS]):
                yield from got.to_batches()


def _s3_reader(any_path: str):
    """A function fetching an S3 object of the warehouse of `any_path` whole."""
    import pyarrow as pa

    storage = storage_for(any_path)
    client = storage.s3_client()

    def read(path: str):
        key = object_key(path)
        body = client.get_object(Bucket=storage.bucket, Key=key)["Body"].read()
        return pa.BufferReader(body)

    return read


def _with_commit_version(table: TableSchema) -> StructType:
    return spark_schema(table).add("commit_version", LongType(), False)
