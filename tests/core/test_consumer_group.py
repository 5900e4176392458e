"""Consumer groups (txn_core.consumer_group): pull and push consumers, their
committed offsets, retries and dead letters. Topic rows are written directly
with delta-rs: no Spark."""

from __future__ import annotations

import os
import re
import sys
import threading
import zlib

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from schemas import CONSUMER_MEMBERS, CONSUMER_OFFSETS, dlq_path, table_path, topic_path
from schemas.arrow import arrow_schema
from txn_core import (
    Broker,
    ConfigError,
    ConsumedMessage,
    Consumer,
    ConsumerClosedError,
    ConsumeResult,
    CorruptOffsetError,
    NoListenerError,
    PushConsumer,
)
from txn_core.consumer import read_topic
from txn_core.consumer_group import read_committed_offsets, retry_delay_s

from factories import Clock, Panic, deliver, panicking_once

GROUP = "billing"


def offsets(messages: list[ConsumedMessage]) -> list[tuple[int, int]]:
    return [(m.queue_id, m.queue_offset) for m in messages]


def dead_letters(warehouse: str, group: str = GROUP) -> list[dict]:
    rows = DeltaTable(dlq_path(warehouse, group)).to_pyarrow_table().to_pylist()
    return sorted(rows, key=lambda r: (r["queue_id"], r["queue_offset"]))


# --- pull consumer ---------------------------------------------------------------


def test_poll_hands_out_messages_in_queue_order_and_continues_after_them(warehouse):
    deliver(warehouse, q0=range(3), q1=range(2))
    consumer = Consumer(warehouse, GROUP, "ORDER")

    first = consumer.poll(3)
    # the queues take turns, each in offset order; the turn goes on in the next poll
    assert offsets(first) == [(0, 0), (1, 0), (0, 1)]
    assert offsets(consumer.poll(10)) == [(1, 1), (0, 2)]
    assert consumer.poll() == []

    m = first[0]
    assert (m.topic, m.msg_id, m.transaction_id, m.keys, m.tags) == (
        "ORDER",
        "msg-0-0",
        "tx-0-0",
        "order-0-0",
        "created",
    )
    assert (m.body, m.properties, m.born_ms, m.commit_ms, m.reconsume_times) == (
        b"body-0-0",
        {"n": "0-0"},
        10,
        20,
        0,
    )

    deliver(warehouse, q0=range(3, 5), q2=range(1))
    assert offsets(consumer.poll()) == [(2, 0), (0, 3), (0, 4)]


def test_a_poll_opens_only_the_files_that_may_hold_its_next_offsets(warehouse):
    # a topic gains a file per run: a poll must not open them all, every time
    deliver(warehouse, q0=range(3), q1=range(3))
    deliver(warehouse, q0=range(3, 6), q1=range(3, 6))
    consumer = Consumer(warehouse, GROUP, "ORDER")
    assert len(consumer.poll(100)) == 12
    for uri in DeltaTable(topic_path(warehouse, "ORDER")).file_uris():
        os.remove(uri)  # gone from storage, still in the log
    deliver(warehouse, q0=range(6, 8), q1=range(6, 7))

    assert offsets(consumer.poll(100)) == [(0, 6), (1, 6), (0, 7)]
    later = read_topic(warehouse, "ORDER", queue_id=0, from_queue_offset=6)
    assert [(r["queue_id"], r["queue_offset"]) for r in later] == [(0, 6), (0, 7)]
    with pytest.raises(OSError):  # what a read of every file meets
        read_topic(warehouse, "ORDER")


def test_a_poll_over_many_queues_reads_one_band_and_loses_and_repeats_nothing(
    warehouse, monkeypatch
):
    """Past PER_QUEUE_READ_MAX queues one band of offsets is read and split
    by queue (a term per queue in the scan made a poll slow, then crash)."""
    from txn_core import consumer_group

    monkeypatch.setattr(consumer_group, "PER_QUEUE_READ_MAX", 2)
    bands = []
    read_band = Consumer._read_band
    monkeypatch.setattr(
        Consumer, "_read_band", lambda self, *a: bands.append(1) or read_band(self, *a)
    )
    deliver(warehouse, q0=range(5), q1=range(2), q3=range(7), q4=range(1))
    consumer = Consumer(warehouse, GROUP, "ORDER")

    def drain() -> list[tuple[int, int]]:
        got = []
        for _ in range(50):
            batch = consumer.poll(4)
            assert len(batch) <= 4
            if not batch:
                return got
            got += offsets(batch)
        raise AssertionError("never drained")

    first = drain()
    deliver(warehouse, q1=range(2, 4), q4=range(1, 3), q6=range(3))  # and a new queue
    second = drain()
    consumer.commit()

    seen = first + second
    assert len(seen) == len(set(seen)) == 5 + 4 + 7 + 3 + 3
    for queue_id in (0, 1, 3, 4, 6):
        mine = [offset for q, offset in seen if q == queue_id]
        assert mine == list(range(len(mine))), (queue_id, mine)  # in order, none skipped
    assert {q for q, _ in first[:4]} == {0, 1, 3, 4}  # the queues take turns
    assert bands and consumer.committed() == {0: 5, 1: 4, 3: 7, 4: 3, 6: 3}


