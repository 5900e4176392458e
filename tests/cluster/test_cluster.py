"""The job on a real Spark standalone cluster, code shipped with --py-files.

A master and one worker are started on loopback from pyspark's own
`spark-class`, the reconciliation is submitted to them through
`scripts/submit.sh`, and exactly the processes started here are stopped.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import zipfile
from pathlib import Path

import build_pyfiles
import pytest

import factories as fx

pytestmark = pytest.mark.spark  # a Spark cluster of its own

REPO = Path(__file__).resolve().parents[2]

STARTUP_TIMEOUT_S = 60
#: what the worker logs once the master has accepted it
WORKER_REGISTERED = b"Successfully registered with master"
# Generous: ~40 s on an idle 2-core machine, several times that when it is shared.
SUBMIT_TIMEOUT_S = 300
STOP_TIMEOUT_S = 15


def test_pyfiles_zip_holds_the_packages(tmp_path):
    out = build_pyfiles.build_zip(tmp_path / "code.zip")
    names = set(zipfile.ZipFile(out).namelist())
    for package in build_pyfiles.PACKAGES:
        assert f"{package}/__init__.py" in names
    assert "jobs/session.py" in names and "schemas/tables.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    # Same sources, same bytes: a rebuild is not a new artefact.
    again = build_pyfiles.build_zip(tmp_path / "again.zip")
    assert out.read_bytes() == again.read_bytes()


def _spark_bin() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent / "bin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYTHON"] = sys.executable
    # SPARK_TESTING would make Ivy look for the Delta jar in ./dummy/.m2.
    env.pop("SPARK_TESTING", None)
    # The test session's own PySpark settings must not leak into the children.
    for key in ("PYSPARK_GATEWAY_PORT", "PYSPARK_GATEWAY_SECRET", "SPARK_SUBMIT_ARGS"):
        env.pop(key, None)
    return env


class Cluster:
    """One master and one worker; remembers exactly the processes it started."""

    def __init__(self, root: Path):
        self.root = root
        self.master_port = _free_port()
        self.master_ui = _free_port()
        self.worker_port = _free_port()
        self.worker_ui = _free_port()
        self.work_dir = root / "work"
        self.procs: list[subprocess.Popen] = []
        self.env = _base_env()
        self._worker_log: LogWatch | None = None

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def _spawn(self, name: str, args: list[str], marker: bytes | None = None) -> LogWatch:
        # A session of its own: stopping its process group reaches exactly the
        # JVM spark-class execs (and the executors it forks), nothing else.
        proc = subprocess.Popen(
            [str(_spark_bin() / "spark-class"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            cwd=self.root,
        )
        self.procs.append(proc)
        return LogWatch(proc, self.root / f"{name}.log", marker)

    def start(self) -> None:
        self._spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.master_port),
                "--webui-port",
                str(self.master_ui),
            ],
        )
        self._worker_log = self._spawn(
            "worker",
            [
                "org.apache.spark.deploy.worker.Worker",
                self.url,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.worker_port),
                "--webui-port",
                str(self.worker_ui),
                "--cores",
                "1",
                "--memory",
                "1g",
                "--work-dir",
                str(self.work_dir),
            ],
            marker=WORKER_REGISTERED,
        )

    def state(self) -> dict:
        """The master's status (its JSON page)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.master_ui}/json/", timeout=10) as resp:
            return json.load(resp)

    def wait_for_worker(self) -> dict:
        """Block until the worker logs that the master accepted it; the
        master's status then. (The master's web pages are all attached by
        then: it registers workers only once it has started, UI included.)"""
        watch = self._worker_log
        if not watch.seen.wait(STARTUP_TIMEOUT_S):
            raise AssertionError(f"no worker registered within {STARTUP_TIMEOUT_S}s\n{self.logs()}")
        assert watch.found, f"the worker stopped before registering:\n{self.logs()}"
        return self.state()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        """SIGTERM each started process group, SIGKILL what is left at the deadline."""
        for proc in self.procs:
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=STOP_TIMEOUT_S)
        # The executor JVM the worker forked is in the worker's group and can
        # outlive it for a moment.
        for proc in self.procs:
            if not _group_gone(proc.pid, deadline):
                _signal_group(proc.pid, signal.SIGKILL)

    def assert_stopped(self) -> None:
        for proc in self.procs:
            assert proc.poll() is not None
            assert _group_gone(proc.pid, time.monotonic() + STOP_TIMEOUT_S)


class LogWatch:
    """Copies a process's output to its log file from a thread; `seen` is set
    once a line holds `marker` (`found` True) or the output ends (False)."""

    def __init__(self, proc: subprocess.Popen, path: Path, marker: bytes | None):
        self.marker, self.found, self.seen = marker, False, threading.Event()
        threading.Thread(target=self._copy, args=(proc.stdout, path), daemon=True).start()

    def _copy(self, stream, path: Path) -> None:
        with stream, open(path, "wb") as log:
            for line in stream:
                log.write(line)
                log.flush()
                if self.marker and not self.found and self.marker in line:
                    self.found = True
                    self.seen.set()
        self.seen.set()


