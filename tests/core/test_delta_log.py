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
