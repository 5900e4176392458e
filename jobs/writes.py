"""A run's table writes: each one tagged commit, started as soon as its rows
are known, several at a time, skipped on a redo that finds it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from pyspark.sql import functions as F

from jobs import job_tables, tagged_writes
from jobs.faults import InjectedFault, fault_point
from jobs.lease import Lease, LeaseLost

#: output tables written at once (independent writes; see RunWrites)
PARALLEL_WRITES = 4


class RunWrites:
    """The run's table writes, each started as soon as its rows are known,
    several at a time (`PARALLEL_WRITES`).

    The writes are independent — each is one tagged commit, skipped on a
    redo that finds it, and the intent makes them one run — so they need no
    order, and overlapping them hides each commit's round trips.
    """

    def __init__(self, run_number: int, lease: Lease, redo: bool) -> None:
        self._put_args = (run_number, lease, redo)
        self._pool = ThreadPoolExecutor(PARALLEL_WRITES, thread_name_prefix="write")
        self._started: list = []

    def start(self, df, path: str, app: str, mode: str) -> None:
        self.submit(_put, df, path, app, mode)

    def submit(self, put, *args) -> None:
        """Run `put(*args, run_number, lease, redo)` beside the other writes."""
        self._raise_first_error(finished_only=True)  # a crashed write stops the run here
        self._started.append(self._pool.submit(put, *args, *self._put_args))

    def finish(self) -> None:
        """Wait for every write; raise the first that failed."""
        self.close()
        self._raise_first_error()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _raise_first_error(self, finished_only: bool = False) -> None:
        errors = [
            f.exception()
            for f in self._started
            if (f.done() or not finished_only) and f.exception() is not None
        ]
        if errors:  # a crash point or a lost lease first: they say why the run stopped
            raise next((e for e in errors if isinstance(e, (InjectedFault, LeaseLost))), errors[0])


def start_deliveries(wh: str, delivered, topics, writes: RunWrites) -> None:
    """Start writing `delivered` (TOPIC rows with their `topic`) to the
    tables of `topics`: in one Spark job when `jobs.commits` can write them
    all (`_put_deliveries`), else one write per topic."""
    paths = {
        topic: job_tables.ensure_topic_table(wh, topic)  # creating one is a commit too
        for topic in topics
    }
    tables = tagged_writes.split_tables(delivered, "topic", paths)
    if tables is not None:
        writes.submit(_put_deliveries, delivered, tables)
        return
    for topic, path in paths.items():
        writes.start(
            delivered.where(F.col("topic") == topic).drop("topic"),
            path,
            f"topics/{topic}",
            "append",
        )


def _put(df, path: str, app: str, mode: str, run_number: int, lease: Lease, redo: bool) -> None:
    lease.keep_alive()  # never write once another run may have taken over
    tagged_writes.write_for_run(df, path, run_number, app, mode=mode, redo=redo)
    fault_point(f"after:{app}")


def _put_deliveries(delivered, tables: dict, run_number: int, lease: Lease, redo: bool) -> None:
    """Each topic's rows of `delivered` appended to its table (`tables`,
    `tagged_writes.split_tables`): all of them written by one Spark job, then one
    tagged commit per topic. A redo writes only the topics its crashed
    attempt did not commit."""
    apps = {topic: f"topics/{topic}" for topic in tables}
    todo = {
        topic: table
        for topic, table in tables.items()
        if not (redo and tagged_writes.committed_by_run(table.table_uri, run_number, apps[topic]))
    }
    if not todo:
        return
    lease.keep_alive()  # never write once another run may have taken over
    append = tagged_writes.split_commits(delivered, "topic", todo)
    for topic in sorted(todo):
        lease.keep_alive()
        append[topic](tagged_writes.run_tag(run_number, apps[topic]))
        fault_point(f"after:{apps[topic]}")
