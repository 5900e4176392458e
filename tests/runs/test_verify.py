"""`verify` recomputes every message's fate from the raw tables (I2, I3, I6: docs/protocol.md §5).

A warehouse is reconciled by the real job over two runs (deliveries to two
topics and two queues, a rollback, invalid/duplicate/conflicting OPs, an
expired message with a late commit, one overridden by an operator, a
MAX_CHECKS discard, a pending message, an OP whose small op_offset sits in
a late commit, a plain message in each run among the commits of its queue,
an operator's OP naming one). A copy is then tampered with, one way per message, and every
tampering must be reported naming its message; the untouched warehouse, and
one with a run killed half-way, verify ok.
"""

from __future__ import annotations

import hashlib
import shutil

import pytest
from deltalake import DeltaTable

from schemas import DISCARD, HALF, OP, PENDING, QUEUES, table_path, topic_path

import factories as fx

T0 = 1_000_000_000_000
T1 = T0 + 1_000  # run 1: fresh messages still immune (6 s default)
T2 = T1 + 30_000  # run 2: one check interval later
HOUR = 3_600_000


def _config(warehouse: str) -> dict:
    return {"warehouse": warehouse, "check_max": 1, "check_budget": "sent", "reserved_hours": 1}


def build_reconciled(spark, wh: str) -> dict:
    """Fill `wh` and reconcile it twice; return the half rows by role."""
    from jobs.reconcile import reconcile

    m = {
        "c1": fx.half(9001, store_ms=T0, queue_id=0),
        "c2": fx.half(9002, store_ms=T0, queue_id=0),
        "c3": fx.half(9003, store_ms=T0, queue_id=1, body=bytes(range(256))),
        "pay": fx.half(9004, store_ms=T0, topic="PAY", queue_id=0),
        "rb": fx.half(9005, store_ms=T0),
        "pending": fx.half(9006, store_ms=T0),
        "dup": fx.half(9007, store_ms=T0),
        "conflict": fx.half(9008, store_ms=T0),
        "bad_then_good": fx.half(9009, store_ms=T0),
        "expired_late": fx.half(9010, store_ms=T1 - 2 * HOUR),
        "expired_admin": fx.half(9011, store_ms=T1 - 2 * HOUR),
        "max_checks": fx.half(9012, store_ms=T0 - 10_000),
        "small_op_offset": fx.half(9013, store_ms=T0),
        # plain messages, stored before the OPs of their run (store_ms T0 + 1)
        "plain1": fx.half(9014, store_ms=T0, message_type="NORMAL"),
        "plain2": fx.half(9015, store_ms=T0, message_type="NORMAL"),
    }
    fx.write_halves(wh, *[m[k] for k in ("c1", "c2", "c3", "pay", "rb")])
    fx.write_halves(
        wh,
        *[
            m[k]
            for k in (
                "pending",
                "dup",
                "conflict",
                "bad_then_good",
                "expired_late",
                "expired_admin",
                "max_checks",
                "small_op_offset",
                "plain1",
            )
        ],
    )
    fx.write_ops(
        wh,
        fx.op(m["c2"], op_offset=7002),
        fx.op(m["c1"], op_offset=7001),
        fx.op(m["rb"], "ROLLBACK", op_offset=7005),
    )
    fx.write_ops(
        wh,
        fx.op(m["c3"], op_offset=7003),
        fx.op(m["pay"], op_offset=7004),
        fx.op(m["dup"], op_offset=7007),
        fx.op(m["dup"], op_offset=7008),
        fx.op(m["conflict"], op_offset=7009),
        fx.op(m["conflict"], "ROLLBACK", op_offset=7010),
        fx.op(m["bad_then_good"], op_offset=7011, producer_group="other_group"),
        {**fx.op(m["c1"], op_offset=7012), "half_offset": 123456},
    )
    reconcile(spark, _config(wh), now_ms=T1)

    # op_offset 6999 is the smallest of all, but its commit is the last one:
    # commit order (table version first) puts it after every run-1 delivery.
    fx.write_ops(
        wh,
        fx.op(m["small_op_offset"], op_offset=6999),
        fx.op(m["bad_then_good"], op_offset=7013),
        fx.op(m["expired_late"], op_offset=7014),
        fx.op(m["expired_admin"], op_offset=7015, source="ADMIN"),
        # an operator's OP for a plain message: a conflict, applied nowhere
        fx.op(m["plain1"], "ROLLBACK", op_offset=7016, source="ADMIN"),
    )
    fx.write_halves(wh, m["plain2"])
    reconcile(spark, _config(wh), now_ms=T2)
    # Written after the last run: legitimately not processed yet.
    fx.write_halves(wh, fx.half(9099, store_ms=T2))
    return m


