"""Every table's schema, written once.

The broker core derives pyarrow schemas from these (`schemas.arrow`), the job
derives Spark StructTypes (`schemas.spark`); `tests/test_schemas.py` proves the
two agree. Column names of the public tables are fixed by docs/protocol.md §2.
"""

from schemas.tables import (
    ALL_TABLES,
    CHECK_ANSWERS,
    CHECK_REQUESTS,
    CONSUMER_MEMBERS,
    CONSUMER_OFFSETS,
    DISCARD,
    DISTINCT_COLUMNS,
    DLQ,
    HALF,
    LEASE,
    OP,
    PENDING,
    PRODUCERS,
    QUEUES,
    REJECTED,
    RESOLVED,
    RUNS,
    TOPIC,
    Column,
    TableSchema,
    dlq_path,
    table_path,
    topic_directory,
    topic_of_directory,
    topic_path,
)

__all__ = [
    "ALL_TABLES",
    "CHECK_ANSWERS",
    "CHECK_REQUESTS",
    "CONSUMER_MEMBERS",
    "CONSUMER_OFFSETS",
    "DISCARD",
    "DISTINCT_COLUMNS",
    "DLQ",
    "HALF",
    "LEASE",
    "OP",
    "PENDING",
    "PRODUCERS",
    "QUEUES",
    "REJECTED",
    "RESOLVED",
    "RUNS",
    "TOPIC",
    "Column",
    "TableSchema",
    "dlq_path",
    "table_path",
    "topic_directory",
    "topic_of_directory",
    "topic_path",
]
