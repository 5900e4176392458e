"""Forked worker processes (gunicorn --preload, Celery's prefork pool,
multiprocessing's default on Linux): a broker inherited from the parent
waited forever in the child, and a new open panicked in delta-rs. Now both
refuse with ForkedProcessError, and a child forked before any use works.

Each case forks a process started for the test, whose parent has used
delta-rs exactly when the case says (this test process has long since)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from deltalake import DeltaTable

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from txn_core import Broker, Consumer, Message, Producer
    from txn_core.consumer import read_topic

    warehouse = sys.argv[1]

    def in_child(work):
        readable, writable = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(readable)
            try:
                out = str(work())
            except BaseException as exc:
                out = f"{type(exc).__name__}: {exc}"
            os.write(writable, out.encode())
            os._exit(0)
        os.close(writable)
        with os.fdopen(readable) as pipe:
            out = pipe.read()
        os.waitpid(pid, 0)
        return out

    def open_and_send(body):
        with Broker.open(warehouse) as broker:
            return Producer(broker, "g").send(Message(topic="T", body=body)).send_status

    seen = {"fresh child": in_child(lambda: open_and_send(b"fresh child"))}
    broker = Broker.open(warehouse)
    producer = Producer(broker, "g")
    producer.send(Message(topic="T", body=b"parent"))
    seen["inherited broker"] = in_child(
        lambda: producer.send(Message(topic="T", body=b"inherited")).send_status
    )
    seen["closed in child"] = in_child(lambda: broker.close() or "closed")
    seen["new broker"] = in_child(lambda: open_and_send(b"new broker"))
    seen["consumer"] = in_child(lambda: Consumer(warehouse, "billing", "T").poll(10))
    seen["read_topic"] = in_child(lambda: read_topic(warehouse, "T"))
    seen["parent after"] = producer.send(Message(topic="T", body=b"parent after")).send_status
    broker.close()
    print(json.dumps(seen))
    sys.stdout.flush()
    os._exit(0)  # the interpreter's teardown can abort in pyarrow's threads
    """
)


def test_a_child_forked_after_the_broker_core_ran_refuses_and_one_forked_before_works(tmp_path):
    warehouse = str(tmp_path / "wh")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, warehouse],
        capture_output=True,
        text=True,
        timeout=120,  # a child that waits for its parent's writer thread never ends
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    assert seen.pop("fresh child") == "SEND_OK"
    assert seen.pop("closed in child") == "closed"  # and the parent's writer still runs
    assert seen.pop("parent after") == "SEND_OK"
    for case, what in [
        ("inherited broker", "this Broker"),
        ("new broker", "Broker.open"),
        ("consumer", "Consumer"),
        ("read_topic", "read_topic"),
    ]:
        refusal = seen.pop(case)
        assert refusal.startswith(f"ForkedProcessError: {what} cannot run in process"), refusal
        assert "forked from process" in refusal and "'spawn'" in refusal
    assert seen == {}

    half = DeltaTable(str(tmp_path / "wh" / "_sys" / "half")).to_pyarrow_table(columns=["body"])
    assert sorted(half["body"].to_pylist()) == [b"fresh child", b"parent", b"parent after"]
