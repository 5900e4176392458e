"""A run's writes as Spark's parquet files committed by delta-rs (jobs.commits):
the table reads the same through Delta (rows, change feed, statistics), the
commit is tagged with its run, NOT NULL holds, and where the commit would not
be Delta's own the write falls back to Delta's writer."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from deltalake import DeltaTable

from jobs import commits, job_tables, tagged_writes
from jobs.lease import Lease, LeaseLost
from schemas import QUEUES, TOPIC
from schemas.spark import spark_schema


def _topic_table(spark, warehouse) -> str:
    return job_tables.ensure_topic_table(warehouse, "ORDER")


def _topic_rows(spark, offsets, queue_id=0, msg_id="m"):
    rows = [
        (
            queue_id,
            o,
            f"{msg_id}{o}",
            f"t{o}",
            1000 + o,
            "pg",
            None,
            None,
            b"body",
            None,
            1,
            2,
            3,
            "run-1",
        )
        for o in offsets
    ]
    return spark.createDataFrame(rows, spark_schema(TOPIC))


def _last_adds(path: str) -> list[dict]:
    version = DeltaTable(path).version()
    with open(os.path.join(path, "_delta_log", f"{version:020d}.json")) as entry:
        return [json.loads(line)["add"] for line in entry if '"add"' in line]


def test_an_append_reads_as_delta_with_the_statistics_delta_keeps(spark, warehouse):
    path = _topic_table(spark, warehouse)
    df = _topic_rows(spark, range(10, 20)).coalesce(1)
    assert commits.committable(path, df) is not None
    assert tagged_writes.write_for_run(df, path, 7, "topics/ORDER")

    got = spark.read.format("delta").load(path)
    assert sorted(r.queue_offset for r in got.collect()) == list(range(10, 20))
    adds = _last_adds(path)
    assert len(adds) == 1 and "/" not in adds[0]["path"]  # in the table's directory
    stats = json.loads(adds[0]["stats"])
    # a topic table keeps statistics on its first two columns only (job_tables.STATS_COLUMNS)
    assert stats == {
        "numRecords": 10,
        "minValues": {"queue_id": 0, "queue_offset": 10},
        "maxValues": {"queue_id": 0, "queue_offset": 19},
        "nullCount": {"queue_id": 0, "queue_offset": 0},
    }
    assert not [n for n in os.listdir(path) if n.startswith(commits.STAGING_PREFIX)]
    assert tagged_writes.committed_by_run(path, 7, "topics/ORDER")
    # the statistics skip files: a seek past the last offset reads no file
    seek = got.where("queue_offset > 100")
    assert seek.count() == 0
    assert seek.inputFiles() == []


def test_an_overwrite_replaces_the_rows_and_the_change_feed_shows_both(spark, warehouse):
    path = _topic_table(spark, warehouse)
    tagged_writes.write_for_run(_topic_rows(spark, [1, 2]), path, 1, "topics/ORDER")
    tagged_writes.write_for_run(_topic_rows(spark, [3]), path, 2, "topics/ORDER", mode="overwrite")
    assert [r.queue_offset for r in spark.read.format("delta").load(path).collect()] == [3]
    changes = (
        spark.read.format("delta")
        .option("readChangeFeed", "true")
        .option("startingVersion", 2)
        .load(path)
    )
    assert sorted((r._change_type, r.queue_offset) for r in changes.collect()) == [
        ("delete", 1),
        ("delete", 2),
        ("insert", 3),
    ]
    # an overwrite with no rows empties the table
    tagged_writes.write_for_run(_topic_rows(spark, []), path, 3, "topics/ORDER", mode="overwrite")
    assert spark.read.format("delta").load(path).count() == 0
    assert DeltaTable(path).to_pyarrow_table().num_rows == 0


def test_a_null_in_a_not_null_column_fails_and_commits_nothing(spark, warehouse):
    path = _topic_table(spark, warehouse)
    before = DeltaTable(path).version()
    bad = _topic_rows(spark, [1]).selectExpr(
        *[f"CAST(NULL AS string) AS {c}" if c == "msg_id" else c for c in TOPIC.names]
    )
    with pytest.raises(Exception, match="NOT NULL constraint violated for column msg_id"):
        tagged_writes.write_for_run(bad, path, 1, "topics/ORDER")
    assert DeltaTable(path).version() == before
    # the next write clears what the failed one left
    tagged_writes.write_for_run(_topic_rows(spark, [2]), path, 2, "topics/ORDER")
    assert not [n for n in os.listdir(path) if n.startswith(commits.STAGING_PREFIX)]
    assert [r.queue_offset for r in spark.read.format("delta").load(path).collect()] == [2]


def _staging_dir(table: str, name: str) -> str:
    """A staging directory with a file in it, as another process writing would have it."""
    path = os.path.join(table, name)
    os.makedirs(path)
    with open(os.path.join(path, "part-00000.parquet"), "wb") as f:
        f.write(b"being written")
    return path


def test_a_stale_runs_write_leaves_the_files_of_the_run_that_took_over(spark, warehouse):
    """A run that stalled past its lease and wakes to write must not remove the
    staging directory of the run that took the lease over (it would fail that
    run): a write removes only leftovers of its own lease's generation or an
    earlier one. The stale write then commits nothing (the fence)."""
    path = _topic_table(spark, warehouse)
    clock = [1_000.0]
    stale = Lease(warehouse, 60, clock=lambda: clock[0]).acquire()
    clock[0] += 61
    live = Lease(warehouse, 60, clock=lambda: clock[0]).acquire()
    assert live.generation > stale.generation
    in_flight = _staging_dir(path, commits.staging_name(live.generation))
    crashed = _staging_dir(path, commits.staging_name(stale.generation))
    older_release = _staging_dir(path, commits.STAGING_PREFIX + uuid.uuid4().hex)
    before = DeltaTable(path).version()

    with pytest.raises(LeaseLost):
        tagged_writes.write_for_run(_topic_rows(spark, [1]), path, 1, "topics/ORDER", lease=stale)
    assert DeltaTable(path).version() == before
    assert os.listdir(in_flight) == ["part-00000.parquet"]
    assert not os.path.exists(crashed) and not os.path.exists(older_release)

    # the live run's own next write clears what its generation left (a crash)
    assert tagged_writes.write_for_run(_topic_rows(spark, [2]), path, 1, "topics/ORDER", lease=live)
    assert not [n for n in os.listdir(path) if n.startswith(commits.STAGING_PREFIX)]
    assert [r.queue_offset for r in spark.read.format("delta").load(path).collect()] == [2]


def test_other_columns_or_a_check_constraint_go_to_deltas_writer(spark, warehouse):
    path = _topic_table(spark, warehouse)
    assert commits.committable(path, _topic_rows(spark, [1]).drop("run_id")) is None
    assert commits.committable("s3://bucket/topics/ORDER", _topic_rows(spark, [1])) is None
    spark.sql(f"ALTER TABLE delta.`{path}` ADD CONSTRAINT positive CHECK (queue_offset >= 0)")
    assert commits.committable(path, _topic_rows(spark, [1])) is None
    with pytest.raises(Exception, match="positive"):  # Delta's writer enforces it
        tagged_writes.write_for_run(_topic_rows(spark, [-1]), path, 1, "topics/ORDER")
    tagged_writes.write_for_run(_topic_rows(spark, [5]), path, 2, "topics/ORDER")
    assert DeltaTable(path).history(1)[0]["userMetadata"] == tagged_writes.run_tag(
        2, "topics/ORDER"
    )
    assert [r.queue_offset for r in spark.read.format("delta").load(path).collect()] == [5]


def test_deltas_writer_adds_nothing_for_a_run_another_attempt_already_wrote(spark, warehouse):
    """Where Delta's writer writes, its idempotent-write record is the fence
    (`jobs.fence`): checked within its commit, so an attempt that passed its
    lease check and then stalled while another committed adds nothing."""
    path = _topic_table(spark, warehouse)
    spark.sql(f"ALTER TABLE delta.`{path}` ADD CONSTRAINT positive CHECK (queue_offset >= 0)")
    lease = Lease(warehouse, 600).acquire()
    tagged_writes.write_for_run(_topic_rows(spark, [5]), path, 2, "topics/ORDER", lease=lease)
    # the stalled attempt of run 2, then one of run 1, both past their lease checks
    tagged_writes.write_for_run(_topic_rows(spark, [5]), path, 2, "topics/ORDER", lease=lease)
    tagged_writes.write_for_run(_topic_rows(spark, [4]), path, 1, "topics/ORDER", lease=lease)
    assert [r.queue_offset for r in spark.read.format("delta").load(path).collect()] == [5]


def test_a_checkpoint_every_ten_commits_as_delta_writes_them(spark, warehouse):
    path = os.path.join(warehouse, "_sys", "queues")
    job_tables.create_table(path, QUEUES)
    rows = lambda n: spark.createDataFrame([("ORDER", 0, n, n)], spark_schema(QUEUES))  # noqa: E731
    for n in range(1, 11):
        tagged_writes.write_for_run(rows(n), path, n, QUEUES.path, mode="overwrite")
    assert DeltaTable(path).version() == 10
    assert os.path.exists(os.path.join(path, "_delta_log", f"{10:020d}.checkpoint.parquet"))
    assert [tuple(r) for r in spark.read.format("delta").load(path).collect()] == [
        ("ORDER", 0, 10, 10)
    ]


def test_file_statistics_of_strings_are_bounds():
    import pyarrow as pa
    import pyarrow.parquet as pq

    from txn_core.delta_log import file_stats

    table = pa.table({"k": pa.array(["b" * 40, "a", None]), "n": pa.array([3, 1, 2])})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    metadata = pq.read_metadata(pa.BufferReader(sink.getvalue()))
    stats = file_stats(metadata, ["k", "n"], string_prefix=commits.STRING_PREFIX)
    # the min is a prefix of at most 32 characters; a max longer than that is left out
    assert stats == {
        "numRecords": 3,
        "minValues": {"k": "a", "n": 1},
        "maxValues": {"n": 3},
        "nullCount": {"k": 1, "n": 0},
    }
    # delta-rs keeps whole values, as the producers' blind appends do
    assert file_stats(metadata, ["k"])["maxValues"] == {"k": "b" * 40}


def test_a_split_write_stages_each_tables_rows_in_one_job_and_commits_each(spark, warehouse):
    from pyspark.sql import functions as F

    paths = {t: job_tables.ensure_topic_table(warehouse, t) for t in ("ORDER", "PAY")}
    rows = (
        _topic_rows(spark, [1, 2])
        .withColumn("topic", F.lit("ORDER"))
        .unionByName(_topic_rows(spark, [7]).withColumn("topic", F.lit("PAY")))
        .unionByName(_topic_rows(spark, [9]).withColumn("topic", F.lit("SHIP")))
    )
    split = tagged_writes.split_commits(
        rows, "topic", tagged_writes.split_tables(rows, "topic", paths)
    )
    assert sorted(split) == ["ORDER", "PAY"]
    # staged, not committed: the files are in the tables' directories, unread
    assert all(DeltaTable(p).version() == 0 for p in paths.values())
    assert any(n.endswith(".parquet") for n in os.listdir(paths["PAY"]))
    split["ORDER"](tagged_writes.run_tag(3, "topics/ORDER"))
    split["PAY"](tagged_writes.run_tag(3, "topics/PAY"))

    def read(t: str) -> list[int]:
        return sorted(r.queue_offset for r in spark.read.format("delta").load(paths[t]).collect())

    assert (read("ORDER"), read("PAY")) == ([1, 2], [7])  # SHIP has no table here: not written
    assert json.loads(_last_adds(paths["PAY"])[0]["stats"])["minValues"]["queue_offset"] == 7
    assert tagged_writes.committed_by_run(paths["PAY"], 3, "topics/PAY")
    assert not [
        n for t in paths.values() for n in os.listdir(t) if n.startswith(commits.STAGING_PREFIX)
    ]
    # a table Delta's writer must write makes the caller write one table at a time
    spark.sql(f"ALTER TABLE delta.`{paths['PAY']}` ADD CONSTRAINT c CHECK (queue_offset >= 0)")
    assert tagged_writes.split_tables(rows, "topic", paths) is None


def test_a_null_in_a_not_null_column_fails_a_split_write_naming_the_tables(spark, warehouse):
    from pyspark.sql import functions as F

    paths = {t: job_tables.ensure_topic_table(warehouse, t) for t in ("ORDER", "PAY")}
    bad = _topic_rows(spark, [1]).selectExpr(
        *[f"CAST(NULL AS string) AS {c}" if c == "msg_id" else c for c in TOPIC.names]
    )
    rows = bad.withColumn("topic", F.lit("ORDER")).unionByName(
        _topic_rows(spark, [7]).withColumn("topic", F.lit("PAY"))
    )
    tables = tagged_writes.split_tables(rows, "topic", paths)
    with pytest.raises(Exception, match="NOT NULL constraint violated for column msg_id of") as e:
        tagged_writes.split_commits(rows, "topic", tables)
    assert paths["ORDER"] in str(e.value) and paths["PAY"] in str(e.value)
    assert all(DeltaTable(p).version() == 0 for p in paths.values())


def test_distinct_columns_are_written_without_a_dictionary(spark, warehouse):
    import pyarrow.parquet as pq

    path = _topic_table(spark, warehouse)
    assert tagged_writes.write_for_run(
        _topic_rows(spark, range(100)).coalesce(1), path, 7, "topics/ORDER"
    )
    (add,) = _last_adds(path)
    meta = pq.ParquetFile(os.path.join(path, add["path"])).metadata
    chunks = {
        meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i)
        for i in range(meta.num_columns)
    }
    for name in ("queue_offset", "half_offset", "msg_id", "body"):
        assert not chunks[name].has_dictionary_page, name
    # the others keep parquet's default: a dictionary for repeated values
    assert chunks["producer_group"].has_dictionary_page