def _group_gone(pgid: int, deadline: float) -> bool:
    """Wait until no process of group `pgid` is left, or the deadline passes."""
    while (members := _group_members(pgid)) and time.monotonic() < deadline:
        _wait_for_an_exit(members, deadline - time.monotonic())
    return not _group_members(pgid)


def _wait_for_an_exit(pids: list[int], timeout: float) -> None:
    """Block until one of `pids` exits (or `timeout` s pass). They are the
    worker's grandchildren (the executor JVM), which this process cannot
    wait() for; a pidfd becomes readable when its process exits."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            return  # already gone: the caller looks again
    try:
        select.select(fds, [], [], max(timeout, 0))
    finally:
        for fd in fds:
            os.close(fd)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command name: state, ppid, pgrp, ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _run_in_own_group(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` in a process group of its own; on timeout kill the whole group,
    so the Python driver spark-submit forked does not outlive the test."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=SUBMIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=STOP_TIMEOUT_S)
        raise AssertionError(
            f"spark-submit did not finish in {SUBMIT_TIMEOUT_S}s:\n{err[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _write_warehouse(warehouse: str) -> dict:
    """Three commits, a rollback and a pending message, written as producers do."""
    store = 1_000_000
    halves = [
        fx.half(100 + i, store_ms=store, queue_id=i % 2, body=bytes([i, 0, 255]) * 3)
        for i in range(5)
    ]
    fx.write_halves(warehouse, *halves[:3])
    fx.write_halves(warehouse, *halves[3:])
    fx.write_ops(
        warehouse,
        *[
            fx.op(halves[i], action, op_offset=500 + i)
            for i, action in enumerate(["COMMIT", "COMMIT", "ROLLBACK", "COMMIT"])
        ],
    )
    return {"store_ms": store}


@pytest.mark.slow
@pytest.mark.parametrize("store", ["local", "s3"])
def test_reconcile_on_standalone_cluster(tmp_path, store, request):
    from deltalake import DeltaTable

    from schemas import topic_path
    from txn_core import load_config
    from txn_core.storage import Storage, options_for, use

    store_flags: list[str] = []
    if store == "s3":  # the executors reach the bucket with the driver's settings
        server = request.getfixturevalue("s3")
        settings = server.config()
        warehouse = use(Storage.from_config(load_config(env={}, **settings))).warehouse
        store_flags = server.store_flags(settings)
    else:
        warehouse = str(tmp_path / "warehouse")
    expected = _write_warehouse(warehouse)
    cluster_root = tmp_path / "cluster"
    cluster_root.mkdir()
    cluster = Cluster(cluster_root)
    try:
        cluster.start()
        state = cluster.wait_for_worker()
        assert state["aliveworkers"] == 1 and state["cores"] == 1
        env = dict(cluster.env, TXN_SPARK_MASTER=cluster.url)
        now_ms = expected["store_ms"] + 1_000  # inside immunity: the pending one is not checked
        done = _run_in_own_group(
            [
                str(REPO / "scripts" / "submit.sh"),
                "run",
                "--warehouse",
                warehouse,
                *store_flags,
                "--now-ms",
                str(now_ms),
            ],
            cwd=tmp_path,
            env=env,
        )
        assert done.returncode == 0, f"{done.stderr[-4000:]}\n{cluster.logs()}"
        summary_lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert len(summary_lines) == 1, done.stdout
        summary = json.loads(summary_lines[0])
        assert summary["now_ms"] == now_ms
        assert summary["committed"] == 3 and summary["rolled_back"] == 1
        assert summary["pending_after"] == 1
        assert summary["delivered_by_topic"] == {"ORDER": 3}

        topic = topic_path(warehouse, "ORDER")
        delivered = (
            DeltaTable(topic, storage_options=options_for(topic)).to_pyarrow_table().to_pylist()
        )
        assert sorted(r["transaction_id"] for r in delivered) == ["tx-100", "tx-101", "tx-103"]
        for row in delivered:
            i = row["half_offset"] - 100
            assert row["body"] == bytes([i, 0, 255]) * 3
        # Dense per queue, in commit order (tx-101 before tx-103 within one OP commit).
        placed = {r["transaction_id"]: (r["queue_id"], r["queue_offset"]) for r in delivered}
        assert placed == {"tx-100": (0, 0), "tx-101": (1, 0), "tx-103": (1, 1)}

        # The work ran on the executor: it fetched the shipped code zip.
        shipped = list(cluster.work_dir.glob("app-*/*/txn_pyfiles.zip"))
        assert shipped, f"no executor fetched the zip under {cluster.work_dir}"
    finally:
        cluster.stop()
    cluster.assert_stopped()
