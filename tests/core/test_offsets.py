"""I1: half and op offsets are unique with many threads and processes writing."""

import multiprocessing
import threading

import pyarrow.compute as pc
from deltalake import DeltaTable

from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
)
from txn_core.offsets import OffsetAllocator

PROCESSES, THREADS, SENDS = 4, 4, 10


class Alternating(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return arg

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOWN


def _send_from_threads(warehouse, start, out):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Alternating())
        start.wait()
        errors = []

        def send(t):
            try:
                for i in range(SENDS):
                    state = (
                        LocalTransactionState.COMMIT_MESSAGE
                        if (t + i) % 3
                        else LocalTransactionState.ROLLBACK_MESSAGE
                    )
                    producer.send_message_in_transaction(Message(topic="T", body=b"x"), state)
                # one batch per thread too: all-or-none, offsets from the same allocator
                producer.send_batch_in_transaction(
                    [Message(topic="T", body=b"b")] * 3, LocalTransactionState.COMMIT_MESSAGE
                )
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                errors.append(repr(exc))

        threads = [threading.Thread(target=send, args=(t,)) for t in range(THREADS)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        out.put((broker.epoch, errors))


def test_offsets_unique_across_processes_and_threads(warehouse):
    Broker.open(warehouse).close()  # create tables up front, as a deployment would
    ctx = multiprocessing.get_context("spawn")  # delta-rs does not survive fork
    start, out = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [
        ctx.Process(target=_send_from_threads, args=(warehouse, start, out))
        for _ in range(PROCESSES)
    ]
    [p.start() for p in procs]
    reports = [out.get(timeout=300) for _ in procs]
    [p.join(timeout=60) for p in procs]
    assert [errors for _, errors in reports] == [[]] * PROCESSES
    assert len({epoch for epoch, _ in reports}) == PROCESSES

    per_thread = SENDS + 3
    halves = DeltaTable(f"{warehouse}/_sys/half").to_pyarrow_table()
    ops = DeltaTable(f"{warehouse}/_sys/op").to_pyarrow_table()
    assert halves.num_rows == PROCESSES * THREADS * per_thread
    assert pc.count_distinct(halves["half_offset"]).as_py() == halves.num_rows
    assert ops.num_rows == halves.num_rows  # every send decided
    assert pc.count_distinct(ops["op_offset"]).as_py() == ops.num_rows
    # half and op offsets come from one allocator per broker: disjoint sets
    assert not set(halves["half_offset"].to_pylist()) & set(ops["op_offset"].to_pylist())
    # every OP names a stored half with its own transaction id
    by_offset = dict(zip(halves["half_offset"].to_pylist(), halves["transaction_id"].to_pylist()))
    assert all(
        by_offset[h] == t
        for h, t in zip(ops["half_offset"].to_pylist(), ops["transaction_id"].to_pylist())
    )


def test_allocator_moves_to_a_new_epoch_when_the_sequence_is_used_up():
    epochs = iter([7, 8])
    alloc = OffsetAllocator(next(epochs), lambda: next(epochs))
    alloc._counter = iter([2**32 - 2])  # nearly exhausted
    first = alloc.take(4)
    assert alloc.epoch == 8 and first == [(8 << 32) | i for i in range(4)]
    assert alloc.take(1) == [(8 << 32) | 4]
