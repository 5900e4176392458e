"""Reading Delta tables as parquet (jobs.appends): a producer table's new rows
are exactly the change data feed's inserts, a state table read whole is its
snapshot at the pinned version, and anything else falls back to Delta."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from jobs import appends, inputs, job_tables, scheduled
from schemas import HALF, OP, PENDING, table_path
from schemas.arrow import arrow_schema
from schemas.spark import spark_schema
from schemas.tables import DISCARD, RESOLVED, SCHEDULED

import factories as fx


def _rows(df) -> list[tuple]:
    cols = [c for c in df.columns if c != "properties"]
    return sorted(tuple(r) for r in df.select(*cols).collect())


def _same_as_change_feed(spark, path: str, after: int, upto: int) -> None:
    got = inputs.added_rows(spark, path, HALF, after, upto)
    want = inputs.change_feed_inserts(spark, path, after, upto)
    assert got.columns == want.columns
    assert _rows(got) == _rows(want)


def test_many_small_appended_files_are_read_by_the_driver_like_the_change_feed(
    spark, warehouse, monkeypatch
):
    """A file per message (one-at-a-time producers): the driver reads them."""
    for i in range(5):
        fx.write_halves(warehouse, fx.half(10 + i, properties={"n": str(i)}, tags=None))
    path = table_path(warehouse, HALF)
    upto = DeltaTable(path).version()
    read_by = []
    real = appends._rows_in_driver
    monkeypatch.setattr(appends, "_rows_in_driver", lambda *a: read_by.append("driver") or real(*a))
    monkeypatch.setattr(appends, "DRIVER_READ_MIN_FILES", 3)
    _same_as_change_feed(spark, path, 0, upto)
    _same_as_change_feed(spark, path, 1, upto)
    assert read_by == ["driver", "driver"]
    monkeypatch.setattr(appends, "DRIVER_READ_MAX_BYTES", 10)  # too big in all: Spark reads
    _same_as_change_feed(spark, path, 0, upto)
    assert read_by == ["driver", "driver"]


def test_files_small_on_disk_whose_rows_are_not_are_read_by_spark(spark, warehouse, monkeypatch):
    """The driver's budget holds the rows as read, not their compressed
    files: bodies that compress a hundredfold would otherwise fill the
    driver's memory."""
    for i in range(5):
        fx.write_halves(warehouse, fx.half(10 + i, body=b"x" * 200_000))
    path = table_path(warehouse, HALF)
    upto = DeltaTable(path).version()
    files = appends.appended_files(path, 0, upto)
    on_disk = sum(size for *_, size in files)
    monkeypatch.setattr(appends, "DRIVER_READ_MIN_FILES", 3)
    budget = 5 * on_disk
    assert budget < 5 * 200_000  # the rows as read pass it: the bodies compress more than fivefold
    monkeypatch.setattr(appends, "DRIVER_READ_MAX_BYTES", budget)
    assert appends._rows_in_driver(files, HALF) is None
    got = inputs.added_rows(spark, path, HALF, 0, upto)
    assert "FileScan" in got._jdf.queryExecution().executedPlan().toString()
    _same_as_change_feed(spark, path, 0, upto)
    monkeypatch.setattr(appends, "DRIVER_READ_MAX_BYTES", 2 * 5 * 200_000)  # within it: the driver
    rows = appends._rows_in_driver(files, HALF)
    assert rows is not None and rows.num_rows == 5
    assert rows.column("body")[0].as_py() == b"x" * 200_000


def test_the_rows_the_driver_reads_reach_spark_in_few_partitions_not_one_per_file(
    spark, warehouse, monkeypatch
):
    """Spark makes a partition of each Arrow chunk it is handed (past a size it
    keeps in the plan): a chunk per file read would make a run's every stage
    a task per producer commit, and its writes as many files."""
    for i in range(12):
        fx.write_halves(warehouse, fx.half(10 + i))
    path = table_path(warehouse, HALF)
    upto = DeltaTable(path).version()
    monkeypatch.setattr(appends, "DRIVER_READ_MIN_FILES", 3)
    with fx.arrow_frames_parallelized(spark):
        rows = inputs.added_rows(spark, path, HALF, 0, upto)
        assert rows.rdd.getNumPartitions() == 1
        _same_as_change_feed(spark, path, 0, upto)


