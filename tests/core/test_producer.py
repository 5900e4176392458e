"""Broker core semantics, docs/protocol.md §3.1, items 1–10."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest
from deltalake import DeltaTable

from txn_core import (
    Broker,
    BrokerClosedError,
    Config,
    ConfigError,
    Consumer,
    LocalTransactionState,
    Message,
    MessageValidationError,
    NoListenerError,
    PersistError,
    Producer,
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


def full_message() -> Message:
    """A message with every field set."""
    return Message(
        topic="ORDER",
        body=b"\x00body\xff",
        keys="order-42",
        tags="created",
        properties={"k": "v"},
        queue_id=3,
        check_immunity_s=60,
    )


def test_commit_writes_half_then_producer_op(producer, listener, warehouse):
    msg = full_message()
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


def test_a_single_transactional_send_keeps_its_delay_level(producer, listener, warehouse):
    result = producer.send_message_in_transaction(
        Message(topic="ORDER", body=b"x", delay_level=3), COMMIT
    )
    assert result.op_written and listener.executed[0].delay_level == 3
    (half,) = rows(warehouse, "_sys/half")
    assert half["deliver_at_ms"] == half["store_ms"] + 10_000  # level 3: 10 s


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
        (dict(topic="ORDER\n"), "topic"),  # a regex's `$` matches before a final newline
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
        # lone surrogates (`surrogateescape`): UTF-8 cannot encode them, and the
        # group commit failed on them with every other sender's rows
        (dict(keys="order-\udcff"), "keys"),
        (dict(tags="\ud800"), "tags"),
        (dict(properties={"k": "v\udcff"}), "properties['k']"),
        (dict(properties={"k\udcff": "v"}), "properties['k\\udcff']"),
        # RocketMQ's 32,767 bytes of keys, tags and properties (a 50 MiB property was stored)
        (dict(keys="k" * 32_768), "keys"),
        (dict(keys="k" * 20_000, tags="t" * 12_768), "keys"),
        (dict(properties={"p": "\u00e9" * 16_384}), "properties"),
    ],
)
def test_bad_message_names_the_field_and_writes_nothing(warehouse, kwargs, field):
    with Broker.open(warehouse, config=Config(warehouse=warehouse, max_body_bytes=1024)) as b:
        producer = TransactionProducer(b, "order_group", Scripted())
        fields = dict(topic="ORDER", body=b"x")
        fields.update(kwargs)
        with pytest.raises(MessageValidationError) as err:
            producer.send_message_in_transaction(Message(**fields), COMMIT)
        assert err.value.field == field
        assert isinstance(err.value, ValueError)
    assert rows(warehouse, "_sys/half") == [] and rows(warehouse, "_sys/op") == []


def test_a_warehouse_that_cannot_be_created_is_a_persist_error_naming_the_table(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    where = str(tmp_path / "file" / "warehouse")
    for opening in (lambda: Broker.open(where), lambda: Consumer(where, "billing", "ORDER").poll()):
        with pytest.raises(PersistError, match=r"could not create .*/warehouse/_sys/\w+: "):
            opening()


@pytest.mark.parametrize("cls", [Producer, TransactionProducer])
def test_a_producer_of_something_else_than_a_broker_is_refused(warehouse, cls):
    # a warehouse path passed for the broker failed only at the first send
    with pytest.raises(
        ConfigError, match=r"broker must be a Broker \(Broker.open\(warehouse\)\), got str"
    ):
        cls(warehouse, "order_group")


@pytest.mark.parametrize(
    "group", ["", "g" * 256, "bad group", "order_group\n", "CID_RMQ_SYS_TRANS", None]
)
def test_bad_group_is_refused(broker, group):
    with pytest.raises(MessageValidationError) as err:
        TransactionProducer(broker, group, Scripted())
    assert err.value.field == "producer_group"


@pytest.mark.parametrize("plain", [False, True], ids=["transactional", "plain"])
def test_concurrent_sends_share_commits(broker, warehouse, plain):
    producer = TransactionProducer(broker, "order_group", Scripted())
    results, start = [], threading.Barrier(32)

    def send():
        start.wait()
        for _ in range(5):
            msg = Message(topic="ORDER", body=b"x")
            results.append(
                producer.send(msg) if plain else producer.send_message_in_transaction(msg, COMMIT)
            )

    threads = [threading.Thread(target=send) for _ in range(32)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(results) == 160 and all(plain or r.op_written for r in results)
    assert len({r.half_offset for r in results}) == 160
    counts = broker.commit_counts
    ops = 0 if plain else 160  # a plain message needs no OP
    # group commit: far fewer commits than rows, for halves and OPs alike
    assert 0 < counts["_sys/half"] < 160 / 2 and counts["_sys/op"] < max(ops / 2, 1)
    stats = broker.writer_stats
    assert [(stats[t].commits, stats[t].rows) for t in ("_sys/half", "_sys/op")] == [
        (counts["_sys/half"], 160),
        (counts["_sys/op"], ops),
    ]
    assert len(rows(warehouse, "_sys/half")) == 160 and len(rows(warehouse, "_sys/op")) == ops


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


UNWRITABLE = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    from txn_core import Broker, Consumer, Message, Producer

    warehouse, seen = sys.argv[1], {}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with Broker.open(warehouse) as broker:
        producer = Producer(broker, "order_group")
        Consumer(warehouse, "billing", "ORDER", member="first").poll()
        for case, limit, call in [
            ("cut short", 100_000, lambda: producer.send(
                Message(topic="ORDER", body=os.urandom(150_000)))),
            ("broker", 0, lambda: Broker.open(warehouse)),
            ("consumer", 0, lambda: Consumer(warehouse, "billing", "ORDER", member="m").poll()),
        ]:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
            try:
                call()
                seen[case] = "done"
            except Exception as exc:
                seen[case] = f"{type(exc).__name__}: {exc}"
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        producer.send(Message(topic="ORDER", body=b"after"))
    print(json.dumps(seen))
    sys.stdout.flush()
    os._exit(0)  # the interpreter's teardown can abort in pyarrow's threads
    """
)


