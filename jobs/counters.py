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

from pyspark.sql import DataFrame, Observation
from pyspark.sql import functions as F

from jobs import transforms as T
from txn_core.vocabulary import CANCEL, Action, Decision, OpOutcome


def _where(cond: str) -> str:
    """SQL: how many rows meet the SQL condition `cond` (0, not null, when
    there are none). SQL text, as in `T.select`: one call into the JVM per
    counter instead of a dozen."""
    return f"coalesce(sum(CASE WHEN {cond} THEN 1 ELSE 0 END), 0)"


#: SQL: the bytes of the rows' bodies
_BODY_BYTES = "coalesce(sum(length(body)), 0)"
_NO_CANCEL = f"action != '{CANCEL}'"
#: SQL: a classified OP names a delayed message and was stored before its due time
_DELAYED = "coalesce(due_ms > store_ms, false)"


#: SQL: how many rows
_ROWS = "count(1)"


_ids = count()
#: the name of the struct column an observation's counters are fields of
_STRUCT = "counters"


class Counters:
    """The observations of one run; `values()` once the observed rows are kept."""

    def __init__(self) -> None:
        self._seen: dict[str, Observation] = {}
        # an observation's values once fetched: they never change, and each
        # fetch is a few calls into the JVM, for every call of `values`
        self._got: dict[str, dict] = {}

    def _observe(self, name: str, df: DataFrame, **counters: str) -> DataFrame:
        """`df` observed under `name`: each counter the SQL aggregate given."""
        # a name of its own in the process: Spark tells observations apart by name
        seen = Observation(f"{name}-{next(_ids)}")
        self._seen[name] = seen
        self._got.pop(name, None)
        # one struct of all the counters: a Column per counter is a few calls into the JVM each
        fields = ", ".join(f"'{c}', {sql}" for c, sql in counters.items())
        return df.observe(seen, F.expr(f"named_struct({fields}) AS {_STRUCT}"))

    def halves(self, half: DataFrame, bodies: bool = False) -> DataFrame:
        """`half`, the new half rows `T.with_reject_reason`, counted (read,
        set aside as rejected, and plain messages accepted: each committed
        by its store). `bodies`: their bodies' bytes too (`_half_body_bytes`),
        which makes the pass read the bodies."""
        return self._observe(
            "half",
            half,
            half_read=_ROWS,
            rejected_halves=_where(f"{T.REJECT_REASON} IS NOT NULL"),
            plain=_where(f"{T.REJECT_REASON} IS NULL AND {T.IS_PLAIN}"),
            **({"_half_body_bytes": _BODY_BYTES} if bodies else {}),
        )

    def pending(self, pending_prev: DataFrame, bodies: bool = False) -> DataFrame:
        """`pending_prev` counted; `bodies`: their bodies' bytes too
        (`_pending_body_bytes`)."""
        return self._observe(
            "pending",
            pending_prev,
            pending_before=_ROWS,
            **({"_pending_body_bytes": _BODY_BYTES} if bodies else {}),
        )

    def ops(self, classified: DataFrame, rules: T.Rules) -> DataFrame:
        """`classified` (`T.classify_ops`), counted by outcome. Called again
        for OPs classified again with the history: the last one counts.
        Also the winning COMMITs of delayed messages: committed before their
        time (`_commits_delayed`), of which due after the run's watermark
        (`_commits_later`: scheduled, not delivered), and the earliest such
        due time; and the wins that decide a live message (`_wins_on_live`:
        a message has one win at most, and a win's target is live unless
        discarded by an earlier run, as a message resolved before has no
        win)."""
        won_delayed = f"outcome = '{OpOutcome.WIN}' AND action = '{Action.COMMIT}' AND {_DELAYED}"
        later = f"{won_delayed} AND due_ms > {rules.watermark_sql}"
        return self._observe(
            "ops",
            classified,
            op_read=_ROWS,
            committed=_where(f"outcome = '{OpOutcome.WIN}' AND action = '{Action.COMMIT}'"),
            rolled_back=_where(f"outcome = '{OpOutcome.WIN}' AND action = '{Action.ROLLBACK}'"),
            duplicate_ops=_where(f"outcome = '{OpOutcome.DUPLICATE}'"),
            conflicting_ops=_where(f"outcome = '{OpOutcome.CONFLICT}'"),
            # a cancel's outcome is its own step's to count (`jobs.cancels`)
            invalid_ops=_where(f"outcome = '{OpOutcome.INVALID}' AND {_NO_CANCEL}"),
            late_ops=_where(f"outcome = '{OpOutcome.LATE}' AND {_NO_CANCEL}"),
            _cancel_ops=_where(f"action = '{CANCEL}'"),
            _commits_of_delayed=_where(
                f"outcome = '{OpOutcome.WIN}' AND action = '{Action.COMMIT}' AND due_ms IS NOT NULL"
            ),
            # an operator's COMMIT of a discarded message, whose delay is not kept
            _commits_after_discard=_where(
                f"outcome = '{OpOutcome.WIN}' AND action = '{Action.COMMIT}' "
                "AND coalesce(discarded, false)"
            ),
            _unknown_offset_ops=_where(f"reason = '{T.UNKNOWN_OFFSET}'"),
            # a win decides its message; only one discarded before is not live
            _wins_on_live=_where(f"outcome = '{OpOutcome.WIN}' AND NOT coalesce(discarded, false)"),
            _commits_delayed=_where(won_delayed),
            _commits_later=_where(later),
            _commits_later_earliest=f"min(CASE WHEN {later} THEN due_ms END)",
        )

    def fates(self, fates: DataFrame, rules: T.Rules) -> DataFrame:
        """`fates` (`T.decide` on the messages no OP decided), counted by
        decision, with the age of the oldest still pending and the earliest
        clock at which one becomes due (`T.due_at_ms` as the next run sees it)."""
        pending = f"decision IN ('{Decision.CHECK}', '{Decision.WAIT}')"
        return self._observe(
            "fates",
            fates,
            check_requests=_where(f"decision = '{Decision.CHECK}'"),
            discarded_max_checks=_where(f"decision = '{Decision.MAX_CHECKS}'"),
            discarded_expired=_where(f"decision = '{Decision.EXPIRED}'"),
            pending_after=_where(pending),
            oldest_pending_age_ms=f"max(CASE WHEN {pending} THEN age_ms END)",
            next_due_ms=f"min(CASE WHEN {pending} "
            f"THEN {T.due_at_sql(rules, T.last_check_after_sql(rules))} END)",
        )

    def due(self, due_keys: DataFrame) -> DataFrame:
        """`due_keys` (the scheduled rows this run's clock makes due, with
        `_cancelled` on those cancelled before, if any), counted: the rows
        (`_due_rows`), those not cancelled (`_due`: delivered now) and of
        those the transactional ones (`_due_resolved`: resolved when their
        COMMIT won)."""
        kept = "_cancelled IS NULL" if "_cancelled" in due_keys.columns else "true"
        return self._observe(
            "due",
            due_keys,
            _due_rows=_ROWS,
            _due=_where(kept),
            _due_resolved=_where(f"{kept} AND resolved_before"),
        )

    def bodies(self, rows: DataFrame) -> DataFrame:
        """`rows` (messages with their bodies), with the bytes of their bodies
        counted (`_body_bytes`): what collecting them would hold."""
        return self._observe("bodies", rows, _body_bytes=_BODY_BYTES)

    def values(self) -> dict:
        """Every counter observed so far; waits for the actions that compute them.
        `committed` counts the plain messages (`plain`, delivered by the run
        that reads them) with the winning COMMITs, once both are observed."""
        out: dict = {}
        for name, seen in self._seen.items():
            if name not in self._got:
                self._got[name] = seen.get[_STRUCT].asDict()
            out.update(self._got[name])
        if "committed" in out and "plain" in out:
            out["committed"] += out["plain"]
        return out
