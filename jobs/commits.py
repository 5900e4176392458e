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
import re
import shutil
import threading
import uuid

from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from jobs import job_tables
from jobs.jvm_calls import select_expr
from jobs.transforms import sql_string, sql_strings
from schemas import DISTINCT_COLUMNS
from txn_core import kept_tables
from txn_core.delta_log import (
    catch_up,
    file_stats,
    local_path,
    reader_duties,
    refresh,
    tip,
    writer_duties,
)
from txn_core.log_trim import trim_behind_newest
from txn_core.storage import is_s3, object_key, options_for, registered

#: where Spark writes a commit's files before they move into the table; a
#: crash can leave one behind (hidden from Delta by its leading `_`), and
#: a later write to the table removes it (`_leftover`)
STAGING_PREFIX = "_txn_staging-"
#: on S3, the directory inside the table where Spark writes a commit's files,
#: and where they stay: a move there is a copy. Not hidden, so that VACUUM
#: deletes what a crash left uncommitted, once older than its retention.
S3_STAGING_PREFIX = "txn-staged-"
#: Delta's defaults, for tables that do not set them
DEFAULT_INDEXED_COLUMNS = 32
DEFAULT_CHECKPOINT_INTERVAL = 10
#: Delta keeps string statistics to this many characters
STRING_PREFIX = 32


def committable(path: str, df: DataFrame):
    """The delta-rs table at `path` when this module (`write`) or the driver
    (`jobs.driver_writes`) can commit `df`'s rows to it — the commit Delta's
    writer would make —, else None: a table on a local disk or in a
    registered S3 warehouse (`txn_core.storage`) whose protocol asks for
    nothing beyond the change data feed (whole files added or removed need
    no change files: the feed's readers take them as inserts and deletes),
    with no CHECK constraint, invariant or generated column to enforce, and
    `df`'s columns."""
    if not _local_or_registered_s3(path):
        return None
    from deltalake.exceptions import TableNotFoundError

    try:
        # its commits catch up with the appends made by hand (`driver_writes`)
        table = kept_tables.take(path, options_for(path), behind_own_appends=True)
    except TableNotFoundError:
        return None
    if reader_duties(table) is None and writer_duties(table) is None:
        schema = table_schema(table)
        if [(f.name, f.dataType.simpleString()) for f in schema.fields] == [
            (f.name, f.dataType.simpleString()) for f in df.schema.fields
        ]:
            return table
    kept_tables.give_back(table)
    return None


def _local_or_registered_s3(path: str) -> bool:
    """Whether `path` is on a local disk or in an S3 warehouse this process
    registered (`txn_core.storage.use`): what this module and delta-rs'
    commits from the driver are tested on. Elsewhere (ADLS, GCS) Delta's
    writer writes."""
    return local_path(path) is not None or (is_s3(path) and registered(path) is not None)


def table_schema(table) -> StructType:
    """The table's columns as Spark's types (Delta's schema JSON is Spark's)."""
    return StructType.fromJson(json.loads(table.schema().to_json()))


def stage(df: DataFrame, table, generation: int | None = None) -> list:
    """Write `df`'s rows (its columns those of `table`: `committable`) as
    files into the table's directory, uncommitted (invisible to readers);
    their `add` actions, for `commit`. A null in a NOT NULL column fails the
    Spark job, naming the column, and nothing is staged (as Delta's writer
    does). `generation`: the writing run's lease's (`Lease.generation`),
    which says whose leftovers a write may remove (`_leftover`)."""
    root = local_path(table.table_uri)
    if root is None:
        return _stage_on_s3(df, table)

    def write(staging: str) -> dict:
        _writer(select_expr(df, _not_null_checked(df, table_schema(table), root))).parquet(staging)
        return {0: staging}

    return _staged({0: table}, write, 0, generation)[0]


def stage_split(
    df: DataFrame, column: str, tables: dict, home=None, generation: int | None = None
) -> dict[str, list]:
    """`stage` for several tables in one Spark job: each row of `df` goes to
    the table `tables` names for its `column` value (each table `committable`
    for `df` without `column`; rows of other values are not written). The
    `add` actions by value. `home`: the value whose table Spark writes in
    (on S3 the other tables' files are copied from it: the one with most
    rows), the first by default. `generation`: as for `stage`.

    Why: one job reads `df` once, where one write per table reads all of it
    each time to keep its own rows.
    """
    home = min(tables) if home is None else home
    if local_path(tables[home].table_uri) is None:
        return _stage_split_on_s3(df, column, tables, home)

    def write(staging: str) -> dict:
        return _write_split(df, column, tables, staging)

    return _staged(tables, write, home, generation)


