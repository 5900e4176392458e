"""Broker core semantics, docs/protocol.md §3.1, items 1–8."""

import os
import shutil
import threading

import pytest
from deltalake import DeltaTable

from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    MessageValidationError,
    NoListenerError,
    PersistError,
    TransactionListener,
    TransactionProducer,
)

COMMIT = LocalTransactionState.COMMIT_MESSAGE
ROLLBACK = LocalTransactionState.ROLLBACK_MESSAGE
UNKNOWN = LocalTransactionState.UNKNOWN


class Scripted(TransactionListener):
    """Returns (or raises) what `arg` says; records every call."""

    def __init__(self):
        self.executed = []
        self.checked = []

    def execute_local_transaction(self, msg, arg):
        self.executed.append(msg)
        if isinstance(arg, BaseException):
            raise arg
        return arg() if callable(arg) else arg

    def check_local_transaction(self, msg):
        self.checked.append(msg)
        return COMMIT


def rows(warehouse, path):
    return DeltaTable(f"{warehouse}/{path}").to_pyarrow_table().to_pylist()


def version(warehouse, path):
    return DeltaTable(f"{warehouse}/{path}").version()


@pytest.fixture
def broker(warehouse):
    b = Broker.open(warehouse)
    yield b
    b.close()


@pytest.fixture
def listener():
    return Scripted()


@pytest.fixture
def producer(broker, listener):
    return TransactionProducer(broker, "order_group", listener)


def test_open_creates_missing_tables(warehouse):
    with Broker.open(warehouse):
        for path in ("_sys/half", "_sys/op", "_sys/check_answers"):
            assert DeltaTable(f"{warehouse}/{path}").version() == 0


def test_no_listener_is_refused_before_anything_is_written(broker, warehouse):
    producer = TransactionProducer(broker, "order_group")
    with pytest.raises(NoListenerError, match="order_group"):
        producer.send_message_in_transaction(Message(topic="ORDER", body=b"x"))
    assert rows(warehouse, "_sys/half") == []


def test_commit_writes_half_then_producer_op(producer, listener, warehouse):
    msg = Message(
        topic="ORDER",
        body=b"\x00body\xff",
        keys="order-42",
        tags="created",
        properties={"k": "v"},
        queue_id=3,
        check_immunity_s=60,
    )
    result = producer.send_message_in_transaction(msg, arg=COMMIT)
    assert result.local_state is COMMIT and result.op_written and result.error is None
    [half] = rows(warehouse, "_sys/half")
    assert half["half_offset"] == result.half_offset
    assert half["transaction_id"] == result.transaction_id
    assert (
        half["topic"],
        half["body"],
        half["keys"],
        half["tags"],
        half["queue_id"],
        half["check_immunity_s"],
        dict(half["properties"]),
    ) == ("ORDER", b"\x00body\xff", "order-42", "created", 3, 60, {"k": "v"})
    assert half["store_ms"] >= half["born_ms"]
    [op] = rows(warehouse, "_sys/op")
    assert (
        op["half_offset"],
        op["transaction_id"],
        op["producer_group"],
        op["action"],
        op["source"],
    ) == (result.half_offset, result.transaction_id, "order_group", "COMMIT", "PRODUCER")
    # the listener saw the stored message, ids filled in, as RocketMQ sets transactionId
    assert listener.executed[0].transaction_id == result.transaction_id


def test_rollback_writes_a_rollback_op(producer, warehouse):
    result = producer.send_message_in_transaction(Message(topic="ORDER", body=b"x"), ROLLBACK)
    [op] = rows(warehouse, "_sys/op")
    assert op["action"] == "ROLLBACK" and result.op_written


@pytest.mark.parametrize("arg", [UNKNOWN, None, RuntimeError("db down"), "maybe"])
def test_unknown_none_exception_or_garbage_write_no_op(producer, warehouse, arg):
    result = producer.send_message_in_transaction(Message(topic="ORDER", body=b"x"), arg)
    assert result.local_state is UNKNOWN and not result.op_written
    assert len(rows(warehouse, "_sys/half")) == 1
    assert rows(warehouse, "_sys/op") == []
    if isinstance(arg, BaseException):
        assert result.error is arg
    if arg == "maybe":
        assert isinstance(result.error, TypeError)


