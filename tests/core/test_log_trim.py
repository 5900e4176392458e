"""Producer tables' logs trimmed behind the job's cursor (txn_core.log_trim)."""

from __future__ import annotations

import os

import pyarrow as pa
from deltalake import DeltaTable

from jobs.reconcile import reconcile
from jobs.verify import verify
from schemas import HALF, OP, table_path, topic_path
from schemas.arrow import arrow_schema
from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
)
from txn_core.group_commit import GroupCommitWriter
from txn_core.log_trim import job_cursor
from txn_core.maintenance import maintain
from txn_core.tables import PRODUCER_TABLE_CONFIG, open_or_create

import factories as fx
from factories import STORE_MS, op_rows

#: a checkpoint every 5 commits, and a time-based retention that drops nothing
EVERY_5 = dict(PRODUCER_TABLE_CONFIG, **{"delta.checkpointInterval": "5"})


def entries(path: str) -> list[str]:
    return sorted(os.listdir(os.path.join(path, "_delta_log")))


def writer_on(table: DeltaTable, **kwargs) -> GroupCommitWriter:
    return GroupCommitWriter(
        table, arrow_schema(OP), name=OP.path, clock=lambda: STORE_MS, compact_every=None, **kwargs
    )


def test_the_writer_trims_up_to_the_newest_checkpoint_at_or_before_the_floor(warehouse):
    writer = writer_on(
        open_or_create(warehouse, OP, configuration=EVERY_5),
        log_cleanup_every=20,
        log_floor=lambda: 12,
    )
    for o in range(20):
        writer.submit(op_rows([o])).result()
    writer.close()
    path = table_path(warehouse, OP)
    left = entries(path)
    # checkpoints at 4, 9, 14, 19: the newest one at or before 12 is 9
    assert writer.upkeep.trimmed_entries > 0
    assert "00000000000000000008.json" not in left
    assert "00000000000000000004.checkpoint.parquet" not in left
    assert {
        "00000000000000000009.json",
        "00000000000000000009.checkpoint.parquet",
        "00000000000000000012.json",
        "00000000000000000020.json",
    } <= set(left)
    table = DeltaTable(path)
    assert sorted(table.to_pyarrow_table()["op_offset"].to_pylist()) == list(range(20))
    feed = pa.table(table.load_cdf(starting_version=12)).to_pylist()  # the job reads on
    assert sorted(r["op_offset"] for r in feed) == list(range(11, 20))


def test_nothing_is_trimmed_before_the_job_has_run(warehouse):
    assert job_cursor(warehouse, HALF) is None
    writer = writer_on(
        open_or_create(warehouse, OP, configuration=EVERY_5),
        log_cleanup_every=10,
        log_floor=lambda: job_cursor(warehouse, OP),
    )
    for o in range(10):
        writer.submit(op_rows([o])).result()
    writer.close()
    assert writer.upkeep.log_cleanups == 1 and writer.upkeep.trimmed_entries == 0
    assert "00000000000000000000.json" in entries(table_path(warehouse, OP))


def test_a_writer_left_behind_while_another_committed_and_trimmed_commits_on(warehouse):
    idle = writer_on(open_or_create(warehouse, OP, configuration=EVERY_5), log_cleanup_every=None)
    assert idle.submit(op_rows([0])).result() == 1
    busy = writer_on(
        DeltaTable(table_path(warehouse, OP)), log_cleanup_every=12, log_floor=lambda: 10**9
    )
    for o in range(1, 13):
        busy.submit(op_rows([o])).result()
    busy.close()
    assert "00000000000000000001.json" not in entries(table_path(warehouse, OP))
    # The idle handle stands at version 1, whose commit is gone from the log.
    assert idle.submit(op_rows([13])).result() == 14
    idle.close()
    assert sorted(
        DeltaTable(table_path(warehouse, OP)).to_pyarrow_table()["op_offset"].to_pylist()
    ) == list(range(14))


class CommitAll(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT_MESSAGE


def test_the_job_reads_on_and_verifies_after_producers_trimmed_behind_its_cursor(spark, warehouse):
    for table in (HALF, OP):
        open_or_create(warehouse, table, configuration=EVERY_5)
    broker = Broker.open(warehouse)
    # Two processes' OPs for one message, committed out of op_offset order:
    # the ROLLBACK (higher offset) first, then the COMMIT. The job takes the
    # first in commit order; once the log no longer dates them, verify must
    # follow the job's pick, not the op_offset order.
    x = fx.half(1, store_ms=broker.clock(), topic="T")
    fx.write_halves(warehouse, x)
    fx.write_ops(warehouse, fx.op(x, "ROLLBACK", op_offset=2_000))
    fx.write_ops(warehouse, fx.op(x, "COMMIT", op_offset=1_000))
    producer = TransactionProducer(broker, "g", CommitAll())

    def send(n: int) -> None:
        for i in range(n):
            producer.send_message_in_transaction(Message(topic="T", body=b"%d" % i))

    send(12)
    cfg = {"warehouse": warehouse}
    now = broker.clock() + 1000
    first = reconcile(spark, cfg, now_ms=now)
    assert (first.committed, first.rolled_back, first.conflicting_ops) == (12, 1, 1)
    # The first run read from version 0 and is the latest: nothing may go yet.
    assert job_cursor(warehouse, HALF) == 0
    assert maintain(broker, purge=False, vacuum=False).trimmed_log_entries == 0
    reconcile(spark, cfg, now_ms=now)  # the next run starts after what the first read
    assert job_cursor(warehouse, HALF) == first.half_version + 1
    assert job_cursor(warehouse, OP) == first.op_version + 1
    assert maintain(broker, purge=False, vacuum=False).trimmed_log_entries > 0
    assert "00000000000000000000.json" not in entries(table_path(warehouse, HALF))
    assert "00000000000000000002.json" not in entries(table_path(warehouse, OP))  # x's OPs

    send(3)
    assert reconcile(spark, cfg, now_ms=now + 1).committed == 3
    offsets = DeltaTable(topic_path(warehouse, "T")).to_pyarrow_table()["queue_offset"]
    assert sorted(offsets.to_pylist()) == list(range(15))
    report = verify(spark, cfg)
    assert report.ok, report.render()
    producer.close()
    broker.close()
