"""Cancels of delayed messages (docs/protocol.md §4, "Cancelling a delayed
message"): ADMIN OPs with action CANCEL, judged apart from the decisions.

A run's cancels are few (operators' actions), so they are collected to the
driver and judged there, in commit order, after `jobs.transforms.classify_ops`
has matched each to its message (live, plain of the run, or the history of
decided and discarded ones). A cancel of a message the run neither holds
nor finds in the history (a plain one scheduled by an earlier run) is
looked up in the scheduled set, among the rows still waiting. The run
records the valid ones in `_sys/cancelled`; a message with a cancel row is
never delivered: the run whose window holds its due time drops it from the
due rows (`prior_cancels_due`), and one whose COMMIT of it wins at or after
that time drops it from its deliveries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from jobs import inputs
from jobs import transforms as T
from jobs.local import local_frame
from schemas.spark import spark_schema
from schemas.tables import CANCELLED, REJECTED, SCHEDULED
from txn_core.vocabulary import CANCEL, Action, OpOutcome, Source

#: reasons a cancel is rejected (`_sys/rejected`, after "INVALID: " / "LATE: ")
NOT_ADMIN = "a cancel must be an ADMIN OP"
NOT_DELAYED = "not a delayed message"
ALREADY_DUE = "message already due"
ALREADY_DELIVERED = "message already delivered"
ROLLED_BACK = "message rolled back"


#: the run's counters the cancels add to
COUNTERS = ("cancelled", "invalid_ops", "late_ops", "duplicate_ops")


@dataclass
class Judged:
    """A run's cancels, judged: the CANCELLED rows, the REJECTED rows (as
    tuples in their tables' column order) and the counts they add."""

    cancelled: list[tuple] = field(default_factory=list)
    rejected: list[tuple] = field(default_factory=list)
    counts: dict[str, int] = field(
        default_factory=lambda: {
            "cancelled": 0,
            "invalid_ops": 0,
            "late_ops": 0,
            "duplicate_ops": 0,
        }
    )

    def cancelled_frame(self, spark: SparkSession) -> DataFrame:
        return local_frame(spark, self.cancelled, spark_schema(CANCELLED))

    def rejected_frame(self, spark: SparkSession) -> DataFrame:
        return local_frame(spark, self.rejected, spark_schema(REJECTED))


def judge(
    spark: SparkSession, wh: str, versions: dict[str, int], classified: DataFrame, rules: T.Rules
) -> Judged:
    """The cancels of `classified` (`T.classify_ops`, with the history), in
    commit order. Valid: an ADMIN OP naming its message's own transaction
    and group, a delayed message not rolled back or discarded, due after the
    run's watermark, with no earlier cancel (else a duplicate)."""
    rows = [
        r.asDict()
        for r in classified.where(F.col("action") == CANCEL)
        .select(
            "op_offset",
            "half_offset",
            "transaction_id",
            "producer_group",
            "source",
            "store_ms",
            "remark",
            "commit_version",
            "outcome",
            "reason",
            "topic",
            "queue_id",
            "prior_action",
            "discarded",
            "due_ms",
        )
        .orderBy("commit_version", "op_offset")
        .collect()
    ]
    keys = sorted({r["half_offset"] for r in rows})
    waiting = _waiting(spark, wh, versions, keys, rules)
    before = _cancelled_before(spark, wh, versions, keys)
    out = Judged()
    for r in rows:
        found = waiting.get(r["half_offset"])
        if r["reason"] == T.UNKNOWN_OFFSET and found is not None:
            # a plain message an earlier run scheduled: only the scheduled set knows it
            r.update(found, outcome=OpOutcome.CANCEL, reason=None)
        elif r["due_ms"] is None and found is not None and r["outcome"] == OpOutcome.CANCEL:
            # committed and scheduled by an earlier run: the history knows no due time or queue
            r.update(due_ms=found["due_ms"], queue_id=found["queue_id"], topic=found["topic"])
        outcome, reason = _verdict(r, found, before, rules)
        if outcome == OpOutcome.CANCEL:
            before.add(r["half_offset"])
            out.counts["cancelled"] += 1
            out.cancelled.append(_cancelled_row(r, rules))
        elif outcome == OpOutcome.DUPLICATE:
            out.counts["duplicate_ops"] += 1
        else:
            out.counts["invalid_ops" if outcome == OpOutcome.INVALID else "late_ops"] += 1
            out.rejected.append(
                (
                    "_sys/op",
                    r["op_offset"],
                    r["transaction_id"],
                    r["producer_group"],
                    f"{outcome}: {reason}",
                    rules.run_id,
                )
            )
    return out