def _break_table(warehouse, path):
    """Make the table's log unwritable: its _delta_log becomes a plain file.

    (chmod does not stop root, which CI runs as.)
    """
    log_dir = os.path.join(warehouse, path, "_delta_log")
    shutil.move(log_dir, log_dir + ".saved")
    with open(log_dir, "w") as fh:
        fh.write("not a directory")


def test_half_persist_failure_raises_and_skips_local_transaction(producer, listener, warehouse):
    _break_table(warehouse, "_sys/half")
    with pytest.raises(PersistError, match="_sys/half"):
        producer.send_message_in_transaction(Message(topic="ORDER", body=b"x"), COMMIT)
    assert listener.executed == []


def test_op_persist_failure_is_reported_not_raised(producer, warehouse):
    def commit_after_breaking_op_table():
        _break_table(warehouse, "_sys/op")
        return COMMIT

    result = producer.send_message_in_transaction(
        Message(topic="ORDER", body=b"x"), commit_after_breaking_op_table
    )
    assert result.local_state is COMMIT
    assert result.op_written is False and isinstance(result.op_error, PersistError)
    assert len(rows(warehouse, "_sys/half")) == 1  # the back-check will settle it


def test_delay_level_is_cleared_for_a_single_send(producer, listener):
    result = producer.send_message_in_transaction(
        Message(topic="ORDER", body=b"x", delay_level=3), COMMIT
    )
    assert result.op_written and listener.executed[0].delay_level == 0


def test_batch_is_one_half_commit_one_decision_one_op_commit(producer, listener, warehouse):
    half_v, op_v = version(warehouse, "_sys/half"), version(warehouse, "_sys/op")
    batch = [Message(topic="ORDER", body=f"m{i}".encode(), keys=f"k{i}") for i in range(5)]
    result = producer.send_batch_in_transaction(batch, COMMIT)
    assert version(warehouse, "_sys/half") == half_v + 1
    assert version(warehouse, "_sys/op") == op_v + 1
    assert len(listener.executed) == 1 and len(listener.executed[0]) == 5
    assert len(set(result.half_offsets)) == 5 and len(set(result.transaction_ids)) == 5
    ops = rows(warehouse, "_sys/op")
    assert sorted(o["half_offset"] for o in ops) == sorted(result.half_offsets)
    assert {o["transaction_id"] for o in ops} == set(result.transaction_ids)


@pytest.mark.parametrize(
    "batch, field",
    [
        ([], "messages"),
        ([Message(topic="A", body=b"x"), Message(topic="B", body=b"x")], "messages"),
        (
            [Message(topic="A", body=b"x"), Message(topic="A", body=b"x", delay_level=2)],
            "messages[1].delay_level",
        ),
        ([Message(topic="A", body=b"x"), Message(topic="A", body=b"")], "messages[1].body"),
    ],
)
def test_batch_rules(producer, warehouse, batch, field):
    with pytest.raises(MessageValidationError) as err:
        producer.send_batch_in_transaction(batch, COMMIT)
    assert err.value.field == field
    assert rows(warehouse, "_sys/half") == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(topic=""), "topic"),
        (dict(topic="T" * 128), "topic"),
        (dict(topic="bad topic!"), "topic"),
        (dict(topic="_sys_half"), "topic"),
        (dict(topic="RMQ_SYS_TRANS_HALF_TOPIC"), "topic"),
        (dict(topic="TBW102"), "topic"),
        (dict(topic=42), "topic"),
        (dict(body=None), "body"),
        (dict(body=b""), "body"),
        (dict(body="text"), "body"),
        (dict(body=b"x" * 1025), "body"),
        (dict(keys=7), "keys"),
        (dict(tags=b"t"), "tags"),
        (dict(queue_id=-1), "queue_id"),
        (dict(queue_id=True), "queue_id"),
        (dict(check_immunity_s="60"), "check_immunity_s"),
        (dict(properties=["k", "v"]), "properties"),
        (dict(properties={"": "v"}), "properties"),
        (dict(properties={"k": 1}), "properties['k']"),
        (dict(properties={"k": "a\x01b"}), "properties['k']"),
    ],
)
def test_bad_message_names_the_field_and_writes_nothing(warehouse, kwargs, field):
    from txn_core import Config

    with Broker.open(warehouse, config=Config(warehouse=warehouse, max_body_bytes=1024)) as b:
        producer = TransactionProducer(b, "order_group", Scripted())
        fields = dict(topic="ORDER", body=b"x")
        fields.update(kwargs)
        with pytest.raises(MessageValidationError) as err:
            producer.send_message_in_transaction(Message(**fields), COMMIT)
        assert err.value.field == field
        assert isinstance(err.value, ValueError)
    assert rows(warehouse, "_sys/half") == [] and rows(warehouse, "_sys/op") == []


