"""The job's tables: creating them, their versions, reading inputs by version,
writes tagged with their run (skipped when a redo finds them done), and the
run records of `_sys/runs` (intent and commit).

Cursors are table versions (DESIGN-NOTES): a run reads the producer tables'
change data feed between the previous run's versions and the ones pinned in
its intent, and the job's own state tables by time travel to the versions
pinned there, so a redo of the run sees exactly the same inputs.
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field, fields
from typing import Callable

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pyspark.sql.types import LongType

from jobs import appends, commits
from jobs.local import local_frame
from schemas import (CHECK_ANSWERS, CHECK_REQUESTS, DISCARD, HALF, OP, PENDING, QUEUES,
                     REJECTED, RESOLVED, RUNS, TOPIC, TableSchema, table_path, topic_path)
from schemas.arrow import arrow_schema
from schemas.spark import spark_schema
from txn_core.delta_log import LOG_DIR, entry_name
from txn_core.storage import options_for
from txn_core.vocabulary import RunStatus

#: tables whose rows other parties read incrementally or with delta-rs: change data feed on
CDF_PROPERTIES = {"delta.enableChangeDataFeed": "true"}
#: leading columns with file statistics. Statistics cost CPU on every row
#: written (and, for the 38 columns of a run record, ~1 s of a cold JVM's
#: first write), and only these are ever used to skip files: consumers seek
#: a topic by (queue_id, queue_offset), a run looks resolved messages up by
#: half_offset and the last run by run_number; the pending set is read whole.
STATS_COLUMNS = {TOPIC.path: 2, RESOLVED.path: 1, PENDING.path: 1, RUNS.path: 2}
#: `_sys/runs` last: once it exists, all the others do (one existence check per run)
JOB_TABLES = (PENDING, QUEUES, RESOLVED, REJECTED, DISCARD, CHECK_REQUESTS, RUNS)
#: state tables a run reads, pinned by version in its intent
STATE_TABLES = (PENDING, QUEUES, RESOLVED, DISCARD)
#: state tables a run reads whole, not looked up by key
WHOLE_STATE_TABLES = (PENDING, QUEUES)
#: job tables that only grow, by a file or two a run: compacted every COMPACT_EVERY_RUNS
APPEND_ONLY_TABLES = (RUNS, RESOLVED, CHECK_REQUESTS, DISCARD, REJECTED)
COMPACT_EVERY_RUNS = 100
NO_VERSION = -1

log = logging.getLogger(__name__)


class HistoryGoneError(RuntimeError):
    """The Delta log no longer holds the versions the job still has to read."""


def is_delta(path: str) -> bool:
    """Whether a Delta table is at `path` (a look at its log with delta-rs: no
    Spark job, see `latest_version`)."""
    from deltalake import DeltaTable as RsTable
    return RsTable.is_deltatable(path, storage_options=options_for(path))


def create_table(path: str, table: TableSchema) -> None:
    """Create an empty job table if missing. Every job table has the change data
    feed on (consumers and producers follow them with delta-rs) and no other
    table feature, so delta-rs can read them.

    Created through delta-rs, whose creation is one put-if-absent of the
    table's first log entry: a run killed while creating a table leaves all of
    it or nothing. Spark's builder first makes `_delta_log/`, and its catalog
    takes a directory left so for an existing table, never to be created.
    """
    from deltalake import CommitProperties
    from deltalake import DeltaTable as RsTable
    RsTable.create(path, arrow_schema(table), mode="ignore",
                   configuration=table_properties(table), storage_options=options_for(path),
                   commit_properties=CommitProperties(max_commit_retries=0))


def table_properties(table: TableSchema) -> dict[str, str]:
    props = dict(CDF_PROPERTIES)
    if table.path in STATS_COLUMNS:
        props["delta.dataSkippingNumIndexedCols"] = str(STATS_COLUMNS[table.path])
    return props


def ensure_job_tables(warehouse: str) -> None:
    if is_delta(table_path(warehouse, RUNS)):
        return
    for table in JOB_TABLES:
        path = table_path(warehouse, table)
        if not is_delta(path):
            create_table(path, table)


def latest_version(path: str) -> int:
    """The table's latest version, or NO_VERSION if there is no table.

    Read with delta-rs, not Spark: it is a look at the log, and from Spark the
    first one of a process costs seconds of JVM warm-up — the most of an
    empty run's time once Spark is up.
    """
    from deltalake import DeltaTable as RsTable
    from deltalake.exceptions import TableNotFoundError
    try:
        return RsTable(path, storage_options=options_for(path)).version()
    except TableNotFoundError:
        return NO_VERSION


def empty(spark: SparkSession, table: TableSchema, with_commit_version: bool = False) -> DataFrame:
    schema = spark_schema(table)
    if with_commit_version:
        schema = schema.add("commit_version", LongType(), False)
    return local_frame(spark, [], schema)


def snapshot(spark: SparkSession, path: str, table: TableSchema, version: int) -> DataFrame:
    """The table as of `version` (empty when it did not exist then)."""
    if version == NO_VERSION:
        return empty(spark, table)
    return spark.read.format("delta").option("versionAsOf", version).load(path)


def log_holds(spark: SparkSession, path: str, version: int) -> bool:
    """Whether the table's log still has the commit of `version` (Hadoop FS: any storage)."""
    jvm = spark.sparkContext._jvm
    log_file = jvm.org.apache.hadoop.fs.Path(f"{path.rstrip('/')}/{LOG_DIR}/{entry_name(version)}")
    fs = log_file.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    return fs.exists(log_file)


