"""A run in a notebook's own SparkSession, whose settings are the user's,
not `jobs.session.build_spark`'s: the rules must not depend on them, and
reads must not skip what the session would let them skip."""

from __future__ import annotations

import os
import time

import pytest

from jobs import appends
from jobs.reconcile import reconcile
from jobs.session import settings_held
from jobs.verify import verify
from schemas import HALF, table_path
from txn_core import Broker, LocalTransactionState, Message, Producer, TransactionProducer
from txn_core.consumer import read_topic

import factories as fx

#: settings a notebook or a cluster's defaults may well have
NOTEBOOK = {
    "spark.sql.ansi.enabled": "false",
    "spark.sql.caseSensitive": "true",
    "spark.sql.session.timeZone": "Pacific/Kiritimati",
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.autoBroadcastJoinThreshold": "-1",
    "spark.sql.shuffle.partitions": "7",
    "spark.sql.parquet.enableVectorizedReader": "false",
    "spark.sql.storeAssignmentPolicy": "LEGACY",
    "spark.sql.execution.arrow.pyspark.enabled": "false",
    "spark.sql.files.ignoreCorruptFiles": "true",
    "spark.sql.files.ignoreMissingFiles": "true",
}


def test_the_rules_hold_under_a_notebooks_settings(spark, warehouse):
    now = time.time_ns() // 1_000_000
    cfg = {"warehouse": warehouse}
    with Broker.open(warehouse) as broker:
        txn = TransactionProducer(
            broker, "order_group", fx.DecideByBody(on_check=LocalTransactionState.COMMIT_MESSAGE)
        )
        plain = Producer(broker, "order_group")
        for body in (b"commit-1", b"rollback-1", b"later-1", b"commit-2"):
            txn.send_message_in_transaction(Message(topic="ORDER", body=body), None)
        plain.send(Message(topic="ORDER", body=b"plain-1"))
        plain.send(Message(topic="PAY", body=b"plain-2", delay_ms=5_000))
        with settings_held(spark, NOTEBOOK):
            first = reconcile(spark, cfg, now_ms=now + 1_000)
            second = reconcile(spark, cfg, now_ms=now + 10_000)  # the unsure one is checked
            assert txn.answer_checks() == 1
            third = reconcile(spark, cfg, now_ms=now + 11_000)
            report = verify(spark, cfg)
        txn.close()

    assert first.delivered_by_topic == {"ORDER": 3}
    assert second.delivered_by_topic == {"PAY": 1} and second.check_requests == 1
    assert third.delivered_by_topic == {"ORDER": 1}
    assert report.ok, report.render()
    ordered = [(r["queue_offset"], r["body"]) for r in read_topic(warehouse, "ORDER")]
    assert ordered == [(0, b"commit-1"), (1, b"commit-2"), (2, b"plain-1"), (3, b"later-1")]


def test_a_file_a_run_cannot_read_fails_it_though_the_session_would_skip_it(
    spark, warehouse, monkeypatch
):
    """Skipped, the file's messages would be lost to every later run (its
    version is behind the run's cursor), and to `verify`. The session gets
    its own settings back after the run."""
    halves = [fx.half(store_ms=0) for _ in range(3)]
    for half in halves:  # a file each: read by Spark, as few files are
        fx.write_halves(warehouse, half)
    fx.write_ops(warehouse, *(fx.op(h) for h in halves))
    path = table_path(warehouse, HALF)
    _, damaged, _ = appends.appended_files(path, 0, 3)[1]
    with open(damaged, "wb") as fh:
        fh.write(b"not parquet at all")
    monkeypatch.setattr(appends, "DRIVER_READ_MIN_FILES", 100)

    with settings_held(spark, NOTEBOOK):
        with pytest.raises(Exception, match="(?i)not a parquet file"):
            reconcile(spark, {"warehouse": warehouse}, now_ms=1_000_000)
        assert spark.conf.get("spark.sql.files.ignoreCorruptFiles") == "true"
    assert not os.path.exists(os.path.join(warehouse, "topics", "ORDER"))
