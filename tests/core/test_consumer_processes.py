"""Members of one consumer group as separate OS processes
(tests/consumer_member.py, a pull Consumer each), on a local warehouse whose
topic rows the test writes directly with delta-rs: no Spark.

Each process logs every poll and commit (what it got, the queues it held
after the call, time.time() before and after) to its own file; the test
merges the logs. Between two calls a process holds exactly the queues its
last call left it with, so those gaps are times it certainly held them:
no two processes' gaps may overlap on a queue.

Real processes run on the real clock, so the membership timings are made
short through the Consumer's documented settings: heartbeat_interval_s=0.25
everywhere; member_timeout_s=2 where a member is killed or stopped (the
others wait out those 2 s), 5 where nobody dies (a hand-over seen before a
member's last heartbeat is 5 s old cannot have come from the timeout). A
member reads every membership row younger than the timeout at each
heartbeat: the default 30 s against 0.25 s heartbeats would make that
hundreds of rows, and the test slow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from schemas import CONSUMER_MEMBERS, table_path
from txn_core.consumer_group import allocate_queues, read_committed_offsets

from factories import deliver

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MEMBER_SCRIPT = REPO / "tests" / "consumer_member.py"
GROUP = "billing"
TOPIC = "ORDER"
QUEUES = range(8)
NAMES = ["m0", "m1", "m2"]  # the rule sorts them: m0 gets 0-2, m1 3-5, m2 6-7
HEARTBEAT_S = 0.25
TIMEOUT_S = 5.0  # member_timeout_s where nobody dies
KILL_TIMEOUT_S = 2.0  # member_timeout_s where a member is killed
#: the longest the test waits for the processes to get somewhere
PATIENCE_S = 30.0


class Member:
    """One member process and its log; `name` labels its files and is its
    member id unless `member=None` (the default host:pid:random id) is given."""

    def __init__(self, tmp: Path, warehouse: str, name: str, **settings: Any):
        self.name = name
        self.log = tmp / f"{name}.log"
        self.stop_file = tmp / f"{name}.stop"
        self.err = tmp / f"{name}.err"
        self.member_timeout_s = settings.get("member_timeout_s", TIMEOUT_S)
        config = {
            "warehouse": warehouse,
            "group": GROUP,
            "topic": TOPIC,
            "member": name,
            "heartbeat_interval_s": HEARTBEAT_S,
            "member_timeout_s": self.member_timeout_s,
            "batch": 4,
            "log": str(self.log),
            "stop": str(self.stop_file),
            **settings,
        }
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(MEMBER_SCRIPT), json.dumps(config)],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=err,
                stderr=err,
            )
        self.killed_at: float | None = None

    @property
    def member_id(self) -> str:
        (start,) = self.records("start")
        return str(start["member"])

    def records(self, event: str | None = None) -> list[dict]:
        if not self.log.exists():
            return []
        records = []
        for line in self.log.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return [r for r in records if event is None or r["e"] == event]

    def calls(self) -> list[dict]:
        return [r for r in self.records() if r["e"] in ("poll", "commit")]

    def got(self) -> list[tuple[int, int]]:
        return [(q, o) for r in self.records("poll") for q, o in r["got"]]

    def uncommitted(self) -> list[tuple[int, int]]:
        """What it polled after its last logged commit (a SIGKILL's window)."""
        window: list[tuple[int, int]] = []
        for record in self.records():
            if record["e"] == "commit":
                window = []
            elif record["e"] == "poll":
                window += [(q, o) for q, o in record["got"]]
        return window

    def stop(self) -> None:
        self.stop_file.touch()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.killed_at = time.time()
        self.proc.wait(timeout=10)

    def wait_closed(self) -> None:
        assert self.proc.wait(timeout=PATIENCE_S) == 0, self.describe()
        assert self.records()[-1]["e"] == "close", self.describe()

    def describe(self) -> str:
        tail = self.log.read_text().splitlines()[-5:] if self.log.exists() else []
        return (
            f"member {self.name} (exit {self.proc.poll()}): last log lines {tail}; "
            f"stderr {self.err.read_text()[-3000:]!r}"
        )

    def held_gaps(self) -> dict[int, list[tuple[float, float]]]:
        """The times it certainly held each queue: from the end of a call to
        the start of the next (its close, or its SIGKILL). A process stopped
        with SIGSTOP believes it holds its queues until its next call, but
        reads and commits nothing meanwhile: its gap ends when it stopped."""
        calls = self.calls()
        ends = [c["t0"] for c in calls[1:]]
        closes = self.records("close")
        if closes:
            ends.append(closes[0]["t0"])
        elif self.killed_at is not None:
            ends.append(self.killed_at)
        pauses = [p["t"] for p in self.records("pause")]
        gaps: dict[int, list[tuple[float, float]]] = {}
        for call, end in zip(calls, ends):
            end = min([end] + [t for t in pauses if call["t1"] <= t < end])
            for queue_id in call["held"]:
                gaps.setdefault(queue_id, []).append((call["t1"], end))
        return gaps


@pytest.fixture
def group(tmp_path, warehouse):
    """Starts member processes; kills whatever is left of them at the end."""
    started: list[Member] = []

    def start(name: str, **settings: Any) -> Member:
        started.append(Member(tmp_path, warehouse, name, **settings))
        return started[-1]

    yield start
    for member in started:
        if member.proc.poll() is None:
            member.proc.kill()
            member.proc.wait(timeout=10)


def wait_until(condition: Callable[[], bool], what: str, members: Iterable[Member]) -> None:
    """Until the processes get there (as their logs say), failing at once if one exits."""
    members = list(members)
    deadline = time.monotonic() + PATIENCE_S
    while not condition():
        for member in members:
            if member.killed_at is None and member.proc.poll() not in (None, 0):
                raise AssertionError(f"waiting for {what}: {member.describe()}")
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not within {PATIENCE_S}s: {what}; " + "; ".join(m.describe() for m in members)
            )
        time.sleep(0.02)


