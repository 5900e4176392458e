"""Lists of SQL text handed to the JVM in one call, or none.

py4j sends a Python list to the JVM one element per call, each a round trip,
and a small run's driver spends more time in those than in analysing its
selects; the lists, mostly the same run after run, are kept in the JVM
(docs/performance.md, "A select in one call into the JVM").
"""

from __future__ import annotations

from collections import OrderedDict
from functools import lru_cache
from threading import Lock
from typing import Any

from pyspark.sql import DataFrame

# Never in a column name or in the SQL text the job writes (checked).
_SEPARATOR = "\u0001"
#: lists kept as Java arrays (a small run makes a few dozen)
KEPT_ARRAYS = 512


def select_expr(df: DataFrame, texts: list[str]) -> DataFrame:
    """`df.selectExpr(*texts)`, in one call into the JVM (its analysis).

    >>> select_expr(df, ["half_offset", "store_ms + 1 AS due_ms"])  # doctest: +SKIP
    """
    from pyspark.sql.classic.dataframe import DataFrame as ClassicDataFrame

    if not hasattr(df, "_jdf"):  # Spark Connect: no JVM of ours to call
        return df.selectExpr(*texts)
    jdf = df._jdf.selectExpr(java_strings(df.sparkSession, texts))
    return ClassicDataFrame(jdf, df.sparkSession)


def hint(df: DataFrame, name: str) -> DataFrame:
    """`df.hint(name)` in one call (PySpark makes an empty Java list first)."""
    from pyspark.sql.classic.dataframe import DataFrame as ClassicDataFrame

    if not hasattr(df, "_jdf"):
        return df.hint(name)
    empty = _empty_seq(df.sparkSession.sparkContext._gateway)
    return ClassicDataFrame(df._jdf.hint(name, empty), df.sparkSession)


def java_strings(spark: Any, texts: list[str]) -> Any:
    """A Java `String[]` of `texts`: kept from an earlier call, or made by one."""
    gateway = spark.sparkContext._gateway
    key = tuple(texts)
    with _lock:
        kept = _kept.setdefault(gateway, OrderedDict())
        if key in kept:
            kept.move_to_end(key)
            return kept[key]
    if any(_SEPARATOR in t for t in texts):
        raise ValueError(f"SQL text holds the separator U+0001: {texts!r}")
    array = _split(gateway)(_SEPARATOR.join(texts), _SEPARATOR)
    with _lock:
        kept[key] = array
        while len(kept) > KEPT_ARRAYS:
            kept.popitem(last=False)
    return array


# the arrays kept, by gateway (a process has one; a test may start another)
_kept: dict[Any, OrderedDict[tuple[str, ...], Any]] = {}
_lock = Lock()


@lru_cache(maxsize=4)
def _empty_seq(gateway: Any) -> Any:
    to_seq = gateway.jvm.org.apache.spark.api.python.PythonUtils.toSeq
    return to_seq(gateway.jvm.java.util.ArrayList())


@lru_cache(maxsize=4)
def _split(gateway: Any) -> Any:
    # Looking a class or its method up by name is a call per part; once per gateway.
    return gateway.jvm.org.apache.commons.lang3.StringUtils.splitByWholeSeparatorPreserveAllTokens
