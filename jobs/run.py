"""A run's lifecycle: the lease, the redo of an unfinished run, the intent,
the outputs (`jobs.pipeline`), the COMMITTED record.

A run, under the job's lease (exit 75 when another run holds it):
  1. if the latest run has an intent but no COMMITTED record, redoes exactly
     that run (same input versions, state versions, clock and rules);
  2. records its intent (STARTED row of `_sys/runs`);
  3. computes its outputs and writes each table in a commit tagged with its run
     number (`jobs.writes`), then the COMMITTED row.
A crash between two writes leaves an intent that step 1 completes, skipping the
writes whose tagged commit it finds (I4, `tagged_writes.write_for_run`). A dry
run computes the run that would be done next and writes nothing.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields

from jobs import appends, inputs, job_tables, run_log, scheduled
from jobs import transforms as T
from jobs.faults import InjectedFault, fault_point
from jobs.held import Held
from jobs.interpreted import interpreted_if_small
from jobs.lease import Lease
from jobs.pipeline import Outputs, compute, write_outputs
from jobs.session import strict_reads, use_warehouse
from jobs.writes import RunWrites
from schemas import HALF, RUNS, table_path
from txn_core.config import Config, ConfigError, as_config
from txn_core.vocabulary import RunStatus

__all__ = ["RunSummary", "idle_ahead", "reconcile", "recover", "rows_ahead"]


@dataclass
class RunSummary(run_log.InputVersions):
    """The counters (docs/protocol.md §4.5) of one run, plus the input versions it read."""

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
    #: plain messages read (and delivered) by this run, counted in `committed` too
    plain: int = 0
    #: the earliest now_ms at which a pending message becomes due for a check
    #: or a discard under this run's rules, or a scheduled message due for
    #: delivery (None: nothing pending or scheduled)
    next_due_ms: int | None = None
    #: the run's watermark: the latest clock of the runs so far (delayed
    #: messages due at or before it are delivered)
    watermark_ms: int = -1
    #: delayed plain messages this run read and scheduled (not due yet)
    scheduled: int = 0
    #: scheduled messages this run delivered (counted in `committed` too)
    delivered_scheduled: int = 0
    #: cancels of delayed messages this run applied (`_sys/cancelled`)
    cancelled: int = 0
    #: the scheduled set after this run: how many wait, and the earliest due time
    scheduled_after: int = 0
    next_scheduled_ms: int | None = None
    #: True when nothing was new and nothing due: only the run record was written
    idle: bool = False
    dry_run: bool = False
    #: run_id of an interrupted run this invocation completed first, if any
    redone_run_id: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)


#: a clock further ahead of the wall clock than this is taken for a typo
NOW_MS_AHEAD_MAX_MS = 366 * 86_400_000
_INT64_MAX = 2**63 - 1


def check_now_ms(now_ms: object, wall_ms: int | None, name: str = "now_ms") -> None:
    """`now_ms` (None: the wall clock's, later) refused (ConfigError naming
    `name`) unless an integer from 0 to 2^63-1 and, given the wall clock
    `wall_ms` (a run's), at most a year after it: a run's clock becomes the
    warehouse's watermark, which never goes back, so one run far in the
    future would make every later run take delayed messages for due and
    pending ones for expired, for good."""
    if now_ms is None:
        return
    if not isinstance(now_ms, int) or isinstance(now_ms, bool) or not 0 <= now_ms <= _INT64_MAX:
        raise ConfigError(f"{name} must be an integer from 0 to 2^63-1 (ms); got {now_ms!r}")
    if wall_ms is not None and now_ms > wall_ms + NOW_MS_AHEAD_MAX_MS:
        raise ConfigError(
            f"{name} {now_ms} is more than a year after this machine's clock ({wall_ms}): a "
            "run's clock becomes the warehouse's watermark, which never goes back, so every "
            "later run would deliver delayed messages at once and expire pending ones; check "
            "the value (milliseconds since the epoch)"
        )


def reconcile(
    spark,
    config: Config | dict,
    now_ms: int | None = None,
    *,
    dry_run: bool = False,
    lease: Lease | None = None,
    clock=time.time,
) -> RunSummary:
    """Run the job once (after completing an interrupted run, if any).

    `now_ms` fixes the clock of every time rule (default: the wall clock).
    `lease`: one already acquired by the caller (the CLI takes it before
    starting Spark); otherwise the run acquires and releases its own, with
    `clock` as the lease's wall clock. Raises LeaseHeld when another run
    holds the lease.
    """
    cfg = as_config(config)
    check_now_ms(now_ms, int(clock() * 1000))
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
        last = run_log.last_run(cfg.warehouse)
        if last is None or last.status != RunStatus.STARTED:
            return None
        with lease.renewed():
            return _execute(spark, cfg, last, lease, redo=True).summary
    finally:
        lease.release()


def _locked_run(spark, cfg: Config, now_ms: int | None, lease: Lease) -> RunSummary:
    wh = cfg.warehouse
    _ensure_tables(wh)
    last = run_log.last_run(wh)
    redone = None
    if last is not None and last.status == RunStatus.STARTED:
        # Same input versions, state versions, clock and rules as the first
        # attempt: the writes it made are skipped, the others done.
        last = _execute(spark, cfg, last, lease, redo=True).record
        redone = last.run_id
    started = time.time()
    intent = _new_intent(spark, wh, last, cfg, now_ms)
    lease.keep_alive()
    if _nothing_to_do(last, intent):
        summary = _record_idle_run(wh, last, intent, lease, started)
    else:
        run_log.write_run_record(wh, intent, lease)
        fault_point("after_intent")
        summary = _execute(spark, cfg, intent, lease, pending=_pending_after(last)).summary
    summary.redone_run_id = redone
    chores = job_tables.upkeep_due(intent.run_number)
    if chores:
        lease.keep_alive()
        if "scheduled" in chores:
            scheduled.upkeep(wh, summary.watermark_ms)
        tables = tuple(t for t in job_tables.APPEND_ONLY_TABLES if t.path in chores)
        job_tables.compact_job_tables(wh, tables)
        # the run records' compaction leaves files behind, as the lease's changes do
        if RUNS.path in chores:
            job_tables.vacuum_every_run_tables(wh, lease)
        if "topics" in chores:
            job_tables.keep_topic_log_retention(wh, cfg.topic_log_retention_hours)
            job_tables.compact_topics(wh)
    return summary


def _nothing_to_do(last: run_log.RunRecord | None, intent: run_log.RunRecord) -> bool:
    """No input table has a new version since `last`, its rules are the same,
    and its pending set has nothing due at the intent's clock: a full run
    would write nothing but its run records."""
    if last is None or last.status != RunStatus.COMMITTED:
        return False
    unchanged = (last.half_version, last.op_version, last.answers_version) == (
        intent.half_version,
        intent.op_version,
        intent.answers_version,
    )
    same_rules = T.Rules.from_json(last.rules_json).same_rules(T.Rules.from_json(intent.rules_json))
    pending, due = last.counters.get("pending_after"), last.counters.get("next_due_ms")
    waiting = run_log.decode_json(last.summary_json).get("scheduled_after", 0)
    # next_due_ms covers the scheduled set's earliest due time too
    nothing_due = (pending == 0 and not waiting) or (due is not None and intent.now_ms < due)
    return unchanged and same_rules and nothing_due


def idle_ahead(config: Config | dict, now_ms: int | None = None) -> bool:
    """Whether the next run would have nothing to do, judged from the Delta logs
    alone (delta-rs), so before any JVM starts. Only a prediction: data that
    arrives between this call and the run makes a full run, as it should."""
    cfg = as_config(config)
    use_warehouse(None, cfg)
    last = run_log.last_run(cfg.warehouse)
    if last is None:
        return False
    intent = _new_intent(None, cfg.warehouse, last, cfg, now_ms)
    return _nothing_to_do(last, intent) and not job_tables.upkeep_due(intent.run_number)


def rows_ahead(config: Config | dict, now_ms: int | None = None) -> int | None:
    """How many rows the next run would read, judged from the Delta logs
    alone (delta-rs), before any JVM starts: the half and OP rows added
    since the last run (their files' statistics) and the messages it left
    pending. None when the logs cannot tell, or the last run is unfinished
    (the next one redoes it first). A prediction, like `idle_ahead`."""
    cfg = as_config(config)
    use_warehouse(None, cfg)
    last = run_log.last_run(cfg.warehouse)
    if last is not None and last.status != RunStatus.COMMITTED:
        return None
    intent = _new_intent(None, cfg.warehouse, last, cfg, now_ms)
    return _rows_read(cfg.warehouse, intent, _pending_after(last))


def _rows_read(wh: str, record: run_log.RunRecord, pending: int | None) -> int | None:
    """The rows the run of `record` reads: the half and OP rows its versions
    add (their files' statistics) and the `pending` messages the last run
    left; None when the logs cannot tell or `pending` is None."""
    if pending is None:
        return None
    paths = inputs.input_paths(wh)
    new = [
        appends.appended_rows(paths["half"], record.prev_half_version, record.half_version),
        appends.appended_rows(paths["op"], record.prev_op_version, record.op_version),
    ]
    return None if None in new else sum(n for n in new if n is not None) + pending


def _pending_after(last: run_log.RunRecord | None) -> int | None:
    """The messages `last` left pending (none before the first run); None if it never finished."""
    if last is None:
        return 0
    if last.status != RunStatus.COMMITTED:
        return None
    return int(last.counters.get("pending_after") or 0)


def _record_idle_run(
    wh: str, last: run_log.RunRecord, intent: run_log.RunRecord, lease: Lease, started: float
) -> RunSummary:
    """The run record of a run with nothing to do, written as one COMMITTED
    row: with no other write there is nothing for an intent to make atomic.
    Its duration runs from `started`, before its inputs were looked at (the
    work an idle run does), to the record (which cannot time its own commit)."""
    prev = last.counters
    carried = run_log.decode_json(last.summary_json)
    oldest = prev.get("oldest_pending_age_ms")
    summary = RunSummary(
        run_id=intent.run_id,
        now_ms=intent.now_ms,
        half_read=0,
        op_read=0,
        pending_before=prev["pending_after"],
        pending_after=prev["pending_after"],
        committed=0,
        rolled_back=0,
        check_requests=0,
        discarded_max_checks=0,
        discarded_expired=0,
        duplicate_ops=0,
        conflicting_ops=0,
        invalid_ops=0,
        late_ops=0,
        delivered_by_topic={},
        # the same messages, older by the time since the last run
        oldest_pending_age_ms=(
            None if oldest is None else max(oldest + intent.now_ms - last.now_ms, 0)
        ),
        duration_ms=0,
        run_number=intent.run_number,
        **intent.input_versions(),
        next_due_ms=prev.get("next_due_ms"),
        idle=True,
        watermark_ms=T.Rules.from_json(intent.rules_json).watermark_ms,
        scheduled_after=carried.get("scheduled_after", 0),
        next_scheduled_ms=carried.get("next_scheduled_ms"),
    )
    summary.duration_ms = int((time.time() - started) * 1000)
    _commit(wh, intent, summary, lease)
    return summary


def _dry_run(spark, cfg: Config, now_ms: int | None) -> RunSummary:
    last = run_log.last_run(cfg.warehouse)
    record = (
        last
        if last is not None and last.status == RunStatus.STARTED
        else _new_intent(spark, cfg.warehouse, last, cfg, now_ms)
    )
    summary = _execute(spark, cfg, record, lease=None, write=False).summary
    summary.dry_run = True
    return summary


def _ensure_tables(warehouse: str) -> None:
    if not job_tables.is_delta(table_path(warehouse, HALF)):
        from txn_core.tables import ensure_broker_tables

        ensure_broker_tables(warehouse)
    job_tables.ensure_job_tables(warehouse)


def _new_intent(
    spark, wh: str, last: run_log.RunRecord | None, cfg: Config, now_ms: int | None
) -> run_log.RunRecord:
    paths = inputs.input_paths(wh)
    # OPs first, halves after: every OP read then has its half in the half
    # snapshot, because a producer writes an OP only after its half is durable.
    op_v = job_tables.latest_version(paths["op"])
    half_v = job_tables.latest_version(paths["half"])
    answers_v = job_tables.latest_version(paths["answers"])
    versions = job_tables.latest_versions(wh, job_tables.STATE_TABLES)
    number = (last.run_number if last else 0) + 1
    now = int(time.time() * 1000) if now_ms is None else now_ms
    run_id = f"run-{number:08d}-{now}"
    rules = T.Rules.from_config(cfg, run_id=run_id, run_number=number, now_ms=now, **_carried(last))
    nothing = job_tables.NO_VERSION
    return run_log.RunRecord(
        run_id=run_id,
        run_number=number,
        status=RunStatus.STARTED,
        now_ms=now,
        started_ms=int(time.time() * 1000),
        half_version=half_v,
        op_version=op_v,
        answers_version=answers_v,
        prev_half_version=last.half_version if last else nothing,
        prev_op_version=last.op_version if last else nothing,
        prev_answers_version=last.answers_version if last else nothing,
        state_versions=versions,
        rules_json=rules.to_json(),
    )


def _carried(last: run_log.RunRecord | None) -> dict:
    """What a run takes over from the last one besides its input versions:
    its watermark (a run recorded before watermarks: its clock) and the
    size of the scheduled set."""
    if last is None:
        return {}
    summary = run_log.decode_json(last.summary_json)
    watermark = summary.get("watermark_ms")
    if watermark is None:
        watermark = max(T.Rules.from_json(last.rules_json).watermark_ms, last.now_ms)
    return {"prev_watermark_ms": watermark, "scheduled_before": summary.get("scheduled_after", 0)}


@dataclass
class _Executed:
    record: run_log.RunRecord
    summary: RunSummary


def _execute(
    spark,
    cfg: Config,
    record: run_log.RunRecord,
    lease: Lease | None,
    write: bool = True,
    redo: bool = False,
    pending: int | None = None,
) -> _Executed:
    """Compute the run of `record` and, if `write`, write it; `redo`: a
    crashed attempt of this run may have written some of its tables;
    `pending`: how many messages the last run left pending, if known (a
    small run runs interpreted, `jobs.interpreted`)."""
    started = time.time()
    wh = cfg.warehouse
    rules = T.Rules.from_json(record.rules_json)
    held = Held()
    writes = (
        RunWrites(record.run_number, lease, redo, cfg.max_body_bytes, cfg.topic_log_retention_hours)
        if write
        else None
    )
    small_run = interpreted_if_small(spark, _rows_read(wh, record, pending))
    with appends.log_entries_kept(), strict_reads(spark), small_run as small:
        try:
            out = compute(spark, wh, record, rules, held, writes, small=small)
            if writes is not None:
                write_outputs(wh, out, writes)
            summary = _summary(record, out, int((time.time() - started) * 1000))
            if write:
                lease.keep_alive()
                record = _commit(wh, record, summary, lease)
            return _Executed(record, summary)
        finally:
            if writes is not None:
                writes.close()  # before the kept rows they read are freed
            held.release()


def _summary(record: run_log.RunRecord, out: Outputs, duration_ms: int) -> RunSummary:
    c = out.counts
    names = {f.name for f in fields(RunSummary)}
    values = {k: v for k, v in c.items() if k in names}
    return RunSummary(
        run_id=record.run_id,
        now_ms=record.now_ms,
        watermark_ms=T.Rules.from_json(record.rules_json).watermark_ms,
        delivered_by_topic=out.delivered_by_topic,
        duration_ms=duration_ms,
        run_number=record.run_number,
        **record.input_versions(),
        **values,
    )


def _commit(
    wh: str, record: run_log.RunRecord, summary: RunSummary, lease: Lease | None
) -> run_log.RunRecord:
    d = summary.to_dict()
    done = run_log.RunRecord(
        **{
            **record.__dict__,
            "status": RunStatus.COMMITTED,
            "ended_ms": int(time.time() * 1000),
            "counters": d,
            "delivered_by_topic": summary.delivered_by_topic,
            "summary_json": summary.to_json(),
        }
    )
    run_log.write_run_record(wh, done, lease)
    fault_point("after_commit")
    return done
