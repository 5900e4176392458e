"""Table definitions in an engine-neutral form.

Types are Spark SQL type names (the narrowest common vocabulary of both engines):
`bigint`, `int`, `string`, `binary`, `boolean`, `map<string,string>`,
`map<string,bigint>`, `array<int>`. `nullable=False` becomes a Delta NOT NULL column, so
both writers refuse rows missing a key field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    nullable: bool = True


@dataclass(frozen=True)
class TableSchema:
    """A Delta table: its path under the warehouse and its columns."""

    path: str
    columns: tuple[Column, ...]
    #: the engine that writes the table (docs/protocol.md §2, "one writer engine per table")
    writer: str = "job"

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"{self.path} has no column {name!r}")


#: columns whose values are (nearly) all distinct wherever they appear: ids,
#: offsets, message keys and bodies. A parquet dictionary of them never pays
#: off, so the job's writer builds none (`jobs.commits`).
DISTINCT_COLUMNS = frozenset(
    {
        "half_offset",
        "op_offset",
        "queue_offset",
        "transaction_id",
        "msg_id",
        "request_id",
        "keys",
        "body",
    }
)


def _cols(*specs: tuple[str, str] | tuple[str, str, bool]) -> tuple[Column, ...]:
    return tuple(Column(*s) for s in specs)


# The half row's columns, shared by every table that carries a whole message.
_MESSAGE = (
    ("transaction_id", "string", False),
    ("msg_id", "string", False),
    ("producer_group", "string", False),
    ("topic", "string", False),
    ("queue_id", "int", False),
    ("tags", "string"),
    ("keys", "string"),
    ("body", "binary", False),
    ("properties", "map<string,string>"),
    ("born_ms", "bigint", False),
)
#: a message's columns, as every table that carries one names them
MESSAGE_COLUMNS = tuple(c[0] for c in _MESSAGE)

# A stored message: the half row as the job's tables keep it (pending, discard).
_STORED = _cols(
    ("half_offset", "bigint", False),
    *_MESSAGE,
    ("store_ms", "bigint", False),
    ("check_immunity_s", "int"),
)
#: the columns of a stored message every table that keeps one whole has
#: (`_sys/half`, `_sys/pending`, `_sys/discard`)
STORED_MESSAGE_COLUMNS = tuple(c.name for c in _STORED)

# Columns added to `_sys/half` since its first release: nullable, at the end,
# and added to an existing table when a broker opens it
# (`txn_core.tables.add_missing_columns`); rows written before read as null.
HALF = TableSchema(
    "_sys/half",
    _STORED
    + _cols(
        # NORMAL (a plain message: committed by its store) or TRANSACTION;
        # null: TRANSACTION (txn_core.vocabulary.MessageType)
        ("message_type", "string"),
        # when a delayed message is due (epoch ms, the broker core's clock, as
        # store_ms): store_ms + its delay, or its deliver_at_ms; null: at once
        ("deliver_at_ms", "bigint"),
    ),
    writer="broker",
)

OP = TableSchema(
    "_sys/op",
    _cols(
        ("op_offset", "bigint", False),
        ("half_offset", "bigint", False),
        ("transaction_id", "string", False),
        ("producer_group", "string", False),
        ("action", "string", False),  # COMMIT | ROLLBACK
        ("source", "string", False),  # PRODUCER | CHECK | ADMIN
        ("store_ms", "bigint", False),
        ("remark", "string"),
    ),
    writer="broker",
)

CHECK_REQUESTS = TableSchema(
    "_sys/check_requests",
    _cols(
        ("request_id", "string", False),
        ("run_id", "string", False),
        ("half_offset", "bigint", False),
        *[c for c in _MESSAGE if c[0] != "born_ms"],
        ("born_ms", "bigint", False),
        ("check_times", "int", False),
        ("requested_ms", "bigint", False),
    ),
)

CHECK_ANSWERS = TableSchema(
    "_sys/check_answers",
    _cols(
        ("request_id", "string", False),
        ("half_offset", "bigint", False),
        ("transaction_id", "string", False),
        ("producer_group", "string", False),
        ("answer", "string", False),  # COMMIT | ROLLBACK | UNKNOWN | ERROR
        ("answered_ms", "bigint", False),
        ("error", "string"),
    ),
    writer="broker",
)

DISCARD = TableSchema(
    "_sys/discard",
    _STORED
    + _cols(
        ("check_times", "int", False),
        ("reason", "string", False),  # MAX_CHECKS | EXPIRED
        ("discarded_ms", "bigint", False),
        ("run_id", "string", False),
    ),
)

TOPIC = TableSchema(
    "topics/<topic>",
    _cols(
        ("queue_id", "int", False),
        ("queue_offset", "bigint", False),
        ("msg_id", "string", False),
        ("transaction_id", "string", False),
        ("half_offset", "bigint", False),
        ("producer_group", "string", False),
        ("tags", "string"),
        ("keys", "string"),
        ("body", "binary", False),
        ("properties", "map<string,string>"),
        ("born_ms", "bigint", False),
        ("commit_ms", "bigint", False),
        ("delivered_ms", "bigint", False),
        ("run_id", "string", False),
    ),
)

# One row per Broker.open: the version of that commit is the broker's offset
# epoch (I1: txn_core/offsets.py).
PRODUCERS = TableSchema(
    "_sys/producers",
    _cols(
        ("broker_id", "string", False),
        ("host", "string", False),
        ("pid", "int", False),
        ("opened_ms", "bigint", False),
    ),
    writer="broker",
)

# --- the job's private state -------------------------------------------------

# Counters of one run (docs/protocol.md §4.5), kept as columns of `_sys/runs` so they can be
# queried with SQL; `summary_json` holds the same summary verbatim.
RUN_COUNTERS = (
    "half_read",
    "op_read",
    "pending_before",
    "pending_after",
    "committed",
    "rolled_back",
    "check_requests",
    "discarded_max_checks",
    "discarded_expired",
    "duplicate_ops",
    "conflicting_ops",
    "invalid_ops",
    "late_ops",
    "rejected_halves",
    "oldest_pending_age_ms",
    "duration_ms",
    "next_due_ms",
)

# Two rows per run: STARTED (the intent: everything needed to redo the run
# identically) and COMMITTED (the same plus the summary). A run is complete
# when its COMMITTED row exists.
RUNS = TableSchema(
    "_sys/runs",
    _cols(
        ("run_id", "string", False),
        ("run_number", "bigint", False),
        ("status", "string", False),  # STARTED | COMMITTED
        ("now_ms", "bigint", False),
        ("started_ms", "bigint", False),
        ("ended_ms", "bigint"),
        ("half_version", "bigint", False),
        ("op_version", "bigint", False),
        ("answers_version", "bigint", False),
        ("prev_half_version", "bigint", False),
        ("prev_op_version", "bigint", False),
        ("prev_answers_version", "bigint", False),
        # versions of the job's own state tables the run reads (time travel on redo)
        ("state_versions", "map<string,bigint>", False),
        # the rule settings the run used, so a redo applies the same ones
        ("rules_json", "string", False),
        *[(name, "bigint") for name in RUN_COUNTERS],
        ("delivered_by_topic", "map<string,bigint>"),
        ("summary_json", "string"),
    ),
)

# Columns added to a job table after its first release are nullable and
# last, and added to an existing table by the job (`jobs.job_tables`).
PENDING = TableSchema(
    "_sys/pending",
    _STORED
    + _cols(
        ("checks_sent", "int", False),
        ("checks_undecided", "int", False),  # answers UNKNOWN / ERROR
        ("last_check_ms", "bigint"),
        ("run_number", "bigint", False),
        # a delayed transactional message's due time, as `_sys/half` has it
        ("deliver_at_ms", "bigint"),
    ),
)

RESOLVED = TableSchema(
    "_sys/resolved",
    _cols(
        ("half_offset", "bigint", False),
        ("transaction_id", "string", False),
        ("producer_group", "string", False),
        ("topic", "string", False),
        ("action", "string", False),
        ("source", "string", False),
        ("op_offset", "bigint", False),
        ("op_version", "bigint", False),
        ("op_store_ms", "bigint", False),
        ("after_discard", "boolean", False),
        ("run_id", "string", False),
    ),
)

# Committed messages not due yet (docs/protocol.md §4, "Delayed messages"):
# appended by the run that reads the commit, each run's rows sorted by
# due_ms into files of narrow ranges, so a run reading what falls due in
# (its previous watermark, its own] skips every other file by its statistics
# (due_ms first: the only column with statistics). Every 100th run deletes
# the rows due at or before its watermark (`jobs.scheduled.upkeep`).
SCHEDULED = TableSchema(
    "_sys/scheduled",
    _cols(
        ("due_ms", "bigint", False),
        ("commit_ms", "bigint", False),
        # the version of the table that committed it (`_sys/half` for a plain message)
        ("commit_version", "bigint", False),
    )
    + _STORED
    + _cols(
        ("run_number", "bigint", False),
        # a transactional message's winning OP source (its `_sys/resolved`
        # row is written when the COMMIT wins); null: a plain message, whose
        # resolved row the delivering run writes
        ("source", "string"),
    ),
)

# Cancels of delayed messages (docs/protocol.md §4, "Cancelling a delayed
# message"): one row per message whose cancel a run applied, appended by
# that run. Small (operators' actions); looked up by half_offset, and by
# due_ms for the runs whose window holds it (statistics on both).
CANCELLED = TableSchema(
    "_sys/cancelled",
    _cols(
        ("half_offset", "bigint", False),
        ("due_ms", "bigint", False),
        ("transaction_id", "string", False),
        ("producer_group", "string", False),
        ("topic", "string", False),
        ("queue_id", "int", False),
        ("op_offset", "bigint", False),
        ("op_version", "bigint", False),
        ("op_store_ms", "bigint", False),
        ("remark", "string"),
        ("run_id", "string", False),
        ("run_number", "bigint", False),
    ),
)

QUEUES = TableSchema(
    "_sys/queues",
    _cols(
        ("topic", "string", False),
        ("queue_id", "int", False),
        ("next_queue_offset", "bigint", False),
        ("run_number", "bigint", False),
    ),
)

REJECTED = TableSchema(
    "_sys/rejected",
    _cols(
        ("source_table", "string", False),
        ("row_offset", "bigint"),
        ("transaction_id", "string"),
        ("producer_group", "string"),
        ("reason", "string", False),
        ("run_id", "string", False),
    ),
)

# Written through delta-rs with put-if-absent commits (one run at a time).
LEASE = TableSchema(
    "_sys/lease",
    _cols(
        ("holder", "string", False),
        ("host", "string", False),
        ("pid", "int", False),
        ("action", "string", False),  # ACQUIRE | RENEW | RELEASE
        ("wall_ms", "bigint", False),
        ("expires_ms", "bigint", False),
    ),
    writer="broker",
)

# --- consumer groups (txn_core.consumer_group), written through delta-rs ------

# Appended by every commit of a consumer group; per (group, topic, queue_id)
# the row with the highest committed_ms wins, ties going to the highest
# next_offset (docs/protocol.md §3.2, "Consumer groups").
CONSUMER_OFFSETS = TableSchema(
    "_sys/consumer_offsets",
    _cols(
        ("group", "string", False),
        ("topic", "string", False),
        ("queue_id", "int", False),
        ("next_offset", "bigint", False),
        ("member", "string", False),
        ("committed_ms", "bigint", False),
    ),
    writer="broker",  # the broker core's delta-rs, in the consumer's process
)

# Appended by every member of a consumer group: when it joins, at each
# heartbeat (at most every heartbeat_interval_s), and with leaving=true when it
# closes. Each member's newest row is its state: alive while not leaving and
# newer than the group's member_timeout_s; `queues` are the queue ids it holds
# (docs/protocol.md §3.2, "Several members").
CONSUMER_MEMBERS = TableSchema(
    "_sys/consumer_members",
    _cols(
        ("group", "string", False),
        ("topic", "string", False),
        ("member", "string", False),
        ("heartbeat_ms", "bigint", False),
        ("leaving", "boolean", False),
        ("queues", "array<int>", False),
    ),
    writer="broker",  # the broker core's delta-rs, in the consumer's process
)

# One table per consumer group (`dlq_path`): the messages its listener gave up
# on, each as delivered (its topic and TOPIC columns) and why.
DLQ = TableSchema(
    "_sys/dlq/<group>",
    _cols(("topic", "string", False))
    + TOPIC.columns
    + _cols(
        ("group", "string", False),
        ("reconsume_times", "int", False),
        ("reason", "string", False),
        ("dead_ms", "bigint", False),
    ),
    writer="broker",  # the broker core's delta-rs, in the consumer's process
)

ALL_TABLES = (
    HALF,
    OP,
    CHECK_REQUESTS,
    CHECK_ANSWERS,
    DISCARD,
    TOPIC,
    PRODUCERS,
    RUNS,
    PENDING,
    RESOLVED,
    SCHEDULED,
    CANCELLED,
    QUEUES,
    REJECTED,
    LEASE,
    CONSUMER_OFFSETS,
    CONSUMER_MEMBERS,
    DLQ,
)


def table_path(warehouse: str, table: TableSchema) -> str:
    """The table's location: `<warehouse>/<path>`, for local paths and URIs alike."""
    return warehouse.rstrip("/") + "/" + table.path


