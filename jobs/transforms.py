"""The reconciliation rules (docs/protocol.md §4) as DataFrame -> DataFrame functions.

Nothing here reads or writes a table: `jobs.pipeline.compute` hands in the
pending set, the new rows and, when needed, a few rows of history, and applies
the functions in the order of the numbered sections below. Each is
deterministic for given inputs, so a crashed run is redone with identical
outputs (I4). The rules read only a message's keys (`message_keys`: ids,
topic, queue, times, check counters); its body, properties and the like are
joined back once, onto every decided message (`with_bodies`), so the costly
columns never go through the rules' joins and sorts.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from jobs.jvm_calls import hint, select_expr
from schemas import HALF, OP, TOPIC, TableSchema
from schemas.spark import spark_type
from schemas.tables import (
    CHECK_REQUESTS,
    DISCARD,
    PENDING,
    QUEUES,
    REJECTED,
    RESOLVED,
    SCHEDULED,
    STORED_MESSAGE_COLUMNS,
)
from txn_core.vocabulary import (
    CANCEL,
    SYSTEM_TOPIC_REGEX,
    TOPIC_PATTERN,
    Action,
    CheckAnswer,
    Decision,
    MessageType,
    OpOutcome,
    Source,
)

#: columns of a message no rule reads; they only travel to the output tables
BODY_COLUMNS = ("msg_id", "tags", "keys", "body", "properties", "born_ms")

#: the columns of `message_keys` (pending messages without their bodies)
MESSAGE_KEY_COLUMNS = tuple(c for c in PENDING.names if c not in BODY_COLUMNS)
#: what a run decides about a message (`queue_positions`, `decide`), as
#: opposed to the message itself: all `with_bodies` takes from the decision
FATE_COLUMNS = (
    "half_offset",
    "decision",
    "queue_offset",
    "commit_ms",
    "checks_sent",
    "checks_undecided",
    "last_check_ms",
    "age_ms",
    "deliver_at_ms",  # a pending message's, carried in `_sys/pending`
)
#: an OP as the job reads it: its row and the table version that added it
OP_COLUMNS = (*OP.names, "commit_version")

#: the reason of an OP naming no message `classify_ops` was given
UNKNOWN_OFFSET = "unknown half_offset"


#: what Rules carries from run to run besides the rules themselves
_CARRIED = ("watermark_ms", "prev_watermark_ms", "scheduled_before")


@dataclass(frozen=True)
class Rules:
    """Everything the rules depend on besides the data; stored in the run's intent."""

    run_id: str
    run_number: int
    now_ms: int
    transaction_timeout_ms: int
    check_max: int
    check_interval_ms: int
    reserved_ms: int
    max_checks_per_run: int
    check_budget: str
    #: the run's watermark W: the latest clock of any run so far, this one's
    #: included; committed messages due at or before it are delivered
    #: (docs/protocol.md §4, "Delayed messages"). -1: no clock yet
    watermark_ms: int = -1
    #: the previous run's watermark: scheduled messages due in
    #: (prev_watermark_ms, watermark_ms] are this run's to deliver
    prev_watermark_ms: int = -1
    #: how many messages the scheduled set held before this run
    scheduled_before: int = 0

    @classmethod
    def from_config(
        cls,
        config,
        *,
        run_id: str,
        run_number: int,
        now_ms: int,
        prev_watermark_ms: int = -1,
        scheduled_before: int = 0,
    ) -> Rules:
        return cls(
            run_id=run_id,
            run_number=run_number,
            now_ms=now_ms,
            watermark_ms=max(prev_watermark_ms, now_ms),
            prev_watermark_ms=prev_watermark_ms,
            scheduled_before=scheduled_before,
            transaction_timeout_ms=config.transaction_timeout_ms,
            check_max=config.check_max,
            check_interval_ms=config.check_interval_ms,
            reserved_ms=config.reserved_hours * 3_600_000,
            max_checks_per_run=config.max_checks_per_run,
            check_budget=config.check_budget,
        )

    @property
    def now_sql(self) -> str:
        """SQL: the run's clock (`sql_run_value`)."""
        return sql_run_value(self.now_ms)

    @property
    def run_number_sql(self) -> str:
        return sql_run_value(self.run_number)

    @property
    def watermark_sql(self) -> str:
        return sql_run_value(self.watermark_ms)

    @property
    def delivered_sql(self) -> str:
        """SQL: the clock a delivery is stamped with, the watermark (the run's
        clock, or the latest of all runs' when this one's went back: it
        delivers what is due by then)."""
        return sql_run_value(max(self.now_ms, self.watermark_ms))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def same_rules(self, other: Rules) -> bool:
        """Whether both decide alike at the same clock (run identity aside)."""
        mine, theirs = asdict(self), asdict(other)
        for key in ("run_id", "run_number", "now_ms", *_CARRIED):
            del mine[key], theirs[key]
        return mine == theirs

    @classmethod
    def from_json(cls, text: str) -> Rules:
        return cls(**json.loads(text))


def select(df: DataFrame, *exprs: str) -> DataFrame:
    """`df.select(...)` of SQL text: column names and expressions (`"a + 1
    AS b"`). A name handed to `DataFrame.select` costs three calls into the
    JVM (PySpark builds a Column for it), and each `F` function as many;
    text costs one call in all (`jobs.jvm_calls`), which a small run's driver
    feels (docs/performance.md, "Fewer calls into the JVM per run").

    >>> select(df, "half_offset", "store_ms AS commit_ms")  # doctest: +SKIP
    """
    return select_expr(df, [f"`{e}`" if _NAME.fullmatch(e) else e for e in exprs])


