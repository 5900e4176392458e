"""Delayed and timer messages (docs/protocol.md §4, "Delayed messages")
through the real broker core and the real job: held in the scheduled set
until a run's clock reaches their time, delivered then once, in their queue
after every message due earlier; idle runs stay idle until the first is due."""

from __future__ import annotations

import time

import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from jobs import job_tables, scheduled
from jobs.reconcile import reconcile
from jobs.status import status
from jobs.verify import verify
from schemas import table_path, topic_path
from schemas.tables import CHECK_REQUESTS, RESOLVED, SCHEDULED
from txn_core import Broker, Config, Message, Producer, TransactionProducer

import factories as fx

T0 = 1_700_000_000_000


def _queue(warehouse: str, topic: str = "ORDER") -> list[tuple[bytes, int, int]]:
    """(body, queue_offset, delivered_ms) of queue 0, in queue order."""
    path = topic_path(warehouse, topic)
    if not DeltaTable.is_deltatable(path):
        return []
    rows = DeltaTable(path).to_pyarrow_table().to_pylist()
    rows.sort(key=lambda r: r["queue_offset"])
    return [(r["body"], r["queue_offset"], r["delivered_ms"]) for r in rows if r["queue_id"] == 0]


class Clock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def test_delayed_messages_wait_for_their_time_and_come_in_due_order(spark, warehouse):
    cfg = {"warehouse": warehouse}
    clock = Clock(T0)
    with Broker.open(Config(warehouse=warehouse), clock=clock) as broker:
        producer = Producer(broker, "order_group")
        producer.send(Message(topic="ORDER", body=b"late", delay_ms=60_000))  # due T0+60s
        producer.send(Message(topic="ORDER", body=b"level1", delay_level=1))  # due T0+1s
        producer.send(Message(topic="ORDER", body=b"now"))
        producer.send(Message(topic="ORDER", body=b"past", deliver_at_ms=T0 - 10))  # at once
        producer.send(Message(topic="ORDER", body=b"soon", deliver_at_ms=T0 + 30_000))

        first = reconcile(spark, cfg, now_ms=T0)
        assert (first.half_read, first.committed, first.scheduled) == (5, 2, 3)
        assert (first.scheduled_after, first.next_due_ms) == (3, T0 + 1_000)
        assert [b for b, _, _ in _queue(warehouse)] == [b"now", b"past"]

        # before the first is due: an idle run, nothing read
        idle = reconcile(spark, cfg, now_ms=T0 + 999)
        assert idle.idle and idle.next_due_ms == T0 + 1_000

        # at 40 s: level1 (1 s) and soon (30 s) are due; a new message stored
        # at 20 s (before "soon" was due) comes between them
        clock.now = T0 + 20_000
        producer.send(Message(topic="ORDER", body=b"at 20s"))
        clock.now = T0 + 40_000
        producer.send(Message(topic="ORDER", body=b"at 40s"))
        second = reconcile(spark, cfg, now_ms=T0 + 40_000)

    assert (second.idle, second.delivered_scheduled, second.committed) == (False, 2, 4)
    assert (second.scheduled_after, second.next_due_ms) == (1, T0 + 60_000)
    shown = status(spark, cfg, now_ms=T0 + 40_000)
    assert (shown.scheduled, shown.next_scheduled_ms) == (1, T0 + 60_000)
    assert shown.scheduled_by_topic == {"ORDER": 1}
    report = verify(spark, cfg)  # none early, none twice, none lost; one still scheduled
    assert report.ok, report.render()
    assert (report.counts["delivered"], report.counts["scheduled"]) == (6, 1)
    assert [b for b, _, _ in _queue(warehouse)] == [
        b"now",
        b"past",
        b"level1",
        b"at 20s",
        b"soon",
        b"at 40s",
    ]
    # a clock going back delivers nothing early and nothing twice
    back = reconcile(spark, cfg, now_ms=T0 + 50_000 - 30_000)
    assert back.idle and back.watermark_ms == T0 + 40_000
    # the due boundary: due at T0+60s is delivered by a run at exactly T0+60s
    before = reconcile(spark, cfg, now_ms=T0 + 59_999)
    assert before.idle
    due = reconcile(spark, cfg, now_ms=T0 + 60_000)
    assert (due.delivered_scheduled, due.scheduled_after, due.next_due_ms) == (1, 0, None)
    queue = _queue(warehouse)
    assert [b for b, _, _ in queue] == [
        b"now",
        b"past",
        b"level1",
        b"at 20s",
        b"soon",
        b"at 40s",
        b"late",
    ]
    assert [o for _, o, _ in queue] == list(range(7))  # dense, each once
    assert queue[-1][2] == T0 + 60_000
    after = reconcile(spark, cfg, now_ms=T0 + 120_000)
    assert after.idle and len(_queue(warehouse)) == 7
    scheduled_rows = DeltaTable(table_path(warehouse, SCHEDULED)).to_pyarrow_table()
    assert scheduled_rows.num_rows == 3  # appended once each (the upkeep is every 100th run)
    report = verify(spark, cfg)
    assert report.ok, report.render()
    assert (report.counts["delivered"], report.counts["scheduled"]) == (7, 0)

    # the audit catches a delivery before its time
    path = topic_path(warehouse, "ORDER")
    rows = DeltaTable(path).to_pyarrow_table()
    early = pc.if_else(pc.equal(rows["body"], b"late"), T0 + 59_000, rows["delivered_ms"])
    rows = rows.set_column(rows.schema.get_field_index("delivered_ms"), "delivered_ms", early)
    write_deltalake(path, rows, mode="overwrite")
    assert verify(spark, cfg).differences_by_kind == {"delivered_early": 1}


