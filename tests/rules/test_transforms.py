"""The rules of docs/protocol.md §4 on in-memory DataFrames (no tables): one test per boundary."""

from __future__ import annotations

import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F

from jobs import transforms as T
from jobs.interpreted import interpreted_if_small
from schemas import CHECK_ANSWERS, DISCARD, HALF, OP, PENDING, QUEUES, RESOLVED, TOPIC
from schemas.spark import spark_schema
from txn_core.vocabulary import Decision, OpOutcome

import factories as fx

NOW = 1_000_000


def rules(**kw) -> T.Rules:
    base = dict(
        run_id="run-7",
        run_number=7,
        now_ms=NOW,
        transaction_timeout_ms=6000,
        check_max=15,
        check_interval_ms=30000,
        reserved_ms=72 * 3_600_000,
        max_checks_per_run=0,
        check_budget="answered",
    )
    base.update(kw)
    return T.Rules(**base)


def pending_df(spark, *rows: dict):
    full = [
        {"checks_sent": 0, "checks_undecided": 0, "last_check_ms": None, "run_number": 1, **r}
        for r in rows
    ]
    return spark.createDataFrame(full, spark_schema(PENDING))


def halves_df(spark, *rows: dict):
    return spark.createDataFrame(list(rows), spark_schema(HALF))


def ops_df(spark, *rows: tuple[dict, int]):
    """OP rows with the table version (commit_version) they were committed in."""
    schema = spark_schema(OP).add("commit_version", "long", False)
    return spark.createDataFrame([{**r, "commit_version": v} for r, v in rows], schema)


def decisions(spark, r: T.Rules, *rows: dict) -> dict[int, str]:
    out = T.decide(pending_df(spark, *rows), r).select("half_offset", "decision").collect()
    return {row["half_offset"]: row["decision"] for row in out}


# --- age, immunity, interval, expiry --------------------------------------------------------


def test_age_equal_to_immunity_is_immune_and_one_ms_more_is_checked(spark):
    r = rules()
    got = decisions(spark, r, fx.half(1, store_ms=NOW - 6000), fx.half(2, store_ms=NOW - 6001))
    assert got == {1: Decision.WAIT, 2: Decision.CHECK}


def test_per_message_immunity_overrides_the_default_and_negative_means_default(spark):
    r = rules()
    got = decisions(
        spark,
        r,
        fx.half(1, store_ms=NOW - 60_000, check_immunity_s=60),  # exactly 60 s: immune
        fx.half(2, store_ms=NOW - 60_001, check_immunity_s=60),  # 1 ms past: checked
        fx.half(3, store_ms=NOW - 1, check_immunity_s=0),  # no floor
        fx.half(4, store_ms=NOW - 6000, check_immunity_s=-1),  # default 6 s: immune
        fx.half(5, store_ms=NOW - 5000, check_immunity_s=None),
    )
    assert got == {
        1: Decision.WAIT,
        2: Decision.CHECK,
        3: Decision.CHECK,
        4: Decision.WAIT,
        5: Decision.WAIT,
    }


def test_message_stored_in_the_future_has_age_zero(spark):
    r = rules(transaction_timeout_ms=0)
    df = T.decide(pending_df(spark, fx.half(1, store_ms=NOW + 50_000)), r)
    row = df.select("age_ms", "decision").first()
    assert (row["age_ms"], row["decision"]) == (0, Decision.WAIT)


def test_check_interval_is_respected(spark):
    r = rules()
    old = NOW - 100_000
    got = decisions(
        spark,
        r,
        fx.half(1, store_ms=old, checks_sent=1, last_check_ms=NOW - 29_999),
        fx.half(2, store_ms=old, checks_sent=1, last_check_ms=NOW - 30_000),
    )
    assert got == {1: Decision.WAIT, 2: Decision.CHECK}


def test_expire_after_reserved_hours_without_check(spark):
    r = rules(reserved_ms=3_600_000)
    got = decisions(
        spark, r, fx.half(1, store_ms=NOW - 3_600_000), fx.half(2, store_ms=NOW - 3_600_001)
    )
    assert got == {1: Decision.CHECK, 2: Decision.EXPIRED}
    out = T.discards(
        T.decide(pending_df(spark, fx.half(2, store_ms=NOW - 3_600_001, checks_sent=3)), r), r
    )
    row = out.first()
    assert (row["reason"], row["check_times"], row["discarded_ms"], row["run_id"]) == (
        "EXPIRED",
        3,
        NOW,
        "run-7",
    )