def _write_split(df: DataFrame, column: str, tables: dict, staging: str) -> dict:
    """Write `df`'s rows for `tables` into `staging`, a directory for each
    table (`_SPLIT_COLUMN`); those directories by value (one without rows
    is not made)."""
    values = sorted(tables)
    where = ", ".join(local_path(tables[v].table_uri) or tables[v].table_uri for v in values)
    strictest = _strictest_schema([table_schema(tables[v]) for v in values])
    rows = df.where(f"`{column}` IN {sql_strings(values)}")
    cases = " ".join(f"WHEN {sql_string(v)} THEN {i}" for i, v in enumerate(values))
    index = f"CASE `{column}` {cases} END AS {_SPLIT_COLUMN}"
    checked = _not_null_checked(rows, strictest, where)  # the table's columns: not `column`
    _writer(select_expr(rows, [*checked, index])).partitionBy(_SPLIT_COLUMN).parquet(staging)
    return {v: f"{staging}/{_SPLIT_COLUMN}={i}" for i, v in enumerate(values)}


def _staged(tables: dict, write, home, generation: int | None) -> dict:
    """Clear what earlier writes left staged in the tables (`_leftover`), let
    `write(staging)` write the files in a new staging directory (inside
    `home`'s table, so that the files move by a rename) and say where each
    table's files are, move them into their tables; the `add` actions by
    table."""
    roots = {key: local_path(table.table_uri) for key, table in tables.items()}
    for root in roots.values():
        _remove_leftovers(root, generation)
    staging = os.path.join(roots[home], staging_name(generation))
    with _in_flight_lock:
        _in_flight.add(staging)
    try:
        written = write(staging)
        staged = {}
        for key, table in tables.items():
            # no directory: no row for that table
            there = os.path.isdir(written[key])
            added = _moved_into_table(written[key], roots[key]) if there else []
            staged[key] = _add_actions(table, roots[key], added)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        with _in_flight_lock:
            _in_flight.discard(staging)
    return staged


def _stage_split_on_s3(df: DataFrame, column: str, tables: dict, home) -> dict[str, list]:
    """`stage_split` on S3: Spark writes every table's files into a staging
    directory of `home`'s table (`S3_STAGING_PREFIX`), where `home`'s stay;
    each other table's are copied by the store (no byte passes through this
    process) into a staging directory of that table, then deleted where
    Spark wrote them. A crash midway leaves only files no commit names,
    which VACUUM deletes."""
    name = S3_STAGING_PREFIX + uuid.uuid4().hex
    home_uri = tables[home].table_uri.rstrip("/")
    written = _write_split(df, column, tables, f"{home_uri}/{name}")
    storage = registered(home_uri)
    client = storage.s3_client()
    staging_key = f"{object_key(home_uri)}/{name}/"
    files = _listed(client, storage.bucket, staging_key)
    staged = {}
    for value, table in tables.items():
        subdir = written[value].rsplit("/", 1)[1] + "/"
        own = [f for f in files if f["Key"].startswith(staging_key + subdir)]
        if value == home:
            staged[value] = _s3_adds(table, client, storage.bucket, own, f"{object_key(home_uri)}/")
            continue
        uri = table.table_uri.rstrip("/")
        copied = _copied(client, storage.bucket, own, f"{object_key(uri)}/{name}/")
        staged[value] = _s3_adds(table, client, storage.bucket, copied, f"{object_key(uri)}/")
        _deleted(client, storage.bucket, [f["Key"] for f in own])
    return staged


def _stage_on_s3(df: DataFrame, table) -> list:
    """`stage` on S3: the files stay where Spark wrote them, in a directory of
    their own inside the table (`S3_STAGING_PREFIX`), named by their `add`
    actions."""
    uri = table.table_uri.rstrip("/")
    name = S3_STAGING_PREFIX + uuid.uuid4().hex
    _writer(select_expr(df, _not_null_checked(df, table_schema(table), uri))).parquet(
        f"{uri}/{name}"
    )
    storage = registered(uri)
    client = storage.s3_client()
    files = _listed(client, storage.bucket, f"{object_key(uri)}/{name}/")
    return _s3_adds(table, client, storage.bucket, files, f"{object_key(uri)}/")


