#!/usr/bin/env python3
"""Throughput and latency of the broker core's transactional and plain sends.

Flags mirror RocketMQ's own benchmark (example/benchmark/TransactionProducer):
-w threads, -s message size, -t topic, -sr/-su share of sends whose local
transaction rolls back / returns UNKNOWN, -cr/-cu the same for back-check
answers (recorded, used when checks are answered), -i pause between sends.
Beyond RocketMQ's: -d duration, --batch-size for the bulk path, --skip-naive.

In one run it measures, at the same concurrency:
  1. the per-message path with group commit (what TransactionProducer does);
  2. the naive design: one Delta commit per half row and one per OP row;
  3. the batch path (send_batch_in_transaction) with --batch-size messages;
  4. plain sends (Producer.send: a half row, no OP), group-committed;
  5. plain batches (Producer.send_batch) of --batch-size messages, with
     max_batch_bytes raised to fit them (RocketMQ's 4 MiB default holds
     about 2,000 messages of 2 KB).
`--modes` picks some of them (e.g. `--modes plain,plain-batch`).
For the group-commit run it also prints where each table's writer thread
spent the window (`Broker.writer_stats`): inside Delta commits, building
Arrow columns, or idle waiting for rows; and how busy its upkeep thread was.

"Durable" here means committed to a Delta table on the warehouse's storage
(the commit file is in _delta_log). RocketMQ's default broker acknowledges
before fsync (ASYNC_FLUSH); the broker core (like delta-rs) does not fsync on a local disk either,
so the two are comparable on one machine; on S3 a commit is durable in S3.

With `--s3-loopback` (MinIO; `--s3-loopback moto` for moto) or `--warehouse
s3://…` every design is measured twice in one invocation, on a local disk and
on the object store, with the S3 / local ratios and, on a loopback server, the
object-store requests per message it counted; `--threads-list 32,256`
repeats the per-message path per count.

Example:
    python scripts/bench_broker.py -w 256 -s 2048 -d 20
    python scripts/bench_broker.py --s3-loopback --threads-list 32,256 -d 20 --skip-naive
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from txn_core import (
    Broker,
    LocalTransactionState,
    Message,
    Producer,
    TransactionListener,
    TransactionProducer,
)

from bench_store import Store, add_arguments, stores_from_args

COMMIT = LocalTransactionState.COMMIT_MESSAGE
ROLLBACK = LocalTransactionState.ROLLBACK_MESSAGE
UNKNOWN = LocalTransactionState.UNKNOWN


class BenchListener(TransactionListener):
    """Decides as RocketMQ's benchmark does: the intended outcome rides in the body."""

    def __init__(self, check_rollback_rate: float, check_unknown_rate: float):
        self.cr, self.cu = check_rollback_rate, check_unknown_rate

    def execute_local_transaction(self, msg, arg):
        first = msg if isinstance(msg, Message) else msg[0]  # a batch is a sequence
        return (COMMIT, ROLLBACK, UNKNOWN)[first.body[0]]

    def check_local_transaction(self, msg):
        r = random.random()
        return ROLLBACK if r < self.cr else UNKNOWN if r < self.cr + self.cu else COMMIT


def make_body(size: int, rollback_rate: float, unknown_rate: float) -> bytes:
    r = random.random()
    outcome = 1 if r < rollback_rate else 2 if r < rollback_rate + unknown_rate else 0
    return bytes([outcome]) + os.urandom(max(size - 1, 0))


def percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(p * len(sorted_values)))]


def open_broker(store: Store, keys: dict | None = None, **kwargs) -> tuple[Broker, str]:
    """A broker on a fresh warehouse of `store` (configuration `keys` added),
    and that warehouse."""
    warehouse = store.warehouse()
    return Broker.open(store.config(warehouse, **(keys or {})), **kwargs), warehouse


def per_message(counts_before: dict, counts_after: dict, messages: int) -> dict:
    """Object-store requests per message over a window, by kind and in all."""
    diff = {k: counts_after.get(k, 0) - counts_before.get(k, 0) for k in counts_after}
    figures = {f"{k}_per_msg": round(v / messages, 4) for k, v in sorted(diff.items()) if v}
    figures["requests_per_msg"] = round(sum(diff.values()) / messages, 4) if messages else None
    return figures


