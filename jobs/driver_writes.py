"""A run's write of few rows: collected by the driver as Arrow and committed
by delta-rs, in one Spark job.

A Spark write of a few rows costs several jobs and their planning (the write,
its file committer, for Delta's writer the table's snapshot), ~0.25 s on a
local disk and more on an object store, where collecting the same rows and
committing them from the driver takes ~0.1 s and works on every store
delta-rs reaches with the warehouse's settings. A run knows how many rows
each table gets before it writes (its counters), so it takes this path when
they fit in the driver's memory (`fits`). The commit is the one
`jobs.commits` makes: the table's own columns, NOT NULL enforced, tagged with
the run, checkpoints as Delta's writer makes them.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame

from jobs.commits import after_commit, commit_options
from txn_core.blind_append import BlindAppender, unsupported_reason
from txn_core.delta_log import appended, catch_up, local_dir, tip

#: rows of a table without message bodies (each ~100-200 bytes) one write
#: may collect
NARROW_MAX_ROWS = 250_000
#: what the message bodies of one write may take in the driver, counted at
#: the largest body a producer may send (`max_body_bytes`)
BODY_BYTES_MAX = 256 * 1024 * 1024
#: rows with bodies one write may collect, however small the bodies
MESSAGE_MAX_ROWS = 50_000


def fits(
    rows: int, columns: Iterable[str], max_body_bytes: int, body_bytes: int | None = None
) -> bool:
    """Whether a write of `rows` rows with these columns is collected by the
    driver: few enough rows, and for rows carrying a message body, few enough
    that their bodies fit in `BODY_BYTES_MAX`: `body_bytes` when the run
    counted them, else as if each body were of `max_body_bytes`."""
    if "body" not in columns:
        return rows <= NARROW_MAX_ROWS
    if body_bytes is None:
        body_bytes = rows * max(max_body_bytes, 1)
    return rows <= MESSAGE_MAX_ROWS and body_bytes <= BODY_BYTES_MAX


def collect(df: DataFrame) -> pa.Table:
    """`df`'s rows in the driver, as Arrow (one Spark job)."""
    return df.toArrow()


def write(rows: pa.Table, table, mode: str, user_metadata: str, *, by_hand: bool = False) -> int:
    """Commit `rows` (`collect`) to the delta-rs `table` (`commits.committable`
    for their columns) as one commit, appended or replacing every row
    (`mode`), with `user_metadata` in its commitInfo. Returns the version.

    `by_hand`: an append to a table on a local disk is committed by an entry
    this process writes (`_append_by_hand`), leaving `table` behind it:
    delta-rs would list the whole log there twice, and a topic keeps days of
    it. Elsewhere, and to a table it may not write so, delta-rs commits.

    A null in a NOT NULL column raises, naming the column, and nothing is
    committed (as Delta's writer does).
    """
    from deltalake import write_deltalake

    if mode not in ("append", "overwrite"):
        raise ValueError(f"mode must be 'append' or 'overwrite'; got {mode!r}")
    schema = pa.schema(table.schema().to_arrow())
    _check_not_null(rows, schema, table.table_uri)
    rows = rows.select(schema.names).cast(schema)
    if by_hand and mode == "append" and _append_by_hand(rows, table, user_metadata):
        return after_commit(table)
    catch_up(table)
    write_deltalake(table, rows, mode=mode, **commit_options(user_metadata))
    return after_commit(table)


def _append_by_hand(rows: pa.Table, table, user_metadata: str) -> bool:
    """Append `rows` to `table` on a local disk as the producers do
    (`txn_core.blind_append`: a parquet file, then a log entry linked in
    only if its version is free), right after the newest version this
    process knows (`delta_log.tip`); False, nothing written, for a table
    elsewhere or one it may not write so, or no rows (delta-rs adds no
    file then). A version taken meanwhile raises CommitFailedError, as a
    delta-rs commit without retries does."""
    if not rows.num_rows or local_dir(table) is None:
        return False
    if unsupported_reason(table, rows.schema) is not None:
        return False
    appender = BlindAppender(table, rows.schema, after=tip(table), strict=True)
    appended(table, appender.append(rows, user_metadata))
    return True


def split(rows: pa.Table, column: str, values: Iterable[str]) -> dict[str, pa.Table]:
    """`rows` without `column`, by its value (each of `values`, maybe empty)."""
    rest = rows.drop_columns([column])
    return {v: rest.filter(pc.equal(rows[column], v)) for v in values}


def _check_not_null(rows: pa.Table, schema: pa.Schema, where: str) -> None:
    for field in schema:
        if not field.nullable and rows[field.name].null_count:
            raise ValueError(f"NOT NULL constraint violated for column {field.name} of {where}")