def test_max_checks_per_run_takes_the_oldest_first(spark):
    r = rules(max_checks_per_run=2)
    got = decisions(
        spark,
        r,
        fx.half(10, store_ms=NOW - 50_000),
        fx.half(11, store_ms=NOW - 90_000),
        fx.half(12, store_ms=NOW - 70_000),
        fx.half(9, store_ms=NOW - 70_000),
    )
    # 11 is oldest; 9 and 12 tie on store_ms and half_offset breaks the tie
    assert got == {11: Decision.CHECK, 9: Decision.CHECK, 12: Decision.WAIT, 10: Decision.WAIT}


# --- check_max in both budget modes --------------------------------------------------------


def _simulate_checks(spark, budget: str, answer_each_check: bool) -> tuple[int, str]:
    """Run the check rules run after run, 30 s apart, on one never-decided message."""
    msg = fx.half(1, store_ms=0)
    pend = pending_df(spark, msg)
    requests = 0
    for i in range(1, 40):
        r = rules(now_ms=i * 30_000, check_budget=budget, run_id=f"run-{i}", run_number=i)
        decided = T.decide(pend, r).cache()
        kind = decided.select("decision").first()["decision"]
        if kind == Decision.MAX_CHECKS:
            discarded = T.discards(decided, r).first()
            assert discarded["check_times"] == requests
            return requests, discarded["reason"]
        assert kind == Decision.CHECK
        req = T.check_requests(decided, r).first()
        requests += 1
        assert req["check_times"] == requests
        assert req["request_id"] == f"run-{i}-1"
        pend = T.next_pending(decided, r)
        if answer_each_check:
            answers = spark.createDataFrame(
                [
                    fx.answer(req["request_id"], msg, "UNKNOWN"),
                    fx.answer(req["request_id"], msg, "UNKNOWN"),
                ],  # a duplicate counts once
                spark_schema(CHECK_ANSWERS),
            )
            pend = T.apply_answers(pend, answers)
        # materialise each run, as the job does by writing `_sys/pending`
        pend = spark.createDataFrame(T.conform(pend, PENDING).collect(), spark_schema(PENDING))
    raise AssertionError("never discarded")


@pytest.mark.parametrize("budget,answered", [("answered", True), ("sent", False)])
def test_exactly_check_max_checks_then_discard_when_due_again(spark, budget, answered):
    assert _simulate_checks(spark, budget, answered) == (15, "MAX_CHECKS")


def test_answered_budget_is_not_burnt_by_unanswered_checks(spark):
    r = rules(check_budget="answered", check_max=2)
    got = decisions(
        spark,
        r,
        fx.half(1, store_ms=0, checks_sent=5, checks_undecided=1),
        fx.half(2, store_ms=0, checks_sent=2, checks_undecided=2),
    )
    assert got == {1: Decision.CHECK, 2: Decision.MAX_CHECKS}


def test_answers_of_another_group_or_transaction_do_not_count(spark):
    msg = fx.half(1, store_ms=0)
    answers = spark.createDataFrame(
        [
            fx.answer("a", msg, "UNKNOWN"),
            fx.answer("b", msg, "ERROR"),
            fx.answer("c", msg, "COMMIT"),
            {**fx.answer("d", msg, "UNKNOWN"), "producer_group": "other"},
            {**fx.answer("e", msg, "UNKNOWN"), "transaction_id": "tx-x"},
        ],
        spark_schema(CHECK_ANSWERS),
    )
    out = T.apply_answers(pending_df(spark, msg), answers)
    assert out.select("checks_undecided").first()[0] == 2


# --- OP resolution ---------------------------------------------------------------------


def _outcomes(spark, live_rows, ops, history=None):
    live = pending_df(spark, *live_rows)
    hist = (
        history
        if history is not None
        else T.history_targets(
            spark.createDataFrame([], spark_schema(RESOLVED)),
            spark.createDataFrame([], spark_schema(DISCARD)),
        )
    )
    classified = T.classify_ops(ops_df(spark, *ops), T.op_targets(T.message_keys(live), hist))
    return {
        r["op_offset"]: (r["outcome"], r["reason"])
        for r in classified.select("op_offset", "outcome", "reason").collect()
    }