def run_per_message(
    args, group_commit: bool, duration: float, store: Store, plain: bool = False
) -> dict:
    """Closed-loop senders for `duration` seconds; returns the figures.
    `plain`: `Producer.send` (a half row each, no local transaction, no OP)."""
    keys = {}
    if args.group_commit_interval_ms is not None:
        keys["group_commit_interval_ms"] = args.group_commit_interval_ms
    broker, warehouse = open_broker(store, keys, group_commit=group_commit)
    producer = (
        Producer(broker, "benchmark_producer")
        if plain
        else TransactionProducer(
            broker,
            "benchmark_transaction_producer",
            BenchListener(args.check_rollback_rate, args.check_unknown_rate),
        )
    )
    bodies = [
        make_body(args.message_size, args.send_rollback_rate, args.send_unknown_rate)
        for _ in range(256)
    ]
    stop = threading.Event()
    start = threading.Barrier(args.threads + 1)
    latencies: list[list[float]] = [[] for _ in range(args.threads)]
    failures = [0] * args.threads
    decided = [0] * args.threads

    def sender(i: int) -> None:
        start.wait()
        mine, n = latencies[i], i
        while not stop.is_set():
            t0 = time.perf_counter()
            msg = Message(topic=args.topic, body=bodies[n % len(bodies)])
            try:
                if plain:
                    producer.send(msg)
                else:
                    result = producer.send_message_in_transaction(msg)
            except Exception:  # noqa: BLE001 - counted like RocketMQ's benchmark
                failures[i] += 1
                continue
            if stop.is_set():
                break  # finished after the window closed: not counted
            mine.append(time.perf_counter() - t0)
            decided[i] += plain or result.op_written or result.local_state is UNKNOWN
            n += 1
            if args.interval_ms:
                time.sleep(args.interval_ms / 1000)

    threads = [threading.Thread(target=sender, args=(i,), daemon=True) for i in range(args.threads)]
    [t.start() for t in threads]
    start.wait()
    began = time.perf_counter()
    before, requests_before = broker.writer_stats, store.requests()
    time.sleep(duration)
    stop.set()
    elapsed = time.perf_counter() - began
    requests_after = store.requests()
    window = {table: stats - before[table] for table, stats in broker.writer_stats.items()}
    # The naive design can leave senders retrying their commit long after the
    # window; they are not waited for (nor counted) beyond a grace period.
    deadline = time.perf_counter() + 30
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    stragglers = sum(t.is_alive() for t in threads)
    commits = broker.commit_counts
    if not stragglers:
        broker.close()
        store.remove(warehouse)
    lat = sorted(x for per in latencies for x in per)
    return {
        "store": store.name,
        "design": ("plain sends, " if plain else "")
        + ("group commit" if group_commit else "naive (one commit per row)"),
        "threads": args.threads,
        "messages": len(lat),
        "seconds": round(elapsed, 2),
        **(per_message(requests_before, requests_after, len(lat)) if requests_after else {}),
        "msgs_per_s": round(sum(decided) / elapsed, 1),
        "p50_ms": round(percentile(lat, 0.50) * 1e3, 1),
        "p99_ms": round(percentile(lat, 0.99) * 1e3, 1),
        "max_ms": round((lat[-1] if lat else float("nan")) * 1e3, 1),
        "failures": sum(failures),
        "half_commits": commits["_sys/half"],
        "op_commits": commits["_sys/op"],
        "senders_still_committing_after_window": stragglers,
        **{f"writer {table}": writer_figures(stats, elapsed) for table, stats in window.items()},
    }


def writer_figures(stats, elapsed: float) -> dict:
    """A writer thread's window: commit size and time, its time by activity,
    and how busy its upkeep thread was (checkpoints, compaction, log clean-up)."""

    def share(seconds: float) -> str:
        return f"{100 * seconds / elapsed:.0f}%"

    return {
        "rows_per_commit": round(stats.rows_per_commit, 1),
        "ms_per_commit": round(stats.ms_per_commit, 1),
        "in_commit": share(stats.commit_s),
        "building": share(stats.build_s),
        "idle": share(stats.idle_s),
        "upkeep_beside_it": share(stats.upkeep_s),
        "upkeep_log_races_retried": stats.upkeep_retries,
    }