def test_thousands_of_scattered_queues_are_polled_and_new_ones_among_them_found(warehouse):
    """Queue ids hashed from keys: a poll's file predicate named every gap
    between the known ids, and delta-rs crashed on 8,000 of them (a
    segmentation fault, the consumer's process gone)."""
    ids = sorted({zlib.crc32(b"order-%d" % i) & 0x7FFFFFFF for i in range(10_000)})
    deliver(warehouse, **{f"q{q}": range(1) for q in ids})
    consumer = Consumer(warehouse, GROUP, "ORDER")
    seen = []
    while batch := consumer.poll(1000):
        seen += batch
    assert sorted(offsets(seen)) == [(q, 0) for q in ids]

    # new queues between known ones, low, in the middle and high, and known ones' next rows
    new = [q + 1 for q in ids[:20] + ids[5000:5020] + ids[-20:] if q + 1 not in ids]
    next_rows = {f"q{q}": range(1, 2) for q in ids[:3]}
    deliver(warehouse, **{f"q{q}": range(1) for q in new}, **next_rows)
    later = []
    while batch := consumer.poll(1000):
        later += batch
    assert sorted(offsets(later)) == sorted([(q, 0) for q in new] + [(q, 1) for q in ids[:3]])


def test_a_poll_of_any_size_returns_what_there_is(warehouse):
    """`poll(sys.maxsize)` looped that many times (a hang), and an offset past
    2^63 in its reads raised a raw OverflowError."""
    deliver(warehouse, q0=range(3), q1=range(2))
    consumer = Consumer(warehouse, GROUP, "ORDER")
    assert sorted(offsets(consumer.poll(sys.maxsize))) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    consumer.seek(0, 2**63 - 1)
    assert consumer.poll(2**80) == []
    many = Consumer(warehouse, "many", "ORDER")
    for queue_id in range(40):  # more queues than a poll reads one by one
        many.seek(queue_id, 0)
    assert len(many.poll(2**80)) == 5


class Waits:
    """A consumer's `sleep`: moves the test's clock instead of waiting, and
    can deliver messages at a given wait, as the job would meanwhile."""

    def __init__(self, clock: Clock, warehouse: str, deliver_at: int | None = None):
        self.clock, self.warehouse, self.deliver_at = clock, warehouse, deliver_at
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.clock.advance(seconds)
        if len(self.waits) == self.deliver_at:
            deliver(self.warehouse, q0=range(2))


def test_a_poll_with_a_timeout_returns_when_messages_come(warehouse):
    clock = Clock()
    waits = Waits(clock, warehouse, deliver_at=3)
    consumer = Consumer(warehouse, GROUP, "ORDER", clock=clock, sleep=waits)
    # the topic has no table at the first looks: the poll waits for it too
    assert offsets(consumer.poll(10, timeout_s=5.0)) == [(0, 0), (0, 1)]
    assert waits.waits == [0.2, 0.2, 0.2]  # POLL_INTERVAL_S, until a look found them
    deliver(warehouse, q0=range(2, 3))
    assert offsets(consumer.poll(10, timeout_s=5.0)) == [(0, 2)]
    assert len(waits.waits) == 3  # messages there at once: no wait


def test_a_poll_with_a_timeout_gives_up_at_it_and_heartbeats_while_it_waits(warehouse):
    deliver(warehouse, q0=range(1))
    clock = Clock()
    waits = Waits(clock, warehouse)
    consumer = Consumer(
        warehouse,
        GROUP,
        "ORDER",
        clock=clock,
        sleep=waits,
        poll_interval_s=1.0,
        heartbeat_interval_s=2.0,
        member_timeout_s=3.0,
    )
    assert offsets(consumer.poll(10)) == [(0, 0)]
    started = clock.now
    assert consumer.poll(10, timeout_s=6.5) == []
    assert waits.waits == pytest.approx([1.0] * 6 + [0.5])  # the last wait ends at the timeout
    assert clock.now == pytest.approx(started + 6.5)
    members = DeltaTable(table_path(warehouse, CONSUMER_MEMBERS)).to_pyarrow_table()
    heartbeats = sorted(members.column("heartbeat_ms").to_pylist())
    # joined at the first poll, then a heartbeat every 2 s of the wait: never taken for gone
    assert heartbeats == [int(started * 1000) + step for step in (0, 2000, 4000, 6000)]
    assert consumer.assignment() == [0]