_NAME = re.compile(r"\w+")


def conform(df: DataFrame, table: TableSchema, *extra: str) -> DataFrame:
    """Select `table`'s columns in order with their exact types (plus `extra` as is).

    As SQL text, casting only the columns whose type differs, and not at all
    when `df` has them already: each Column built in Python costs a few
    dozen calls into the JVM (a cast by DataType more), and a run conforms
    some 250 columns, enough to show in a small run's time.
    """
    have = {f.name: f.dataType for f in df.schema.fields}
    names = [*table.names, *extra]
    exprs = [
        f"`{c.name}`"
        if have.get(c.name) == spark_type(c.type)
        else f"CAST(`{c.name}` AS {c.type}) AS `{c.name}`"
        for c in table.columns
    ]
    if list(have) == names and all(not e.startswith("CAST") for e in exprs):
        return df
    return select_expr(df, [*exprs, *[f"`{name}`" for name in extra]])


def sql_strings(values) -> str:
    """('A', 'B') for SQL's IN (the vocabulary's constants, say)."""
    return "(" + ", ".join(sql_string(str(v)) for v in values) + ")"


def sql_string(value: str) -> str:
    """`value` as a SQL string literal, whatever it holds (a run id, a path)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def sql_run_value(value: int) -> str:
    """SQL: the BIGINT `value`, one of a run's own (its clock, number,
    watermark, an input's version), in a form Spark does not write into the
    code it generates.

    Spark writes a BIGINT literal into the Java code of every plan that uses
    it, so each run's code would differ from the last run's: its code cache
    would miss, and every big run of a long-lived session compile some twenty
    classes anew (Janino, then the JIT, while their loops run slowly). This
    expression is not folded to a literal (its lambda is not foldable), Spark
    keeps it as an object the code refers to, evaluated per row at a small
    cost (docs/performance.md). Not for a filter a scan should push down to
    its files: those need literals.

    >>> spark.sql(f"SELECT {sql_run_value(7)} AS v").first().v  # doctest: +SKIP
    7
    """
    return f"aggregate(array(), CAST({int(value)} AS BIGINT), (v, _) -> v)"


# --- 1. new half rows ----------------------------------------------------------


def half_reject_reason() -> Column:
    """Why a half row cannot be processed, or null. Evaluated per row: one bad
    row is set aside and never stops the others (docs/protocol.md §4, rule 1)."""
    topic = F.col("topic")
    return (
        F.when(~topic.rlike(TOPIC_PATTERN), F.lit("invalid topic name"))
        .when(topic.rlike(SYSTEM_TOPIC_REGEX), F.lit("system topic name"))
        .when(F.col("queue_id") < 0, F.lit("negative queue_id"))
        .when(F.expr(_UNKNOWN_TYPE), F.lit("unknown message_type"))
    )


# SQL text, as the OP rules: Columns need a session, these are module constants.
#: a half row's message_type is not one this job knows (null: TRANSACTION)
_UNKNOWN_TYPE = f"coalesce(NOT message_type IN {sql_strings(MessageType)}, false)"
#: a half row is a plain message (`Producer.send`): committed by its own store
IS_PLAIN = f"coalesce(message_type = '{MessageType.NORMAL}', false)"


#: the column `with_reject_reason` adds
REJECT_REASON = "_reject_reason"


def with_reject_reason(new_half: DataFrame) -> DataFrame:
    """`new_half` with `half_reject_reason` as REJECT_REASON: evaluated once
    per row for all that reads it (the split, the counters), not a regular
    expression per row and reader: a visible share of a run's CPU."""
    return new_half.withColumn(REJECT_REASON, half_reject_reason())


def split_halves(new_half: DataFrame, rules: Rules) -> tuple[DataFrame, DataFrame]:
    """(accepted half rows, REJECTED rows for the others); `new_half` may
    come `with_reject_reason` already."""
    tagged = new_half if REJECT_REASON in new_half.columns else with_reject_reason(new_half)
    accepted = tagged.where(f"{REJECT_REASON} IS NULL").drop(REJECT_REASON)
    rejected = select(
        tagged.where(f"{REJECT_REASON} IS NOT NULL"),
        f"{sql_string(HALF.path)} AS source_table",
        "half_offset AS row_offset",
        "transaction_id",
        "producer_group",
        f"{REJECT_REASON} AS reason",
        f"{sql_string(rules.run_id)} AS run_id",
    )
    return accepted, conform(rejected, REJECTED)


def split_kinds(accepted_half: DataFrame) -> tuple[DataFrame, DataFrame]:
    """(the transactional half rows, the plain ones) of `accepted_half`
    (`split_halves`): only the first become live messages."""
    return accepted_half.where(f"NOT {IS_PLAIN}"), accepted_half.where(IS_PLAIN)


#: what the rules need of a plain message: its identity, queue and commit
PLAIN_KEY_COLUMNS = (
    "half_offset",
    "transaction_id",
    "producer_group",
    "topic",
    "queue_id",
    "commit_version",
    "store_ms",
    "deliver_at_ms",
)


