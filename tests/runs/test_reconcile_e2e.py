"""The job end to end on real Delta tables: producer rows written with delta-rs
(tests/factories.py) so every store_ms is exact, runs with a fixed clock."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from jobs import commits, pipeline
from jobs.counters import Counters
from jobs.reconcile import reconcile
from jobs.status import status
from schemas import CHECK_REQUESTS, DISCARD, HALF, PENDING, REJECTED, RUNS, table_path, topic_path
from schemas.tables import QUEUES

import factories as fx

T0 = 10_000_000
HOUR = 3_600_000


def rows(path: str, *, sort: str = "half_offset") -> list[dict]:
    return sorted(DeltaTable(path).to_pyarrow_table().to_pylist(), key=lambda r: r[sort])


@pytest.mark.parametrize(
    "history",
    [
        "read near the OPs",
        "looked up by key",
        "read near, a big run's passes",
        "read near, a big run's passes, its OPs ranked by one task",
    ],
)
def test_runs_resolve_deliver_check_and_discard_across_runs(spark, warehouse, monkeypatch, history):
    """OPs for messages no longer pending (late, an operator's) are judged
    by the history the same way whether a run reads it with the live
    messages or, when that would read too much, looks it up afterwards.
    And the same tables whether the run takes a small run's passes (one
    task, the undecided messages decided with their bodies) or a big one's."""
    if history == "looked up by key":
        monkeypatch.setattr(pipeline, "HISTORY_NEAR_MAX_ROWS", -1)
    else:
        monkeypatch.setattr(pipeline, "_with_history", lambda *a: pytest.fail("a second pass"))
    if history.startswith("read near, a big run's passes"):
        monkeypatch.setattr("jobs.interpreted.INTERPRETED_MAX_ROWS", -1)  # not small
        thresholds = ["POSITIONS_ONE_TASK_MAX_ROWS", "UNDELIVERED_ONE_PASS_MAX_ROWS"]
        if not history.endswith("by one task"):  # else ranked by one task, joined as a big run's
            thresholds.append("CLASSIFY_ONE_TASK_MAX_ROWS")
        for threshold in thresholds:
            monkeypatch.setattr(pipeline, threshold, -1)
    cfg = {"warehouse": warehouse, "check_max": 1, "reserved_hours": 1}
    h1, h2, h5 = (fx.half(store_ms=T0 - 1000) for _ in range(3))
    h4 = fx.half(store_ms=T0 - 10_000)
    h3 = fx.half(
        store_ms=T0 - 1000,
        topic="PAY",
        queue_id=1,
        body=bytes(range(256)),
        keys="k\u00e9 y",
        tags="t|x",
        properties={"\u00fc": "\x00", "empty": ""},
    )
    h_unchecked = fx.half(store_ms=T0 - 1000, check_immunity_s=3600)
    h_answered = fx.half(store_ms=T0 - 100_000)
    h_late, h_admin = (fx.half(store_ms=T0 - HOUR - 1) for _ in range(2))
    bad = fx.half(store_ms=T0, topic="no such topic")
    fx.write_halves(warehouse, h1, h2, h3, h4, h5, h_unchecked, h_answered, h_late, h_admin, bad)
    # h2's OP is committed before h1's although its op_offset is larger: commit order wins
    fx.write_ops(warehouse, fx.op(h2, op_offset=900), fx.op(h5, "ROLLBACK"))
    fx.write_ops(
        warehouse,
        fx.op(h1, op_offset=100),
        fx.op(h3),
        fx.op(h2),
        fx.op(h5, "COMMIT"),
        fx.op(h4, producer_group="other_group"),
        fx.op(fx.half(10**12)),
    )

    first = reconcile(spark, cfg, now_ms=T0)

    assert (first.half_read, first.op_read, first.committed, first.rolled_back) == (10, 8, 3, 1)
    assert first.rejected_halves == 1  # `bad`: set aside, counted, never live
    assert (first.duplicate_ops, first.conflicting_ops, first.invalid_ops) == (1, 1, 2)
    assert first.delivered_by_topic == {"ORDER": 2, "PAY": 1}
    # h4 and h_answered are past immunity; h_unchecked has its own hour
    assert (first.check_requests, first.discarded_expired, first.pending_after) == (2, 2, 3)
    assert first.oldest_pending_age_ms == 100_000 and first.pending_before == 0
    order = rows(topic_path(warehouse, "ORDER"), sort="queue_offset")
    assert [(r["half_offset"], r["queue_offset"]) for r in order] == [
        (h2["half_offset"], 0),
        (h1["half_offset"], 1),
    ]
    pay = rows(topic_path(warehouse, "PAY"))[0]
    for key in ("body", "keys", "tags", "msg_id", "transaction_id", "born_ms", "queue_id"):
        assert pay[key] == h3[key]
    assert dict(pay["properties"]) == h3["properties"]
    requests = rows(table_path(warehouse, CHECK_REQUESTS))
    assert [(r["half_offset"], r["check_times"], r["request_id"]) for r in requests] == [
        (h4["half_offset"], 1, f"{first.run_id}-{h4['half_offset']}"),
        (h_answered["half_offset"], 1, f"{first.run_id}-{h_answered['half_offset']}"),
    ]
    rejected = rows(table_path(warehouse, REJECTED), sort="reason")
    assert [r["reason"] for r in rejected] == [
        "INVALID: producer_group mismatch",
        "INVALID: unknown half_offset",
        "invalid topic name",
    ]

    # Producers answer, decide and override between the runs.
    fx.write_answers(warehouse, fx.answer(requests[1]["request_id"], h_answered, "UNKNOWN"))
    h6 = fx.half(store_ms=T0 + 1)
    fx.write_halves(warehouse, h6)
    fx.write_ops(warehouse, fx.op(h6), fx.op(h_late, source="CHECK"))
    fx.write_ops(warehouse, fx.op(h4), fx.op(h_admin, source="ADMIN"))

    second = reconcile(spark, cfg, now_ms=T0 + 40_000)

    assert (second.committed, second.late_ops, second.discarded_max_checks) == (3, 1, 1)
    assert second.delivered_by_topic == {"ORDER": 3}
    order = rows(topic_path(warehouse, "ORDER"), sort="queue_offset")
    assert [r["queue_offset"] for r in order] == [0, 1, 2, 3, 4]
    assert [r["half_offset"] for r in order[2:]] == [
        h6["half_offset"],
        h4["half_offset"],
        h_admin["half_offset"],
    ]
    # bodies joined back from new halves, the pending set and (the override) the discard table
    assert [(r["body"], r["keys"]) for r in order[2:]] == [
        (h["body"], h["keys"]) for h in (h6, h4, h_admin)
    ]
    discard = {r["half_offset"]: r["reason"] for r in rows(table_path(warehouse, DISCARD))}
    assert discard == {
        h_late["half_offset"]: "EXPIRED",
        h_admin["half_offset"]: "EXPIRED",
        h_answered["half_offset"]: "MAX_CHECKS",
    }
    assert second.pending_after == 1 and second.pending_before == 3

    versions = _versions(warehouse)
    empty = reconcile(spark, cfg, now_ms=T0 + 40_000)
    assert (empty.half_read, empty.op_read, empty.check_requests, empty.pending_after) == (
        0,
        0,
        0,
        1,
    )
    assert empty.prev_op_version == second.op_version == empty.op_version
    assert empty.idle  # h_unchecked's own hour is not over: nothing to compute
    changed = {p for p, v in _versions(warehouse).items() if versions.get(p) != v}
    assert changed == {"_sys/runs", "_sys/lease"}

    report = status(spark, cfg, now_ms=T0 + 1000)
    assert (report.pending, report.oldest_pending_age_ms) == (1, 2000)
    assert report.pending_by_topic == {"ORDER": 1}
    assert report.pending_by_producer_group == {fx.GROUP: 1}
    assert not report.interrupted


