"""Producer (plain sends and batches), TransactionProducer and
TransactionListener (RocketMQ's DefaultMQProducerImpl rules)."""

from __future__ import annotations

import abc
import inspect
import logging
import threading
from collections.abc import Sequence
from typing import Any, Self

from txn_core import forks
from txn_core.broker import Broker, StoredMessages
from txn_core.checks import CheckAnswerer
from txn_core.config import ConfigError
from txn_core.errors import BrokerClosedError, NoListenerError
from txn_core.message import (
    BatchSendReceipt,
    BatchSendResult,
    LocalTransactionState,
    Message,
    SendReceipt,
    SendResult,
    validate_batch,
    validate_group,
    validate_plain,
    validate_transactional,
)
from txn_core.vocabulary import MessageType

log = logging.getLogger(__name__)


class TransactionListener(abc.ABC):
    """What a producer implements: run the local transaction, and answer back-checks.

    Return COMMIT_MESSAGE, ROLLBACK_MESSAGE or UNKNOWN. Returning None or
    raising counts as UNKNOWN: the back-check decides later.
    """

    @abc.abstractmethod
    def execute_local_transaction(
        self, msg: Message | Sequence[Message], arg: Any
    ) -> LocalTransactionState: ...

    @abc.abstractmethod
    def check_local_transaction(self, msg: Message) -> LocalTransactionState: ...


