"""Shared fixtures: one SparkSession for the whole test session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from jobs.session import build_spark

    # One JVM runs every test (~175, many full runs and audits): more heap
    # than a single run's default 2g needs.
    session = build_spark("txn-tests", master="local[2]",
                          conf={"spark.sql.shuffle.partitions": "2",
                                "spark.driver.memory": "3g"})
    yield session
    session.stop()


@pytest.fixture
def warehouse(tmp_path):
    """A fresh, empty warehouse directory."""
    path = tmp_path / "warehouse"
    path.mkdir()
    return str(path)
