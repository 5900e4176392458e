"""The broker core: RocketMQ-style transactional producers on Delta Lake tables.

Producers append half and OP rows through delta-rs (no JVM); the reconciliation
job (`jobs/`) does the rest; consumer groups read the topics (`Consumer`,
`PushConsumer`). See docs/protocol.md §3.

>>> from txn_core import Broker, Message, TransactionProducer, load_config
"""

from txn_core.broker import Broker
from txn_core.config import Config, ConfigError, load_config
from txn_core.consumer_group import (
    ConsumedMessage,
    Consumer,
    ConsumerClosedError,
    CorruptOffsetError,
    PushConsumer,
)
from txn_core.errors import (
    BrokerClosedError,
    MessageValidationError,
    NoListenerError,
    PersistError,
    TxnError,
)
from txn_core.message import BatchSendResult, LocalTransactionState, Message, SendResult
from txn_core.producer import TransactionListener, TransactionProducer
from txn_core.vocabulary import ConsumeResult

__all__ = [
    "BatchSendResult",
    "Broker",
    "BrokerClosedError",
    "Config",
    "ConfigError",
    "ConsumeResult",
    "ConsumedMessage",
    "Consumer",
    "ConsumerClosedError",
    "CorruptOffsetError",
    "LocalTransactionState",
    "Message",
    "MessageValidationError",
    "NoListenerError",
    "PersistError",
    "PushConsumer",
    "SendResult",
    "TransactionListener",
    "TransactionProducer",
    "TxnError",
    "load_config",
]