def test_a_rejected_half_is_never_delivered_even_when_committed(spark, warehouse):
    # a valid topic: were the rejected row joined with a fate, it would land in topics/ORDER
    good, bad = fx.half(store_ms=T0), fx.half(store_ms=T0, topic="ORDER", queue_id=-1)
    fx.write_halves(warehouse, good, bad)
    fx.write_ops(warehouse, fx.op(good), fx.op(bad))

    summary = reconcile(spark, {"warehouse": warehouse}, now_ms=T0)

    assert (summary.rejected_halves, summary.committed, summary.invalid_ops) == (1, 1, 1)
    assert [r["half_offset"] for r in rows(topic_path(warehouse, "ORDER"))] == [good["half_offset"]]
    assert summary.pending_after == 0


def test_an_undecided_answer_alone_is_counted_in_the_pending_set(spark, warehouse):
    # nothing new but the answer, and nothing due: the run must still carry it
    cfg = {"warehouse": warehouse, "check_budget": "answered"}
    h = fx.half(store_ms=T0 - 10_000)
    fx.write_halves(warehouse, h)
    first = reconcile(spark, cfg, now_ms=T0)
    request = rows(table_path(warehouse, CHECK_REQUESTS))[0]
    assert first.check_requests == 1
    fx.write_answers(warehouse, fx.answer(request["request_id"], h, "UNKNOWN"))

    second = reconcile(spark, cfg, now_ms=T0 + 1)

    assert (second.half_read, second.op_read, second.check_requests) == (0, 0, 0)
    assert not second.idle and second.pending_after == 1
    pending = rows(table_path(warehouse, PENDING))
    assert [(r["checks_sent"], r["checks_undecided"]) for r in pending] == [(1, 1)]


