"""Messages, local-transaction states and send results, with RocketMQ's input rules."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from txn_core.errors import MessageValidationError
from txn_core.vocabulary import TOPIC_MAX_LEN, Action, is_system_topic

# RocketMQ's Validators: topic and group names.
_NAME_RE = re.compile(r"^[%|a-zA-Z0-9_-]+$")
GROUP_MAX_LEN = 255
_SYSTEM_GROUP_PREFIXES = ("cid_rmq_sys_", "_sys")
# RocketMQ joins properties with \x01 between name and value and \x02 between
# pairs; refusing them keeps our properties portable to RocketMQ.
_PROPERTY_SEPARATORS = ("\x01", "\x02")


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


@dataclass
class Message:
    """A message to send in a transaction.

    After a send (and in the listener's calls) `transaction_id`, `msg_id` and
    `half_offset` are filled in, as RocketMQ sets `msg.transactionId`.

    >>> Message(topic="ORDER", body=b"{}", keys="order-42", tags="created").topic
    'ORDER'
    """

    topic: str
    body: bytes
    keys: str | None = None
    tags: str | None = None
    properties: Mapping[str, str] | None = None
    queue_id: int = 0
    check_immunity_s: int | None = None
    #: RocketMQ delay level; transactions ignore it (a single send clears it,
    #: a batch refuses it).
    delay_level: int = 0
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


def _validate_fields(msg: Message, max_body_bytes: int, in_batch: bool) -> None:
    """Everything but the topic. Plain type() tests first: this runs per message."""
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
    if msg.keys is not None and type(msg.keys) is not str:
        _optional_str(msg.keys, "keys")
    if msg.tags is not None and type(msg.tags) is not str:
        _optional_str(msg.tags, "tags")
    if type(msg.queue_id) is not int or not 0 <= msg.queue_id < 2**31:
        _int_field(msg.queue_id, "queue_id", 0, 2**31 - 1)
    if msg.check_immunity_s is not None:
        _int_field(msg.check_immunity_s, "check_immunity_s", -(2**31), 2**31 - 1)
    if msg.delay_level:
        _int_field(msg.delay_level, "delay_level", 0, 2**31 - 1)
        if in_batch:
            raise MessageValidationError("delay_level", "a batch must not carry a delay level")
    if msg.properties:
        _validate_properties(msg.properties)


def _validate_properties(properties: object) -> None:
    if not isinstance(properties, Mapping):
        raise MessageValidationError(
            "properties", f"must be a mapping of str to str, got {type(properties).__name__}"
        )
    for key, value in properties.items():
        if not isinstance(key, str) or not key:
            raise MessageValidationError("properties", f"key {key!r} must be a non-empty string")
        if not isinstance(value, str):
            raise MessageValidationError(
                f"properties[{key!r}]", f"value must be a string, got {type(value).__name__}"
            )
        for text in (key, value):
            if any(sep in text for sep in _PROPERTY_SEPARATORS):
                raise MessageValidationError(
                    f"properties[{key!r}]", "must not contain the control characters \\x01 or \\x02"
                )


def validate_batch(messages: object, max_body_bytes: int) -> Sequence[Message]:
    """RocketMQ's batch rules: non-empty, one topic, no delay; each message valid."""
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
            _validate_fields(msg, max_body_bytes, in_batch=True)
        except MessageValidationError as exc:
            raise MessageValidationError(f"messages[{i}].{exc.field}", exc.problem) from None
    return messages


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