@pytest.fixture(scope="module")
def reconciled(spark, tmp_path_factory):
    """The base warehouse after two real runs, and the messages by role."""
    wh = str(tmp_path_factory.mktemp("verify") / "warehouse")
    return wh, build_reconciled(spark, wh)


@pytest.fixture
def copy(reconciled, tmp_path):
    """A private copy of the reconciled warehouse to tamper with."""
    base, m = reconciled
    wh = str(tmp_path / "warehouse")
    shutil.copytree(base, wh)
    return wh, m


def _verify(spark, wh):
    from jobs.verify import verify

    return verify(spark, _config(wh))


def _kinds_for(report, half_offset: int) -> set[str]:
    return {d["kind"] for d in report.differences if d["half_offset"] == half_offset}


def test_untouched_warehouse_verifies_ok(spark, reconciled, monkeypatch):
    import jobs.verify as V

    wh, m = reconciled
    # as a big warehouse is audited, with the session's own settings (the others: a small one's)
    monkeypatch.setattr(V, "_raw_rows", lambda wh: None)
    report = _verify(spark, wh)
    assert report.ok, report.render()
    assert report.differences == []
    c = report.counts
    assert c["delivered"] == 11  # c1 c2 c3 pay dup conflict bad_then_good expired_admin
    #                               small_op_offset plain1 plain2
    assert c["plain"] == 2
    assert c["rolled_back"] == 1
    assert c["discarded"] == 2  # expired_late, max_checks
    assert c["pending"] == 1
    assert c["halves_judged"] == 15
    assert c["halves_not_yet_processed"] == 1
    assert c["invalid_ops"] == 2 and c["late_ops"] == 1
    assert "verify: OK" in report.render()
    assert report.to_dict()["ok"] is True
    # What verify accepted as commit order, seen in the job's output.
    q0 = (
        spark.read.format("delta")
        .load(topic_path(wh, "ORDER"))
        .where("queue_id = 0")
        .orderBy("queue_offset")
        .collect()
    )
    # each run: its plain message (stored at T0) before its OPs (T0 + 1)
    assert [r["half_offset"] for r in q0] == [
        *(9014, 9001, 9002, 9007, 9008),
        *(9015, 9013, 9009, 9011),
    ]
    assert [r["queue_offset"] for r in q0] == list(range(9))


def test_a_small_warehouse_is_audited_planned_once_in_one_partition(spark, reconciled, monkeypatch):
    import jobs.interpreted
    import jobs.verify as V
    from jobs.interpreted import SMALL_AUDIT

    wh, _ = reconciled
    raw = sum(DeltaTable(table_path(wh, t)).to_pyarrow_table().num_rows for t in (HALF, OP))
    assert V._raw_rows(wh) == raw
    assert V.small_audit_ahead(_config(wh))
    session = {key: spark.conf.get(key, None) for key in SMALL_AUDIT}
    seen = []

    def audit(spark, wh, keep):  # what the audit runs with, not the audit
        seen.append({key: spark.conf.get(key, None) for key in SMALL_AUDIT})

    monkeypatch.setattr(V, "_audit", audit)
    _verify(spark, wh)
    monkeypatch.setattr(jobs.interpreted, "INTERPRETED_MAX_ROWS", raw - 1)
    _verify(spark, wh)
    assert not V.small_audit_ahead(_config(wh))
    assert seen == [SMALL_AUDIT, session]
    assert {key: spark.conf.get(key, None) for key in SMALL_AUDIT} == session


def test_an_unreadable_log_leaves_the_audits_size_unknown(tmp_path):
    import jobs.verify as V

    log = tmp_path / "_sys" / "half" / "_delta_log"
    log.mkdir(parents=True)
    (log / "00000000000000000000.json").write_text("not json\n")
    assert V._raw_rows(str(tmp_path)) is None  # the audit then runs as for a big one, and says why