@pytest.mark.parametrize("group", ["", "g" * 256, "bad group", "CID_RMQ_SYS_TRANS", None])
def test_bad_group_is_refused(broker, group):
    with pytest.raises(MessageValidationError) as err:
        TransactionProducer(broker, group, Scripted())
    assert err.value.field == "producer_group"


def test_concurrent_sends_share_commits(broker, warehouse):
    producer = TransactionProducer(broker, "order_group", Scripted())
    results, start = [], threading.Barrier(32)

    def send():
        start.wait()
        for _ in range(5):
            results.append(
                producer.send_message_in_transaction(Message(topic="ORDER", body=b"x"), COMMIT)
            )

    threads = [threading.Thread(target=send) for _ in range(32)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(results) == 160 and all(r.op_written for r in results)
    assert len({r.half_offset for r in results}) == 160
    counts = broker.commit_counts
    # group commit: far fewer commits than rows, for halves and OPs alike
    assert counts["_sys/half"] < 160 / 2 and counts["_sys/op"] < 160 / 2
    stats = broker.writer_stats
    assert [(stats[t].commits, stats[t].rows) for t in ("_sys/half", "_sys/op")] == [
        (counts["_sys/half"], 160),
        (counts["_sys/op"], 160),
    ]
    assert len(rows(warehouse, "_sys/half")) == 160 and len(rows(warehouse, "_sys/op")) == 160


def test_resolve_writes_an_admin_op(producer, broker, warehouse):
    result = producer.send_message_in_transaction(Message(topic="ORDER", body=b"x"), UNKNOWN)
    offset = broker.resolve(result.transaction_id, commit=False, remark="ops ticket 42")
    [op] = rows(warehouse, "_sys/op")
    assert (
        op["op_offset"],
        op["source"],
        op["action"],
        op["remark"],
        op["half_offset"],
        op["producer_group"],
    ) == (offset, "ADMIN", "ROLLBACK", "ops ticket 42", result.half_offset, "order_group")
    with pytest.raises(LookupError, match="no-such-id"):
        broker.resolve("no-such-id", commit=True)


def test_closed_broker_refuses_sends(warehouse):
    from txn_core import BrokerClosedError

    b = Broker.open(warehouse)
    producer = TransactionProducer(b, "order_group", Scripted())
    b.close()
    with pytest.raises(BrokerClosedError):
        producer.send_message_in_transaction(Message(topic="ORDER", body=b"x"), COMMIT)


def test_unique_columns_are_written_without_a_dictionary(producer, warehouse):
    """Offsets and ids are unique: a dictionary for them is built only to be
    dropped (txn_core.group_commit.plain_encoding). Repeated values keep theirs."""
    import pyarrow.parquet as pq

    producer.send_batch_in_transaction(
        [Message(topic="ORDER", body=b"same", keys="k") for _ in range(50)], COMMIT
    )

    def encodings(path: str) -> dict[str, set[str]]:
        table = DeltaTable(os.path.join(warehouse, path))
        meta = pq.ParquetFile(table.file_uris()[0].removeprefix("file://")).metadata
        group = meta.row_group(0)
        return {
            group.column(i).path_in_schema: set(group.column(i).encodings)
            for i in range(group.num_columns)
        }

    def dictionary(encs: set[str]) -> bool:
        return bool(encs & {"PLAIN_DICTIONARY", "RLE_DICTIONARY"})

    half, op = encodings("_sys/half"), encodings("_sys/op")
    assert not any(dictionary(half[c]) for c in ("half_offset", "transaction_id", "msg_id"))
    assert not any(dictionary(op[c]) for c in ("op_offset", "half_offset", "transaction_id"))
    assert dictionary(half["topic"]) and dictionary(half["body"]) and dictionary(op["action"])
