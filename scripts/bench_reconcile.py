"""Benchmark of the reconciliation job (a script printing figures, not a test).

In one invocation:
  1. a run over B new messages on an empty warehouse (H = 0);
  2. a run over B new messages after a history of H = 10 x B resolved ones;
     the ratio 2/1 shows whether the run scales with what is new, not with history
     (target <= 1.3). Each run is done once unmeasured on a copy of its
     warehouse (its first time, printed too), then --repeats times measured,
     each on a fresh copy (the last run over B, H = 0, in place);
  3. the lower bound: Spark reading the same B new half + OP rows (as the job
     reads them, jobs.appends) and writing the delivered rows once, all to
     one table: once unmeasured, then --repeats times, each right after a
     measured run of 2; ratio of the medians run/lower bound (target <= 3),
     and each repetition's; and the same rows each written to its topic's
     table (the job's 4 topics: 4 tables), which is what delivering them
     takes at least (its second time);
  4. the wall time of `txn-reconcile run` with nothing new, Spark start included,
     in a fresh process (target <= 20 s);
  5. a small run: SMALL new messages on the warehouse of run 1, in the same
     session: the near-fixed cost a frequent schedule (cron every minute) pays.
With --s3-loopback (or --warehouse s3://… and the endpoint settings) all of it
is measured on local disk and then on the object store, in one invocation and
one SparkSession, and the object store's figures are printed as ratios to
local disk's.
Runs 1-3 share one SparkSession, warmed up first by a run over 1,000 messages
and then by the run that resolves the history (before run 1: a cold JVM
compiles Spark's hot code during its first big run, which would otherwise be
charged to run 1 alone). --warm-runs N adds N runs over --warm-batch new
messages, each on a fresh copy of one warehouse, before the history: the
session as a continuous job's is after minutes of runs, its planner's code
compiled by the JIT (the default, 0, measures a session's first big runs,
while the JIT is still compiling it).
Producer rows are written with delta-rs in big batches (no broker core;
--rows-per-commit, 250,000 by default: a run's new rows in one file per
table), with the mix: 85 % commit, 10 % roll back, 5 % stay pending.

    python scripts/bench_reconcile.py --batch 200000
    python scripts/bench_reconcile.py --batch 200000 --s3-loopback
    python scripts/bench_reconcile.py --batch 200000 --warm-runs 20 --warm-batch 200000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from functools import partial
from statistics import median

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jvm_cpu import CpuAccount

from schemas import HALF, OP, table_path
from schemas.arrow import arrow_schema
from schemas.spark import spark_schema
from txn_core.storage import options_for
from txn_core.tables import ensure_broker_tables

from bench_store import Store, add_arguments, stores_from_args

TOPICS = ("ORDER", "PAY", "SHIP", "BILL")
SMALL = 50
CHUNK = 250_000
NOW = 10**12


def _strings(prefix: str, offsets: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise(prefix, pc.cast(offsets, pa.string()), "")


def half_batch(start: int, n: int, body_bytes: int, store_ms: int) -> pa.Table:
    idx = range(start, start + n)
    off = pa.array(idx, pa.int64())
    props = pa.MapArray.from_arrays(
        pa.array(range(0, 2 * n + 1, 2), pa.int32()),
        pa.array(["k", "n"] * n),
        pa.array(["v", "x"] * n),
    )
    cols = {
        "half_offset": off,
        "transaction_id": _strings("tx-", off),
        "msg_id": _strings("msg-", off),
        "producer_group": pa.array(["bench_group"] * n),
        "topic": pa.array([TOPICS[i % len(TOPICS)] for i in idx]),
        "queue_id": pa.array([i % 8 for i in idx], pa.int32()),
        "tags": pa.array(["t"] * n),
        "keys": _strings("k-", off),
        "body": pa.array([b"x" * body_bytes] * n, pa.binary()),
        "properties": props,
        "born_ms": pa.array([store_ms - 1] * n, pa.int64()),
        "store_ms": pa.array([store_ms] * n, pa.int64()),
        "check_immunity_s": pa.nulls(n, pa.int32()),
        "message_type": pa.nulls(n, pa.string()),  # transactional
        "deliver_at_ms": pa.nulls(n, pa.int64()),  # not delayed
    }
    return pa.table(cols, schema=arrow_schema(HALF))


def op_batch(start: int, n: int, store_ms: int, pending: bool) -> pa.Table:
    """OPs for a batch: offset % 20 == 0 stays pending (if asked), 1 and 2 roll back."""
    decided = [i for i in range(start, start + n) if not (pending and i % 20 == 0)]
    off = pa.array(decided, pa.int64())
    m = len(decided)
    cols = {
        "op_offset": pa.array([i + (1 << 40) for i in decided], pa.int64()),
        "half_offset": off,
        "transaction_id": _strings("tx-", off),
        "producer_group": pa.array(["bench_group"] * m),
        "action": pa.array(["ROLLBACK" if i % 20 in (1, 2) else "COMMIT" for i in decided]),
        "source": pa.array(["PRODUCER"] * m),
        "store_ms": pa.array([store_ms + 1] * m, pa.int64()),
        "remark": pa.nulls(m, pa.string()),
    }
    return pa.table(cols, schema=arrow_schema(OP))


def fill(
    warehouse: str,
    start: int,
    n: int,
    body_bytes: int,
    store_ms: int,
    leave_pending: bool,
    rows_per_commit: int = CHUNK,
) -> None:
    """`n` messages from offset `start`: their half rows, then their OPs, in
    commits of `rows_per_commit` rows each."""
    ensure_broker_tables(warehouse)
    for s in range(start, start + n, rows_per_commit):
        k = min(rows_per_commit, start + n - s)
        write_deltalake(
            table_path(warehouse, HALF),
            half_batch(s, k, body_bytes, store_ms),
            mode="append",
            storage_options=options_for(warehouse),
        )
    for s in range(start, start + n, rows_per_commit):
        k = min(rows_per_commit, start + n - s)
        write_deltalake(
            table_path(warehouse, OP),
            op_batch(s, k, store_ms, leave_pending),
            mode="append",
            storage_options=options_for(warehouse),
        )


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _topic_like_table(spark, out: str) -> None:
    """An empty table with the half rows' columns, made like a topic table
    (with its file statistics)."""
    from delta.tables import DeltaTable as SparkDeltaTable

    from jobs.job_tables import table_properties
    from schemas import TOPIC

    builder = SparkDeltaTable.createIfNotExists(spark).location(out).addColumns(spark_schema(HALF))
    for key, value in table_properties(TOPIC).items():
        builder = builder.property(key, value)
    builder.execute()


def _delivered_rows(spark, warehouse: str, start_half_v: int, start_op_v: int):
    """The new half rows of the committed messages, read the cheapest way the
    job knows (jobs.appends: as parquet, not through the change feed's
    row-by-row reader)."""
    from jobs.inputs import added_rows
    from jobs.job_tables import latest_version

    half_path, op_path = table_path(warehouse, HALF), table_path(warehouse, OP)
    half = added_rows(spark, half_path, HALF, start_half_v, latest_version(half_path))
    ops = added_rows(spark, op_path, OP, start_op_v, latest_version(op_path))
    return half.join(ops.where("action = 'COMMIT'").select("half_offset"), "half_offset").drop(
        "commit_version"
    )


def lower_bound(spark, warehouse: str, start_half_v: int, start_op_v: int, out: str) -> float:
    """Read B new half + OP rows as the job does, write the delivered rows once,
    all to one table."""
    _topic_like_table(spark, out)
    return timed(
        lambda: _delivered_rows(spark, warehouse, start_half_v, start_op_v)
        .write.format("delta")
        .mode("append")
        .save(out)
    )[0]


def lower_bound_by_topic(
    spark, warehouse: str, start_half_v: int, start_op_v: int, out: str
) -> float:
    """The same, but each row written to its topic's table, as the job must:
    the rows read and joined once and kept, then one write per topic, four at
    a time (as the job writes). What writing to several tables costs beyond
    writing the same rows to one."""
    from concurrent.futures import ThreadPoolExecutor

    from jobs.held import Held

    outs = {topic: f"{out}/{topic}" for topic in TOPICS}
    for path in outs.values():
        _topic_like_table(spark, path)

    def run():
        held = Held()
        kept = held.checkpoint(_delivered_rows(spark, warehouse, start_half_v, start_op_v))
        with ThreadPoolExecutor(4) as pool:
            list(
                pool.map(
                    lambda t: kept.where(kept.topic == t)
                    .write.format("delta")
                    .mode("append")
                    .save(outs[t]),
                    TOPICS,
                )
            )
        held.release()

    return timed(run)[0]


def _all(values: list[float], digits: int = 1) -> str:
    return "[" + ", ".join(f"{v:.{digits}f}" for v in values) + "]"


def measure(spark, store: Store, args) -> dict:
    """Every figure of the module's docstring, on `store`."""
    from jobs.reconcile import reconcile

    b, h = args.batch, args.history_factor * args.batch
    cfg = store.config
    cpu = CpuAccount(spark)  # the measured runs' and lower bounds' CPU by kind
    write = partial(fill, rows_per_commit=args.rows_per_commit)

    def run(warehouse: str, copy: bool = True, cpu_of: str | None = None) -> tuple[float, object]:
        """(seconds, summary) of the run over `warehouse`, or over a copy of
        it, left as it was for the next repetition (the same inputs, the
        same plans)."""
        # A new name each time: Spark's Delta caches each path's log, and a
        # table deleted and made again at the same path would be reported
        # (and read) as the same table changed.
        target = f"{warehouse}-copy-{uuid.uuid4().hex[:8]}" if copy else warehouse
        if copy:
            store.copy(warehouse, target)

        def once():
            return timed(lambda: reconcile(spark, cfg(target), now_ms=NOW + 1000))

        took, summary = cpu.call(cpu_of, once) if cpu_of else once()
        if copy:
            store.remove(target)
        return took, summary

    # Warm the JVM up first (class loading, code generation), so that the
    # first measured run is not charged for it and the ratios compare runs.
    warm = store.warehouse("warm-up")
    write(cfg(warm).warehouse, 0, 1_000, args.body_bytes, NOW, leave_pending=True)
    reconcile(spark, cfg(warm), now_ms=NOW + 1000)
    if args.warm_runs:  # the JIT compiles Spark's planner over dozens of runs
        steady = cfg(store.warehouse("steady")).warehouse
        write(steady, 0, args.warm_batch, args.body_bytes, NOW, leave_pending=True)
        for _ in range(args.warm_runs):
            run(steady)

    # The history's own run comes first: a run over that many rows is also
    # what brings the JVM's compiled code up to speed (a small warm-up does
    # not make the hot paths hot), so both measured runs below find it warm.
    hist = cfg(store.warehouse("history")).warehouse
    write(hist, 0, h, args.body_bytes, NOW - 10_000, leave_pending=False)
    t_build, _ = timed(lambda: reconcile(spark, cfg(hist), now_ms=NOW))

    # Each run once unmeasured (its "first time": it also pays for what
    # Spark compiles or sizes for the first time in the session), then
    # `repeats` times measured, alternated with the lower bound: the JVM's
    # compiler keeps warming up over the first runs of a session, and one
    # measurement of each side, taken at different moments, compared that
    # as much as the two.
    fresh = cfg(store.warehouse("fresh")).warehouse
    write(fresh, 0, b, args.body_bytes, NOW, leave_pending=True)
    t_fresh_1, _ = run(fresh)
    fresh_runs = [run(fresh, copy=r < args.repeats - 1) for r in range(args.repeats)]

    half_v = DeltaTable(table_path(hist, HALF), storage_options=options_for(hist)).version()
    op_v = DeltaTable(table_path(hist, OP), storage_options=options_for(hist)).version()
    write(hist, h, b, args.body_bytes, NOW, leave_pending=True)
    t_hist_1, _ = run(hist)
    lower_bound(spark, hist, half_v, op_v, store.warehouse("lower_bound_warm_up"))
    hist_times, lower_times = [], []
    for r in range(args.repeats):
        hist_times.append(run(hist, cpu_of="run over B after history")[0])
        out = store.warehouse(f"lower_bound-{r}")
        lower = partial(lower_bound, spark, hist, half_v, op_v, out)
        lower_times.append(cpu.call("lower bound", lower))
    lower_bound_by_topic(spark, hist, half_v, op_v, store.warehouse("by_topic_warm_up"))
    t_by_topic = lower_bound_by_topic(spark, hist, half_v, op_v, store.warehouse("by_topic"))

    write(fresh, b, SMALL, args.body_bytes, NOW, leave_pending=True)
    t_small, s_small = timed(lambda: reconcile(spark, cfg(fresh), now_ms=NOW + 1000))
    return {
        "store": store,
        "b": b,
        "h": h,
        "fresh_runs": fresh_runs,
        "fresh_1": t_fresh_1,
        "hist": hist_times,
        "hist_1": t_hist_1,
        "build": t_build,
        "lower": lower_times,
        "by_topic": t_by_topic,
        "small": (t_small, s_small),
        "fresh_warehouse": fresh,
        "cpu": cpu,
    }


