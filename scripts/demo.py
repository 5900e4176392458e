#!/usr/bin/env python3
"""The whole protocol on the embedded default: local warehouse, local Spark.

A demo producer sends orders whose local transactions end differently —
commit, rollback, unknown then answered by a back-check, never answered —
and the reconciliation job runs several times with an advancing clock
(`now_ms`, no waiting), showing what it delivered, checked and discarded.
An operator then overrides the discard, `verify` audits the result, and a
consumer reads the real topics.

    python scripts/demo.py [--warehouse ./warehouse/demo]
    python scripts/demo.py --s3-loopback          # the same on an S3 server on loopback
    TXN_WAREHOUSE=s3://bucket/prefix python scripts/demo.py   # on your bucket (TXN_S3_*)

A local warehouse is wiped at the start; on an object store the demo writes
under a fresh prefix of the warehouse (`demo-<time>`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
    load_config,
)
from txn_core.consumer import read_topic

from s3_loopback import Running

COMMIT = LocalTransactionState.COMMIT_MESSAGE
ROLLBACK = LocalTransactionState.ROLLBACK_MESSAGE
UNKNOWN = LocalTransactionState.UNKNOWN

# order -> (what the local transaction returns at send, what a back-check answers)
SCENARIO = {
    "order-1": (COMMIT, None),
    "order-2": (COMMIT, None),
    "order-3": (COMMIT, None),
    "order-4": (ROLLBACK, None),
    "order-5": (ROLLBACK, None),
    "order-6": (UNKNOWN, COMMIT),
    "order-7": (UNKNOWN, COMMIT),
    "order-8": (UNKNOWN, ROLLBACK),
    "order-9": (UNKNOWN, UNKNOWN),  # the local system never finds out
}


class OrderService(TransactionListener):
    """Stands in for a service with a local database: the outcome per order id."""

    def execute_local_transaction(self, msg, arg):
        if not isinstance(msg, Message):  # the invoice batch: one local transaction for all
            return COMMIT
        return SCENARIO[msg.keys][0]

    def check_local_transaction(self, msg):
        return SCENARIO[msg.keys][1]


class DemoClock:
    """The broker core's clock, advanced by the demo instead of by waiting."""

    def __init__(self):
        self.now = time.time_ns() // 1_000_000

    def __call__(self) -> int:
        return self.now


def show(label: str, s) -> None:
    print(
        f"  {label:<43} delivered {s.committed:>2}  rolled back {s.rolled_back:>2}  "
        f"check requests {s.check_requests:>2}  discarded {s.discarded_max_checks:>2}  "
        f"pending {s.pending_after:>2}"
    )


def s3_loopback() -> tuple[Running, dict]:
    """scripts/s3_loopback.py (MinIO) in a child process, and the settings that
    reach it."""
    # These credentials become the loopback server's; a real store needs yours.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo-secret")
    server = Running("minio", "demo")
    return server, {
        "warehouse": "s3://demo/warehouse",
        "s3_path_style": True,
        "s3_endpoint": server.endpoint,
        "s3_allow_http": True,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--warehouse",
        default=None,
        help="demo warehouse (default: the configuration's, else ./warehouse/demo);"
        " wiped at the start when local",
    )
    p.add_argument(
        "--s3-loopback",
        action="store_true",
        help="run against an S3 server started on loopback (scripts/s3_loopback.py)",
    )
    p.add_argument(
        "--conf", default=os.path.join(os.path.dirname(__file__), "..", "conf", "reconcile.toml")
    )
    args = p.parse_args(argv)
    server, overrides = s3_loopback() if args.s3_loopback else (None, {})
    try:
        return demo(args, overrides)
    finally:
        if server is not None:
            server.stop()


def demo(args, overrides: dict) -> int:
    warehouse = (
        args.warehouse
        or overrides.pop("warehouse", None)
        or os.environ.get("TXN_WAREHOUSE")
        or "./warehouse/demo"
    )
    if "://" in warehouse:  # an object store: a fresh prefix instead of a wipe
        warehouse = f"{warehouse.rstrip('/')}/demo-{int(time.time())}"
    else:
        shutil.rmtree(warehouse, ignore_errors=True)
    # check_max 3 instead of 15 keeps the demo short; every other rule is the default.
    config = load_config(args.conf, warehouse=warehouse, check_max=3, **overrides)

    print(f"1. Producer: orders and an invoice batch into {config.warehouse}")
    clock = DemoClock()
    t0 = clock.now
    broker = Broker.open(config, clock=clock)
    producer = TransactionProducer(broker, "order_group", OrderService())
    ids = {}
    for order in SCENARIO:
        result = producer.send_message_in_transaction(
            Message(
                topic="ORDER",
                body=f'{{"order": "{order}"}}'.encode(),
                keys=order,
                tags="created",
                properties={"source": "demo"},
            )
        )
        ids[order] = result.transaction_id
        print(f"  {order}: local transaction {result.local_state.value}")
    batch = producer.send_batch_in_transaction(
        [
            Message(topic="INVOICE", body=f"invoice {i}".encode(), keys=f"invoice-{i}")
            for i in range(5)
        ]
    )
    print(f"  invoice batch of {len(batch)}: {batch.local_state.value} (one commit, one OP commit)")

    print("\n2. Reconciliation runs (spark-submit jobs/reconcile.py run does the same):")
    from jobs.reconcile import reconcile
    from jobs.session import build_spark
    from jobs.verify import verify

    spark = build_spark("txn-demo")

    def run(label: str, after_s: int):
        clock.now = t0 + after_s * 1000
        summary = reconcile(spark, config, now_ms=clock.now)
        show(f"t+{after_s:>3}s {label}", summary)
        return summary

    run("(unknown ones still immune)", 1)
    run("(past transaction_timeout: checks)", 7)
    print(f"     producer answers {producer.answer_checks()} check request(s)")
    run("(answers applied; order-9 again)", 37)
    producer.answer_checks()
    run("(order-9: third check)", 67)
    producer.answer_checks()
    run("(order-9: checked 3 times: discard)", 97)

    print("\n3. An operator settles order-9 by hand (as resuming from TRANS_CHECK_MAX_TIME_TOPIC):")
    broker.resolve(ids["order-9"], commit=True, remark="customer confirmed by phone")
    run("(ADMIN commit overrides the discard)", 98)

    report = verify(spark, config)
    print(
        f"\n4. verify (full anti-join audit of the raw tables): "
        f"{'OK' if report.ok else 'DIFFERENCES'}"
    )
    if not report.ok:
        print(report.render())

    print("\n5. A consumer reads the real topics (delta-rs, no Spark):")
    for topic in ("ORDER", "INVOICE"):
        for row in read_topic(config, topic):
            print(
                f"  {topic:<8} queue {row['queue_id']} offset {row['queue_offset']}  "
                f"{row['keys']:<10} {row['body'].decode()}"
            )
    producer.close()
    broker.close()
    spark.stop()
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
