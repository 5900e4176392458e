"""The broker core: durable half and OP rows on Delta tables, without a JVM
(delta-rs, and on a local disk plain blind appends: `txn_core.blind_append`).

A Broker is one process's handle on a warehouse. It owns one group-commit
writer per producer table and an offset epoch; producers (any number, any
groups, any threads) share it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, overload

import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from schemas import HALF, OP, TableSchema, table_path
from schemas.arrow import arrow_schema
from txn_core import forks
from txn_core.config import Config
from txn_core.errors import BrokerClosedError, PersistError
from txn_core.group_commit import AFTER_STAMP, Columns, DirectWriter, GroupCommitWriter, WriterStats
from txn_core.log_trim import job_cursor
from txn_core.message import Message, delivery_times, validate_group, validate_text
from txn_core.offsets import OffsetAllocator, register_epoch
from txn_core.storage import options_for, resolve_warehouse
from txn_core.tables import ensure_broker_tables
from txn_core.vocabulary import CANCEL, Action, MessageType, Source

log = logging.getLogger(__name__)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Broker:
    """Open with `Broker.open(warehouse)`; share one per process; `close()` at the end.

    >>> broker = Broker.open("/tmp/warehouse")                      # doctest: +SKIP
    >>> broker.resolve("7F0001…", commit=True, remark="ops ticket 42")  # doctest: +SKIP
    """

    def __init__(
        self,
        warehouse: str,
        tables: Mapping[str, DeltaTable],
        config: Config,
        clock: Callable[[], int],
        storage_options: dict[str, str] | None,
        group_commit: bool = True,
    ):
        self.warehouse = warehouse
        self.config = config
        self.clock = clock
        self.storage_options = storage_options
        self.broker_id = uuid.uuid4().hex
        self._tables = dict(tables)
        producers = self._tables["_sys/producers"]
        try:
            epoch = register_epoch(producers, self.broker_id, clock())
        except (DeltaError, OSError) as exc:  # no permission to write, a full disk, ...
            raise PersistError(
                f"could not register this broker in {producers.table_uri}: {exc} (producers "
                "need write access to the warehouse)"
            ) from exc
        self._offsets = OffsetAllocator(
            epoch, lambda: register_epoch(producers, self.broker_id, clock())
        )
        #: columns whose values are unique by construction: no dictionary encoding
        plain = {
            HALF: ("half_offset", "transaction_id", "msg_id"),
            OP: ("op_offset", "half_offset", "transaction_id"),
        }

        def writer(table: TableSchema) -> GroupCommitWriter | DirectWriter:
            if not group_commit:  # one commit per call: only for measuring what group commit buys
                return DirectWriter(
                    table_path(warehouse, table),
                    arrow_schema(table),
                    name=table.path,
                    clock=clock,
                    storage_options=storage_options,
                )
            # The log is trimmed behind the job's cursor (txn_core.log_trim).
            return GroupCommitWriter(
                self._tables[table.path],
                arrow_schema(table),
                name=table.path,
                clock=clock,
                log_floor=lambda: job_cursor(warehouse, table, storage_options),
                plain_columns=plain[table],
                storage_options=storage_options,
                min_commit_interval_s=config.group_commit_interval_ms / 1000,
            )

        self._half = writer(HALF)
        self._op = writer(OP)
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        warehouse: str | os.PathLike[str] | Config,
        *,
        config: Config | None = None,
        clock: Callable[[], int] | None = None,
        storage_options: dict[str, str] | None = None,
        group_commit: bool = True,
    ) -> Broker:
        """Open the warehouse, creating missing producer tables.

        `warehouse` may be a path/URI or a Config (its `warehouse` and `s3_*`
        settings are used). `clock` returns epoch milliseconds (tests inject
        one); `storage_options`, when given, go to delta-rs as they are instead
        of those the settings make. `group_commit=False` makes every append
        its own commit (the naive design; benchmarks only).

        Before anything is written, an object store is checked once per
        process (`txn_core.storage`): StorageError names what is wrong.
        """
        forks.note_use("Broker.open")
        if isinstance(warehouse, os.PathLike):
            warehouse = os.fspath(warehouse)
        if isinstance(warehouse, Config):
            config, warehouse = warehouse, warehouse.warehouse
        if config is None:
            config = Config(warehouse=warehouse)
            named: str | Config = warehouse
        else:  # its settings, for the warehouse named
            named = replace(config, warehouse=warehouse)
        warehouse, _ = resolve_warehouse(named, storage_options, check=True)
        storage_options = options_for(warehouse, storage_options)
        tables = ensure_broker_tables(warehouse, storage_options=storage_options)
        return cls(warehouse, tables, config, clock or wall_clock_ms, storage_options, group_commit)

    @property
    def epoch(self) -> int:
        return self._offsets.epoch

    def table(self, path: str) -> DeltaTable:
        """The broker's own handle on one of its tables (e.g. "_sys/check_answers")."""
        return self._tables[path]

    # --- writes -------------------------------------------------------------------

    def store_halves(
        self,
        group: str,
        messages: Sequence[Message],
        message_type: MessageType = MessageType.TRANSACTION,
    ) -> StoredMessages:
        """Persist half rows for `messages` in one commit; return copies with ids set.

        `message_type` NORMAL stores plain messages: committed by this
        store, never checked (their `check_immunity_s` is not kept).
        A message's delay, plain or transactional, (`delay_level`, `delay_ms`, `deliver_at_ms`)
        becomes its `deliver_at_ms` column (store_ms + delay for a relative
        one); one beyond `max_delay_ms` raises MessageValidationError, with
        nothing written.
        Returns only once the rows are durable (committed); raises PersistError
        when they are not. Columns are built straight from the inputs: this is
        the bulk path's hot loop.
        """
        self._check_open()
        n = len(messages)
        plain = message_type == MessageType.NORMAL
        times = delivery_times(
            messages, self.clock(), self.config.delay_level_ms, self.config.max_delay_ms
        )
        offsets = self._offsets.take(n)
        ids = new_message_ids(n)
        bodies = [m.body if type(m.body) is bytes else bytes(m.body) for m in messages]
        columns: Columns = {
            "half_offset": offsets,
            "transaction_id": ids,
            "msg_id": ids,
            "producer_group": [group] * n,
            "topic": [m.topic for m in messages],
            "queue_id": [m.queue_id for m in messages],
            "tags": [m.tags for m in messages],
            "keys": [m.keys for m in messages],
            "body": bodies,
            "properties": [list(m.properties.items()) if m.properties else [] for m in messages],
            "born_ms": [self.clock()] * n,
            "check_immunity_s": [None] * n if plain else [m.check_immunity_s for m in messages],
            "message_type": [str(message_type)] * n,
            "deliver_at_ms": [None] * n if times is None else times[0],
            # store_ms + the delay, when the writer stamps store_ms
            **({} if times is None else {"deliver_at_ms" + AFTER_STAMP: times[1]}),
        }
        self._half.submit(columns).result()
        return StoredMessages(messages, bodies, ids, offsets, group)

    def store_ops(
        self,
        half_offsets: list[int],
        transaction_ids: list[str],
        producer_group: str,
        actions: str | list[str],
        source: str,
        remarks: str | list[str | None] | None = None,
    ) -> list[int]:
        """Persist OP rows for one producer group in one commit; return their
        op_offsets once durable. `actions`/`remarks` may be one value for all."""
        self._check_open()
        n = len(half_offsets)
        actions = [actions] * n if isinstance(actions, str) else list(actions)
        remarks = [remarks] * n if remarks is None or isinstance(remarks, str) else list(remarks)
        if len(transaction_ids) != n or len(actions) != n or len(remarks) != n:
            raise ValueError("store_ops needs one transaction id, action and remark per offset")
        if not set(actions) <= {*Action, CANCEL}:
            raise ValueError(
                f"action must be one of {[str(a) for a in Action] + [CANCEL]}, "
                f"got {sorted(set(actions))}"
            )
        if source not in set(Source):
            raise ValueError(f"source must be one of {[str(s) for s in Source]}, got {source!r}")
        offsets = self._offsets.take(n)
        self._op.submit(
            {
                "op_offset": offsets,
                "half_offset": list(half_offsets),
                "transaction_id": list(transaction_ids),
                "producer_group": [producer_group] * n,
                "action": actions,
                "source": [source] * n,
                "remark": remarks,
            }
        ).result()
        return offsets

    def resolve(self, transaction_id: str, commit: bool, remark: str | None = None) -> int:
        """An operator's decision for one transaction: an OP row with source=ADMIN.

        Like RocketMQ's operators resuming a message from
        TRANS_CHECK_MAX_TIME_TOPIC, this also overrides a discard. Returns
        the OP's offset; raises LookupError when no half message has that id,
        ValueError when it is a plain message's (nothing to decide).
        """
        if not isinstance(transaction_id, str) or not transaction_id:
            raise ValueError("transaction_id must be a non-empty string")
        if not isinstance(commit, bool):
            raise ValueError("commit must be True (commit) or False (rollback)")
        _validate_remark(remark)
        half = self.find_half(transaction_id)
        if half["message_type"] == MessageType.NORMAL:
            raise ValueError(
                f"{transaction_id!r} is a plain (NORMAL) message: committed when it was "
                "stored, it has no transaction to resolve"
            )
        return self.store_ops(
            [half["half_offset"]],
            [transaction_id],
            half["producer_group"],
            Action.COMMIT if commit else Action.ROLLBACK,
            Source.ADMIN,
            remark,
        )[0]

    def cancel(
        self,
        msg_id: str | None = None,
        *,
        transaction_id: str | None = None,
        remark: str | None = None,
    ) -> int:
        """Cancel a delayed message's delivery before it is due: an OP with
        action CANCEL and source ADMIN (RocketMQ 5 cancels a timer message by
        its handle; RocketMQ 4 cannot).

        The message is named by `msg_id` or `transaction_id` (the same id
        here; both given, they must agree). The job records the cancel and
        never delivers the message, whether it is pending, committed and
        scheduled, or not read yet; a cancel it reads once the message is due
        (or delivered) is rejected with the reason (docs/protocol.md §4,
        "Cancelling a delayed message"). Returns the OP's offset; raises
        LookupError when no half message has that id, ValueError when it is
        not delayed.
        """
        if msg_id is not None and transaction_id is not None and msg_id != transaction_id:
            raise ValueError(f"msg_id {msg_id!r} and transaction_id {transaction_id!r} differ")
        wanted = msg_id if msg_id is not None else transaction_id
        if not isinstance(wanted, str) or not wanted:
            raise ValueError("give the message's msg_id or transaction_id (a non-empty string)")
        _validate_remark(remark)
        half = self.find_half(wanted)
        if half["deliver_at_ms"] is None or half["deliver_at_ms"] <= half["store_ms"]:
            raise ValueError(f"{wanted!r} is not a delayed message: nothing to cancel")
        return self.store_ops(
            [half["half_offset"]], [wanted], half["producer_group"], CANCEL, Source.ADMIN, remark
        )[0]

    def find_half(self, transaction_id: str) -> dict[str, Any]:
        """The half row of `transaction_id` (a full scan: for operators, not hot paths)."""
        forks.check("Broker.find_half")
        # Its own handle: the writer's belongs to the writer thread.
        table = DeltaTable(
            table_path(self.warehouse, HALF),
            storage_options=options_for(self.warehouse, self.storage_options),
        )
        rows: list[dict[str, Any]] = (
            table.to_pyarrow_dataset()
            .to_table(
                columns=[
                    "half_offset",
                    "producer_group",
                    "topic",
                    "message_type",
                    "store_ms",
                    "deliver_at_ms",
                ],
                filter=pc.field("transaction_id") == transaction_id,
            )
            .to_pylist()
        )
        if not rows:
            raise LookupError(
                f"no half message has transaction_id {transaction_id!r} in {self.warehouse}"
            )
        return rows[0]

    # --- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if forks.forked():
            return  # what is queued is the parent's to commit, and its threads are there
        self._half.close()
        self._op.close()

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        forks.check("this Broker")
        if self._closed:
            raise BrokerClosedError("the broker is closed")

    @property
    def commit_counts(self) -> dict[str, int]:
        """Delta commits made by the group-commit writers (for benchmarks)."""
        return {HALF.path: self._half.commits, OP.path: self._op.commits}

    @property
    def committers(self) -> dict[str, str]:
        """Per producer table, how its commits are made: "blind append" on a
        local disk, "delta-rs" on an object store (`GroupCommitWriter.committer`)."""
        if not (
            isinstance(self._half, GroupCommitWriter) and isinstance(self._op, GroupCommitWriter)
        ):
            return {HALF.path: "delta-rs", OP.path: "delta-rs"}
        return {HALF.path: self._half.committer, OP.path: self._op.committer}

    @property
    def writer_stats(self) -> dict[str, WriterStats]:
        """Per producer table, what its group-commit writer has done and where
        its time went (`WriterStats`); empty without group commit."""
        if not (
            isinstance(self._half, GroupCommitWriter) and isinstance(self._op, GroupCommitWriter)
        ):
            return {}
        return {HALF.path: self._half.stats(), OP.path: self._op.stats()}


