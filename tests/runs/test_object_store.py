"""The warehouse on an S3-compatible server (MinIO, on loopback, started by
`conftest.s3`): one URI for both engines, concurrent producer processes, the
job's whole cycle, a killed run, and every bad store named before a write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from jobs import scheduled
from jobs.faults import FAULT_EXIT_CODE
from jobs.reconcile import main, reconcile
from jobs.status import status
from jobs.verify import verify
from schemas import CONSUMER_MEMBERS, HALF, OP, RUNS, table_path, topic_path
from schemas.tables import SCHEDULED
from txn_core import (
    Broker,
    ConfigError,
    Consumer,
    ConsumeResult,
    LocalTransactionState,
    Message,
    Producer,
    PushConsumer,
    TransactionListener,
    TransactionProducer,
    load_config,
)
from txn_core.consumer import read_topic
from txn_core.maintenance import maintain
from txn_core.storage import Storage, StorageError, options_for, use

import factories as fx
from conftest import REPO, S3_KEY_ID, S3_SECRET, S3Server

S = LocalTransactionState
T = 1_800_000_000_000
#: a secret the store does not know (MinIO checks signatures)
WRONG_SECRET = "not-the-secret-0c4d9e2a"


def _rows(uri: str) -> list[dict]:
    return DeltaTable(uri, storage_options=options_for(uri)).to_pyarrow_table().to_pylist()


def _no_secrets(*texts: str) -> None:
    for text in texts:
        assert S3_SECRET not in text and S3_KEY_ID not in text


# --- configuration: no server needed ------------------------------------------------


def test_one_warehouse_uri_is_mapped_for_each_engine():
    cfg = load_config(
        env={},
        warehouse="s3://bucket/wh/",
        s3_endpoint="http://127.0.0.1:9000",
        s3_path_style=True,
        s3_allow_http=True,
        s3_region="eu-west-1",
    )
    assert cfg.warehouse == "s3a://bucket/wh"  # what delta-rs and Spark's s3a both read
    storage = Storage.from_config(cfg)
    assert storage.delta_rs_options() == {
        "AWS_REGION": "eu-west-1",
        "AWS_CONDITIONAL_PUT": "etag",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false",
        "AWS_ALLOW_HTTP": "true",
    }
    assert storage.hadoop_options() == {
        "fs.s3a.bucket.bucket.endpoint.region": "eu-west-1",
        "fs.s3a.bucket.bucket.path.style.access": "true",
        "fs.s3a.bucket.bucket.aws.credentials.provider": (
            "software.amazon.awssdk.auth.credentials.DefaultCredentialsProvider"
        ),
        "fs.s3a.bucket.bucket.endpoint": "http://127.0.0.1:9000",
        "fs.s3a.bucket.bucket.connection.ssl.enabled": "false",
    }
    # virtual-hosted requests to a custom endpoint go to bucket.host
    hosted = Storage(warehouse="s3a://bucket/wh", endpoint="https://store.example:9000")
    assert hosted.delta_rs_options()["AWS_ENDPOINT_URL"] == "https://bucket.store.example:9000"
    assert Storage(warehouse="/tmp/wh").delta_rs_options() is None
    assert Storage(warehouse="/tmp/wh").hadoop_options() == {}


def test_store_settings_follow_the_precedence_of_every_key(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text(
        'warehouse = "s3a://b/wh"\ns3_endpoint = "https://file:1"\ns3_path_style = true\n'
    )
    env = {"TXN_S3_ENDPOINT": "https://env:2", "TXN_S3_PATH_STYLE": "false"}
    cfg = load_config(conf, env=env, s3_endpoint="https://flag:3")
    assert (cfg.s3_endpoint, cfg.s3_path_style) == ("https://flag:3", False)
    assert load_config(conf, env={}).s3_path_style is True


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"warehouse": "http://host/wh"}, "unsupported scheme 'http'"),
        ({"warehouse": "s3:///wh"}, "names no bucket"),
        ({"warehouse": "s3://b/wh", "s3_endpoint": "http://127.0.0.1:9000"}, "s3_allow_http"),
        ({"s3_endpoint": "127.0.0.1:9000"}, "s3_endpoint"),
        ({"s3_path_style": "yes"}, "s3_path_style"),
    ],
)
def test_bad_store_settings_are_refused_naming_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(env={}, **overrides)


def test_a_bad_boolean_in_the_environment_names_the_variable():
    with pytest.raises(ConfigError, match="TXN_S3_ALLOW_HTTP"):
        load_config(env={"TXN_S3_ALLOW_HTTP": "maybe"})


# --- a store that cannot be used: named before anything is written -------------------


def test_every_unusable_store_is_named_before_a_write(s3, monkeypatch):
    def refused(cfg: dict, named: str) -> None:
        config = load_config(env={}, **cfg)
        # producers, and consumer groups (their members, offsets and dead letters)
        for opening in (
            lambda: Broker.open(config),
            lambda: Consumer(config, "billing", "ORDER"),
            lambda: PushConsumer(config, "billing", "ORDER", lambda m: ConsumeResult.SUCCESS),
            lambda: Consumer(config.warehouse, "billing", "ORDER"),  # the URI alone
        ):
            with pytest.raises(StorageError, match=named) as caught:
                opening()
            _no_secrets(str(caught.value))

    refused(
        {**s3.config(), "warehouse": "s3://no-such-bucket/wh"},
        "bucket 'no-such-bucket' does not exist",
    )
    refused({**s3.config(), "s3_endpoint": "http://127.0.0.1:9"}, "cannot reach the store")
    lax = S3Server("moto", "--no-conditional-writes")
    try:
        settings = lax.config()
        refused(settings, "does not enforce conditional writes")
        lax_warehouse = load_config(env={}, **settings).warehouse
        for table in (HALF, CONSUMER_MEMBERS):
            path = table_path(lax_warehouse, table)
            assert not DeltaTable.is_deltatable(path, storage_options=options_for(path))
    finally:
        lax.stop()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    refused(s3.config(), "refused the credentials")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.aws/credentials either
    refused(s3.config(), "no AWS credentials")


def test_a_warehouse_named_by_its_uri_alone_keeps_its_prefix(s3):
    """`Broker.open("s3://bucket/prefix")` with options of the caller's own
    once made its tables at the bucket's root, dropping the prefix."""
    config = load_config(env={}, **s3.config())
    options = Storage.from_config(config).delta_rs_options()
    bare = config.warehouse.replace("s3a://", "s3://", 1)
    with Broker.open(bare, storage_options=options) as broker:
        assert broker.warehouse == config.warehouse
        Producer(broker, "orders").send(Message(topic="ORDER", body=b"x"))
    half = table_path(config.warehouse, HALF)
    assert len(DeltaTable(half, storage_options=options).to_pyarrow_table()) == 1
    root = table_path(f"s3a://{Storage.from_config(config).bucket}", HALF)
    assert not DeltaTable.is_deltatable(root, storage_options=options)
    consumer = Consumer(bare, "billing", "ORDER", storage_options=options)
    assert consumer.warehouse == config.warehouse and consumer.poll(10) == []


