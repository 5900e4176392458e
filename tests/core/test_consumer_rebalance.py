"""Several members of one consumer group share a topic's queues
(txn_core.consumer_group, docs/protocol.md §3.2 "Several members"): the
assignment rule, heartbeats and the member timeout on an injected clock,
hand-overs at the committed offset, and the upkeep of the two consumer tables.
Topic rows are written directly with delta-rs: no Spark. Members are Consumer
objects with the ids "a", "b", "c" in one process (the rule sorts them)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections import Counter

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from schemas import CONSUMER_MEMBERS, CONSUMER_OFFSETS, table_path
from schemas.arrow import arrow_schema
from txn_core import (
    Broker,
    Config,
    ConfigError,
    ConsumedMessage,
    Consumer,
    ConsumeResult,
    CorruptMembershipError,
    PersistError,
    PushConsumer,
    QueueNotAssignedError,
    consumer_group,
    log_trim,
)
from txn_core.blind_append import ENGINE_INFO, BlindAppender
from txn_core.consumer_group import (
    CONSUMER_LOG_RETENTION,
    HEARTBEAT_INTERVAL_S,
    MEMBER_TIMEOUT_S,
    allocate_queues,
    read_committed_offsets,
)
from txn_core.maintenance import maintain, maintain_consumer_tables
from txn_core.tables import open_or_create

from factories import Clock, deliver

GROUP = "billing"
DAY_MS = 86_400_000


def member(warehouse: str, name: str, clock: Clock, **kwargs) -> Consumer:
    return Consumer(warehouse, GROUP, "ORDER", clock=clock, member=name, **kwargs)


def ids(messages: list[ConsumedMessage]) -> list[tuple[int, int]]:
    return [(m.queue_id, m.queue_offset) for m in messages]


def drain(consumer: Consumer) -> list[tuple[int, int]]:
    """Poll until nothing is left, committing after each batch (process, then commit)."""
    seen: list[tuple[int, int]] = []
    while batch := consumer.poll(3):
        seen += ids(batch)
        consumer.commit()
    return seen


def commit_one_by_one(consumer: Consumer, times: int, then=lambda: None) -> None:
    """`times` rounds of polling one message and committing it, `then` after each."""
    for _ in range(times):
        consumer.poll(1)
        consumer.commit()
        then()


def committed(warehouse: str) -> dict[int, int]:
    return read_committed_offsets(warehouse, GROUP, "ORDER")  # joins no group


def settled_pair(warehouse: str, clock: Clock) -> tuple[Consumer, Consumer]:
    """Members a and b of a 4-queue topic, past their first hand-over:
    a holds queues 0 and 1, b queues 2 and 3."""
    a, b = member(warehouse, "a", clock), member(warehouse, "b", clock)
    a.commit()  # joins: alone, it takes every queue
    b.commit()  # joins: its share (2, 3) is still a's, so it waits
    assert (a.assignment(), b.assignment()) == ([0, 1, 2, 3], [])
    clock.advance(HEARTBEAT_INTERVAL_S)
    a.commit()  # heartbeat: a sees b and lets go of 2 and 3
    b.commit()  # heartbeat: nobody holds 2 and 3 any more, b takes them
    assert (a.assignment(), b.assignment()) == ([0, 1], [2, 3])
    assert a.members() == b.members() == ["a", "b"]
    return a, b


@pytest.mark.parametrize(
    "queues, members, expected",
    [
        (range(8), "abc", [[0, 1, 2], [3, 4, 5], [6, 7]]),  # the first 8 % 3 blocks are longer
        (range(4), "ab", [[0, 1], [2, 3]]),
        ([3, 9], "cab", [[3], [9], []]),  # more members than queues; ids sorted, not their order
        ([7, 1, 4], "a", [[1, 4, 7]]),
        ([], "ab", [[], []]),
    ],
)
def test_the_rule_is_rocketmqs_allocate_averagely(queues, members, expected):
    assert [allocate_queues(queues, list(members), m) for m in sorted(members)] == expected
    assert allocate_queues(queues, list(members), "not-a-member") == []


def test_two_members_split_the_queues_and_together_read_every_message_once(warehouse):
    deliver(warehouse, q0=range(3), q1=range(3), q2=range(3), q3=range(3))
    clock = Clock()
    a, b = settled_pair(warehouse, clock)

    from_a, from_b = drain(a), drain(b)
    assert {q for q, _ in from_a} == {0, 1} and {q for q, _ in from_b} == {2, 3}
    deliver(warehouse, q0=range(3, 5), q3=range(3, 4))
    from_a += drain(a)
    from_b += drain(b)
    everything = [(q, o) for q, n in ((0, 5), (1, 3), (2, 3), (3, 4)) for o in range(n)]
    assert sorted(from_a + from_b) == everything  # each exactly once
    assert committed(warehouse) == {0: 5, 1: 3, 2: 3, 3: 4}


def test_a_third_member_takes_its_share_once_its_holder_let_go_and_nothing_is_read_twice(warehouse):
    deliver(warehouse, q0=range(2), q1=range(2), q2=range(2), q3=range(2))
    clock = Clock()
    a, b = settled_pair(warehouse, clock)
    seen = drain(a) + drain(b)

    c = member(warehouse, "c", clock)
    assert c.poll() == []  # its share, queue 3, is still b's
    assert (c.members(), c.assignment()) == (["a", "b", "c"], [])
    deliver(warehouse, q2=range(2, 3), q3=range(2, 4))
    seen += drain(b)  # b goes on with queue 3 meanwhile, and commits

    clock.advance(HEARTBEAT_INTERVAL_S)
    seen += drain(a) + drain(b)  # heartbeats: a keeps 0 and 1, b lets go of 3
    assert (a.assignment(), b.assignment()) == ([0, 1], [2])
    deliver(warehouse, q3=range(4, 6))
    seen += drain(c)  # c's heartbeat: it takes queue 3 at b's committed offset
    assert c.assignment() == [3]
    deliver(warehouse, q0=range(2, 3), q3=range(6, 7))
    seen += drain(a) + drain(b) + drain(c)

    counts = Counter(seen)
    assert [m for m, n in counts.items() if n > 1] == []  # nothing read twice
    assert sorted(counts) == [
        (q, o) for q, n in ((0, 3), (1, 2), (2, 3), (3, 7)) for o in range(n)
    ]  # nothing missed


def test_a_commit_that_comes_with_a_heartbeat_commits_before_letting_go(warehouse):
    deliver(warehouse, q0=range(2), q1=range(2), q2=range(2), q3=range(2))
    clock = Clock()
    a, b = settled_pair(warehouse, clock)
    c = member(warehouse, "c", clock)
    c.commit()  # joins; its share, queue 3, is still b's
    assert ids(b.poll()) == [(2, 0), (3, 0), (2, 1), (3, 1)]
    clock.advance(HEARTBEAT_INTERVAL_S)  # b's heartbeat comes due while it processes

    assert b.commit() == {2: 2, 3: 2}  # commits first, then lets go of queue 3
    assert b.assignment() == [2]
    deliver(warehouse, q3=range(2, 3))
    assert ids(c.poll()) == [(3, 2)]  # from b's commit: nothing twice


def test_a_member_that_stops_heartbeating_loses_its_queues_after_the_timeout(warehouse):
    deliver(warehouse, q0=range(2), q1=range(2), q2=range(4), q3=range(4))
    clock = Clock()
    a, b = settled_pair(warehouse, clock)
    drain(a)
    assert ids(b.poll(4)) == [(2, 0), (3, 0), (2, 1), (3, 1)]
    b.commit()
    assert ids(b.poll(2)) == [(2, 2), (3, 2)]  # then b hangs before committing these

    clock.advance(MEMBER_TIMEOUT_S - HEARTBEAT_INTERVAL_S)
    assert a.poll() == []  # a heartbeat: b is not gone yet
    assert a.members() == ["a", "b"]
    clock.advance(HEARTBEAT_INTERVAL_S + 0.001)
    # b's last heartbeat is older than the timeout: a takes 2 and 3 at b's
    # commit, so what b polled and did not commit comes again (at-least-once)
    assert ids(a.poll()) == [(2, 2), (3, 2), (2, 3), (3, 3)]
    assert (a.members(), a.assignment()) == (["a"], [0, 1, 2, 3])
    a.commit()

    # b wakes up: it knows it was taken for gone, lets go and commits nothing
    assert b.commit() == {}
    assert b.assignment() == []  # joined again; its share is a's until a lets go
    assert committed(warehouse) == {0: 2, 1: 2, 2: 4, 3: 4}


def test_a_member_back_after_the_timeout_keeps_what_nobody_took_over(warehouse):
    deliver(warehouse, q0=range(4), q1=range(4))
    clock = Clock()
    alone = member(warehouse, "a", clock)
    assert ids(alone.poll(2)) == [(0, 0), (1, 0)]
    clock.advance(3 * MEMBER_TIMEOUT_S)  # a slow batch: as long as nobody took over,
    assert alone.commit() == {0: 1, 1: 1}  # the single member goes on as before
    assert ids(alone.poll(2)) == [(0, 1), (1, 1)]

    # now b takes over while a is silent, commits and leaves again
    clock.advance(3 * MEMBER_TIMEOUT_S)
    b = member(warehouse, "b", clock)
    assert ids(b.poll(2)) == [(0, 1), (1, 1)]  # a's uncommitted ones, again
    b.commit()
    b.close()
    # a is back: nobody holds its queues, but b moved their offsets: a starts there
    assert alone.commit() == {}
    assert ids(alone.poll()) == [(0, 2), (1, 2), (0, 3), (1, 3)]
    assert alone.commit() == {0: 4, 1: 4}


def test_close_hands_the_queues_over_at_the_next_heartbeat_not_after_the_timeout(warehouse):
    deliver(warehouse, q0=range(2), q1=range(2), q2=range(3), q3=range(3))
    clock = Clock()
    a, b = settled_pair(warehouse, clock)
    drain(a)
    assert ids(b.poll(2)) == [(2, 0), (3, 0)]
    b.commit()
    b.close()

    clock.advance(HEARTBEAT_INTERVAL_S)  # well within the timeout
    assert ids(a.poll()) == [(2, 1), (3, 1), (2, 2), (3, 2)]  # from b's commit
    assert (a.members(), a.assignment()) == (["a"], [0, 1, 2, 3])
    rows = DeltaTable(table_path(warehouse, CONSUMER_MEMBERS)).to_pyarrow_table().to_pylist()
    newest_of_b = max((r for r in rows if r["member"] == "b"), key=lambda r: r["heartbeat_ms"])
    assert (newest_of_b["leaving"], newest_of_b["queues"]) == (True, [])


def test_a_new_queue_is_shared_out_at_the_poll_that_finds_it(warehouse):
    deliver(warehouse, q0=range(1), q1=range(1))
    clock = Clock()
    a, b = member(warehouse, "a", clock), member(warehouse, "b", clock)
    a.commit()
    b.commit()
    clock.advance(HEARTBEAT_INTERVAL_S)
    drain(a)
    drain(b)
    assert (a.assignment(), b.assignment()) == ([0], [1])

    deliver(warehouse, q1=range(1, 2), q2=range(2))
    # queues 0, 1, 2 now: a's share is 0 and 1, b's is 2. Before its next
    # heartbeat b finds queue 2, lets go of 1 (unread) and takes 2 (nobody held it);
    # a finds queue 2 as well and takes 1, which b's newest row no longer holds.
    assert ids(b.poll()) == [(2, 0), (2, 1)]
    b.commit()
    assert ids(a.poll()) == [(1, 1)]  # from b's commit of queue 1
    assert (a.assignment(), b.assignment()) == ([0, 1], [2])
    assert sorted(committed(warehouse).items()) == [(0, 1), (1, 1), (2, 2)]


def test_seek_refuses_a_queue_another_member_holds(warehouse):
    deliver(warehouse, q0=range(3), q1=range(3), q2=range(3), q3=range(3))
    clock = Clock()
    a, b = settled_pair(warehouse, clock)
    with pytest.raises(QueueNotAssignedError, match=r"queue 2 of topic 'ORDER' .* member 'a'"):
        a.seek(2, 0)
    b.seek(2, 2)
    assert ids(b.poll(1)) == [(2, 2)]


def test_two_push_consumers_share_the_queues_and_a_handed_over_queue_loses_its_retries(warehouse):
    deliver(warehouse, q0=range(2), q1=range(2))
    clock = Clock()
    calls: list[tuple[str, int, int, int]] = []

    def listener(name: str):
        def call(message: ConsumedMessage) -> ConsumeResult:
            calls.append((name, message.queue_id, message.queue_offset, message.reconsume_times))
            if name == "a" and message.queue_id == 1:
                return ConsumeResult.RECONSUME_LATER  # a cannot handle queue 1
            return ConsumeResult.SUCCESS

        return call

    a = PushConsumer(warehouse, GROUP, "ORDER", listener("a"), clock=clock, member="a")
    assert a.consume_once() == 3  # alone: 0/0, 0/1, and 1/0 fails
    assert ("a", 1, 1, 0) not in calls  # 1/1 waits behind the retry of 1/0
    b = PushConsumer(warehouse, GROUP, "ORDER", listener("b"), clock=clock, member="b")
    assert b.consume_once() == 0  # its share, queue 1, is still a's

    clock.advance(HEARTBEAT_INTERVAL_S)
    calls.clear()
    assert a.consume_once() == 0  # lets go of queue 1: its buffer and retry with it
    assert a.consumer.assignment() == [0]
    assert b.consume_once() == 2  # takes queue 1 at the committed offset 0
    assert calls == [("b", 1, 0, 0), ("b", 1, 1, 0)]
    deliver(warehouse, q0=range(2, 3), q1=range(2, 3))
    calls.clear()
    assert a.consume_once() + b.consume_once() == 2
    assert sorted(calls) == [("a", 0, 2, 0), ("b", 1, 2, 0)]
    a.shutdown()
    b.shutdown()
    assert committed(warehouse) == {0: 3, 1: 3}


def test_two_push_consumers_in_background_threads_consume_every_message_once(warehouse):
    """Real concurrency: both members' threads append to the same tables."""
    deliver(warehouse, q0=range(2), q1=range(2), q2=range(2), q3=range(2))
    clock = Clock()
    lock = threading.Lock()
    seen: Counter[tuple[int, int]] = Counter()
    by_member: dict[str, set[int]] = {"a": set(), "b": set()}
    enough = threading.Event()

    def listener(name: str):
        def call(message: ConsumedMessage) -> ConsumeResult:
            with lock:
                seen[message.queue_id, message.queue_offset] += 1
                by_member[name].add(message.queue_id)
                if sum(seen.values()) >= 24:
                    enough.set()
            return ConsumeResult.SUCCESS

        return call

    members = [
        PushConsumer(
            warehouse, GROUP, "ORDER", listener(n), clock=clock, member=n, idle_wait_s=0.005
        )
        for n in ("a", "b")
    ]

    def wait_until(condition) -> None:
        done = threading.Event()
        for _ in range(6000):  # 30 s at most
            if condition():
                return
            done.wait(0.005)  # the threads' progress, not the clock: that is driven below
        raise AssertionError("the consumers did not get there")

    def heartbeated() -> bool:  # both made a round at the clock's time
        return all(p.consumer._heartbeat_ms == int(clock.now * 1000) for p in members)

    for push in members:
        push.start()
    try:
        wait_until(heartbeated)
        for _ in range(6):  # a hand-over takes a heartbeat or two of each
            if (members[0].assignment(), members[1].assignment()) == ([0, 1], [2, 3]):
                break
            clock.advance(HEARTBEAT_INTERVAL_S)
            wait_until(heartbeated)
        assert (members[0].assignment(), members[1].assignment()) == ([0, 1], [2, 3])
        with lock:
            by_member["a"].clear()
            by_member["b"].clear()
        deliver(warehouse, q0=range(2, 6), q1=range(2, 6), q2=range(2, 6), q3=range(2, 6))
        assert enough.wait(timeout=30), f"only {sum(seen.values())} consumed"
    finally:
        for push in members:
            push.shutdown()
    assert all(p.last_error is None for p in members)
    assert sorted(seen) == [(q, o) for q in range(4) for o in range(6)]
    assert set(seen.values()) == {1}  # nothing twice
    assert by_member == {"a": {0, 1}, "b": {2, 3}}
    assert committed(warehouse) == {q: 6 for q in range(4)}


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"member_timeout_s": 0}, "member_timeout_s must be a positive"),
        ({"member_timeout_s": -5}, "member_timeout_s must be a positive"),
        ({"member_timeout_s": float("nan")}, "member_timeout_s must be a positive"),
        ({"member_timeout_s": "30"}, "member_timeout_s must be a number"),
        ({"heartbeat_interval_s": 0}, "heartbeat_interval_s must be a positive"),
        (
            {"member_timeout_s": 10},
            r"member_timeout_s \(10\) must be longer than heartbeat_interval",
        ),
        (
            {"member_timeout_s": 5, "heartbeat_interval_s": 6},
            r"member_timeout_s \(5\) must be longer than heartbeat_interval_s \(6\)",
        ),
        ({"member_timeout_s": 2 * 86_400}, "member_timeout_s must be at most 86400"),
        ({"member": ""}, "member must be 1..255 printable"),
        ({"member": " a"}, "member must be 1..255 printable"),
        ({"member": 7}, "member must be a string"),
    ],
)
def test_bad_membership_settings_are_refused(warehouse, kwargs, problem):
    with pytest.raises(ConfigError, match=problem):
        Consumer(warehouse, GROUP, "ORDER", **kwargs)
    with pytest.raises(ConfigError, match=problem):
        PushConsumer(warehouse, GROUP, "ORDER", lambda m: ConsumeResult.SUCCESS, **kwargs)