def _later(rules: Rules) -> str:
    """SQL: a plain message is delayed past the run's watermark (to be
    scheduled, not delivered). A `deliver_at_ms` at or before its store time
    is no delay: the message is delivered as a plain one."""
    return f"coalesce(deliver_at_ms > store_ms AND deliver_at_ms > {rules.watermark_sql}, false)"


def split_plain(plain: DataFrame, rules: Rules) -> tuple[DataFrame, DataFrame]:
    """(the plain messages (keys or rows) this run delivers, those it
    schedules: due after its watermark)."""
    later = _later(rules)
    return plain.where(f"NOT {later}"), plain.where(later)


def plain_keys(plain_half: DataFrame) -> DataFrame:
    """The PLAIN_KEY_COLUMNS of the plain half rows `split_kinds` gives (with
    their `commit_version`: the `_sys/half` version that stored them)."""
    return select(plain_half, *PLAIN_KEY_COLUMNS)


def plain_targets(plain: DataFrame) -> DataFrame:
    """Plain messages (`plain_keys`) as OP targets: already committed, so an
    OP naming one is a duplicate (COMMIT) or a conflict (ROLLBACK) and
    changes nothing (docs/protocol.md §4, rule 3)."""
    return select(
        plain,
        *_IDENTITY,
        f"'{Action.COMMIT}' AS prior_action",
        "false AS discarded",
        f"{_DUE} AS due_ms",  # what a cancel of it needs
    )


def plain_winners(plain: DataFrame) -> DataFrame:
    """Plain messages (`plain_keys`) as `winners` rows: a COMMIT whose
    `source` is NORMAL, its own half row standing for the OP (`op_offset`
    the half_offset, `commit_version` the half table's version,
    `op_store_ms` its store time)."""
    return select(
        plain,
        *_IDENTITY,
        f"'{Action.COMMIT}' AS action",
        f"'{MessageType.NORMAL}' AS source",
        "half_offset AS op_offset",
        "commit_version",
        "store_ms AS op_store_ms",
        "false AS discarded",
        # a delayed message already due: placed by its due time
        f"CAST({_DUE} AS BIGINT) AS due_ms",
        f"{_DUE} AS target_due_ms",
    )


def scheduled_rows(plain_half: DataFrame, rules: Rules) -> DataFrame:
    """SCHEDULED rows of the plain half rows (whole, with `commit_version`)
    this run schedules (`split_plain`)."""
    _, later = split_plain(plain_half, rules)
    rows = _replaced(
        later,
        due_ms="deliver_at_ms",
        commit_ms="store_ms",
        run_number=rules.run_number_sql,
        source="CAST(NULL AS STRING)",
    )
    return conform(rows, SCHEDULED)


def split_won(won: DataFrame, rules: Rules) -> tuple[DataFrame, DataFrame]:
    """(the winning OPs (`winners`) this run applies now, the COMMITs of
    delayed messages due after its watermark: scheduled, delivered later)."""
    later = f"action = '{Action.COMMIT}' AND coalesce(due_ms > {rules.watermark_sql}, false)"
    return won.where(f"NOT ({later})"), won.where(later)


def scheduled_commits(later: DataFrame, messages: DataFrame, rules: Rules) -> DataFrame:
    """SCHEDULED rows of the winning COMMITs `split_won` holds back: the
    whole stored message (from `messages`, `known_messages`), its due time,
    its commit (the OP's store time and version) and the OP's source."""
    keys = select(
        later, "half_offset", "due_ms", "op_store_ms AS commit_ms", "commit_version", "source"
    )
    rows = _replaced(
        keys.join(select(messages, *STORED_MESSAGE_COLUMNS), "half_offset"),
        run_number=rules.run_number_sql,
    )
    return conform(rows, SCHEDULED)


def due_scheduled(scheduled: DataFrame, rules: Rules) -> DataFrame:
    """The rows of the scheduled set (`_sys/scheduled` as the run's intent
    pinned it) due in (prev_watermark_ms, watermark_ms]: this run's to
    deliver. A filter on due_ms alone: Delta skips every file whose
    statistics put it outside."""
    # literals, not `sql_run_value`: a filter the scan pushes down to its files
    return scheduled.where(f"due_ms > {rules.prev_watermark_ms} AND due_ms <= {rules.watermark_ms}")


def scheduled_winners(due: DataFrame) -> DataFrame:
    """Due scheduled messages (`due_scheduled`) as `plain_winners` rows:
    committed at `commit_ms`, placed by `due_ms`; `resolved_before` for a
    transactional one, whose `_sys/resolved` row its COMMIT's run wrote."""
    return select(
        due,
        *_IDENTITY,
        f"'{Action.COMMIT}' AS action",
        f"'{MessageType.NORMAL}' AS source",
        "half_offset AS op_offset",
        "commit_version",
        "commit_ms AS op_store_ms",
        "false AS discarded",
        "due_ms",
        "source IS NOT NULL AS resolved_before",
    )


def live_messages(pending_prev: DataFrame, accepted_half: DataFrame, rules: Rules) -> DataFrame:
    """The messages this run may resolve or check: the carried pending set plus new halves."""
    fresh = _replaced(
        accepted_half,
        checks_sent="0",
        checks_undecided="0",
        last_check_ms="CAST(NULL AS BIGINT)",
        run_number=rules.run_number_sql,
    )
    return conform(pending_prev, PENDING).unionByName(conform(fresh, PENDING))


