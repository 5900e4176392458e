"""I4: killing a run at any step and running again gives the same tables as a
run that was never killed. Faults are injected by TXN_FAULT_AT (jobs/faults.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from deltalake import DeltaTable

from jobs import driver_writes, faults, pipeline
from jobs.faults import FAULT_EXIT_CODE, InjectedFault
from jobs.lease import LeaseHeld
from jobs.reconcile import reconcile, recover

import factories as fx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 500 * 3_600_000
STEPS = [
    "after_lease",
    "after_intent",
    "after:topics/ORDER",
    "after:topics/PAY",
    "after:_sys/check_requests",
    "after:_sys/discard",
    "after:_sys/resolved",
    "after:_sys/rejected",
    "after:_sys/queues",
    "after:_sys/pending",
    "after_commit",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    """Producer tables whose first run writes every output table."""
    wh = str(tmp_path_factory.mktemp("base") / "warehouse")
    os.makedirs(wh)
    delivered, checked, expired, waiting = (
        fx.half(store_ms=T - 100_000),
        fx.half(store_ms=T - 100_000),
        fx.half(store_ms=T - 73 * 3_600_000),
        fx.half(store_ms=T),
    )
    paid = fx.half(store_ms=T - 100_000, topic="PAY")  # two topics: a crash between their commits
    plain = fx.half(store_ms=T - 100_000, message_type="NORMAL")  # delivered with no OP
    fx.write_halves(
        wh,
        delivered,
        checked,
        expired,
        waiting,
        paid,
        plain,
        fx.half(store_ms=T, topic="bad topic"),
    )
    fx.write_ops(wh, fx.op(delivered), fx.op(delivered, "ROLLBACK"), fx.op(paid))
    return wh


@pytest.fixture(scope="module")
def baseline(spark, base, tmp_path_factory):
    wh = str(tmp_path_factory.mktemp("clean") / "warehouse")
    shutil.copytree(base, wh)
    faults.SEEN.clear()
    summary = reconcile(spark, {"warehouse": wh}, now_ms=T)
    assert summary.delivered_by_topic == {"ORDER": 2, "PAY": 1}  # a plain message among them
    # the output writes run concurrently: their steps come in any order
    assert faults.SEEN[:2] == STEPS[:2] and faults.SEEN[-1] == STEPS[-1]
    assert sorted(faults.SEEN) == sorted(STEPS), "the scenario must reach every write step"
    return fx.job_outputs(wh), summary


def _copy(base: str, tmp_path) -> str:
    wh = str(tmp_path / "warehouse")
    shutil.copytree(base, wh)
    return wh


def _later() -> float:
    return time.time() + 3600  # the crashed run's lease (ttl 600 s) has expired


@pytest.fixture(params=["collected", "spark"])
def write_path(request, monkeypatch) -> str:
    """How the run writes its (few) rows: collected by the driver, as a run
    this small does, or by Spark, as a bigger one does (jobs.driver_writes)."""
    if request.param == "spark":
        monkeypatch.setattr(driver_writes, "NARROW_MAX_ROWS", -1)
        monkeypatch.setattr(driver_writes, "MESSAGE_MAX_ROWS", -1)
        # and its passes: the undecided messages decided, then given their bodies
        monkeypatch.setattr(pipeline, "UNDELIVERED_ONE_PASS_MAX_ROWS", -1)
        monkeypatch.setattr("jobs.interpreted.INTERPRETED_MAX_ROWS", -1)
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_kill_at_step_then_rerun_gives_the_uninterrupted_tables(
    spark, base, baseline, step, write_path, tmp_path, monkeypatch
):
    clean_tables, clean_summary = baseline
    wh = _copy(base, tmp_path)
    cfg = {"warehouse": wh}
    monkeypatch.setenv("TXN_FAULT_AT", step)
    with pytest.raises(InjectedFault):
        reconcile(spark, cfg, now_ms=T)
    monkeypatch.delenv("TXN_FAULT_AT")
    with pytest.raises(LeaseHeld):  # the "dead" run's lease holds until it expires
        reconcile(spark, cfg, now_ms=T)

    redone = recover(spark, cfg, clock=_later)
    if step == "after_lease":  # died before its intent: there is nothing to redo
        assert redone is None
        reconcile(spark, cfg, now_ms=T, clock=_later)
    elif step == "after_commit":
        assert redone is None
    else:
        drop = {"duration_ms", "redone_run_id"}
        assert {k: v for k, v in redone.to_dict().items() if k not in drop} == {
            k: v for k, v in clean_summary.to_dict().items() if k not in drop
        }
    assert fx.job_outputs(wh) == clean_tables


@pytest.mark.slow
def test_process_killed_mid_run_is_redone_by_the_next_process(base, baseline, tmp_path):
    clean_tables, clean_summary = baseline
    wh = _copy(base, tmp_path)
    cmd = [sys.executable, "-m", "jobs.reconcile", "run", "--warehouse", wh, "--now-ms", str(T)]
    env = {
        **os.environ,
        "TXN_FAULT_AT": "after:_sys/resolved",
        "TXN_FAULT_MODE": "exit",
        "PYTHONPATH": REPO,
    }
    killed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == FAULT_EXIT_CODE, killed.stderr[-2000:]
    assert killed.stdout == ""

    env = {k: v for k, v in env.items() if not k.startswith("TXN_FAULT")}
    rerun = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    # the dead process's lease is recognised as stale (same host, pid gone): exit 0 at once
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["redone_run_id"] == clean_summary.run_id
    assert summary["run_number"] == 2 and summary["half_read"] == 0
    tables = fx.job_outputs(wh)
    tables["_sys/runs"] = [r for r in tables["_sys/runs"] if "('run_number', 2)" not in r]
    assert tables == clean_tables


def test_a_redo_finds_the_tagged_commit_of_its_run_past_untagged_ones(spark, tmp_path):
    from deltalake import write_deltalake

    from jobs import tagged_writes

    path = str(tmp_path / "t")
    rows = spark.createDataFrame([(1,)], "x int")
    assert not tagged_writes.committed_by_run(path, 7, "t")  # no table yet
    assert tagged_writes.write_for_run(rows, path, 6, "t")
    assert tagged_writes.write_for_run(rows, path, 7, "other")
    assert tagged_writes.write_for_run(rows, path, 7, "t")
    write_deltalake(path, DeltaTable(path).to_pyarrow_table().slice(0, 1), mode="append")
    assert tagged_writes.committed_by_run(path, 7, "t")  # the operator's append is stepped over
    assert not tagged_writes.committed_by_run(path, 8, "t")  # a later run never wrote
    # a redo skips what its run wrote, and writes what it did not
    assert not tagged_writes.write_for_run(rows, path, 7, "t", redo=True)
    assert tagged_writes.write_for_run(rows, path, 8, "t", redo=True)
    assert DeltaTable(path).to_pyarrow_table().num_rows == 5
    # beyond the newest commits read first: the whole history is read
    for _ in range(tagged_writes.RECENT_COMMITS):
        write_deltalake(path, DeltaTable(path).to_pyarrow_table().slice(0, 1), mode="append")
    assert tagged_writes.committed_by_run(path, 8, "t") and not tagged_writes.committed_by_run(
        path, 8, "x"
    )
    # a run that crashed under the job before the tags: Delta's txnAppId record
    (
        rows.write.format("delta")
        .mode("append")
        .option("txnAppId", "reconcile:legacy")
        .option("txnVersion", 9)
        .save(path)
    )
    assert tagged_writes.committed_by_run(path, 9, "legacy")
    assert not tagged_writes.committed_by_run(path, 10, "legacy")