def test_first_valid_op_in_commit_order_wins_not_lowest_op_offset(spark):
    h = fx.half(1)
    got = _outcomes(
        spark,
        [h],
        [
            (fx.op(h, "ROLLBACK", op_offset=5), 3),
            (fx.op(h, "COMMIT", op_offset=900), 2),
            (fx.op(h, "COMMIT", op_offset=901), 2),
        ],
    )
    assert got == {
        900: (OpOutcome.WIN, None),
        901: (OpOutcome.DUPLICATE, None),
        5: (OpOutcome.CONFLICT, None),
    }


def test_invalid_ops_are_counted_and_a_later_valid_op_wins(spark):
    h = fx.half(1)
    got = _outcomes(
        spark,
        [h],
        [
            (fx.op(h, op_offset=1, producer_group="other"), 1),
            (fx.op(h, op_offset=2, transaction_id="tx-forged"), 1),
            (fx.op(h, op_offset=3, action="MAYBE"), 1),
            (fx.op(h, op_offset=4, source="SOMEONE"), 1),
            (fx.op(fx.half(99), op_offset=5), 1),
            (fx.op(h, op_offset=6), 2),
        ],
    )
    assert got == {
        1: (OpOutcome.INVALID, "producer_group mismatch"),
        2: (OpOutcome.INVALID, "transaction_id mismatch"),
        3: (OpOutcome.INVALID, "invalid action"),
        4: (OpOutcome.INVALID, "invalid source"),
        5: (OpOutcome.INVALID, "unknown half_offset"),
        6: (OpOutcome.WIN, None),
    }


def test_only_the_live_messages_no_valid_op_decided_remain_pending(spark):
    decided, forged, silent = fx.half(1), fx.half(2), fx.half(3)
    ops = [
        (fx.op(decided, op_offset=10), 1),
        (fx.op(forged, op_offset=11, producer_group="other"), 1),
        (fx.op(fx.half(99), op_offset=12), 2),
    ]
    live = T.message_keys(pending_df(spark, decided, forged, silent))
    assert live.columns == list(T.MESSAGE_KEY_COLUMNS)
    classified = T.classify_ops(ops_df(spark, *ops), T.op_targets(live, _history(spark)))
    remaining = T.remaining_pending(live, T.winners(classified))
    assert sorted(r[0] for r in remaining.select("half_offset").collect()) == [2, 3]
    assert [r[0] for r in T.unmatched_op_keys(classified).collect()] == [99]


def test_an_op_row_written_twice_wins_once(spark):
    live_msg, old = fx.half(1), fx.half(2)
    twice = [
        (fx.op(live_msg, op_offset=7), 3),
        (fx.op(live_msg, op_offset=7), 3),
        (fx.op(old, op_offset=8, source="ADMIN"), 3),
        (fx.op(old, op_offset=8, source="ADMIN"), 3),
    ]
    live = T.message_keys(pending_df(spark, live_msg))
    history = _history(spark, discarded=[_discarded(old)])
    classified = T.classify_ops(ops_df(spark, *twice), T.op_targets(live, history))
    assert sorted((r.half_offset, r.outcome) for r in classified.collect()) == [
        (1, OpOutcome.DUPLICATE),
        (1, OpOutcome.WIN),
        (2, OpOutcome.DUPLICATE),
        (2, OpOutcome.WIN),
    ]


def _mixed_ops(spark):
    """(OPs of every outcome for three live messages and an unknown one, their targets)."""
    a, b, c = fx.half(1), fx.half(2), fx.half(3)
    ops = ops_df(
        spark,
        (fx.op(a, "ROLLBACK", op_offset=9, source="ADMIN"), 2),
        (fx.op(a, "COMMIT", op_offset=3), 2),
        (fx.op(a, "MAYBE", op_offset=4), 1),
        (fx.op(a, "ROLLBACK", op_offset=1), 3),
        (fx.op(b, op_offset=5), 1),
        (fx.op(b, op_offset=5), 1),
        (fx.op(b, op_offset=6, source="ADMIN"), 1),
        (fx.op(b, op_offset=7, producer_group="other"), 1),
        (fx.op(c, "ROLLBACK", op_offset=8, source="CHECK"), 4),
        (fx.op(fx.half(99), op_offset=10), 1),
    )
    return ops, T.op_targets(T.message_keys(pending_df(spark, a, b, c)), _history(spark))