def test_delta_rs_reads_check_requests_and_topics_with_change_feed(spark, warehouse):
    h1, h2 = fx.half(store_ms=0), fx.half(store_ms=0)
    fx.write_halves(warehouse, h1, h2)
    fx.write_ops(warehouse, fx.op(h1))
    reconcile(spark, {"warehouse": warehouse}, now_ms=60_000)
    expected = {table_path(warehouse, CHECK_REQUESTS): h2, topic_path(warehouse, "ORDER"): h1}
    for path, message in expected.items():
        table = DeltaTable(path)
        assert table.to_pyarrow_table().num_rows == 1
        feed = pa.table(table.load_cdf(starting_version=0).read_all()).to_pylist()
        assert [r["half_offset"] for r in feed if r["_change_type"] == "insert"] == [
            message["half_offset"]
        ]
    # statistics only on the columns a reader seeks by: a topic by (queue_id, queue_offset)
    config = DeltaTable(topic_path(warehouse, "ORDER")).metadata().configuration
    assert config.get("delta.dataSkippingNumIndexedCols") == "2"
    add = pa.table(
        DeltaTable(topic_path(warehouse, "ORDER")).get_add_actions(flatten=True)
    ).to_pylist()[0]
    assert add["min.queue_offset"] == 0 and "min.msg_id" not in add
    runs = DeltaTable(table_path(warehouse, RUNS)).metadata().configuration
    assert runs.get("delta.dataSkippingNumIndexedCols") == "2"  # run_id, run_number


def test_dry_run_computes_the_summary_and_writes_nothing(spark, warehouse):
    h1, h2 = fx.half(store_ms=0), fx.half(store_ms=0)
    fx.write_halves(warehouse, h1, h2)
    fx.write_ops(warehouse, fx.op(h1))
    before = _tree(warehouse)

    summary = reconcile(spark, {"warehouse": warehouse}, now_ms=60_000, dry_run=True)

    assert (summary.committed, summary.check_requests, summary.dry_run) == (1, 1, True)
    assert summary.delivered_by_topic == {"ORDER": 1}
    assert _tree(warehouse) == before


