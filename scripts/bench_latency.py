"""Commit-to-consumer latency (a script printing figures, not a test).

For each rate, on a fresh local warehouse: transactional producers send 2 KB
messages at a steady rate (per-message sends, paced; 90 % commit, 5 % roll
back, 5 % answer UNKNOWN and commit when checked), the continuous job runs
in a process of its own (`txn-reconcile run --every`), and a consumer group
(`txn_core.Consumer`) polls the topic and commits. Printed per rate: the
rate reached, the latency from a commit (the send returning COMMIT) to the
consumer's poll returning the message (p50, p99, max), the job's CPU
(its Python process and its JVM) per delivered message, and the check that
every committed message arrived exactly once and no rolled-back one did
(judged after the drain and, for what was late, single catch-up runs; the
latencies are those of the messages consumed within the drain). Before
the timed sends, the job is warmed up by `--warm-up-s` of sends at the
same rate, checked but not timed: a new JVM spends its first minutes
compiling Spark's code (runs of 15-20 s at first, still compiling after a
hundred runs), and the figures are those of a continuous job that has been
running. The runs are described too: their median time, and for the timed
part the longest run and the longest time between two runs' starts (a run
plus what follows it: every 100th run compacts the job's tables).
Then, in the same invocation, the same is measured for one fresh
`txn-reconcile run` a minute (the cron cadence) at each of `--cron-rates`
(1,000 msg/s by default, the rate the latency target is set at; `--cron`
adds every rate of `--rates`, `--cron-rates ""` none).

    python scripts/bench_latency.py --rates 100,1000,3000 --duration 180
    python scripts/bench_latency.py --rates 1000 --duration 180 --cron
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from statistics import quantiles

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from txn_core import (
    Broker,
    Consumer,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
    load_config,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPIC = "ORDER"
#: quick checks and timeouts, so that the UNKNOWN 5 % are settled within seconds
RULES = {"transaction_timeout_ms": 1_000, "check_interval_ms": 1_000}
S = LocalTransactionState


class _Listener(TransactionListener):
    """Key `m<i>`: i % 20 == 0 rolls back, == 1 is UNKNOWN (COMMIT when checked)."""

    def execute_local_transaction(self, msg, arg):
        i = int(msg.keys[1:])
        return {0: S.ROLLBACK_MESSAGE, 1: S.UNKNOWN}.get(i % 20, S.COMMIT_MESSAGE)

    def check_local_transaction(self, msg):
        return S.COMMIT_MESSAGE


class _Produced:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.committed_at: dict[str, float] = {}  # committed by the producer: when
        self.checked: set[str] = set()  # UNKNOWN, committed when checked
        self.rolled_back: set[str] = set()
        self.sent = 0


def _produce(
    producer, rate: float, duration: float, threads: int, body: bytes, prefix: str = "m"
) -> _Produced:
    """Sends paced at `rate` per second for `duration` seconds, keyed `prefix` + number."""
    out = _Produced()
    start = time.monotonic() + 0.5
    total = int(rate * duration)
    counter = iter(range(total))
    next_lock = threading.Lock()

    def sender() -> None:
        while True:
            with next_lock:
                i = next(counter, None)
            if i is None:
                return
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            key = f"{prefix}{i}"
            result = producer.send_message_in_transaction(Message(topic=TOPIC, body=body, keys=key))
            done = time.time()
            with out.lock:
                out.sent += 1
                if result.local_state == S.COMMIT_MESSAGE:
                    out.committed_at[key] = done
                elif result.local_state == S.ROLLBACK_MESSAGE:
                    out.rolled_back.add(key)
                else:
                    out.checked.add(key)

    workers = [threading.Thread(target=sender, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return out


class _Consumed:
    def __init__(self) -> None:
        self.at: dict[str, list[float]] = {}


def _consume(warehouse: str, stop: threading.Event, out: _Consumed) -> None:
    consumer = Consumer(warehouse, "bench", TOPIC)
    while not stop.is_set():
        batch = consumer.poll(5_000)
        now = time.time()
        for message in batch:
            out.at.setdefault(message.keys, []).append(now)
        if batch:
            consumer.commit()
        else:
            stop.wait(0.05)
    consumer.close()


def _job_cpu_s(pid: int) -> float:
    """CPU seconds of process `pid` and its descendants (the job and its JVM)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parents.items():
            if p == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(cpu.get(p, 0.0) for p in tree)


def _job_command(warehouse: str, *extra: str) -> list[str]:
    rules = [f"--{k.replace('_', '-')}={v}" for k, v in RULES.items()]
    return [sys.executable, "-m", "jobs.reconcile", "run", "--warehouse", warehouse, *rules, *extra]


