"""Errors raised by the broker core. Each names what is wrong."""

from __future__ import annotations


class TxnError(Exception):
    """Base class of the broker core's errors."""


class MessageValidationError(TxnError, ValueError):
    """A message, topic, group or property is invalid; nothing was written.

    `field` names the offending field, e.g. "topic" or "properties['k']".
    """

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class NoListenerError(TxnError):
    """A producer without a TransactionListener cannot send in a transaction,
    nor a push consumer without a listener consume."""


class PersistError(TxnError):
    """A write to the warehouse failed (the message was not stored)."""


class BrokerClosedError(TxnError):
    """The broker (or producer) was closed."""


class ForkedProcessError(TxnError, RuntimeError):
    """The broker core was used in a process forked from one that had
    already used it (`txn_core.forks`): delta-rs cannot run there."""
