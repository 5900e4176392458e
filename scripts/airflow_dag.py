"""Example Airflow DAG: run the reconciliation job with SparkSubmitOperator.

Copy (or symlink) this file into Airflow's `dags/` folder on a machine that has
this repository checked out, pyspark's `spark-submit` on the PATH, and the
provider `apache-airflow-providers-apache-spark` installed. Point it at the
checkout with the environment variable `TXN_REPO` (default: the parent of the
directory holding this file) and at the Spark master with the Airflow
connection `spark_default` (e.g. `spark://host:7077`, or `local[2]` as host).
Build the code zip first, and again after every upgrade of the code:
`python scripts/build_pyfiles.py` (it writes `dist/txn_pyfiles.zip`).

Schedule. RocketMQ's checker runs every 30 s. Airflow cannot do that usefully:
the cron granularity is one minute, and the scheduler's own latency plus
~10 s of Spark start per run would make a 30-s interval overlap itself. This
DAG therefore runs every minute (`*/1 * * * *`); for a tighter cadence, run
`scripts/submit.sh run` in a loop or from cron instead (docs/operating.md).
The job's timing rules use `check_interval_ms`, not the schedule, so a
slower schedule only delays checks; it never checks a message too often.

Overlap and exit code 75. `max_active_runs=1` stops Airflow from overlapping
its own runs, but a run started by cron, by hand or by an Airflow retry can
still hold the job's lease. The job then exits 75 having changed nothing.
`LeaseAwareSparkSubmitOperator` turns exit 75 into a *skipped* task (the next
scheduled run is the retry), while any other failure (exit 1, or 2 for a bad
configuration) fails the task and is retried `retries` times. Airflow's
SparkSubmitHook only raises a generic AirflowException for a non-zero exit,
so the operator reads the exit code from the spark-submit process the hook
kept. (With a BashOperator running `scripts/submit.sh`, the built-in
`skip_on_exit_code=75` does the same.)

The module imports without Airflow: the command and the operator's keyword
arguments are built by plain functions, tested in tests/runs/test_airflow_dag.py;
the DAG object is defined only when Airflow is importable.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

try:
    from jobs.session import DELTA_JAR
except ImportError:  # Airflow's dags folder need not have the repo on sys.path
    DELTA_JAR = "io.delta:delta-spark_4.2_2.13:4.4.0"

#: exit code of a run that found another run holding the lease (docs/protocol.md §3.4)
EXIT_LEASE_HELD = 75
SCHEDULE = "*/1 * * * *"
DAG_ID = "txn_reconcile"

DELTA_CONF = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
}


def repo_dir() -> Path:
    return Path(os.environ.get("TXN_REPO") or Path(__file__).resolve().parent.parent)


def operator_kwargs(
    repo: Path | str | None = None,
    conf_file: str = "conf/reconcile.toml",
    extra_args: list[str] | None = None,
    conn_id: str = "spark_default",
) -> dict:
    """Keyword arguments of SparkSubmitOperator for one `run` of the job.

    Paths are made absolute against the checkout: Airflow starts spark-submit
    from a working directory of its own.
    """
    repo = Path(repo) if repo is not None else repo_dir()
    conf_path = Path(conf_file)
    if not conf_path.is_absolute():
        conf_path = repo / conf_path
    return {
        "application": str(repo / "jobs" / "reconcile.py"),
        "application_args": ["run", "--conf", str(conf_path), *(extra_args or [])],
        "conn_id": conn_id,
        "packages": DELTA_JAR,
        "conf": dict(DELTA_CONF),
        "py_files": str(repo / "dist" / "txn_pyfiles.zip"),
        "name": DAG_ID,
        "verbose": False,
    }


def spark_submit_command(
    master: str = "local[2]", spark_submit: str = "spark-submit", **kwargs
) -> list[str]:
    """The command line the operator ends up running (for logs, cron, and tests).

    Mirrors the order SparkSubmitHook uses: options, then the application and
    its arguments.
    """
    kw = operator_kwargs(**kwargs)
    cmd = [spark_submit, "--master", master]
    for key, value in kw["conf"].items():
        cmd += ["--conf", f"{key}={value}"]
    cmd += ["--py-files", kw["py_files"], "--packages", kw["packages"], "--name", kw["name"]]
    return cmd + [kw["application"], *kw["application_args"]]


def is_lease_held(returncode: int | None) -> bool:
    """True when a spark-submit exit code means "another run holds the lease"."""
    return returncode == EXIT_LEASE_HELD


DEFAULT_ARGS = {
    "owner": "txn",
    # Exit 1 (e.g. storage briefly unavailable) is worth retrying; a crashed run
    # is completed by the next attempt (I4, docs/protocol.md §5), so retrying is always safe.
    "retries": 2,
    "retry_delay": timedelta(seconds=30),
    # Past this Airflow kills spark-submit; the lease then frees itself after
    # lease_ttl_s (conf/reconcile.toml), and the next run redoes the work.
    "execution_timeout": timedelta(minutes=20),
}

try:
    from airflow import DAG
    from airflow.exceptions import AirflowException, AirflowSkipException
    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
except ImportError:
    DAG = None
else:

    class LeaseAwareSparkSubmitOperator(SparkSubmitOperator):
        """SparkSubmitOperator whose exit 75 (lease held elsewhere) skips the task."""

        def execute(self, context):
            try:
                return super().execute(context)
            except AirflowException:
                process = getattr(getattr(self, "_hook", None), "_submit_sp", None)
                if process is not None and is_lease_held(process.returncode):
                    raise AirflowSkipException(
                        "another reconciliation run holds the lease; nothing changed"
                    ) from None
                raise

    with DAG(
        dag_id=DAG_ID,
        schedule=SCHEDULE,
        start_date=datetime(2026, 1, 1, tzinfo=UTC),
        catchup=False,  # missed minutes need no replay: one run catches up everything
        max_active_runs=1,
        default_args=DEFAULT_ARGS,
        tags=["txn", "reconcile"],
    ) as dag:
        LeaseAwareSparkSubmitOperator(task_id="reconcile", **operator_kwargs())
