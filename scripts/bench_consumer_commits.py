"""Benchmark of a consumer group's commits as its offsets table ages (a
script printing figures, not a test).

A member commits to `_sys/consumer_offsets` at every poll that moves an
offset. In one invocation, for each variant, a fresh warehouse with one
topic of --commits messages and one member that polls one message and
commits it, --commits times:

  by hand    as the consumer is: each commit one parquet file and one log
             entry (`txn_core.blind_append`, through
             `txn_core.consumer_group._AppendedTable`), the member writing
             the checkpoints and trimming the log behind them
  delta-rs   the same through delta-rs's append (the code before
             2026-12-07, afternoon), whose cost grows with the table's files

Prints each variant's median commit time by block of --block commits and
the log entries left at the end. With --maintain-every K, a third variant:
by hand, with `maintain_consumer_tables` run after every K commits (not
timed). With --read-at N,M,…: after N, M, … commits by hand (no
maintenance), how long `read_committed_offsets` takes, and a second
member's join and first poll (what grows with the tables' files).

    python scripts/bench_consumer_commits.py --commits 1500 --maintain-every 250
    python scripts/bench_consumer_commits.py --commits 0 --read-at 100,900,3600
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _topic(warehouse: str, messages: int) -> None:
    """One commit of `messages` rows in queue 0 of topic ORDER."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from schemas import TOPIC, topic_path
    from schemas.arrow import arrow_schema

    rows = [
        {
            "queue_id": 0,
            "queue_offset": n,
            "msg_id": f"msg-{n}",
            "transaction_id": f"tx-{n}",
            "half_offset": n,
            "producer_group": "bench",
            "tags": None,
            "keys": None,
            "body": b"x" * 100,
            "properties": [],
            "born_ms": 1,
            "commit_ms": 2,
            "delivered_ms": 3,
            "run_id": "run-1",
        }
        for n in range(messages)
    ]
    write_deltalake(
        topic_path(warehouse, "ORDER"),
        pa.Table.from_pylist(rows, schema=arrow_schema(TOPIC)),
        mode="append",
    )


def _run(
    commits: int, block: int, by_hand: bool, maintain_every: int = 0
) -> tuple[list[float], int]:
    """Median commit ms per block, and the offsets log's entries at the end."""
    from schemas import CONSUMER_OFFSETS, HALF, table_path
    from txn_core import Consumer, consumer_group
    from txn_core.maintenance import maintain_consumer_tables
    from txn_core.tables import open_or_create

    root = tempfile.mkdtemp(prefix="bench-consumer-commits-")
    reason = consumer_group.unsupported_reason
    try:
        if not by_hand:
            consumer_group.unsupported_reason = lambda *args: "the benchmark's delta-rs variant"
        open_or_create(root, HALF)  # a warehouse, as producers leave it
        _topic(root, commits)
        consumer = Consumer(root, "bench", "ORDER")
        times: list[float] = []
        for n in range(commits):
            if maintain_every and n and n % maintain_every == 0:
                maintain_consumer_tables(root, int(time.time() * 1000))
            if len(consumer.poll(1)) != 1:
                raise SystemExit("bench_consumer_commits: a poll found no message")
            started = time.perf_counter()
            consumer.commit()
            times.append((time.perf_counter() - started) * 1000)
        consumer.close()
        log_dir = os.path.join(table_path(root, CONSUMER_OFFSETS), "_delta_log")
        entries = sum(1 for name in os.listdir(log_dir) if name.endswith(".json"))
        blocks = [median(times[i : i + block]) for i in range(0, len(times), block)]
        return blocks, entries
    finally:
        consumer_group.unsupported_reason = reason
        shutil.rmtree(root, ignore_errors=True)


def _reads(points: list[int]) -> None:
    """Prints the reads' times after each number of commits in `points`."""
    from schemas import HALF
    from txn_core import Consumer
    from txn_core.consumer_group import read_committed_offsets
    from txn_core.tables import open_or_create

    root = tempfile.mkdtemp(prefix="bench-consumer-reads-")
    try:
        open_or_create(root, HALF)
        _topic(root, max(points))
        consumer, done = Consumer(root, "bench", "ORDER", member="committer"), 0
        for point in points:
            while done < point:
                consumer.poll(1)
                consumer.commit()
                done += 1
            started = time.perf_counter()
            read_committed_offsets(root, "bench", "ORDER")
            read_ms = (time.perf_counter() - started) * 1000
            started = time.perf_counter()
            joiner = Consumer(root, "bench", "ORDER", member=f"joiner-{point}")
            joiner.poll(1)
            join_ms = (time.perf_counter() - started) * 1000
            joiner.close()
            print(
                f"after {point:>6} commits: read_committed_offsets {read_ms:7.1f} ms, "
                f"a second member's join and first poll {join_ms:7.1f} ms",
                flush=True,
            )
        consumer.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--commits", type=int, default=10_000, help="commits per variant")
    p.add_argument("--block", type=int, default=1_000, help="commits per printed median")
    p.add_argument(
        "--maintain-every", type=int, default=0, help="K: also the variant maintained every K"
    )
    p.add_argument(
        "--read-at", default="", help="N,M,…: time the reads after that many commits by hand"
    )
    args = p.parse_args(argv)
    if args.commits < 0 or args.block < 1 or args.maintain_every < 0:
        p.error("--block must be positive, --commits and --maintain-every not negative")
    try:
        points = sorted({int(n) for n in args.read_at.split(",") if n.strip()})
    except ValueError:
        p.error(f"--read-at must be commit counts separated by commas, got {args.read_at!r}")
    if any(n < 1 for n in points):
        p.error(f"--read-at counts must be positive, got {args.read_at!r}")
    if points:
        _reads(points)
    if not args.commits:
        return
    variants = [("by hand", True, 0), ("delta-rs", False, 0)]
    if args.maintain_every:
        variants.append(("maintained", True, args.maintain_every))
    for name, trimmed, every in variants:
        blocks, entries = _run(args.commits, args.block, trimmed, every)
        figures = ", ".join(f"{ms:.1f}" for ms in blocks)
        print(f"{name:>10}: commit ms by block of {args.block}: {figures}", flush=True)
        print(f"{name:>10}: offsets log entries at the end: {entries}", flush=True)


if __name__ == "__main__":
    main()