def test_a_busy_run_with_nothing_due_delivers_the_new_and_keeps_every_timer(spark, warehouse):
    """A run whose clock makes none of the scheduled set due still reads its
    due range, empty, and counts it as it keeps it (`Counters.due`)."""
    cfg = {"warehouse": warehouse}
    clock = Clock(T0)
    with Broker.open(Config(warehouse=warehouse), clock=clock) as broker:
        producer = Producer(broker, "order_group")
        producer.send(Message(topic="ORDER", body=b"later", delay_ms=60_000))
        assert reconcile(spark, cfg, now_ms=T0).scheduled == 1
        clock.now = T0 + 500
        producer.send(Message(topic="ORDER", body=b"now"))
        busy = reconcile(spark, cfg, now_ms=T0 + 500)
    assert (busy.idle, busy.committed, busy.delivered_scheduled) == (False, 1, 0)
    assert (busy.scheduled_after, busy.next_due_ms) == (1, T0 + 60_000)
    assert [b for b, _, _ in _queue(warehouse)] == [b"now"]


def _two_runs(spark, warehouse: str, crash: dict[int, str], monkeypatch) -> None:
    """Run 1 schedules two timers, run 2 delivers one; `crash`: run number ->
    the step at which that run dies (then recovered, as the next invocation would)."""
    cfg = {"warehouse": warehouse}
    t = T0
    plain = {"message_type": "NORMAL"}
    fx.write_halves(
        warehouse,
        fx.half(1, store_ms=t - 10, **plain),
        fx.half(2, store_ms=t - 10, deliver_at_ms=t + 1_000, **plain),
        fx.half(3, store_ms=t - 10, deliver_at_ms=t + 5_000, **plain),
        fx.half(4, store_ms=t - 10, deliver_at_ms=t - 5, **plain),
    )
    for number, now in ((1, t), (2, t + 2_000)):
        if number == 2:
            fx.write_halves(warehouse, fx.half(5, store_ms=t + 1_500, **plain))
        fx.run_or_crash(spark, cfg, now, crash.get(number), monkeypatch)


def test_a_run_killed_at_a_scheduling_or_delivering_step_redoes_to_the_same_tables(
    spark, tmp_path, monkeypatch
):
    clean = str(tmp_path / "clean")
    _two_runs(spark, clean, {}, monkeypatch)
    expected = fx.job_outputs(clean)
    assert [b for b, _, _ in _queue(clean)] == [b"body-1", b"body-4", b"body-2", b"body-5"]
    for crash in ({1: "after:_sys/scheduled"}, {2: "after:topics/ORDER"}):
        wh = str(tmp_path / crash[min(crash)].replace("/", "_").replace(":", "_"))
        _two_runs(spark, wh, crash, monkeypatch)
        assert fx.job_outputs(wh) == expected, crash


def _requests(warehouse: str) -> list[int]:
    """The check_times of every check request, in order."""
    path = table_path(warehouse, CHECK_REQUESTS)
    if not DeltaTable.is_deltatable(path):
        return []
    return sorted(r["check_times"] for r in DeltaTable(path).to_pyarrow_table().to_pylist())


