"""jobs.local: a driver's rows as a DataFrame Spark holds in its plan."""

from __future__ import annotations

from pyspark.sql.types import IntegerType, LongType, MapType, StringType, StructField, StructType

from jobs.local import local_frame

SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("queue_id", IntegerType(), True),
        StructField("props", MapType(StringType(), StringType()), True),
        StructField("offset", LongType(), False),
    ]
)


def _plan(df) -> str:
    return df._jdf.queryExecution().optimizedPlan().toString()


def test_rows_keep_their_values_and_the_exact_schema(spark):
    df = local_frame(spark, [("ORDER", 3, {"k": "v"}, 1 << 40), ("PAY", None, None, 0)], SCHEMA)
    assert df.schema == SCHEMA
    assert [tuple(r) for r in df.collect()] == [
        ("ORDER", 3, {"k": "v"}, 1 << 40),
        ("PAY", None, None, 0),
    ]
    assert "LocalRelation" in _plan(df)  # no Python RDD: no task runs a Python worker


def test_no_rows_is_an_empty_relation_the_optimizer_drops(spark):
    empty = local_frame(spark, [], SCHEMA)
    assert empty.schema == SCHEMA and empty.count() == 0
    one = local_frame(spark, [("ORDER", 1, None, 5)], SCHEMA)
    assert _plan(one.unionByName(empty)) == _plan(one)


def test_an_empty_frame_is_made_once_per_session_and_schema(spark):
    # a run takes several empty frames, each some forty calls into the JVM to make
    assert local_frame(spark, [], SCHEMA) is local_frame(spark, [], SCHEMA)
    other = StructType([StructField("topic", StringType(), False)])
    assert local_frame(spark, [], other) is not local_frame(spark, [], SCHEMA)
    assert local_frame(spark, [], other).schema == other
