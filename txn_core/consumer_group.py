"""Consumer groups: RocketMQ's pull and push consumers on the topic tables.

A consumer group keeps, per (topic, queue_id), the next `queue_offset` it has
not finished: its committed offset, appended to `_sys/consumer_offsets` by
every commit. A new consumer of the group resumes there, so whatever was
polled but not committed is delivered again (at-least-once). A `Consumer`
polls and commits by hand; a `PushConsumer` hands each message to a listener,
retries a RECONSUME_LATER with RocketMQ's backoff, dead-letters a message
after `max_reconsume_times` retries (`_sys/dlq/<group>`) and commits as it
goes.

Several consumers (processes, or objects with distinct `member` ids) of one
group and topic share the topic's queues. Each is a member: from its first
poll, commit or seek it appends a heartbeat row to `_sys/consumer_members`
(at most every `heartbeat_interval_s`, from its own calls), listing the
queues it holds; `close` appends a leaving row. At each heartbeat a member
rebalances: the live members (newest row not leaving, not older than
`member_timeout_s`), sorted, split the sorted queue ids into contiguous
blocks (`allocate_queues`, RocketMQ's AllocateMessageQueueAveragely). A
member lets go of a queue that is no longer its own at once, and takes one
only when no other live member's newest row holds it (and no other member
claimed it at the same time), starting from the group's committed offset: a
queue changes hands without being read twice as long as its previous holder
committed what it polled (docs/protocol.md §3.2).

>>> consumer = Consumer("./warehouse", "billing", "ORDER")        # doctest: +SKIP
>>> for message in consumer.poll():                               # doctest: +SKIP
...     handle(message.body)
>>> consumer.commit()                                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
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
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from schemas import CONSUMER_MEMBERS, CONSUMER_OFFSETS, DLQ, HALF, TOPIC, table_path, topic_path
from schemas.arrow import arrow_schema
from txn_core import forks, superseded
from txn_core.blind_append import BlindAppender, TableChanged, unsupported_reason
from txn_core.broker import Broker
from txn_core.config import Config, ConfigError, int_in_range
from txn_core.delta_log import appended, refresh
from txn_core.errors import (
    BrokerClosedError,
    MessageValidationError,
    NoListenerError,
    PersistError,
    TxnError,
)
from txn_core.log_trim import trim_behind_newest
from txn_core.message import QUEUE_ID_MAX, QUEUE_OFFSET_MAX, validate_topic
from txn_core.storage import options_for, resolve_warehouse
from txn_core.tables import check_topic_table, open_existing, open_or_create
from txn_core.vocabulary import ConsumeResult

__all__ = [
    "DELAY_LEVELS_S",
    "HEARTBEAT_INTERVAL_S",
    "MEMBER_TIMEOUT_MAX_S",
    "MEMBER_TIMEOUT_S",
    "ConsumedMessage",
    "Consumer",
    "ConsumerClosedError",
    "CorruptMembershipError",
    "CorruptOffsetError",
    "Listener",
    "PushConsumer",
    "QueueNotAssignedError",
    "allocate_queues",
    "read_committed_offsets",
    "retry_delay_s",
    "validate_consumer_group",
]

_log = logging.getLogger(__name__)

#: RocketMQ's delay levels 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h:
#: the n-th retry of a message waits level n + 2, as RocketMQ's broker sends a
#: message back at level 3 + reconsumeTimes (10 s first, 2 h from the 16th on)
DELAY_LEVELS_S = (
    *(1, 5, 10, 30),
    *(60 * minutes for minutes in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 20, 30)),
    *(3600, 7200),
)

CONSUMER_GROUP_MAX_LEN = 255
#: a poll over at most this many queues reads each one's own range of
#: offsets (and the files that may hold it); over more, one band (`_read_band`)
PER_QUEUE_READ_MAX = 32
_GROUP_RE = re.compile(r"^[A-Za-z0-9_.-]+\Z")  # \Z: `$` lets a final newline through
MEMBER_MAX_LEN = 255

#: a member appends a heartbeat row (and rebalances) at most this often
HEARTBEAT_INTERVAL_S = 10.0
#: a member whose newest heartbeat is older than this is gone: its queues go to the others
MEMBER_TIMEOUT_S = 30.0
#: a poll with a timeout looks at the topic table again this often while it waits
POLL_INTERVAL_S = 0.2
#: the longest member_timeout_s: `maintain_consumer_tables` expires older membership rows
MEMBER_TIMEOUT_MAX_S = 86_400.0

# The consumer tables are small and appended to by consumers only: no change
# data feed (the producer tables' setting), just a checkpoint now and then.
_CHECKPOINT_INTERVAL = 100
_CONSUMER_TABLE_CONFIG = {"delta.checkpointInterval": str(_CHECKPOINT_INTERVAL)}
# Appends a concurrent maintenance commit made fail, tried again (`_append`).
_APPEND_ATTEMPTS = 10
#: the log of a table a member commits to at every heartbeat or poll is kept
#: for a day, not Delta's 30: on a local disk delta-rs lists the whole log at
#: every commit, so its cost follows the entries kept (`maintain_consumer_tables`
#: sets it on tables made before it was set here)
CONSUMER_LOG_RETENTION = {
    "delta.logRetentionDuration": "interval 1 days",
    "delta.enableExpiredLogCleanup": "true",
}
_OFFSETS_TABLE_CONFIG = {**_CONSUMER_TABLE_CONFIG, **CONSUMER_LOG_RETENTION}
# The membership table gets a row per member every heartbeat: its removed
# files go after a day too (maintain_consumer_tables expires the rows).
_MEMBERS_TABLE_CONFIG = {
    **_OFFSETS_TABLE_CONFIG,
    "delta.deletedFileRetentionDuration": "interval 1 days",
}


class ConsumerClosedError(BrokerClosedError):
    """The consumer was closed (or shut down); it polls and commits no more."""


class CorruptOffsetError(TxnError, ValueError):
    """A `_sys/consumer_offsets` row of the group cannot be a committed offset
    (e.g. a null or negative next_offset); nothing was read past it or deleted."""


class CorruptMembershipError(TxnError, ValueError):
    """A live-looking `_sys/consumer_members` row of the group cannot be read
    (e.g. a null member, heartbeat_ms or leaving flag, or a negative queue id);
    nothing was consumed, no row was deleted."""


class QueueNotAssignedError(TxnError, ValueError):
    """A queue this member does not hold (another member does, or it is being
    handed over): `seek` refuses it."""


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

    >>> retry_delay_s(1), retry_delay_s(5), retry_delay_s(16), retry_delay_s(40)
    (10, 180, 7200, 7200)
    """
    if retry < 1:
        raise ValueError(f"retry must be at least 1, got {retry}")
    return DELAY_LEVELS_S[min(retry + 2, len(DELAY_LEVELS_S)) - 1]


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 1:
        raise ConfigError(f"{name} must be positive, got {value}")
    return value


