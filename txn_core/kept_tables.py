"""delta-rs tables a long-lived process keeps open between its uses of them.

Opening a table replays its log from the last checkpoint, and a continuous
job's run uses a dozen of its own tables (the run records, the pending set,
the queues, the topics it commits to), most of them on the run's critical
path (docs/performance.md). A table given back after use is brought up to
date when taken again (`update_incremental`: a listing of the log and the
entries added since), so later commits by anyone (an operator's
compaction, another process) are seen as on a fresh open.

A table is never shared: taking it removes it from here, and a second user
meanwhile opens its own. Only tables on a local disk are kept, and only
while the log entry of the version they were given back at is the same file
(a table deleted and made again at its path is opened afresh).

    >>> table = take("/wh/_sys/runs")              # doctest: +SKIP
    >>> table.version()                            # doctest: +SKIP
    41
    >>> give_back(table)                           # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from txn_core.delta_log import local_path, open_table

if TYPE_CHECKING:
    from deltalake import DeltaTable

#: tables kept at most (the least recently given back go first): a job
#: writes some fifteen; a test process opens hundreds of warehouses
KEPT_MAX = 64

_kept: OrderedDict[str, tuple[DeltaTable, tuple[int, int]]] = OrderedDict()
_lock = threading.Lock()


def take(
    uri: str, storage_options: dict[str, str] | None = None, version: int | None = None
) -> DeltaTable:
    """The delta-rs table at `uri` (at `version`; default: its latest),
    yours until `give_back`: the one given back last, up to date, or a new
    open (`txn_core.delta_log.open_table`), whose errors (no table) it
    raises."""
    key = _key(uri)
    with _lock:
        entry = None if key is None else _kept.pop(key, None)
    if entry is not None:
        table, identity = entry
        if _entry_identity(table) == identity and _updated(table):
            if version is None or table.version() == version:
                return table
            give_back(table)  # up to date, for the next user; this one wants an older version
    opened: DeltaTable = open_table(uri, version=version, storage_options=storage_options)
    return opened


def give_back(table: DeltaTable) -> None:
    """Keep `table` (from `take`, or any delta-rs table) for the next `take`
    of its path; a table on another store than a local disk is dropped."""
    key, identity = _key(table.table_uri), _entry_identity(table)
    if key is None or identity is None:
        return
    with _lock:
        _kept[key] = (table, identity)
        _kept.move_to_end(key)
        while len(_kept) > KEPT_MAX:
            _kept.popitem(last=False)


def _key(uri: str) -> str | None:
    """The table's directory, however `uri` spells it; None off a local disk."""
    root = local_path(uri)
    return None if root is None else os.path.normpath(os.path.abspath(root))


def _entry_identity(table: DeltaTable) -> tuple[int, int] | None:
    """(inode, modification time in ns) of the log entry of the version the
    table is at, on a local disk; None elsewhere or when it is gone."""
    root = local_path(table.table_uri)
    if root is None:
        return None
    try:
        st = os.stat(os.path.join(root, "_delta_log", f"{table.version():020d}.json"))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _updated(table: DeltaTable) -> bool:
    """Whether the table could be brought up to its latest version."""
    from deltalake.exceptions import DeltaError

    try:
        table.update_incremental()
    except (DeltaError, OSError):
        return False
    return True
