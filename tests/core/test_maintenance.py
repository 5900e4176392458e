"""Producer-side table health: compaction, checkpoints, and the retention purge (I5)."""

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from schemas import RESOLVED
from schemas.arrow import arrow_schema
from schemas.tables import CANCELLED
from txn_core import (
    Broker,
    Config,
    LocalTransactionState,
    Message,
    Producer,
    TransactionListener,
    TransactionProducer,
)
from txn_core.maintenance import maintain
from txn_core.tables import open_or_create

HOUR = 3_600_000


class Decide(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return arg

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOWN


class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


def _mark_resolved(warehouse, results):
    """Stand-in for the job's `_sys/resolved` rows (the job writes them in production)."""
    rows = [
        {
            "half_offset": r.half_offset,
            "transaction_id": r.transaction_id,
            "producer_group": "g",
            "topic": "T",
            "action": "COMMIT",
            "source": "PRODUCER",
            "op_offset": 0,
            "op_version": 0,
            "op_store_ms": 0,
            "after_discard": False,
            "run_id": "run-1",
        }
        for r in results
    ]
    table = open_or_create(warehouse, RESOLVED, configuration={})
    write_deltalake(
        table,
        pa.Table.from_pylist(
            [{**{c: None for c in arrow_schema(RESOLVED).names}, **row} for row in rows],
            schema=arrow_schema(RESOLVED),
        ),
        mode="append",
    )


def _half_offsets(warehouse: str, table: str) -> set[int]:
    """The half offsets left in `_sys/<table>` (half or op)."""
    rows = DeltaTable(f"{warehouse}/_sys/{table}").to_pyarrow_table(columns=["half_offset"])
    return set(rows["half_offset"].to_pylist())


def test_purge_deletes_only_resolved_messages_older_than_retention(warehouse):
    clock = Clock(1_000 * HOUR)
    config = Config(warehouse=warehouse, reserved_hours=72)
    with Broker.open(warehouse, config=config, clock=clock) as broker:
        producer = TransactionProducer(broker, "g", Decide())
        commit = LocalTransactionState.COMMIT_MESSAGE
        old_resolved = producer.send_message_in_transaction(Message(topic="T", body=b"a"), commit)
        old_pending = producer.send_message_in_transaction(Message(topic="T", body=b"b"), None)
        clock.now += 72 * HOUR  # exactly at the window's edge: kept
        edge = producer.send_message_in_transaction(Message(topic="T", body=b"c"), commit)
        clock.now += 1
        _mark_resolved(warehouse, [old_resolved, edge])
        report = maintain(broker, now_ms=clock.now + 72 * HOUR - 1)
    assert (report.purged_halves, report.purged_ops) == (1, 1)
    assert _half_offsets(warehouse, "half") == {old_pending.half_offset, edge.half_offset}
    assert _half_offsets(warehouse, "op") == {edge.half_offset}


def _mark_cancelled(warehouse, results, due_ms):
    """Stand-in for the job's `_sys/cancelled` rows."""
    schema = arrow_schema(CANCELLED)
    rows = [
        {
            **{c: None for c in schema.names},
            "half_offset": r.half_offset,
            "due_ms": due,
            "transaction_id": r.msg_id,
            "producer_group": "g",
            "topic": "T",
            "queue_id": 0,
            "op_offset": 0,
            "op_version": 0,
            "op_store_ms": 0,
            "run_id": "run-1",
            "run_number": 1,
        }
        for r, due in zip(results, due_ms, strict=True)
    ]
    table = open_or_create(warehouse, CANCELLED, configuration={})
    write_deltalake(table, pa.Table.from_pylist(rows, schema=schema), mode="append")


def test_purge_deletes_cancelled_plain_messages_once_due_and_old(warehouse):
    """A cancelled plain message is never delivered, so never resolved: its
    cancel finishes it once its due time too is before the window; a
    cancelled transactional one waits for its decision."""
    clock = Clock(1_000 * HOUR)
    config = Config(warehouse=warehouse, reserved_hours=72)
    with Broker.open(warehouse, config=config, clock=clock) as broker:
        plain = Producer(broker, "g")
        txn = TransactionProducer(broker, "g", Decide())
        due_soon = plain.send(Message(topic="T", body=b"a", delay_ms=HOUR))
        due_late = plain.send(Message(topic="T", body=b"b", delay_ms=48 * HOUR))
        pending = txn.send_message_in_transaction(
            Message(topic="T", body=b"c", delay_ms=HOUR), None
        )
        sent = [due_soon, due_late, pending]
        for r in sent:
            broker.cancel(r.msg_id)
        _mark_cancelled(
            warehouse, sent, [clock.now + HOUR, clock.now + 48 * HOUR, clock.now + HOUR]
        )
        report = maintain(broker, now_ms=clock.now + 74 * HOUR)
    assert (report.purged_halves, report.purged_ops) == (1, 1)
    kept = {due_late.half_offset, pending.half_offset}
    assert _half_offsets(warehouse, "half") == _half_offsets(warehouse, "op") == kept


def test_compaction_and_checkpoint_leave_rows_and_change_feed_intact(warehouse):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Decide())
        for i in range(12):
            producer.send_message_in_transaction(
                Message(topic="T", body=bytes([i])), LocalTransactionState.COMMIT_MESSAGE
            )
        half = DeltaTable(f"{warehouse}/_sys/half")
        before_files, before_version = len(half.file_uris()), half.version()
        report = maintain(broker)
    half = DeltaTable(f"{warehouse}/_sys/half")
    assert before_files == 12 and len(half.file_uris()) == 1
    assert report.compacted_files["_sys/half"] == 12
    assert half.to_pyarrow_table().num_rows == 12
    # the rewrite is not data: the change feed over it holds no new inserts
    changes = pa.table(half.load_cdf(starting_version=before_version + 1))
    assert changes.num_rows == 0


