"""A run's table writes: each one tagged commit, started as soon as its rows
are known, several at a time, skipped on a redo that finds it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pyspark.sql import functions as F

from jobs import driver_writes, fence, job_tables, tagged_writes
from jobs.counters import Counters
from jobs.faults import InjectedFault, fault_point
from jobs.held import Held
from jobs.lease import Lease, LeaseLost

#: output tables written at once (independent writes; see RunWrites)
PARALLEL_WRITES = 4
#: topic tables one delivery commits to at once (`_each_topic`)
TOPIC_COMMITS_AT_ONCE = 8


class RunWrites:
    """The run's table writes, each started as soon as its rows are known,
    several at a time (`PARALLEL_WRITES`); `max_body_bytes`: the largest
    message body a producer may send (what a collected write may hold).

    The writes are independent — each is one tagged commit, skipped on a
    redo that finds it, and the intent makes them one run — so they need no
    order, and overlapping them hides each commit's round trips.
    """

    def __init__(
        self,
        run_number: int,
        lease: Lease,
        redo: bool,
        max_body_bytes: int,
        topic_log_retention_hours: int = job_tables.DEFAULT_TOPIC_LOG_RETENTION_HOURS,
    ) -> None:
        self._put_args = (run_number, lease, redo)
        self._max_body_bytes = max_body_bytes
        #: what a topic table created by the run keeps of its log
        self.topic_log_retention_hours = topic_log_retention_hours
        self._pool = ThreadPoolExecutor(PARALLEL_WRITES, thread_name_prefix="write")
        self._started: list = []

    def start(
        self,
        df,
        path: str,
        app: str,
        mode: str,
        rows: int | None = None,
        body_bytes: int | None = None,
    ) -> None:
        """Write `df` to the table at `path` as the run's commit of `app`;
        `rows`: how many rows it has, when known, and `body_bytes`: at most
        how many bytes their message bodies take, when counted (few: the
        driver collects and commits them, `jobs.driver_writes`)."""
        self.submit(_put, df, path, app, mode, self.collects(rows, df.columns, body_bytes))

    def collects(self, rows: int | None, columns, body_bytes: int | None = None) -> bool:
        """Whether a write of `rows` rows of these columns goes through the driver."""
        return rows is not None and driver_writes.fits(
            rows, columns, self._max_body_bytes, body_bytes
        )

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
        if errors:
            raise _why_stopped(errors)


def start_deliveries(
    wh: str, delivered, topics: dict[str, int], writes: RunWrites, body_bytes: int | None = None
) -> None:
    """Start writing `delivered` (TOPIC rows with their `topic`) to the
    tables of `topics` (rows by topic) when `jobs.commits` can commit to
    them all: rows the driver can hold however large their bodies (or as
    large as `body_bytes`, a bound the run counted), collected once and
    committed to each table (`_put_collected_deliveries`);
    rows it can hold if their bodies are small, kept and their bodies
    counted first (`_put_counted_deliveries`); more, written by one Spark
    job (`_put_deliveries`); else one write per topic (`_put_each_topic`)."""
    paths = job_tables.ensure_topic_tables(
        wh, topics, writes.topic_log_retention_hours, tagged_writes.TABLES_OPENED_AT_ONCE
    )
    tables = tagged_writes.split_tables(delivered, "topic", paths)
    rows = sum(topics.values())
    if tables is None:
        writes.submit(_put_each_topic, delivered, paths)
    elif writes.collects(rows, delivered.columns, body_bytes):
        writes.submit(_put_collected_deliveries, delivered, tables)
    elif writes.collects(rows, delivered.columns, body_bytes=0):
        writes.submit(_put_counted_deliveries, delivered, tables, topics, writes)
    else:
        writes.submit(_put_deliveries, delivered, tables, topics)


def _put(
    df, path: str, app: str, mode: str, collect: bool, run_number: int, lease: Lease, redo: bool
) -> None:
    lease.keep_alive()  # never write once another run may have taken over
    tagged_writes.write_for_run(
        df, path, run_number, app, mode=mode, redo=redo, collect=collect, lease=lease
    )
    fault_point(f"after:{app}")


def _put_deliveries(
    delivered, tables: dict, rows: dict, run_number: int, lease: Lease, redo: bool
) -> None:
    """Each topic's rows of `delivered` appended to its table (`tables`,
    `tagged_writes.split_tables`): all of them written by one Spark job, in
    the table of the topic with most `rows` (on S3 the others' files are
    copied from there), then one tagged commit per topic. A redo writes
    only the topics its crashed attempt did not commit."""
    todo = _topics_to_write(tables, run_number, redo)
    if not todo:
        return
    lease.keep_alive()  # never write once another run may have taken over
    home = max(sorted(todo), key=lambda topic: rows[topic])
    append = tagged_writes.split_commits(delivered, "topic", todo, home, lease)

    def commit(topic: str) -> None:
        lease.keep_alive()
        tag = tagged_writes.run_tag(run_number, _app(topic))
        fence.commit(tables[topic], lease, lambda: append[topic](tag))
        fault_point(f"after:{_app(topic)}")

    _each_topic(commit, todo)


def _put_collected_deliveries(
    delivered, tables: dict, run_number: int, lease: Lease, redo: bool
) -> None:
    """`_put_deliveries` through the driver: the rows collected once
    (`jobs.driver_writes`), then one tagged commit per topic."""
    todo = _topics_to_write(tables, run_number, redo)
    if not todo:
        return
    lease.keep_alive()  # never write once another run may have taken over
    by_topic = driver_writes.split(driver_writes.collect(delivered), "topic", todo)

    def commit(topic: str) -> None:
        lease.keep_alive()
        tag = tagged_writes.run_tag(run_number, _app(topic))
        table, rows = todo[topic], by_topic[topic]
        # a topic's log is long (topic_log_retention_hours): appended by hand
        fence.commit(
            table, lease, lambda: driver_writes.write(rows, table, "append", tag, by_hand=True)
        )
        fault_point(f"after:{_app(topic)}")

    _each_topic(commit, todo)


def _each_topic(commit: Callable[[str], None], topics: dict) -> None:
    """`commit(topic)` for each of `topics`, several at once
    (`TOPIC_COMMITS_AT_ONCE`): each is a commit to a table of its own, a few
    round trips to the store, which one after another ended a small run's
    deliveries (docs/performance.md). Every commit is tried; once all are
    done, the error that says why the run stopped is raised, if any."""
    if len(topics) == 1:
        commit(next(iter(topics)))
        return
    at_once = min(len(topics), TOPIC_COMMITS_AT_ONCE)
    with ThreadPoolExecutor(at_once, thread_name_prefix="commit") as pool:
        done = [pool.submit(commit, topic) for topic in sorted(topics)]
    errors = [f.exception() for f in done if f.exception() is not None]
    if errors:
        raise _why_stopped(errors)


def _why_stopped(errors: list) -> BaseException:
    """The error to raise of several: a crash point or a lost lease first,
    which say why the run stopped."""
    return next((e for e in errors if isinstance(e, (InjectedFault, LeaseLost))), errors[0])


def _put_counted_deliveries(
    delivered,
    tables: dict,
    rows: dict,
    writes: RunWrites,
    run_number: int,
    lease: Lease,
    redo: bool,
) -> None:
    """Deliveries few enough for the driver if their bodies are small: the
    rows computed once and kept, their bodies' bytes counted on the way, then
    collected (`_put_collected_deliveries`) when those bytes fit, else
    written by Spark (`_put_deliveries`) from the kept rows. Only a count
    tells: a body may be as large as `max_body_bytes`."""
    if not _topics_to_write(tables, run_number, redo):
        return
    held, counted = Held(), Counters()
    try:
        kept = held.checkpoint(counted.bodies(delivered))
        body_bytes = counted.values()["_body_bytes"]
        if writes.collects(sum(rows.values()), kept.columns, body_bytes):
            _put_collected_deliveries(kept, tables, run_number, lease, redo)
        else:
            _put_deliveries(kept, tables, rows, run_number, lease, redo)
    finally:
        held.release()


def _put_each_topic(delivered, paths: dict, run_number: int, lease: Lease, redo: bool) -> None:
    """Each topic's rows of `delivered` appended to its table (`paths`), one
    write each (`tagged_writes.write_for_run`: where `jobs.commits` cannot
    commit to one of the tables, such as on ADLS or GCS, or a table with a
    CHECK constraint), all topics at once. For
    more than one, the rows are computed once and kept (`jobs.held`), where
    each write would otherwise compute all of them (the messages' bodies
    read and joined) to keep its own."""
    todo = _topics_to_write(paths, run_number, redo)
    if not todo:
        return
    held = Held()
    try:
        kept = held.checkpoint(delivered) if len(todo) > 1 else delivered

        def put(topic: str) -> None:
            rows = kept.where(F.col("topic") == topic).drop("topic")
            _put(rows, todo[topic], _app(topic), "append", False, run_number, lease, False)

        at_once = min(len(todo), TOPIC_COMMITS_AT_ONCE)
        with ThreadPoolExecutor(at_once, thread_name_prefix="topic") as pool:
            list(pool.map(put, sorted(todo)))
    finally:
        held.release()


def _topics_to_write(tables: dict, run_number: int, redo: bool) -> dict:
    """The topics of `tables` (a table or its path, by topic) to write: all,
    but on a redo those its crashed attempt committed."""
    return {
        topic: table
        for topic, table in tables.items()
        if not (redo and tagged_writes.committed_by_run(_uri(table), run_number, _app(topic)))
    }


def _uri(table) -> str:
    return table if isinstance(table, str) else table.table_uri


def _app(topic: str) -> str:
    return f"topics/{topic}"