def added_rows(spark: SparkSession, path: str, table: TableSchema,
               after: int, upto: int, *,
               keep_slow: Callable[[DataFrame], DataFrame] | None = None) -> DataFrame:
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
            f"read incrementally; restore the log or raise the retention and rerun")
    files = appends.appended_files(path, after, upto)
    if files is not None:
        return (appends.read_appended(spark, files, table) if files
                else empty(spark, table, with_commit_version=True))
    rows = change_feed_inserts(spark, path, after, upto)
    return keep_slow(rows) if keep_slow is not None else rows


def change_feed_inserts(spark: SparkSession, path: str, after: int, upto: int) -> DataFrame:
    """The change data feed's inserts in versions (after, upto], with `commit_version`."""
    return (spark.read.format("delta").option("readChangeFeed", "true")
            .option("startingVersion", after + 1).option("endingVersion", upto).load(path)
            .where(F.col("_change_type") == "insert")
            .withColumnRenamed("_commit_version", "commit_version")
            .drop("_change_type", "_commit_timestamp"))


def compact_job_tables(spark: SparkSession, warehouse: str) -> dict[str, int]:
    """OPTIMIZE the job's append-only tables; returns files removed per table.

    A run adds a small file or two to each; left alone, reading them (the
    next run's `last_run`, `status`, producers following `_sys/check_requests`)
    slows with every run. The rewrite is dataChange=false: the change data
    feed that producers and consumers follow shows nothing new. A failure is
    logged and left to the next round — the run it follows is already done.
    """
    from delta.tables import DeltaTable
    removed = {}
    for table in APPEND_ONLY_TABLES:
        path = table_path(warehouse, table)
        try:
            metrics = DeltaTable.forPath(spark, path).optimize().executeCompaction().first()
            removed[table.path] = int(metrics["metrics"]["numFilesRemoved"])
        except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a finished run
            log.warning("compaction of %s failed (%s); the next round retries", path, exc)
    return removed


def run_tag(run_number: int, app: str) -> str:
    """The tag a run's commit carries in its commitInfo (`userMetadata`)."""
    return json.dumps({"txn_reconcile_run": run_number, "table": app}, sort_keys=True)


def _read_tag(user_metadata: str | None) -> tuple[int, str] | None:
    try:
        tag = json.loads(user_metadata or "")
        return int(tag["txn_reconcile_run"]), str(tag["table"])
    except (ValueError, TypeError, KeyError):
        return None  # not a commit of the job's writes (creation, compaction, an operator's)


