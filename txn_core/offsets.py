"""Unique offsets across threads and processes, without a coordinator (I1).

Each Broker registers once: it commits one row to `_sys/producers` at exactly
the version after the one it read (no commit retries), so two brokers can
never obtain the same version. That version is the broker's epoch, and its
offsets are `epoch << 32 | sequence`. Offsets are unique, not dense; nothing
reads "the current max offset" on the hot path.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
import time
from collections.abc import Callable

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from schemas import PRODUCERS
from schemas.arrow import arrow_schema

SEQUENCE_BITS = 32
_NO_RETRY = CommitProperties(max_commit_retries=0)


def register_epoch(
    producers: DeltaTable, broker_id: str, now_ms: int, attempts: int = 10_000
) -> int:
    """Commit a registration row at exactly `read version + 1`; return that version."""
    row = pa.Table.from_pylist(
        [
            {
                "broker_id": broker_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "opened_ms": now_ms,
            }
        ],
        schema=arrow_schema(PRODUCERS),
    )
    for attempt in range(attempts):
        producers.update_incremental()
        read_version = producers.version()
        try:
            write_deltalake(producers, row, mode="append", commit_properties=_NO_RETRY)
        except CommitFailedError:
            # Another broker took that version; back off a little and try the next.
            time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 50)))
            continue
        epoch = read_version + 1
        if producers.version() != epoch:  # pragma: no cover - would break I1
            raise RuntimeError(
                f"epoch registration committed version {producers.version()}, expected {epoch}"
            )
        if epoch >= 2**31:
            raise RuntimeError("the producers table exceeded 2^31 versions; offsets would overflow")
        return epoch
    raise RuntimeError(f"could not register a broker epoch after {attempts} attempts")


class OffsetAllocator:
    """Hands out `epoch << 32 | n` for n = 0, 1, 2 …; thread-safe.

    When the 2^32 sequence numbers of an epoch are used up, `renew` (a
    callable returning a fresh epoch) is asked for another.
    """

    def __init__(self, epoch: int, renew: Callable[[], int]):
        self._epoch = epoch
        self._renew = renew
        self._counter = itertools.count()
        self._lock = threading.Lock()

    @property
    def epoch(self) -> int:
        return self._epoch

    def take(self, n: int) -> list[int]:
        with self._lock:
            start = next(self._counter)
            if start + n > 2**SEQUENCE_BITS:
                self._epoch = self._renew()
                self._counter = itertools.count()
                start = next(self._counter)
            # Skip the n-1 numbers this call consumes beyond `start`.
            if n > 1:
                self._counter = itertools.count(start + n)
            base = self._epoch << SEQUENCE_BITS
            return [base | (start + i) for i in range(n)]