class Producer:
    """Sends plain messages for one producer group (RocketMQ's DefaultMQProducer):
    no local transaction, no back-check. A message is durable when the call
    returns, and the job delivers it to `topics/<topic>` at its next run,
    exactly once, in the order of its commit (docs/protocol.md §3.1, "Plain
    messages and batches"). Sends from many threads share commits.

    >>> producer = Producer(broker, group="order_group")               # doctest: +SKIP
    >>> receipt = producer.send(Message(topic="ORDER", body=b"{...}"))  # doctest: +SKIP
    >>> receipt.send_status                                             # doctest: +SKIP
    'SEND_OK'
    >>> batch = producer.send_batch([Message(topic="ORDER", body=b"a"),
    ...                              Message(topic="ORDER", body=b"b")])  # doctest: +SKIP
    >>> len(batch)                                                      # doctest: +SKIP
    2
    """

    def __init__(self, broker: Broker, group: str):
        if not isinstance(broker, Broker):
            raise ConfigError(
                f"broker must be a Broker (Broker.open(warehouse)), got {type(broker).__name__}"
            )
        self.broker = broker
        self.group = validate_group(group)
        self._closed = False

    def send(self, msg: Message) -> SendReceipt:
        """Store one plain message; returns once it is durable.

        A delay (`delay_level`, `delay_ms` or `deliver_at_ms`, at most one)
        makes the job deliver it at store time + delay, or at `deliver_at_ms`
        (at once when that is past): docs/protocol.md §3.1, "Delayed
        messages". Raises MessageValidationError (nothing written) for a bad
        message or a delay beyond `max_delay_ms`, PersistError when it could
        not be stored, BrokerClosedError after `close()`.
        """
        self._check_open()
        validate_plain(msg, self.broker.config.max_body_bytes)
        stored = self.broker.store_halves(self.group, [msg], MessageType.NORMAL)
        return SendReceipt(
            msg_id=stored.transaction_ids[0],
            half_offset=stored.half_offsets[0],
            topic=msg.topic,
            queue_id=msg.queue_id,
        )

    def send_batch(self, messages: Sequence[Message]) -> BatchSendReceipt:
        """Store plain messages in one commit: all or none.

        RocketMQ's batch rules, checked before anything is written
        (MessageValidationError naming the field): at least one message, one
        topic, not a `%RETRY%`/`%DLQ%` topic, no delay level, and at most
        `max_batch_bytes` in all (`txn_core.message.message_size`). Each
        message gets its own `msg_id` and offset; they are delivered in the
        batch's order.
        """
        self._check_open()
        config = self.broker.config
        validate_batch(messages, config.max_body_bytes, max_batch_bytes=config.max_batch_bytes)
        stored = self.broker.store_halves(self.group, messages, MessageType.NORMAL)
        return BatchSendReceipt(
            msg_ids=stored.transaction_ids,
            half_offsets=stored.half_offsets,
            topic=messages[0].topic,
        )

    def close(self) -> None:
        """Refuse sends from now on (BrokerClosedError), as RocketMQ's producer
        after shutdown; the broker, which owns the writers, stays open."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerClosedError(f"the producer of group {self.group!r} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransactionProducer(Producer):
    """Sends messages in transactions for one producer group; as a
    `Producer`, it also sends plain messages (`send`, `send_batch`), as
    RocketMQ's TransactionMQProducer extends DefaultMQProducer. A
    transactional message may be delayed, as a plain one (RocketMQ drops
    the delay): delivered at its time if committed by then, at once if
    committed later, never if rolled back or discarded.

    >>> producer = TransactionProducer(broker, group="order_group",
    ...                                listener=OrderListener())        # doctest: +SKIP
    >>> result = producer.send_message_in_transaction(
    ...     Message(topic="ORDER", body=b"{...}", keys="order-42"))     # doctest: +SKIP
    >>> result.local_state                                               # doctest: +SKIP
    <LocalTransactionState.COMMIT_MESSAGE: 'COMMIT_MESSAGE'>
    """

    def __init__(self, broker: Broker, group: str, listener: TransactionListener | None = None):
        super().__init__(broker, group)
        self.listener = None if listener is None else _valid_listener(listener)
        self._checks = CheckAnswerer(broker, self.group, self._check_state)
        self._checks_lock = threading.Lock()
        self._checker: threading.Thread | None = None
        self._stop = threading.Event()

    # --- sending ------------------------------------------------------------------

    def send_message_in_transaction(self, msg: Message, arg: Any = None) -> SendResult:
        """Store the half message, run the local transaction, report its outcome.

        A delay (`delay_level`, `delay_ms` or `deliver_at_ms`, at most one,
        within `max_delay_ms`) is kept, unlike RocketMQ: the job delivers
        the message at its time if it is committed by then (at once if
        committed later), never if it is rolled back or discarded; checks
        go on as for any pending message (docs/protocol.md §3.1, "Delayed
        messages").
        Raises MessageValidationError (nothing written) for a bad message,
        NoListenerError without a listener, PersistError when the half row
        could not be stored (the local transaction is then not run).
        """
        self._check_open()
        listener = self._require_listener()
        validate_transactional(msg, self.broker.config.max_body_bytes)
        stored = self.broker.store_halves(self.group, [msg])
        state, error = _execute(listener, stored[0], arg)
        result = SendResult(
            transaction_id=stored.transaction_ids[0],
            msg_id=stored.transaction_ids[0],
            half_offset=stored.half_offsets[0],
            local_state=state,
            error=error,
        )
        result.op_written, result.op_error = self._report(state, stored)
        return result

    def send_batch_in_transaction(
        self, messages: Sequence[Message], arg: Any = None
    ) -> BatchSendResult:
        """Store all half rows in one commit, decide them with one local transaction.

        `execute_local_transaction(batch, arg)` receives the stored messages
        as a sequence (ids filled in, each a copy); its one decision is
        written as one OP per message, in one commit. Checks stay per message.
        """
        self._check_open()
        listener = self._require_listener()
        validate_batch(messages, self.broker.config.max_body_bytes)
        stored = self.broker.store_halves(self.group, messages)
        state, error = _execute(listener, stored, arg)
        result = BatchSendResult(
            transaction_ids=list(stored.transaction_ids),
            msg_ids=list(stored.transaction_ids),
            half_offsets=list(stored.half_offsets),
            local_state=state,
            error=error,
        )
        result.op_written, result.op_error = self._report(state, stored)
        return result

    def _report(
        self, state: LocalTransactionState, stored: StoredMessages
    ) -> tuple[bool, BaseException | None]:
        """Write the decision's OP rows; a failure is returned, not raised
        (docs/protocol.md §3.1, item 4): the local transaction has run, and
        a caller told "failed" might run it again."""
        if state.action is None:
            return False, None
        try:
            self.broker.store_ops(
                stored.half_offsets, stored.transaction_ids, self.group, state.action, "PRODUCER"
            )
        # any Exception: a PersistError, or the broker closed meanwhile
        except Exception as exc:  # noqa: BLE001
            log.warning(
                "OP for %d message(s) of group %s not written (%s); the back-check "
                "will settle them",
                len(stored),
                self.group,
                exc,
            )
            return False, exc
        return True, None

    def _require_listener(self) -> TransactionListener:
        if self.listener is None:
            raise NoListenerError(
                f"producer group {self.group!r} has no TransactionListener; "
                "pass listener= to send messages in a transaction"
            )
        return self.listener

    # --- back-checks --------------------------------------------------------------

    def answer_checks(self) -> int:
        """One pass over this group's open check requests; returns how many were answered."""
        forks.check("TransactionProducer.answer_checks")
        self._check_open()
        self.broker._check_open()  # before the listener answers: no answer without its OP
        self._require_listener()  # the answerer calls self._check_state, which uses it
        with self._checks_lock:
            return self._checks.poll()

    def start_checker(self, poll_s: float = 1.0) -> None:
        """Answer checks from a background thread every `poll_s` seconds until close()."""
        if (
            not isinstance(poll_s, (int, float))
            or isinstance(poll_s, bool)
            or not 0 < poll_s < float("inf")
        ):
            raise ConfigError(
                f"poll_s must be a positive, finite number of seconds, got {poll_s!r}"
            )
        self._check_open()
        self._require_listener()
        if self._checker is not None:
            return
        self._stop.clear()
        self._checker = threading.Thread(
            target=self._check_loop, args=(poll_s,), name=f"check-{self.group}", daemon=True
        )
        self._checker.start()

    def _check_loop(self, poll_s: float) -> None:
        while not self._stop.is_set():
            try:
                self.answer_checks()
            # BaseException: a thread ended by one stops answering, silently
            except BaseException:
                log.exception("answering checks for group %s failed", self.group)
            self._stop.wait(poll_s)

    def _check_state(self, msg: Message) -> LocalTransactionState:
        return self._require_listener().check_local_transaction(msg)

    def close(self) -> None:
        self._stop.set()
        if self._checker is not None:
            self._checker.join()
            self._checker = None
        super().close()  # after the checker: its last pass is not refused


def _valid_listener(listener: object) -> TransactionListener:
    """`listener`, refused (ConfigError) unless it can run a local transaction
    and answer a check: else every send would store a half message whose
    local transaction never runs."""
    if isinstance(listener, type):
        raise ConfigError(
            f"listener must be an instance of a TransactionListener, not the class "
            f"{listener.__name__} itself: pass {listener.__name__}()"
        )
    for name in ("execute_local_transaction", "check_local_transaction"):
        method = getattr(listener, name, None)
        if not callable(method):
            raise ConfigError(
                f"listener {type(listener).__name__} has no {name} method; a "
                "TransactionListener implements execute_local_transaction(msg, arg) and "
                "check_local_transaction(msg)"
            )
        if inspect.iscoroutinefunction(method):
            raise ConfigError(
                f"listener {type(listener).__name__}.{name} is a coroutine function; it must "
                "return a LocalTransactionState (run your async code to completion in it)"
            )
    return listener  # type: ignore[return-value]


def _execute(
    listener: TransactionListener, msg: Message | Sequence[Message], arg: Any
) -> tuple[LocalTransactionState, BaseException | None]:
    try:
        state = listener.execute_local_transaction(msg, arg)
    except Exception as exc:  # noqa: BLE001 - RocketMQ: an exception means UNKNOW
        log.warning("execute_local_transaction raised %r; state UNKNOWN", exc)
        return LocalTransactionState.UNKNOWN, exc
    if state is None:
        return LocalTransactionState.UNKNOWN, None
    try:
        return LocalTransactionState(state), None
    except ValueError:
        return LocalTransactionState.UNKNOWN, TypeError(
            f"execute_local_transaction returned {state!r}, not a LocalTransactionState"
        )