def _listed(client, bucket: str, prefix: str) -> list[dict]:
    """The parquet objects under `prefix` (a listing: key, size, time), by key."""
    return sorted(
        (
            obj
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=prefix
            )
            for obj in page.get("Contents", [])
            if obj["Key"].endswith(".parquet")
        ),
        key=lambda o: o["Key"],
    )


def _s3_adds(table, client, bucket: str, files: list[dict], root_key: str) -> list:
    """The `add` actions of the table's staged `files` (a listing, keys under
    the table's `root_key`): their sizes from the listing, their statistics
    from their footers (a ranged GET each). A file without rows (Spark
    writes one for an empty DataFrame) is deleted instead."""
    indexed = _indexed_columns(table_schema(table), table.metadata().configuration)
    adds = []
    for obj in files:
        metadata = _footer(client, bucket, obj["Key"], obj["Size"])
        if metadata.num_rows == 0:
            client.delete_object(Bucket=bucket, Key=obj["Key"])
            continue
        adds.append(
            _add(
                obj["Key"][len(root_key) :],
                obj["Size"],
                int(obj["LastModified"].timestamp() * 1000),
                file_stats(metadata, indexed, string_prefix=STRING_PREFIX),
            )
        )
    return adds


#: S3 copies made at once
S3_PARALLEL_REQUESTS = 16
#: S3 copies an object this big or bigger only in parts
S3_COPY_MAX_BYTES = 5 * 1024**3


def _copied(client, bucket: str, files: list[dict], into: str) -> list[dict]:
    """Copy `files` (a listing) into the prefix `into`, keeping their names,
    by the store itself (multipart for the largest); the copies' listing."""
    from concurrent.futures import ThreadPoolExecutor

    def copy(obj: dict) -> dict:
        key = into + obj["Key"].rsplit("/", 1)[1]
        source = {"Bucket": bucket, "Key": obj["Key"]}
        if obj["Size"] < S3_COPY_MAX_BYTES:
            client.copy_object(Bucket=bucket, Key=key, CopySource=source)
        else:
            client.copy(source, bucket, key)  # boto3's managed copy: in parts
        return {**obj, "Key": key}

    with ThreadPoolExecutor(S3_PARALLEL_REQUESTS, thread_name_prefix="s3-copy") as pool:
        return list(pool.map(copy, files))


def _deleted(client, bucket: str, keys: list[str]) -> None:
    """Delete the objects `keys`, a thousand a request (S3's limit)."""
    for i in range(0, len(keys), 1000):
        batch = [{"Key": k} for k in keys[i : i + 1000]]
        client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


#: a parquet file's last bytes fetched first, which hold a small footer whole
_FOOTER_GUESS = 64 * 1024


