"""The job's tables: which there are, creating them, their latest versions,
and compacting the ones that only grow."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from schemas import TOPIC, TableSchema, table_path, topic_path
from schemas.arrow import arrow_schema
from schemas.tables import (
    CANCELLED,
    CHECK_REQUESTS,
    DISCARD,
    LEASE,
    PENDING,
    QUEUES,
    REJECTED,
    RESOLVED,
    RUNS,
    SCHEDULED,
)
from txn_core.config import Config
from txn_core.storage import options_for

log = logging.getLogger(__name__)


#: tables whose rows other parties read incrementally or with delta-rs: change data feed on
CDF_PROPERTIES = {"delta.enableChangeDataFeed": "true"}


#: leading columns with file statistics. Statistics cost CPU on every row
#: written (and a cold JVM's first write of a wide run record), and only these
#: are ever used to skip files: consumers seek a topic by (queue_id,
#: queue_offset), a run looks resolved messages up by half_offset and the last
#: run by run_number; the pending set is read whole.
STATS_COLUMNS = {
    TOPIC.path: 2,
    RESOLVED.path: 1,
    PENDING.path: 1,
    RUNS.path: 2,
    SCHEDULED.path: 1,
    CANCELLED.path: 2,
}


#: `_sys/runs` last: once it exists, all the others do, but `_sys/cancelled`,
#: the newest, made last of all (`ensure_job_tables`)
JOB_TABLES = (PENDING, QUEUES, RESOLVED, REJECTED, DISCARD, CHECK_REQUESTS, SCHEDULED, RUNS)


#: state tables a run reads, pinned by version in its intent
STATE_TABLES = (PENDING, QUEUES, RESOLVED, DISCARD, SCHEDULED, CANCELLED)


#: state tables a run reads whole, not looked up by key
WHOLE_STATE_TABLES = (PENDING, QUEUES)


#: job tables that only grow, by a file or two a run: compacted every COMPACT_EVERY_RUNS
APPEND_ONLY_TABLES = (RUNS, RESOLVED, CHECK_REQUESTS, DISCARD, REJECTED)


#: job tables whose logs each commit's checkpoint trims (`keeps_short_log`); `_sys/runs`
#: is trimmed by its own writer (`jobs.run_log`), as `_sys/lease` is
SHORT_LOG_TABLES = (*STATE_TABLES, REJECTED, CHECK_REQUESTS)


def keeps_short_log(uri: str) -> bool:
    """Whether the table at `uri` is one of `SHORT_LOG_TABLES`. Nothing reads
    their history beyond the versions the latest run pinned, a commit or two
    back (a producer whose cursor in `_sys/check_requests`' change feed was
    trimmed rescans the table), and a run commits to most of them at every
    busy run: on a local disk a long log makes each of those commits and
    reads slower (docs/performance.md, "A continuous job over hours")."""
    end = uri.rstrip("/")
    return any(end.endswith("/" + table.path) for table in SHORT_LOG_TABLES)


#: how often each chore of the job's upkeep is done (`upkeep_due`)
COMPACT_EVERY_RUNS = 100

#: a compaction packs files under this size: one that reached it is left
#: alone, where delta-rs' default (100 MB) rewrote a table's older rows at
#: every round until they came to 100 MB
COMPACT_TARGET_BYTES = 16 << 20

#: the chores of the job's upkeep: the scheduled set's (`jobs.scheduled.upkeep`),
#: the compaction of each append-only table, then the topics' log retention
#: (`keep_topic_log_retention`)
UPKEEP_CHORES = ("scheduled", *(table.path for table in APPEND_ONLY_TABLES), "topics")

#: the version of a table that does not exist yet
NO_VERSION = -1


def is_delta(path: str) -> bool:
    """Whether a Delta table is at `path` (a look at its log with delta-rs: no
    Spark job, see `latest_version`)."""
    from deltalake import DeltaTable as RsTable

    return RsTable.is_deltatable(path, storage_options=options_for(path))


def create_table(
    path: str, table: TableSchema, properties: dict[str, str] | None = None, name: str | None = None
) -> None:
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

    RsTable.create(
        path,
        arrow_schema(table),
        mode="ignore",
        name=name,
        configuration=table_properties(table) if properties is None else properties,
        storage_options=options_for(path),
        commit_properties=CommitProperties(max_commit_retries=0),
    )


def table_properties(table: TableSchema) -> dict[str, str]:
    from txn_core.tables import EVERY_RUN_TABLE_CONFIG

    props = dict(CDF_PROPERTIES)
    if table == RUNS:
        props.update(EVERY_RUN_TABLE_CONFIG)
    if table.path in STATS_COLUMNS:
        props["delta.dataSkippingNumIndexedCols"] = str(STATS_COLUMNS[table.path])
    return props


#: job tables that gained columns after their first release
MIGRATED_TABLES = (PENDING, SCHEDULED)


def ensure_job_tables(warehouse: str) -> None:
    """Create the missing job tables, add the columns an earlier release's
    lack (nullable, last: a metadata-only commit, before any run pins them),
    then create `_sys/cancelled`, the newest table: once it exists, every
    job table is current (one existence check per run)."""
    if is_delta(table_path(warehouse, RUNS)) and is_delta(table_path(warehouse, CANCELLED)):
        return
    for table in JOB_TABLES:
        path = table_path(warehouse, table)
        if not is_delta(path):
            create_table(path, table)
    from deltalake import DeltaTable as RsTable

    from txn_core.tables import add_missing_columns

    for table in MIGRATED_TABLES:
        path = table_path(warehouse, table)
        add_missing_columns(RsTable(path, storage_options=options_for(path)), table)
    create_table(table_path(warehouse, CANCELLED), CANCELLED)


#: `topic_log_retention_hours`' default
DEFAULT_TOPIC_LOG_RETENTION_HOURS: int = Config.topic_log_retention_hours


def ensure_topic_table(
    warehouse: str, topic: str, log_retention_hours: int = DEFAULT_TOPIC_LOG_RETENTION_HOURS
) -> str:
    """The topic's table, created if missing with its log kept
    `log_retention_hours` (`topic_properties`) and named after the topic.
    Raises `SharedTopicTableError` when the table at its path is another
    topic's (`txn_core.tables.check_topic_table`)."""
    path = topic_path(warehouse, topic)
    if not is_delta(path):
        create_table(path, TOPIC, topic_properties(log_retention_hours), name=topic)
    if path not in _topic_tables_checked:
        _check_topic_table(path, topic)
        _topic_tables_checked.add(path)
    return path


