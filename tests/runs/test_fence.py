"""A run's commits are fenced by its lease (`jobs.fence`): a run that stalls,
or whose host's clock is behind, while another run takes the lease over and
completes its intent, commits nothing more, whatever the clocks say."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, write_deltalake

from jobs import driver_writes, fence, tagged_writes
from jobs.lease import Lease, LeaseLost
from jobs.reconcile import reconcile
from jobs.verify import verify
from schemas import LEASE, RUNS, table_path, topic_path
from txn_core import kept_tables
from txn_core.config import load_config
from txn_core.storage import Storage, options_for, use

import factories as fx
from conftest import REPO

#: a lease of the default ttl held by a host whose clock is this far behind
#: the others': to them it has expired the moment it is taken
BEHIND_S = 700
TTL_S = 600
NOW_MS = 10**9


def _behind() -> float:
    return time.time() - BEHIND_S


def _table(path: str, *values: int) -> None:
    write_deltalake(
        path, pa.table({"v": list(values)}), mode="append", storage_options=options_for(path)
    )


def _values(path: str) -> list[int]:
    table = DeltaTable(path, storage_options=options_for(path))
    return sorted(table.to_pyarrow_table()["v"].to_pylist())


def _append(table, *values: int, tag: str | None = None) -> None:
    """One commit through the handle `table`, from its version, no retry."""
    metadata = {} if tag is None else {"userMetadata": tag}
    props = CommitProperties(custom_metadata=metadata, max_commit_retries=0)
    write_deltalake(table, pa.table({"v": list(values)}), mode="append", commit_properties=props)


# --- the lease's verify and the fence, without Spark ------------------------------------


@pytest.mark.parametrize("store", ["local", "s3"])
def test_verify_reads_the_store_where_keep_alive_trusts_the_holders_clock(warehouse, s3, store):
    if store == "s3":
        warehouse = _s3_warehouse(s3)
    mine = Lease(warehouse, TTL_S, clock=_behind).acquire()
    assert mine._still_own()  # one look at the lease's log: nothing newer than its own entry
    mine.verify()
    Lease(warehouse, TTL_S).acquire()  # another host: expired by its clock
    mine.keep_alive()  # by this host's clock a third of the ttl has not passed: no read
    with pytest.raises(LeaseLost, match="taken over"):
        mine.verify()
    with pytest.raises(LeaseLost):
        mine.keep_alive()  # and every later write stops


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_lease_table_deleted_and_made_again_is_not_the_holders(warehouse, s3, store):
    """An operator deletes `_sys/lease` while a run holds it; another run
    makes it again and takes the lease, its log reaching the holder's own
    version: the holder's look at its entry finds another file there, and
    its check reads the other run's row."""
    if store == "s3":
        warehouse = _s3_warehouse(s3)
    mine = Lease(warehouse, TTL_S, clock=_behind).acquire()
    own_version = mine._own[0]
    lease_path = table_path(warehouse, LEASE)
    fx.delete_table(lease_path)
    other = Lease(warehouse, TTL_S).acquire()
    while DeltaTable(lease_path, storage_options=options_for(lease_path)).version() < own_version:
        other.release()
        other = Lease(warehouse, TTL_S).acquire()
    with pytest.raises(LeaseLost, match="taken over"):
        mine.verify()


@pytest.mark.parametrize("store", ["local", "s3"])
def test_a_commit_from_a_version_read_before_another_runs_commit_never_lands(warehouse, s3, store):
    if store == "s3":
        warehouse = _s3_warehouse(s3)
    path = f"{warehouse}/t"
    _table(path, 1)
    mine = Lease(warehouse, TTL_S, clock=_behind).acquire()
    handle = kept_tables.take(path, options_for(path))

    def stalled_then_commit() -> None:
        # this run checked its lease, then stalled; meanwhile another run
        # took the lease over and committed to the same table
        Lease(warehouse, TTL_S).acquire()
        _append(DeltaTable(path, storage_options=options_for(path)), 2, tag=_tag(1))
        _append(handle, 3)

    with pytest.raises(LeaseLost, match=r"another run \(run 1, t\) committed"):
        fence.commit(handle, mine, stalled_then_commit)
    assert _values(path) == [1, 2]
    with pytest.raises(LeaseLost):
        mine.verify()


def test_a_fenced_commit_steps_over_an_operators_commit(warehouse):
    path = f"{warehouse}/t"
    _table(path, 1)
    mine = Lease(warehouse, TTL_S).acquire()
    handle = kept_tables.take(path, options_for(path))
    _append(DeltaTable(path), 2)  # an operator's commit (no run's tag) after the handle's read
    fence.commit(handle, mine, lambda: _append(handle, 3, tag=_tag(1)))
    assert _values(path) == [1, 2, 3]