def message_keys(messages: DataFrame) -> DataFrame:
    """`messages` (PENDING rows) without their BODY_COLUMNS: all the rules need."""
    return select(messages, *MESSAGE_KEY_COLUMNS)


# --- 2. OPs ----------------------------------------------------------------


def history_targets(resolved: DataFrame, discarded: DataFrame) -> DataFrame:
    """What the history says about some messages: how they were resolved
    (`prior_action`) and whether they were discarded."""
    res = select(
        resolved,
        "half_offset",
        "transaction_id",
        "producer_group",
        "topic",
        "CAST(NULL AS INT) AS queue_id",
        "action AS prior_action",
        "after_discard AS discarded",
    )
    dis = _targets(discarded, discarded=True)
    # the rows of one message agree on its identity; max() just picks it deterministically
    # a discarded message's delay is not kept: an operator's COMMIT of it
    # delivers it at once (docs/protocol.md §4.4)
    grouped = (
        res.unionByName(dis.drop("due_ms"))
        .groupBy("half_offset")
        .agg(*[F.expr(f"max({c}) AS {c}") for c in (*_IDENTITY[1:], "prior_action", "discarded")])
    )
    return select(grouped, "*", "CAST(NULL AS BIGINT) AS due_ms")


def op_targets(live: DataFrame, history: DataFrame | None = None) -> DataFrame:
    """Every message an OP of this run may refer to, with its identity and
    queue: the `live` messages, and those `history` (`history_targets`) knows."""
    targets = _targets(live, discarded=False)
    return targets if history is None else targets.unionByName(history)


#: what identifies a message and its queue, in every table that names one
_IDENTITY = ("half_offset", "transaction_id", "producer_group", "topic", "queue_id")


def _targets(messages: DataFrame, *, discarded: bool) -> DataFrame:
    """`messages` as OP targets no OP resolved before, with the due time
    (`due_ms`) of a delayed one (null: not delayed, or not known)."""
    due = _DUE if "deliver_at_ms" in messages.columns else "CAST(NULL AS BIGINT)"
    return select(
        messages,
        *_IDENTITY,
        "CAST(NULL AS STRING) AS prior_action",
        f"{str(discarded).lower()} AS discarded",
        f"{due} AS due_ms",
    )


#: SQL: a stored message's due time when it is delayed (after its store time), else null
_DUE = "CASE WHEN deliver_at_ms > store_ms THEN deliver_at_ms END"


_VALID_OP = f"(action IN {sql_strings(Action)} AND source IN {sql_strings(Source)})"
_ADMIN_OP = f"({_VALID_OP} AND source = '{Source.ADMIN}')"
# valid OPs first, in commit order; the same for every candidate winner
_OP_RANK = (
    "PARTITION BY half_offset, transaction_id, producer_group "
    f"ORDER BY {_VALID_OP} DESC, commit_version, op_offset"
)
# every frame runs from the group's first row: the valid rows come first,
# so the first row holds the first valid action whenever there is one
_UPTO_HERE = f"({_OP_RANK} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)"
_OP_INVALID = f"""CASE WHEN _t_txn IS NULL THEN '{UNKNOWN_OFFSET}'
    WHEN NOT action IN {sql_strings([*Action, CANCEL])} THEN 'invalid action'
    WHEN NOT source IN {sql_strings(Source)} THEN 'invalid source'
    WHEN producer_group != _t_group THEN 'producer_group mismatch'
    WHEN transaction_id != _t_txn THEN 'transaction_id mismatch' END"""
_DISCARDED = "coalesce(discarded, false)"
_OP_OUTCOME = f"""CASE WHEN _late THEN '{OpOutcome.LATE}'
    WHEN _invalid IS NOT NULL THEN '{OpOutcome.INVALID}'
    WHEN action = '{CANCEL}' THEN '{OpOutcome.CANCEL}'
    WHEN prior_action IS NULL
         AND (CASE WHEN {_DISCARDED} THEN _first_admin ELSE _first END) THEN '{OpOutcome.WIN}'
    WHEN action = coalesce(prior_action, CASE WHEN {_DISCARDED} THEN _first_admin_action
                                              ELSE _first_action END) THEN '{OpOutcome.DUPLICATE}'
    ELSE '{OpOutcome.CONFLICT}' END"""
# the working columns classify_ops drops from what it returns
_CLASSIFY_WORK = (
    "_t_txn",
    "_t_group",
    "_invalid",
    "_late",
    "_first",
    "_first_action",
    "_first_admin",
    "_first_admin_action",
)