def test_a_poll_without_a_timeout_looks_once_even_if_the_clock_steps_back(warehouse):
    clock = Clock()

    def stepping_back() -> float:
        clock.advance(-1.0)  # an NTP step: each reading earlier than the last
        return clock.now

    def never(seconds: float) -> None:
        raise AssertionError(f"a poll without a timeout waited {seconds} s")

    consumer = Consumer(warehouse, GROUP, "ORDER", clock=stepping_back, sleep=never)
    assert consumer.poll(10) == []


@pytest.mark.parametrize(
    "timeout_s, problem",
    [
        (-1, "timeout_s must be a finite number of seconds, 0 or more, got -1"),
        (float("nan"), "timeout_s must be a finite number of seconds, 0 or more, got nan"),
        (float("inf"), "timeout_s must be a finite number of seconds, 0 or more, got inf"),
        ("5", "timeout_s must be a number of seconds, got str"),
        (True, "timeout_s must be a number of seconds, got bool"),
    ],
)
def test_a_bad_poll_timeout_is_refused_before_any_look(warehouse, timeout_s, problem):
    deliver(warehouse, q0=range(1))
    consumer = Consumer(warehouse, GROUP, "ORDER")
    with pytest.raises(ConfigError, match=re.escape(problem)):
        consumer.poll(10, timeout_s=timeout_s)
    assert offsets(consumer.poll(10)) == [(0, 0)]  # nothing was handed out by the refused call


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"poll_interval_s": 0}, "poll_interval_s must be a positive, finite number of seconds"),
        ({"sleep": 0.2}, "sleep must be a callable taking seconds"),
    ],
)
def test_bad_wait_settings_are_refused(warehouse, kwargs, problem):
    with pytest.raises(ConfigError, match=problem):
        Consumer(warehouse, GROUP, "ORDER", **kwargs)


def test_a_consumer_reads_the_warehouse_of_a_broker(warehouse):
    deliver(warehouse, q0=range(2))
    with Broker.open(warehouse) as broker:
        consumer = Consumer(broker, GROUP, "ORDER")
        assert consumer.warehouse == broker.warehouse
        assert offsets(consumer.poll(10)) == [(0, 0), (0, 1)]
        consumer.commit()
        assert read_committed_offsets(broker, GROUP, "ORDER") == {0: 2}
        consumer.close()  # its queue goes to the next member
        listener = Listener()
        deliver(warehouse, q0=range(2, 3))
        assert PushConsumer(broker, GROUP, "ORDER", listener).consume_once() == 1
    # the names RocketMQ users look for in the consumer module are there too
    from txn_core import consumer

    assert (consumer.Consumer, consumer.PushConsumer) == (Consumer, PushConsumer)


def test_seek_out_of_range_is_refused_and_leaves_the_consumer_as_it_was(warehouse):
    """A queue id of 2^31 (no producer can send to it) was taken in before its
    membership row failed, and every later poll raised a cast error."""
    deliver(warehouse, q0=range(2))
    consumer = Consumer(warehouse, GROUP, "ORDER")
    with pytest.raises(ConfigError, match="queue_id must be an integer from 0 to 2147483647; got"):
        consumer.seek(2**31, 0)
    with pytest.raises(ConfigError, match="offset must be an integer from 0 to 922337203685477"):
        consumer.seek(0, 2**63)
    assert offsets(consumer.poll()) == [(0, 0), (0, 1)]


def test_a_consumer_of_a_path_with_no_warehouse_says_so(tmp_path, warehouse, caplog):
    Broker.open(warehouse).close()
    deliver(warehouse, q0=range(1))
    with caplog.at_level("WARNING", logger="txn_core.consumer_group"):
        Consumer(warehouse, GROUP, "ORDER").close()  # producers made it: nothing to say
        assert Consumer(str(tmp_path / "wharehouse"), GROUP, "ORDER").poll() == []
    (said,) = [r.getMessage() for r in caplog.records if r.name == "txn_core.consumer_group"]
    assert f"no warehouse at {tmp_path / 'wharehouse'} yet" in said