@pytest.mark.parametrize(
    "corruption, problem",
    [
        ({"leaving": None}, "leaving is None"),
        ({"heartbeat_ms": None}, "heartbeat_ms is None"),
        ({"queues": [0, -1]}, r"queues is \[0, -1\]"),
    ],
)
def test_a_corrupt_membership_row_stops_the_group_with_a_clear_error(
    warehouse, corruption, problem
):
    deliver(warehouse, q0=range(2))
    clock = Clock()
    # written with a schema that lets a null in, as a foreign writer might
    schema = pa.schema([f.with_nullable(True) for f in arrow_schema(CONSUMER_MEMBERS)])
    row = {
        "group": GROUP,
        "topic": "ORDER",
        "member": "z",
        "heartbeat_ms": int(clock.now * 1000),
        "leaving": False,
        "queues": [0],
        **corruption,
    }
    path = table_path(warehouse, CONSUMER_MEMBERS)
    write_deltalake(path, pa.Table.from_pylist([row], schema=schema), mode="append")

    consumer = member(warehouse, "a", clock)
    with pytest.raises(
        CorruptMembershipError, match=rf"group 'billing', topic 'ORDER', member 'z'.*{problem}"
    ):
        consumer.poll()
    assert DeltaTable(path).to_pyarrow_table().num_rows == 1  # nothing deleted, nothing joined
    assert committed(warehouse) == {}  # nothing consumed
    other = Consumer(warehouse, "shipping", "ORDER", clock=clock)  # other groups go on
    assert ids(other.poll()) == [(0, 0), (0, 1)]