def classify_ops(
    ops: DataFrame,
    targets: DataFrame,
    *,
    discards: bool = True,
    one_task: bool = False,
    few_targets: bool = False,
) -> DataFrame:
    """Add `outcome` (WIN, DUPLICATE, CONFLICT, INVALID, LATE) and `reason` to
    each OP, and the `topic`, `queue_id` and `discarded` flag of the message
    it names.

    The first valid OP in commit order (table version, then op_offset within
    the commit) wins; a message resolved by an earlier run has no winner here,
    so all its OPs compare against the earlier decision. PRODUCER and CHECK
    OPs for a discarded message are late; only ADMIN OPs may override a discard.

    Only OPs naming the message's own transaction and group can be valid, so
    the OPs are ranked per (half_offset, transaction_id, producer_group)
    before they meet their message, and the join keeps that order: a sort of
    the OPs alone, instead of one for the join and another of the joined rows.

    `discards=False`: no target is a discarded message (the live messages
    never are), so the ADMIN OPs need no ranking of their own: two window
    functions fewer.

    `one_task`: the OPs are few enough to be ranked by one task, which needs
    no shuffle (a Spark job of its own) to bring each message's OPs together.
    With `few_targets` too, that task also joins them with the targets, held
    in a hash table, where sending the targets to every task first is
    another Spark job.

    The rules are SQL text, as in `conform`: built as Columns in Python they
    take a thousand calls into the JVM on every run's driver.
    """
    if discards:  # for a discarded message, only ADMIN OPs count
        admin_ranks = (
            f"{_ADMIN_OP} AND count(CASE WHEN {_ADMIN_OP} THEN 1 END) "
            f"OVER {_UPTO_HERE} = 1 AS _first_admin",
            f"first(CASE WHEN {_ADMIN_OP} THEN action END, true) "
            f"OVER {_UPTO_HERE} AS _first_admin_action",
        )
    else:
        admin_ranks = ("false AS _first_admin", "CAST(NULL AS STRING) AS _first_admin_action")
    # one partition, or the join's partitioning: no second shuffle either way
    together = ops.coalesce(1) if one_task else ops.repartition("half_offset")
    ranked = select(
        together,
        "*",
        f"{_VALID_OP} AND row_number() OVER ({_OP_RANK}) = 1 AS _first",
        f"first(CASE WHEN {_VALID_OP} THEN action END) OVER {_UPTO_HERE} AS _first_action",
        *admin_ranks,
    )
    t = select(
        targets,
        "half_offset",
        "transaction_id AS _t_txn",
        "producer_group AS _t_group",
        "topic",
        "queue_id",
        "prior_action",
        "discarded",
        "due_ms",
    )
    if one_task and few_targets:
        t = _in_one_task(t)
    joined = select(ranked.join(t, "half_offset", "left"), "*", f"{_OP_INVALID} AS _invalid")
    joined = select(
        joined, "*", f"_invalid IS NULL AND {_DISCARDED} AND source != '{Source.ADMIN}' AS _late"
    )
    kept = [f"`{c}`" for c in joined.columns if c not in _CLASSIFY_WORK]
    return select(
        joined,
        *kept,
        "coalesce(_invalid, CASE WHEN _late THEN 'message discarded' END) AS reason",
        f"{_OP_OUTCOME} AS outcome",
    )


def unmatched_op_keys(classified: DataFrame) -> DataFrame:
    """half_offsets of the OPs `classify_ops` found no target for: against
    the live messages alone, these are the ones that need the history."""
    return classified.where(F.col("reason") == UNKNOWN_OFFSET).select("half_offset").distinct()


def reclassify_with_history(
    classified: DataFrame, keys: DataFrame, history: DataFrame
) -> DataFrame:
    """`classified` (against the live messages), with the OPs for `keys`
    (`unmatched_op_keys`) classified again against `history`
    (`history_targets`). OPs of different messages never meet in
    `classify_ops`, so only those OPs change."""
    kept = classified.join(keys, "half_offset", "left_anti")
    again = classified.join(keys, "half_offset", "left_semi").select(*OP_COLUMNS)
    return kept.unionByName(classify_ops(again, history))


def op_rejections(classified: DataFrame, rules: Rules) -> DataFrame:
    """REJECTED rows for OPs never applied (invalid or late), for audit."""
    # cancels are judged and recorded apart (`jobs.cancels`)
    bad = classified.where(
        f"outcome IN {sql_strings([OpOutcome.INVALID, OpOutcome.LATE])} AND action != '{CANCEL}'"
    )
    return conform(
        select(
            bad,
            f"{sql_string(OP.path)} AS source_table",
            "op_offset AS row_offset",
            "transaction_id",
            "producer_group",
            "concat(outcome, ': ', reason) AS reason",
            f"{sql_string(rules.run_id)} AS run_id",
        ),
        REJECTED,
    )


def winners(classified: DataFrame) -> DataFrame:
    """The winning OPs: the message each decides (its keys: the OP matched
    them) and the decision."""
    return select(
        classified.where(f"outcome = '{OpOutcome.WIN}'"),
        "half_offset",
        "transaction_id",
        "producer_group",
        "topic",
        "queue_id",
        "action",
        "source",
        "op_offset",
        "commit_version",
        "store_ms AS op_store_ms",
        "discarded",
        # a delayed message committed before its time is placed by that
        # time (and scheduled while it is ahead); committed at or after
        # it, by its commit, as any other
        "CASE WHEN due_ms > store_ms THEN due_ms END AS due_ms",
        # the message's own due time, however late the commit: a cancel applies
        "due_ms AS target_due_ms",
    )


# --- 3. deliveries ---------------------------------------------------------


