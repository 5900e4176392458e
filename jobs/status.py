"""`status`: what is pending, as of the last committed run (docs/protocol.md §3.4)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from pyspark.sql import functions as F

from jobs import inputs, job_tables, run_log
from jobs.session import use_warehouse
from schemas import HALF, PENDING, table_path
from schemas.tables import CANCELLED, SCHEDULED
from txn_core.config import Config, as_config
from txn_core.vocabulary import RunStatus


@dataclass
class StatusReport:
    warehouse: str
    now_ms: int
    last_run_id: str | None
    last_run_status: str | None
    #: an interrupted run the next run will redo first
    interrupted: bool
    pending: int
    oldest_pending_age_ms: int | None
    pending_by_producer_group: dict[str, int]
    pending_by_topic: dict[str, int]
    #: half-table versions written since the last run read it (not yet in `pending`)
    unread_half_versions: int
    #: the scheduled set (delayed messages committed, not due yet) as of the
    #: last committed run: how many, the earliest due time, how many per topic
    scheduled: int = 0
    next_scheduled_ms: int | None = None
    scheduled_by_topic: dict[str, int] = field(default_factory=dict)
    #: delayed messages whose delivery was cancelled (`Broker.cancel`), in
    #: all, and per topic; a cancelled message no longer counts as scheduled
    cancelled: int = 0
    cancelled_by_topic: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def status(spark, config: Config | dict, now_ms: int | None = None) -> StatusReport:
    cfg = as_config(config)
    wh = use_warehouse(spark, cfg)
    now = int(time.time() * 1000) if now_ms is None else now_ms
    last = run_log.last_run(wh)
    path = table_path(wh, PENDING)
    pending = (
        spark.read.format("delta").load(path)
        if job_tables.is_delta(path)
        else inputs.empty(spark, PENDING)
    ).cache()
    try:
        total = pending.agg(F.count(F.lit(1)).alias("n"), F.min("store_ms").alias("oldest")).first()

        def by(c: str) -> dict:
            rows = pending.groupBy(c).agg(F.count(F.lit(1)).alias("n")).orderBy(c).collect()
            return {r[c]: r["n"] for r in rows}

        waiting = _scheduled(spark, wh, last)
        waiting.update(_cancelled(spark, wh, last))
        half_v = job_tables.latest_version(table_path(wh, HALF))
        read_v = last.half_version if last else job_tables.NO_VERSION
        return StatusReport(
            warehouse=wh,
            now_ms=now,
            last_run_id=last.run_id if last else None,
            last_run_status=last.status if last else None,
            interrupted=bool(last and last.status == RunStatus.STARTED),
            pending=total["n"],
            oldest_pending_age_ms=(
                max(now - total["oldest"], 0) if total["oldest"] is not None else None
            ),
            pending_by_producer_group=by("producer_group"),
            pending_by_topic=by("topic"),
            unread_half_versions=max(half_v - read_v, 0),
            **waiting,
        )
    finally:
        pending.unpersist()


def _scheduled(spark, wh: str, last: run_log.RunRecord | None) -> dict:
    """The scheduled set after the last committed run (the one before an
    interrupted run): the rows of `_sys/scheduled` it had written, due after
    its watermark and not cancelled (a scan of what waits: an operator's
    look, not a run's)."""
    path = table_path(wh, SCHEDULED)
    committed = run_log.last_committed_run(wh, last)
    if committed is None or not job_tables.is_delta(path):
        return {}
    summary = run_log.decode_json(committed.summary_json)
    if not summary.get("scheduled_after"):
        return {}
    waiting = (
        spark.read.format("delta")
        .load(path)
        .where(F.col("due_ms") > F.lit(summary.get("watermark_ms", committed.now_ms)))
        .where(F.col("run_number") <= F.lit(committed.run_number))
    )
    cancelled = table_path(wh, CANCELLED)
    if job_tables.is_delta(cancelled):
        dropped = spark.read.format("delta").load(cancelled)
        if last is not None and last.status != RunStatus.COMMITTED:
            dropped = dropped.where(F.col("run_id") != F.lit(last.run_id))
        waiting = waiting.join(dropped.select("half_offset"), "half_offset", "left_anti")
    # the summary's next_scheduled_ms counts cancelled messages too (a run
    # does not read the cancels of what waits): the rows left say it
    rows = waiting.groupBy("topic").agg(F.count(F.lit(1)).alias("n"), F.min("due_ms").alias("next"))
    counted = rows.orderBy("topic").collect()
    by_topic = {r["topic"]: r["n"] for r in counted}
    return {
        "scheduled": sum(by_topic.values()),
        "next_scheduled_ms": min((r["next"] for r in counted), default=None),
        "scheduled_by_topic": by_topic,
    }


def _cancelled(spark, wh: str, last: run_log.RunRecord | None) -> dict:
    """The cancels the committed runs recorded (`_sys/cancelled`), by topic."""
    path = table_path(wh, CANCELLED)
    if last is None or not job_tables.is_delta(path):
        return {}
    rows = spark.read.format("delta").load(path)
    if last.status != RunStatus.COMMITTED:  # an interrupted run's rows are not yet its
        rows = rows.where(F.col("run_id") != F.lit(last.run_id))
    counted = rows.groupBy("topic").agg(F.count(F.lit(1)).alias("n")).orderBy("topic").collect()
    by_topic = {r["topic"]: r["n"] for r in counted}
    return {"cancelled": sum(by_topic.values()), "cancelled_by_topic": by_topic}