def test_a_commit_by_hand_from_behind_its_handle_steps_over_an_operators_commit(warehouse):
    """A topic's commits are appended by hand (`driver_writes.write(by_hand=True)`),
    the handle left behind them: the fence reads the version they reached."""
    path = f"{warehouse}/t"
    _table(path, 1)
    mine = Lease(warehouse, TTL_S).acquire()
    handle = kept_tables.take(path, options_for(path), behind_own_appends=True)

    def by_hand(value: int, run: int):
        rows = pa.table({"v": [value]})
        return lambda: driver_writes.write(rows, handle, "append", _tag(run), by_hand=True)

    assert fence.commit(handle, mine, by_hand(2, 1)) == 1
    assert handle.version() == 0  # left behind: no listing of the log
    _append(DeltaTable(path), 3)  # an operator's commit (no run's tag)
    assert fence.commit(handle, mine, by_hand(4, 2)) == 3
    assert _values(path) == [1, 2, 3, 4]
    assert tagged_writes.committed_by_run(path, 2, "t")


def test_a_commit_by_hand_after_another_runs_commit_never_lands(warehouse):
    path = f"{warehouse}/t"
    _table(path, 1)
    mine = Lease(warehouse, TTL_S, clock=_behind).acquire()
    handle = kept_tables.take(path, options_for(path), behind_own_appends=True)
    rows = pa.table({"v": [3]})

    def stalled_then_commit() -> int:
        Lease(warehouse, TTL_S).acquire()
        _append(DeltaTable(path), 2, tag=_tag(1))
        return driver_writes.write(rows, handle, "append", _tag(9), by_hand=True)

    with pytest.raises(LeaseLost, match=r"another run \(run 1, t\) committed"):
        fence.commit(handle, mine, stalled_then_commit)
    assert _values(path) == [1, 2]
    # the file written for the refused commit is gone with it
    assert len([n for n in os.listdir(path) if n.endswith(".parquet")]) == 2


def test_a_delta_rs_commit_from_behind_its_own_appends_never_lands_after_another_run(warehouse):
    """A handle left behind its appends by hand is brought to the last of
    them, not to the latest version, before delta-rs commits through it: a
    commit from there fails on another run's, as one from the version read."""
    path = f"{warehouse}/t"
    _table(path, 1)
    mine = Lease(warehouse, TTL_S, clock=_behind).acquire()
    handle = kept_tables.take(path, options_for(path), behind_own_appends=True)
    first = pa.table({"v": [2]})
    fence.commit(
        handle, mine, lambda: driver_writes.write(first, handle, "append", _tag(8), by_hand=True)
    )

    def stalled_then_overwrite() -> int:
        Lease(warehouse, TTL_S).acquire()
        _append(DeltaTable(path), 3, tag=_tag(1))
        return driver_writes.write(pa.table({"v": [4]}), handle, "overwrite", _tag(9))

    with pytest.raises(LeaseLost, match=r"another run \(run 1, t\) committed"):
        fence.commit(handle, mine, stalled_then_overwrite)
    assert _values(path) == [1, 2, 3]


def test_a_commit_by_a_holder_that_lost_its_lease_is_not_even_tried(warehouse):
    path = f"{warehouse}/t"
    _table(path, 1)
    mine = Lease(warehouse, TTL_S, clock=_behind).acquire()
    handle = kept_tables.take(path, options_for(path))
    Lease(warehouse, TTL_S).acquire()
    with pytest.raises(LeaseLost, match="taken over"):
        fence.commit(handle, mine, lambda: _append(handle, 2))
    assert _values(path) == [1]


def test_commits_of_tables_read_before_one_check_of_the_lease_share_it(warehouse, monkeypatch):
    paths = [f"{warehouse}/a", f"{warehouse}/b"]
    for path in paths:
        _table(path, 1)
    mine = Lease(warehouse, TTL_S).acquire()
    handles = [kept_tables.take(p) for p in paths]
    reads = []
    look = mine._still_own  # each check of the lease starts with a look at its log

    def counted():
        reads.append(1)
        return look()

    monkeypatch.setattr(mine, "_still_own", counted)
    for handle in handles:  # as a run's topics are committed, after one Spark write
        fence.commit(handle, mine, lambda h=handle: _append(h, 2, tag=_tag(1)))
    assert len(reads) == 1
    fence.commit(handles[0], mine, lambda: _append(handles[0], 3, tag=_tag(1)))
    assert len(reads) == 2  # read again since: its version is newer than the check
    assert [_values(p) for p in paths] == [[1, 2, 3], [1, 2]]


def _s3_warehouse(s3) -> str:
    return use(Storage.from_config(load_config(env={}, **s3.config()))).warehouse


def _tag(run: int) -> str:
    return tagged_writes.run_tag(run, "t")


# --- whole runs -------------------------------------------------------------------------