def ensure_topic_tables(
    warehouse: str, topics: Iterable[str], log_retention_hours: int, at_once: int
) -> dict[str, str]:
    """`ensure_topic_table` of each of `topics`, up to `at_once` at a time
    (each is a commit or a read of a log: on an object store, round trips to
    overlap); the path of each. Names that differ only in case are taken one
    after the other, in order: where the file system ignores case, the
    first makes the directory and its table, and the next is refused."""
    alike: dict[str, list[str]] = {}
    for topic in sorted(topics):
        alike.setdefault(topic.casefold(), []).append(topic)

    def ensure(names: list[str]) -> list[tuple[str, str]]:
        return [(name, ensure_topic_table(warehouse, name, log_retention_hours)) for name in names]

    threads = max(1, min(len(alike), at_once))
    with ThreadPoolExecutor(threads, thread_name_prefix="topic") as pool:
        return dict(pair for pairs in pool.map(ensure, alike.values()) for pair in pairs)


#: the topic tables this process found to be their topic's
_topic_tables_checked: set[str] = set()


def _check_topic_table(path: str, topic: str) -> None:
    """`check_topic_table` where a file system may ignore case: on a local
    disk (object stores never do)."""
    from txn_core import kept_tables
    from txn_core.delta_log import local_path
    from txn_core.tables import check_topic_table

    if local_path(path) is None:
        return
    table = kept_tables.take(path)  # opened for the run's commits anyway
    try:
        check_topic_table(table, topic)
    finally:
        kept_tables.give_back(table)