def test_a_page_of_a_queue_opens_only_the_files_that_may_hold_it(warehouse):
    """`read_topic(..., limit=N)` read every row from its offset on, then
    kept N: a consumer paging through a backlog read the whole backlog at
    every page."""
    for topic in ("ORDER", "PAY"):
        for first in range(0, 9, 3):
            deliver(warehouse, topic, q0=range(first, first + 3))
    page = read_topic(warehouse, "ORDER", queue_id=0, from_queue_offset=1, limit=4)
    assert [r["queue_offset"] for r in page] == [1, 2, 3, 4]
    rest = read_topic(warehouse, "ORDER", queue_id=0, from_queue_offset=1, limit=2**63 - 1)
    assert [r["queue_offset"] for r in rest] == list(range(1, 9))  # no overflow past 2^63
    end = read_topic(warehouse, "ORDER", queue_id=0, from_queue_offset=7, limit=5)
    assert [r["queue_offset"] for r in end] == [7, 8]  # fewer than asked: the queue's end
    DeltaTable(topic_path(warehouse, "PAY")).delete("queue_offset IN (3, 4)")
    after_gap = read_topic(warehouse, "PAY", queue_id=0, from_queue_offset=3, limit=2)
    assert [r["queue_offset"] for r in after_gap] == [5, 6]  # rows someone deleted: read on

    table = topic_path(warehouse, "ORDER")
    for action in pa.table(DeltaTable(table).get_add_actions(flatten=True)).to_pylist():
        if action["min.queue_offset"] >= 3:
            os.remove(os.path.join(table, action["path"]))  # gone: a read opening it fails
    first_page = read_topic(warehouse, "ORDER", queue_id=0, from_queue_offset=0, limit=3)
    assert [r["queue_offset"] for r in first_page] == [0, 1, 2]
    with pytest.raises(OSError):
        read_topic(warehouse, "ORDER", queue_id=0, from_queue_offset=0, limit=4)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"limit": -1}, "limit must be an integer from 0 to 9223372036854775807; got -1"),
        ({"limit": 2**63}, "limit must be an integer from 0 to 9223372036854775807; got 92"),
        ({"from_queue_offset": -1}, "from_queue_offset must be an integer from 0 to 9223372036"),
        ({"from_queue_offset": 2**63}, "from_queue_offset must be an integer from 0 to 92233"),
        ({"from_queue_offset": "5"}, "from_queue_offset must be an integer from 0 to 922337203"),
        ({"queue_id": 1.0}, "queue_id must be an integer from 0 to 2147483647; got 1.0"),
        ({"queue_id": 2**31}, "queue_id must be an integer from 0 to 2147483647; got 2147483648"),
    ],
)
def test_read_topic_refuses_an_offset_or_queue_that_is_not_one(warehouse, kwargs, problem):
    deliver(warehouse, q0=range(2))
    with pytest.raises(ConfigError, match=re.escape(problem)):
        read_topic(warehouse, "ORDER", **kwargs)


@pytest.mark.parametrize(
    "bad, problem",
    [
        ("", "warehouse must be a non-empty path or URI, got ''"),  # not the current directory
        (None, "warehouse must be a path, a URI, a Config or a Broker, got NoneType"),
        (5, "warehouse must be a path, a URI, a Config or a Broker, got int"),
        (b"/wh", "warehouse must be a path, a URI, a Config or a Broker, got bytes"),
    ],
)
def test_every_reader_refuses_a_warehouse_that_is_not_one(warehouse, monkeypatch, bad, problem):
    deliver(warehouse, q0=range(1))
    monkeypatch.chdir(warehouse)  # "" once read the warehouse the process stood in
    from txn_core.maintenance import maintain_consumer_tables

    for read in (
        lambda: read_topic(bad, "ORDER"),
        lambda: read_committed_offsets(bad, GROUP, "ORDER"),
        lambda: maintain_consumer_tables(bad, 0),
        lambda: Consumer(bad, GROUP, "ORDER"),
    ):
        with pytest.raises(ConfigError, match=re.escape(problem)):
            read()


def test_read_committed_offsets_refuses_a_group_or_topic_that_is_not_one(warehouse):
    # it answered {} for any of them, as for a group that never committed
    with pytest.raises(ConfigError, match="consumer group"):
        read_committed_offsets(warehouse, "a/b", "ORDER")
    with pytest.raises(ConfigError, match="topic"):
        read_committed_offsets(warehouse, GROUP, None)


def test_readers_take_a_config_or_a_broker_as_the_warehouse(warehouse):
    from txn_core import Config
    from txn_core.maintenance import maintain_consumer_tables

    deliver(warehouse, q0=range(2))
    with Broker.open(warehouse) as broker:
        for given in (Config(warehouse=warehouse), broker):
            assert [r["queue_offset"] for r in read_topic(given, "ORDER")] == [0, 1]
            assert maintain_consumer_tables(given, 0).expired_member_rows == 0


def test_a_topic_nothing_was_delivered_to_raises_an_error_txn_core_exports(warehouse):
    from txn_core import MissingTableError  # documented, and was not exported

    with pytest.raises(MissingTableError, match="topic 'ORDER' has no table"):
        read_topic(warehouse, "ORDER")