def test_group_commit_writer_compacts_its_small_files_without_new_data(warehouse):
    """The writer's upkeep compacts every COMPACT_EVERY small commits: a
    long-running producer's table does not pile up small files."""
    from txn_core import writer_upkeep

    with Broker.open(warehouse) as broker:
        broker._half.upkeep.compact_every = 5  # the default is 256: keep the test small
        producer = TransactionProducer(broker, "g", Decide())
        sent = [
            producer.send_message_in_transaction(
                Message(topic="T", body=bytes([i])), LocalTransactionState.COMMIT_MESSAGE
            )
            for i in range(12)
        ]
    # closed: the upkeep due by then is done (it runs beside the writer, so
    # a compaction may also take in commits made while it ran)
    assert writer_upkeep.COMPACT_EVERY == 256 and broker._half.upkeep.compactions == 2
    half = DeltaTable(f"{warehouse}/_sys/half")
    assert len(half.file_uris()) <= 3  # one compacted file, then at most 2 commits after it
    changes = pa.table(half.load_cdf(starting_version=0)).to_pylist()
    inserted = [c["half_offset"] for c in changes if c["_change_type"] == "insert"]
    assert sorted(inserted) == sorted(r.half_offset for r in sent)
    assert sorted(half.to_pyarrow_table()["half_offset"].to_pylist()) == sorted(
        r.half_offset for r in sent
    )


def test_purge_keeps_a_committed_delayed_message_until_its_time_is_old_too(warehouse):
    """A delayed transactional message committed early is resolved when the
    job schedules it: purged then, a cancel before its time found no half
    row (LookupError) although the message was still to be delivered."""
    clock = Clock(1_000 * HOUR)
    config = Config(warehouse=warehouse, reserved_hours=24)
    with Broker.open(warehouse, config=config, clock=clock) as broker:
        txn = TransactionProducer(broker, "g", Decide())
        commit = LocalTransactionState.COMMIT_MESSAGE
        later = txn.send_message_in_transaction(
            Message(topic="T", body=b"a", delay_ms=48 * HOUR), commit
        )
        sooner = txn.send_message_in_transaction(
            Message(topic="T", body=b"b", delay_ms=2 * HOUR), commit
        )
        _mark_resolved(warehouse, [later, sooner])
        report = maintain(broker, now_ms=clock.now + 27 * HOUR)
        assert (report.purged_halves, report.purged_ops) == (1, 1)  # `sooner`: due 25 h ago
        assert _half_offsets(warehouse, "half") == {later.half_offset}
        broker.cancel(later.msg_id)  # still cancellable before its time
        report = maintain(broker, now_ms=clock.now + 73 * HOUR)  # due 25 h ago now
    assert report.purged_halves == 1 and _half_offsets(warehouse, "half") == set()