def test_maintenance_expires_old_heartbeats_and_superseded_offsets(warehouse):
    deliver(warehouse, q0=range(6), q1=range(6))
    clock = Clock()
    gone = member(warehouse, "gone", clock)
    gone.poll(2)
    gone.commit()
    gone.close()
    clock.advance(2 * DAY_MS / 1000)
    a = member(warehouse, "a", clock)
    for _ in range(4):
        a.poll(2)
        a.commit()  # one offsets row per queue each
        clock.advance(HEARTBEAT_INTERVAL_S)
    offsets_path = table_path(warehouse, CONSUMER_OFFSETS)
    assert DeltaTable(offsets_path).to_pyarrow_table().num_rows == 10
    before = committed(warehouse)

    report = maintain_consumer_tables(warehouse, int(clock.now * 1000))
    assert (report.expired_member_rows, report.superseded_offset_rows) == (2, 8)
    members = DeltaTable(table_path(warehouse, CONSUMER_MEMBERS)).to_pyarrow_table()
    assert set(members["member"].to_pylist()) == {"a"}
    assert committed(warehouse) == before == {0: 5, 1: 5}
    assert DeltaTable(offsets_path).to_pyarrow_table().num_rows == 2  # the newest of each queue
    assert report.compacted_files[CONSUMER_MEMBERS.path] > 1

    # the member goes on as before
    deliver(warehouse, q1=range(6, 7))
    assert ids(a.poll()) == [(0, 5), (1, 5), (1, 6)]
    assert a.commit() == {0: 6, 1: 7}
    assert maintain_consumer_tables(warehouse, int(clock.now * 1000)).superseded_offset_rows == 2