def test_few_ops_are_classified_alike_by_one_task_without_a_shuffle(spark):
    """`one_task` (a small run) ranks the OPs in one partition: the same
    outcomes as the OPs shuffled by message, and no such shuffle planned."""
    ops, targets = _mixed_ops(spark)
    ops = ops.repartition(3)  # a message's OPs in several partitions
    targets = F.broadcast(targets)  # few, as a small run's
    one = T.classify_ops(ops, targets, one_task=True)
    shuffled = T.classify_ops(ops, targets)
    assert_df_equality(one, shuffled, ignore_row_order=True, ignore_nullable=True)

    def shuffles(df) -> int:  # the history's own grouping among them
        return (
            df._jdf.queryExecution()
            .executedPlan()
            .toString()
            .count("Exchange hashpartitioning(half_offset")
        )

    assert shuffles(one) == shuffles(shuffled) - 1


def test_few_ops_and_targets_are_joined_in_the_one_task_without_an_exchange(spark, tmp_path):
    """`one_task` with `few_targets` (a small run, few live messages): the
    task ranking the OPs joins them with the targets too, none sent to every
    task first (a Spark job of its own) nor shuffled. The same outcomes."""
    ops, targets = _mixed_ops(spark)
    # read from files, as a run's inputs: Spark knows their size (small)
    ops.repartition(3).write.parquet(str(tmp_path / "ops"))  # a message's OPs in several
    targets.write.parquet(str(tmp_path / "targets"))
    ops, targets = (spark.read.parquet(str(tmp_path / name)) for name in ("ops", "targets"))
    broadcast = T.classify_ops(ops, targets, one_task=True)
    joined_in_task = T.classify_ops(ops, targets, one_task=True, few_targets=True)
    assert_df_equality(joined_in_task, broadcast, ignore_row_order=True, ignore_nullable=True)

    def plan(df) -> str:
        return df._jdf.queryExecution().executedPlan().toString()

    assert "BroadcastExchange" in plan(broadcast)
    with interpreted_if_small(spark, 1):  # a small run's settings
        assert "Exchange" not in plan(joined_in_task)


def test_live_messages_are_classified_alike_without_ranking_admin_ops(spark):
    """`discards=False` (the run's first pass, against live messages only)
    must give every OP the outcome the full ranking gives it."""
    ops, targets = _mixed_ops(spark)
    lean = T.classify_ops(ops, targets, discards=False)
    full = T.classify_ops(ops, targets)
    assert_df_equality(lean, full, ignore_row_order=True, ignore_nullable=True)
    assert sorted((r.op_offset, r.outcome) for r in lean.collect()) == [
        (1, OpOutcome.CONFLICT),
        (3, OpOutcome.WIN),
        (4, OpOutcome.INVALID),
        (5, OpOutcome.DUPLICATE),
        (5, OpOutcome.WIN),
        (6, OpOutcome.DUPLICATE),
        (7, OpOutcome.INVALID),
        (8, OpOutcome.WIN),
        (9, OpOutcome.CONFLICT),
        (10, OpOutcome.INVALID),
    ]


def _history(spark, resolved=(), discarded=()):
    res = spark.createDataFrame(list(resolved), spark_schema(RESOLVED))
    dis = spark.createDataFrame(list(discarded), spark_schema(DISCARD))
    return T.history_targets(res, dis)


def _resolved(h, action, after_discard=False):
    return {
        "half_offset": h["half_offset"],
        "transaction_id": h["transaction_id"],
        "producer_group": h["producer_group"],
        "topic": h["topic"],
        "action": action,
        "source": "PRODUCER",
        "op_offset": 1,
        "op_version": 1,
        "op_store_ms": 1,
        "after_discard": after_discard,
        "run_id": "run-1",
    }


def _discarded(h):
    return {**h, "check_times": 15, "reason": "MAX_CHECKS", "discarded_ms": 5, "run_id": "run-1"}


def test_ops_for_messages_resolved_earlier_are_duplicates_or_conflicts(spark):
    h = fx.half(1)
    got = _outcomes(
        spark,
        [],
        [(fx.op(h, "ROLLBACK", op_offset=1), 4), (fx.op(h, "COMMIT", op_offset=2), 4)],
        history=_history(spark, resolved=[_resolved(h, "ROLLBACK")]),
    )
    assert got == {1: (OpOutcome.DUPLICATE, None), 2: (OpOutcome.CONFLICT, None)}


def test_after_discard_producer_and_check_ops_are_late_admin_wins(spark):
    h = fx.half(1)
    got = _outcomes(
        spark,
        [],
        [
            (fx.op(h, "COMMIT", op_offset=1, source="PRODUCER"), 4),
            (fx.op(h, "COMMIT", op_offset=2, source="CHECK"), 4),
            (fx.op(h, "ROLLBACK", op_offset=3, source="ADMIN"), 5),
            (fx.op(h, "COMMIT", op_offset=4, source="ADMIN"), 6),
        ],
        history=_history(spark, discarded=[_discarded(h)]),
    )
    assert got == {
        1: (OpOutcome.LATE, "message discarded"),
        2: (OpOutcome.LATE, "message discarded"),
        3: (OpOutcome.WIN, None),
        4: (OpOutcome.CONFLICT, None),
    }