def test_the_cli_exits_2_when_the_store_refuses_the_credentials(s3):
    done = _cli(s3.config(), "run", env={"AWS_SECRET_ACCESS_KEY": WRONG_SECRET})
    assert done.returncode == 2, done.stderr
    assert "refused the credentials" in done.stderr
    assert done.stdout == ""
    _no_secrets(done.stderr)
    assert WRONG_SECRET not in done.stderr


def test_the_cli_exits_2_for_a_missing_bucket_before_starting_spark(s3):
    done = _cli({**s3.config(), "warehouse": "s3://no-such-bucket/wh"}, "run")
    assert done.returncode == 2, done.stderr
    assert "bucket 'no-such-bucket' does not exist" in done.stderr
    assert done.stdout == ""
    _no_secrets(done.stderr)


def _s3_flags(settings: dict) -> list[str]:
    """The CLI's flags for the warehouse and the loopback store of `settings`."""
    return ["--warehouse", settings["warehouse"], *S3Server.store_flags(settings)]


def _cli(settings: dict, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`txn-reconcile ARGS` on the warehouse of `settings`, in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "jobs.reconcile", *args, *_s3_flags(settings)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_second_run_on_s3_exits_75_while_the_lease_is_held(s3):
    from jobs.lease import EXIT_LEASE_HELD, Lease

    settings = s3.config()
    cfg = load_config(env={}, **settings)
    lease = Lease(use(Storage.from_config(cfg)).warehouse, cfg.lease_ttl_s).acquire()
    try:
        done = _cli(settings, "run")
    finally:
        lease.release()
    assert done.returncode == EXIT_LEASE_HELD, done.stderr
    assert "holds the job's lease" in done.stderr and done.stdout == ""


def test_the_lease_and_the_run_records_are_vacuumed_on_s3(s3):
    """`full` vacuums list the table's prefix on the store; the lease's,
    under its renewal lock, leaves the lease held."""
    from jobs import job_tables
    from jobs.lease import Lease
    from schemas import LEASE

    cfg = load_config(env={}, **s3.config())
    warehouse = use(Storage.from_config(cfg)).warehouse
    for _ in range(3):
        Lease(warehouse, 60).acquire().release()
    job_tables.ensure_job_tables(warehouse)
    held = Lease(warehouse, 60).acquire()
    assert job_tables.vacuum_every_run_tables(warehouse, held) == {LEASE.path: 0, RUNS.path: 0}
    assert held.vacuum(retention_hours=0) == 6  # one file a change, the last one live
    assert held.current().holder == held.holder
    held.release()
    assert Lease(warehouse, 60).acquire().current().action == "ACQUIRE"


# --- the job's reads ---------------------------------------------------------------------


def test_a_tables_latest_version_on_s3_is_listed_not_replayed(s3):
    """The job asks every run for the latest version of nine tables: on the
    store that is a GET of `_last_checkpoint` and a LIST of the entries
    after it, where opening the table GETs every entry since the checkpoint;
    the same answer."""
    from jobs.job_tables import NO_VERSION, latest_version

    cfg = load_config(env={}, **s3.config())
    use(Storage.from_config(cfg))
    path = f"{cfg.warehouse}/t"
    options = options_for(path)
    assert latest_version(path) == NO_VERSION
    for i in range(3):
        write_deltalake(path, pa.table({"a": [i]}), mode="append", storage_options=options)
    assert latest_version(path) == 2  # no checkpoint yet: the whole log listed
    DeltaTable(path, storage_options=options).create_checkpoint()
    for i in range(5):
        write_deltalake(path, pa.table({"a": [i]}), mode="append", storage_options=options)
    assert DeltaTable(path, storage_options=options).version() == 7

    before = s3.requests()
    assert latest_version(path) == 7
    after = s3.requests()
    spent = {kind: after.get(kind, 0) - before.get(kind, 0) for kind in after}
    assert spent.get("GET", 0) == 1 and spent.get("LIST", 0) == 1, spent


def test_the_job_reads_appended_rows_and_snapshots_as_parquet_on_s3(spark, s3, monkeypatch):
    """The log entries are fetched from the store, so the job reads a
    producer table's new files as parquet there too, not through the change
    data feed's row-by-row reader; the rows are the same. Many small files
    are fetched by the driver and reach Spark in one partition."""
    from jobs import appends, inputs
    from jobs.session import use_warehouse

    cfg = load_config(env={}, **s3.config())
    use_warehouse(spark, cfg)
    broker = Broker.open(cfg)
    producer = TransactionProducer(broker, group="g", listener=Listener())
    for i in range(3):
        producer.send_message_in_transaction(Message(topic="ORDER", body=bytes([i]), keys="commit"))
    broker.close()
    path = table_path(cfg.warehouse, HALF)
    upto = DeltaTable(path, storage_options=options_for(path)).version()
    files = appends.appended_files(path, 0, upto)
    assert files is not None and len(files) == 3
    assert all(f.startswith(path + "/") and f.endswith(".parquet") for _, f, _ in files)
    fast = inputs.added_rows(spark, path, HALF, 0, upto)
    slow = inputs.change_feed_inserts(spark, path, 0, upto)
    assert sorted(r.body for r in fast.collect()) == [bytes([i]) for i in range(3)]
    assert sorted((r.half_offset, r.commit_version) for r in fast.collect()) == sorted(
        (r.half_offset, r.commit_version) for r in slow.collect()
    )
    assert all(f.startswith("s3a://") for f in appends.snapshot_files(path, upto))
    monkeypatch.setattr(appends, "DRIVER_READ_MIN_FILES", 2)
    with fx.arrow_frames_parallelized(spark):
        by_driver = inputs.added_rows(spark, path, HALF, 0, upto)
        assert by_driver.rdd.getNumPartitions() == 1
        assert sorted((r.half_offset, r.commit_version, r.body) for r in by_driver.collect()) == (
            sorted((r.half_offset, r.commit_version, r.body) for r in fast.collect())
        )
    # rows past the driver's budget: it stops fetching, and Spark reads them
    fetched = []
    real_reader = appends._s3_reader

    def counting_reader(any_path):
        read = real_reader(any_path)
        return lambda path: fetched.append(path) or read(path)

    monkeypatch.setattr(appends, "_s3_reader", counting_reader)
    monkeypatch.setattr(appends, "_PARALLEL_GETS", 1)
    monkeypatch.setattr(appends, "DRIVER_READ_MAX_BYTES", 1)
    assert appends._rows_in_driver(files, HALF) is None
    assert len(fetched) == 1
    by_spark = inputs.added_rows(spark, path, HALF, 0, upto)
    assert sorted((r.half_offset, r.commit_version, r.body) for r in by_spark.collect()) == (
        sorted((r.half_offset, r.commit_version, r.body) for r in fast.collect())
    )


def test_the_jobs_writes_are_committed_by_delta_rs_on_s3_collected_or_spark_written(spark, s3):
    """A run's write of few rows is collected and committed by delta-rs on
    S3 too; a bigger one is written by Spark into the table's own staging
    directory, where its files stay, and committed by delta-rs with their
    statistics. Both tagged with their run; a table Delta's writer must
    write (a CHECK constraint) still gets Delta's writer."""
    from jobs import commits, job_tables, tagged_writes
    from jobs.session import use_warehouse
    from schemas import QUEUES
    from schemas.spark import spark_schema

    cfg = load_config(env={}, **s3.config())
    use_warehouse(spark, cfg)
    job_tables.ensure_job_tables(cfg.warehouse)
    path = table_path(cfg.warehouse, QUEUES)
    rows = spark.createDataFrame([("ORDER", 0, 5, 1), ("PAY", 1, 9, 1)], spark_schema(QUEUES))
    assert commits.committable(path, rows)
    assert commits.committable("s3a://unregistered-bucket/_sys/queues", rows) is None

    def table() -> DeltaTable:
        return DeltaTable(path, storage_options=options_for(path))

    def adds() -> list[dict]:
        return pa.table(table().get_add_actions(flatten=False)).to_pylist()

    tagged_writes.write_for_run(rows, path, 1, QUEUES.path, mode="overwrite", collect=True)
    assert all("/" not in a["path"] for a in adds())
    tagged_writes.write_for_run(rows.coalesce(1), path, 2, QUEUES.path, mode="overwrite")
    (add,) = adds()
    assert add["path"].startswith(commits.S3_STAGING_PREFIX)
    assert (add["num_records"], add["max"]["next_queue_offset"]) == (2, 9)
    assert tagged_writes.committed_by_run(path, 1, QUEUES.path)
    assert tagged_writes.committed_by_run(path, 2, QUEUES.path)
    read = spark.read.format("delta").load(path)
    assert sorted(tuple(r) for r in read.collect()) == [("ORDER", 0, 5, 1), ("PAY", 1, 9, 1)]

    spark.sql(f"ALTER TABLE delta.`{path}` ADD CONSTRAINT c CHECK (next_queue_offset >= 0)")
    assert commits.committable(path, rows) is None
    tagged_writes.write_for_run(rows, path, 3, QUEUES.path, mode="overwrite")
    assert "Apache-Spark" in table().history(1)[0]["engineInfo"]


# --- producers --------------------------------------------------------------------------


@pytest.mark.slow
def test_four_producer_processes_on_one_bucket_lose_nothing(s3):
    cfg = s3.config()
    per_thread = 15
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "s3_producer.py"),
                json.dumps(cfg),
                str(per_thread),
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        _no_secrets(out, err)
        reports.append(json.loads(out.strip().splitlines()[-1]))
        # every half and OP durable: the four raced to create the tables, too
        assert reports[-1]["failures"] == [], reports[-1]["failures"][:3]
    # on S3 too the commits are blind appends, racing with put-if-absent
    assert all(
        r["committers"] == {"_sys/half": "blind append", "_sys/op": "blind append"} for r in reports
    )
    sent = {tx: off for r in reports for tx, off in r["sent"]}
    assert len(sent) == 4 * (4 * per_thread + 20)

    wh = use(Storage.from_config(load_config(env={}, **cfg)), check=False).warehouse
    halves = _rows(table_path(wh, HALF))
    ops = _rows(table_path(wh, OP))
    # I1: unique offsets across processes; nothing lost, nothing written twice
    assert len({h["half_offset"] for h in halves}) == len(halves) == len(sent)
    assert {h["transaction_id"]: h["half_offset"] for h in halves} == sent
    assert len({o["op_offset"] for o in ops}) == len(ops) == len(sent)
    assert {o["transaction_id"] for o in ops} == set(sent)


