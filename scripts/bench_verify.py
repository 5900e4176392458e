"""Benchmark of `verify`, the full audit (a script printing figures, not a test).

In one invocation and one SparkSession:
  1. a warehouse of N messages (85 % commit, 10 % roll back, 5 % pending),
     written with delta-rs in big batches, and one run of the job over it;
  2. `verify` once unmeasured (the session's first audit: the JVM compiles
     Spark's code for it), then --repeats times measured, each one printed,
     with the report's verdict (it must be OK).
The same warehouse audited again shows the audit's own cost: it writes nothing.

    python scripts/bench_verify.py --messages 300000
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_reconcile import NOW, fill


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=300_000, help="N, messages in the warehouse")
    p.add_argument("--body-bytes", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="measured audits")
    args = p.parse_args(argv)

    from jobs.reconcile import reconcile
    from jobs.session import build_spark
    from jobs.verify import verify

    root = tempfile.mkdtemp(prefix="bench-verify-")
    warehouse = os.path.join(root, "warehouse")
    fill(warehouse, 0, args.messages, args.body_bytes, NOW - 10_000, leave_pending=True)
    spark = build_spark("bench-verify")
    try:
        reconcile(spark, {"warehouse": warehouse}, now_ms=NOW)
        times = []
        for i in range(args.repeats + 1):
            t = time.perf_counter()
            report = verify(spark, {"warehouse": warehouse})
            took = time.perf_counter() - t
            if not report.ok:
                raise SystemExit(f"verify found differences:\n{report.render()}")
            label = "first (unmeasured)" if i == 0 else f"repeat {i}"
            print(f"verify {label:<18}: {took:6.2f} s  ({report.counts['halves_judged']:,} judged)")
            if i:
                times.append(took)
        print(f"N = {args.messages:,} messages, cores = {os.cpu_count()}")
        print(f"verify median of {args.repeats}: {median(times):.2f} s")
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
