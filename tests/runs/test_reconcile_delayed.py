"""Delayed and timer messages (docs/protocol.md §4, "Delayed messages")
through the real broker core and the real job: held in the scheduled set
until a run's clock reaches their time, delivered then once, in their queue
after every message due earlier; idle runs stay idle until the first is due."""

from __future__ import annotations

import time

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake

from jobs.faults import InjectedFault
from jobs.reconcile import reconcile, recover
from jobs.status import status
from jobs.verify import verify
from schemas import table_path, topic_path
from schemas.tables import SCHEDULED
from txn_core import Broker, Config, Message, Producer

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
    scheduled = DeltaTable(table_path(warehouse, SCHEDULED)).to_pyarrow_table()
    assert scheduled.num_rows == 3  # appended once each, never rewritten
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
        if number in crash:
            monkeypatch.setenv("TXN_FAULT_AT", crash[number])
            with pytest.raises(InjectedFault):
                reconcile(spark, cfg, now_ms=now)
            monkeypatch.delenv("TXN_FAULT_AT")
            assert recover(spark, cfg, clock=lambda: time.time() + 3600) is not None
        else:
            reconcile(spark, cfg, now_ms=now)


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
