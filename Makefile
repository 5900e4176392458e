# The two commands of the README. Each one sets up what it needs first, and
# is safe to run again: pip skips what is installed, mvn what is in ~/.m2.
PYTHON ?= python3
# MinIO for the object-store tests and benchmarks, built from its Go module
# (a few minutes once, then kept under target/ per version).
MINIO_VERSION = v0.0.0-20260212201848-7aac2a2c5b7c
MINIO = target/minio-$(MINIO_VERSION)/minio

.PHONY: setup demo test test-fast check bench

setup: $(MINIO)
	$(PYTHON) -m pip install -q --disable-pip-version-check --root-user-action=ignore -e '.[test]'
	mvn -q -B -f pom.xml dependency:resolve dependency:build-classpath \
	    -Dmdep.outputFile=target/spark-jars.txt -DexcludeArtifactIds=scala-library
	$(PYTHON) scripts/build_class_archive.py

$(MINIO):
	GOBIN=$(CURDIR)/$(dir $(MINIO)) go install github.com/minio/minio@$(MINIO_VERSION)
	mkdir -p target/bin && ln -sfn $(CURDIR)/$(MINIO) target/bin/minio

demo: setup
	$(PYTHON) scripts/demo.py

# Lint, format and types: what CI checks before the tests.
check:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy

test: setup check
	$(PYTHON) -m pytest -q --durations=15

# The broker core and everything else that needs no Spark: seconds, not minutes.
test-fast: setup
	$(PYTHON) -m pytest -q -m "not spark"

bench: setup
	$(PYTHON) scripts/bench_broker.py --duration 10
