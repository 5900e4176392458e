"""The computation of a run's outputs from its inputs: the rules of
`jobs.transforms` in order, each write started as soon as its rows are known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType

from jobs import appends, cancels, driver_writes, inputs, job_tables, run_log, scheduled
from jobs import transforms as T
from jobs.counters import Counters
from jobs.held import Held
from jobs.local import local_frame
from jobs.writes import RunWrites, start_deliveries
from schemas import CHECK_ANSWERS, HALF, OP, table_path
from schemas.tables import (
    CANCELLED,
    CHECK_REQUESTS,
    DISCARD,
    PENDING,
    QUEUES,
    REJECTED,
    RESOLVED,
    SCHEDULED,
    STORED_MESSAGE_COLUMNS,
)
from txn_core.vocabulary import Decision

#: above this many OPs for messages no longer pending, look them up by a join, not IN (...)
HISTORY_IN_LIST_MAX = 10_000


#: up to this many rows of the history (`_sys/resolved`, `_sys/discard`)
#: in the range of the run's OPs are read with the live messages
#: (`_history_near`); above, those the OPs need are looked up by key
HISTORY_NEAR_MAX_ROWS = 50_000


#: up to this many decided rows (~100 bytes each) are sent whole to every task
#: of a write to be joined with their messages (`T.with_bodies`), and up to
#: this many winning OPs to find the messages they leave undecided
#: (`T.remaining_pending`); above, both sides are shuffled, which moves every
#: message through a sort
BROADCAST_MAX_ROWS = 1_000_000

#: up to this many deliveries are counted (`T.queue_ends`) and placed in
#: their queues (`T.queue_positions`) by one task each: a count and a sort
#: of narrow rows a task does in a fraction of a second, where the shuffles
#: they save are Spark jobs of every run
POSITIONS_ONE_TASK_MAX_ROWS = 250_000


#: up to this many new OPs (their log entries' statistics) are ranked by one
#: task (`T.classify_ops`), as many as one task places (a sort of narrow
#: rows): their shuffle is a Spark job of its own, whose set-up costs more
#: than ranking a few thousand rows, and whose plan costs the driver and the
#: JIT more than one task's sort of a few hundred thousand
CLASSIFY_ONE_TASK_MAX_ROWS = POSITIONS_ONE_TASK_MAX_ROWS


#: when at most this many live messages (pending before, new half rows)
#: can be left undecided (`_undecided_at_most`), they are decided and
#: joined with their bodies in one pass and kept: as many as a run keeps
#: anyway when a table's write may collect them
#: (`driver_writes.MESSAGE_MAX_ROWS`), and a local checkpoint fewer
UNDELIVERED_ONE_PASS_MAX_ROWS = driver_writes.MESSAGE_MAX_ROWS


#: the driver's own small frames (`jobs.local`): history keys, each queue's last offset
_HALF_OFFSETS = StructType([StructField("half_offset", LongType(), False)])


_QUEUE_ENDS = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("queue_id", IntegerType(), False),
        StructField("queue_offset", LongType(), False),
    ]
)


@dataclass
class Outputs:
    """The run's output tables but the topics, `_sys/queues` and
    `_sys/resolved` (whose writes `compute` starts), each as a function
    building its DataFrame, and its counters. Built only for the tables a
    run writes: most runs check, discard and reject nothing, and each frame
    planned is time on a small run's driver."""

    requests: Callable[[], DataFrame]
    discards: Callable[[], DataFrame]
    rejected: Callable[[], DataFrame]
    pending: Callable[[], DataFrame]
    counts: dict = field(default_factory=dict)
    delivered_by_topic: dict = field(default_factory=dict)
    #: the bytes of the bodies of the messages not delivered, when counted
    undelivered_body_bytes: int | None = None


