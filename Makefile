# Tideline: every target bootstraps what it needs, idempotently.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tideline-installed
PG_BIN := /usr/lib/postgresql/15/bin
WAL2JSON := /usr/lib/postgresql/15/lib/wal2json.so
APT_PACKAGES := postgresql-15 postgresql-15-wal2json openjdk-17-jdk-headless maven kcat
JAR_CACHE := .cache/jars

.PHONY: demo test bench soak lint typecheck system venv jars clean

## system: Debian packages (Postgres 15 + wal2json, a JDK, Maven, kcat) -- only installed when missing.
system:
	@if [ ! -x $(PG_BIN)/postgres ] || [ ! -f $(WAL2JSON) ] || ! command -v java >/dev/null || ! command -v mvn >/dev/null \
		|| ! command -v kcat >/dev/null; then \
		echo "installing system packages: $(APT_PACKAGES)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

## jars: Apache Kafka (KRaft broker) and Spark's Kafka source into $(JAR_CACHE), fetched once with Maven.
jars: system venv
	@bash jvm/fetch-jars.sh $(JAR_CACHE) $(PY)

lint: venv
	$(VENV)/bin/ruff check .

typecheck: venv
	$(VENV)/bin/mypy

test: system venv jars lint typecheck
	$(VENV)/bin/pytest -q tests

## soak: every test at its long size; the fault tests record results, rendered into RELIABILITY.md
## (written even when a test fails: a failed fault test records no row, so its row is missing).
RELIABILITY_DIR := $(CURDIR)/.reliability-results
soak: system venv jars
	rm -rf $(RELIABILITY_DIR)
	TIDELINE_SOAK=1 TIDELINE_RELIABILITY_DIR=$(RELIABILITY_DIR) $(VENV)/bin/pytest -q tests; status=$$?; \
		$(PY) -m tideline.reliability --dir $(RELIABILITY_DIR) || status=1; exit $$status

bench: system venv jars
	$(PY) -m bench

demo: system venv jars
	$(VENV)/bin/tideline demo

clean:
	rm -rf $(VENV) tideline-data .pytest_cache .mypy_cache .ruff_cache .reliability-results $(JAR_CACHE)
