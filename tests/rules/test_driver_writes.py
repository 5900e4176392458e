"""A run's small writes collected by the driver and committed by delta-rs
(jobs.driver_writes): the table reads the same through Delta (rows, change
feed, statistics that skip files), the commit is tagged with its run, NOT
NULL holds, and only writes that fit in the driver take this path."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from jobs import driver_writes, inputs, job_tables, tagged_writes
from jobs.writes import RunWrites
from schemas import TOPIC, table_path
from schemas.spark import spark_schema
from schemas.tables import QUEUES
from txn_core import log_trim

import factories as fx


def _topic_rows(spark, offsets):
    rows = [
        (0, o, f"m{o}", f"t{o}", 1000 + o, "pg", None, "k", b"body", {"p": "v"}, 1, 2, 3, "r")
        for o in offsets
    ]
    return spark.createDataFrame(rows, spark_schema(TOPIC))


def _engine(path: str) -> str:
    return DeltaTable(path).history(1)[0].get("engineInfo", "")


def test_a_collected_append_reads_as_delta_with_statistics_that_skip_files(spark, warehouse):
    path = job_tables.ensure_topic_table(warehouse, "ORDER")
    assert tagged_writes.write_for_run(
        _topic_rows(spark, range(10, 20)), path, 7, "topics/ORDER", collect=True
    )

    assert _engine(path).startswith("delta-rs")  # the driver's commit, not Spark's
    got = spark.read.format("delta").load(path)
    assert sorted(r.queue_offset for r in got.collect()) == list(range(10, 20))
    row = got.where("queue_offset = 10").first()
    assert (row.body, row.properties, row.tags) == (b"body", {"p": "v"}, None)
    assert tagged_writes.committed_by_run(path, 7, "topics/ORDER")
    # the statistics skip files: a seek past the last offset reads no file
    seek = got.where("queue_offset > 100")
    assert seek.count() == 0
    assert seek.inputFiles() == []


def test_a_collected_overwrite_replaces_the_rows_and_the_change_feed_shows_both(spark, warehouse):
    path = job_tables.ensure_topic_table(warehouse, "ORDER")
    tagged_writes.write_for_run(_topic_rows(spark, [1, 2]), path, 1, "topics/ORDER", collect=True)
    tagged_writes.write_for_run(
        _topic_rows(spark, [3]), path, 2, "topics/ORDER", mode="overwrite", collect=True
    )
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
    tagged_writes.write_for_run(
        _topic_rows(spark, []), path, 3, "topics/ORDER", mode="overwrite", collect=True
    )
    assert spark.read.format("delta").load(path).count() == 0


def test_a_null_in_a_not_null_column_fails_and_commits_nothing(spark, warehouse):
    path = job_tables.ensure_topic_table(warehouse, "ORDER")
    before = DeltaTable(path).version()
    bad = _topic_rows(spark, [1]).withColumn("msg_id", F.lit(None).cast("string"))
    with pytest.raises(ValueError, match="NOT NULL constraint violated for column msg_id"):
        tagged_writes.write_for_run(bad, path, 1, "topics/ORDER", collect=True)
    assert DeltaTable(path).version() == before


def test_the_rows_of_several_tables_are_collected_once_and_committed_to_each(spark, warehouse):
    paths = {t: job_tables.ensure_topic_table(warehouse, t) for t in ("ORDER", "PAY")}
    rows = (
        _topic_rows(spark, [1, 2])
        .withColumn("topic", F.lit("ORDER"))
        .unionByName(_topic_rows(spark, [7]).withColumn("topic", F.lit("PAY")))
    )
    tables = tagged_writes.split_tables(rows, "topic", paths)
    by_topic = driver_writes.split(driver_writes.collect(rows), "topic", sorted(tables))
    for topic, table in tables.items():
        driver_writes.write(by_topic[topic], table, "append", tagged_writes.run_tag(3, topic))
    read = {
        t: sorted(r.queue_offset for r in spark.read.format("delta").load(p).collect())
        for t, p in paths.items()
    }
    assert read == {"ORDER": [1, 2], "PAY": [7]}


def test_a_topics_appends_by_hand_list_its_log_only_to_checkpoint_it(spark, warehouse, monkeypatch):
    """A topic keeps days of log (topic_log_retention_hours), which delta-rs
    lists whole on a local disk at every commit: a run's appends to it are
    written by hand, the kept table left behind them until a checkpoint."""
    path = job_tables.ensure_topic_table(warehouse, "ORDER")
    updates: list[int] = []  # each a listing of the log, from the version the table was at
    update, load = DeltaTable.update_incremental, DeltaTable.load_as_version
    monkeypatch.setattr(
        DeltaTable, "update_incremental", lambda t: (updates.append(t.version()), update(t))
    )
    monkeypatch.setattr(
        DeltaTable, "load_as_version", lambda t, v: (updates.append(t.version()), load(t, v))
    )
    rows = driver_writes.collect(_topic_rows(spark, range(10)))
    versions = []
    for run in range(1, 13):
        table = tagged_writes.split_tables(
            _topic_rows(spark, []).withColumn("topic", F.lit("ORDER")), "topic", {"ORDER": path}
        )["ORDER"]
        batch = rows.slice(run - 1, 1) if run <= 10 else rows.slice(9, 0)
        versions.append(
            driver_writes.write(batch, table, "append", _tag(run, "topics/ORDER"), by_hand=True)
        )
    assert versions == list(range(1, 13))
    # once, to checkpoint version 10; runs 11 and 12 add no file (delta-rs commits them)
    assert updates == [0]
    assert os.path.exists(f"{path}/_delta_log/{10:020d}.checkpoint.parquet")
    engines = [h.get("engineInfo") for h in DeltaTable(path).history(12)]
    assert engines.count("lakehouse-txn blind append") == 10
    assert tagged_writes.committed_by_run(path, 12, "topics/ORDER")
    assert tagged_writes.committed_by_run(path, 10, "topics/ORDER")  # an entry by hand
    got = spark.read.format("delta").load(path)
    assert sorted(r.queue_offset for r in got.collect()) == list(range(10))
    seek = got.where("queue_offset > 8")
    assert [r.queue_offset for r in seek.collect()] == [9]
    assert len(seek.inputFiles()) == 1  # the statistics written by hand skip files


def _tag(run: int, app: str) -> str:
    return tagged_writes.run_tag(run, app)


def test_a_state_tables_log_keeps_its_last_entries_a_topics_its_history(
    spark, warehouse, monkeypatch
):
    """A busy run commits to each state table it changes: kept whole, their
    logs made every commit and read of a continuous job slower by the hour on
    a local disk (docs/performance.md). A topic's history is its readers'
    (Spark streams follow it by version) and stays."""
    monkeypatch.setattr(log_trim, "KEPT_ENTRIES", 10)
    job_tables.ensure_job_tables(warehouse)
    queues = table_path(warehouse, QUEUES)
    topic = job_tables.ensure_topic_table(warehouse, "ORDER")
    messages = driver_writes.collect(_topic_rows(spark, range(1, 41)))
    for run in range(1, 41):  # versions 1-40 of each
        row = pa.table({"topic": ["ORDER"], "queue_id": [0], "next_queue_offset": [run]})
        row = row.append_column("run_number", pa.array([run], pa.int64()))
        driver_writes.write(row, DeltaTable(queues), "overwrite", _tag(run, QUEUES.path))
        driver_writes.write(messages.slice(run - 1, 1), DeltaTable(topic), "append", _tag(run, "t"))

    # at version 40: back to the newest checkpoint at least 10 versions back
    assert fx.logged_versions(queues) == list(range(30, 41))
    assert fx.logged_versions(topic) == list(range(41))
    # what a redo of the last run reads is still there: its pinned version, its tag
    pinned = inputs.read_snapshot(spark, queues, QUEUES, 39).collect()
    assert [r.next_queue_offset for r in pinned] == [39]
    assert tagged_writes.committed_by_run(queues, 40, QUEUES.path)
    assert not tagged_writes.committed_by_run(queues, 41, QUEUES.path)


def test_only_writes_that_fit_in_the_driver_are_collected():
    narrow, message = ["half_offset", "action"], ["half_offset", "body"]
    assert driver_writes.fits(driver_writes.NARROW_MAX_ROWS, narrow, 4 << 20)
    assert not driver_writes.fits(driver_writes.NARROW_MAX_ROWS + 1, narrow, 4 << 20)
    # rows with bodies: as many as bodies of the largest size allowed fit in the budget
    per_budget = driver_writes.BODY_BYTES_MAX // (4 << 20)
    assert driver_writes.fits(per_budget, message, 4 << 20)
    assert not driver_writes.fits(per_budget + 1, message, 4 << 20)
    assert driver_writes.fits(driver_writes.MESSAGE_MAX_ROWS, message, 1024)
    assert not driver_writes.fits(driver_writes.MESSAGE_MAX_ROWS + 1, message, 1024)
    # bodies the run counted: their bytes, not the largest size allowed
    assert driver_writes.fits(10_000, message, 4 << 20, body_bytes=10_000 * 100)
    assert not driver_writes.fits(10_000, message, 1, body_bytes=driver_writes.BODY_BYTES_MAX + 1)
    assert not driver_writes.fits(driver_writes.MESSAGE_MAX_ROWS + 1, message, 1, body_bytes=0)
    writes = RunWrites(1, lease=None, redo=False, max_body_bytes=4 << 20)
    try:
        assert not writes.collects(None, narrow)  # unknown count: Spark writes it
        assert writes.collects(10, message)
        assert not writes.collects(10_000, message)
        assert writes.collects(10_000, message, body_bytes=1_000_000)
    finally:
        writes.close()


def _collected_writes(monkeypatch) -> dict:
    """Filled by the runs that follow: for each table a run writes (by its
    app id), whether the driver collected the rows."""
    from jobs import writes

    collected = {}
    real = writes._put

    def put(df, path, app, mode, collect, *rest):
        collected[app] = collect
        return real(df, path, app, mode, collect, *rest)

    monkeypatch.setattr(writes, "_put", put)
    return collected


def test_a_run_collects_the_undelivered_messages_by_the_bytes_of_their_bodies(
    spark, warehouse, monkeypatch
):
    """The messages a run keeps pending and asks to check go to two tables:
    the run keeps them once, counting their bodies' bytes, and collects each
    table's rows when those bytes fit, however large a body may be."""
    from jobs.reconcile import reconcile
    from schemas import PENDING
    from schemas.tables import CHECK_REQUESTS

    now = 1_800_000_000_000
    fx.write_halves(
        warehouse, *[fx.half(i, store_ms=now - 100_000, body=b"b" * 10) for i in range(3)]
    )
    collected = _collected_writes(monkeypatch)
    # room for the bodies of 2 messages of the largest size, and for 3 of 10 bytes
    monkeypatch.setattr(driver_writes, "BODY_BYTES_MAX", 2 * (4 << 20))
    summary = reconcile(spark, {"warehouse": warehouse, "max_body_bytes": 4 << 20}, now_ms=now)
    assert (summary.check_requests, summary.pending_after) == (3, 3)
    assert collected[PENDING.path] and collected[CHECK_REQUESTS.path]
    monkeypatch.setattr(driver_writes, "BODY_BYTES_MAX", 29)  # 30 bytes of bodies: too many
    summary = reconcile(spark, {"warehouse": warehouse}, now_ms=now + 100_000)
    assert summary.check_requests == 3
    assert not collected[PENDING.path] and not collected[CHECK_REQUESTS.path]