def test_empty_warehouse_run_succeeds_with_zero_counters(spark, warehouse, monkeypatch):
    # given as a relative path, as `make demo` and the default "./warehouse" do
    monkeypatch.chdir(os.path.dirname(warehouse))
    summary = reconcile(spark, {"warehouse": "./" + os.path.basename(warehouse)}, now_ms=5)
    d = summary.to_dict()
    assert d["run_number"] == 1 and d["pending_after"] == 0 and d["half_read"] == 0
    assert d["oldest_pending_age_ms"] is None and d["delivered_by_topic"] == {}
    assert DeltaTable(table_path(warehouse, HALF)).version() == 0


def test_idle_run_writes_one_record_until_something_is_due_or_the_rules_change(
    spark, warehouse, monkeypatch
):
    from jobs import job_tables, run_log

    monkeypatch.setattr(job_tables, "COMPACT_EVERY_RUNS", 3)  # run 3 compacts the job's tables
    fx.write_halves(warehouse, fx.half(store_ms=0))
    cfg = {"warehouse": warehouse, "transaction_timeout_ms": 60_000}
    first = reconcile(spark, cfg, now_ms=1000)
    assert (first.pending_after, first.check_requests, first.idle) == (1, 0, False)
    assert first.next_due_ms == 60_001  # the first ms past the immunity
    runs = table_path(warehouse, RUNS)
    before = DeltaTable(runs).version()

    idle = reconcile(spark, cfg, now_ms=60_000)

    assert idle.idle and (idle.run_number, idle.pending_after, idle.half_read) == (2, 1, 0)
    assert idle.oldest_pending_age_ms == 60_000 and idle.next_due_ms == 60_001
    assert DeltaTable(runs).version() == before + 1  # one COMMITTED row, no intent
    assert [(r["run_number"], r["status"]) for r in rows(runs, sort="run_number")][-1] == (
        2,
        "COMMITTED",
    )
    # A shorter timeout makes the message due at the same clock: a full run checks it.
    due = reconcile(spark, {**cfg, "transaction_timeout_ms": 30_000}, now_ms=60_000)
    assert (due.idle, due.check_requests, due.run_number) == (False, 1, 3)
    assert due.next_due_ms == 60_000 + 30_000  # checked now: due again an interval later
    # ... and, being run 3, compacted _sys/runs (5 rows in 5 files) without
    # changing a row or adding to the change feed producers follow
    assert len(DeltaTable(runs).file_uris()) == 1
    assert [(r["run_number"], r["status"]) for r in rows(runs, sort="run_number")] == [
        (1, "COMMITTED"),
        (1, "STARTED"),
        (2, "COMMITTED"),
        (3, "COMMITTED"),
        (3, "STARTED"),
    ]
    assert run_log.last_run(warehouse).run_number == 3
    requests = DeltaTable(table_path(warehouse, CHECK_REQUESTS))
    feed = pa.table(requests.load_cdf(starting_version=0).read_all()).to_pylist()
    assert [r["_change_type"] for r in feed] == ["insert"]


def test_the_upkeep_is_spread_over_the_runs_a_chore_after_a_run():
    from jobs import job_tables

    every = job_tables.COMPACT_EVERY_RUNS
    due = {n: job_tables.upkeep_due(n) for n in range(1, 3 * every + 1)}
    window = [chore for n in range(1, every + 1) for chore in due[n]]
    # each chore once in any COMPACT_EVERY_RUNS runs, never two after one run
    assert sorted(window) == sorted(job_tables.UPKEEP_CHORES)
    assert all(due[n] == due[n + every] for n in range(1, 2 * every + 1))
    assert max(len(chores) for chores in due.values()) == 1
    assert set(job_tables.UPKEEP_CHORES) == {"scheduled", "topics"} | {
        table.path for table in job_tables.APPEND_ONLY_TABLES
    }


def _log_retention(path: str) -> str | None:
    return DeltaTable(path).metadata().configuration.get("delta.logRetentionDuration")


