"""Consumer groups: RocketMQ's pull and push consumers on the topic tables.

A consumer group keeps, per (topic, queue_id), the next `queue_offset` it has
not finished: its committed offset, appended to `_sys/consumer_offsets` by
every commit. A new consumer of the group resumes there, so whatever was
polled but not committed is delivered again (at-least-once). A `Consumer`
polls and commits by hand; a `PushConsumer` hands each message to a listener,
retries a RECONSUME_LATER with RocketMQ's backoff, dead-letters a message
after `max_reconsume_times` retries (`_sys/dlq/<group>`) and commits as it
goes. One consumer process per group and topic is supported: queues are not
shared out among several members yet (docs/protocol.md §3.2).

>>> consumer = Consumer("./warehouse", "billing", "ORDER")        # doctest: +SKIP
>>> for message in consumer.poll():                               # doctest: +SKIP
...     handle(message.body)
>>> consumer.commit()                                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import TableNotFoundError

from schemas import CONSUMER_OFFSETS, DLQ, TOPIC, table_path, topic_path
from schemas.arrow import arrow_schema
from txn_core.config import Config, ConfigError
from txn_core.errors import BrokerClosedError, MessageValidationError, TxnError
from txn_core.message import validate_topic
from txn_core.storage import Storage, options_for, use
from txn_core.tables import open_existing, open_or_create
from txn_core.vocabulary import ConsumeResult

__all__ = [
    "DELAY_LEVELS_S",
    "ConsumedMessage",
    "Consumer",
    "ConsumerClosedError",
    "CorruptOffsetError",
    "Listener",
    "PushConsumer",
    "retry_delay_s",
    "validate_consumer_group",
]

_log = logging.getLogger(__name__)

#: RocketMQ's delay levels 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h:
#: the n-th retry of a message waits level n (the last one from the 18th on)
DELAY_LEVELS_S = (
    *(1, 5, 10, 30),
    *(60 * minutes for minutes in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30)),
    *(3600, 7200),
)

CONSUMER_GROUP_MAX_LEN = 255
_GROUP_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

# Both tables are small and appended to by consumers only: no change data
# feed (the producer tables' setting), just a checkpoint now and then.
_CONSUMER_TABLE_CONFIG = {"delta.checkpointInterval": "100"}


class ConsumerClosedError(BrokerClosedError):
    """The consumer was closed (or shut down); it polls and commits no more."""


class CorruptOffsetError(TxnError, ValueError):
    """A `_sys/consumer_offsets` row of the group cannot be a committed offset
    (e.g. a null or negative next_offset); nothing was read past it or deleted."""


def validate_consumer_group(group: object) -> str:
    """A consumer group's name: 1..255 of letters, digits, `_`, `-`, `.`,
    and no `..` (the name is a path segment of its dead-letter table).

    >>> validate_consumer_group("billing.v2")
    'billing.v2'
    """
    if not isinstance(group, str):
        raise ConfigError(f"consumer group must be a string, got {type(group).__name__}")
    if not group:
        raise ConfigError("consumer group must not be empty")
    if len(group) > CONSUMER_GROUP_MAX_LEN:
        raise ConfigError(
            f"consumer group {group[:40]!r}… is {len(group)} characters; "
            f"at most {CONSUMER_GROUP_MAX_LEN} are allowed"
        )
    if not _GROUP_RE.match(group):
        raise ConfigError(
            f"consumer group {group!r} contains characters outside [A-Za-z0-9_.-] "
            "(no '/', spaces or other punctuation)"
        )
    if ".." in group or group == ".":
        raise ConfigError(f"consumer group {group!r} must not be '.' or contain '..'")
    return group


def retry_delay_s(retry: int) -> int:
    """Seconds the `retry`-th redelivery of a message waits (1-based).

    >>> retry_delay_s(1), retry_delay_s(5), retry_delay_s(40)
    (1, 60, 7200)
    """
    if retry < 1:
        raise ValueError(f"retry must be at least 1, got {retry}")
    return DELAY_LEVELS_S[min(retry, len(DELAY_LEVELS_S)) - 1]


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


def _non_negative_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ConfigError(f"{name} must not be negative, got {value}")
    return value


@dataclass(frozen=True)
class ConsumedMessage:
    """A delivered message as a consumer hands it out.

    `reconsume_times` is how often it was delivered before (0 on the first
    delivery; a push consumer counts its retries).

    >>> ConsumedMessage("ORDER", 0, 7, "msg-7", "tx-7", "order-7", "created", b"{}").queue_offset
    7
    """

    topic: str
    queue_id: int
    queue_offset: int
    msg_id: str
    transaction_id: str
    keys: str | None
    tags: str | None
    body: bytes
    properties: dict[str, str] = field(default_factory=dict)
    born_ms: int = 0
    commit_ms: int = 0
    reconsume_times: int = 0
    # The rest of the topic row, so a dead-lettered message keeps all of it.
    half_offset: int = 0
    producer_group: str = ""
    delivered_ms: int = 0
    run_id: str = ""

    @classmethod
    def from_row(cls, topic: str, row: Mapping[str, Any]) -> ConsumedMessage:
        """From a topic row as pyarrow gives it (properties as key/value pairs)."""
        properties = row.get("properties") or []
        return cls(
            topic=topic,
            queue_id=row["queue_id"],
            queue_offset=row["queue_offset"],
            msg_id=row["msg_id"],
            transaction_id=row["transaction_id"],
            keys=row["keys"],
            tags=row["tags"],
            body=row["body"],
            properties=dict(properties),
            born_ms=row["born_ms"],
            commit_ms=row["commit_ms"],
            half_offset=row["half_offset"],
            producer_group=row["producer_group"],
            delivered_ms=row["delivered_ms"],
            run_id=row["run_id"],
        )

    def topic_row(self) -> dict[str, Any]:
        """The message's topic row (the TOPIC columns, properties as pairs)."""
        row = {name: getattr(self, name) for name in TOPIC.names}
        row["properties"] = list(self.properties.items())
        return row