@pytest.mark.parametrize("by_expression", [True, False])
def test_appends_and_a_compaction_are_read_as_parquet_like_the_change_feed(
    spark, warehouse, monkeypatch, by_expression
):
    """Each row with the version that added its file: up to
    `VERSION_MAP_MAX_FILES` files, from an expression on the file's name
    (no join); more, by a join with a table of the files."""
    if not by_expression:
        monkeypatch.setattr(appends, "VERSION_MAP_MAX_FILES", 0)
    for i in range(3):
        fx.write_halves(warehouse, fx.half(2 * i), fx.half(2 * i + 1))
    path = table_path(warehouse, HALF)
    DeltaTable(path).optimize.compact()  # dataChange=false: adds no rows
    fx.write_halves(warehouse, fx.half(6))
    upto = DeltaTable(path).version()

    files = appends.appended_files(path, 0, upto)
    assert [v for v, _, _ in files] == [1, 2, 3, 5]  # version 0 creates the table, 4 compacts
    assert appends.appended_files(path, 3, 4) == []
    assert inputs.added_rows(spark, path, HALF, 3, 4).count() == 0
    _same_as_change_feed(spark, path, 0, upto)
    _same_as_change_feed(spark, path, 2, upto)
    by_offset = {
        r.half_offset: r.commit_version
        for r in inputs.added_rows(spark, path, HALF, 0, upto).collect()
    }
    assert by_offset == {0: 1, 1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 5}
    read = inputs.added_rows(spark, path, HALF, 0, upto)
    assert read.schema["commit_version"].dataType.simpleString() == "bigint"
    plan = read._jdf.queryExecution().toString()
    assert ("Join" not in plan) == by_expression
    one_commit = inputs.added_rows(spark, path, HALF, 1, 2)  # a literal version
    assert one_commit.schema["commit_version"].dataType.simpleString() == "bigint"
    assert sorted(
        tuple(r) for r in one_commit.select("half_offset", "commit_version").collect()
    ) == [(2, 2), (3, 2)]


def test_a_delete_in_the_range_falls_back_to_the_change_feed(spark, warehouse):
    fx.write_halves(warehouse, fx.half(1), fx.half(2))
    path = table_path(warehouse, HALF)
    DeltaTable(path).delete("half_offset = 2")  # rewrites the file, with a change file
    fx.write_halves(warehouse, fx.half(3))
    upto = DeltaTable(path).version()
    assert '"cdc"' in open(appends.log_entry(path, 2)).read()
    assert appends.appended_files(path, 0, upto) is None
    _same_as_change_feed(spark, path, 0, upto)
    assert sorted(
        r.half_offset for r in inputs.added_rows(spark, path, HALF, 0, upto).collect()
    ) == [1, 2, 3]  # the rewrite inserts nothing


def _merge(path: str, *rows: dict, update: bool = False) -> None:
    source = pa.Table.from_pylist([fx.half(**r) for r in rows], schema=arrow_schema(HALF))
    merge = DeltaTable(path).merge(
        source, "t.half_offset = s.half_offset", source_alias="s", target_alias="t"
    )
    if update:
        merge = merge.when_matched_update({"tags": "s.tags"})
    merge.when_not_matched_insert_all().execute()


def test_a_merge_that_only_inserts_is_read_as_parquet_and_one_that_updates_is_not(spark, warehouse):
    """The producers answer checks with an insert-only MERGE: its change file
    repeats the rows it adds, which may be read from the added file."""
    fx.write_halves(warehouse, fx.half(1), fx.half(2))
    path = table_path(warehouse, HALF)
    _merge(path, {"half_offset": 2}, {"half_offset": 3})  # 2 exists: only 3 is inserted
    inserted = DeltaTable(path).version()
    assert '"cdc"' in open(appends.log_entry(path, inserted)).read()
    files = appends.appended_files(path, inserted - 1, inserted)
    assert files is not None and [v for v, _, _ in files] == [inserted]
    _same_as_change_feed(spark, path, 0, inserted)
    assert sorted(
        r.half_offset for r in inputs.added_rows(spark, path, HALF, 1, inserted).collect()
    ) == [3]

    _merge(path, {"half_offset": 3, "tags": "changed"}, {"half_offset": 4}, update=True)
    updated = DeltaTable(path).version()
    assert appends.appended_files(path, inserted, updated) is None  # rewrites 3's file
    _same_as_change_feed(spark, path, inserted, updated)


def test_only_rows_from_the_change_feed_are_handed_to_keep_slow(spark, warehouse):
    fx.write_halves(warehouse, fx.half(1), fx.half(5))
    path = table_path(warehouse, HALF)
    kept = []

    def keep(df):
        kept.append(df)
        return df

    inputs.added_rows(spark, path, HALF, 0, 1, keep_slow=keep)  # a plain append: parquet
    assert kept == []
    DeltaTable(path).delete("half_offset = 1")  # rewrites the file with 5 in it
    fx.write_halves(warehouse, fx.half(2))
    rows = inputs.added_rows(spark, path, HALF, 0, 3, keep_slow=keep)
    assert kept == [rows] and sorted(r.half_offset for r in rows.collect()) == [1, 2, 5]