def _validate_remark(remark: object) -> None:
    """An operator's remark: a string UTF-8 can encode, or None."""
    if remark is not None:
        if not isinstance(remark, str):
            raise ValueError(f"remark must be a string or None, got {type(remark).__name__}")
        validate_text(remark, "remark")


def new_message_ids(n: int) -> list[str]:
    """`n` random 32-hex-digit ids (128 bits, as uuid4), the shape of RocketMQ's
    UNIQ_KEY; drawn in one call because uuid4() per message is a hot spot."""
    digits = os.urandom(16 * n).hex().upper()
    return [digits[i : i + 32] for i in range(0, 32 * n, 32)]


class StoredMessages(Sequence[Message]):
    """The messages of one store_halves call as stored: ids filled in.

    Each item is a copy, not the caller's object (one Message may be sent many
    times), made when first asked for: a listener deciding a 10,000-message
    batch rarely looks at every message, and copying them all up front was
    the bulk path's largest cost.
    """

    def __init__(
        self,
        messages: Sequence[Message],
        bodies: list[bytes],
        ids: list[str],
        offsets: list[int],
        group: str,
    ):
        self._messages, self._bodies, self._ids = messages, bodies, ids
        self.half_offsets, self._group = offsets, group
        self._copies: dict[int, Message] = {}

    @property
    def transaction_ids(self) -> list[str]:
        return self._ids

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]
        copy = self._copies.get(index)
        if copy is None:
            msg = self._messages[index]
            copy = object.__new__(Message)  # field by field: dataclass __init__ is slow here
            for name in Message.__slots__:
                setattr(copy, name, getattr(msg, name))
            copy.body = self._bodies[index]
            copy.properties = dict(msg.properties) if msg.properties else {}
            copy.transaction_id = copy.msg_id = self._ids[index]
            copy.half_offset = self.half_offsets[index]
            copy.producer_group = self._group
            self._copies[index] = copy
        return copy

    def __repr__(self) -> str:
        return f"StoredMessages({len(self)} messages of group {self._group!r})"


__all__ = ["Broker", "PersistError", "validate_group"]