def share_then_stop(survivors) -> None:
    """The two survivors (m0, m2) share the queues; then both stop. The
    shares are checked first: the last to stop takes all, the other left."""
    for member in survivors:
        assert member.calls()[-1]["held"] == allocate_queues(QUEUES, ["m0", "m2"], member.name)
    for member in survivors:
        member.stop()
    for member in survivors:
        member.wait_closed()


def deliver_all(warehouse: str, offsets: range) -> None:
    """One topic commit: `offsets` of every queue."""
    deliver(warehouse, TOPIC, **{f"q{q}": offsets for q in QUEUES})


def everything(per_queue: int) -> list[tuple[int, int]]:
    return [(q, o) for q in QUEUES for o in range(per_queue)]


def consumed(members: Iterable[Member]) -> Counter[tuple[int, int]]:
    return Counter(message for member in members for message in member.got())


def all_committed(members: list[Member], per_queue: int) -> Callable[[], bool]:
    """The processes committed every queue up to `per_queue` (as their logs
    say: cheaper to poll than the offsets table, read once afterwards)."""

    def done() -> bool:
        committed: dict[int, int] = {}
        for member in members:
            for record in member.records("commit"):
                for queue_id, offset in record["moved"].items():
                    committed[int(queue_id)] = max(committed.get(int(queue_id), 0), offset)
        return committed == {q: per_queue for q in QUEUES}

    return done


def all_started(members: list[Member]) -> Callable[[], bool]:
    return lambda: all(m.records("start") for m in members)


def all_see(members: list[Member], names: list[str]) -> Callable[[], bool]:
    """Each process's last call saw exactly the members `names` live."""
    return lambda: all(m.calls() and m.calls()[-1].get("members") == names for m in members)


def settled(members: list[Member], names: list[str]) -> Callable[[], bool]:
    """Each process holds its share of the queues among the members `names`."""
    return lambda: all(
        m.calls() and m.calls()[-1]["held"] == allocate_queues(QUEUES, names, m.member_id)
        for m in members
    )


def overlaps(members: list[Member]) -> list[tuple[int, str, str]]:
    """(queue, member, member) where two processes certainly held a queue at once."""
    found = []
    gaps = [(m.name, m.held_gaps()) for m in members]
    for i, (name_a, gaps_a) in enumerate(gaps):
        for name_b, gaps_b in gaps[i + 1 :]:
            for queue_id in sorted(set(gaps_a) & set(gaps_b)):
                if any(
                    max(start_a, start_b) < min(end_a, end_b)
                    for start_a, end_a in gaps_a[queue_id]
                    for start_b, end_b in gaps_b[queue_id]
                ):
                    found.append((queue_id, name_a, name_b))
    return found


def reads_in_order(members: list[Member]) -> dict[int, list[int]]:
    """Per queue, the offsets read, poll after poll across the processes.

    Ordered by the end of each poll: a holder's last poll of a queue ends
    before it writes the row that lets go of it, which its taker reads
    before its own poll of the queue ends."""
    polls = sorted((r["t1"], r["got"]) for m in members for r in m.records("poll") if r["got"])
    order: dict[int, list[int]] = {}
    for _, got in polls:
        for queue_id, offset in got:
            order.setdefault(queue_id, []).append(offset)
    return order