def test_tables_it_cannot_read_as_written_are_left_to_the_change_feed(warehouse):
    assert appends.appended_files("gs://bucket/_sys/half", 0, 3) is None
    path = f"{warehouse}/partitioned"
    rows = pa.Table.from_pylist([{**fx.half(1), "properties": None}], schema=arrow_schema(HALF))
    write_deltalake(path, rows, partition_by=["topic"])
    write_deltalake(path, rows, mode="append", partition_by=["topic"])
    assert appends.appended_files(path, 0, 1) is None


def _pending(*offsets: int):
    return [
        {
            **fx.half(o, store_ms=o),
            "checks_sent": 0,
            "checks_undecided": 0,
            "last_check_ms": None,
            "run_number": 1,
        }
        for o in offsets
    ]


def _write_pending(spark, path: str, rows: list[dict]) -> None:
    (
        spark.createDataFrame(rows, spark_schema(PENDING))
        .write.format("delta")
        .mode("overwrite")
        .save(path)
    )


def _read_whole(spark, warehouse: str, version: int):
    return inputs.read_state(
        spark, warehouse, {inputs.state_version_key(PENDING): version}, PENDING
    )


def test_a_state_table_read_whole_is_its_snapshot_at_the_pinned_version(
    spark, warehouse, monkeypatch
):
    job_tables.ensure_job_tables(warehouse)
    path = table_path(warehouse, PENDING)
    _write_pending(spark, path, _pending(1, 2))
    _write_pending(spark, path, _pending(3))  # an overwrite: version 1's files are gone in 2
    assert len(appends.snapshot_files(path, 1)) >= 1
    assert set(appends.snapshot_files(path, 1)).isdisjoint(appends.snapshot_files(path, 2))
    assert appends.snapshot_files(path, 0) == []
    for version, offsets in ((0, []), (1, [1, 2]), (2, [3])):
        with monkeypatch.context() as m:  # read as files: Delta's reader is never asked
            m.setattr(inputs, "snapshot", lambda *a: pytest.fail("read through Delta"))
            got = _read_whole(spark, warehouse, version)
        want = spark.read.format("delta").option("versionAsOf", version).load(path)
        assert got.columns == want.columns == PENDING.names
        assert _rows(got) == _rows(want)
        assert sorted(r.half_offset for r in got.collect()) == offsets


def test_a_state_table_with_deletion_vectors_is_read_by_delta(spark, warehouse):
    job_tables.ensure_job_tables(warehouse)
    path = table_path(warehouse, PENDING)
    spark.sql(
        f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
    )
    _write_pending(spark, path, _pending(1, 2, 3))
    spark.sql(f"DELETE FROM delta.`{path}` WHERE half_offset = 2")  # a deletion vector
    version = DeltaTable(path).version()
    assert appends.snapshot_files(path, version) is None  # its files hold a deleted row
    assert sorted(r.half_offset for r in _read_whole(spark, warehouse, version).collect()) == [1, 3]


def _scheduled(*due: int) -> list[dict]:
    stored = [c.name for c in SCHEDULED.columns]
    rows = [
        {**fx.half(d, store_ms=1), "due_ms": d, "commit_ms": 1, "commit_version": 1} for d in due
    ]
    return [{**{k: r.get(k) for k in stored}, "run_number": 1, "source": None} for r in rows]


def _due(spark, warehouse: str, version: int, after: int, upto: int) -> list[int]:
    rows = inputs.read_scheduled(
        spark, warehouse, {inputs.state_version_key(SCHEDULED): version}, after, upto
    )
    return sorted(r.due_ms for r in rows.where(f"due_ms > {after} AND due_ms <= {upto}").collect())


