"""Reading a real topic's committed messages without a JVM (delta-rs).

A consumer keeps its own position per queue — the next `queue_offset` to
read — exactly as a RocketMQ consumer keeps its consume offset. Offsets are
dense from 0 per (topic, queue_id), so "everything from offset N" is a
simple filter, and a consumer that commits its position after processing
reads each message once.

>>> for row in read_topic("./warehouse", "ORDER", queue_id=0, from_queue_offset=0):
...     handle(row["body"])                                        # doctest: +SKIP

A consumer group keeps those positions in the warehouse instead
(`txn_core.consumer_group`; its `Consumer` and `PushConsumer` can be imported
from here too).
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from schemas import topic_path
from txn_core import forks
from txn_core.broker import Broker
from txn_core.config import Config, int_in_range
from txn_core.consumer_group import ConsumedMessage, Consumer, PushConsumer
from txn_core.message import QUEUE_ID_MAX, QUEUE_OFFSET_MAX, validate_topic
from txn_core.storage import options_for, resolve_warehouse
from txn_core.tables import MissingTableError, check_topic_table

__all__ = ["ConsumedMessage", "Consumer", "PushConsumer", "read_topic"]


def read_topic(
    warehouse: str | os.PathLike[str] | Config | Broker,
    topic: str,
    *,
    queue_id: int | None = None,
    from_queue_offset: int = 0,
    limit: int | None = None,
    storage_options: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Delivered messages of `topic`, in (queue_id, queue_offset) order:
    from `from_queue_offset` on, of one queue or all, at most `limit`.

    `warehouse` is a path or URI, a Config (an S3 warehouse's endpoint
    settings come with it) or a Broker. Raises MissingTableError when nothing was ever
    delivered to the topic. A page of one queue (`queue_id` and `limit`)
    reads only the files that may hold it.
    """
    forks.note_use("read_topic")
    validate_topic(topic)
    from_queue_offset = int_in_range("from_queue_offset", from_queue_offset, 0, QUEUE_OFFSET_MAX)
    if queue_id is not None:
        queue_id = int_in_range("queue_id", queue_id, 0, QUEUE_ID_MAX)
    if limit is not None:
        limit = int_in_range("limit", limit, 0, QUEUE_OFFSET_MAX)
    # as producers and the job name it (`~`, a relative path, s3://); it only reads
    warehouse, storage_options = resolve_warehouse(warehouse, storage_options, check=False)
    uri = topic_path(warehouse, topic)
    try:
        table = DeltaTable(uri, storage_options=options_for(uri, storage_options))
    except TableNotFoundError:
        raise MissingTableError(
            f"topic {topic!r} has no table under {warehouse} yet (nothing delivered to it)"
        ) from None
    check_topic_table(table, topic)
    condition = pc.field("queue_offset") >= from_queue_offset
    files = f"queue_offset >= {from_queue_offset}"
    if queue_id is not None:
        condition = condition & (pc.field("queue_id") == queue_id)
        files += f" AND queue_id = {queue_id}"
    rows = None
    if limit is not None and queue_id is not None:
        # A queue's offsets are dense, so its first `limit` rows lie below
        # from_queue_offset + limit: a backlog is not read whole for a page
        # of it. Fewer found (its end, or rows someone deleted): read on
        # without the bound.
        end = min(from_queue_offset + limit, QUEUE_OFFSET_MAX)
        rows = _read(
            table,
            files + f" AND queue_offset < {end}",
            condition & (pc.field("queue_offset") < end),
        )
        if rows.num_rows < limit:
            rows = None
    if rows is None:
        rows = _read(table, files, condition)
    rows = rows.sort_by([("queue_id", "ascending"), ("queue_offset", "ascending")])
    if limit is not None:
        rows = rows.slice(0, limit)
    messages: list[dict[str, Any]] = rows.to_pylist()
    return messages


def _read(table: DeltaTable, files: str, condition: pc.Expression) -> pa.Table:
    """The rows matching `condition`, opening only the files whose
    statistics may hold rows matching `files` (SQL text)."""
    return table.to_pyarrow_dataset(file_pruning_predicate=files).to_table(filter=condition)
