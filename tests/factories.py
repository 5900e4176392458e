"""Rows for the producer tables and the topics written directly with delta-rs,
so tests control every column (store_ms above all) without the broker core or
the job; a clock tests move by hand."""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from schemas import CHECK_ANSWERS, HALF, OP, TOPIC, table_path, topic_path
from schemas.arrow import arrow_schema
from txn_core.message import LocalTransactionState
from txn_core.producer import TransactionListener
from txn_core.storage import is_s3, object_key, options_for, registered
from txn_core.tables import ensure_broker_tables

_offsets = itertools.count(1)
GROUP = "order_group"


def half(
    half_offset: int | None = None,
    *,
    store_ms: int = 0,
    topic: str = "ORDER",
    queue_id: int = 0,
    group: str = GROUP,
    body: bytes | None = None,
    check_immunity_s: int | None = None,
    **extra,
) -> dict:
    off = next(_offsets) if half_offset is None else half_offset
    row = {
        "half_offset": off,
        "transaction_id": f"tx-{off}",
        "msg_id": f"msg-{off}",
        "producer_group": group,
        "topic": topic,
        "queue_id": queue_id,
        "tags": "created",
        "keys": f"order-{off}",
        "body": body if body is not None else f"body-{off}".encode(),
        "properties": {"k": "v", "n": str(off)},
        "born_ms": store_ms - 1,
        "store_ms": store_ms,
        "check_immunity_s": check_immunity_s,
    }
    row.update(extra)
    return row


def op(
    h: dict,
    action: str = "COMMIT",
    *,
    op_offset: int | None = None,
    source: str = "PRODUCER",
    store_ms: int | None = None,
    **extra,
) -> dict:
    row = {
        "op_offset": next(_offsets) + 10**9 if op_offset is None else op_offset,
        "half_offset": h["half_offset"],
        "transaction_id": h["transaction_id"],
        "producer_group": h["producer_group"],
        "action": action,
        "source": source,
        "store_ms": h["store_ms"] + 1 if store_ms is None else store_ms,
        "remark": None,
    }
    row.update(extra)
    return row


def answer(request_id: str, h: dict, answer_: str = "UNKNOWN", *, answered_ms: int = 0) -> dict:
    return {
        "request_id": request_id,
        "half_offset": h["half_offset"],
        "transaction_id": h["transaction_id"],
        "producer_group": h["producer_group"],
        "answer": answer_,
        "answered_ms": answered_ms,
        "error": None,
    }


def _append(warehouse: str, table, rows: Iterable[dict]) -> None:
    rows = list(rows)
    if not rows:
        return
    ensure_broker_tables(warehouse)
    # pyarrow builds map columns from (key, value) pairs
    rows = [
        {k: (list(v.items()) if isinstance(v, dict) else v) for k, v in r.items()} for r in rows
    ]
    path = table_path(warehouse, table)
    write_deltalake(
        path,
        pa.Table.from_pylist(rows, schema=arrow_schema(table)),
        mode="append",
        storage_options=options_for(path),
    )


def write_halves(warehouse: str, *rows: dict) -> None:
    """One commit (one table version) holding `rows`."""
    _append(warehouse, HALF, rows)


def write_ops(warehouse: str, *rows: dict) -> None:
    _append(warehouse, OP, rows)


def write_answers(warehouse: str, *rows: dict) -> None:
    _append(warehouse, CHECK_ANSWERS, rows)


# --- columns for the broker core's writers (txn_core.group_commit) ---

#: the store_ms a writer stamps in the writer tests
STORE_MS = 1234


def op_rows(offsets: list[int]) -> dict[str, list]:
    """OP columns for `offsets` (all but store_ms, which the writer stamps)."""
    n = len(offsets)
    return {
        "op_offset": offsets,
        "half_offset": offsets,
        "transaction_id": [f"tx-{o}" for o in offsets],
        "producer_group": ["g"] * n,
        "action": ["COMMIT"] * n,
        "source": ["PRODUCER"] * n,
        "remark": [None] * n,
    }


class DecideByBody(TransactionListener):
    """Decides each message by its body: b"commit…" commits, b"rollback…"
    rolls back, anything else is UNKNOWN; a back-check answers `on_check`."""

    def __init__(self, on_check: LocalTransactionState = LocalTransactionState.UNKNOWN):
        self.on_check = on_check

    def execute_local_transaction(self, msg, arg):
        if msg.body.startswith(b"commit"):
            return LocalTransactionState.COMMIT_MESSAGE
        if msg.body.startswith(b"rollback"):
            return LocalTransactionState.ROLLBACK_MESSAGE
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg):
        return self.on_check


class Panic(BaseException):
    """What a Rust library's panic raises in Python (pyo3's PanicException):
    not an Exception, so a thread that catches only those ends at one."""


