"""jobs.held: what a run keeps is computed once, reads back the same rows, and
is freed when the run releases it."""

import pytest
from pyspark.sql import functions as F

from jobs.held import Held


def _kept_rdds(spark) -> set[int]:
    return {
        info.id()
        for info in spark.sparkContext._jsc.sc().getRDDStorageInfo()
        if info.numCachedPartitions() > 0
    }


def test_checkpoint_keeps_the_rows_and_release_frees_them(spark):
    before = _kept_rdds(spark)
    held = Held()
    df = spark.range(1000).select(F.col("id"), (F.col("id") % 7).alias("k"))
    kept = held.checkpoint(df)
    assert _kept_rdds(spark) - before, "the checkpoint holds no blocks"
    assert sorted(map(tuple, kept.collect())) == sorted(map(tuple, df.collect()))
    # computed once: the plan reads the kept rows, not the range again
    assert "Range" not in kept._jdf.queryExecution().executedPlan().toString()
    held.release()
    assert _kept_rdds(spark) - before == set()


def test_cache_is_released_with_the_rest(spark):
    held = Held()
    df = held.cache(spark.range(10).withColumn("x", F.lit(1)))
    assert df.count() == 10 and df.is_cached
    held.checkpoint(spark.range(5))
    held.release()
    assert not df.is_cached
    held.release()  # twice is harmless: nothing left to free


def test_a_checkpoint_started_soon_is_computed_on_its_own_thread_and_freed_on_release(spark):
    before = _kept_rdds(spark)
    held = Held()
    df = spark.range(1000).select((F.col("id") * 3).alias("x"))
    placed = held.checkpoint_soon(df)
    kept = placed.result(timeout=120)
    assert sorted(r.x for r in kept.collect()) == [3 * i for i in range(1000)]
    assert "Range" not in kept._jdf.queryExecution().executedPlan().toString()
    assert _kept_rdds(spark) - before
    # one never waited for is finished and freed too, not left to the cleaner
    held.checkpoint_soon(spark.range(50))
    held.release()
    assert _kept_rdds(spark) - before == set()


def test_a_checkpoint_started_soon_that_fails_raises_where_its_rows_are_wanted(spark):
    held = Held()
    bad = spark.range(3).selectExpr("assert_true(id < 0, 'not placed') AS x")
    placed = held.checkpoint_soon(bad)
    with pytest.raises(Exception, match="not placed"):  # Spark's error, in the waiting thread
        placed.result(timeout=120)
    held.release()
