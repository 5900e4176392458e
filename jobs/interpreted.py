"""Small runs (and audits of small warehouses) evaluate their expressions interpreted, not compiled.

Over a few thousand rows compiled code does not pay: each new shape of a
run's plans costs dozens of classes (Janino, then the JVM's JIT
compilers), and once Spark's code cache hits (`T.sql_run_value` keeps a
run's own values out of the code) a small run is no faster compiled than
interpreted. Over a hundred thousand, compiled code wins
(docs/performance.md, "Minutes into a continuous job" and "What is left
between a big run and its lower bound").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from jobs.session import restore_settings

log = logging.getLogger(__name__)

#: a run reading at most this many rows (new half and OP rows, the pending
#: set) runs interpreted
INTERPRETED_MAX_ROWS = 20_000

#: the session's settings while a small run runs: no whole-stage code, and
#: Spark's expression factories take their interpreted form. And a join
#: whose sides are each in one partition (`T.with_bodies(one_task=True)`)
#: stays in that partition: past this size, by Spark's estimate of a side,
#: which for a join's output multiplies its inputs' (and may still pass
#: this), Spark shuffles both sides into several (a Spark job each)
INTERPRETED = {
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    "spark.sql.maxSinglePartitionBytes": str(2**63 - 1),
}

#: the settings while `verify` audits a small warehouse: interpreted, and
#: each query planned once, in one partition. Its comparisons hold some forty
#: exchanges; adaptive execution runs each as a Spark job of its own and plans
#: the rest again after each (docs/performance.md, "A small warehouse's audit")
SMALL_AUDIT = {
    **INTERPRETED,
    "spark.sql.shuffle.partitions": "1",
    "spark.sql.adaptive.enabled": "false",
}


@contextmanager
def interpreted_if_small(
    spark, rows: int | None, settings: Mapping[str, str] = INTERPRETED
) -> Iterator[bool]:
    """Within: the session runs interpreted (`settings`: `INTERPRETED`, or
    `SMALL_AUDIT`) if `rows`, a run's or an audit's estimate (None: unknown), is at most
    `INTERPRETED_MAX_ROWS`; yields whether it does. The settings the session
    had are put back after, its own (a notebook's) included.

    >>> with interpreted_if_small(spark, 2_500) as interpreted:  # doctest: +SKIP
    ...     spark.range(2_500).selectExpr("id * 2").count()
    """
    if rows is None or rows > INTERPRETED_MAX_ROWS:
        yield False
        return
    before = {key: spark.conf.get(key, None) for key in settings}
    try:
        for key, value in settings.items():
            spark.conf.set(key, value)
    except Exception as exc:  # noqa: BLE001 - a session that refuses them runs compiled
        log.info("running compiled: the session refused %s (%s)", sorted(settings), exc)
        restore_settings(spark, before)
        yield False
        return
    try:
        yield True
    finally:
        restore_settings(spark, before)