def test_consumer_tables_keep_a_day_of_log_and_maintenance_gives_older_tables_that(warehouse):
    """On a local disk delta-rs lists a table's whole log at every commit:
    a member commits at every poll, so the offsets table may keep a day of
    entries, not Delta's 30. A table made before that setting gets it from
    maintenance, and its older entries then go."""
    offsets_path = table_path(warehouse, CONSUMER_OFFSETS)
    empty = pa.Table.from_pylist([], schema=arrow_schema(CONSUMER_OFFSETS))
    write_deltalake(offsets_path, empty, mode="append")  # an offsets table of before
    deliver(warehouse, q0=range(4))
    clock = Clock()
    consumer = member(warehouse, "a", clock)
    commit_one_by_one(consumer, 4)
    members = DeltaTable(table_path(warehouse, CONSUMER_MEMBERS)).metadata().configuration
    assert {k: members.get(k) for k in CONSUMER_LOG_RETENTION} == CONSUMER_LOG_RETENTION
    assert "delta.logRetentionDuration" not in DeltaTable(offsets_path).metadata().configuration
    DeltaTable(offsets_path).create_checkpoint()  # entries go only from behind an expired one
    log_dir = os.path.join(offsets_path, "_delta_log")
    two_days_ago = time.time() - 2 * DAY_MS / 1000
    for name in os.listdir(log_dir):  # the log so far, as if written two days ago
        os.utime(os.path.join(log_dir, name), (two_days_ago, two_days_ago))

    maintain_consumer_tables(warehouse, int(clock.now * 1000))
    offsets = DeltaTable(offsets_path)
    configuration = offsets.metadata().configuration
    assert {k: configuration.get(k) for k in CONSUMER_LOG_RETENTION} == CONSUMER_LOG_RETENTION
    assert "00000000000000000000.json" not in os.listdir(log_dir)
    assert committed(warehouse) == {0: 4}
    deliver(warehouse, q0=range(4, 5))
    assert ids(consumer.poll()) == [(0, 4)]
    assert consumer.commit() == {0: 5}
    assert committed(warehouse) == {0: 5}
    consumer.close()
    fresh = os.path.join(os.path.dirname(warehouse), "fresh")
    os.mkdir(fresh)
    deliver(fresh, q0=range(1))
    made_now = member(fresh, "a", Clock())
    made_now.poll()
    made_now.commit()
    made_now.close()
    configuration = DeltaTable(table_path(fresh, CONSUMER_OFFSETS)).metadata().configuration
    assert {k: configuration.get(k) for k in CONSUMER_LOG_RETENTION} == CONSUMER_LOG_RETENTION


