"""Producers answer back-checks: own group only, once per request, across restarts."""

import multiprocessing
import threading

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from schemas import CHECK_REQUESTS
from schemas.arrow import arrow_schema
from txn_core import (
    Broker,
    BrokerClosedError,
    ConfigError,
    LocalTransactionState,
    Message,
    TransactionListener,
    TransactionProducer,
)
from txn_core.tables import open_or_create

from factories import Panic, panicking_once

COMMIT = LocalTransactionState.COMMIT_MESSAGE
ROLLBACK = LocalTransactionState.ROLLBACK_MESSAGE
UNKNOWN = LocalTransactionState.UNKNOWN


class Answers(TransactionListener):
    """Leaves every send UNKNOWN; answers checks from a dict keyed by message key."""

    def __init__(self, by_key=None):
        self.by_key = by_key or {}
        self.checked = []

    def execute_local_transaction(self, msg, arg):
        return UNKNOWN

    def check_local_transaction(self, msg):
        self.checked.append(msg)
        answer = self.by_key.get(msg.keys, UNKNOWN)
        if isinstance(answer, BaseException):
            raise answer
        return answer


def request_rows(warehouse, sends, group, run_id="run-1", check_times=1):
    """What the job writes for each (result, message) pair; returns the request ids."""
    table = open_or_create(warehouse, CHECK_REQUESTS)
    rows = []
    for result, msg in sends:
        rows.append(
            {
                "request_id": f"{run_id}-{result.half_offset}",
                "run_id": run_id,
                "half_offset": result.half_offset,
                "transaction_id": result.transaction_id,
                "msg_id": result.msg_id,
                "producer_group": group,
                "topic": msg.topic,
                "queue_id": msg.queue_id,
                "tags": msg.tags,
                "keys": msg.keys,
                "body": msg.body,
                "properties": list((msg.properties or {}).items()),
                "born_ms": 1,
                "check_times": check_times,
                "requested_ms": 2,
            }
        )
    write_deltalake(
        table, pa.Table.from_pylist(rows, schema=arrow_schema(CHECK_REQUESTS)), mode="append"
    )
    return [r["request_id"] for r in rows]


def table_rows(warehouse, path):
    return DeltaTable(f"{warehouse}/{path}").to_pyarrow_table().to_pylist()


def send_unknown(producer, keys):
    out = []
    for key in keys:
        msg = Message(
            topic="ORDER", body=f"body-{key}".encode(), keys=key, tags="t", properties={"p": key}
        )
        out.append((producer.send_message_in_transaction(msg), msg))
    return out


def test_no_requests_table_yet_means_nothing_to_answer(warehouse):
    with Broker.open(warehouse) as broker:
        assert TransactionProducer(broker, "g", Answers()).answer_checks() == 0


def test_answers_own_group_with_original_message_and_records_every_answer(warehouse):
    listener = Answers({"c": COMMIT, "r": ROLLBACK, "u": UNKNOWN, "e": RuntimeError("db")})
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", listener)
        sends = send_unknown(producer, ["c", "r", "u", "e"])
        request_rows(warehouse, sends, "g")
        request_rows(warehouse, send_unknown(producer, ["x"]), "other_group")
        assert producer.answer_checks() == 4
        assert producer.answer_checks() == 0  # nothing new: nothing answered twice

    seen = {m.keys: m for m in listener.checked}
    assert set(seen) == {"c", "r", "u", "e"}  # never the other group's request
    original = sends[0][0]
    assert (
        seen["c"].transaction_id,
        seen["c"].body,
        seen["c"].tags,
        seen["c"].topic,
        dict(seen["c"].properties),
    ) == (original.transaction_id, b"body-c", "t", "ORDER", {"p": "c"})
    answers = {a["transaction_id"]: a for a in table_rows(warehouse, "_sys/check_answers")}
    by_key = {msg.keys: answers[res.transaction_id] for res, msg in sends}
    assert {k: a["answer"] for k, a in by_key.items()} == {
        "c": "COMMIT",
        "r": "ROLLBACK",
        "u": "UNKNOWN",
        "e": "ERROR",
    }
    assert "RuntimeError: db" in by_key["e"]["error"]
    ops = table_rows(warehouse, "_sys/op")
    assert sorted((o["action"], o["source"]) for o in ops) == [
        ("COMMIT", "CHECK"),
        ("ROLLBACK", "CHECK"),
    ]