def test_the_due_rows_are_read_from_the_files_whose_statistics_may_hold_them(
    spark, warehouse, monkeypatch
):
    job_tables.ensure_job_tables(warehouse)
    path = table_path(warehouse, SCHEDULED)
    for due in ((10, 20), (30, 40), (50, 60)):  # a file each, disjoint due ranges
        spark.createDataFrame(_scheduled(*due), spark_schema(SCHEDULED)).coalesce(1).write.format(
            "delta"
        ).mode("append").save(path)
    files = appends.snapshot_files(path, 3)
    assert len(files) == 3
    assert scheduled.files_due(path, 3, 20, 40) == [f for f in files if _holds(f, 30)]
    assert len(scheduled.files_due(path, 3, 15, 55)) == 3  # every range meets the window
    assert scheduled.files_due(path, 3, 60, 99) == []
    assert scheduled.files_due(path, 2, 20, 60) == [f for f in files if _holds(f, 30)]
    with monkeypatch.context() as m:  # read as files: Delta's reader is never asked
        m.setattr(inputs, "snapshot", lambda *a: pytest.fail("read through Delta"))
        assert _due(spark, warehouse, 3, 20, 50) == [30, 40, 50]
        assert _due(spark, warehouse, 3, 60, 99) == []
    spark.sql(
        f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
    )
    spark.sql(f"DELETE FROM delta.`{path}` WHERE due_ms = 40")  # a deletion vector
    version = DeltaTable(path).version()
    assert scheduled.files_due(path, version, 20, 50) is None  # a file holds a deleted row
    assert _due(spark, warehouse, version, 20, 50) == [30, 50]  # read by Delta


def _resolved(*offsets: int) -> pa.Table:
    rows = [
        {
            "half_offset": o,
            "transaction_id": f"t{o}",
            "producer_group": "g",
            "topic": "ORDER",
            "action": "COMMIT",
            "source": "PRODUCER",
            "op_offset": o,
            "op_version": 1,
            "op_store_ms": 0,
            "after_discard": False,
            "run_id": "run-1",
        }
        for o in offsets
    ]
    return pa.Table.from_pylist(rows, schema=arrow_schema(RESOLVED))


def test_resolved_messages_are_looked_up_in_the_files_whose_statistics_may_hold_them(
    spark, warehouse, monkeypatch
):
    """A run that meets OPs for messages no longer pending reads their
    `_sys/resolved` rows from the few files that may hold them, chosen from
    the log in the driver, not through Delta's reader, which rebuilds the
    table's state in Spark jobs first."""
    import pyarrow.parquet as pq

    job_tables.ensure_job_tables(warehouse)
    path = table_path(warehouse, RESOLVED)
    for offsets in ((10, 20), (30, 40), (50, 60)):  # a file each, disjoint ranges
        write_deltalake(path, _resolved(*offsets), mode="append")
    files = appends.snapshot_files(path, 3)
    assert len(files) == 3
    holding_30 = [f for f in files if 30 in pq.read_table(f)["half_offset"].to_pylist()]
    assert appends.snapshot_files_holding(path, 3, "half_offset", [35, 40, 99]) == holding_30
    assert len(appends.snapshot_files_holding(path, 3, "half_offset", [10, 30, 60])) == 3
    assert appends.snapshot_files_holding(path, 3, "half_offset", [5, 25, 61]) == []
    assert appends.snapshot_files_holding(path, 2, "half_offset", [50]) == []  # not there yet
    versions = {inputs.state_version_key(RESOLVED): 3}
    with monkeypatch.context() as m:  # read as files: Delta's reader is never asked
        m.setattr(inputs, "snapshot", lambda *a: pytest.fail("read through Delta"))
        found = inputs.read_state_holding(spark, warehouse, versions, RESOLVED, [40, 45])
        assert sorted(r.half_offset for r in found.where("half_offset IN (40, 45)").collect()) == [
            40
        ]


def test_the_history_near_a_runs_ops_is_read_from_the_files_whose_ranges_overlap_theirs(
    spark, warehouse, monkeypatch
):
    """The range of half_offsets a run's OPs name comes from their commits'
    statistics; the history in that range from the files of `_sys/resolved`
    whose own statistics overlap it, with their row count, so that a run
    can tell whether reading them with the live messages is cheap."""
    import json
    import os

    job_tables.ensure_job_tables(warehouse)
    path = table_path(warehouse, RESOLVED)
    for offsets in ((10, 20), (30, 40), (50, 60)):  # a file each, disjoint ranges
        write_deltalake(path, _resolved(*offsets), mode="append")
    ops = table_path(warehouse, OP)
    fx.write_ops(warehouse, fx.op(fx.half(55)), fx.op(fx.half(38)))
    start = DeltaTable(ops).version() - 1
    fx.write_ops(warehouse, fx.op(fx.half(33)))
    upto = DeltaTable(ops).version()
    assert appends.appended_range(ops, start, upto, "half_offset") == (33, 55)
    assert appends.appended_range(ops, upto - 1, upto, "half_offset") == (33, 33)
    assert appends.appended_range(ops, upto, upto, "half_offset") is None  # nothing new

    files, rows = appends.snapshot_files_overlapping(path, 3, "half_offset", 33, 55)
    assert (len(files), rows) == (2, 4)
    assert appends.snapshot_files_overlapping(path, 3, "half_offset", 41, 49) == ([], 0)
    versions = {inputs.state_version_key(RESOLVED): 3}
    near, rows = inputs.read_state_in_range(spark, warehouse, versions, RESOLVED, 33, 55)
    assert (sorted(r.half_offset for r in near.collect()), rows) == ([40, 50], 4)
    none_yet = {inputs.state_version_key(RESOLVED): job_tables.NO_VERSION}
    near, rows = inputs.read_state_in_range(spark, warehouse, none_yet, RESOLVED, 0, 99)
    assert (near.count(), rows) == (0, 0)
    with monkeypatch.context() as m:  # created, never written: not even opened
        m.setattr(appends, "open_snapshot", lambda *a: pytest.fail("opened"))
        versions = {inputs.state_version_key(DISCARD): 0}
        near, rows = inputs.read_state_in_range(spark, warehouse, versions, DISCARD, 0, 99)
        assert (near.count(), rows) == (0, 0)

    # a commit whose file has no statistics: the range cannot be bounded
    log = os.path.join(ops, "_delta_log")
    with open(os.path.join(log, f"{upto:020d}.json")) as entry:
        actions = [json.loads(line) for line in entry if line.strip()]
    for action in actions:
        action.get("add", {}).pop("stats", None)
    with open(os.path.join(log, f"{upto + 1:020d}.json"), "w") as entry:
        entry.write("\n".join(json.dumps(a) for a in actions))
    assert appends.appended_range(ops, start, upto + 1, "half_offset") is None


