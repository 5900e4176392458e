"""`_sys/runs`: a run's intent (STARTED) and record (COMMITTED), written and
read with delta-rs, off Spark's critical path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import pyarrow as pa

from jobs import fence
from jobs.lease import Lease
from jobs.tagged_writes import run_tag
from schemas import RUNS, table_path
from schemas.arrow import arrow_schema
from txn_core.storage import options_for
from txn_core.vocabulary import RunStatus


@dataclass
class InputVersions:
    """The producer-table versions a run reads: each table's rows added in
    (prev_*, *]. Both the run record and the run's summary carry them."""

    half_version: int
    op_version: int
    answers_version: int
    prev_half_version: int
    prev_op_version: int
    prev_answers_version: int

    def input_versions(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(InputVersions)}


@dataclass
class RunRecord(InputVersions):
    """One row of `_sys/runs` (the intent, or the intent plus the summary)."""

    run_id: str
    run_number: int
    status: str
    now_ms: int
    started_ms: int
    state_versions: dict[str, int]
    rules_json: str
    ended_ms: int | None = None
    counters: dict[str, int | None] = field(default_factory=dict)
    delivered_by_topic: dict[str, int] | None = None
    summary_json: str | None = None

    def to_row(self) -> dict:
        row = {k: v for k, v in self.__dict__.items() if k != "counters"}
        row["state_versions"] = dict(sorted(self.state_versions.items()))
        from schemas.tables import RUN_COUNTERS

        row.update({name: self.counters.get(name) for name in RUN_COUNTERS})
        return row

    @classmethod
    def from_row(cls, row: dict) -> RunRecord:
        from schemas.tables import RUN_COUNTERS

        base = {k: row[k] for k in cls.__dataclass_fields__ if k != "counters"}
        base["state_versions"] = dict(base["state_versions"])
        if base["delivered_by_topic"] is not None:
            base["delivered_by_topic"] = dict(base["delivered_by_topic"])
        return cls(**base, counters={n: row[n] for n in RUN_COUNTERS})


def last_run(warehouse: str) -> RunRecord | None:
    """The latest run: its COMMITTED record, or its STARTED one if it never
    finished. Read with delta-rs (see `latest_version`)."""
    from txn_core.tables import latest_run_rows

    rows = latest_run_rows(warehouse)
    if not rows:
        return None
    rows.sort(key=lambda r: r["status"] != RunStatus.COMMITTED)
    return RunRecord.from_row(rows[0])


def last_committed_run(warehouse: str, last: RunRecord | None) -> RunRecord | None:
    """`last` (`last_run`) when it committed, else the COMMITTED record of
    the run before it (an interrupted run's state is not yet the warehouse's)."""
    from txn_core.tables import latest_run_rows

    if last is None or last.status == RunStatus.COMMITTED:
        return last
    rows = latest_run_rows(warehouse, run_number=last.run_number - 1)
    committed = [r for r in rows if r["status"] == RunStatus.COMMITTED]
    return RunRecord.from_row(committed[0]) if committed else None


def write_run_record(warehouse: str, record: RunRecord, lease: Lease | None = None) -> None:
    """Append one row to `_sys/runs`, tagged like the run's other commits and
    fenced by the run's `lease` like them (`jobs.fence`): a run that lost its
    lease records neither an intent nor a COMMITTED row.

    Never a redo: a run's STARTED row is written once (a crash after it makes
    the next invocation redo that run, not write it again), and once its
    COMMITTED row is in, the run is not redone.

    Written with delta-rs, like `last_run` reads it: a one-row commit costs
    far less there than through Spark's Delta writer, and every run writes
    two, one after the other on its critical path (intent, commit).
    The table is the same Delta table to Spark (verify, compaction).
    """
    from deltalake import CommitProperties, write_deltalake

    from txn_core import kept_tables
    from txn_core.log_trim import checkpoint_and_trim

    row = pa.Table.from_pylist([record.to_row()], schema=arrow_schema(RUNS))
    tag = run_tag(record.run_number, f"{RUNS.path}:{record.status}")
    path = table_path(warehouse, RUNS)
    table = kept_tables.take(path, options_for(path))
    once = CommitProperties(custom_metadata={"userMetadata": tag}, max_commit_retries=0)
    fence.commit(
        table, lease, lambda: write_deltalake(table, row, mode="append", commit_properties=once)
    )
    checkpoint_and_trim(table)
    kept_tables.give_back(table)


def decode_json(text: str | None) -> dict:
    return json.loads(text) if text else {}
