"""Blind appends to a Delta table on a local disk, without delta-rs' per-commit cost.

Why: a delta-rs append of 70 half rows cost 13 ms of CPU on a fresh table and
25-34 ms once it held 100-300 files (measured here, deltalake 1.6.6: it plans
the write through DataFusion, wakes its runtime's threads for every step, and
re-materialises the table's file list after the commit), while the parquet
file itself takes 1-2 ms and the log entry a few hundred microseconds. The
group-commit writers are latency-bound (a send waits for two commits), so that
overhead was most of a send's latency.

What: exactly a blind append of the Delta protocol — one parquet file and one
log entry holding `commitInfo` and its `add` action — committed with the
primitive delta-rs itself uses on a local filesystem: the entry is written to
a staging file and hard-linked to `_delta_log/<version>.json`, which fails if
that version exists. Appenders, delta-rs writers (compactions, retention
deletes, other processes) and delta-spark readers can therefore share the
table, as SPEC §2 asks of the producer tables (one writer engine per table:
this is that engine's log protocol, not a second one).

A lost race moves on to the next version after reading the winner's entry: a
blind append conflicts only with a change of the table's protocol or metadata,
and after one the appender re-checks the table before committing again. A
table whose protocol asks more of a writer than this (column mapping,
constraints, generated columns, any writer feature beyond appendOnly,
invariants and changeDataFeed, partitions) is refused (`unsupported_reason`);
the group-commit writer then uses delta-rs. Checkpoints stay with delta-rs:
`checkpoint_due(version)` tells the caller when the table's
`delta.checkpointInterval` asks for one.

The add action carries the statistics delta-rs would write for the same rows
(tests compare them): readers skip files by them. An appender left behind
while other processes committed past a checkpoint and trimmed the log behind
it (`txn_core.log_trim`) could link a version that existed and was deleted;
it notices (the predecessor is missing and a newer checkpoint exists), takes
the entry back and goes on after that checkpoint. Like delta-rs on a local
disk, nothing is fsynced.
"""
from __future__ import annotations

import itertools
import json
import os
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable

from txn_core.log_trim import checkpoint_versions, local_dir

ENGINE_INFO = "lakehouse-txn local append"
#: writer features whose duties a blind append of plain columns meets by
#: itself (appendOnly: it only adds; invariants: NOT NULL is checked below and
#: column invariants are refused; changeDataFeed: inserts need no CDC files)
_APPEND_SAFE_FEATURES = {"appendOnly", "invariants", "changeDataFeed"}
_FIELD_DUTIES = ("delta.invariants", "delta.generationExpression", "delta.identity",
                 "delta.columnMapping")


class TableChanged(RuntimeError):
    """The table's protocol or metadata changed so that this appender may no
    longer write it; the caller goes on with delta-rs."""


def unsupported_reason(table: DeltaTable, schema: pa.Schema) -> str | None:
    """Why the appender may not write `table` with rows of `schema`, or None."""
    if local_dir(table) is None:
        return f"{table.table_uri} is not on a local filesystem"
    protocol = table.protocol()
    if protocol.min_reader_version > 1 or protocol.reader_features:
        return f"reader protocol {protocol.min_reader_version} {protocol.reader_features or ''}"
    if protocol.min_writer_version > 4 and not (
            protocol.min_writer_version == 7
            and set(protocol.writer_features or ()) <= _APPEND_SAFE_FEATURES):
        return (f"writer protocol {protocol.min_writer_version} with features "
                f"{sorted(protocol.writer_features or ())}")
    metadata = table.metadata()
    if metadata.partition_columns:
        return f"partitioned by {metadata.partition_columns}"
    duties = sorted(k for k in metadata.configuration
                    if k.startswith("delta.constraints.") or k == "delta.columnMapping.mode")
    if duties:
        return f"table properties {duties}"
    delta_schema = table.schema()
    for field in delta_schema.fields:
        if any(k.startswith(_FIELD_DUTIES) for k in field.metadata):
            return f"column {field.name!r} has {sorted(field.metadata)}"
    if not pa.schema(delta_schema.to_arrow()).equals(schema, check_metadata=False):
        return "the table's schema differs from the rows'"
    for field in schema:
        if not (_has_stats(field.type) or pa.types.is_binary(field.type)
                or pa.types.is_map(field.type)):
            return f"column {field.name!r} is {field.type}, whose statistics it does not write"
    return None


def _has_stats(type_: pa.DataType) -> bool:
    """The column types whose statistics the appender writes as delta-rs does:
    null count, and min/max (full values) when there is a non-null value.
    delta-rs writes none for binary and map columns."""
    return pa.types.is_integer(type_) or pa.types.is_string(type_)


