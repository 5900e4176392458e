"""The one place a SparkSession with Delta Lake is built.

Tests, the job, scripts and notebooks all call `build_spark`, so the Delta
jars, SQL extensions and local defaults are set the same way everywhere.
The jars come from Maven's local repository: `make setup` resolves them with
`mvn` from `pom.xml` and writes their paths to `target/spark-jars.txt`, which
a local session puts on its classpath as they are. Without that file (a
notebook on a machine where only pip ran) the session asks Spark's Ivy
resolver for `DELTA_JAR`, which looks in `~/.m2` before the network — the
same jars, resolved again at every start.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from txn_core.config import ConfigError

DELTA_JAR = "io.delta:delta-spark_4.2_2.13:4.4.0"
#: a class of that jar: a JVM without it was started without the jar
DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
#: Spark's s3a file system, for a warehouse on S3: the version of the Hadoop
#: pyspark ships (its jars/hadoop-client-api-*.jar); it brings the AWS SDK
S3A_JAR = "org.apache.hadoop:hadoop-aws:3.5.0"
#: written by `make setup` (mvn dependency:build-classpath), one run of the pom
JAR_LIST = Path(__file__).resolve().parent.parent / "target" / "spark-jars.txt"

_DEFAULTS = {
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # Small local jobs: a few shuffle partitions, not 200.
    "spark.sql.shuffle.partitions": "4",
    # Delta rebuilds each table's snapshot with 50 partitions by default; the
    # job reads a dozen small logs per run, each then a 50-task job. Raise it
    # on a cluster with huge logs.
    "spark.databricks.delta.snapshotPartitions": "2",
    # Spark compiles the code it generates for each query, and keeps the last
    # 100 classes by default; a run generates ~175, so in a long-lived session
    # (a notebook, the tests, a benchmark) every run compiled all of them
    # again (and the JIT then compiled the new classes too). Identical code of
    # later runs now reuses the compiled class. A cache entry is one class, ~3
    # KB of bytecode; static: set at start.
    "spark.sql.codegen.cache.maxEntries": "1000",
    # A run writes every topic's rows in one job, partitioned by table
    # (`jobs.commits.stage_split`): without concurrent writers each task
    # would first sort its rows, bodies and all, by table.
    "spark.sql.maxConcurrentOutputFileWriters": "16",
    # PySpark records the Python call site of every DataFrame call, for error
    # messages: five more round trips to the JVM per call, 40 % of a small
    # run's ~4,500. The job's errors name their table and rule themselves.
    "spark.python.sql.dataFrameDebugging.enabled": "false",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "2g",
    # Keep the shuffle's equal partitions: AQE merged the 4 of a million-row
    # stage into 3 unequal ones, and on 2 cores the largest then ran alone.
    "spark.sql.adaptive.coalescePartitions.enabled": "false",
    # Spark may add a bloom filter to a join, built by a scan of its own of
    # the other side: in a run that was one more pass over the new messages
    # (and an aggregate) ahead of the deliveries' write, where every join
    # with a big side is broadcast or planned by the job.
    "spark.sql.optimizer.runtime.bloomFilter.enabled": "false",
    "spark.databricks.delta.schema.autoMerge.enabled": "false",
    # Data we write is small per commit; no need for Delta's optimized writes etc.
    "spark.databricks.delta.retentionDurationCheck.enabled": "true",
}

#: settings of a session whose driver runs the tasks (`local[...]`), where
#: the job knows the memory: not pushed onto a cluster's executors
LOCAL_DEFAULTS = {
    # Spark builds a broadcast join's table on the driver in pages of this
    # size, by default 1/16 of a core's share of execution memory (32-64 MB
    # in a 2-4 GB driver) however few its rows, and each table stays on the
    # heap until the driver's garbage collector finds it unused: a run
    # broadcasts several, and a long-lived session filled its heap with
    # nearly empty pages (docs/operating.md). 1 MB is Spark's own smallest
    # default; 8,192 pages a task (Spark's limit) are 8 GB, more than a
    # local session has.
    "spark.buffer.pageSize": "1m"
}


#: a class-data archive of the classes a run loads, made by `make setup`
#: (scripts/build_class_archive.py). Mapping them, instead of loading and
#: verifying some 10,000 classes from the jars, saves seconds of every start.
CLASS_ARCHIVE = JAR_LIST.parent / "spark-classes.jsa"
#: the driver's logging: Spark's defaults at WARN, without the warnings every
#: healthy run prints (each one is explained in the file)
LOG_CONFIG = Path(__file__).resolve().parent.parent / "conf" / "log4j2.properties"
#: JVM warnings (e.g. an archive this JDK cannot use) to stderr, not stdout:
#: stdout carries the job's JSON summary
_WARNINGS_TO_STDERR = "-Xlog:disable -Xlog:all=warning:stderr"
#: for a process that runs once over little (an idle run, a single run over
#: a few hundred thousand rows at most): the C1 compiler only, whose code is
#: ready sooner than C2's, and the serial collector, which starts no GC
#: threads. A long-lived session, and a run over millions, need C2's code.
SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: for any other (G1) JVM: a full run keeps its intermediate rows on the heap
#: (`jobs.held`), ~1 GB for a million messages, which G1's adaptive threshold
#: took for a heap filling up, marking it over and over; marking from 75 %
#: occupancy does not
LONG_RUN_GC = "-XX:-G1UseAdaptiveIHOP -XX:InitiatingHeapOccupancyPercent=75"


def build_spark(
    app_name: str = "txn-reconcile",
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    *,
    short_lived: bool = False,
):
    """Return a SparkSession with Delta Lake.

    Under `spark-submit` (or with an active session) the master and the jars
    given there win; otherwise a local session `local[2]` is started, with
    the Delta jar resolved through Ivy from `~/.m2`. A local JVM gets
    `driver_java_options(short_lived)`; a JVM already running (spark-submit)
    keeps its own (`--driver-java-options` sets the same there). A local
    master also gets `LOCAL_DEFAULTS`; `conf` wins over every default.

    >>> spark = build_spark(master="local[1]")          # doctest: +SKIP
    >>> spark.range(1).count()                           # doctest: +SKIP
    1
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.appName(app_name)
    submitted = _submitted()
    if not submitted:
        builder = builder.master(spark_master(master))
        jars = resolved_jars()
        builder = (
            builder.config("spark.jars", ",".join(jars))
            if jars
            else builder.config("spark.jars.packages", DELTA_JAR)
        )
        builder = builder.config("spark.driver.extraJavaOptions", driver_java_options(short_lived))
    else:
        _require_delta_jar()
    local = not submitted and _is_local(master)
    defaults = {**_DEFAULTS, **LOCAL_DEFAULTS} if local else _DEFAULTS
    for key, value in {**defaults, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = _started(builder, local=local)
    spark.sparkContext.setLogLevel(spark_log_level())
    return spark


#: the levels Spark's `setLogLevel` takes
SPARK_LOG_LEVELS = ("ALL", "DEBUG", "ERROR", "FATAL", "INFO", "OFF", "TRACE", "WARN")


def spark_log_level() -> str:
    """`TXN_SPARK_LOG_LEVEL` (default WARN); ConfigError, before any JVM
    starts, for a level Spark does not take (Python's `WARNING`)."""
    from txn_core.config import ConfigError

    level = os.environ.get("TXN_SPARK_LOG_LEVEL", "WARN")
    if level.upper() not in SPARK_LOG_LEVELS:
        raise ConfigError(
            f"TXN_SPARK_LOG_LEVEL must be one of {', '.join(SPARK_LOG_LEVELS)}; got {level!r}"
        )
    return level.upper()


def check_spark_environment() -> None:
    """The `TXN_SPARK_*` variables a session will read, checked before any
    JVM starts: ConfigError naming the one Spark would refuse late."""
    spark_log_level()
    if not _submitted():
        spark_master()


def spark_master(master: str | None = None) -> str:
    """`master`, else `TXN_SPARK_MASTER`, else local[2] (an empty variable
    counts as unset, as in scripts/submit.sh); ConfigError for one Spark
    does not take, which it reported as a Java stack trace.

    >>> spark_master("spark://head:7077")
    'spark://head:7077'
    """
    from txn_core.config import ConfigError

    chosen = master or os.environ.get("TXN_SPARK_MASTER") or "local[2]"
    if chosen != "yarn" and not chosen.startswith(("local", "spark://", "k8s://")):
        source = "the Spark master" if master else "TXN_SPARK_MASTER"
        raise ConfigError(
            f"{source} must be local, local[N], spark://host:port, yarn or k8s://...; "
            f"got {chosen!r}"
        )
    return chosen


def _submitted() -> bool:
    """Whether this process is spark-submit's driver (its master is spark-submit's)."""
    return "SPARK_SUBMIT_ARGS" not in os.environ and _under_spark_submit()


def _is_local(master: str | None) -> bool:
    return spark_master(master).startswith("local")


def _started(builder: Any, *, local: bool) -> Any:
    """`builder.getOrCreate()`; a local JVM binds to loopback, so that Spark
    need not look for (and warn about) this host's address."""
    if not local or "SPARK_LOCAL_IP" in os.environ:
        return builder.getOrCreate()
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # read by the JVM pyspark launches now
    try:
        return builder.getOrCreate()
    finally:
        del os.environ["SPARK_LOCAL_IP"]


class MissingDeltaJarError(ConfigError):
    """spark-submit started the JVM without the Delta Lake jar."""


def _require_delta_jar() -> None:
    """Refuse, in one line, a JVM that spark-submit started without the Delta
    jar, before Spark logs a stack trace for each missing class."""
    from pyspark import SparkContext

    SparkContext._ensure_initialized()  # attaches to spark-submit's JVM
    if not SparkContext._jvm.org.apache.spark.util.Utils.classIsLoadable(DELTA_EXTENSION):
        raise MissingDeltaJarError(
            f"the Delta Lake jar is not on Spark's classpath: pass --packages {DELTA_JAR} "
            "to spark-submit, or run scripts/submit.sh, which does"
        )


def driver_java_options(short_lived: bool = False, archive: Path = CLASS_ARCHIVE) -> str:
    """Options of a local driver JVM: the class archive when `make setup` made
    one with the JDK that will run (`archive_fits`), `LOG_CONFIG`, and
    `SHORT_LIVED_JVM` for a short-lived process, else `LONG_RUN_GC`.

    A JVM that still cannot use the archive (other jars) says so on stderr
    and starts without it.
    """
    options = [_WARNINGS_TO_STDERR]
    if LOG_CONFIG.is_file():
        options.append(java_option("-Dlog4j2.configurationFile=", LOG_CONFIG))
    if archive_fits(archive):
        options.append(java_option("-XX:SharedArchiveFile=", archive))
    options.append(SHORT_LIVED_JVM if short_lived else LONG_RUN_GC)
    return " ".join(options)


def java_option(option: str, path: Path | str) -> str:
    """`option` and `path` as one JVM option of a string Spark's launcher
    splits at spaces (`spark.driver.extraJavaOptions`, spark-submit's
    `--driver-java-options`): quoted when the path holds a space or a
    quote, as under a directory such as `My Projects`.

    >>> java_option("-XX:SharedArchiveFile=", "/a b/x.jsa")
    '-XX:SharedArchiveFile="/a b/x.jsa"'
    """
    text = str(path)
    if not any(c.isspace() or c in "\"'\\" for c in text):
        return option + text
    return option + '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def java_home() -> Path | None:
    """The JDK a local driver JVM is started from, as Spark's launcher picks
    it: `JAVA_HOME`, else the `java` on the PATH (its home, links resolved)."""
    if os.environ.get("JAVA_HOME"):
        return Path(os.environ["JAVA_HOME"]).resolve()
    found = shutil.which("java")
    return Path(found).resolve().parent.parent if found else None


def jdk_stamp() -> str:
    """What identifies the JDK of `java_home` for its class archives: its home
    and the version and vendor its `release` file names. Read from a file,
    not by starting `java -version`: every session's start asks."""
    home = java_home()
    if home is None:
        return ""
    try:
        release = (home / "release").read_text(errors="replace")
    except OSError:
        release = ""
    wanted = ("IMPLEMENTOR=", "JAVA_RUNTIME_VERSION=", "JAVA_VERSION=")
    named = [line for line in release.splitlines() if line.startswith(wanted)]
    return "\n".join([str(home), *named])


def archive_stamp(archive: Path = CLASS_ARCHIVE) -> Path:
    """Where `scripts/build_class_archive.py` records the JDK an archive was made with."""
    return archive.with_name(archive.name + ".jdk")


def archive_fits(archive: Path = CLASS_ARCHIVE) -> bool:
    """The archive exists and was made with the JDK a driver JVM starts from
    now: another JDK refuses it, on every start, with an error on stderr."""
    try:
        return archive.is_file() and archive_stamp(archive).read_text() == jdk_stamp()
    except OSError:
        return False


def resolved_jars(listing: Path = JAR_LIST) -> list[str] | None:
    """The Delta jars `make setup` resolved, if the list is there and every
    jar in it exists and it is for DELTA_JAR's version; else None."""
    try:
        jars = [j for j in listing.read_text().strip().split(os.pathsep) if j]
    except OSError:
        return None
    delta = DELTA_JAR.split(":")[1] + "-" + DELTA_JAR.split(":")[2] + ".jar"
    if not any(j.endswith(delta) for j in jars) or not all(os.path.isfile(j) for j in jars):
        return None
    return jars


def _under_spark_submit() -> bool:
    """True when this Python process was launched by spark-submit (the JVM exists)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def print_error(line: str) -> None:
    """Print `line` on the process's stderr: under spark-submit, which passes
    this Python process's stderr on through its own stdout, the JVM's."""
    if _under_spark_submit():
        from pyspark import SparkContext

        try:
            SparkContext._ensure_initialized()  # attaches to spark-submit's JVM
            SparkContext._jvm.java.lang.System.err.println(line)
            return
        except Exception:  # noqa: BLE001 — an unreachable JVM: the line still goes out below
            pass
    print(line, file=sys.stderr, flush=True)


#: jars of s3a and its AWS SDK among the resolved ones: only for an S3 warehouse
_S3A_JARS = ("hadoop-aws-", "bundle-", "analyticsaccelerator-s3-", "wildfly-openssl-")


def submit_jars(argv: list[str]) -> str:
    """The `--jars` of a spark-submit of the job with arguments `argv`, from
    the jars `make setup` resolved (no Ivy resolution, no network): those of
    Delta, and s3a's for a warehouse on S3; "" when they were not resolved,
    or s3a's are needed and not among them (`submit_packages` then)."""
    jars = resolved_jars()
    if jars is None:
        return ""
    if not submit_packages(argv).endswith(S3A_JAR):
        return ",".join(j for j in jars if not os.path.basename(j).startswith(_S3A_JARS))
    # A list from before the pom had hadoop-aws: Ivy resolves it instead.
    s3a = S3A_JAR.split(":")[1] + "-" + S3A_JAR.split(":")[2] + ".jar"
    return ",".join(jars) if any(j.endswith(s3a) for j in jars) else ""


def submit_conf(master: str) -> list[str]:
    """The `--conf` settings (`key=value`) of a spark-submit of the job on
    `master`: `LOCAL_DEFAULTS` for a local master, none for a cluster's.

    >>> submit_conf("local[2]")
    ['spark.buffer.pageSize=1m']
    """
    return [f"{k}={v}" for k, v in LOCAL_DEFAULTS.items()] if _is_local(master) else []


def submit_packages(argv: list[str]) -> str:
    """The `--packages` of a spark-submit of the job with arguments `argv`:
    the Delta jar, and s3a's when the configured warehouse is on S3 (its
    SDK is some 700 MB that every executor would otherwise fetch).

    A configuration that does not load gives the Delta jar alone: the job
    itself then reports what is wrong.
    """
    import argparse

    from txn_core.config import ConfigError, load_config
    from txn_core.storage import is_s3

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--conf")
    parser.add_argument("--warehouse")
    try:
        known, _ = parser.parse_known_args(argv)
        warehouse = load_config(known.conf, warehouse=known.warehouse).warehouse
    except (argparse.ArgumentError, ConfigError):
        return DELTA_JAR
    return f"{DELTA_JAR},{S3A_JAR}" if is_s3(warehouse) else DELTA_JAR


#: settings a run and an audit hold, whatever the session had (a
#: notebook's): a file the log names that Spark cannot read fails the read;
#: skipped, its rows would be lost to every later run, and to `verify`
STRICT_READS = {
    "spark.sql.files.ignoreMissingFiles": "false",
    "spark.sql.files.ignoreCorruptFiles": "false",
}


def strict_reads(spark) -> AbstractContextManager[None]:
    """Within: the session holds `STRICT_READS` (`settings_held`)."""
    return settings_held(spark, STRICT_READS)


@contextmanager
def settings_held(spark, settings: Mapping[str, str]) -> Iterator[None]:
    """Within: the session holds `settings`; what it had is put back after
    (a notebook's own values included)."""
    before = {key: spark.conf.get(key, None) for key in settings}
    try:
        for key, value in settings.items():
            spark.conf.set(key, value)
        yield
    finally:
        restore_settings(spark, before)


def restore_settings(spark, settings: Mapping[str, str | None]) -> None:
    """Put the session's `settings` back (None: unset)."""
    for key, value in settings.items():
        if value is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, value)


def use_warehouse(spark, config) -> str:
    """Make `config`'s warehouse reachable from `spark` and from this
    process's delta-rs calls; return its URI (the same for both engines).

    An object store is checked first, once per process (credentials, bucket,
    conditional writes: `txn_core.storage.Storage.check`); its `fs.s3a.*`
    settings go into the session, from which Spark copies them into every
    job's Hadoop configuration, and into the context's own for the driver's
    file system calls.
    """
    from txn_core.config import as_config
    from txn_core.storage import Storage, use

    storage = use(Storage.from_config(as_config(config)))
    options = storage.hadoop_options()
    if options and spark is not None:
        hadoop = spark.sparkContext._jsc.hadoopConfiguration()
        for key, value in options.items():
            spark.conf.set(key, value)
            hadoop.set(key, value)
    return storage.warehouse