def queue_positions(
    won: DataFrame, queues: DataFrame, *, plain: bool = False, one_task: bool = False
) -> DataFrame:
    """Where each winning COMMIT goes: dense queue offsets per (topic,
    queue_id), continuing the previous maximum, in commit order; `commit_ms`
    is the winning OP's store time.

    `plain`: `won` holds plain messages too (`plain_winners`), committed in
    `_sys/half`, whose versions do not compare with `_sys/op`'s. Each kind
    then keeps its own commit order (table version, then offset), and the
    two are merged by commit time: a message is placed by the latest
    (commit_ms, offset) among its kind's messages of the queue up to it,
    ties going to the COMMIT OPs (docs/protocol.md §4.3).

    `one_task`: the winners are few enough to be placed by one task, which
    needs no shuffle (a Spark job of its own) to bring each queue's rows
    together.
    """
    # a row per queue: sent whole to the tasks, which keep their partitioning
    base = F.broadcast(select(queues, "topic", "queue_id", "next_queue_offset"))
    order = f"PARTITION BY topic, queue_id ORDER BY {', '.join(_merge_order(plain))}"
    # only what the ordering and the fate need: every row goes through a sort
    wanted = ["half_offset", "topic", "queue_id", "commit_version", "op_offset", "op_store_ms"]
    wanted += ["source"] + (["due_ms"] if "due_ms" in won.columns else [])
    rows = select(won.where(f"action = '{Action.COMMIT}'"), *wanted)
    if one_task:
        rows = rows.coalesce(1)
    return select(
        _with_merge_key(rows, plain).join(base, ["topic", "queue_id"], "left"),
        "half_offset",
        "topic",
        "queue_id",
        f"coalesce(next_queue_offset, 0) + row_number() OVER ({order}) - 1 AS queue_offset",
        "op_store_ms AS commit_ms",
    )