def topic_properties(log_retention_hours: int) -> dict[str, str]:
    """A topic table's properties: the job's tables' (`table_properties`), and
    its log entries dropped after `log_retention_hours` (at the job's
    checkpoints, `jobs.commits.checkpoint_as_delta_does`). A topic's history
    is its version-following readers' (Spark streams, change-feed readers);
    consumer groups read by offset and need none of it."""
    retention = {"delta.logRetentionDuration": f"interval {log_retention_hours} hours"}
    return {**table_properties(TOPIC), **retention}


def keep_topic_log_retention(warehouse: str, log_retention_hours: int) -> list[str]:
    """Give every topic the job has delivered to (`_sys/queues`) the log
    retention of `topic_properties`, where it has another (a table made by an
    earlier release, or before the setting changed); the topics changed. A
    failure is logged and left to the next round."""
    from deltalake import DeltaTable as RsTable

    from txn_core.tables import set_properties

    wanted = topic_properties(log_retention_hours)
    changed = []
    try:
        for topic in delivered_topics(warehouse):
            path = topic_path(warehouse, topic)
            if not is_delta(path):
                continue
            if set_properties(RsTable(path, storage_options=options_for(path)), wanted):
                changed.append(topic)
    except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a finished run
        log.warning("setting the topics' log retention failed (%s); the next round retries", exc)
    return changed


def latest_version(path: str) -> int:
    """The table's latest version, or NO_VERSION if there is no table.

    A listing of its log on a local disk or the warehouse's S3 store, else
    read with delta-rs; never Spark: it is a look at the log, and from Spark
    the first one of a process costs seconds of JVM warm-up — the most of an
    empty run's time once Spark is up.
    """
    from deltalake.exceptions import TableNotFoundError

    from txn_core.delta_log import latest_local_version, latest_s3_version, local_path, open_table
    from txn_core.storage import object_key, registered

    root = local_path(path)
    if root is not None:  # a listing of the log, no replay of it
        version = latest_local_version(root)
        return NO_VERSION if version is None else version
    storage = registered(path)
    if storage is not None and storage.is_s3:  # the same on the warehouse's store
        version = latest_s3_version(storage.s3_client(), storage.bucket, object_key(path))
        return NO_VERSION if version is None else version
    try:  # producers may be adding to the log meanwhile
        return open_table(path, storage_options=options_for(path)).version()
    except TableNotFoundError:
        return NO_VERSION


def latest_versions(warehouse: str, tables) -> dict[str, int]:
    """`latest_version` of each of the job's `tables` (schemas), by path:
    read at once, the job being their only writer."""
    paths = {table.path: table_path(warehouse, table) for table in tables}
    with ThreadPoolExecutor(max(len(paths), 1), thread_name_prefix="version") as pool:
        return dict(zip(paths, pool.map(latest_version, paths.values())))


def delivered_topics(warehouse: str) -> list[str]:
    """The topics the job has delivered to (`_sys/queues`)."""
    from deltalake import DeltaTable as RsTable

    path = table_path(warehouse, QUEUES)
    queues = RsTable(path, storage_options=options_for(path))
    return sorted(set(queues.to_pyarrow_table(columns=["topic"])["topic"].to_pylist()))


#: a topic's table has its small files merged (`compact_topics`) once it
#: holds this many files under `COMPACT_TARGET_BYTES`
TOPIC_COMPACT_MIN_FILES = 50