def test_writes_the_disk_refuses_or_cuts_short_fail_clearly_and_leave_tables_readable(tmp_path):
    """A write may take fewer bytes than given (a disk filling up, a file
    size limit): the rest was dropped, the send acknowledged, and `_sys/half`
    unreadable from then on ("Parquet magic bytes not found"). A warehouse
    a broker or a consumer group cannot write to gave delta-rs' raw error."""
    warehouse = str(tmp_path / "wh")
    done = subprocess.run(
        [sys.executable, "-c", UNWRITABLE, warehouse], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["cut short"].startswith("PersistError: could not append 1 row(s) to _sys/half")
    assert "File too large" in seen["cut short"]
    assert seen["broker"].startswith("PersistError: could not register this broker in ")
    assert "need write access to the warehouse" in seen["broker"]
    assert seen["consumer"].startswith("PersistError: could not write to ")
    assert "_sys/consumer_members" in seen["consumer"]
    assert [r["body"] for r in rows(warehouse, "_sys/half")] == [b"after"]


class JavaStyle:
    def executeLocalTransaction(self, msg, arg):
        return COMMIT

    def checkLocalTransaction(self, msg):
        return COMMIT


class Async(TransactionListener):
    async def execute_local_transaction(self, msg, arg):
        return COMMIT

    def check_local_transaction(self, msg):
        return COMMIT


@pytest.mark.parametrize(
    "listener, problem",
    [
        (lambda msg, arg: COMMIT, "listener function has no execute_local_transaction method"),
        (JavaStyle(), "listener JavaStyle has no execute_local_transaction method"),
        (Scripted, "not the class Scripted itself: pass Scripted()"),
        (Async(), "listener Async.execute_local_transaction is a coroutine function"),
    ],
)
def test_a_listener_that_cannot_run_a_local_transaction_is_refused_up_front(
    broker, warehouse, listener, problem
):
    """Each was taken, and every send stored a half message whose local
    transaction never ran (UNKNOWN, an AttributeError in its result)."""
    with pytest.raises(ConfigError, match=re.escape(problem)):
        TransactionProducer(broker, "order_group", listener)
    assert rows(warehouse, "_sys/half") == []


def test_a_broker_closed_during_the_local_transaction_is_reported_not_raised(
    producer, broker, warehouse
):
    """The OP could not be written because a shutdown closed the broker: the
    call raised BrokerClosedError after the local transaction had committed,
    and the caller lost the transaction id (and might run it again)."""

    def commit_then_shut_down():
        broker.close()
        return COMMIT

    result = producer.send_message_in_transaction(
        Message(topic="ORDER", body=b"x"), commit_then_shut_down
    )
    assert result.local_state is COMMIT and result.transaction_id
    assert result.op_written is False and isinstance(result.op_error, BrokerClosedError)
    assert len(rows(warehouse, "_sys/half")) == 1 and rows(warehouse, "_sys/op") == []


def test_a_closed_producer_refuses_sends_and_leaves_its_broker_open(broker, warehouse):
    msg = Message(topic="ORDER", body=b"x")
    with (
        Producer(broker, "order_group") as plain,
        TransactionProducer(broker, "order_group", Scripted()) as txn,
    ):
        pass
    for call in (
        lambda: plain.send(msg),
        lambda: plain.send_batch([msg]),
        lambda: txn.send_message_in_transaction(msg, COMMIT),
        lambda: txn.send_batch_in_transaction([msg], COMMIT),
        txn.answer_checks,
    ):
        with pytest.raises(BrokerClosedError, match="producer of group 'order_group' is closed"):
            call()
    Producer(broker, "order_group").send(msg)
    assert len(rows(warehouse, "_sys/half")) == 1


def test_a_misspelt_field_of_a_message_raises_instead_of_going_unsent():
    msg = Message(topic="ORDER", body=b"x")
    with pytest.raises(AttributeError, match="'key'"):
        msg.key = "order-42"  # `keys`: it was set on the object, and never sent


def test_keys_tags_and_properties_take_at_most_32767_bytes_together(broker, warehouse):
    producer = Producer(broker, "order_group")
    at_limit = Message(
        topic="ORDER", body=b"x", keys="k" * 767, tags="t" * 1000, properties={"p": "v" * 30_999}
    )
    producer.send(at_limit)
    at_limit.tags += "!"
    with pytest.raises(MessageValidationError, match="32768 together; the limit .* is 32767"):
        producer.send(at_limit)
    assert len(rows(warehouse, "_sys/half")) == 1


def test_a_warehouse_made_again_under_a_running_broker_fails_its_sends(warehouse):
    """Deleted and made again while a broker ran, the warehouse's new log got
    that broker's next commits after a gap (every reader refused the
    table), and both brokers held the same epoch, so the same offsets."""
    old = Broker.open(warehouse)
    producer = Producer(old, "order_group")
    for _ in range(3):
        producer.send(Message(topic="ORDER", body=b"before"))
    shutil.rmtree(warehouse)
    with Broker.open(warehouse) as new:
        Producer(new, "order_group").send(Message(topic="ORDER", body=b"new"))
    with pytest.raises(PersistError, match="deleted or made again while this process had it"):
        producer.send(Message(topic="ORDER", body=b"after"))
    old.close()
    assert [r["body"] for r in rows(warehouse, "_sys/half")] == [b"new"]


def test_closed_broker_refuses_sends(warehouse):
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


# --- plain sends and batches (docs/protocol.md §3.1, "Plain messages and batches") ---


def test_a_plain_send_is_durable_on_return_as_a_normal_half_row_without_an_op(broker, warehouse):
    producer = Producer(broker, "order_group")
    msg = full_message()
    receipt = producer.send(msg)
    # durable: another reader sees it as soon as the call returned
    [half] = rows(warehouse, "_sys/half")
    assert (half["half_offset"], half["msg_id"], half["transaction_id"]) == (
        receipt.half_offset,
        receipt.msg_id,
        receipt.msg_id,
    )
    assert (half["message_type"], half["check_immunity_s"]) == ("NORMAL", None)  # never checked
    assert (half["topic"], half["queue_id"], half["body"], half["keys"], half["tags"]) == (
        "ORDER",
        3,
        b"\x00body\xff",
        "order-42",
        "created",
    )
    assert (receipt.topic, receipt.queue_id, receipt.send_status) == ("ORDER", 3, "SEND_OK")
    assert rows(warehouse, "_sys/op") == []
    assert msg.msg_id is None  # the caller's message is not changed: it may be sent again
    assert producer.send(msg).half_offset != receipt.half_offset
    # a transactional half says what it is too
    TransactionProducer(broker, "order_group", Scripted()).send_message_in_transaction(
        Message(topic="ORDER", body=b"t"), COMMIT
    )
    assert sorted(h["message_type"] for h in rows(warehouse, "_sys/half")) == [
        "NORMAL",
        "NORMAL",
        "TRANSACTION",
    ]


def test_a_plain_batch_is_one_commit_all_or_none(broker, warehouse):
    producer = Producer(broker, "order_group")
    before = version(warehouse, "_sys/half")
    receipt = producer.send_batch(
        [Message(topic="ORDER", body=f"m{i}".encode(), keys=f"k{i}") for i in range(5)]
    )
    assert version(warehouse, "_sys/half") == before + 1 and len(receipt) == 5
    halves = rows(warehouse, "_sys/half")
    assert sorted(h["half_offset"] for h in halves) == sorted(receipt.half_offsets)
    assert [h["msg_id"] for h in sorted(halves, key=lambda h: h["keys"])] == receipt.msg_ids
    assert {h["message_type"] for h in halves} == {"NORMAL"} and receipt.topic == "ORDER"
    # a store that fails stores none of the batch, and says so
    _break_table(warehouse, "_sys/half")
    with pytest.raises(PersistError, match="_sys/half"):
        producer.send_batch([Message(topic="ORDER", body=b"x") for _ in range(3)])
    log_dir = os.path.join(warehouse, "_sys/half", "_delta_log")
    os.remove(log_dir)
    shutil.move(log_dir + ".saved", log_dir)
    assert len(rows(warehouse, "_sys/half")) == 5


@pytest.mark.parametrize(
    "batch, field",
    [
        ([], "messages"),
        (Message(topic="A", body=b"x"), "messages"),
        ([Message(topic="A", body=b"x"), Message(topic="B", body=b"x")], "messages"),
        ([Message(topic="%RETRY%order_group", body=b"x")], "messages[0].topic"),
        ([Message(topic="%DLQ%order_group", body=b"x")], "messages[0].topic"),
        ([Message(topic="_sys_half", body=b"x")], "messages[0].topic"),
        (
            [Message(topic="A", body=b"x"), Message(topic="A", body=b"x", delay_level=2)],
            "messages[1].delay_level",
        ),
        ([Message(topic="A", body=b"x"), Message(topic="A", body=b"")], "messages[1].body"),
        ([Message(topic="A", body=b"x"), "not a message"], "messages[1]"),
        # 1,000 + 25 bytes: over max_batch_bytes = 1,024 by one
        ([Message(topic="A", body=b"x" * 1000), Message(topic="A", body=b"y" * 25)], "messages"),
    ],
)
def test_plain_batch_rules_name_the_field_and_write_nothing(warehouse, batch, field):
    config = Config(warehouse=warehouse, max_batch_bytes=1024)
    with Broker.open(warehouse, config=config) as b:
        with pytest.raises(MessageValidationError) as err:
            Producer(b, "order_group").send_batch(batch)
    assert err.value.field == field and isinstance(err.value, ValueError)
    assert rows(warehouse, "_sys/half") == []


def test_a_batch_counts_bodies_keys_tags_and_properties_up_to_max_batch_bytes(warehouse):
    # bodies 1,000 + 1, keys 10, tags "é" (2 bytes in UTF-8), properties "ab" and
    # "cdefghijk" (11): 1,024
    exact = [
        Message(topic="A", body=b"x" * 1000),
        Message(topic="A", body=b"y", keys="k" * 10, tags="\u00e9", properties={"ab": "cdefghijk"}),
    ]
    config = Config(warehouse=warehouse, max_batch_bytes=1024)
    with Broker.open(warehouse, config=config) as b:
        producer = Producer(b, "order_group")
        assert len(producer.send_batch(exact)) == 2
        exact[1].tags = "\u00e9!"
        with pytest.raises(MessageValidationError, match="1025 bytes.*max_batch_bytes = 1024"):
            producer.send_batch(exact)
        alone = Message(topic="A", body=b"x" * 1025)
        with pytest.raises(MessageValidationError, match="= 1024: send it on its own"):
            producer.send_batch([alone])  # not "in smaller batches": there are none
        # a transactional batch is decided by one local transaction: no total limit
        TransactionProducer(b, "order_group", Scripted()).send_batch_in_transaction(exact, COMMIT)
    assert len(rows(warehouse, "_sys/half")) == 4


def test_a_plain_send_refuses_a_bad_delay_and_bad_fields_before_writing(broker, warehouse):
    producer = Producer(broker, "order_group")
    for msg, field in (
        (Message(topic="ORDER", body=b"x", delay_level=0), "delay_level"),
        (Message(topic="ORDER", body=b""), "body"),
        (Message(topic="RMQ_SYS_TRANS_HALF_TOPIC", body=b"x"), "topic"),
    ):
        with pytest.raises(MessageValidationError) as err:
            producer.send(msg)
        assert err.value.field == field
    assert rows(warehouse, "_sys/half") == []
    with pytest.raises(MessageValidationError) as err:
        Producer(broker, "bad group")
    assert err.value.field == "producer_group"


def test_an_operators_remark_utf8_cannot_encode_is_refused_before_writing(broker, warehouse):
    receipt = Producer(broker, "order_group").send(
        Message(topic="ORDER", body=b"x", delay_ms=60_000)
    )
    with pytest.raises(MessageValidationError, match="remark: holds"):
        broker.cancel(receipt.msg_id, remark="ticket \udcff")
    with pytest.raises(ValueError, match="remark must be a string"):
        broker.cancel(receipt.msg_id, remark=42)
    assert rows(warehouse, "_sys/op") == []
    broker.cancel(receipt.msg_id, remark="ticket é-42")  # any text UTF-8 encodes
    assert [r["remark"] for r in rows(warehouse, "_sys/op")] == ["ticket é-42"]


def test_resolve_refuses_a_plain_message(broker, warehouse):
    receipt = Producer(broker, "order_group").send(Message(topic="ORDER", body=b"x"))
    with pytest.raises(ValueError, match="plain"):
        broker.resolve(receipt.msg_id, commit=False)
    assert rows(warehouse, "_sys/op") == []


def test_an_old_half_table_gains_the_new_column_when_a_broker_opens_it(warehouse):
    """A warehouse an earlier release made has no `message_type`: opening a
    broker adds it (nullable; its rows read it as null), once, however many
    brokers open it, and plain sends work on it."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from schemas import HALF
    from schemas.arrow import arrow_schema
    from txn_core.tables import PRODUCER_TABLE_CONFIG, missing_columns

    new_columns = ("message_type", "deliver_at_ms")
    old_schema = pa.schema([f for f in arrow_schema(HALF) if f.name not in new_columns])
    path = os.path.join(warehouse, "_sys/half")
    DeltaTable.create(path, old_schema, configuration=PRODUCER_TABLE_CONFIG)
    old_row = {"half_offset": 1, "transaction_id": "t1", "msg_id": "t1", "producer_group": "g"}
    old_row |= {"topic": "ORDER", "queue_id": 0, "body": b"old", "born_ms": 1, "store_ms": 2}
    write_deltalake(path, pa.Table.from_pylist([old_row], schema=old_schema), mode="append")
    assert missing_columns(DeltaTable(path), HALF) == list(new_columns)

    brokers = [Broker.open(warehouse), Broker.open(warehouse)]
    migrated = version(warehouse, "_sys/half")
    assert migrated == 2 and missing_columns(DeltaTable(path), HALF) == []
    assert brokers[0].committers["_sys/half"] == "blind append"  # the fast path still fits
    receipt = Producer(brokers[1], "order_group").send(Message(topic="ORDER", body=b"new"))
    for b in brokers:
        b.close()
    by_offset = {h["half_offset"]: h for h in rows(warehouse, "_sys/half")}
    assert by_offset[1]["message_type"] is None  # written before: a transactional half
    assert by_offset[receipt.half_offset]["message_type"] == "NORMAL"
    assert version(warehouse, "_sys/half") == migrated + 1  # the second open added nothing


def test_opening_a_path_with_no_warehouse_says_it_creates_one(tmp_path, caplog):
    """A typo in the warehouse path made a new warehouse that no job reads,
    and nothing said so."""
    with caplog.at_level("WARNING", logger="txn_core.tables"):
        Broker.open(str(tmp_path / "wharehouse")).close()
        Broker.open(str(tmp_path / "wharehouse")).close()  # exists now: nothing to say
    created = [r.getMessage() for r in caplog.records if "creating a new warehouse" in r.message]
    assert created == [
        f"creating a new warehouse at {tmp_path / 'wharehouse'} (it has no _sys/half): if "
        "producers and the job should share an existing one, check the warehouse setting"
    ]
