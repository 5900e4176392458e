"""The example Airflow DAG imports without Airflow and builds the right command."""

from __future__ import annotations

import ast
import importlib.util
import shlex
from pathlib import Path

import pytest

from jobs.session import DELTA_JAR

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = REPO / "scripts" / "airflow_dag.py"


def _load():
    spec = importlib.util.spec_from_file_location("txn_airflow_dag", DAG_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dag_module():
    return _load()


def _airflow_installed() -> bool:
    return importlib.util.find_spec("airflow") is not None


def test_imports_without_airflow(dag_module):
    if _airflow_installed():
        assert dag_module.DAG is not None and dag_module.dag.max_active_runs == 1
    else:
        # The DAG is only defined when Airflow is importable; the builders always are.
        assert dag_module.DAG is None
        assert not hasattr(dag_module, "dag")
    assert callable(dag_module.spark_submit_command)


def test_operator_kwargs(dag_module, tmp_path):
    kw = dag_module.operator_kwargs(repo=tmp_path)
    assert kw["application"] == str(tmp_path / "jobs" / "reconcile.py")
    assert kw["application_args"] == ["run", "--conf", str(tmp_path / "conf" / "reconcile.toml")]
    assert kw["packages"] == DELTA_JAR
    assert kw["py_files"] == str(tmp_path / "dist" / "txn_pyfiles.zip")
    assert kw["conf"] == {
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    }
    assert kw["conn_id"] == "spark_default"


def test_operator_kwargs_keep_absolute_conf_and_extra_args(dag_module, tmp_path):
    conf = tmp_path / "elsewhere.toml"
    kw = dag_module.operator_kwargs(
        repo=tmp_path, conf_file=str(conf), extra_args=["--warehouse", "s3a://bucket/wh"]
    )
    assert kw["application_args"] == ["run", "--conf", str(conf), "--warehouse", "s3a://bucket/wh"]


def test_repo_from_environment(dag_module, tmp_path, monkeypatch):
    monkeypatch.setenv("TXN_REPO", str(tmp_path))
    assert dag_module.operator_kwargs()["application"] == str(tmp_path / "jobs" / "reconcile.py")
    monkeypatch.delenv("TXN_REPO")
    assert dag_module.operator_kwargs()["application"] == str(REPO / "jobs" / "reconcile.py")


def test_spark_submit_command(dag_module, tmp_path):
    cmd = dag_module.spark_submit_command(master="spark://127.0.0.1:7077", repo=tmp_path)
    assert cmd[:3] == ["spark-submit", "--master", "spark://127.0.0.1:7077"]
    joined = shlex.join(cmd)
    assert f"--packages {DELTA_JAR}" in joined
    assert "--conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension" in joined
    assert (
        "--conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog"
    ) in joined
    assert f"--py-files {tmp_path / 'dist' / 'txn_pyfiles.zip'}" in joined
    # spark-submit treats everything after the application as the job's own arguments.
    app = cmd.index(str(tmp_path / "jobs" / "reconcile.py"))
    assert cmd[app + 1 :] == ["run", "--conf", str(tmp_path / "conf" / "reconcile.toml")]
    assert all(opt not in cmd[app:] for opt in ("--packages", "--py-files", "--master"))


def test_schedule_retries_and_lease_exit(dag_module):
    assert dag_module.SCHEDULE == "*/1 * * * *"
    assert dag_module.DEFAULT_ARGS["retries"] >= 1
    assert dag_module.is_lease_held(75)
    assert not dag_module.is_lease_held(0)
    assert not dag_module.is_lease_held(1)
    assert not dag_module.is_lease_held(2)


def test_fallback_jar_matches_session():
    """The literal used when `jobs` is not importable must not drift from session.py."""
    tree = ast.parse(DAG_FILE.read_text())
    fallbacks = [
        node.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "DELTA_JAR" for t in node.targets)
        and isinstance(node.value, ast.Constant)
    ]
    assert fallbacks == [DELTA_JAR]