# --- the job ----------------------------------------------------------------------------


class Listener(TransactionListener):
    """Local outcome and check answer chosen by the message's keys."""

    def execute_local_transaction(self, msg, arg):
        if isinstance(msg, (list, tuple)) or not hasattr(msg, "keys"):
            return S.COMMIT_MESSAGE  # the batch
        return {"commit": S.COMMIT_MESSAGE, "rollback": S.ROLLBACK_MESSAGE}.get(msg.keys, S.UNKNOWN)

    def check_local_transaction(self, msg):
        return S.COMMIT_MESSAGE if msg.keys == "checked" else S.UNKNOWN


@pytest.mark.slow
def test_the_whole_cycle_on_s3_checks_discards_resolves_and_verifies(spark, s3):
    settings = {
        **s3.config(),
        "check_max": 2,
        "transaction_timeout_ms": 1_000,
        "check_interval_ms": 1_000,
    }
    cfg = load_config(env={}, **settings)
    clock = [T]
    broker = Broker.open(cfg, clock=lambda: clock[0])
    producer = TransactionProducer(broker, group="order_group", listener=Listener())
    sent = {
        k: producer.send_message_in_transaction(
            Message(topic="ORDER", body=f"body-{k}".encode(), keys=k, properties={"p": k})
        )
        for k in ("commit", "rollback", "checked", "never")
    }
    producer.send_batch_in_transaction(
        [Message(topic="PAY", body=bytes([i, 0, 255]), keys=f"pay-{i}") for i in range(3)]
    )
    Producer(broker, "ship_group").send(Message(topic="SHIP", body=b"later", delay_ms=5_000))

    first = reconcile(spark, cfg, now_ms=T + 2_000)
    assert (first.committed, first.rolled_back, first.check_requests) == (4, 1, 2)
    assert first.scheduled == 1 and first.next_scheduled_ms == T + 5_000
    assert first.delivered_by_topic == {"ORDER": 1, "PAY": 3}
    _no_secrets(first.to_json())

    assert producer.answer_checks() == 2  # "checked" commits, "never" stays unknown
    second = reconcile(spark, cfg, now_ms=T + 4_000)
    assert (second.committed, second.check_requests) == (1, 1)
    assert producer.answer_checks() == 1
    # the delayed message's file, listed from the log on the store and read as parquet
    path = table_path(cfg.warehouse, SCHEDULED)
    version = DeltaTable(path, storage_options=options_for(path)).version()
    due_files = scheduled.files_due(path, version, T + 4_000, T + 6_000)
    assert due_files is not None and len(due_files) == 1 and due_files[0].startswith("s3a://")
    third = reconcile(spark, cfg, now_ms=T + 6_000)
    assert third.discarded_max_checks == 1 and third.pending_after == 0
    assert third.delivered_scheduled == 1 and third.delivered_by_topic["SHIP"] == 1

    # an operator overrides the discard (CLI: an ADMIN OP through the broker core)
    flags = _s3_flags(settings)
    assert (
        main(
            [
                "resolve",
                *flags,
                "--transaction-id",
                sent["never"].transaction_id,
                "--commit",
                "--remark",
                "ops ticket 42",
            ]
        )
        == 0
    )
    fourth = reconcile(spark, cfg, now_ms=T + 7_000)
    assert fourth.committed == 1

    report = verify(spark, cfg)
    assert report.ok, report.to_dict()
    assert status(spark, cfg, now_ms=T + 7_000).pending == 0

    order = read_topic(cfg, "ORDER")
    assert [(r["queue_offset"], r["keys"], r["body"]) for r in order] == [
        (0, "commit", b"body-commit"),
        (1, "checked", b"body-checked"),
        (2, "never", b"body-never"),
    ]
    assert sorted(r["body"] for r in read_topic(cfg, "PAY")) == [
        bytes([i, 0, 255]) for i in range(3)
    ]
    assert [r["body"] for r in read_topic(cfg, "SHIP")] == [b"later"]
    # each run's few rows were collected and committed by the driver (jobs.driver_writes)
    order = topic_path(cfg.warehouse, "ORDER")
    tagged = [
        c
        for c in DeltaTable(order, storage_options=options_for(order)).history()
        if c.get("userMetadata")
    ]
    assert len(tagged) == 3 and all(c["engineInfo"].startswith("delta-rs") for c in tagged)
    runs = _rows(table_path(cfg.warehouse, RUNS))
    _no_secrets(repr(runs), json.dumps(report.to_dict(), default=str))

    done = maintain(broker, now_ms=T + 7_000)
    assert done is not None
    producer.close()
    broker.close()