def test_after_admin_override_of_a_discard_producer_ops_stay_late(spark):
    h = fx.half(1)
    got = _outcomes(
        spark,
        [],
        [
            (fx.op(h, "COMMIT", op_offset=1), 4),
            (fx.op(h, "COMMIT", op_offset=2, source="ADMIN"), 4),
        ],
        history=_history(spark, resolved=[_resolved(h, "COMMIT", True)], discarded=[_discarded(h)]),
    )
    assert got == {1: (OpOutcome.LATE, "message discarded"), 2: (OpOutcome.DUPLICATE, None)}


def test_an_op_naming_a_plain_message_is_a_duplicate_or_a_conflict(spark):
    """A plain message is committed by its store: an OP for it (a stray one,
    an operator's) never decides it, in the run that reads the message
    (`plain_targets`) or a later one (its `_sys/resolved` row)."""
    p, late = fx.half(1, message_type="NORMAL"), fx.half(2, message_type="NORMAL")
    plain = T.plain_keys(halves_df(spark, p).withColumn("commit_version", F.lit(3)))
    ops = ops_df(
        spark,
        (fx.op(p, "COMMIT", op_offset=10), 1),
        (fx.op(p, "ROLLBACK", op_offset=11, source="ADMIN"), 1),
        (fx.op(p, op_offset=12, producer_group="other"), 1),
        (fx.op(late, "ROLLBACK", op_offset=13), 1),
    )
    earlier = T.plain_winners(
        T.plain_keys(halves_df(spark, late).withColumn("commit_version", F.lit(2)))
    )
    history = _history(spark, resolved=T.resolved_rows(earlier, rules()).collect())
    targets = T.op_targets(T.message_keys(pending_df(spark)), history).unionByName(
        T.plain_targets(plain)
    )
    got = {
        r["op_offset"]: (r["outcome"], r["reason"]) for r in T.classify_ops(ops, targets).collect()
    }
    assert got == {
        10: (OpOutcome.DUPLICATE, None),
        11: (OpOutcome.CONFLICT, None),
        12: (OpOutcome.INVALID, "producer_group mismatch"),
        13: (OpOutcome.CONFLICT, None),
    }


def test_ops_naming_no_live_message_are_classified_again_against_the_history(spark):
    live_msg, old = fx.half(1), fx.half(2)
    ops = ops_df(
        spark,
        (fx.op(live_msg, op_offset=1), 1),
        (fx.op(old, "COMMIT", op_offset=2), 1),
        (fx.op(old, "ROLLBACK", op_offset=3), 2),
    )
    live = T.message_keys(pending_df(spark, live_msg))
    history = _history(spark, resolved=[_resolved(old, "ROLLBACK")])
    first = T.classify_ops(ops, T.op_targets(live, _history(spark)))
    again = T.reclassify_with_history(first, T.unmatched_op_keys(first), history)

    def outcomes(classified):
        return sorted((r.op_offset, r.outcome, r.reason) for r in classified.collect())

    assert outcomes(first)[1:] == [
        (2, OpOutcome.INVALID, T.UNKNOWN_OFFSET),
        (3, OpOutcome.INVALID, T.UNKNOWN_OFFSET),
    ]
    assert (
        outcomes(again)
        == outcomes(T.classify_ops(ops, T.op_targets(live, history)))
        == [(1, OpOutcome.WIN, None), (2, OpOutcome.CONFLICT, None), (3, OpOutcome.DUPLICATE, None)]
    )


# --- deliveries ------------------------------------------------------------------------


def _shuffles_by_queue(df) -> bool:
    plan = df._jdf.queryExecution().executedPlan().toString()
    return "Exchange hashpartitioning(topic#" in plan


