"""Which files of `_sys/consumer_offsets` a read of a group's offsets may
leave unopened.

Every commit of a member adds a file, and until maintenance deletes the
superseded rows a read that opened them all grew with them
(docs/performance.md, "Reading only the consumer files that can matter").
A group's offsets are the newest row per queue, so the reader opens the
newest files first (`committed_ms >= cutoff`) and stops as soon as the
log's statistics prove that every older file holds only valid rows, each
for a queue it already has a strictly newer row of. Anything the
statistics cannot prove (no statistics, nulls, a negative value, a tie) is
read, so the result and the corrupt-row errors are those of reading every file.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

#: how many of the newest files the first try opens, then 8 times more at each
FIRST_FILES = 16
#: a file whose queue ids span more than this is read rather than checked queue by queue
MAX_QUEUE_SPAN = 4096


def cutoffs(actions: pa.Table) -> list[int | None]:
    """The `committed_ms` cutoffs to try, newest first, ending in None (every
    file). `actions` is `DeltaTable.get_add_actions(flatten=True)`."""
    if "max.committed_ms" not in actions.column_names:
        return [None]
    newest_first = sorted(
        (ms for ms in actions["max.committed_ms"].to_pylist() if ms is not None), reverse=True
    )
    tries: list[int | None] = []
    files = FIRST_FILES
    while files < len(newest_first):
        tries.append(newest_first[files - 1])
        files *= 8
    return [*tries, None]


def older_files_superseded(
    actions: pa.Table, cutoff: int, group: str, topic: str, newest: dict[int, tuple[int, int]]
) -> bool:
    """Whether every file whose rows are all older than `cutoff` can be left
    unread: not the group's and topic's by its statistics, or only valid rows
    of queues that `newest` ((committed_ms, next_offset) per queue, from the
    files at or after the cutoff) holds a strictly newer row of."""
    for f in actions.to_pylist():
        max_ms = f.get("max.committed_ms")
        if max_ms is None or max_ms >= cutoff:
            continue  # read at this cutoff
        if not _may_hold(f, "group", group) or not _may_hold(f, "topic", topic):
            continue
        if not _valid(f):
            return False
        low, high = f["min.queue_id"], f["max.queue_id"]
        if high - low > MAX_QUEUE_SPAN:
            return False
        for queue_id in range(low, high + 1):
            if queue_id not in newest or newest[queue_id][0] <= max_ms:
                return False
    return True


def _may_hold(f: dict[str, Any], column: str, value: str) -> bool:
    low, high = f.get(f"min.{column}"), f.get(f"max.{column}")
    if low is None or high is None:
        return True
    # Long strings' bounds may be cut short: a cut min is still below, a cut max is rounded up.
    return bool(low <= value <= high or high.startswith(value[: len(high)]))


def _valid(f: dict[str, Any]) -> bool:
    """Whether the statistics prove every row's queue_id, next_offset and
    committed_ms set, and its queue_id and next_offset not negative (as the
    reader requires)."""
    for column in ("queue_id", "next_offset", "committed_ms"):
        if f.get(f"null_count.{column}") != 0 or None in (
            f.get(f"min.{column}"),
            f.get(f"max.{column}"),
        ):
            return False
    return bool(f["min.queue_id"] >= 0 and f["min.next_offset"] >= 0)
