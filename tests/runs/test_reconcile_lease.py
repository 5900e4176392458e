"""One run at a time (exit 75), and the command line's exit codes."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError

from jobs import job_tables, run_log
from jobs.lease import Lease, LeaseHeld, LeaseLost
from jobs.reconcile import main, reconcile
from jobs.session import spark_master
from schemas import HALF, LEASE, RUNS, table_path
from txn_core import log_trim
from txn_core.config import ConfigError
from txn_core.tables import (
    EVERY_RUN_TABLE_CONFIG,
    SMALL_TABLE_CHECKPOINT_EVERY,
    vacuum_every_run_table,
)

import factories as fx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jobs.reconcile", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_unexpired_lease_of_another_holder_is_refused(warehouse):
    held = Lease(warehouse, ttl_s=60).acquire()
    with pytest.raises(LeaseHeld, match=held.holder):
        Lease(warehouse, ttl_s=60).acquire()
    held.release()
    Lease(warehouse, ttl_s=60).acquire()  # released: free again


def test_expired_lease_is_taken_over(warehouse):
    Lease(warehouse, ttl_s=60).acquire()  # never released, as by a crash
    with pytest.raises(LeaseHeld):
        Lease(warehouse, ttl_s=60, clock=lambda: time.time() + 59).acquire()
    taker = Lease(warehouse, ttl_s=60, clock=lambda: time.time() + 61).acquire()
    assert taker.current().holder == taker.holder


def test_of_two_runners_reading_the_same_version_only_one_commits(warehouse):
    slow = Lease(warehouse, ttl_s=60)
    with slow._read() as (table, row):
        assert row is None
        Lease(warehouse, ttl_s=60).acquire()  # the other runner commits first
        with pytest.raises(CommitFailedError):
            slow._write(table, "ACQUIRE", 0)


def test_renewal_fails_once_another_run_took_over(warehouse):
    now = [1000.0]
    mine = Lease(warehouse, ttl_s=30, clock=lambda: now[0]).acquire()
    now[0] += 31
    Lease(warehouse, ttl_s=30, clock=lambda: now[0]).acquire()
    with pytest.raises(LeaseLost):
        mine.keep_alive()


def _outcomes(lease: Lease) -> queue.Queue:
    """What the lease's keep_alive calls do, as they happen: "renewed" or the
    LeaseLost raised (calls with nothing to do are not queued). The test
    blocks on it for the renewal thread instead of polling."""
    outcomes: queue.Queue = queue.Queue()
    keep_alive = lease.keep_alive

    def observed() -> None:
        before = lease._renewed_ms
        try:
            keep_alive()
        except LeaseLost as exc:
            outcomes.put(exc)
            raise
        if lease._renewed_ms != before:
            outcomes.put("renewed")

    lease.keep_alive = observed
    return outcomes


def test_a_working_run_renews_its_lease_in_the_background_until_it_is_taken_over(warehouse):
    now = [1000.0]
    mine = Lease(warehouse, ttl_s=30, clock=lambda: now[0]).acquire()
    outcomes = _outcomes(mine)
    with mine.renewed(every_s=0.01):
        now[0] += 11  # a third of the ttl has passed: the thread renews, until 1041
        assert outcomes.get(timeout=10) == "renewed"
    assert mine.current().action == "RENEW" and mine.current().expires_ms == 1_041_000
    now[0] += 31  # the run stalls past the expiry, and another run takes over
    Lease(warehouse, ttl_s=30, clock=lambda: now[0]).acquire()
    with mine.renewed(every_s=0.01):
        assert isinstance(outcomes.get(timeout=10), LeaseLost)
    with pytest.raises(LeaseLost, match="taken over"):
        mine.keep_alive()  # and every later write stops


def test_the_renewal_thread_outlives_a_panic_in_delta_rs(warehouse):
    now = [1000.0]
    mine = Lease(warehouse, ttl_s=30, clock=lambda: now[0]).acquire()
    outcomes = _outcomes(mine)
    mine.keep_alive = fx.panicking_once(mine.keep_alive, threading.Event())
    with mine.renewed(every_s=0.01):
        now[0] += 11
        assert outcomes.get(timeout=10) == "renewed"  # after the panic, the next beat


def test_a_run_whose_lease_was_lost_writes_nothing(spark, warehouse):
    fx.write_halves(warehouse, fx.half(store_ms=0))
    lease = Lease(warehouse, ttl_s=600).acquire()
    lease.lost = "taken over (simulated)"
    with pytest.raises(LeaseLost):
        reconcile(spark, {"warehouse": warehouse}, now_ms=10**9, lease=lease)
    assert DeltaTable(table_path(warehouse, RUNS)).version() == 0  # created, never written


def test_overlapping_run_raises_lease_held_and_changes_no_table(spark, warehouse):
    fx.write_halves(warehouse, fx.half(store_ms=0))
    other = Lease(warehouse, ttl_s=600).acquire()
    before = DeltaTable(table_path(warehouse, HALF)).version(), sorted(os.listdir(warehouse))
    with pytest.raises(LeaseHeld):
        reconcile(spark, {"warehouse": warehouse}, now_ms=10**9)
    assert (
        DeltaTable(table_path(warehouse, HALF)).version(),
        sorted(os.listdir(warehouse)),
    ) == before
    assert not os.path.exists(os.path.join(warehouse, "_sys", "runs"))
    assert other.current().holder == other.holder


def test_cli_exits_75_when_the_lease_is_held_and_writes_nothing(warehouse):
    Lease(warehouse, ttl_s=600).acquire()
    lease_version = DeltaTable(os.path.join(warehouse, "_sys", "lease")).version()
    result = _cli("run", "--warehouse", warehouse)
    assert result.returncode == 75, result.stderr
    assert "lease" in result.stderr and result.stdout == ""
    assert sorted(os.listdir(os.path.join(warehouse, "_sys"))) == ["lease"]
    assert DeltaTable(os.path.join(warehouse, "_sys", "lease")).version() == lease_version


@pytest.mark.parametrize(
    "args,needle",
    [
        (["run", "--conf", "/nonexistent/reconcile.toml"], "does not exist"),
        (["run", "--check-budget", "weekly"], "check_budget"),
        (["run", "--check-max", "-1"], "check_max"),
    ],
)
def test_cli_exits_2_on_bad_configuration(tmp_path, args, needle):
    result = _cli(*args, "--warehouse", str(tmp_path / "wh"))
    assert result.returncode == 2
    assert needle in result.stderr
    assert not (tmp_path / "wh").exists()


def test_bad_environment_value_and_bad_arguments_exit_2(tmp_path, capsys):
    wh = str(tmp_path / "wh")
    assert _cli("run", "--warehouse", wh, env={"TXN_CHECK_MAX": "many"}).returncode == 2
    with pytest.raises(SystemExit) as exc:
        main(["resolve", "--transaction-id", "x"])  # neither --commit nor --rollback
    assert exc.value.code == 2
    assert main(["run", "--warehouse", wh, "--now-ms", "-5"]) == 2
    assert "now-ms" in capsys.readouterr().err
    # beyond a long: exit 1 and a TypeError or OverflowError from deep inside, the lease written
    assert main(["run", "--warehouse", wh, "--now-ms", "99999999999999999999"]) == 2
    assert "--now-ms must be an integer from 0 to 2^63-1" in capsys.readouterr().err
    # a typo a year ahead: its watermark would have made every delayed message due, for good
    ahead = int(time.time() * 1000) + 400 * 86_400_000
    for args in (["run", "--dry-run"], ["run"]):
        assert main([*args, "--warehouse", wh, "--now-ms", str(ahead)]) == 2
        assert "is more than a year after this machine's clock" in capsys.readouterr().err
    assert not os.path.exists(wh)


def test_a_clock_a_year_ahead_is_refused_by_reconcile_too(spark, tmp_path):
    wh = str(tmp_path / "wh")
    wall = 1_800_000_000.0
    with pytest.raises(ConfigError, match="now_ms 1831622400001 is more than a year after"):
        reconcile(spark, {"warehouse": wh}, now_ms=1_831_622_400_001, clock=lambda: wall)
    assert not os.path.exists(wh)


def test_commands_on_a_warehouse_nobody_used_exit_2_and_make_nothing(tmp_path, capsys):
    """On a mistyped path `status` and `verify` reported all clear (exit 0),
    and `resolve` and `cancel` made a new warehouse there."""
    wh = str(tmp_path / "typo")
    for args in (
        ["status"],
        ["verify"],
        ["resolve", "--transaction-id", "x", "--commit"],
        ["cancel", "--msg-id", "x"],
        ["run", "--dry-run"],  # printed an all-clear run, exit 0
    ):
        assert main([*args, "--warehouse", wh]) == 2, args
        assert f"no warehouse at {wh} (it has no _sys/half and no _sys/runs)" in (
            capsys.readouterr().err
        )
    assert not os.path.exists(wh)
    # an empty id is a bad argument (exit 2), as a missing one is
    for args in (["resolve", "--transaction-id", "", "--commit"], ["cancel", "--msg-id", " "]):
        assert main([*args, "--warehouse", wh]) == 2, args
        assert "must name a message" in capsys.readouterr().err


def test_the_command_line_refuses_before_spark_what_spark_would_refuse_late(
    tmp_path, capsys, monkeypatch
):
    wh = str(tmp_path / "wh")
    # every configuration key has its flag, as documented (docs/protocol.md §3.4)
    assert main(["run", "--warehouse", wh, "--topic-log-retention-hours", "0"]) == 2
    assert "topic_log_retention_hours from arguments is out of range" in capsys.readouterr().err
    assert main(["status", "--warehouse", wh, "--now-ms", "-5"]) == 2  # was echoed back
    assert "--now-ms must be an integer from 0 to 2^63-1 (ms); got -5" in capsys.readouterr().err
    # Python's spelling of a level: exit 1 once the JVM had started
    monkeypatch.setenv("TXN_SPARK_LOG_LEVEL", "WARNING")
    assert main(["run", "--warehouse", wh]) == 2
    assert "TXN_SPARK_LOG_LEVEL must be one of ALL, DEBUG" in capsys.readouterr().err
    monkeypatch.delenv("TXN_SPARK_LOG_LEVEL")
    # a master Spark refuses: exit 1 and a Java stack trace that did not name the variable
    monkeypatch.setenv("TXN_SPARK_MASTER", "bogus")
    assert main(["status", "--warehouse", wh]) == 2
    assert "TXN_SPARK_MASTER must be local, local[N], spark://host:port, yarn or k8s://...; " in (
        capsys.readouterr().err
    )
    # resolve and cancel start no Spark: the master is not theirs to refuse
    assert main(["cancel", "--msg-id", "x", "--warehouse", wh]) == 2
    assert "no warehouse at" in capsys.readouterr().err
    monkeypatch.setenv("TXN_SPARK_MASTER", "")  # unset, as scripts/submit.sh takes it
    assert spark_master() == "local[2]"
    assert not os.path.exists(wh)


def test_submit_sh_passes_help_and_a_flag_without_its_value_to_the_job():
    """`scripts/submit.sh run --help` put the help text among the JVM's options
    (the JVM took `usage:` for its main class), and `--conf` without a value
    was reported by a helper parser calling itself `-c`."""
    from jobs.reconcile import submit_java_options
    from jobs.session import DELTA_JAR, submit_packages

    assert "usage" not in submit_java_options(["run", "--help"])
    assert submit_packages(["run", "--conf"]) == DELTA_JAR
    done = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "submit.sh"), "run", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage: txn-reconcile run" in done.stdout
    # a master spark-submit refuses: exit 1 and a Java stack trace, the variable unnamed
    refused = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "submit.sh"), "run"],
        cwd=REPO,
        env={**os.environ, "TXN_SPARK_MASTER": "bogus"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr == (
        "submit.sh: bad configuration: TXN_SPARK_MASTER must be local, local[N], "
        "spark://host:port, yarn or k8s://...; got 'bogus'\n"
    )


@pytest.mark.parametrize("signals", ["term", "term-twice"])
def test_a_stop_signal_lets_a_run_finish_and_release_its_lease_and_a_second_stops_it(
    spark, warehouse, signals
):
    """A scheduler stops a run with SIGTERM (Airflow's timeout, `kill`).
    The run used to die at once and keep its lease, which a run from
    another host waited `lease_ttl_s` for. Now the first signal lets it
    finish; a second ends it at once, and the next run completes it."""
    halves = [fx.half(store_ms=0) for _ in range(3)]
    fx.write_halves(warehouse, *halves)
    fx.write_ops(warehouse, *(fx.op(h) for h in halves))
    stopped = _cli(
        "run",
        "--warehouse",
        warehouse,
        "--now-ms",
        "1000000",
        env={"TXN_FAULT_AT": "after_intent", "TXN_FAULT_MODE": signals},
    )
    assert "SIGTERM: finishing the run under way" in stopped.stderr
    lease = Lease(warehouse, ttl_s=600).current()
    if signals == "term":
        assert stopped.returncode == 0, stopped.stderr[-3000:]
        assert json.loads(stopped.stdout.splitlines()[-1])["delivered_by_topic"] == {"ORDER": 3}
        assert lease.action == "RELEASE"
    else:
        assert stopped.returncode == -signal.SIGTERM, stopped.stderr[-3000:]
        assert lease.action != "RELEASE"
        assert run_log.last_run(warehouse).status == "STARTED"
        redone = reconcile(spark, {"warehouse": warehouse}, now_ms=2_000_000)
        assert redone.delivered_by_topic == {}  # the redo delivered them, before this run
    delivered = DeltaTable(os.path.join(warehouse, "topics", "ORDER")).to_pyarrow_table()
    assert sorted(delivered["half_offset"].to_pylist()) == sorted(h["half_offset"] for h in halves)


def test_python_dash_m_jobs_is_the_same_command_line():
    done = subprocess.run(
        [sys.executable, "-m", "jobs", "run", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: txn-reconcile run") and "--dry-run" in done.stdout


def _newest_checkpoint(table: str) -> int | None:
    """The version of a local table's newest checkpoint (None: none yet)."""
    try:
        with open(os.path.join(table, "_delta_log", "_last_checkpoint")) as f:
            return json.load(f)["version"]
    except FileNotFoundError:
        return None


def _run_record(number: int, status: str) -> run_log.RunRecord:
    return run_log.RunRecord(
        **dict.fromkeys(run_log.InputVersions.__dataclass_fields__, -1),
        run_id=f"run-{number:08d}",
        run_number=number,
        status=status,
        now_ms=number,
        started_ms=number,
        state_versions={},
        rules_json="{}",
    )


def test_the_lease_and_run_logs_are_checkpointed_every_ten_commits(warehouse):
    """Both take commits every run and are read several times a run, each
    read replaying the log from the newest checkpoint (a GET per entry on
    an object store): left to the tables' own intervals (50, 100), the
    replay grew by a few entries with every run."""
    every = SMALL_TABLE_CHECKPOINT_EVERY
    for _ in range(every // 2 + 1):  # the creation, then two commits each
        Lease(warehouse, ttl_s=60).acquire().release()
    assert _newest_checkpoint(table_path(warehouse, LEASE)) == every
    Lease(warehouse, ttl_s=60).acquire()  # read from the checkpoint on

    job_tables.ensure_job_tables(warehouse)
    runs = table_path(warehouse, RUNS)
    assert _newest_checkpoint(runs) is None
    for number in range(1, every // 2 + 1):
        run_log.write_run_record(warehouse, _run_record(number, "STARTED"))
        run_log.write_run_record(warehouse, _run_record(number, "COMMITTED"))
    assert DeltaTable(runs).version() == every
    assert _newest_checkpoint(runs) == every
    last = run_log.last_run(warehouse)
    assert (last.run_number, last.status) == (every // 2, "COMMITTED")


def _data_files(table: str) -> int:
    return sum(n.endswith(".parquet") for n in os.listdir(table))


def test_the_lease_and_run_logs_keep_their_last_entries_only(warehouse, monkeypatch):
    """Both take commits at every run, idle or not: kept whole, their logs
    made every commit, and every idle run of a continuous job, slower by the
    hour (delta-rs lists a local log whole; docs/performance.md)."""
    monkeypatch.setattr(log_trim, "KEPT_ENTRIES", 20)
    for _ in range(40):  # the creation, then two commits each
        Lease(warehouse, ttl_s=60).acquire().release()
    lease = table_path(warehouse, LEASE)
    # at version 80: trimmed to the newest checkpoint at least 20 versions back
    assert fx.logged_versions(lease) == list(range(60, 81))
    held = Lease(warehouse, ttl_s=60).acquire()
    with pytest.raises(LeaseHeld, match=held.holder):
        Lease(warehouse, ttl_s=60).acquire()

    job_tables.ensure_job_tables(warehouse)
    runs = table_path(warehouse, RUNS)
    for number in range(1, 21):
        run_log.write_run_record(warehouse, _run_record(number, "STARTED"))
        run_log.write_run_record(warehouse, _run_record(number, "COMMITTED"))
    assert fx.logged_versions(runs) == list(range(20, 41))
    assert DeltaTable(runs).to_pyarrow_table().num_rows == 40
    last = run_log.last_run(warehouse)
    assert (last.run_number, last.status) == (20, "COMMITTED")


def test_no_commit_can_take_a_version_the_trimmed_log_no_longer_holds(warehouse, monkeypatch):
    """What makes trimming safe: a commit is a put-if-absent of the next
    version's entry, which would succeed where that entry was trimmed; but
    delta-rs refuses to commit from a handle whose version is gone."""
    monkeypatch.setattr(log_trim, "KEPT_ENTRIES", 10)
    Lease(warehouse, ttl_s=60).acquire().release()
    lease = table_path(warehouse, LEASE)
    stale = DeltaTable(lease)  # version 2, as a process paused long enough would hold it
    for _ in range(15):
        Lease(warehouse, ttl_s=60).acquire().release()
    assert fx.logged_versions(lease)[0] > stale.version() + 1
    last = Lease(warehouse, ttl_s=60).current()
    with pytest.raises(DeltaError):
        Lease(warehouse, ttl_s=60)._write(stale, "ACQUIRE", 2**62)
    assert Lease(warehouse, ttl_s=60).current() == last


def test_the_files_the_lease_and_run_records_leave_are_deleted(warehouse):
    for _ in range(5):  # a file each commit, one of them live
        Lease(warehouse, ttl_s=60).acquire().release()
    job_tables.ensure_job_tables(warehouse)
    runs = table_path(warehouse, RUNS)
    for number in range(1, 6):
        run_log.write_run_record(warehouse, _run_record(number, "COMMITTED"))
    assert job_tables.compact_job_tables(warehouse, (RUNS,)) == {RUNS.path: 5}
    # a table made by an earlier release, with Delta's week
    DeltaTable(runs).alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "interval 7 days"}
    )
    held = Lease(warehouse, ttl_s=60).acquire()
    # what was replaced within the hour is kept
    assert job_tables.vacuum_every_run_tables(warehouse, held) == {LEASE.path: 0, RUNS.path: 0}
    assert DeltaTable(runs).metadata().configuration == {
        **job_tables.table_properties(RUNS),
        **EVERY_RUN_TABLE_CONFIG,
    }
    assert held.vacuum(retention_hours=0) == 10
    assert vacuum_every_run_table(DeltaTable(runs), retention_hours=0) == 5
    assert _data_files(table_path(warehouse, LEASE)) == 1 and _data_files(runs) == 1
    assert held.current().holder == held.holder
    held.keep_alive()
    assert sorted(r["run_number"] for r in DeltaTable(runs).to_pyarrow_table().to_pylist()) == [
        1,
        2,
        3,
        4,
        5,
    ]


def test_the_run_records_upkeep_vacuums_the_lease_and_the_run_records(
    spark, warehouse, monkeypatch
):
    vacuumed = []
    monkeypatch.setattr(job_tables, "upkeep_due", lambda number: [RUNS.path])
    monkeypatch.setattr(
        job_tables, "vacuum_every_run_tables", lambda wh, lease: vacuumed.append((wh, lease.held))
    )
    reconcile(spark, {"warehouse": warehouse}, now_ms=1_000)
    assert vacuumed == [(warehouse, True)]
