"""Which jars and JVM options a local SparkSession is given (no Spark started here)."""

import os
import subprocess
from pathlib import Path

import build_class_archive

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
    assert f"-XX:SharedArchiveFile={archive}" in driver_java_options(archive=archive)
    assert driver_java_options(True, archive).endswith(SHORT_LIVED_JVM)
    assert LONG_RUN_GC not in driver_java_options(True, archive)


def test_a_truncated_class_archive_is_never_installed(tmp_path):
    # A JVM given a truncated archive dies of SIGBUS: the builder must catch it.
    made = tmp_path / "small.jsa"
    subprocess.run(
        [build_class_archive.java(), f"-XX:ArchiveClassesAtExit={made}", "-version"],
        check=True,
        capture_output=True,
    )
    assert build_class_archive.loads(made)
    cut = tmp_path / "cut.jsa"
    cut.write_bytes(made.read_bytes()[:4096])
    assert not build_class_archive.loads(cut)


def test_the_class_archive_is_rebuilt_when_older_than_the_jars(tmp_path, monkeypatch):
    jars = tmp_path / "spark-jars.txt"
    jars.write_text("a.jar")
    archive = tmp_path / "spark-classes.jsa"
    monkeypatch.setattr(build_class_archive, "JAR_LIST", jars)
    assert not build_class_archive.up_to_date(archive)
    archive.write_bytes(b"x")
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
    change-feed options, commit timestamps that tie) are quiet."""
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