@pytest.mark.parametrize("path", ["by hand", "delta-rs"])
def test_commits_trim_the_offsets_log_behind_its_checkpoints(warehouse, monkeypatch, path):
    """A member commits at every poll: the log of the offsets table stays a
    checkpoint or two long, and a handle left behind the trim commits on;
    appending by hand or, where the appender may not write, through delta-rs.
    (At a tenth of the real intervals, to take 35 commits, not 350.)"""
    if path == "delta-rs":
        monkeypatch.setattr(consumer_group, "unsupported_reason", lambda *args: "delta-rs's path")
        monkeypatch.setattr(consumer_group, "_CHECKPOINT_INTERVAL", 10)
    monkeypatch.setattr(log_trim, "KEPT_ENTRIES", 10)
    open_or_create(warehouse, CONSUMER_OFFSETS, configuration={"delta.checkpointInterval": "10"})
    deliver(warehouse, q0=range(40))
    clock = Clock()
    other = Consumer(warehouse, "shipping", "ORDER", clock=clock)
    other.poll(1)
    assert other.commit() == {0: 1}  # its handle now stays at the table's first versions
    busy = member(warehouse, "a", clock)
    commit_one_by_one(busy, 34)
    log_dir = os.path.join(table_path(warehouse, CONSUMER_OFFSETS), "_delta_log")
    names = os.listdir(log_dir)
    versions = sorted(int(n[:20]) for n in names if n.endswith(".json"))
    checkpoints = sorted(int(n[:20]) for n in names if n.endswith(".checkpoint.parquet"))
    assert versions[-1] == 35
    # trimmed at version 30, behind the newest checkpoint at least 10 versions back
    assert versions[0] == checkpoints[0] and 10 < versions[0] <= 20
    assert committed(warehouse) == {0: 34}

    other.poll(2)
    assert other.commit() == {0: 3}
    assert read_committed_offsets(warehouse, "shipping", "ORDER") == {0: 3}
    busy.close()
    other.close()