class LocalAppender:
    """Appends Arrow tables to one local Delta table; one thread at a time.

    >>> appender = LocalAppender(DeltaTable(path), schema)      # doctest: +SKIP
    >>> appender.append(rows)                                   # doctest: +SKIP
    42

    `dictionary_columns`: the columns whose parquet pages may use dictionary
    encoding (the others are written plain). Raises ValueError when the table
    is not one it may write (`unsupported_reason`).
    """

    def __init__(self, table: DeltaTable, schema: pa.Schema, *,
                 dictionary_columns: list[str] | None = None):
        reason = unsupported_reason(table, schema)
        if reason is not None:
            raise ValueError(f"cannot append to {table.table_uri} directly: {reason}")
        self._table = table
        self._schema = schema
        self._dictionary = dictionary_columns if dictionary_columns is not None else True
        self._root = local_dir(table)
        self._log = os.path.join(self._root, "_delta_log")
        self._required = [f.name for f in schema if not f.nullable]
        self._with_stats = [f.name for f in schema if _has_stats(f.type)]
        self._checkpoint_interval = _checkpoint_interval(table)
        self._next = table.version() + 1
        # File names: unique across processes by the appender's id, within it
        # by a counter (a uuid4 per file would be one more system call, see _commit).
        self._id = uuid.uuid4()
        self._files = itertools.count()

    def append(self, rows: pa.Table) -> int:
        """Commit `rows` as one new file; returns the table version that adds it.

        Raises ValueError (nothing written) for rows of another schema or with
        nulls in a NOT NULL column, TableChanged when a concurrent commit made
        the table one this appender may not write (the file is removed), and
        OSError when the disk refuses the file or the log entry.
        """
        self._check(rows)
        seq = next(self._files)
        name = f"part-{seq:05d}-{self._id}-c000.snappy.parquet"
        path = os.path.join(self._root, name)
        sink = pa.BufferOutputStream()
        pq.write_table(rows, sink, compression="snappy", use_dictionary=self._dictionary)
        data = sink.getvalue()
        _write_new_file(path, data)
        try:
            entry = self._entry(rows, name, data.size)
            return self._commit(entry, seq)
        except BaseException:
            _remove_quietly(path)  # never referenced by a committed entry
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
            raise ValueError(f"NOT NULL column(s) {nulls} of {self._table.table_uri} "
                             f"hold nulls")

    def _entry(self, rows: pa.Table, name: str, size: int) -> bytes:
        """The log entry of the commit: commitInfo and the file's add action,
        with the statistics readers skip files by. They must be complete:
        delta-rs' pyarrow dataset reads a missing min/max as a null bound and
        skips the file for any filter on that column."""
        stats: dict = {"numRecords": rows.num_rows, "minValues": {}, "maxValues": {},
                       "nullCount": {n: rows.column(n).null_count for n in self._with_stats}}
        for n in self._with_stats:
            # Python's order of str is code point order, which is the UTF-8
            # byte order Delta's string statistics use.
            values = [v for v in rows.column(n).to_pylist() if v is not None]
            if values:
                stats["minValues"][n] = min(values)
                stats["maxValues"][n] = max(values)
        now_ms = time.time_ns() // 1_000_000
        commit_info = {"timestamp": now_ms, "operation": "WRITE",
                       "operationParameters": {"mode": "Append"}, "isBlindAppend": True,
                       "engineInfo": ENGINE_INFO, "clientVersion": ENGINE_INFO}
        add = {"path": name, "partitionValues": {}, "size": size,
               "modificationTime": now_ms, "dataChange": True,
               "stats": json.dumps(stats, separators=(",", ":"))}
        return (json.dumps({"commitInfo": commit_info}) + "\n"
                + json.dumps({"add": add}) + "\n").encode()

    def _commit(self, entry: bytes, seq: int) -> int:
        """Link the entry to the first free version from `_next` on.

        Every system call releases the GIL, and under a few hundred sender
        threads taking it back cost this thread a fraction of a millisecond
        each time: the commit path makes as few as it can (no stat, no
        getrandom, raw os calls instead of buffered files)."""
        staged = os.path.join(self._log, f"_commit_{self._id}_{seq}.json.tmp")
        _write_new_file(staged, entry)
        try:
            while True:
                version = self._next
                target = os.path.join(self._log, f"{version:020d}.json")
                try:
                    os.link(staged, target)
                except FileExistsError:
                    self._next = version + 1
                    self._after_lost_race(target)
                    continue
                if self._behind_a_checkpoint(version):
                    # Our handle fell behind while other processes committed past a
                    # checkpoint and trimmed the log: this version had existed and
                    # was trimmed. No reader looks below that checkpoint; move on,
                    # checking the table: the versions jumped over were not read
                    # one by one as lost races are.
                    _remove_quietly(target)
                    self._revalidate()
                    continue
                self._next = version + 1
                return version
        finally:
            _remove_quietly(staged)

    def _after_lost_race(self, winner: str) -> None:
        """A blind append conflicts with nothing but a protocol or metadata change."""
        try:
            with open(winner, "rb") as f:
                changed = any({"metaData", "protocol"} & json.loads(line).keys()
                              for line in f if line.strip())
        except FileNotFoundError:  # trimmed meanwhile: it was old, nothing to learn
            return
        if changed:
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
        trimmed); if so, `_next` moves past the newest checkpoint. Versions are
        contiguous and trimmed oldest first, so a present predecessor proves
        `version` new (the usual, one-stat case)."""
        if os.path.exists(os.path.join(self._log, f"{version - 1:020d}.json")):
            return False
        newest = max(checkpoint_versions(os.listdir(self._log)), default=-1)
        if newest < version:
            return False
        self._next = max(self._next, newest + 1)
        return True


def _checkpoint_interval(table: DeltaTable) -> int:
    return int(table.metadata().configuration.get("delta.checkpointInterval", "100"))


def _write_new_file(path: str, data) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
