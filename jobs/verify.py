"""`verify`: the full audit of I2, I3 and I6 (docs/protocol.md §5), recomputed from the raw tables.

It trusts none of the job's incremental state: it reads the whole history of
`_sys/half` and `_sys/op` with their commit versions, recomputes every half
message's fate by a full anti-join, with rules of its own (not
`jobs.transforms`), and compares it with every table the job wrote. Only rows
up to the input versions of the last committed run (`_sys/runs`) are judged;
newer ones are legitimately not handled yet. `_sys/runs` also dates every OP
and discard, which is what "an OP arriving after the discard" means
(docs/protocol.md §4, rule 3). A plain message (`message_type` NORMAL) is
committed by its own half row, dated by the run whose half versions hold
it, whatever OP names it. Discards depend on the clock and on check
answers, so each is checked against the rule it names, not recomputed. The
rules: `_judged_ops`, `_winners`, `_expected`; docs/operating.md, "verify: the audit".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from jobs import appends, inputs, interpreted, job_tables
from jobs.held import Held
from jobs.interpreted import SMALL_AUDIT, interpreted_if_small
from jobs.jvm_calls import select_expr
from jobs.local import local_frame
from jobs.session import strict_reads, use_warehouse
from jobs.tagged_writes import TABLES_OPENED_AT_ONCE
from jobs.transforms import sql_string, sql_strings
from schemas import HALF, OP, TOPIC, TableSchema, table_path, topic_of_directory, topic_path
from schemas.spark import spark_schema
from schemas.tables import (
    CANCELLED,
    CHECK_REQUESTS,
    DISCARD,
    MESSAGE_COLUMNS,
    PENDING,
    QUEUES,
    REJECTED,
    RESOLVED,
    RUNS,
    TOPIC_DIRECTORY_ESCAPES,
)
from txn_core.config import as_config
from txn_core.delta_log import open_table
from txn_core.storage import options_for
from txn_core.vocabulary import (
    CANCEL,
    SYSTEM_TOPIC_REGEX,
    TOPIC_PATTERN,
    Action,
    Decision,
    MessageType,
    RunStatus,
    Source,
)

# RocketMQ's topic rule and system names (docs/protocol.md §3.1, item 8): a half row breaking
# them did not come from the broker core and is set aside by the job.
# The message's content as the half row has it; a topic, pending or discard row
# must carry it unchanged (I3).
CONTENT = tuple(c for c in MESSAGE_COLUMNS if c != "topic")
MAX_LISTED = 1000

DELIVERED, ROLLED_BACK, DISCARDED, PENDING_FATE, REJECTED_FATE = (
    "DELIVERED",
    "ROLLED_BACK",
    "DISCARDED",
    "PENDING",
    "REJECTED",
)
#: a delayed plain message no committed run's watermark has reached yet
SCHEDULED_FATE = "SCHEDULED"
#: a delayed message committed (or plain) whose delivery a recorded cancel withdrew
CANCELLED_FATE = "CANCELLED"


@dataclass
class VerifyReport:
    """The audit's outcome: `.ok` is True when nothing differs."""

    ok: bool
    differences: list[dict[str, Any]]
    counts: dict[str, Any]
    differences_by_kind: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    judged_run: dict[str, Any] | None = None

    @property
    def total_differences(self) -> int:
        return sum(self.differences_by_kind.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "counts": self.counts,
            "differences_by_kind": self.differences_by_kind,
            "total_differences": self.total_differences,
            "differences": self.differences,
            "notes": self.notes,
            "judged_run": self.judged_run,
        }

    def render(self) -> str:
        lines = [f"verify: {'OK' if self.ok else 'FAILED'}"]
        if self.judged_run:
            r = self.judged_run
            lines.append(
                f"judged up to run {r['run_number']} ({r['run_id']}): "
                f"_sys/half version {r['half_version']}, "
                f"_sys/op version {r['op_version']}"
            )
        else:
            lines.append("no committed run yet: nothing is judged, outputs must be empty")
        lines.append("counts: " + ", ".join(f"{k}={v}" for k, v in self.counts.items()))
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.differences_by_kind:
            lines.append(f"{self.total_differences} difference(s):")
            for kind, n in sorted(self.differences_by_kind.items()):
                lines.append(f"  {kind}: {n}")
            lines.append("first differences:")
            for d in self.differences:
                who = f"half_offset={d['half_offset']}" if d["half_offset"] is not None else ""
                if d.get("transaction_id"):
                    who += f" transaction_id={d['transaction_id']}"
                lines.append(
                    f"  [{d['kind']}] {d['table'] or ''} {who.strip()}: "
                    f"expected {d['expected']}; found {d['found']}"
                )
            if len(self.differences) < self.total_differences:
                lines.append(f"  ... {self.total_differences - len(self.differences)} more")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


# --- reading -----------------------------------------------------------------


def _read(
    spark: SparkSession, path: str, table: TableSchema, version: int | None = None
) -> DataFrame:
    """The table at `version` (None: its latest), empty when there is none.

    Read as the job reads its state (`inputs.read_snapshot`): the parquet
    files of that snapshot where the log allows. Delta's reader prepares
    each of its scans while a query is optimised, and the audit's
    comparisons hold a dozen of them (docs/performance.md)."""
    if not job_tables.is_delta(path) or (version is not None and version < 0):
        return _digested(local_frame(spark, [], spark_schema(table)))
    at = job_tables.latest_version(path) if version is None else version
    return _digested(inputs.read_snapshot(spark, path, table, at))


def _digested(df: DataFrame) -> DataFrame:
    """`df` with each message body as its length and SHA-256 digest ("2048
    bytes, sha256 9f86..."): the audit only compares bodies, and a
    warehouse's bodies, kept whole several times over, outgrow the driver."""
    if "body" not in df.columns:
        return df
    return df.withColumn(
        "body",
        F.concat(F.length("body").cast("string"), F.lit(" bytes, sha256 "), F.sha2("body", 256)),
    )


def _with_versions(
    spark: SparkSession, path: str, table: TableSchema, upto: int, notes: list[str]
) -> DataFrame:
    """Every row inserted up to version `upto`, with its `cv` (commit version)
    and `dated` (whether `cv` is known).

    The rows come as the job reads new rows (`inputs.added_rows`): the
    appended files read as parquet where the commits allow, else the change
    data feed, whose row-by-row reader costs several times as much.

    When the log no longer reaches back to version 0 (producer log retention,
    or the producers trimming it behind the job's cursor), the commit version
    of older rows is lost: they are dated version 0 (read by the first run)
    with `dated` false. Their relative commit order then cannot be recomputed;
    where it matters (which of two such OPs won, queue order among such
    messages, the winner's version) the audit takes the job's record, and
    checks everything else; "late after a discard" between two such rows
    stays approximate (both count as read by the first run). The report says so.
    """
    if upto < 0 or not job_tables.is_delta(path):
        return (
            inputs.empty(spark, table)
            .withColumn("cv", F.lit(None).cast("bigint"))
            .withColumn("dated", F.lit(True))
        )
    try:
        return (
            inputs.added_rows(spark, path, table, -1, upto)
            .withColumnRenamed("commit_version", "cv")
            .withColumn("dated", F.lit(True))
        )
    except inputs.HistoryGoneError:
        pass  # the log no longer holds version 0
    notes.append(
        f"{path}: the log no longer holds version 0; rows older than the "
        f"log are dated 0 (read by the first run), and their commit order is "
        f"taken from the job's records"
    )
    snap = spark.read.format("delta").option("versionAsOf", upto).load(path)
    known = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").agg(F.min("version")).first()[0]
    dated = inputs.added_rows(spark, path, table, known, upto).select(
        *[F.col(c) for c in snap.columns], F.col("commit_version").alias("cv")
    )
    old = snap.join(dated.select(*snap.columns[:1]), snap.columns[:1], "left_anti")
    return (
        old.withColumn("cv", F.lit(0).cast("bigint"))
        .withColumn("dated", F.lit(False))
        .unionByName(dated.withColumn("dated", F.lit(True)))
    )


