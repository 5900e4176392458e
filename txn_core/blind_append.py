"""Blind appends to a Delta table, without delta-rs' per-commit cost.

A group-commit writer is latency-bound (a send waits for two commits), and a
delta-rs append costs far more than what it writes: on a local disk it plans
the write through DataFusion and re-reads the table's file list; on S3 it
lists the log before and after, and reads its own entry back twice.
`BlindAppender` writes one parquet file, then one log entry (`commitInfo` and
the file's `add`) with the primitive delta-rs itself uses (a hard link locally,
a put-if-absent on S3), so delta-rs writers and delta-spark readers share the
table. A lost race reads the winner's entry and moves on: only a change of
protocol or metadata conflicts (`TableChanged` if the table may no longer be
written). Tables asking more of a writer are refused (`unsupported_reason`);
checkpoints stay with delta-rs (`checkpoint_due`). Figures: docs/performance.md.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import time
import uuid
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from txn_core.delta_log import (
    LOG_DIR,
    checkpoint_versions,
    entry_name,
    file_stats,
    local_dir,
    reader_duties,
    writer_duties,
)
from txn_core.storage import is_s3, registered, storage_for

ENGINE_INFO = "lakehouse-txn blind append"
#: on S3, an appender idle longer than this checks that the version it took
#: was never taken before (log clean-up deletes only entries days old)
IDLE_RECHECK_S = 60.0
#: how often a put answered 409 (another put of the key under way) is asked again
CONFLICT_RETRIES = 10


class TableChanged(RuntimeError):
    """The table's protocol or metadata changed so that this appender may no
    longer write it; the caller goes on with delta-rs."""


class TableReplaced(OSError):
    """The table was deleted, and maybe made again, while this appender had
    it open: its log lacks the version before the one just put, and no
    checkpoint explains it. The entry put is taken back."""


class EntryOutcomeUnknown(OSError):
    """The store gave no answer to a put of a log entry, nor to the read
    after it: the rows may be committed. Their file is kept (an entry may
    reference it), and the send is reported failed."""


def unsupported_reason(
    table: DeltaTable, schema: pa.Schema, storage_options: dict[str, str] | None = None
) -> str | None:
    """Why the appender may not write `table` with rows of `schema`, or None.
    On S3 the appender reaches the table with the settings of its registered
    warehouse, so delta-rs `storage_options` of other settings are refused."""
    if local_dir(table) is None:
        if not is_s3(table.table_uri):
            return f"{table.table_uri} is neither on a local filesystem nor on S3"
        storage = registered(table.table_uri)
        if storage is None:
            return f"the warehouse of {table.table_uri} was not opened (txn_core.storage.use)"
        if storage_options is not None and storage_options != storage.delta_rs_options():
            return "its storage options are not its warehouse's settings"
    duties = reader_duties(table) or writer_duties(table)
    if duties is not None:
        return duties
    if not pa.schema(table.schema().to_arrow()).equals(schema, check_metadata=False):
        return "the table's schema differs from the rows'"
    for field in schema:
        if not (
            _has_stats(field.type)
            or pa.types.is_binary(field.type)
            or pa.types.is_map(field.type)
            or pa.types.is_list(field.type)
        ):
            return f"column {field.name!r} is {field.type}, whose statistics it does not write"
    return None


def _has_stats(type_: pa.DataType) -> bool:
    """The column types whose statistics the appender writes as delta-rs does:
    null count, and min/max (full values) when there is a non-null value.
    delta-rs writes none for binary, map and list columns."""
    return bool(
        pa.types.is_integer(type_) or pa.types.is_string(type_) or pa.types.is_boolean(type_)
    )


class BlindAppender:
    """Appends Arrow tables to one Delta table (local or S3); one thread at a time.

    >>> appender = BlindAppender(DeltaTable(path), schema)      # doctest: +SKIP
    >>> appender.append(rows)                                   # doctest: +SKIP
    42

    `dictionary_columns`: the columns whose parquet pages may use dictionary
    encoding (the others are written plain). `after`: the version its first
    commit follows, when the caller knows one newer than the table's (its own
    appends since). `strict`: a lost race raises CommitFailedError, nothing
    committed, rather than moving past the winner, for a writer whose commit
    must follow the version it read (the job's, `jobs.fence`). Raises
    ValueError when the table is not one it may write (`unsupported_reason`).
    """

    def __init__(
        self,
        table: DeltaTable,
        schema: pa.Schema,
        *,
        dictionary_columns: list[str] | None = None,
        storage_options: dict[str, str] | None = None,
        after: int | None = None,
        strict: bool = False,
    ):
        reason = unsupported_reason(table, schema, storage_options)
        if reason is not None:
            raise ValueError(f"cannot append to {table.table_uri} directly: {reason}")
        self._table = table
        self._schema = schema
        self._dictionary = dictionary_columns if dictionary_columns is not None else True
        root = local_dir(table)
        self._store: _Store = _LocalStore(root) if root is not None else _S3Store(table.table_uri)
        self._required = [f.name for f in schema if not f.nullable]
        self._with_stats = [f.name for f in schema if _has_stats(f.type)]
        self._checkpoint_interval = _checkpoint_interval(table)
        self._next = (table.version() if after is None else after) + 1
        self._strict = strict
        self._known_at = time.monotonic()  # when `_next - 1` was last seen in the log
        # File names: unique across processes by the appender's id, within it
        # by a counter (a uuid4 per file would be one more system call).
        self._id = uuid.uuid4()
        self._files = itertools.count()

    def append(self, rows: pa.Table, user_metadata: str | None = None) -> int:
        """Commit `rows` as one new file, with `user_metadata` in the
        commitInfo if given; returns the table version that adds it.

        Raises ValueError (nothing written) for rows of another schema or with
        nulls in a NOT NULL column, TableChanged when a concurrent commit made
        the table one this appender may not write (the file is removed), and
        OSError (or the S3 client's error) when the store refuses the file or
        the log entry.
        """
        self._check(rows)
        seq = next(self._files)
        name = f"part-{seq:05d}-{self._id}-c000.snappy.parquet"
        sink = pa.BufferOutputStream()
        pq.write_table(rows, sink, compression="snappy", use_dictionary=self._dictionary)
        data = sink.getvalue()
        self._store.write_file(name, data)
        try:
            entry = self._entry(data, name, user_metadata)
            return self._commit(entry, seq)
        except EntryOutcomeUnknown:
            raise  # the file stays: a committed entry may reference it
        except BaseException:
            self._store.remove(name)  # never referenced by a committed entry
            raise

    def checkpoint_due(self, version: int) -> bool:
        """Whether the table's checkpointInterval asks for a checkpoint at
        `version`; at the versions delta-rs' own hook picks (4, 9, … for 5)."""
        return (version + 1) % self._checkpoint_interval == 0

    # --- steps ---------------------------------------------------------------------

    def _check(self, rows: pa.Table) -> None:
        if not rows.schema.equals(self._schema, check_metadata=False):
            raise ValueError(f"rows of schema {rows.schema} do not fit {self._table.table_uri}")
        nulls = [n for n in self._required if rows.column(n).null_count]
        if nulls:
            raise ValueError(f"NOT NULL column(s) {nulls} of {self._table.table_uri} hold nulls")

    def _entry(self, data: pa.Buffer, name: str, user_metadata: str | None) -> bytes:
        """The log entry of the commit: commitInfo and the file's add action,
        with the statistics readers skip files by, whole values as delta-rs
        writes them. They must be complete: delta-rs' pyarrow dataset reads a
        missing min/max as a null bound and skips the file for any filter on
        that column."""
        stats = file_stats(
            pq.read_metadata(pa.BufferReader(data)), self._with_stats, bool_bounds=True
        )
        now_ms = time.time_ns() // 1_000_000
        commit_info = {
            "timestamp": now_ms,
            "operation": "WRITE",
            "operationParameters": {"mode": "Append"},
            "isBlindAppend": True,
            "engineInfo": ENGINE_INFO,
            "clientVersion": ENGINE_INFO,
        }
        if user_metadata is not None:
            commit_info["userMetadata"] = user_metadata
        add = {
            "path": name,
            "partitionValues": {},
            "size": data.size,
            "modificationTime": now_ms,
            "dataChange": True,
            "stats": json.dumps(stats, separators=(",", ":")),
        }
        return (
            json.dumps({"commitInfo": commit_info}) + "\n" + json.dumps({"add": add}) + "\n"
        ).encode()

    def _commit(self, entry: bytes, seq: int) -> int:
        """Put the entry at the first free version from `_next` on."""
        staged = self._store.stage(entry, f"{self._id}_{seq}")
        try:
            while True:
                version = self._next
                if not self._put_entry(version, staged, entry):
                    winner = self._store.read_entry(version)
                    if winner == entry:  # ours: a retried put whose answer was lost
                        return self._committed(version)
                    self._refuse_if_strict(version)
                    self._next = version + 1
                    self._after_lost_race(winner)
                    continue
                if self._behind_a_checkpoint(version):
                    # Our handle fell behind while others committed past a
                    # checkpoint and the log was cleaned behind it: this version
                    # had existed. No reader looks below that checkpoint; move on,
                    # checking the table (the versions jumped over were not read
                    # one by one as lost races are).
                    self._store.remove_entry(version)
                    self._refuse_if_strict(version)
                    self._revalidate()
                    continue
                return self._committed(version)
        finally:
            self._store.unstage(staged)

    def _put_entry(self, version: int, staged: Staged, entry: bytes) -> bool:
        """`put_entry`, where a put with no answer (its responses lost, the
        client's retries spent) is settled by reading the entry back: it may
        have been written. Not settled, it raises EntryOutcomeUnknown."""
        try:
            return self._store.put_entry(version, staged)
        except Exception as exc:
            status = _status(exc) if isinstance(getattr(exc, "response", None), dict) else None
            if not self._store.remote or (status is not None and status < 500):
                raise  # a local link happened or not; a 4xx refused the put
            try:
                written = self._store.read_entry(version)
            except Exception:  # noqa: BLE001 - the store is still not answering
                written = None
            if written is not None:
                return written == entry  # another's entry: ours cannot be there
            raise EntryOutcomeUnknown(
                f"{self._table.table_uri}: the store did not answer whether version "
                f"{version} was written ({exc}); it may hold the rows"
            ) from exc

    def _committed(self, version: int) -> int:
        self._next = version + 1
        self._known_at = time.monotonic()
        return version

    def _refuse_if_strict(self, version: int) -> None:
        if self._strict:
            from deltalake.exceptions import CommitFailedError

            raise CommitFailedError(
                f"{self._table.table_uri}: version {version} was committed by another writer"
            )

    def _after_lost_race(self, winner: bytes | None) -> None:
        """A blind append conflicts with nothing but a protocol or metadata change."""
        if winner is None:  # cleaned up meanwhile: it was old, nothing to learn
            return
        if any(
            {"metaData", "protocol"} & json.loads(line).keys()
            for line in winner.splitlines()
            if line.strip()
        ):
            self._revalidate()

    def _revalidate(self) -> None:
        """Check the table as it is now, as at construction."""
        self._table.update_incremental()
        reason = unsupported_reason(self._table, self._schema)
        if reason is not None:
            raise TableChanged(f"{self._table.table_uri} changed: {reason}")
        self._checkpoint_interval = _checkpoint_interval(self._table)

    def _behind_a_checkpoint(self, version: int) -> bool:
        """Whether `version` lies below a checkpoint (so it existed and was
        cleaned up); if so, `_next` moves past the newest checkpoint. Versions
        are contiguous and removed oldest first, so a present predecessor
        proves `version` new. On S3 the proof is asked for only after an idle
        spell: clean-up removes entries days old, never one just seen."""
        if self._store.remote and time.monotonic() - self._known_at < IDLE_RECHECK_S:
            return False
        if version == 0 or self._store.entry_exists(version - 1):
            return False
        newest = self._store.newest_checkpoint()
        if newest is None or newest < version:
            # Nothing removes an entry but below a checkpoint: this log is
            # not the one the appender read (committing here left a gap
            # every reader refuses, and took offsets another broker holds).
            self._store.remove_entry(version)
            raise TableReplaced(
                f"{self._table.table_uri}: its log has no version {version - 1} and no "
                "checkpoint past it: the table was deleted or made again while this "
                "process had it open; open the broker again"
            )
        self._next = max(self._next, newest + 1)
        return True


def _checkpoint_interval(table: DeltaTable) -> int:
    return int(table.metadata().configuration.get("delta.checkpointInterval", "100"))


#: a log entry ready to be put: a staged file's path (local disk) or its bytes (S3)
Staged = str | bytes


class _Store(Protocol):
    """Where a table's files and log entries are written."""

    remote: bool

    def write_file(self, name: str, data: pa.Buffer) -> None: ...
    def remove(self, name: str) -> None: ...
    def stage(self, entry: bytes, tag: str) -> Staged: ...
    def unstage(self, staged: Staged) -> None: ...
    def put_entry(self, version: int, staged: Staged) -> bool: ...
    def read_entry(self, version: int) -> bytes | None: ...
    def remove_entry(self, version: int) -> None: ...
    def entry_exists(self, version: int) -> bool: ...
    def newest_checkpoint(self) -> int | None: ...


class _LocalStore:
    """A table on a local disk. Every system call releases the GIL, and under a
    few hundred sender threads taking it back costs a fraction of a
    millisecond: as few calls as can be (no stat, raw os calls)."""

    remote = False

    def __init__(self, root: str):
        self._root = root
        self._log = os.path.join(root, LOG_DIR)

    def write_file(self, name: str, data: pa.Buffer) -> None:
        _write_new_file(os.path.join(self._root, name), data)

    def remove(self, name: str) -> None:
        _remove_quietly(os.path.join(self._root, name))

    def stage(self, entry: bytes, tag: str) -> Staged:
        staged = os.path.join(self._log, f"_commit_{tag}.json.tmp")
        _write_new_file(staged, entry)
        return staged

    def unstage(self, staged: Staged) -> None:
        assert isinstance(staged, str)
        _remove_quietly(staged)

    def put_entry(self, version: int, staged: Staged) -> bool:
        # A hard link fails if the version exists: delta-rs' own primitive here.
        assert isinstance(staged, str)
        try:
            os.link(staged, os.path.join(self._log, entry_name(version)))
            return True
        except FileExistsError:
            return False

    def read_entry(self, version: int) -> bytes | None:
        try:
            with open(os.path.join(self._log, entry_name(version)), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def remove_entry(self, version: int) -> None:
        _remove_quietly(os.path.join(self._log, entry_name(version)))

    def entry_exists(self, version: int) -> bool:
        return os.path.exists(os.path.join(self._log, entry_name(version)))

    def newest_checkpoint(self) -> int | None:
        return max(checkpoint_versions(os.listdir(self._log)), default=None)


class _S3Store:
    """A table on S3, through the warehouse's boto3 client; the log entry with
    `If-None-Match: *`, which the store was checked to enforce when the
    warehouse was opened (`txn_core.storage`)."""

    remote = True

    def __init__(self, uri: str):
        bucket, _, prefix = uri.split("://", 1)[1].partition("/")
        self._bucket, self._prefix = bucket, prefix.rstrip("/")
        self._client = storage_for(uri).s3_client()

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}" if self._prefix else name

    def _entry_key(self, version: int) -> str:
        return self._key(f"{LOG_DIR}/{entry_name(version)}")

    def write_file(self, name: str, data: pa.Buffer) -> None:
        self._client.put_object(Bucket=self._bucket, Key=self._key(name), Body=data.to_pybytes())

    def remove(self, name: str) -> None:
        self._delete(self._key(name))

    def stage(self, entry: bytes, tag: str) -> Staged:
        return entry

    def unstage(self, staged: Staged) -> None:
        pass

    def put_entry(self, version: int, staged: Staged) -> bool:
        from botocore.exceptions import ClientError

        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                self._client.put_object(
                    Bucket=self._bucket, Key=self._entry_key(version), Body=staged, IfNoneMatch="*"
                )
                return True
            except ClientError as exc:
                status = _status(exc)
                if status == 412:
                    return False
                # 409: a concurrent put of the same key was under way; ask again
                if status != 409 or attempt == CONFLICT_RETRIES:
                    raise
                time.sleep(0.01 * (attempt + 1))
        raise AssertionError("unreachable")

    def read_entry(self, version: int) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            return bytes(
                self._client.get_object(Bucket=self._bucket, Key=self._entry_key(version))[
                    "Body"
                ].read()
            )
        except ClientError as exc:
            if _status(exc) == 404:
                return None
            raise

    def remove_entry(self, version: int) -> None:
        self._delete(self._entry_key(version))

    def entry_exists(self, version: int) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self._bucket, Key=self._entry_key(version))
            return True
        except ClientError as exc:
            if _status(exc) == 404:
                return False
            raise

    def newest_checkpoint(self) -> int | None:
        """From `_last_checkpoint`, which every checkpoint writer updates (a
        listing of the log would read every entry's name)."""
        from botocore.exceptions import ClientError

        try:
            body = self._client.get_object(
                Bucket=self._bucket, Key=self._key(f"{LOG_DIR}/_last_checkpoint")
            )["Body"].read()
        except ClientError as exc:
            if _status(exc) == 404:
                return None
            raise
        return int(json.loads(body)["version"])

    def _delete(self, key: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._client.delete_object(Bucket=self._bucket, Key=key)
        except ClientError:
            pass  # an unreferenced file: vacuum removes it later


def _status(exc: Any) -> int | None:
    """The HTTP status of a botocore ClientError."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None if status is None else int(status)


def _write_new_file(path: str, data: bytes | pa.Buffer) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        rest = memoryview(data).cast("B")
        # A write may take fewer bytes than given (a disk filling up, a file
        # size limit): a file cut short would be committed, its table unreadable.
        while rest:
            written = os.write(fd, rest)
            if written == 0:
                raise OSError(errno.ENOSPC, f"no byte of the last {len(rest)} written", path)
            rest = rest[written:]
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
