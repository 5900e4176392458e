"""The group-commit writer: tickets, the wake-up chain, failures and log cleanup."""

import os
import threading
import time

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from schemas import OP, table_path
from schemas.arrow import arrow_schema
from txn_core import PersistError
from txn_core.group_commit import GroupCommitWriter
from txn_core.tables import PRODUCER_TABLE_CONFIG, open_or_create

from factories import STORE_MS, Panic, op_rows


def open_writer(warehouse: str, configuration: dict | None = None, **kwargs) -> GroupCommitWriter:
    table = open_or_create(warehouse, OP, configuration=configuration)
    return GroupCommitWriter(
        table, arrow_schema(OP), name=OP.path, clock=lambda: STORE_MS, **kwargs
    )


def changes(warehouse: str) -> list[dict]:
    return pa.table(DeltaTable(table_path(warehouse, OP)).load_cdf(starting_version=0)).to_pylist()


class GatedWrites:
    """Stands in for the writer's commit step: holds the first commit until
    `release()`, so the appends submitted meanwhile form the next batch; fails
    the commits whose number is in `failing` (1 = the first)."""

    def __init__(self, monkeypatch, failing=()):
        self.gate, self.started = threading.Event(), threading.Event()
        self.failing, self.calls = set(failing), 0
        real = GroupCommitWriter._append_rows

        def append_rows(writer, rows):
            self.calls += 1
            if self.calls == 1:
                self.started.set()
                self.gate.wait(10)
            if self.calls in self.failing:
                raise OSError(f"disk full (commit {self.calls})")
            return real(writer, rows)

        monkeypatch.setattr(GroupCommitWriter, "_append_rows", append_rows)

    def hold_first(self, writer: GroupCommitWriter, offsets: list[int]):
        ticket = writer.submit(op_rows(offsets))
        assert self.started.wait(10)
        return ticket

    def release(self):
        self.gate.set()