def write_for_run(df: DataFrame, path: str, run_number: int, app: str, *,
                  mode: str = "append", redo: bool = False) -> bool:
    """Write `df` as run `run_number`'s commit to `path`, tagged with the run
    (`run_tag`). On a redo, skip the write when the crashed attempt already
    committed it (`committed_by_run`). Returns whether it wrote.

    Written by `jobs.commits` (Spark's parquet writer, then a delta-rs
    commit) where that commit is the one Delta's writer would make, which
    saves the writer's snapshot and post-commit jobs; by Delta's writer
    everywhere else.

    Why tags, not Delta's txnAppId/txnVersion: Delta checks those against
    the table's whole reconstructed state, a Spark job per table written —
    about 1 s each on 2 cores, most of a small run's time — while the tag is
    needed only on a redo, where reading the last commits' commitInfo with
    delta-rs takes milliseconds. A first attempt cannot find its own commit,
    and two attempts never write at once: the run holds the lease and checks
    it before each write (`jobs.lease`).
    """
    if redo and committed_by_run(path, run_number, app):
        return False
    tag = run_tag(run_number, app)
    table = commits.committable(path, df)
    if table is not None:
        commits.write(df, table, mode, tag)
    else:
        df.write.format("delta").mode(mode).option("userMetadata", tag).save(path)
    return True


def split_tables(df: DataFrame, column: str, paths: dict[str, str]) -> dict | None:
    """The tables of `paths` (by value of `column`) opened for `split_commits`,
    or None unless `jobs.commits` can write every one of them the rows of
    `df` (then `write_for_run`, one table at a time)."""
    rows = df.drop(column)
    tables = {value: commits.committable(path, rows) for value, path in paths.items()}
    return None if any(table is None for table in tables.values()) else tables


def split_commits(df: DataFrame, column: str,
                  tables: dict) -> dict[str, Callable[[str], int]]:
    """Stage the rows of `df` for `tables` (`split_tables`), each row to the
    table of its `column` value, in one Spark job (`commits.stage_split`);
    each table's append as a function of its commit's userMetadata
    (`run_tag`)."""
    staged = commits.stage_split(df, column, tables)
    return {value: functools.partial(commits.commit, tables[value], staged[value], "append")
            for value in tables}


def committed_by_run(path: str, run_number: int, app: str) -> bool:
    """Whether run `run_number` committed its write of `app` to the table.

    Walks the log back from the newest commit and stops at the first commit
    tagged by an earlier run: runs write one after another, so a commit of
    this run can only come after it. Untagged commits (creation, compaction,
    an operator's DELETE or OPTIMIZE) are stepped over. A run that crashed
    under a job version before the tags left Delta's idempotent-write record
    (txnAppId `reconcile:<app>`) instead: that counts too.
    """
    from deltalake import DeltaTable as RsTable
    from deltalake.exceptions import TableNotFoundError
    try:
        table = RsTable(path, storage_options=options_for(path))
    except TableNotFoundError:
        return False
    legacy = table.transaction_version(f"reconcile:{app}")
    if legacy is not None and legacy >= run_number:
        return True
    recent = table.history(RECENT_COMMITS)
    found = _tagged(recent, run_number, app)
    if found is None and len(recent) == RECENT_COMMITS:  # not decided yet: read them all
        found = _tagged(table.history(), run_number, app)
    return bool(found)


#: commits `committed_by_run` reads first (one run writes a table once, plus
#: the odd compaction), before the table's whole history
RECENT_COMMITS = 16


def _tagged(commits: list[dict], run_number: int, app: str) -> bool | None:
    """True: `commits` (newest first) hold the run's commit of `app`; False:
    they reach an earlier run's commit first; None: neither."""
    for commit in commits:
        tag = _read_tag(commit.get("userMetadata"))
        if tag == (run_number, app):
            return True
        if tag is not None and tag[0] < run_number:
            return False
    return None


def ensure_topic_table(warehouse: str, topic: str) -> str:
    path = topic_path(warehouse, topic)
    if not is_delta(path):
        create_table(path, TOPIC)
    return path


# --- run records -------------------------------------------------------------