def test_a_topics_log_keeps_its_entries_for_the_configured_hours(spark, warehouse, monkeypatch):
    """A topic's history is for the readers that follow it by version (Spark
    streams): kept `topic_log_retention_hours`, where Delta's 30 days made
    every commit and read of a continuous job on a local disk slower by the
    hour (docs/performance.md)."""
    from jobs import job_tables

    older = job_tables.ensure_topic_table(warehouse, "OLD", log_retention_hours=72)
    fx.write_halves(warehouse, h := fx.half(store_ms=T0 - 1000, topic="NEW"))
    fx.write_ops(warehouse, fx.op(h))
    job_tables.ensure_job_tables(warehouse)
    queue = pa.table({"topic": ["OLD"], "queue_id": [0], "next_queue_offset": [0]})
    queue = queue.append_column("run_number", pa.array([0], pa.int64()))
    write_deltalake(table_path(warehouse, QUEUES), queue, mode="append")
    cfg = {"warehouse": warehouse, "topic_log_retention_hours": 1}
    monkeypatch.setattr(job_tables, "upkeep_due", lambda number: ["topics"])
    compact, compacted = job_tables.compact_topics, []
    monkeypatch.setattr(
        job_tables, "compact_topics", lambda wh: compacted.append(wh) or compact(wh)
    )
    reconcile(spark, cfg, now_ms=T0)
    assert compacted == [warehouse]  # the same chore merges the topics' small files
    newer = topic_path(warehouse, "NEW")
    assert rows(newer, sort="queue_offset")[0]["msg_id"] == h["msg_id"]
    # made by the run with the setting; an older topic given it by the upkeep
    assert _log_retention(newer) == _log_retention(older) == "interval 1 hours"
    assert job_tables.keep_topic_log_retention(warehouse, 1) == []
    assert job_tables.keep_topic_log_retention(warehouse, 3) == ["NEW", "OLD"]

    # the job's checkpoints drop the entries past it
    rows_again = DeltaTable(newer).to_pyarrow_table()

    def append_and_after_commit(times: int) -> bool:
        for _ in range(times):
            write_deltalake(older, rows_again, mode="append")
        table = DeltaTable(older)
        return commits.checkpoint_as_delta_does(
            table, table.version(), table.metadata().configuration
        )

    assert append_and_after_commit(8)  # versions 3-10, a checkpoint at 10
    append_and_after_commit(7)  # 11-17, then all made 4 hours old
    log_dir = os.path.join(older, "_delta_log")
    for name in os.listdir(log_dir):
        stamp = os.path.getmtime(os.path.join(log_dir, name)) - 4 * 3600
        os.utime(os.path.join(log_dir, name), (stamp, stamp))
    assert append_and_after_commit(3)  # 18-20, a checkpoint at 20
    # what the newest checkpoint past the retention (10) replaces is gone
    assert fx.logged_versions(older) == list(range(10, 21))


@pytest.fixture
def jvm_starts(spark, monkeypatch) -> list[bool]:
    """Whether each `main` of the CLI in the test asked for a short-lived JVM
    (the test session's Spark is handed out instead of a new one)."""
    from jobs import reconcile as job

    started: list[bool] = []
    monkeypatch.setattr(
        job, "_spark", lambda short_lived=False: started.append(short_lived) or spark
    )
    return started


