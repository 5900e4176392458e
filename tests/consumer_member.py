"""A consumer-group member process for tests/core/test_consumer_processes.py:
a pull `Consumer` that polls, "processes" (logs) and commits until told to
stop, logging every call to its own file.

    python tests/consumer_member.py '{"warehouse": …, "member": "m0", "log": …, "stop": …}'

Settings (JSON): warehouse, group, topic, member (null: the default
host:pid:random id), heartbeat_interval_s, member_timeout_s, batch (poll
size), log (the file it appends to), stop (a path: once it exists, the
member closes after its next commit or empty poll and exits 0), and
optionally, counted in messages polled so far:
- hang_after: once it has polled that many, it logs "hang" right after a
  poll and blocks there, before committing, for the test to SIGKILL it
  mid-batch;
- pause_after: once it has polled that many, it logs "pause" right after a
  poll and stops itself (SIGSTOP) before committing; after the test's
  SIGCONT it logs "resume" and goes on (commits that batch, and so on).

Each log line is one JSON object, written with a single os.write on an
O_APPEND descriptor (nothing is buffered in the process: a SIGKILL loses no
line that was written); `t0`/`t1` are time.time() before and after the call:
- {"e": "poll", "t0", "t1", "held": [queues after the call], "members": […],
  "got": [[queue_id, queue_offset], …]}: "got" are the messages handed out,
  processed before the commit that follows;
- {"e": "commit", "t0", "t1", "held": […], "moved": {queue_id: next_offset}};
- {"e": "start", "t", "pid", "member", "code": the consumer_group module's file};
- {"e": "hang", "t"}; {"e": "pause", "t"}; {"e": "resume", "t"}; {"e": "close", "t0", "t1"}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from txn_core import Consumer, consumer_group

#: how long an idle member waits before it polls again (real processes, real time)
IDLE_WAIT_S = 0.05
#: a hung member blocks this long at most (the test kills it long before)
HANG_S = 120.0


def main() -> int:
    settings = json.loads(sys.argv[1])
    fd = os.open(settings["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(**record: Any) -> None:
        os.write(fd, (json.dumps(record) + "\n").encode())

    consumer = Consumer(
        settings["warehouse"],
        settings["group"],
        settings["topic"],
        member=settings.get("member"),
        heartbeat_interval_s=settings["heartbeat_interval_s"],
        member_timeout_s=settings["member_timeout_s"],
    )
    log(
        e="start",
        t=time.time(),
        pid=os.getpid(),
        member=consumer.member,
        code=consumer_group.__file__,
    )
    hang_after = settings.get("hang_after")
    pause_after = settings.get("pause_after")
    polled = 0
    while True:
        t0 = time.time()
        batch = consumer.poll(settings["batch"])
        t1 = time.time()
        got = [[m.queue_id, m.queue_offset] for m in batch]
        log(e="poll", t0=t0, t1=t1, held=consumer.assignment(), members=consumer.members(), got=got)
        polled += len(batch)
        if batch and hang_after is not None and polled >= hang_after:
            log(e="hang", t=time.time())
            threading.Event().wait(HANG_S)  # killed here, the batch not committed
            return 3
        if batch and pause_after is not None and polled >= pause_after:
            pause_after = None  # once
            log(e="pause", t=time.time())
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped here until SIGCONT
            log(e="resume", t=time.time())
        if batch:
            t0 = time.time()
            moved = consumer.commit()
            t1 = time.time()
            log(e="commit", t0=t0, t1=t1, held=consumer.assignment(), moved=moved)
        if os.path.exists(settings["stop"]):
            t0 = time.time()
            consumer.close()
            log(e="close", t0=t0, t1=time.time())
            return 0
        if not batch:
            time.sleep(IDLE_WAIT_S)


if __name__ == "__main__":
    code = main()
    # Everything is committed and logged by now; the interpreter's teardown can
    # abort in pyarrow's threads (docs/operating.md, "A process's exit code").
    os._exit(code)