def _with_merge_key(rows: DataFrame, plain: bool) -> DataFrame:
    """`rows` (winning COMMITs) with `_plain`, `_order` and `_at`, the merge
    key of `queue_positions`: the running maximum of (time, offset) along
    its kind's order in its queue. Non-decreasing along each kind's order,
    so sorting by it keeps that order and interleaves the kinds by time.

    Three kinds: COMMIT OPs (`_plain` 0) and plain messages (1), each in
    commit order (table version, offset) at their commit time, and delayed
    messages now due (2, a `due_ms`: plain, or transactional committed
    before their time), in the order of their due time (then half_offset),
    at it: a delayed message goes after every message due before
    it. Without plain messages: `rows` as they are."""
    if not plain:
        return rows
    due = F.col("due_ms") if "due_ms" in rows.columns else F.lit(None).cast("bigint")
    kind = (
        F.when(due.isNotNull(), F.lit(2))
        .when(F.col("source") == MessageType.NORMAL, F.lit(1))
        .otherwise(F.lit(0))
    )
    own = (
        Window.partitionBy("topic", "queue_id", "_plain")
        .orderBy("_order", "_tie")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    return (
        rows.withColumn("_plain", kind)
        .withColumn("_order", F.coalesce(due, F.col("commit_version")))
        # delayed messages due at one time: by half_offset, whichever kind
        # (plain or transactional, delivered now or from the scheduled set)
        .withColumn(
            "_tie", F.when(due.isNotNull(), F.col("half_offset")).otherwise(F.col("op_offset"))
        )
        .withColumn(
            "_at", F.max(F.struct(F.coalesce(due, F.col("op_store_ms")), F.col("_tie"))).over(own)
        )
    )


def _merge_order(plain: bool) -> tuple[str, ...]:
    """The sort of a queue's deliveries (`queue_positions`)."""
    return ("_at", "_plain", "_order", "_tie") if plain else ("commit_version", "op_offset")


def queue_ends(won: DataFrame, queues: DataFrame, *, one_task: bool = False) -> DataFrame:
    """(topic, queue_id, delivered, last_queue_offset) of each queue the
    winning COMMITs of `won` go to: what `queue_positions` will say of each
    queue, known without placing a message. Its offsets are dense from the
    queue's next one, so counting a queue's COMMITs gives its last offset.

    What it is for: the topics to write and the next QUEUES table are known
    as soon as the OPs are classified, before any message has its place
    (a grouping of the winners, not a sort of them).

    `one_task`: the winners are few enough to be counted by one task, with
    the queues' rows beside them: one Spark job, with no exchange whatever
    the inputs' partitioning, where a shuffle of the counts and a broadcast
    of the queues take three.
    """
    base = select(queues, "topic", "queue_id", "next_queue_offset")
    commits = won.where(f"action = '{Action.COMMIT}'")
    if one_task:
        counted = (
            select(
                commits, "topic", "queue_id", "1 AS _n", "CAST(NULL AS BIGINT) AS next_queue_offset"
            )
            .unionByName(select(base, "*", "0 AS _n"))
            .coalesce(1)
            .groupBy("topic", "queue_id")
            .agg(
                F.expr("sum(_n) AS delivered"),
                F.expr("max(next_queue_offset) AS next_queue_offset"),
            )
            .where("delivered > 0")
        )
    else:
        counted = (
            commits.groupBy("topic", "queue_id")
            .agg(F.expr("count(1) AS delivered"))
            .join(base, ["topic", "queue_id"], "left")
        )
    return select(
        counted,
        "topic",
        "queue_id",
        "delivered",
        "coalesce(next_queue_offset, 0) + delivered - 1 AS last_queue_offset",
    )


def known_messages(messages: DataFrame, discarded: DataFrame) -> DataFrame:
    """The stored messages (STORED_MESSAGE_COLUMNS) of every message a fate
    of this run can name: the live `messages` and the new plain ones (both in
    `messages`) and the `discarded` ones its OPs name (an ADMIN OP may deliver
    a discarded message)."""
    return select(messages, *STORED_MESSAGE_COLUMNS).unionByName(
        select(discarded, *STORED_MESSAGE_COLUMNS)
    )


def with_bodies(
    fates: DataFrame, messages: DataFrame, *, broadcast: bool = False, one_task: bool = False
) -> DataFrame:
    """Rows decided on keys alone (queue positions, decided pending rows):
    their FATE_COLUMNS, each with its whole message (the
    STORED_MESSAGE_COLUMNS of `messages`: live messages, plain ones, or a
    discarded one an ADMIN OP delivers).

    `broadcast`: the fates are few enough to send whole to every task, so
    the messages, the wide side, are joined where they lie instead of
    being shuffled. `one_task`: the messages too are few enough for one
    task, which joins them with the fates (in a hash table) where sending
    the fates first is a Spark job of its own.
    """
    decided = select(fates, *[c for c in FATE_COLUMNS if c in fates.columns])
    stored = select(messages, *STORED_MESSAGE_COLUMNS)
    if one_task:
        decided, stored = _in_one_task(decided), stored.coalesce(1)
    elif broadcast:
        decided = F.broadcast(decided)
    return decided.join(stored, "half_offset", "inner")


def _in_one_task(side: DataFrame) -> DataFrame:
    """`side` of a join whose other side is in one partition too, as the
    hash table it builds: one partition each side needs no exchange (with
    `jobs.interpreted`'s settings, under which a small run runs), and Spark
    would otherwise send a small side to every task first (a Spark job of
    its own)."""
    return hint(side.coalesce(1), "shuffle_hash")


def deliveries(settled: DataFrame, rules: Rules) -> DataFrame:
    """TOPIC rows (plus `topic`) of `settled` (queue positions joined
    `with_bodies`), `delivered_ms` the run's watermark."""
    rows = _replaced(settled, delivered_ms=rules.delivered_sql, run_id=sql_string(rules.run_id))
    return conform(rows, TOPIC, "topic")


def next_queues(
    queues: DataFrame, positions: DataFrame, rules: Rules, *, one_task: bool = False
) -> DataFrame:
    """The QUEUES table after this run's deliveries (`queue_positions`, or
    just each queue's last one: only the maximum queue_offset counts).
    `one_task`: both are few (a row per queue), grouped and joined by one
    task (`_in_one_task`), where each otherwise takes a Spark job."""
    if one_task:
        positions = positions.coalesce(1)
    moved = select(
        positions.groupBy("topic", "queue_id").agg(
            F.expr("max(queue_offset) + 1 AS next_queue_offset")
        ),
        "*",
        f"{rules.run_number_sql} AS run_number",
    )
    if one_task:  # as in `remaining_pending`: an outer join keeps the one partition
        moved_keys = _in_one_task(select(moved, "topic", "queue_id", "true AS _moved"))
        kept = queues.coalesce(1).join(moved_keys, ["topic", "queue_id"], "left")
        kept = kept.where("_moved IS NULL").drop("_moved")
    else:
        kept = queues.join(select(moved, "topic", "queue_id"), ["topic", "queue_id"], "left_anti")
    return conform(kept, QUEUES).unionByName(conform(moved, QUEUES))


def resolved_rows(won: DataFrame, rules: Rules) -> DataFrame:
    return conform(
        select(
            won,
            "half_offset",
            "transaction_id",
            "producer_group",
            "topic",
            "action",
            "source",
            "op_offset",
            "commit_version AS op_version",
            "op_store_ms",
            "discarded AS after_discard",
            f"{sql_string(rules.run_id)} AS run_id",
        ),
        RESOLVED,
    )


# --- 4. what stays pending -------------------------------------------------


def remaining_pending(
    live: DataFrame, won: DataFrame, *, broadcast: bool = False, one_task: bool = False
) -> DataFrame:
    """The live messages no OP of this run decided. `broadcast`: `won` is
    small enough to send whole to every task (the live messages are not
    shuffled). `one_task`: both are few enough for one task (`with_bodies`)."""
    keys = select(won, "half_offset")
    if one_task:
        # an outer join: Spark moves a one-partition side's coalesce above an anti join
        won_keys = _in_one_task(select(keys, "half_offset", "true AS _won"))
        rows = live.coalesce(1).join(won_keys, "half_offset", "left")
        return rows.where("_won IS NULL").drop("_won")
    return live.join(F.broadcast(keys) if broadcast else keys, "half_offset", "left_anti")


def apply_answers(pending: DataFrame, answers: DataFrame) -> DataFrame:
    """Count check answers without a decision (UNKNOWN/ERROR) towards the
    `answered` budget: one per request_id, only for the message's own group
    and transaction."""
    undecided = (
        answers.where(f"answer IN {sql_strings(CheckAnswer)}")
        .groupBy("half_offset", "transaction_id", "producer_group")
        .agg(F.expr("count(DISTINCT request_id) AS _answered"))
    )
    joined = pending.join(undecided, ["half_offset", "transaction_id", "producer_group"], "left")
    return _replaced(
        joined,
        checks_undecided="CAST(checks_undecided + coalesce(_answered, 0) AS INT)",
        _answered=None,
    )


def _replaced(df: DataFrame, **columns: str | None) -> DataFrame:
    """`df.withColumn` for each of `columns` (its SQL text; None: dropped)
    as one `select` of text: a column `df` has keeps its place, a new one
    comes last."""
    have = df.columns
    kept = [
        c if c not in columns else f"{columns[c]} AS {c}"
        for c in have
        if c not in columns or columns[c] is not None
    ]
    added = [f"{sql} AS {c}" for c, sql in columns.items() if c not in have and sql is not None]
    return select(df, *kept, *added)


def age_sql(rules: Rules) -> str:
    """SQL: now − store_ms; a message stored "in the future" has age 0."""
    return f"CAST(greatest({rules.now_sql} - store_ms, 0) AS BIGINT)"


def immunity_sql(rules: Rules) -> str:
    """SQL: how long a message is immune to checks, in ms: its own check
    immunity, else the transaction timeout."""
    return (
        "CASE WHEN check_immunity_s IS NOT NULL AND check_immunity_s >= 0 "
        "THEN CAST(check_immunity_s AS BIGINT) * 1000 "
        f"ELSE CAST({rules.transaction_timeout_ms} AS BIGINT) END"
    )


def decide(pending: DataFrame, rules: Rules) -> DataFrame:
    """Add `age_ms` and `decision` (EXPIRED, MAX_CHECKS, CHECK, WAIT) per message."""
    counted = "checks_sent" if rules.check_budget == "sent" else "checks_undecided"
    interval_over = (
        f"(last_check_ms IS NULL OR {rules.now_sql} - last_check_ms >= {rules.check_interval_ms})"
    )
    due = f"(age_ms > {immunity_sql(rules)} AND {interval_over})"
    decision = f"""CASE WHEN age_ms > {rules.reserved_ms} THEN '{Decision.EXPIRED}'
        WHEN {due} AND {counted} >= {rules.check_max} THEN '{Decision.MAX_CHECKS}'
        WHEN {due} THEN '{Decision.CHECK}'
        ELSE '{Decision.WAIT}' END"""
    flagged = _replaced(_replaced(pending, age_ms=age_sql(rules)), decision=decision)
    if rules.max_checks_per_run <= 0:
        return flagged
    chosen = select(
        select(flagged.where(f"decision = '{Decision.CHECK}'"), "half_offset", "store_ms")
        .orderBy("store_ms", "half_offset")
        .limit(rules.max_checks_per_run),
        "half_offset",
        "true AS _chosen",
    )
    return _replaced(
        flagged.join(chosen, "half_offset", "left"),
        decision=f"CASE WHEN decision = '{Decision.CHECK}' AND _chosen IS NULL "
        f"THEN '{Decision.WAIT}' ELSE decision END",
        _chosen=None,
    )


def due_at_ms(rules: Rules) -> Column:
    """Per pending row: the first now_ms at which `decide` would not say WAIT.

    The inverse of `decide`'s time rules — EXPIRED once now − store_ms >
    reserved; due once now − store_ms > the immunity and the check interval
    has passed since the last check. Its minimum over the next pending set
    lets a later run with no new input and the same rules know, without
    reading the pending set, that nothing is due yet.
    """
    return F.expr(due_at_sql(rules))


def due_at_sql(rules: Rules, last_check_ms: str = "last_check_ms") -> str:
    """SQL of `due_at_ms`, the last check's time given as SQL (a column, or
    `last_check_after_sql`)."""
    expires = f"store_ms + {rules.reserved_ms + 1}"
    interval_over = f"coalesce(({last_check_ms}) + {rules.check_interval_ms}, store_ms)"
    due = f"greatest(store_ms + {immunity_sql(rules)} + 1, {interval_over})"
    return f"CAST(least({expires}, {due}) AS BIGINT)"


def discards(decided: DataFrame, rules: Rules) -> DataFrame:
    rows = _replaced(
        decided.where(f"decision IN {sql_strings([Decision.EXPIRED, Decision.MAX_CHECKS])}"),
        check_times="checks_sent",
        reason="decision",
        discarded_ms=rules.now_sql,
        run_id=sql_string(rules.run_id),
    )
    return conform(rows, DISCARD)


def check_requests(decided: DataFrame, rules: Rules) -> DataFrame:
    """One request per message checked; request_id is stable across redos of the run."""
    rows = _replaced(
        decided.where(f"decision = '{Decision.CHECK}'"),
        request_id=f"concat({sql_string(rules.run_id + '-')}, CAST(half_offset AS STRING))",
        run_id=sql_string(rules.run_id),
        check_times="checks_sent + 1",
        requested_ms=rules.now_sql,
    )
    return conform(rows, CHECK_REQUESTS)


def last_check_after_sql(rules: Rules) -> str:
    """SQL: a decided row's last_check_ms once this run is done: now if it is checked."""
    return f"CASE WHEN decision = '{Decision.CHECK}' THEN {rules.now_sql} ELSE last_check_ms END"


def still_pending(decided: DataFrame, rules: Rules) -> DataFrame:
    """The CHECK and WAIT rows of `decided` as the next run will see them
    (a check counted), with whatever columns `decided` has."""
    return _replaced(
        decided.where(f"decision IN {sql_strings([Decision.CHECK, Decision.WAIT])}"),
        checks_sent=f"CASE WHEN decision = '{Decision.CHECK}' THEN checks_sent + 1 "
        "ELSE checks_sent END",
        last_check_ms=last_check_after_sql(rules),
        run_number=rules.run_number_sql,
    )


def next_pending(decided: DataFrame, rules: Rules) -> DataFrame:
    return conform(still_pending(decided, rules), PENDING)
