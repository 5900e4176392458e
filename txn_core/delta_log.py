"""The Delta log protocol as this project reads and writes it by hand, in one place.

Three shortcuts bypass an engine's own Delta code: producers commit blind
appends (`txn_core.blind_append`), the job reads appended files from log
entries (`jobs.appends`) and commits files Spark wrote (`jobs.commits`).
Each is only taken on a table that asks nothing more of a reader or writer
than what they do; what that means, where a table's log lives and what its
entries are called, and the file statistics readers skip files by are
defined here. No Spark: the broker core imports it.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = [
    "LOG_DIR",
    "SAFE_WRITER_FEATURES",
    "appended",
    "catch_up",
    "checkpoint_versions",
    "entry_name",
    "file_stats",
    "is_log_file",
    "latest_local_version",
    "latest_s3_version",
    "local_dir",
    "local_path",
    "plain_reader",
    "reader_duties",
    "refresh",
    "tip",
    "writer_duties",
]

LOG_DIR = "_delta_log"
#: the attribute of a delta-rs table holding (the version it was at, the
#: version this process appended by hand through it since), for `tip`
_TIP = "_txn_appended"
#: writer features whose duties a writer of whole files (adds and removes of
#: plain columns) meets by itself: appendOnly (it only adds, or the table is
#: not append-only), invariants (NOT NULL is checked; column invariants are
#: refused by `writer_duties`), changeDataFeed (whole files added or removed
#: need no change files)
SAFE_WRITER_FEATURES = frozenset({"appendOnly", "invariants", "changeDataFeed"})
#: reader features under which a data file's rows are the table's rows as written
_PLAIN_READER_FEATURES = frozenset({"timestampNtz"})
#: column metadata that gives a writer a duty (an invariant to check, a value to generate)
_FIELD_DUTIES = (
    "delta.invariants",
    "delta.generationExpression",
    "delta.identity",
    "delta.columnMapping",
)
_CHECKPOINT = re.compile(r"^(\d{20})\.checkpoint(\.\d{10}\.\d{10})?\.parquet\Z")
_LOG_FILE = re.compile(r"^(\d{20})\.(json|crc|checkpoint(\.\d{10}\.\d{10})?\.parquet)\Z")


#: what delta-rs says when it lists a log while another process adds entries
#: to it: the directory listing missed an entry being created (a local
#: directory's listing is in hash order); listed again, the entry is there
TRANSIENT_LOG_ERROR = "Expected contiguous commit files"
#: listings of a log `open_table` makes before it gives up
OPEN_ATTEMPTS = 10


def open_table(
    uri: str, *, version: int | None = None, storage_options: dict[str, str] | None = None
) -> Any:
    """`deltalake.DeltaTable(uri, …)`, listed again (up to `OPEN_ATTEMPTS`
    times) when a concurrent writer's entry was missed (`TRANSIENT_LOG_ERROR`):
    for a reader of a table that producers write at the same time."""
    from deltalake import DeltaTable
    from deltalake.exceptions import DeltaError

    for attempt in range(1, OPEN_ATTEMPTS + 1):
        try:
            return DeltaTable(uri, version=version, storage_options=storage_options)
        except DeltaError as exc:
            if TRANSIENT_LOG_ERROR not in str(exc) or attempt == OPEN_ATTEMPTS:
                raise
            time.sleep(0.005 * attempt)
    raise AssertionError("unreachable")


_ENTRY = re.compile(r"^(\d{20})\.json\Z")


def latest_local_version(root: str) -> int | None:
    """The newest version whose commit entry is in the `_delta_log` of the
    table directory `root`, or None when it has none (no table).

    A listing, no log replay: an entry is linked into place whole, so its
    name alone says the version is committed.
    """
    try:
        names = os.listdir(os.path.join(root, LOG_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return None
    versions = [int(m.group(1)) for m in map(_ENTRY.match, names) if m]
    return max(versions, default=None)


def latest_s3_version(client: Any, bucket: str, table_key: str) -> int | None:
    """The newest version whose commit entry is in the `_delta_log` of the
    table at `table_key` in an S3 `bucket` (a boto3 `client`), or None when
    it has none (no table).

    A listing from the newest checkpoint on (`_last_checkpoint`), no replay
    of the log: where opening the table costs a GET of every entry since
    that checkpoint, this is a GET and a LIST. S3 lists what is written
    (strong consistency), and an entry is put whole.
    """
    log = f"{table_key.strip('/')}/{LOG_DIR}/"
    start = None
    try:
        hint = client.get_object(Bucket=bucket, Key=log + "_last_checkpoint")["Body"].read()
        start = int(json.loads(hint)["version"])
    except client.exceptions.NoSuchKey:
        pass
    except (ValueError, KeyError, TypeError):
        pass  # an unreadable hint: list the whole log
    newest = None
    pages = client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=log, StartAfter=log + (f"{start:020d}" if start is not None else "")
    )
    for page in pages:
        for obj in page.get("Contents", []):
            match = _ENTRY.match(obj["Key"][len(log) :])
            if match:
                newest = max(newest if newest is not None else -1, int(match.group(1)))
    # the checkpoint's own entry may be gone (expired): the checkpoint says it was committed
    return newest if newest is not None else start


def refresh(table: Any, *, behind_own_appends: bool = False) -> None:
    """Bring the delta-rs `table` up to its latest version
    (`update_incremental`), unless a look at two files tells that its log on
    a local disk holds nothing newer (`_local_log_ends_at`).

    On a local disk delta-rs lists the whole `_delta_log` at every update,
    found new entries or not: a cost that grows with the log, which a topic
    keeps for days. Elsewhere (S3 lists from a version) it updates as it is.
    `behind_own_appends`: for a caller that only appends by hand, the table
    may stay behind the versions this process appended through it (`tip`):
    only a commit by someone else brings it up to date.
    """
    root = local_dir(table)
    known = tip(table) if behind_own_appends else table.version()
    if root is None or not _local_log_ends_at(root, known):
        table.update_incremental()


def tip(table: Any) -> int:
    """The newest version of the delta-rs `table` this process knows: the one
    it is at, or past it the last this process appended by hand through it
    (`appended`) while it stayed behind."""
    base, newest = table.__dict__.get(_TIP, (None, None))
    return int(newest) if base == table.version() else int(table.version())


def appended(table: Any, version: int) -> None:
    """Note that this process committed `version` of `table` by hand (an
    entry delta-rs did not write), leaving the table where it is: on a
    local disk delta-rs would list the whole log to move it (`catch_up`)."""
    setattr(table, _TIP, (table.version(), version))


def catch_up(table: Any) -> None:
    """Bring `table` to the version this process appended by hand through it
    (`appended`) if it is behind it, for a caller that reads its files or
    commits through delta-rs. To that version, not the latest: a commit
    from there fails if anyone committed since, as one from the version
    read would (the job's fence, `jobs.fence`, stands on that)."""
    newest = tip(table)
    if newest > table.version():
        table.load_as_version(newest)


def _local_log_ends_at(root: str, version: int) -> bool:
    """Whether the log of the table directory `root` holds no version after
    `version`: no entry of the next one (versions are committed one after
    another), and no checkpoint past it (entries are only removed behind one,
    and `_last_checkpoint` names the newest before any is removed). False
    when that cannot be told."""
    log = os.path.join(root, LOG_DIR)
    if os.path.exists(os.path.join(log, entry_name(version + 1))):
        return False
    try:
        with open(os.path.join(log, "_last_checkpoint"), "rb") as f:
            return int(json.loads(f.read())["version"]) <= version
    except FileNotFoundError:
        return True  # no checkpoint: no entry was ever removed
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable: let delta-rs list the log


def entry_name(version: int) -> str:
    """The file name of a version's commit in `_delta_log/`.

    >>> entry_name(42)
    '00000000000000000042.json'
    """
    return f"{version:020d}.json"


def checkpoint_versions(names: list[str]) -> list[int]:
    """The versions of the checkpoints among a `_delta_log` listing."""
    return [int(m.group(1)) for m in map(_CHECKPOINT.match, names) if m]


def is_log_file(name: str) -> int | None:
    """The version of a commit, checksum or checkpoint file name, else None."""
    match = _LOG_FILE.match(name)
    return int(match.group(1)) if match else None


def local_path(uri: str) -> str | None:
    """`uri` as a local filesystem path (a plain path or a file: URI), else None."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return unquote(parsed.path)
    return uri if parsed.scheme == "" else None


def local_dir(table: Any) -> str | None:
    """A delta-rs table's directory when it is on a local filesystem, else None."""
    return local_path(table.table_uri)


def plain_reader(min_reader_version: int, reader_features: list[str] | None) -> bool:
    """Whether a reader of this protocol reads data files as they are."""
    return min_reader_version == 1 or (
        min_reader_version == 3 and set(reader_features or ()) <= _PLAIN_READER_FEATURES
    )


def reader_duties(table: Any) -> str | None:
    """Why a delta-rs `table` (at its loaded version) does not hold its rows
    in its data files as written — reader features, partitions, column
    mapping — or None when it does."""
    protocol, metadata = table.protocol(), table.metadata()
    if not plain_reader(protocol.min_reader_version, protocol.reader_features):
        return (
            f"reader protocol {protocol.min_reader_version} "
            f"{sorted(protocol.reader_features or ())}"
        )
    if metadata.partition_columns:
        return f"partitioned by {metadata.partition_columns}"
    if metadata.configuration.get("delta.columnMapping.mode", "none") != "none":
        return "table properties ['delta.columnMapping.mode']"
    return None


def writer_duties(table: Any) -> str | None:
    """Why a writer of whole files of plain columns may not write the delta-rs
    `table` — writer features beyond SAFE_WRITER_FEATURES, CHECK constraints,
    column invariants, generated or identity columns — or None."""
    protocol, metadata = table.protocol(), table.metadata()
    if protocol.min_writer_version > 4 and not (
        protocol.min_writer_version == 7
        and set(protocol.writer_features or ()) <= SAFE_WRITER_FEATURES
    ):
        return (
            f"writer protocol {protocol.min_writer_version} with features "
            f"{sorted(protocol.writer_features or ())}"
        )
    constraints = sorted(k for k in metadata.configuration if k.startswith("delta.constraints."))
    if constraints:
        return f"table properties {constraints}"
    for field in json.loads(table.schema().to_json())["fields"]:
        duties = sorted(k for k in field.get("metadata", {}) if k.startswith(_FIELD_DUTIES))
        if duties:
            return f"column {field['name']!r} has {duties}"
    return None


def file_stats(
    metadata: Any, indexed: list[str], string_prefix: int | None = None, bool_bounds: bool = False
) -> dict[str, Any]:
    """Delta file statistics of a parquet file from its footer (pyarrow's
    `FileMetaData`): the row count, and for each indexed top-level column its
    null count and, for integers and strings (and booleans with
    `bool_bounds`, as delta-rs writes them; Delta's Spark writer does not),
    min and max. With
    `string_prefix` (Delta's writer keeps 32 characters) a string's min is
    cut to it, still a lower bound, and a longer max is left out, as it
    would no longer be an upper bound; delta-rs keeps whole values. A column
    whose footer lacks a statistic gets none: readers then keep the file,
    which is always right."""
    stats: dict[str, Any] = {
        "numRecords": metadata.num_rows,
        "minValues": {},
        "maxValues": {},
        "nullCount": {},
    }
    schema = metadata.schema
    wanted = set(indexed)
    for i in range(metadata.num_columns):
        column = schema.column(i)
        if column.path not in wanted:  # nested leaves have dotted paths: never indexed here
            continue
        chunks = [
            metadata.row_group(g).column(i).statistics for g in range(metadata.num_row_groups)
        ]
        if any(s is None or not s.has_null_count for s in chunks):
            continue
        stats["nullCount"][column.path] = sum(s.null_count for s in chunks)
        ordered = (
            column.physical_type in ("INT32", "INT64")
            or (column.physical_type == "BYTE_ARRAY" and str(column.logical_type) == "String")
            or (bool_bounds and column.physical_type == "BOOLEAN")
        )
        with_values = [s for s in chunks if s.num_values > 0]
        if not ordered or not with_values or not all(s.has_min_max for s in with_values):
            continue
        low, high = min(s.min for s in with_values), max(s.max for s in with_values)
        if isinstance(low, str) and string_prefix is not None:
            low = low[:string_prefix]
            if len(high) > string_prefix:
                high = None
        stats["minValues"][column.path] = low
        if high is not None:
            stats["maxValues"][column.path] = high
    return stats