def _seed(warehouse: str) -> None:
    """A committed message, a rolled-back one and one left pending, with
    fixed offsets so that two warehouses hold the same rows."""
    committed = fx.half(101, store_ms=NOW_MS - 5_000)
    rolled_back = fx.half(102, store_ms=NOW_MS - 5_000)
    pending = fx.half(103, store_ms=NOW_MS - 1_000)
    fx.write_halves(warehouse, committed, rolled_back, pending)
    fx.write_ops(
        warehouse, fx.op(committed, op_offset=201), fx.op(rolled_back, "ROLLBACK", op_offset=202)
    )


def _outputs(warehouse: str) -> dict:
    """The job's outputs but its run records (a takeover adds runs of its own)."""
    outputs = fx.job_outputs(warehouse)
    outputs.pop(RUNS.path)
    return outputs


def _statuses(warehouse: str) -> list[tuple[int, str]]:
    rows = DeltaTable(table_path(warehouse, RUNS)).to_pyarrow_table().to_pylist()
    return sorted((r["run_number"], r["status"]) for r in rows)


#: the commits of a run over `_seed`'s messages, each with which of its
#: commits to that table (the run records: the intent, then COMMITTED)
RUN_COMMITS = [
    (RUNS.path, 1),
    ("_sys/queues", 1),
    ("_sys/resolved", 1),
    ("topics/ORDER", 1),
    ("_sys/pending", 1),
    (RUNS.path, 2),
]


@pytest.fixture(scope="module")
def one_run(spark, tmp_path_factory) -> dict:
    """The outputs of one run over `_seed`'s messages, undisturbed."""
    clean = str(tmp_path_factory.mktemp("clean"))
    _seed(clean)
    reconcile(spark, {"warehouse": clean}, now_ms=NOW_MS)
    return _outputs(clean)


@pytest.mark.parametrize("table,nth", RUN_COMMITS, ids=[f"{t}#{n}" for t, n in RUN_COMMITS])
def test_a_run_stalled_at_any_commit_while_another_completes_it_leaves_one_runs_outputs(
    spark, tmp_path, monkeypatch, one_run, table, nth
):
    """The stalled run has checked its lease and is about to commit when the
    other run, whose clock says the lease expired, takes over, completes the
    stalled run's intent (or makes run 1 itself) and releases the lease."""
    stalled = str(tmp_path / "stalled")
    os.makedirs(stalled)
    _seed(stalled)

    commit = fence.commit
    seen: list[str] = []

    def stalls_at_the_commit(handle, lease, make):
        if lease is not None and lease.clock is _behind:
            seen.append(handle.table_uri.rstrip("/").split("/stalled/")[-1])
            if seen[-1] == table and seen.count(table) == nth:
                inner = make

                def make():
                    reconcile(spark, {"warehouse": stalled}, now_ms=NOW_MS)
                    return inner()

        return commit(handle, lease, make)

    monkeypatch.setattr(fence, "commit", stalls_at_the_commit)
    with pytest.raises(LeaseLost):
        reconcile(spark, {"warehouse": stalled}, now_ms=NOW_MS, clock=_behind)
    assert seen.count(table) >= nth, seen
    assert _outputs(stalled) == one_run
    # run 1 once, whoever wrote its intent; the other run's own run after it, if any
    assert _statuses(stalled)[:2] == [(1, "COMMITTED"), (1, "STARTED")]
    assert (1, "COMMITTED") not in _statuses(stalled)[2:]
    assert len(DeltaTable(topic_path(stalled, "ORDER")).to_pyarrow_table()) == 1


def test_a_run_on_a_host_whose_clock_is_behind_delivers_nothing_twice(
    spark, warehouse, monkeypatch
):
    """Two processes: this one's run holds the lease by a clock 700 s behind;
    another host's `txn-reconcile run`, to which that lease has expired, runs
    while this one is about to commit its deliveries."""
    _seed(warehouse)
    other: list[subprocess.CompletedProcess] = []
    commit = fence.commit

    def other_host_runs_first(handle, lease, make):
        if "/topics/" in handle.table_uri and not other:
            other.append(
                subprocess.run(
                    [sys.executable, "-m", "jobs.reconcile", "run", "--warehouse", warehouse]
                    + ["--now-ms", str(NOW_MS)],
                    cwd=REPO,
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
            )
        return commit(handle, lease, make)

    monkeypatch.setattr(fence, "commit", other_host_runs_first)
    with pytest.raises(LeaseLost, match="another run"):
        reconcile(spark, {"warehouse": warehouse}, now_ms=NOW_MS, clock=_behind)
    assert other[0].returncode == 0, other[0].stderr[-3000:]
    assert len(DeltaTable(topic_path(warehouse, "ORDER")).to_pyarrow_table()) == 1
    assert _statuses(warehouse) == [(1, "COMMITTED"), (1, "STARTED"), (2, "COMMITTED")]
    assert verify(spark, {"warehouse": warehouse}).ok
