"""The whole protocol through the broker core: send, reconcile, answer checks, resolve."""

from __future__ import annotations

import time

from deltalake import DeltaTable

from jobs.reconcile import main, reconcile
from schemas import topic_path
from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
)

S = LocalTransactionState


class Listener(TransactionListener):
    """Local outcome and check answer chosen by the message's keys."""

    def __init__(self):
        self.local = {"a": S.COMMIT_MESSAGE, "b": S.ROLLBACK_MESSAGE}
        self.check = {"c": S.COMMIT_MESSAGE}

    def execute_local_transaction(self, msg, arg):
        return self.local.get(msg.keys, S.UNKNOWN)

    def check_local_transaction(self, msg):
        return self.check.get(msg.keys, S.UNKNOWN)


def test_send_reconcile_check_and_resolve(spark, warehouse, capsys):
    cfg = {"warehouse": warehouse}
    broker = Broker.open(warehouse)
    producer = TransactionProducer(broker, group="order_group", listener=Listener())
    sent = {
        k: producer.send_message_in_transaction(
            Message(
                topic="ORDER", body=f"body-{k}".encode(), keys=k, tags="t", properties={"p": k}
            ),
            arg=None,
        )
        for k in "abcd"
    }
    now = int(time.time() * 1000) + 7_000

    first = reconcile(spark, cfg, now_ms=now)
    assert (first.committed, first.rolled_back, first.check_requests) == (1, 1, 2)

    assert producer.answer_checks() == 2  # c answers COMMIT, d UNKNOWN
    second = reconcile(spark, cfg, now_ms=now + 30_000)
    assert (second.committed, second.check_requests) == (1, 1)

    assert (
        main(
            [
                "resolve",
                "--warehouse",
                warehouse,
                "--transaction-id",
                sent["d"].transaction_id,
                "--commit",
                "--remark",
                "ticket 42",
            ]
        )
        == 0
    )
    assert (
        main(["resolve", "--warehouse", warehouse, "--transaction-id", "no-such-tx", "--rollback"])
        == 1
    )
    assert "no-such-tx" in capsys.readouterr().err
    third = reconcile(spark, cfg, now_ms=now + 31_000)
    assert third.committed == 1 and third.pending_after == 0

    delivered = DeltaTable(topic_path(warehouse, "ORDER")).to_pyarrow_table().to_pylist()
    assert sorted((r["queue_offset"], r["keys"], r["body"]) for r in delivered) == [
        (0, "a", b"body-a"),
        (1, "c", b"body-c"),
        (2, "d", b"body-d"),
    ]
    producer.close()
    broker.close()
