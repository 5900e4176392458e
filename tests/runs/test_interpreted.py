"""Small runs run interpreted (`jobs.interpreted`): no class compiled per run."""

from __future__ import annotations

import pytest

from jobs.interpreted import INTERPRETED, INTERPRETED_MAX_ROWS, interpreted_if_small
from jobs.reconcile import reconcile

import factories as fx

T0 = 10_000_000


def _classes_compiled(spark) -> int:
    """Spark's count of the classes it generated and compiled in this JVM."""
    metrics = spark.sparkContext._jvm.org.apache.spark.metrics.source.CodegenMetrics
    return int(metrics.METRIC_COMPILATION_TIME().getCount())


def _classes_of_three_alike_runs(spark, warehouse) -> list[int]:
    """The classes compiled by each of three runs of one shape (five new
    messages: four committed, one rolled back), each at its own clock."""
    compiled = []
    for n in range(3):
        halves = [fx.half(store_ms=T0) for _ in range(5)]
        fx.write_halves(warehouse, *halves)
        fx.write_ops(warehouse, *(fx.op(h) for h in halves[:4]), fx.op(halves[4], "ROLLBACK"))
        before = _classes_compiled(spark)
        summary = reconcile(spark, {"warehouse": warehouse}, now_ms=T0 + 1_000 * n)
        compiled.append(_classes_compiled(spark) - before)
        assert (summary.committed, summary.rolled_back, summary.pending_after) == (4, 1, 0)
    return compiled


def test_a_small_run_compiles_no_class_and_leaves_the_sessions_settings_as_they_were(
    spark, warehouse
):
    spark.conf.set("spark.sql.codegen.wholeStage", "true")  # as a notebook might
    compiled = _classes_of_three_alike_runs(spark, warehouse)
    assert compiled[1:] == [0, 0]
    assert spark.conf.get("spark.sql.codegen.wholeStage") == "true"
    assert spark.conf.get("spark.sql.codegen.factoryMode", None) is None
    spark.conf.unset("spark.sql.codegen.wholeStage")


def test_a_compiled_run_reuses_the_classes_of_the_last_run_of_its_shape(
    spark, warehouse, monkeypatch
):
    # every run compiled, as a run over more than INTERPRETED_MAX_ROWS is
    monkeypatch.setattr("jobs.interpreted.INTERPRETED_MAX_ROWS", -1)
    compiled = _classes_of_three_alike_runs(spark, warehouse)
    # the run's clock, number and input versions are not in the generated
    # code (`T.sql_run_value`): as literals they made ~20 classes every run
    assert compiled[0] > 0 and compiled[2] == 0, compiled


def test_only_a_run_known_to_be_small_runs_interpreted_and_the_settings_come_back(spark):
    keys = sorted(INTERPRETED)

    def settings() -> list[str | None]:
        return [spark.conf.get(key, None) for key in keys]

    for rows in (None, INTERPRETED_MAX_ROWS + 1):
        with interpreted_if_small(spark, rows) as interpreted:
            assert not interpreted and settings() == [None] * len(keys)
    with pytest.raises(ZeroDivisionError):
        with interpreted_if_small(spark, INTERPRETED_MAX_ROWS) as interpreted:
            assert interpreted and settings() == [INTERPRETED[key] for key in keys]
            _ = 1 / 0  # a failing run gives the settings back too
    assert settings() == [None] * len(keys)
