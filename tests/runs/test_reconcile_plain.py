"""Plain messages (docs/protocol.md §3.1, "Plain messages and batches"; §4.3)
through the real broker core and the real job: delivered once, with dense
offsets, in commit order among the transactional ones of their queue, and
audited by `verify`; and a warehouse an earlier release made, without
`_sys/half.message_type`, read as it is, migrated by a broker and run on."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from jobs.held import Held
from jobs.reconcile import reconcile
from jobs.verify import verify
from schemas import HALF, OP, RESOLVED, table_path, topic_path
from schemas.arrow import arrow_schema
from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    Producer,
    TransactionListener,
    TransactionProducer,
)
from txn_core.tables import PRODUCER_TABLE_CONFIG

import factories as fx

COMMIT = LocalTransactionState.COMMIT_MESSAGE
ROLLBACK = LocalTransactionState.ROLLBACK_MESSAGE
UNKNOWN = LocalTransactionState.UNKNOWN


class Decides(TransactionListener):
    """The local transaction's outcome is the `arg` of the send."""

    def execute_local_transaction(self, msg, arg):
        return arg

    def check_local_transaction(self, msg):
        return UNKNOWN


def _queue(warehouse: str, topic: str = "ORDER") -> dict[int, list[tuple[bytes, int]]]:
    """(body, queue_offset) per queue, in queue order."""
    out: dict[int, list[tuple[bytes, int]]] = {}
    rows = DeltaTable(topic_path(warehouse, topic)).to_pyarrow_table().to_pylist()
    for r in sorted(rows, key=lambda r: (r["queue_id"], r["queue_offset"])):
        out.setdefault(r["queue_id"], []).append((r["body"], r["queue_offset"]))
    return out


def _now() -> int:
    return time.time_ns() // 1_000_000


@pytest.mark.parametrize("passes", ["a small run's", "a big run's"])
def test_plain_and_transactional_sends_are_delivered_once_in_commit_order(
    spark, warehouse, monkeypatch, passes
):
    """The same queues whether a run places its deliveries in their one
    collect (a small run) or beforehand, beside the queues' count (a big
    one, `jobs.pipeline`)."""
    placed_early = []
    if passes == "a big run's":
        monkeypatch.setattr("jobs.interpreted.INTERPRETED_MAX_ROWS", -1)
        soon = Held.checkpoint_soon
        monkeypatch.setattr(
            Held, "checkpoint_soon", lambda held, df: placed_early.append(1) or soon(held, df)
        )
    cfg = {"warehouse": warehouse}
    with Broker.open(warehouse) as broker:
        plain = Producer(broker, "order_group")
        txn = TransactionProducer(broker, "order_group", Decides())
        # one thread, one after the other: the order a consumer must see
        plain.send(Message(topic="ORDER", body=b"a"))
        txn.send_message_in_transaction(Message(topic="ORDER", body=b"b"), COMMIT)
        plain.send_batch([Message(topic="ORDER", body=b"c1"), Message(topic="ORDER", body=b"c2")])
        txn.send_message_in_transaction(Message(topic="ORDER", body=b"rolled back"), ROLLBACK)
        waiting = txn.send_message_in_transaction(Message(topic="ORDER", body=b"e"), UNKNOWN)
        plain.send(Message(topic="ORDER", body=b"f", queue_id=1))
        txn.send_message_in_transaction(Message(topic="ORDER", body=b"g"), COMMIT)

        first = reconcile(spark, cfg, now_ms=_now())

        plain.send(Message(topic="ORDER", body=b"h"))
        broker.resolve(waiting.transaction_id, commit=True)  # committed after h was stored

    assert (first.committed, first.rolled_back, first.pending_after) == (6, 1, 1)
    assert first.delivered_by_topic == {"ORDER": 6}
    second = reconcile(spark, cfg, now_ms=_now())
    again = reconcile(spark, cfg, now_ms=_now())

    assert (second.half_read, second.committed, second.pending_after) == (1, 2, 0)
    assert (again.half_read, again.committed) == (0, 0)
    assert _queue(warehouse) == {
        0: [(b"a", 0), (b"b", 1), (b"c1", 2), (b"c2", 3), (b"g", 4), (b"h", 5), (b"e", 6)],
        1: [(b"f", 0)],
    }
    resolved = DeltaTable(table_path(warehouse, RESOLVED)).to_pyarrow_table().to_pylist()
    assert sorted(r["source"] for r in resolved) == ["ADMIN"] + ["NORMAL"] * 5 + ["PRODUCER"] * 3
    report = verify(spark, cfg)
    assert report.ok, report.render()
    assert (report.counts["delivered"], report.counts["plain"]) == (8, 5)
    assert len(placed_early) == (2 if passes == "a big run's" else 0)  # the runs delivering


def test_an_old_warehouse_runs_as_it_is_then_a_broker_migrates_it(spark, warehouse, monkeypatch):
    """`_sys/half` as an earlier release made it: the job reads it without
    the column (also through the change data feed); the first broker to
    open it adds the column; old and new rows then run and verify alike."""
    from jobs import appends

    old_half = pa.schema(
        [f for f in arrow_schema(HALF) if f.name not in ("message_type", "deliver_at_ms")]
    )
    old = fx.half(store_ms=1_000)
    for table, schema, rows in ((HALF, old_half, [old]), (OP, arrow_schema(OP), [fx.op(old)])):
        path = table_path(warehouse, table)
        DeltaTable.create(path, schema, configuration=PRODUCER_TABLE_CONFIG)
        rows = [
            {k: list(v.items()) if isinstance(v, dict) else v for k, v in r.items()} for r in rows
        ]
        write_deltalake(path, pa.Table.from_pylist(rows, schema=schema), mode="append")
    with monkeypatch.context() as m:
        m.setattr(appends, "appended_files", lambda *args: None)  # the change data feed
        first = reconcile(spark, {"warehouse": warehouse}, now_ms=2_000)
    assert (first.committed, first.rejected_halves) == (1, 0)
    assert "message_type" not in DeltaTable(table_path(warehouse, HALF)).schema().to_arrow().names

    with Broker.open(warehouse) as broker:
        Producer(broker, "order_group").send(Message(topic="ORDER", body=b"plain"))
        TransactionProducer(broker, "order_group", Decides()).send_message_in_transaction(
            Message(topic="ORDER", body=b"txn"), COMMIT
        )
    second = reconcile(spark, {"warehouse": warehouse}, now_ms=_now())

    assert (second.half_read, second.committed) == (2, 2)
    assert _queue(warehouse) == {0: [(old["body"], 0), (b"plain", 1), (b"txn", 2)]}
    report = verify(spark, {"warehouse": warehouse})
    assert report.ok, report.render()
    assert report.counts["plain"] == 1
