"""Answering back-checks: the producer side of `_sys/check_requests`.

A poll reads only the requests added since the last table version it read
(change data feed); the first poll of a process — or one whose version was
cleaned from the log — falls back to "my group's requests minus those already
answered". Answers are recorded with a MERGE that inserts a request's answer
only if none exists: delta-rs fails a merge whose read set a concurrent
commit changed, so when two processes of one group answer the same request,
exactly one answer row (and so one OP) survives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError

from schemas import CHECK_ANSWERS, CHECK_REQUESTS, TableSchema
from schemas.arrow import arrow_schema
from txn_core.message import LocalTransactionState, Message
from txn_core.tables import open_existing
from txn_core.vocabulary import Source

if TYPE_CHECKING:
    from txn_core.broker import Broker

log = logging.getLogger(__name__)

#: what a producer reads of a request: all of it but the job's bookkeeping
_REQUEST_COLUMNS = [n for n in CHECK_REQUESTS.names if n not in ("run_id", "requested_ms")]


class CheckAnswerer:
    """One producer group's reader of check requests (one per TransactionProducer)."""

    def __init__(
        self, broker: Broker, group: str, check: Callable[[Message], LocalTransactionState]
    ):
        self._broker = broker
        self._group = group
        self._check = check
        self._requests: DeltaTable | None = None
        self._cursor: int | None = None  # last check_requests version fully handled

    def poll(self) -> int:
        """Answer every open request of this group; return how many were answered here."""
        requests = self._open_requests()
        if requests is None:
            return 0
        requests.update_incremental()
        version = requests.version()
        if self._cursor is not None and version <= self._cursor:
            return 0
        todo = self._read_new(requests, version)
        answered = self._answer(todo) if todo.num_rows else 0
        self._cursor = version
        return answered

    # --- reading ------------------------------------------------------------------

    def _open_requests(self) -> DeltaTable | None:
        if self._requests is None:
            self._requests = open_existing(
                self._broker.warehouse, CHECK_REQUESTS, self._broker.storage_options
            )
        return self._requests

    def _read_new(self, requests: DeltaTable, version: int) -> pa.Table:
        mine = pc.field("producer_group") == self._group
        if self._cursor is not None:
            try:
                changes = pa.table(
                    requests.load_cdf(
                        starting_version=self._cursor + 1,
                        ending_version=version,
                        columns=_REQUEST_COLUMNS + ["_change_type"],
                    )
                )
            except DeltaError as exc:  # the log between the versions was cleaned up
                log.info(
                    "check request changes since version %s unavailable (%s); rescanning",
                    self._cursor,
                    exc,
                )
            else:
                changes = _normalise(changes)
                changes = changes.filter(pc.field("_change_type") == "insert")
                return changes.filter(mine).select(_REQUEST_COLUMNS)
        everything = requests.to_pyarrow_dataset().to_table(columns=_REQUEST_COLUMNS, filter=mine)
        answered = self._answered_ids()
        if answered:
            everything = everything.filter(
                pc.invert(pc.is_in(everything["request_id"], pa.array(list(answered))))
            )
        return _normalise(everything)

    def _answered_ids(self) -> set[str]:
        answers = self._broker.table(CHECK_ANSWERS.path)
        answers.update_incremental()
        got = answers.to_pyarrow_dataset().to_table(
            columns=["request_id"], filter=pc.field("producer_group") == self._group
        )
        return set(got["request_id"].to_pylist())

    # --- answering ----------------------------------------------------------------

    def _answer(self, todo: pa.Table) -> int:
        answers, decisions = [], {}
        for req in todo.to_pylist():
            msg = Message(
                topic=req["topic"],
                body=req["body"],
                keys=req["keys"],
                tags=req["tags"],
                properties=dict(req["properties"] or []),
                queue_id=req["queue_id"],
                transaction_id=req["transaction_id"],
                msg_id=req["msg_id"],
                half_offset=req["half_offset"],
                producer_group=self._group,
            )
            state, error = _run_check(self._check, msg)
            answers.append(
                {
                    "request_id": req["request_id"],
                    "half_offset": req["half_offset"],
                    "transaction_id": req["transaction_id"],
                    "producer_group": self._group,
                    "answer": "ERROR" if error else (state.action or "UNKNOWN"),
                    "answered_ms": self._broker.clock(),
                    "error": error,
                }
            )
            if state.action:
                decisions[req["request_id"]] = (req, state.action)
        won = self._record_answers(answers)
        ops = [(req, action, rid) for rid, (req, action) in decisions.items() if rid in won]
        if ops:
            # If this fails the answer row exists but no OP: the message stays
            # pending and the job checks it again later — nothing is lost.
            self._broker.store_ops(
                [req["half_offset"] for req, _, _ in ops],
                [req["transaction_id"] for req, _, _ in ops],
                self._group,
                [action for _, action, _ in ops],
                Source.CHECK,
                [f"check {rid}" for _, _, rid in ops],
            )
        return len(won)

    def _record_answers(self, answers: list[dict[str, object]]) -> set[str]:
        """Insert answers whose request has none yet; return the request ids inserted."""
        table = self._broker.table(CHECK_ANSWERS.path)
        source = pa.Table.from_pylist(answers, schema=arrow_schema(CHECK_ANSWERS))
        group = self._group.replace("'", "''")
        for attempt in range(100):
            table.update_incremental()
            try:
                metrics = (
                    table.merge(
                        source,
                        source_alias="s",
                        target_alias="t",
                        predicate=f"t.producer_group = '{group}' AND t.request_id = s.request_id",
                    )
                    .when_not_matched_insert_all()
                    .execute()
                )
            except CommitFailedError:
                time.sleep(0.005 * (attempt + 1))  # a concurrent answer landed; redo
                continue
            if not metrics.get("num_target_rows_inserted"):
                return set()
            # Our merge is the handle's latest version; read back what it inserted.
            mine = table.version()
            inserted = pa.table(
                table.load_cdf(
                    starting_version=mine,
                    ending_version=mine,
                    columns=["request_id", "_change_type"],
                )
            )
            inserted = _normalise(inserted, CHECK_ANSWERS)
            inserted = inserted.filter(pc.field("_change_type") == "insert")
            return set(inserted["request_id"].to_pylist())
        raise RuntimeError("could not record check answers after 100 attempts")