def compute(
    spark,
    wh: str,
    record: run_log.RunRecord,
    rules: T.Rules,
    held: Held,
    writes: RunWrites | None,
    *,
    small: bool = False,
) -> Outputs:
    """The run's outputs (`jobs.transforms`' docstring has the order).

    The rules run on the messages' keys; the keys, the classified OPs and
    the decisions on the undecided messages are each computed once and kept
    (`jobs.held`), and the counters are taken while they are
    (`jobs.counters`). Once the OPs are classified, the winners say all the
    writes of deliveries need: each queue's count (`T.queue_ends`: the
    topics to write, the next queues) and, placed in their queues, the rows
    the topics' write joins with their bodies (one pass, however many
    topics); a big run places them beside the count, and kept, while the
    driver plans the writes. The messages not delivered (pending, checked,
    discarded: few) are joined with their bodies by a pass of their own,
    kept when more than one table takes rows from it (reading the bodies
    twice is cheaper than keeping the delivered rows with them); when few
    can be left undecided, they are decided in that same pass. Each write
    starts as soon as its rows are known (`writes`) and runs beside the
    rest. No `writes` (a dry run): the counters only, the bodies are never
    read.

    Plain messages (half rows of type NORMAL, committed by their store)
    never enter the live set: when the run has any, their keys are kept
    apart, join the OP targets as already committed and the winners as
    COMMITs of their own, which `T.queue_positions` merges with the OPs'.

    `small`: the run reads a few thousand rows and the session runs with
    `jobs.interpreted`'s settings, which keep a join of two one-partition
    sides in one partition: its joins are then done by one task each, the
    smaller side in a hash table (`T.with_bodies(one_task=True)`), where
    sending it to every task first is a Spark job of its own.
    """
    writing = writes is not None
    paths = inputs.input_paths(wh)
    ops = inputs.added_rows(spark, paths["op"], OP, record.prev_op_version, record.op_version)
    half = inputs.added_rows(
        spark,
        paths["half"],
        HALF,
        record.prev_half_version,
        record.half_version,
        keep_slow=held.cache,
    )
    answers = inputs.added_rows(
        spark, paths["answers"], CHECK_ANSWERS, record.prev_answers_version, record.answers_version
    )
    pending_prev = inputs.read_state(spark, wh, record.state_versions, PENDING)
    queues = inputs.read_state(spark, wh, record.state_versions, QUEUES)

    counted = Counters()
    checked = T.with_reject_reason(half)
    _, rejected_halves = T.split_halves(checked, rules)
    # a small run's bodies are counted in its first pass: a bound on what
    # its deliveries carry, for the driver to collect them at once
    bodies = small and writing
    accepted, _ = T.split_halves(counted.halves(checked, bodies), rules)
    transactional, _ = T.split_kinds(accepted)
    live = held.checkpoint(
        T.message_keys(T.live_messages(counted.pending(pending_prev, bodies), transactional, rules))
    )
    # the messages again, for the bodies of those decided, without the
    # observations (counted once) or the checks: a rejected half has no fate
    messages = T.live_messages(pending_prev, half, rules)
    plain = _plain_keys(checked, rules, held) if counted.values()["plain"] else None
    later = _scheduling(plain, rules)
    prior = cancels.prior_cancels(spark, wh, record.state_versions)
    due = due_keys = None
    if rules.scheduled_before:
        # delayed messages due in (the previous watermark, this run's]: their keys
        due = T.due_scheduled(
            inputs.read_scheduled(
                spark, wh, record.state_versions, rules.prev_watermark_ms, rules.watermark_ms
            ),
            rules,
        )
        due_keys = T.scheduled_winners(due)
        if prior is not None:  # cancelled before: leave the set now, undelivered
            dropped = T.select(cancels.prior_cancels_due(prior, rules), "*", "true AS _cancelled")
            due_keys = due_keys.join(F.broadcast(dropped), "half_offset", "left")
        due_keys = held.checkpoint(counted.due(due_keys))
    n_due_rows, n_due, n_due_resolved = _due_counts(counted, due_keys)
    if due_keys is not None and "_cancelled" in due_keys.columns:
        due_keys = due_keys.where("_cancelled IS NULL").drop("_cancelled")
    later["delivered_scheduled"] = n_due
    targets = T.op_targets(live)
    if plain is not None:  # an OP naming a plain message of this run: a duplicate or a conflict
        targets = targets.unionByName(T.plain_targets(plain))
    near = _history_near(spark, wh, record, targets)
    targets, discard_hist, discards = (targets, None, False) if near is None else near
    n_ops = appends.appended_rows(paths["op"], record.prev_op_version, record.op_version)
    few_ops = n_ops is not None and n_ops <= CLASSIFY_ONE_TASK_MAX_ROWS
    classified = T.classify_ops(
        ops, targets, discards=discards, one_task=few_ops, few_targets=small
    )
    classified = held.checkpoint(counted.ops(classified, rules))
    # whether an operator's COMMIT may deliver a message of the discard table
    from_history = discards
    if near is None:  # the history of the OPs that name no live message, if any, by key
        from_history = counted.values()["_unknown_offset_ops"] > 0
        classified, discard_hist = _with_history(
            spark, wh, record, classified, held, counted, rules
        )
    # delayed transactional messages committed before their time: those
    # still ahead of the watermark are scheduled, the others placed by it
    observed = counted.values()
    later["scheduled"] += observed["_commits_later"]
    delayed_now = observed["_commits_delayed"] > observed["_commits_later"]
    later["next_scheduled_ms"] = _earliest(
        scheduled.next_due_after(
            wh, record.state_versions.get(SCHEDULED.path, job_tables.NO_VERSION), rules.watermark_ms
        )
        if rules.scheduled_before > n_due_rows
        else None,
        later.pop("_new_earliest"),
        observed["_commits_later_earliest"],
    )
    later["scheduled_after"] = rules.scheduled_before + later["scheduled"] - n_due_rows
    judged = (
        cancels.judge(spark, wh, record.state_versions, classified, rules)
        if observed["_cancel_ops"]
        else None
    )
    won_ops = T.winners(classified)
    won_now, won_later = T.split_won(won_ops, rules)
    later["withheld"] = 0
    commits_now_of_delayed = observed["_commits_of_delayed"] > observed["_commits_later"]
    if prior is not None and (commits_now_of_delayed or observed["_commits_after_discard"]):
        # committed at or after the time of a message cancelled while pending,
        # or by an operator after it was discarded (its delay is not kept)
        kept = cancels.drop_cancelled_commits(won_now, prior)
        later["withheld"] = won_now.count() - kept.count()
        won_now = kept
    c = _with_scheduling(counted.values(), later)
    # plain messages: committed by their store, delivered among the winning
    # COMMITs; the delayed ones once due
    won, decided_now = won_now, won_ops
    if plain is not None:
        now, _ = T.split_plain(plain, rules)
        won = won.unionByName(T.plain_winners(now), allowMissingColumns=True)
        decided_now = decided_now.unionByName(T.plain_winners(now), allowMissingColumns=True)
    if n_due:
        won = won.unionByName(due_keys, allowMissingColumns=True)
        if n_due > n_due_resolved:  # a plain message is resolved by the run delivering it
            decided_now = decided_now.unionByName(
                due_keys.where("NOT resolved_before").drop("resolved_before"),
                allowMissingColumns=True,
            )
    one_task = c["committed"] <= POSITIONS_ONE_TASK_MAX_ROWS
    merge = plain is not None or n_due > 0 or delayed_now

    def positions():
        return T.queue_positions(won, queues, plain=merge, one_task=one_task)

    placed = None
    if writing and one_task and not small and c["committed"] + n_due > 0:
        # the deliveries placed in their queues (one task: a core left for
        # the queues' count) while the driver counts the queues and plans
        # the writes, where the deliveries' write would place them only once
        # planned; a small run places them in its deliveries' one collect
        placed = held.checkpoint_soon(positions())
    # before any write: Spark gives a job's tasks the cores in the order
    # the jobs came, and this small one would wait for a write's
    queue_ends = sorted(tuple(r) for r in T.queue_ends(won, queues, one_task=one_task).collect())
    delivered_by_topic = _delivered_by_topic(queue_ends)
    if writing and delivered_by_topic:  # a few rows, written first for the same reason
        writes.start(
            T.next_queues(
                queues, _queue_ends_frame(spark, queue_ends), rules, one_task=True
            ).coalesce(1),
            table_path(wh, QUEUES),
            QUEUES.path,
            "overwrite",
            rows=len(queue_ends),  # and the queues this run leaves as they are: a few per topic
        )
    n_resolved = _resolved_count(c, observed["_commits_later"], n_due_resolved)
    if writing and n_resolved:
        writes.start(
            T.resolved_rows(decided_now, rules),
            table_path(wh, RESOLVED),
            RESOLVED.path,
            "append",
            rows=n_resolved,
        )
    known = T.known_messages(messages, discard_hist)
    if writing and later["scheduled"]:
        rows = None
        if plain is not None:
            rows = T.scheduled_rows(_plain_rows(checked, rules), rules)
        if observed["_commits_later"]:
            commits = T.scheduled_commits(won_later, known, rules)
            rows = commits if rows is None else rows.unionByName(commits)
        writes.start(
            _scheduled_files(rows, later),
            table_path(wh, SCHEDULED),
            SCHEDULED.path,
            "append",
            rows=later["scheduled"],
        )
    # the due messages are delivered, never pending: only the deliveries read them
    delivered_from = known
    if n_due:
        delivered_from = known.unionByName(T.select(due, *STORED_MESSAGE_COLUMNS))
    if writing and delivered_by_topic:  # the biggest write: started before the others are planned
        delivered = T.with_bodies(
            placed.result() if placed is not None else positions(),
            delivered_from,
            broadcast=c["committed"] <= BROADCAST_MAX_ROWS,
            one_task=small,
        )
        start_deliveries(
            wh,
            T.deliveries(delivered, rules),
            delivered_by_topic,
            writes,
            body_bytes=_bodies_at_most(observed, from_history or n_due > 0),
        )
    few_won = c["committed"] - c["plain"] + c["rolled_back"] <= BROADCAST_MAX_ROWS
    few_won = few_won and c["delivered_scheduled"] <= BROADCAST_MAX_ROWS
    undecided = T.remaining_pending(live, won_ops, broadcast=few_won, one_task=small)
    fates = T.decide(T.apply_answers(undecided, answers), rules)
    # few messages left undecided: decided and joined with their bodies in
    # one pass, kept (as `_keeps_undelivered` keeps so few), instead of two.
    # Counted on the joined rows (each fate has its message): a join that
    # finds a side empty may leave the other out of the executed plan
    few_undecided = writing and _undecided_at_most(c) <= UNDELIVERED_ONE_PASS_MAX_ROWS
    if few_undecided:
        joined = T.with_bodies(fates, known, broadcast=True, one_task=small)
        undelivered = held.checkpoint(counted.bodies(counted.fates(joined, rules)))
    else:
        decided = held.checkpoint(counted.fates(fates, rules))
    c = {k: v for k, v in _with_scheduling(counted.values(), later).items() if k[0] != "_"}
    c["cancelled"] = 0
    if judged is not None:
        for name, n in judged.counts.items():
            c[name] += n
        if writing and judged.cancelled:
            writes.start(
                judged.cancelled_frame(spark),
                table_path(wh, CANCELLED),
                CANCELLED.path,
                "append",
                rows=len(judged.cancelled),
            )
    # no new version: nothing to count, and no Spark job to wait for
    c["answers_read"] = (
        answers.count() if record.answers_version > record.prev_answers_version else 0
    )
    body_bytes = None
    if few_undecided:
        body_bytes = counted.values()["_body_bytes"]
    else:
        undelivered = T.with_bodies(
            decided, known, broadcast=_undelivered_rows(c) <= BROADCAST_MAX_ROWS
        )
        if writing and _keeps_undelivered(c, writes):
            undelivered = held.checkpoint(counted.bodies(undelivered))
            body_bytes = counted.values()["_body_bytes"]

    def with_decision(*decisions: str):
        return undelivered.where(f"decision IN {T.sql_strings(decisions)}")

    return Outputs(
        requests=lambda: T.check_requests(with_decision(Decision.CHECK), rules),
        discards=lambda: T.discards(with_decision(Decision.EXPIRED, Decision.MAX_CHECKS), rules),
        rejected=lambda: _rejected(spark, rejected_halves, classified, judged, rules),
        pending=lambda: T.next_pending(with_decision(Decision.CHECK, Decision.WAIT), rules),
        counts=c,
        delivered_by_topic=delivered_by_topic,
        undelivered_body_bytes=body_bytes,
    )