def test_the_cli_predicts_an_idle_run_before_spark_starts_and_starts_it_short_lived(
    warehouse, monkeypatch, jvm_starts
):
    from jobs import job_tables
    from jobs import reconcile as job

    started = jvm_starts
    cfg = {"warehouse": warehouse, "transaction_timeout_ms": 60_000}
    assert not job.idle_ahead(cfg, 1000)  # no run yet: the first one creates the tables
    fx.write_halves(warehouse, fx.half(store_ms=0))
    assert (
        job.main(
            [
                "run",
                "--warehouse",
                warehouse,
                "--now-ms",
                "1000",
                "--transaction-timeout-ms",
                "60000",
            ]
        )
        == 0
    )
    assert job.idle_ahead(cfg, 60_000)  # pending, but immune until 60_001
    assert not job.idle_ahead(cfg, 60_001)  # due: a full run
    assert not job.idle_ahead({**cfg, "transaction_timeout_ms": 30_000}, 60_000)  # new rules
    assert (
        job.main(
            [
                "run",
                "--warehouse",
                warehouse,
                "--now-ms",
                "60000",
                "--transaction-timeout-ms",
                "60000",
            ]
        )
        == 0
    )
    assert started == [True, True]  # run 1 over one message, run 2 idle: both short-lived
    assert job.idle_ahead(cfg, 60_000)
    monkeypatch.setattr(job_tables, "COMPACT_EVERY_RUNS", 3)
    assert not job.idle_ahead(cfg, 60_000)  # run 3 compacts the job's tables
    monkeypatch.setattr(job_tables, "COMPACT_EVERY_RUNS", 100)
    fx.write_halves(warehouse, fx.half(store_ms=0))
    assert not job.idle_ahead(cfg, 60_000)  # a new half: a full run


def test_a_single_run_predicted_small_gets_a_short_lived_jvm_and_a_big_one_the_default(
    warehouse, monkeypatch, jvm_starts
):
    from jobs import reconcile as job
    from jobs.session import LONG_RUN_GC, SHORT_LIVED_JVM

    started = jvm_starts
    cfg = {"warehouse": warehouse, "transaction_timeout_ms": 60_000}
    run = ["run", "--warehouse", warehouse, "--transaction-timeout-ms", "60000", "--now-ms"]
    assert job.rows_ahead(cfg, 1000) == 0  # no table yet
    halves = [fx.half(store_ms=0) for _ in range(3)]
    fx.write_halves(warehouse, *halves[:2])
    fx.write_halves(warehouse, halves[2])
    fx.write_ops(warehouse, fx.op(halves[0]))
    assert job.rows_ahead(cfg, 1000) == 4  # three half rows in two commits, one OP
    monkeypatch.setattr(job, "SHORT_LIVED_MAX_ROWS", 3)
    assert job.main([*run, "1000"]) == 0
    fx.write_ops(warehouse, fx.op(halves[1]))
    assert job.rows_ahead(cfg, 2000) == 3  # one new OP, two messages left pending
    assert job.main([*run, "2000"]) == 0
    assert started == [False, True]

    # scripts/submit.sh starts its driver JVM by the same prediction
    fx.write_halves(warehouse, fx.half(store_ms=0))
    assert job.rows_ahead(cfg, 3000) == 2  # one new half, one pending
    submit = [*run, "3000"]
    assert job.submit_java_options(submit).endswith(SHORT_LIVED_JVM)
    monkeypatch.setattr(job, "SHORT_LIVED_MAX_ROWS", 1)
    assert job.submit_java_options(submit).endswith(LONG_RUN_GC)
    # a continuous job, or arguments the job will refuse: the default JVM
    assert job.submit_java_options(["run", "--warehouse", warehouse, "--every", "1s"]).endswith(
        LONG_RUN_GC
    )
    assert job.submit_java_options(["run", "--now-ms", "soon"]).endswith(LONG_RUN_GC)


def test_verify_of_a_small_warehouse_gets_a_short_lived_jvm(warehouse, monkeypatch):
    from jobs import interpreted
    from jobs import reconcile as job
    from jobs.session import LONG_RUN_GC, SHORT_LIVED_JVM

    halves = [fx.half(store_ms=0) for _ in range(2)]
    fx.write_halves(warehouse, *halves)
    fx.write_ops(warehouse, fx.op(halves[0]))
    verify = ["verify", "--warehouse", warehouse]
    # three raw rows: a small audit (jobs.interpreted.SMALL_AUDIT), one a process runs once
    assert job.submit_java_options(verify).endswith(SHORT_LIVED_JVM)
    monkeypatch.setattr(interpreted, "INTERPRETED_MAX_ROWS", 2)
    assert job.submit_java_options(verify).endswith(LONG_RUN_GC)