def engines(table_dir: str) -> dict[int, str]:
    """The engineInfo of each commit in the log of the table at `table_dir`."""
    log_dir = os.path.join(table_dir, "_delta_log")
    found = {}
    for name in os.listdir(log_dir):
        if name.endswith(".json"):
            with open(os.path.join(log_dir, name)) as entry:
                info = json.loads(entry.readline())["commitInfo"]
            found[int(name[:20])] = info.get("engineInfo") or info.get("clientVersion", "")
    return found


def test_reading_the_members_leaves_out_the_files_of_expired_heartbeats(warehouse, opened_files):
    deliver(warehouse, q0=range(2))
    clock = Clock()
    a = member(warehouse, "a", clock)
    for _ in range(30):  # one heartbeat file each
        a.commit()
        clock.advance(HEARTBEAT_INTERVAL_S)
    opened_files.clear()
    b = member(warehouse, "b", clock)
    b.commit()  # joins: reads the members
    assert b.members() == ["a", "b"]
    opened = [n for uri, n in opened_files if CONSUMER_MEMBERS.path in uri]
    # a's heartbeats within the timeout (its last at most 3 intervals back), not all 30
    assert opened and max(opened) <= MEMBER_TIMEOUT_S / HEARTBEAT_INTERVAL_S + 1


