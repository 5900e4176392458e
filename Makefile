# The two commands of the README. Each one sets up what it needs first, and
# is safe to run again: pip skips what is installed, mvn what is in ~/.m2.
PYTHON ?= python3

.PHONY: setup demo test bench

setup:
	$(PYTHON) -m pip install -q --disable-pip-version-check --root-user-action=ignore -e '.[test]'
	mvn -q -B -f pom.xml dependency:resolve dependency:build-classpath \
	    -Dmdep.outputFile=target/spark-jars.txt -DexcludeArtifactIds=scala-library
	$(PYTHON) scripts/build_class_archive.py

demo: setup
	$(PYTHON) scripts/demo.py

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) scripts/bench_broker.py --duration 10
