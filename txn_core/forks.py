"""Forked processes: where the broker core refuses to run, and says why.

delta-rs, under the broker and the consumers, runs its I/O on threads of a
runtime it starts in the process at its first use, and a fork copies no
thread. In a child forked after that, a Broker or Consumer inherited from
the parent waits forever for threads that are not there, and any new open
panics in delta-rs. So a process records that it used delta-rs through
the broker core (`note_use`), and a child forked after that refuses with
`ForkedProcessError`, naming what to do instead (docs/operating.md,
"Producers and consumers in worker processes"). A process forked before
any use is a fresh start and may open its own.

>>> note_use("Broker.open")        # doctest: +SKIP
"""

from __future__ import annotations

import os

from txn_core.errors import ForkedProcessError

#: the process that used delta-rs through the broker core (None: not yet);
#: a child forked afterwards inherits it and sees a pid that is not its own
_used_in: int | None = None


def note_use(what: str) -> None:
    """Record that this process uses delta-rs for `what` (e.g. "Broker.open"),
    after `check`ing that it may."""
    global _used_in
    check(what)
    if _used_in is None:
        _used_in = os.getpid()


def check(what: str) -> None:
    """Raise ForkedProcessError when this process was forked from one that
    had used delta-rs through the broker core."""
    if _used_in is None or _used_in == os.getpid():
        return
    raise ForkedProcessError(
        f"{what} cannot run in process {os.getpid()}: it was forked from process "
        f"{_used_in} after that one opened a warehouse, and delta-rs cannot run in "
        "such a child (a fork copies none of its I/O threads: a send would wait "
        "forever). Open brokers and consumers in each worker process after it "
        "starts, never in the parent before it forks: multiprocessing's 'spawn' or "
        "'forkserver' start method; with gunicorn --preload or Celery's prefork "
        "pool, open them in the worker (post_fork, worker_process_init, or at the "
        'first request). See docs/operating.md, "Producers and consumers in worker '
        'processes".'
    )


def forked() -> bool:
    """Whether this process was forked from one that used delta-rs here."""
    return _used_in is not None and _used_in != os.getpid()