def test_a_members_commits_are_appended_by_hand_with_the_checkpoints_they_fall_due_at(warehouse):
    """An offsets or heartbeat row is one parquet file and one log entry
    (txn_core.blind_append), whose cost does not grow with the table's
    files; the commits bypass delta-rs's hook, so the member writes the
    checkpoints. A fresh handle reads them."""
    offsets_dir = table_path(warehouse, CONSUMER_OFFSETS)
    open_or_create(warehouse, CONSUMER_OFFSETS, configuration={"delta.checkpointInterval": "10"})
    deliver(warehouse, q0=range(25))
    clock = Clock()
    consumer = member(warehouse, "a", clock)
    commit_one_by_one(consumer, 25, then=lambda: clock.advance(HEARTBEAT_INTERVAL_S))
    by_hand = {v: e for v, e in engines(offsets_dir).items() if v > 0}
    assert len(by_hand) == 25 and set(by_hand.values()) == {ENGINE_INFO}
    members = engines(table_path(warehouse, CONSUMER_MEMBERS))
    assert len(members) > 20 and {e for v, e in members.items() if v > 0} == {ENGINE_INFO}
    checkpoints = sorted(
        int(n[:20])
        for n in os.listdir(os.path.join(offsets_dir, "_delta_log"))
        if n.endswith(".checkpoint.parquet")
    )
    assert checkpoints == [9, 19]
    assert DeltaTable(offsets_dir).version() == 25
    assert committed(warehouse) == {0: 25}
    consumer.close()


def test_a_consumer_table_the_appender_may_not_write_is_appended_to_by_delta_rs(warehouse):
    offsets_dir = table_path(warehouse, CONSUMER_OFFSETS)
    table = open_or_create(warehouse, CONSUMER_OFFSETS)
    table.alter.add_constraint({"offset_ok": "next_offset >= 0"})  # a duty a blind append skips
    deliver(warehouse, q0=range(3))
    consumer = member(warehouse, "a", Clock())
    commit_one_by_one(consumer, 3)
    last = max(engines(offsets_dir).items())
    assert last[0] == 4 and last[1] != ENGINE_INFO
    assert committed(warehouse) == {0: 3}
    consumer.close()


def test_a_commit_the_store_refuses_is_a_persist_error_naming_the_table(warehouse, monkeypatch):
    deliver(warehouse, q0=range(2))
    consumer = member(warehouse, "a", Clock())
    consumer.poll(1)
    consumer.commit()

    def full_disk(self, rows, user_metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BlindAppender, "append", full_disk)
    consumer.poll(1)
    with pytest.raises(PersistError, match="consumer_offsets.*No space left.*needs write access"):
        consumer.commit()
    monkeypatch.undo()
    assert consumer.commit() == {0: 2}  # the offset polled is still to commit
    assert committed(warehouse) == {0: 2}
    consumer.close()


