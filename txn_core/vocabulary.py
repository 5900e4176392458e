"""The protocol's words, defined once for the broker core, the job and `verify`.

Every value here is stored in a table column (docs/protocol.md §2), so the
members are `str` enums: they compare equal to the strings in the rows, and
format as them in SQL and f-strings.
"""

from __future__ import annotations

import enum
import re

__all__ = [
    "Action",
    "CANCEL",
    "CheckAnswer",
    "ConsumeResult",
    "Decision",
    "MessageType",
    "OpOutcome",
    "RETRY_TOPIC_PREFIXES",
    "RunStatus",
    "Source",
    "SYSTEM_TOPIC_REGEX",
    "TOPIC_MAX_LEN",
    "TOPIC_PATTERN",
    "is_system_topic",
]


class MessageType(enum.StrEnum):
    """What kind of message a `_sys/half` row is (`message_type`; RocketMQ 5's
    names). A null `message_type` (rows written before the column existed) is
    a TRANSACTION.

    - TRANSACTION: a half message, delivered once a COMMIT OP decides it;
    - NORMAL: a plain message (`Producer.send`), committed by its own store:
      it needs no OP and is never checked.

    >>> MessageType.NORMAL == "NORMAL"
    True
    """

    NORMAL = "NORMAL"
    TRANSACTION = "TRANSACTION"


class Action(enum.StrEnum):
    """What an OP row does to its half message."""

    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"


#: the action of an ADMIN OP that cancels a delayed message's delivery
#: (`Broker.cancel`): not a decision of its transaction, so not an `Action`
CANCEL = "CANCEL"


class Source(enum.StrEnum):
    """Who wrote an OP row: the producer after its local transaction, a
    producer answering a back-check, or an operator (`Broker.resolve`)."""

    PRODUCER = "PRODUCER"
    CHECK = "CHECK"
    ADMIN = "ADMIN"


class CheckAnswer(enum.StrEnum):
    """A producer's answer to a back-check (`_sys/check_answers.answer`);
    COMMIT and ROLLBACK answers are written as OPs instead."""

    UNKNOWN = "UNKNOWN"
    ERROR = "ERROR"


class OpOutcome(enum.StrEnum):
    """What a run makes of an OP row: the first valid OP of a message wins;
    a later one agreeing with it is a duplicate, disagreeing a conflict; one
    naming no known message, or malformed, is invalid; one arriving after
    its message was discarded is late."""

    WIN = "WIN"
    #: a CANCEL OP naming a known message, judged apart (`jobs.cancels`)
    CANCEL = "CANCEL"
    DUPLICATE = "DUPLICATE"
    CONFLICT = "CONFLICT"
    INVALID = "INVALID"
    LATE = "LATE"


class Decision(enum.StrEnum):
    """What a run decides for a pending message no OP decided: discard it
    (too old, or checked too often), check it now, or wait."""

    EXPIRED = "EXPIRED"
    MAX_CHECKS = "MAX_CHECKS"
    CHECK = "CHECK"
    WAIT = "WAIT"


class RunStatus(enum.StrEnum):
    """A `_sys/runs` row: a run's intent, written before its outputs, or its
    record once they are all committed."""

    STARTED = "STARTED"
    COMMITTED = "COMMITTED"


class ConsumeResult(enum.StrEnum):
    """What a push consumer's listener says of a message: done, or deliver
    it again later (RocketMQ's ConsumeConcurrentlyStatus).

    >>> ConsumeResult.SUCCESS == "CONSUME_SUCCESS"
    True
    """

    SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"

    # RocketMQ's Java spelling, for code ported from it.
    CONSUME_SUCCESS = "CONSUME_SUCCESS"


#: RocketMQ's topic rule (TopicValidator): 1..127 of [A-Za-z0-9_%|-]
TOPIC_MAX_LEN = 127
#: (for Spark's `rlike`: Java's `\z` is the end of the text; its `$` also
#: matches before a final newline, which would let "ORDER\n" through)
TOPIC_PATTERN = r"^[A-Za-z0-9_%|\-]{1,127}\z"
#: topics RocketMQ reserves (TopicValidator.SYSTEM_TOPIC_SET), and the prefixes
#: reserved in any case: RocketMQ's and our own tables'
_SYSTEM_TOPICS = (
    "TBW102",
    "SCHEDULE_TOPIC_XXXX",
    "BenchmarkTest",
    "RMQ_SYS_TRANS_HALF_TOPIC",
    "RMQ_SYS_TRANS_OP_HALF_TOPIC",
    "TRANS_CHECK_MAX_TIME_TOPIC",
    "SELF_TEST_TOPIC",
    "OFFSET_MOVED_EVENT",
    "RMQ_SYS_TRACE_TOPIC",
)
_SYSTEM_PREFIXES = ("rmq_sys_", "_sys")
#: RocketMQ's retry and dead-letter topics (MixAll.RETRY_GROUP_TOPIC_PREFIX,
#: DLQ_GROUP_TOPIC_PREFIX): a batch may not go to one (docs/protocol.md §3.1)
RETRY_TOPIC_PREFIXES = ("%RETRY%", "%DLQ%")
#: the system-topic rule as one regular expression that Python's `re` and
#: Spark's `rlike` (Java's regex) read alike, so both engines apply one rule
SYSTEM_TOPIC_REGEX = (
    f"^(?:{'|'.join(map(re.escape, _SYSTEM_TOPICS))})$"
    f"|^(?i:{'|'.join(map(re.escape, _SYSTEM_PREFIXES))})"
)
_SYSTEM_TOPIC = re.compile(SYSTEM_TOPIC_REGEX)


def is_system_topic(topic: str) -> bool:
    """Whether `topic` is reserved: no message may be sent to it.

    >>> is_system_topic("RMQ_SYS_TRANS_HALF_TOPIC"), is_system_topic("ORDER")
    (True, False)
    """
    return _SYSTEM_TOPIC.search(topic) is not None