def _outputs(warehouse: str) -> dict[str, list]:
    """The job's output tables (wall-clock columns removed), order-independent."""
    wall_clock = {"started_ms", "ended_ms", "summary_json", "duration_ms"}
    tables = {}
    for name in (
        "topics/ORDER",
        "_sys/pending",
        "_sys/queues",
        "_sys/resolved",
        "_sys/check_requests",
        "_sys/discard",
        "_sys/rejected",
        "_sys/runs",
    ):
        path = f"{warehouse}/{name}"
        if not DeltaTable.is_deltatable(path, storage_options=options_for(path)):
            continue
        tables[name] = sorted(
            repr(
                sorted(
                    (k, sorted(v) if isinstance(v, list) else v)
                    for k, v in r.items()
                    if k not in wall_clock
                )
            )
            for r in _rows(path)
        )
    return tables


def _seed(settings: dict) -> None:
    """Producer rows written directly: a commit, a rollback, one left to check."""

    cfg = load_config(env={}, **settings)
    wh = use(Storage.from_config(cfg)).warehouse
    delivered = fx.half(1, store_ms=T - 100_000)
    checked = fx.half(2, store_ms=T - 100_000)
    rolled = fx.half(3, store_ms=T - 100_000)
    fx.write_halves(wh, delivered, checked, rolled)
    fx.write_ops(wh, fx.op(delivered, op_offset=11), fx.op(rolled, "ROLLBACK", op_offset=13))


