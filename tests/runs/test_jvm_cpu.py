"""The benchmarks' account of a run's CPU by kind of JVM thread
(`scripts/jvm_cpu.py`)."""

from __future__ import annotations

import sys

import pytest
from jvm_cpu import KINDS, CpuAccount, JvmCpu, describe, kind_of


@pytest.mark.parametrize(
    "name, kind",
    [
        ("Executor task l", "tasks"),
        ("C2 CompilerThre", "jit"),
        ("C1 CompilerThre", "jit"),
        ("Sweeper thread", "jit"),
        ("GC Thread#0", "gc"),
        ("G1 Conc#0", "gc"),
        ("VM Thread", "gc"),
        ("Thread-4", "driver"),
        ("dag-scheduler-e", "driver"),
    ],
)
def test_a_thread_is_counted_by_its_kind(name, kind):
    assert kind_of(name) == kind


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_cpu_of_a_query_is_counted_in_its_tasks_and_all_kinds_add_up(spark):
    cpu = JvmCpu.of(spark)
    assert cpu is not None
    before = cpu.sample()
    spark.range(30_000_000).selectExpr("sum(id * id % 7)").collect()
    used = cpu.since(before)
    assert set(used) == set(KINDS) and min(used.values()) >= 0
    assert used["tasks"] > 0.05  # summing 30 million rows is the tasks' work
    total = cpu.sample().total - before.total
    assert sum(used.values()) <= total + 0.05  # no thread counted twice
    assert describe(used).startswith("tasks ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_account_returns_each_call_and_reports_the_medians_by_label(spark):
    cpu = CpuAccount(spark)
    query = spark.range(1_000_000).selectExpr("count(1)")
    assert cpu.call("count", query.collect)[0][0] == 1_000_000
    cpu.call("count", query.collect)
    assert cpu.call("nothing", lambda: 7) == 7
    count, nothing = cpu.lines(width=8)
    assert count.startswith("CPU, count   : tasks ") and nothing.startswith("CPU, nothing : ")