def compact_topics(warehouse: str) -> dict[str, int]:
    """Merge the small files of every topic the job has delivered to that
    holds at least `TOPIC_COMPACT_MIN_FILES` of them; files removed by topic.

    A run adds a file to each topic it delivers to, and every open of the
    table (a consumer's, the job's commits and checkpoints) grows with them
    (docs/performance.md). delta-rs' compaction keeps the files' order, so
    a merged file holds a range of each queue's offsets, which the
    consumers' file statistics still find; it is dataChange=false, unseen
    by change-feed readers and Spark streams. The replaced files stay until
    a VACUUM (docs/operating.md). A failure is logged and left to the next
    round."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import DeltaTable as RsTable

    removed = {}
    try:
        topics = delivered_topics(warehouse)
    except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a finished run
        log.warning("listing the topics to compact failed (%s); the next round retries", exc)
        return removed
    for topic in topics:
        path = topic_path(warehouse, topic)
        try:
            table = RsTable(path, storage_options=options_for(path))
            sizes = pa.table(table.get_add_actions(flatten=True))["size_bytes"]
            small = pc.sum(pc.less(sizes, COMPACT_TARGET_BYTES)).as_py() or 0
            if small >= TOPIC_COMPACT_MIN_FILES:
                metrics = table.optimize.compact(target_size=COMPACT_TARGET_BYTES)
                removed[topic] = int(metrics.get("numFilesRemoved", 0))
        except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a finished run
            log.warning("compaction of %s failed (%s); the next round retries", path, exc)
    return removed


def upkeep_due(run_number: int) -> list[str]:
    """The chores of `UPKEEP_CHORES` due after run `run_number`: each once
    every `COMPACT_EVERY_RUNS` runs, spread over them, so that a run waits
    for one chore, not for all: a continuous job's next run reads what came
    during the pause, and a long pause made it a long run (docs/performance.md,
    "The consumer's poll, and the job's upkeep in the timed part").

    >>> [upkeep_due(n) for n in (100, 101, 114)]
    [['scheduled'], [], ['_sys/runs']]
    """
    every, chores = COMPACT_EVERY_RUNS, UPKEEP_CHORES
    return [c for i, c in enumerate(chores) if run_number % every == i * every // len(chores)]


def vacuum_every_run_tables(warehouse: str, lease) -> dict[str, int]:
    """The files `_sys/lease` and `_sys/runs` no longer reference deleted
    (`txn_core.tables.vacuum_every_run_table`), the lease's under its renewal
    lock (`Lease.vacuum`); files deleted per table. A failure is logged and
    left to the next round, as the compaction's."""
    from deltalake import DeltaTable as RsTable

    from txn_core.tables import vacuum_every_run_table

    deleted = {}
    try:
        deleted[LEASE.path] = lease.vacuum()
        path = table_path(warehouse, RUNS)
        deleted[RUNS.path] = vacuum_every_run_table(
            RsTable(path, storage_options=options_for(path))
        )
    except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a finished run
        log.warning(
            "vacuuming the lease and the run records failed (%s); the next round retries", exc
        )
    return deleted


def compact_job_tables(
    warehouse: str, tables: tuple[TableSchema, ...] = APPEND_ONLY_TABLES
) -> dict[str, int]:
    """Compact the job's append-only `tables`; returns files removed per table.

    A run adds a small file or two to each; left alone, reading them (the
    next run's `last_run`, `status`, producers following `_sys/check_requests`)
    slows with every run. The rewrite is dataChange=false: the change data
    feed that producers and consumers follow shows nothing new. It is
    delta-rs' compaction, in this process: a few small files read and one
    commit per table, where Spark's OPTIMIZE took Spark jobs of its own, a
    pause of seconds between two runs of a continuous job. A failure is
    logged and left to the next round: the run it follows is already done.
    """
    from deltalake import DeltaTable as RsTable

    removed = {}
    for table in tables:
        path = table_path(warehouse, table)
        try:
            metrics = RsTable(path, storage_options=options_for(path)).optimize.compact(
                target_size=COMPACT_TARGET_BYTES
            )
            removed[table.path] = int(metrics.get("numFilesRemoved", 0))
        except Exception as exc:  # noqa: BLE001 - housekeeping must not fail a finished run
            log.warning("compaction of %s failed (%s); the next round retries", path, exc)
    return removed