def test_a_new_consumer_of_the_group_resumes_at_the_commit(warehouse):
    deliver(warehouse, q0=range(4), q1=range(2))
    consumer = Consumer(warehouse, GROUP, "ORDER", clock=Clock())
    consumer.poll(3)
    assert consumer.commit() == {0: 2, 1: 1}
    assert consumer.commit() == {}  # nothing new: no row
    consumer.close()

    again = Consumer(warehouse, GROUP, "ORDER")
    assert again.committed() == {0: 2, 1: 1}
    assert offsets(again.poll()) == [(0, 2), (1, 1), (0, 3)]
    rows = DeltaTable(table_path(warehouse, CONSUMER_OFFSETS)).to_pyarrow_table().to_pylist()
    assert sorted((r["queue_id"], r["next_offset"], r["committed_ms"]) for r in rows) == [
        (0, 2, 1_000_000),
        (1, 1, 1_000_000),
    ]
    assert {r["group"] for r in rows} == {GROUP} and {r["topic"] for r in rows} == {"ORDER"}


def test_polled_but_uncommitted_messages_are_delivered_again_after_a_restart(warehouse):
    deliver(warehouse, q0=range(5))
    consumer = Consumer(warehouse, GROUP, "ORDER")
    consumer.poll(2)
    consumer.commit()
    assert offsets(consumer.poll(2)) == [(0, 2), (0, 3)]
    consumer.close()  # crashed before committing 2 and 3

    assert offsets(Consumer(warehouse, GROUP, "ORDER").poll()) == [(0, 2), (0, 3), (0, 4)]


def test_two_groups_keep_independent_offsets(warehouse):
    deliver(warehouse, q0=range(3))
    billing = Consumer(warehouse, "billing", "ORDER")
    billing.poll()
    billing.commit()
    shipping = Consumer(warehouse, "shipping", "ORDER")
    assert offsets(shipping.poll(1)) == [(0, 0)]
    shipping.commit()

    assert Consumer(warehouse, "billing", "ORDER").committed() == {0: 3}
    assert Consumer(warehouse, "shipping", "ORDER").committed() == {0: 1}


def test_commit_moves_offsets_forward_only_and_the_newest_row_wins(warehouse):
    deliver(warehouse, q0=range(5))
    clock = Clock()
    consumer = Consumer(warehouse, GROUP, "ORDER", clock=clock)
    consumer.poll(4)
    consumer.commit()
    consumer.seek(0, 1)  # back: redelivered here, but the commit stays at 4
    assert offsets(consumer.poll(1)) == [(0, 1)]
    assert consumer.commit() == {}
    assert Consumer(warehouse, GROUP, "ORDER").committed() == {0: 4}

    # the next member committed later: its row wins (committed_ms, then next_offset)
    consumer.close()  # it holds queue 0 until it leaves (test_consumer_rebalance.py)
    clock.advance(1)
    other = Consumer(warehouse, GROUP, "ORDER", clock=clock)
    other.seek(0, 5)
    other.commit()
    assert Consumer(warehouse, GROUP, "ORDER").committed() == {0: 5}


def test_poll_on_a_topic_without_a_table_returns_nothing(warehouse):
    consumer = Consumer(warehouse, GROUP, "NOTHING_YET")
    assert consumer.poll() == []
    assert consumer.commit() == {}
    listener = Listener()
    push = PushConsumer(warehouse, "shipping", "NOTHING_YET", listener)
    assert push.consume_once() == 0  # a push round too: nothing, no error
    deliver(warehouse, "NOTHING_YET", q0=range(1))
    assert offsets(consumer.poll()) == [(0, 0)]
    assert push.consume_once() == 1 and listener.calls == [(0, 0, 0)]


def test_a_closed_consumer_refuses_to_poll(warehouse):
    consumer = Consumer(warehouse, GROUP, "ORDER")
    consumer.close()
    with pytest.raises(ConsumerClosedError, match="billing"):
        consumer.poll()


@pytest.mark.parametrize(
    "group",
    [
        "",
        "a/b",
        "..",
        "a..b",
        ".",
        "with space",
        "x" * 256,
        "tab\t",
        "semi;colon",
        "billing\n",
        None,
        7,
    ],
)
def test_bad_group_names_are_refused(warehouse, group):
    with pytest.raises(ConfigError, match="consumer group"):
        Consumer(warehouse, group, "ORDER")


