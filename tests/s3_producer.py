"""A producer process for the object-store tests: sends from several threads
to the warehouse of the configuration given as JSON, then prints what it sent.

    python tests/s3_producer.py '{"warehouse": "s3://…", …}' MESSAGES_PER_THREAD
"""

from __future__ import annotations

import json
import os
import sys
import threading

from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
    load_config,
)

THREADS = 4
BATCH = 20


class CommitAll(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT_MESSAGE

    def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT_MESSAGE


def main() -> None:
    config = load_config(env={}, **json.loads(sys.argv[1]))
    per_thread = int(sys.argv[2])
    broker = Broker.open(config)
    producer = TransactionProducer(broker, group="s3_group", listener=CommitAll())
    sent: list[list] = []
    failures: list[str] = []
    lock = threading.Lock()

    def send(thread: int) -> None:
        for i in range(per_thread):
            try:
                result = producer.send_message_in_transaction(
                    Message(topic="ORDER", body=f"{thread}-{i}".encode(), keys=f"k{thread}-{i}")
                )
            except Exception as exc:  # noqa: BLE001 - reported to the test
                with lock:
                    failures.append(f"send: {exc!r}")
                continue
            with lock:
                sent.append([result.transaction_id, result.half_offset])
                if not result.op_written:
                    failures.append(f"op: {result.op_error!r}")

    threads = [threading.Thread(target=send, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    batch = producer.send_batch_in_transaction(
        [Message(topic="ORDER", body=b"batch", keys=f"b{i}") for i in range(BATCH)]
    )
    for t in threads:
        t.join()
    sent.extend([tx, off] for tx, off in zip(batch.transaction_ids, batch.half_offsets))
    print(
        json.dumps({"sent": sent, "failures": failures, "committers": broker.committers}),
        flush=True,
    )
    producer.close()
    broker.close()


if __name__ == "__main__":
    main()
    # Everything is sent and printed by now; the interpreter's teardown can
    # abort in pyarrow's threads (docs/operating.md, "A process's exit code").
    os._exit(0)