def test_outputs_of_an_unfinished_run_are_not_judged(spark, copy, monkeypatch):
    """A run killed after its first write leaves rows the next run completes;
    until then verify judges the last committed run and says so."""
    from jobs.faults import InjectedFault
    from jobs.reconcile import reconcile

    wh, m = copy
    fresh = fx.half(9020, store_ms=T2)
    fx.write_halves(wh, fresh)
    fx.write_ops(wh, fx.op(fresh, op_offset=7020))
    monkeypatch.setenv("TXN_FAULT_AT", "after:topics/ORDER")
    with pytest.raises(InjectedFault):
        reconcile(spark, _config(wh), now_ms=T2 + 1)
    monkeypatch.delenv("TXN_FAULT_AT")
    order = spark.read.format("delta").load(topic_path(wh, "ORDER"))
    assert order.where("half_offset = 9020").count() == 1  # the crashed run did write

    report = _verify(spark, wh)
    assert report.ok, report.render()
    assert report.judged_run["run_number"] == 2
    assert any("has not committed" in note for note in report.notes)
    assert report.counts["halves_not_yet_processed"] == 2  # 9099 and 9020


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _add_discard(spark, wh, half_offset, reason="EXPIRED", body=None):
    """Append a discard row for `half_offset` as if the last committed run
    wrote it (with the half's content, or `body` instead of its body)."""
    from pyspark.sql import functions as F

    from jobs.verify import _committed_runs

    discard = table_path(wh, DISCARD)
    columns = spark.read.format("delta").load(discard).columns
    run_id = _committed_runs(wh)[0][-1]["run_id"]
    row = (
        spark.read.format("delta")
        .load(table_path(wh, HALF))
        .where(F.col("half_offset") == half_offset)
        .withColumn("check_times", F.lit(0))
        .withColumn("reason", F.lit(reason))
        .withColumn("discarded_ms", F.lit(T2))
        .withColumn("run_id", F.lit(run_id))
        .select(*columns)
    )
    if body is not None:
        row = row.withColumn("body", F.lit(body))
    row.write.format("delta").mode("append").save(discard)