def test_each_sender_gets_its_own_commits_version_and_rows_stay_in_order(warehouse):
    writer = open_writer(warehouse)
    got: dict[int, tuple[int, list[int]]] = {}
    start = threading.Barrier(24)

    def send(sender: int):
        start.wait()
        for k in range(5):
            offsets = [sender * 100 + k * 10 + i for i in range(3)]
            got[offsets[0]] = (writer.submit(op_rows(offsets)).result(), offsets)

    threads = [threading.Thread(target=send, args=(s,)) for s in range(24)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    writer.close()

    rows = changes(warehouse)
    assert {r["_change_type"] for r in rows} == {"insert"} and len(rows) == 24 * 5 * 3
    assert {r["store_ms"] for r in rows} == {STORE_MS}
    by_version: dict[int, list[int]] = {}
    for r in rows:
        by_version.setdefault(r["_commit_version"], []).append(r["op_offset"])
    assert len(by_version) == writer.commits < 24 * 5  # senders shared commits
    for version, offsets in got.values():
        committed = by_version[version]
        at = committed.index(offsets[0])  # a sender's rows: in its commit, together, in order
        assert committed[at : at + 3] == offsets


def test_a_failed_commit_fails_only_its_own_senders(warehouse, monkeypatch):
    writes = GatedWrites(monkeypatch, failing={2})
    writer = open_writer(warehouse)
    first = writes.hold_first(writer, [1])
    doomed = [writer.submit(op_rows([o])) for o in (2, 3, 4)]  # queued: the second commit
    writes.release()
    assert first.result(10) == 1
    for ticket in doomed:
        with pytest.raises(PersistError, match="3 row\\(s\\) to _sys/op: disk full"):
            ticket.result(10)
    assert writer.submit(op_rows([5])).result(10) == 2  # the writer goes on
    writer.close()
    assert sorted(r["op_offset"] for r in changes(warehouse)) == [1, 5]


def test_stats_count_committed_rows_and_where_the_time_went(warehouse, monkeypatch):
    writes = GatedWrites(monkeypatch, failing={3})
    writer = open_writer(warehouse)
    before = writer.stats()
    first = writes.hold_first(writer, [1])
    held_from = time.perf_counter()
    queued = [writer.submit(op_rows([o, o + 1])) for o in (10, 20, 30)]  # the second commit
    with pytest.raises(TimeoutError):
        first.result(timeout=0.2)  # longer than the real commits of this test take
    held = time.perf_counter() - held_from
    writes.release()
    assert [first.result(10)] + [t.result(10) for t in queued] == [1, 2, 2, 2]
    with pytest.raises(PersistError):
        writer.submit(op_rows([99])).result(10)  # the third commit fails
    writer.close()
    stats = writer.stats() - before
    # only committed rows count
    assert (stats.commits, stats.rows, stats.rows_per_commit) == (2, 7, 3.5)
    assert stats.commit_s >= held  # the writer was inside the held commit, not idle
    assert stats.ms_per_commit == pytest.approx(1000 * stats.commit_s / 2)
    assert min(stats.build_s, stats.upkeep_s, stats.idle_s) >= 0


def test_a_sender_that_never_asks_does_not_hold_up_the_others(warehouse, monkeypatch):
    writes = GatedWrites(monkeypatch)
    writer = open_writer(warehouse)
    first = writes.hold_first(writer, [1])
    with pytest.raises(TimeoutError):
        first.result(timeout=0.01)  # the commit is still held
    silent, *others = [writer.submit(op_rows([o])) for o in (2, 3, 4)]
    writes.release()
    # `silent` heads the second commit's wake-up chain and never passes it on;
    # the writer wakes the rest after CHAIN_STALL_S
    assert [t.result(10) for t in others] == [2, 2]
    assert first.result(10) == first.result(10) == 1  # asking twice is fine
    writer.close()
    assert silent.result(10) == 2


def log_entries(warehouse: str) -> list[str]:
    return sorted(os.listdir(os.path.join(table_path(warehouse, OP), "_delta_log")))


def test_the_writer_drops_expired_log_entries_every_log_cleanup_every_commits(warehouse):
    config = dict(
        PRODUCER_TABLE_CONFIG,
        **{"delta.checkpointInterval": "5", "delta.logRetentionDuration": "interval 0 seconds"},
    )
    writer = open_writer(warehouse, config, log_cleanup_every=8, compact_every=None)
    for o in range(7):
        writer.submit(op_rows([o])).result()
    # version 7 committed: a checkpoint at 4, but no cleanup after each commit
    assert "00000000000000000000.json" in log_entries(warehouse)
    assert writer.upkeep.log_cleanups == 0
    assert writer.submit(op_rows([7])).result() == 8  # then cleanup up to the checkpoint ...
    assert writer.submit(op_rows([8])).result() == 9  # ... and the writer goes on
    writer.close()
    entries = log_entries(warehouse)
    assert writer.upkeep.log_cleanups == 1
    # dropped up to the newest checkpoint when the clean-up ran (4, or 9 if
    # the upkeep thread got to it after the last commit)
    first = min(int(e[:20]) for e in entries if e.endswith(".json"))
    assert first in (4, 9) and f"{first:020d}.checkpoint.parquet" in entries
    assert "00000000000000000009.json" in entries
    # the table still reads, and so does the change feed from the checkpoint on
    table = DeltaTable(table_path(warehouse, OP))
    assert sorted(table.to_pyarrow_table()["op_offset"].to_pylist()) == list(range(9))
    feed = pa.table(table.load_cdf(starting_version=first)).to_pylist()
    assert sorted(r["op_offset"] for r in feed) == list(range(first - 1, 9))
    assert {r["_change_type"] for r in feed} == {"insert"}


def test_log_cleanup_follows_the_tables_setting(warehouse):
    config = dict(
        PRODUCER_TABLE_CONFIG,
        **{
            "delta.checkpointInterval": "5",
            "delta.logRetentionDuration": "interval 0 seconds",
            "delta.enableExpiredLogCleanup": "false",
        },
    )
    writer = open_writer(warehouse, config, log_cleanup_every=3, compact_every=None)
    for o in range(9):
        writer.submit(op_rows([o])).result()
    writer.close()
    assert writer.upkeep.log_cleanups == 0
    assert "00000000000000000000.json" in log_entries(warehouse)


def test_upkeep_retries_a_log_changing_under_it_quietly_and_counts_it(
    warehouse, monkeypatch, caplog
):
    """delta-rs' "Expected contiguous commit files" while other writers commit
    is expected under load: counted in the writer's stats, not a warning."""
    import logging

    import txn_core.writer_upkeep as upkeep_module

    real, calls = upkeep_module.DeltaTable, []

    class Racing(real):
        def load_as_version(self, version):
            calls.append(version)
            if len(calls) == 1:
                raise Exception(
                    "Generic delta kernel error: Expected contiguous commit files, but found gap"
                )
            return super().load_as_version(version)

    monkeypatch.setattr(upkeep_module, "DeltaTable", Racing)
    writer = open_writer(
        warehouse, configuration={**PRODUCER_TABLE_CONFIG, "delta.checkpointInterval": "2"}
    )
    with caplog.at_level(logging.WARNING, logger="txn_core.writer_upkeep"):
        for o in range(6):  # checkpoints due at versions 1, 3, 5
            writer.submit(op_rows([o])).result(10)
        writer.close()
    assert writer.stats().upkeep_retries == 1
    assert writer.upkeep.checkpoints == len(calls) - 1 >= 1
    assert not caplog.records


def test_upkeep_outlives_a_panic_in_delta_rs(warehouse, monkeypatch):
    """An upkeep step that panicked (not an Exception) ended the upkeep's
    thread: no checkpoint, compaction or log clean-up after it, ever."""
    import txn_core.writer_upkeep as upkeep_module

    real, calls = upkeep_module.DeltaTable, []

    class Panicking(real):
        def create_checkpoint(self):
            calls.append(1)
            if len(calls) == 1:
                raise Panic("called `Option::unwrap()` on a `None` value")
            return super().create_checkpoint()

    monkeypatch.setattr(upkeep_module, "DeltaTable", Panicking)
    writer = open_writer(
        warehouse, configuration={**PRODUCER_TABLE_CONFIG, "delta.checkpointInterval": "2"}
    )
    for o in range(6):  # checkpoints due at versions 1, 3, 5
        writer.submit(op_rows([o])).result(10)
    writer.close()
    assert len(calls) >= 2 and writer.upkeep.checkpoints == len(calls) - 1


def test_a_compaction_meeting_a_gap_in_the_log_is_retried_without_a_warning(
    warehouse, monkeypatch, caplog
):
    """A compaction that lists the log while another producer's entry is
    half-made ("Expected contiguous commit files") is done by a later round,
    counted as a retry: a warning and its traceback in a producer's log under
    load said something was wrong when nothing was."""
    import logging

    import txn_core.writer_upkeep as upkeep_module

    real, compactions = upkeep_module.DeltaTable, []

    class Gap:
        def compact(self, **kwargs):
            raise Exception(
                "Generic delta kernel error: Expected contiguous commit files, but found gap"
            )

    class Racing(real):
        @property
        def optimize(self):
            compactions.append(len(compactions))
            return Gap() if len(compactions) == 1 else super().optimize

    monkeypatch.setattr(upkeep_module, "DeltaTable", Racing)
    retries = []
    with caplog.at_level(logging.WARNING, logger="txn_core.writer_upkeep"):
        for first in (0, 2):  # each writer: two commits, then a compaction (done by close)
            writer = open_writer(warehouse, compact_every=2)
            for o in (first, first + 1):
                writer.submit(op_rows([o])).result(10)
            writer.close()
            retries.append(writer.stats().upkeep_retries)
    assert (len(compactions), retries) == (2, [1, 0])
    assert not caplog.records
    table = DeltaTable(table_path(warehouse, OP))
    assert len(table.file_uris()) == 1  # the second compaction merged all four commits' files
    assert sorted(table.to_pyarrow_table()["op_offset"].to_pylist()) == [0, 1, 2, 3]


def test_a_commit_after_a_quiet_spell_is_at_once_and_one_under_load_gathers_an_interval_of_rows(
    warehouse, monkeypatch
):
    """`min_commit_interval_s` (config `group_commit_interval_ms`): rows that
    come while the last commit is younger than the interval wait for its end
    and go in one commit; a row after a quiet spell waits for nothing."""
    import txn_core.group_commit as group_commit

    slept, real_sleep = [], time.sleep
    monkeypatch.setattr(group_commit.time, "sleep", lambda s: (slept.append(s), real_sleep(s)))
    writer = open_writer(warehouse, compact_every=None, min_commit_interval_s=0.5)
    assert writer.submit(op_rows([0])).result(10) == 1
    assert slept == []  # nothing committed before it: at once
    tickets = [writer.submit(op_rows([o])) for o in (1, 2, 3)]
    assert [t.result(10) for t in tickets] == [2, 2, 2]  # one commit for the three
    assert len(slept) == 1 and 0 < slept[0] <= 0.5
    writer.close()
    assert writer.stats().commits == 2


def test_checkpoints_go_to_the_newest_due_version_and_never_wait_for_a_compaction(
    warehouse, monkeypatch
):
    """Under load versions fall due for a checkpoint faster than one is
    written: the upkeep writes the newest one, not each in turn; and a
    compaction (seconds under load) runs on a thread of its own, so the
    checkpoints go on meanwhile."""
    import txn_core.writer_upkeep as upkeep_module

    real = upkeep_module.DeltaTable
    checkpointed, compacting, release = [], threading.Event(), threading.Event()
    first_checkpoint, go_on, second_checkpoint = (threading.Event() for _ in range(3))

    class Held:
        def compact(self, **kwargs):
            compacting.set()
            assert release.wait(10)

    class Watched(real):
        @property
        def optimize(self):
            return Held()

        def create_checkpoint(self):
            checkpointed.append(self.version())
            if len(checkpointed) == 1:
                first_checkpoint.set()
                assert go_on.wait(10)
            else:
                second_checkpoint.set()
            return super().create_checkpoint()

    monkeypatch.setattr(upkeep_module, "DeltaTable", Watched)
    config = {**PRODUCER_TABLE_CONFIG, "delta.checkpointInterval": "2"}
    writer = open_writer(
        warehouse, config, compact_every=2, log_cleanup_every=None, min_commit_interval_s=0
    )
    for o in range(2):  # versions 1 and 2: a checkpoint due at 1, a compaction
        writer.submit(op_rows([o])).result(10)
    assert compacting.wait(10) and first_checkpoint.wait(10)
    for o in range(2, 6):  # due at 3 and 5 while the first checkpoint is being written
        writer.submit(op_rows([o])).result(10)
    go_on.set()
    second_checkpoint.wait(10)  # the upkeep's next round, the compaction still held
    assert checkpointed == [1, 5]
    release.set()
    writer.close()


def test_a_compaction_waits_its_interval_after_the_last_one_but_not_at_close(
    warehouse, monkeypatch
):
    """Under a steady load small files fall due faster than every few
    seconds: a compaction starts `compact_min_interval_s` after the last
    one ended at the earliest (the clock injected), and `close()` does what
    is due whatever the time."""
    import txn_core.writer_upkeep as upkeep_module

    real, clock, ran = upkeep_module.DeltaTable, [0.0], []
    started = [threading.Event() for _ in range(3)]

    class Timed(real):
        @property
        def optimize(self):
            ran.append(clock[0])
            started[len(ran) - 1].set()
            return super().optimize

    monkeypatch.setattr(upkeep_module, "DeltaTable", Timed)
    table = open_or_create(warehouse, OP)
    upkeep = upkeep_module.WriterUpkeep(
        table.table_uri,
        name=OP.path,
        compact_every=2,
        compact_min_interval_s=60,
        log_cleanup_every=None,
        monotonic=lambda: clock[0],
    )
    for version in (1, 2):
        upkeep.committed(version, small_file=True)
    assert started[0].wait(10)  # the first: at once
    with upkeep._due:  # ended (its end is what the interval counts from)
        assert upkeep._due.wait_for(lambda: not upkeep._compacting, 10)
    for version in (3, 4):
        upkeep.committed(version, small_file=True)
    clock[0] = 61.0
    upkeep.committed(5, small_file=True)  # the interval is over: the due one starts
    assert started[1].wait(10)
    for version in (6, 7):
        upkeep.committed(version, small_file=True)
    upkeep.close()  # due, within the interval: done by close
    assert ran == [0.0, 61.0, 61.0] and upkeep.compactions == 3