def test_a_run_collects_its_pending_set_alone_by_the_bytes_of_its_bodies(
    spark, warehouse, monkeypatch
):
    """A run whose undelivered messages all stay pending writes one table
    from them: it still counts their bodies' bytes, so that the driver
    collects the pending set when they fit rather than Spark writing it."""
    from jobs.reconcile import reconcile
    from schemas import PENDING

    now = 1_800_000_000_000
    fx.write_halves(warehouse, *[fx.half(i, store_ms=now - 10, body=b"b" * 10) for i in range(3)])
    collected = _collected_writes(monkeypatch)
    # room for the 30 bytes of these bodies, not for one of the largest size
    monkeypatch.setattr(driver_writes, "BODY_BYTES_MAX", 30)
    summary = reconcile(spark, {"warehouse": warehouse, "max_body_bytes": 4 << 20}, now_ms=now)
    assert (summary.check_requests, summary.pending_after) == (0, 3)
    assert collected == {PENDING.path: True}
    fx.write_halves(warehouse, fx.half(3, store_ms=now - 10, body=b"b" * 10))
    summary = reconcile(spark, {"warehouse": warehouse}, now_ms=now + 1)  # 40 bytes: too many
    assert (summary.check_requests, summary.pending_after) == (0, 4)
    assert collected == {PENDING.path: False}
    pending = spark.read.format("delta").load(f"{warehouse}/{PENDING.path}")
    assert sorted(r.half_offset for r in pending.collect()) == [0, 1, 2, 3]


