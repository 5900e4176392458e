#!/usr/bin/env python3
"""Build `target/spark-classes.jsa`, the class-data archive local Spark starts with.

A run with nothing to do spends most of its time starting a JVM that loads
and verifies some 10,000 Spark and Delta classes. A dynamic CDS archive
(JDK 13+) of the classes an idle run loads lets the next JVM map them
instead; `jobs.session.build_spark` gives it to every local driver JVM.

`make setup` runs this once (about 40 s): a first run on a scratch warehouse,
then an idle run whose JVM writes the archive when it exits. The archive is
tied to this JDK and these jars; a JVM that cannot use it (after an upgrade)
warns on stderr and starts without it. Rerun with `--force` after upgrading.

    python scripts/build_class_archive.py            # builds it if missing
    python scripts/build_class_archive.py --force    # rebuilds it
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jobs.session import CLASS_ARCHIVE, JAR_LIST, driver_java_options  # noqa: E402


def up_to_date(archive: Path = CLASS_ARCHIVE) -> bool:
    """The archive exists and is newer than the jars it was made from (the
    Delta jar list `make setup` writes, and pyspark's own jars)."""
    import pyspark

    if not archive.is_file():
        return False
    sources = [JAR_LIST, Path(pyspark.__file__).parent / "jars"]
    made = archive.stat().st_mtime
    return all(not s.exists() or s.stat().st_mtime <= made for s in sources)


def java() -> str:
    home = os.environ.get("JAVA_HOME")
    return os.path.join(home, "bin", "java") if home else "java"


def loads(archive: Path) -> bool:
    """A JVM starts with the archive. A truncated archive crashes the JVM
    (SIGBUS) rather than being ignored, so none is installed unchecked."""
    # in the archive's folder: a crashing JVM leaves its hs_err_pid*.log in its cwd
    probe = subprocess.run(
        [java(), f"-XX:SharedArchiveFile={archive}", "-version"],
        capture_output=True,
        text=True,
        cwd=archive.parent,
    )
    return probe.returncode == 0


def build(out: Path = CLASS_ARCHIVE) -> Path:
    scratch = Path(tempfile.mkdtemp(prefix="class-archive-"))
    try:
        warehouse = str(scratch / "warehouse")
        first = [
            sys.executable,
            "-m",
            "jobs.reconcile",
            "run",
            "--warehouse",
            warehouse,
            "--now-ms",
            "1",
        ]
        _quietly(first)
        dumped = scratch / "spark-classes.jsa"
        _quietly([sys.executable, __file__, "--dump", str(dumped), warehouse])
        if not dumped.is_file() or not loads(dumped):
            raise RuntimeError(f"the JVM wrote no usable class archive at {dumped}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(dumped), str(out.with_suffix(".tmp")))
        os.replace(out.with_suffix(".tmp"), out)  # never a half-written archive in place
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _quietly(cmd: list[str]) -> None:
    """Run `cmd`; its output is shown only if it fails."""
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}")


def dump(archive: str, warehouse: str) -> None:
    """One idle run, as the CLI does it, in a JVM that archives its classes
    when it exits; waits for that exit, when the archive is written."""
    from pyspark import SparkContext

    from jobs import reconcile
    from jobs.session import build_spark

    options = driver_java_options(short_lived=True, archive=Path(archive))  # no archive yet
    spark = build_spark(
        "txn-reconcile",
        conf={"spark.driver.extraJavaOptions": f"{options} -XX:ArchiveClassesAtExit={archive}"},
    )
    code = reconcile.main(["run", "--warehouse", warehouse, "--now-ms", "1"])
    if code != 0:
        raise SystemExit(f"the idle run failed with exit {code}")
    jvm = SparkContext._gateway.proc
    spark.stop()
    jvm.stdin.close()  # the gateway JVM exits on end of input
    jvm.wait(timeout=300)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--dump", nargs=2, metavar=("ARCHIVE", "WAREHOUSE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dump:
        dump(*args.dump)
        return 0
    if up_to_date() and not args.force:
        return 0
    try:
        built = build()
    except Exception as exc:  # noqa: BLE001 - only a speed-up: set-up goes on without it
        print(
            f"could not build the JVM class archive ({exc}); Spark starts without it",
            file=sys.stderr,
        )
        return 0
    print(f"built {built.relative_to(REPO)} (JVM class archive: faster Spark starts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