@pytest.mark.slow
def test_deliveries_too_big_for_the_driver_are_written_by_one_spark_job_on_s3(
    spark, s3, monkeypatch
):
    """Where the driver may not collect them, every topic's rows are written
    by one Spark job into the table of the topic with most rows; the other
    topics' files are copied by the store into their own tables and deleted
    where they were written; a crash between two topics' commits is redone
    exactly once. A topic table with a CHECK constraint makes each topic's
    rows a write of their own (Delta's writer for that table), with the
    same outcome."""
    from jobs import commits, driver_writes, job_tables
    from jobs.faults import InjectedFault
    from jobs.reconcile import recover

    monkeypatch.setattr(driver_writes, "NARROW_MAX_ROWS", -1)
    monkeypatch.setattr(driver_writes, "MESSAGE_MAX_ROWS", -1)
    results = {}
    for name, crash in (("clean", None), ("crashed", "after:topics/ORDER"), ("constrained", None)):
        cfg = load_config(env={}, **s3.config())
        wh = use(Storage.from_config(cfg)).warehouse
        topics = ["ORDER", "ORDER", "PAY"]
        rows = [fx.half(i, store_ms=T - 100_000, topic=t) for i, t in enumerate(topics)]
        fx.write_halves(wh, *rows)
        fx.write_ops(wh, *[fx.op(r, op_offset=100 + i) for i, r in enumerate(rows)])
        if name == "constrained":
            pay = job_tables.ensure_topic_table(wh, "PAY")
            spark.sql(f"ALTER TABLE delta.`{pay}` ADD CONSTRAINT c CHECK (queue_offset >= 0)")
        if crash:
            monkeypatch.setenv("TXN_FAULT_AT", crash)
            with pytest.raises(InjectedFault):
                reconcile(spark, cfg, now_ms=T)
            monkeypatch.delenv("TXN_FAULT_AT")
            assert recover(spark, cfg, clock=lambda: time.time() + 3600).committed == 3
        else:
            assert reconcile(spark, cfg, now_ms=T).delivered_by_topic == {"ORDER": 2, "PAY": 1}
        results[name] = _outputs(wh)
        assert sorted(r["half_offset"] for r in _rows(topic_path(wh, "ORDER"))) == [0, 1]
        staged = {t: _staged_objects(topic_path(wh, t)) for t in ("ORDER", "PAY")}
        added = {t: _added_paths(topic_path(wh, t)) for t in ("ORDER", "PAY")}
        if name == "constrained":  # PAY by Delta's writer: files at the table's root
            assert added["PAY"] and not staged["PAY"]
            assert not any(p.startswith(commits.S3_STAGING_PREFIX) for p in added["PAY"])
        if name != "clean":  # a crash leaves files no commit names, for VACUUM
            continue
        # every file the job wrote is one a commit names: the copied ones deleted
        assert staged == {t: set(paths) for t, paths in added.items()}
        # ORDER's files where Spark wrote them; PAY's copied into PAY's table
        assert all("/txn_target=" in p for p in added["ORDER"]), added
        assert added["PAY"] and all(p.count("/") == 1 for p in added["PAY"]), added
        # verify reads files two, one and no directories below their tables' in one scan each
        report = verify(spark, cfg)
        assert report.ok and report.counts["delivered"] == 3, report.render()
    assert results["crashed"] == results["clean"] == results["constrained"]