@pytest.mark.parametrize("one_task", [False, True])
def test_deliveries_dense_per_queue_in_commit_order_continuing_previous(spark, one_task):
    r = rules()
    hs = [
        fx.half(1, queue_id=0),
        fx.half(2, queue_id=0),
        fx.half(3, queue_id=1),
        fx.half(4, queue_id=0, topic="PAY"),
    ]
    ops = [
        (fx.op(hs[0], op_offset=50), 9),
        (fx.op(hs[1], op_offset=70), 8),
        (fx.op(hs[2], op_offset=1), 8),
        (fx.op(hs[3], op_offset=2), 9),
    ]
    live = pending_df(spark, *hs)
    won = T.winners(
        T.classify_ops(ops_df(spark, *ops), T.op_targets(T.message_keys(live), _history(spark)))
    )
    queues = spark.createDataFrame(
        [{"topic": "ORDER", "queue_id": 0, "next_queue_offset": 10, "run_number": 3}],
        spark_schema(QUEUES),
    )
    positions = T.queue_positions(won, queues, one_task=one_task)
    assert _shuffles_by_queue(positions) is not one_task  # one task: no shuffle by queue
    settled = T.with_bodies(positions, live)
    got = T.deliveries(settled, r).select("topic", "queue_id", "queue_offset", "half_offset")
    expected = spark.createDataFrame(
        [("ORDER", 0, 10, 2), ("ORDER", 0, 11, 1), ("ORDER", 1, 0, 3), ("PAY", 0, 0, 4)],
        "topic string, queue_id int, queue_offset long, half_offset long",
    )
    assert_df_equality(got, expected, ignore_row_order=True, ignore_nullable=True)
    nxt = T.next_queues(queues, positions, r, one_task=one_task)
    nxt = nxt.select("topic", "queue_id", "next_queue_offset")
    assert sorted(map(tuple, nxt.collect())) == [("ORDER", 0, 12), ("ORDER", 1, 1), ("PAY", 0, 1)]


@pytest.mark.parametrize("one_task", [False, True])
def test_plain_messages_merge_with_commits_by_commit_time_each_kind_in_its_order(spark, one_task):
    """docs/protocol.md §4.3: COMMIT OPs keep their commit order (OP version,
    op_offset), plain messages theirs (half version, half_offset), and the
    two interleave by commit time; a message stored with an earlier time
    than one of its kind committed before it (another process's clock)
    never overtakes that one."""
    hs = {o: fx.half(o, queue_id=0) for o in (1, 2, 3)}
    ops = [
        (fx.op(hs[1], op_offset=50, store_ms=200), 4),
        (fx.op(hs[2], op_offset=51, store_ms=300), 4),
        (fx.op(hs[3], op_offset=52, store_ms=150), 5),  # committed after 2, on a slower clock
    ]
    live = pending_df(spark, *hs.values())
    won = T.winners(
        T.classify_ops(ops_df(spark, *ops), T.op_targets(T.message_keys(live), _history(spark)))
    )
    # half_offset: (store_ms, the _sys/half version that stored it)
    stored = {11: (100, 7), 13: (120, 7), 12: (90, 8), 14: (400, 9)}
    rows = [fx.half(o, store_ms=ms, message_type="NORMAL") for o, (ms, _) in stored.items()]
    versions = " ".join(f"WHEN {o} THEN {v}" for o, (_, v) in stored.items())
    plain = T.plain_keys(
        halves_df(spark, *rows).withColumn(
            "commit_version", F.expr(f"CAST(CASE half_offset {versions} END AS BIGINT)")
        )
    )
    queues = spark.createDataFrame(
        [{"topic": "ORDER", "queue_id": 0, "next_queue_offset": 5, "run_number": 3}],
        spark_schema(QUEUES),
    )
    every = won.unionByName(T.plain_winners(plain))
    placed = T.queue_positions(every, queues, plain=True, one_task=one_task)
    assert _shuffles_by_queue(placed) is not one_task
    placed = placed.orderBy("queue_offset").collect()
    assert [(r["half_offset"], r["queue_offset"], r["commit_ms"]) for r in placed] == [
        (11, 5, 100),
        (13, 6, 120),
        (12, 7, 90),  # after 13, committed before it in _sys/half
        (1, 8, 200),
        (2, 9, 300),
        (3, 10, 150),  # after 2, committed before it in _sys/op
        (14, 11, 400),
    ]
    assert sorted(map(tuple, T.queue_ends(every, queues).collect())) == [("ORDER", 0, 7, 11)]


