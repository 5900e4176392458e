"""The reconciliation job (SPEC §5): resolve, deliver, check, discard — exactly once.

    spark-submit jobs/reconcile.py run --conf conf/reconcile.toml [--now-ms N] [--dry-run]
    python -m jobs.reconcile status|verify|resolve ...
    from jobs.reconcile import reconcile; reconcile(spark, config, now_ms=None)

A run, under the job's lease (exit 75 when another run holds it):
  1. if the latest run has an intent but no COMMITTED record, redo exactly
     that run (same input versions, state versions, clock and rules);
  2. record the new run's intent (STARTED row of `_sys/runs`);
  3. compute its outputs (`jobs.transforms`), write each table in a commit
     tagged with the run number, then the COMMITTED row.
A crash between any two writes leaves an intent that step 1 completes, and
the redo skips the writes whose tagged commit it finds (I4,
`state.write_for_run`).

`--dry-run` computes the run that would be done next (the redo if one is
due) and prints its summary; it takes no lease and writes nothing, not even
missing tables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

if __package__ in (None, ""):  # run as a file by spark-submit: make `jobs`, `schemas`, … importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType  # noqa: E402,E501

from jobs import state  # noqa: E402
from jobs import transforms as T  # noqa: E402
from jobs.counters import Counters  # noqa: E402
from jobs.faults import InjectedFault, fault_point  # noqa: E402
from jobs.held import Held  # noqa: E402
from jobs.local import local_frame  # noqa: E402
from jobs.lease import EXIT_LEASE_HELD, Lease, LeaseHeld, LeaseLost  # noqa: E402
from jobs.session import use_warehouse  # noqa: E402
from schemas import (CHECK_REQUESTS, DISCARD, HALF, PENDING, QUEUES, REJECTED,  # noqa: E402
                     RESOLVED, table_path)
from txn_core.config import Config, ConfigError, as_config, load_config  # noqa: E402
from txn_core.vocabulary import Action, Decision, RunStatus, Source  # noqa: E402

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
#: above this many OPs for messages no longer pending, look them up by a join, not IN (...)
HISTORY_IN_LIST_MAX = 10_000
#: up to this many decided rows (~100 bytes each) are sent whole to every task
#: of a write to be joined with their messages (`T.with_bodies`), and up to
#: this many winning OPs to find the messages they leave undecided
#: (`T.remaining_pending`); above, both sides are shuffled, which moves every
#: message through a sort
BROADCAST_MAX_ROWS = 1_000_000
#: output tables written at once (independent writes; see _Writes)
PARALLEL_WRITES = 4
#: the driver's own small frames (`jobs.local`): history keys, each queue's last offset
_HALF_OFFSETS = StructType([StructField("half_offset", LongType(), False)])
_QUEUE_ENDS = StructType([StructField("topic", StringType(), False),
                          StructField("queue_id", IntegerType(), False),
                          StructField("queue_offset", LongType(), False)])


@dataclass
class RunSummary(state.InputVersions):
    """SPEC §5.3 counters of one run, plus the input versions it read."""

    run_id: str
    now_ms: int
    half_read: int
    op_read: int
    pending_before: int
    pending_after: int
    committed: int
    rolled_back: int
    check_requests: int
    discarded_max_checks: int
    discarded_expired: int
    duplicate_ops: int
    conflicting_ops: int
    invalid_ops: int
    late_ops: int
    delivered_by_topic: dict[str, int]
    oldest_pending_age_ms: int | None
    duration_ms: int
    run_number: int
    rejected_halves: int = 0
    #: the earliest now_ms at which a pending message becomes due for a check
    #: or a discard under this run's rules (None: nothing pending)
    next_due_ms: int | None = None
    #: True when nothing was new and nothing due: only the run record was written
    idle: bool = False
    dry_run: bool = False
    #: run_id of an interrupted run this invocation completed first, if any
    redone_run_id: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)


# --- notebook / library entry point -----------------------------------------

def reconcile(spark, config: Config | dict, now_ms: int | None = None, *,
              dry_run: bool = False, lease: Lease | None = None,
              clock=time.time) -> RunSummary:
    """Run the job once (after completing an interrupted run, if any).

    `now_ms` fixes the clock of every time rule (default: the wall clock).
    `lease`: one already acquired by the caller (the CLI takes it before
    starting Spark); otherwise the run acquires and releases its own, with
    `clock` as the lease's wall clock. Raises LeaseHeld when another run
    holds the lease.
    """
    cfg = as_config(config)
    if now_ms is not None and (not isinstance(now_ms, int) or now_ms < 0):
        raise ConfigError(f"now_ms must be a non-negative integer (ms); got {now_ms!r}")
    use_warehouse(spark, cfg)
    if dry_run:
        return _dry_run(spark, cfg, now_ms)
    own = lease is None
    if own:
        lease = Lease(cfg.warehouse, cfg.lease_ttl_s, clock=clock).acquire()
    crashed = False
    try:
        fault_point("after_lease")
        with lease.renewed():
            return _locked_run(spark, cfg, now_ms, lease)
    except InjectedFault:
        crashed = True  # behave as a killed process: the lease stays until it expires
        raise
    finally:
        if own and not crashed:
            lease.release()


def recover(spark, config: Config | dict, *, clock=time.time) -> RunSummary | None:
    """Only complete an interrupted run, if there is one (its summary, else None)."""
    cfg = as_config(config)
    use_warehouse(spark, cfg)
    lease = Lease(cfg.warehouse, cfg.lease_ttl_s, clock=clock).acquire()
    try:
        _ensure_tables(cfg.warehouse)
        last = state.last_run(cfg.warehouse)
        if last is None or last.status != RunStatus.STARTED:
            return None
        with lease.renewed():
            return _execute(spark, cfg.warehouse, last, lease, redo=True).summary
    finally:
        lease.release()


def _locked_run(spark, cfg: Config, now_ms: int | None, lease: Lease) -> RunSummary:
    wh = cfg.warehouse
    _ensure_tables(wh)
    last = state.last_run(wh)
    redone = None
    if last is not None and last.status == RunStatus.STARTED:
        # Same input versions, state versions, clock and rules as the first
        # attempt: the writes it made are skipped, the others done.
        last = _execute(spark, wh, last, lease, redo=True).record
        redone = last.run_id
    intent = _new_intent(spark, wh, last, cfg, now_ms)
    lease.keep_alive()
    if _nothing_to_do(last, intent):
        summary = _record_idle_run(wh, last, intent)
    else:
        state.write_run_record(wh, intent)
        fault_point("after_intent")
        summary = _execute(spark, wh, intent, lease).summary
    summary.redone_run_id = redone
    if intent.run_number % state.COMPACT_EVERY_RUNS == 0:
        lease.keep_alive()
        state.compact_job_tables(spark, wh)
    return summary


def _nothing_to_do(last: state.RunRecord | None, intent: state.RunRecord) -> bool:
    """No input table has a new version since `last`, its rules are the same,
    and its pending set has nothing due at the intent's clock: a full run
    would write nothing but its run records."""
    if last is None or last.status != RunStatus.COMMITTED:
        return False
    unchanged = ((last.half_version, last.op_version, last.answers_version)
                 == (intent.half_version, intent.op_version, intent.answers_version))
    same_rules = T.Rules.from_json(last.rules_json).same_rules(
        T.Rules.from_json(intent.rules_json))
    pending, due = last.counters.get("pending_after"), last.counters.get("next_due_ms")
    nothing_due = pending == 0 or (due is not None and intent.now_ms < due)
    return unchanged and same_rules and nothing_due


def idle_ahead(config: Config | dict, now_ms: int | None = None) -> bool:
    """Whether the next run would have nothing to do, judged from the Delta logs
    alone (delta-rs), so before any JVM starts. Only a prediction: data that
    arrives between this call and the run makes a full run, as it should."""
    cfg = as_config(config)
    use_warehouse(None, cfg)
    last = state.last_run(cfg.warehouse)
    if last is None:
        return False
    intent = _new_intent(None, cfg.warehouse, last, cfg, now_ms)
    return (_nothing_to_do(last, intent)
            and intent.run_number % state.COMPACT_EVERY_RUNS != 0)


def _record_idle_run(wh: str, last: state.RunRecord,
                     intent: state.RunRecord) -> RunSummary:
    """The run record of a run with nothing to do, written as one COMMITTED
    row: with no other write there is nothing for an intent to make atomic."""
    started = time.time()
    prev = last.counters
    oldest = prev.get("oldest_pending_age_ms")
    summary = RunSummary(
        run_id=intent.run_id, now_ms=intent.now_ms, half_read=0, op_read=0,
        pending_before=prev["pending_after"], pending_after=prev["pending_after"],
        committed=0, rolled_back=0, check_requests=0, discarded_max_checks=0,
        discarded_expired=0, duplicate_ops=0, conflicting_ops=0, invalid_ops=0, late_ops=0,
        delivered_by_topic={},
        # the same messages, older by the time since the last run
        oldest_pending_age_ms=(None if oldest is None
                               else max(oldest + intent.now_ms - last.now_ms, 0)),
        duration_ms=0, run_number=intent.run_number, **intent.input_versions(),
        next_due_ms=prev.get("next_due_ms"), idle=True)
    summary.duration_ms = int((time.time() - started) * 1000)
    _commit(wh, intent, summary)
    return summary


def _dry_run(spark, cfg: Config, now_ms: int | None) -> RunSummary:
    last = state.last_run(cfg.warehouse)
    record = (last if last is not None and last.status == RunStatus.STARTED
              else _new_intent(spark, cfg.warehouse, last, cfg, now_ms))
    summary = _execute(spark, cfg.warehouse, record, lease=None, write=False).summary
    summary.dry_run = True
    return summary


def _ensure_tables(warehouse: str) -> None:
    if not state.is_delta(table_path(warehouse, HALF)):
        from txn_core.tables import ensure_broker_tables
        ensure_broker_tables(warehouse)
    state.ensure_job_tables(warehouse)


def _new_intent(spark, wh: str, last: state.RunRecord | None, cfg: Config,
                now_ms: int | None) -> state.RunRecord:
    paths = state.input_paths(wh)
    # OPs first, halves after: every OP read then has its half in the half
    # snapshot, because a producer writes an OP only after its half is durable.
    op_v = state.latest_version(paths["op"])
    half_v = state.latest_version(paths["half"])
    answers_v = state.latest_version(paths["answers"])
    versions = {t.path: state.latest_version(table_path(wh, t))
                for t in state.STATE_TABLES}
    number = (last.run_number if last else 0) + 1
    now = int(time.time() * 1000) if now_ms is None else now_ms
    run_id = f"run-{number:08d}-{now}"
    rules = T.Rules.from_config(cfg, run_id=run_id, run_number=number, now_ms=now)
    nothing = state.NO_VERSION
    return state.RunRecord(
        run_id=run_id, run_number=number, status=RunStatus.STARTED, now_ms=now,
        started_ms=int(time.time() * 1000),
        half_version=half_v, op_version=op_v, answers_version=answers_v,
        prev_half_version=last.half_version if last else nothing,
        prev_op_version=last.op_version if last else nothing,
        prev_answers_version=last.answers_version if last else nothing,
        state_versions=versions, rules_json=rules.to_json())


# --- one run ---------------------------------------------------------------

@dataclass
class _Outputs:
    """The run's output tables but the topics, `_sys/queues` and
    `_sys/resolved` (whose writes `_compute` starts) as DataFrames, and its
    counters."""

    requests: object
    discards: object
    rejected: object
    pending: object
    counts: dict = field(default_factory=dict)
    delivered_by_topic: dict = field(default_factory=dict)


@dataclass
class _Executed:
    record: state.RunRecord
    summary: RunSummary


def _execute(spark, wh: str, record: state.RunRecord, lease: Lease | None,
             write: bool = True, redo: bool = False) -> _Executed:
    """Compute the run of `record` and, if `write`, write it; `redo`: a
    crashed attempt of this run may have written some of its tables."""
    started = time.time()
    rules = T.Rules.from_json(record.rules_json)
    held = Held()
    writes = _Writes(record.run_number, lease, redo) if write else None
    try:
        out = _compute(spark, wh, record, rules, held, writes)
        if writes is not None:
            _write_outputs(wh, out, writes)
        summary = _summary(record, out, int((time.time() - started) * 1000))
        if write:
            lease.keep_alive()
            record = _commit(wh, record, summary)
        return _Executed(record, summary)
    finally:
        if writes is not None:
            writes.close()  # before the kept rows they read are freed
        held.release()


def _compute(spark, wh: str, record: state.RunRecord, rules: T.Rules, held: Held,
             writes: "_Writes | None") -> _Outputs:
    """The run's outputs (`jobs.transforms`' docstring has the order).

    The rules run on the messages' keys; the keys, the classified OPs and
    the decisions on the undecided messages are each computed once and kept
    (`jobs.held`), and the counters are taken while they are
    (`jobs.counters`). Once the OPs are classified, the winners say all the
    writes of deliveries need: each queue's count (`T.queue_ends`: the
    topics to write, the next queues) and, placed in their queues, the rows
    the topics' write joins with their bodies (one pass, however many
    topics). The messages not delivered (pending, checked, discarded: few)
    are joined with their bodies by a pass of their own, kept when more
    than one table takes rows from it. Keeping the delivered rows with their
    bodies instead, to write them from there, cost ~0.5 s more of a
    million-message run on 2 cores than reading the bodies twice. Each write
    starts as soon as its rows are known (`writes`) and runs beside the
    rest. No `writes` (a dry run): the counters only, the bodies are never
    read.
    """
    writing = writes is not None
    paths = state.input_paths(wh)
    ops = state.added_rows(spark, paths["op"], state.OP, record.prev_op_version,
                           record.op_version)
    half = state.added_rows(spark, paths["half"], HALF, record.prev_half_version,
                            record.half_version, keep_slow=held.cache)
    answers = state.added_rows(spark, paths["answers"], state.CHECK_ANSWERS,
                               record.prev_answers_version, record.answers_version)
    pending_prev = state.read_state(spark, wh, record.state_versions, PENDING)
    queues = state.read_state(spark, wh, record.state_versions, QUEUES)

    counted = Counters()
    checked = T.with_reject_reason(half)
    _, rejected_halves = T.split_halves(checked, rules)
    accepted, _ = T.split_halves(counted.halves(checked), rules)
    live = held.checkpoint(T.message_keys(
        T.live_messages(counted.pending(pending_prev), accepted, rules)))
    # the messages again, for the bodies of those decided, without the
    # observations (counted once) or the checks: a rejected half has no fate
    messages = T.live_messages(pending_prev, half, rules)
    no_history = T.history_targets(state.empty(spark, RESOLVED), state.empty(spark, DISCARD))
    classified = held.checkpoint(counted.ops(
        T.classify_ops(ops, T.op_targets(live, no_history), discards=False)))
    classified, discard_hist = _with_history(spark, wh, record, classified, held, counted)
    c = counted.values()
    won = T.winners(classified)
    # before any write: Spark gives a job's tasks the cores in the order
    # the jobs came, and this small one would wait for a write's
    queue_ends = sorted(tuple(row) for row in T.queue_ends(won, queues).collect())
    delivered_by_topic = _delivered_by_topic(queue_ends)
    if writing and delivered_by_topic:  # a few rows, written first for the same reason
        writes.start(T.next_queues(queues, _queue_ends_frame(spark, queue_ends), rules)
                     .coalesce(1), table_path(wh, QUEUES), QUEUES.path, "overwrite")
    if writing and (c["committed"] or c["rolled_back"]):
        writes.start(T.resolved_rows(won, rules), table_path(wh, RESOLVED), RESOLVED.path,
                     "append")
    known = T.known_messages(messages, discard_hist)
    if writing and delivered_by_topic:  # the biggest write: started before the others are planned
        delivered = T.with_bodies(T.queue_positions(won, queues), known,
                                  broadcast=c["committed"] <= BROADCAST_MAX_ROWS)
        _start_deliveries(wh, T.deliveries(delivered, rules), delivered_by_topic, writes)
    few_won = c["committed"] + c["rolled_back"] <= BROADCAST_MAX_ROWS
    undecided = T.remaining_pending(live, won, broadcast=few_won)
    decided = held.checkpoint(counted.fates(
        T.decide(T.apply_answers(undecided, answers), rules), rules))
    c = {k: v for k, v in counted.values().items() if not k.startswith("_")}
    # no new version: nothing to count, and no Spark job to wait for
    c["answers_read"] = (answers.count() if record.answers_version > record.prev_answers_version
                         else 0)
    undelivered = T.with_bodies(decided, known,
                                broadcast=_undelivered_rows(c) <= BROADCAST_MAX_ROWS)
    if writing and len(_tables_of_undelivered(c)) > 1:
        undelivered = held.checkpoint(undelivered)

    def with_decision(*decisions: str):
        return undelivered.where(F.col("decision").isin(*decisions))

    return _Outputs(
        requests=T.check_requests(with_decision(Decision.CHECK), rules),
        discards=T.discards(with_decision(Decision.EXPIRED, Decision.MAX_CHECKS), rules),
        rejected=rejected_halves.unionByName(T.op_rejections(classified, rules)),
        pending=T.next_pending(with_decision(Decision.CHECK, Decision.WAIT), rules),
        counts=c, delivered_by_topic=delivered_by_topic)


def _undelivered_rows(c: dict) -> int:
    """How many messages this run discards or keeps pending: its fates but deliveries."""
    return c["pending_after"] + c["discarded_max_checks"] + c["discarded_expired"]


def _tables_of_undelivered(c: dict) -> list[str]:
    """The tables this run writes from the messages it does not deliver."""
    wanted = {CHECK_REQUESTS.path: c["check_requests"],
              DISCARD.path: c["discarded_max_checks"] or c["discarded_expired"],
              PENDING.path: _pending_changed(c)}
    return [table for table, written in wanted.items() if written]


def _with_history(spark, wh: str, record: state.RunRecord, classified, held: Held,
                  counted: Counters):
    """(`classified` (`T.classify_ops` against the live messages), corrected
    for the OPs that match no live message by what the resolved and discard
    tables say of their messages; the discard rows read: an ADMIN OP may
    deliver a discarded message).

    Usually there are no such OPs (`counted` says so), and the history is
    not read at all; otherwise only the files whose statistics may hold
    their offsets.
    """
    if not counted.values()["_unknown_offset_ops"]:
        return classified, state.empty(spark, DISCARD)
    keys = [r[0] for r in T.unmatched_op_keys(classified).collect()]
    resolved = state.read_state(spark, wh, record.state_versions, RESOLVED)
    discarded = state.read_state(spark, wh, record.state_versions, DISCARD)
    wanted = local_frame(spark, [(k,) for k in keys], _HALF_OFFSETS)
    if len(keys) <= HISTORY_IN_LIST_MAX:
        resolved = resolved.where(resolved.half_offset.isin(keys))
        discarded = discarded.where(discarded.half_offset.isin(keys))
    else:
        resolved = resolved.join(wanted, "half_offset", "left_semi")
        discarded = discarded.join(wanted, "half_offset", "left_semi")
    history = T.history_targets(resolved, discarded)
    reclassified = T.reclassify_with_history(classified, wanted, history)
    return held.checkpoint(counted.ops(reclassified)), discarded


def _delivered_by_topic(queue_ends: list[tuple]) -> dict[str, int]:
    by_topic: dict[str, int] = {}
    for topic, _queue_id, n, _last in queue_ends:
        by_topic[topic] = by_topic.get(topic, 0) + n
    return dict(sorted(by_topic.items()))


def _queue_ends_frame(spark, queue_ends: list[tuple]):
    """`T.queue_ends` as the rows `T.next_queues` takes (the last
    delivered queue_offset of each queue)."""
    return local_frame(spark, [(t, q, last) for t, q, _n, last in queue_ends], _QUEUE_ENDS)


class _Writes:
    """The run's table writes, each started as soon as its rows are known,
    several at a time (`PARALLEL_WRITES`).

    The writes are independent — each is one tagged commit, skipped on a
    redo that finds it, and the intent makes them one run — so they need no
    order. Each costs a Delta commit's round trips besides its rows; on 2
    local cores overlapping them saved ~10 % (11.4 s -> 10.2 s at 100,000
    messages), on object storage the round trips weigh more.
    """

    def __init__(self, run_number: int, lease: Lease, redo: bool) -> None:
        self._put_args = (run_number, lease, redo)
        self._pool = ThreadPoolExecutor(PARALLEL_WRITES, thread_name_prefix="write")
        self._started: list = []

    def start(self, df, path: str, app: str, mode: str) -> None:
        self.submit(_put, df, path, app, mode)

    def submit(self, put, *args) -> None:
        """Run `put(*args, run_number, lease, redo)` beside the other writes."""
        self._raise_first_error(finished_only=True)  # a crashed write stops the run here
        self._started.append(self._pool.submit(put, *args, *self._put_args))

    def finish(self) -> None:
        """Wait for every write; raise the first that failed."""
        self.close()
        self._raise_first_error()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _raise_first_error(self, finished_only: bool = False) -> None:
        errors = [f.exception() for f in self._started
                  if (f.done() or not finished_only) and f.exception() is not None]
        if errors:  # a crash point or a lost lease first: they say why the run stopped
            raise next((e for e in errors if isinstance(e, (InjectedFault, LeaseLost))),
                       errors[0])


def _start_deliveries(wh: str, delivered, topics, writes: _Writes) -> None:
    """Start writing `delivered` (TOPIC rows with their `topic`) to the
    tables of `topics`: in one Spark job when `jobs.commits` can write them
    all (`_put_deliveries`), else one write per topic."""
    paths = {topic: state.ensure_topic_table(wh, topic)  # creating one is a commit too
             for topic in topics}
    tables = state.split_tables(delivered, "topic", paths)
    if tables is not None:
        writes.submit(_put_deliveries, delivered, tables)
        return
    for topic, path in paths.items():
        writes.start(delivered.where(F.col("topic") == topic).drop("topic"), path,
                     f"topics/{topic}", "append")


def _write_outputs(wh: str, out: _Outputs, writes: _Writes) -> None:
    """Write every output table of the run but those `_compute` started
    (`_sys/queues`, `_sys/resolved`, the topics), and wait for all."""
    for df, path, app, mode in _output_writes(wh, out):
        writes.start(df, path, app, mode)
    writes.finish()


def _output_writes(wh: str, out: _Outputs) -> list[tuple]:
    """(DataFrame, table path, app id, save mode) of each table this run
    changes, but those `_compute` starts."""
    c = out.counts
    frames = {CHECK_REQUESTS: (out.requests, "append"), DISCARD: (out.discards, "append"),
              PENDING: (out.pending, "overwrite")}
    writes = [(df, table_path(wh, table), table.path, mode)
              for table, (df, mode) in frames.items()
              if table.path in _tables_of_undelivered(c)]
    if c["rejected_halves"] or c["invalid_ops"] or c["late_ops"]:
        writes.append((out.rejected, table_path(wh, REJECTED), REJECTED.path, "append"))
    return writes


def _put(df, path: str, app: str, mode: str, run_number: int, lease: Lease,
         redo: bool) -> None:
    lease.keep_alive()  # never write once another run may have taken over
    state.write_for_run(df, path, run_number, app, mode=mode, redo=redo)
    fault_point(f"after:{app}")


def _put_deliveries(delivered, tables: dict, run_number: int, lease: Lease,
                    redo: bool) -> None:
    """Each topic's rows of `delivered` appended to its table (`tables`,
    `state.split_tables`): all of them written by one Spark job, then one
    tagged commit per topic. A redo writes only the topics its crashed
    attempt did not commit."""
    apps = {topic: f"topics/{topic}" for topic in tables}
    todo = {topic: table for topic, table in tables.items()
            if not (redo and state.committed_by_run(table.table_uri, run_number, apps[topic]))}
    if not todo:
        return
    lease.keep_alive()  # never write once another run may have taken over
    append = state.split_commits(delivered, "topic", todo)
    for topic in sorted(todo):
        lease.keep_alive()
        append[topic](state.run_tag(run_number, apps[topic]))
        fault_point(f"after:{apps[topic]}")


def _pending_changed(c: dict) -> bool:
    """Whether the pending set differs from the one read (else keep the table as is)."""
    return any(c[k] for k in ("half_read", "committed", "rolled_back", "check_requests",
                              "discarded_max_checks", "discarded_expired", "answers_read"))


def _summary(record: state.RunRecord, out: _Outputs, duration_ms: int) -> RunSummary:
    c = out.counts
    names = {f.name for f in fields(RunSummary)}
    values = {k: v for k, v in c.items() if k in names}
    return RunSummary(
        run_id=record.run_id, now_ms=record.now_ms, delivered_by_topic=out.delivered_by_topic,
        duration_ms=duration_ms, run_number=record.run_number, **record.input_versions(),
        **values)


def _commit(wh: str, record: state.RunRecord, summary: RunSummary) -> state.RunRecord:
    d = summary.to_dict()
    done = state.RunRecord(**{**record.__dict__, "status": RunStatus.COMMITTED,
                              "ended_ms": int(time.time() * 1000),
                              "counters": d, "delivered_by_topic": summary.delivered_by_topic,
                              "summary_json": summary.to_json()})
    state.write_run_record(wh, done)
    fault_point("after_commit")
    return done


# --- command line ------------------------------------------------------------

_RULE_FLAGS = ("transaction_timeout_ms", "check_max", "check_interval_ms", "reserved_hours",
               "max_checks_per_run", "check_budget", "lease_ttl_s")
#: the object store's settings (docs/operating.md, "A warehouse on S3")
_STORE_FLAGS = {"s3_endpoint": str, "s3_region": str, "s3_path_style": "bool",
                "s3_allow_http": "bool"}


def _boolean(text: str) -> bool:
    value = {"true": True, "false": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--conf", help="TOML configuration file (SPEC §4)")
    common.add_argument("--warehouse", help="root of all tables (overrides file and env)")
    for key in _RULE_FLAGS:
        kind = str if key == "check_budget" else int
        common.add_argument("--" + key.replace("_", "-"), type=kind, default=None,
                            help=f"override configuration key {key}")
    for key, store_kind in _STORE_FLAGS.items():
        common.add_argument("--" + key.replace("_", "-"), default=None,
                            type=_boolean if store_kind == "bool" else str,
                            metavar="true|false" if store_kind == "bool" else None,
                            help=f"override configuration key {key}")
    parser = argparse.ArgumentParser(
        prog="txn-reconcile",
        description="Reconciliation job for transactional messages on Delta Lake")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", parents=[common], help="one reconciliation run")
    run.add_argument("--now-ms", type=int, help="the clock of every time rule (ms)")
    run.add_argument("--dry-run", action="store_true",
                     help="compute and print the summary; write nothing, take no lease")
    status = sub.add_parser("status", parents=[common], help="report the pending set")
    status.add_argument("--now-ms", type=int, help="the clock for pending ages (ms)")
    sub.add_parser("verify", parents=[common], help="full audit of the tables (SPEC §6)")
    resolve = sub.add_parser("resolve", parents=[common],
                             help="operator decision for one transaction (an ADMIN OP)")
    resolve.add_argument("--transaction-id", required=True)
    decision = resolve.add_mutually_exclusive_group(required=True)
    decision.add_argument("--commit", action="store_true")
    decision.add_argument("--rollback", action="store_true")
    resolve.add_argument("--remark")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.conf, warehouse=args.warehouse,
                          **{k: getattr(args, k) for k in (*_RULE_FLAGS, *_STORE_FLAGS)})
        # An object store is checked before the lease or Spark: exit 2 names what is wrong.
        use_warehouse(None, cfg)
        return _COMMANDS[args.command](args, cfg)
    except ConfigError as exc:
        return _fail(EXIT_USAGE, f"bad configuration: {exc}")
    except LeaseHeld as exc:
        return _fail(EXIT_LEASE_HELD, str(exc))
    except Exception as exc:  # noqa: BLE001 — the exit code contract: 1 and the reason
        return _fail(EXIT_FAILURE, f"{type(exc).__name__}: {exc}")


def _fail(code: int, message: str) -> int:
    print(f"txn-reconcile: {message}", file=sys.stderr)
    return code


def _spark(*, short_lived: bool = False):
    from jobs.session import build_spark
    return build_spark("txn-reconcile", short_lived=short_lived)


def _cmd_run(args, cfg: Config) -> int:
    if args.now_ms is not None and args.now_ms < 0:
        raise ConfigError(f"--now-ms must be a non-negative integer; got {args.now_ms}")
    # The lease comes before Spark starts, so an overlapping run exits 75 in a second.
    lease = None if args.dry_run else Lease(cfg.warehouse, cfg.lease_ttl_s).acquire()
    crashed = False
    try:
        # A run with nothing to do writes one row: a JVM tuned to start fast
        # (see build_spark) saves seconds of it. Any full run gets the default.
        spark = _spark(short_lived=not args.dry_run and _predict_idle(cfg, args.now_ms))
        summary = reconcile(spark, cfg, args.now_ms, dry_run=args.dry_run, lease=lease)
    except InjectedFault:
        crashed = True
        raise
    finally:
        if lease is not None and not crashed:
            lease.release()
    print(summary.to_json(), flush=True)
    return EXIT_OK


def _predict_idle(cfg: Config, now_ms: int | None) -> bool:
    """`idle_ahead`, or False when the tables cannot tell: the prediction only
    picks the JVM's options, and the run itself reports any real problem."""
    try:
        return idle_ahead(cfg, now_ms)
    except Exception:  # noqa: BLE001
        return False


