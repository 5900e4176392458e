"""Blind appends without delta-rs' commit path (txn_core.local_append): the
table they leave must be the one delta-rs would have left, shareable with
delta-rs writers and other appenders."""
from __future__ import annotations

import json
import os
import threading

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake

from schemas import HALF, OP, table_path
from schemas.arrow import arrow_schema
from txn_core import PersistError
from txn_core.group_commit import GroupCommitWriter, to_arrow
from txn_core.local_append import LocalAppender, TableChanged, unsupported_reason
from txn_core.tables import open_or_create

from test_group_commit import STORE_MS, op_rows


def half_rows(offsets: list[int]) -> pa.Table:
    n = len(offsets)
    return to_arrow(arrow_schema(HALF), {
        "half_offset": offsets, "transaction_id": [f"TX{o:030d}" for o in offsets],
        "msg_id": [f"M{o}" for o in offsets], "producer_group": ["orders"] * n,
        "topic": ["ORDER", "PAYMENT\u00e9"] * (n // 2) + ["ORDER"] * (n % 2),
        "queue_id": [o % 4 for o in offsets], "tags": [None] * n,
        "keys": [None if o % 3 else f"k{o}" for o in offsets],
        "body": [bytes([o % 256]) * 100 for o in offsets],
        "properties": [[("a", str(o))] if o % 2 else [] for o in offsets],
        "born_ms": [1_000 + o for o in offsets], "check_immunity_s": [None] * n},
        "store_ms", STORE_MS)


def add_actions(path: str) -> list[dict]:
    log = os.path.join(path, "_delta_log")
    adds = []
    for name in sorted(os.listdir(log)):
        if name.endswith(".json"):
            with open(os.path.join(log, name)) as f:
                adds += [json.loads(line)["add"] for line in f if '"add"' in line]
    return adds


def test_an_append_reads_back_as_if_delta_rs_had_written_it(tmp_path):
    ours = open_or_create(str(tmp_path / "ours"), HALF)
    theirs = open_or_create(str(tmp_path / "theirs"), HALF)
    rows = half_rows(list(range(7)))
    assert LocalAppender(ours, arrow_schema(HALF)).append(rows) == 1
    write_deltalake(theirs, rows, mode="append")

    ours, theirs = DeltaTable(ours.table_uri), DeltaTable(theirs.table_uri)
    assert ours.version() == theirs.version() == 1
    assert ours.to_pyarrow_table().sort_by("half_offset").equals(
        theirs.to_pyarrow_table().sort_by("half_offset"))
    # the same statistics: delta-rs' own readers skip files by them
    [mine], [its] = add_actions(ours.table_uri[7:]), add_actions(theirs.table_uri[7:])
    assert json.loads(mine["stats"]) == json.loads(its["stats"])
    assert mine["dataChange"] is True and mine["size"] == os.path.getsize(
        os.path.join(ours.table_uri[7:], mine["path"]))
    # a filtered read by a column without numeric stats finds the row
    found = ours.to_pyarrow_dataset().to_table(
        filter=pc.field("transaction_id") == f"TX{3:030d}")
    assert found["half_offset"].to_pylist() == [3]
    feed = pa.table(ours.load_cdf(starting_version=1)).to_pylist()
    assert {(r["_change_type"], r["_commit_version"]) for r in feed} == {("insert", 1)}


def test_appenders_and_delta_rs_writers_share_a_table(warehouse):
    table = open_or_create(warehouse, OP)
    path, schema = table_path(warehouse, OP), arrow_schema(OP)
    first, second = LocalAppender(table, schema), LocalAppender(DeltaTable(path), schema)

    def rows(o: int) -> pa.Table:
        return to_arrow(schema, op_rows([o]), "store_ms", STORE_MS)

    versions = [first.append(rows(0)), second.append(rows(1))]  # second lost version 1
    write_deltalake(DeltaTable(path), rows(2), mode="append")
    versions += [first.append(rows(3)), second.append(rows(4))]
    assert versions == [1, 2, 4, 5]

    def send(offsets: range) -> None:  # racing from threads, each with its own appender
        mine = LocalAppender(DeltaTable(path), schema)
        for o in offsets:
            mine.append(rows(o))

    threads = [threading.Thread(target=send, args=(range(10 + 10 * t, 20 + 10 * t),))
               for t in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    final = DeltaTable(path)
    assert final.version() == 45  # no version lost, none taken twice
    assert sorted(final.to_pyarrow_table()["op_offset"].to_pylist()) == \
        [0, 1, 2, 3, 4] + list(range(10, 50))
    assert not [n for n in os.listdir(os.path.join(path, "_delta_log")) if n.endswith(".tmp")]


def test_nulls_in_a_not_null_column_are_refused_and_nothing_is_written(warehouse):
    table = open_or_create(warehouse, OP)
    schema = arrow_schema(OP)
    columns = op_rows([1, 2])
    columns["transaction_id"] = ["tx-1", None]
    rows = pa.Table.from_arrays(
        [pa.array(columns.get(f.name, [STORE_MS] * 2), type=f.type) for f in schema],
        schema=schema)
    before = sorted(os.listdir(table_path(warehouse, OP)))
    with pytest.raises(ValueError, match=r"NOT NULL column\(s\) \['transaction_id'\]"):
        LocalAppender(table, schema).append(rows)
    assert sorted(os.listdir(table_path(warehouse, OP))) == before
    assert DeltaTable(table_path(warehouse, OP)).version() == 0


def test_a_protocol_or_metadata_change_stops_the_appender_and_delta_rs_takes_over(warehouse):
    table = open_or_create(warehouse, OP)
    path, schema = table_path(warehouse, OP), arrow_schema(OP)
    stale = LocalAppender(table, schema)
    assert stale.append(to_arrow(schema, op_rows([1]), "store_ms", STORE_MS)) == 1
    writer = GroupCommitWriter(DeltaTable(path), schema, name=OP.path,
                               clock=lambda: STORE_MS)
    DeltaTable(path).alter.add_constraint({"positive_offset": "op_offset > 0"})  # version 2
    files = set(os.listdir(path))
    with pytest.raises(TableChanged, match="delta.constraints.positive_offset"):
        stale.append(to_arrow(schema, op_rows([2]), "store_ms", STORE_MS))
    assert set(os.listdir(path)) == files  # its parquet file is gone again

    # The group-commit writer goes on through delta-rs, which enforces the constraint.
    assert writer.submit(op_rows([3])).result(10) == 3
    with pytest.raises(PersistError, match="failed validation check"):
        writer.submit(op_rows([-1])).result(10)
    writer.close()
    assert sorted(DeltaTable(path).to_pyarrow_table()["op_offset"].to_pylist()) == [1, 3]


def test_tables_it_cannot_write_are_named_with_the_reason(tmp_path):
    schema = arrow_schema(OP)
    partitioned = str(tmp_path / "partitioned")
    write_deltalake(partitioned, to_arrow(schema, op_rows([1]), "store_ms", STORE_MS),
                    partition_by=["action"])
    assert "partitioned by ['action']" in unsupported_reason(DeltaTable(partitioned), schema)
    with pytest.raises(ValueError, match="cannot append to .*partitioned"):
        LocalAppender(DeltaTable(partitioned), schema)
    other = open_or_create(str(tmp_path / "half"), HALF)
    assert unsupported_reason(other, schema) == "the table's schema differs from the rows'"
    assert unsupported_reason(other, arrow_schema(HALF)) is None
