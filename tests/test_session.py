"""Which jars a local SparkSession is given (no Spark started here)."""
import os

from jobs.session import DELTA_JAR, resolved_jars


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