def test_a_run_collects_its_deliveries_by_the_bytes_of_their_bodies(spark, warehouse, monkeypatch):
    """More deliveries than the driver could hold at the largest body size:
    a small run collects them at once when the bodies its first pass counted
    (the new half rows' and the pending set's) fit; else it keeps them,
    counting their bodies' bytes, collects them when those fit, and else has
    Spark write them from the kept rows; each message is delivered once
    whichever way."""
    from jobs import writes
    from jobs.reconcile import reconcile

    taken = []

    def spy(name: str):
        real = getattr(writes, name)

        def put(*args):
            taken.append(name)
            return real(*args)

        monkeypatch.setattr(writes, name, put)

    spy("_put_collected_deliveries")
    spy("_put_counted_deliveries")
    spy("_put_deliveries")
    now = 1_800_000_000_000

    def deliver(offsets: range, body_bytes_max: int, topics=("ORDER", "PAY")) -> int:
        halves = [
            fx.half(i, store_ms=now - 10, topic=topics[i % 2], body=b"b" * 10) for i in offsets
        ]
        fx.write_halves(warehouse, *halves)
        fx.write_ops(warehouse, *[fx.op(h) for h in halves])
        taken.clear()
        monkeypatch.setattr(driver_writes, "BODY_BYTES_MAX", body_bytes_max)
        cfg = {"warehouse": warehouse, "max_body_bytes": 4 << 20}
        return reconcile(spark, cfg, now_ms=now).committed

    # room for 2 bodies of the largest size, and for these 3 of 10 bytes
    assert deliver(range(3), 2 * (4 << 20)) == 3
    assert taken == ["_put_collected_deliveries"]  # counted in the first pass: no count of its own
    assert deliver(range(3, 6), 29) == 3  # 30 bytes of bodies: too many
    assert taken == ["_put_counted_deliveries", "_put_deliveries"]
    # a message left pending with a body of 100 bytes: counted in the bound,
    # so the deliveries are counted themselves, and their 30 bytes fit
    fx.write_halves(warehouse, fx.half(1_000, store_ms=now - 10, topic="PAY", body=b"p" * 100))
    assert deliver(range(6, 9), 50) == 3
    assert taken == ["_put_counted_deliveries", "_put_collected_deliveries"]
    delivered = {
        topic: sorted(
            (r.queue_offset, r.msg_id)
            for r in spark.read.format("delta").load(f"{warehouse}/topics/{topic}").collect()
        )
        for topic in ("ORDER", "PAY")
    }
    assert delivered == {
        "ORDER": [(0, "msg-0"), (1, "msg-2"), (2, "msg-4"), (3, "msg-6"), (4, "msg-8")],
        "PAY": [(0, "msg-1"), (1, "msg-3"), (2, "msg-5"), (3, "msg-7")],
    }


