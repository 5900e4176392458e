"""Shared fixtures: one SparkSession for the whole test session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from jobs.session import build_spark

    session = build_spark("txn-tests", master="local[2]",
                          conf={"spark.sql.shuffle.partitions": "2"})
    yield session
    session.stop()


@pytest.fixture
def warehouse(tmp_path):
    """A fresh, empty warehouse directory."""
    path = tmp_path / "warehouse"
    path.mkdir()
    return str(path)
