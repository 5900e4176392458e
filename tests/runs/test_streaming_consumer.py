"""A Spark consumer reads a topic table as a stream (Delta's streaming
source, with a checkpoint) into a Delta sink: every delivered message
arrives once, across runs of the job, a restart of the stream and a change
of the topic's log retention, and the topic's compaction; and a consumer
group reads it once too."""

from __future__ import annotations

from deltalake import DeltaTable

from jobs import job_tables
from jobs.reconcile import reconcile
from schemas import topic_path
from txn_core import Consumer

import factories as fx

T = 700 * 3_600_000


def _deliver(warehouse: str, n: int) -> list[int]:
    """n new committed messages to ORDER, and a run of the job."""
    halves = [fx.half(store_ms=T - 10_000) for _ in range(n)]
    fx.write_halves(warehouse, *halves)
    fx.write_ops(warehouse, *[fx.op(h) for h in halves])
    return [h["half_offset"] for h in halves]


def _stream_once(spark, source: str, sink: str, checkpoint: str) -> None:
    """Everything new in `source` since the checkpoint, appended to `sink`."""
    query = (
        spark.readStream.format("delta")
        .load(source)
        .select("queue_id", "queue_offset", "half_offset", "body")
        .writeStream.format("delta")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start(sink)
    )
    query.awaitTermination(300)
    assert query.exception() is None


def test_a_topic_streams_into_a_sink_once_across_runs_and_restarts(
    spark, warehouse, tmp_path, monkeypatch
):
    """And across the upkeep's compaction of the topic (`compact_topics`):
    a rewrite of the same rows, which neither the stream nor a consumer
    group reads again."""
    cfg = {"warehouse": warehouse}
    source = topic_path(warehouse, "ORDER")
    sink, checkpoint = str(tmp_path / "sink"), str(tmp_path / "checkpoint")
    group = Consumer(warehouse, "billing", "ORDER")

    first = _deliver(warehouse, 3)
    reconcile(spark, cfg, now_ms=T)
    _stream_once(spark, source, sink, checkpoint)
    assert [m.half_offset for m in group.poll(32)] == first
    group.commit()
    # the upkeep's change of the topic's log retention is a commit the stream reads past
    assert job_tables.keep_topic_log_retention(warehouse, 1) == ["ORDER"]
    second = _deliver(warehouse, 2)
    reconcile(spark, cfg, now_ms=T + 1_000)
    reconcile(spark, cfg, now_ms=T + 2_000)  # nothing new: no commit to the topic
    assert job_tables.compact_topics(warehouse) == {}  # 2 small files: fewer than it takes
    monkeypatch.setattr(job_tables, "TOPIC_COMPACT_MIN_FILES", 2)
    assert job_tables.compact_topics(warehouse) == {"ORDER": 2}
    assert len(DeltaTable(source).file_uris()) == 1
    _stream_once(spark, source, sink, checkpoint)  # a new query on the same checkpoint
    _stream_once(spark, source, sink, checkpoint)  # and again, with nothing new

    got = DeltaTable(sink).to_pyarrow_table().to_pylist()
    assert sorted(r["half_offset"] for r in got) == sorted(first + second)
    assert sorted(r["queue_offset"] for r in got) == list(range(5))  # each message once
    assert [m.half_offset for m in group.poll(32)] == second
    group.close()  # without committing: a new member starts from the committed offsets
    restarted = Consumer(warehouse, "billing", "ORDER")
    assert [m.half_offset for m in restarted.poll(32)] == second
    restarted.close()