def run_batches(args, store: Store, plain: bool = False) -> dict:
    """Batches of --batch-size back to back for --batch-duration seconds.
    `plain`: `Producer.send_batch`, with max_batch_bytes raised to fit a batch."""
    body = bytes([0]) + os.urandom(args.message_size - 1)  # every batch commits
    batch = [Message(topic=args.topic, body=body) for _ in range(args.batch_size)]
    limit = max(4 * 1024 * 1024, args.batch_size * args.message_size)
    broker, warehouse = open_broker(store, {"max_batch_bytes": limit} if plain else None)
    producer = (
        Producer(broker, "benchmark_producer")
        if plain
        else TransactionProducer(broker, "benchmark_transaction_producer", BenchListener(0, 0))
    )
    sent, lat = 0, []
    began = time.perf_counter()
    while time.perf_counter() - began < args.batch_duration:
        t0 = time.perf_counter()
        if plain:
            sent += len(producer.send_batch(batch))
        else:
            result = producer.send_batch_in_transaction(batch)
            sent += len(result) if result.op_written else 0
        lat.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - began
    broker.close()
    store.remove(warehouse)
    lat.sort()
    return {
        "store": store.name,
        "design": "plain batches" if plain else "batch path",
        **({"max_batch_bytes": limit} if plain else {}),
        "batch_size": args.batch_size,
        "batches": len(lat),
        "messages": sent,
        "seconds": round(elapsed, 2),
        "msgs_per_s": round(sent / elapsed, 1),
        "p50_batch_ms": round(percentile(lat, 0.5) * 1e3, 1),
        "max_batch_ms": round(lat[-1] * 1e3, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-w", "--threads", type=int, default=32, help="sender threads (32)")
    p.add_argument("-s", "--message-size", type=int, default=2048, help="body bytes (2048)")
    p.add_argument("-t", "--topic", default="BenchmarkTopic")
    p.add_argument("-sr", "--send-rollback-rate", type=float, default=0.0)
    p.add_argument("-su", "--send-unknown-rate", type=float, default=0.0)
    p.add_argument("-cr", "--check-rollback-rate", type=float, default=0.0)
    p.add_argument("-cu", "--check-unknown-rate", type=float, default=0.0)
    p.add_argument("-i", "--interval-ms", type=int, default=0, help="pause between sends")
    p.add_argument("-d", "--duration", type=float, default=20.0, help="seconds per design")
    p.add_argument(
        "--group-commit-interval-ms",
        type=int,
        default=None,
        help="the writers' least time between two commits to a table (default: the config's)",
    )
    p.add_argument("--batch-size", type=int, default=10_000)
    p.add_argument("--batch-duration", type=float, default=10.0)
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, of {', '.join(MODES)} (default: all; naive unless --skip-naive)",
    )
    p.add_argument(
        "--threads-list",
        default=None,
        help="with an object store: comma-separated thread counts (default: -w)",
    )
    add_arguments(p)
    args = p.parse_args(argv)

    print(
        "durable = committed to a Delta table (commit file written to the warehouse's "
        "storage); no fsync on local disk, like RocketMQ's default ASYNC_FLUSH"
    )
    stores, server = stores_from_args(args)
    if len(stores) == 2:
        try:
            compare_stores(args, *stores)
        finally:
            server and server.stop()
        os._exit(0)
    local = stores[0]
    modes = _modes(args)
    grouped = None
    if "transactional" in modes:
        grouped = run_per_message(args, True, args.duration, local)
        print(json.dumps(grouped), flush=True)
    # The batch paths before the naive design: naive senders still retrying
    # their commits after its window would share the cores with them.
    if "batch" in modes:
        print(json.dumps(run_batches(args, local)), flush=True)
    if "plain" in modes:
        plain = run_per_message(args, True, args.duration, local, plain=True)
        print(json.dumps(plain), flush=True)
        if grouped is not None:
            ratio = round(plain["msgs_per_s"] / grouped["msgs_per_s"], 2)
            print(json.dumps({"plain_vs_transactional_per_message": ratio}), flush=True)
    if "plain-batch" in modes:
        print(json.dumps(run_batches(args, local, plain=True)), flush=True)
    if "naive" in modes:
        naive = run_per_message(args, False, args.duration, local)
        print(json.dumps(naive))
        if grouped is not None:
            ratio = grouped["msgs_per_s"] / naive["msgs_per_s"] if naive["msgs_per_s"] else None
            print(
                json.dumps({"group_commit_vs_naive": round(ratio, 1) if ratio else None}),
                flush=True,
            )
    # Abandoned naive senders may still be inside delta-rs: leave without
    # running interpreter shutdown under them.
    os._exit(0)


#: what one invocation can measure (`--modes`)
MODES = ("transactional", "batch", "plain", "plain-batch", "naive")


def _modes(args) -> set[str]:
    modes = {m.strip() for m in args.modes.split(",") if m.strip()}
    unknown = modes - set(MODES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {', '.join(MODES)}")
    return modes - ({"naive"} if args.skip_naive else set())


def compare_stores(args, *stores: Store) -> None:
    """Each design on local disk, then on the object store; store / local."""
    counts = [int(n) for n in (args.threads_list or str(args.threads)).split(",")]
    for threads in counts:
        args.threads = threads
        local, s3 = (run_per_message(args, True, args.duration, s) for s in stores)
        print(json.dumps(local), flush=True)
        print(json.dumps(s3), flush=True)
        print(
            json.dumps(
                _ratios(
                    f"per-message, {threads} threads", local, s3, ("msgs_per_s", "p50_ms", "p99_ms")
                )
            ),
            flush=True,
        )
    local, s3 = (run_batches(args, s) for s in stores)
    print(json.dumps(local), flush=True)
    print(json.dumps(s3), flush=True)
    print(json.dumps(_ratios("batch path", local, s3, ("msgs_per_s", "p50_batch_ms"))), flush=True)


def _ratios(label: str, local: dict, s3: dict, keys: tuple[str, ...]) -> dict:
    return {
        "s3_over_local": label,
        **{k: round(s3[k] / local[k], 2) if local[k] else None for k in keys},
    }


if __name__ == "__main__":
    sys.exit(main())
