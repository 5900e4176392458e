"""A run delivering to more topics than it opens tables at once, and `verify`
reading every topic's table in one scan, each row's table named by its
file's directory (docs/performance.md, "Hundreds of topics, and paths with spaces")."""

from __future__ import annotations

import threading
import time

from deltalake import DeltaTable, write_deltalake

from jobs import appends, job_tables, tagged_writes
from jobs.reconcile import reconcile
from jobs.verify import verify
from schemas import TOPIC, topic_path
from txn_core import Broker, Message, Producer

TOPICS = [f"T{i:02d}" for i in range(12)] + ["odd|one", "odd%41"]


class MostAtOnce:
    """Wraps a function; `most` is how many calls ever ran at once."""

    def __init__(self, fn):
        self.fn, self.running, self.most = fn, 0, 0
        self.lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            return self.fn(*args, **kwargs)
        finally:
            with self.lock:
                self.running -= 1


def _move(warehouse: str, source: str, target: str) -> int:
    """Move one delivered row from `source`'s table to `target`'s; its half_offset."""
    table = DeltaTable(topic_path(warehouse, source))
    row = table.to_pyarrow_table().slice(0, 1)
    offset = row["half_offset"][0].as_py()
    table.delete(f"half_offset = {offset}")
    write_deltalake(topic_path(warehouse, target), row, mode="append")
    return offset


def test_a_run_opens_a_bounded_number_of_tables_and_verify_reads_them_in_one_scan(
    spark, warehouse, monkeypatch
):
    monkeypatch.setattr(tagged_writes, "TABLES_OPENED_AT_ONCE", 3)
    created = MostAtOnce(job_tables.ensure_topic_table)
    monkeypatch.setattr(job_tables, "ensure_topic_table", created)
    opened = MostAtOnce(tagged_writes.commits.committable)
    monkeypatch.setattr(tagged_writes.commits, "committable", opened)
    with Broker.open(warehouse) as broker:
        producer = Producer(broker, "order_group")
        for topic in TOPICS:
            producer.send(Message(topic=topic, body=topic.encode()))

    summary = reconcile(spark, {"warehouse": warehouse}, now_ms=time.time_ns() // 1_000_000)

    assert summary.delivered_by_topic == dict.fromkeys(TOPICS, 1)
    assert 1 <= created.most <= 3 and 1 <= opened.most <= 3

    read = []
    monkeypatch.setattr(
        appends,
        "read_parquet",
        lambda spark, table, files, _read=appends.read_parquet: (
            read.append((table, len(files))) or _read(spark, table, files)
        ),
    )
    report = verify(spark, {"warehouse": warehouse})
    assert report.ok, report.render()
    assert report.counts["topic_tables"] == len(TOPICS)
    assert [n for table, n in read if table is TOPIC] == [len(TOPICS)]  # one scan, a file each

    away = _move(warehouse, "odd|one", "T02")
    back = _move(warehouse, "T03", "odd%41")
    report = verify(spark, {"warehouse": warehouse})
    wrong = {
        d["half_offset"]: (d["expected"], d["found"])
        for d in report.differences
        if d["kind"] == "wrong_topic"
    }
    assert wrong == {away: ("odd|one", "T02"), back: ("T03", "odd%41")}


def test_a_files_topic_is_its_table_directorys_name_at_any_depth(spark):
    from pyspark.sql import functions as F

    from jobs.verify import _topic_of_file

    paths = [
        ("file:/w/topics/ORDER/part-0.parquet", 0),
        ("s3a://b/topics/wh/topics/pay~beu/txn-staged-1/part-0.parquet", 1),
        ("s3a://b/wh/topics/a~p41/txn-staged-1/txn_target=0/part-0.parquet", 2),
    ]
    found = [
        spark.createDataFrame([(path,)], ["p"]).select(_topic_of_file(F.col("p"), depth)).first()[0]
        for path, depth in paths
    ]
    assert found == ["ORDER", "pay|eu", "a%41"]
