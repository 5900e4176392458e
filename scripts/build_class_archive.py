#!/usr/bin/env python3
"""Build `target/spark-classes.jsa`, the class-data archive local Spark starts with.

A new JVM spends seconds loading and verifying Spark's and Delta's classes:
some 10,000 to start a session, 11,000 more for a run that delivers. A
dynamic CDS archive (JDK 13+) of the classes a run loads lets the next JVM
map them instead; `jobs.session.build_spark` gives it to every local driver
JVM.

`make setup` runs this once (about a minute): a few messages of each kind
sent to a scratch warehouse (committed, rolled back, unanswered, plain,
delayed), then one run over them in a JVM that writes the archive when it
exits: its classes are those of a full run (reads, checks, deliveries, the
scheduled set, every write), which include an idle run's. The archive is
tied to this JDK and these jars. The JDK it was made with is recorded beside
it (`spark-classes.jsa.jdk`): a session started from another JDK (another
`JAVA_HOME`, an upgrade) goes without the archive, and this script, so `make
setup`, builds it again. After an upgrade of the jars a JVM warns on stderr
and starts without it until then.

    python scripts/build_class_archive.py            # builds it if missing or stale
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

from jobs.session import (  # noqa: E402
    CLASS_ARCHIVE,
    JAR_LIST,
    archive_fits,
    archive_stamp,
    driver_java_options,
    java_home,
    java_option,
    jdk_stamp,
)


def up_to_date(archive: Path = CLASS_ARCHIVE) -> bool:
    """The archive exists, was made with the JDK that starts Spark now, and is
    newer than the jars it was made from (the Delta jar list `make setup`
    writes, and pyspark's own jars)."""
    import pyspark

    if not archive_fits(archive):
        return False
    sources = [JAR_LIST, Path(pyspark.__file__).parent / "jars"]
    made = archive.stat().st_mtime
    return all(not s.exists() or s.stat().st_mtime <= made for s in sources)


def java() -> str:
    """The `java` of the JDK Spark starts from (`jobs.session.java_home`)."""
    home = java_home()
    return str(home / "bin" / "java") if home else "java"


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
        now_ms = _send_each_kind(warehouse)
        dumped = scratch / "spark-classes.jsa"
        _quietly([sys.executable, __file__, "--dump", str(dumped), warehouse, str(now_ms)])
        if not dumped.is_file() or not loads(dumped):
            raise RuntimeError(f"the JVM wrote no usable class archive at {dumped}")
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(dumped), str(out.with_suffix(".tmp")))
        os.replace(out.with_suffix(".tmp"), out)  # never a half-written archive in place
        archive_stamp(out).write_text(jdk_stamp())
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _quietly(cmd: list[str]) -> None:
    """Run `cmd`; its output is shown only if it fails."""
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}")


#: the scratch messages' store time, and the run's clock: past the
#: transaction timeout (the unanswered one is checked), before the delayed
#: one's time (it is scheduled)
_STORE_MS, _RUN_MS = 1_000_000, 1_000_000 + 3_600_000


def _send_each_kind(warehouse: str) -> int:
    """Send a few messages of each kind through the broker core, so that the
    run over them loads the classes of every rule and write; the run's clock."""
    from txn_core import (
        Broker,
        LocalTransactionState,
        Message,
        Producer,
        TransactionListener,
        TransactionProducer,
        load_config,
    )

    outcomes = [
        LocalTransactionState.COMMIT_MESSAGE,
        LocalTransactionState.ROLLBACK_MESSAGE,
        LocalTransactionState.UNKNOWN,
    ]

    class Outcome(TransactionListener):
        def execute_local_transaction(self, msg, arg):
            return outcomes[int(msg.keys)]

        def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOWN

    with Broker.open(load_config(warehouse=warehouse, env={}), clock=lambda: _STORE_MS) as broker:
        producer = TransactionProducer(broker, "archive", Outcome())
        for i, _ in enumerate(outcomes):
            producer.send_message_in_transaction(Message(topic="ARCHIVE", body=b"x", keys=str(i)))
        plain = Producer(broker, "archive")
        plain.send(Message(topic="ARCHIVE", body=b"plain"))
        plain.send(Message(topic="ARCHIVE", body=b"later", delay_ms=2 * _RUN_MS))
    return _RUN_MS


def dump(archive: str, warehouse: str, now_ms: str) -> None:
    """One run over the scratch messages, as the CLI does it, in a JVM that
    archives its classes when it exits; waits for that exit, when the
    archive is written."""
    from pyspark import SparkContext

    from jobs import reconcile
    from jobs.session import build_spark

    options = driver_java_options(short_lived=True, archive=Path(archive))  # no archive yet
    spark = build_spark(
        "txn-reconcile",
        conf={
            "spark.driver.extraJavaOptions": options
            + " "
            + java_option("-XX:ArchiveClassesAtExit=", archive)
        },
    )
    code = reconcile.main(["run", "--warehouse", warehouse, "--now-ms", now_ms])
    if code != 0:
        raise SystemExit(f"the run failed with exit {code}")
    jvm = SparkContext._gateway.proc
    spark.stop()
    jvm.stdin.close()  # the gateway JVM exits on end of input
    jvm.wait(timeout=300)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument(
        "--dump", nargs=3, metavar=("ARCHIVE", "WAREHOUSE", "NOW_MS"), help=argparse.SUPPRESS
    )
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