def _footer(client, bucket: str, key: str, size: int):
    """The parquet footer of an S3 object: its last bytes, then as many as the
    footer's length says if they were not enough."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def tail(n: int) -> bytes:
        ranged = f"bytes={size - n}-"
        return client.get_object(Bucket=bucket, Key=key, Range=ranged)["Body"].read()

    data = tail(min(size, _FOOTER_GUESS))
    needed = int.from_bytes(data[-8:-4], "little") + 8
    if needed > len(data):
        data = tail(needed)
    return pq.read_metadata(pa.BufferReader(data))


#: the column `stage_split` partitions its one write by: the target's index
_SPLIT_COLUMN = "txn_target"


def commit(table, adds: list, mode: str, user_metadata: str) -> int:
    """Commit staged `adds` to the table (`mode`: append, or overwrite: they
    replace every file), with `user_metadata` in its commitInfo; the version."""
    _check_mode(mode)
    catch_up(table)
    table.create_write_transaction(
        adds, mode=mode, schema=table.schema(), **commit_options(user_metadata)
    )
    return after_commit(table)


def commit_options(user_metadata: str) -> dict:
    """The keywords of a job's delta-rs commit: `user_metadata` in its
    commitInfo, no retry (a commit from a stale version fails rather than
    land on top of another run's: `jobs.fence`), and no checkpoint or log
    clean-up of delta-rs' own (`after_commit` does them as Delta does)."""
    from deltalake import CommitProperties
    from deltalake.transaction import PostCommitHookProperties

    return {
        "commit_properties": CommitProperties(
            custom_metadata={"userMetadata": user_metadata}, max_commit_retries=0
        ),
        "post_commithook_properties": PostCommitHookProperties(
            create_checkpoint=False, cleanup_expired_logs=False
        ),
    }


def after_commit(table) -> int:
    """The version the job's commit to `table` made, checkpointed as Delta's
    writer would (`checkpoint_as_delta_does`); at each checkpoint of a state
    table, its log trimmed to the last hundred or so entries
    (`job_tables.keeps_short_log`)."""
    # a driver write has moved the table, one by hand noted its version
    # (`delta_log.tip`), a staged one did neither
    refresh(table, behind_own_appends=True)
    version = tip(table)
    checkpointed = checkpoint_as_delta_does(table, version, table.metadata().configuration)
    if checkpointed and job_tables.keeps_short_log(table.table_uri):
        trim_behind_newest(table)
    kept_tables.give_back(table)  # for the next run's commit
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


#: the staging directories this process is writing in: never another's leftovers
_in_flight: set[str] = set()
_in_flight_lock = threading.Lock()
_GENERATION = re.compile(re.escape(STAGING_PREFIX) + r"g(\d+)-")


def staging_name(generation: int | None) -> str:
    """A new staging directory's name, carrying the lease generation of the
    run that writes in it."""
    owner = "" if generation is None else f"g{generation}-"
    return f"{STAGING_PREFIX}{owner}{uuid.uuid4().hex}"


def _leftover(name: str, generation: int | None) -> bool:
    """Whether the staging directory `name`, not one this process is writing
    in, is what an earlier write left behind, for a run of lease `generation`
    to remove: one of an earlier or of its own generation (a crash, a run
    that lost the lease). Not one of a later generation: that is the run that
    took the lease from this one over, writing now; removing its files would
    fail its run (the fence already keeps this one from committing).
    Without a generation (no lease: tests, tools) every one is a leftover."""
    if not name.startswith(STAGING_PREFIX):
        return False
    if generation is None:
        return True
    found = _GENERATION.match(name)
    return found is None or int(found.group(1)) <= generation


def _strictest_schema(schemas: list[StructType]) -> StructType:
    """The first schema, each column NOT NULL where any of them says so."""
    first = schemas[0]
    for field in first.fields:
        field.nullable = all(s[field.name].nullable for s in schemas)
    return first


def _not_null_checked(df: DataFrame, schema: StructType, where: str) -> list[str]:
    """The columns of `schema` (the table's) in `df`, as SQL text for
    `select_expr`, failing on a null in a column the table declares NOT NULL
    (where Spark cannot tell from the plan that there is none). Text, not
    Columns: a Column built in Python is several calls into the JVM, a
    hundred for a table's columns, on the path of a run's biggest write."""
    nullable = {f.name: f.nullable for f in df.schema.fields}
    columns = []
    for field in schema.fields:
        name = f"`{field.name}`"
        if not field.nullable and nullable[field.name]:
            message = sql_string(f"NOT NULL constraint violated for column {field.name} of {where}")
            name = f"CASE WHEN {name} IS NULL THEN raise_error({message}) ELSE {name} END AS {name}"
        columns.append(name)
    return columns


def _remove_leftovers(root: str, generation: int | None) -> None:
    with _in_flight_lock:
        in_flight = set(_in_flight)
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if path not in in_flight and _leftover(name, generation):
            shutil.rmtree(path, ignore_errors=True)


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

    full = os.path.join(root, name)
    metadata = pq.read_metadata(full)
    if metadata.num_rows == 0:
        for leftover in (full, os.path.join(root, f".{name}.crc")):
            if os.path.exists(leftover):
                os.remove(leftover)
        return None
    info = os.stat(full)
    stats = file_stats(metadata, indexed, string_prefix=STRING_PREFIX)
    return _add(name, info.st_size, int(info.st_mtime * 1000), stats)


def _add(path: str, size: int, mtime_ms: int, stats: dict):
    """The `add` action of a data file (`path` relative to the table's root)."""
    from deltalake.transaction import AddAction

    return AddAction(path, size, {}, mtime_ms, True, json.dumps(stats))


def checkpoint_as_delta_does(table, version: int, config: dict) -> bool:
    """A checkpoint every `delta.checkpointInterval` commits (Delta's default,
    10), and the log entries past `delta.logRetentionDuration` dropped then,
    as Delta's writer does after its commits; Spark's readers then replay at
    most that many commits. Returns whether it made one."""
    interval = int(config.get("delta.checkpointInterval", DEFAULT_CHECKPOINT_INTERVAL))
    if interval > 0 and version > 0 and version % interval == 0:
        catch_up(table)  # to the version checkpointed, or past it
        table.create_checkpoint()
        table.cleanup_metadata()
        return True
    return False