def _bodies_at_most(observed: dict, beyond_the_counted: bool) -> int | None:
    """The bytes of the bodies a run may deliver, when its first pass counted
    those of the rows they come from (the new half rows and the pending set:
    a small run), and none may come from elsewhere (`beyond_the_counted`:
    the scheduled set, the discard table)."""
    if beyond_the_counted or "_half_body_bytes" not in observed:
        return None
    return int(observed["_half_body_bytes"] + observed["_pending_body_bytes"])


def _due_counts(counted: Counters, due_keys) -> tuple[int, int, int]:
    """(scheduled rows due in this run, of which delivered: not cancelled,
    and of those the transactional ones: resolved when their COMMIT won),
    counted as `due_keys` were kept (`Counters.due`); zeros without any."""
    if due_keys is None:
        return 0, 0, 0
    seen = counted.values()
    return seen["_due_rows"], seen["_due"], seen["_due_resolved"]


def _rejected(spark, rejected_halves, classified, judged, rules: T.Rules):
    """The run's REJECTED rows: half rows, OPs never applied, and cancels."""
    rows = rejected_halves.unionByName(T.op_rejections(classified, rules))
    if judged is not None and judged.rejected:
        rows = rows.unionByName(judged.rejected_frame(spark))
    return rows


def _resolved_count(c: dict, commits_later: int, due_resolved: int) -> int:
    """The `_sys/resolved` rows of the run: its winning OPs (those of the
    COMMITs it schedules or withholds, cancelled, included) and the plain
    messages it delivers (those due from the scheduled set included, but the
    transactional ones)."""
    return c["committed"] + c["rolled_back"] + commits_later + c["withheld"] - due_resolved