def _holds(file: str, due_ms: int) -> bool:
    import pyarrow.parquet as pq

    return due_ms in pq.read_table(file, columns=["due_ms"])["due_ms"].to_pylist()


def test_the_driver_reads_files_written_before_a_column_was_added_with_it_null(tmp_path):
    import pyarrow.parquet as pq

    schema = arrow_schema(HALF)
    old, new = str(tmp_path / "old.parquet"), str(tmp_path / "new.parquet")
    row = fx.half(1)
    pq.write_table(pa.Table.from_pylist([row], schema=schema).drop_columns(["message_type"]), old)
    pq.write_table(pa.Table.from_pylist([{**fx.half(2), "message_type": "NORMAL"}], schema), new)
    batches = appends._local_batches([(3, old, 0), (4, new, 0)], schema)
    rows = [row for batch in batches for row in batch.to_pylist()]
    got = {r["half_offset"]: (r["message_type"], r["commit_version"]) for r in rows}
    assert got == {1: (None, 3), 2: ("NORMAL", 4)}


def test_within_a_run_each_log_entry_is_read_once_and_only_then(warehouse, monkeypatch):
    """The run's size, then its files: one read of each new entry
    (`log_entries_kept`), kept no longer than the run."""
    for i in range(3):
        fx.write_halves(warehouse, fx.half(i))
    path = table_path(warehouse, HALF)
    upto = DeltaTable(path).version()
    read: list[int] = []
    reader = appends._read_log_entries
    monkeypatch.setattr(
        appends, "_read_log_entries", lambda p, vs: read.extend(vs) or reader(p, vs)
    )
    with appends.log_entries_kept():
        assert appends.appended_rows(path, 0, upto) == 3
        assert [v for v, _, _ in appends.appended_files(path, 0, upto)] == [1, 2, 3]
        assert [v for v, _, _ in appends.appended_files(path, 1, upto)] == [2, 3]
    assert read == [1, 2, 3]
    assert appends.appended_rows(path, 0, upto) == 3  # after the run: read again
    assert read == [1, 2, 3, 1, 2, 3]


def test_a_table_read_as_parquet_is_not_opened_again_but_a_later_column_mapping_is_seen(
    spark, warehouse, monkeypatch
):
    """The next run's read of a producer table needs no replay of its log
    (`appends._plain_from`): the commits it reads are checked one by one,
    and one that maps columns still sends the read to the change feed."""
    for i in range(3):
        fx.write_halves(warehouse, fx.half(i))
    path = table_path(warehouse, HALF)
    assert [v for v, _, _ in appends.appended_files(path, 0, 2)] == [1, 2]
    opened: list[int] = []
    real = appends._rs_table
    monkeypatch.setattr(appends, "_rs_table", lambda p, v: opened.append(v) or real(p, v))
    assert [v for v, _, _ in appends.appended_files(path, 2, 3)] == [3]
    assert opened == []
    spark.sql(
        f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.minReaderVersion' = '2', "
        "'delta.minWriterVersion' = '5', 'delta.columnMapping.mode' = 'name')"
    )
    assert appends.appended_files(path, 3, DeltaTable(path).version()) is None
    assert opened == []