def _newer_rows(spark: SparkSession, path: str, judged_rows: int) -> int:
    """Rows added after the judged version (halves the job has legitimately not read)."""
    if not job_tables.is_delta(path):
        return 0
    rows = _rows_in(path)
    if rows is None:  # no statistics, or deletion vectors: Spark counts the rows
        rows = spark.read.format("delta").load(path).count()
    return max(rows - judged_rows, 0)


def _topics(spark: SparkSession, warehouse: str) -> list[str]:
    """Topic tables present under `<warehouse>/topics/` (local paths and URIs alike)."""
    jvm = spark.sparkContext._jvm
    root = jvm.org.apache.hadoop.fs.Path(warehouse.rstrip("/") + "/topics")
    fs = root.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if not fs.exists(root):
        return []
    names = (s.getPath().getName() for s in fs.listStatus(root) if s.isDirectory())
    return sorted(topic_of_directory(name) for name in names)


#: what the audit reads of each run record
RUN_COLUMNS = (
    "run_id",
    "run_number",
    "status",
    "now_ms",
    "half_version",
    "op_version",
    "rules_json",
    "state_versions",
)


def _committed_runs(warehouse: str):
    """(committed runs in order, the incomplete run after them or None)."""
    path = table_path(warehouse, RUNS)
    if not job_tables.is_delta(path):
        return [], None
    # delta-rs: Spark's Delta reader cost more to plan its scan than these rows to read.
    table = open_table(path, storage_options=options_for(path))
    rows = table.to_pyarrow_table(columns=list(RUN_COLUMNS)).to_pylist(maps_as_pydicts="strict")
    by_number: dict[int, dict] = {}
    for row in rows:
        seen = by_number.get(row["run_number"])
        if seen is None or row["status"] == RunStatus.COMMITTED:
            by_number[row["run_number"]] = row
    committed = [
        by_number[n] for n in sorted(by_number) if by_number[n]["status"] == RunStatus.COMMITTED
    ]
    last = max(by_number) if by_number else None
    incomplete = (
        by_number[last]
        if last is not None and by_number[last]["status"] != RunStatus.COMMITTED
        else None
    )
    return committed, incomplete


def _rules(run: dict) -> dict:
    try:
        return json.loads(run.get("rules_json") or "{}")
    except ValueError:
        return {}


# --- helpers ---------------------------------------------------------------
# The comparisons are SQL text, each table's checks in one select: built
# with `F`, every column, literal and cast is a call into the JVM, and those
# calls were most of a small audit's driver time (docs/performance.md).


def _canon(col: str, name: str) -> str:
    """A comparable form of a column: maps become sorted entry arrays
    (Spark cannot compare maps), everything else stays as it is."""
    if name == "properties":
        return f"array_sort(map_entries(`{col}`))"
    return f"`{col}`"


def _show(col: str, name: str) -> str:
    if name == "properties":
        return f"to_json(`{col}`)"
    return f"CAST(`{col}` AS STRING)"


def _check(
    when: str, kind: str, table: str, expected: str, found: str, transaction_id="transaction_id"
) -> str:
    """One difference, as a struct, for the rows where `when` holds (null
    elsewhere). `table`, `expected` and `found` are SQL expressions of strings."""
    return (
        f"CASE WHEN {when} THEN named_struct('kind', {sql_string(kind)}, 'table', {table}, "
        f"'half_offset', CAST(half_offset AS BIGINT), "
        f"'transaction_id', CAST({transaction_id} AS STRING), "
        f"'expected', {expected}, 'found', {found}) END"
    )


def _differences(df: DataFrame, *checks: str) -> DataFrame:
    """The differences `checks` find in the rows of `df`: several checks
    over one join, so that each table is joined with the expectation once."""
    found = f"explode(array_compact(array({', '.join(checks)}))) AS d"
    return select_expr(df, [found]).select("d.*")


def _diff(df: DataFrame, kind: str, table: str, expected: str, found: str) -> DataFrame:
    return _differences(df, _check("true", kind, table, expected, found))


def _found(rows: DataFrame) -> DataFrame:
    """A table's rows, every column but half_offset prefixed `f_`, to sit beside
    the expected message after a join (`f_row` is null where there is none)."""
    return select_expr(
        rows,
        [
            "half_offset",
            "true AS f_row",
            *[f"`{c}` AS `f_{c}`" for c in rows.columns if c != "half_offset"],
        ],
    )


def _content_check(when: str, table: str, columns=CONTENT) -> str:
    """The row (`f_` columns) does not carry its message's content unchanged;
    names the columns that differ, with both values."""
    differs = {c: f"NOT ({_canon(c, c)} <=> {_canon(f'f_{c}', c)})" for c in columns}

    def describe(prefix: str) -> str:
        # concat_ws skips the nulls: the columns that are equal
        shown = (
            f"CASE WHEN {differs[c]} THEN "
            f"concat('{c}=', coalesce({_show(prefix + c, c)}, 'null')) END"
            for c in columns
        )
        return f"concat_ws('; ', {', '.join(shown)})"

    any_differs = " OR ".join(differs.values())
    return _check(
        f"({when}) AND ({any_differs})", "content_mismatch", table, describe(""), describe("f_")
    )


def _op_text(action: str, source: str, op_offset: str, version: str) -> str:
    """An OP as a difference shows it: "COMMIT PRODUCER op_offset 7 version 3"."""
    return (
        f"concat_ws(' ', {action}, {source}, 'op_offset', CAST({op_offset} AS STRING), "
        f"'version', CAST({version} AS STRING))"
    )


def _duplicates(rows: DataFrame, kind: str, table: str) -> DataFrame:
    per_msg = rows.groupBy("half_offset").agg(
        F.count("*").alias("n"), F.first("transaction_id").alias("transaction_id")
    )
    return _diff(
        per_msg.where("n > 1"),
        kind,
        sql_string(table),
        "'1 row'",
        "concat(CAST(n AS STRING), ' rows')",
    )


def _fate_text() -> str:
    return "concat('no row (message ', coalesce(fate, 'not judged or unknown'), ')')"


def _is(*fates: str) -> str:
    return f"coalesce(fate IN {sql_strings(fates)}, false)"


# --- the audit of each output table ------------------------------------------
# `expected` holds every judged message once, with its recomputed fate, its
# content, its winning OP (`w_*`) and, if delivered, its queue offset. Each
# table is joined with it once, on half_offset, and every rule of that table
# is a check over the joined rows.