def test_queue_ends_say_what_queue_positions_will(spark):
    """The run knows its topics and next queues from `queue_ends`, before any
    message has its place: for each queue, as many deliveries and the same
    last offset as `queue_positions` then gives (a queue with a previous
    end, new queues, a rollback that takes no place, two COMMITs of one
    message that deliver it once)."""
    hs = [
        fx.half(1, queue_id=0),
        fx.half(2, queue_id=0),
        fx.half(3, queue_id=1),
        fx.half(4, queue_id=0, topic="PAY"),
        fx.half(5, queue_id=0),
    ]
    ops = [
        (fx.op(hs[0], op_offset=50), 9),
        (fx.op(hs[1], op_offset=70), 8),
        (fx.op(hs[1], op_offset=71), 9),
        (fx.op(hs[2], op_offset=1), 8),
        (fx.op(hs[3], op_offset=2), 9),
        (fx.op(hs[4], "ROLLBACK", op_offset=3), 9),
    ]
    live = pending_df(spark, *hs)
    won = T.winners(
        T.classify_ops(ops_df(spark, *ops), T.op_targets(T.message_keys(live), _history(spark)))
    )
    queues = spark.createDataFrame(
        [{"topic": "ORDER", "queue_id": 0, "next_queue_offset": 10, "run_number": 3}],
        spark_schema(QUEUES),
    )
    placed = (
        T.queue_positions(won, queues)
        .groupBy("topic", "queue_id")
        .agg(F.count(F.lit(1)), F.max("queue_offset"))
    )
    expected = [("ORDER", 0, 2, 11), ("ORDER", 1, 1, 0), ("PAY", 0, 1, 0)]
    assert sorted(map(tuple, placed.collect())) == expected
    assert sorted(map(tuple, T.queue_ends(won, queues).collect())) == expected
    # counted by one task from the kept winners (as a run keeps them): the
    # same ends, and no exchange (broadcast or shuffle) at all
    in_one_task = T.queue_ends(won.localCheckpoint(), queues, one_task=True)
    assert sorted(map(tuple, in_one_task.collect())) == expected
    assert "Exchange" not in in_one_task._jdf.queryExecution().executedPlan().toString()


def test_delivered_row_carries_the_message_byte_identical(spark):
    body = bytes(range(256)) * 3
    h = fx.half(1, body=body, tags="t\u00e9", keys="k 1", properties={"\u00fc": "\x00v"})
    live = pending_df(spark, h)
    won = T.winners(
        T.classify_ops(
            ops_df(spark, (fx.op(h, store_ms=77), 1)),
            T.op_targets(T.message_keys(live), _history(spark)),
        )
    )
    empty_q = spark.createDataFrame([], spark_schema(QUEUES))
    positions = T.queue_positions(won, empty_q)
    row = T.deliveries(T.with_bodies(positions, live), rules()).first()
    assert (row["body"], row["tags"], row["keys"], row["properties"]) == (
        body,
        "t\u00e9",
        "k 1",
        {"\u00fc": "\x00v"},
    )
    assert (row["commit_ms"], row["delivered_ms"], row["queue_offset"]) == (77, NOW, 0)
    assert [c for c in row.asDict() if c != "topic"] == TOPIC.names


def test_rejected_halves_are_set_aside_with_a_reason(spark):
    r = rules()
    rows = [
        fx.half(1),
        fx.half(2, topic="bad topic!"),
        fx.half(3, topic="_sys_half"),
        fx.half(4, queue_id=-1),
        fx.half(5, topic="x" * 128),
        fx.half(6, message_type="DELAY"),  # a kind this job does not know: never guessed
        fx.half(7, message_type="NORMAL"),
        fx.half(8, message_type="TRANSACTION"),
        fx.half(9, topic="ORDER\n"),  # written by hand: Java's `$` matches before a final newline
    ]
    accepted, rejected = T.split_halves(halves_df(spark, *rows), r)
    assert sorted(r_["half_offset"] for r_ in accepted.collect()) == [1, 7, 8]
    transactional, plain = T.split_kinds(accepted)
    assert sorted(r_["half_offset"] for r_ in transactional.collect()) == [1, 8]  # null too
    assert [r_["half_offset"] for r_ in plain.collect()] == [7]
    got = rejected.select("row_offset", "reason")
    expected = spark.createDataFrame(
        [
            (2, "invalid topic name"),
            (3, "system topic name"),
            (4, "negative queue_id"),
            (5, "invalid topic name"),
            (6, "unknown message_type"),
            (9, "invalid topic name"),
        ],
        "row_offset long, reason string",
    )
    assert_df_equality(got, expected, ignore_row_order=True, ignore_nullable=True)