def empty_run(store: Store, warehouse: str) -> tuple[float, subprocess.CompletedProcess]:
    """`txn-reconcile run` with nothing new, in a new process."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.reconcile",
            "run",
            "--warehouse",
            warehouse,
            "--now-ms",
            str(NOW + 1000),
            *store.cli_flags(),
        ],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    return time.perf_counter() - t0, done


def report(f: dict, repeats: int) -> dict[str, float]:
    """Print one store's figures; return the headline ones (for the ratios)."""
    t_fresh = median([t for t, _ in f["fresh_runs"]])
    s_fresh = f["fresh_runs"][-1][1]
    t_hist, t_lower = median(f["hist"]), median(f["lower"])
    t_small, s_small = f["small"]
    t_empty, empty = f["empty"]
    h = f["h"]
    print(f"--- {f['store'].name}: {f['store'].root}")
    print(
        f"run over B, H = 0            : {t_fresh:8.1f} s  "
        f"{_all([t for t, _ in f['fresh_runs']])} "
        f"(first time {f['fresh_1']:.1f} s; committed {s_fresh.committed:,}, "
        f"rolled back {s_fresh.rolled_back:,}, pending {s_fresh.pending_after:,})"
    )
    print(
        f"run over B, H = {h:<12,}: {t_hist:8.1f} s  {_all(f['hist'])} "
        f"(first time {f['hist_1']:.1f} s; history run itself {f['build']:.1f} s)"
    )
    print(f"history ratio                : {t_hist / t_fresh:8.2f}   (target <= 1.3)")
    print(f"lower bound (read B, write delivered once): {t_lower:.1f} s  {_all(f['lower'])}")
    print(
        f"run / lower bound            : {t_hist / t_lower:8.2f}   (target <= 3; each "
        f"repetition: {_all([t / lt for t, lt in zip(f['hist'], f['lower'])], 2)}; "
        f"first time / lower bound {f['hist_1'] / t_lower:.2f})"
    )
    for line in f["cpu"].lines(width=24):
        print(f"  {line}")
    print(
        f"the same rows to their {len(TOPICS)} topic tables (2nd time): "
        f"{f['by_topic']:.1f} s; run / that: {t_hist / f['by_topic']:.2f}"
    )
    print(
        f"empty run, new process       : {t_empty:8.1f} s  exit {empty.returncode} (target <= 20 s)"
    )
    print(
        f"small run, {SMALL} new messages  : {t_small:8.1f} s  (after run 1, same session; "
        f"committed {s_small.committed})",
        flush=True,
    )
    if empty.returncode:
        print(empty.stderr[-2000:], file=sys.stderr)
    return {
        "run over B, H = 0": t_fresh,
        "run over B after history": t_hist,
        "lower bound": t_lower,
        "empty run": t_empty,
        "small run": t_small,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=1_000_000, help="B, new messages per run")
    p.add_argument("--history-factor", type=int, default=10, help="H = factor x B")
    p.add_argument("--body-bytes", type=int, default=100)
    p.add_argument(
        "--rows-per-commit",
        type=int,
        default=CHUNK,
        help="rows of each producer commit the benchmark writes (its messages' layout: "
        "fewer, as producers' own batches, make more files and log entries to read)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="measured repetitions of each run and of the lower bound (their medians are compared)",
    )
    p.add_argument(
        "--warm-runs",
        type=int,
        default=0,
        help="runs over --warm-batch new messages before anything is measured (a warm JIT)",
    )
    p.add_argument(
        "--warm-batch",
        type=int,
        default=25_000,
        help="new messages in each of the --warm-runs runs",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    stores, server = stores_from_args(args)

    from jobs.session import build_spark

    try:
        spark = build_spark("bench-reconcile")
        measured = [measure(spark, store, args) for store in stores]
        spark.stop()
        for f in measured:
            f["empty"] = empty_run(f["store"], f["fresh_warehouse"])
        print(
            f"B = {args.batch:,} new messages per run (85% commit, 10% rollback, "
            f"5% pending), H = {args.history_factor * args.batch:,} resolved before, "
            f"body {args.body_bytes} B, {args.rows_per_commit:,} rows per producer commit, "
            f"cores = {os.cpu_count()}"
        )
        print(f"medians of {args.repeats} measured repetitions; all of them in brackets")
        headlines = [report(f, args.repeats) for f in measured]
        if len(headlines) == 2:
            local, remote = headlines
            print("--- object store / local disk, same invocation")
            for key in local:
                print(f"{key:<29}: {remote[key] / local[key]:8.2f}")
    finally:
        for store in stores:
            store.close()
        if server:
            server.stop()


if __name__ == "__main__":
    main()
