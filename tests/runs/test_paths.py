"""Names a path has to carry: a warehouse under a directory with spaces and
other characters, and topics whose names hold `%` or `|` (RocketMQ's topic
alphabet), through the broker core, the job, `status`, `verify` and the
consumer; and the warehouse paths neither engine can read, refused."""

from __future__ import annotations

import os
import re
import time

import pytest
from deltalake import DeltaTable

from jobs import commits
from jobs.reconcile import reconcile
from jobs.status import status
from jobs.verify import verify
from schemas import topic_directory, topic_of_directory, topic_path
from txn_core import (
    Broker,
    Consumer,
    LocalTransactionState,
    Message,
    Producer,
    TransactionListener,
    TransactionProducer,
)
from txn_core.config import ConfigError, load_config
from txn_core.consumer import read_topic
from txn_core.tables import SharedTopicTableError

#: RocketMQ's longest topic name, every character escaped in its directory
LONGEST = ("%|" * 64)[:127]
TOPICS = ("ORDER", "pay|eu", "a%41", "rate%", "x%7C|y", LONGEST)


class Unknown(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOWN


def _now() -> int:
    return time.time_ns() // 1_000_000


def test_each_topic_has_a_directory_of_its_own_that_names_it_back():
    directories = [topic_directory(t) for t in TOPICS]
    assert directories[:5] == ["ORDER", "pay~beu", "a~p41", "rate~p", "x~p7C~by"]
    assert len(directories[5].encode()) == 254  # a file name holds 255 bytes
    assert [topic_of_directory(d) for d in directories] == list(TOPICS)
    assert topic_path("/wh/", "pay|eu") == "/wh/topics/pay~beu"


@pytest.mark.parametrize("passes", ["a small run's", "a big run's"])
def test_a_warehouse_path_with_spaces_and_topics_with_percent_and_pipe(
    spark, tmp_path, monkeypatch, passes
):
    """delta-rs lists a table's files as URIs (`my%20wh`), which Spark read
    as names until `jobs.appends` decoded them: the second run, reading the
    first one's state, failed, and so did `verify`. It cannot open a path
    holding `|` or `%41` at all: a topic so named stopped every run."""
    staged = []
    if passes == "a big run's":  # Spark writes the deliveries, staged and committed
        monkeypatch.setattr("jobs.interpreted.INTERPRETED_MAX_ROWS", -1)
        monkeypatch.setattr("jobs.driver_writes.MESSAGE_MAX_ROWS", -1)
        stage_split = commits.stage_split
        monkeypatch.setattr(
            commits, "stage_split", lambda *a, **k: staged.append(1) or stage_split(*a, **k)
        )
    warehouse = str(tmp_path / "my wh+é,(x)'=&@")
    cfg = {"warehouse": warehouse}
    with Broker.open(warehouse) as broker:
        plain = Producer(broker, "order_group")
        txn = TransactionProducer(broker, "order_group", Unknown())
        for topic in TOPICS:
            plain.send(Message(topic=topic, body=topic.encode()))
        waiting = txn.send_message_in_transaction(Message(topic="pay|eu", body=b"later"), None)

        first = reconcile(spark, cfg, now_ms=_now())
        waiting_by_topic = status(spark, cfg).pending_by_topic
        broker.resolve(waiting.transaction_id, commit=True)
        plain.send(Message(topic="a%41", body=b"second"))
    second = reconcile(spark, cfg, now_ms=_now())  # reads the first run's state as files

    assert first.delivered_by_topic == dict.fromkeys(TOPICS, 1)
    assert (first.pending_after, second.pending_after) == (1, 0)
    assert second.delivered_by_topic == {"pay|eu": 1, "a%41": 1}
    assert sorted(os.listdir(os.path.join(warehouse, "topics"))) == sorted(
        topic_directory(t) for t in TOPICS
    )
    assert (waiting_by_topic, status(spark, cfg).pending) == ({"pay|eu": 1}, 0)
    report = verify(spark, cfg)
    assert report.ok, report.render()
    assert report.counts["topic_tables"] == len(TOPICS)
    got = {t: [m.body for m in Consumer(warehouse, "billing", t).poll(10)] for t in TOPICS}
    assert got == {
        **{t: [t.encode()] for t in TOPICS},
        "pay|eu": [b"pay|eu", b"later"],
        "a%41": [b"a%41", b"second"],
    }
    assert [r["body"] for r in read_topic(warehouse, "x%7C|y")] == [b"x%7C|y"]
    assert DeltaTable(topic_path(warehouse, "rate%")).version() >= 1
    assert len(staged) == (2 if passes == "a big run's" else 0)  # both runs deliver


@pytest.mark.parametrize(
    "first, second, in_one_run",
    [("Order", "ORDER", False), ("ORDER", "Order", True)],  # in one run: in order
)
def test_two_topics_a_case_blind_file_system_gives_one_directory_stop_the_run(
    spark, tmp_path, first, second, in_one_run
):
    """On macOS's and Windows' default file systems `topics/ORDER` is
    `topics/Order`: the two topics' messages would share one table and one
    range of offsets. A link from the second name to the first's directory
    makes that here. The run stops with an error naming both and delivers
    nothing into the other's table; once the warehouse can tell them apart
    the next run delivers everything (nothing lost)."""
    warehouse = str(tmp_path / "wh")
    cfg = {"warehouse": warehouse}
    os.makedirs(os.path.join(warehouse, "topics", first))
    os.symlink(first, os.path.join(warehouse, "topics", second))
    with Broker.open(warehouse) as broker:
        producer = Producer(broker, "order_group")
        producer.send(Message(topic=first, body=b"first"))
        if not in_one_run:
            assert reconcile(spark, cfg, now_ms=_now()).delivered_by_topic == {first: 1}
        producer.send(Message(topic=second, body=b"second"))

    refused = f"topic {second!r} would use the table of topic {first!r}"
    with pytest.raises(SharedTopicTableError, match=refused):
        reconcile(spark, cfg, now_ms=_now())
    assert [r["body"] for r in read_topic(warehouse, first)] == ([] if in_one_run else [b"first"])
    with pytest.raises(SharedTopicTableError, match=refused):
        read_topic(warehouse, second)
    with pytest.raises(SharedTopicTableError, match=refused):
        Consumer(warehouse, "billing", second).poll(10)

    os.unlink(os.path.join(warehouse, "topics", second))  # a case-sensitive home
    reconcile(spark, cfg, now_ms=_now())
    assert [r["body"] for r in read_topic(warehouse, first)] == [b"first"]
    assert [r["body"] for r in read_topic(warehouse, second)] == [b"second"]
    report = verify(spark, cfg)
    assert report.ok, report.render()


@pytest.mark.parametrize(
    "warehouse, named",
    [
        ("/data/a|b", "|"),
        ("/data/100%", "%"),
        ("/data/x%41", "%"),
        ("/data/[prod]", "[ ]"),
        ("/data/wh#1", "#"),
        ("/data/{a,b}", "{ }"),
        ("/data/a*", "*"),
        ("/data/a^b", "^"),
    ],
)
def test_a_warehouse_path_neither_engine_can_read_is_refused(warehouse, named):
    with pytest.raises(ConfigError, match=f"holds {re.escape(named)},"):
        load_config(env={}, warehouse=warehouse)
    with pytest.raises(ConfigError, match="holds"):
        Consumer(warehouse, "billing", "ORDER")


def test_an_s3_prefix_holds_only_the_characters_aws_calls_safe():
    assert load_config(env={}, warehouse="s3://b/ok_(1)/x.y-z!'").warehouse == (
        "s3a://b/ok_(1)/x.y-z!'"
    )
    for prefix in ("my wh", "caf\u00e9", "a+b", "a=b"):
        with pytest.raises(ConfigError, match="prefix may hold only"):
            load_config(env={}, warehouse=f"s3://bucket/{prefix}")