def test_a_delayed_transactional_message_is_delivered_at_its_time_iff_committed(spark, warehouse):
    """Committed before its time: waits for it; committed after it: at once;
    rolled back or discarded: never. A pending one is checked meanwhile."""
    # one check per message, then a discard (check_budget sent: unanswered checks count)
    cfg = {"warehouse": warehouse, "check_max": 1, "check_budget": "sent"}
    clock = Clock(T0)
    with Broker.open(Config(warehouse=warehouse), clock=clock) as broker:
        producer = TransactionProducer(broker, "order_group", listener=fx.DecideByBody())

        def send(body: bytes, **delay) -> str:
            msg = Message(topic="ORDER", body=body, **delay)
            return producer.send_message_in_transaction(msg).transaction_id

        send(b"commit early", delay_ms=60_000)  # committed at T0, due T0+60s
        late = send(b"unknown then commit", delay_ms=10_000)  # due T0+10s
        send(b"rollback", delay_ms=5_000)
        send(b"unknown forever", delay_ms=120_000)  # checked, then discarded
        producer.send(Message(topic="ORDER", body=b"plain now"))

        first = reconcile(spark, cfg, now_ms=T0)
        assert (first.committed, first.rolled_back, first.scheduled) == (1, 1, 1)
        assert (first.pending_after, first.next_scheduled_ms) == (2, T0 + 60_000)
        assert [b for b, _, _ in _queue(warehouse)] == [b"plain now"]

        clock.now = T0 + 20_000  # after "unknown then commit" was due: delivered at once
        broker.resolve(late, commit=True, remark="decided after its time")
        second = reconcile(spark, cfg, now_ms=T0 + 20_000)
    assert (second.committed, second.scheduled, second.check_requests) == (1, 0, 1)
    assert [b for b, _, _ in _queue(warehouse)] == [b"plain now", b"unknown then commit"]
    assert _requests(warehouse) == [1]  # the delay does not hold back the check
    report = verify(spark, cfg)
    assert report.ok, report.render()
    assert report.counts["scheduled"] == 1 and report.counts["pending"] == 1

    before = reconcile(spark, cfg, now_ms=T0 + 59_999)
    assert before.committed == 0 and before.discarded_max_checks == 1
    due = reconcile(spark, cfg, now_ms=T0 + 60_000)
    assert (due.delivered_scheduled, due.committed, due.scheduled_after) == (1, 1, 0)
    queue = _queue(warehouse)
    assert [b for b, _, _ in queue] == [b"plain now", b"unknown then commit", b"commit early"]
    assert queue[-1][2] == T0 + 60_000
    # far past every due time: the rolled-back and the discarded one never come
    last = reconcile(spark, cfg, now_ms=T0 + 400_000)
    assert last.committed == 0 and len(_queue(warehouse)) == 3
    report = verify(spark, cfg)
    assert report.ok, report.render()
    counts = report.counts
    assert (counts["delivered"], counts["rolled_back"], counts["discarded"]) == (3, 1, 1)
    assert (counts["scheduled"], counts["pending"]) == (0, 0)
    resolved = DeltaTable(table_path(warehouse, RESOLVED)).to_pyarrow_table().to_pylist()
    # the early COMMIT's resolved row is its run's, not the delivering one's
    by_run = sorted((r["run_id"][:12], r["action"], r["source"]) for r in resolved)
    assert by_run == [
        ("run-00000001", "COMMIT", "NORMAL"),
        ("run-00000001", "COMMIT", "PRODUCER"),
        ("run-00000001", "ROLLBACK", "PRODUCER"),
        ("run-00000002", "COMMIT", "ADMIN"),
    ]

    # the audit catches a transactional message delivered before its time
    path = topic_path(warehouse, "ORDER")
    rows = DeltaTable(path).to_pyarrow_table()
    early = pc.if_else(pc.equal(rows["body"], b"commit early"), T0 + 59_999, rows["delivered_ms"])
    rows = rows.set_column(rows.schema.get_field_index("delivered_ms"), "delivered_ms", early)
    write_deltalake(path, rows, mode="overwrite")
    assert verify(spark, cfg).differences_by_kind == {"delivered_early": 1}


