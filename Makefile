# `make demo` trains on 2 ranks; `make test` runs lint, types and the test suite at 1, 2 and 3 ranks
# (MPI) and 2 and 3 ranks (Gloo); `make docs` builds the site into site/. Each sets up .venv on a
# fresh machine first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# A failure on one rank must end the job, never hang it: the conftest aborts the world on the first
# failing test, and the launchers stop after this many seconds whatever happens.
JOB_TIMEOUT := 900
RUN_ENV := OMP_NUM_THREADS=1 MPIEXEC_TIMEOUT=$(JOB_TIMEOUT) JAX_PLATFORMS=cpu

.PHONY: demo test lint docs test-1 test-mpi test-gloo test-horovod bench bench-smoke clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[mpi,torch,jax,test,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(RUN_ENV) $(BIN)/dataparallel run -n 2 --timeout $(JOB_TIMEOUT) examples/torch_digits.py

# The documentation site (mkdocs.yml; the docs extra is in the venv): a warning, a broken link or
# anchor fails it. tests/test_docs.py builds it the same way, into a temporary folder.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks tools
	$(BIN)/ruff format --check src tests examples benchmarks tools
	$(BIN)/mypy

# Tests marked `matrix` (families x dtypes x ops and other products) run every case at MPI with 2
# ranks and a sample holding every pair of their values in the other worlds (tests/conftest.py);
# `make test PYTEST_ARGS=--matrix=full` runs every case everywhere.
PYTEST_ARGS ?=
PYTEST := $(BIN)/python -m pytest $(PYTEST_ARGS)
# Every rank of every pass, and every process a test starts, imports the library and the test
# modules: Python's bytecode is kept (PYTHONDONTWRITEBYTECODE, where the machine sets it, is
# turned off), or each would compile them again (pytest's rewritten test modules too) as it starts.
# Every pass compiles the same JAX steps: JAX keeps them in the venv for the passes after the first.
# The size limit turns on the cache's file lock, so that ranks compiling the same step at once never
# read each other's half-written entry.
TEST_ENV := $(RUN_ENV) PYTHONDONTWRITEBYTECODE= JAX_COMPILATION_CACHE_DIR=$(CURDIR)/$(VENV)/jax-cache \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
	JAX_COMPILATION_CACHE_MAX_SIZE=1000000000

# A rank killed by a signal (a crash in C) leaves Python's faulthandler stacks but no report that
# names its test: in the multi-rank passes each rank keeps a note of the test it is in
# (tests/conftest.py), and a pass that fails prints the notes last.
TRAIL := $(CURDIR)/$(VENV)/rank-trail
RANKS_ENV := $(TEST_ENV) PYTEST_RANK_TRAIL=$(TRAIL)
SHOW_TRAIL := { cat $(TRAIL)/rank-* 2>/dev/null; exit 1; }

test-mpi: $(STAMP)
	rm -rf $(TRAIL)
	$(RANKS_ENV) $(BIN)/mpiexec -n 2 $(PYTEST) -x -q || $(SHOW_TRAIL)
	rm -rf $(TRAIL)
	$(RANKS_ENV) $(BIN)/mpiexec -n 3 $(PYTEST) -x -q || $(SHOW_TRAIL)

test-gloo: $(STAMP)
	rm -rf $(TRAIL)
	$(RANKS_ENV) $(BIN)/dataparallel run -n 2 --backend gloo --timeout $(JOB_TIMEOUT) \
		-m pytest -x -q $(PYTEST_ARGS) || $(SHOW_TRAIL)
	rm -rf $(TRAIL)
	$(RANKS_ENV) $(BIN)/dataparallel run -n 3 --backend gloo --timeout $(JOB_TIMEOUT) \
		-m pytest -x -q $(PYTEST_ARGS) || $(SHOW_TRAIL)

# The docstrings' examples run first (a world of one); the suite's world of one runs last, so the
# job ends on a plain pytest summary. Its tests mostly start jobs and wait on them: two
# pytest-xdist workers keep both cores busy, each test to whichever is free, a few files whole
# (`--dist loadgroup`: tests/conftest.py says which). The slowest tests are listed last, where the
# suite's time goes.
TEST_WORKERS ?= 2
test-1: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -q --doctest-modules src/dataparallel
	$(TEST_ENV) $(PYTEST) -q -n $(TEST_WORKERS) --dist loadgroup --durations=30

test: lint test-mpi test-gloo test-1

# Horovod's own PyTorch suite against dataparallel.horovod.torch (docs/horovod.md): mpiexec -n 2,
# mpiexec -n 3 and Gloo at 2 ranks, each under a 3-minute limit. HOROVOD_TESTS is Horovod's test/
# folder (parallel/test_torch.py, utils/common.py), which this project does not ship.
HOROVOD_TESTS ?= ../shared/peers/horovod/test
test-horovod: $(STAMP)
	$(RUN_ENV) $(BIN)/python tools/horovod_suite/run.py $(HOROVOD_TESTS) --timeout 180

bench: $(STAMP)
	$(RUN_ENV) $(BIN)/dataparallel run -n 2 benchmarks/collectives.py
	$(RUN_ENV) $(BIN)/dataparallel run -n 2 benchmarks/scatter_exchange.py
	$(RUN_ENV) $(BIN)/dataparallel run -n 2 benchmarks/bucket_size.py
	$(RUN_ENV) $(BIN)/dataparallel run -n 2 benchmarks/train_step.py
	$(RUN_ENV) $(BIN)/dataparallel run -n 2 benchmarks/optax_step.py

# Each benchmark of `make bench` once, at its smallest (BENCH_SMOKE=1: benchmarks/_timing.py runs
# every case once): the suite does not run them, and a benchmark that no longer runs would
# otherwise go unseen until someone measures. CI runs it after the suite.
BENCH_SMOKE_ENV := $(RUN_ENV) BENCH_SMOKE=1
bench-smoke: $(STAMP)
	$(BENCH_SMOKE_ENV) $(BIN)/dataparallel run -n 2 --timeout 300 benchmarks/collectives.py
	$(BENCH_SMOKE_ENV) $(BIN)/dataparallel run -n 2 --timeout 300 benchmarks/scatter_exchange.py
	$(BENCH_SMOKE_ENV) $(BIN)/dataparallel run -n 2 --timeout 300 benchmarks/bucket_size.py
	$(BENCH_SMOKE_ENV) $(BIN)/dataparallel run -n 2 --timeout 300 benchmarks/train_step.py \
		--d 128 --rounds 1 --budget 0.01 --tolerance 1000
	$(BENCH_SMOKE_ENV) $(BIN)/dataparallel run -n 2 --timeout 300 benchmarks/optax_step.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
