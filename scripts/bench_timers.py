"""Benchmark of delayed messages in the reconciliation job (a script printing
figures, not a test): does a run's cost follow what is due and new, not
what waits?

In one invocation, one SparkSession, on local disk:
  1. `base`: a warehouse whose scheduled set is empty; B new messages
     (bench_reconcile's mix: 85 % commit, 10 % roll back, 5 % pending)
     are then reconciled by a run at clock NOW + 1 % of the spread: the
     run with no timers at all;
  2. `timers`: the same, after T timers (plain messages, `deliver_at_ms`
     spread evenly over SPREAD = 24 h of clock) were scheduled by a run
     at NOW (unmeasured): the measured run reads the same B new messages
     and delivers the 1 % of the timers its clock makes due;
  3. the lower bound for the rows run 2 delivers: Spark reading the B new
     half + OP rows as the job reads them and the due rows of
     `_sys/scheduled` (its `due_ms` filter, file statistics skipping the
     rest), and writing all the delivered rows once, to one table; and,
     for comparison, run 1's own (the B new rows only).
Each run is done once unmeasured on a copy of its warehouse, then
--repeats times measured, each on a fresh copy; the lower bound
alternates with run 2. Targets: run 2 / run 1 <= 1.3, run 2 / lower
bound <= 3.

    python scripts/bench_timers.py                       # T = 1,000,000, B = 100,000
    python scripts/bench_timers.py --timers 100000 --batch 10000 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from functools import partial
from statistics import median

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import write_deltalake

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_reconcile import CHUNK, NOW, TOPICS, _delivered_rows, _topic_like_table, fill, timed
from jvm_cpu import CpuAccount

from schemas import HALF, table_path
from schemas.arrow import arrow_schema
from schemas.tables import SCHEDULED
from txn_core.tables import ensure_broker_tables

SPREAD_MS = 24 * 3_600_000
#: the share of the timers the measured run's clock makes due
DUE_SHARE = 0.01


def timer_batch(start: int, n: int, total: int, body_bytes: int) -> pa.Table:
    """Plain messages stored at NOW - 1 whose deliver_at_ms are spread evenly
    over (NOW, NOW + SPREAD_MS], offsets from `start` (of `total` timers)."""
    idx = range(start, start + n)
    off = pa.array([(1 << 41) + i for i in idx], pa.int64())
    strings = pc.cast(off, pa.string())
    props = pa.MapArray.from_arrays(
        pa.array(range(0, 2 * n + 1, 2), pa.int32()),
        pa.array(["k", "n"] * n),
        pa.array(["v", "x"] * n),
    )
    cols = {
        "half_offset": off,
        "transaction_id": pc.binary_join_element_wise("tm-", strings, ""),
        "msg_id": pc.binary_join_element_wise("tm-", strings, ""),
        "producer_group": pa.array(["bench_group"] * n),
        "topic": pa.array([TOPICS[i % len(TOPICS)] for i in idx]),
        "queue_id": pa.array([i % 8 for i in idx], pa.int32()),
        "tags": pa.array(["t"] * n),
        "keys": pc.binary_join_element_wise("k-", strings, ""),
        "body": pa.array([b"x" * body_bytes] * n, pa.binary()),
        "properties": props,
        "born_ms": pa.array([NOW - 2] * n, pa.int64()),
        "store_ms": pa.array([NOW - 1] * n, pa.int64()),
        "check_immunity_s": pa.nulls(n, pa.int32()),
        "message_type": pa.array(["NORMAL"] * n),
        # a permutation of the due times: the half table is not sorted by them
        "deliver_at_ms": pa.array(
            [NOW + 1 + (i * 7919 % total) * SPREAD_MS // total for i in idx], pa.int64()
        ),
    }
    return pa.table(cols, schema=arrow_schema(HALF))


def add_timers(warehouse: str, total: int, body_bytes: int) -> None:
    ensure_broker_tables(warehouse)
    for s in range(0, total, CHUNK):
        write_deltalake(
            table_path(warehouse, HALF),
            timer_batch(s, min(CHUNK, total - s), total, body_bytes),
            mode="append",
        )


def lower_bound(
    spark, warehouse: str, half_v: int, op_v: int, sched_v: int | None, now: int, out: str
):
    """Read the B new rows and the due scheduled ones (none: `sched_v`
    None) as the job reads them (the files whose statistics may hold due
    rows, as parquet), write what is delivered once, to one table."""
    from jobs.inputs import read_scheduled, state_version_key
    from schemas.spark import spark_schema

    _topic_like_table(spark, out)

    def rows():  # the files listed inside the timing, as the job's run lists them
        new = _delivered_rows(spark, warehouse, half_v, op_v)
        if sched_v is None:
            return new
        due = (
            read_scheduled(spark, warehouse, {state_version_key(SCHEDULED): sched_v}, NOW, now)
            .where(f"due_ms > {NOW} AND due_ms <= {now}")
            .select(*spark_schema(HALF).fieldNames()[:-2])
        )
        return new.unionByName(due, allowMissingColumns=True)

    return timed(lambda: rows().write.format("delta").mode("append").save(out))[0]


def _all(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.2f}" for v in values) + "]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--timers", type=int, default=1_000_000, help="T, timers waiting")
    p.add_argument("--batch", type=int, default=100_000, help="B, new messages of the run")
    p.add_argument("--body-bytes", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from jobs.job_tables import latest_version
    from jobs.reconcile import reconcile
    from jobs.session import build_spark

    root = tempfile.mkdtemp(prefix="bench-timers-")
    spark = build_spark("bench-timers")
    now = NOW + int(SPREAD_MS * DUE_SHARE)
    try:
        base, timers = f"{root}/base", f"{root}/timers"
        for wh in (base, timers):
            os.makedirs(wh)
        warm = f"{root}/warm"
        os.makedirs(warm)
        fill(warm, 0, 1_000, args.body_bytes, NOW - 1, True)
        reconcile(spark, {"warehouse": warm}, now_ms=NOW)

        # the scheduled set: T timers read and scheduled by a run at NOW
        add_timers(timers, args.timers, args.body_bytes)
        t_schedule, first = timed(lambda: reconcile(spark, {"warehouse": timers}, now_ms=NOW))
        assert first.scheduled == args.timers, first
        reconcile(spark, {"warehouse": base}, now_ms=NOW)  # a first run (empty) for both
        base_half_v = latest_version(table_path(base, HALF))
        base_op_v = latest_version(f"{base}/_sys/op")
        half_v = latest_version(table_path(timers, HALF))
        op_v = latest_version(f"{timers}/_sys/op")
        sched_v = latest_version(table_path(timers, SCHEDULED))
        for wh in (base, timers):
            fill(wh, 10**9, args.batch, args.body_bytes, NOW + 1000, True)

        cpu = CpuAccount(spark)  # where run 2's CPU goes, and its lower bound's

        def run(wh: str, tag: str, cpu_of: str | None = None) -> tuple[float, object]:
            copy = f"{root}/{tag}"
            shutil.copytree(wh, copy)
            try:
                once = partial(timed, lambda: reconcile(spark, {"warehouse": copy}, now_ms=now))
                return cpu.call(cpu_of, once) if cpu_of else once()
            finally:
                shutil.rmtree(copy)

        first_base, _ = run(base, "base-first")
        first_timers, s = run(timers, "timers-first")
        lower_bound(spark, timers, half_v, op_v, sched_v, now, f"{root}/lower-warm")
        t_base, t_timers, t_lower, t_base_lower = [], [], [], []
        for r in range(args.repeats):
            t_base.append(run(base, f"base-{r}")[0])
            t_base_lower.append(
                lower_bound(spark, base, base_half_v, base_op_v, None, now, f"{root}/bl-{r}")
            )
            t, s = run(timers, f"timers-{r}", cpu_of="run 2")
            t_timers.append(t)
            out = f"{root}/lower-{r}"
            t_lower.append(
                cpu.call(
                    "lower bound",
                    partial(lower_bound, spark, timers, half_v, op_v, sched_v, now, out),
                )
            )
        due = s.delivered_scheduled
        print(
            f"T = {args.timers:,} timers over 24 h, B = {args.batch:,} new messages, "
            f"body {args.body_bytes} B, cores = {os.cpu_count()}; medians of {args.repeats}"
        )
        print(f"scheduling the T timers (one run, unmeasured below): {t_schedule:.1f} s")
        print(
            f"run 1, no timers             : {median(t_base):6.2f} s  {_all(t_base)} "
            f"(first {first_base:.2f} s)"
        )
        print(
            f"run 2, {due:,} timers due ({DUE_SHARE:.0%}): {median(t_timers):6.2f} s  "
            f"{_all(t_timers)} (first {first_timers:.2f} s; delivered {s.committed:,})"
        )
        print(
            f"run 2 / run 1                : {median(t_timers) / median(t_base):6.2f}"
            "   (target <= 1.3)"
        )
        print(f"lower bound (read, write once): {median(t_lower):6.2f} s  {_all(t_lower)}")
        print(
            f"run 2 / lower bound          : {median(t_timers) / median(t_lower):6.2f}"
            "   (target <= 3)"
        )
        for line in cpu.lines(width=11):
            print(f"  {line}")
        print(
            f"for comparison, run 1 / its own lower bound (read B, write once, "
            f"{median(t_base_lower):.2f} s {_all(t_base_lower)}): "
            f"{median(t_base) / median(t_base_lower):.2f}"
        )
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