def _run_check(
    check: Callable[[Message], LocalTransactionState], msg: Message
) -> tuple[LocalTransactionState, str | None]:
    try:
        state = check(msg)
    except KeyboardInterrupt:  # Ctrl-C in a caller's answer_checks
        raise
    # A listener's failure is an ERROR answer, whatever it raised: a
    # `sys.exit()` or a Rust library's panic (not Exceptions) ended the
    # checker thread silently, and the group's messages went unanswered
    # until the job discarded them.
    except BaseException as exc:  # noqa: BLE001
        return LocalTransactionState.UNKNOWN, f"{type(exc).__name__}: {_text(exc)}"
    if state is None:
        return LocalTransactionState.UNKNOWN, None
    try:
        return LocalTransactionState(state), None
    except ValueError:
        return LocalTransactionState.UNKNOWN, f"check_local_transaction returned {state!r}"


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot say what it is
        return f"<unprintable {type(exc).__name__}>"


def _normalise(table: pa.Table, like: TableSchema = CHECK_REQUESTS) -> pa.Table:
    """delta-rs hands back view types (string_view…) that compute kernels refuse;
    cast to the schema's plain types (CDF's `_change_type` to string)."""
    schema = arrow_schema(like)
    fields = [
        schema.field(n) if n in schema.names else pa.field(n, pa.string())
        for n in table.column_names
    ]
    return table.cast(pa.schema(fields))
