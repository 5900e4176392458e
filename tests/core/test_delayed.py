"""Delayed and timer messages in the broker core (docs/protocol.md §3.1,
"Delayed messages"): the fields' rules, the limit, the stored `deliver_at_ms`."""

import pytest
from deltalake import DeltaTable

from txn_core import (
    Broker,
    Config,
    LocalTransactionState,
    Message,
    MessageValidationError,
    Producer,
    TransactionListener,
    TransactionProducer,
)
from txn_core.config import ConfigError, load_config

NOW = 1_700_000_000_000


def half_rows(warehouse):
    return DeltaTable(f"{warehouse}/_sys/half").to_pyarrow_table().to_pylist()


@pytest.fixture
def broker(warehouse):
    b = Broker.open(Config(warehouse=warehouse), clock=lambda: NOW)
    yield b
    b.close()


def test_each_kind_of_delay_is_stored_as_its_delivery_time(broker, warehouse):
    producer = Producer(broker, "order_group")
    sent = {
        "plain": producer.send(Message(topic="ORDER", body=b"a")),
        "level 3": producer.send(Message(topic="ORDER", body=b"b", delay_level=3)),
        "level 99": producer.send(Message(topic="ORDER", body=b"c", delay_level=99)),
        "relative": producer.send(Message(topic="ORDER", body=b"d", delay_ms=1234)),
        "absolute": producer.send(Message(topic="ORDER", body=b"e", deliver_at_ms=NOW + 5)),
        "past": producer.send(Message(topic="ORDER", body=b"f", deliver_at_ms=NOW - 5)),
        "zero": producer.send(Message(topic="ORDER", body=b"g", delay_ms=0)),
    }
    by_id = {r["msg_id"]: r for r in half_rows(warehouse)}
    due = {name: by_id[r.msg_id]["deliver_at_ms"] for name, r in sent.items()}
    assert all(by_id[r.msg_id]["store_ms"] == NOW for r in sent.values())
    assert due == {
        "plain": None,
        "level 3": NOW + 10_000,  # 1s 5s 10s ...
        "level 99": NOW + 2 * 3_600_000,  # above the last: the last (2h)
        "relative": NOW + 1234,
        "absolute": NOW + 5,
        "past": NOW - 5,  # delivered at once by the job
        "zero": NOW,
    }


@pytest.mark.parametrize(
    "msg, field",
    [
        (Message(topic="ORDER", body=b"x", delay_level=0), "delay_level"),
        (Message(topic="ORDER", body=b"x", delay_level=-1), "delay_level"),
        (Message(topic="ORDER", body=b"x", delay_level=1.5), "delay_level"),  # type: ignore[arg-type]
        (Message(topic="ORDER", body=b"x", delay_level=True), "delay_level"),  # type: ignore[arg-type]
        (Message(topic="ORDER", body=b"x", delay_ms=-1), "delay_ms"),
        (Message(topic="ORDER", body=b"x", delay_ms="5"), "delay_ms"),  # type: ignore[arg-type]
        (Message(topic="ORDER", body=b"x", deliver_at_ms=-3), "deliver_at_ms"),
        (Message(topic="ORDER", body=b"x", delay_level=1, delay_ms=5), "delay_ms"),
        (Message(topic="ORDER", body=b"x", delay_ms=3 * 86_400_000 + 1), "delay_ms"),
        (
            Message(topic="ORDER", body=b"x", deliver_at_ms=NOW + 3 * 86_400_000 + 1),
            "deliver_at_ms",
        ),
    ],
)
def test_a_bad_delay_is_refused_naming_its_field_and_nothing_is_written(
    broker, warehouse, msg, field
):
    with pytest.raises(MessageValidationError) as err:
        Producer(broker, "order_group").send(msg)
    assert err.value.field == field
    assert half_rows(warehouse) == []


def test_the_limit_and_the_levels_are_configurable(warehouse):
    config = Config(warehouse=warehouse, delay_levels="1s 2m", max_delay_ms=60_000)
    with Broker.open(config, clock=lambda: NOW) as b:
        producer = Producer(b, "order_group")
        producer.send(Message(topic="ORDER", body=b"x", delay_level=1))
        with pytest.raises(MessageValidationError, match="max_delay_ms = 60000") as err:
            producer.send(Message(topic="ORDER", body=b"x", delay_level=2))  # 2m > 1 min
        assert err.value.field == "delay_level"
    assert [r["deliver_at_ms"] for r in half_rows(warehouse)] == [NOW + 1000]