def _scheduled_files(rows, later: dict):
    """The run's SCHEDULED rows in files of narrow due_ms ranges, sorted."""
    files = max(1, -(-later["scheduled"] // scheduled.ROWS_PER_FILE))
    return rows.repartitionByRange(files, "due_ms").sortWithinPartitions("due_ms", "half_offset")


def _scheduling(plain, rules: T.Rules) -> dict:
    """How many of the run's plain messages (`plain` keys, or None) it
    schedules, and the earliest due time among them (`_new_earliest`)."""
    if plain is None:
        return {"scheduled": 0, "_new_earliest": None}
    _, later = T.split_plain(plain, rules)
    row = later.selectExpr("count(1)", "min(deliver_at_ms)").first()
    return {"scheduled": int(row[0]), "_new_earliest": row[1]}


def _earliest(*times: int | None) -> int | None:
    known = [t for t in times if t is not None]
    return min(known) if known else None


def _with_scheduling(c: dict, later: dict) -> dict:
    """The counters `jobs.counters` observed, with the scheduled set's:
    `committed` counts the messages this run delivers (the plain ones it
    schedules instead are left out, the due ones it delivers counted), and
    `next_due_ms` covers the earliest scheduled due time."""
    c = {**c, **later}
    if "committed" in c:
        c["committed"] += later["delivered_scheduled"] - later["scheduled"] - later["withheld"]
    if "next_due_ms" in c or later["next_scheduled_ms"] is not None:
        c["next_due_ms"] = _earliest(c.get("next_due_ms"), later["next_scheduled_ms"])
    return c


def _plain_rows(checked, rules: T.Rules):
    """The run's plain half rows, whole (`T.scheduled_rows` takes the delayed ones)."""
    accepted, _ = T.split_halves(checked, rules)
    _, plain = T.split_kinds(accepted)
    return plain


def _plain_keys(checked, rules: T.Rules, held: Held):
    """The keys of the run's plain messages (`T.plain_keys`), from the new
    half rows `T.with_reject_reason` (not those the counters observe: they
    count once), kept: the OP targets, the queues, the resolved rows and the
    deliveries all read them."""
    accepted, _ = T.split_halves(checked, rules)
    _, plain = T.split_kinds(accepted)
    return held.checkpoint(T.plain_keys(plain))


def _live_rows(c: dict) -> int:
    """At most how many messages this run may leave undecided: the pending
    set it read and its new half rows."""
    return c["pending_before"] + c["half_read"]


def _undecided_at_most(c: dict) -> int:
    """At most how many messages this run leaves undecided: its live
    messages (`_live_rows`) but those a winning OP decides."""
    return _live_rows(c) - c["_wins_on_live"]


def _undelivered_rows(c: dict) -> int:
    """How many messages this run discards or keeps pending: its fates but deliveries."""
    return c["pending_after"] + c["discarded_max_checks"] + c["discarded_expired"]


def _keeps_undelivered(c: dict, writes: RunWrites) -> bool:
    """Whether the messages not delivered are kept with their bodies' bytes
    counted: read by more than one table's write, or by one that the driver
    may collect if their bodies are small (`driver_writes.fits`), which only
    a count of their bytes can tell."""
    tables = len(_tables_of_undelivered(c))
    return tables > 1 or (tables == 1 and writes.collects(_undelivered_rows(c), ["body"], 0))


def _tables_of_undelivered(c: dict) -> list[str]:
    """The tables this run writes from the messages it does not deliver."""
    wanted = {
        CHECK_REQUESTS.path: c["check_requests"],
        DISCARD.path: c["discarded_max_checks"] or c["discarded_expired"],
        PENDING.path: _pending_changed(c),
    }
    return [table for table, written in wanted.items() if written]


def _history_near(spark, wh: str, record: run_log.RunRecord, targets):
    """(`targets` (the live messages, as `T.op_targets`) with what
    `_sys/resolved` and `_sys/discard` say of the other messages whose
    half_offset lies between the least and the greatest the run's OPs name,
    the discard rows among them, whether there are any), so that an OP for
    a message an earlier run resolved is classified in the same pass as the
    others: `_with_history`'s second pass costs a Spark job to find such
    OPs, and a second classification and checkpoint of them all.

    None when the OP table's log entries lack the statistics to bound the
    range, a history table cannot be read as parquet, or the files of that
    range hold more than `HISTORY_NEAR_MAX_ROWS` rows (an OP for a message
    long resolved): then `_with_history` looks up the messages it needs by
    key.
    """
    span = appends.appended_range(
        inputs.input_paths(wh)["op"], record.prev_op_version, record.op_version, "half_offset"
    )
    if span is None:
        return None
    read = [
        inputs.read_state_in_range(spark, wh, record.state_versions, table, *span)
        for table in (RESOLVED, DISCARD)
    ]
    if read[0] is None or read[1] is None or read[0][1] + read[1][1] > HISTORY_NEAR_MAX_ROWS:
        return None
    (resolved, n_resolved), (discarded, n_discarded) = read
    if n_resolved + n_discarded == 0:
        return targets, inputs.empty(spark, DISCARD), False
    # as in `_with_history`: the history is that of the messages no live one stands for
    live = F.broadcast(T.select(targets, "half_offset"))
    resolved = resolved.join(live, "half_offset", "left_anti")
    discarded = discarded.join(live, "half_offset", "left_anti")
    return targets.unionByName(T.history_targets(resolved, discarded)), discarded, n_discarded > 0


def _with_history(
    spark,
    wh: str,
    record: run_log.RunRecord,
    classified,
    held: Held,
    counted: Counters,
    rules: T.Rules,
):
    """(`classified` (`T.classify_ops` against the live messages), corrected
    for the OPs that match no live message by what the resolved and discard
    tables say of their messages; the discard rows read: an ADMIN OP may
    deliver a discarded message).

    Usually there are no such OPs (`counted` says so), and the history is
    not read at all; otherwise only the files whose statistics may hold
    their offsets.
    """
    if not counted.values()["_unknown_offset_ops"]:
        return classified, inputs.empty(spark, DISCARD)
    keys = [r[0] for r in T.unmatched_op_keys(classified).collect()]
    resolved = inputs.read_state_holding(spark, wh, record.state_versions, RESOLVED, keys)
    discarded = inputs.read_state_holding(spark, wh, record.state_versions, DISCARD, keys)
    wanted = local_frame(spark, [(k,) for k in keys], _HALF_OFFSETS)
    if len(keys) <= HISTORY_IN_LIST_MAX:
        resolved = resolved.where(resolved.half_offset.isin(keys))
        discarded = discarded.where(discarded.half_offset.isin(keys))
    else:
        resolved = resolved.join(wanted, "half_offset", "left_semi")
        discarded = discarded.join(wanted, "half_offset", "left_semi")
    history = T.history_targets(resolved, discarded)
    reclassified = T.reclassify_with_history(classified, wanted, history)
    return held.checkpoint(counted.ops(reclassified, rules)), discarded


def _delivered_by_topic(queue_ends: list[tuple]) -> dict[str, int]:
    by_topic: dict[str, int] = {}
    for topic, _queue_id, n, _last in queue_ends:
        by_topic[topic] = by_topic.get(topic, 0) + n
    return dict(sorted(by_topic.items()))


def _queue_ends_frame(spark, queue_ends: list[tuple]):
    """`T.queue_ends` as the rows `T.next_queues` takes (the last
    delivered queue_offset of each queue)."""
    return local_frame(spark, [(t, q, last) for t, q, _n, last in queue_ends], _QUEUE_ENDS)


def write_outputs(wh: str, out: Outputs, writes: RunWrites) -> None:
    """Write every output table of the run but those `compute` started
    (`_sys/queues`, `_sys/resolved`, the topics), and wait for all."""
    for df, path, app, mode, rows in _output_writes(wh, out):
        # each of these tables takes some of the undelivered messages
        body_bytes = None if app == REJECTED.path else out.undelivered_body_bytes
        writes.start(df, path, app, mode, rows, body_bytes)
    writes.finish()


def _output_writes(wh: str, out: Outputs) -> list[tuple]:
    """(DataFrame, table path, app id, save mode, rows) of each table this
    run changes, but those `compute` starts."""
    c = out.counts
    frames = {
        CHECK_REQUESTS: (out.requests, "append", c["check_requests"]),
        DISCARD: (out.discards, "append", c["discarded_max_checks"] + c["discarded_expired"]),
        PENDING: (out.pending, "overwrite", c["pending_after"]),
    }
    writes = [
        (frame(), table_path(wh, table), table.path, mode, rows)
        for table, (frame, mode, rows) in frames.items()
        if table.path in _tables_of_undelivered(c)
    ]
    rejected = c["rejected_halves"] + c["invalid_ops"] + c["late_ops"]
    if rejected:
        writes.append((out.rejected(), table_path(wh, REJECTED), REJECTED.path, "append", rejected))
    return writes


def _pending_changed(c: dict) -> bool:
    """Whether the pending set differs from the one read (else keep the table
    as is). Plain messages never pend: read and delivered, they change nothing."""
    transactional = {
        "half_read": c["half_read"] - c["plain"],
        # the winning COMMIT OPs, delivered now or scheduled
        "committed": c["committed"]
        - c["plain"]
        - c["delivered_scheduled"]
        + c["scheduled"]
        + c["withheld"],
    }
    return any(
        {**c, **transactional}[k]
        for k in (
            "half_read",
            "committed",
            "rolled_back",
            "check_requests",
            "discarded_max_checks",
            "discarded_expired",
            "answers_read",
        )
    )