def test_good_group_names_are_accepted(warehouse):
    for group in ("billing", "Billing-2", "billing.v2", "a_b", "x" * 255):
        assert Consumer(warehouse, group, "ORDER").group == group


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"max_reconsume_times": 0}, "max_reconsume_times must be positive"),
        ({"max_reconsume_times": "3"}, "max_reconsume_times must be an integer"),
        ({"batch": -1}, "batch must be positive"),
        ({"idle_wait_s": float("inf")}, "idle_wait_s must be a positive, finite number"),
    ],
)
def test_bad_push_settings_are_refused(warehouse, kwargs, problem):
    with pytest.raises(ConfigError, match=problem):
        PushConsumer(warehouse, GROUP, "ORDER", lambda m: ConsumeResult.SUCCESS, **kwargs)


def test_bad_poll_and_seek_arguments_are_refused(warehouse):
    consumer = Consumer(warehouse, GROUP, "ORDER")
    with pytest.raises(ConfigError, match="max_messages must be positive"):
        consumer.poll(0)
    with pytest.raises(ConfigError, match="offset must be an integer from 0 to"):
        consumer.seek(0, -1)
    with pytest.raises(ConfigError, match="topic"):
        Consumer(warehouse, GROUP, "bad/topic")


@pytest.mark.parametrize(
    "corruption, problem",
    [
        ({"next_offset": None}, r"queue 3 is corrupt \(next_offset is None\)"),
        ({"next_offset": -3}, r"queue 3 is corrupt \(next_offset is -3\)"),
        ({"queue_id": None}, r"queue None is corrupt \(queue_id is None\)"),
        ({"queue_id": -1}, r"queue -1 is corrupt \(queue_id is -1\)"),
        ({"committed_ms": None}, r"queue 3 is corrupt \(committed_ms is None\)"),
    ],
)
def test_a_corrupt_offsets_row_names_group_topic_and_queue(warehouse, corruption, problem):
    # written with a schema that lets a null in, as a foreign writer might
    schema = pa.schema([f.with_nullable(True) for f in arrow_schema(CONSUMER_OFFSETS)])
    row = {
        "group": GROUP,
        "topic": "ORDER",
        "queue_id": 3,
        "next_offset": 2,
        "member": "m",
        "committed_ms": 1,
        **corruption,
    }
    path = table_path(warehouse, CONSUMER_OFFSETS)
    write_deltalake(path, pa.Table.from_pylist([row], schema=schema), mode="append")

    with pytest.raises(CorruptOffsetError, match=rf"group 'billing', topic 'ORDER', {problem}"):
        Consumer(warehouse, GROUP, "ORDER")
    with pytest.raises(CorruptOffsetError, match=rf"group 'billing', topic 'ORDER', {problem}"):
        PushConsumer(warehouse, GROUP, "ORDER", lambda m: ConsumeResult.SUCCESS)
    with pytest.raises(CorruptOffsetError, match=problem):
        read_committed_offsets(warehouse, GROUP, "ORDER")
    assert DeltaTable(path).to_pyarrow_table().num_rows == 1  # nothing deleted
    Consumer(warehouse, "shipping", "ORDER")  # other groups are not concerned


# --- push consumer ---------------------------------------------------------------


class Listener:
    """Answers per message from `answers` ({(queue, offset): [result, …]}),
    SUCCESS when none is left; records every call."""

    def __init__(self, answers: dict | None = None):
        self.answers = {k: list(v) for k, v in (answers or {}).items()}
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, message: ConsumedMessage):
        key = (message.queue_id, message.queue_offset)
        self.calls.append((*key, message.reconsume_times))
        queued = self.answers.get(key)
        answer = queued.pop(0) if queued else ConsumeResult.SUCCESS
        if isinstance(answer, BaseException):
            raise answer
        return answer


def test_push_success_moves_the_group_on(warehouse):
    deliver(warehouse, q0=range(3), q1=range(1))
    listener = Listener()
    push = PushConsumer(warehouse, GROUP, "ORDER", listener, batch=10)
    assert push.consume_once() == 4
    assert sorted(listener.calls) == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 0)]
    assert push.consume_once() == 0
    assert Consumer(warehouse, GROUP, "ORDER").committed() == {0: 3, 1: 1}


def test_a_push_consumer_subscribes_its_listener_and_refuses_to_start_without_one(warehouse):
    deliver(warehouse, q0=range(2))
    push = PushConsumer(warehouse, GROUP, "ORDER")
    for call in (push.consume_once, push.start):
        with pytest.raises(NoListenerError, match="has no listener: .*subscribe"):
            call()
    assert push.consumer.committed() == {}  # nothing polled, nothing committed
    with pytest.raises(ConfigError, match="listener must be a callable"):
        push.subscribe("not callable")
    listener = Listener()
    assert push.subscribe(listener) is push
    assert push.consume_once() == 2 and listener.calls == [(0, 0, 0), (0, 1, 0)]
    deliver(warehouse, q0=range(2, 3))
    other = Listener()
    push.subscribe(other)  # replaces the listener for the next rounds
    assert push.consume_once() == 1 and other.calls == [(0, 2, 0)]