def _positive_seconds(value: object, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return float(value)


def _wait_seconds(value: object, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{name} must be a finite number of seconds, 0 or more, got {value!r}")
    return float(value)


def _valid_listener(listener: object) -> Listener:
    if not callable(listener):
        raise ConfigError(f"listener must be a callable, got {type(listener).__name__}")
    if inspect.iscoroutinefunction(listener) or inspect.iscoroutinefunction(
        type(listener).__call__
    ):
        raise ConfigError(
            "listener is a coroutine function; it must return a ConsumeResult (run your "
            "async code to completion in it)"
        )
    return listener


def _member_settings(heartbeat_interval_s: object, member_timeout_s: object) -> tuple[int, int]:
    """The heartbeat interval and member timeout, validated, in milliseconds."""
    interval = _positive_seconds(heartbeat_interval_s, "heartbeat_interval_s")
    timeout = _positive_seconds(member_timeout_s, "member_timeout_s")
    if timeout <= interval:
        raise ConfigError(
            f"member_timeout_s ({timeout:g}) must be longer than heartbeat_interval_s "
            f"({interval:g}): a live member would be taken for gone between two heartbeats"
        )
    if timeout > MEMBER_TIMEOUT_MAX_S:
        raise ConfigError(
            f"member_timeout_s must be at most {MEMBER_TIMEOUT_MAX_S:g} (a day: maintenance "
            f"expires older membership rows), got {timeout:g}"
        )
    return max(1, round(interval * 1000)), max(1, round(timeout * 1000))


def _valid_member(member: object) -> str:
    if member is None:
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    if not isinstance(member, str):
        raise ConfigError(f"member must be a string, got {type(member).__name__}")
    if (
        not member
        or len(member) > MEMBER_MAX_LEN
        or not member.isprintable()
        or member.strip() != member
    ):
        raise ConfigError(
            f"member must be 1..{MEMBER_MAX_LEN} printable characters without leading or "
            f"trailing spaces, got {member[:40]!r}"
        )
    return member


def allocate_queues(queue_ids: Collection[int], members: Collection[str], member: str) -> list[int]:
    """The queues `member` holds when the live `members` share `queue_ids`:
    RocketMQ's AllocateMessageQueueAveragely.

    Members and queue ids are sorted; with n members and q queues, the i-th
    member (from 0) gets the i-th of n contiguous blocks of the queue ids, the
    first q % n blocks holding q // n + 1 queues, the others q // n (none when
    there are more members than queues). A member not in `members` gets none.

    >>> [allocate_queues(range(8), ["a", "b", "c"], m) for m in "abc"]
    [[0, 1, 2], [3, 4, 5], [6, 7]]
    >>> [allocate_queues([3, 9], ["b", "a", "c"], m) for m in "abc"]
    [[3], [9], []]
    """
    ordered = sorted(set(members))
    if member not in ordered:
        return []
    queues = sorted(set(queue_ids))
    index = ordered.index(member)
    size, extra = divmod(len(queues), len(ordered))
    start = index * size + min(index, extra)
    return queues[start : start + size + (1 if index < extra else 0)]


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
    warehouse: str | os.PathLike[str] | Config | Broker,
    group: str,
    topic: str,
    storage_options: dict[str, str] | None = None,
) -> dict[int, int]:
    """The group's committed next offset per queue of `topic` ({} when none).

    Per queue the row with the highest committed_ms wins, ties going to the
    highest next_offset: the result depends on the rows only, not on the
    order in which files are read. Raises CorruptOffsetError naming the group,
    topic and queue of the first row that holds no usable offset. Reading
    joins no group: this is how to look at a group's position from outside.
    """
    group, topic = validate_consumer_group(group), _valid_topic(topic)
    warehouse, storage_options = resolve_warehouse(warehouse, storage_options, check=False)
    newest = _read_committed(warehouse, group, topic, storage_options)
    return {queue_id: key[1] for queue_id, key in newest.items()}


def _read_committed(
    warehouse: str, group: str, topic: str, storage_options: dict[str, str] | None
) -> dict[int, tuple[int, int]]:
    """`read_committed_offsets`, with each winning row's (committed_ms, next_offset)."""
    table = open_existing(warehouse, CONSUMER_OFFSETS, storage_options)
    if table is None:
        return {}
    condition = (pc.field("group") == group) & (pc.field("topic") == topic)
    actions = pa.table(table.get_add_actions(flatten=True))
    for cutoff in superseded.cutoffs(actions):
        files = None if cutoff is None else f"committed_ms >= {cutoff} OR committed_ms IS NULL"
        rows = (
            table.to_pyarrow_dataset(file_pruning_predicate=files)
            .to_table(filter=condition, columns=["queue_id", "next_offset", "committed_ms"])
            .to_pylist()
        )
        newest = _newest_per_queue(rows, warehouse, group, topic)
        if cutoff is None or superseded.older_files_superseded(
            actions, cutoff, group, topic, newest
        ):
            return newest
    raise AssertionError("the last cutoff reads every file")


def _newest_per_queue(
    rows: list[dict[str, Any]], warehouse: str, group: str, topic: str
) -> dict[int, tuple[int, int]]:
    """The winning (committed_ms, next_offset) per queue of `rows`; a corrupt row raises."""
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
    return newest


def _valid_topic(topic: object) -> str:
    try:
        return validate_topic(topic)
    except MessageValidationError as exc:
        raise ConfigError(f"topic: {exc.problem}") from None


class _AppendedTable:
    """A consumer table and this process's appends to it: by hand
    (`BlindAppender`, one parquet file and one log entry) where the
    appender may write it, else through delta-rs (`_append`). A member
    commits at every poll that moves an offset; a delta-rs append does work
    in proportion to the table's files, which grow until maintenance, while
    the appender's does not (docs/performance.md, "The consumer tables'
    logs"). Its commits bypass delta-rs's post-commit hook, so it writes the
    checkpoints they fall due at, and trims the log behind them."""

    def __init__(
        self, table: DeltaTable, schema: pa.Schema, storage_options: dict[str, str] | None
    ):
        self.table = table
        self._appender: BlindAppender | None = None
        reason = unsupported_reason(table, schema, storage_options)
        if reason is None:
            self._appender = BlindAppender(table, schema, storage_options=storage_options)
        else:
            _log.info("%s: appending through delta-rs (%s)", table.table_uri, reason)

    def append(self, rows: pa.Table) -> None:
        if self._appender is None:
            _append(self.table, rows)
            return
        try:
            version = self._appender.append(rows)
        except TableChanged as exc:
            _log.warning(
                "%s: appending through delta-rs from now on (%s)", self.table.table_uri, exc
            )
            self._appender = None
            _append(self.table, rows)
            return
        except Exception as exc:  # a full disk, no permission, the store's error
            raise _persist_error(self.table, exc) from exc
        appended(self.table, version)
        if self._appender.checkpoint_due(version):
            self._checkpoint()

    def _checkpoint(self) -> None:
        """A checkpoint at the table's newest version, and the log trimmed
        behind the newest one at least `KEPT_ENTRIES` versions back: nobody
        reads these tables' history. A failure is only logged: the rows are
        committed, and the next checkpoint falls due a hundred commits on."""
        try:
            self.table.update_incremental()
            self.table.create_checkpoint()
        except Exception as exc:  # noqa: BLE001 - the appends go on without it
            _log.warning("%s: writing a checkpoint failed (%s)", self.table.table_uri, exc)
            return
        trim_behind_newest(self.table)


def _append(table: DeltaTable, rows: pa.Table) -> None:
    """Append `rows` to a consumer table through delta-rs. delta-rs refuses an
    append that a concurrent delete or compaction (`maintain_consumer_tables`)
    overlaps; nothing was committed then, so it appends again on the new
    version.

    The commit of every `_CHECKPOINT_INTERVAL`th version trims the log
    behind the newest checkpoint at least `KEPT_ENTRIES` versions back
    (`trim_behind_newest`): on a local disk delta-rs lists the whole log at
    every commit."""
    for attempt in range(_APPEND_ATTEMPTS):
        refresh(table)
        try:
            write_deltalake(table, rows, mode="append")
        except CommitFailedError:
            if attempt == _APPEND_ATTEMPTS - 1:
                raise
            continue
        except (DeltaError, OSError) as exc:
            raise _persist_error(table, exc) from exc
        if table.version() % _CHECKPOINT_INTERVAL == 0:
            trim_behind_newest(table)
        return


def _persist_error(table: DeltaTable, exc: BaseException) -> PersistError:
    return PersistError(
        f"could not write to {table.table_uri}: {exc} (a consumer group writes its "
        "members and offsets into the warehouse: it needs write access there)"
    )


class Consumer:
    """A pull consumer of one topic in a consumer group: one member of it.

    `poll` hands out the next messages of the queues this member holds, after
    the group's committed offsets (and after what it handed out before);
    `commit` makes everything polled so far the group's committed position.
    Members of a group share the topic's queues (`allocate_queues`); the first
    `poll`, `commit` or `seek` joins the group, `close` leaves it. Not
    thread-safe: one thread polls.

    A member heartbeats only from its own calls: one that does not call
    `poll` or `commit` for `member_timeout_s` (e.g. a batch processed for
    longer than that) is taken for gone and the others may take its queues;
    its next call lets go of those they took (what it polled from them and
    did not commit is delivered again) and keeps the rest. A waiting poll
    (`timeout_s`) heartbeats at each look.

    >>> with Consumer("./warehouse", "billing", "ORDER") as c:       # doctest: +SKIP
    ...     batch = c.poll(100); process(batch); c.commit()
    """

    def __init__(
        self,
        warehouse: str | os.PathLike[str] | Config | Broker,
        group: str,
        topic: str,
        *,
        clock: Callable[[], float] = time.time,
        storage_options: dict[str, str] | None = None,
        member: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        member_timeout_s: float = MEMBER_TIMEOUT_S,
        poll_interval_s: float = POLL_INTERVAL_S,
        sleep: Callable[[float], None] = time.sleep,
    ):
        forks.note_use("Consumer")
        self.group = validate_consumer_group(group)
        self.topic = _valid_topic(topic)
        if not callable(clock):
            raise ConfigError(f"clock must be a callable returning seconds, got {clock!r}")
        if not callable(sleep):
            raise ConfigError(f"sleep must be a callable taking seconds, got {sleep!r}")
        self._poll_interval_s = _positive_seconds(poll_interval_s, "poll_interval_s")
        self._sleep = sleep
        self._heartbeat_interval_ms, self._member_timeout_ms = _member_settings(
            heartbeat_interval_s, member_timeout_s
        )
        #: this member's id in the group: host:pid:random unless given (unique per live member)
        self.member = _valid_member(member)
        self.warehouse, storage_options = resolve_warehouse(warehouse, storage_options, check=True)
        self._clock = clock
        self._storage_options = storage_options
        half = table_path(self.warehouse, HALF)
        if not DeltaTable.is_deltatable(half, options_for(half, storage_options)):
            _log.warning(  # a typo in a path: a consumer that reads nothing, ever
                "consumer %s/%s: no warehouse at %s yet (it has no %s); it reads nothing "
                "until producers and the job use it: check the path if you expected one",
                self.group,
                self.topic,
                self.warehouse,
                HALF.path,
            )
        # The group's newest committed (committed_ms, next_offset) per queue, as known here.
        self._newest = _read_committed(self.warehouse, self.group, self.topic, storage_options)
        self._committed = {queue_id: key[1] for queue_id, key in self._newest.items()}
        # Where the next poll starts, per queue held: ahead of the committed
        # offset by what was handed out since.
        self._position: dict[int, int] = {}
        self._held: set[int] = set()  # the queues this member consumes
        self._queues: set[int] = set()  # every queue id of the topic known here
        self._members: tuple[str, ...] = ()  # the live members at the last rebalance
        self._heartbeat_ms: int | None = None  # this member's last heartbeat; None: not joined
        self._row_ms = -1  # the heartbeat_ms of this member's last row
        #: called with the queues this member lets go of (a push consumer drops their state)
        self._on_revoke: Callable[[set[int]], None] | None = None
        self._last_turn = -1  # the queue whose message a poll handed out last
        self._topic_table: DeltaTable | None = None
        self._offsets: _AppendedTable | None = None
        self._members_table: _AppendedTable | None = None
        self._closed = False

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def positions(self) -> dict[int, int]:
        """The next offset `poll` hands out, per queue held."""
        return dict(self._position)

    def committed(self) -> dict[int, int]:
        """The group's committed next offset per queue, as this consumer knows
        it (read when it was made; a queue's is read again when it is taken)."""
        return dict(self._committed)

    def assignment(self) -> list[int]:
        """The queue ids this member holds now, sorted ([] before it joined)."""
        return sorted(self._held)

    def members(self) -> list[str]:
        """The group's live members on this topic at the last rebalance, sorted."""
        return list(self._members)

    def poll(self, max_messages: int = 32, timeout_s: float = 0.0) -> list[ConsumedMessage]:
        """Up to `max_messages` next messages of the queues held, each queue's
        in offset order and the queues taken in turn; [] when there is
        nothing new (or no topic table yet).

        With `timeout_s`, a poll that finds nothing waits for messages up to
        that long (by the consumer's clock), looking again every
        `poll_interval_s`, and returns as soon as a look finds some.

        >>> consumer.poll(100, timeout_s=5.0)   # [] only after 5 s of nothing  # doctest: +SKIP
        """
        max_messages = _positive_int(max_messages, "max_messages")
        timeout = _wait_seconds(timeout_s, "timeout_s")
        deadline = self._clock() + timeout
        while True:
            polled = self._poll(max_messages, skip=())
            remaining = deadline - self._clock()
            # no timeout: one look, whatever a clock stepping back during it says
            if polled or timeout == 0 or remaining <= 0:
                return polled
            self._sleep(min(self._poll_interval_s, remaining))

    def seek(self, queue_id: int, offset: int) -> None:
        """Make `offset` the next one `poll` hands out from `queue_id`.

        In memory only: a commit still moves the committed offset forward
        only, so seeking back redelivers to this consumer but not after a
        restart. A queue not held by this member raises QueueNotAssignedError
        (a queue id never seen before counts as a new queue of the topic).
        """
        self._check_open()
        queue_id = int_in_range("queue_id", queue_id, 0, QUEUE_ID_MAX)
        offset = int_in_range("offset", offset, 0, QUEUE_OFFSET_MAX)
        self._heartbeat_if_due()
        if queue_id not in self._held and queue_id not in self._queues:
            self._queues.add(queue_id)
            self._rebalance()
        if queue_id not in self._held:
            raise QueueNotAssignedError(
                f"queue {queue_id} of topic {self.topic!r} is not held by member "
                f"{self.member!r} of group {self.group!r} (it holds {self.assignment()}): "
                "another member holds it, or it is being handed over"
            )
        self._position[queue_id] = offset

    def commit(self) -> dict[int, int]:
        """Commit everything polled so far from the queues still held; returns
        the offsets written (queues whose committed offset moved forward), {}
        when none did."""
        return self._commit(self._position)

    def close(self) -> None:
        """Leave the group: a leaving row hands this member's queues to the
        others at their next heartbeat. Does not commit: polled messages not
        committed are delivered again. If the row cannot be written (logged),
        the others take over after member_timeout_s."""
        if self._closed:
            return
        self._closed = True
        self._held.clear()
        self._position.clear()
        if self._heartbeat_ms is None or forks.forked():
            return  # never joined, or joined by the process this one was forked from
        try:
            self._write_member_row(self._now_ms(), [], leaving=True)
        except Exception:  # noqa: BLE001 - the timeout hands the queues over instead
            _log.warning(
                "consumer %s/%s: member %s could not record that it leaves; the others take "
                "over its queues after member_timeout_s",
                self.group,
                self.topic,
                self.member,
                exc_info=True,
            )

    def _check_open(self) -> None:
        forks.check("this Consumer")
        if self._closed:
            raise ConsumerClosedError(
                f"the consumer of group {self.group!r} on topic {self.topic!r} is closed"
            )

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    # --- membership -----------------------------------------------------------

    def _expired(self) -> bool:
        """Whether this member's last heartbeat is older than the timeout, so
        that the others take it for gone."""
        return (
            self._heartbeat_ms is not None
            and self._now_ms() - self._heartbeat_ms > self._member_timeout_ms
        )

    def _heartbeat_if_due(self) -> None:
        """Join, or heartbeat and rebalance when heartbeat_interval_s has passed."""
        if (
            self._heartbeat_ms is None
            or self._now_ms() - self._heartbeat_ms >= self._heartbeat_interval_ms
        ):
            self._rebalance()

    def _rebalance(self) -> None:
        """Read the live members, let go of the queues no longer this member's,
        claim those of its own that no other live member holds, append this
        member's heartbeat row (the queues it holds and claims), and read
        again: a claim another member made meanwhile wins (`_confirm`)."""
        now_ms = self._now_ms()
        if self._heartbeat_ms is None:
            self._queues |= self._discover_queues()
        # Back after the others may have taken it for gone: what it held is
        # kept only where nobody took over meanwhile (checked as a claim is).
        suspect = set(self._held) if self._expired() else set()
        if suspect:
            _log.warning(
                "consumer %s/%s: member %s did not heartbeat for %d ms (member_timeout_s is "
                "%d ms): it keeps of its queues %s those nobody took over meanwhile",
                self.group,
                self.topic,
                self.member,
                now_ms - (self._heartbeat_ms or 0),
                self._member_timeout_ms,
                sorted(suspect),
            )
        others = self._read_members(now_ms)
        held_by_others: set[int] = set().union(*others.values())
        self._queues |= held_by_others
        members = sorted({*others, self.member})
        target = set(allocate_queues(self._queues, members, self.member))
        if (self._held - target) | (suspect & held_by_others):
            self._revoke((self._held - target) | (suspect & held_by_others))
        suspect &= self._held
        claimed = target - self._held - held_by_others
        self._write_member_row(now_ms, sorted(self._held | claimed), leaving=False)
        self._heartbeat_ms = now_ms
        self._members = tuple(members)
        if claimed or suspect:
            self._confirm(claimed, suspect, now_ms)
        if target - self._held:
            _log.info(
                "consumer %s/%s: member %s of %s holds %s, waits for %s",
                self.group,
                self.topic,
                self.member,
                members,
                sorted(self._held),
                sorted(target - self._held),
            )

    def _confirm(self, claimed: set[int], suspect: set[int], now_ms: int) -> None:
        """Take the `claimed` queues, and keep the `suspect` ones (held through
        a timeout), that no other live member claims now.

        Two members that claim a queue at the same time each read again after
        their own row: the later of the two rows is in the later reader's
        view, so at least one of them lets go (both may, and claim it again
        at a later heartbeat): a queue is never taken by two. Each queue
        taken starts at the group's committed offset, which its previous
        holder wrote before it let go; a suspect queue whose offset another
        member committed meanwhile starts there again too.
        """
        taken = set().union(*self._read_members(now_ms).values())
        if suspect & taken:
            self._revoke(suspect & taken)
        gained = claimed - taken
        if (claimed | suspect) & taken:
            _log.info(
                "consumer %s/%s: member %s lets go of %s, claimed by another member",
                self.group,
                self.topic,
                self.member,
                sorted((claimed | suspect) & taken),
            )
            self._write_member_row(now_ms, sorted(self._held | gained), leaving=False)
        suspect -= taken
        if not gained and not suspect:
            return
        newest = _read_committed(self.warehouse, self.group, self.topic, self._storage_options)
        moved_meanwhile = {q for q in suspect if newest.get(q) != self._newest.get(q)}
        if moved_meanwhile:
            self._revoke(moved_meanwhile)
            gained |= moved_meanwhile
        for queue_id, key in newest.items():
            if queue_id not in self._held:
                self._newest[queue_id] = key
                self._committed[queue_id] = key[1]
        for queue_id in gained:
            self._position[queue_id] = self._committed.get(queue_id, 0)
        self._held |= gained

    def _revoke(self, queues: set[int]) -> None:
        """Let go of `queues`: forget their positions, commit for them no more."""
        for queue_id in queues:
            self._position.pop(queue_id, None)
        self._held -= queues
        if self._on_revoke is not None:
            self._on_revoke(set(queues))

    def _members_handle(self) -> _AppendedTable:
        if self._members_table is None:
            table = open_or_create(
                self.warehouse,
                CONSUMER_MEMBERS,
                configuration=_MEMBERS_TABLE_CONFIG,
                storage_options=self._storage_options,
            )
            self._members_table = _AppendedTable(
                table, arrow_schema(CONSUMER_MEMBERS), self._storage_options
            )
        return self._members_table

    def _write_member_row(self, now_ms: int, queues: list[int], *, leaving: bool) -> None:
        # Each row of a member is newer than its last one, even within a millisecond.
        self._row_ms = max(now_ms, self._row_ms + 1)
        row = {
            "group": self.group,
            "topic": self.topic,
            "member": self.member,
            "heartbeat_ms": self._row_ms,
            "leaving": leaving,
            "queues": queues,
        }
        self._members_handle().append(
            pa.Table.from_pylist([row], schema=arrow_schema(CONSUMER_MEMBERS))
        )

    def _read_members(self, now_ms: int) -> dict[str, frozenset[int]]:
        """The other live members of the group on the topic and the queues each
        holds (its newest row, not leaving, not older than member_timeout_s)."""
        table = self._members_handle().table
        refresh(table)
        heartbeat, cutoff = pc.field("heartbeat_ms"), now_ms - self._member_timeout_ms
        condition = (
            (pc.field("group") == self.group)
            & (pc.field("topic") == self.topic)
            & ((heartbeat >= cutoff) | heartbeat.is_null())
        )
        # Files whose heartbeats are all older than the timeout are left out by
        # the log's statistics: a dataset of every file grew with the table.
        files = f"heartbeat_ms >= {cutoff} OR heartbeat_ms IS NULL"
        rows = (
            table.to_pyarrow_dataset(file_pruning_predicate=files)
            .to_table(filter=condition, columns=["member", "heartbeat_ms", "leaving", "queues"])
            .to_pylist()
        )
        newest: dict[str, tuple[int, bool, list[int]]] = {}
        for row in rows:
            member, heartbeat_ms, leaving, queues = (
                row["member"],
                row["heartbeat_ms"],
                row["leaving"],
                row["queues"],
            )
            problem = None
            if member is None or not member:
                problem = f"member is {member!r}"
            elif heartbeat_ms is None:
                problem = "heartbeat_ms is None"
            elif leaving is None:
                problem = "leaving is None"
            elif queues is None or any(q is None or q < 0 for q in queues):
                problem = f"queues is {queues!r}"
            if problem is not None:
                raise CorruptMembershipError(
                    f"{table_path(self.warehouse, CONSUMER_MEMBERS)}: a row of group "
                    f"{self.group!r}, topic {self.topic!r}, member {member!r} is corrupt "
                    f"({problem}); nothing was consumed. Fix or delete that row by hand"
                )
            if member == self.member:
                continue  # this member's state is the one in memory
            # A member's newest row is its state; at the same time, leaving wins.
            if member not in newest or (heartbeat_ms, leaving) > newest[member][:2]:
                newest[member] = (heartbeat_ms, leaving, queues)
        return {
            member: frozenset(queues)
            for member, (_, leaving, queues) in newest.items()
            if not leaving
        }

    def _discover_queues(self) -> set[int]:
        """The topic's queue ids: those with a message at offset 0 (offsets are
        dense from 0 per queue), and those the group committed."""
        found = set(self._committed)
        table = self._open_topic()
        if table is not None:
            rows = table.to_pyarrow_dataset(file_pruning_predicate="queue_offset = 0").to_table(
                filter=pc.field("queue_offset") == 0, columns=["queue_id"]
            )
            found.update(pc.unique(rows["queue_id"]).to_pylist())
        return found

    # --- reading and committing -------------------------------------------------

    def _open_topic(self) -> DeltaTable | None:
        if self._topic_table is not None:
            refresh(self._topic_table)  # an idle poll costs two file looks
            return self._topic_table
        uri = topic_path(self.warehouse, self.topic)
        try:
            table = DeltaTable(uri, storage_options=options_for(uri, self._storage_options))
        except TableNotFoundError:
            return None  # nothing delivered to the topic yet
        check_topic_table(table, self.topic)
        self._topic_table = table
        return table

    def _read(self, table: DeltaTable, max_messages: int, skip: Collection[int]) -> pa.Table:
        """The next batch of each queue held but `skip`, and the first message
        of each queue not known here yet."""
        queue, offset = pc.field("queue_id"), pc.field("queue_offset")
        condition = offset == 0
        files = ["queue_offset = 0"]
        if self._queues:
            known = sorted(self._queues)
            condition = condition & ~queue.isin(known)
            files[0] += f" AND ({_queue_ids_outside(known)})"
        held = [q for q in sorted(self._held) if q not in skip]
        starts = [self._position[q] for q in held]
        if len(held) > PER_QUEUE_READ_MAX:
            return self._read_band(table, condition, files[0], held, starts, max_messages)
        # Offsets are dense, so each queue's next batch is one offset range:
        # the scan reads no more than it hands out.
        for queue_id, start in zip(held, starts):
            end = min(start + max_messages, QUEUE_OFFSET_MAX)  # a huge max_messages: the rest
            condition = condition | ((queue == queue_id) & (offset >= start) & (offset < end))
            files.append(
                f"queue_id = {queue_id} AND queue_offset >= {start} AND queue_offset < {end}"
            )
        # The files whose statistics may hold those rows, picked from the log:
        # a topic gains a file per run, and opening every one made a poll's
        # cost grow with the topic's age.
        dataset = table.to_pyarrow_dataset(
            file_pruning_predicate=" OR ".join(f"({f})" for f in files)
        )
        return dataset.to_table(filter=condition, columns=TOPIC.names)

    def _read_band(
        self,
        table: DeltaTable,
        new_queues: pc.Expression,
        new_files: str,
        held: list[int],
        starts: list[int],
        max_messages: int,
    ) -> pa.Table:
        """`_read` for many queues, where a term per queue made the scan's
        filter and the files' predicate grow with them until a poll took
        seconds, then crashed (docs/performance.md). One band of offsets over
        all of them instead, each row then kept when in its queue's own
        range, and as many of each queue as a poll can hand out when the
        queues take turns (at least one each)."""
        depth = max(1, -(-max_messages // len(held)))
        low, high = min(starts), min(max(starts) + depth, QUEUE_OFFSET_MAX)
        queue, offset = pc.field("queue_id"), pc.field("queue_offset")
        band = queue.isin(held) & (offset >= low) & (offset < high)
        files = (
            f"({new_files}) OR (queue_id >= {held[0]} AND queue_id <= {held[-1]} "
            f"AND queue_offset >= {low} AND queue_offset < {high})"
        )
        rows = table.to_pyarrow_dataset(file_pruning_predicate=files).to_table(
            filter=new_queues | band, columns=TOPIC.names
        )
        at = pc.index_in(rows["queue_id"], value_set=pa.array(held, pa.int32()))
        start = pc.take(pa.array(starts, pa.int64()), at)  # null: not a queue held
        in_range = pc.and_(  # offset - start, not start + depth: no overflow past 2^63
            pc.greater_equal(rows["queue_offset"], start),
            pc.less(pc.subtract(rows["queue_offset"], start), min(depth, QUEUE_OFFSET_MAX)),
        )
        return rows.filter(pc.or_(pc.fill_null(in_range, False), pc.is_null(at)))

    def _poll(self, max_messages: int, skip: Collection[int]) -> list[ConsumedMessage]:
        """`poll`, leaving out the queues in `skip` (a push consumer's busy ones)."""
        self._check_open()
        self._heartbeat_if_due()
        table = self._open_topic()
        if table is None:
            return []
        rows = self._read(table, max_messages, skip)
        new_queues = set(pc.unique(rows["queue_id"]).to_pylist()) - self._queues
        if new_queues:
            # A queue appeared: share it out now, not at the next heartbeat.
            self._queues |= new_queues
            self._rebalance()
            rows = self._read(table, max_messages, skip)
        rows = rows.sort_by([("queue_id", "ascending"), ("queue_offset", "ascending")])
        by_queue: dict[int, list[ConsumedMessage]] = {}
        for row in rows.to_pylist():
            if row["queue_id"] not in self._held or row["queue_id"] in skip:
                continue  # another member's new queue
            messages = by_queue.setdefault(row["queue_id"], [])
            expected = self._position[row["queue_id"]] + len(messages)
            # A gap means the rest of the queue is not there yet: stop at it.
            if row["queue_offset"] == expected:
                messages.append(ConsumedMessage.from_row(self.topic, row))
        # Queues take turns, and the turn goes on from one poll to the next,
        # so a small max_messages does not favour the lowest queue ids.
        turns = sorted(by_queue, key=lambda q: (q <= self._last_turn, q))
        polled: list[ConsumedMessage] = []
        deepest = max((len(messages) for messages in by_queue.values()), default=0)
        for depth in range(min(max_messages, deepest)):
            for queue_id in turns:
                if depth < len(by_queue[queue_id]) and len(polled) < max_messages:
                    polled.append(by_queue[queue_id][depth])
        if polled:
            self._last_turn = polled[-1].queue_id
        for message in polled:
            self._position[message.queue_id] = message.queue_offset + 1
        return polled

    def _commit(self, next_offsets: Mapping[int, int]) -> dict[int, int]:
        """Append an offsets row for each queue held whose offset moves forward,
        then heartbeat if due: a queue let go of at that rebalance goes with its
        offset committed."""
        self._check_open()
        if self._expired():
            self._rebalance()  # taken for gone: it commits for no queue another took over
        moved = self._write_offsets(next_offsets)
        self._heartbeat_if_due()
        return moved

    def _write_offsets(self, next_offsets: Mapping[int, int]) -> dict[int, int]:
        moved = {
            queue_id: next_offset
            for queue_id, next_offset in sorted(next_offsets.items())
            if queue_id in self._held and next_offset > self._committed.get(queue_id, 0)
        }
        if not moved:
            return {}
        if self._offsets is None:
            table = open_or_create(
                self.warehouse,
                CONSUMER_OFFSETS,
                configuration=_OFFSETS_TABLE_CONFIG,
                storage_options=self._storage_options,
            )
            self._offsets = _AppendedTable(
                table, arrow_schema(CONSUMER_OFFSETS), self._storage_options
            )
        now_ms = self._now_ms()
        # A row sorts after the one it supersedes even if this member's clock
        # is behind the previous holder's: the newest row stays the newest.
        stamps = {
            queue_id: max(now_ms, self._newest.get(queue_id, (-1, 0))[0] + 1) for queue_id in moved
        }
        rows = [
            {
                "group": self.group,
                "topic": self.topic,
                "queue_id": queue_id,
                "next_offset": next_offset,
                "member": self.member,
                "committed_ms": stamps[queue_id],
            }
            for queue_id, next_offset in moved.items()
        ]
        self._offsets.append(pa.Table.from_pylist(rows, schema=arrow_schema(CONSUMER_OFFSETS)))
        self._committed.update(moved)
        self._newest.update((q, (stamps[q], moved[q])) for q in moved)
        return moved


def _queue_ids_outside(known: list[int]) -> str:
    """SQL: queue_id may be none of `known` (sorted): it is outside the runs of
    consecutive known ids, as ranges a file's min/max statistics can rule
    out where NOT IN cannot. Only the `KNOWN_RUNS_IN_PREDICATE_MAX` longest
    runs are left out: ids hashed from keys make thousands of runs, and
    delta-rs crashes on a predicate that long (docs/performance.md). A known
    id in a shorter run only lets a file be opened; the scan's filter leaves
    its rows out."""
    runs: list[list[int]] = []
    for queue_id in known:
        if runs and queue_id == runs[-1][1] + 1:
            runs[-1][1] = queue_id
        else:
            runs.append([queue_id, queue_id])
    if len(runs) > KNOWN_RUNS_IN_PREDICATE_MAX:
        longest = sorted(runs, key=lambda run: run[0] - run[1])[:KNOWN_RUNS_IN_PREDICATE_MAX]
        runs = sorted(longest)
    ranges = [f"queue_id < {runs[0][0]}", f"queue_id > {runs[-1][1]}"]
    ranges += [f"(queue_id > {a[1]} AND queue_id < {b[0]})" for a, b in zip(runs, runs[1:])]
    return " OR ".join(ranges)


#: how many runs of known queue ids a poll's file predicate leaves out at most
KNOWN_RUNS_IN_PREDICATE_MAX = 64


def _text(render: Callable[[Any], str], value: object) -> str:
    """`render(value)`, or a placeholder when that raises (a listener's odd
    exception or answer must not fail the round that reports it)."""
    try:
        return render(value)
    except Exception:  # noqa: BLE001 - any failure: the placeholder instead
        return f"<unprintable {type(value).__name__}>"


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
    committed offset again, with fresh counts. Several push consumers of a
    group share the topic's queues as `Consumer`s do; a queue taken over by
    another member loses its buffered messages and retries here.

    >>> def listener(message):                                      # doctest: +SKIP
    ...     handle(message.body)
    ...     return ConsumeResult.SUCCESS
    >>> consumer = PushConsumer("./warehouse", "billing", "ORDER", listener)  # doctest: +SKIP
    >>> consumer.start(); ...; consumer.shutdown()                  # doctest: +SKIP
    """

    def __init__(
        self,
        warehouse: str | os.PathLike[str] | Config | Broker,
        group: str,
        topic: str,
        listener: Listener | None = None,
        *,
        max_reconsume_times: int = 16,
        batch: int = 32,
        clock: Callable[[], float] = time.time,
        storage_options: dict[str, str] | None = None,
        idle_wait_s: float = 0.2,
        member: str | None = None,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        member_timeout_s: float = MEMBER_TIMEOUT_S,
    ):
        self._listener = None if listener is None else _valid_listener(listener)
        self._max_reconsume_times = _positive_int(max_reconsume_times, "max_reconsume_times")
        self._batch = _positive_int(batch, "batch")
        idle_wait_s = _positive_seconds(idle_wait_s, "idle_wait_s")
        self.consumer = Consumer(
            warehouse,
            group,
            topic,
            clock=clock,
            storage_options=storage_options,
            member=member,
            heartbeat_interval_s=heartbeat_interval_s,
            member_timeout_s=member_timeout_s,
        )
        self.consumer._on_revoke = self._revoked
        self._clock = clock
        self._idle_wait_s = float(idle_wait_s)
        # Polled messages not finished yet, per queue, in offset order.
        self._buffers: dict[int, deque[ConsumedMessage]] = {}
        self._retries: dict[int, _Retry] = {}
        self._dlq_table: _AppendedTable | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: the last error of a background round (the thread goes on after it)
        self.last_error: BaseException | None = None

    @property
    def group(self) -> str:
        return self.consumer.group

    @property
    def member(self) -> str:
        return self.consumer.member

    def assignment(self) -> list[int]:
        """The queue ids this member holds now (safe beside the background thread)."""
        with self._lock:
            return self.consumer.assignment()

    @property
    def topic(self) -> str:
        return self.consumer.topic

    def subscribe(self, listener: Listener) -> PushConsumer:
        """Make `listener` the one each message is handed to (RocketMQ's
        registerMessageListener), when none was given to the constructor or
        to replace it: the round under way finishes with the old one.
        Returns the consumer.

        >>> push = PushConsumer("./warehouse", "billing", "ORDER")  # doctest: +SKIP
        >>> push.subscribe(listener).start()                         # doctest: +SKIP
        """
        listener = _valid_listener(listener)
        with self._lock:
            self._listener = listener
        return self

    def consume_once(self) -> int:
        """One round: poll the queues with nothing waiting, deliver what is
        due, dead-letter what ran out of retries, commit. Returns the number
        of listener calls made (0: nothing was due)."""
        with self._lock:
            self._check_listener()
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
        with self._lock:
            self._check_listener()
        if self._thread is not None:
            raise RuntimeError(f"the push consumer of group {self.group!r} is already started")
        self._thread = threading.Thread(
            target=self._run, name=f"push-consumer-{self.group}-{self.topic}", daemon=True
        )
        self._thread.start()

    def shutdown(self, timeout_s: float | None = 30.0) -> None:
        """Stop the background thread (the round under way finishes, and
        commits) and close: leave the group, handing the queues over."""
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

    def _check_listener(self) -> None:
        if self._listener is None:
            raise NoListenerError(
                f"the push consumer of group {self.group!r} on topic {self.topic!r} has no "
                "listener: pass one to PushConsumer or call subscribe(listener) first"
            )

    def _revoked(self, queues: set[int]) -> None:
        """Another member takes these queues over: forget their buffered
        messages and retries (their new holder starts at the committed offset)."""
        for queue_id in queues:
            self._buffers.pop(queue_id, None)
            self._retries.pop(queue_id, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                delivered = self.consume_once()
            except ConsumerClosedError:
                return
            # A store that fails now may answer in the next round; the
            # committed offsets make a round safe to repeat. (BaseException:
            # delta-rs' panics are one; a thread ended by one stops silently.)
            except BaseException as exc:  # noqa: BLE001
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
        """Call the listener; None on success, else the reason to retry.

        Whatever the listener raises or returns ends here: an answer that is
        not a string is not compared (`==` of e.g. a DataFrame raises), and
        the reason's text cannot fail, so a bad answer is a reconsume with
        backoff like any other, never an error that redelivers at once."""
        listener = self._listener
        assert listener is not None  # consume_once checked it
        try:
            result = listener(message)
        except KeyboardInterrupt:  # Ctrl-C in a caller's consume_once loop
            raise
        # A failing listener is a reconsume, whatever it raised (RocketMQ
        # catches Throwable): a `sys.exit()` or a Rust library's panic ended
        # the push thread, and with it the group's consuming, silently.
        except BaseException as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {_text(str, exc)}"
        if isinstance(result, str):
            if result == ConsumeResult.SUCCESS:
                return None
            if result == ConsumeResult.RECONSUME_LATER:
                return str(ConsumeResult.RECONSUME_LATER)
        return f"the listener returned {_text(repr, result)}, not a ConsumeResult"

    def _dead_letter(self, message: ConsumedMessage, retry: _Retry) -> None:
        if self._dlq_table is None:
            table = dataclasses.replace(DLQ, path=f"_sys/dlq/{self.group}")
            self._dlq_table = _AppendedTable(
                open_or_create(
                    self.consumer.warehouse,
                    table,
                    configuration=_CONSUMER_TABLE_CONFIG,
                    storage_options=self.consumer._storage_options,
                ),
                arrow_schema(DLQ),
                self.consumer._storage_options,
            )
        row = {
            "topic": message.topic,
            **message.topic_row(),
            "group": self.group,
            "reconsume_times": retry.failures - 1,
            "reason": retry.reason,
            "dead_ms": int(self._clock() * 1000),
        }
        self._dlq_table.append(pa.Table.from_pylist([row], schema=arrow_schema(DLQ)))
        _log.warning(
            "push consumer %s: %s queue %d offset %d dead-lettered after %d retries: %s",
            self.group,
            message.topic,
            message.queue_id,
            message.queue_offset,
            retry.failures - 1,
            retry.reason,
        )
