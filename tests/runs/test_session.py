"""Which jars and JVM options a local SparkSession is given (no Spark started
here, but for one driver in a process of its own)."""

import os
import subprocess
import sys
from pathlib import Path

import build_class_archive
import pytest

from jobs import session
from jobs.session import DELTA_JAR, LONG_RUN_GC, SHORT_LIVED_JVM, driver_java_options, resolved_jars

REPO = Path(__file__).resolve().parents[2]


def _jar(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(b"PK")
    return str(path)


def test_the_jar_list_from_make_setup_is_used_when_every_jar_is_there(tmp_path):
    delta = _jar(tmp_path, f"{DELTA_JAR.split(':')[1]}-{DELTA_JAR.split(':')[2]}.jar")
    other = _jar(tmp_path, "delta-storage-4.4.0.jar")
    listing = tmp_path / "spark-jars.txt"
    listing.write_text(os.pathsep.join([delta, other]))
    assert resolved_jars(listing) == [delta, other]


def test_missing_list_missing_jar_or_another_delta_version_fall_back_to_ivy(tmp_path):
    assert resolved_jars(tmp_path / "absent.txt") is None
    delta = _jar(tmp_path, f"{DELTA_JAR.split(':')[1]}-{DELTA_JAR.split(':')[2]}.jar")
    gone = tmp_path / "spark-jars.txt"
    gone.write_text(os.pathsep.join([delta, str(tmp_path / "deleted.jar")]))
    assert resolved_jars(gone) is None
    old = tmp_path / "old.txt"
    old.write_text(_jar(tmp_path, f"{DELTA_JAR.split(':')[1]}-3.0.0.jar"))
    assert resolved_jars(old) is None


def test_the_class_archive_is_used_when_there_and_short_lived_flags_only_when_asked(tmp_path):
    archive = tmp_path / "spark-classes.jsa"
    plain = driver_java_options(archive=archive)
    assert "SharedArchiveFile" not in plain and SHORT_LIVED_JVM not in plain
    assert plain.endswith(LONG_RUN_GC)
    assert "-Xlog:all=warning:stderr" in plain  # stdout stays the job's JSON
    archive.write_bytes(b"x")
    session.archive_stamp(archive).write_text(session.jdk_stamp())
    assert f"-XX:SharedArchiveFile={archive}" in driver_java_options(archive=archive)
    assert driver_java_options(True, archive).endswith(SHORT_LIVED_JVM)
    assert LONG_RUN_GC not in driver_java_options(True, archive)


def _jdk(root: Path, version: str) -> Path:
    home = root / f"jdk-{version}"
    (home / "bin").mkdir(parents=True)
    (home / "release").write_text(f'IMPLEMENTOR="Vendor"\nJAVA_VERSION="{version}"\nOS_ARCH="x"\n')
    return home


def test_an_archive_made_with_another_jdk_is_neither_used_nor_up_to_date(tmp_path, monkeypatch):
    """Another JDK refuses the archive with an error on every start: the
    session goes without it, and `make setup` builds it again."""
    jdk17, jdk25 = _jdk(tmp_path, "17.0.15"), _jdk(tmp_path, "25.0.3")
    archive = tmp_path / "spark-classes.jsa"
    archive.write_bytes(b"x")
    monkeypatch.setattr(build_class_archive, "JAR_LIST", tmp_path / "absent.txt")
    import pyspark

    newest = (Path(pyspark.__file__).parent / "jars").stat().st_mtime
    os.utime(archive, (newest + 1, newest + 1))
    monkeypatch.setenv("JAVA_HOME", str(jdk17))
    assert "SharedArchiveFile" not in driver_java_options(archive=archive)  # no record: unknown JDK
    assert not build_class_archive.up_to_date(archive)
    session.archive_stamp(archive).write_text(session.jdk_stamp())
    assert f"-XX:SharedArchiveFile={archive}" in driver_java_options(archive=archive)
    assert build_class_archive.up_to_date(archive)
    monkeypatch.setenv("JAVA_HOME", str(jdk25))
    assert "SharedArchiveFile" not in driver_java_options(archive=archive)
    assert not build_class_archive.up_to_date(archive)
    # the JDK on the PATH when JAVA_HOME is unset, through the link to it
    monkeypatch.delenv("JAVA_HOME")
    (jdk17 / "bin" / "java").write_text("#!/bin/sh\n")
    (jdk17 / "bin" / "java").chmod(0o755)
    links = tmp_path / "links"
    links.mkdir()
    (links / "java").symlink_to(jdk17 / "bin" / "java")
    monkeypatch.setenv("PATH", str(links))
    assert session.java_home() == jdk17.resolve()
    assert f"-XX:SharedArchiveFile={archive}" in driver_java_options(archive=archive)
    (jdk17 / "release").write_text('JAVA_VERSION="17.0.16"\n')  # upgraded in place
    assert "SharedArchiveFile" not in driver_java_options(archive=archive)


def test_a_truncated_class_archive_is_never_installed(tmp_path):
    # JDK 17 given a truncated archive dies of SIGBUS: the builder must catch
    # it. JDK 25 checks the archive first and starts without it.
    made = tmp_path / "small.jsa"
    subprocess.run(
        [build_class_archive.java(), f"-XX:ArchiveClassesAtExit={made}", "-version"],
        check=True,
        capture_output=True,
    )
    assert build_class_archive.loads(made)
    cut = tmp_path / "cut.jsa"
    cut.write_bytes(made.read_bytes()[:4096])
    given = [build_class_archive.java(), f"-XX:SharedArchiveFile={cut}", "-version"]
    starts = subprocess.run(given, capture_output=True, cwd=tmp_path).returncode == 0
    assert build_class_archive.loads(cut) is starts
    if 'JAVA_VERSION="17' in session.jdk_stamp():
        assert not starts


def test_the_class_archive_is_rebuilt_when_older_than_the_jars(tmp_path, monkeypatch):
    jars = tmp_path / "spark-jars.txt"
    jars.write_text("a.jar")
    archive = tmp_path / "spark-classes.jsa"
    monkeypatch.setattr(build_class_archive, "JAR_LIST", jars)
    assert not build_class_archive.up_to_date(archive)
    archive.write_bytes(b"x")
    session.archive_stamp(archive).write_text(session.jdk_stamp())
    os.utime(jars, (1, 1))
    os.utime(archive, (2, 2))
    assert not build_class_archive.up_to_date(archive)  # pyspark's jars are newer still
    import pyspark

    pyspark_jars = Path(pyspark.__file__).parent / "jars"
    newest = max(pyspark_jars.stat().st_mtime, 3)
    os.utime(archive, (newest + 1, newest + 1))
    assert build_class_archive.up_to_date(archive)
    os.utime(jars, (newest + 2, newest + 2))  # `make setup` resolved other jars
    assert not build_class_archive.up_to_date(archive)


def test_the_driver_logs_at_warn_without_the_warnings_of_a_healthy_run(spark):
    """conf/log4j2.properties reaches the JVM: root at WARN, and the warnings
    every run prints (a local checkpoint freed on purpose, Delta's duplicated
    change-feed options, commit timestamps that tie, a task carrying the rows
    the driver read) are quiet."""
    from jobs.session import LOG_CONFIG

    assert f"-Dlog4j2.configurationFile={LOG_CONFIG}" in driver_java_options()
    manager = spark.sparkContext._jvm.org.apache.logging.log4j.LogManager
    assert str(manager.getRootLogger().getLevel()) == "WARN"
    for quiet in (
        "org.apache.spark.rdd.MapPartitionsRDD",
        "org.apache.spark.sql.util.CaseInsensitiveStringMap",
        "org.apache.spark.sql.delta.DeltaHistoryManager",
    ):
        assert str(manager.getLogger(quiet).getLevel()) == "ERROR", quiet
    assert str(manager.getLogger("org.apache.spark.sql.delta.DeltaLog").getLevel()) == "WARN"
    # The scheduler's notes on a large task binary and on a task carrying the
    # driver's rows are dropped, its other warnings are not.
    jvm = spark.sparkContext._jvm
    config = manager.getContext(False).getConfiguration()

    def dropped(logger: str, message: str) -> bool:
        event = (
            jvm.org.apache.logging.log4j.core.impl.Log4jLogEvent.newBuilder()
            .setLoggerName(logger)
            .setLevel(jvm.org.apache.logging.log4j.Level.WARN)
            .setMessage(jvm.org.apache.logging.log4j.message.SimpleMessage(message))
            .build()
        )
        return config.getLoggerConfig(logger).isFiltered(event)

    dag, tasks = (
        "org.apache.spark.scheduler.DAGScheduler",
        "org.apache.spark.scheduler.TaskSetManager",
    )
    assert dropped(dag, "Broadcasting large task binary with size 1063.9 KiB")
    assert not dropped(dag, "Resubmitting ShuffleMapStage 3 due to fetch failure")
    assert dropped(
        tasks,
        "Stage 12 contains a task of very large size (4096 KiB). "
        "The maximum recommended task size is 1000 KiB.",
    )
    assert not dropped(tasks, "Lost task 0.0 in stage 3.0 (TID 7): java.io.IOException")


@pytest.mark.spark
def test_spark_submit_without_the_delta_jar_says_so_in_one_line_and_exits_2(tmp_path):
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_SUBMIT_ARGS", "SPARK_TESTING")}
    done = subprocess.run(
        [str(submit), "jobs/reconcile.py", "run", "--warehouse", str(tmp_path / "wh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    # On stderr although spark-submit passes the driver's stderr on through its stdout.
    ours = [line for line in done.stderr.splitlines() if line.startswith("txn-reconcile:")]
    assert len(ours) == 1, done.stderr
    assert "the Delta Lake jar is not on Spark's classpath" in ours[0]
    assert f"--packages {DELTA_JAR}" in ours[0] and "scripts/submit.sh" in ours[0]
    for output in (done.stderr, done.stdout):
        assert "Exception" not in output and "Traceback" not in output
        assert not any(line.startswith("\tat ") for line in output.splitlines())
    assert not (tmp_path / "wh" / "_sys" / "runs").exists()  # no run was recorded


def test_an_error_line_goes_to_stderr_outside_spark_submit(capsys, monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    session.print_error("txn-reconcile: bad configuration: x")
    assert capsys.readouterr() == ("", "txn-reconcile: bad configuration: x\n")


def test_submit_passes_the_resolved_jars_with_s3a_only_for_a_warehouse_on_s3(monkeypatch):
    delta = "/m2/io/delta/delta-spark_4.2_2.13/4.4.0/delta-spark_4.2_2.13-4.4.0.jar"
    aws = "/m2/org/apache/hadoop/hadoop-aws/3.5.0/hadoop-aws-3.5.0.jar"
    sdk = "/m2/software/amazon/awssdk/bundle/2.35.4/bundle-2.35.4.jar"
    monkeypatch.setattr(session, "resolved_jars", lambda: [delta, aws, sdk])
    monkeypatch.delenv("TXN_WAREHOUSE", raising=False)
    assert session.submit_jars(["run", "--warehouse", "/tmp/wh"]) == delta
    on_s3 = ["run", "--warehouse", "s3://bucket/wh"]
    assert session.submit_jars(on_s3) == f"{delta},{aws},{sdk}"
    # A list without hadoop-aws, or no list: `--packages`, resolved by Ivy.
    monkeypatch.setattr(session, "resolved_jars", lambda: [delta])
    assert session.submit_jars(on_s3) == ""
    assert session.submit_jars(["status", "--warehouse", "/tmp/wh"]) == delta
    monkeypatch.setattr(session, "resolved_jars", lambda: None)
    assert session.submit_jars(["run", "--warehouse", "/tmp/wh"]) == ""


def test_a_local_session_builds_a_broadcast_table_in_pages_of_1_mb(spark):
    """A broadcast join's table stays on the driver's heap until the garbage
    collector finds it unused, at least one page of `spark.buffer.pageSize`:
    Spark's default in the tests' 4 GB driver is 64 MB for a table of 1,000
    rows. A local session's pages are 1 MB (`jobs.session.LOCAL_DEFAULTS`),
    and spark-submit on a local master is given the same."""
    from pyspark.sql import functions as F

    assert spark.conf.get("spark.buffer.pageSize") == "1m"
    used = spark.sparkContext._jsc.sc().env().memoryManager().storageMemoryUsed
    keys = spark.range(1000).selectExpr("CAST(id AS STRING) AS k")
    before = used()
    assert (
        spark.range(5000).selectExpr("CAST(id AS STRING) AS k").join(F.broadcast(keys), "k").count()
        == 1000
    )
    assert used() - before < 4 * 2**20
    assert session.submit_conf("local[2]") == ["spark.buffer.pageSize=1m"]
    assert session.submit_conf("spark://host:7077") == []


@pytest.mark.slow
def test_a_driver_starts_from_a_directory_with_a_space(tmp_path):
    """The JVM options name files of the project (its log configuration,
    the class archive); installed under a directory such as `My Projects`,
    each path must stay one option, or the JVM cannot start at all."""
    under = tmp_path / "My Projects"
    under.mkdir()
    config = under / "log4j2.properties"
    config.write_text(session.LOG_CONFIG.read_text())
    assert session.java_option("-Dx=", config) == f'-Dx="{config}"'
    program = (
        "import sys; from pathlib import Path; import jobs.session as s\n"
        "s.LOG_CONFIG = Path(sys.argv[1])\n"
        "spark = s.build_spark('space', short_lived=True)\n"
        "print(spark.sparkContext._jvm.java.lang.System.getProperty('log4j2.configurationFile'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == str(config)