def measure(rate: float, args, cron: bool = False) -> dict:
    """The figures of one rate, in a warehouse of its own, deleted after."""
    warehouse = tempfile.mkdtemp(prefix="bench-latency-")
    try:
        return _measure_in(warehouse, rate, args, cron)
    finally:
        shutil.rmtree(warehouse, ignore_errors=True)


def _measure_in(warehouse: str, rate: float, args, cron: bool) -> dict:
    cfg = load_config(
        env={}, warehouse=warehouse, group_commit_interval_ms=args.group_commit_interval_ms, **RULES
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    broker = Broker.open(cfg)
    producer = TransactionProducer(broker, group="bench_group", listener=_Listener())
    producer.start_checker(poll_s=0.5)
    stop, consumed = threading.Event(), _Consumed()
    consumer = threading.Thread(target=_consume, args=(warehouse, stop, consumed), daemon=True)
    consumer.start()
    cpu, runs = 0.0, 0
    summaries: list[str] = []
    body = b"x" * args.body_bytes
    warm = _Produced()
    if cron:
        ended = threading.Event()

        def every_minute() -> None:
            nonlocal cpu, runs
            while not ended.is_set():
                started = time.monotonic()
                job = subprocess.Popen(_job_command(warehouse), cwd=REPO, env=env)
                while job.poll() is None:
                    last = _job_cpu_s(job.pid)
                    time.sleep(0.2)
                cpu, runs = cpu + last, runs + 1
                ended.wait(max(0.0, 60 - (time.monotonic() - started)))

        scheduler = threading.Thread(target=every_minute, daemon=True)
        scheduler.start()
    else:
        job = subprocess.Popen(
            _job_command(warehouse, "--every", args.every),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = job.stdout.readline()  # the first run is done: the session is up
        if not first:
            raise SystemExit("the continuous job did not start")
        lines = threading.Thread(target=lambda: summaries.extend(job.stdout), daemon=True)
        lines.start()
        # sent and checked like the others, but not timed: a new JVM compiles
        # Spark's code during its first minutes, and the figures are those
        # of a job that has been running
        warm = _produce(producer, rate, args.warm_up_s, args.threads, body, prefix="w")
        cpu_start = _job_cpu_s(job.pid)
    began, timed_from_ms = time.monotonic(), int(time.time() * 1000)
    produced = _produce(producer, rate, args.duration, args.threads, body)
    sending_s = time.monotonic() - began
    # everything committed, by the producer or when checked, reaches the consumer
    want = set(produced.committed_at) | produced.checked
    warm_want = set(warm.committed_at) | warm.checked
    deadline = time.monotonic() + args.drain_s
    while time.monotonic() < deadline and not want.issubset(consumed.at):
        time.sleep(0.2)
    # the latencies are those of the messages consumed by now; the rest are late
    latencies = sorted(
        consumed.at[k][0] - t for k, t in produced.committed_at.items() if k in consumed.at
    )
    late = len(want - set(consumed.at))
    if cron:
        ended.set()
        scheduler.join()
    else:
        cpu = _job_cpu_s(job.pid) - cpu_start
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=900)  # SIGTERM lets the run under way finish
    # Catch up with single runs (checks need a run to ask and one to read
    # the answer), so that exactly-once is judged on everything sent.
    everything = want | warm_want
    for _ in range(4):
        if everything.issubset(consumed.at):
            break
        subprocess.run(_job_command(warehouse), cwd=REPO, env=env, stdout=subprocess.DEVNULL)
        settle = time.monotonic() + 10
        while time.monotonic() < settle and not everything.issubset(consumed.at):
            time.sleep(0.2)
    time.sleep(1)  # a duplicate would be polled by now
    stop.set()
    consumer.join()
    producer.close()
    broker.close()
    rolled_back = produced.rolled_back | warm.rolled_back
    # the job's CPU from the end of the warm-up, per timed message delivered (an
    # overestimate when the warm-up left a backlog: the job delivered that too)
    delivered = sum(len(v) for k, v in consumed.at.items() if not k.startswith("w"))
    return {
        "rate": rate,
        "cadence": "cron, 1/min" if cron else f"--every {args.every}",
        "reached": produced.sent / sending_s,
        "latencies": latencies,
        "late": late,
        "missing": len(everything - set(consumed.at)),
        "duplicated": sum(1 for v in consumed.at.values() if len(v) > 1),
        "rolled_back_delivered": len(rolled_back & set(consumed.at)),
        "unexpected": len(set(consumed.at) - everything - rolled_back),
        "checked": len(produced.checked),
        "warm_up": warm.sent,
        "delivered": delivered,
        "cpu_per_msg_ms": 1000 * cpu / max(delivered, 1),
        "runs": _runs(summaries, timed_from_ms) if not cron else (runs, None, None, None),
    }


def _runs(lines: list[str], timed_from_ms: int) -> tuple[int, float | None, float, float]:
    """Of the job's summaries: (runs, median wall time in seconds of those
    that did something, and of the runs started from `timed_from_ms` on the
    longest wall time and the longest time between two starts)."""
    import json
    from statistics import median

    done = [json.loads(line) for line in lines if line.startswith("{")]
    busy = [d["duration_ms"] / 1000 for d in done if not d["idle"]]
    timed = [d for d in done if d["now_ms"] >= timed_from_ms]
    longest = max((d["duration_ms"] / 1000 for d in timed), default=0.0)
    starts = [d["now_ms"] / 1000 for d in timed]
    apart = max((b - a for a, b in zip(starts, starts[1:])), default=0.0)
    return len(done), (median(busy) if busy else None), longest, apart


def report(f: dict) -> None:
    lat = f["latencies"]
    if len(lat) >= 2:
        cuts = quantiles(lat, n=100)
        p50, p99 = cuts[49], cuts[98]
    else:
        p50 = p99 = lat[0] if lat else float("nan")
    ok = not (f["missing"] or f["duplicated"] or f["rolled_back_delivered"] or f["unexpected"])
    print(
        f"{f['rate']:>6,.0f} msg/s ({f['cadence']}): reached {f['reached']:,.0f} msg/s; "
        f"commit -> consumed p50 {p50:.2f} s, p99 {p99:.2f} s, max {max(lat, default=0):.2f} s; "
        f"job CPU {f['cpu_per_msg_ms']:.3f} ms per delivered message; "
        f"{f['runs'][0]} runs"
        + (
            f" (median {f['runs'][1]:.1f} s each; timed: longest {f['runs'][2]:.1f} s,"
            f" longest between two starts {f['runs'][3]:.1f} s)"
            if f["runs"][1] is not None
            else ""
        )
        + "; "
        f"{f['delivered']:,} timed messages delivered ({f['checked']:,} committed on check"
        + (
            f"; {f['late']:,} consumed only after the drain, not in the latencies"
            if f["late"]
            else ""
        )
        + (f"; after {f['warm_up']:,} sent to warm the job up" if f["warm_up"] else "")
        + "): "
        + (
            "every committed message exactly once, no rolled-back one"
            if ok
            else f"MISSING {f['missing']}, DUPLICATED {f['duplicated']}, "
            f"ROLLED BACK DELIVERED {f['rolled_back_delivered']}, UNEXPECTED {f['unexpected']}"
        ),
        flush=True,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="100,1000,3000", help="messages per second, comma-separated")
    p.add_argument("--duration", type=float, default=180, help="seconds of sending per rate")
    p.add_argument("--every", default="1s", help="the continuous job's cadence")
    p.add_argument(
        "--threads",
        type=int,
        default=128,
        help="sender threads, each sending one message at a time and waiting for its two "
        "group commits: too few cannot reach the rate (the figures print the rate reached)",
    )
    p.add_argument("--body-bytes", type=int, default=2048)
    p.add_argument("--drain-s", type=float, default=120, help="wait for the last deliveries")
    p.add_argument(
        "--warm-up-s",
        type=float,
        default=300,
        help="seconds of sending at the rate before the timed ones (continuous job only)",
    )
    p.add_argument(
        "--group-commit-interval-ms",
        type=int,
        default=load_config(env={}).group_commit_interval_ms,
        help="the producers' least time between two commits to a table (default: the config's)",
    )
    p.add_argument(
        "--cron-rates",
        default="1000",
        help='rates at which the cron cadence is measured too, comma-separated ("": none)',
    )
    p.add_argument("--cron", action="store_true", help="the cron cadence at every rate of --rates")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    cron_rates = rates if args.cron else [float(r) for r in args.cron_rates.split(",") if r]
    print(
        f"cores = {os.cpu_count()}, {args.duration:.0f} s per rate, body {args.body_bytes} B, "
        f"group commits at least {args.group_commit_interval_ms} ms apart"
    )
    for rate in rates:
        report(measure(rate, args))
    for rate in cron_rates:
        report(measure(rate, args, cron=True))


if __name__ == "__main__":
    main()