def _topic_differences(delivered_rows: DataFrame, expected: DataFrame) -> list[DataFrame]:
    """Real topics (I3): exactly one row per delivered message, nowhere else,
    with its content, commit order and commit time; queues dense from 0."""
    t = expected.join(_found(delivered_rows), "half_offset", "full")
    row, delivered = "f_row IS NOT NULL", _is(DELIVERED)
    found_in = "concat('topics/', f_found_topic)"
    both = f"{row} AND {delivered}"
    # Dense from 0 without duplicates, whatever the expectation says.
    q = Window.partitionBy("found_topic", "queue_id").orderBy("queue_offset", "half_offset")
    dense = delivered_rows.withColumn("_rank", F.row_number().over(q) - 1)
    return [
        _differences(
            t,
            _check(
                f"{delivered} AND NOT ({row})",
                "missing_delivery",
                "concat('topics/', topic)",
                "'1 row'",
                "'none'",
            ),
            _check(
                f"{row} AND {_is(CANCELLED_FATE)}",
                "delivered_cancelled",
                found_in,
                "'no row (delivery cancelled)'",
                "'a delivered row'",
                transaction_id="f_transaction_id",
            ),
            _check(
                f"{row} AND NOT {delivered} AND NOT {_is(CANCELLED_FATE)}",
                "unexpected_delivery",
                found_in,
                _fate_text(),
                "'a delivered row'",
                transaction_id="f_transaction_id",
            ),
            _content_check(both, "'topics'"),
            *[
                _check(
                    f"{both} AND ({found} != {wanted})",
                    kind,
                    found_in,
                    f"CAST({wanted} AS STRING)",
                    f"CAST({found} AS STRING)",
                    transaction_id="f_transaction_id",
                )
                for kind, wanted, found in (
                    ("wrong_topic", "topic", "f_found_topic"),
                    ("queue_offset_order", "exp_queue_offset", "f_queue_offset"),
                    ("commit_ms_mismatch", "w_store_ms", "f_commit_ms"),
                )
            ],
        ),
        _differences(
            t,
            _check(
                f"{both} AND (f_delivered_ms < w_due)",
                "delivered_early",
                found_in,
                "concat('at or after ', CAST(w_due AS STRING))",
                "CAST(f_delivered_ms AS STRING)",
                transaction_id="f_transaction_id",
            ),
        ),
        _duplicates(delivered_rows, "duplicate_delivery", "topics"),
        _diff(
            dense.where("queue_offset != _rank"),
            "queue_offset_not_dense",
            "concat('topics/', found_topic, ' queue ', CAST(queue_id AS STRING))",
            "CAST(_rank AS STRING)",
            "CAST(queue_offset AS STRING)",
        ),
    ]


def _pending_differences(pending: DataFrame, expected: DataFrame) -> list[DataFrame]:
    """Pending: exactly the undecided, undiscarded judged halves, unchanged."""
    p = expected.join(_found(pending), "half_offset", "full")
    row, waiting = "f_row IS NOT NULL", _is(PENDING_FATE)
    table = sql_string(PENDING.path)
    return [
        _differences(
            p,
            _check(
                f"{waiting} AND NOT ({row})", "missing_pending", table, "'a pending row'", "'none'"
            ),
            _check(
                f"{row} AND NOT {waiting}",
                "unexpected_pending",
                table,
                _fate_text(),
                "'a pending row'",
                transaction_id="f_transaction_id",
            ),
            _content_check(
                f"{row} AND {waiting}", table, CONTENT + ("store_ms", "check_immunity_s")
            ),
        ),
        _duplicates(pending, "duplicate_pending", PENDING.path),
    ]


def _resolved_differences(resolved: DataFrame, expected: DataFrame) -> list[DataFrame]:
    """The job's incremental state: one resolved row per decided message, as recomputed."""
    r = expected.join(_found(resolved), "half_offset", "full")
    # a transactional message committed and scheduled is decided already
    # (as is one whose delivery was cancelled)
    transactional = "NOT coalesce(plain, true)"
    scheduled_commit = f"({_is(SCHEDULED_FATE, CANCELLED_FATE)} AND {transactional})"
    row = "f_row IS NOT NULL"
    decided = f"({_is(DELIVERED, ROLLED_BACK)} OR {scheduled_commit})"
    differs = (
        "((f_action != w_action) OR (f_op_offset != w_op_offset) OR (f_source != w_source)"
        " OR ((f_op_version != w_cv) AND w_dated))"
    )
    table = sql_string(RESOLVED.path)
    return [
        _differences(
            r,
            _check(
                f"{decided} AND NOT ({row})",
                "missing_resolved",
                table,
                "concat(w_action, ' by op_offset ', CAST(w_op_offset AS STRING))",
                "'none'",
            ),
            _check(
                f"{row} AND NOT {decided}",
                "unexpected_resolved",
                table,
                "'no row'",
                "concat(f_action, ' by op_offset ', CAST(f_op_offset AS STRING))",
                transaction_id="f_transaction_id",
            ),
            _check(
                f"{row} AND {decided} AND {differs}",
                "resolved_mismatch",
                table,
                _op_text("w_action", "w_source", "w_op_offset", "w_cv"),
                _op_text("f_action", "f_source", "f_op_offset", "f_op_version"),
            ),
        ),
        _duplicates(resolved, "duplicate_resolved", RESOLVED.path),
    ]


def _discard_differences(
    discard_dated: DataFrame, per_half_discard: DataFrame, expected: DataFrame, requests: DataFrame
) -> list[DataFrame]:
    """Discards: by committed runs, at most one per message, only of undecided
    messages, each following the rule it names at the clock of its run
    (EXPIRED: older than reserved_hours; MAX_CHECKS: as many checks as
    check_max), and carrying its message unchanged."""
    unknown_run = "run_number IS NULL"
    n_requests = requests.groupBy("half_offset").agg(F.count("*").alias("n_requests"))
    d = (
        _found(discard_dated.where(f"NOT ({unknown_run})"))
        .join(expected.withColumn("e_row", F.lit(True)), "half_offset", "left")
        .join(n_requests, "half_offset", "left")
    )
    judged = "e_row IS NOT NULL"
    age = "greatest(f_run_now_ms - store_ms, 0)"
    requests_n = "coalesce(n_requests, 0)"
    bad_expired = (
        f"(f_reason = {sql_string(Decision.EXPIRED)} AND f_reserved_ms IS NOT NULL"
        f" AND {age} <= f_reserved_ms)"
    )
    bad_max = (
        f"(f_reason = {sql_string(Decision.MAX_CHECKS)} AND f_check_max IS NOT NULL AND ("
        f"f_check_times != {requests_n}"
        f" OR (f_check_budget = 'sent' AND f_check_times != f_check_max)"
        f" OR f_check_times < f_check_max))"
    )
    bad_reason = f"NOT (f_reason IN {sql_strings((Decision.EXPIRED, Decision.MAX_CHECKS))})"
    table = sql_string(DISCARD.path)
    return [
        _diff(
            discard_dated.where(unknown_run),
            "discard_by_unknown_run",
            table,
            "'run_id of a committed run'",
            "run_id",
        ),
        _diff(
            per_half_discard.where("n_discards > 1").withColumnRenamed("d_txn", "transaction_id"),
            "duplicate_discard",
            table,
            "'at most 1 discard row'",
            "concat(CAST(n_discards AS STRING), ' rows')",
        ),
        # A discard the run could not have made: the message was already decided.
        _diff(
            expected.where("w_before_discard OR ((bad_half OR plain) AND n_discards > 0)"),
            "discard_of_decided_message",
            table,
            "concat('no discard; decided by op_offset ', "
            "coalesce(CAST(w_op_offset AS STRING), '(rejected half)'))",
            "'a discard row'",
        ),
        _differences(
            d,
            _check(
                f"NOT ({judged})",
                "discard_without_half",
                table,
                "'a judged half row'",
                "'none'",
                transaction_id="f_transaction_id",
            ),
            _check(
                f"{judged} AND ({bad_expired} OR {bad_max} OR {bad_reason})",
                "discard_rule_violated",
                table,
                "concat('EXPIRED: age > ', CAST(f_reserved_ms AS STRING), "
                "' ms; MAX_CHECKS: check_times = requests >= check_max = ', "
                "CAST(f_check_max AS STRING))",
                f"concat(f_reason, ' age=', CAST({age} AS STRING), "
                f"' check_times=', CAST(f_check_times AS STRING), "
                f"' requests=', CAST({requests_n} AS STRING))",
                transaction_id="f_transaction_id",
            ),
            _content_check(judged, table, CONTENT + ("store_ms", "check_immunity_s")),
        ),
    ]