def read_committed_offsets(
    warehouse: str, group: str, topic: str, storage_options: dict[str, str] | None = None
) -> dict[int, int]:
    """The group's committed next offset per queue of `topic` ({} when none).

    Per queue the row with the highest committed_ms wins, ties going to the
    highest next_offset: the result depends on the rows only, not on the
    order in which files are read. Raises CorruptOffsetError naming the group,
    topic and queue of the first row that holds no usable offset.
    """
    table = open_existing(warehouse, CONSUMER_OFFSETS, storage_options)
    if table is None:
        return {}
    condition = (pc.field("group") == group) & (pc.field("topic") == topic)
    rows = (
        table.to_pyarrow_dataset()
        .to_table(filter=condition, columns=["queue_id", "next_offset", "committed_ms"])
        .to_pylist()
    )
    newest: dict[int, tuple[int, int]] = {}
    for row in rows:
        queue_id, next_offset, committed_ms = (
            row["queue_id"],
            row["next_offset"],
            row["committed_ms"],
        )
        problem = None
        if queue_id is None or queue_id < 0:
            problem = f"queue_id is {queue_id!r}"
        elif next_offset is None or next_offset < 0:
            problem = f"next_offset is {next_offset!r}"
        elif committed_ms is None:
            problem = "committed_ms is None"
        if problem is not None:
            raise CorruptOffsetError(
                f"{table_path(warehouse, CONSUMER_OFFSETS)}: the row of group {group!r}, "
                f"topic {topic!r}, queue {queue_id!r} is corrupt ({problem}); "
                "nothing was consumed. Fix or delete that row by hand"
            )
        key = (committed_ms, next_offset)
        if queue_id not in newest or key > newest[queue_id]:
            newest[queue_id] = key
    return {queue_id: key[1] for queue_id, key in newest.items()}


def _resolve_warehouse(warehouse: str | Config) -> str:
    if isinstance(warehouse, Config):
        return use(Storage.from_config(warehouse), check=False).warehouse
    if not isinstance(warehouse, str) or not warehouse:
        raise ConfigError(f"warehouse must be a path, a URI or a Config, got {warehouse!r}")
    return warehouse


def _valid_topic(topic: object) -> str:
    try:
        return validate_topic(topic)
    except MessageValidationError as exc:
        raise ConfigError(f"topic: {exc.problem}") from None


