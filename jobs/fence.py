"""A run's commits fenced by its lease: once another run may have taken over,
none of them lands.

The lease (`jobs.lease`) keeps a second run from starting while one works, but
it is a promise in wall-clock time. A run whose host stalls past the lease's
expiry (a laptop asleep under a notebook, a frozen VM or container, SIGSTOP),
or whose clock is behind the other hosts', goes on working while another run
takes the lease over and redoes its intent. Checking the lease before a write
leaves the moment between the check and the commit, and delta-rs would rebase
an append over the commits it finds there: the stalled run would deliver its
messages a second time.

So every commit a run makes to the job's tables is made
  1. from the version its delta-rs handle holds,
  2. once a read of the lease table, begun after that version was read, found
     this run's row still the newest (`Lease.verify`),
  3. with no retry (`jobs.commits.commit_options`): Delta's put-if-absent of
     the next log entry is the fence.
A run taking over writes its lease row before any commit of its own, so when
(2) finds this run's row the newest no other run had committed to the table
by (1), and one that commits later takes the next version first and makes
(3) fail. A failed commit is then looked at: a commit tagged by a run
(`tagged_writes.run_tag`) means another run works on this warehouse, and this
one stops (`LeaseLost`; the run holding the lease completes the intent, I4);
any other commit (an operator's OPTIMIZE) is stepped over and the commit made
again from the new version. Clocks and pauses decide how soon a stalled run
notices, never whether a message is delivered twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from deltalake.exceptions import CommitFailedError

from jobs.lease import Lease, LeaseLost
from txn_core.delta_log import tip
from txn_core.kept_tables import read_at

#: commits by others than a run (an operator's) a fenced commit steps over
#: before it gives up: more in a row is not an operator but a loop
FOREIGN_COMMITS_STEPPED_OVER = 3

R = TypeVar("R")


def commit(table, lease: Lease | None, make: Callable[[], R]) -> R:
    """`make()`, a commit through the delta-rs `table` from the version it
    holds, with no retry, made only while `lease` is still this run's (the
    module's docstring); its result. `lease` None: a run that writes nothing
    under a lease (tests of the writes alone), committed as it is.

    Raises LeaseLost when another run committed to the table meanwhile, or
    holds the lease now; nothing of this commit is then in the table.

    >>> write = lambda: driver_writes.write(rows, table, "append", tag)  # doctest: +SKIP
    >>> commit(table, lease, write)                                     # doctest: +SKIP
    42
    """
    if lease is None:
        return make()
    read_ns = read_at(table)
    for _ in range(FOREIGN_COMMITS_STEPPED_OVER + 1):
        lease.verify(read_ns)
        version = tip(table)
        try:
            return make()
        except CommitFailedError as exc:
            table.update_incremental()
            read_ns = time.monotonic_ns()
            run = _run_commit_after(table, version)
            if run is not None:
                lease.lost = (
                    f"another run ({run}) committed to {table.table_uri} while this one was"
                    " writing it: this run stops, and the run holding the job's lease"
                    " completes its intent"
                )
                raise LeaseLost(lease.lost) from exc
            failure = exc
    raise failure


def _run_commit_after(table, version: int) -> str | None:
    """Which run's commit to `table` came after `version` ("run N, <table>"),
    if any, by the tag the run's commits carry in their commitInfo."""
    from jobs.tagged_writes import read_tag  # which writes through this module

    newer = table.version() - version
    for info in table.history(newer) if newer > 0 else []:
        tag = read_tag(info.get("userMetadata"))
        if tag is not None:
            return f"run {tag[0]}, {tag[1]}"
    return None