def newest_member_rows(warehouse: str, *, heartbeats: bool = False) -> dict[str, dict]:
    """Each member's newest row in _sys/consumer_members (of its heartbeats only:
    leaving rows left out)."""
    rows = DeltaTable(table_path(warehouse, CONSUMER_MEMBERS)).to_pyarrow_table().to_pylist()
    newest: dict[str, dict] = {}
    for row in sorted(rows, key=lambda r: (r["heartbeat_ms"], r["leaving"])):
        if not (heartbeats and row["leaving"]):
            newest[row["member"]] = row
    return newest


def first_holding(members: list[Member], queues: set[int]) -> dict:
    """The first call after which one of `members` held one of `queues`."""
    return min(
        (c for m in members for c in m.calls() if queues & set(c["held"])), key=lambda c: c["t1"]
    )


def test_three_member_processes_share_eight_queues_and_read_every_message_once(group, warehouse):
    deliver_all(warehouse, range(10))  # already there: the first to join takes it all
    # default member ids (host:pid:random), as processes started alike get
    members = [group(name, member=None) for name in NAMES]
    wait_until(all_started(members), "the three start", members)
    ids = sorted(m.member_id for m in members)
    # the processes run this checkout's code
    assert {m.records("start")[0]["code"] for m in members} == {
        str(REPO / "txn_core" / "consumer_group.py")
    }
    assert len(set(ids)) == 3 and all(i.count(":") == 2 for i in ids), ids
    wait_until(settled(members, ids), "the three hold 0-2, 3-5 and 6-7", members)
    settled_at = time.time()
    for wave in range(1, 4):  # 240 more while they consume
        deliver_all(warehouse, range(10 * wave, 10 * (wave + 1)))
    wait_until(all_committed(members, 40), "everything committed", members)
    assert read_committed_offsets(warehouse, GROUP, TOPIC) == {q: 40 for q in QUEUES}
    for member in members:
        member.stop()
    for member in members:
        member.wait_closed()

    counts = consumed(members)
    assert sorted(counts) == everything(40)  # nothing missed
    assert [m for m, n in counts.items() if n > 1] == []  # nothing read twice
    assert overlaps(members) == []  # no queue held by two processes at once
    # each queue read straight through, across its hand-overs at the committed offset
    assert reads_in_order(members) == {q: list(range(40)) for q in QUEUES}
    for member in members:  # once settled, each read its own share only, and read some
        share = allocate_queues(QUEUES, ids, member.member_id)
        later = [q for r in member.records("poll") if r["t0"] > settled_at for q, _ in r["got"]]
        assert later and set(later) <= set(share), (member.member_id, sorted(set(later)))
    newest = newest_member_rows(warehouse)
    assert {name: (row["leaving"], row["queues"]) for name, row in newest.items()} == {
        name: (True, []) for name in ids
    }


@pytest.mark.parametrize("moment", ["hung mid-batch", "while running"])
def test_a_member_process_killed_with_sigkill_loses_its_queues_after_the_timeout(
    group, warehouse, moment
):
    hung = moment == "hung mid-batch"
    per_queue = 20 if hung else 30
    members = [
        group(
            name,
            member_timeout_s=KILL_TIMEOUT_S,
            **({"hang_after": 10} if hung and name == "m1" else {}),
        )
        for name in NAMES
    ]
    survivors, victim = [members[0], members[2]], members[1]
    victims_queues = set(allocate_queues(QUEUES, NAMES, "m1"))
    wait_until(all_see(members, NAMES), "the three see each other", members)
    deliver_all(warehouse, range(per_queue))  # each takes its share at once
    if hung:
        # it polled a batch and is processing it when it dies
        wait_until(lambda: bool(victim.records("hang")), "the victim hangs", members)
    else:
        wait_until(lambda: len(victim.got()) >= 12, "the victim consumes", members)
    victim.kill()
    assert len(victim.got()) < 3 * per_queue  # it died with work left in its queues
    wait_until(all_committed(members, per_queue), "everything committed", survivors)
    assert read_committed_offsets(warehouse, GROUP, TOPIC) == {q: per_queue for q in QUEUES}
    share_then_stop(survivors)

    counts = consumed(members)
    assert sorted(counts) == everything(per_queue)  # every message at least once
    twice = sorted(m for m, n in counts.items() if n > 1)
    window = victim.uncommitted()
    assert set(counts.values()) <= {1, 2}
    if hung:  # exactly what it polled and did not commit comes again
        assert window and twice == sorted(window)
    else:  # only from its uncommitted window
        assert set(twice) <= set(window), (twice, window)
    assert overlaps(members) == []
    # not taken before its last heartbeat was member_timeout_s old, and not long after
    last_heartbeat_s = newest_member_rows(warehouse)["m1"]["heartbeat_ms"] / 1000
    takeover = first_holding(survivors, victims_queues)
    assert takeover["t1"] > last_heartbeat_s + KILL_TIMEOUT_S
    assert takeover["t0"] < last_heartbeat_s + KILL_TIMEOUT_S + 3.0
    assert not newest_member_rows(warehouse)["m1"]["leaving"]  # it never said it left