#: characters of a topic's name written otherwise in its table's directory
#: name: delta-rs cannot open a path holding `|` or a `%` escape such as
#: `%41` (it panics, or decodes it and looks elsewhere); `~`, never in a
#: topic's name, marks each, so every topic keeps a directory of its own.
#: Two characters each, so that the longest name (127) fits a file name's
#: 255 bytes.
TOPIC_DIRECTORY_ESCAPES = (("%", "~p"), ("|", "~b"))


def topic_path(warehouse: str, topic: str) -> str:
    """The table of `topic`: `<warehouse>/topics/<topic>`, each `%` of the
    name written `~p` and each `|` written `~b` (`topic_directory`).

    >>> topic_path("/wh", "ORDER")
    '/wh/topics/ORDER'
    >>> topic_path("/wh", "pay|eu")
    '/wh/topics/pay~beu'
    """
    return warehouse.rstrip("/") + "/topics/" + topic_directory(topic)


def topic_directory(topic: str) -> str:
    """The name of `topic`'s directory under `topics/` (`topic_path`)."""
    for character, escape in TOPIC_DIRECTORY_ESCAPES:
        topic = topic.replace(character, escape)
    return topic


def topic_of_directory(name: str) -> str:
    """The topic whose table is the directory `name` under `topics/`: the
    inverse of `topic_directory`.

    >>> topic_of_directory("rate~p")
    'rate%'
    """
    for character, escape in reversed(TOPIC_DIRECTORY_ESCAPES):
        name = name.replace(escape, character)
    return name


def dlq_path(warehouse: str, group: str) -> str:
    """The dead-letter table of consumer group `group`: `<warehouse>/_sys/dlq/<group>`."""
    return warehouse.rstrip("/") + "/_sys/dlq/" + group