def _verdict(r: dict, found: dict | None, before: set[int], rules: T.Rules) -> tuple[str, str]:
    """(outcome, reason) of one cancel (`judge`)."""
    if r["outcome"] in (OpOutcome.INVALID, OpOutcome.LATE):
        return r["outcome"], r["reason"]
    if r["source"] != Source.ADMIN:
        return OpOutcome.INVALID, NOT_ADMIN
    if r["prior_action"] == Action.ROLLBACK:
        return OpOutcome.LATE, ROLLED_BACK
    if r["discarded"] and r["prior_action"] is None:
        return OpOutcome.LATE, "message discarded"
    if r["due_ms"] is None:
        # decided COMMIT and not waiting: delivered (or committed after its time)
        if r["prior_action"] == Action.COMMIT and found is None:
            return OpOutcome.LATE, ALREADY_DELIVERED
        return OpOutcome.INVALID, NOT_DELAYED
    if r["due_ms"] <= rules.watermark_ms:
        return OpOutcome.LATE, ALREADY_DUE
    if r["half_offset"] in before:
        return OpOutcome.DUPLICATE, ""
    return OpOutcome.CANCEL, ""


def _cancelled_row(r: dict, rules: T.Rules) -> tuple:
    return (
        r["half_offset"],
        r["due_ms"],
        r["transaction_id"],
        r["producer_group"],
        r["topic"],
        r["queue_id"],
        r["op_offset"],
        r["commit_version"],
        r["store_ms"],
        r["remark"],
        rules.run_id,
        rules.run_number,
    )


def _waiting(
    spark: SparkSession, wh: str, versions: dict[str, int], keys: list[int], rules: T.Rules
) -> dict[int, dict]:
    """The scheduled rows of `keys` still waiting after the previous run's
    watermark (their identity and due time): those due by this run's are
    among them, so that their cancels are late as already due, not unknown
    or delivered. The files whose due_ms range ends at or before it are
    skipped by their statistics."""
    scheduled = inputs.read_state(spark, wh, versions, SCHEDULED)
    found = (
        scheduled.where(
            (F.col("due_ms") > F.lit(rules.prev_watermark_ms)) & F.col("half_offset").isin(keys)
        )
        .select("half_offset", "transaction_id", "producer_group", "topic", "queue_id", "due_ms")
        .collect()
    )
    return {r["half_offset"]: r.asDict() for r in found}


def _cancelled_before(
    spark: SparkSession, wh: str, versions: dict[str, int], keys: list[int]
) -> set[int]:
    """Which of `keys` an earlier run cancelled."""
    cancelled = inputs.read_state(spark, wh, versions, CANCELLED)
    return {
        r[0]
        for r in cancelled.where(F.col("half_offset").isin(keys)).select("half_offset").collect()
    }


def prior_cancels(spark: SparkSession, wh: str, versions: dict[str, int]) -> DataFrame | None:
    """`_sys/cancelled` as the run's intent pinned it; None while no run
    ever cancelled anything (version 0 is its creation): then no run reads it."""
    from jobs.job_tables import NO_VERSION

    if versions.get(CANCELLED.path, NO_VERSION) <= 0:
        return None
    return inputs.read_state(spark, wh, versions, CANCELLED)


def prior_cancels_due(cancels: DataFrame, rules: T.Rules) -> DataFrame:
    """The half_offsets of the earlier cancels due in the run's window
    (prev_watermark_ms, watermark_ms]: the due scheduled rows to drop. A
    cancel this run applies is due after its watermark, so never among them."""
    return cancels.where(
        (F.col("due_ms") > F.lit(rules.prev_watermark_ms))
        & (F.col("due_ms") <= F.lit(rules.watermark_ms))
    ).select("half_offset")


def drop_cancelled_commits(won_now: DataFrame, cancels: DataFrame) -> DataFrame:
    """`won_now` (`T.split_won`) without the COMMITs of messages cancelled
    while pending, now committed at or after their time (a ROLLBACK stays:
    it delivers nothing and is resolved all the same)."""
    cancelled = cancels.select("half_offset", F.lit(True).alias("_cancelled"))
    return (
        won_now.join(F.broadcast(cancelled), "half_offset", "left")
        .where(F.col("_cancelled").isNull() | (F.col("action") != Action.COMMIT))
        .drop("_cancelled")
    )


__all__ = ["Judged", "judge", "prior_cancels", "prior_cancels_due", "drop_cancelled_commits"]