def test_a_run_delivering_a_due_scheduled_message_counts_its_deliveries_first(
    spark, warehouse, monkeypatch
):
    """The bodies a small run's first pass counts are the new half rows' and
    the pending set's; a scheduled message due now comes from elsewhere, so
    that count is no bound, and the deliveries are counted before the driver
    may collect them."""
    from jobs import writes
    from jobs.reconcile import reconcile
    from txn_core import Broker, Config, Message, Producer

    taken = []
    for name in ("_put_collected_deliveries", "_put_counted_deliveries", "_put_deliveries"):
        real = getattr(writes, name)
        monkeypatch.setattr(
            writes, name, lambda *args, _n=name, _r=real: (taken.append(_n), _r(*args))[1]
        )
    now = 1_800_000_000_000
    cfg = {"warehouse": warehouse, "max_body_bytes": 4 << 20}
    with Broker.open(Config(warehouse=warehouse), clock=lambda: now) as broker:
        Producer(broker, "g").send(Message(topic="ORDER", body=b"d" * 1_000, delay_ms=1_000))
    assert reconcile(spark, cfg, now_ms=now).scheduled == 1
    with Broker.open(Config(warehouse=warehouse), clock=lambda: now + 1_000) as broker:
        Producer(broker, "g").send(Message(topic="ORDER", body=b"n" * 10))
    # room for the new message's 10 bytes, not for the due one's 1,000
    monkeypatch.setattr(driver_writes, "BODY_BYTES_MAX", 500)
    taken.clear()
    run = reconcile(spark, cfg, now_ms=now + 1_000)
    assert (run.delivered_scheduled, run.committed) == (1, 2)
    assert taken == ["_put_counted_deliveries", "_put_deliveries"]


