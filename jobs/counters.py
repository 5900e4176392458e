"""A run's counters (docs/protocol.md §4.5), taken while its kept rows are computed.

Each counter is a Spark observation (`DataFrame.observe`) on rows the run
computes anyway (`jobs.pipeline.compute`: the live messages' keys, the
classified OPs, the decisions), not a pass of its own, a Spark job per input:
the tasks that compute the rows aggregate them, and the counts arrive with the
action that keeps them. Only DataFrames the kept rows' plan always executes
are observed, or `values` would wait forever: the kept DataFrame itself, or an
input no optimisation can remove from its plan (a table read under a union).

    >>> counted = Counters()                                   # doctest: +SKIP
    >>> kept = held.checkpoint(counted.ops(classified))        # doctest: +SKIP
    >>> counted.values()["committed"]                          # doctest: +SKIP
    850000
"""

from __future__ import annotations

from itertools import count

from pyspark.sql import Column, DataFrame, Observation
from pyspark.sql import functions as F

from jobs import transforms as T
from txn_core.vocabulary import CANCEL, Action, Decision, OpOutcome


def _where(cond: str) -> Column:
    """How many rows meet the SQL condition `cond` (0, not null, when there
    are none). SQL text, as in `T.conform`: one call into the JVM per
    counter instead of a dozen."""
    return F.expr(f"coalesce(sum(CASE WHEN {cond} THEN 1 ELSE 0 END), 0)")


_NO_CANCEL = f"action != '{CANCEL}'"
#: SQL: a classified OP names a delayed message and was stored before its due time
_DELAYED = "coalesce(due_ms > store_ms, false)"


def _rows() -> Column:
    return F.count(F.lit(1))


_ids = count()


class Counters:
    """The observations of one run; `values()` once the observed rows are kept."""

    def __init__(self) -> None:
        self._seen: dict[str, Observation] = {}

    def _observe(self, name: str, df: DataFrame, *aggregates: Column) -> DataFrame:
        # a name of its own in the process: Spark tells observations apart by name
        seen = Observation(f"{name}-{next(_ids)}")
        self._seen[name] = seen
        return df.observe(seen, *aggregates)

    def halves(self, half: DataFrame) -> DataFrame:
        """`half`, the new half rows `T.with_reject_reason`, counted (read,
        set aside as rejected, and plain messages accepted: each committed
        by its store)."""
        return self._observe(
            "half",
            half,
            _rows().alias("half_read"),
            _where(f"{T.REJECT_REASON} IS NOT NULL").alias("rejected_halves"),
            _where(f"{T.REJECT_REASON} IS NULL AND {T.IS_PLAIN}").alias("plain"),
        )

    def pending(self, pending_prev: DataFrame) -> DataFrame:
        return self._observe("pending", pending_prev, _rows().alias("pending_before"))

    def ops(self, classified: DataFrame, rules: T.Rules) -> DataFrame:
        """`classified` (`T.classify_ops`), counted by outcome. Called again
        for OPs classified again with the history: the last one counts.
        Also the winning COMMITs of delayed messages: committed before their
        time (`_commits_delayed`), of which due after the run's watermark
        (`_commits_later`: scheduled, not delivered), and the earliest such
        due time."""
        won_delayed = f"outcome = '{OpOutcome.WIN}' AND action = '{Action.COMMIT}' AND {_DELAYED}"
        later = f"{won_delayed} AND due_ms > {rules.watermark_ms}"
        return self._observe(
            "ops",
            classified,
            _rows().alias("op_read"),
            _where(f"outcome = '{OpOutcome.WIN}' AND action = '{Action.COMMIT}'").alias(
                "committed"
            ),
            _where(f"outcome = '{OpOutcome.WIN}' AND action = '{Action.ROLLBACK}'").alias(
                "rolled_back"
            ),
            _where(f"outcome = '{OpOutcome.DUPLICATE}'").alias("duplicate_ops"),
            _where(f"outcome = '{OpOutcome.CONFLICT}'").alias("conflicting_ops"),
            # a cancel's outcome is its own step's to count (`jobs.cancels`)
            _where(f"outcome = '{OpOutcome.INVALID}' AND {_NO_CANCEL}").alias("invalid_ops"),
            _where(f"outcome = '{OpOutcome.LATE}' AND {_NO_CANCEL}").alias("late_ops"),
            _where(f"action = '{CANCEL}'").alias("_cancel_ops"),
            _where(
                f"outcome = '{OpOutcome.WIN}' AND action = '{Action.COMMIT}' AND due_ms IS NOT NULL"
            ).alias("_commits_of_delayed"),
            _where(f"reason = '{T.UNKNOWN_OFFSET}'").alias("_unknown_offset_ops"),
            _where(won_delayed).alias("_commits_delayed"),
            _where(later).alias("_commits_later"),
            F.expr(f"min(CASE WHEN {later} THEN due_ms END)").alias("_commits_later_earliest"),
        )

    def fates(self, fates: DataFrame, rules: T.Rules) -> DataFrame:
        """`fates` (`T.decide` on the messages no OP decided), counted by
        decision, with the age of the oldest still pending and the earliest
        clock at which one becomes due (`T.due_at_ms` as the next run sees it)."""
        pending = f"decision IN ('{Decision.CHECK}', '{Decision.WAIT}')"
        return self._observe(
            "fates",
            fates,
            _where(f"decision = '{Decision.CHECK}'").alias("check_requests"),
            _where(f"decision = '{Decision.MAX_CHECKS}'").alias("discarded_max_checks"),
            _where(f"decision = '{Decision.EXPIRED}'").alias("discarded_expired"),
            _where(pending).alias("pending_after"),
            F.expr(f"max(CASE WHEN {pending} THEN age_ms END)").alias("oldest_pending_age_ms"),
            F.min(
                F.when(F.expr(pending), T.due_at_ms(rules, last_check_ms=T.last_check_after(rules)))
            ).alias("next_due_ms"),
        )

    def bodies(self, rows: DataFrame) -> DataFrame:
        """`rows` (messages with their bodies), with the bytes of their bodies
        counted (`_body_bytes`): what collecting them would hold."""
        return self._observe(
            "bodies", rows, F.expr("coalesce(sum(length(body)), 0)").alias("_body_bytes")
        )

    def values(self) -> dict:
        """Every counter observed so far; waits for the actions that compute them.
        `committed` counts the plain messages (`plain`, delivered by the run
        that reads them) with the winning COMMITs, once both are observed."""
        out: dict = {}
        for seen in self._seen.values():
            out.update(seen.get)
        if "committed" in out and "plain" in out:
            out["committed"] += out["plain"]
        return out