@dataclass
class InputVersions:
    """The producer-table versions a run reads: each table's rows added in
    (prev_*, *]. Both the run record and the run's summary carry them."""

    half_version: int
    op_version: int
    answers_version: int
    prev_half_version: int
    prev_op_version: int
    prev_answers_version: int

    def input_versions(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(InputVersions)}


@dataclass
class RunRecord(InputVersions):
    """One row of `_sys/runs` (the intent, or the intent plus the summary)."""

    run_id: str
    run_number: int
    status: str
    now_ms: int
    started_ms: int
    state_versions: dict[str, int]
    rules_json: str
    ended_ms: int | None = None
    counters: dict[str, int | None] = field(default_factory=dict)
    delivered_by_topic: dict[str, int] | None = None
    summary_json: str | None = None

    def to_row(self) -> dict:
        row = {k: v for k, v in self.__dict__.items() if k != "counters"}
        row["state_versions"] = dict(sorted(self.state_versions.items()))
        from schemas.tables import RUN_COUNTERS
        row.update({name: self.counters.get(name) for name in RUN_COUNTERS})
        return row

    @classmethod
    def from_row(cls, row: dict) -> "RunRecord":
        from schemas.tables import RUN_COUNTERS
        base = {k: row[k] for k in cls.__dataclass_fields__ if k != "counters"}
        base["state_versions"] = dict(base["state_versions"])
        if base["delivered_by_topic"] is not None:
            base["delivered_by_topic"] = dict(base["delivered_by_topic"])
        return cls(**base, counters={n: row[n] for n in RUN_COUNTERS})


def last_run(warehouse: str) -> RunRecord | None:
    """The latest run: its COMMITTED record, or its STARTED one if it never
    finished. Read with delta-rs (see `latest_version`)."""
    from txn_core.tables import latest_run_rows
    rows = latest_run_rows(warehouse)
    if not rows:
        return None
    rows.sort(key=lambda r: r["status"] != RunStatus.COMMITTED)
    return RunRecord.from_row(rows[0])


def write_run_record(warehouse: str, record: RunRecord) -> None:
    """Append one row to `_sys/runs`, tagged like the run's other commits.

    Never a redo: a run's STARTED row is written once (a crash after it makes
    the next invocation redo that run, not write it again), and once its
    COMMITTED row is in, the run is not redone.

    Written with delta-rs, like `last_run` reads it: a one-row commit takes
    ~20 ms there against ~0.25 s through Spark's Delta writer, and every run
    writes two, one after the other on its critical path (intent, commit).
    The table is the same Delta table to Spark (verify, compaction).
    """
    from deltalake import CommitProperties, write_deltalake
    row = pa.Table.from_pylist([record.to_row()], schema=arrow_schema(RUNS))
    tag = run_tag(record.run_number, f"{RUNS.path}:{record.status}")
    path = table_path(warehouse, RUNS)
    write_deltalake(path, row, mode="append", storage_options=options_for(path),
                    commit_properties=CommitProperties(custom_metadata={"userMetadata": tag}))


def input_paths(warehouse: str) -> dict[str, str]:
    return {"half": table_path(warehouse, HALF), "op": table_path(warehouse, OP),
            "answers": table_path(warehouse, CHECK_ANSWERS)}


def state_version_key(table: TableSchema) -> str:
    return table.path


def read_state(spark: SparkSession, warehouse: str, versions: dict[str, int],
               table: TableSchema) -> DataFrame:
    """The state table as of the version pinned in `versions` (a run's intent).

    The tables a run reads whole (WHOLE_STATE_TABLES) are read as the parquet
    files of that snapshot when the log allows (`appends.snapshot_files`);
    the others are looked up by key, where Delta's reader skips files by
    their statistics.
    """
    path = table_path(warehouse, table)
    version = versions.get(state_version_key(table), NO_VERSION)
    if table in WHOLE_STATE_TABLES and version != NO_VERSION:
        files = appends.snapshot_files(path, version)
        if files is not None:
            return (spark.read.schema(spark_schema(table)).parquet(*files) if files
                    else empty(spark, table))
    return snapshot(spark, path, table, version)


def decode_json(text: str | None) -> dict:
    return json.loads(text) if text else {}
