"""delta-rs tables a long-lived process keeps open between its uses of them.

Opening a table replays its log from the last checkpoint, and a continuous
job's run uses a dozen of its own tables (the run records, the pending set,
the queues, the topics it commits to), most of them on the run's critical
path (docs/performance.md). A table given back after use is brought up to
date when taken again (`txn_core.delta_log.refresh`: on a local disk a look
at the next entry, a listing of the log and the entries added since only
when there are any), so later commits by anyone (an operator's
compaction, another process) are seen as on a fresh open.

A table is never shared: taking it removes it from here, and a second user
meanwhile opens its own. A table is kept only while the log entry of the
version it was given back at is the same file (a table deleted and made
again at its path is opened afresh): on a local disk its inode and
modification time, on S3 its ETag and modification time (a HEAD request on
taking, and on giving back at a new version, where an open costs a GET of
the checkpoint and of every entry after it). An S3 table is kept only when
it was opened with the options of its registered warehouse
(`txn_core.storage`), whose client makes the HEAD.

    >>> table = take("/wh/_sys/runs")              # doctest: +SKIP
    >>> table.version()                            # doctest: +SKIP
    41
    >>> give_back(table)                           # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from txn_core.delta_log import entry_name, local_path, open_table, refresh
from txn_core.storage import StorageError, is_s3, registered

if TYPE_CHECKING:
    from deltalake import DeltaTable

#: tables kept at most (the least recently given back go first): a job
#: writes some fifteen; a test process opens hundreds of warehouses
KEPT_MAX = 64

#: what tells one log entry from another file at its path (`_entry_identity`)
Identity = tuple[object, object]

_kept: OrderedDict[str, tuple[DeltaTable, Identity]] = OrderedDict()
_lock = threading.Lock()
#: the attribute of a taken table holding its version and entry identity as
#: `take` checked them (a HEAD request on S3), for `give_back` of a table
#: nobody committed to (a DeltaTable is not hashable: no dict can key it)
_CHECKED = "_txn_kept_checked"
#: the attribute of a taken table holding (its version, `time.monotonic_ns`
#: once `take` had read it there), for `read_at`
_READ = "_txn_kept_read"


def take(
    uri: str,
    storage_options: dict[str, str] | None = None,
    version: int | None = None,
    *,
    behind_own_appends: bool = False,
) -> DeltaTable:
    """The delta-rs table at `uri` (at `version`; default: its latest),
    yours until `give_back`: the one given back last, up to date, or a new
    open (`txn_core.delta_log.open_table`), whose errors (no table) it
    raises. `behind_own_appends`: for a caller that only appends by hand
    from its `delta_log.tip`, the table may stay behind the versions this
    process appended through it (`delta_log.refresh`)."""
    key = _key(uri)
    with _lock:
        entry = None if key is None else _kept.pop(key, None)
    if key is not None and entry is not None:
        table, identity = entry
        if local_path(uri) is None and table._storage_options != storage_options:
            _keep(key, entry)  # for a caller with the options it was opened with
        elif _entry_identity(table) == identity:
            checked_at = table.version()
            if _updated(table, behind_own_appends):
                # given back still at the version checked here, it needs no new check
                setattr(table, _CHECKED, (checked_at, identity))
                if version is None or table.version() == version:
                    return _read_now(table)
                give_back(table)  # up to date, for the next user; this one wants another version
    opened: DeltaTable = open_table(uri, version=version, storage_options=storage_options)
    return _read_now(opened)


def read_at(table: DeltaTable) -> int | None:
    """When (`time.monotonic_ns`) `take` had read `table` at the version it
    is at: every commit up to that version was made before then. None for a
    table `take` did not hand out, or one that moved since (its version
    read later, by someone else's call)."""
    read = table.__dict__.get(_READ)
    return read[1] if read is not None and read[0] == table.version() else None


def _read_now(table: DeltaTable) -> DeltaTable:
    setattr(table, _READ, (table.version(), time.monotonic_ns()))
    return table


def give_back(table: DeltaTable) -> None:
    """Keep `table` (from `take`, or any delta-rs table) for the next `take`
    of its path; a table that cannot be kept (above) is dropped."""
    key = _key(table.table_uri)
    if key is None:
        return
    checked = table.__dict__.pop(_CHECKED, None)
    same = checked is not None and checked[0] == table.version()
    identity = checked[1] if checked is not None and same else _entry_identity(table)
    if identity is not None:
        _keep(key, (table, identity))


def _keep(key: str, entry: tuple[DeltaTable, Identity]) -> None:
    with _lock:
        _kept[key] = entry
        _kept.move_to_end(key)
        while len(_kept) > KEPT_MAX:
            _kept.popitem(last=False)


def _key(uri: str) -> str | None:
    """The table's directory, however `uri` spells it; None off a local disk and S3."""
    if is_s3(uri):
        return "s3://" + uri.split("://", 1)[1].rstrip("/")
    root = local_path(uri)
    return None if root is None else os.path.normpath(os.path.abspath(root))


def _entry_identity(table: DeltaTable) -> Identity | None:
    """What tells the log entry of the version the table is at from another
    file at its path; None when it is gone, or on another store."""
    try:
        version = table.version()
        if is_s3(table.table_uri):
            return _s3_entry_identity(table, version)
        root = local_path(table.table_uri)
        if root is None:
            return None
        st = os.stat(os.path.join(root, "_delta_log", entry_name(version)))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _s3_entry_identity(table: DeltaTable, version: int) -> Identity | None:
    """(ETag, modification time) of the entry, by a HEAD request of the
    client of the table's registered warehouse; None when the table was
    opened with other options (another endpoint, region or addressing) or
    the entry cannot be seen."""
    log = _s3_log(table.table_uri, table._storage_options)
    if log is None:
        return None
    client, bucket, prefix = log
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        head = client.head_object(Bucket=bucket, Key=prefix + entry_name(version))
    except (BotoCoreError, ClientError):
        return None
    return head.get("ETag"), head.get("LastModified")


def log_entry(
    uri: str, version: int, storage_options: dict[str, str] | None = None
) -> tuple[object | None, bool] | None:
    """(what tells the log entry of `version` of the table at `uri` from
    another file at its path, None when it is gone; whether an entry of a
    later version exists), in one look: two `stat`s on a local disk, one
    LIST on S3 (its ETag, with the client of the table's registered
    warehouse). None where that cannot be told: another store, or other
    options than the warehouse's.

    Cheaper than bringing a table up to date (on S3 a HEAD, a LIST and a
    GET), for a caller that only asks whether anything was committed after
    a version it knows.
    """
    if is_s3(uri):
        return _s3_log_entry(uri, version, storage_options)
    root = local_path(uri)
    if root is None:
        return None
    log = os.path.join(root, "_delta_log")
    try:
        st = os.stat(os.path.join(log, entry_name(version)))
        identity: object | None = (st.st_ino, st.st_mtime_ns)
    except FileNotFoundError:
        identity = None
    # versions are committed one after another: a later one exists iff the next does
    return identity, os.path.exists(os.path.join(log, entry_name(version + 1)))


def _s3_log_entry(
    uri: str, version: int, storage_options: dict[str, str] | None
) -> tuple[object | None, bool] | None:
    log = _s3_log(uri, storage_options)
    if log is None:
        return None
    client, bucket, prefix = log
    entry = entry_name(version)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        # keys sort as versions do, a version's checkpoint before its entry,
        # and `_last_checkpoint` after every version: the entry, then what follows
        listed = client.list_objects_v2(
            Bucket=bucket, Prefix=prefix, StartAfter=prefix + entry[:-1], MaxKeys=2
        )
    except (BotoCoreError, ClientError):
        return None
    names = [obj["Key"][len(prefix) :] for obj in listed.get("Contents", [])]
    etags = [obj.get("ETag") for obj in listed.get("Contents", [])]
    identity = etags[0] if names[:1] == [entry] else None
    later = names[1:] if identity is not None else names
    return identity, any(name[:20].isdigit() and int(name[:20]) > version for name in later)


def _s3_log(uri: str, storage_options: dict[str, str] | None) -> tuple[Any, str, str] | None:
    """(the S3 client of the table's registered warehouse, the bucket, the key
    prefix of its `_delta_log/`); None when the table is opened with other
    options than the warehouse's (another endpoint, region or addressing),
    or there is no client (no boto3: the table is opened at each use)."""
    storage = registered(uri)
    if storage is None or storage.delta_rs_options() != storage_options:
        return None
    try:
        client = storage.s3_client()
    except (ImportError, StorageError):
        return None
    bucket, _, key = uri.split("://", 1)[1].partition("/")
    return client, bucket, f"{key.strip('/')}/_delta_log/"


def _updated(table: DeltaTable, behind_own_appends: bool) -> bool:
    """Whether the table could be brought up to its latest version."""
    from deltalake.exceptions import DeltaError

    try:
        refresh(table, behind_own_appends=behind_own_appends)
    except (DeltaError, OSError):
        return False
    return True