def test_retries_wait_as_rocketmqs_broker_has_them_wait():
    # RocketMQ sends a failed message back at delay level 3 + reconsumeTimes
    assert [retry_delay_s(n) for n in range(1, 18)] == [
        10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200, 7200
    ]  # fmt: skip


def test_reconsume_later_is_retried_when_due_and_holds_back_its_queue_only(warehouse):
    deliver(warehouse, q0=range(3), q1=range(2))
    clock = Clock()
    later = ConsumeResult.RECONSUME_LATER
    listener = Listener({(0, 1): [later, later]})
    push = PushConsumer(warehouse, GROUP, "ORDER", listener, clock=clock)

    assert push.consume_once() == 4  # 0/0, 0/1 (fails), 1/0, 1/1
    assert (0, 2, 0) not in listener.calls  # waits behind 0/1
    assert push.consumer.committed() == {0: 1, 1: 2}

    clock.advance(retry_delay_s(1) - 0.001)
    assert push.consume_once() == 0  # not due yet
    deliver(warehouse, q1=range(2, 3))
    assert push.consume_once() == 1  # queue 1 goes on meanwhile
    assert listener.calls[-1] == (1, 2, 0)

    clock.advance(0.001)
    assert push.consume_once() == 1  # the first retry, failing again
    assert listener.calls[-1] == (0, 1, 1)
    clock.advance(retry_delay_s(2) - 1)
    assert push.consume_once() == 0  # the second retry waits level 2 (5 s)
    clock.advance(1)
    assert push.consume_once() == 2  # succeeds, then 0/2 follows
    assert listener.calls[-2:] == [(0, 1, 2), (0, 2, 0)]
    assert push.consumer.committed() == {0: 3, 1: 3}


@pytest.mark.parametrize(
    "raised, reason",
    [
        (ValueError("no such account"), "ValueError: no such account"),
        # not Exceptions: they ended the push consumer's thread, silently
        (SystemExit("a library called sys.exit"), "SystemExit: a library called sys.exit"),
        (Panic("index out of bounds"), "Panic: index out of bounds"),
    ],
)
def test_a_listener_that_raises_is_a_reconsume_with_its_reason(warehouse, raised, reason):
    deliver(warehouse, q0=range(2))
    clock = Clock()
    listener = Listener({(0, 0): [raised] * 5})
    push = PushConsumer(warehouse, GROUP, "ORDER", listener, max_reconsume_times=1, clock=clock)
    push.consume_once()
    clock.advance(retry_delay_s(1))
    push.consume_once()

    (dead,) = dead_letters(warehouse)
    assert dead["reason"] == reason
    assert listener.calls == [(0, 0, 0), (0, 0, 1), (0, 1, 0)]


def test_a_push_consumers_thread_outlives_a_round_that_panics(warehouse):
    deliver(warehouse, q0=range(2))
    push = PushConsumer(warehouse, GROUP, "ORDER", Listener({}))
    again = threading.Event()
    push.consume_once = panicking_once(push.consume_once, again)
    push.start()
    try:
        assert again.wait(timeout=30)  # the thread went on to the next round
    finally:
        push.shutdown()
    assert isinstance(push.last_error, Panic)


class Ambiguous:
    """What a listener returning e.g. a pandas DataFrame hands back: `==`
    gives no bool (here: raises, as `bool(frame == x)` does)."""

    def __eq__(self, other):
        raise ValueError("The truth value of a DataFrame is ambiguous")

    __hash__ = None


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


@pytest.mark.parametrize(
    "answer, reason",
    [
        (Ambiguous(), r"the listener returned <.*Ambiguous object at .*>, not a ConsumeResult"),
        (Unprintable(), r"Unprintable: <unprintable Unprintable>"),
    ],
)
def test_a_listener_answer_that_cannot_be_compared_or_printed_is_a_reconsume(
    warehouse, answer, reason
):
    # Before: the comparison (or the reason's text) raised out of the round,
    # and every round delivered the message again at once, never dead-lettered.
    deliver(warehouse, q0=range(2))
    clock = Clock()
    listener = Listener({(0, 0): [answer] * 5})
    push = PushConsumer(warehouse, GROUP, "ORDER", listener, max_reconsume_times=1, clock=clock)
    assert push.consume_once() == 1
    assert push.consume_once() == 0  # waits for its retry: no hot loop
    clock.advance(retry_delay_s(1))
    assert push.consume_once() == 2  # the retry fails too: dead-lettered, then 0/1
    assert listener.calls == [(0, 0, 0), (0, 0, 1), (0, 1, 0)]
    (dead,) = dead_letters(warehouse)
    assert re.fullmatch(reason, dead["reason"]), dead["reason"]
    assert push.consumer.committed() == {0: 2}