def _cmd_status(args, cfg: Config) -> int:
    from jobs.status import status
    report = status(_spark(), cfg, now_ms=args.now_ms)
    print(json.dumps(report.to_dict()), flush=True)
    return EXIT_OK


def _cmd_verify(args, cfg: Config) -> int:
    from jobs.verify import verify
    report = verify(_spark(), cfg)
    print(json.dumps(report.to_dict(), default=str), flush=True)
    readable = getattr(report, "to_text", None)
    print(readable() if callable(readable) else str(report), file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_FAILURE


def _cmd_resolve(args, cfg: Config) -> int:
    from txn_core import Broker
    broker = Broker.open(cfg)
    try:
        broker.resolve(args.transaction_id, commit=args.commit, remark=args.remark)
    finally:
        broker.close()
    print(json.dumps({"transaction_id": args.transaction_id,
                      "action": Action.COMMIT if args.commit else Action.ROLLBACK,
                      "source": Source.ADMIN, "remark": args.remark}), flush=True)
    return EXIT_OK


_COMMANDS = {"run": _cmd_run, "status": _cmd_status, "verify": _cmd_verify,
             "resolve": _cmd_resolve}


def cli() -> None:
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The exit code is the contract (SPEC §5.1), and the interpreter's teardown
    # can abort inside delta-rs' runtime ("terminate called without an active
    # exception", SIGABRT), turning 75 into -6: everything is written and
    # printed by now, so end the process here. (Spark's JVM exits when its
    # gateway pipe closes.)
    os._exit(code)


if __name__ == "__main__":
    cli()
