"""The job run back to back in one SparkSession, at a cadence:
`txn-reconcile run --every 2s`, or `reconcile_forever` from a notebook.

Each iteration is a run like a cron run — its own `_sys/runs` records, its
clock the wall clock when it starts, every rule and invariant — under one
lease, taken before the first run and renewed until the last is done (a
second job on the warehouse exits 75 meanwhile). A run with nothing new and
nothing due writes its run record through delta-rs and starts no Spark job.
A stop request (SIGTERM, SIGINT, or the caller's `stop` event) lets the run
under way finish, then releases the lease. A process killed in the middle of
a run leaves an intent the next process redoes first, exactly as after a
crashed cron run: the lease of a dead process on the same host is taken over
at once, one on another host once its ttl has passed.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from jobs.faults import InjectedFault
from jobs.lease import Lease
from jobs.run import RunSummary, reconcile
from jobs.session import use_warehouse
from txn_core.config import Config, ConfigError, as_config

__all__ = ["parse_every", "reconcile_forever"]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_EVERY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")


def parse_every(text: str) -> float:
    """A cadence in seconds from `500ms`, `2s`, `1m`, `1h` or a number of
    seconds; ConfigError unless it is positive.

    >>> parse_every("2s"), parse_every("500ms"), parse_every("1.5")
    (2.0, 0.5, 1.5)
    """
    match = _EVERY.match(str(text))
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"] if match else 0.0
    if seconds <= 0:
        raise ConfigError(
            f"--every must be a positive duration such as 500ms, 2s, 1m or 1h; got {text!r}"
        )
    return seconds


def reconcile_forever(
    spark,
    config: Config | dict,
    every_s: float,
    *,
    stop: threading.Event | None = None,
    on_run: Callable[[RunSummary], None] | None = None,
    max_runs: int | None = None,
    lease: Lease | None = None,
    clock: Callable[[], float] = time.time,
) -> int:
    """Run the job every `every_s` seconds (from the start of one run to the
    start of the next; at once when a run took longer) until `stop` is set or
    `max_runs` runs are done. Returns the number of runs.

    `on_run(summary)` is called after each run (the CLI prints it). `lease`:
    one the caller acquired and releases (the CLI takes it before starting
    Spark); otherwise the loop acquires its own and releases it when it
    ends. `clock` is the wall clock of the lease and of each run's time
    rules. Raises LeaseHeld when another job holds the lease, and whatever a
    run raises; the interrupted run, if any, is redone by the next run on
    the warehouse.

    >>> stop = threading.Event()                        # doctest: +SKIP
    >>> reconcile_forever(spark, "conf/reconcile.toml", 2.0, stop=stop)  # doctest: +SKIP
    """
    cfg = as_config(config)
    if not isinstance(every_s, (int, float)) or isinstance(every_s, bool) or every_s <= 0:
        raise ConfigError(f"every_s must be a positive number of seconds; got {every_s!r}")
    if max_runs is not None and max_runs < 0:
        raise ConfigError(f"max_runs must be zero or more; got {max_runs!r}")
    stop = stop if stop is not None else threading.Event()
    use_warehouse(spark, cfg)
    own = lease is None
    if lease is None:
        lease = Lease(cfg.warehouse, cfg.lease_ttl_s, clock=clock).acquire()
    runs, crashed = 0, False
    try:
        while not stop.is_set() and (max_runs is None or runs < max_runs):
            started = time.monotonic()
            summary = reconcile(spark, cfg, int(clock() * 1000), lease=lease, clock=clock)
            runs += 1
            if on_run is not None:
                on_run(summary)
            if max_runs is not None and runs >= max_runs:
                break  # not a cadence more, holding the lease, after the last run
            _wait(stop, every_s - (time.monotonic() - started), lease)
    except InjectedFault:
        crashed = True  # behave as a killed process: the lease stays until it expires
        raise
    finally:
        if own and not crashed:
            lease.release()
    return runs


def _wait(stop: threading.Event, seconds: float, lease: Lease) -> None:
    """Wait up to `seconds`, or until `stop` is set, renewing the lease so
    that a cadence longer than its ttl never lets it lapse between runs."""
    deadline = time.monotonic() + seconds
    step = max(lease.ttl_ms / 6000, 0.05)
    while not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        stop.wait(min(left, step))
        lease.keep_alive()