def test_after_max_reconsume_times_the_message_is_dead_lettered_and_the_group_goes_on(warehouse):
    deliver(warehouse, q0=range(3))
    clock = Clock(2_000.0)
    listener = Listener({(0, 1): [ConsumeResult.RECONSUME_LATER] * 10, (0, 2): [None]})
    push = PushConsumer(warehouse, GROUP, "ORDER", listener, max_reconsume_times=3, clock=clock)
    push.consume_once()
    for retry in (1, 2, 3):
        clock.advance(retry_delay_s(retry))
        assert push.consume_once() == (1 if retry < 3 else 2)
    # delivered 1 + max_reconsume_times times, then dead-lettered; 0/2 then
    # returned None (a reconsume as well) and waits for its own retry
    assert [c for c in listener.calls if c[:2] == (0, 1)] == [
        (0, 1, 0),
        (0, 1, 1),
        (0, 1, 2),
        (0, 1, 3),
    ]
    (dead,) = dead_letters(warehouse)
    assert (dead["topic"], dead["queue_id"], dead["queue_offset"], dead["group"]) == (
        "ORDER",
        0,
        1,
        GROUP,
    )
    assert dead["reconsume_times"] == 3
    assert dead["reason"] == "RECONSUME_LATER"
    assert dead["dead_ms"] == int(clock.now * 1000)
    assert (dead["msg_id"], dead["body"], dead["properties"]) == (
        "msg-0-1",
        b"body-0-1",
        [("n", "0-1")],
    )
    assert push.consumer.committed() == {0: 2}  # past the dead letter, before 0/2

    clock.advance(retry_delay_s(1))
    assert push.consume_once() == 1
    assert listener.calls[-1] == (0, 2, 1)
    assert push.consumer.committed() == {0: 3}
    assert len(dead_letters(warehouse)) == 1


def test_a_failed_dead_letter_write_keeps_the_offset_and_is_written_next_round(warehouse):
    deliver(warehouse, q0=range(2))
    clock = Clock()
    listener = Listener({(0, 0): [ConsumeResult.RECONSUME_LATER] * 5})
    push = PushConsumer(warehouse, GROUP, "ORDER", listener, max_reconsume_times=1, clock=clock)
    push.consume_once()
    clock.advance(retry_delay_s(1))
    real = push._dead_letter

    def failing(*args):
        raise OSError("store unreachable")

    push._dead_letter = failing
    with pytest.raises(OSError, match="store unreachable"):
        push.consume_once()
    assert push.consumer.committed() == {}  # not past the message whose DLQ write failed

    push._dead_letter = real
    push.consume_once()  # writes the dead letter without calling the listener again
    assert [c for c in listener.calls if c[:2] == (0, 0)] == [(0, 0, 0), (0, 0, 1)]
    assert [(d["queue_offset"], d["reconsume_times"]) for d in dead_letters(warehouse)] == [(0, 1)]
    assert push.consumer.committed() == {0: 2}


def test_a_restarted_push_consumer_retries_from_the_committed_offset_with_fresh_counts(warehouse):
    deliver(warehouse, q0=range(2))
    clock = Clock()
    listener = Listener({(0, 0): [ConsumeResult.RECONSUME_LATER] * 2})
    first = PushConsumer(warehouse, GROUP, "ORDER", listener, clock=clock)
    first.consume_once()
    first.shutdown()  # leaves the group: the restarted one takes queue 0 at once
    restarted = PushConsumer(warehouse, GROUP, "ORDER", listener, clock=clock)
    restarted.consume_once()  # at once: the retry's wait was in memory
    assert listener.calls == [(0, 0, 0), (0, 0, 0)]


def test_start_and_shutdown_consume_in_the_background(warehouse):
    deliver(warehouse, q0=range(2), q1=range(1))
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def listener(message: ConsumedMessage) -> ConsumeResult:
        seen.append((message.queue_id, message.queue_offset))
        if len(seen) == 4:
            done.set()
        return ConsumeResult.SUCCESS

    push = PushConsumer(warehouse, GROUP, "ORDER", listener, idle_wait_s=0.01)
    push.start()
    try:
        deliver(warehouse, q1=range(1, 2))  # arrives while it runs
        assert done.wait(timeout=30), f"only {seen} consumed"
    finally:
        push.shutdown()
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert push.last_error is None
    assert Consumer(warehouse, GROUP, "ORDER").committed() == {0: 2, 1: 2}
    with pytest.raises(ConsumerClosedError):
        push.consume_once()