def test_the_producers_maintenance_does_the_consumer_tables_too_and_keeps_corrupt_rows(warehouse):
    # a foreign writer's row with a null: maintenance leaves it to an operator
    schema = pa.schema([f.with_nullable(True) for f in arrow_schema(CONSUMER_OFFSETS)])
    corrupt = {"group": "other", "topic": "ORDER", "queue_id": 0, "next_offset": 1}
    offsets_path = table_path(warehouse, CONSUMER_OFFSETS)
    write_deltalake(
        offsets_path,
        pa.Table.from_pylist([{**corrupt, "member": "m", "committed_ms": None}], schema=schema),
        mode="append",
    )
    deliver(warehouse, q0=range(3))
    clock = Clock()
    consumer = member(warehouse, "a", clock)
    commit_one_by_one(consumer, 3, then=lambda: clock.advance(1))

    with Broker.open(warehouse, config=Config(warehouse=warehouse)) as broker:
        report = maintain(broker, now_ms=int(clock.now * 1000))
    assert report.superseded_offset_rows == 2
    assert report.to_dict()["superseded_offset_rows"] == 2
    rows = DeltaTable(offsets_path).to_pyarrow_table().to_pylist()
    assert sorted((r["group"], r["next_offset"], r["committed_ms"]) for r in rows) == [
        ("billing", 3, 1_002_000),
        ("other", 1, None),
    ]


def test_an_append_a_concurrent_maintenance_commit_refused_is_made_again(warehouse, monkeypatch):
    # delta-rs refuses an append that a concurrent delete or compaction overlaps
    import txn_core.consumer_group as consumer_group

    real, refused = consumer_group.write_deltalake, []

    def once_refused(table, rows, **kwargs):
        if not refused:
            refused.append(table.table_uri)
            raise CommitFailedError("a concurrent transaction deleted data this operation read")
        real(table, rows, **kwargs)

    monkeypatch.setattr(consumer_group, "write_deltalake", once_refused)
    # the tables appended to through delta-rs, as those the appender may not write
    monkeypatch.setattr(consumer_group, "unsupported_reason", lambda *args: "delta-rs's path")
    deliver(warehouse, q0=range(2))
    consumer = member(warehouse, "a", Clock())
    assert ids(consumer.poll()) == [(0, 0), (0, 1)]  # its join's row was refused once
    assert consumer.commit() == {0: 2}
    assert refused and committed(warehouse) == {0: 2}


def test_appends_by_hand_move_past_the_versions_a_maintenance_pass_took(warehouse):
    deliver(warehouse, q0=range(4))
    clock = Clock()
    consumer = member(warehouse, "a", clock)
    commit_one_by_one(consumer, 3)
    offsets_dir = table_path(warehouse, CONSUMER_OFFSETS)
    before = DeltaTable(offsets_dir).version()
    report = maintain_consumer_tables(warehouse, int(clock() * 1000))  # two superseded rows go
    assert report.superseded_offset_rows == 2
    taken = DeltaTable(offsets_dir).version()
    assert taken > before  # the versions the member's appender would have put next

    consumer.poll(1)
    assert consumer.commit() == {0: 4}
    assert max(engines(offsets_dir).items()) == (taken + 1, ENGINE_INFO)
    assert committed(warehouse) == {0: 4}
    assert DeltaTable(offsets_dir).to_pyarrow_table().num_rows == 2
    consumer.close()


# --- on S3 (MinIO on loopback) ---------------------------------------------------------


def test_on_s3_two_members_split_the_queues(s3):
    from txn_core.config import load_config

    config = load_config(env={}, **s3.config())
    clock = Clock()
    a = Consumer(config, GROUP, "ORDER", clock=clock, member="a")
    b = Consumer(config, GROUP, "ORDER", clock=clock, member="b")
    deliver(a.warehouse, q0=range(2), q1=range(2))
    a.commit()
    b.commit()
    clock.advance(HEARTBEAT_INTERVAL_S)
    assert drain(a) == [(0, 0), (0, 1)]
    assert drain(b) == [(1, 0), (1, 1)]
    assert read_committed_offsets(a.warehouse, GROUP, "ORDER") == {0: 2, 1: 2}
    b.close()
    clock.advance(HEARTBEAT_INTERVAL_S)
    deliver(a.warehouse, q1=range(2, 3))
    assert drain(a) == [(1, 2)]
