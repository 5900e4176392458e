"""Where a local driver JVM's CPU goes, for the benchmarks: each thread's
CPU time from `/proc` (Linux), summed by kind.

    >>> cpu = CpuAccount(spark)                          # doctest: +SKIP
    >>> query = spark.range(10**7).selectExpr("sum(id)")  # doctest: +SKIP
    >>> cpu.call("sum", query.collect)                   # doctest: +SKIP
    >>> cpu.lines()                                      # doctest: +SKIP
    ['CPU, sum: tasks 0.1 s, JIT 0.2 s, GC 0.0 s, driver 0.1 s (0.4 s)']

Kinds: `tasks` (Spark's task threads: the rows' work), `jit` (HotSpot's
compilers and their code cache sweeper), `gc` (the collector's threads and
the VM thread that stops the others for it) and `driver` (everything else:
the driver's planning on Py4J's threads, Spark's scheduler and broadcasts,
and threads that ended between the samples, counted from the process's own
total). A run that is CPU-bound on few cores is as fast as the sum of these
allows, whatever it overlaps.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from statistics import median
from typing import TypeVar

T = TypeVar("T")

KINDS = ("tasks", "jit", "gc", "driver")

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def kind_of(thread_name: str) -> str:
    """The kind of a JVM thread, by its name as `/proc` shows it (the first
    15 characters: "Executor task l", "C2 CompilerThre", "G1 Conc#0")."""
    if thread_name.startswith("Executor task"):
        return "tasks"
    if "CompilerThre" in thread_name or thread_name.startswith("Sweeper thread"):
        return "jit"
    if thread_name.startswith(("GC Thread", "G1 ", "VM Thread")):
        return "gc"
    return "driver"


@dataclass(frozen=True)
class Sample:
    """CPU seconds by thread id (with its kind), and the process's total."""

    threads: dict[int, tuple[str, float]]
    total: float


@dataclass(frozen=True)
class JvmCpu:
    """The driver JVM of a local SparkSession, by its process id."""

    pid: int

    @classmethod
    def of(cls, spark) -> JvmCpu | None:
        """The session's JVM, or None where `/proc` does not show its threads."""
        pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        return cls(pid) if os.path.isdir(f"/proc/{pid}/task") else None

    def sample(self) -> Sample:
        threads = {}
        root = f"/proc/{self.pid}/task"
        for tid in os.listdir(root):
            try:
                with open(f"{root}/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"{root}/{tid}/stat") as f:
                    seconds = _cpu_seconds(f.read())
            except OSError:  # the thread ended while listed
                continue
            threads[int(tid)] = (kind_of(name), seconds)
        with open(f"/proc/{self.pid}/stat") as f:
            total = _cpu_seconds(f.read())
        return Sample(threads, total)

    def of_call(self, fn: Callable[[], T]) -> tuple[T, dict[str, float]]:
        """`fn()`, and the CPU seconds by kind the JVM used while it ran."""
        before = self.sample()
        out = fn()
        return out, self.since(before)

    def since(self, before: Sample) -> dict[str, float]:
        """CPU seconds by kind from `before` to now; `driver` also holds what
        threads that ended in between used (the total less the other kinds)."""
        now = self.sample()
        by_kind = dict.fromkeys(KINDS, 0.0)
        for tid, (kind, seconds) in now.threads.items():
            by_kind[kind] += seconds - before.threads.get(tid, (kind, 0.0))[1]
        known = sum(v for k, v in by_kind.items() if k != "driver")
        by_kind["driver"] = max(now.total - before.total - known, 0.0)
        return by_kind


class CpuAccount:
    """The JVM CPU by kind of labelled calls, for a benchmark's report
    (nothing where `JvmCpu.of` finds no `/proc`)."""

    def __init__(self, spark) -> None:
        self._jvm = JvmCpu.of(spark)
        self._samples: dict[str, list[dict[str, float]]] = {}

    def call(self, label: str, fn: Callable[[], T]) -> T:
        """`fn()`, its CPU by kind kept under `label`."""
        if self._jvm is None:
            return fn()
        out, used = self._jvm.of_call(fn)
        self._samples.setdefault(label, []).append(used)
        return out

    def lines(self, width: int = 0) -> list[str]:
        """'CPU, <label>: <describe(medians)>' for each label, in order."""
        return [
            f"CPU, {label:<{width}}: {describe(medians(samples))}"
            for label, samples in self._samples.items()
        ]


def _cpu_seconds(stat: str) -> float:
    """utime + stime of a `/proc/.../stat` line (the name in brackets may
    hold spaces: the fields are counted after its closing bracket)."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    """The median of each kind over `samples` (repetitions of one measurement)."""
    return {k: median(s[k] for s in samples) for k in KINDS}


def describe(by_kind: dict[str, float]) -> str:
    """'tasks 2.2 s, JIT 2.0 s, GC 0.3 s, driver 1.2 s (5.7 s)'."""
    names = {"tasks": "tasks", "jit": "JIT", "gc": "GC", "driver": "driver"}
    parts = [f"{names[k]} {by_kind[k]:.1f} s" for k in KINDS]
    return ", ".join(parts) + f" ({sum(by_kind.values()):.1f} s)"
