"""Small DataFrames made of rows the driver holds: a run's few rows of its
own (which file a commit added, each queue's last offset) and its empty
frames (no history to look up).

Why not `spark.createDataFrame(rows)`: from a Python list, Spark makes an
RDD of pickled rows, and every job whose plan holds one runs tasks in Python
workers to unpickle them, even for no rows at all. From an Arrow table, Spark
makes a local relation instead: the rows travel inside the plan, no task reads
them, and the optimizer removes an empty one from the plan altogether.

    >>> from pyspark.sql.types import IntegerType, StringType, StructField
    >>> schema = StructType([StructField("topic", StringType()),
    ...                      StructField("queue_id", IntegerType())])
    >>> local_frame(spark, [("ORDER", 3)], schema).collect()    # doctest: +SKIP
    [Row(topic='ORDER', queue_id=3)]
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType

#: each session's empty frames by schema: a run takes several, and each
#: `createDataFrame` is dozens of calls into the JVM; a DataFrame never
#: changes, so one serves every run of the session
_EMPTY: weakref.WeakKeyDictionary[SparkSession, dict[str, DataFrame]] = weakref.WeakKeyDictionary()


def local_frame(spark: SparkSession, rows: Sequence[tuple], schema: StructType) -> DataFrame:
    """`rows` (tuples in `schema`'s column order; none for an empty frame)
    as a DataFrame of exactly `schema`, types and nullability included."""
    arrow = to_arrow_schema(schema)
    if rows:
        columns = [pa.array(list(values), type=f.type) for values, f in zip(zip(*rows), arrow)]
        return spark.createDataFrame(pa.Table.from_arrays(columns, schema=arrow), schema)
    empties = _EMPTY.setdefault(spark, {})
    key = schema.json()
    if key not in empties:
        empties[key] = spark.createDataFrame(arrow.empty_table(), schema)
    return empties[key]