def _queue_differences(expected: DataFrame, queues: DataFrame) -> list[DataFrame]:
    """Next queue offsets carried by the job continue exactly after the last
    row, in one row a queue (two rows would hide each other in the join)."""
    rows_per_queue = (
        expected.where(_is(DELIVERED))
        .groupBy("topic", "queue_id")
        .agg(F.count("*").alias("n_expected"))
    )
    carried = queues.groupBy("topic", "queue_id").agg(
        F.count("*").alias("n_rows"), F.max("next_queue_offset").alias("next_queue_offset")
    )
    qj = rows_per_queue.join(carried, ["topic", "queue_id"], "full_outer")
    n_expected = "coalesce(n_expected, 0)"
    queue = f"concat({sql_string(QUEUES.path + ' ')}, topic, ' queue ', CAST(queue_id AS STRING))"

    def of_queues(df: DataFrame) -> DataFrame:
        return select_expr(df, ["*", "NULL AS half_offset", "NULL AS transaction_id"])

    return [
        _diff(
            of_queues(qj.where(f"NOT ({n_expected} <=> coalesce(next_queue_offset, 0))")),
            "queue_state_mismatch",
            queue,
            f"CAST({n_expected} AS STRING)",
            "CAST(next_queue_offset AS STRING)",
        ),
        _diff(
            of_queues(carried.where("n_rows > 1")),
            "duplicate_queue",
            queue,
            "'1 row'",
            "concat(CAST(n_rows AS STRING), ' rows')",
        ),
    ]


def _rejected_differences(
    expected: DataFrame, ops: DataFrame, rejected: DataFrame, cancelled: DataFrame
) -> list[DataFrame]:
    """Rejected halves are recorded as such, and so is every OP never applied
    (invalid, or late after a discard: I6), and no other; a CANCEL OP is
    accounted for by its cancel row, or another of its message's (a
    duplicate), or a rejected row."""
    rej_halves = (
        rejected.where(F.col("source_table") == HALF.path)
        .select(F.col("row_offset").alias("half_offset"))
        .distinct()
    )
    rej_ops = (
        rejected.where(F.col("source_table") == OP.path)
        .select(F.col("row_offset").alias("op_offset"), F.lit(True).alias("recorded"))
        .distinct()
    )
    by_half = cancelled.select("half_offset", F.lit(True).alias("c_half"))
    o = ops.join(rej_ops, "op_offset", "left").join(by_half, "half_offset", "left")
    is_cancel = f"coalesce(action = {sql_string(CANCEL)}, false)"
    recorded = f"(recorded IS NOT NULL OR ({is_cancel} AND c_half IS NOT NULL))"
    applied = "(valid AND NOT late)"
    table = sql_string(REJECTED.path)
    return [
        _diff(
            expected.where(_is(REJECTED_FATE)).join(rej_halves, "half_offset", "left_anti"),
            "missing_rejected",
            table,
            "'a rejected row'",
            "'none'",
        ),
        _differences(
            o,
            _check(
                f"NOT {applied} AND NOT {recorded}",
                "unrecorded_rejected_op",
                table,
                "concat('a rejected row for op_offset ', CAST(op_offset AS STRING))",
                "'none'",
            ),
            _check(
                f"{applied} AND {recorded}",
                "valid_op_rejected",
                table,
                "concat('op_offset ', CAST(op_offset AS STRING), ' valid')",
                "'recorded as rejected'",
            ),
        ),
    ]


def _raw_duplicates(half: DataFrame, op: DataFrame) -> list[DataFrame]:
    """I1: offsets unique in the raw tables."""
    dup_op = (
        op.groupBy("op_offset")
        .agg(
            F.count("*").alias("n"),
            F.first("transaction_id").alias("transaction_id"),
            F.first("half_offset").alias("half_offset"),
        )
        .where("n > 1")
    )
    return [
        _duplicates(half, "duplicate_half_offset", HALF.path),
        _diff(
            dup_op,
            "duplicate_op_offset",
            sql_string(OP.path),
            "'1 row per op_offset'",
            "concat(CAST(n AS STRING), ' rows with op_offset ', CAST(op_offset AS STRING))",
        ),
    ]


