"""DataFrames a run computes once and reads several times, released at its end.

A run reads its intermediate results (the live messages' keys, the classified
OPs, the decisions, the decided messages with their bodies) several times each:
counters, then one write per output table. Recomputing them would re-read and
re-join the inputs each time; Spark's cache (`DataFrame.cache`) builds
compressed column batches, as costly to build and to read back as the parquet
they came from. A local checkpoint keeps the rows as they are (in executor
memory, spilling to local disk), for little more than computing them once. The
price: it cannot be recomputed, so losing an executor that holds part of one
(a cluster) fails the run, and the next run redoes it from its intent (I4).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pyspark.sql import DataFrame


class Held:
    """The DataFrames of one run that are kept; `release()` frees them all.

    >>> held = Held()                                    # doctest: +SKIP
    >>> keys = held.checkpoint(df.select("half_offset"))  # doctest: +SKIP
    >>> held.release()                                   # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._releases: list[Callable[[], None]] = []
        self._soon: ThreadPoolExecutor | None = None

    def checkpoint(self, df: DataFrame) -> DataFrame:
        """`df`, computed now and kept as rows."""
        done = df.localCheckpoint(eager=True)
        rdd = _checkpointed_rdd(done)
        if rdd is not None:
            self._releases.append(lambda: rdd.unpersist(False))
        return done

    def checkpoint_soon(self, df: DataFrame) -> Future[DataFrame]:
        """`checkpoint(df)` on a thread of the run's own, started now: for
        rows whose Spark job can run while the driver prepares others."""
        if self._soon is None:
            self._soon = ThreadPoolExecutor(1, thread_name_prefix="held")
        return self._soon.submit(self.checkpoint, df)

    def cache(self, df: DataFrame) -> DataFrame:
        """`df`, kept by Spark's cache from the first action that reads it:
        for rows whose reader costs more than the cache (the change feed's),
        read in part (a few columns) by some steps and whole by others."""
        kept = df.cache()
        self._releases.append(kept.unpersist)
        return kept

    def release(self) -> None:
        if self._soon is not None:  # what they keep is freed too, not left to the cleaner
            self._soon.shutdown(wait=True)
            self._soon = None
        for release in reversed(self._releases):
            release()
        self._releases.clear()


def _checkpointed_rdd(df: DataFrame):
    """The JVM RDD holding a local checkpoint's rows, to free them as soon as
    the run ends; None where the plan is not reachable (Spark Connect), and
    then Spark frees them once the frame is garbage."""
    jdf = getattr(df, "_jdf", None)
    if jdf is None:
        return None
    try:
        return jdf.logicalPlan().rdd()
    except Exception:  # noqa: BLE001 — another Spark's internals: leave it to the cleaner
        return None