def test_a_member_process_stopped_past_the_timeout_commits_nothing_for_queues_taken_over(
    group, warehouse
):
    """SIGSTOP between a poll and its commit, for longer than member_timeout_s:
    the others take its queues at its last commit; after SIGCONT its commit
    writes nothing, and it gets its share back from their commits."""
    members = [
        group(
            name, member_timeout_s=KILL_TIMEOUT_S, **({"pause_after": 10} if name == "m1" else {})
        )
        for name in NAMES
    ]
    survivors, stalled = [members[0], members[2]], members[1]
    stalled_queues = set(allocate_queues(QUEUES, NAMES, "m1"))
    wait_until(all_see(members, NAMES), "the three see each other", members)
    deliver_all(warehouse, range(20))
    wait_until(lambda: bool(stalled.records("pause")), "the member stops itself", members)
    window = stalled.uncommitted()
    assert window  # it stopped holding a polled batch it did not commit
    wait_until(all_committed(members, 20), "the others consume it all", survivors)
    assert read_committed_offsets(warehouse, GROUP, TOPIC) == {q: 20 for q in QUEUES}
    for member in survivors:
        assert member.calls()[-1]["held"] == allocate_queues(QUEUES, ["m0", "m2"], member.name)
    stalled.proc.send_signal(signal.SIGCONT)
    wait_until(settled(members, NAMES), "the three hold their shares again", members)
    deliver_all(warehouse, range(20, 30))
    wait_until(all_committed(members, 30), "everything committed", members)
    assert read_committed_offsets(warehouse, GROUP, TOPIC) == {q: 30 for q in QUEUES}
    for member in members:
        member.stop()
    for member in members:
        member.wait_closed()

    (resumed_at,) = [r["t"] for r in stalled.records("resume")]
    resumed = next(r for r in stalled.records("commit") if r["t0"] > resumed_at)
    assert (resumed["moved"], resumed["held"]) == ({}, [])  # its queues were taken over
    counts = consumed(members)
    assert sorted(counts) == everything(30)
    assert sorted(m for m, n in counts.items() if n > 1) == sorted(window)  # only its batch
    assert set(counts.values()) <= {1, 2}
    assert overlaps(members) == []
    # each queue read straight through, but for the stopped batch: read to its
    # end by the stopped member, then again from its start by the others
    expected = {}
    for q in QUEUES:
        batch = sorted(o for wq, o in window if wq == q)
        expected[q] = [*range(batch[-1] + 1), *range(batch[0], 30)] if batch else [*range(30)]
    assert reads_in_order(members) == expected
    later = [q for r in stalled.records("poll") if r["t0"] > resumed["t1"] for q, _ in r["got"]]
    assert later and set(later) <= stalled_queues  # back with its share


def test_a_member_process_that_closes_hands_its_queues_over_at_the_next_heartbeat(group, warehouse):
    members = [group(name) for name in NAMES]  # member_timeout_s=5
    survivors, leaver = [members[0], members[2]], members[1]
    leavers_queues = set(allocate_queues(QUEUES, NAMES, "m1"))
    wait_until(all_see(members, NAMES), "the three see each other", members)
    deliver_all(warehouse, range(20))
    wait_until(lambda: len(leaver.got()) >= 8, "the leaver consumes", members)
    leaver.stop()  # it closes after its next commit, messages left in its queues
    leaver.wait_closed()
    closed_at = leaver.records("close")[0]["t1"]
    assert len(leaver.got()) < 60
    deliver_all(warehouse, range(20, 30))
    wait_until(all_committed(members, 30), "everything committed", survivors)
    assert read_committed_offsets(warehouse, GROUP, TOPIC) == {q: 30 for q in QUEUES}
    share_then_stop(survivors)

    counts = consumed(members)
    assert sorted(counts) == everything(30)
    assert [m for m, n in counts.items() if n > 1] == []  # it committed all it polled
    assert overlaps(members) == []
    assert reads_in_order(members) == {q: list(range(30)) for q in QUEUES}
    # at a heartbeat of the others (every 0.25 s), before its last heartbeat
    # was member_timeout_s old: not from the timeout
    takeover = first_holding(survivors, leavers_queues)
    last_heartbeat_s = newest_member_rows(warehouse, heartbeats=True)["m1"]["heartbeat_ms"] / 1000
    assert closed_at < takeover["t1"] < last_heartbeat_s + TIMEOUT_S
    left = newest_member_rows(warehouse)["m1"]
    assert (left["leaving"], left["queues"]) == (True, [])
