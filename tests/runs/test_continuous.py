"""The continuous job (jobs/continuous.py): runs back to back in one session,
each with its own run record and every rule; one lease for all of them; a
stop request finishes the run under way and releases the lease; a process
killed at any moment is followed by one that delivers exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from deltalake import DeltaTable

from jobs.continuous import parse_every, reconcile_forever
from jobs.faults import FAULT_EXIT_CODE
from jobs.lease import Lease, LeaseHeld
from jobs.reconcile import reconcile
from schemas import RESOLVED, RUNS, table_path, topic_path
from txn_core.config import ConfigError

import factories as fx
from conftest import REPO

T = 600 * 3_600_000


def _delivered(wh: str, topic: str = "ORDER") -> list[int]:
    path = topic_path(wh, topic)
    if not DeltaTable.is_deltatable(path):
        return []
    return sorted(DeltaTable(path).to_pyarrow_table().column("half_offset").to_pylist())


@pytest.mark.parametrize(
    ("text", "seconds"), [("2s", 2.0), ("500ms", 0.5), ("1m", 60.0), ("1h", 3600.0), ("1.5", 1.5)]
)
def test_a_cadence_is_a_positive_duration(text, seconds):
    assert parse_every(text) == seconds


@pytest.mark.parametrize("text", ["0", "0s", "-1s", "soon", "2 days", ""])
def test_a_cadence_that_is_not_a_positive_duration_is_refused_naming_the_flag(text):
    with pytest.raises(ConfigError, match="--every must be a positive duration"):
        parse_every(text)


def test_runs_follow_each_other_each_with_its_record_under_one_lease(spark, warehouse):
    first = [fx.half(store_ms=T - 100_000) for _ in range(3)]
    fx.write_halves(warehouse, *first)
    fx.write_ops(warehouse, *[fx.op(h) for h in first[:2]], fx.op(first[2], "ROLLBACK"))
    later = fx.half(store_ms=T - 50_000)
    summaries, stop = [], threading.Event()

    def on_run(summary) -> None:
        summaries.append(summary)
        if len(summaries) == 1:  # a producer commits while the job runs
            fx.write_halves(warehouse, later)
            fx.write_ops(warehouse, fx.op(later))
            with pytest.raises(LeaseHeld):  # a second job exits while the loop holds the lease
                reconcile(spark, {"warehouse": warehouse}, now_ms=T, clock=lambda: T / 1000)
        if len(summaries) == 3:
            stop.set()

    runs = reconcile_forever(
        spark, {"warehouse": warehouse}, 0.001, stop=stop, on_run=on_run, clock=lambda: T / 1000
    )

    assert runs == 3
    assert [s.run_number for s in summaries] == [1, 2, 3]
    assert [(s.committed, s.rolled_back, s.idle) for s in summaries] == [
        (2, 1, False),
        (1, 0, False),
        (0, 0, True),  # nothing new and nothing due: no Spark job, one run record
    ]
    assert summaries[2].duration_ms > 0  # looking at its inputs, which an idle run's 0 left out
    assert _delivered(warehouse) == sorted(
        [first[0]["half_offset"], first[1]["half_offset"], later["half_offset"]]
    )
    runs_table = DeltaTable(table_path(warehouse, RUNS)).to_pyarrow_table().to_pylist()
    assert sorted(r["run_number"] for r in runs_table if r["status"] == "COMMITTED") == [1, 2, 3]
    assert Lease(warehouse, 600).current().action == "RELEASE"


def test_a_bad_cadence_or_run_count_is_refused_before_the_lease(spark, warehouse):
    for kwargs in ({"every_s": 0}, {"every_s": -2.0}, {"every_s": 1, "max_runs": -1}):
        with pytest.raises(ConfigError):
            reconcile_forever(spark, {"warehouse": warehouse}, **kwargs)
    assert reconcile_forever(spark, {"warehouse": warehouse}, 1, max_runs=0) == 0


def test_the_last_of_max_runs_ends_the_loop_without_waiting_out_a_cadence(
    spark, warehouse, monkeypatch
):
    """It waited one more cadence after its last run, holding the lease:
    `--every 1h --max-runs 1` an hour, and a cron run meanwhile exited 75."""
    from jobs import continuous

    waits: list[float] = []
    monkeypatch.setattr(continuous, "_wait", lambda stop, seconds, lease: waits.append(seconds))
    runs = reconcile_forever(
        spark, {"warehouse": warehouse}, 3600, max_runs=2, clock=lambda: T / 1000
    )
    assert runs == 2 and len(waits) == 1  # between the two runs only
    assert Lease(warehouse, 600).current().action == "RELEASE"


# --- the command line, in processes of its own ---------------------------------------


def _start(wh: str, *flags: str, fault: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXN_FAULT")}
    env["PYTHONPATH"] = REPO
    if fault:
        env.update(TXN_FAULT_AT=fault, TXN_FAULT_MODE="kill")
    cmd = [sys.executable, "-m", "jobs.reconcile", "run", "--warehouse", wh, "--every", "100ms"]
    return subprocess.Popen(
        [*cmd, *flags], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _summaries(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _seed(wh: str) -> dict[str, list[int]]:
    """Messages to deliver on two topics, one rolled back; what must be delivered."""
    now = int(time.time() * 1000)
    order = [fx.half(store_ms=now - 100_000) for _ in range(2)]
    pay = fx.half(store_ms=now - 100_000, topic="PAY")
    rolled = fx.half(store_ms=now - 100_000)
    fx.write_halves(wh, *order, pay, rolled)
    fx.write_ops(wh, *[fx.op(h) for h in (*order, pay)], fx.op(rolled, "ROLLBACK"))
    return {"ORDER": sorted(h["half_offset"] for h in order), "PAY": [pay["half_offset"]]}


@pytest.mark.slow
def test_sigterm_finishes_the_run_under_way_releases_the_lease_and_exits_0(warehouse):
    want = _seed(warehouse)
    job = _start(warehouse)
    first = job.stdout.readline()  # the first run's summary: the loop is running
    assert json.loads(first)["committed"] == 3, job.stderr.read()[-3000:] if not first else first
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err[-3000:]
    assert all(s["committed"] == 0 for s in _summaries(out))  # later runs: idle, printed whole
    assert {t: _delivered(warehouse, t) for t in want} == want
    assert Lease(warehouse, 600).current().action == "RELEASE"


@pytest.mark.slow
@pytest.mark.parametrize("step", ["after_intent", "after:topics/ORDER", "after_commit"])
def test_a_killed_continuous_job_is_followed_by_one_that_delivers_exactly_once(warehouse, step):
    want = _seed(warehouse)
    dead = _start(warehouse, fault=step)
    out, err = dead.communicate(timeout=300)
    assert dead.returncode in (-signal.SIGKILL, FAULT_EXIT_CODE), err[-3000:]
    assert out == ""  # killed in its first run, before printing it

    # the next process takes the dead one's lease over at once (same host, pid gone)
    rerun = _start(warehouse, "--max-runs", "2")
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    first, second = _summaries(out)
    if step == "after_commit":  # the killed run was complete: nothing to redo
        assert first["redone_run_id"] is None and first["idle"]
    else:
        assert first["redone_run_id"].startswith("run-00000001-")
    assert second["idle"]
    assert {t: _delivered(warehouse, t) for t in want} == want
    resolved = DeltaTable(table_path(warehouse, RESOLVED)).to_pyarrow_table()
    assert resolved.num_rows == 4  # three commits and the rollback, each once


@pytest.mark.slow
def test_a_continuous_job_killed_from_outside_is_followed_by_one_that_goes_on(warehouse):
    want = _seed(warehouse)
    job = _start(warehouse)
    assert json.loads(job.stdout.readline())["committed"] == 3
    more = fx.half(store_ms=int(time.time() * 1000) - 1_000)
    fx.write_halves(warehouse, more)
    fx.write_ops(warehouse, fx.op(more))
    job.kill()  # SIGKILL, wherever the loop is: waiting, or in a run over `more`
    job.communicate(timeout=60)

    rerun = _start(warehouse, "--max-runs", "2")
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    want["ORDER"] = sorted([*want["ORDER"], more["half_offset"]])
    assert {t: _delivered(warehouse, t) for t in want} == want