def test_a_transactional_commit_due_within_the_run_is_placed_by_its_time(spark, warehouse):
    """Committed before its time, read by a run already past it: delivered by
    that run, after the messages due or committed before that time."""
    cfg = {"warehouse": warehouse}
    t = T0
    delayed = fx.half(11, store_ms=t, deliver_at_ms=t + 5_000)
    early = fx.half(12, store_ms=t + 1_000)
    later = fx.half(13, store_ms=t + 7_000)
    fx.write_halves(warehouse, delayed, early, later)
    fx.write_ops(
        warehouse,
        fx.op(delayed, store_ms=t + 100),  # committed first, due at 5 s
        fx.op(early, store_ms=t + 1_001),
        fx.op(later, store_ms=t + 7_001),
    )
    summary = reconcile(spark, cfg, now_ms=t + 10_000)
    assert (summary.committed, summary.scheduled) == (3, 0)
    assert [b for b, _, _ in _queue(warehouse)] == [b"body-12", b"body-11", b"body-13"]
    report = verify(spark, cfg)
    assert report.ok, report.render()


def _txn_runs(spark, warehouse: str, crash: dict[int, str], monkeypatch) -> None:
    """Run 1 reads two delayed transactional messages committed before their
    time (one scheduled, one due within the run) and a rollback; run 2 delivers
    the scheduled one. `crash`: run number -> the step at which it dies."""
    cfg = {"warehouse": warehouse}
    t = T0
    halves = [
        fx.half(21, store_ms=t - 10, deliver_at_ms=t + 1_000),
        fx.half(22, store_ms=t - 10, deliver_at_ms=t - 1),  # due before the run
        fx.half(23, store_ms=t - 10, deliver_at_ms=t + 500),
        fx.half(24, store_ms=t - 10),
    ]
    fx.write_halves(warehouse, *halves)
    fx.write_ops(
        warehouse,
        fx.op(halves[0], op_offset=31, store_ms=t - 5),
        fx.op(halves[1], op_offset=32, store_ms=t - 5),
        fx.op(halves[2], "ROLLBACK", op_offset=33, store_ms=t - 5),
        fx.op(halves[3], op_offset=34, store_ms=t - 5),
    )
    for number, now in ((1, t), (2, t + 2_000)):
        fx.run_or_crash(spark, cfg, now, crash.get(number), monkeypatch)


def test_a_run_killed_while_scheduling_transactional_messages_redoes_to_the_same_tables(
    spark, tmp_path, monkeypatch
):
    clean = str(tmp_path / "clean")
    _txn_runs(spark, clean, {}, monkeypatch)
    assert [b for b, _, _ in _queue(clean)] == [b"body-24", b"body-22", b"body-21"]
    report = verify(spark, {"warehouse": clean})
    assert report.ok, report.render()
    expected = fx.job_outputs(clean)
    for crash in (
        {1: "after:_sys/scheduled"},
        {1: "after:_sys/resolved"},
        {1: "after:topics/ORDER"},
        {2: "after:topics/ORDER"},
    ):
        wh = str(tmp_path / f"{min(crash)}_{crash[min(crash)]}".replace("/", "_").replace(":", "_"))
        _txn_runs(spark, wh, crash, monkeypatch)
        assert fx.job_outputs(wh) == expected, crash


def test_the_job_upkeep_drops_past_scheduled_rows_merges_small_files_and_the_rest_come_due(
    spark, warehouse, monkeypatch
):
    """Every COMPACT_EVERY_RUNS runs, the rows due at or before the committed
    watermark leave `_sys/scheduled`, and many small files are merged sorted
    by due_ms: the set keeps what waits, delivered and counted as before."""
    monkeypatch.setattr(job_tables, "COMPACT_EVERY_RUNS", 2)
    monkeypatch.setattr(scheduled, "SMALL_FILES_TO_MERGE", 2)
    cfg = {"warehouse": warehouse}
    t = T0
    plain = {"message_type": "NORMAL"}
    fx.write_halves(
        warehouse,
        fx.half(60, store_ms=t - 10, deliver_at_ms=t + 1_000, **plain),
        fx.half(61, store_ms=t - 10, deliver_at_ms=t + 9_000, **plain),
    )
    path = table_path(warehouse, SCHEDULED)

    def waiting() -> tuple[list[int], int]:
        table = DeltaTable(path)
        rows = table.to_pyarrow_table().to_pylist()
        return sorted(r["due_ms"] - t for r in rows), len(table.file_uris())

    assert reconcile(spark, cfg, now_ms=t).scheduled == 2  # one file: 1 s and 9 s
    fx.write_halves(warehouse, fx.half(62, store_ms=t + 1_000, deliver_at_ms=t + 5_000, **plain))
    # run 2 delivers the 1-s one and schedules the 5-s one (a second file);
    # its upkeep drops the past row, then merges the two small files
    second = reconcile(spark, cfg, now_ms=t + 2_000)
    assert (second.delivered_scheduled, second.scheduled) == (1, 1)
    assert waiting() == ([5_000, 9_000], 1)
    assert status(spark, cfg, now_ms=t + 2_000).scheduled == 2
    third = reconcile(spark, cfg, now_ms=t + 6_000)
    assert (third.delivered_scheduled, third.next_scheduled_ms) == (1, t + 9_000)
    fourth = reconcile(spark, cfg, now_ms=t + 10_000)
    assert (fourth.delivered_scheduled, fourth.scheduled_after) == (1, 0)
    assert waiting() == ([], 0)
    assert [b for b, _, _ in _queue(warehouse)] == [b"body-60", b"body-62", b"body-61"]
    report = verify(spark, cfg)
    assert report.ok, report.render()