def test_new_requests_after_the_first_poll_are_read_incrementally(warehouse):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Answers({"a": COMMIT, "b": COMMIT}))
        request_rows(warehouse, send_unknown(producer, ["a"]), "g")
        assert producer.answer_checks() == 1
        request_rows(warehouse, send_unknown(producer, ["b"]), "g", run_id="run-2")
        assert producer.answer_checks() == 1
    assert len(table_rows(warehouse, "_sys/op")) == 2


def test_a_restarted_producer_does_not_answer_again(warehouse):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Answers({"a": COMMIT}))
        request_rows(warehouse, send_unknown(producer, ["a", "b"]), "g")
        assert producer.answer_checks() == 2
    with Broker.open(warehouse) as broker:  # a new process: no cursor, falls back
        assert TransactionProducer(broker, "g", Answers({"a": COMMIT})).answer_checks() == 0
    assert len(table_rows(warehouse, "_sys/check_answers")) == 2
    assert len(table_rows(warehouse, "_sys/op")) == 1


def _answer_in_process(warehouse, start, out):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Answers({f"k{i}": COMMIT for i in range(20)}))
        start.wait()
        out.put(producer.answer_checks())


def test_two_processes_of_one_group_answer_each_request_once(warehouse):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Answers())
        ids = request_rows(warehouse, send_unknown(producer, [f"k{i}" for i in range(20)]), "g")
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_answer_in_process, args=(warehouse, start, out)) for _ in range(2)]
    [p.start() for p in procs]
    counts = [out.get(timeout=120) for _ in procs]
    [p.join(timeout=60) for p in procs]
    assert sum(counts) == 20
    answers = table_rows(warehouse, "_sys/check_answers")
    assert sorted(a["request_id"] for a in answers) == sorted(ids)
    ops = table_rows(warehouse, "_sys/op")
    assert len(ops) == 20 and len({o["half_offset"] for o in ops}) == 20


@pytest.mark.parametrize("raised", [SystemExit("sys.exit in a library"), Panic("unwrap on None")])
def test_a_check_that_raises_what_is_no_exception_is_an_error_answer(warehouse, raised):
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Answers({"e": raised, "c": COMMIT}))
        request_rows(warehouse, send_unknown(producer, ["e", "c"]), "g")
        assert producer.answer_checks() == 2
    answers = {a["answer"]: a for a in table_rows(warehouse, "_sys/check_answers")}
    assert set(answers) == {"ERROR", "COMMIT"}
    assert answers["ERROR"]["error"] == f"{type(raised).__name__}: {raised}"


def test_the_background_checker_outlives_a_round_that_panics(warehouse):
    """Its thread ended at anything but an Exception, silently: the group's
    messages then went unanswered until the job discarded them."""
    again = threading.Event()
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Answers())
        producer.answer_checks = panicking_once(producer.answer_checks, again)
        producer.start_checker(poll_s=0.01)
        try:
            assert again.wait(timeout=30)
        finally:
            producer.close()


def test_start_checker_answers_in_the_background(warehouse):
    answered = threading.Event()

    class Signalling(Answers):
        def check_local_transaction(self, msg):
            answered.set()
            return COMMIT

    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Signalling())
        request_rows(warehouse, send_unknown(producer, ["a"]), "g")
        producer.start_checker(poll_s=0.05)
        assert answered.wait(timeout=30)
        producer.close()
        assert not producer._checker  # the thread was joined
    [op] = table_rows(warehouse, "_sys/op")
    assert op["source"] == "CHECK"


@pytest.mark.parametrize("poll_s", [None, "1", 0, -1.0, float("inf"), float("nan"), True])
def test_a_bad_checker_interval_is_refused_before_a_thread_starts(warehouse, poll_s):
    """The thread answered one pass, then died or waited for ever, and a
    later start_checker did nothing: checks went unanswered until discard."""
    with Broker.open(warehouse) as broker:
        producer = TransactionProducer(broker, "g", Answers())
        with pytest.raises(ConfigError, match=r"poll_s must be a positive, finite number"):
            producer.start_checker(poll_s=poll_s)
        assert producer._checker is None  # no thread was started
        producer.close()


def test_a_closed_broker_is_refused_before_the_listener_answers(warehouse):
    listener = Answers({"a": COMMIT})
    broker = Broker.open(warehouse)
    producer = TransactionProducer(broker, "g", listener)
    request_rows(warehouse, send_unknown(producer, ["a"]), "g")
    broker.close()
    with pytest.raises(BrokerClosedError):
        producer.answer_checks()
    assert listener.checked == []  # an answer recorded without its OP waited for the next check
    assert not DeltaTable.is_deltatable(f"{warehouse}/_sys/check_answers") or (
        table_rows(warehouse, "_sys/check_answers") == []
    )
