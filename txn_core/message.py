"""Messages, local-transaction states and send results, with RocketMQ's input rules."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from txn_core.errors import MessageValidationError
from txn_core.vocabulary import RETRY_TOPIC_PREFIXES, TOPIC_MAX_LEN, Action, is_system_topic

# RocketMQ's Validators: topic and group names.
_NAME_RE = re.compile(r"^[%|a-zA-Z0-9_-]+\Z")  # \Z: `$` lets a final newline through
GROUP_MAX_LEN = 255
_SYSTEM_GROUP_PREFIXES = ("cid_rmq_sys_", "_sys")
# RocketMQ joins properties with \x01 between name and value and \x02 between
# pairs; refusing them keeps our properties portable to RocketMQ.
_PROPERTY_SEPARATORS = ("\x01", "\x02")
#: RocketMQ refuses a message whose properties, its keys and tags among
#: them, take more than this many bytes (PROPERTIES_SIZE_EXCEEDED)
MAX_PROPERTIES_BYTES = 32767
#: the largest `queue_id` (a table column of 32 bits) and `queue_offset` (64)
QUEUE_ID_MAX = 2**31 - 1
QUEUE_OFFSET_MAX = 2**63 - 1


class LocalTransactionState(str, enum.Enum):
    """What the local transaction (or a back-check) decided."""

    COMMIT_MESSAGE = "COMMIT_MESSAGE"
    ROLLBACK_MESSAGE = "ROLLBACK_MESSAGE"
    UNKNOWN = "UNKNOWN"

    # RocketMQ's Java spelling, for code ported from it.
    UNKNOW = "UNKNOWN"

    @property
    def action(self) -> Action | None:
        """The OP action this state writes (None for UNKNOWN: nothing is written)."""
        return {"COMMIT_MESSAGE": Action.COMMIT, "ROLLBACK_MESSAGE": Action.ROLLBACK}.get(
            self.value
        )


@dataclass(slots=True)  # slots: `msg.key = ...` (for `keys`) raises, never goes unsent
class Message:
    """A message to send: in a transaction (`TransactionProducer`), or plain
    (`Producer.send`).

    In a listener's calls `transaction_id`, `msg_id` and `half_offset` are
    filled in, as RocketMQ sets `msg.transactionId`.

    >>> Message(topic="ORDER", body=b"{}", keys="order-42", tags="created").topic
    'ORDER'
    """

    topic: str
    body: bytes
    keys: str | None = None
    tags: str | None = None
    properties: Mapping[str, str] | None = None
    queue_id: int = 0
    #: the first back-check's delay; a plain message is never checked and
    #: ignores it
    check_immunity_s: int | None = None
    #: RocketMQ 4's delay level, 1 and up (`delay_levels`; above the last:
    #: the last); at most one of delay_level, delay_ms and deliver_at_ms.
    #: A single send, plain or transactional, delays the message; a batch
    #: refuses it.
    delay_level: int | None = None
    #: RocketMQ 5's timer, relative: deliver this many ms after the store
    #: time (at most `max_delay_ms`)
    delay_ms: int | None = None
    #: RocketMQ 5's timer, absolute: deliver at this epoch ms of the broker
    #: core's clock (at most `max_delay_ms` ahead; in the past: delivered at
    #: once)
    deliver_at_ms: int | None = None
    transaction_id: str | None = None
    msg_id: str | None = None
    half_offset: int | None = None
    producer_group: str | None = field(default=None, repr=False)


def _validate_name(value: object, field_name: str, max_len: int, kind: str, system: bool) -> str:
    """RocketMQ's Validators rules shared by topic and group names."""
    if not isinstance(value, str):
        raise MessageValidationError(field_name, f"must be a string, got {type(value).__name__}")
    if not value:
        raise MessageValidationError(field_name, "must not be empty")
    if len(value) > max_len:
        raise MessageValidationError(
            field_name, f"is {len(value)} characters; at most {max_len} are allowed"
        )
    if not _NAME_RE.match(value):
        raise MessageValidationError(
            field_name, f"{value!r} contains characters outside [A-Za-z0-9_%|-]"
        )
    if system:
        raise MessageValidationError(field_name, f"{value!r} is a system {kind} name")
    return value


def validate_topic(topic: object, field_name: str = "topic") -> str:
    system = isinstance(topic, str) and is_system_topic(topic)
    return _validate_name(topic, field_name, TOPIC_MAX_LEN, "topic", system)


def validate_group(group: object, field_name: str = "producer_group") -> str:
    system = isinstance(group, str) and group.lower().startswith(_SYSTEM_GROUP_PREFIXES)
    return _validate_name(group, field_name, GROUP_MAX_LEN, "group", system)


