"""Reading a group's offsets opens the newest files of `_sys/consumer_offsets`
first, and an older one only where the log's statistics cannot prove it
superseded (`txn_core.superseded`): the result is always that of reading
every file."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from schemas import CONSUMER_OFFSETS, table_path
from schemas.arrow import arrow_schema
from txn_core.consumer_group import CorruptOffsetError, read_committed_offsets
from txn_core.tables import open_or_create


def append(warehouse: str, rows: list[dict]) -> None:
    """One file, as one member's commit makes."""
    write_deltalake(
        table_path(warehouse, CONSUMER_OFFSETS),
        pa.Table.from_pylist(rows, schema=arrow_schema(CONSUMER_OFFSETS)),
        mode="append",
    )


def row(group: str, queue_id: int, next_offset: int, committed_ms: int) -> dict:
    return {
        "group": group,
        "topic": "ORDER",
        "queue_id": queue_id,
        "next_offset": next_offset,
        "member": "m",
        "committed_ms": committed_ms,
    }


def from_every_row(rows: list[dict], group: str) -> dict[int, int]:
    """The reader's rule over all rows: newest committed_ms, ties to the highest offset."""
    newest: dict[int, tuple[int, int]] = {}
    for r in rows:
        if r["group"] == group and r["topic"] == "ORDER":
            key = (r["committed_ms"], r["next_offset"])
            newest[r["queue_id"]] = max(key, newest.get(r["queue_id"], key))
    return {queue_id: key[1] for queue_id, key in newest.items()}


@pytest.mark.parametrize("seed", [1, 2])
def test_the_newest_first_read_equals_reading_every_file(warehouse, seed):
    rng = random.Random(seed)
    open_or_create(warehouse, CONSUMER_OFFSETS)
    written: list[dict] = []
    ms = 1_000
    for _ in range(100):
        ms += rng.choice([0, 1, 5])  # equal committed_ms in different files: ties
        group = rng.choice(["billing", "billing", "audit"])
        rows = [
            # now and then a row older than the file before it: another member's clock behind
            row(group, q, rng.randint(0, 10_000), ms - rng.choice([0, 0, 0, 300]))
            for q in rng.sample(range(8), rng.randint(1, 4))
        ]
        append(warehouse, rows)
        written += rows
    for group in ["billing", "audit", "nobody"]:
        assert read_committed_offsets(warehouse, group, "ORDER") == from_every_row(written, group)


def test_a_steady_members_offsets_are_read_from_its_newest_files(warehouse, opened_files):
    open_or_create(warehouse, CONSUMER_OFFSETS)
    for n in range(60):
        append(warehouse, [row("billing", q, n + 1, 1_000 + n) for q in range(4)])
    assert read_committed_offsets(warehouse, "billing", "ORDER") == dict.fromkeys(range(4), 60)
    assert [n for _, n in opened_files] == [16]


def test_a_queue_committed_only_long_ago_is_read_from_its_old_file(warehouse, opened_files):
    open_or_create(warehouse, CONSUMER_OFFSETS)
    append(warehouse, [row("billing", 7, 5, 500)])
    for n in range(40):
        append(warehouse, [row("billing", q, n + 1, 1_000 + n) for q in range(4)])
    expected = {**dict.fromkeys(range(4), 40), 7: 5}
    assert read_committed_offsets(warehouse, "billing", "ORDER") == expected
    assert [n for _, n in opened_files] == [16, 41]


def test_a_corrupt_row_in_an_old_file_is_still_found(warehouse):
    open_or_create(warehouse, CONSUMER_OFFSETS)
    append(warehouse, [row("billing", 2, -1, 500)])
    for n in range(40):
        append(warehouse, [row("billing", q, n + 1, 1_000 + n) for q in range(4)])
    with pytest.raises(CorruptOffsetError, match="queue 2 is corrupt"):
        read_committed_offsets(warehouse, "billing", "ORDER")


def test_an_old_file_spanning_queues_is_read_for_the_queue_only_it_has(warehouse):
    """Its statistics say queues 0 to 7; 0 to 3 are newer elsewhere, 7 is not."""
    open_or_create(warehouse, CONSUMER_OFFSETS)
    append(warehouse, [row("billing", 0, 3, 500), row("billing", 7, 5, 500)])
    for n in range(40):
        append(warehouse, [row("billing", q, n + 1, 1_000 + n) for q in range(4)])
    expected = {**dict.fromkeys(range(4), 40), 7: 5}
    assert read_committed_offsets(warehouse, "billing", "ORDER") == expected


def test_an_old_file_tied_with_a_newer_files_row_is_read(warehouse):
    """A newer file (by its newest row) holds queue 0's row of the same
    committed_ms as an older file's: the tie goes to the higher offset, 99."""
    open_or_create(warehouse, CONSUMER_OFFSETS)
    append(warehouse, [row("billing", 0, 99, 1_000)])
    for n in range(40):
        append(warehouse, [row("billing", 1, n + 1, 2_000 + n)])
    append(warehouse, [row("billing", 0, 5, 1_000), row("billing", 1, 41, 3_000)])
    assert read_committed_offsets(warehouse, "billing", "ORDER") == {0: 99, 1: 41}
