"""The job's command line: `txn-reconcile`, `python -m jobs`, and
`spark-submit jobs/reconcile.py`; and its library entry points.

    spark-submit jobs/reconcile.py run --conf conf/reconcile.toml [--now-ms N] [--dry-run]
    txn-reconcile run --every 2s [--max-runs N]     # back to back in one session
    python -m jobs status|verify|resolve|cancel ...
    from jobs.reconcile import reconcile; reconcile(spark, config, now_ms=None)
    from jobs.reconcile import reconcile_forever; reconcile_forever(spark, config, every_s=2)

Exit codes: 0 done, 1 failed (the reason on stderr), 2 bad configuration or
store, 75 another run holds the lease. `--dry-run` computes the run that
would be done next (the redo if one is due) and prints its summary; it takes
no lease and writes nothing, not even missing tables.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

if __package__ in (None, ""):  # run as a file by spark-submit: make `jobs`, `schemas`, … importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobs.continuous import parse_every, reconcile_forever
from jobs.faults import InjectedFault
from jobs.lease import EXIT_LEASE_HELD, Lease, LeaseHeld
from jobs.run import RunSummary, check_now_ms, idle_ahead, reconcile, recover, rows_ahead
from jobs.session import check_spark_environment, driver_java_options, print_error, use_warehouse
from txn_core.config import Config, ConfigError, load_config
from txn_core.vocabulary import CANCEL, Action, Source

__all__ = [
    "RunSummary",
    "build_parser",
    "cli",
    "idle_ahead",
    "main",
    "reconcile",
    "reconcile_forever",
    "recover",
    "rows_ahead",
    "submit_java_options",
]


EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

#: a single run predicted to read at most this many rows (`rows_ahead`)
#: starts its JVM for a short life (`jobs.session.SHORT_LIVED_JVM`): a
#: process that runs once does not earn back C2's compile time below about a
#: million rows (docs/operating.md)
SHORT_LIVED_MAX_ROWS = 500_000


#: a flag per configuration key, of its type (`--warehouse` is the common
#: one; the producers' size limits are the producers' to set)
_CONFIG_FLAGS = {
    f.name: type(f.default)
    for f in fields(Config)
    if f.name not in ("warehouse", "max_body_bytes", "max_batch_bytes")
}


def _boolean(text: str) -> bool:
    value = {"true": True, "false": False}.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--conf", help="TOML configuration file (docs/protocol.md §6)")
    common.add_argument("--warehouse", help="root of all tables (overrides file and env)")
    for key, kind in _CONFIG_FLAGS.items():
        common.add_argument(
            "--" + key.replace("_", "-"),
            default=None,
            type=_boolean if kind is bool else kind,
            metavar="true|false" if kind is bool else None,
            help=f"override configuration key {key} (docs/protocol.md §6)",
        )
    parser = argparse.ArgumentParser(
        prog="txn-reconcile",
        description="Reconciliation job for transactional messages on Delta Lake",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", parents=[common], help="one reconciliation run")
    run.add_argument("--now-ms", type=int, help="the clock of every time rule (ms)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="compute and print the summary; write nothing, take no lease",
    )
    run.add_argument(
        "--every",
        metavar="DURATION",
        help="run back to back in one Spark session, one run starting every DURATION "
        "(500ms, 2s, 1m; at once when a run took longer), printing each summary, until "
        "SIGTERM or SIGINT, which let the run under way finish (docs/operating.md, "
        '"The continuous job")',
    )
    run.add_argument("--max-runs", type=int, metavar="N", help="with --every: stop after N runs")
    status = sub.add_parser("status", parents=[common], help="report the pending set")
    status.add_argument("--now-ms", type=int, help="the clock for pending ages (ms)")
    sub.add_parser(
        "verify", parents=[common], help="full audit of the tables (docs/protocol.md §5)"
    )
    resolve = sub.add_parser(
        "resolve", parents=[common], help="operator decision for one transaction (an ADMIN OP)"
    )
    resolve.add_argument("--transaction-id", required=True)
    decision = resolve.add_mutually_exclusive_group(required=True)
    decision.add_argument("--commit", action="store_true")
    decision.add_argument("--rollback", action="store_true")
    resolve.add_argument("--remark")
    cancel = sub.add_parser(
        "cancel",
        parents=[common],
        help="withdraw a delayed message before it is due (an ADMIN OP with action CANCEL)",
    )
    cancel.add_argument("--msg-id", required=True, help="the message's msg_id (its transaction_id)")
    cancel.add_argument("--remark")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(
            args.conf, warehouse=args.warehouse, **{k: getattr(args, k) for k in _CONFIG_FLAGS}
        )
        # An object store is checked before the lease or Spark: exit 2 names what is wrong.
        use_warehouse(None, cfg)
        if args.command in _SPARK_COMMANDS:  # resolve and cancel start no Spark
            check_spark_environment()
        return _COMMANDS[args.command](args, cfg)
    except ConfigError as exc:
        return _fail(EXIT_USAGE, f"bad configuration: {exc}")
    except LeaseHeld as exc:
        return _fail(EXIT_LEASE_HELD, str(exc))
    except Exception as exc:  # noqa: BLE001 — the exit code contract: 1 and the reason
        return _fail(EXIT_FAILURE, f"{type(exc).__name__}: {exc}")


def _fail(code: int, message: str) -> int:
    print_error(f"txn-reconcile: {message}")
    return code


def _spark(*, short_lived: bool = False):
    from jobs.session import build_spark

    return build_spark("txn-reconcile", short_lived=short_lived)


def _cmd_run(args, cfg: Config) -> int:
    check_now_ms(args.now_ms, int(time.time() * 1000), "--now-ms")  # before the lease
    if args.dry_run:  # as `status`: on a mistyped path it would print an all-clear run
        _require_warehouse(cfg)
    if args.every is not None or args.max_runs is not None:
        return _run_continuously(args, cfg)
    # The lease comes before Spark starts, so an overlapping run exits 75 in a second.
    lease = None if args.dry_run else Lease(cfg.warehouse, cfg.lease_ttl_s).acquire()
    crashed = False
    try:
        with _finish_on_first_stop_signal():
            spark = _spark(short_lived=_predict_short(cfg, args.now_ms))
            summary = reconcile(spark, cfg, args.now_ms, dry_run=args.dry_run, lease=lease)
    except InjectedFault:
        crashed = True
        raise
    finally:
        if lease is not None and not crashed:
            lease.release()
    print(summary.to_json(), flush=True)
    return EXIT_OK


@contextlib.contextmanager
def _finish_on_first_stop_signal():
    """Within: a first SIGTERM or SIGINT lets the run under way finish (its
    writes done, its lease released), as the continuous job does; a second
    one ends the process at once, a crash the next run completes. Dying at
    the first left the lease held, and a run from another host (an Airflow
    worker) waited `lease_ttl_s` for it."""

    def first(signum, _frame) -> None:
        for stop in STOP_SIGNALS:
            signal.signal(stop, signal.SIG_DFL)
        print_error(
            f"txn-reconcile: {signal.Signals(signum).name}: finishing the run under way, "
            "then exiting (a second signal stops at once; the next run completes this one)"
        )

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may handle signals (`main` called from another)
        return
    before = {stop: signal.signal(stop, first) for stop in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop, handler in before.items():
            signal.signal(stop, handler)


#: the signals that stop a run (`_finish_on_first_stop_signal`) or the continuous job
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _run_continuously(args, cfg: Config) -> int:
    """`run --every`: `reconcile_forever` until SIGTERM/SIGINT or --max-runs."""
    if args.every is None:
        raise ConfigError("--max-runs needs --every")
    if args.dry_run or args.now_ms is not None:
        raise ConfigError("--every runs on the wall clock and writes: no --dry-run or --now-ms")
    if args.max_runs is not None and args.max_runs < 1:
        raise ConfigError(f"--max-runs must be a positive integer; got {args.max_runs}")
    every_s = parse_every(args.every)
    stop = threading.Event()
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: stop.set())
    lease = Lease(cfg.warehouse, cfg.lease_ttl_s).acquire()  # before Spark: exit 75 at once
    crashed = False
    try:
        reconcile_forever(
            _spark(),
            cfg,
            every_s,
            stop=stop,
            on_run=lambda summary: print(summary.to_json(), flush=True),
            max_runs=args.max_runs,
            lease=lease,
        )
    except InjectedFault:
        crashed = True
        raise
    finally:
        if not crashed:
            lease.release()
    return EXIT_OK


def _predict_short(cfg: Config, now_ms: int | None) -> bool:
    """Whether a single run's JVM is started for a short life: the run is
    idle (`idle_ahead`: one row to write) or reads at most
    `SHORT_LIVED_MAX_ROWS` (`rows_ahead`). False when the tables cannot
    tell: the prediction only picks the JVM's options, and the run itself
    reports any real problem."""
    try:
        if idle_ahead(cfg, now_ms):
            return True
        rows = rows_ahead(cfg, now_ms)
    except Exception:  # noqa: BLE001
        return False
    return rows is not None and rows <= SHORT_LIVED_MAX_ROWS


def _predict_small_audit(cfg: Config) -> bool:
    """Whether `verify`'s JVM is started for a short life: the audit is a
    small one (`jobs.verify.small_audit_ahead`). False when the tables cannot
    tell, as for a run."""
    from jobs.verify import small_audit_ahead

    try:
        return small_audit_ahead(cfg)
    except Exception:  # noqa: BLE001 - the audit itself reports any real problem
        return False


def submit_java_options(argv: list[str]) -> str:
    """The driver JVM's options for `scripts/submit.sh argv`: those of a
    local session (`driver_java_options`), short-lived for a single run
    predicted small (`_predict_short`) or a small audit
    (`_predict_small_audit`), as `txn-reconcile` starts them."""
    try:
        # The job itself says what is wrong, and prints --help: nothing of it
        # may end up among the JVM's options.
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
        cfg = load_config(
            args.conf, warehouse=args.warehouse, **{k: getattr(args, k) for k in _CONFIG_FLAGS}
        )
        if args.command == "verify":
            short = _predict_small_audit(cfg)
        else:
            single = args.command == "run" and args.every is None and args.max_runs is None
            short = single and _predict_short(cfg, args.now_ms)
    except (SystemExit, ConfigError):
        short = False
    return driver_java_options(short_lived=short)


def _require_warehouse(cfg: Config) -> None:
    """Refuse (exit 2) a warehouse neither producers nor the job ever used:
    a mistyped path would read as all clear, or be made anew."""
    from txn_core.tables import is_warehouse

    if not is_warehouse(cfg.warehouse):
        raise ConfigError(
            f"no warehouse at {cfg.warehouse} (it has no _sys/half and no _sys/runs): "
            "check --warehouse, --conf or TXN_WAREHOUSE"
        )


def _require_id(value: str, flag: str) -> None:
    if not value.strip():
        raise ConfigError(f"{flag} must name a message: got {value!r}")


def _cmd_status(args, cfg: Config) -> int:
    from jobs.status import status

    check_now_ms(args.now_ms, None, "--now-ms")  # status writes no watermark
    _require_warehouse(cfg)
    report = status(_spark(), cfg, now_ms=args.now_ms)
    print(json.dumps(report.to_dict()), flush=True)
    return EXIT_OK


def _cmd_verify(args, cfg: Config) -> int:
    from jobs.verify import verify

    _require_warehouse(cfg)
    report = verify(_spark(short_lived=_predict_small_audit(cfg)), cfg)
    print(json.dumps(report.to_dict(), default=str), flush=True)
    print(report.render(), file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_FAILURE


def _cmd_resolve(args, cfg: Config) -> int:
    from txn_core import Broker

    _require_id(args.transaction_id, "--transaction-id")
    _require_warehouse(cfg)
    broker = Broker.open(cfg)
    try:
        broker.resolve(args.transaction_id, commit=args.commit, remark=args.remark)
    finally:
        broker.close()
    print(
        json.dumps(
            {
                "transaction_id": args.transaction_id,
                "action": Action.COMMIT if args.commit else Action.ROLLBACK,
                "source": Source.ADMIN,
                "remark": args.remark,
            }
        ),
        flush=True,
    )
    return EXIT_OK


def _cmd_cancel(args, cfg: Config) -> int:
    from txn_core import Broker

    _require_id(args.msg_id, "--msg-id")
    _require_warehouse(cfg)
    broker = Broker.open(cfg)
    try:
        op_offset = broker.cancel(args.msg_id, remark=args.remark)
    finally:
        broker.close()
    print(
        json.dumps(
            {
                "msg_id": args.msg_id,
                "action": CANCEL,
                "source": Source.ADMIN,
                "op_offset": op_offset,
                "remark": args.remark,
            }
        ),
        flush=True,
    )
    return EXIT_OK


_COMMANDS = {
    "run": _cmd_run,
    "status": _cmd_status,
    "verify": _cmd_verify,
    "resolve": _cmd_resolve,
    "cancel": _cmd_cancel,
}
#: the commands that start Spark, whose TXN_SPARK_* settings are checked first
_SPARK_COMMANDS = ("run", "status", "verify")


def cli() -> None:
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The exit code is the contract (docs/protocol.md §3.4), and the interpreter's teardown
    # can abort inside delta-rs' runtime ("terminate called without an active
    # exception", SIGABRT), turning 75 into -6: everything is written and
    # printed by now, so end the process here. (Spark's JVM exits when its
    # gateway pipe closes.)
    os._exit(code)


if __name__ == "__main__":
    cli()