def _expected(
    judged: DataFrame,
    winners: DataFrame,
    per_half_discard: DataFrame,
    delivered_rows: DataFrame,
    cancelled: DataFrame,
) -> DataFrame:
    """Every judged half once, with its fate (delivered once on COMMIT, rolled
    back on ROLLBACK, discarded once: a discard row and no deciding OP,
    pending, or rejected: a half row the broker core would not have written)
    and, if delivered, the queue offset it should have: per (topic,
    queue_id), dense, in the winners' commit order (among winners older than
    the log, the job's queue order). Partitioned by half_offset, so that
    joining each table with it moves only that table's rows."""
    fate = (
        judged.join(winners, "half_offset", "left")
        .join(per_half_discard.select("half_offset", "n_discards"), "half_offset", "left")
        .join(cancelled.select("half_offset", F.lit(True).alias("cancel")), "half_offset", "left")
        .withColumn(
            "fate",
            F.when(F.col("bad_half"), F.lit(REJECTED_FATE))
            # a committed (or plain) delayed message with a valid cancel is never delivered
            .when(
                F.col("cancel").isNotNull()
                & F.col("due").isNotNull()
                & (F.col("w_action") == Action.COMMIT),
                F.lit(CANCELLED_FATE),
            )
            .when(F.coalesce(F.col("w_scheduled"), F.lit(False)), F.lit(SCHEDULED_FATE))
            .when(F.col("w_action") == Action.COMMIT, F.lit(DELIVERED))
            .when(F.col("w_action") == Action.ROLLBACK, F.lit(ROLLED_BACK))
            .when(F.col("n_discards") > 0, F.lit(DISCARDED))
            .otherwise(F.lit(PENDING_FATE)),
        )
    )
    found_at = delivered_rows.groupBy("half_offset").agg(F.min("queue_offset").alias("found_at"))
    delivered = F.col("fate") == DELIVERED
    queue = ("topic", "queue_id", delivered)
    # Each run's deliveries follow the previous run's; within a run each kind
    # (COMMIT OPs, plain messages) keeps its commit order, and the two are
    # merged by the latest (commit time, offset) of the kind so far
    # (docs/protocol.md §4.3). With one kind, that is its commit order.
    # A delayed message (`w_due`) is a third kind, in the order of its due
    # time, placed at it.
    own = (
        Window.partitionBy(*queue, "w_run", "w_kind")
        .orderBy("_order", "undated_at", "_tie")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    qorder = Window.partitionBy(*queue).orderBy(
        "w_run", "_at", "w_kind", "_order", "undated_at", "_tie"
    )
    return (
        fate.join(found_at, "half_offset", "left")
        .withColumn("undated_at", F.when(~F.col("w_dated"), F.col("found_at")))
        .withColumn("_order", F.coalesce("w_due", "w_cv"))
        # delayed messages due at one time go by half_offset, whatever their kind
        .withColumn(
            "_tie",
            F.when(F.col("w_due").isNotNull(), F.col("half_offset")).otherwise(
                F.col("w_op_offset")
            ),
        )
        .withColumn("_at", F.max(F.struct(F.coalesce("w_due", "w_store_ms"), "_tie")).over(own))
        .withColumn("exp_queue_offset", F.when(delivered, F.row_number().over(qorder) - 1))
        .drop("found_at", "undated_at", "_at", "_order", "_tie")
        .repartition("half_offset")
    )


# --- the audit ----------------------------------------------------------------


@dataclass
class _Scope:
    """What verify judges: the committed runs, and the unfinished one whose
    outputs it ignores (its intent pins the state tables it read)."""

    committed: list[dict]
    incomplete: dict | None
    notes: list[str]

    @property
    def last(self) -> dict | None:
        return self.committed[-1] if self.committed else None

    @property
    def half_upto(self) -> int:
        return int(self.last["half_version"]) if self.last else -1

    @property
    def op_upto(self) -> int:
        return int(self.last["op_version"]) if self.last else -1

    @property
    def ignored_run(self) -> str | None:
        return self.incomplete["run_id"] if self.incomplete else None


def verify(spark: SparkSession, config) -> VerifyReport:
    """Recompute every half message's fate from `_sys/half` and `_sys/op` and
    compare it with the job's outputs and state. Reads only; writes nothing."""
    wh = use_warehouse(spark, as_config(config))
    held = Held()
    try:
        with strict_reads(spark), interpreted_if_small(spark, _raw_rows(wh), SMALL_AUDIT):
            return _audit(spark, wh, held.checkpoint)
    finally:
        held.release()


def small_audit_ahead(config) -> bool:
    """Whether `verify` of `config`'s warehouse will be a small audit
    (`SMALL_AUDIT`), judged from the Delta logs alone before any JVM starts:
    a process that runs one starts its JVM for a short life."""
    cfg = as_config(config)
    use_warehouse(None, cfg)
    rows = _raw_rows(cfg.warehouse)
    return rows is not None and rows <= interpreted.INTERPRETED_MAX_ROWS


def _raw_rows(wh: str) -> int | None:
    """The rows `_sys/half` and `_sys/op` hold, from their files' statistics
    (None when a file has none, or a log cannot be read: the audit itself
    then says what is wrong): what sizes the audit's every comparison."""
    total = 0
    for path in (table_path(wh, HALF), table_path(wh, OP)):
        if not job_tables.is_delta(path):
            continue
        try:
            rows = _rows_in(path)
        except Exception:  # noqa: BLE001 - a prediction, as `jobs.run.rows_ahead`
            return None
        if rows is None:
            return None
        total += rows
    return total


def _rows_in(path: str) -> int | None:
    """The rows of the Delta table at `path`, from its files' statistics
    (None when a file has none, or its files are not its rows as written:
    a deletion vector hides rows that its file's count still includes)."""
    table = open_table(path, storage_options=options_for(path))
    if not appends.plain_table(table):
        return None
    files = pa.table(table.get_add_actions(flatten=True))
    if "num_records" not in files.column_names or files["num_records"].null_count:
        return None
    return int(pc.sum(files["num_records"]).as_py() or 0)


def _audit(spark: SparkSession, wh: str, keep: Callable[[DataFrame], DataFrame]) -> VerifyReport:
    """`verify` in `wh`. `keep` computes a frame that several comparisons
    read once and cuts its plan there: a cached frame keeps its whole plan,
    which each comparison built on it would be analysed and run with again."""
    scope = _scope(wh)
    runs = _runs_frame(spark, scope.committed)
    half = keep(
        _digested(_with_versions(spark, table_path(wh, HALF), HALF, scope.half_upto, scope.notes))
    )
    op = keep(_with_versions(spark, table_path(wh, OP), OP, scope.op_upto, scope.notes))
    tables = _state_tables(spark, wh, scope)
    topic_names, delivered_rows = _delivered_rows(spark, wh, scope.ignored_run)
    delivered_rows = keep(delivered_rows)

    halves = keep(_halves(half))
    discard_dated, per_half_discard = _dated_discards(tables[DISCARD.path], runs)
    per_half_discard = keep(per_half_discard)
    ops = keep(_judged_ops(op, runs, halves, per_half_discard))
    op_winners = _with_delays(_winners(ops, tables[RESOLVED.path]), halves, runs)
    winners = keep(_with_plain(op_winners, halves, runs, tables[RESOLVED.path]))
    ops = keep(_ops_on_scheduled_plain(ops, winners, halves, runs))
    judged = halves.where(F.col("half_cv") <= F.lit(scope.half_upto))
    cancelled, cancel_diffs = _cancels(tables[CANCELLED.path], ops, halves, runs)
    cancelled = keep(cancelled)
    expected = keep(_expected(judged, winners, per_half_discard, delivered_rows, cancelled))

    all_diffs = keep(
        _union(
            [
                *_raw_duplicates(half, op),
                *_discard_differences(
                    discard_dated, per_half_discard, expected, tables[CHECK_REQUESTS.path]
                ),
                *_topic_differences(delivered_rows, expected),
                *_pending_differences(tables[PENDING.path], expected),
                *_resolved_differences(tables[RESOLVED.path], expected),
                *_queue_differences(expected, tables[QUEUES.path]),
                *_rejected_differences(expected, ops, tables[REJECTED.path], cancelled),
                *cancel_diffs,
            ]
        )
    )
    by_kind = {
        r["kind"]: r["n"] for r in all_diffs.groupBy("kind").agg(F.count("*").alias("n")).collect()
    }
    listed = [
        r.asDict()
        for r in all_diffs.orderBy(F.col("half_offset").asc_nulls_last(), "kind")
        .limit(MAX_LISTED)
        .collect()
    ]
    counts = _counts(
        expected,
        ops,
        scope,
        not_yet=_newer_rows(spark, table_path(wh, HALF), half.count()),
        topic_tables=len(topic_names),
    )
    last = scope.last
    judged_run = (
        None
        if last is None
        else {
            "run_id": last["run_id"],
            "run_number": last["run_number"],
            "half_version": scope.half_upto,
            "op_version": scope.op_upto,
        }
    )
    return VerifyReport(
        ok=not by_kind,
        differences=listed,
        counts=counts,
        differences_by_kind=by_kind,
        notes=scope.notes,
        judged_run=judged_run,
    )


def _scope(wh: str) -> _Scope:
    committed, incomplete = _committed_runs(wh)
    notes: list[str] = []
    if incomplete is not None:
        notes.append(
            f"run {incomplete['run_number']} ({incomplete['run_id']}) has not "
            f"committed: its outputs are not judged, the next run completes it"
        )
    return _Scope(committed, incomplete, notes)


def _runs_frame(spark: SparkSession, committed: list[dict]) -> DataFrame:
    """Each committed run with the intervals of OP versions (op_lo, op_hi]
    and half versions (half_lo, run_half_version] it read, to date OPs,
    plain messages and discards, and the rules it ran with."""
    rows, prev_op, prev_half, watermark = [], -1, -1, -1
    for r in committed:
        rules = _rules(r)
        # the latest clock so far (docs/protocol.md §4, "Delayed messages"),
        # recomputed from the runs' clocks, not taken from the job's record
        watermark = max(watermark, int(r["now_ms"]))
        rows.append(
            (
                r["run_id"],
                int(r["run_number"]),
                prev_op,
                int(r["op_version"]),
                prev_half,
                int(r["half_version"]),
                int(r["now_ms"]),
                rules.get("reserved_ms"),
                rules.get("check_max"),
                rules.get("check_budget"),
                watermark,
            )
        )
        prev_op, prev_half = int(r["op_version"]), int(r["half_version"])
    return spark.createDataFrame(
        rows,
        "run_id string, run_number bigint, op_lo bigint, "
        "op_hi bigint, half_lo bigint, run_half_version bigint, "
        "run_now_ms bigint, reserved_ms bigint, "
        "check_max bigint, check_budget string, run_watermark bigint",
    )


def _state_tables(spark: SparkSession, wh: str, scope: _Scope) -> dict[str, DataFrame]:
    """The job's state and output tables by path, without the rows of an
    unfinished run; with one, as its intent pinned them (the state the last
    committed run left)."""
    versions = dict(scope.incomplete.get("state_versions") or {}) if scope.incomplete else {}

    def pinned(table: TableSchema) -> DataFrame:
        df = _read(spark, table_path(wh, table), table, versions.get(table.path))
        if "run_id" in df.columns and scope.ignored_run is not None:
            df = df.where(F.col("run_id") != F.lit(scope.ignored_run))
        return df

    return {
        t.path: pinned(t)
        for t in (DISCARD, PENDING, RESOLVED, QUEUES, REJECTED, CHECK_REQUESTS, CANCELLED)
    }


def _delivered_rows(
    spark: SparkSession, wh: str, ignored_run: str | None
) -> tuple[list[str], DataFrame]:
    """The topics found, and every row of their tables with its `found_topic`.

    The tables whose files can be read as written are read in one scan (one
    for each depth of their files below the table's directory: on S3 a big
    run's files stay in a staging directory), each row's `found_topic`
    named by its table's directory; only the others are read one by one: a
    union of one read per table grows with the square of the topics, each
    step analysing the whole union again (docs/performance.md)."""
    topic_names = _topics(spark, wh)
    listed = _topic_files(wh, topic_names)
    by_depth: dict[int, list[str]] = {}
    for files in listed.values():
        for depth, path in files or []:
            by_depth.setdefault(depth, []).append(path)
    frames = [
        _digested(
            appends.read_parquet(spark, TOPIC, paths).withColumn(
                "found_topic", _topic_of_file(F.col("_metadata.file_path"), depth)
            )
        )
        for depth, paths in sorted(by_depth.items())
    ]
    for name, files in listed.items():
        if files is None:
            frames.append(
                _read(spark, topic_path(wh, name), TOPIC).withColumn("found_topic", F.lit(name))
            )
    if not frames:
        return topic_names, local_frame(spark, [], spark_schema(TOPIC)).withColumn(
            "found_topic", F.lit(None).cast("string")
        )
    delivered = _union(frames)
    if ignored_run is not None:
        delivered = delivered.where(F.col("run_id") != F.lit(ignored_run))
    return topic_names, delivered


def _topic_files(wh: str, topic_names: list[str]) -> dict[str, list[tuple[int, str]] | None]:
    """The data files of each topic's table at its latest version, by topic,
    each with its depth below the table's directory (0: in it); None for a
    table Delta's reader must read (`appends.snapshot_files`), or one with a
    file elsewhere. Topics without a table are left out."""
    from concurrent.futures import ThreadPoolExecutor

    def files(name: str) -> tuple[str, list[tuple[int, str]] | None] | None:
        path = topic_path(wh, name)
        version = job_tables.latest_version(path)
        if version == job_tables.NO_VERSION:
            return None
        found = appends.snapshot_files(path, version)
        inside = path.rstrip("/") + "/"
        if found is None or not all(f.startswith(inside) for f in found):
            return name, None
        return name, [(f[len(inside) :].count("/"), f) for f in found]

    # each is a read of a table's log: on an object store, round trips to overlap
    with ThreadPoolExecutor(TABLES_OPENED_AT_ONCE, thread_name_prefix="topic") as pool:
        return dict(found for found in pool.map(files, topic_names) if found is not None)


def _topic_of_file(file_path, depth: int) -> Any:
    """The topic whose table holds the file at `file_path`, `depth`
    directories below the table's (a URI: the table directory's name,
    `schemas.topic_directory`, holds no character a URI escapes)."""
    below = "(?:/[^/]+){" + str(depth + 1) + "}$"  # the file's name and directories
    topic = F.regexp_extract(file_path, "([^/]+)" + below, 1)
    for character, escape in reversed(TOPIC_DIRECTORY_ESCAPES):  # as `topic_of_directory`
        topic = F.replace(topic, F.lit(escape), F.lit(character))
    return topic


def _halves(half: DataFrame) -> DataFrame:
    """One row per half, `bad_half` when the broker core would not have
    written it, `plain` for a plain message (committed by its store)."""
    known_type = F.coalesce(F.col("message_type").isin(*MessageType), F.lit(True))
    return (
        half.dropDuplicates(["half_offset"])
        .withColumn(
            "bad_half",
            ~F.col("topic").rlike(TOPIC_PATTERN)
            | F.col("topic").rlike(SYSTEM_TOPIC_REGEX)
            | (F.col("queue_id") < 0)
            | ~known_type,
        )
        .withColumn("plain", F.coalesce(F.col("message_type") == MessageType.NORMAL, F.lit(False)))
        # a delayed message's due time (null: not delayed)
        .withColumn(
            "due", F.when(F.col("deliver_at_ms") > F.col("store_ms"), F.col("deliver_at_ms"))
        )
        .withColumnRenamed("cv", "half_cv")
    )


def _dated_discards(discard_all: DataFrame, runs: DataFrame) -> tuple[DataFrame, DataFrame]:
    """Discard rows with the run that wrote them (only committed runs date a
    discard), and per half: how many, and the OP version of the first."""
    dated = discard_all.join(
        F.broadcast(
            runs.select(
                "run_id",
                "run_number",
                F.col("op_hi").alias("d_op_version"),
                "run_now_ms",
                "reserved_ms",
                "check_max",
                "check_budget",
            )
        ),
        "run_id",
        "left",
    )
    per_half = (
        dated.where(F.col("run_number").isNotNull())
        .groupBy("half_offset")
        .agg(
            F.count("*").alias("n_discards"),
            F.min("d_op_version").alias("d_op_version"),
            F.first("transaction_id").alias("d_txn"),
        )
    )
    return dated, per_half


def _judged_ops(
    op: DataFrame, runs: DataFrame, halves: DataFrame, per_half_discard: DataFrame
) -> DataFrame:
    """Each OP dated by the run that read it (the run whose input range holds
    its version) and validated against its half: `valid` (a half with its
    half_offset was visible to that run, and transaction_id and
    producer_group match the half's), `late` (after its message's discard,
    and not ADMIN), `eligible`."""
    o = op.join(
        F.broadcast(runs.select("run_number", "op_lo", "op_hi", "run_half_version")),
        (op["cv"] > F.col("op_lo")) & (op["cv"] <= F.col("op_hi")),
        "left",
    )
    h = halves.select(
        "half_offset",
        F.col("transaction_id").alias("h_txn"),
        F.col("producer_group").alias("h_group"),
        "half_cv",
        "bad_half",
    )
    o = o.join(h, "half_offset", "left").join(
        per_half_discard.select("half_offset", "d_op_version"), "half_offset", "left"
    )
    valid = (
        F.col("h_txn").isNotNull()
        & (F.col("half_cv") <= F.col("run_half_version"))
        & ~F.col("bad_half")
        & (F.col("transaction_id") == F.col("h_txn"))
        & (F.col("producer_group") == F.col("h_group"))
        & F.col("action").isin(*Action)
        & F.col("source").isin(*Source)
    )
    late = (
        F.col("d_op_version").isNotNull()
        & (F.col("cv") > F.col("d_op_version"))
        & (F.col("source") != Source.ADMIN)
    )
    return (
        o.withColumn("valid", F.coalesce(valid, F.lit(False)))
        .withColumn("late", F.col("valid") & F.coalesce(late, F.lit(False)))
        .withColumn("eligible", F.col("valid") & ~F.col("late"))
    )


def _winners(ops: DataFrame, resolved: DataFrame) -> DataFrame:
    """The first eligible OP of each half in commit order (version, then
    op_offset); among OPs older than the log (undated), the job's recorded
    winner goes first."""
    job_pick = resolved.dropDuplicates(["half_offset", "op_offset"]).select(
        "half_offset", "op_offset", F.lit(0).alias("job_pick")
    )
    o = ops.join(job_pick, ["half_offset", "op_offset"], "left").withColumn(
        "job_pick", F.when(F.col("dated"), 1).otherwise(F.coalesce(F.col("job_pick"), F.lit(1)))
    )
    first = Window.partitionBy("half_offset").orderBy("cv", "job_pick", "op_offset")
    return (
        o.where("eligible")
        .withColumn("_n", F.row_number().over(first))
        .where("_n = 1")
        .select(
            "half_offset",
            F.col("op_offset").alias("w_op_offset"),
            F.col("action").alias("w_action"),
            F.col("source").alias("w_source"),
            F.col("cv").alias("w_cv"),
            F.col("dated").alias("w_dated"),
            F.col("run_number").alias("w_run"),
            F.lit(False).alias("w_plain"),
            F.lit(0).alias("w_kind"),
            F.lit(None).cast("bigint").alias("w_due"),
            F.lit(False).alias("w_scheduled"),
            F.col("store_ms").alias("w_store_ms"),
            F.col("d_op_version").isNotNull().alias("w_after_discard"),
            (F.col("d_op_version").isNotNull() & (F.col("cv") <= F.col("d_op_version"))).alias(
                "w_before_discard"
            ),
        )
    )


def _with_delays(op_winners: DataFrame, halves: DataFrame, runs: DataFrame) -> DataFrame:
    """`op_winners` (`_winners`) with the due time of each COMMIT of a
    delayed message committed before that time (`w_due`, kind 2: placed by
    it) and, as for a plain one (`_when_due`), the run that must deliver it;
    none yet: `w_scheduled`. An operator's COMMIT of a discarded message
    delivers it at once (docs/protocol.md §4.4)."""
    due = halves.select("half_offset", F.col("due").alias("_due"))
    delayed = (
        (F.col("w_action") == Action.COMMIT)
        & ~F.col("w_after_discard")
        & F.coalesce(F.col("_due") > F.col("w_store_ms"), F.lit(False))
    )
    w = (
        op_winners.join(due, "half_offset", "left")
        .withColumn("w_due", F.when(delayed, F.col("_due")))
        .withColumn("w_kind", F.when(delayed, 2).otherwise(0))
        .drop("_due")
    )
    return _when_due(w, runs)


def _ops_on_scheduled_plain(
    ops: DataFrame, winners: DataFrame, halves: DataFrame, runs: DataFrame
) -> DataFrame:
    """`ops` (`_judged_ops`) with the OPs naming a plain message that an
    earlier run scheduled and no run before theirs delivered made invalid:
    the job knows such a message only in its scheduled set, where it does
    not look OPs up (docs/protocol.md §3.1, "Plain messages and batches",
    item 7). Plain winners decide their messages whatever OP names them, so
    only the OPs' own outcome changes."""
    read_by = (
        halves.where(F.col("plain") & ~F.col("bad_half"))
        .join(
            F.broadcast(runs.select("run_number", "half_lo", "run_half_version")),
            (F.col("half_cv") > F.col("half_lo")) & (F.col("half_cv") <= F.col("run_half_version")),
        )
        .select("half_offset", F.col("run_number").alias("p_read"))
    )
    delivered_by = winners.where("w_plain").select(
        "half_offset", F.col("w_run").alias("p_delivered")
    )
    o = ops.join(read_by, "half_offset", "left").join(delivered_by, "half_offset", "left")
    unknown = (
        F.col("valid")
        & (F.col("run_number") > F.col("p_read"))
        & (F.col("p_delivered").isNull() | (F.col("run_number") <= F.col("p_delivered")))
    )
    unknown = F.coalesce(unknown, F.lit(False))
    return (
        o.withColumn("valid", F.col("valid") & ~unknown)
        .withColumn("late", F.col("late") & ~unknown)
        .withColumn("eligible", F.col("eligible") & ~unknown)
        .drop("p_read", "p_delivered")
    )


def _with_plain(
    op_winners: DataFrame, halves: DataFrame, runs: DataFrame, resolved: DataFrame
) -> DataFrame:
    """`op_winners` (`_winners`) with each plain message's own commit in
    place of any OP naming it: action COMMIT, source NORMAL, its half_offset,
    half version and store time standing for the OP's; `w_run` the run
    whose half versions hold it. A winner older than the log (undated) is
    dated by the job's record of its run (`_sys/resolved`), as its order is."""
    plain = (
        halves.where(F.col("plain") & ~F.col("bad_half"))
        .join(
            F.broadcast(runs.select("run_number", "half_lo", "run_half_version")),
            (F.col("half_cv") > F.col("half_lo")) & (F.col("half_cv") <= F.col("run_half_version")),
            "left",
        )
        .select(
            "half_offset",
            F.col("half_offset").alias("w_op_offset"),
            F.lit(Action.COMMIT.value).alias("w_action"),
            F.lit(MessageType.NORMAL.value).alias("w_source"),
            F.col("half_cv").alias("w_cv"),
            F.col("dated").alias("w_dated"),
            F.col("run_number").alias("w_run"),
            F.lit(True).alias("w_plain"),
            F.when(F.col("due").isNotNull(), 2).otherwise(1).alias("w_kind"),
            F.col("due").alias("w_due"),
            F.col("store_ms").alias("w_store_ms"),
            F.lit(False).alias("w_after_discard"),
            F.lit(False).alias("w_before_discard"),
        )
    )
    plain = _when_due(plain, runs)
    winners = op_winners.join(plain.select("half_offset"), "half_offset", "left_anti").unionByName(
        plain
    )
    job_run = (
        resolved.select("half_offset", "run_id")
        .join(F.broadcast(runs.select("run_id", "run_number")), "run_id")
        .groupBy("half_offset")
        .agg(F.min("run_number").alias("job_run"))
    )
    return (
        winners.join(job_run, "half_offset", "left")
        .withColumn("w_run", F.when(F.col("w_dated"), F.col("w_run")).otherwise(F.col("job_run")))
        .drop("job_run")
    )


def _when_due(plain: DataFrame, runs: DataFrame) -> DataFrame:
    """Plain winners (`_with_plain`) with the run that must deliver each
    delayed one: the first committed run, from the one that read it on,
    whose watermark reaches its due time (`w_run`); none yet: `w_scheduled`."""
    delayed = plain.where(F.col("w_due").isNotNull())
    runs_w = F.broadcast(runs.select("run_number", "run_watermark"))
    first = (
        delayed.join(
            runs_w,
            (F.col("run_number") >= F.col("w_run")) & (F.col("run_watermark") >= F.col("w_due")),
        )
        .groupBy("half_offset")
        .agg(F.min("run_number").alias("due_run"))
    )
    return (
        plain.join(first, "half_offset", "left")
        .withColumn("w_scheduled", F.col("w_due").isNotNull() & F.col("due_run").isNull())
        .withColumn(
            "w_run", F.when(F.col("w_due").isNotNull(), F.col("due_run")).otherwise(F.col("w_run"))
        )
        .drop("due_run")
    )


def _cancels(
    cancelled: DataFrame, ops: DataFrame, halves: DataFrame, runs: DataFrame
) -> tuple[DataFrame, list[DataFrame]]:
    """(the cancel rows of committed runs that a CANCEL OP justifies, the
    differences of the others). A cancel row is justified by its ADMIN
    CANCEL OP naming the message's own transaction and group, for the
    message's due time, recorded by a run whose watermark was before that
    time (docs/protocol.md §4, "Cancelling a delayed message")."""
    c = (
        cancelled.select(
            "half_offset", "transaction_id", "op_offset", F.col("due_ms").alias("c_due"), "run_id"
        )
        .join(F.broadcast(runs.select("run_id", "run_watermark")), "run_id", "left")
        .join(
            ops.where(F.col("action") == CANCEL).select(
                "op_offset",
                F.col("half_offset").alias("o_half"),
                F.col("source").alias("o_source"),
                F.col("transaction_id").alias("o_txn"),
                F.col("producer_group").alias("o_group"),
            ),
            "op_offset",
            "left",
        )
        .join(
            halves.select(
                "half_offset",
                F.col("due").alias("h_due"),
                F.col("transaction_id").alias("h_txn"),
                F.col("producer_group").alias("h_group"),
            ),
            "half_offset",
            "left",
        )
    )
    justified = (
        f"coalesce(o_half <=> half_offset AND o_source = {sql_string(Source.ADMIN)}"
        " AND o_txn = h_txn AND o_group = h_group AND c_due <=> h_due, false)"
    )
    in_time = "coalesce(c_due > run_watermark, false)"
    valid = c.where(f"{justified} AND {in_time} AND run_watermark IS NOT NULL")
    table = sql_string(CANCELLED.path)
    diffs = [
        _differences(
            c,
            _check(
                f"NOT {justified}",
                "cancel_without_op",
                table,
                "'an ADMIN CANCEL OP of the message, for its due time'",
                "concat('op_offset ', CAST(op_offset AS STRING))",
            ),
            _check(
                f"{justified} AND NOT {in_time}",
                "cancel_after_due",
                table,
                "concat('a run before ', CAST(c_due AS STRING))",
                "concat('recorded at watermark ', "
                "coalesce(CAST(run_watermark AS STRING), 'of no committed run'))",
            ),
        ),
        _duplicates(cancelled, "duplicate_cancel", CANCELLED.path),
    ]
    return valid.select("half_offset").distinct(), diffs


def _union(frames: list[DataFrame]) -> DataFrame:
    union = frames[0]
    for df in frames[1:]:
        union = union.unionByName(df)
    return union


def _counts(
    expected: DataFrame, ops: DataFrame, scope: _Scope, *, not_yet: int, topic_tables: int
) -> dict[str, int]:
    by_fate = expected.groupBy("fate").agg(
        F.count("*").alias("n"), F.sum(F.col("plain").cast("int")).alias("plain")
    )
    fates, plain = {}, 0
    for r in by_fate.collect():
        fates[r["fate"]] = r["n"]
        plain += (r["plain"] or 0) if r["fate"] == DELIVERED else 0
    op_stats = (
        ops.agg(
            F.count("*").alias("ops_judged"),
            F.sum(F.when(~F.col("valid") & (F.col("action") != CANCEL), 1).otherwise(0)).alias(
                "invalid_ops"
            ),
            F.sum(F.when(F.col("late"), 1).otherwise(0)).alias("late_ops"),
        )
        .first()
        .asDict()
    )
    return {
        "halves_judged": sum(fates.values()),
        "halves_not_yet_processed": not_yet,
        "delivered": fates.get(DELIVERED, 0),
        "plain": plain,
        "rolled_back": fates.get(ROLLED_BACK, 0),
        "discarded": fates.get(DISCARDED, 0),
        "pending": fates.get(PENDING_FATE, 0),
        "scheduled": fates.get(SCHEDULED_FATE, 0),
        "cancelled": fates.get(CANCELLED_FATE, 0),
        "rejected": fates.get(REJECTED_FATE, 0),
        "ops_judged": op_stats["ops_judged"],
        "invalid_ops": op_stats["invalid_ops"] or 0,
        "late_ops": op_stats["late_ops"] or 0,
        "topic_tables": topic_tables,
        "committed_runs": len(scope.committed),
    }