def test_the_job_reserves_exactly_the_topics_the_broker_core_refuses(spark):
    """One system-topic rule for both engines: a topic the broker core accepts
    is never set aside by the job (SCHEDULE_TOPIC_ORDERS once was)."""
    from txn_core.errors import MessageValidationError
    from txn_core.message import validate_topic

    topics = [
        "ORDER",
        "SCHEDULE_TOPIC_ORDERS",
        "TBW102x",
        "sys_orders",
        "TBW102",
        "SCHEDULE_TOPIC_XXXX",
        "BenchmarkTest",
        "RMQ_SYS_TRACE_TOPIC",
        "rmq_sys_x",
        "RmQ_SyS_x",
        "_sys",
        "_SYS_half",
        "_system",
    ]

    def refused(topic: str) -> bool:
        try:
            validate_topic(topic)
            return False
        except MessageValidationError:
            return True

    rows = [fx.half(i, topic=t) for i, t in enumerate(topics)]
    _, rejected = T.split_halves(halves_df(spark, *rows), rules())
    set_aside = {topics[r["row_offset"]] for r in rejected.collect()}
    assert set_aside == {t for t in topics if refused(t)}
    assert "SCHEDULE_TOPIC_ORDERS" not in set_aside and "RmQ_SyS_x" in set_aside


def test_next_pending_counts_the_check_and_keeps_waiting_messages(spark):
    r = rules()
    decided = T.decide(
        pending_df(
            spark,
            fx.half(1, store_ms=0, checks_sent=2, checks_undecided=1, last_check_ms=0),
            fx.half(2, store_ms=NOW),
        ),
        r,
    )
    got = T.next_pending(decided, r).select(
        "half_offset", "checks_sent", "checks_undecided", "last_check_ms", "run_number"
    )
    expected = spark.createDataFrame(
        [(1, 3, 1, NOW, 7), (2, 0, 0, None, 7)],
        "half_offset long, checks_sent int, checks_undecided int, "
        "last_check_ms long, run_number long",
    )
    assert_df_equality(got, expected, ignore_row_order=True, ignore_nullable=True)


def test_due_at_is_the_first_clock_at_which_decide_stops_waiting(spark):
    """An idle run trusts the minimum of due_at_ms: at due − 1 every row must
    still WAIT, at due it must not."""
    r = rules(reserved_ms=100_000)
    rows = [
        fx.half(1, store_ms=NOW),  # immunity first
        fx.half(2, store_ms=NOW, check_immunity_s=60),  # its own immunity
        {**fx.half(3, store_ms=NOW - 10_000), "last_check_ms": NOW, "checks_sent": 1},
        {**fx.half(4, store_ms=NOW, check_immunity_s=3600)},  # expires before due
        fx.half(5, store_ms=NOW + 5_000),
    ]  # stored in the future
    due = {
        row["half_offset"]: row["due"]
        for row in T.decide(pending_df(spark, *rows), r)
        .select("half_offset", T.due_at_ms(r).alias("due"))
        .collect()
    }
    assert due == {
        1: NOW + 6001,
        2: NOW + 60_001,
        3: NOW + 30_000,
        4: NOW + 100_001,
        5: NOW + 11_001,
    }
    for offset, at in due.items():
        row = [x for x in rows if x["half_offset"] == offset]
        assert decisions(spark, rules(reserved_ms=100_000, now_ms=at - 1), *row) == {
            offset: Decision.WAIT
        }
        assert decisions(spark, rules(reserved_ms=100_000, now_ms=at), *row) != {
            offset: Decision.WAIT
        }


def test_values_written_into_the_rules_sql_come_back_as_they_were(spark):
    # a run id or a file name goes into SQL text (`T.select`); a quote or a
    # backslash in it must neither break the query nor change the value
    odd = "run-'7' \\ \"x\""
    row = T.select(
        spark.range(1),
        "id",
        f"{T.sql_string(odd)} AS odd",
        f"'b' IN {T.sql_strings(['a', odd, 'b'])} AS found",
    ).first()
    assert (row.id, row.odd, row.found) == (0, odd, True)


def test_a_run_id_with_a_quote_reaches_its_discards_and_check_requests(spark):
    r = rules(run_id="run-'7'", reserved_ms=3_600_000)
    decided = T.decide(
        pending_df(spark, fx.half(1, store_ms=NOW - 3_600_001), fx.half(2, store_ms=NOW - 10_000)),
        r,
    )
    assert T.discards(decided, r).first()["run_id"] == "run-'7'"
    request = T.check_requests(decided, r).first()
    assert (request["run_id"], request["request_id"]) == ("run-'7'", "run-'7'-2")