def _added_paths(uri: str) -> list[str]:
    table = DeltaTable(uri, storage_options=options_for(uri))
    return pa.table(table.get_add_actions(flatten=False))["path"].to_pylist()


def _staged_objects(uri: str) -> set[str]:
    """The parquet objects in the table's staging directories, as paths
    relative to the table."""
    from jobs import commits
    from txn_core.storage import registered

    storage = registered(uri)
    root = uri.split("://", 1)[1].partition("/")[2].rstrip("/") + "/"
    pages = (
        storage.s3_client()
        .get_paginator("list_objects_v2")
        .paginate(Bucket=storage.bucket, Prefix=root + commits.S3_STAGING_PREFIX)
    )
    return {
        o["Key"][len(root) :]
        for page in pages
        for o in page.get("Contents", [])
        if o["Key"].endswith(".parquet")
    }


@pytest.mark.slow
def test_a_killed_run_on_s3_is_redone_exactly_once(spark, s3):
    clean, killed = s3.config(), s3.config()
    _seed(clean)
    _seed(killed)
    expected = reconcile(spark, load_config(env={}, **clean), now_ms=T)

    # SIGKILL after the topic's commit, before the rest: no finally, no lease release
    dead = _cli(
        killed,
        "run",
        "--now-ms",
        str(T),
        env={"TXN_FAULT_AT": "after:topics/ORDER", "TXN_FAULT_MODE": "kill"},
    )
    assert dead.returncode in (-9, FAULT_EXIT_CODE), dead.stderr[-3000:]
    assert dead.stdout == ""
    rerun = _cli(killed, "run", "--now-ms", str(T))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    _no_secrets(dead.stderr, rerun.stdout, rerun.stderr)
    summary = json.loads(rerun.stdout.strip().splitlines()[-1])
    assert summary["redone_run_id"] == expected.run_id

    wh_clean = load_config(env={}, **clean).warehouse
    wh_killed = load_config(env={}, **killed).warehouse
    got, want = _outputs(wh_killed), _outputs(wh_clean)
    # the rerun's own (second, idle) run is not in the clean warehouse
    got["_sys/runs"] = [r for r in got["_sys/runs"] if "('run_number', 2)" not in r]
    assert got == want
    assert len(_rows(topic_path(wh_killed, "ORDER"))) == 1
