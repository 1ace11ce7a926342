# Tideline: every target bootstraps what it needs, idempotently.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# The stamp names the hash of pyproject.toml: any change of the dependencies (a new pin) reinstalls,
# whatever the files' times say (a checkout can leave pyproject.toml older than an existing stamp).
PYPROJECT_HASH := $(shell sha256sum pyproject.toml | cut -c1-16)
STAMP := $(VENV)/.tideline-installed-$(PYPROJECT_HASH)
PG_BIN := /usr/lib/postgresql/15/bin
WAL2JSON := /usr/lib/postgresql/15/lib/wal2json.so
APT_PACKAGES := postgresql-15 postgresql-15-wal2json openjdk-17-jdk-headless maven kcat chromium
JAR_CACHE := .cache/jars
# The native capture core (native/, Rust + PyO3, driven by capture/native/): rebuilt when any of its sources changes.
# rustup installs cargo under ~/.cargo/bin, which a non-login shell (CI) may not have on its PATH.
export PATH := $(HOME)/.cargo/bin:$(PATH)
NATIVE_SOURCES := native/Cargo.toml native/Cargo.lock native/pyproject.toml native/tideline_native.pyi $(wildcard native/src/*.rs)
NATIVE_HASH := $(shell cat $(NATIVE_SOURCES) | sha256sum | cut -c1-16)
NATIVE_STAMP := $(VENV)/.tideline-native-$(NATIVE_HASH)

.PHONY: demo test bench soak reliability lint typecheck system venv native jars clean

## system: Debian packages (Postgres 15 + wal2json, a JDK, Maven, kcat, chromium for the console's browser test)
## -- only installed when missing.
system:
	@if [ ! -x $(PG_BIN)/postgres ] || [ ! -f $(WAL2JSON) ] || ! command -v java >/dev/null || ! command -v mvn >/dev/null \
		|| ! command -v kcat >/dev/null || ! command -v chromium >/dev/null; then \
		echo "installing system packages: $(APT_PACKAGES)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	fi

# pip moves installed packages to what pyproject.toml pins (e.g. pyspark 4.3.0 → 4.2.0); the check after it
# fails the target when the venv's PySpark still is not the pinned one (Spark's Kafka jars are fetched for it).
$(STAMP): pyproject.toml
	@test -x $(PY) || python3.11 -m venv $(VENV) || python3 -m venv $(VENV)
	@rm -f $(VENV)/.tideline-installed*
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@$(PY) -c 'import importlib.metadata as m, sys; req = [r for r in m.requires("tideline") if r.startswith("pyspark==")]; \
		want = req[0].split("==")[1].split(";")[0].strip() if req else None; have = m.version("pyspark"); \
		sys.exit(0 if want in (None, have) else f"error: the venv has pyspark {have}, pyproject.toml pins {want}")'
	@touch $(STAMP)

venv: $(STAMP)

## native: the native capture core (tideline_native) built by maturin into the venv (release build); needs cargo
## (the Rust toolchain: https://rustup.rs). Without it the connector still runs, on the Python path.
$(NATIVE_STAMP): $(STAMP) $(NATIVE_SOURCES)
	@command -v cargo >/dev/null || { echo "error: cargo (Rust) is needed to build native/: install it from https://rustup.rs"; exit 1; }
	@rm -f $(VENV)/.tideline-native-*
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --quiet -m native/Cargo.toml
	@$(PY) -c 'import tideline_native'
	@touch $(NATIVE_STAMP)

native: $(NATIVE_STAMP)

## jars: Apache Kafka (KRaft broker), Spark's Kafka source of the installed PySpark's version, and Kafka
## Connect + Debezium's PostgreSQL connector (the envelope comparison test, `python -m bench --only debezium`)
## into $(JAR_CACHE), fetched once with Maven; fails when any cannot be fetched.
jars: system venv
	@bash jvm/fetch-jars.sh $(JAR_CACHE) $(PY)

lint: venv
	$(VENV)/bin/ruff check .
	cd native && cargo fmt --check && cargo clippy --release --quiet -- -D warnings

typecheck: venv
	$(VENV)/bin/mypy

## test: the suite in TEST_WORKERS processes (pytest-xdist, one test file per worker at a time, so a file's
## module fixtures start once): 21 min with 2 against 33 min serially on a 2-CPU machine. Each worker has
## its own Postgres, Kafka and Spark. TEST_WORKERS=0 runs it in one process. soak and reliability stay
## serial: their fault timings go into RELIABILITY.md.
TEST_WORKERS ?= 2
test: system venv native jars lint typecheck
	$(VENV)/bin/pytest -q tests -n $(TEST_WORKERS) --dist loadfile

## soak: every test at its long size; the fault tests record results, rendered into RELIABILITY.md only when
## every test passed (-p tideline.reliability keeps the rows of passed tests only; a failed run fails the target
## and leaves the previous RELIABILITY.md as it was).
RELIABILITY_DIR := $(CURDIR)/.reliability-results
RELIABILITY_KEPT := echo "pytest failed: RELIABILITY.md not rewritten (the previous report stands)" >&2; exit 1
soak: system venv native jars
	rm -rf $(RELIABILITY_DIR)
	TIDELINE_SOAK=1 TIDELINE_RELIABILITY_DIR=$(RELIABILITY_DIR) $(VENV)/bin/pytest -q -p tideline.reliability tests \
		|| { $(RELIABILITY_KEPT); }
	$(PY) -m tideline.reliability --dir $(RELIABILITY_DIR)

## reliability: only the fault tests (the files that record results), at soak size; rewrites RELIABILITY.md.
## The part of `make soak` that the report is made of (about an hour here; the log cleaner soak alone is 30 min).
FAULT_TESTS := tests/eventstore/test_log_cleaner.py tests/eventstore/test_storage_faults.py \
	tests/eventstore/test_disk_full.py tests/commands/test_pg_restart.py tests/capture/test_decoder_fuzz.py \
	tests/capture/test_faults.py tests/projections/test_executor_kill.py tests/projections/test_rebuild_attempts.py
reliability: system venv native jars
	rm -rf $(RELIABILITY_DIR)
	TIDELINE_SOAK=1 TIDELINE_RELIABILITY_DIR=$(RELIABILITY_DIR) $(VENV)/bin/pytest -q -p tideline.reliability \
		$(FAULT_TESTS) || { $(RELIABILITY_KEPT); }
	$(PY) -m tideline.reliability --dir $(RELIABILITY_DIR)

bench: system venv native jars
	$(PY) -m bench

## demo: the reservations example end to end (examples/reservations/demo.py; an application of Tideline's)
demo: system venv native jars
	PYTHONPATH=$(CURDIR) $(PY) -m examples.reservations.demo

clean:
	rm -rf $(VENV) native/target tideline-data .pytest_cache .mypy_cache .ruff_cache .reliability-results $(JAR_CACHE)
