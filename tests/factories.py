"""Rows for the producer tables written directly with delta-rs, so tests
control every column (store_ms above all) without the broker core."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pyarrow as pa
from deltalake import write_deltalake

from schemas import CHECK_ANSWERS, HALF, OP, table_path
from schemas.arrow import arrow_schema
from txn_core.storage import options_for
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
