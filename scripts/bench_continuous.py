"""Benchmark of the continuous job (a script printing figures, not a test).

One warm SparkSession runs `reconcile_forever` at a cadence on a local
warehouse. After every other run, N new messages arrive (written with
delta-rs in one batch, every one committed), so the runs alternate between
a run over N new messages and an idle one. Printed: each run's wall time
(the `reconcile` call, lease renewal and run records included), and the
medians of both kinds after the first `--warm-up` runs (the JVM compiles
Spark's hot code during the first runs of a session), and the busy runs'
median by blocks of `--block` runs, which shows how far into a session
the runs keep getting faster.

`--long-topic-logs K` gives each topic's log K more (empty) entries after
the first run, as hours of busy runs leave them (a topic's log keeps
`topic_log_retention_hours`; the job keeps its own tables' logs short):
run it with and without, in the same hour, for what a long log costs a run.

    python scripts/bench_continuous.py --new 1000 --runs 24
    python scripts/bench_continuous.py --new 2000 --runs 400 --warm-up 300 --block 50
    python scripts/bench_continuous.py --new 2000 --runs 80 --warm-up 40 --long-topic-logs 10000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_reconcile import fill


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--new", type=int, default=1000, help="N, new messages before every other run")
    p.add_argument("--runs", type=int, default=24, help="runs in all")
    p.add_argument("--warm-up", type=int, default=8, help="first runs left out of the medians")
    p.add_argument("--every", type=float, default=0.2, help="the cadence, seconds")
    p.add_argument("--body-bytes", type=int, default=100)
    p.add_argument("--block", type=int, default=20, help="runs per block of the by-block medians")
    p.add_argument(
        "--long-topic-logs",
        type=int,
        default=0,
        metavar="K",
        help="K more log entries for each topic after the first run",
    )
    args = p.parse_args(argv)
    if args.long_topic_logs < 0:
        p.error(f"--long-topic-logs must be 0 or more, got {args.long_topic_logs}")
    if args.block < 2:
        p.error(f"--block must be at least 2 (a block holds busy and idle runs), got {args.block}")

    import jobs.continuous as continuous
    from jobs.session import build_spark

    spark = build_spark("bench-continuous")
    warehouse = tempfile.mkdtemp(prefix="bench-continuous-")
    fill(warehouse, 0, 1_000, args.body_bytes, _now() - 60_000, leave_pending=False)
    walls: list[float] = []
    runs: list[tuple] = []
    stop = threading.Event()
    next_offset = [1_000]
    timed_run = continuous.reconcile

    def reconcile(*a, **k):
        started = time.perf_counter()
        summary = timed_run(*a, **k)
        walls.append(time.perf_counter() - started)
        return summary

    def on_run(summary) -> None:
        runs.append((summary.run_number, summary.half_read, summary.idle, walls[-1]))
        if len(runs) == 1 and args.long_topic_logs:
            _lengthen_topic_logs(warehouse, args.long_topic_logs)
        if len(runs) % 2 == 1:
            fill(
                warehouse,
                next_offset[0],
                args.new,
                args.body_bytes,
                _now() - 60_000,
                leave_pending=False,
            )
            next_offset[0] += args.new
        if len(runs) >= args.runs:
            stop.set()

    continuous.reconcile = reconcile  # the loop's own calls, timed
    try:
        continuous.reconcile_forever(
            spark, {"warehouse": warehouse}, args.every, stop=stop, on_run=on_run
        )
    finally:
        continuous.reconcile = timed_run
        spark.stop()
        shutil.rmtree(warehouse, ignore_errors=True)
    for number, read, idle, wall in runs:
        kind = "idle" if idle else f"{read:,} new half rows"
        print(f"run {number:3d}: {wall * 1000:7.0f} ms  {kind}")
    measured = runs[args.warm_up :]
    busy = [w for _, _, idle, w in measured if not idle]
    idle = [w for _, _, i, w in measured if i]
    print(
        f"cores = {os.cpu_count()}, cadence {args.every} s, {args.new:,} new messages before every "
        f"other run, {args.long_topic_logs:,} more entries in each topic's log, "
        f"medians after the first {args.warm_up} runs:"
    )
    if busy:
        print(f"run over {args.new:,} new messages: {median(busy) * 1000:7.0f} ms")
    if idle:
        print(f"idle run                    : {median(idle) * 1000:7.0f} ms")
    print(f"runs over {args.new:,} new messages, median by blocks of {args.block} runs:")
    for start in range(0, len(runs), args.block):
        block = [w for _, _, i, w in runs[start : start + args.block] if not i]
        if block:
            print(
                f"  runs {start + 1:4d}-{start + len(runs[start : start + args.block]):4d}: "
                f"{median(block) * 1000:7.0f} ms"
            )


def _lengthen_topic_logs(warehouse: str, entries: int) -> None:
    """Append `entries` commits without actions to each topic's log, then a
    checkpoint: the log a reader lists, not one it replays."""
    from deltalake import DeltaTable

    root = os.path.join(warehouse, "topics")
    entry = json.dumps({"commitInfo": {"timestamp": _now(), "operation": "WRITE"}}) + "\n"
    for topic in sorted(os.listdir(root)):
        log_dir = os.path.join(root, topic, "_delta_log")
        table = DeltaTable(os.path.join(root, topic))
        for version in range(table.version() + 1, table.version() + 1 + entries):
            with open(os.path.join(log_dir, f"{version:020d}.json"), "w") as f:
                f.write(entry)
        table.update_incremental()
        table.create_checkpoint()
    print(f"each topic's log given {entries:,} more entries", flush=True)


def _now() -> int:
    return int(time.time() * 1000)


if __name__ == "__main__":
    main()
