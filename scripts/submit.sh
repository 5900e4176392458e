#!/usr/bin/env bash
# Run the reconciliation job through pyspark's own spark-submit, on any master.
#
#   scripts/submit.sh run --conf conf/reconcile.toml
#   TXN_SPARK_MASTER=spark://host:7077 scripts/submit.sh run --conf conf/reconcile.toml
#
# The project's code travels to the executors as dist/txn_pyfiles.zip
# (--py-files), rebuilt on every call so a cluster never runs stale code.
# The Delta jar (and hadoop-aws for a warehouse on S3) goes in with --jars,
# from the paths `make setup` listed in target/spark-jars.txt; without that
# list, with --packages, resolved by Ivy (from ~/.m2, else the network).
# The driver logs through conf/log4j2.properties: WARN, without known noise.
# Environment: TXN_SPARK_MASTER (default local[2]), PYTHON (default python3),
# PYSPARK_PYTHON (the executors' interpreter; default: the same as PYTHON,
# right for local and loopback masters, set it for a real cluster),
# TXN_SUBMIT_ARGS (extra spark-submit options, split on spaces).
# The job's exit code is passed through unchanged (0 / 2 / 75 / 1).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
# A master spark-submit would refuse with a Java stack trace: one line naming it, exit 2.
(cd "$repo" && "$python" -c '
import sys
from jobs.session import spark_master
from txn_core.config import ConfigError
try:
    spark_master()
except ConfigError as exc:
    sys.exit(f"submit.sh: bad configuration: {exc}")
') || exit 2
spark_bin="$("$python" -c 'import os, pyspark; print(os.path.join(os.path.dirname(pyspark.__file__), "bin"))')"
# The jars' coordinates come from jobs/session.py, so there is one place to bump
# them: Delta's, and s3a's when the warehouse is on S3.
jars="$(cd "$repo" && "$python" -c 'import sys; from jobs.session import submit_jars; print(submit_jars(sys.argv[1:]))' "$@")"
if [ -n "$jars" ]; then  # resolved by `make setup`: no Ivy resolution on every call
  dependencies=(--jars "$jars")
else
  dependencies=(--packages "$(cd "$repo" && "$python" -c 'import sys; from jobs.session import submit_packages; print(submit_packages(sys.argv[1:]))' "$@")")
fi
pyfiles="$("$python" "$repo/scripts/build_pyfiles.py")"
# The class archive `make setup` built (if any) and the logging, as a local session gets them,
# and the short-lived JVM `txn-reconcile run` starts for an idle or small single run.
driver_opts="$(cd "$repo" && "$python" -c 'import sys; from jobs.reconcile import submit_java_options; print(submit_java_options(sys.argv[1:]))' "$@")"

export PYSPARK_PYTHON="${PYSPARK_PYTHON:-$(command -v "$python")}"
# SPARK_TESTING makes Ivy look in ./dummy/.m2 instead of ~/.m2.
unset SPARK_TESTING
# A local driver binds to loopback (Spark would otherwise look for, and warn about, this host's address).
master="${TXN_SPARK_MASTER:-local[2]}"
if [[ "$master" == local* ]]; then
  export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-127.0.0.1}"
fi
# The settings a session gets on this master (jobs/session.py: LOCAL_DEFAULTS on a local one).
settings=()
while IFS= read -r setting; do
  settings+=(--conf "$setting")
done < <(cd "$repo" && "$python" -c 'import sys; from jobs.session import submit_conf; print(*submit_conf(sys.argv[1]), sep="\n")' "$master" | grep .)

# shellcheck disable=SC2086  # TXN_SUBMIT_ARGS is meant to split into options
exec "$spark_bin/spark-submit" \
  --master "$master" \
  "${dependencies[@]}" \
  --driver-java-options "$driver_opts" \
  --conf spark.sql.extensions=io.delta.sql.DeltaSparkSessionExtension \
  --conf spark.sql.catalog.spark_catalog=org.apache.spark.sql.delta.catalog.DeltaCatalog \
  "${settings[@]}" \
  --py-files "$pyfiles" \
  ${TXN_SUBMIT_ARGS:-} \
  "$repo/jobs/reconcile.py" "$@"
