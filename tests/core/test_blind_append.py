"""Blind appends without delta-rs' commit path (txn_core.blind_append): the
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

from schemas import CONSUMER_MEMBERS, HALF, OP, table_path
from schemas.arrow import arrow_schema
from txn_core import PersistError
from txn_core.blind_append import (
    BlindAppender,
    EntryOutcomeUnknown,
    TableChanged,
    unsupported_reason,
)
from txn_core.group_commit import GroupCommitWriter, to_arrow
from txn_core.tables import open_or_create

from factories import STORE_MS, op_rows


def half_rows(offsets: list[int]) -> pa.Table:
    n = len(offsets)
    return to_arrow(
        arrow_schema(HALF),
        {
            "half_offset": offsets,
            "transaction_id": [f"TX{o:030d}" for o in offsets],
            "msg_id": [f"M{o}" for o in offsets],
            "producer_group": ["orders"] * n,
            "topic": ["ORDER", "PAYMENT\u00e9"] * (n // 2) + ["ORDER"] * (n % 2),
            "queue_id": [o % 4 for o in offsets],
            "tags": [None] * n,
            "keys": [None if o % 3 else f"k{o}" for o in offsets],
            "body": [bytes([o % 256]) * 100 for o in offsets],
            "properties": [[("a", str(o))] if o % 2 else [] for o in offsets],
            "born_ms": [1_000 + o for o in offsets],
            "check_immunity_s": [None] * n,
            "message_type": [None if o % 2 else "NORMAL" for o in offsets],
            "deliver_at_ms": [None if o % 2 else STORE_MS + o for o in offsets],
        },
        "store_ms",
        STORE_MS,
    )


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
    assert BlindAppender(ours, arrow_schema(HALF)).append(rows) == 1
    write_deltalake(theirs, rows, mode="append")

    ours, theirs = DeltaTable(ours.table_uri), DeltaTable(theirs.table_uri)
    assert ours.version() == theirs.version() == 1
    assert (
        ours.to_pyarrow_table()
        .sort_by("half_offset")
        .equals(theirs.to_pyarrow_table().sort_by("half_offset"))
    )
    # the same statistics: delta-rs' own readers skip files by them
    [mine], [its] = add_actions(ours.table_uri[7:]), add_actions(theirs.table_uri[7:])
    assert json.loads(mine["stats"]) == json.loads(its["stats"])
    assert mine["dataChange"] is True and mine["size"] == os.path.getsize(
        os.path.join(ours.table_uri[7:], mine["path"])
    )
    # a filtered read by a column without numeric stats finds the row
    found = ours.to_pyarrow_dataset().to_table(filter=pc.field("transaction_id") == f"TX{3:030d}")
    assert found["half_offset"].to_pylist() == [3]
    feed = pa.table(ours.load_cdf(starting_version=1)).to_pylist()
    assert {(r["_change_type"], r["_commit_version"]) for r in feed} == {("insert", 1)}


def test_boolean_and_list_columns_get_the_statistics_delta_rs_writes(tmp_path):
    """A consumer group's heartbeat rows (a boolean and a list column):
    min/max for the boolean, nothing for the list, as delta-rs writes them."""
    ours = open_or_create(str(tmp_path / "ours"), CONSUMER_MEMBERS)
    theirs = open_or_create(str(tmp_path / "theirs"), CONSUMER_MEMBERS)
    rows = pa.Table.from_pylist(
        [
            {
                "group": "g",
                "topic": "T",
                "member": m,
                "heartbeat_ms": ms,
                "leaving": gone,
                "queues": q,
            }
            for m, ms, gone, q in (("a", 5, False, [0, 2]), ("b", 7, True, []))
        ],
        schema=arrow_schema(CONSUMER_MEMBERS),
    )
    assert unsupported_reason(ours, rows.schema) is None
    BlindAppender(ours, rows.schema).append(rows)
    write_deltalake(theirs, rows, mode="append")
    [mine], [its] = add_actions(ours.table_uri[7:]), add_actions(theirs.table_uri[7:])
    assert json.loads(mine["stats"]) == json.loads(its["stats"])
    assert json.loads(mine["stats"])["maxValues"]["leaving"] is True
    found = DeltaTable(ours.table_uri).to_pyarrow_dataset().to_table(filter=pc.field("leaving"))
    assert found["queues"].to_pylist() == [[]]


def test_appenders_and_delta_rs_writers_share_a_table(warehouse):
    table = open_or_create(warehouse, OP)
    path, schema = table_path(warehouse, OP), arrow_schema(OP)
    first, second = BlindAppender(table, schema), BlindAppender(DeltaTable(path), schema)

    def rows(o: int) -> pa.Table:
        return to_arrow(schema, op_rows([o]), "store_ms", STORE_MS)

    versions = [first.append(rows(0)), second.append(rows(1))]  # second lost version 1
    write_deltalake(DeltaTable(path), rows(2), mode="append")
    versions += [first.append(rows(3)), second.append(rows(4))]
    assert versions == [1, 2, 4, 5]

    def send(offsets: range) -> None:  # racing from threads, each with its own appender
        mine = BlindAppender(DeltaTable(path), schema)
        for o in offsets:
            mine.append(rows(o))

    threads = [
        threading.Thread(target=send, args=(range(10 + 10 * t, 20 + 10 * t),)) for t in range(4)
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    final = DeltaTable(path)
    assert final.version() == 45  # no version lost, none taken twice
    assert sorted(final.to_pyarrow_table()["op_offset"].to_pylist()) == [0, 1, 2, 3, 4] + list(
        range(10, 50)
    )
    assert not [n for n in os.listdir(os.path.join(path, "_delta_log")) if n.endswith(".tmp")]


def test_a_strict_appender_that_lost_its_version_commits_nothing_and_says_so(warehouse):
    """The job's commits must follow the version they read (jobs.fence):
    a strict appender raises as a delta-rs commit without retries does."""
    from deltalake.exceptions import CommitFailedError

    table = open_or_create(warehouse, OP)
    path, schema = table_path(warehouse, OP), arrow_schema(OP)
    rows = to_arrow(schema, op_rows([1]), "store_ms", STORE_MS)
    strict = BlindAppender(table, schema, strict=True)
    write_deltalake(DeltaTable(path), rows, mode="append")  # another writer takes version 1
    files = set(os.listdir(path))
    with pytest.raises(CommitFailedError, match="version 1 was committed by another writer"):
        strict.append(rows, "run 7")
    assert DeltaTable(path).version() == 1
    assert set(os.listdir(path)) == files  # its parquet file removed
    assert not [n for n in os.listdir(os.path.join(path, "_delta_log")) if n.endswith(".tmp")]


def test_an_appender_after_a_version_it_knows_tags_its_commit(warehouse):
    table = open_or_create(warehouse, OP)
    path, schema = table_path(warehouse, OP), arrow_schema(OP)
    rows = to_arrow(schema, op_rows([1]), "store_ms", STORE_MS)
    first = BlindAppender(table, schema)
    assert first.append(rows) == 1
    # the table is still at version 0: the version after the appender's own is given
    assert BlindAppender(table, schema, after=1, strict=True).append(rows, "run 7") == 2
    assert [h.get("userMetadata") for h in DeltaTable(path).history(2)] == ["run 7", None]


def test_nulls_in_a_not_null_column_are_refused_and_nothing_is_written(warehouse):
    table = open_or_create(warehouse, OP)
    schema = arrow_schema(OP)
    columns = op_rows([1, 2])
    columns["transaction_id"] = ["tx-1", None]
    rows = pa.Table.from_arrays(
        [pa.array(columns.get(f.name, [STORE_MS] * 2), type=f.type) for f in schema], schema=schema
    )
    before = sorted(os.listdir(table_path(warehouse, OP)))
    with pytest.raises(ValueError, match=r"NOT NULL column\(s\) \['transaction_id'\]"):
        BlindAppender(table, schema).append(rows)
    assert sorted(os.listdir(table_path(warehouse, OP))) == before
    assert DeltaTable(table_path(warehouse, OP)).version() == 0


def test_a_protocol_or_metadata_change_stops_the_appender_and_delta_rs_takes_over(warehouse):
    table = open_or_create(warehouse, OP)
    path, schema = table_path(warehouse, OP), arrow_schema(OP)
    stale = BlindAppender(table, schema)
    assert stale.append(to_arrow(schema, op_rows([1]), "store_ms", STORE_MS)) == 1
    writer = GroupCommitWriter(DeltaTable(path), schema, name=OP.path, clock=lambda: STORE_MS)
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
    write_deltalake(
        partitioned, to_arrow(schema, op_rows([1]), "store_ms", STORE_MS), partition_by=["action"]
    )
    assert "partitioned by ['action']" in unsupported_reason(DeltaTable(partitioned), schema)
    with pytest.raises(ValueError, match="cannot append to .*partitioned"):
        BlindAppender(DeltaTable(partitioned), schema)
    other = open_or_create(str(tmp_path / "half"), HALF)
    assert unsupported_reason(other, schema) == "the table's schema differs from the rows'"
    assert unsupported_reason(other, arrow_schema(HALF)) is None


# --- on S3 (MinIO on loopback) ---------------------------------------------------------


def _s3_table(s3, schema_of=OP):
    from txn_core.config import load_config
    from txn_core.storage import Storage, use

    storage = use(Storage.from_config(load_config(env={}, **s3.config())))
    table = open_or_create(storage.warehouse, schema_of, storage_options=storage.delta_rs_options())
    return table, storage.delta_rs_options()


def test_on_s3_appenders_and_delta_rs_writers_share_a_table(s3):
    table, options = _s3_table(s3)
    schema = arrow_schema(OP)
    assert unsupported_reason(table, schema, options) is None

    def rows(o: int) -> pa.Table:
        return to_arrow(schema, op_rows([o]), "store_ms", STORE_MS)

    def handle() -> DeltaTable:
        return DeltaTable(table.table_uri, storage_options=options)

    first, second = BlindAppender(table, schema), BlindAppender(handle(), schema)
    versions = [first.append(rows(0)), second.append(rows(1))]  # second lost version 1
    write_deltalake(handle(), rows(2), mode="append")
    versions += [first.append(rows(3)), second.append(rows(4))]
    assert versions == [1, 2, 4, 5]

    def send(offsets: range) -> None:
        mine = BlindAppender(handle(), schema)
        for o in offsets:
            mine.append(rows(o))

    threads = [
        threading.Thread(target=send, args=(range(10 + 5 * t, 15 + 5 * t),)) for t in range(3)
    ]
    [t.start() for t in threads]
    [t.join() for t in threads]
    final = handle()
    assert final.version() == 20  # no version lost, none taken twice
    assert sorted(final.to_pyarrow_table()["op_offset"].to_pylist()) == [0, 1, 2, 3, 4] + list(
        range(10, 25)
    )
    feed = pa.table(final.load_cdf(starting_version=1)).to_pylist()
    assert sorted(r["op_offset"] for r in feed if r["_change_type"] == "insert") == [
        0,
        1,
        2,
        3,
        4,
    ] + list(range(10, 25))


def test_on_s3_a_put_whose_answer_was_lost_is_recognised_as_ours(s3, monkeypatch):
    table, options = _s3_table(s3)
    schema = arrow_schema(OP)
    appender = BlindAppender(table, schema)
    store = appender._store
    real_put = type(store).put_entry

    def put_then_lose_the_answer(self, version, staged):
        assert real_put(self, version, staged)
        return False  # as a retry would see: 412, the key exists

    monkeypatch.setattr(type(store), "put_entry", put_then_lose_the_answer)
    assert appender.append(to_arrow(schema, op_rows([7]), "store_ms", STORE_MS)) == 1
    monkeypatch.undo()
    assert appender.append(to_arrow(schema, op_rows([8]), "store_ms", STORE_MS)) == 2
    final = DeltaTable(table.table_uri, storage_options=options)
    assert sorted(final.to_pyarrow_table()["op_offset"].to_pylist()) == [7, 8]


def test_on_s3_a_put_with_no_answer_at_all_is_read_back_and_its_file_kept(s3, monkeypatch):
    """Every answer to an entry's put lost (the client's retries spent): the
    appender took the entry for not written and deleted the file it
    references, and the table could no longer be read by anyone."""
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError

    table, options = _s3_table(s3)
    schema = arrow_schema(OP)
    appender = BlindAppender(table, schema)
    client = appender._store._client
    real_put = client.put_object

    def put_then_lose_every_answer(**kwargs):
        real_put(**kwargs)
        if kwargs.get("IfNoneMatch"):
            raise ConnectionClosedError(endpoint_url="http://store")

    def unreachable(**kwargs):
        raise EndpointConnectionError(endpoint_url="http://store")

    def rows(o: int) -> pa.Table:
        return to_arrow(schema, op_rows([o]), "store_ms", STORE_MS)

    monkeypatch.setattr(client, "put_object", put_then_lose_every_answer)
    assert appender.append(rows(7)) == 1  # read back: ours
    monkeypatch.setattr(client, "get_object", unreachable)  # nor does the read get an answer
    with pytest.raises(EntryOutcomeUnknown, match="version 2 was written .* may hold the rows"):
        appender.append(rows(8))
    monkeypatch.undo()
    assert appender.append(rows(9)) == 3
    final = DeltaTable(table.table_uri, storage_options=options)
    assert sorted(final.to_pyarrow_table()["op_offset"].to_pylist()) == [7, 8, 9]


def test_on_s3_an_appender_idle_past_a_cleaned_log_moves_past_its_checkpoint(s3, monkeypatch):
    """A handle left at an old version while others committed, checkpointed
    and cleaned the log would otherwise put a version that had existed."""
    import txn_core.blind_append as blind_append

    table, options = _s3_table(s3)
    schema = arrow_schema(OP)
    stale = BlindAppender(table, schema)  # knows version 0

    other = DeltaTable(table.table_uri, storage_options=options)
    for o in range(1, 4):
        write_deltalake(other, to_arrow(schema, op_rows([o]), "store_ms", STORE_MS), mode="append")
    other.create_checkpoint()  # at version 3
    store = stale._store
    for version in (0, 1, 2):  # what a log clean-up past the retention would do
        store.remove_entry(version)
    monkeypatch.setattr(blind_append, "IDLE_RECHECK_S", 0.0)
    assert stale.append(to_arrow(schema, op_rows([9]), "store_ms", STORE_MS)) == 4
    final = DeltaTable(table.table_uri, storage_options=options)
    assert sorted(final.to_pyarrow_table()["op_offset"].to_pylist()) == [1, 2, 3, 9]


def test_other_stores_and_unopened_warehouses_fall_back_to_delta_rs(s3, tmp_path):
    table, options = _s3_table(s3)
    schema = arrow_schema(OP)
    other_settings = {**options, "AWS_REGION": "eu-west-1"}
    assert (
        unsupported_reason(table, schema, other_settings)
        == "its storage options are not its warehouse's settings"
    )
    unopened = DeltaTable(table.table_uri, storage_options=options)
    from txn_core import storage

    saved = dict(storage._registered)
    storage._registered.clear()
    try:
        assert "was not opened" in unsupported_reason(unopened, schema, options)
    finally:
        storage._registered.update(saved)


def test_on_s3_a_put_met_by_a_concurrent_put_is_asked_again_then_reported(s3, monkeypatch):
    """S3 answers 409 while another conditional put of the key is under way:
    the appender asks again (and gives up, raising, if it never ends)."""
    from botocore.exceptions import ClientError

    import txn_core.blind_append as blind_append

    table, options = _s3_table(s3)
    schema = arrow_schema(OP)
    appender = BlindAppender(table, schema)
    client = appender._store._client
    real_put, conflicts = client.put_object, []

    def conflicting(**kwargs):
        if kwargs.get("IfNoneMatch") and len(conflicts) < 2:
            conflicts.append(kwargs["Key"])
            raise ClientError(
                {
                    "Error": {"Code": "ConditionalRequestConflict"},
                    "ResponseMetadata": {"HTTPStatusCode": 409},
                },
                "PutObject",
            )
        return real_put(**kwargs)

    monkeypatch.setattr(client, "put_object", conflicting)
    assert appender.append(to_arrow(schema, op_rows([5]), "store_ms", STORE_MS)) == 1
    assert len(conflicts) == 2
    monkeypatch.setattr(blind_append, "CONFLICT_RETRIES", 1)
    conflicts.clear()
    with pytest.raises(ClientError, match="ConditionalRequestConflict"):
        appender.append(to_arrow(schema, op_rows([6]), "store_ms", STORE_MS))
    final = DeltaTable(table.table_uri, storage_options=options)
    assert sorted(final.to_pyarrow_table()["op_offset"].to_pylist()) == [5]
