"""Writes tagged with their run: each a single commit whose metadata names
the run and the table, so that a redo finds the commits its crashed attempt
made and skips them (I4).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pyspark.sql import DataFrame

from jobs import commits, driver_writes, fence
from jobs.lease import Lease
from txn_core.storage import options_for


def run_tag(run_number: int, app: str) -> str:
    """The tag a run's commit carries in its commitInfo (`userMetadata`)."""
    return json.dumps({"txn_reconcile_run": run_number, "table": app}, sort_keys=True)


def read_tag(user_metadata: str | None) -> tuple[int, str] | None:
    try:
        tag = json.loads(user_metadata or "")
        return int(tag["txn_reconcile_run"]), str(tag["table"])
    except (ValueError, TypeError, KeyError):
        return None  # not a commit of the job's writes (creation, compaction, an operator's)


def write_for_run(
    df: DataFrame,
    path: str,
    run_number: int,
    app: str,
    *,
    mode: str = "append",
    redo: bool = False,
    collect: bool = False,
    lease: Lease | None = None,
) -> bool:
    """Write `df` as run `run_number`'s commit to `path`, tagged with the run
    (`run_tag`), fenced by the run's `lease` (`jobs.fence`). On a redo, skip
    the write when the crashed attempt already committed it
    (`committed_by_run`). Returns whether it wrote.

    `collect`: the rows are few, collected by the driver and committed by
    delta-rs (`jobs.driver_writes`). Otherwise written by `jobs.commits`
    (Spark's parquet writer, then a delta-rs commit). Either only where that
    commit is the one Delta's writer would make, which saves the writer's
    snapshot and post-commit jobs; by Delta's writer everywhere else, with
    Delta's own fence: its idempotent-write record (txnAppId
    `reconcile:<app>`, txnVersion the run), which it checks within the commit.

    Why tags, not Delta's txnAppId/txnVersion, where delta-rs commits: Delta
    checks those against the table's whole reconstructed state, a Spark job per
    table written — most of a small run's time — while the tag is needed only
    on a redo, where reading the last commits' commitInfo with delta-rs is
    quick. A first attempt cannot find its own commit, and a stalled attempt
    cannot commit once another has taken over (`jobs.fence`).
    """
    if redo and committed_by_run(path, run_number, app):
        return False
    tag = run_tag(run_number, app)
    table = commits.committable(path, df) if collect else None
    if table is not None:
        rows = driver_writes.collect(df)
        fence.commit(table, lease, lambda: driver_writes.write(rows, table, mode, tag))
        return True
    table = commits.committable(path, df)
    if table is not None:
        adds = commits.stage(df, table, lease.generation if lease else None)
        fence.commit(table, lease, lambda: commits.commit(table, adds, mode, tag))
        return True
    if lease is not None:
        lease.verify()
    (
        df.write.format("delta")
        .mode(mode)
        .option("userMetadata", tag)
        .option("txnAppId", f"reconcile:{app}")
        .option("txnVersion", run_number)
        .save(path)
    )
    return True


#: tables a run opens (or creates) at once: a run may deliver to hundreds of
#: topics, and a thread each would be as many open tables and sockets
TABLES_OPENED_AT_ONCE = 32


def opened_at_once(tables) -> int:
    """Threads for opening `tables`: one each, up to `TABLES_OPENED_AT_ONCE`."""
    return max(1, min(len(tables), TABLES_OPENED_AT_ONCE))


def split_tables(df: DataFrame, column: str, paths: dict[str, str]) -> dict | None:
    """The tables of `paths` (by value of `column`) opened for `split_commits`,
    or None unless `jobs.commits` can commit the rows of `df` to every one of
    them (`commits.committable`; else `write_for_run`, one table at a time)."""
    rows = df.drop(column)
    rows.schema  # noqa: B018 — analysed once, here, not by each thread below
    # each is a read of a table's log: on an object store, round trips to overlap
    with ThreadPoolExecutor(opened_at_once(paths), thread_name_prefix="open") as pool:
        opened = list(pool.map(lambda path: commits.committable(path, rows), paths.values()))
    tables = dict(zip(paths, opened))
    return None if any(table is None for table in tables.values()) else tables


def split_commits(
    df: DataFrame, column: str, tables: dict, home=None, lease: Lease | None = None
) -> dict[str, Callable[[str], int]]:
    """Stage the rows of `df` for `tables` (`split_tables`), each row to the
    table of its `column` value, in one Spark job (`commits.stage_split`,
    written in `home`'s table, by the run holding `lease`); each table's
    append as a function of its commit's userMetadata (`run_tag`)."""
    staged = commits.stage_split(df, column, tables, home, lease.generation if lease else None)
    return {
        value: functools.partial(commits.commit, tables[value], staged[value], "append")
        for value in tables
    }


def committed_by_run(path: str, run_number: int, app: str) -> bool:
    """Whether run `run_number` committed its write of `app` to the table.

    Walks the log back from the newest commit and stops at the first commit
    tagged by an earlier run: runs write one after another, so a commit of
    this run can only come after it. Untagged commits (creation, compaction,
    an operator's DELETE or OPTIMIZE) are stepped over. A run that crashed
    under a job version before the tags left Delta's idempotent-write record
    (txnAppId `reconcile:<app>`) instead: that counts too.
    """
    from deltalake import DeltaTable as RsTable
    from deltalake.exceptions import TableNotFoundError

    try:
        table = RsTable(path, storage_options=options_for(path))
    except TableNotFoundError:
        return False
    legacy = table.transaction_version(f"reconcile:{app}")
    if legacy is not None and legacy >= run_number:
        return True
    recent = table.history(RECENT_COMMITS)
    found = _tagged(recent, run_number, app)
    if found is None and len(recent) == RECENT_COMMITS:  # not decided yet: read them all
        found = _tagged(table.history(), run_number, app)
    return bool(found)


#: commits `committed_by_run` reads first (one run writes a table once, plus
#: the odd compaction), before the table's whole history
RECENT_COMMITS = 16


def _tagged(commits: list[dict], run_number: int, app: str) -> bool | None:
    """True: `commits` (newest first) hold the run's commit of `app`; False:
    they reach an earlier run's commit first; None: neither."""
    for commit in commits:
        tag = read_tag(commit.get("userMetadata"))
        if tag == (run_number, app):
            return True
        if tag is not None and tag[0] < run_number:
            return False
    return None