def panicking_once(call: Callable[[], Any], next_call: threading.Event) -> Callable[[], Any]:
    """`call`, except that its first call raises Panic; `next_call` is set
    when a later one starts (a test waits on it, not on the clock)."""
    calls = []

    def once() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise Panic("called `Option::unwrap()` on a `None` value")
        next_call.set()
        return call()

    return once


# --- topic rows, as the job delivers them (for consumers) ---


class Clock:
    """A clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def topic_row(queue_id: int, queue_offset: int) -> dict:
    n = f"{queue_id}-{queue_offset}"
    return {
        "queue_id": queue_id,
        "queue_offset": queue_offset,
        "msg_id": f"msg-{n}",
        "transaction_id": f"tx-{n}",
        "half_offset": queue_id * 1000 + queue_offset,
        "producer_group": "order_group",
        "tags": "created",
        "keys": f"order-{n}",
        "body": f"body-{n}".encode(),
        "properties": [("n", n)],
        "born_ms": 10,
        "commit_ms": 20,
        "delivered_ms": 30,
        "run_id": "run-1",
    }


def deliver(warehouse: str, topic: str = "ORDER", **offsets_by_queue: range) -> None:
    """One commit of topic rows: `q0=range(0, 3)` delivers offsets 0..2 of queue 0."""
    rows = [
        topic_row(int(name[1:]), offset)
        for name, offsets in offsets_by_queue.items()
        for offset in offsets
    ]
    path = topic_path(warehouse, topic)
    write_deltalake(
        path,
        pa.Table.from_pylist(rows, schema=arrow_schema(TOPIC)),
        mode="append",
        storage_options=options_for(path),
    )


#: producer-side and lease tables are not outputs of the job
NOT_OUTPUTS = {"_sys/half", "_sys/op", "_sys/check_answers", "_sys/producers", "_sys/lease"}
#: wall-clock columns: the only ones allowed to differ between a redo and a clean run
WALL_CLOCK = {"started_ms", "ended_ms", "summary_json", "duration_ms"}


def run_or_crash(spark, cfg: dict, now_ms: int, crash: str | None, monkeypatch):
    """A run at `now_ms`, its summary; with `crash` (a TXN_FAULT_AT step) it
    dies there and is recovered, as the next invocation would (None)."""
    import time

    import pytest

    from jobs.faults import InjectedFault
    from jobs.reconcile import reconcile, recover

    if crash is None:
        return reconcile(spark, cfg, now_ms=now_ms)
    monkeypatch.setenv("TXN_FAULT_AT", crash)
    with pytest.raises(InjectedFault):
        reconcile(spark, cfg, now_ms=now_ms)
    monkeypatch.delenv("TXN_FAULT_AT")
    assert recover(spark, cfg, clock=lambda: time.time() + 3600) is not None
    return None


def job_outputs(warehouse: str) -> dict[str, list]:
    """Every output table of the job on a local `warehouse` (wall-clock
    columns removed), order-independent: a redo must leave them as a clean
    run does."""
    tables = {}
    for root, dirs, _ in os.walk(warehouse):
        if "_delta_log" not in dirs:
            continue
        dirs.clear()
        name = os.path.relpath(root, warehouse)
        if name in NOT_OUTPUTS:
            continue
        rows = DeltaTable(root).to_pyarrow_table().to_pylist()
        tables[name] = sorted(
            repr(sorted((k, _unordered(v)) for k, v in r.items() if k not in WALL_CLOCK))
            for r in rows
        )
    return tables


def _unordered(value):
    """Maps compare as sets of entries: Delta does not promise their order."""
    return sorted(value) if isinstance(value, list) else value


@contextmanager
def arrow_frames_parallelized(spark) -> Iterator[None]:
    """Within it, Spark parallelizes every DataFrame made from Arrow, as it
    does those over its local-relation threshold (48 MB: the backlog of a
    steady load), where it makes a partition of each Arrow chunk."""
    key = "spark.sql.execution.arrow.localRelationThreshold"
    kept = spark.conf.get(key)
    spark.conf.set(key, "0")
    try:
        yield
    finally:
        spark.conf.set(key, kept)


def logged_versions(path: str) -> list[int]:
    """The versions whose commits a local table's log still holds."""
    names = os.listdir(os.path.join(path, "_delta_log"))
    return sorted(int(n.split(".")[0]) for n in names if n.endswith(".json") and n[0].isdigit())


def delete_table(uri: str) -> None:
    """Every file of the table at `uri`: a local directory, or the objects
    under its prefix in a registered S3 warehouse (as an operator deleting
    it would leave nothing)."""
    if not is_s3(uri):
        shutil.rmtree(uri)
        return
    storage = registered(uri)
    assert storage is not None, f"{uri} is in no registered warehouse"
    client = storage.s3_client()
    listed = client.list_objects_v2(Bucket=storage.bucket, Prefix=object_key(uri) + "/")
    for item in listed.get("Contents", []):
        client.delete_object(Bucket=storage.bucket, Key=item["Key"])
