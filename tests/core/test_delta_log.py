"""Reading a log that producers add to at the same time (txn_core.delta_log.open_table)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import DeltaError

from txn_core import delta_log


def test_a_listing_that_missed_a_concurrent_entry_is_made_again(tmp_path, monkeypatch):
    write_deltalake(str(tmp_path), pa.table({"a": [1]}))
    calls = []

    def flaky(uri, version=None, storage_options=None):
        calls.append(uri)
        if len(calls) < 3:
            raise DeltaError(f"Generic delta kernel error: {delta_log.TRANSIENT_LOG_ERROR}, gap")
        return DeltaTable(uri, version=version, storage_options=storage_options)

    monkeypatch.setattr("deltalake.DeltaTable", flaky)
    assert delta_log.open_table(str(tmp_path)).version() == 0
    assert len(calls) == 3


def test_any_other_error_or_a_gap_that_stays_is_raised(tmp_path, monkeypatch):
    def broken(uri, version=None, storage_options=None):
        raise DeltaError(f"{delta_log.TRANSIENT_LOG_ERROR}: for good")

    monkeypatch.setattr("deltalake.DeltaTable", broken)
    monkeypatch.setattr(delta_log.time, "sleep", lambda s: None)
    with pytest.raises(DeltaError, match="for good"):
        delta_log.open_table(str(tmp_path))
    monkeypatch.undo()
    with pytest.raises(Exception, match="does not exist"):  # not a retry: at once
        delta_log.open_table(str(tmp_path / "none"))


def test_the_latest_local_version_is_the_newest_entry_listed(tmp_path):
    assert delta_log.latest_local_version(str(tmp_path / "none")) is None
    table = str(tmp_path / "t")
    write_deltalake(table, pa.table({"a": [1]}))
    for _ in range(11):
        write_deltalake(table, pa.table({"a": [2]}), mode="append")
    DeltaTable(table).create_checkpoint()
    # an entry being written elsewhere and not linked yet is not a version
    (tmp_path / "t" / "_delta_log" / "_commit_0123.json.tmp").write_text("{}")
    assert delta_log.latest_local_version(table) == DeltaTable(table).version() == 11


def _counting_updates(monkeypatch) -> list[int]:
    calls: list[int] = []
    update = DeltaTable.update_incremental

    def counted(self):
        calls.append(self.version())
        return update(self)

    monkeypatch.setattr(DeltaTable, "update_incremental", counted)
    return calls


def test_refresh_leaves_a_local_table_alone_when_its_log_holds_nothing_newer(tmp_path, monkeypatch):
    write_deltalake(str(tmp_path), pa.table({"a": [1]}))
    table = DeltaTable(str(tmp_path))
    calls = _counting_updates(monkeypatch)
    delta_log.refresh(table)
    assert calls == [] and table.version() == 0
    write_deltalake(str(tmp_path), pa.table({"a": [2]}), mode="append")  # another writer
    delta_log.refresh(table)
    assert calls == [0] and table.version() == 1
    assert sorted(table.to_pyarrow_table()["a"].to_pylist()) == [1, 2]


def test_refresh_sees_versions_whose_entries_were_removed_behind_a_checkpoint(tmp_path):
    write_deltalake(str(tmp_path), pa.table({"a": [0]}))
    table = DeltaTable(str(tmp_path))
    for n in range(1, 6):
        write_deltalake(str(tmp_path), pa.table({"a": [n]}), mode="append")
    DeltaTable(str(tmp_path)).create_checkpoint()
    for n in range(0, 5):  # log clean-up: the next entry is gone, the checkpoint tells
        (tmp_path / "_delta_log" / delta_log.entry_name(n)).unlink()
    delta_log.refresh(table)
    assert table.version() == 5
    assert sorted(table.to_pyarrow_table()["a"].to_pylist()) == [0, 1, 2, 3, 4, 5]


def test_refresh_updates_when_the_checkpoint_pointer_cannot_be_read(tmp_path, monkeypatch):
    write_deltalake(str(tmp_path), pa.table({"a": [1]}))
    table = DeltaTable(str(tmp_path))
    (tmp_path / "_delta_log" / "_last_checkpoint").write_text("{not json")
    calls = _counting_updates(monkeypatch)
    delta_log.refresh(table)
    assert calls == [0]


def test_refresh_of_a_table_on_s3_always_updates(monkeypatch):
    class OnS3:
        table_uri = "s3://bucket/t"
        updates = 0

        def version(self) -> int:
            return 3

        def update_incremental(self) -> None:
            self.updates += 1

    table = OnS3()
    delta_log.refresh(table)
    assert table.updates == 1


def test_a_table_left_behind_its_own_appends_knows_its_tip_and_catches_up(tmp_path, monkeypatch):
    write_deltalake(str(tmp_path), pa.table({"a": [1]}))
    table = DeltaTable(str(tmp_path))
    assert delta_log.tip(table) == 0
    write_deltalake(str(tmp_path), pa.table({"a": [2]}), mode="append")  # as if by hand
    delta_log.appended(table, 1)
    assert (table.version(), delta_log.tip(table)) == (0, 1)
    calls = _counting_updates(monkeypatch)
    delta_log.refresh(table, behind_own_appends=True)  # nothing but its own since
    assert calls == [] and table.version() == 0
    write_deltalake(str(tmp_path), pa.table({"a": [3]}), mode="append")  # someone else's
    delta_log.refresh(table, behind_own_appends=True)
    assert calls == [0] and delta_log.tip(table) == table.version() == 2
    delta_log.catch_up(table)  # not behind: nothing to do
    write_deltalake(str(tmp_path), pa.table({"a": [4]}), mode="append")  # as if by hand
    delta_log.appended(table, 3)
    delta_log.refresh(table)  # a reader's refresh catches up with them
    assert calls == [0, 2] and delta_log.tip(table) == table.version() == 3
    write_deltalake(str(tmp_path), pa.table({"a": [5]}), mode="append")  # as if by hand
    delta_log.appended(table, 4)
    write_deltalake(str(tmp_path), pa.table({"a": [6]}), mode="append")  # someone else's
    delta_log.catch_up(table)  # to its own last append, not past it
    assert table.version() == 4
    assert sorted(table.to_pyarrow_table()["a"].to_pylist()) == [1, 2, 3, 4, 5]