class Consumer:
    """A pull consumer of one topic in a consumer group.

    `poll` hands out the next messages after the group's committed offsets
    (and after what it handed out before); `commit` makes everything polled
    so far the group's committed position. Not thread-safe: one thread polls.

    >>> with Consumer("./warehouse", "billing", "ORDER") as c:       # doctest: +SKIP
    ...     batch = c.poll(100); process(batch); c.commit()
    """

    def __init__(
        self,
        warehouse: str | Config,
        group: str,
        topic: str,
        *,
        clock: Callable[[], float] = time.time,
        storage_options: dict[str, str] | None = None,
    ):
        self.group = validate_consumer_group(group)
        self.topic = _valid_topic(topic)
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {clock!r}")
        self.warehouse = _resolve_warehouse(warehouse)
        self.member = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._clock = clock
        self._storage_options = storage_options
        self._committed = read_committed_offsets(
            self.warehouse, self.group, self.topic, storage_options
        )
        # Where the next poll starts, per queue: ahead of the committed offset
        # by what was handed out since.
        self._position = dict(self._committed)
        self._last_turn = -1  # the queue whose message a poll handed out last
        self._topic_table: DeltaTable | None = None
        self._offsets_table: DeltaTable | None = None
        self._closed = False

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def positions(self) -> dict[int, int]:
        """The next offset `poll` hands out, per queue seen so far."""
        return dict(self._position)

    def committed(self) -> dict[int, int]:
        """The group's committed next offset per queue, as this consumer knows it."""
        return dict(self._committed)

    def poll(self, max_messages: int = 32) -> list[ConsumedMessage]:
        """Up to `max_messages` next messages, each queue's in offset order and
        the queues taken in turn; [] when there is nothing new (or no topic
        table yet)."""
        return self._poll(_positive_int(max_messages, "max_messages"), skip=())

    def seek(self, queue_id: int, offset: int) -> None:
        """Make `offset` the next one `poll` hands out from `queue_id`.

        In memory only: a commit still moves the committed offset forward
        only, so seeking back redelivers to this consumer but not after a
        restart.
        """
        self._check_open()
        self._position[_non_negative_int(queue_id, "queue_id")] = _non_negative_int(
            offset, "offset"
        )

    def commit(self) -> dict[int, int]:
        """Commit everything polled so far; returns the offsets written
        (queues whose committed offset moved forward), {} when none did."""
        return self._commit(self._position)

    def close(self) -> None:
        """Stop; polled messages not committed are delivered again to the
        group's next consumer."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ConsumerClosedError(
                f"the consumer of group {self.group!r} on topic {self.topic!r} is closed"
            )

    def _open_topic(self) -> DeltaTable | None:
        if self._topic_table is not None:
            self._topic_table.update_incremental()
            return self._topic_table
        uri = topic_path(self.warehouse, self.topic)
        try:
            self._topic_table = DeltaTable(
                uri, storage_options=options_for(uri, self._storage_options)
            )
        except TableNotFoundError:
            return None  # nothing delivered to the topic yet
        return self._topic_table

    def _poll(self, max_messages: int, skip: Collection[int]) -> list[ConsumedMessage]:
        """`poll`, leaving out the queues in `skip` (a push consumer's busy ones)."""
        self._check_open()
        table = self._open_topic()
        if table is None:
            return []
        queue, offset = pc.field("queue_id"), pc.field("queue_offset")
        # Offsets are dense, so each queue's next batch is one offset range:
        # the scan reads no more than it hands out.
        condition = (~queue.isin(list(self._position))) & (offset < max_messages)
        for queue_id, start in self._position.items():
            if queue_id not in skip:
                condition = condition | (
                    (queue == queue_id) & (offset >= start) & (offset < start + max_messages)
                )
        rows = table.to_pyarrow_dataset().to_table(filter=condition, columns=TOPIC.names)
        rows = rows.sort_by([("queue_id", "ascending"), ("queue_offset", "ascending")])
        by_queue: dict[int, list[ConsumedMessage]] = {}
        for row in rows.to_pylist():
            messages = by_queue.setdefault(row["queue_id"], [])
            expected = self._position.get(row["queue_id"], 0) + len(messages)
            # A gap means the rest of the queue is not there yet: stop at it.
            if row["queue_offset"] == expected:
                messages.append(ConsumedMessage.from_row(self.topic, row))
        # Queues take turns, and the turn goes on from one poll to the next,
        # so a small max_messages does not favour the lowest queue ids.
        turns = sorted(by_queue, key=lambda q: (q <= self._last_turn, q))
        polled: list[ConsumedMessage] = []
        for depth in range(max_messages):
            for queue_id in turns:
                if depth < len(by_queue[queue_id]) and len(polled) < max_messages:
                    polled.append(by_queue[queue_id][depth])
        if polled:
            self._last_turn = polled[-1].queue_id
        for message in polled:
            self._position[message.queue_id] = message.queue_offset + 1
        return polled

    def _commit(self, next_offsets: Mapping[int, int]) -> dict[int, int]:
        """Append an offsets row for each queue whose offset moves forward."""
        self._check_open()
        moved = {
            queue_id: next_offset
            for queue_id, next_offset in sorted(next_offsets.items())
            if next_offset > self._committed.get(queue_id, 0)
        }
        if not moved:
            return {}
        if self._offsets_table is None:
            self._offsets_table = open_or_create(
                self.warehouse,
                CONSUMER_OFFSETS,
                configuration=_CONSUMER_TABLE_CONFIG,
                storage_options=self._storage_options,
            )
        committed_ms = int(self._clock() * 1000)
        rows = [
            {
                "group": self.group,
                "topic": self.topic,
                "queue_id": queue_id,
                "next_offset": next_offset,
                "member": self.member,
                "committed_ms": committed_ms,
            }
            for queue_id, next_offset in moved.items()
        ]
        self._offsets_table.update_incremental()
        write_deltalake(
            self._offsets_table,
            pa.Table.from_pylist(rows, schema=arrow_schema(CONSUMER_OFFSETS)),
            mode="append",
        )
        self._committed.update(moved)
        return moved


#: a push consumer's listener: what to do with one message
Listener = Callable[[ConsumedMessage], ConsumeResult]


@dataclass(frozen=True)
class _Retry:
    """The failed head of a queue: how often it failed, when it is due again, why."""

    failures: int
    due_s: float
    reason: str


class PushConsumer:
    """A consumer that calls `listener` for each message of `topic`, as
    RocketMQ's concurrently-consuming push consumer.

    A listener returning RECONSUME_LATER (or raising, or returning anything
    but SUCCESS) gets the message again after RocketMQ's delay for that
    retry; meanwhile the later messages of its queue wait and the other
    queues go on. After `max_reconsume_times` retries have failed too, the
    message goes to `_sys/dlq/<group>` and its queue moves on. Offsets are
    committed after each round, up to each queue's first unfinished message.
    Retries are counted in memory: a restarted consumer delivers from the
    committed offset again, with fresh counts.

    >>> def listener(message):                                      # doctest: +SKIP
    ...     handle(message.body)
    ...     return ConsumeResult.SUCCESS
    >>> consumer = PushConsumer("./warehouse", "billing", "ORDER", listener)  # doctest: +SKIP
    >>> consumer.start(); ...; consumer.shutdown()                  # doctest: +SKIP
    """

    def __init__(
        self,
        warehouse: str | Config,
        group: str,
        topic: str,
        listener: Listener,
        *,
        max_reconsume_times: int = 16,
        batch: int = 32,
        clock: Callable[[], float] = time.time,
        storage_options: dict[str, str] | None = None,
        idle_wait_s: float = 0.2,
    ):
        if not callable(listener):
            raise ConfigError(f"listener must be a callable, got {type(listener).__name__}")
        self._max_reconsume_times = _positive_int(max_reconsume_times, "max_reconsume_times")
        self._batch = _positive_int(batch, "batch")
        if not isinstance(idle_wait_s, (int, float)) or not idle_wait_s > 0:
            raise ConfigError(
                f"idle_wait_s must be a positive number of seconds, got {idle_wait_s!r}"
            )
        self.consumer = Consumer(
            warehouse, group, topic, clock=clock, storage_options=storage_options
        )
        self._listener = listener
        self._clock = clock
        self._idle_wait_s = float(idle_wait_s)
        # Polled messages not finished yet, per queue, in offset order.
        self._buffers: dict[int, deque[ConsumedMessage]] = {}
        self._retries: dict[int, _Retry] = {}
        self._dlq_table: DeltaTable | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the last error of a background round (the thread goes on after it)
        self.last_error: BaseException | None = None

    @property
    def group(self) -> str:
        return self.consumer.group

    @property
    def topic(self) -> str:
        return self.consumer.topic

    def consume_once(self) -> int:
        """One round: poll the queues with nothing waiting, deliver what is
        due, dead-letter what ran out of retries, commit. Returns the number
        of listener calls made (0: nothing was due)."""
        with self._lock:
            busy = [queue_id for queue_id, buffer in self._buffers.items() if buffer]
            for message in self.consumer._poll(self._batch, skip=busy):
                self._buffers.setdefault(message.queue_id, deque()).append(message)
            delivered = 0
            for queue_id in sorted(self._buffers):
                delivered += self._drain(queue_id)
            next_offsets = self.consumer.positions()
            for queue_id, buffer in self._buffers.items():
                if buffer:
                    next_offsets[queue_id] = buffer[0].queue_offset
            self.consumer._commit(next_offsets)
            return delivered

    def start(self) -> None:
        """Consume in a background thread until `shutdown`."""
        self.consumer._check_open()
        if self._thread is not None:
            raise RuntimeError(f"the push consumer of group {self.group!r} is already started")
        self._thread = threading.Thread(
            target=self._run, name=f"push-consumer-{self.group}-{self.topic}", daemon=True
        )
        self._thread.start()

    def shutdown(self, timeout_s: float | None = 30.0) -> None:
        """Stop the background thread (the round under way finishes) and close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"the push consumer of group {self.group!r} did not stop within {timeout_s}s "
                    "(a listener call is still running)"
                )
        with self._lock:
            self.consumer.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                delivered = self.consume_once()
            except ConsumerClosedError:
                return
            # A store that fails now may answer in the next round; the
            # committed offsets make a round safe to repeat.
            except Exception as exc:  # noqa: BLE001
                self.last_error = exc
                _log.exception("push consumer %s/%s: round failed", self.group, self.topic)
                delivered = 0
            if delivered == 0:
                self._stop.wait(self._idle_wait_s)

    def _drain(self, queue_id: int) -> int:
        """Deliver the queue's messages in order until one must wait."""
        buffer = self._buffers[queue_id]
        delivered = 0
        while buffer:
            message = buffer[0]
            retry = self._retries.get(queue_id)
            # A retry whose dead-letter write failed last round skips the listener.
            if retry is None or retry.failures <= self._max_reconsume_times:
                if retry is not None and self._clock() < retry.due_s:
                    break  # the queue waits for its head
                failures = retry.failures if retry is not None else 0
                delivered += 1
                reason = self._deliver(dataclasses.replace(message, reconsume_times=failures))
                if reason is None:
                    buffer.popleft()
                    self._retries.pop(queue_id, None)
                    continue
                retry = _Retry(failures + 1, self._clock() + retry_delay_s(failures + 1), reason)
                self._retries[queue_id] = retry
                if retry.failures <= self._max_reconsume_times:
                    break
            # Out of retries: the queue moves past it only once the write succeeded.
            self._dead_letter(message, retry)
            buffer.popleft()
            self._retries.pop(queue_id, None)
        return delivered

    def _deliver(self, message: ConsumedMessage) -> str | None:
        """Call the listener; None on success, else the reason to retry."""
        try:
            result = self._listener(message)
        except Exception as exc:  # noqa: BLE001 - a failing listener is a reconsume
            return f"{type(exc).__name__}: {exc}"
        if result == ConsumeResult.SUCCESS:
            return None
        if result == ConsumeResult.RECONSUME_LATER:
            return str(ConsumeResult.RECONSUME_LATER)
        return f"the listener returned {result!r}, not a ConsumeResult"

    def _dead_letter(self, message: ConsumedMessage, retry: _Retry) -> None:
        if self._dlq_table is None:
            table = dataclasses.replace(DLQ, path=f"_sys/dlq/{self.group}")
            self._dlq_table = open_or_create(
                self.consumer.warehouse,
                table,
                configuration=_CONSUMER_TABLE_CONFIG,
                storage_options=self.consumer._storage_options,
            )
        row = {
            "topic": message.topic,
            **message.topic_row(),
            "group": self.group,
            "reconsume_times": retry.failures - 1,
            "reason": retry.reason,
            "dead_ms": int(self._clock() * 1000),
        }
        self._dlq_table.update_incremental()
        write_deltalake(
            self._dlq_table, pa.Table.from_pylist([row], schema=arrow_schema(DLQ)), mode="append"
        )
        _log.warning(
            "push consumer %s: %s queue %d offset %d dead-lettered after %d retries: %s",
            self.group,
            message.topic,
            message.queue_id,
            message.queue_offset,
            retry.failures - 1,
            retry.reason,
        )
