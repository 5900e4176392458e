"""jobs.jvm_calls: a select of SQL text is the same select as PySpark's, made
in one call into the JVM (none for the list when it was made before)."""

import contextlib

import pytest
from chispa import assert_df_equality

from jobs import jvm_calls


@contextlib.contextmanager
def _counted_calls(spark):
    """A list that gets one item per call into the JVM (py4j's deletes of
    objects Python dropped aside: they come whenever Python collects)."""
    client = spark.sparkContext._gateway._gateway_client
    send, calls = client.send_command, []

    def counted(command, *args, **kwargs):
        if not command.startswith("m\n"):
            calls.append(command[:40])
        return send(command, *args, **kwargs)

    client.send_command = counted
    try:
        yield calls
    finally:
        client.send_command = send


def _frame(spark):
    return spark.range(6).selectExpr("id", *[f"id * {i} AS c{i}" for i in range(15)])


def test_select_expr_is_pyspark_s_select_expr(spark):
    df = _frame(spark)
    texts = ["`id`", "c3 + c4 AS s", "CASE WHEN id > 2 THEN 'big' END AS size", "*"]
    assert_df_equality(jvm_calls.select_expr(df, texts), df.selectExpr(*texts))


def test_a_select_of_sixteen_items_is_one_call_for_its_list_then_none(spark):
    df = _frame(spark)
    texts = ["`id`", *[f"c{i} + 1 AS d{i}" for i in range(15)], "'a fresh list' AS tag"]
    jvm_calls.java_strings(spark, ["warms up the lookup of the split"])
    with _counted_calls(spark) as first:
        one = jvm_calls.select_expr(df, texts)
    with _counted_calls(spark) as again:
        two = jvm_calls.select_expr(df, texts)
    with _counted_calls(spark) as pyspark:
        three = df.selectExpr(*texts)
    assert one.columns == two.columns == three.columns
    assert len(first) == 2, first  # the array, then the select
    assert len(again) == 1, again  # the select alone
    assert len(pyspark) > len(texts)  # what it saves: a call per item


def test_kept_arrays_are_bounded_and_the_oldest_go_first(spark, monkeypatch):
    monkeypatch.setattr(jvm_calls, "KEPT_ARRAYS", 2)
    first = jvm_calls.java_strings(spark, ["bounded 1"])
    jvm_calls.java_strings(spark, ["bounded 2"])
    assert jvm_calls.java_strings(spark, ["bounded 1"]) is first  # now the newest
    jvm_calls.java_strings(spark, ["bounded 3"])  # drops "bounded 2"
    kept = jvm_calls._kept[spark.sparkContext._gateway]
    assert len(kept) == 2
    assert set(kept) == {("bounded 1",), ("bounded 3",)}
    assert list(jvm_calls.java_strings(spark, ["bounded 1"])) == ["bounded 1"]


def test_text_holding_the_separator_is_refused(spark):
    with pytest.raises(ValueError, match="separator"):
        jvm_calls.java_strings(spark, ["a\u0001b"])


def test_hint_is_pyspark_s_hint(spark):
    df = _frame(spark).coalesce(1)
    mine = jvm_calls.hint(df, "shuffle_hash")._jdf.queryExecution().logical().toString()
    theirs = df.hint("shuffle_hash")._jdf.queryExecution().logical().toString()
    assert mine == theirs
    assert mine.startswith("UnresolvedHint shuffle_hash")
