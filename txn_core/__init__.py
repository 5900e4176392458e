"""The broker core: RocketMQ-style transactional and plain producers on Delta Lake tables.

Producers append half and OP rows through delta-rs (no JVM); the reconciliation
job (`jobs/`) does the rest; consumer groups read the topics (`Consumer`,
`PushConsumer`). See docs/protocol.md §3.

>>> from txn_core import Broker, Message, Producer, TransactionProducer, load_config
"""

from txn_core.broker import Broker
from txn_core.config import Config, ConfigError, load_config
from txn_core.consumer_group import (
    ConsumedMessage,
    Consumer,
    ConsumerClosedError,
    CorruptMembershipError,
    CorruptOffsetError,
    PushConsumer,
    QueueNotAssignedError,
)
from txn_core.errors import (
    BrokerClosedError,
    ForkedProcessError,
    MessageValidationError,
    NoListenerError,
    PersistError,
    TxnError,
)
from txn_core.message import (
    BatchSendReceipt,
    BatchSendResult,
    LocalTransactionState,
    Message,
    SendReceipt,
    SendResult,
)
from txn_core.producer import Producer, TransactionListener, TransactionProducer
from txn_core.tables import MissingTableError
from txn_core.vocabulary import ConsumeResult, MessageType

__all__ = [
    "BatchSendReceipt",
    "BatchSendResult",
    "Broker",
    "BrokerClosedError",
    "Config",
    "ConfigError",
    "ConsumeResult",
    "ConsumedMessage",
    "Consumer",
    "ConsumerClosedError",
    "CorruptMembershipError",
    "CorruptOffsetError",
    "ForkedProcessError",
    "LocalTransactionState",
    "Message",
    "MessageType",
    "MessageValidationError",
    "MissingTableError",
    "NoListenerError",
    "PersistError",
    "Producer",
    "PushConsumer",
    "QueueNotAssignedError",
    "SendReceipt",
    "SendResult",
    "TransactionListener",
    "TransactionProducer",
    "TxnError",
    "load_config",
]