def test_a_batch_refuses_every_kind_of_delay(broker, warehouse):
    producer = Producer(broker, "order_group")
    for name in ("delay_level", "delay_ms", "deliver_at_ms"):
        delayed = Message(topic="ORDER", body=b"x", **{name: 1})
        with pytest.raises(MessageValidationError) as err:
            producer.send_batch([Message(topic="ORDER", body=b"x"), delayed])
        assert err.value.field == f"messages[1].{name}"
    assert half_rows(warehouse) == []


def test_the_delay_levels_setting_is_validated_naming_the_key(tmp_path):
    assert load_config(env={}).delay_level_ms[-1] == 2 * 3_600_000
    assert load_config(env={"TXN_DELAY_LEVELS": "1s 1h"}).delay_level_ms == (1000, 3_600_000)
    for bad in ("", "1s 5x", "0s", "5s 1s", "1.5s"):
        with pytest.raises(ConfigError, match="delay_levels"):
            load_config(env={}, delay_levels=bad)
    with pytest.raises(ConfigError, match="max_delay_ms"):
        load_config(env={}, max_delay_ms=0)


def test_sends_sharing_a_commit_each_get_store_ms_plus_their_own_delay(warehouse):
    """Group commit merges delayed and undelayed sends into one commit: the
    relative delays are added to the one store_ms the writer stamps."""
    import threading

    ticks = iter(range(NOW, NOW + 10**6))
    with Broker.open(Config(warehouse=warehouse), clock=lambda: next(ticks)) as b:
        producer = Producer(b, "order_group")

        def send(i: int) -> None:
            delay = {"delay_ms": i * 100} if i % 2 else {}
            producer.send(Message(topic="ORDER", body=str(i).encode(), **delay))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rows = half_rows(warehouse)
    assert len(rows) == 40
    for r in rows:
        i = int(r["body"])
        expected = r["store_ms"] + i * 100 if i % 2 else None
        assert r["deliver_at_ms"] == expected, r


class _Commit(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOWN


def test_a_transactional_message_keeps_its_delay_as_a_plain_one_does(broker, warehouse):
    producer = TransactionProducer(broker, "order_group", listener=_Commit())
    sent = {
        "level 1": producer.send_message_in_transaction(
            Message(topic="ORDER", body=b"a", delay_level=1)
        ),
        "relative": producer.send_message_in_transaction(
            Message(topic="ORDER", body=b"b", delay_ms=90_000)
        ),
        "absolute": producer.send_message_in_transaction(
            Message(topic="ORDER", body=b"c", deliver_at_ms=NOW + 7)
        ),
    }
    by_id = {r["msg_id"]: r for r in half_rows(warehouse)}
    assert {n: by_id[r.msg_id]["deliver_at_ms"] for n, r in sent.items()} == {
        "level 1": NOW + 1_000,
        "relative": NOW + 90_000,
        "absolute": NOW + 7,
    }
    assert {r["message_type"] for r in by_id.values()} == {"TRANSACTION"}


@pytest.mark.parametrize(
    "msg, field",
    [
        (Message(topic="ORDER", body=b"x", delay_level=0), "delay_level"),
        (Message(topic="ORDER", body=b"x", delay_ms=-1), "delay_ms"),
        (Message(topic="ORDER", body=b"x", delay_ms=3 * 86_400_000 + 1), "delay_ms"),
        (
            Message(topic="ORDER", body=b"x", deliver_at_ms=NOW + 3 * 86_400_000 + 1),
            "deliver_at_ms",
        ),
        (Message(topic="ORDER", body=b"x", delay_level=2, deliver_at_ms=NOW), "deliver_at_ms"),
    ],
)
def test_a_transactional_send_refuses_a_bad_delay_before_the_local_transaction(
    broker, warehouse, msg, field
):
    listener = _Commit()
    ran = []
    listener.execute_local_transaction = lambda m, a: ran.append(m)  # type: ignore[method-assign]
    with pytest.raises(MessageValidationError) as err:
        TransactionProducer(broker, "order_group", listener=listener).send_message_in_transaction(
            msg
        )
    assert err.value.field == field
    assert half_rows(warehouse) == [] and ran == []
