"""delta-rs tables kept open between uses (`txn_core.kept_tables`)."""

from __future__ import annotations

import shutil

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from txn_core import kept_tables


def _rows(*values: int) -> pa.Table:
    return pa.table({"n": pa.array(values, pa.int64())})


def _numbers(table: DeltaTable) -> list[int]:
    return sorted(table.to_pyarrow_table()["n"].to_pylist())


def test_a_table_given_back_is_taken_again_with_the_commits_made_since(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(1))
    first = kept_tables.take(path)
    kept_tables.give_back(first)
    write_deltalake(path, _rows(2), mode="append")  # by another writer

    again = kept_tables.take(path + "/")  # the same table, spelt otherwise

    assert again is first
    assert again.version() == 1
    assert _numbers(again) == [1, 2]


def test_a_taken_table_is_not_shared(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(1))
    kept_tables.give_back(DeltaTable(path))

    mine = kept_tables.take(path)
    theirs = kept_tables.take(path)  # while mine is out

    assert theirs is not mine
    assert theirs.version() == mine.version() == 0


def test_an_older_version_is_opened_as_asked(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(1))
    write_deltalake(path, _rows(2), mode="append")
    kept_tables.give_back(DeltaTable(path))

    old = kept_tables.take(path, version=0)

    assert old.version() == 0
    assert _numbers(old) == [1]
    assert kept_tables.take(path).version() == 1  # the kept one, still there


def test_a_table_made_again_at_its_path_is_opened_afresh(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(1))
    write_deltalake(path, _rows(2), mode="append")
    kept_tables.give_back(DeltaTable(path))
    shutil.rmtree(path)
    write_deltalake(path, _rows(7))
    write_deltalake(path, _rows(8), mode="append")  # the same versions, other files

    table = kept_tables.take(path)

    assert _numbers(table) == [7, 8]


def test_only_tables_on_a_local_disk_are_kept(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(1))
    local = DeltaTable(path)
    kept_tables.give_back(local)
    assert kept_tables.take(path) is local

    assert kept_tables._key("s3://bucket/wh/_sys/runs") is None