def _optional_str(value: object, field_name: str) -> None:
    if value is not None and not isinstance(value, str):
        raise MessageValidationError(
            field_name, f"must be a string or None, got {type(value).__name__}"
        )


def validate_text(text: str, field_name: str) -> None:
    """Refuse a string UTF-8 cannot encode (a lone surrogate, as
    `surrogateescape` decoding leaves): the group commit would fail on it,
    and with it every other sender's rows in the same commit."""
    if not text.isascii():  # a flag CPython keeps: no scan for the common case
        try:
            text.encode()
        except UnicodeEncodeError as exc:
            raise MessageValidationError(
                field_name,
                f"holds {text[exc.start]!r} at position {exc.start}, which UTF-8 cannot "
                "encode (a lone surrogate)",
            ) from None


def _int_field(value: object, field_name: str, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise MessageValidationError(field_name, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise MessageValidationError(field_name, f"{value} is out of range [{low}, {high}]")


def validate_message(msg: object, max_body_bytes: int, *, in_batch: bool = False) -> Message:
    """Check every field of `msg`; raise MessageValidationError naming the first bad one."""
    if not isinstance(msg, Message):
        raise MessageValidationError(
            "message", f"must be a txn_core.Message, got {type(msg).__name__}"
        )
    validate_topic(msg.topic)
    _validate_fields(msg, max_body_bytes, in_batch)
    return msg


def _validate_fields(msg: Message, max_body_bytes: int, in_batch: bool) -> int:
    """Everything but the topic; returns the body's size. Plain type() tests
    first: this runs per message."""
    body = msg.body
    if type(body) is bytes:
        size = len(body)
    elif isinstance(body, (bytes, bytearray, memoryview)):
        size = memoryview(body).nbytes
    elif body is None:
        raise MessageValidationError("body", "must not be None")
    else:
        raise MessageValidationError("body", f"must be bytes, got {type(body).__name__}")
    if size == 0:
        raise MessageValidationError("body", "must not be empty")
    if size > max_body_bytes:
        raise MessageValidationError("body", f"is {size} bytes; the limit is {max_body_bytes}")
    keys, tags = msg.keys, msg.tags
    if keys is not None:
        if type(keys) is not str:
            _optional_str(keys, "keys")
        if not keys.isascii():
            validate_text(keys, "keys")
    if tags is not None:
        if type(tags) is not str:
            _optional_str(tags, "tags")
        if not tags.isascii():
            validate_text(tags, "tags")
    if type(msg.queue_id) is not int or not 0 <= msg.queue_id <= QUEUE_ID_MAX:
        _int_field(msg.queue_id, "queue_id", 0, QUEUE_ID_MAX)
    if msg.check_immunity_s is not None:
        _int_field(msg.check_immunity_s, "check_immunity_s", -(2**31), 2**31 - 1)
    if msg.delay_level is not None or msg.delay_ms is not None or msg.deliver_at_ms is not None:
        _validate_delay(msg, in_batch)
    chars = (len(keys) if keys else 0) + (len(tags) if tags else 0)
    if msg.properties:
        chars += _validate_properties(msg.properties)
    if chars * 4 > MAX_PROPERTIES_BYTES:  # UTF-8 takes at most 4 bytes a character
        _validate_properties_size(msg)
    return size


#: the fields that delay a message, at most one per message
DELAY_FIELDS = ("delay_level", "delay_ms", "deliver_at_ms")


def _validate_delay(msg: Message, in_batch: bool) -> None:
    """The delay fields' own rules (the limit `max_delay_ms` needs the
    configuration and the clock: `delivery_times`)."""
    given = [name for name in DELAY_FIELDS if getattr(msg, name) is not None]
    if in_batch:
        raise MessageValidationError(given[0], "a batch must not carry a delay")
    if len(given) > 1:
        raise MessageValidationError(
            given[1], f"at most one of {', '.join(DELAY_FIELDS)} may be set; got {given}"
        )
    name = given[0]
    value = getattr(msg, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise MessageValidationError(name, f"must be an integer, got {type(value).__name__}")
    if name == "delay_level" and value < 1:
        raise MessageValidationError(
            name, f"{value} is not a delay level; levels start at 1 (None: no delay)"
        )
    if value < 0:
        raise MessageValidationError(name, f"{value} is negative")


def delivery_times(
    messages: Sequence[Message], now_ms: int, levels_ms: Sequence[int], max_delay_ms: int
) -> tuple[list[int | None], list[int | None]] | None:
    """(absolute deliver_at_ms, relative delay in ms) per message, each None
    when not given; None when no message is delayed. A delay level becomes
    its duration (`levels_ms`, the last for a level above it). A delay
    beyond `max_delay_ms` (a `deliver_at_ms` more than that after `now_ms`)
    raises MessageValidationError naming the field."""
    absolute: list[int | None] = []
    relative: list[int | None] = []
    delayed = False
    for msg in messages:
        at, delay = msg.deliver_at_ms, msg.delay_ms
        if msg.delay_level is not None:
            delay = levels_ms[min(msg.delay_level, len(levels_ms)) - 1]
        if delay is not None and delay > max_delay_ms:
            name = "delay_level" if msg.delay_level is not None else "delay_ms"
            raise MessageValidationError(
                name, f"delays {delay} ms; the limit is max_delay_ms = {max_delay_ms}"
            )
        if at is not None and at - now_ms > max_delay_ms:
            raise MessageValidationError(
                "deliver_at_ms",
                f"{at} is {at - now_ms} ms ahead of the broker's clock ({now_ms}); "
                f"the limit is max_delay_ms = {max_delay_ms}",
            )
        delayed = delayed or at is not None or delay is not None
        absolute.append(at)
        relative.append(delay)
    return (absolute, relative) if delayed else None


def message_size(msg: Message, body_size: int) -> int:
    """What a message counts toward a batch's `max_batch_bytes`: its body's
    `body_size` bytes plus the UTF-8 bytes of its keys, tags and property
    names and values (RocketMQ counts its encoded message; the topic, the
    same for the whole batch, and fixed overheads are left out here)."""
    size = body_size
    if msg.keys:
        size += len(msg.keys.encode())
    if msg.tags:
        size += len(msg.tags.encode())
    if msg.properties:
        size += sum(len(k.encode()) + len(v.encode()) for k, v in msg.properties.items())
    return size


def _validate_properties_size(msg: Message) -> None:
    parts = {
        "keys": len(msg.keys.encode()) if msg.keys else 0,
        "tags": len(msg.tags.encode()) if msg.tags else 0,
        "properties": sum(
            len(k.encode()) + len(v.encode()) for k, v in (msg.properties or {}).items()
        ),
    }
    size = sum(parts.values())
    if size > MAX_PROPERTIES_BYTES:
        largest = max(parts, key=lambda name: parts[name])
        raise MessageValidationError(
            largest,
            f"{parts[largest]} bytes, and the keys, tags and properties {size} together; "
            f"the limit for those is {MAX_PROPERTIES_BYTES} (RocketMQ's): put large data "
            "in the body",
        )


def _validate_properties(properties: object) -> int:
    """Check each name and value; return how many characters they hold."""
    if not isinstance(properties, Mapping):
        raise MessageValidationError(
            "properties", f"must be a mapping of str to str, got {type(properties).__name__}"
        )
    chars = 0
    for key, value in properties.items():
        if not isinstance(key, str) or not key:
            raise MessageValidationError("properties", f"key {key!r} must be a non-empty string")
        if not isinstance(value, str):
            raise MessageValidationError(
                f"properties[{key!r}]", f"value must be a string, got {type(value).__name__}"
            )
        for text in (key, value):
            validate_text(text, f"properties[{key!r}]")
            if any(sep in text for sep in _PROPERTY_SEPARATORS):
                raise MessageValidationError(
                    f"properties[{key!r}]", "must not contain the control characters \\x01 or \\x02"
                )
        chars += len(key) + len(value)
    return chars


def validate_batch(
    messages: object, max_body_bytes: int, *, max_batch_bytes: int | None = None
) -> Sequence[Message]:
    """RocketMQ's batch rules: non-empty, one topic, not a retry or
    dead-letter topic (`%RETRY%…`, `%DLQ%…`), no delay; each message valid;
    with `max_batch_bytes`, the messages' sizes (`message_size`) add up to
    at most that."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise MessageValidationError("messages", "must be a sequence of Message")
    if not messages:
        raise MessageValidationError("messages", "must not be empty")
    first = messages[0]
    if not isinstance(first, Message):
        raise MessageValidationError(
            "messages[0]", f"must be a txn_core.Message, got {type(first).__name__}"
        )
    topic = first.topic
    try:
        validate_topic(topic)  # once: every message must carry this same topic
    except MessageValidationError as exc:
        raise MessageValidationError(f"messages[0].{exc.field}", exc.problem) from None
    if topic.startswith(RETRY_TOPIC_PREFIXES):
        raise MessageValidationError(
            "messages[0].topic",
            f"{topic!r} is a retry or dead-letter topic; a batch cannot go there",
        )
    total = 0
    for i, msg in enumerate(messages):
        if type(msg) is not Message and not isinstance(msg, Message):
            raise MessageValidationError(
                f"messages[{i}]", f"must be a txn_core.Message, got {type(msg).__name__}"
            )
        if msg.topic != topic:
            raise MessageValidationError(
                "messages",
                f"a batch must share one topic; messages[{i}] has {msg.topic!r}, not {topic!r}",
            )
        try:
            size = _validate_fields(msg, max_body_bytes, in_batch=True)
        except MessageValidationError as exc:
            raise MessageValidationError(f"messages[{i}].{exc.field}", exc.problem) from None
        if max_batch_bytes is not None:
            total += message_size(msg, size)
    if max_batch_bytes is not None and total > max_batch_bytes:
        if len(messages) == 1:
            raise MessageValidationError(
                "messages",
                f"its one message is {total} bytes (body, keys, tags and properties); the "
                f"limit is max_batch_bytes = {max_batch_bytes}: send it on its own (send)",
            )
        raise MessageValidationError(
            "messages",
            f"the batch is {total} bytes (bodies, keys, tags and properties of its "
            f"{len(messages)} messages); the limit is max_batch_bytes = {max_batch_bytes}: "
            "send it in smaller batches",
        )
    return messages


def validate_plain(msg: object, max_body_bytes: int) -> Message:
    """A single plain message (`Producer.send`): every field as
    `validate_message`; its delay, if any, is checked against the limit
    when stored (`delivery_times`)."""
    return validate_message(msg, max_body_bytes)


def validate_transactional(msg: object, max_body_bytes: int) -> Message:
    """A single transactional message: every field as `validate_message`,
    its delay (`delay_level`, `delay_ms` or `deliver_at_ms`) included: unlike
    RocketMQ, which clears it, the job delivers a delayed transactional
    message at its time if it is committed by then, at once if committed
    later, never if rolled back or discarded (docs/protocol.md §3.1, "Delayed
    messages"). The limit `max_delay_ms` is checked when stored, as for a
    plain send."""
    return validate_message(msg, max_body_bytes)


@dataclass
class SendResult:
    """Outcome of `send_message_in_transaction` (RocketMQ's TransactionSendResult)."""

    transaction_id: str
    msg_id: str
    half_offset: int
    local_state: LocalTransactionState
    send_status: str = "SEND_OK"
    #: the exception the local transaction raised, if any (its state is then UNKNOWN)
    error: BaseException | None = None
    #: False when the decided state's OP row could not be written; the back-check
    #: will settle the message (as RocketMQ's oneway endTransaction)
    op_written: bool = False
    op_error: BaseException | None = None


@dataclass
class BatchSendResult:
    """Outcome of `send_batch_in_transaction`: one decision for every message."""

    transaction_ids: list[str]
    msg_ids: list[str]
    half_offsets: list[int]
    local_state: LocalTransactionState
    send_status: str = "SEND_OK"
    error: BaseException | None = None
    op_written: bool = False
    op_error: BaseException | None = None

    def __len__(self) -> int:
        return len(self.transaction_ids)


@dataclass(frozen=True)
class SendReceipt:
    """Outcome of `Producer.send` (RocketMQ 5's SendReceipt): the message is
    durable in `_sys/half`, and the job delivers it to `topic` at its next
    run. Its `queue_offset` is given then, by the job (docs/protocol.md §4.3).

    >>> receipt = producer.send(Message(topic="ORDER", body=b"{}"))   # doctest: +SKIP
    >>> receipt.msg_id, receipt.send_status                          # doctest: +SKIP
    ('7F3A…', 'SEND_OK')
    """

    msg_id: str
    #: the message's offset in `_sys/half` (unique, not dense); its
    #: `transaction_id` column equals `msg_id`
    half_offset: int
    topic: str
    queue_id: int
    send_status: str = "SEND_OK"


@dataclass(frozen=True)
class BatchSendReceipt:
    """Outcome of `Producer.send_batch`: every message durable, in one commit.

    >>> receipt = producer.send_batch([Message(topic="ORDER", body=b"a"),
    ...                                Message(topic="ORDER", body=b"b")])  # doctest: +SKIP
    >>> len(receipt), receipt.topic                                      # doctest: +SKIP
    (2, 'ORDER')
    """

    msg_ids: list[str]
    half_offsets: list[int]
    topic: str
    send_status: str = "SEND_OK"

    def __len__(self) -> int:
        return len(self.msg_ids)
