"""Cancelling delayed messages (docs/protocol.md §4, "Cancelling a delayed
message") through the real broker core and job: a cancel read before the
due time withdraws the delivery of a message pending, committed and
scheduled, or not read yet; one read later, or naming a message unknown or
not delayed, is rejected with its reason; `status` and `verify` see them."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from jobs.reconcile import main, reconcile
from jobs.status import status
from jobs.verify import verify
from schemas import table_path, topic_path
from schemas.tables import CANCELLED, OP, REJECTED, RESOLVED
from txn_core import (
    Broker,
    Config,
    LocalTransactionState,
    Message,
    Producer,
    TransactionListener,
    TransactionProducer,
)
from txn_core.vocabulary import CANCEL

import factories as fx

T0 = 1_700_000_000_000


class Clock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


class _ByBody(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        if msg.body.startswith(b"commit"):
            return LocalTransactionState.COMMIT_MESSAGE
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOWN


def _bodies(warehouse: str) -> list[bytes]:
    path = topic_path(warehouse, "ORDER")
    rows = DeltaTable(path).to_pyarrow_table().to_pylist()
    return [r["body"] for r in sorted(rows, key=lambda r: r["queue_offset"])]


def _rejected_ops(warehouse: str) -> dict[int, str]:
    rows = DeltaTable(table_path(warehouse, REJECTED)).to_pyarrow_table().to_pylist()
    return {r["row_offset"]: r["reason"] for r in rows if r["source_table"] == "_sys/op"}


def test_cancelled_delayed_messages_are_never_delivered_and_late_cancels_are_rejected(
    spark, warehouse
):
    cfg = {"warehouse": warehouse}
    clock = Clock(T0)
    with Broker.open(Config(warehouse=warehouse), clock=clock) as broker:
        plain = Producer(broker, "order_group")
        txn = TransactionProducer(broker, "order_group", listener=_ByBody())
        scheduled_plain = plain.send(Message(topic="ORDER", body=b"plain 60s", delay_ms=60_000))
        pending = txn.send_message_in_transaction(
            Message(topic="ORDER", body=b"pending 60s", delay_ms=60_000)
        )
        committed = txn.send_message_in_transaction(
            Message(topic="ORDER", body=b"commit 60s", delay_ms=60_000)
        )
        at_once = plain.send(Message(topic="ORDER", body=b"plain now"))
        soon = plain.send(Message(topic="ORDER", body=b"plain 10s", delay_ms=10_000))
        first = reconcile(spark, cfg, now_ms=T0)
        assert (first.scheduled, first.pending_after) == (3, 1)

        clock.now = T0 + 5_000
        unread = plain.send(Message(topic="ORDER", body=b"plain 30s", delay_ms=30_000))
        ops = {
            "scheduled plain": broker.cancel(scheduled_plain.msg_id, remark="order paid"),
            "again": broker.cancel(scheduled_plain.msg_id),
            "pending": broker.cancel(transaction_id=pending.transaction_id),
            "committed": broker.cancel(committed.msg_id),
            "unread": broker.cancel(unread.msg_id),
            # written by other means: the broker refuses both (below)
            "not delayed": broker.store_ops(
                [at_once.half_offset], [at_once.msg_id], "order_group", CANCEL, "ADMIN"
            )[0],
            "unknown": broker.store_ops([12345], ["no-such-id"], "order_group", CANCEL, "ADMIN")[0],
            # a decision naming a plain message only the scheduled set holds: unknown
            "commit of scheduled plain": broker.store_ops(
                [scheduled_plain.half_offset],
                [scheduled_plain.msg_id],
                "order_group",
                "COMMIT",
                "ADMIN",
            )[0],
        }
        with pytest.raises(ValueError, match="not a delayed message"):
            broker.cancel(at_once.msg_id)
        with pytest.raises(LookupError):
            broker.cancel("no-such-id")
        second = reconcile(spark, cfg, now_ms=T0 + 20_000)  # delivers "plain 10s"
        assert (second.cancelled, second.duplicate_ops) == (4, 1)
        assert (second.invalid_ops, second.late_ops) == (2, 1)
        assert _bodies(warehouse) == [b"plain now", b"plain 10s"]

        clock.now = T0 + 25_000
        ops["delivered"] = broker.cancel(soon.msg_id)  # read after its time
        broker.resolve(pending.transaction_id, commit=True)  # committed before its time
        third = reconcile(spark, cfg, now_ms=T0 + 30_000)
    assert (third.cancelled, third.late_ops, third.scheduled) == (0, 1, 1)
    assert _rejected_ops(warehouse) == {
        ops["not delayed"]: "LATE: message already delivered",
        ops["unknown"]: "INVALID: unknown half_offset",
        ops["commit of scheduled plain"]: "INVALID: unknown half_offset",
        ops["delivered"]: "LATE: message already delivered",
    }
    shown = status(spark, cfg, now_ms=T0 + 30_000)
    assert (shown.scheduled, shown.cancelled) == (0, 4)

    # every cancelled message falls due: none is delivered
    due = reconcile(spark, cfg, now_ms=T0 + 70_000)
    assert (due.delivered_scheduled, due.committed, due.scheduled_after) == (0, 0, 0)
    assert _bodies(warehouse) == [b"plain now", b"plain 10s"]
    cancelled = DeltaTable(table_path(warehouse, CANCELLED)).to_pyarrow_table().to_pylist()
    assert sorted(r["op_offset"] for r in cancelled) == sorted(
        ops[k] for k in ("scheduled plain", "pending", "committed", "unread")
    )
    report = verify(spark, cfg)
    assert report.ok, report.render()
    assert (report.counts["cancelled"], report.counts["delivered"]) == (4, 2)
    assert report.counts["invalid_ops"] == 1  # the COMMIT; cancels are counted apart

    # the audit catches a cancelled message delivered all the same
    path = topic_path(warehouse, "ORDER")
    rows = DeltaTable(path).to_pyarrow_table()
    extra = rows.filter(pa.compute.equal(rows["body"], b"plain 10s")).to_pylist()[0]
    extra.update(
        body=b"plain 60s",
        msg_id=scheduled_plain.msg_id,
        transaction_id=scheduled_plain.msg_id,
        half_offset=scheduled_plain.half_offset,
        queue_offset=2,
        delivered_ms=T0 + 70_000,
    )
    write_deltalake(path, pa.Table.from_pylist([extra], schema=rows.schema), mode="append")
    assert verify(spark, cfg).differences_by_kind.get("delivered_cancelled") == 1


def test_a_message_cancelled_while_pending_stays_undelivered_after_a_discard(spark, warehouse):
    """An operator's COMMIT of a discarded message delivers it at once (its
    delay is not kept): it delivered a message cancelled while it was
    pending, which no cancelled message may be."""
    cfg = {"warehouse": warehouse, "check_max": 0}
    soon = fx.half(store_ms=T0, deliver_at_ms=T0 + 20_000)
    later = fx.half(store_ms=T0, deliver_at_ms=T0 + 600_000)
    fx.write_halves(warehouse, soon, later)
    reconcile(spark, cfg, now_ms=T0 + 1_000)
    fx.write_ops(
        warehouse, *[fx.op(h, CANCEL, source="ADMIN", store_ms=T0 + 1_500) for h in (soon, later)]
    )
    assert reconcile(spark, cfg, now_ms=T0 + 2_000).cancelled == 2
    assert reconcile(spark, cfg, now_ms=T0 + 7_000).discarded_max_checks == 2
    fx.write_ops(warehouse, fx.op(later, source="ADMIN", store_ms=T0 + 8_000))
    first = reconcile(spark, cfg, now_ms=T0 + 9_000)  # before its time
    fx.write_ops(warehouse, fx.op(soon, source="ADMIN", store_ms=T0 + 30_000))
    second = reconcile(spark, cfg, now_ms=T0 + 31_000)  # after it
    assert (first.committed, second.committed) == (0, 0)  # each was delivered: 1 and 1
    assert not DeltaTable.is_deltatable(topic_path(warehouse, "ORDER"))
    resolved = DeltaTable(table_path(warehouse, RESOLVED)).to_pyarrow_table().to_pylist()
    # each COMMIT wins all the same, and resolves its message
    assert sorted((r["half_offset"], r["action"]) for r in resolved) == sorted(
        (h["half_offset"], "COMMIT") for h in (soon, later)
    )
    report = verify(spark, cfg)
    assert report.ok, report.render()


def test_a_cancel_read_by_the_run_its_message_falls_due_in_is_late_as_already_due(spark, warehouse):
    """Such a cancel was rejected as naming an unknown message (a plain one,
    counted as invalid) or one already delivered (a transactional one)."""
    cfg = {"warehouse": warehouse}
    plain = fx.half(store_ms=T0, message_type="NORMAL", deliver_at_ms=T0 + 5_000)
    txn = fx.half(store_ms=T0, deliver_at_ms=T0 + 5_000)
    fx.write_halves(warehouse, plain, txn)
    fx.write_ops(warehouse, fx.op(txn, store_ms=T0 + 2_500))
    assert reconcile(spark, cfg, now_ms=T0 + 3_000).scheduled_after == 2
    cancels = [fx.op(h, CANCEL, source="ADMIN", store_ms=T0 + 5_500) for h in (plain, txn)]
    fx.write_ops(warehouse, *cancels)
    due = reconcile(spark, cfg, now_ms=T0 + 6_000)
    assert (due.delivered_scheduled, due.late_ops, due.invalid_ops) == (2, 2, 0)
    assert _rejected_ops(warehouse) == {
        c["op_offset"]: "LATE: message already due" for c in cancels
    }
    report = verify(spark, cfg)
    assert report.ok, report.render()


def _cancel_runs(spark, warehouse: str, crash: dict[int, str], monkeypatch) -> list:
    """Run 1 schedules a plain timer and holds two delayed transactional
    messages pending; run 2 reads a cancel of each (one in the same run as
    its ROLLBACK) and a cancel of a message not delayed; run 3, past the due
    time, reads the COMMIT of a cancelled one. `crash`: run number -> the
    step at which that run dies (then recovered). Returns the summaries of
    every run (None for one killed)."""
    cfg = {"warehouse": warehouse}
    t = T0
    due = t + 10_000
    halves = [
        fx.half(41, store_ms=t - 10, deliver_at_ms=due, message_type="NORMAL"),
        fx.half(42, store_ms=t - 10, deliver_at_ms=due),
        fx.half(43, store_ms=t - 10, deliver_at_ms=due),
        fx.half(44, store_ms=t - 10, message_type="NORMAL"),
    ]
    fx.write_halves(warehouse, *halves)
    admin = {"source": "ADMIN", "store_ms": t + 100}
    later_ops = {
        2: [
            fx.op(halves[0], CANCEL, op_offset=51, **admin),
            fx.op(halves[1], CANCEL, op_offset=52, **admin),
            fx.op(halves[2], CANCEL, op_offset=53, **admin),
            fx.op(halves[2], "ROLLBACK", op_offset=54, store_ms=t + 200),
            fx.op(halves[3], CANCEL, op_offset=55, **admin),
        ],
        3: [fx.op(halves[1], op_offset=56, store_ms=t + 15_000)],
    }
    summaries = []
    for number, now in ((1, t), (2, t + 1_000), (3, t + 20_000)):
        fx.write_ops(warehouse, *later_ops.get(number, []))
        summaries.append(fx.run_or_crash(spark, cfg, now, crash.get(number), monkeypatch))
    return summaries


def test_cancels_with_a_rollback_in_the_same_run_and_a_run_killed_at_their_writes(
    spark, tmp_path, monkeypatch
):
    clean = str(tmp_path / "clean")
    first, second, third = _cancel_runs(spark, clean, {}, monkeypatch)
    assert (first.scheduled, first.pending_after) == (1, 2)
    # the ROLLBACK and the cancel of one message in one run: both apply
    assert (second.cancelled, second.rolled_back, second.late_ops) == (3, 1, 1)
    # the plain timer falls due cancelled; the COMMIT of 42 resolves it, undelivered
    assert (third.committed, third.delivered_scheduled, third.pending_after) == (0, 0, 0)
    assert _bodies(clean) == [b"body-44"]
    resolved = DeltaTable(table_path(clean, RESOLVED)).to_pyarrow_table().to_pylist()
    assert sorted((r["half_offset"], r["action"]) for r in resolved) == [
        (42, "COMMIT"),
        (43, "ROLLBACK"),
        (44, "COMMIT"),
    ]
    report = verify(spark, {"warehouse": clean})
    assert report.ok, report.render()
    expected = fx.job_outputs(clean)
    assert len(expected["_sys/cancelled"]) == 3
    for crash in ({2: "after:_sys/cancelled"}, {3: "after:_sys/resolved"}):
        wh = str(tmp_path / f"{min(crash)}_{crash[min(crash)]}".replace("/", "_").replace(":", "_"))
        _cancel_runs(spark, wh, crash, monkeypatch)
        assert fx.job_outputs(wh) == expected, crash


def test_cancel_from_the_command_line_writes_the_admin_op(warehouse, capsys):
    clock = Clock(T0)
    with Broker.open(Config(warehouse=warehouse), clock=clock) as broker:
        plain = Producer(broker, "order_group")
        later = plain.send(Message(topic="ORDER", body=b"plain 60s", delay_ms=60_000))
        now = plain.send(Message(topic="ORDER", body=b"plain now"))
    args = ["cancel", "--warehouse", warehouse, "--msg-id", later.msg_id, "--remark", "paid"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f'"msg_id": "{later.msg_id}"' in printed and '"action": "CANCEL"' in printed
    ops = DeltaTable(table_path(warehouse, OP)).to_pyarrow_table().to_pylist()
    assert [(o["half_offset"], o["action"], o["source"], o["remark"]) for o in ops] == [
        (later.half_offset, CANCEL, "ADMIN", "paid")
    ]
    assert main(["cancel", "--warehouse", warehouse, "--msg-id", now.msg_id]) == 1
    assert "not a delayed message" in capsys.readouterr().err
    assert main(["cancel", "--warehouse", warehouse, "--msg-id", "no-such-id"]) == 1
    assert "no-such-id" in capsys.readouterr().err
    assert len(DeltaTable(table_path(warehouse, OP)).to_pyarrow_table()) == 1
