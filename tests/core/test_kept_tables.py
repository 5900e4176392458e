"""delta-rs tables kept open between uses (`txn_core.kept_tables`)."""

from __future__ import annotations

import shutil

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from txn_core import kept_tables

import factories as fx


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


def test_a_table_on_a_local_disk_given_back_is_the_one_taken(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, _rows(1))
    local = DeltaTable(path)
    kept_tables.give_back(local)
    assert kept_tables.take(path) is local


# --- on S3 (MinIO on loopback) ---------------------------------------------------------


def _s3_table_path(s3) -> tuple[str, dict[str, str]]:
    """A table's URI in a fresh warehouse registered on the S3 server, its
    delta-rs options."""
    from txn_core.config import load_config
    from txn_core.storage import Storage, use

    storage = use(Storage.from_config(load_config(env={}, **s3.config())))
    options = storage.delta_rs_options()
    assert options is not None
    return storage.warehouse + "/t", options


def test_on_s3_a_table_given_back_is_taken_again_with_the_commits_made_since(s3):
    uri, options = _s3_table_path(s3)
    write_deltalake(uri, _rows(1), storage_options=options)
    first = kept_tables.take(uri, options)
    kept_tables.give_back(first)
    write_deltalake(uri, _rows(2), mode="append", storage_options=options)  # by another writer

    again = kept_tables.take(uri, options)

    assert again is first
    assert (again.version(), _numbers(again)) == (1, [1, 2])


def test_on_s3_a_table_made_again_at_its_path_is_opened_afresh(s3):
    uri, options = _s3_table_path(s3)
    write_deltalake(uri, _rows(1), storage_options=options)
    write_deltalake(uri, _rows(2), mode="append", storage_options=options)
    kept = kept_tables.take(uri, options)
    kept_tables.give_back(kept)
    fx.delete_table(uri)
    write_deltalake(uri, _rows(7), storage_options=options)
    write_deltalake(uri, _rows(8), mode="append", storage_options=options)  # the same versions

    table = kept_tables.take(uri, options)

    assert table is not kept
    assert _numbers(table) == [7, 8]


def test_on_s3_a_table_opened_with_other_options_than_its_warehouses_is_not_kept(s3):
    uri, options = _s3_table_path(s3)
    write_deltalake(uri, _rows(1), storage_options=options)
    other = DeltaTable(uri, storage_options={**options, "AWS_REQUEST_PAYER": "false"})
    kept_tables.give_back(other)
    assert kept_tables.take(uri, options) is not other

    mine = kept_tables.take(uri, options)
    kept_tables.give_back(mine)
    # the kept table is handed only to a caller with the options it was opened with
    assert kept_tables.take(uri, {**options, "AWS_REQUEST_PAYER": "false"}) is not mine
    assert kept_tables.take(uri, options) is mine


def test_on_s3_a_table_given_back_unchanged_needs_no_second_request(s3):
    uri, options = _s3_table_path(s3)
    write_deltalake(uri, _rows(1), storage_options=options)
    kept_tables.give_back(kept_tables.take(uri, options))

    def heads(use) -> int:
        before = s3.requests().get("HEAD", 0)
        use()
        return s3.requests().get("HEAD", 0) - before

    read = kept_tables.take(uri, options)
    assert heads(lambda: kept_tables.give_back(read)) == 0  # checked when taken
    written = kept_tables.take(uri, options)
    write_deltalake(written, _rows(2), mode="append")
    assert heads(lambda: kept_tables.give_back(written)) == 1  # a new version: its own entry
    assert _numbers(kept_tables.take(uri, options)) == [1, 2]
