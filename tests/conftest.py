"""Shared fixtures: one SparkSession for the whole test session, and an
S3-compatible server on loopback for the object-store tests."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from s3_loopback import Running

REPO = Path(__file__).resolve().parent.parent

#: the test session's AWS credentials: distinctive, so tests can show that
#: they appear in no output, table or error
S3_KEY_ID = "TXNTESTKEYID7Q4Z"
S3_SECRET = "txn-test-secret-9f3b1c77e2d04a85"
S3_BUCKET = "txn-tests"

# Set before any JVM starts: a JVM sees the environment it was started with,
# and the session's Spark (the `spark` fixture) may start before the `s3` one.
# No test reaches AWS itself: the object-store tests name a loopback endpoint.
os.environ.update(
    AWS_ACCESS_KEY_ID=S3_KEY_ID, AWS_SECRET_ACCESS_KEY=S3_SECRET, AWS_EC2_METADATA_DISABLED="true"
)


def pytest_collection_modifyitems(items):
    """Mark every test that uses the session's Spark `spark`, so that
    `pytest -m "not spark"` (`make test-fast`) runs the rest in seconds."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.spark)


@pytest.fixture(scope="session")
def spark():
    from jobs.session import build_spark

    # One JVM runs every test (~250 Spark tests, many full runs and audits):
    # more heap than a single run's default 2g needs; 3g ran out once the
    # delayed and cancel tests came (Java heap space in the tests after them).
    session = build_spark(
        "txn-tests",
        master="local[2]",
        conf={"spark.sql.shuffle.partitions": "2", "spark.driver.memory": "4g"},
    )
    yield session
    session.stop()


@pytest.fixture
def warehouse(tmp_path):
    """A fresh, empty warehouse directory."""
    path = tmp_path / "warehouse"
    path.mkdir()
    return str(path)


class S3Server(Running):
    """`scripts/s3_loopback.py` on a free loopback port, with `S3_BUCKET`
    created: MinIO (which checks every request's signature against the
    credentials above), or moto with `extra_args` such as
    `--no-conditional-writes`."""

    def __init__(self, server: str = "minio", *extra_args: str):
        super().__init__(server, S3_BUCKET, extra_args=extra_args)

    def config(self, prefix: str | None = None) -> dict:
        """Configuration keys of a fresh warehouse on this server."""
        return {
            "warehouse": f"s3://{S3_BUCKET}/{prefix or uuid.uuid4().hex}",
            "s3_endpoint": self.endpoint,
            "s3_path_style": True,
            "s3_allow_http": True,
        }

    @staticmethod
    def store_flags(settings: dict) -> list[str]:
        """The CLI's flags for the store of `settings` (a `config()`): its
        endpoint, path-style addressing and plain HTTP."""
        return [
            "--s3-endpoint",
            settings["s3_endpoint"],
            "--s3-path-style",
            "true",
            "--s3-allow-http",
            "true",
        ]

    def requests(self) -> dict[str, int]:
        import json
        import urllib.request

        with urllib.request.urlopen(self.counts_url, timeout=10) as resp:
            return json.load(resp)


@pytest.fixture
def opened_files(monkeypatch) -> list[tuple[str, int]]:
    """(table URI, number of files) of each pyarrow dataset delta-rs builds
    during the test: which files a read chose to open."""
    from deltalake import DeltaTable

    opened: list[tuple[str, int]] = []
    to_dataset = DeltaTable.to_pyarrow_dataset

    def counted(self, *args, **kwargs):
        dataset = to_dataset(self, *args, **kwargs)
        opened.append((self.table_uri, len(dataset.files)))
        return dataset

    monkeypatch.setattr(DeltaTable, "to_pyarrow_dataset", counted)
    return opened


@pytest.fixture(scope="session")
def s3():
    """An S3 server for the whole session (the test credentials above are in
    the environment of every process the tests start)."""
    server = S3Server()
    yield server
    server.stop()
