"""The broker core: durable half and OP rows on Delta tables, via delta-rs.

A Broker is one process's handle on a warehouse. It owns one group-commit
writer per producer table and an offset epoch; producers (any number, any
groups, any threads) share it.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable, Iterable, Mapping

import pyarrow.compute as pc
from deltalake import DeltaTable

from schemas import HALF, OP, table_path
from schemas.arrow import arrow_schema
from txn_core.config import Config
from txn_core.errors import BrokerClosedError, PersistError
from txn_core.group_commit import DirectWriter, GroupCommitWriter
from txn_core.message import Message, validate_group
from txn_core.offsets import OffsetAllocator, register_epoch
from txn_core.tables import ensure_broker_tables

log = logging.getLogger(__name__)

ACTIONS = ("COMMIT", "ROLLBACK")
SOURCES = ("PRODUCER", "CHECK", "ADMIN")


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Broker:
    """Open with `Broker.open(warehouse)`; share one per process; `close()` at the end.

    >>> broker = Broker.open("/tmp/warehouse")                      # doctest: +SKIP
    >>> broker.resolve("7F0001…", commit=True, remark="ops ticket 42")  # doctest: +SKIP
    """

    def __init__(self, warehouse: str, tables: Mapping[str, DeltaTable], config: Config,
                 clock: Callable[[], int], storage_options: dict[str, str] | None,
                 group_commit: bool = True):
        self.warehouse = warehouse
        self.config = config
        self.clock = clock
        self.storage_options = storage_options
        self.broker_id = uuid.uuid4().hex
        self._tables = dict(tables)
        producers = self._tables["_sys/producers"]
        self._offsets = OffsetAllocator(
            register_epoch(producers, self.broker_id, clock()),
            lambda: register_epoch(producers, self.broker_id, clock()))
        if group_commit:
            self._half = GroupCommitWriter(self._tables[HALF.path], arrow_schema(HALF),
                                           name=HALF.path, clock=clock)
            self._op = GroupCommitWriter(self._tables[OP.path], arrow_schema(OP),
                                         name=OP.path, clock=clock)
        else:  # one commit per call: only for measuring what group commit buys
            self._half = DirectWriter(table_path(warehouse, HALF), arrow_schema(HALF),
                                      name=HALF.path, clock=clock,
                                      storage_options=storage_options)
            self._op = DirectWriter(table_path(warehouse, OP), arrow_schema(OP),
                                    name=OP.path, clock=clock, storage_options=storage_options)
        self._closed = False
        self._close_lock = threading.Lock()

    @classmethod
    def open(cls, warehouse: str | Config, *, config: Config | None = None,
             clock: Callable[[], int] | None = None,
             storage_options: dict[str, str] | None = None,
             group_commit: bool = True) -> "Broker":
        """Open the warehouse, creating missing producer tables.

        `warehouse` may be a path/URI or a Config (its `warehouse` is used).
        `clock` returns epoch milliseconds (tests inject one); `storage_options`
        go to delta-rs for object stores. `group_commit=False` makes every
        append its own commit (the naive design; benchmarks only).
        """
        if isinstance(warehouse, Config):
            config, warehouse = warehouse, warehouse.warehouse
        config = config or Config(warehouse=warehouse)
        tables = ensure_broker_tables(warehouse, storage_options=storage_options)
        return cls(warehouse, tables, config, clock or wall_clock_ms, storage_options,
                   group_commit)

    @property
    def epoch(self) -> int:
        return self._offsets.epoch

    def table(self, path: str) -> DeltaTable:
        """The broker's own handle on one of its tables (e.g. "_sys/check_answers")."""
        return self._tables[path]

    # --- writes -------------------------------------------------------------------

    def store_halves(self, group: str, messages: list[Message]) -> list[Message]:
        """Persist half rows for `messages` in one commit; return copies with ids set.

        Returns only once the rows are durable (committed); raises PersistError
        when they are not.
        """
        self._check_open()
        offsets = self._offsets.take(len(messages))
        stored = []
        for msg, offset in zip(messages, offsets):
            msg_id = new_message_id()
            stored.append(Message(
                topic=msg.topic, body=bytes(msg.body), keys=msg.keys, tags=msg.tags,
                properties=dict(msg.properties) if msg.properties else {},
                queue_id=msg.queue_id, check_immunity_s=msg.check_immunity_s,
                delay_level=0,  # RocketMQ clears delay levels of transactional messages
                transaction_id=msg_id, msg_id=msg_id, half_offset=offset,
                producer_group=group))
        born = self.clock()
        columns = {
            "half_offset": offsets,
            "transaction_id": [m.transaction_id for m in stored],
            "msg_id": [m.msg_id for m in stored],
            "producer_group": [group] * len(stored),
            "topic": [m.topic for m in stored],
            "queue_id": [m.queue_id for m in stored],
            "tags": [m.tags for m in stored],
            "keys": [m.keys for m in stored],
            "body": [m.body for m in stored],
            "properties": [list(m.properties.items()) for m in stored],
            "born_ms": [born] * len(stored),
            "check_immunity_s": [m.check_immunity_s for m in stored],
        }
        self._half.submit(columns).result()
        return stored

    def store_ops(self, ops: Iterable[Mapping]) -> list[int]:
        """Persist OP rows (keys: half_offset, transaction_id, producer_group, action,
        source, remark) in one commit; return their op_offsets once durable."""
        self._check_open()
        ops = list(ops)
        for op in ops:
            if op["action"] not in ACTIONS:
                raise ValueError(f"action must be one of {ACTIONS}, got {op['action']!r}")
            if op["source"] not in SOURCES:
                raise ValueError(f"source must be one of {SOURCES}, got {op['source']!r}")
        offsets = self._offsets.take(len(ops))
        columns = {
            "op_offset": offsets,
            "half_offset": [op["half_offset"] for op in ops],
            "transaction_id": [op["transaction_id"] for op in ops],
            "producer_group": [op["producer_group"] for op in ops],
            "action": [op["action"] for op in ops],
            "source": [op["source"] for op in ops],
            "remark": [op.get("remark") for op in ops],
        }
        self._op.submit(columns).result()
        return offsets

    def resolve(self, transaction_id: str, commit: bool, remark: str | None = None) -> int:
        """An operator's decision for one transaction: an OP row with source=ADMIN.

        Like RocketMQ's operators resuming a message from
        TRANS_CHECK_MAX_TIME_TOPIC, this also overrides a discard. Returns
        the OP's offset; raises LookupError when no half message has that id.
        """
        if not isinstance(transaction_id, str) or not transaction_id:
            raise ValueError("transaction_id must be a non-empty string")
        if not isinstance(commit, bool):
            raise ValueError("commit must be True (commit) or False (rollback)")
        half = self.find_half(transaction_id)
        return self.store_ops([{
            "half_offset": half["half_offset"], "transaction_id": transaction_id,
            "producer_group": half["producer_group"],
            "action": "COMMIT" if commit else "ROLLBACK", "source": "ADMIN",
            "remark": remark}])[0]

    def find_half(self, transaction_id: str) -> dict:
        """The half row of `transaction_id` (a full scan: for operators, not hot paths)."""
        table = self._tables[HALF.path]
        table.update_incremental()
        rows = table.to_pyarrow_dataset().to_table(
            columns=["half_offset", "producer_group", "topic"],
            filter=pc.field("transaction_id") == transaction_id).to_pylist()
        if not rows:
            raise LookupError(f"no half message has transaction_id {transaction_id!r} in "
                              f"{self.warehouse}")
        return rows[0]

    # --- lifecycle ----------------------------------------------------------------

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._half.close()
        self._op.close()

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerClosedError("the broker is closed")

    @property
    def commit_counts(self) -> dict[str, int]:
        """Delta commits made by the group-commit writers (for benchmarks)."""
        return {HALF.path: self._half.commits, OP.path: self._op.commits}


def new_message_id() -> str:
    """A 32-hex-digit unique id, the shape of RocketMQ's UNIQ_KEY."""
    return uuid.uuid4().hex.upper()


__all__ = ["Broker", "PersistError", "validate_group"]