def test_a_run_commits_to_its_topics_all_at_once(spark, warehouse, monkeypatch):
    """Each topic's commit is a few round trips to the store: a run makes
    them at once, not one after another (each waits here until the other
    has started; one after another, the first would wait in vain)."""
    import threading

    from jobs.reconcile import reconcile

    both_started = threading.Barrier(2, timeout=30)
    real = driver_writes.write

    def write(rows, table, mode, user_metadata, **options):
        if "/topics/" in table.table_uri:
            both_started.wait()
        return real(rows, table, mode, user_metadata, **options)

    monkeypatch.setattr(driver_writes, "write", write)
    now = 1_800_000_000_000
    halves = [fx.half(i, store_ms=now - 10, topic=("ORDER", "PAY")[i % 2]) for i in range(4)]
    fx.write_halves(warehouse, *halves)
    fx.write_ops(warehouse, *[fx.op(h) for h in halves])
    assert reconcile(spark, {"warehouse": warehouse}, now_ms=now).delivered_by_topic == {
        "ORDER": 2,
        "PAY": 2,
    }


def test_commits_to_several_topics_are_all_tried_and_a_crash_is_raised_first():
    """A failed commit leaves the others to finish (a redo skips those, I4);
    the error raised is the injected crash or lost lease, which says why the
    run stopped, before any other."""
    from jobs.faults import InjectedFault
    from jobs.writes import _each_topic

    tried = []

    def commit(topic: str) -> None:
        tried.append(topic)
        if topic == "A":
            raise ValueError("store refused")
        if topic == "C":
            raise InjectedFault("fault injected at step 'after:topics/C'")

    with pytest.raises(InjectedFault):
        _each_topic(commit, {"A": None, "B": None, "C": None, "D": None})
    assert sorted(tried) == ["A", "B", "C", "D"]
    with pytest.raises(ValueError, match="store refused"):
        _each_topic(commit, {"A": None, "B": None})