def _versions(warehouse: str) -> dict[str, int]:
    out = {}
    for root, dirs, _ in os.walk(warehouse):
        if "_delta_log" in dirs:
            out[os.path.relpath(root, warehouse)] = DeltaTable(root).version()
            dirs.clear()
    return out


def _tree(warehouse: str) -> list[tuple[str, int]]:
    return sorted(
        (os.path.relpath(os.path.join(r, f), warehouse), os.path.getsize(os.path.join(r, f)))
        for r, _, files in os.walk(warehouse)
        for f in files
    )


def test_log_cleaned_beyond_the_cursor_fails_clearly_and_writes_nothing(spark, warehouse):
    from jobs.inputs import HistoryGoneError
    from txn_core.config import load_config

    fx.write_halves(warehouse, fx.half(store_ms=0))
    fx.write_halves(warehouse, fx.half(store_ms=0))
    half_path = table_path(warehouse, HALF)
    DeltaTable(half_path).create_checkpoint()
    os.remove(os.path.join(half_path, "_delta_log", f"{0:020d}.json"))  # as log clean-up does

    with pytest.raises(HistoryGoneError, match="no longer holds version 0"):
        reconcile(spark, load_config(warehouse=warehouse), now_ms=1)
    assert not os.path.exists(topic_path(warehouse, "ORDER"))
    runs = DeltaTable(table_path(warehouse, RUNS)).to_pyarrow_table().to_pylist()
    assert [r["status"] for r in runs] == ["STARTED"]  # the next run retries the same intent


@pytest.mark.parametrize("one_pass_max, one_pass", [(3, True), (2, False)])
def test_the_undecided_are_bounded_by_the_wins_and_decided_alike_in_one_pass_or_two(
    spark, warehouse, monkeypatch, one_pass_max, one_pass
):
    """A big run decides the messages it leaves undecided in the pass that
    joins their bodies when at most `UNDELIVERED_ONE_PASS_MAX_ROWS` can be
    (its live messages but those a winning OP decides: a duplicate or an
    invalid OP decides nothing), and writes the same rows either way."""
    monkeypatch.setattr("jobs.interpreted.INTERPRETED_MAX_ROWS", -1)  # a big run's passes
    monkeypatch.setattr(pipeline, "UNDELIVERED_ONE_PASS_MAX_ROWS", one_pass_max)
    bounds, counted_with_bodies = [], []
    bound = pipeline._undecided_at_most
    monkeypatch.setattr(
        pipeline, "_undecided_at_most", lambda c: bounds.append(bound(c)) or bound(c)
    )
    fates = Counters.fates  # in one pass, the fates are counted on the rows with their bodies
    monkeypatch.setattr(
        Counters,
        "fates",
        lambda counters, df, rules: counted_with_bodies.append("body" in df.columns)
        or fates(counters, df, rules),
    )
    h = [fx.half(store_ms=T0 - 1000) for _ in range(4)] + [fx.half(store_ms=T0 - HOUR - 1)]
    fx.write_halves(warehouse, *h)
    fx.write_ops(
        warehouse,
        fx.op(h[0]),
        fx.op(h[0]),  # a duplicate
        fx.op(h[1], "ROLLBACK"),
        fx.op(h[2], transaction_id="someone else's"),  # invalid
    )
    s = reconcile(spark, {"warehouse": warehouse}, now_ms=T0)

    assert bounds == [3]  # five live messages, two decided by a win
    assert counted_with_bodies == [one_pass]
    assert (s.committed, s.rolled_back, s.duplicate_ops, s.invalid_ops) == (1, 1, 1, 1)
    assert (s.check_requests, s.pending_after) == (1, 3)  # the old one is checked
    pending = rows(table_path(warehouse, PENDING))
    assert [r["half_offset"] for r in pending] == [m["half_offset"] for m in h[2:]]
    assert [r["body"] for r in pending] == [m["body"] for m in h[2:]]
    requests = rows(table_path(warehouse, CHECK_REQUESTS))
    assert [r["half_offset"] for r in requests] == [h[4]["half_offset"]]