def test_a_run_whose_clock_went_back_delivers_at_the_watermark(spark, warehouse):
    """The watermark never goes back, so a run whose clock did delivers what
    is due by the watermark: stamped with its clock, those messages read as
    delivered before their time, and `verify` failed the warehouse."""
    cfg = {"warehouse": warehouse}
    fx.write_halves(warehouse, fx.half(store_ms=T0, message_type="NORMAL"))
    assert reconcile(spark, cfg, now_ms=T0 + 100_000).watermark_ms == T0 + 100_000
    plain = fx.half(store_ms=T0 + 10_000, message_type="NORMAL", deliver_at_ms=T0 + 50_000)
    txn = fx.half(store_ms=T0 + 10_000, deliver_at_ms=T0 + 60_000)
    fx.write_halves(warehouse, plain, txn)
    fx.write_ops(warehouse, fx.op(txn, store_ms=T0 + 11_000))
    back = reconcile(spark, cfg, now_ms=T0 + 20_000)
    assert (back.watermark_ms, back.committed) == (T0 + 100_000, 2)
    assert [d for _, _, d in _queue(warehouse)] == [T0 + 100_000] * 3
    report = verify(spark, cfg)
    assert report.ok, report.render()


def test_status_shows_the_committed_scheduled_set_without_cancels_or_an_interrupted_run(
    spark, warehouse, monkeypatch
):
    """`status` showed the next due time of a cancelled message (the run's
    summary counts them), and nothing scheduled at all while a run was
    interrupted."""
    from jobs.faults import InjectedFault
    from jobs.reconcile import recover

    cfg = {"warehouse": warehouse}
    clock = Clock(T0)
    with Broker.open(Config(warehouse=warehouse), clock=clock) as broker:
        producer = Producer(broker, "order_group")
        first = producer.send(Message(topic="ORDER", body=b"60s", delay_ms=60_000))
        reconcile(spark, cfg, now_ms=T0)
        clock.now = T0 + 1_000
        producer.send(Message(topic="PAY", body=b"90s", delay_ms=90_000))
        monkeypatch.setenv("TXN_FAULT_AT", "after:_sys/scheduled")  # its row written, not committed
        try:
            reconcile(spark, cfg, now_ms=T0 + 2_000)
        except InjectedFault:
            pass
        monkeypatch.delenv("TXN_FAULT_AT")
        shown = status(spark, cfg, now_ms=T0 + 2_000)
        assert shown.interrupted
        assert (shown.scheduled, shown.next_scheduled_ms) == (1, T0 + 60_000)
        assert shown.scheduled_by_topic == {"ORDER": 1}

        assert recover(spark, cfg, clock=lambda: time.time() + 3600) is not None  # lease lapsed
        assert reconcile(spark, cfg, now_ms=T0 + 3_000).scheduled_after == 2
        broker.cancel(first.msg_id)
        assert reconcile(spark, cfg, now_ms=T0 + 4_000).cancelled == 1
    shown = status(spark, cfg, now_ms=T0 + 4_000)
    assert (shown.scheduled, shown.next_scheduled_ms) == (1, T0 + 91_000)
    assert shown.scheduled_by_topic == {"PAY": 1}