def test_every_tampering_is_caught_naming_the_message(spark, copy, monkeypatch):
    """One tampering per message (a verify run costs tens of seconds, so they
    share one copy); each must show up as its own difference, on its message."""
    wh, m = copy
    order = topic_path(wh, "ORDER")
    # c2 and plain1: their delivered rows are deleted.
    spark.sql(f"DELETE FROM delta.`{order}` WHERE half_offset IN (9002, 9014)").collect()
    # c1 and plain2: their delivered rows are appended a second time.
    (
        spark.read.format("delta")
        .load(order)
        .where("half_offset IN (9001, 9015)")
        .write.format("delta")
        .mode("append")
        .save(order)
    )
    # c3: the first byte of its 256-byte body flips from 0x00 to 0x01.
    spark.sql(
        f"UPDATE delta.`{order}` SET body = concat(X'01', substring(body, 2)) "
        f"WHERE half_offset = 9003"
    ).collect()
    # small_op_offset: its delivered row gains a property.
    spark.sql(
        f"UPDATE delta.`{order}` SET properties = map_concat(properties, map('forged', 'yes')) "
        f"WHERE half_offset = 9013"
    ).collect()
    # pending: its row vanishes from the pending set.
    spark.sql(f"DELETE FROM delta.`{table_path(wh, PENDING)}` WHERE half_offset = 9006").collect()
    # bad_then_good and expired_admin swap their places in ORDER queue 0.
    spark.sql(
        f"UPDATE delta.`{order}` SET queue_offset = 15 - queue_offset "
        f"WHERE half_offset IN (9009, 9011)"
    ).collect()

    # the queues' state: ORDER queue 1's row a second time (a stalled run's
    # overwrite rebased over the run that took over did that: test_fence.py)
    queues = table_path(wh, QUEUES)
    (
        spark.read.format("delta")
        .load(queues)
        .where("topic = 'ORDER' AND queue_id = 1")
        .write.format("delta")
        .mode("append")
        .save(queues)
    )

    # pay (delivered) and expired_late (already discarded) get a forged discard.
    _add_discard(spark, wh, 9004)
    # ... the second one with another body: every discard row is compared.
    _add_discard(spark, wh, 9010, body=b"forged")

    report = _verify(spark, wh)
    assert not report.ok
    assert "missing_delivery" in _kinds_for(report, 9002)
    assert "duplicate_delivery" in _kinds_for(report, 9001)
    body = [
        d
        for d in report.differences
        if d["half_offset"] == 9003 and d["kind"] == "content_mismatch"
    ]
    assert len(body) == 1 and body[0]["transaction_id"] == "tx-9003"
    flipped = bytes([1]) + bytes(range(1, 256))
    assert body[0]["expected"].startswith(f"body=256 bytes, sha256 {_sha256(bytes(range(256)))}")
    assert body[0]["found"].startswith(f"body=256 bytes, sha256 {_sha256(flipped)}")
    props = [(d["expected"], d["found"]) for d in report.differences if d["half_offset"] == 9013]
    assert props == [
        ('properties={"k":"v","n":"9013"}', 'properties={"k":"v","n":"9013","forged":"yes"}')
    ]
    assert _kinds_for(report, 9006) == {"missing_pending"}
    assert "discard_of_decided_message" in _kinds_for(report, 9004)
    assert "duplicate_discard" in _kinds_for(report, 9010)
    forged = [
        d
        for d in report.differences
        if d["half_offset"] == 9010 and d["kind"] == "content_mismatch"
    ]
    assert len(forged) == 1 and forged[0]["found"] == f"body=6 bytes, sha256 {_sha256(b'forged')}"
    assert "queue_offset_order" in _kinds_for(report, 9009)
    assert "queue_offset_order" in _kinds_for(report, 9011)
    assert _kinds_for(report, 9014) == {"missing_delivery"}
    doubled = [d for d in report.differences if d["kind"] == "duplicate_queue"]
    assert [(d["table"], d["expected"], d["found"]) for d in doubled] == [
        ("_sys/queues ORDER queue 1", "1 row", "2 rows")
    ]
    assert "duplicate_delivery" in _kinds_for(report, 9015)
    # Untouched messages stay clean, except for the gaps the deletions and
    # the extra rows leave in ORDER queue 0, where the later deliveries now sit.
    tampered = {9001, 9002, 9003, 9004, 9006, 9010, 9009, 9011, 9013, 9014, 9015}
    others = {
        (d["half_offset"], d["kind"])
        for d in report.differences
        if d["half_offset"] not in tampered and d["kind"] != "duplicate_queue"
    }
    assert {kind for _, kind in others} <= {"queue_offset_not_dense"}, others
    assert not {off for off, _ in others} & {9005, 9012, 9099}
    text = report.render()
    assert "verify: FAILED" in text
    for needle in (
        "half_offset=9002 transaction_id=tx-9002",
        "[missing_pending]",
        "[duplicate_discard]",
    ):
        assert needle in text
    assert report.to_dict()["total_differences"] == report.total_differences >= 6

    # More differences than are listed: the first ones listed, all counted.
    import jobs.verify as V

    monkeypatch.setattr(V, "MAX_LISTED", 3)
    capped = _verify(spark, wh)

    def key(d):
        return d["half_offset"], d["kind"]  # ties may come in either order

    assert [key(d) for d in capped.differences] == [key(d) for d in report.differences[:3]]
    assert all(d in report.differences for d in capped.differences)
    assert capped.differences_by_kind == report.differences_by_kind


def test_rows_deleted_by_deletion_vectors_are_seen_deleted(spark, copy):
    """The audit reads the job's tables and the topics as the parquet files
    of their snapshot where the log allows; a deletion vector hides rows
    still in those files, so such a table is read through Delta's reader."""
    from jobs import appends

    wh, _ = copy
    order, pending = topic_path(wh, "ORDER"), table_path(wh, PENDING)
    half = table_path(wh, HALF)
    for path in (order, pending, half):
        spark.sql(
            f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
        )
    spark.sql(f"DELETE FROM delta.`{order}` WHERE half_offset = 9002").collect()
    spark.sql(f"DELETE FROM delta.`{pending}` WHERE half_offset = 9006").collect()
    # two more halves after the last run, in one file, and one of them deleted:
    # the file's count still includes it
    fx.write_halves(wh, fx.half(9100, store_ms=T2), fx.half(9101, store_ms=T2))
    spark.sql(f"DELETE FROM delta.`{half}` WHERE half_offset = 9101").collect()
    assert appends.snapshot_files(order, DeltaTable(order).version()) is None

    report = _verify(spark, wh)
    assert "missing_delivery" in _kinds_for(report, 9002)
    assert "missing_pending" in _kinds_for(report, 9006)
    assert report.counts["halves_not_yet_processed"] == 2  # 9099 and 9100
