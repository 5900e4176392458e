"""The scheduled set (`_sys/scheduled`): committed messages not due yet
(docs/protocol.md §4, "Delayed messages"), looked at with delta-rs.

A run reads the rows due in (its previous watermark, its watermark] with
Spark (`jobs.transforms.due_scheduled`), schedules the messages it reads
that are due later, and needs the earliest due time still waiting for its
`next_due_ms`: `next_due_after` finds it from the files' statistics,
opening only the files that may hold it.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from jobs.job_tables import NO_VERSION
from schemas import table_path
from schemas.tables import SCHEDULED
from txn_core.storage import options_for


def next_due_after(warehouse: str, version: int, after_ms: int) -> int | None:
    """The earliest due_ms above `after_ms` in `_sys/scheduled` as of
    `version` (None: none). The files whose statistics end above `after_ms`
    bound it by the least of their maxima; only the files that may hold a
    due time in (after_ms, that bound] are read, and only their due_ms."""
    if version == NO_VERSION:
        return None
    from deltalake import DeltaTable

    path = table_path(warehouse, SCHEDULED)
    table = DeltaTable(path, version=version, storage_options=options_for(path))
    files = pa.table(table.get_add_actions(flatten=True))
    if files.num_rows == 0:
        return None
    if "max.due_ms" not in files.column_names or files["max.due_ms"].null_count:
        bound = None  # files without statistics: read the column
    else:
        later = files.filter(pc.greater(files["max.due_ms"], after_ms))
        if later.num_rows == 0:
            return None
        bound = pc.min(later["max.due_ms"]).as_py()
    due = pc.field("due_ms") > after_ms
    if bound is not None:
        due = due & (pc.field("due_ms") <= bound)
    found = table.to_pyarrow_dataset().to_table(columns=["due_ms"], filter=due)["due_ms"]
    earliest: int | None = pc.min(found).as_py()
    return earliest
